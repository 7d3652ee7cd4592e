"""Packed GGUF weights under tensor parallelism: each rank keeps its rows of the column-parallel
linears, its blocks of the row-parallel ones (a split inside a block takes fp32) and its
vocabulary rows of the embedding and LM head packed (the last shard zero-padded), the memory
plan counts that, and greedy tokens with two ranks equal one rank's, logprobs up to summation
order."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.common.distributed.layout import TensorParallel
from pdserve.common.engine.llm import LLM
from pdserve.common.engine.rank_model import build_rank_model
from pdserve.common.models.gguf_loader import load_gguf
from pdserve.common.models.llama import tp_keeps_packed
from pdserve.common.models.quant.embedding import PackedEmbedding
from pdserve.common.models.quant.footprint import loaded_weights_footprint, weights_footprint
from pdserve.common.models.quant.packed import PackedWeight, QType
from pdserve.common.models.registry import LoadedModel, model_fingerprint
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.tests.unit.test_packed_model import (H, HEADS, INTER, KV_HEADS, VOCAB,
                                                 write_gguf)

PROMPTS = [[3, 17, 42, 99, 5], list(range(30, 70))]


def run(path, tp: int):
    config, weights = load_gguf(path, packed=True)
    loaded = LoadedModel(config, weights, Tokenizer.tiny(), model_fingerprint(config, weights))
    llm = LLM(EngineConfig(model="tiny", num_threads=1, cache=CacheConfig(num_blocks=64),
                           scheduler=SchedulerConfig(max_num_batched_tokens=16),
                           parallel=ParallelConfig(tensor_parallel_size=tp)), loaded=loaded)
    return llm


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tp2_keeps_the_linears_packed_and_decodes_like_tp1(tmp_path, tied):
    write_gguf(tmp_path / "m.gguf", tied, VOCAB + 1)  # rank 1's vocabulary shard pads a row
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    one = run(tmp_path / "m.gguf", 1)
    try:
        ref, ref_fp = one.generate(PROMPTS, params), one.engine.weights_footprint
    finally:
        one.engine.close()
    two = run(tmp_path / "m.gguf", 2)
    try:
        model = two.engine.model  # rank 0's shard
        d = H // HEADS
        layer0, layer1 = model.layers
        # rank 0: 2 of 4 query heads and 1 of 2 KV heads, as rows of each packed shard
        qkv0 = layer0.self_attn.qkv_proj.packed_weight
        assert qkv0.qtype == QType.Q4_0 and qkv0.shape == ((HEADS // 2 + 2) * d, H)
        assert [(p.qtype, p.out_features) for p in layer1.self_attn.qkv_proj.packed_parts] == [
            (QType.Q4_1, (HEADS // 2 + KV_HEADS // 2) * d), (QType.Q8_0, KV_HEADS // 2 * d)]
        assert layer0.mlp.gate_up_proj.packed_weight.shape == (INTER, H)  # half of 2 x INTER
        assert layer0.self_attn.o_proj.packed_weight.shape == (H, H // 2)  # whole blocks
        assert layer0.mlp.down_proj.packed_weight is None  # 48 of 96 inputs: inside a block
        rows = VOCAB // 2 + 1  # the embedding and head: this rank's share of the vocabulary
        assert isinstance(model.embed_tokens, PackedEmbedding)
        assert model.embed_tokens.packed_weight.shape == (rows, H)
        head = model.lm_head.packed_weight
        assert head.shape == (rows, H)
        assert (head is model.embed_tokens.packed_weight) == tied
        fp = two.engine.weights_footprint
        assert ref_fp.resident_bytes < fp.resident_bytes < 0.6 * fp.fp32_bytes
        got = two.generate(PROMPTS, params)
    finally:
        two.engine.close()
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


@pytest.mark.parametrize("qtype", list(QType), ids=lambda q: q.name)
def test_the_last_vocabulary_shard_pads_with_zero_weights(qtype):
    k = qtype.block_size
    w = PackedWeight(qtype, torch.randint(0, 256, (5, qtype.block_bytes), dtype=torch.uint8), k)
    part = w.padded_rows(3, 4)  # rows 3 and 4, then two padding rows
    assert part.shape == (4, k)
    assert torch.equal(part.data[:2], w.data[3:5])
    assert torch.equal(part.dequantize()[2:], torch.zeros(2, k))
    assert part.data.data_ptr() != w.data.data_ptr()  # a copy: the whole weight can be freed
    with pytest.raises(ValueError, match="not a shard"):
        w.padded_rows(0, 0)


class _NoComm:
    """Stands in for the group's communicator where a test only builds ranks' shards."""


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_tp_estimate_counts_what_the_ranks_hold(tmp_path, tied):
    """The KV plan's estimate (before any rank builds) equals what the two ranks' shards hold,
    but for what each rank holds twice (the norms) and the last vocabulary shard's padding."""
    write_gguf(tmp_path / "m.gguf", tied, VOCAB + 1)
    cfg, weights = load_gguf(tmp_path / "m.gguf", packed=True)
    config = EngineConfig(model="tiny", num_threads=1)
    ranks = [build_rank_model(config, cfg, weights, TensorParallel(r, 2, _NoComm()), "cpu")
             for r in range(2)]
    held = sum(weights_footprint(m).resident_bytes for m in ranks)
    estimate = loaded_weights_footprint(weights, lambda n, w: tp_keeps_packed(cfg, n, w, 2))
    norms = sum(p.numel() * 4 for n, p in ranks[1].named_parameters() if "norm" in n)
    row = weights["model.embed_tokens.weight"].data.shape[1]  # bytes of one vocabulary row
    padding = (2 * (VOCAB // 2 + 1) - (VOCAB + 1)) * row * (1 if tied else 2)
    assert held == estimate.resident_bytes + norms + padding
    # o's 64 inputs split on whole blocks; down's 96 do not (fp32 on both ranks)
    assert tp_keeps_packed(cfg, "model.layers.0.self_attn.o_proj.weight",
                           weights["model.layers.0.self_attn.o_proj.weight"], 2)
    assert not tp_keeps_packed(cfg, "model.layers.0.mlp.down_proj.weight",
                               weights["model.layers.0.mlp.down_proj.weight"], 2)
