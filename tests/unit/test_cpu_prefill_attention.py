"""Native CPU paged prefill attention (cpu_kernels/prefill_attention.cpp) against the torch
reference `prefill_reference` (`_prefill_one`, causal SDPA per request; an offset mask for
chunks with a prefix).

Tolerance: fp32 atol 1e-5 / rtol 1e-4, as for the decode kernel: only the summation order (online
softmax over 64-key tiles) and a ~1 ulp polynomial exp differ. Slots a request does not own hold
large garbage, so reading past a context or outside a block table fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.common.attention import cpu_native
from pdserve.common.attention.torch_backend import prefill_reference as reference

TOL = dict(atol=1e-5, rtol=1e-4)
NUM_KV_HEADS = 2


@pytest.fixture(scope="module")
def kernels():
    module = cpu_native.load_cpu_kernels()
    assert module is not None, "native CPU kernels failed to build"
    if not module.fast_prefill:
        pytest.skip("this CPU has no AVX2: the engine uses SDPA for prefill here")
    return module


def make_prefill_batch(chunks, head_dim, block_size, group, seed=0):
    """chunks: (chunk length, context length) per request. Returns query [T, H, d], kv_cache
    (scattered pages, garbage elsewhere), block_tables, seq_lens, query_start_loc."""
    gen = torch.Generator().manual_seed(seed)
    per_req = [-(-ctx // block_size) for _, ctx in chunks]
    num_blocks = sum(per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    kv_cache = 100 * torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=gen)
    tables = torch.zeros(len(chunks), max(per_req), dtype=torch.int32)
    used = 0
    for i, ((_, ctx), nb) in enumerate(zip(chunks, per_req)):
        tables[i, :nb] = perm[used:used + nb].int()
        used += nb
        flat = kv_cache[:, tables[i, :nb].long()].flatten(1, 2)
        flat[:, :ctx] = torch.randn(2, ctx, NUM_KV_HEADS, head_dim, generator=gen)
        kv_cache[:, tables[i, :nb].long()] = flat.view(2, nb, block_size, NUM_KV_HEADS,
                                                       head_dim)
    lens = [q for q, _ in chunks]
    query = torch.randn(sum(lens), NUM_KV_HEADS * group, head_dim, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([ctx for _, ctx in chunks], dtype=torch.int32)
    return query, kv_cache, tables, seq_lens, qsl


SHAPES = [(64, 16, 3), (128, 32, 1), (64, 16, 8), (80, 16, 5), (36, 8, 2)]  # 36: d % 8 != 0


@pytest.mark.parametrize("head_dim,block_size,group", SHAPES,
                         ids=[f"d{d}-bs{b}-gqa{g}" for d, b, g in SHAPES])
def test_chunks_with_and_without_prefix_match_reference(kernels, head_dim, block_size, group):
    # whole prompts, chunks after a prefix (aligned or not), partial 16-token vectors, 1 token,
    # and a context longer than several 64-key tiles
    # (20, 70): token vectors of 8 (AVX2) and 16 that straddle a 64-key tile boundary
    chunks = [(1, 1), (16, 16), (17, 17), (100, 100), (5, 37), (16, 16 + block_size),
              (33, 777), (20, 70), (1, 300)]
    query, kv, tables, lens, qsl = make_prefill_batch(chunks, head_dim, block_size, group)
    scale = head_dim ** -0.5
    # rows after the last request's stay as they are: no lane writes past a chunk's end
    buf = torch.full((query.shape[0] + 16, *query.shape[1:]), 7.0)
    out = buf[:query.shape[0]]
    out.fill_(float("nan"))
    kernels.paged_prefill(query, kv, tables, lens, qsl, 0, scale, out)
    torch.testing.assert_close(out, reference(query, kv, tables, lens, qsl, 0, scale), **TOL)
    assert torch.equal(buf[query.shape[0]:], torch.full_like(buf[query.shape[0]:], 7.0))


def test_rows_before_first_req_are_left_alone(kernels):
    """The decode requests of a mixed batch come first; the kernel must not touch their rows."""
    query, kv, tables, lens, qsl = make_prefill_batch([(1, 9), (1, 40), (20, 50)], 64, 16, 3)
    out = torch.full_like(query, 7.0)
    kernels.paged_prefill(query, kv, tables, lens, qsl, 2, 0.125, out)
    assert torch.equal(out[:2], torch.full_like(out[:2], 7.0))
    torch.testing.assert_close(out[2:], reference(query, kv, tables, lens, qsl, 2, 0.125)[2:],
                               **TOL)


def test_strided_query_rows(kernels):
    query, kv, tables, lens, qsl = make_prefill_batch([(30, 30), (7, 70)], 64, 16, 3)
    wide = torch.zeros(query.shape[0], query.shape[1] + 4, 64)
    wide[:, :query.shape[1]] = query
    strided = wide[:, :query.shape[1]]  # rows further apart than heads * d
    out = torch.empty_like(query)
    kernels.paged_prefill(strided, kv, tables, lens, qsl, 0, 0.125, out)
    torch.testing.assert_close(out, reference(query, kv, tables, lens, qsl, 0, 0.125), **TOL)


def test_thread_count_does_not_change_the_result(kernels):
    query, kv, tables, lens, qsl = make_prefill_batch([(64, 64), (40, 200), (3, 3)], 64, 16, 3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.empty_like(query)
        kernels.paged_prefill(query, kv, tables, lens, qsl, 0, 0.125, one)
        torch.set_num_threads(2)
        many = torch.empty_like(query)
        kernels.paged_prefill(query, kv, tables, lens, qsl, 0, 0.125, many)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)  # items are independent: no order-dependent reduction


@pytest.mark.parametrize("break_it,match", [
    (lambda t, l, q: l.__setitem__(0, 0), "seq_lens"),
    (lambda t, l, q: t.__setitem__((1, 0), 10_000), "block_tables"),
    (lambda t, l, q: q.__setitem__(1, q[2].item()), "chunk"),  # empty chunk
    (lambda t, l, q: l.__setitem__(1, 3), "chunk"),  # chunk longer than its context
    (lambda t, l, q: q.__setitem__(2, 13), "chunk"),  # past the last query row
    (lambda t, l, q: q.__setitem__(0, -1), "chunk"),
])
def test_bad_metadata_is_a_value_error(kernels, break_it, match):
    query, kv, tables, lens, qsl = make_prefill_batch([(4, 4), (8, 20)], 64, 16, 3)
    break_it(tables, lens, qsl)
    with pytest.raises(ValueError, match=match):
        kernels.paged_prefill(query, kv, tables, lens, qsl, 0, 0.125, torch.empty_like(query))


def test_bad_shapes_are_value_errors(kernels):
    query, kv, tables, lens, qsl = make_prefill_batch([(4, 4), (8, 20)], 64, 16, 3)
    out = torch.empty_like(query)
    for first_req in (-1, 3):
        with pytest.raises(ValueError, match="first_req"):
            kernels.paged_prefill(query, kv, tables, lens, qsl, first_req, 0.125, out)
    with pytest.raises(ValueError, match="kv heads"):  # no kv heads: not a division by zero
        kernels.paged_prefill(query, kv[:, :, :, :0], tables, lens, qsl, 0, 0.125, out)
    with pytest.raises(ValueError, match="kv heads"):  # 6 query heads over 4 kv heads
        kernels.paged_prefill(query, torch.zeros(2, 8, 16, 4, 64), tables, lens, qsl, 0, 0.125,
                              out)
    with pytest.raises(ValueError, match="disagree"):
        kernels.paged_prefill(query, kv, tables, lens[:1], qsl, 0, 0.125, out)
