"""`pdserve bench serve/sweep` against a tiny stack: prompts drawn with the served model's
tokenizer by default, a tokenizer with a larger vocabulary refused before anything is sent,
failed requests reported first and loudly with a non-zero exit past the threshold."""

import json

import httpx
import pytest

from pdserve.bench.failures import EXIT_TOO_MANY_FAILED
from pdserve.cli import main
from pdserve.tests.integration.inproc_stack import inproc_stack


@pytest.fixture(scope="module")
def stack():
    with inproc_stack(max_model_len=256) as s:
        yield s


def bench(capsys, *argv):
    code = main(["bench", *argv, "--no-progress"])
    out = capsys.readouterr()
    return code, out.out, out.err


def common(stack, tmp_path, n=6):
    return ["--base-url", stack.router_http, "--num-prompts", str(n), "--input-len", "16",
            "--output-len", "4", "--out-dir", str(tmp_path), "--no-per-request"]


def test_models_lists_the_vocabulary(stack):
    card = httpx.get(f"{stack.router_http}/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["vocab_size"] == 320


def test_default_tokenizer_is_the_served_models_and_every_request_succeeds(stack, tmp_path,
                                                                            capsys):
    code, out, _ = bench(capsys, "serve", *common(stack, tmp_path))
    line = json.loads(out.strip().splitlines()[-1])
    assert "prompts drawn with the 'tiny' tokenizer" in out
    assert code == 0 and line["failed"] == 0 and line["requests"] == 6
    assert "FAILED" not in out


def test_a_tokenizer_past_the_served_vocabulary_is_refused_before_sending(stack, tmp_path,
                                                                          capsys):
    with pytest.raises(SystemExit) as info:
        bench(capsys, "serve", *common(stack, tmp_path), "--tokenizer", "smollm2")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "accepts 320" in err and "--tokenizer" in err


def test_failed_requests_come_first_and_fail_the_run(stack, tmp_path, capsys):
    code, out, err = bench(capsys, "serve", *common(stack, tmp_path), "--tokenizer", "tiny",
                           "--model-name", "no-such-model")
    assert code == EXIT_TOO_MANY_FAILED
    lines = out.strip().splitlines()
    banner = next(i for i, l in enumerate(lines) if l.startswith("!!! 6 of 6 requests FAILED"))
    table = next(i for i, l in enumerate(lines) if l.startswith("duration "))
    assert banner < table
    assert "404" in lines[banner + 1] or "model" in lines[banner + 1]
    line = json.loads(lines[-1])
    assert line["failed"] == 6 and line["failed_fraction"] == 1.0 and "error" in line
    assert "more than --max-failed-fraction" in err
    # under a threshold that tolerates it, the same run exits 0 but still says so first
    code, out, _ = bench(capsys, "serve", *common(stack, tmp_path), "--tokenizer", "tiny",
                         "--model-name", "no-such-model", "--max-failed-fraction", "1")
    assert code == 0 and out.startswith("!!! 6 of 6")


def test_sweep_reports_failures_before_each_attainment_line(stack, tmp_path, capsys):
    code, out, _ = bench(capsys, "sweep", *common(stack, tmp_path, n=3), "--tokenizer", "tiny",
                         "--model-name", "no-such-model", "--rates", "50", "--warmup", "0")
    assert code == EXIT_TOO_MANY_FAILED
    lines = out.strip().splitlines()
    banner = next(i for i, l in enumerate(lines) if l.startswith("!!! 3 of 3"))
    rate = next(i for i, l in enumerate(lines) if l.startswith("rate 50 req/s"))
    assert banner < rate
    assert json.loads(lines[-1])["failed"] == 3
