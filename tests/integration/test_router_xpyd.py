"""xPyD through real processes (tiny model): 2 prefill + 2 decode instances; one of each is
killed in the middle of a load run. Every request either completes with the offline
engine's greedy tokens or gets a clean error (never a hang), and the router keeps serving.
Then KV-aware routing: a prompt that extends one served before goes to the instance whose
local prefix cache holds it."""

import concurrent.futures as cf
import threading
import time

import grpc
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.services.launcher import free_port
from pdserve.tests.integration.disagg_helpers import disagg_stack, generate, metric, wait_for
from pdserve.tests.integration.services_helpers import (offline_engine, start_engine,
                                                         start_router, wait_engine, wait_http)

MAX_TOKENS = 12
N_LOAD, N_AFTER = 30, 6
PROMPTS = [[(11 * i + 3 * j) % 200 + 3 for j in range(36 + (7 * i) % 40)]
           for i in range(N_LOAD + N_AFTER)]
CLEAN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
REQUEST_TIMEOUT_S = 60  # a request this slow counts as hung


@pytest.fixture(scope="module")
def reference():
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in offline_engine().generate(PROMPTS, params)]


def one(grpc_addr: str, i: int):
    t0 = time.monotonic()
    try:
        tokens, _ = generate(grpc_addr, PROMPTS[i], MAX_TOKENS, timeout=REQUEST_TIMEOUT_S)
        return i, tokens, None, time.monotonic() - t0
    except grpc.RpcError as err:
        return i, None, (err.code(), err.details()), time.monotonic() - t0


def test_killing_a_prefill_and_a_decode_mid_load(tmp_path, reference):
    router_args = ("--retry-backoff", "0.02", "--prefill-timeout", "10",
                   "--stream-idle-timeout", "20")
    with disagg_stack(tmp_path, n_prefill=2, n_decode=2, router_args=router_args) as stack:
        done = []
        killed = threading.Event()

        def killer():
            while len(done) < 6 and not killed.is_set():
                time.sleep(0.01)
            stack.kill("prefill0")
            stack.kill("decode0")
            killed.set()
        k = threading.Thread(target=killer, daemon=True)
        k.start()
        with cf.ThreadPoolExecutor(6) as pool:
            for fut in cf.as_completed([pool.submit(one, stack.grpc_addr, i)
                                        for i in range(N_LOAD)]):
                done.append(fut.result())
        k.join(30)
        assert killed.is_set()
        errors = [(i, e) for i, t, e, _ in done if e is not None]
        for i, tokens, err, secs in done:
            assert secs < REQUEST_TIMEOUT_S - 5, f"request {i} took {secs:.1f}s"
            if err is None:
                assert tokens == reference[i], f"request {i}: wrong tokens"
            else:
                assert err[0] in CLEAN and err[1], f"request {i}: unclean error {err}"
        assert len(errors) <= 6, errors  # at most those in flight on the killed instances
        rungs = {r: metric(stack.http_url, "pdserve_router_fallback_rungs_total", f'rung="{r}"')
                 for r in ("prefill_retry", "prefill_to_unified", "decode_retry",
                           "error_after_tokens")}
        print(f"\n{len(errors)} clean errors of {N_LOAD}; ladder rungs {rungs}")
        assert errors or sum(rungs.values()) > 0  # the kills hit requests in flight
        for name, addr in (("prefill", stack.prefill[0]), ("decode", stack.decode[0])):
            wait_for(lambda a=addr: metric(stack.http_url, "pdserve_instance_up",
                                           f'instance="{a}"') == 0, 10, f"{name}0 down")
        for i in range(N_LOAD, N_LOAD + N_AFTER):  # the survivors serve everything now
            tokens, _ = generate(stack.grpc_addr, PROMPTS[i], MAX_TOKENS, timeout=30)
            assert tokens == reference[i]
        assert metric(stack.http_url, "pdserve_router_disagg_decisions_total",
                      'decision="prefill"') > 0


def test_kv_aware_sends_a_cached_prefix_to_its_holder(tmp_path):
    """Colocated, no store: a prompt's blocks can only be reused on the instance that
    computed them, so cached_tokens > 0 proves the router picked that one."""
    ports = [free_port("127.0.0.1") for _ in range(4)]
    addrs = [f"127.0.0.1:{p}" for p in ports[:2]]
    children = []
    try:
        for i, p in enumerate(ports[:2]):
            children.append(start_engine(tmp_path, p, name=f"engine{i}"))
        for child, a in zip(children, addrs):
            wait_engine(child, a, timeout_s=180)
        children.append(start_router(tmp_path, addrs, ports[2], ports[3],
                                     extra=("--decode-policy", "kv_aware")))
        wait_http(children[-1], f"http://127.0.0.1:{ports[2]}/health")
        grpc_addr = f"127.0.0.1:{ports[3]}"
        bases = [[(13 * k + j) % 190 + 5 for j in range(96)] for k in range(4)]  # 6 blocks
        for b in bases:
            generate(grpc_addr, b, 2, timeout=30)
        for b in reversed(bases):  # not the order round-robin would happen to get right
            _, last = generate(grpc_addr, b + [7, 8, 9, 10, 11], 2, timeout=30)
            assert last.usage.cached_tokens >= 96, last.usage
    finally:
        for child in reversed(children):
            child.stop(10.0)
