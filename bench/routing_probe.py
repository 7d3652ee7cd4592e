"""What a running `pdserve up` stack says about its routing: the router's calls per instance and
the engines' prefix-cache counters, read before and after a measured run.

The engines' /metrics ports are on their command lines (`up` gives each `--metrics-port`); the
launcher's services.json names their pids. Linux only (/proc); elsewhere the engine counters
read as zero and the hit share as unknown.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import httpx

_ENGINE_PREFIXES = ("unified", "decode", "prefill")


@dataclass(frozen=True)
class ProbeReading:
    routed: dict[str, int] = field(default_factory=dict)  # instance -> decode calls routed
    hit_tokens: float = 0.0  # prompt tokens found in the engines' prefix caches
    query_tokens: float = 0.0  # prompt tokens looked up there


def metrics_port(cmdline: list[str]) -> int:
    """The value of `--metrics-port` in an argv; 0 when absent."""
    for i, word in enumerate(cmdline[:-1]):
        if word == "--metrics-port":
            return int(cmdline[i + 1])
    return 0


def engine_metric_ports(services_file: Path) -> list[int]:
    pids = json.loads(services_file.read_text())
    ports = []
    for name, pid in sorted(pids.items()):
        if not name.startswith(_ENGINE_PREFIXES):
            continue
        try:
            argv = Path(f"/proc/{int(pid)}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        port = metrics_port([w.decode(errors="replace") for w in argv])
        if port:
            ports.append(port)
    return ports


_SAMPLE = re.compile(r'^pdserve_router_routed_total\{([^}]*)\}\s+([0-9.e+]+)', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def routed_counts(metrics_text: str) -> dict[str, int]:
    """instance -> decode calls routed there, from the router's /metrics."""
    out = {}
    for labels, value in _SAMPLE.findall(metrics_text):
        named = dict(_LABEL.findall(labels))
        if named.get("kind") == "decode" and "instance" in named:
            out[named["instance"]] = int(float(value))
    return out


def _counter(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})?\s+([0-9.e+]+)", text, re.M)
    return float(m.group(1)) if m else 0.0


def prefix_hits(engine_metrics: list[str]) -> tuple[float, float]:
    """(prefix-cache hit tokens, query tokens) summed over the engines' /metrics texts."""
    return (sum(_counter(t, "vllm:prefix_cache_hits") for t in engine_metrics),
            sum(_counter(t, "vllm:prefix_cache_queries") for t in engine_metrics))


class StackProbe:
    def __init__(self, router_url: str, services_file: Path, timeout_s: float = 10.0):
        self._router = router_url.rstrip("/")
        self._services = services_file
        self._timeout = timeout_s

    def read(self) -> ProbeReading:
        with httpx.Client(timeout=self._timeout) as http:
            routed = routed_counts(http.get(f"{self._router}/metrics").text)
            texts = [http.get(f"http://127.0.0.1:{p}/metrics").text
                     for p in engine_metric_ports(self._services)]
        hits, queries = prefix_hits(texts)
        return ProbeReading(routed, hits, queries)
