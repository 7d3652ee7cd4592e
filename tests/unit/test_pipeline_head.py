"""The LM head split between the last pipeline stage and rank 0 (pipeline_head.py): which
engines split; rank 0's rows joined with the last stage's rows give the whole head's logits
(fp32 and packed GGUF weights, tied and untied heads); a PP=2 engine splits and its sampled
logits (and greedy tokens) equal a PP=1 engine's."""

import dataclasses

import pytest
import torch

from pdserve.common.config import EngineConfig, ParallelConfig
from pdserve.common.distributed.pipeline_head import (LastStageHead, Rank0Head, head_cut,
                                                      last_stage_inputs)
from pdserve.common.models.quant.packed import PackedWeight, QType
from pdserve.common.models.registry import load_model
from pdserve.common.models.vocab_parallel import ParallelLMHead

from pdserve.common.engine.llm import LLM

from tests.unit.test_pipeline_parallel import engine_config, hf_model
from tests.unit.test_tensor_parallel import GREEDY, PROMPTS, hf_greedy


def config(tp=1, pp=2, dtype="auto"):
    return EngineConfig(model="tiny", num_threads=1, dtype=dtype,
                        parallel=ParallelConfig(tensor_parallel_size=tp,
                                                pipeline_parallel_size=pp))


def test_only_cpu_fp32_pipelines_without_tensor_parallel_split():
    model = load_model("tiny").config
    cut = head_cut(config(), model, "cpu")
    assert 0 < cut < model.vocab_size and cut % 64 == 0
    assert head_cut(config(pp=1), model, "cpu") == 0
    assert head_cut(config(tp=2), model, "cpu") == 0
    assert head_cut(config(dtype="bfloat16"), model, "cpu") == 0
    assert head_cut(config(), model, "cuda") == 0


def _full_head(model, weight):
    head = ParallelLMHead(model.hidden_size, model.vocab_size)
    if isinstance(weight, PackedWeight):
        head.load_packed(weight)
        head.finish_loading()
    else:
        head.weight_loader(head.weight, weight)
    return head.eval()


def _q8_0(weight: torch.Tensor) -> PackedWeight:
    """weight [V, H] as Q8_0 blocks (fp16 scale + 32 int8), for a packed head."""
    v, h = weight.shape
    blocks = weight.reshape(v, h // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-8).half()
    q = (blocks / d.float()).round().clamp(-127, 127).to(torch.int8)
    data = torch.cat([d.view(torch.uint8).reshape(v, h // 32, 2),
                      q.view(torch.uint8)], dim=-1).reshape(v, -1).contiguous()
    return PackedWeight(QType.Q8_0, data, h)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_rank0_rows_joined_with_the_last_stages_equal_the_whole_head(packed, tied):
    model = dataclasses.replace(load_model("tiny").config, tie_word_embeddings=tied)
    torch.manual_seed(0)
    full = torch.randn(model.vocab_size, model.hidden_size)
    weight = _q8_0(full) if packed else full
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    weights = {name: weight, "model.norm.weight": torch.ones(model.hidden_size)}
    cfg = config()
    cut = head_cut(cfg, model, "cpu")
    stage_model, stage_weights = last_stage_inputs(model, weights, cut)
    assert stage_model.vocab_size == model.vocab_size - cut
    assert tuple(stage_weights[name].shape) == (model.vocab_size - cut, model.hidden_size)
    assert weights[name] is weight  # the caller's weights are left whole
    hidden = torch.randn(5, model.hidden_size)
    with torch.inference_mode():
        theirs = _full_head(stage_model, stage_weights[name])(hidden)
        received = torch.cat([theirs, hidden], dim=1)
        head = Rank0Head(cfg, model, weights, cut, "cpu")
        assert head.received_width == received.shape[1]
        joined = head.join(received)
        want = _full_head(model, weight)(hidden)
    assert joined.shape == (5, model.vocab_size)
    torch.testing.assert_close(joined, want, rtol=1e-5, atol=1e-5)
    assert head.join(received[:0]).shape == (0, model.vocab_size)


class _Stage(torch.nn.Module):
    pp = "stage"

    def forward(self, x):
        return x + 1

    def compute_logits(self, hidden):
        return hidden * 2


def test_the_last_stage_sends_its_logits_then_the_hidden_rows():
    stage = LastStageHead(_Stage())
    hidden = torch.arange(6.0).view(2, 3)
    assert stage.pp == "stage"
    assert torch.equal(stage(hidden), hidden + 1)
    assert torch.equal(stage.compute_logits(hidden), torch.cat([hidden * 2, hidden], dim=1))


def test_a_pp2_engine_splits_its_head_and_its_greedy_tokens_equal_transformers(tmp_path):
    hf, loaded = hf_model("gqa", tmp_path)
    llm = LLM(engine_config(1, 2), loaded=loaded)
    try:
        head = llm.engine.executor.head
        assert head is not None and head.cut == head_cut(llm.engine.config, loaded.config,
                                                         "cpu")
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.close()
    assert got == hf_greedy(hf, PROMPTS)
