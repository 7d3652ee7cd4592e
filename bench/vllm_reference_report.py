"""The report of bench/vllm_reference.sh: each server's client results and pdserve's ratios to
vLLM's, as medians over the hold's rounds.

    python -m pdserve.bench.vllm_reference_report OUT_DIR NAME...

OUT_DIR holds `vllm bench serve --save-result` files, one per server (`vllm` and each pdserve
variant NAME), request rate (2, inf) and round: `SERVER-rRATE.json` from a sequential hold (one
server up at a time, one round) or `SERVER-rRATE-kK.json` from an alternating hold (ROUNDS=N:
all servers up, each round runs the client against every server). A ratio is always taken
within one round, variant over vLLM, and the report gives the median of those paired ratios:
on a VM whose speed drifts by a tenth over minutes, a ratio of runs from the same few minutes
is what can be compared, where one from two ends of a hold is not. Prints a table of the
per-server medians, each variant's ratios (median, then per round), then one JSON line.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

RATES = ("2", "inf")
KEYS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
_NAME = re.compile(r"^(?P<server>[A-Za-z0-9_.-]+?)-r(?P<rate>2|inf)(?:-k(?P<round>\d+))?\.json$")


def collect(out: Path, servers: list[str]) -> dict[tuple[str, str], dict[int, dict]]:
    """{(server, rate): {round: {key: value}}} for every result file of `servers` in `out`;
    ValueError when a server lacks a rate, a file lacks a key, or the servers' rounds differ
    (a ratio needs both sides of every round)."""
    found: dict[tuple[str, str], dict[int, dict]] = {(s, r): {} for s in servers for r in RATES}
    for path in sorted(out.glob("*.json")):
        m = _NAME.match(path.name)
        if not m or (m["server"], m["rate"]) not in found:
            continue
        data = json.loads(path.read_text())
        missing = [k for k in KEYS if k not in data]
        if missing:
            raise ValueError(f"{path}: no {', '.join(missing)} (did the client run fail?)")
        found[(m["server"], m["rate"])][int(m["round"] or 0)] = {k: float(data[k]) for k in KEYS}
    rounds = {key: sorted(v) for key, v in found.items()}
    for key, r in rounds.items():
        if not r:
            raise ValueError(f"no result for {key[0]} at rate {key[1]} in {out}")
        if r != rounds[(servers[0], key[1])]:
            raise ValueError(f"{key[0]} ran rounds {r} at rate {key[1]}, {servers[0]} "
                             f"{rounds[(servers[0], key[1])]}")
    return found


def summarize(out: Path, names: list[str]) -> dict:
    """Per-server medians over rounds and, per variant and rate, the median of its within-round
    ratios to vLLM (throughput and ITL p50) beside each round's."""
    res = collect(out, ["vllm", *names])
    runs = {f"{s}-r{r}": {k: round(statistics.median(v[k] for v in res[(s, r)].values()), 2)
                          for k in KEYS} for (s, r) in res}
    over = {}
    for n in names:
        over[n] = {}
        for r in RATES:
            base, var = res[("vllm", r)], res[(n, r)]
            tp = [var[k]["output_throughput"] / base[k]["output_throughput"] for k in sorted(base)]
            itl = [var[k]["median_itl_ms"] / base[k]["median_itl_ms"] for k in sorted(base)]
            over[n][r] = {"throughput": round(statistics.median(tp), 3),
                          "itl_p50": round(statistics.median(itl), 3),
                          "throughput_rounds": [round(x, 3) for x in tp],
                          "itl_p50_rounds": [round(x, 3) for x in itl]}
    return {"bench": "vllm_reference", "rounds": len(res[("vllm", RATES[0])]), "runs": runs,
            "over_vllm": over}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    from pdserve.bench.offline import cpu_name  # torch-free at import

    s = summarize(Path(argv[0]), argv[1:])
    width = max(14, *(len(n) + 6 for n in argv[1:]))
    print(f"{'run (median)':<{width}}" + "".join(f"{k:>19}" for k in KEYS))
    for name, r in s["runs"].items():
        print(f"{name:<{width}}" + "".join(f"{r[k]:>19}" for k in KEYS))
    for n, by_rate in s["over_vllm"].items():
        for r, v in by_rate.items():
            print(f"{n} / vLLM at rate {r}: throughput {v['throughput']} "
                  f"(rounds {v['throughput_rounds']}), ITL p50 {v['itl_p50']} "
                  f"(rounds {v['itl_p50_rounds']})")
    print(json.dumps({**s, "cpu": cpu_name(), "variants": argv[1:]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
