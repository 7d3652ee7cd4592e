"""The load generator's sampling settings reach the request it sends: temperature always, top_p
only when asked for (< 1), over HTTP and over the router's gRPC."""

import pytest

from pdserve.bench.cli_args import add_target_args, target_from
from pdserve.bench.client_grpc import GrpcClient
from pdserve.bench.client_http import HttpClient
from pdserve.bench.request import BenchRequest
from pdserve.bench.target import TargetConfig

REQ = BenchRequest(tier="t", max_tokens=8, prompt_ids=(1, 2, 3))


def test_http_body_sends_top_p_only_when_asked():
    _, body = HttpClient(TargetConfig(temperature=1.0))._body(REQ, None)
    assert body["temperature"] == 1.0 and "top_p" not in body
    path, body = HttpClient(TargetConfig(temperature=0.8, top_p=0.95))._body(REQ, None)
    assert path == "/v1/completions" and body["top_p"] == 0.95


def test_grpc_request_sends_top_p_only_when_asked():
    plain = GrpcClient(TargetConfig(api="grpc", temperature=1.0))._request(REQ, None)
    assert plain.params.temperature == 1.0 and not plain.params.HasField("top_p")
    msg = GrpcClient(TargetConfig(api="grpc", temperature=0.8, top_p=0.9))._request(REQ, None)
    assert msg.params.top_p == pytest.approx(0.9)


def test_cli_flag_and_bounds():
    import argparse

    p = argparse.ArgumentParser()
    add_target_args(p)
    args = p.parse_args(["--temperature", "0.8", "--top-p", "0.95"])
    assert target_from(args).top_p == 0.95
    assert target_from(p.parse_args([])).top_p == 1.0
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="top_p"):
            TargetConfig(top_p=bad)
