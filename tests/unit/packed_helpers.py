"""Shared by the packed-weight tests: gguf-py-quantized random weights, the fp64 reference and a
tiny two-layer llama GGUF writer."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pdserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.common.engine.llm import LLM
from pdserve.common.models.gguf_loader import load_gguf
from pdserve.common.models.quant import gemm
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.packed import PackedWeight, QType
from pdserve.common.models.registry import LoadedModel, model_fingerprint
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.tests.unit.kquant_helpers import make_kquant_weight


def _switch_m() -> int:
    native = load_packed_kernels()
    return gemm.large_m(native.simd) if native is not None else max(gemm.LARGE_M.values())


LARGE_M = _switch_m()  # this build's switch from the packed kernel to expand + GEMM


def blocked_m() -> int | None:
    """This build's switch to the expansion into oneDNN's layout (None: never), read when
    called: a test may lower it to what its engine's step budget reaches."""
    native = load_packed_kernels()
    return gemm.BLOCKED_M[native.simd] if native is not None else None


# types gguf-py reads but cannot write: their test weights are random valid blocks
UNQUANTIZABLE = (QType.IQ4_NL, QType.IQ4_XS)


def make_weight(qtype: QType, n: int, k: int, seed: int = 0) -> tuple[PackedWeight, torch.Tensor]:
    """A random weight quantized by gguf-py (random blocks for UNQUANTIZABLE types); returns it
    packed and as gguf-py dequantizes it."""
    if qtype in UNQUANTIZABLE:
        return make_kquant_weight(qtype, n, k, seed)
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    packed = quantize(values, GGMLQuantizationType(int(qtype)))  # [n, k / 32 * block_bytes] uint8
    ref = dequantize(packed, GGMLQuantizationType(int(qtype))).astype(np.float32)
    return PackedWeight.from_numpy(qtype, packed, k), torch.from_numpy(ref.copy())


def weights_read_one_hot(native, w: PackedWeight, m: int) -> torch.Tensor:
    """The [N, K] weights the native GEMM multiplies by, read back m columns per call: one-hot
    activation rows make each output one weight times 1 plus zeros, so exactly that weight
    (+0 for -0), whichever path the build takes at m rows."""
    n, k = w.data.shape[0], w.in_features
    got = torch.empty(n, k)
    for k0 in range(0, k, m):
        cols = torch.arange(k0, min(k0 + m, k))
        x = torch.zeros(len(cols), k)
        x[torch.arange(len(cols)), cols] = 1.0
        got[:, cols] = native.packed_gemm(x, w.data, int(w.qtype)).T
    return got


def reference(x, w_fp32, bias=None, residual=None):
    y = x.double() @ w_fp32.double().T
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y.float()


def tol(k: int) -> dict:
    return dict(atol=2e-5 * k ** 0.5, rtol=1e-5)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# encode(hf_name, (out, in), heads) -> (the tensor's bytes [out, row_bytes], its GGML type);
# heads: the rows' head count for q/k (llama.cpp permutes those rows), else 0
Encode = Callable[[str, tuple[int, int], int], tuple[np.ndarray, GGMLQuantizationType]]


def write_tiny_llama_gguf(path, dims: tuple[int, int, int, int, int], tied: bool,
                          encode: Encode) -> None:
    """A 2-layer llama GGUF; dims = (hidden, heads, kv_heads, intermediate, vocab); fp32 norms."""
    h, heads, kv_heads, inter, vocab = dims
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for fn, v in (("add_block_count", 2), ("add_context_length", 1024),
                  ("add_embedding_length", h), ("add_feed_forward_length", inter),
                  ("add_head_count", heads), ("add_head_count_kv", kv_heads),
                  ("add_layer_norm_rms_eps", 1e-5), ("add_vocab_size", vocab)):
        getattr(w, fn)(v)

    def add(gguf_name, hf_name, shape, n_heads=0):
        data, qt = encode(hf_name, shape, n_heads)
        w.add_tensor(gguf_name, data, raw_dtype=qt)

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, h))
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, h))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    kv = kv_heads * h // heads
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h),
              "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, h),
              "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    for i in range(2):
        for module, shape in shapes.items():
            n_heads = {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads}.get(module, 0)
            add(f"blk.{i}.{GGUF_NAMES[module]}.weight", f"model.layers.{i}.{module}.weight",
                shape, n_heads)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight",
                         (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def engine(path, packed: bool) -> LLM:
    """An engine over the GGUF at `path`, weights packed or expanded at load."""
    config, weights = load_gguf(path, packed=packed)
    loaded = LoadedModel(config, weights, Tokenizer.tiny(), model_fingerprint(config, weights))
    return LLM(EngineConfig(model="tiny", num_threads=2, cache=CacheConfig(num_blocks=96),
                            scheduler=SchedulerConfig(max_num_batched_tokens=512)), loaded=loaded)


def assert_same_greedy(ours: LLM, ref: LLM, vocab: int) -> None:
    """Equal greedy tokens and logprobs (up to summation order) for a short prompt, one long
    enough to cross this build's quant.gemm.large_m and, where the build has a BLOCKED_M that
    the engine's step budget reaches, one that crosses it (every CPU path runs)."""
    budget = ours.engine.config.scheduler.max_num_batched_tokens
    lengths = [m + 9 for m in (LARGE_M, blocked_m()) if m is not None and m <= budget]
    prompts = [[3, 17, 42, 99, 5]] + [[(7 * i) % (vocab - 1) + 1 for i in range(n)]
                                      for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    for a, b in zip(ours.generate(prompts, params), ref.generate(prompts, params)):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
