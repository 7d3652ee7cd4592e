"""`--backends dns:NAME:PORT` (services/router/routing/dns_watch.py): parsing, resolution into the pool,
periodic re-resolution, and a failed lookup keeping the last answer."""

import asyncio
import socket

from pdserve.services.router.routing.dns_watch import DnsWatcher, split_dns


class FakePool:
    def __init__(self):
        self.syncs = []

    def sync(self, source, addresses):
        self.syncs.append((source, set(addresses)))


def test_split_dns():
    plain, dns = split_dns(("10.0.0.1:50051", "dns:decode.ns.svc:50052", "dns:x:1"))
    assert plain == ("10.0.0.1:50051",)
    assert dns == (("decode.ns.svc", 50052), ("x", 1))


def _infos(*hosts):
    return [(socket.AF_INET6 if ":" in h else socket.AF_INET, socket.SOCK_STREAM, 6, "",
             (h, 0)) for h in hosts]


def test_resolves_refreshes_and_keeps_last_answer_on_failure():
    answers = [_infos("10.0.0.1", "10.0.0.2"), _infos("10.0.0.2", "fd00::3"), OSError("down")]

    async def main():
        loop = asyncio.get_running_loop()
        calls = []

        async def fake_getaddrinfo(name, port, **kw):
            calls.append((name, port))
            answer = answers[min(len(calls), len(answers)) - 1]
            if isinstance(answer, Exception):
                raise answer
            return answer

        loop.getaddrinfo = fake_getaddrinfo
        pool = FakePool()
        watcher = await DnsWatcher((("decode", 7000),), pool, interval_s=0.02).start()
        try:
            assert pool.syncs[0] == ("dns", {"10.0.0.1:7000", "10.0.0.2:7000"})
            while len(calls) < 4:  # two more refreshes: one new answer, then failures
                await asyncio.sleep(0.01)
        finally:
            await watcher.stop()
        assert calls[0] == ("decode", 7000)
        assert ("dns", {"10.0.0.2:7000", "[fd00::3]:7000"}) == pool.syncs[1]
        # the lookup failed from then on: the pool keeps the last good answer
        assert all(s == pool.syncs[1] for s in pool.syncs[2:]) and len(pool.syncs) >= 3
    asyncio.run(asyncio.wait_for(main(), 10))


def test_localhost_really_resolves():
    async def main():
        pool = FakePool()
        await DnsWatcher((("localhost", 7001),), pool).refresh()
        assert "127.0.0.1:7001" in pool.syncs[0][1]
    asyncio.run(main())
