"""Llama-family decoder (Llama, SmolLM, Mistral-like; Qwen2 through `qkv_bias`).

The forward takes a flat batch of T tokens from many requests (prefill chunks and decode tokens
packed together) with their positions; attention reads and writes the paged KV cache through
an `AttentionBackend`. Weights load by Hugging Face names (`load_weights`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from pdserve.common.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.common.config import ModelConfig
from pdserve.common.distributed.layout import (SINGLE, WHOLE_MODEL, PipelineStage,
                                              TensorParallel, check_pp_split, check_tp_split,
                                              kv_head_range)
from pdserve.common.models.linear import (MergedColumnParallelLinear, PackedLoading,
                                          QKVParallelLinear, RowParallelLinear, even_shard)
from pdserve.common.models.packed_layer import DecodeStep, PackedLayer, PackedLinear
from pdserve.common.models.packed_stack import PackedStack
from pdserve.common.models.quant.cpu_native import load_packed_kernels
from pdserve.common.models.quant.embedding import PackedEmbedding
from pdserve.common.models.quant.gemm import large_m
from pdserve.common.models.quant.packed import PackedWeight
from pdserve.common.models.rope import RotaryEmbedding
from pdserve.common.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.native = None  # the native CPU kernels' module, once use_cpu_kernels() set it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dim() == 2:  # [T, hidden] fp32 on the CPU
            return self.native.rms_norm(x, self.weight, self.eps)
        return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)


def query_features(cfg: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """(start, length) of rank `rank` of `size`'s query features: its KV heads' groups (the
    input features of its part of o_proj)."""
    first, count = kv_head_range(cfg.num_kv_heads, rank, size)
    width = cfg.num_heads // cfg.num_kv_heads * cfg.head_dim
    return first * width, count * width


class Attention(nn.Module):
    """This rank's heads only: its KV heads (layout.kv_head_range) and their query heads."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rope: RotaryEmbedding,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        first, count = kv_head_range(cfg.num_kv_heads, tp.rank, tp.size)
        group, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = count * group, count, d
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.qkv_bias, tp_rank=tp.rank, tp_size=tp.size,
                                          kv_heads=(first, count))
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, tp_rank=tp.rank,
                                        tp_size=tp.size, comm=tp.comm,
                                        in_shard=query_features(cfg, tp.rank, tp.size))
        self.backend, self.rope = backend, rope
        self.scale = cfg.head_dim ** -0.5
        self._comm = tp.comm if tp.size > 1 else None

    def forward(self, cos_sin, x, kv_cache, meta: AttentionMetadata, residual,
                keep: Optional[torch.Tensor] = None):
        """x [T, hidden] (normed) -> residual + attention output [T, hidden]; with `keep` [N]
        (row indices), every row's K/V is still written but only rows `keep` are projected
        and returned: [N, hidden]."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (h + 2 kvh) d]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        fused = self.backend.fused_forward(qkv, *cos_sin, kv_cache, meta, self.scale,
                                           self.num_heads)
        if fused is not None:  # rotary, KV write and attention in one call
            return self._project(fused.view(t, q_size), residual, keep)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rope(cos_sin, q, k)
        self.backend.write_kv(k, v, kv_cache, meta.slot_mapping)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, h, d]
        return self._project(out.reshape(t, q_size), residual, keep)

    def _project(self, out, residual, keep):
        """out [T, h d], residual [T, hidden] -> rows `keep` (all when None) of the output
        projection plus residual. No rows: nothing to project, but the tensor ranks still meet
        at a barrier (every rank holds the same `keep`, so all join it). The output
        projection's all-reduce is otherwise the one collective after a layer's K/V write,
        and rank 0's KV connector reads every rank's shared cache of the layer once the
        layer returns (`layer_done`): without it, a last layer that sampled nothing let rank
        0 save a block before a slower rank had written its heads of it."""
        if keep is not None:
            out, residual = out[keep], residual[keep]
            if keep.numel() == 0:
                if self._comm is not None:
                    self._comm.barrier()
                return residual
        return self.o_proj(out, residual)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size,
                                                       [cfg.intermediate_size] * 2,
                                                       tp_rank=tp.rank, tp_size=tp.size)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                           tp_rank=tp.rank, tp_size=tp.size, comm=tp.comm)

    def forward(self, x, residual):
        """x [T, hidden] (normed) -> residual + MLP output [T, hidden]."""
        return self.down_proj(self.gate_up_proj.silu_and_mul(x), residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, backend, rope, tp: TensorParallel = SINGLE):
        super().__init__()
        self.self_attn = Attention(cfg, backend, rope, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, cos_sin, x, kv_cache, meta, keep: Optional[torch.Tensor] = None):
        """x [T, hidden] -> [T, hidden], or rows `keep` only ([N, hidden]; K/V of all T)."""
        h = self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, meta, residual=x,
                           keep=keep)
        if h.shape[0] == 0:
            return h
        return self.mlp(self.post_attention_layernorm(h), residual=h)

    def as_native_layer(self) -> Optional[PackedLayer]:
        """This layer as native calls (packed_layer.py) when all four linears kept their GGUF
        blocks (one rank: tp_size 1 keeps them packed), each in one type but qkv, which may
        be two (its tail: a Q4_K_M file's v), and the norms are fp32; else None."""
        attn, mlp = self.self_attn, self.mlp
        qkv = attn.qkv_proj.packed_parts
        linears = (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if (len(qkv) not in (1, 2) or any(m.packed_weight is None for m in linears)
                or self.input_layernorm.weight.dtype != torch.float32
                or attn.qkv_proj.tp_size > 1):  # the native calls do not all-reduce
            return None
        bias, n = attn.qkv_proj.bias, qkv[0].out_features
        head = PackedLinear.of(qkv[0], None if bias is None else bias[:n])
        tail = (PackedLinear.of(qkv[1], None if bias is None else bias[n:])
                if len(qkv) == 2 else None)
        pl = [PackedLinear.of(m.packed_weight, m.bias) for m in linears]
        return PackedLayer(self.input_layernorm.weight, self.post_attention_layernorm.weight,
                           self.input_layernorm.eps, head, *pl, num_heads=attn.num_heads,
                           q_size=attn.num_heads * attn.head_dim, scale=attn.scale,
                           qkv_tail=tail)


def tp_keeps_packed(cfg: ModelConfig, name: str, w: PackedWeight, tp_size: int) -> bool:
    """Whether every rank of tp_size keeps its part of checkpoint weight `name` packed (the
    KV plan's estimate, before any rank builds its shard): always but for a row-parallel
    linear (o, down) whose input split falls inside a block on some rank (`keeps_packed`)."""
    if name.endswith("o_proj.weight"):
        splits = [query_features(cfg, r, tp_size) for r in range(tp_size)]
    elif name.endswith("down_proj.weight"):
        splits = [even_shard(w.in_features, r, tp_size, "in_features") for r in range(tp_size)]
    else:
        return True
    return all(w.splits_at(start, n) for start, n in splits)


# HF parameter name fragment -> (our fused parameter, shard id)
_STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"),
            ("v_proj", "qkv_proj", "v"), ("gate_proj", "gate_up_proj", 0),
            ("up_proj", "gate_up_proj", 1))


class LlamaForCausalLM(nn.Module):
    """With `tp` of size T this is one rank's shard (see common/distributed/layout.py); every
    rank runs the same forward, and the row-parallel layers and the embedding all-reduce.
    With `pp` a pipeline stage: only its layers (the others are empty placeholders, so
    parameter names keep their checkpoint indices), the embedding on the first stage, the final
    norm and the LM head on the last."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 tp: TensorParallel = SINGLE, pp: PipelineStage = WHOLE_MODEL):
        super().__init__()
        check_tp_split(cfg, tp.size)
        check_pp_split(cfg.num_layers, pp.size)
        self.config, self.tp, self.pp = cfg, tp, pp
        self.layer_range = pp.layers(cfg.num_layers)
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                               cfg.rope_scaling)
        self.rope = rope
        if pp.is_first:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, rope, tp)
                                    if i in self.layer_range else nn.Identity()
                                    for i in range(cfg.num_layers))
        if pp.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
            if cfg.tie_word_embeddings and pp.is_first:
                self.lm_head.weight = self.embed_tokens.weight
        # a later stage of a tied model reads the embedding's weight as its LM head
        self._head_from_embedding = cfg.tie_word_embeddings and pp.is_last and not pp.is_first
        # use_cpu_kernels: this stage's layers as native calls (packed_layer.py), their kernels
        self._packed_layers: Optional[list[PackedLayer]] = None
        self._packed_gemm = None
        self._rms_norm = None
        self._packed_stack: Optional[PackedStack] = None  # the same layers in one call

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                layer_done: Optional[Callable[[int, torch.Tensor], None]] = None,
                hidden_in: Optional[torch.Tensor] = None,
                keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] after this stage's layers
        (normed on the last stage). `hidden_in` [T, hidden]: the previous stage's output (every
        stage but the first). `kv_caches`: this stage's layers' caches, in layer order.
        `layer_done(i, kv_cache)` runs after layer i wrote its K/V (the KV connector), on
        every tensor rank's part too: each layer ends with a collective after its K/V write.
        `keep` [N] (last stage only): the rows the caller reads (the sampled tokens); the result
        is then those rows, [N, hidden]. No layer after the model's last reads its output, so
        that layer writes every row's K/V but runs its output projection and MLP for `keep`
        only: a prompt chunk of C tokens costs the last layer ~1/C of those GEMMs."""
        if keep is not None and not self.pp.is_last:
            raise ValueError("keep selects the sampled rows: the last pipeline stage only")
        if self.pp.is_first:  # packed embedding rows come as fp32: the layers' dtype
            dtype = self.layers[self.layer_range.start].input_layernorm.weight.dtype
            x = self.embed_tokens(input_ids).to(dtype)
        else:
            x = hidden_in
        cos_sin = self.rope.cos_sin(positions)
        attend = self._packed_attend(x, kv_caches, meta, cos_sin)
        # a few decodes: each packed layer in one native call (packed_layer.py)
        step = None if attend is None else DecodeStep.of(
            meta.num_tokens, meta.num_decodes, meta.num_reqs, self._packed_gemm.fused_rows,
            cos_sin, meta.slot_mapping, meta.block_tables, meta.seq_lens)
        if step is not None and layer_done is None and self._packed_stack is not None:
            # no hook between layers: every layer in one native call (packed_stack.py)
            x = self._packed_stack.forward(self._packed_gemm, x, kv_caches, step)
            return self._final(x, keep)
        last = self.layer_range.stop - 1
        for i, kv_cache in zip(self.layer_range, kv_caches):
            # the last layer computes rows `keep` only (the one-call decode layer: every row)
            prune = i == last and keep is not None and step is None
            if attend is not None:  # the same kernels as the modules, called directly
                x = self._packed_layers[i - self.layer_range.start].forward(
                    self._packed_gemm, self._rms_norm, attend, x, kv_cache, step,
                    keep=keep if prune else None)
            else:
                x = self.layers[i](cos_sin, x, kv_cache, meta, keep=keep if prune else None)
            if prune:
                keep = None  # the layer returned those rows only
            if layer_done is not None:
                layer_done(i, kv_cache)
        return self._final(x, keep)

    def _final(self, x: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
        """The stage's output: rows `keep` of x (all when None), normed on the last stage."""
        if keep is not None:
            x = x[keep]
        if not self.pp.is_last or x.shape[0] == 0:
            return x
        return self.norm(x)

    def _packed_attend(self, x, kv_caches, meta, cos_sin):
        """The attention step of the packed-layer path (packed_layer.py) when this step takes
        it, else None: every layer packed, fp32 CPU activations, and fewer rows than the packed
        kernel's switch point (from there on the modules expand + oneDNN), fused attention."""
        if (self._packed_layers is None or x.dtype != torch.float32 or x.device.type != "cpu"
                or x.shape[0] >= large_m(self._packed_gemm.simd) or not kv_caches):
            return None
        return self.layers[self.layer_range.start].self_attn.backend.fused_step(
            meta, kv_caches[0], *cos_sin)

    def use_cpu_kernels(self, native) -> None:
        """Run the RMSNorms through the native CPU kernels (common/attention/cpu_native.py):
        one pass per row instead of torch's five ops. For an fp32 model on the CPU only.
        Where every layer of this stage is packed and the packed kernels built, small steps
        run each layer as native calls (DecoderLayer.as_native_layer)."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.native = native
        gemm = load_packed_kernels()
        layers = [self.layers[i].as_native_layer() for i in self.layer_range]
        if gemm is not None and layers and all(p is not None for p in layers):
            self._packed_layers, self._packed_gemm = layers, gemm
            self._packed_stack = PackedStack.of(layers)
            self._rms_norm = native.rms_norm

    def _apply(self, fn, recurse=True):
        """`.to(device)` moves each packed weight in its module; a tied head would then hold
        its own copy of the embedding's blocks, so it is tied again to the moved ones."""
        tied = (self.pp.is_first and self.pp.is_last
                and isinstance(self.embed_tokens, PackedEmbedding)
                and self.lm_head.packed_weight is self.embed_tokens.packed_weight)
        super()._apply(fn, recurse)
        if tied:
            self.lm_head.packed_parts = (self.embed_tokens.packed_weight,)
        return self

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """hidden [N, hidden] -> logits [N, vocab] (fp32) on rank 0; None on other ranks."""
        return self.lm_head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> None:
        """Load Hugging Face named weights; every parameter must be covered exactly once.
        `PackedWeight`s (GGUF blocks) stay packed in the linears and the embedding."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self._stage_name(hf_name.removeprefix("model."))
            if name is None:
                continue  # another pipeline stage's (or the tied head's copy)
            name, shard = _fused_name(name)
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r}")
            param = params[name]
            module = self.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(tensor, PackedWeight):
                if self._load_packed(name, module, tensor, shard):
                    loaded.update([name if shard is None else f"{name}:{shard}"]
                                  + (["lm_head.weight"] if name == "embed_tokens.weight"
                                     and self.config.tie_word_embeddings
                                     and self.pp.is_last else []))
                    continue
                tensor = tensor.dequantize()
            loader = getattr(module, "weight_loader", None)
            tensor = tensor.to(param.dtype)
            if loader is not None:
                loader(param, tensor, shard)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add(name if shard is None else f"{name}:{shard}")
        self._check_complete(loaded)
        for m in self.modules():
            if isinstance(m, PackedLoading):
                m.finish_loading()

    def _stage_name(self, name: str) -> Optional[str]:
        """Our parameter name for checkpoint name `name`; None when this stage does not hold
        it (another stage's layer, the embedding or head elsewhere, a tied head's copy)."""
        if name.startswith("layers."):
            return name if int(name.split(".", 2)[1]) in self.layer_range else None
        if name == "lm_head.weight":
            return None if self.config.tie_word_embeddings or not self.pp.is_last else name
        if name == "embed_tokens.weight":
            if self._head_from_embedding:
                return "lm_head.weight"
            return name if self.pp.is_first else None
        if name == "norm.weight" and not self.pp.is_last:
            return None
        return name

    def _load_packed(self, name: str, module: nn.Module, w: PackedWeight, shard) -> bool:
        """Keep `w` packed where a module can use it; False: load it as fp32 instead. Tensor
        parallel ranks keep their part packed: their vocabulary rows of the embedding and LM
        head, their rows or blocks of the linears where a split falls on whole blocks
        (`keeps_packed`)."""
        if name == "embed_tokens.weight":
            if w.in_features != self.embed_tokens.weight.shape[1] or (
                    w.out_features != self.config.vocab_size):
                raise ValueError(f"weight {name!r} has shape {w.shape}, expected "
                                 f"{(self.config.vocab_size, self.embed_tokens.weight.shape[1])}")
            embed = self.embed_tokens  # the fp32 placeholder knows this rank's rows
            part = w if self.tp.size == 1 else w.padded_rows(embed.start, embed.shard)
            self.embed_tokens = PackedEmbedding(part, self.tp, embed.start)
            if self.config.tie_word_embeddings and self.pp.is_last:  # the head: same blocks
                self.lm_head.load_rank_part(part)
            return True
        if isinstance(module, PackedLoading) and module.keeps_packed(w):
            module.load_packed(w, shard)
            return True
        return False

    def _check_complete(self, loaded: set[str]) -> None:
        expected = set()
        for name, _ in self.named_parameters():
            stacked = [s for frag, fused, s in _STACKED if f".{fused}." in f".{name}"]
            if name.endswith(".bias") and "qkv_proj" in name:
                stacked = ["q", "k", "v"]
            expected.update(f"{name}:{s}" for s in stacked) if stacked else expected.add(name)
        missing = expected - loaded
        if missing:
            raise ValueError(f"missing weights: {sorted(missing)[:5]} ({len(missing)} in all)")


def _fused_name(name: str):
    for frag, fused, shard in _STACKED:
        if f".{frag}." in name:
            return name.replace(f".{frag}.", f".{fused}."), shard
    return name, None
