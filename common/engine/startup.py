"""Engine start-up after the weights are loaded: measure the non-KV peak, then warm up.

The order (docs/served-performance.md, "Start-up"): parse config -> load weights -> a
profiling forward at the largest batch the scheduler may form (`profile_peak_bytes`: every
chunk sampled, `max_num_batched_tokens` tokens over up to `max_num_seqs` sequences) measures
the memory a step takes besides the KV cache -> the KV cache is planned from what is left of
the budget -> `warm_up` runs a few real steps (prefill and decode, greedy and random rows:
native kernels loaded, the runner's buffers sized, the sampler's paths taken) and leaves the
engine as if it had never run a request -> only then does a service report SERVING.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.common.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARMUP_PREFIX = "__warmup-"  # request ids of warm-up requests (never a client's: see _ids)


@dataclass(frozen=True)
class PeakProfile:
    """What the profiling forward measured."""

    activation_bytes: int  # peak host (or device) memory the forward added over its start
    num_tokens: int
    num_seqs: int
    seconds: float

    def describe(self) -> str:
        return (f"profiling forward: {self.num_tokens} tokens in {self.num_seqs} sequences, "
                f"non-KV peak +{self.activation_bytes / 2**20:.1f} MiB over the weights, "
                f"{self.seconds:.2f}s")


def profile_batch(max_tokens: int, max_seqs: int, max_model_len: int,
                  block_size: int) -> SchedulerOutput:
    """The largest step the scheduler may form: `max_tokens` prompt tokens over
    min(max_seqs, max_tokens) sequences (each shorter than `max_model_len`), all sampled,
    on consecutive blocks from block 0."""
    n = max(min(max_seqs, max_tokens), -(-max_tokens // (max_model_len - 1)))
    per, extra = divmod(max_tokens, n)  # the first `extra` sequences get one more token
    chunks, next_block = [], 0
    for i in range(n):
        length = per + (i < extra)
        blocks = -(-length // block_size)
        chunks.append(ScheduledChunk(f"{WARMUP_PREFIX}profile-{i}", (0,) * length, 0,
                                     tuple(range(next_block, next_block + blocks)), True))
        next_block += blocks
    return SchedulerOutput(tuple(chunks))


def profile_peak_bytes(run, batch: SchedulerOutput, device: str) -> PeakProfile:
    """Runs `run(batch)` (a forward into a scratch KV cache) and measures the peak memory it
    added: on CUDA torch's allocator peak; on the host the process's peak RSS (VmHWM, reset
    through /proc/self/clear_refs first) minus its RSS before."""
    t0 = time.perf_counter()
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(batch)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = _rss_bytes()
        reset = _reset_peak_rss()
        run(batch)
        peak = (_peak_rss_bytes() if reset else _rss_bytes()) - base
    return PeakProfile(max(int(peak), 0), batch.num_tokens, len(batch.chunks),
                       time.perf_counter() - t0)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rss_bytes() -> int:
    return _status_kib("VmRSS:") * 1024


def _peak_rss_bytes() -> int:
    return _status_kib("VmHWM:") * 1024


def _reset_peak_rss() -> bool:
    """Sets VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def warmup_requests(vocab_size: int, block_size: int, max_model_len: int):
    """(request_id, prompt, params): one greedy and one random (temperature 1.0) request whose
    prompts fill less than one block (no full block: nothing to publish to a prefix cache or a
    KV store), three output tokens each, fixed seeds (the engine's own seed stream untouched)."""
    length = max(1, min(block_size - 1, max_model_len - 5))
    prompt = [(7 * i + 1) % vocab_size for i in range(length)]
    return [(f"{WARMUP_PREFIX}{i}", prompt,
             SamplingParams(max_tokens=3, temperature=t, seed=i, ignore_eos=True))
            for i, t in enumerate((0.0, 1.0))]

