"""The last layer runs its output projection and MLP for the sampled rows only: the sampled
rows' hidden states and logits equal the full forward's, every row's K/V is written as before,
and the last layer's GEMMs really see only those rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.config import EngineConfig
from pdserve.common.distributed.layout import SINGLE
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.rank_model import allocate_kv_caches, build_rank_model
from pdserve.common.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.common.models.registry import tiny_model

BLOCK = 16


@pytest.fixture(scope="module", params=["torch", "onednn"])
def model(request):
    cfg, weights = tiny_model(seed=3)
    config = EngineConfig(model="tiny", num_threads=1, cpu_gemm=request.param)
    return cfg, build_rank_model(config, cfg, weights, SINGLE, "cpu")


def _step(sample_last_prompt: bool = True) -> SchedulerOutput:
    """A decode, a whole 20-token prompt and the first 12-token chunk of a longer one (not
    sampled: its prompt goes on next step)."""
    return SchedulerOutput((
        ScheduledChunk("dec", (9,), 5, (0,), True),
        ScheduledChunk("whole", tuple(range(40, 60)), 0, (1, 2), sample_last_prompt),
        ScheduledChunk("part", tuple(range(70, 82)), 0, (3,), False)))


def _run(model_pair, out, keep_rows: bool):
    cfg, m = model_pair
    caches = allocate_kv_caches(cfg, (0, 1), 4, BLOCK, "cpu")
    for c in caches:  # the decode's earlier context (positions 0 .. 4)
        c[:, 0, :5].normal_(generator=torch.Generator().manual_seed(1))
    runner = ModelRunner(m, caches, BLOCK)
    ids, pos, meta = runner._prepare(out)
    keep = runner._sampled_rows(out, meta) if keep_rows else None
    with torch.inference_mode():
        hidden = m(ids, pos, caches, meta, keep=keep)
    return hidden, caches, keep


def test_sampled_rows_equal_the_full_forward(model):
    full, caches_full, _ = _run(model, _step(), keep_rows=False)
    part, caches_part, keep = _run(model, _step(), keep_rows=True)
    assert keep.tolist() == [0, 20]  # the decode, the whole prompt's last token
    assert part.shape == (2, full.shape[1])
    torch.testing.assert_close(part, full[keep], rtol=1e-5, atol=1e-5)
    for a, b in zip(caches_full, caches_part):  # every row's K/V, bit for bit
        assert torch.equal(a, b)


def test_the_last_layer_projects_the_sampled_rows_only(model):
    cfg, m = model
    seen = []
    hooks = [m.layers[i].mlp.down_proj.register_forward_hook(
        lambda mod, args, out, i=i: seen.append((i, args[0].shape[0])))
        for i in range(cfg.num_layers)]
    try:
        _run(model, _step(), keep_rows=True)
    finally:
        for h in hooks:
            h.remove()
    assert seen == [(0, 33), (1, 2)]  # 1 + 20 + 12 rows, then the 2 sampled


def test_no_sampled_row_still_writes_every_kv(model):
    full, caches_full, _ = _run(model, _step(sample_last_prompt=False), keep_rows=False)
    part, caches_part, keep = _run(model, _step(sample_last_prompt=False), keep_rows=True)
    assert keep.tolist() == [0] and part.shape == (1, full.shape[1])
    out = SchedulerOutput((ScheduledChunk("part", tuple(range(70, 82)), 0, (3,), False),))
    none, caches_none, keep = _run(model, out, keep_rows=True)
    assert keep.numel() == 0 and none.shape == (0, full.shape[1])
    assert torch.equal(caches_none[-1][:, 3], caches_full[-1][:, 3])  # the chunk's block
    assert torch.equal(caches_none[0][:, 3], caches_full[0][:, 3])


def test_keep_is_refused_before_the_last_pipeline_stage(model):
    from pdserve.common.distributed.layout import pipeline_stage
    from pdserve.common.models.llama import LlamaForCausalLM
    cfg, m = model
    first = LlamaForCausalLM(cfg, m.layers[0].self_attn.backend, pp=pipeline_stage(
        cfg.num_layers, 0, 2))
    with pytest.raises(ValueError, match="last pipeline stage"):
        first(torch.tensor([1]), torch.tensor([0]), [], None, keep=torch.tensor([0]))


class _Recorder:
    """Rank 0 of a 2-rank group whose collectives only record their order (values are not
    summed: this test reads the order, not the numbers)."""

    rank, world_size = 0, 2

    def __init__(self, events: list):
        self.events = events

    def all_reduce(self, t):
        self.events.append("collective")

    def gather_last_dim(self, t):
        self.events.append("collective")
        return torch.cat([t, t], dim=-1)

    def barrier(self):
        self.events.append("collective")

    def abort(self):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("sample", [False, True])
def test_every_layer_meets_the_other_ranks_before_its_kv_hook(sample):
    """Rank 0's KV connector reads every tensor rank's shared cache of layer i in
    layer_done(i); only a collective inside the layer, after its K/V write, tells rank 0 that
    the other ranks wrote theirs. A last layer with no sampled row projects nothing, and once
    joined no collective either: rank 0 then saved blocks a slower rank had not written yet
    (seen under CPU load as wrong tokens after a TP 2 prefill handed off to a decode)."""
    from pdserve.common.distributed.layout import TensorParallel
    cfg, weights = tiny_model(seed=3)
    events = []
    tp = TensorParallel(rank=0, size=2, comm=_Recorder(events))
    m = build_rank_model(EngineConfig(model="tiny", num_threads=1), cfg, weights, tp, "cpu")
    caches = allocate_kv_caches(cfg, (0, 2), 4, BLOCK, "cpu")
    runner = ModelRunner(m, caches, BLOCK)
    out = SchedulerOutput((ScheduledChunk("part", tuple(range(70, 82)), 0, (3,), sample),))
    ids, pos, meta = runner._prepare(out)
    keep = runner._sampled_rows(out, meta)
    assert keep.numel() == int(sample)
    with torch.inference_mode():
        m(ids, pos, caches, meta, lambda i, kv: events.append(("layer_done", i)), keep=keep)
    hooks = [i for i, e in enumerate(events) if e != "collective"]
    assert [events[i] for i in hooks] == [("layer_done", i) for i in range(cfg.num_layers)]
    starts = [-1] + hooks[:-1]
    assert all("collective" in events[a + 1:b] for a, b in zip(starts, hooks)), events
