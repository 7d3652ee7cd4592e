"""NH (connector/nh.py, connector/native/nh.c) is Adiantum's NH: its numpy definition and every
C loop (AVX-512, AVX2 and portable) give Adiantum's published hashes, and equal each other on every
length, including the partial units and chunks a block payload never has."""

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.connector import nh

VECTORS = json.loads((Path(__file__).parent / "data" / "nh_adiantum.json").read_text())["vectors"]


def _c_loop(isa: nh.Isa):
    """The library's entry point with the ISA chosen here, not by the CPU check."""
    fn = nh.bind_entry(nh._load_library())

    def call(key: np.ndarray, msg: bytes) -> bytes:
        src = np.frombuffer(msg, dtype=np.uint8).copy()
        out = np.zeros(nh.hashes_nbytes(len(msg)), dtype=np.uint8)
        assert fn(key.ctypes.data, src.ctypes.data, len(msg), out.ctypes.data, isa) \
            == len(out)
        return out.tobytes()
    return call


LOOPS = {"reference": nh.nh_reference, "dispatched": nh.nh_chunks,
         "portable": _c_loop(nh.Isa.SCALAR)}
for _isa in (nh.Isa.AVX2, nh.Isa.AVX512):  # each wider loop wherever the kernels build for it
    if nh.best_isa() >= _isa:
        LOOPS[_isa.name.lower()] = _c_loop(_isa)


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("vector", range(len(VECTORS)))
def test_adiantum_vectors(loop, vector):
    v = VECTORS[vector]
    key = np.frombuffer(bytes.fromhex(v["key_hex"]), dtype="<u4")
    assert len(key) * 4 == nh.KEY_BYTES
    assert LOOPS[loop](key, bytes.fromhex(v["message_hex"])).hex() == v["hash_hex"]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 48, 1008, 1023, 1024, 1025,
                               3 * 1024 + 40, 737_280, 737_280 + 5])
def test_loops_agree_on_every_length(n):
    key = nh.derive_key(b"k" * 32)
    msg = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = nh.nh_reference(key, msg)
    assert len(want) == nh.hashes_nbytes(n)
    for name, loop in LOOPS.items():
        assert loop(key, msg) == want, name


def test_a_changed_word_changes_its_chunk_hash_only():
    key = nh.derive_key(b"k" * 32)
    msg = bytearray(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    before = nh.nh_chunks(key, msg)
    msg[1500] ^= 0x80  # in the second chunk
    after = nh.nh_chunks(key, msg)
    assert before[:32] == after[:32] and before[64:] == after[64:]
    assert before[32:64] != after[32:64]


def test_the_key_depends_on_the_mac_key_and_is_read_only():
    a, b = nh.derive_key(b"a" * 32), nh.derive_key(b"b" * 32)
    assert a.shape == (nh.KEY_BYTES // 4,) and a.dtype == np.dtype("<u4")
    assert not np.array_equal(a, b)
    with pytest.raises(ValueError):
        a[0] = 0


def test_the_native_loop_is_built_and_runs_without_the_gil():
    lib = nh._load_library()
    assert isinstance(lib, ctypes.CDLL) and not isinstance(lib, ctypes.PyDLL)
    assert nh.native_available()  # the suite's machines have a C compiler


@pytest.mark.parametrize("cap,widest", [("scalar", nh.Isa.SCALAR), ("avx2", nh.Isa.AVX2)])
def test_the_isa_cap_bounds_the_loop(monkeypatch, cap, widest):
    monkeypatch.setenv("PDSERVE_CPU_ISA", cap)
    assert nh.best_isa() <= widest
