"""The printed table of a serve run: one line per tier and one for all requests."""

from __future__ import annotations

from typing import Optional

from pdserve.bench.failures import banner, tally

_COLS = ("tier", "reqs", "ok", "ttft p50", "ttft p99", "itl p50", "itl p99", "tpot p50",
         "tpot p99", "e2e p50", "attain", "goodput")


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1000:.0f}ms"


def _row(name: str, block: dict) -> list[str]:
    t, i, p, e = (block[k] for k in ("ttft_s", "itl_s", "tpot_s", "e2e_s"))
    return [name, str(block["requests"]), str(block["completed"]), _ms(t["p50"]), _ms(t["p99"]),
            _ms(i["p50"]), _ms(i["p99"]), _ms(p["p50"]), _ms(p["p99"]), _ms(e["p50"]),
            f"{block['attainment'] * 100:.1f}%", f"{block['goodput_rps']:.2f}/s"]


def format_table(summary: dict, title: str = "") -> str:
    rows = [list(_COLS)] + [_row(t, b) for t, b in summary["tiers"].items()]
    rows.append(_row("all", summary))
    widths = [max(len(r[c]) for r in rows) for c in range(len(_COLS))]
    loud = banner(tally([summary]))  # failures first: before the title and the figures
    lines = ([loud] if loud else []) + ([title] if title else [])
    lines.append(f"duration {summary['duration_s']:.2f}s  "
                 f"requests {summary['request_throughput']:.2f}/s  "
                 f"output {summary['output_throughput']:.1f} tok/s  "
                 f"total {summary['total_token_throughput']:.1f} tok/s  "
                 f"failed {summary['failed']}")
    for r in rows:
        lines.append("  ".join(c.rjust(w) if k else c.ljust(w)
                               for k, (c, w) in enumerate(zip(r, widths))))
    for msg, n in summary["errors"].items():
        lines.append(f"  error x{n}: {msg[:160]}")
    bd = {t: b["breakdown"] for t, b in summary["tiers"].items() if b["breakdown"]}
    for tier, fields in bd.items():
        parts = "  ".join(f"{k.removesuffix('_s')} {_ms(v['p50'])}" for k, v in fields.items())
        lines.append(f"  breakdown {tier} (p50): {parts}")
    return "\n".join(lines)
