"""KV memory planning: how many blocks a KV budget buys.

The budget is one of: an explicit block count; KV bytes; a total memory budget for weights and
KV together, of which the KV gets what the model's resident weights leave (so weights kept
packed, docs/packed-weights.md, leave more blocks in the same budget); or a fraction of the
memory still free after the weights were loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)


def available_memory_bytes(device: str = "cpu", cgroup_dir: str = "/sys/fs/cgroup") -> int:
    """Free memory the KV cache may draw from: free HBM on CUDA; on the host, MemAvailable,
    capped by what the container's cgroup (v2) limit still allows, so a pod is not OOM-killed
    for a KV cache sized from the whole host."""
    if str(device).startswith("cuda"):
        import torch
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    host = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024
    if host is None:
        raise RuntimeError("MemAvailable not found in /proc/meminfo")
    room = _cgroup_room(cgroup_dir)
    return host if room is None else min(host, room)


def _cgroup_room(cgroup_dir: str) -> Optional[int]:
    """limit - usage of the cgroup v2 this process is in; None when unlimited or unknown."""
    try:
        with open(f"{cgroup_dir}/memory.max") as f:
            limit = f.read().strip()
        with open(f"{cgroup_dir}/memory.current") as f:
            current = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(int(limit) - current, 0)


@dataclass(frozen=True)
class WeightsFootprint:
    """Bytes the model's weights hold, and what the same weights take as fp32."""

    resident_bytes: int
    fp32_bytes: int

    def __post_init__(self):
        if self.resident_bytes < 0 or self.fp32_bytes < 0:
            raise ValueError(f"weight bytes must be >= 0, got {self}")

    def describe(self) -> str:
        return (f"weights: {self.resident_bytes / 2**20:.1f} MiB resident "
                f"({self.fp32_bytes / 2**20:.1f} MiB as fp32)")


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    budget_bytes: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens, {self.num_blocks * self.bytes_per_block / 2**20:.1f} "
                f"MiB ({self.bytes_per_block} bytes/block)")


def plan_kv_blocks(bytes_per_token: int, block_size: int, *, budget_bytes: Optional[int] = None,
                   fraction: float = 0.2, num_blocks: Optional[int] = None,
                   device: str = "cpu", memory_budget_bytes: Optional[int] = None,
                   weights: Optional[WeightsFootprint] = None) -> KVPlan:
    """Number of blocks from an explicit count, a KV byte budget, a total budget for weights
    plus KV (`memory_budget_bytes` minus `weights.resident_bytes`), or a fraction of free
    memory. Logs the weights' footprint (when given) beside the plan."""
    per_block = bytes_per_token * block_size
    if weights is not None:
        logger.info("%s", weights.describe())
    if num_blocks is None and memory_budget_bytes is not None:
        if budget_bytes is not None:
            raise ValueError("give a KV byte budget or a total memory budget, not both")
        budget_bytes = memory_budget_bytes - (weights.resident_bytes if weights else 0)
    if num_blocks is None:
        if budget_bytes is None:
            budget_bytes = int(available_memory_bytes(device) * fraction)
        num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"KV budget of {budget_bytes} bytes holds no block of {per_block} bytes")
    plan = KVPlan(num_blocks, block_size, per_block, budget_bytes or num_blocks * per_block)
    logger.info("%s", plan.describe())
    return plan
