"""`--dtype bfloat16|float16` (weights and activations) against transformers run in the same
dtype on the same weights (the seeded tiny model), greedy, under the near-tie rule of
tests/e2e/test_smollm2_vs_hf.py, its threshold widened to the dtype's resolution: a divergence
is accepted only between transformers' top two tokens whose log-probabilities are less than
max(NEAR_TIE, 2 units in the last place of the dtype at the step's largest logit) apart (bf16
logits near 16 are spaced 0.125 apart: two tokens closer than that are a tie in bf16); the
prompt's comparison stops there."""

import pytest
import torch

from pdserve.bench.hf_peer import hf_model_from_loaded
from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.common.engine.llm import LLM
from pdserve.common.models.registry import load_model
from pdserve.common.sampling_params import SamplingParams
from tests.e2e.test_smollm2_vs_hf import NEAR_TIE

pytest.importorskip("transformers")
MAX_TOKENS = 16
PROMPTS = [[3, 17, 42, 99, 5], list(range(30, 70)), [7] * 20]  # the long one is chunked


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_dtype_matches_transformers_in_that_dtype(tiny, dtype):
    name = str(dtype).removeprefix("torch.")
    llm = LLM(EngineConfig(model="tiny", dtype=name, num_threads=1,
                           cache=CacheConfig(num_blocks=64),
                           scheduler=SchedulerConfig(max_num_batched_tokens=16)), loaded=tiny)
    model = llm.engine.model
    assert next(model.parameters()).dtype == dtype and llm.engine.kv_dtype == dtype
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    ours = llm.generate(PROMPTS, params)
    hf = hf_model_from_loaded(tiny).to(dtype)
    refs = []
    with torch.inference_mode():
        for ids in PROMPTS:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0, output_scores=True,
                              return_dict_in_generate=True)
            refs.append((out.sequences[0, len(ids):].tolist(), [s[0].float() for s in out.scores]))
    for out, ref in zip(ours, refs):
        _assert_matches_near_tie(out, *ref, torch.finfo(dtype).eps)
    # the comparison is not vacuous: the fp32 engine's first tokens agree too
    assert all(o.token_ids[0] == r[0][0] for o, r in zip(ours, refs))


def test_cpu_default_is_fp32_and_cuda_default_bf16():
    from pdserve.common.models.dtype import resolve_dtype
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float64")


def _assert_matches_near_tie(out, ref_toks, ref_logits, eps):
    for j, (a, b) in enumerate(zip(out.token_ids, ref_toks)):
        if a == b:
            continue
        lps = ref_logits[j].log_softmax(-1)
        tie = max(NEAR_TIE, 2 * eps * ref_logits[j].abs().max().item())
        gap = abs(lps[a].item() - lps[b].item())
        assert a in lps.topk(2).indices.tolist() and b in [t for t, _ in out.logprobs[j].top] \
            and gap < tie, f"diverged at {j}: ours {a} vs transformers {b} (gap {gap:.4f})"
        return
    assert out.token_ids == ref_toks
