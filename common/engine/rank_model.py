"""Building one rank's model and KV cache, the same way in the engine process (rank 0) and in
a tensor- or pipeline-parallel worker."""

from __future__ import annotations

import torch

from pdserve.common.attention.backend import get_attention_backend
from pdserve.common.attention.cpu_native import load_cpu_kernels
from pdserve.common.config import EngineConfig, ModelConfig
from pdserve.common.distributed.layout import (WHOLE_MODEL, PipelineStage, TensorParallel,
                                              kv_head_range)
from pdserve.common.models.cpu_gemm import pack_linears, resolve_cpu_gemm
from pdserve.common.models.dtype import resolve_dtype
from pdserve.common.models.linear import use_blocked_weights
from pdserve.common.models.llama import LlamaForCausalLM


def build_rank_model(config: EngineConfig, model_config: ModelConfig,
                     weights: dict[str, torch.Tensor], tp: TensorParallel, device: str,
                     pp: PipelineStage = WHOLE_MODEL) -> LlamaForCausalLM:
    """This rank's shard of the model (its heads of its pipeline stage's layers), loaded from
    the full weights, on `device`, with the CPU fast paths (oneDNN prepacked linears, native
    kernels) the config asks for."""
    backend = get_attention_backend(config.attention_backend, device)
    model = LlamaForCausalLM(model_config, backend, tp, pp)
    model.load_weights(weights.items())
    dtype = resolve_dtype(config.dtype, device)
    model.to(device=device, dtype=dtype).eval()  # floating-point tensors only: packed stay
    if dtype != torch.float32:  # oneDNN packing and the native kernels are fp32-only
        return model
    if resolve_cpu_gemm(config.cpu_gemm, device) == "onednn":
        pack_linears(model)
        use_blocked_weights(model)  # GGUF-packed layers' largest GEMMs (quant/blocked.py)
    native = load_cpu_kernels() if device == "cpu" else None
    if native is not None:
        model.use_cpu_kernels(native)
    return model


def allocate_kv_caches(cfg: ModelConfig, tp: tuple[int, int], num_blocks: int,
                       block_size: int, device: str, dtype: torch.dtype = torch.float32,
                       pp: PipelineStage = WHOLE_MODEL) -> list[torch.Tensor]:
    """One [2, blocks, block_size, this rank's KV heads, head_dim] tensor of `dtype` per layer
    of its pipeline stage (tp: rank, size): this rank's heads of every block."""
    _, heads = kv_head_range(cfg.num_kv_heads, *tp)
    return [torch.zeros(2, num_blocks, block_size, heads, cfg.head_dim, device=device,
                        dtype=dtype)
            for _ in pp.layers(cfg.num_layers)]


def rank_device(device: str, rank: int, world_size: int) -> str:
    """CUDA ranks each take their own GPU (cuda:rank, global rank); CPU ranks share the
    host."""
    if device.startswith("cuda") and world_size > 1:
        return f"cuda:{rank}"
    return device
