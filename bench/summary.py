"""A run's records -> the figures of the result file: latencies, throughput, goodput by tier.

Latency summaries cover the requests that completed; ITL pools every gap of every request.
Throughputs divide by the run's duration (first send -> last completion).
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

from pdserve.bench.breakdown import aggregate_breakdowns
from pdserve.bench.goodput import OVERALL, attainment_by_tier
from pdserve.bench.record import RequestRecord
from pdserve.bench.slo import TierSLO, slo_for
from pdserve.bench.stats import summarize


def latency_block(records: Sequence[RequestRecord]) -> dict:
    ok = [r for r in records if r.ok]
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "ttft_s": summarize([r.ttft_s for r in ok]).to_json(),
        "itl_s": summarize([g for r in ok for g in r.itl_s]).to_json(),
        "tpot_s": summarize([r.tpot_s for r in ok if r.tpot_s is not None]).to_json(),
        "e2e_s": summarize([r.e2e_s for r in ok]).to_json(),
        "breakdown": aggregate_breakdowns([r.breakdown for r in ok if r.breakdown]),
    }


def summarize_run(records: Sequence[RequestRecord], duration_s: float,
                  slos: Mapping[str, TierSLO]) -> dict:
    ok = [r for r in records if r.ok]
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    per = max(duration_s, 1e-9)
    att = attainment_by_tier(records, slos, duration_s)
    tiers = {}
    for tier, a in att.items():
        if tier == OVERALL:
            continue
        mine = [r for r in records if r.tier == tier]
        tiers[tier] = dict(latency_block(mine), slo=slo_for(tier, slos).to_json(),
                           **a.to_json())
    errors = Counter(r.error for r in records if r.error)
    return dict(
        latency_block(records),
        duration_s=duration_s,
        input_tokens=inp,
        output_tokens=out,
        request_throughput=len(ok) / per,
        output_throughput=out / per,
        total_token_throughput=(inp + out) / per,
        attainment=att[OVERALL].attainment,
        goodput_rps=att[OVERALL].goodput_rps,
        met=att[OVERALL].met,
        tiers=tiers,
        errors=dict(errors.most_common(5)),
    )
