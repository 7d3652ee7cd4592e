"""PNG plots: TTFT and ITL CDFs per tier; SLO attainment against request rate.

matplotlib's Agg backend draws without a display, so this works on servers and in CI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from pdserve.bench.record import RequestRecord


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: Sequence[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        ax.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], where="post", label=label)


def plot_latency_cdfs(records: Sequence[RequestRecord], path: Path,
                      slo_lines: Mapping[str, tuple] = None, title: str = "") -> Path:
    """Two panels, TTFT and ITL, one CDF per tier; slo_lines: {tier: (ttft_s, itl_s)}."""
    plt = _pyplot()
    fig, (a_ttft, a_itl) = plt.subplots(1, 2, figsize=(11, 4))
    tiers = sorted({r.tier for r in records})
    for tier in tiers:
        ok = [r for r in records if r.tier == tier and r.ok]
        _cdf(a_ttft, [r.ttft_s for r in ok], tier)
        _cdf(a_itl, [g for r in ok for g in r.itl_s], tier)
    for tier, (ttft, itl) in (slo_lines or {}).items():
        if ttft:
            a_ttft.axvline(ttft, ls="--", lw=0.8, color="gray")
        if itl:
            a_itl.axvline(itl, ls="--", lw=0.8, color="gray")
    for ax, name in ((a_ttft, "TTFT (s)"), (a_itl, "inter-token latency (s)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no line when every request failed
            ax.legend(loc="lower right")
    fig.suptitle(title or "latency CDFs by tier")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_attainment(curves: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]],
                    path: Path, target: float = 0.9, title: str = "") -> Path:
    """One panel per tier (side by side, "overall" first), one line per stack on it, so the
    stacks compare on the same axis: {stack: {tier: [(rate, attainment), ...]}}."""
    plt = _pyplot()
    layout = attainment_axes(curves)
    n = max(len(layout), 1)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4), squeeze=False, sharey=True)
    for ax, (tier, stacks) in zip(axes[0], layout.items()):
        for stack in stacks:
            pts = sorted(curves[stack][tier])
            ax.plot([p[0] for p in pts], [p[1] * 100 for p in pts], marker="o", label=stack)
        ax.axhline(target * 100, ls="--", lw=0.8, color="gray")
        ax.set_title(tier)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left")
    fig.suptitle(title or "SLO attainment against rate, per tier")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def attainment_axes(curves: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]]
                    ) -> dict[str, list[str]]:
    """What plot_attainment draws: {tier (one axis each): [stacks with a line on it]}."""
    tiers = sorted({t for per in curves.values() for t in per},
                   key=lambda t: (t != "overall", t))
    return {t: [s for s, per in curves.items() if per.get(t)] for t in tiers}
