"""Issue 19's throughput target from one serve_saturation.sh hold: medians and ratios.

    python bench/saturation_peer.py OUT_DIR   (stdlib only: it runs beside any checkout)

OUT_DIR holds, per pass i and temperature T (1.0 / 0.0), the last JSON line of
`pdserve bench serve` (served-tT-i.json), of serve_profile --decode-window beside it
(profile-tT-i.json) and of `pdserve bench offline` (offline-tT-i.json). Prints each cell's
runs and median, served temperature 1.0 over greedy offline (the target: >= 0.95), served 1.0
over served greedy and offline 1.0 over offline greedy (what sampling costs on each path),
the step breakdown's medians per temperature, then one JSON line.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
from pathlib import Path

TEMPS = ("1.0", "0.0")
PROFILE_KEYS = ("engine_step_ms", "forward_ms", "sample_ms", "update_ms", "period_ms",
                "mean_batch", "process_cores", "router_cpu_ms_per_token")


def _lines(out: Path, kind: str, temp: str) -> list[dict]:
    found = []
    for p in sorted(out.glob(f"{kind}-t{temp}-*.json")):
        text = p.read_text().strip()
        if not text.startswith("{"):
            raise ValueError(f"{p}: no JSON line (the run failed?)")
        found.append(json.loads(text))
    return found


def throughput(out: Path, kind: str, temp: str) -> list[float]:
    """Output tok/s of each run of a cell (served: bench serve's, offline: bench offline's);
    ValueError when the cell has no run or a served run lost requests."""
    key = "output_throughput" if kind == "served" else "pdserve_output_tok_s"
    rows = _lines(out, kind, temp)
    if not rows:
        raise ValueError(f"no {kind} run at temperature {temp} in {out}")
    if kind == "served" and any(r.get("failed") for r in rows):
        raise ValueError(f"a served run at temperature {temp} had failed requests")
    return [float(r[key]) for r in rows]


def profile_medians(out: Path, temp: str) -> dict:
    """Median of each breakdown field over the runs whose profile has it ({} when none)."""
    rows = _lines(out, "profile", temp)
    return {k: round(statistics.median(r[k] for r in rows if k in r), 3)
            for k in PROFILE_KEYS if any(k in r for r in rows)}


def summarize(out: Path) -> dict:
    tp = {f"{kind}_t{t}": throughput(out, kind, t) for kind in ("served", "offline")
          for t in TEMPS}
    med = {k: statistics.median(v) for k, v in tp.items()}
    return {"bench": "serve_saturation", "runs": tp,
            "median_tok_s": {k: round(v, 1) for k, v in med.items()},
            "served_t1_over_offline_greedy": round(med["served_t1.0"] / med["offline_t0.0"], 3),
            "served_t1_over_served_greedy": round(med["served_t1.0"] / med["served_t0.0"], 3),
            "offline_t1_over_offline_greedy": round(med["offline_t1.0"] / med["offline_t0.0"],
                                                    3),
            "profile": {f"t{t}": profile_medians(out, t) for t in TEMPS},
            "cpu": next((r["cpu"] for r in _lines(out, "offline", TEMPS[1]) if r.get("cpu")),
                        platform.processor() or platform.machine())}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    s = summarize(Path(argv[0]))
    for k, v in s["runs"].items():
        print(f"{k:<14} {' '.join(f'{x:.1f}' for x in v)}  median {s['median_tok_s'][k]}")
    for k in ("served_t1_over_offline_greedy", "served_t1_over_served_greedy",
              "offline_t1_over_offline_greedy"):
        print(f"{k} {s[k]}")
    for t, p in s["profile"].items():
        print(f"decode window {t}: " + ", ".join(f"{k} {v}" for k, v in p.items()))
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
