"""A GGUF with some tensors stored in another type: what a mixed file such as Q4_K_M looks like
(a Q6_K or Q8_0 `attn_v` beside Q4_K q and k), made from a file at hand for benchmarks and
tests of the mixed-type paths (docs/packed-weights.md, "Mixed types in one fused layer").

    python -m pdserve.bench.retype_gguf --model smollm2 --retype attn_v=Q8_0 --out mixed.gguf

    python -m pdserve.bench.retype_gguf --retype attn_q=IQ4_NL ... --out iq4.gguf

Each tensor whose name ends in `<suffix>.weight` is expanded by gguf-py and re-quantized into
the new type: by gguf-py (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16, F32), or by the quantizers
in bench/iq4_quant.py (IQ4_NL and IQ4_XS, which gguf-py reads but cannot write; IQ4_NL is
what llama.cpp's IQ4_XS files hold for rows narrower than 256, IQ4_XS needs rows of whole
256-weight super-blocks). Metadata and every other tensor are copied byte for
byte. The re-quantized values round again, so outputs differ slightly from the original
file's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from pdserve.bench.iq4_quant import quantize_iq4_nl, quantize_iq4_xs
from pdserve.common.models.registry import resolve_model

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32", "IQ4_NL", "IQ4_XS")


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
