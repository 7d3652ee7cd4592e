"""A GGUF with some tensors stored in another type: what a mixed file such as Q4_K_M looks like
(a Q6_K or Q8_0 `attn_v` beside Q4_K q and k), made from a file at hand for benchmarks and
tests of the mixed-type paths (docs/packed-weights.md, "Mixed types in one fused layer").

    python -m pdserve.bench.retype_gguf --model smollm2 --retype attn_v=Q8_0 --out mixed.gguf

    python -m pdserve.bench.retype_gguf --retype attn_q=IQ4_NL ... --out iq4.gguf

Each tensor whose name ends in `<suffix>.weight` is expanded by gguf-py and re-quantized into
the new type: by gguf-py (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16, F32), or by the quantizers
below (IQ4_NL and IQ4_XS, which gguf-py reads but cannot write; IQ4_NL is what llama.cpp's
Q2_K, Q3_K and IQ4_XS files hold for rows narrower than 256, IQ4_XS needs rows of whole
256-weight super-blocks). Metadata and every other tensor are copied byte for byte. The
re-quantized values round again, so outputs differ slightly from the original file's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from pdserve.common.models.quant.packed import IQ4_NL_GRID
from pdserve.common.models.registry import resolve_model

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32", "IQ4_NL", "IQ4_XS")
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
    the level nearest x / dl (llama.cpp's layout; its scale search without importance
    weights)."""
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


def encode(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """values re-quantized into qtype (gguf-py's quantizer, or ours for the IQ4 types)."""
    own = {gguf.GGMLQuantizationType.IQ4_NL: quantize_iq4_nl,
           gguf.GGMLQuantizationType.IQ4_XS: quantize_iq4_xs}.get(qtype)
    if own is not None:
        return own(values.reshape(-1, values.shape[-1]))
    return gguf.quants.quantize(values, qtype)


def parse_retype(spec: str) -> tuple[str, gguf.GGMLQuantizationType]:
    """'attn_v=Q8_0' -> ('attn_v', Q8_0)."""
    suffix, _, name = spec.partition("=")
    if not suffix or name not in QUANTIZABLE:
        raise argparse.ArgumentTypeError(f"--retype wants SUFFIX=TYPE with TYPE one of "
                                         f"{', '.join(QUANTIZABLE)}, got {spec!r}")
    return suffix, gguf.GGMLQuantizationType[name]


def retype(src: Path, out: Path, rules: list[tuple[str, gguf.GGMLQuantizationType]]) -> int:
    """Write `out`: `src` with the tensors the rules match re-encoded; returns how many."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer adds these itself
        if name == "general.alignment":  # the writer pads tensor data to its own alignment
            writer.add_custom_alignment(int(field.contents()))
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    changed = 0
    for t in reader.tensors:
        data, qtype = np.asarray(t.data), t.tensor_type
        new = next((q for suffix, q in rules if t.name.endswith(f"{suffix}.weight")), None)
        if new is not None and new != qtype:
            try:
                data, qtype = encode(gguf.quants.dequantize(data, qtype), new), new
            except ValueError as e:
                raise ValueError(f"{t.name} as {new.name}: {e}") from None
            changed += 1
        # quantized data is bytes: give the writer their shape; float data carries its own
        shape = tuple(int(n) for n in reversed(t.shape))  # numpy order [rows, columns]
        raw_shape = (gguf.quants.quant_shape_to_byte_shape(shape, qtype)
                     if data.dtype == np.uint8 else None)
        writer.add_tensor(t.name, data, raw_dtype=qtype, raw_shape=raw_shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return changed


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a .gguf path or a model name")
    p.add_argument("--retype", type=parse_retype, action="append", required=True,
                   metavar="SUFFIX=TYPE", help="e.g. attn_v=Q8_0 (repeatable)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    src = resolve_model(args.model)
    print(f"{retype(src, args.out, args.retype)} tensors re-encoded: {args.out}")


if __name__ == "__main__":
    main()
