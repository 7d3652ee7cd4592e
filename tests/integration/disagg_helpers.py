"""A disaggregated stack of real processes for tests: redis, KV store master and node, prefill
and decode instances, the router; every one on free loopback ports, all stopped on exit,
failure included. Tests may kill any part (`stack.children[name]`) to inject failures."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import engine_pb2_grpc as pb_grpc
from pdserve.common.rpc import kvstore_pb2 as kv_pb
from pdserve.common.rpc import kvstore_pb2_grpc as kv_grpc
from pdserve.common.rpc import router_pb2
from pdserve.common.rpc import router_pb2_grpc
from pdserve.services.kvstore.redis_proc import RedisProcess
from pdserve.services.launcher import Child, engine_serving, free_port, http_ok, wait_until
from pdserve.tests.integration.services_helpers import SERVE, TINY_ENGINE_ARGS

HOST = "127.0.0.1"


@dataclass
class DisaggStack:
    http_url: str
    grpc_addr: str  # the router's gRPC API
    master_addr: str
    prefill: list[str]
    decode: list[str]
    redis: RedisProcess
    children: dict[str, Child] = field(default_factory=dict)

    def kill(self, name: str) -> None:
        child = self.children[name]
        child.proc.kill()
        child.proc.wait(10)


def _store_nodes(master_addr: str) -> int:
    """Storage nodes the master knows; -1 while the master does not answer."""
    addresses = store_node_addresses(master_addr)
    return -1 if addresses is None else len(addresses)


def store_node_addresses(master_addr: str) -> list[str] | None:
    """The addresses of the storage nodes the master knows; None while it does not answer."""
    with grpc.insecure_channel(master_addr) as ch:
        try:
            stats = kv_grpc.KVStoreMasterStub(ch).Stats(kv_pb.StatsRequest(), timeout=1)
        except grpc.RpcError:
            return None
    return [n.address for n in stats.nodes]


def _start(stack: DisaggStack, log_dir: Path, name: str, argv: list[str], check) -> None:
    child = Child(name, SERVE + argv, log_dir)
    child.start()
    stack.children[name] = child
    wait_until(check, child, 120, threading.Event())


@contextlib.contextmanager
def disagg_stack(log_dir: Path, n_prefill: int = 1, n_decode: int = 2, model: str = "tiny",
                 engine_args=TINY_ENGINE_ARGS, router_args=()):
    log_dir.mkdir(parents=True, exist_ok=True)
    with RedisProcess() as redis:
        maddr = f"{HOST}:{free_port(HOST)}"
        hp, gp = free_port(HOST), free_port(HOST)
        stack = DisaggStack(f"http://{HOST}:{hp}", f"{HOST}:{gp}", maddr, [], [], redis)
        try:
            _start(stack, log_dir, "kv-master", ["kvstore-master", "--port", maddr.split(":")[1],
                                                 "--redis-url", redis.url, "--node-timeout",
                                                 "3"], lambda: _store_nodes(maddr) >= 0)
            _start(stack, log_dir, "kv-node", ["kvstore-node", "--master", maddr,
                                               "--capacity-mib", "64", "--transport", "tcp"],
                   lambda: _store_nodes(maddr) > 0)
            kv = ["--kv-store", maddr, "--kv-transport", "tcp", "--model", model]
            for role, n, addrs in (("prefill", n_prefill, stack.prefill),
                                   ("decode", n_decode, stack.decode)):
                for i in range(n):
                    addr = f"{HOST}:{free_port(HOST)}"
                    argv = [role, "--port", addr.split(":")[1], *kv, *engine_args]
                    if role == "decode":
                        argv += ["--role", "decode"]
                    _start(stack, log_dir, f"{role}{i}", argv,
                           lambda a=addr, r=role: engine_serving(a, r))
                    addrs.append(addr)
            _start(stack, log_dir, "router", [
                "router", "--model", model, "--backends", ",".join(stack.decode),
                "--prefill-backends", ",".join(stack.prefill), "--kv-store", maddr,
                "--port", str(hp), "--grpc-port", str(gp), "--health-interval", "0.3",
                *router_args], lambda: http_ok(f"{stack.http_url}/health"))
            yield stack
        finally:
            for child in reversed(list(stack.children.values())):
                child.stop(10.0)


def generate(grpc_addr: str, ids: list[int], max_tokens: int, timeout: float = 60):
    """Greedy tokens of one Router.Generate call and its last message."""
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), params=params)
    with grpc.insecure_channel(grpc_addr) as ch:
        msgs = list(router_pb2_grpc.RouterStub(ch).Generate(req, timeout=timeout))
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def engine_load(address: str, service: str = "decode") -> pb.LoadResponse:
    stub = pb_grpc.PrefillServiceStub if service == "prefill" else pb_grpc.DecodeServiceStub
    with grpc.insecure_channel(address) as ch:
        return stub(ch).GetLoad(pb.LoadRequest(), timeout=5)


def metric(http_url: str, name: str, labels: str = "") -> float:
    """One sample of the router's /metrics (0 when absent), e.g. metric(u, "x_total",
    'reason="stored"')."""
    import httpx

    text = httpx.get(f"{http_url}/metrics", timeout=5).text
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(check, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def store_call(master_addr: str, coro_fn, transport: str = "tcp"):
    """Runs coro_fn(KVStoreClient) on a fresh loop (for injecting store damage)."""
    from pdserve.connector.kvstore.client import KVStoreClient

    async def main():
        async with KVStoreClient(master_addr, transport) as kv:
            return await coro_fn(kv)
    return asyncio.run(asyncio.wait_for(main(), 30))


def greedy_params(max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def prefill_direct(address: str, ids: list[int], max_tokens: int) -> pb.PrefillResponse:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.PrefillServiceStub(ch).Prefill(pb.PrefillRequest(
            prompt_token_ids=ids, params=greedy_params(max_tokens)), timeout=60)


def decode_direct(address: str, ids: list[int], max_tokens: int, **req) -> list[int]:
    """Tokens a decode instance streams for `ids` (after `first_token_id`, when given)."""
    with grpc.insecure_channel(address) as ch:
        msgs = list(pb_grpc.DecodeServiceStub(ch).Decode(pb.DecodeRequest(
            prompt_token_ids=ids, params=greedy_params(max_tokens), **req), timeout=60))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return [t for m in msgs for t in m.token_ids]
