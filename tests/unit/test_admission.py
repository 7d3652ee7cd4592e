"""Admission: the bounded priority queue, its token budget, shedding, the TTFT SLO estimate,
per-key token buckets and API keys. Every await has a timeout."""

import asyncio

import pytest

from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.admission.admission import AdmissionController
from pdserve.services.router.admission.admission_config import AdmissionConfig
from pdserve.services.router.admission.api_keys import bearer, check_key, load_api_keys
from pdserve.services.router.api.errors import APIError
from pdserve.services.router.admission.prefill_rate import PrefillRate
from pdserve.services.router.admission.rate_limit import KeyedRateLimiter
from pdserve.services.router.api.request_meta import meta_from_headers


def run(coro, timeout=5.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def rejected(metrics, reason):
    return metrics.admission_rejected.labels(reason)._value.get()


def controller(**kw):
    m = RouterMetrics()
    return AdmissionController(AdmissionConfig(**kw), m), m


def test_slots_queue_in_priority_order_and_hand_over():
    async def main():
        ctl, _ = controller(max_prefilling=1)
        first = await ctl.admit(10)
        order = []

        async def wait(name, prio):
            ticket = await ctl.admit(10, priority=prio)
            order.append(name)
            ticket.release()  # hands the slot to the next in line
        tasks = [asyncio.ensure_future(wait(n, p)) for n, p in (("low", 0), ("high", 5),
                                                                 ("mid", 1))]
        await asyncio.sleep(0.01)
        assert ctl.prefilling == 1 and order == [] and ctl.queued_tokens == 30
        first.first_token()
        await asyncio.wait_for(asyncio.gather(*tasks), 1)
        assert order == ["high", "mid", "low"]
        assert ctl.prefilling == 0 and ctl.queued_tokens == 0
    run(main())


def test_full_queue_refuses_with_retry_after_and_sheds_lower_priority():
    async def main():
        ctl, m = controller(max_prefilling=1, max_queued=1)
        held = await ctl.admit(10)
        low = asyncio.ensure_future(ctl.admit(10, priority=0))
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as err:
            await ctl.admit(10, priority=0)  # same priority: refused, nothing shed
        assert err.value.status == 429 and err.value.retry_after >= 1
        assert err.value.grpc_code.name == "RESOURCE_EXHAUSTED"
        high = asyncio.ensure_future(ctl.admit(10, priority=3))
        await asyncio.sleep(0.01)
        with pytest.raises(APIError):
            await low  # shed for the higher priority
        assert rejected(m, "queue_full") == 1 and rejected(m, "shed") == 1
        held.release()
        (await asyncio.wait_for(high, 1)).release()
        assert ctl.prefilling == 0
    run(main())


def test_token_budget_bounds_the_queue():
    async def main():
        ctl, m = controller(max_prefilling=1, max_queued_tokens=100)
        held = await ctl.admit(5)
        waiting = asyncio.ensure_future(ctl.admit(80))
        await asyncio.sleep(0.01)
        with pytest.raises(APIError):
            await ctl.admit(30)  # 80 + 30 > 100
        assert rejected(m, "tokens_full") == 1
        held.release()
        (await asyncio.wait_for(waiting, 1)).release()
    run(main())


def test_slo_rejects_at_once_when_the_estimate_misses_the_target():
    async def main():
        ctl, m = controller(prefill_tokens_per_s=1000.0)
        a = await ctl.admit(1500)  # 1.5 s of prefill in flight
        assert ctl.estimate_ttft(0, 500) == pytest.approx(2.0)
        with pytest.raises(APIError) as err:
            await ctl.admit(500, ttft_slo_s=1.0)
        assert err.value.status == 429 and err.value.retry_after == 1
        b = await ctl.admit(500, ttft_slo_s=3.0)  # reachable: admitted
        assert rejected(m, "slo") == 1
        a.release()
        b.release()
        t = await ctl.admit(500, ttft_slo_s=1.0)  # nothing in flight any more: 0.5 s
        t.release()
    run(main())


def test_slo_default_target_applies_without_a_header():
    async def main():
        ctl, _ = controller(prefill_tokens_per_s=100.0, default_ttft_slo_s=1.0)
        with pytest.raises(APIError):
            await ctl.admit(200)
    run(main())


def test_queue_timeout_refuses_and_a_cancelled_waiter_leaves_no_slot_behind():
    async def main():
        ctl, m = controller(max_prefilling=1, queue_timeout_s=0.05)
        held = await ctl.admit(1)
        with pytest.raises(APIError):
            await ctl.admit(1)
        assert rejected(m, "queue_timeout") == 1
        task = asyncio.ensure_future(ctl.admit(1))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        held.first_token()
        held.release()  # idempotent: the slot is freed once
        assert ctl.prefilling == 0 and ctl.queued_tokens == 0
    run(main())


def test_prefill_rate_measures_busy_throughput():
    now = [10.0]
    rate = PrefillRate(1000.0, clock=lambda: now[0])
    for i in range(30):  # 100 tokens finish every 0.1 s, each dispatched long before
        now[0] += 0.1
        rate.observe(100, dispatched_at=0.0)
    assert rate.tokens_per_s == pytest.approx(1000.0, rel=0.01)
    for i in range(30):
        now[0] += 0.5
        rate.observe(100, dispatched_at=0.0)
    assert rate.tokens_per_s == pytest.approx(200.0, rel=0.02)


def test_token_buckets_per_key():
    now = [0.0]
    lim = KeyedRateLimiter(rps=2.0, burst=2.0, tokens_per_s=0.0, clock=lambda: now[0])
    assert lim.check("a", 10) is None and lim.check("a", 10) is None
    wait = lim.check("a", 10)
    assert wait == pytest.approx(0.5)
    assert lim.check("b", 10) is None  # another key has its own bucket
    now[0] += 0.5
    assert lim.check("a", 10) is None
    tok = KeyedRateLimiter(rps=0.0, burst=0.0, tokens_per_s=100.0, clock=lambda: now[0])
    assert tok.check("a", 80) is None
    assert tok.check("a", 80) == pytest.approx(0.6)
    assert tok.check("a", 1000) == float("inf")
    assert not KeyedRateLimiter(0, 0, 0).enabled


def test_api_keys_and_headers(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-one\n\n sk-two \n")
    keys = load_api_keys(str(f))
    assert keys == {"sk-one", "sk-two"}
    check_key(keys, bearer("Bearer sk-two"))
    for bad in ("Bearer sk-three", "sk-one", None):
        with pytest.raises(APIError) as err:
            check_key(keys, bearer(bad))
        assert err.value.status == 401
    check_key(frozenset(), "")  # no key file: open
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError):
        load_api_keys(str(tmp_path / "empty"))
    h = {"authorization": "Bearer k", "x-priority": "7", "x-ttft-slo-ms": "250",
         "x-session-id": "s1"}
    meta = meta_from_headers(h.get, "x-session-id", user="u")
    assert (meta.api_key, meta.priority, meta.ttft_slo_s, meta.affinity) == ("k", 7, 0.25, "s1")
    assert meta_from_headers({}.get, "x-session-id", user="u").affinity == "u"
    for bad in ({"x-priority": "high"}, {"x-ttft-slo-ms": "-1"}, {"x-priority": "5000"}):
        with pytest.raises(APIError):
            meta_from_headers(bad.get, "x-session-id")
