"""Instance registry: engines heartbeat into Redis, the router watches it. A new instance is
used as soon as it is healthy, a clean leave is seen at once, a crashed instance drops out
when its entry expires; cache summaries reach the router."""

import asyncio
import time

import grpc
import pytest

from pdserve.bench.router_fakes import FakeInstance
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.rpc import router_pb2, router_pb2_grpc
from pdserve.services.kvstore.redis_proc import RedisProcess
from pdserve.services.registry.config import RegistryConfig
from pdserve.services.registry.heartbeat import Heartbeat
from pdserve.services.registry.record import InstanceRecord
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.server import start_router
from pdserve.tests.unit.fake_engine import FakeTokenizer


@pytest.fixture
def redis():
    with RedisProcess() as proc:
        yield proc


def record_fn(inst: FakeInstance, running=0, cached=frozenset()):
    return lambda: InstanceRecord(inst.address, "unified", "fake", running=running,
                                  waiting=1, waiting_tokens=77, kv_usage=0.5, cached=cached)


async def until(check, timeout_s: float, what: str) -> float:
    """Seconds until check() holds; fails after timeout_s."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def generate(port: int) -> grpc.StatusCode:
    req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 2, 3]),
                                     params=pb.SamplingParams(max_tokens=1))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            [m async for m in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=10)]
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_instances_join_leave_and_expire_through_the_registry(redis):
    async def main():
        reg = RegistryConfig(redis.url, ttl_s=1.0, interval_s=0.2)
        a, b = await FakeInstance.start(), await FakeInstance.start()
        beats, router = [], None
        try:
            beats += [await Heartbeat(reg, record_fn(a, cached=frozenset({b"\x01" * 8}))).start(),
                      await Heartbeat(reg, record_fn(b)).start()]
            router = await start_router(RouterConfig(
                model="fake", backends=(), registry_url=redis.url, registry_interval_s=0.2,
                health_interval_s=0.2, port=0, grpc_port=0), tokenizer=FakeTokenizer())
            pool = router.state.pool
            await until(lambda: len(pool.healthy) == 2, 3, "both instances healthy")
            assert await generate(router.grpc_port) == grpc.StatusCode.OK
            backend_a = pool.backend(a.address)
            await until(lambda: backend_a.cache_summary == {b"\x01" * 8}, 2, "summary")
            # load comes from the pool's GetLoad (the fake's: none waiting), not the entry's 77
            assert backend_a.reported.waiting_tokens == 0

            await beats.pop().stop()  # b leaves cleanly: its entry is deleted
            left = await until(lambda: pool.backend(b.address) is None, 2, "b to leave")
            assert left < 1.0

            await beats[0]._periodic.stop()  # a "crashes": no more beats, the entry expires
            gone = await until(lambda: pool.backend(a.address) is None, 4, "a to expire")
            assert gone < reg.ttl_s + 1.0
            assert await generate(router.grpc_port) == grpc.StatusCode.UNAVAILABLE

            c = await FakeInstance.start()  # a new one is used as soon as it is healthy
            try:
                beats.append(await Heartbeat(reg, record_fn(c)).start())
                await until(lambda: len(pool.healthy) == 1, 2, "c healthy")
                assert await generate(router.grpc_port) == grpc.StatusCode.OK
                assert c.calls == 1
            finally:
                await c.stop()
        finally:
            for hb in beats:
                await hb.stop()
            if router is not None:
                await router.stop()
            await a.stop()
            await b.stop()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_heartbeat_survives_redis_down_and_record_roundtrips():
    rec = InstanceRecord("10.0.0.1:5000", "prefill", "m", 1, 2, 3, 0.25,
                         frozenset({b"abcdefgh", b"12345678"}))
    assert InstanceRecord.from_json(rec.to_json()) == rec
    with pytest.raises(ValueError):
        InstanceRecord("nohost", "prefill")
    with pytest.raises(ValueError):
        RegistryConfig("redis://x", ttl_s=1.0, interval_s=1.0)

    async def main():
        from pdserve.services.launcher import free_port

        dead = RegistryConfig(f"redis://127.0.0.1:{free_port('127.0.0.1')}/0", ttl_s=1.0,
                              interval_s=0.2)
        hb = await Heartbeat(dead, lambda: rec).start()  # nothing listens: logs, keeps going
        await asyncio.sleep(0.5)
        assert hb.beats == 0 and hb._periodic.running
        await hb.stop()
    asyncio.run(asyncio.wait_for(main(), 20))


def test_engine_snapshot_reads_stats_and_the_published_cache_summary():
    from types import SimpleNamespace

    from pdserve.common.engine.outputs import EngineStats
    from pdserve.services.registry.engine_snapshot import cache_summary, engine_record_fn

    cached = [bytes([i]) * 32 for i in range(10)]  # oldest first, as the pool keeps them
    core = SimpleNamespace(cached_block_hashes=lambda limit: tuple(cached[-limit:]))
    summary = cache_summary(core, 3)
    assert summary == tuple(bytes([i]) * 8 for i in (7, 8, 9))  # the newest, shortened
    stats = EngineStats(num_running=2, num_waiting=3, kv_usage=0.4, num_waiting_tokens=99,
                        num_free_blocks=1, num_total_blocks=2, prefix_cache_queries=0,
                        prefix_cache_hits=0, num_preemptions=0)
    engine = SimpleNamespace(stats=lambda: stats, cached_block_hashes=summary)
    rec = engine_record_fn(engine, "h:1", "decode", "m")()
    assert (rec.running, rec.waiting, rec.waiting_tokens, rec.kv_usage) == (2, 3, 99, 0.4)
    assert rec.cached == frozenset(summary)
    bare = SimpleNamespace(stats=lambda: stats)  # an engine that publishes no summary
    assert engine_record_fn(bare, "h:1", "decode", "m")().cached == frozenset()


def test_real_engines_register_report_their_cache_and_expire(tmp_path, redis):
    """Engine processes started with --registry, a router with only --registry: both are
    found and used; an engine's entry carries its cache summary after it served a prompt;
    a killed engine leaves the router's instance list when its entry expires."""
    import httpx
    import redis as redis_sync

    from pdserve.services.launcher import free_port
    from pdserve.tests.integration.disagg_helpers import generate, wait_for
    from pdserve.tests.integration.services_helpers import (TINY_ENGINE_ARGS, start_engine,
                                                             start_router, wait_engine,
                                                             wait_http)

    ports = [free_port("127.0.0.1") for _ in range(4)]
    addrs = [f"127.0.0.1:{p}" for p in ports[:2]]
    url = f"http://127.0.0.1:{ports[2]}"
    children = []
    try:
        for i, p in enumerate(ports[:2]):
            children.append(start_engine(tmp_path, p, name=f"engine{i}", extra=(
                *TINY_ENGINE_ARGS, "--registry", redis.url)))
        for child, a in zip(children, addrs):
            wait_engine(child, a, timeout_s=180)
        children.append(start_router(tmp_path, [], ports[2], ports[3],
                                     extra=("--registry", redis.url)))
        wait_http(children[-1], url + "/health")
        wait_for(lambda: httpx.get(url + "/health", timeout=5).json()["healthy_instances"] == 2,
                 10, "both engines found through the registry")
        generate(f"127.0.0.1:{ports[3]}", list(range(5, 75)), 2, timeout=30)  # 4 full blocks
        r = redis_sync.Redis.from_url(redis.url)
        entries = lambda: [InstanceRecord.from_json(v) for v in  # noqa: E731
                           r.mget(r.keys("pdserve:instance:*"))]
        wait_for(lambda: any(len(e.cached) >= 4 for e in entries()), 5, "a cache summary")
        assert all(len(e.fingerprint) >= 16 and e.block_size == 16 and e.model == "tiny"
                   for e in entries())
        children[0].proc.kill()
        children[0].proc.wait(10)
        t0 = time.monotonic()
        wait_for(lambda: httpx.get(url + "/health", timeout=5).json()["instances"] == 1, 10,
                 "the killed engine to leave")
        assert time.monotonic() - t0 < 6.0  # TTL 3 s + a poll
        assert generate(f"127.0.0.1:{ports[3]}", [1, 2, 3], 2, timeout=30)[0]
    finally:
        for child in reversed(children):
            child.stop(10.0)


BAD_ENTRIES = {
    "list": "[1, 2]",
    "not-json": "{nope",
    "no-address": '{"role": "unified"}',
    "wrong-type": '{"address": "127.0.0.1:1", "role": "unified", "running": "many"}',
    "bool-count": '{"address": "127.0.0.1:1", "role": "unified", "waiting": true}',
    "bad-role": '{"address": "127.0.0.1:1", "role": "boss"}',
    "bad-port": '{"address": "127.0.0.1:99999", "role": "unified"}',
    "bad-usage": '{"address": "127.0.0.1:1", "role": "unified", "kv_usage": 7}',
    "bad-b64": '{"address": "127.0.0.1:1", "role": "unified", "cached": "!!"}',
    "ragged": '{"address": "127.0.0.1:1", "role": "unified", "cached": "AAAA"}',
    "huge": '{"address": "127.0.0.1:1", "role": "unified", "model": "' + "x" * 70000 + '"}',
}


def test_record_refuses_malformed_entries():
    for text in BAD_ENTRIES.values():
        with pytest.raises(ValueError):
            InstanceRecord.from_json(text)


def test_malformed_and_foreign_entries_are_skipped_and_the_watcher_lives(redis):
    """Bad entries (and one for another model) sit in the registry beside a good one: the
    router uses the good one, skips the rest, and still sees an instance that joins later."""
    import redis as redis_sync

    async def main():
        r = redis_sync.Redis.from_url(redis.url)
        for name, text in BAD_ENTRIES.items():
            r.set(f"pdserve:instance:bad-{name}", text)
        reg = RegistryConfig(redis.url, ttl_s=1.0, interval_s=0.2)
        a, other = await FakeInstance.start(), await FakeInstance.start()
        r.set(f"pdserve:instance:{other.address}",
              InstanceRecord(other.address, "unified", "another-model").to_json())
        beats, router = [], None
        try:
            beats.append(await Heartbeat(reg, record_fn(a)).start())
            router = await start_router(RouterConfig(
                model="fake", backends=(), registry_url=redis.url, registry_interval_s=0.2,
                health_interval_s=0.2, port=0, grpc_port=0), tokenizer=FakeTokenizer())
            pool = router.state.pool
            await until(lambda: len(pool.healthy) == 1, 3, "the good instance")
            assert pool.backend(other.address) is None  # another model: never a candidate
            watcher = router.watchers[0]
            assert watcher.skipped >= len(BAD_ENTRIES) + 1
            b = await FakeInstance.start()
            try:
                beats.append(await Heartbeat(reg, record_fn(b)).start())
                await until(lambda: len(pool.healthy) == 2, 3, "a later instance")
                assert watcher._periodic.running
            finally:
                for hb in beats:
                    await hb.stop()
                beats.clear()
                await b.stop()
        finally:
            for hb in beats:
                await hb.stop()
            if router is not None:
                await router.stop()
            await a.stop()
            await other.stop()
    asyncio.run(asyncio.wait_for(main(), 60))
