// Paged decode attention for the CPU: K/V are read straight from the paged cache through the
// block table (no dense gather copy), each K/V row once per (request, kv head) for all the query
// heads of its GQA group, with an online softmax over block-aligned tiles and fp32 accumulation.
//
// Prefill chunks go to prefill_attention.cpp; the fused layer step, RMSNorm and the Python
// bindings are in layer_ops.cpp.
//
// Built just in time by pdserve/common/attention/cpu_native.py. With AVX2+FMA (the loader adds
// -mavx2 -mfma when the CPU has them) the inner loops use 8-wide intrinsics; otherwise plain
// loops.
//
// Layouts (fp32 / int32; the cache fp32, bf16 or fp16, widened to fp32 as it is loaded):
//   query        [D, H, d]   rows may be strided (a view of a bigger [T, H, d]); heads dense
//   kv_cache     [2, NB, bs, kvh, d] contiguous (0 = keys, 1 = values)
//   block_tables [D, W]      cache block of each request's bs-token page
//   seq_lens     [D]         context length incl. the new token, 1 <= len <= W * bs
//   out          [D, H, d]   contiguous; query head j uses kv head j / (H / kvh)

#include "decode_attention.h"


// out = softmax(scale * q K^T) V per request and head, K/V read through the block table.
at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& kv_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        c10::optional<at::Tensor> out_opt, int64_t heads_per_item) {
  TORCH_CHECK_VALUE(query.device().is_cpu() && kv_cache.device().is_cpu() &&
                        block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
                    "paged_decode: all tensors must be on the CPU");
  TORCH_CHECK_VALUE(query.scalar_type() == at::kFloat,
                    "paged_decode: query must be float32 (the cache may be fp32, bf16 or fp16)");
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
                    "paged_decode: block_tables and seq_lens must be int32");
  TORCH_CHECK_VALUE(query.dim() == 3, "paged_decode: query must be [D, heads, head_dim], got ",
                    query.sizes());
  TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
                    "paged_decode: kv_cache must be [2, blocks, block_size, kv_heads, head_dim], "
                    "got ", kv_cache.sizes());
  const int64_t num_reqs = query.size(0), heads = query.size(1), d = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), kvh = kv_cache.size(3);
  TORCH_CHECK_VALUE(kv_cache.size(4) == d, "paged_decode: head_dim mismatch: query ", d,
                    ", kv_cache ", kv_cache.size(4));
  pdserve_kernels::check_heads("paged_decode", heads, kvh);
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == num_reqs,
                    "paged_decode: block_tables must be [D, W] with D = ", num_reqs, ", got ",
                    block_tables.sizes());
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) == num_reqs,
                    "paged_decode: seq_lens must be [D] with D = ", num_reqs, ", got ",
                    seq_lens.sizes());
  TORCH_CHECK_VALUE(kv_cache.is_contiguous(), "paged_decode: kv_cache must be contiguous");

  // a strided row stride (query sliced out of a fused qkv) is fine; heads must be dense
  const at::Tensor q = (query.stride(2) == 1 && query.stride(1) == d) ? query : query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out;
  if (out_opt.has_value()) {
    out = *out_opt;
    TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kFloat &&
                          out.is_contiguous() && out.sizes() == query.sizes(),
                      "paged_decode: out must be a contiguous float32 CPU tensor of shape ",
                      query.sizes());
  } else {
    out = query.new_empty({num_reqs, heads, d});
  }
  if (num_reqs == 0) return out;

  // below this many (token, kv head) rows a decode runs on one thread (~256 KiB of fp32 KV at
  // head_dim 64, ~20 us). Batch 1 reads its whole context's KV from L3 or DRAM every layer
  // (SmolLM2 at 300 tokens: 900 rows, 460 KB), bound by one core's bandwidth when serial: with
  // 8192 here its attention took 1.6 ms of a 10 ms step on 2 threads.
  constexpr int64_t kSerialKvRows = 512;
  const int64_t width = tables.size(1);
  pdserve_kernels::check_metadata(tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), num_reqs,
                                  width, bs, num_blocks);

  // tiles of >= 64 tokens: fewer max/rescale passes than one block at a time
  const int64_t tile_blocks = std::max<int64_t>(1, 64 / bs);
  // Items are (request, range of kv heads). A request's whole head range reads its blocks
  // contiguously; one head per item gives more, smaller items when a few requests could not keep
  // every thread busy.
  if (heads_per_item <= 0)
    heads_per_item = num_reqs >= 4 * at::get_num_threads() ? kvh : 1;
  heads_per_item = std::min(heads_per_item, kvh);
  const int64_t chunks = (kvh + heads_per_item - 1) / heads_per_item;
  // Grain 1 (each item streams a whole context), unless the whole problem is so small that
  // waking the other threads costs more than it saves: then one thread does it all. On a
  // shared machine a parallel region stalls whenever one of its threads is descheduled.
  int64_t kv_rows = 0;
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < num_reqs; ++r) kv_rows += len_ptr[r];
  const int64_t items = num_reqs * chunks;
  const int64_t grain = kv_rows * kvh < kSerialKvRows ? items : 1;
  pdserve_kernels::dispatch_kv("paged_decode", kv_cache.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* kv = static_cast<const T*>(kv_cache.data_ptr());
    const DecodeProblem<T> p{q.data_ptr<float>(), q.stride(0), kv,
                             kv + num_blocks * bs * kvh * d, tables.data_ptr<int32_t>(),
                             lens.data_ptr<int32_t>(), out.data_ptr<float>(), heads, kvh, d, bs,
                             width, static_cast<float>(scale)};
    if (num_reqs == 1) {  // batch 1: the context in parts, merged (decode_attention.h)
      std::vector<float> buf(DecodeParts::floats(heads, d));
      const DecodeParts parts(buf.data(), heads, d);
      at::parallel_for(0, kDecodeParts, grain == 1 ? 1 : kDecodeParts,
                       [&](int64_t begin, int64_t end) {
        decode_parts(p, 0, begin, end, tile_blocks, parts);
      });
      merge_parts(parts, heads, d, 0, heads, p.out);
      return;
    }
    at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
      Scratch scratch(heads, d, tile_blocks * bs);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t h0 = (i % chunks) * heads_per_item;
        decode_item(p, i / chunks, h0, std::min(h0 + heads_per_item, kvh), tile_blocks,
                    scratch);
      }
    });
  });
  return out;
}
