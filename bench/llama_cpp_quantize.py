"""llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`) writing the GGUF mixes
pdserve's packed weights are checked on (docs/packed-weights.md, "llama.cpp's own files"): from
an F32 or F16 GGUF, one file per mix, without an importance matrix.

llama-cpp-python is not a pdserve dependency: run this with the Python of the environment
bench/llama_cpp_peer.py describes, pdserve on PYTHONPATH (it imports no torch). An F32 source
from the packaged Q4_1 file (its values, every matrix re-encoded as F32):

    python -m pdserve.bench.retype_gguf --retype token_embd=F32 --retype attn_q=F32 \\
        --retype attn_k=F32 --retype attn_v=F32 --retype attn_output=F32 \\
        --retype ffn_gate=F32 --retype ffn_up=F32 --retype ffn_down=F32 --out f32.gguf
    /work/llama-venv/bin/python -m pdserve.bench.llama_cpp_quantize --gguf f32.gguf \\
        --mixes Q2_K Q3_K_M Q4_K_M IQ4_XS --out-dir .

Writes OUT_DIR/<stem>-<MIX>.gguf and prints one JSON line (each file and its size). The
mixes offered are those checked to need no importance matrix (the IQ1 .. IQ3 mixes do).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# llama.h's llama_ftype values of the mixes offered
MIXES = {"Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "IQ4_XS": 30}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True, help="an F32 or F16 GGUF")
    p.add_argument("--mixes", nargs="+", choices=sorted(MIXES), required=True)
    p.add_argument("--out-dir", type=Path, default=Path("."))
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("llama_cpp_quantize needs llama-cpp-python, which pdserve does not "
                         "depend on: install it into a separate venv (bench/llama_cpp_peer.py "
                         "says how) and run this module with that venv's Python") from None
    written = {}
    for mix in args.mixes:
        out = args.out_dir / f"{args.gguf.stem}-{mix}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = MIXES[mix]
        params.nthread = args.num_threads
        rc = llama_cpp.llama_model_quantize(str(args.gguf).encode(), str(out).encode(), params)
        if rc != 0:
            raise SystemExit(f"llama_model_quantize failed for {mix} (rc {rc})")
        written[mix] = {"path": str(out), "bytes": out.stat().st_size}
    print(json.dumps({"bench": "llama_cpp_quantize", "source": str(args.gguf), "files": written}))


if __name__ == "__main__":
    main()
