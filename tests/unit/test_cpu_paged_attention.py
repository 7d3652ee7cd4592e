"""Native CPU paged decode attention (cpu_native.py) against the torch reference `_decode`.

Tolerance: fp32 atol 1e-5 / rtol 1e-4. Only the summation order differs (online softmax over
block tiles, a polynomial exp accurate to ~1 ulp, vs one SDPA over the gathered context).

Cache slots a request does not own hold large garbage, so a kernel reading past a request's
length or outside its block table fails the comparison. The first test to load the kernels may
build them (~20-60 s, once per machine and source version).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from pdserve.common.attention import cpu_native
from pdserve.common.attention.backend import AttentionMetadata
from pdserve.common.attention.torch_backend import TorchAttentionBackend, _decode

TOL = dict(atol=1e-5, rtol=1e-4)
NUM_KV_HEADS = 2
# groups 4 and 12: the AVX2 value loop's 16-lane pass at its widest (4 heads) and after an
# 8-head chunk; head_dim 72: its 8-lane tail after the 32-lane passes (3 heads); head_dim 80:
# the AVX-512 value loop's four-chunk pass, then one 16-lane chunk (3 heads)
SHAPES = ([(d, bs, g) for d in (64, 128) for bs in (16, 32) for g in (1, 3, 4, 8)]
          + [(64, 16, 12), (72, 16, 3), (80, 16, 3)])
SHAPE_IDS = [f"d{d}-bs{bs}-gqa{g}" for d, bs, g in SHAPES]


@pytest.fixture(scope="module")
def kernels():
    module = cpu_native.load_cpu_kernels()
    if module is None:
        pytest.skip("native CPU kernels unavailable (no compiler or PDSERVE_NO_NATIVE=1)")
    return module


def make_decode_batch(lens, head_dim, block_size, group, num_kv_heads=NUM_KV_HEADS, seed=0):
    """Decode-only batch: query [D, heads, d], kv_cache with scattered pages and garbage in every
    slot past a request's length, metadata as the runner builds it (tables padded with 0)."""
    gen = torch.Generator().manual_seed(seed)
    per_req = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    kv_cache = 100 * torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                                 generator=gen)  # garbage, overwritten where owned
    tables = torch.zeros(len(lens), max(per_req), dtype=torch.int32)
    used = 0
    for i, (n, nb) in enumerate(zip(lens, per_req)):
        tables[i, :nb] = perm[used:used + nb].int()
        used += nb
        flat = kv_cache[:, tables[i, :nb].long()].flatten(1, 2)  # [2, nb*bs, kvh, d] copy
        flat[:, :n] = torch.randn(2, n, num_kv_heads, head_dim, generator=gen)
        kv_cache[:, tables[i, :nb].long()] = flat.view(2, nb, block_size, num_kv_heads, head_dim)
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
    meta = AttentionMetadata(
        num_tokens=len(lens), num_decodes=len(lens),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64), max_query_len=1,
        max_seq_len=max(lens), query_lens_cpu=[1] * len(lens), seq_lens_cpu=list(lens))
    return query, kv_cache, meta


def _native(kernels, query, kv_cache, meta, scale, **kw):
    return kernels.paged_decode(query, kv_cache, meta.block_tables, meta.seq_lens, scale,
                                kw.get("out"), kw.get("heads_per_item", 0))


@pytest.mark.parametrize("head_dim,block_size,group", SHAPES, ids=SHAPE_IDS)
def test_ragged_batch_matches_reference(kernels, head_dim, block_size, group):
    bs = block_size
    lens = [1, 2, bs - 1, bs, bs + 1, 2 * bs, 3 * bs + 7, 777]
    q, kv, meta = make_decode_batch(lens, head_dim, bs, group)
    scale = head_dim ** -0.5
    ref = _decode(q, kv, meta, scale)
    torch.testing.assert_close(cpu_native.paged_decode(q, kv, meta.block_tables, meta.seq_lens,
                                                       scale), ref, **TOL)
    # every work split (one kv head per item .. all of them) gives the same answer
    for hpi in (1, 2):
        torch.testing.assert_close(_native(kernels, q, kv, meta, scale, heads_per_item=hpi),
                                   ref, **TOL)


@pytest.mark.parametrize("seq_len", [1, 16, 17, 2048 + 5])
def test_batch_one(kernels, seq_len):
    q, kv, meta = make_decode_batch([seq_len], 64, 16, 3, num_kv_heads=3)
    ref = _decode(q, kv, meta, 0.125)
    torch.testing.assert_close(_native(kernels, q, kv, meta, 0.125), ref, **TOL)


@pytest.mark.parametrize("seq_len", [33, 300, 777])
def test_batch_one_parts_independent_of_threads(kernels, seq_len):
    """Batch 1 runs its context as fixed block-aligned parts merged in order (not one part per
    thread), so its answer is bit-identical at 1, 2 and 3 threads, and matches the reference."""
    q, kv, meta = make_decode_batch([seq_len], 64, 16, 3, num_kv_heads=3, seed=seq_len)
    ref = _decode(q, kv, meta, 0.125)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(_native(kernels, q, kv, meta, 0.125))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(outs[0], ref, **TOL)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_many_requests_threads(kernels):
    """Which thread runs which (request, kv heads) item depends on the thread count and the
    item size: the answer matches the reference and is bit-identical over 1, 2 and 3 threads,
    repeated calls and every item size."""
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 400, (70,), generator=gen).tolist()
    q, kv, meta = make_decode_batch(lens, 64, 16, 3, num_kv_heads=3, seed=1)
    ref = _decode(q, kv, meta, 0.125)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for hpi in (0, 1, 3, 0):
                outs.append(_native(kernels, q, kv, meta, 0.125, heads_per_item=hpi))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(outs[0], ref, **TOL)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_strided_query_and_out(kernels):
    """A query sliced out of a fused qkv row (strided rows), written into a given `out`."""
    q, kv, meta = make_decode_batch([5, 40, 100], 64, 16, 3)
    heads, d = q.shape[1], q.shape[2]
    qkv = torch.randn(3, (heads + 2 * NUM_KV_HEADS) * d)
    qkv[:, :heads * d] = q.flatten(1)
    q_view = qkv[:, :heads * d].view(3, heads, d)
    assert not q_view.is_contiguous()
    out = torch.full_like(q, float("nan"))
    res = _native(kernels, q_view, kv, meta, 0.125, out=out)
    assert res.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, _decode(q, kv, meta, 0.125), **TOL)
    # a query with permuted head/dim strides is made contiguous first
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(_native(kernels, q_t, kv, meta, 0.125),
                               _decode(q, kv, meta, 0.125), **TOL)


def test_bad_input_raises_value_error(kernels):
    q, kv, meta = make_decode_batch([5, 20], 64, 16, 2)
    tables, lens = meta.block_tables, meta.seq_lens
    cases = [
        (q, kv, tables, torch.tensor([0, 20], dtype=torch.int32)),  # empty context
        (q, kv, tables, torch.tensor([5, 33], dtype=torch.int32)),  # longer than the table
        (q, kv, torch.tensor([[0, 0], [1, 999]], dtype=torch.int32), lens),  # block id out
        (q, kv, torch.tensor([[0, 0], [-1, 1]], dtype=torch.int32), lens),  # negative block
        (q.double(), kv, tables, lens),
        (q, kv, tables.long(), lens),
        (q[:, :, :32], kv, tables, lens),  # head_dim mismatch
        (q[:, :3], kv, tables, lens),  # heads not a multiple of kv heads
        (q[:1], kv, tables, lens),  # batch mismatch
        (q, kv[0], tables, lens),  # not 5-D
    ]
    for args in cases:
        with pytest.raises(ValueError):
            kernels.paged_decode(*args, 0.125, None, 0)
    with pytest.raises(ValueError):  # wrong out shape
        kernels.paged_decode(q, kv, tables, lens, 0.125, torch.empty(2, 4, 32), 0)


def _mixed_batch(head_dim=64, block_size=16, group=3, kvh=3):
    """Two decodes then one extend chunk (cached prefix 21, 6 new tokens), caches filled."""
    q, kv, meta = make_decode_batch([9, 50, 27], head_dim, block_size, group, num_kv_heads=kvh)
    q_ext = torch.randn(6, q.shape[1], head_dim, generator=torch.Generator().manual_seed(5))
    query = torch.cat([q[:2], q_ext])  # [T=8, heads, d]
    key = torch.randn(8, kvh, head_dim)  # only the extend's keys are read (the cache has them)
    value = torch.randn(8, kvh, head_dim)
    meta = AttentionMetadata(
        num_tokens=8, num_decodes=2, query_start_loc=torch.tensor([0, 1, 2, 8],
                                                                  dtype=torch.int32),
        seq_lens=meta.seq_lens, block_tables=meta.block_tables, slot_mapping=meta.slot_mapping,
        max_query_len=6, max_seq_len=50, query_lens_cpu=[1, 1, 6], seq_lens_cpu=[9, 50, 27])
    return query, key, value, kv, meta


def test_backend_uses_native_and_matches_gather_path(kernels, monkeypatch):
    query, key, value, kv, meta = _mixed_batch()
    backend = TorchAttentionBackend()
    native_out = backend.forward(query, key, value, kv, meta, 0.125)
    monkeypatch.setenv("PDSERVE_NO_NATIVE", "1")
    gather_out = backend.forward(query, key, value, kv, meta, 0.125)
    torch.testing.assert_close(native_out, gather_out, **TOL)
    dec_meta = AttentionMetadata(2, 2, meta.query_start_loc[:3], meta.seq_lens[:2],
                                 meta.block_tables[:2], meta.slot_mapping[:2], 1, 50, [1, 1],
                                 [9, 50])
    torch.testing.assert_close(native_out[:2], _decode(query[:2], kv, dec_meta, 0.125), **TOL)


def test_no_native_env_forces_fallback(monkeypatch):
    monkeypatch.setenv("PDSERVE_NO_NATIVE", "1")
    assert cpu_native.load_cpu_kernels() is None
    with pytest.raises(RuntimeError):
        cpu_native.paged_decode(*make_decode_batch([3], 64, 16, 1)[:2], torch.zeros(1, 1).int(),
                                torch.ones(1).int(), 0.125)
    query, key, value, kv, meta = _mixed_batch()
    out = TorchAttentionBackend().forward(query, key, value, kv, meta, 0.125)
    assert torch.isfinite(out).all()


def test_build_failure_falls_back(monkeypatch, tmp_path, caplog):
    """A failed build (here: no compiler) is one warning and None, not an exception."""
    monkeypatch.delenv("PDSERVE_NO_NATIVE", raising=False)
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpu_native._load_once.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert cpu_native.load_cpu_kernels() is None
            assert cpu_native.load_cpu_kernels() is None
        assert sum("unavailable" in r.message for r in caplog.records) == 1
    finally:
        cpu_native._load_once.cache_clear()  # later tests load the real (cached) build


def test_build_is_cached_and_second_load_fast(kernels):
    """After the first build, a fresh process imports the cached library without compiling."""
    directory = cpu_native.build_directory()
    assert (directory / "BUILD_OK").exists()
    code = ("import time, torch; t = time.perf_counter();"
            "from pdserve.common.attention.cpu_native import load_cpu_kernels;"
            "m = load_cpu_kernels(); print(m.__file__); print(time.perf_counter() - t)")
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_NO_NATIVE"}
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    path, load_s = res.stdout.split()
    assert path == kernels.__file__
    assert float(load_s) < 2.0, f"second load took {load_s} s: rebuilt?"
    assert time.perf_counter() - t0 < 30
