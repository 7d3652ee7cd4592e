"""Round-robin over healthy instances; an instance that stops answering is marked down, one
that comes (back) up is used again; with none up the router answers 503 / UNAVAILABLE."""

import time

import grpc
import httpx

from pdserve.common.rpc import router_pb2 as pb
from pdserve.common.rpc import router_pb2_grpc as pb_grpc
from pdserve.services.launcher import free_port
from pdserve.tests.integration.services_helpers import (start_engine, start_router, wait_engine,
                                                         wait_http)


def wait_health(url: str, status: int, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(url + "/health", timeout=5)
        if r.status_code == status or time.monotonic() > deadline:
            assert r.status_code == status, r.text
            return r.json()
        time.sleep(0.1)


def complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                     "max_tokens": 4}, timeout=30)


def test_instances_go_down_and_come_back(tmp_path):
    pa, pb_, hp, gp = (free_port("127.0.0.1") for _ in range(4))
    a_addr, b_addr = f"127.0.0.1:{pa}", f"127.0.0.1:{pb_}"
    url = f"http://127.0.0.1:{hp}"
    children = []
    try:
        children.append(start_engine(tmp_path, pa, name="engine-a"))
        wait_engine(children[-1], a_addr)
        children.append(start_router(tmp_path, [a_addr, b_addr], hp, gp))
        wait_http(children[-1], url + "/health")
        assert wait_health(url, 200)["healthy_instances"] == 1  # b has nothing listening
        assert all(complete(url).status_code == 200 for _ in range(4))

        children[0].stop(10.0)  # a goes away: nothing is up
        wait_health(url, 503)
        r = complete(url)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        with grpc.insecure_channel(f"127.0.0.1:{gp}") as channel:
            try:
                list(pb_grpc.RouterStub(channel).Generate(pb.GenerateRequest(text="x"),
                                                          timeout=10))
                raise AssertionError("Generate should fail with no instance up")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE

        children.append(start_engine(tmp_path, pb_, name="engine-b"))  # b comes up
        wait_engine(children[-1], b_addr)
        assert wait_health(url, 200)["healthy_instances"] == 1
        assert complete(url).status_code == 200
    finally:
        for child in reversed(children):
            child.stop(10.0)
