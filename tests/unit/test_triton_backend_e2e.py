"""The tiny model generates the same greedy tokens with the Triton backend (interpreted on the
CPU) as with the torch backend, and with the native CPU kernels (fused layer step, paged decode
and prefill attention, RMSNorm) as with torch ops alone: prefill without and with a cached
prefix, chunked prefill, mixed decode + prefill steps, and decode steps that cross block
boundaries."""

from __future__ import annotations

import torch

from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.common.engine.llm import LLM
from pdserve.common.sampling_params import SamplingParams


def _prompts():
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(10, 100, (n,), generator=gen).tolist() for n in (1, 5, 16, 37)]
    # the second round extends the first round's prompts: prefix-cache hits, extend attention
    more = [p + torch.randint(10, 100, (9,), generator=gen).tolist() for p in ids[2:]]
    return ids, more


def _generate(backend: str) -> list[list[int]]:
    # a small token budget forces the 37-token prompt through chunked prefill
    llm = LLM(EngineConfig(model="tiny", attention_backend=backend,
                           cache=CacheConfig(num_blocks=64, block_size=16),
                           scheduler=SchedulerConfig(max_num_batched_tokens=24)))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first, second = _prompts()
    return [o.token_ids for o in llm.generate(first, params) + llm.generate(second, params)]


def test_triton_matches_torch_greedy():
    expect = _generate("torch")
    got = _generate("triton")
    assert got == expect
    assert all(len(t) == 8 for t in got)


def test_native_cpu_kernels_match_the_torch_ops(monkeypatch):
    native = _generate("torch")
    monkeypatch.setenv("PDSERVE_NO_NATIVE", "1")  # SDPA, torch rotary, index_copy, RMSNorm ops
    assert _generate("torch") == native
