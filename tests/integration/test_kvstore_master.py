"""KV store master semantics against a real Redis (tests/conftest.py's `redis_url`: a
testcontainers container where Docker answers, a local redis-server otherwise)."""

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from pdserve.services.kvstore.config import MasterConfig
from pdserve.services.kvstore.master import MasterCore
from pdserve.services.kvstore.metadata import RedisMetaStore
from pdserve.connector.kvstore.records import NodeInfo, PutStatus

MiB = 1 << 20


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


class Env:
    """Masters sharing one fresh namespace and one fake clock; `run` closes their clients."""

    def __init__(self, redis_url):
        self.url = redis_url
        self.ns = f"test:{uuid.uuid4().hex}"
        self.clock = Clock()
        self._clients = []

    async def make(self, **kw) -> MasterCore:
        r = aioredis.Redis.from_url(self.url)
        self._clients.append(r)
        cfg = MasterConfig(namespace=self.ns, redis_url=self.url, **kw)
        core = MasterCore(cfg, RedisMetaStore(r, self.ns), clock=self.clock)
        await core.start()
        return core

    def run(self, coro_fn):
        async def wrapped():
            try:
                await asyncio.wait_for(coro_fn(), 30)
            finally:
                for r in self._clients:
                    await r.aclose()
                self._clients.clear()

        asyncio.run(wrapped())


@pytest.fixture
def env(redis_url):
    return Env(redis_url)


async def _nodes(core, n, cap=4 * MiB):
    for i in range(n):
        await core.register_node(NodeInfo(f"n{i}", f"127.0.0.1:{7000 + i}", cap, "inc"))


def test_put_is_invisible_until_put_end_and_revoke_frees(env):
    make = env.make

    async def main():
        m = await make()
        await _nodes(m, 1)
        started = await m.put_start(b"k", 1000, lease_s=0)
        assert started.status is PutStatus.OK and len(started.replicas) == 1
        assert await m.get_replicas(b"k") is None and m.batch_exists([b"k"]) == [False]
        # first writer wins; a second is told the first still writes (not readable yet)
        assert (await m.put_start(b"k", 1000, 0)).status is PutStatus.WRITING
        assert await m.put_end(b"k") and not await m.put_end(b"k")
        assert (await m.put_start(b"k", 1000, 0)).status is PutStatus.EXISTS  # complete
        got = await m.get_replicas(b"k")
        assert got.size == 1000 and got.replicas == started.replicas
        assert await m.put_start(b"r", 1000, 0) and await m.put_revoke(b"r")
        assert await m.get_replicas(b"r") is None and not await m.put_revoke(b"r")
        assert m.stats().nodes[0].used == 1024  # only k's aligned bytes remain
        assert (await m.put_start(b"r", 1000, 0)).status is PutStatus.OK  # revoked: free again

    env.run(main)


def test_batch_replica_lookup_answers_in_order_and_renews_leases(env):
    make = env.make

    async def main():
        m = await make()
        await _nodes(m, 1)
        for key in (b"a", b"b"):
            assert (await m.put_start(key, 100, lease_s=0)).status is PutStatus.OK
            assert await m.put_end(key)
        assert (await m.put_start(b"w", 100, lease_s=0)).status is PutStatus.OK  # unfinished
        got = await m.get_replicas_many([b"b", b"nope", b"w", b"a", b"b"])
        assert [g is not None for g in got] == [True, False, False, True, True]
        assert got[0] == await m.get_replicas(b"b") and got[3].size == 100
        # the read leases are renewed, so the looked-up objects cannot be removed now
        assert await m.remove([b"a", b"b"]) == 0
        assert await m.get_replicas_many([]) == []

    env.run(main)


def test_replicas_go_to_distinct_nodes(env):
    make = env.make

    async def main():
        m = await make(replica_num=2)
        await _nodes(m, 3)
        for i in range(6):
            r = (await m.put_start(f"k{i}".encode(), 5000, 0)).replicas
            assert len(r) == 2 and len({x.node_id for x in r}) == 2
        assert (await m.put_start(b"x", 10, 0, replica_num=4)).status \
            is PutStatus.NOT_ENOUGH_NODES

    env.run(main)


def test_prefix_lookup_and_batch_exists(env):
    make = env.make

    async def main():
        m = await make()
        await _nodes(m, 1)
        for k in (b"a", b"b", b"d"):
            await m.put_start(k, 10, 0)
            await m.put_end(k)
        await m.put_start(b"c", 10, 0)  # being written: does not count yet
        assert m.prefix_lookup([b"a", b"b", b"c", b"d"]) == 2
        assert m.prefix_lookup([b"x", b"a"]) == 0
        assert m.batch_exists([b"d", b"c", b"zz"]) == [True, False, False]

    env.run(main)


def test_eviction_at_watermark_spares_leased_objects(env):
    make, clock = env.make, env.clock

    async def main():
        m = await make(high_watermark=0.8, low_watermark=0.5)
        await _nodes(m, 1, cap=10 * MiB)
        for i in range(7):  # 7 MiB: under the 8 MiB high watermark
            assert (await m.put_start(f"o{i}".encode(), MiB, lease_s=100 if i < 2 else 0)
                    ).status is PutStatus.OK
            await m.put_end(f"o{i}".encode())
            clock.t += 1
        await m.get_replicas(b"o2")  # o2 becomes the most recently used unleased object
        clock.t += 10  # past the read lease
        assert (await m.put_start(b"big", 2 * MiB, 0)).status is PutStatus.OK  # 9 MiB > 8
        alive = m.batch_exists([f"o{i}".encode() for i in range(7)])
        assert alive[:2] == [True, True]  # leased: never evicted
        assert m.stats().nodes[0].used <= 5 * MiB and alive[2] is True  # LRU kept o2
        assert m.stats().evictions == 7 - sum(alive)
        assert (await m.put_start(b"huge", 20 * MiB, 0)).status is PutStatus.NOT_ENOUGH_NODES

    env.run(main)


def test_no_space_when_everything_is_leased(env):
    make = env.make

    async def main():
        m = await make()
        await _nodes(m, 1, cap=2 * MiB)
        for k in (b"a", b"b"):
            await m.put_start(k, MiB, lease_s=60)
            await m.put_end(k)
        assert (await m.put_start(b"c", MiB, 0)).status is PutStatus.NO_SPACE
        assert await m.remove([b"a"]) == 0  # leased: an unforced remove keeps it
        assert await m.remove([b"a"], force=True) == 1
        assert (await m.put_start(b"c", MiB, 0)).status is PutStatus.OK

    env.run(main)


def test_lease_expiry_and_abandoned_writes(env):
    make, clock = env.make, env.clock

    async def main():
        m = await make(put_timeout_s=10)
        await _nodes(m, 1)
        await m.put_start(b"leased", 100, lease_s=30)
        await m.put_end(b"leased")
        await m.put_start(b"stuck", 100, lease_s=0)  # its writer dies: no PutEnd ever
        clock.t += 5
        for n in ("n0",):
            assert m.heartbeat(n, "inc")
        await m.sweep()
        assert await m.remove([b"leased"]) == 0
        clock.t += 26
        assert m.heartbeat("n0", "inc")
        await m.sweep()
        assert not await m.put_end(b"stuck")  # revoked by the put timeout
        assert await m.remove([b"leased"]) == 1  # lease over: removable
        assert m.stats().objects == 0 and m.stats().nodes[0].used == 0

    env.run(main)


def test_node_death_drops_its_objects_keeps_other_replicas(env):
    make, clock = env.make, env.clock

    async def main():
        m = await make(node_timeout_s=3, heartbeat_interval_s=1)
        await _nodes(m, 3)
        await m.put_start(b"two", 100, 0, replica_num=2)
        await m.put_start(b"one", 100, 0, replica_num=1)
        for k in (b"two", b"one"):
            await m.put_end(k)
        victim = (await m.get_replicas(b"one")).replicas[0].node_id
        clock.t += 4
        for n in ("n0", "n1", "n2"):
            if n != victim:
                assert m.heartbeat(n, "inc")
        await m.sweep()
        assert m.batch_exists([b"one"]) == [False]
        assert not m.heartbeat(victim, "inc")  # told to register again
        two = await m.get_replicas(b"two")
        assert two is not None and victim not in {r.node_id for r in two.replicas}
        assert len(m.stats().nodes) == 2

    env.run(main)


def test_master_restart_keeps_metadata(env):
    make = env.make

    async def main():
        m1 = await make(replica_num=2)
        await _nodes(m1, 2)
        placed = (await m1.put_start(b"kept", 3000, lease_s=50)).replicas
        await m1.put_end(b"kept")
        await m1.put_start(b"half", 3000, 0)
        m2 = await make(replica_num=2)  # a new master process on the same redis
        got = await m2.get_replicas(b"kept")
        assert got.size == 3000 and got.replicas == placed
        assert m2.batch_exists([b"half"]) == [False] and await m2.put_end(b"half")
        assert [n.used for n in m2.stats().nodes] == [n.used for n in m1.stats().nodes]
        assert (await m2.put_start(b"new", 100, 0)).replicas[0].offset >= 6016  # no overlap
        assert await m2.remove([b"kept"]) == 0  # the lease survived the restart too

    env.run(main)


def test_reads_renew_leases_without_redis_and_write_them_back_later(env):
    async def main():
        m = await env.make()
        await _nodes(m, 1)
        assert (await m.put_start(b"a", 100, lease_s=0)).status is PutStatus.OK
        assert await m.put_end(b"a")
        real = m._meta.save_objects

        async def redis_down(metas):
            raise ConnectionError("redis is down")
        m._meta.save_objects = redis_down
        env.clock.t += 100
        assert (await m.get_replicas(b"a")).size == 100  # served from memory
        with pytest.raises(ConnectionError):
            await m.flush_renewals()  # kept pending
        m._meta.save_objects = real
        await m.flush_renewals()
        again = await env.make()  # a restarted master sees the renewed lease
        assert again._objects[b"a"].lease_until == env.clock.t + 5.0
    env.run(main)
