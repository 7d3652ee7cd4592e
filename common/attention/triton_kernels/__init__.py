"""Triton paged-attention kernels (compiled on CUDA, interpreted on the CPU; see _launch)."""

from pdserve.common.attention.triton_kernels.decode_attention import decode_attention
from pdserve.common.attention.triton_kernels.extend_attention import extend_attention
from pdserve.common.attention.triton_kernels.reshape_and_cache import reshape_and_cache

__all__ = ["decode_attention", "extend_attention", "reshape_and_cache"]
