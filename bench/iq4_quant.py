"""IQ4_NL and IQ4_XS quantizers for benchmark files (bench/retype_gguf.py): gguf-py reads both
types but cannot write them. Simpler than llama-quantize's (see _iq4_fit), so a file made here
is not what llama.cpp would write from the same weights, only one in the same format."""

from __future__ import annotations

import numpy as np

from pdserve.common.models.quant.packed import IQ4_NL_GRID

IQ4_GRID = np.array(IQ4_NL_GRID, dtype=np.float32)
IQ4_GRID.flags.writeable = False  # a constant: shared by every call


def _iq4_fit(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., 32] -> (scale d [..., 1] fp32, grid indices [..., 32] uint8) per block: 15
    trial scales around max|x| / 127, as llama.cpp's quantize_row_iq4_nl tries, each refit by
    least squares, the one with the least error kept. Simpler than llama.cpp's: the fit is
    unweighted (it weights by x^2 without an imatrix) and the indices are not re-picked for the
    final scale. Good enough for benchmark files; not a replacement for llama-quantize."""
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)  # signed
    safe = np.where(peak == 0, 1.0, peak)
    best_err = np.full(peak.shape, np.inf, dtype=np.float32)
    best_d = np.zeros(peak.shape, dtype=np.float32)
    best_q = np.zeros(x.shape, dtype=np.uint8)
    for step in range(-7, 8):
        q = _nearest_level(x * ((IQ4_GRID[0] + step) / safe))
        v = IQ4_GRID[q]
        d = (x * v).sum(-1, keepdims=True) / (v * v).sum(-1, keepdims=True)
        err = ((x - d * v) ** 2).sum(-1, keepdims=True)
        better = err < best_err
        best_err, best_d = np.where(better, err, best_err), np.where(better, d, best_d)
        best_q = np.where(better, q, best_q)
    return np.where(peak == 0, 0, best_d), best_q


def _nearest_level(y: np.ndarray) -> np.ndarray:
    return np.searchsorted((IQ4_GRID[1:] + IQ4_GRID[:-1]) / 2, y).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:  # [..., 32] indices -> [..., 16] bytes
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _blocks(values: np.ndarray, width: int) -> np.ndarray:
    rows, k = values.shape
    if k % width:
        raise ValueError(f"rows must be whole {width}-weight blocks, got {k} columns")
    if not np.isfinite(values).all():
        raise ValueError("values to quantize must be finite")
    return values.reshape(rows, k // width, width).astype(np.float32)


def _fp16_scale(d: np.ndarray) -> np.ndarray:
    """d as the fp16 the block stores; refuses values whose scale fp16 cannot hold (|x| above
    ~8e6), which would store inf and expand to inf or NaN."""
    with np.errstate(over="ignore"):
        half = d.astype(np.float16)
    if not np.isfinite(half).all():
        raise ValueError("values too large for an fp16 block scale (|x| above ~8e6)")
    return half


def quantize_iq4_nl(values: np.ndarray) -> np.ndarray:
    """[rows, K] fp32 (K a multiple of 32) -> IQ4_NL bytes [rows, K / 32 * 18]: per block the
    fp16 scale d, then 16 bytes of nibbles (element j low, j + 16 high) indexing the grid."""
    x = _blocks(values, 32)
    d, q = _iq4_fit(x)
    out = np.concatenate([_fp16_scale(d).view(np.uint8), _nibbles(q)], -1)
    return out.reshape(values.shape[0], -1)


def quantize_iq4_xs(values: np.ndarray) -> np.ndarray:
    """[rows, K] fp32 (K a multiple of 256) -> IQ4_XS bytes [rows, K / 256 * 136]: per
    super-block the fp16 d, the sub-blocks' 6-bit scales ls (dl = d * (ls - 32): the high 2
    bits in a uint16, the low 4 in 4 bytes of nibbles), then 8 x 16 bytes of grid indices, each
    the level nearest x / dl (llama.cpp's layout; the scales found as _iq4_fit says)."""
    x = _blocks(values, 256).reshape(values.shape[0], -1, 8, 32)
    sub_d, _ = _iq4_fit(x)  # [r, nb, 8, 1]
    peak = np.take_along_axis(sub_d, np.abs(sub_d).argmax(-2)[..., None, :], -2)  # [r, nb, 1, 1]
    d = _fp16_scale(-peak / 32).astype(np.float32)
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d))
    ls = np.clip(np.rint(sub_d * inv), -32, 31).astype(np.int32) + 32  # [r, nb, 8, 1]
    dl = d * (ls - 32)
    q = _nearest_level(x / np.where(dl == 0, 1, dl))
    low = ls[..., 0] & 15  # [r, nb, 8]
    scales_l = (low[..., 0::2] | (low[..., 1::2] << 4)).astype(np.uint8)  # [r, nb, 4]
    scales_h = ((ls[..., 0] >> 4) << (2 * np.arange(8))).sum(-1).astype(np.uint16)  # [r, nb]
    out = np.concatenate([d[..., 0, :].astype(np.float16).view(np.uint8),
                          scales_h[..., None].view(np.uint8), scales_l,
                          _nibbles(q).reshape(*q.shape[:2], 128)], -1)
    return out.reshape(values.shape[0], -1)
