"""bench/retype_gguf.py: the chosen tensors re-encoded in the new type (the values gguf-py's
round trip gives), every other tensor and the metadata as they were, bad rules refused."""

from __future__ import annotations

import argparse

import gguf
import numpy as np
import pytest

from pdserve.bench.retype_gguf import main, parse_retype
from pdserve.tests.unit.test_packed_model import write_gguf

QT = gguf.GGMLQuantizationType


def tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_retype_re_encodes_only_the_matching_tensors(tmp_path, capsys):
    write_gguf(tmp_path / "m.gguf", tied=True)
    main(["--model", str(tmp_path / "m.gguf"), "--retype", "attn_k=Q8_0",
          "--out", str(tmp_path / "r.gguf")])
    assert "2 tensors re-encoded" in capsys.readouterr().out
    before, after = tensors(tmp_path / "m.gguf"), tensors(tmp_path / "r.gguf")
    assert before.keys() == after.keys()
    for name, t in before.items():
        u = after[name]
        assert list(u.shape) == list(t.shape), name
        if name.endswith("attn_k.weight"):
            assert u.tensor_type == QT.Q8_0
            values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            assert np.array_equal(np.asarray(u.data), gguf.quants.quantize(values, QT.Q8_0))
        else:
            assert u.tensor_type == t.tensor_type, name
            assert np.array_equal(np.asarray(u.data), np.asarray(t.data)), name
    meta = [{k: f.contents() for k, f in gguf.GGUFReader(p).fields.items()
             if not k.startswith("GGUF.")} for p in (tmp_path / "m.gguf", tmp_path / "r.gguf")]
    assert meta[0] == meta[1] and meta[1]["llama.attention.head_count_kv"] == 2


def test_bad_rules_are_refused():
    assert parse_retype("attn_v=Q8_0") == ("attn_v", QT.Q8_0)
    for bad in ("attn_v", "=Q8_0", "attn_v=Q4_K", "attn_v=q8_0"):
        with pytest.raises(argparse.ArgumentTypeError, match="SUFFIX=TYPE"):
            parse_retype(bad)


@pytest.mark.parametrize("name_len", [1, 17, 33, 49])
def test_a_custom_alignment_is_kept(tmp_path, name_len):
    """A file whose tensor data is 64-byte aligned (general.alignment) stays readable, whatever
    its header's length (32-byte padding lines up with 64 for some lengths only)."""
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_custom_alignment(64)
    w.add_name("x" * name_len)
    rng = np.random.default_rng(0)
    for i in range(3):
        w.add_tensor(f"blk.{i}.attn_v.weight",
                     gguf.quants.quantize(rng.standard_normal((4, 32)).astype(np.float32),
                                          QT.Q4_0), raw_dtype=QT.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    main(["--model", str(tmp_path / "a.gguf"), "--retype", "attn_v=Q8_0",
          "--out", str(tmp_path / "b.gguf")])
    out = gguf.GGUFReader(tmp_path / "b.gguf")
    assert out.fields["general.alignment"].contents() == 64
    assert [t.tensor_type for t in out.tensors] == [QT.Q8_0] * 3


def test_iq4_types_are_written_by_our_quantizers(tmp_path):
    write_gguf(tmp_path / "m.gguf", tied=True)  # H 64: rows of two 32-weight blocks
    main(["--model", str(tmp_path / "m.gguf"), "--retype", "ffn_up=IQ4_NL",
          "--out", str(tmp_path / "r.gguf")])
    up = tensors(tmp_path / "r.gguf")["blk.0.ffn_up.weight"]
    assert up.tensor_type == QT.IQ4_NL
    assert np.isfinite(gguf.quants.dequantize(np.asarray(up.data), QT.IQ4_NL)).all()
    # IQ4_XS needs rows of whole 256-weight super-blocks: the error names the tensor
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight as IQ4_XS: .*256-weight"):
        main(["--model", str(tmp_path / "m.gguf"), "--retype", "ffn_up=IQ4_XS",
              "--out", str(tmp_path / "x.gguf")])
