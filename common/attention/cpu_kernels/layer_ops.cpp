// The native CPU kernels' fused layer pieces and the module's Python bindings:
//   attention_step  one layer's rotary, KV write and attention (decodes and prefill chunks)
//   rms_norm        one pass per row (torch runs five ops for it on the CPU)
// The attention kernels themselves: paged_attention.cpp (decode), prefill_attention.cpp.

#include "kernels.h"
#include "layer_rows.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>


// One layer's attention, fused: rotary on every token's q and k heads, k and v written to their
// cache slots, then attention: paged decode for the first num_decodes requests (one token each)
// and paged prefill for the chunks after them. The torch path spends ~20 small ops per layer on
// the first two and runs prefill chunks one SDPA call at a time.
//   qkv             [T, (H + 2 kvh) d] fp32, rows may be strided (the fused projection's output)
//   cos, sin        [T, d] fp32 contiguous (the rows for each token's position)
//   slot_mapping    [T] int64, each token's cache slot
//   query_start_loc [R + 1] int32; the rest as paged_decode / paged_prefill.
// Returns [T, H, d].
at::Tensor attention_step(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, int64_t num_decodes, double scale,
                          int64_t num_heads) {
  TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                        kv_cache.device().is_cpu(),
                    "attention_step: kv_cache must be a contiguous CPU tensor "
                    "[2, blocks, block_size, kv_heads, head_dim], got ", kv_cache.sizes());
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), kvh = kv_cache.size(3);
  const int64_t d = kv_cache.size(4);
  TORCH_CHECK_VALUE(d % 2 == 0, "attention_step: head_dim must be even, got ", d);
  pdserve_kernels::check_heads("attention_step", num_heads, kvh);
  TORCH_CHECK_VALUE(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.device().is_cpu() &&
                        qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * kvh) * d,
                    "attention_step: qkv must be float32 CPU [T, (heads + 2 kv_heads) head_dim] "
                    "with unit column stride, got ", qkv.sizes());
  const int64_t n = qkv.size(0);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                          t->numel() == n * d && t->device().is_cpu(),
                      "attention_step: cos and sin must be contiguous float32 [T, head_dim]");
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                        slot_mapping.device().is_cpu() && slot_mapping.numel() == n,
                    "attention_step: slot_mapping must be contiguous int64 CPU [T]");
  // everything the attention will read is checked here, before the cache is written
  pdserve_kernels::check_batch_metadata("attention_step", block_tables, seq_lens,
                                        &query_start_loc, bs, num_blocks);
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK_VALUE(num_decodes >= 0 && num_decodes <= num_reqs, "attention_step: num_decodes = ",
                    num_decodes, " must be in [0, ", num_reqs, "]");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  // decode r is query row r; the chunks after them end at the last row
  for (int64_t r = 0; r <= num_decodes; ++r)
    TORCH_CHECK_VALUE(qsl[r] == r, "attention_step: query_start_loc[", r, "] = ", qsl[r],
                      ", but the first ", num_decodes, " requests are one-token decodes");
  TORCH_CHECK_VALUE(qsl[num_reqs] == n, "attention_step: query_start_loc[", num_reqs, "] = ",
                    qsl[num_reqs], " must be the token count ", n);
  pdserve_kernels::check_chunks("attention_step", qsl, seq_lens.data_ptr<int32_t>(), num_decodes,
                                num_reqs, n);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK_VALUE(slots[r] >= 0 && slots[r] < num_blocks * bs, "attention_step: "
                      "slot_mapping[", r, "] = ", slots[r], " is outside the cache's ",
                      num_blocks * bs, " slots");

  at::Tensor q = qkv.new_empty({n, num_heads, d});
  float* qp = q.data_ptr<float>();
  const float* x = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t x_stride = qkv.stride(0);
  pdserve_kernels::dispatch_kv("attention_step", kv_cache.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    T* kc = static_cast<T*>(kv_cache.data_ptr());
    T* vc = kc + num_blocks * bs * kvh * d;
    // tokens are independent (distinct slots); a decode batch's few rows stay on one thread
    at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
      std::vector<float> k(d);
      for (int64_t r = begin; r < end; ++r) {
        const float* row = x + r * x_stride;
        const float* c = cp + r * d;
        const float* s = sp + r * d;
        for (int64_t h = 0; h < num_heads; ++h)
          rope_row(row + h * d, c, s, qp + (r * num_heads + h) * d, d);
        // keys rotated in fp32, then rounded once to the cache type (as torch's copy does)
        for (int64_t h = 0; h < kvh; ++h) {
          rope_row(row + (num_heads + h) * d, c, s, k.data(), d);
          store_row(k.data(), kc + (slots[r] * kvh + h) * d, d);
        }
        store_row(row + (num_heads + kvh) * d, vc + slots[r] * kvh * d, kvh * d);
      }
    });
  });
  at::Tensor out = qkv.new_empty({n, num_heads, d});
  if (num_decodes > 0)
    paged_decode(q.narrow(0, 0, num_decodes), kv_cache, block_tables.narrow(0, 0, num_decodes),
                 seq_lens.narrow(0, 0, num_decodes), scale, out.narrow(0, 0, num_decodes), 0);
  if (num_decodes < num_reqs)
    paged_prefill(q, kv_cache, block_tables, seq_lens, query_start_loc, num_decodes, scale, out);
  return out;
}

// RMSNorm of each row: y = (x * rsqrt(mean(x^2) + eps)) * w, fp32, x [T, n] with contiguous
// rows (row stride may exceed n), w [n]. One pass per row instead of torch's five ops on the CPU.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
                        x.stride(1) == 1,
                    "rms_norm: x must be float32 CPU [T, n] with unit column stride, got ",
                    x.sizes());
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == n && w.scalar_type() == at::kFloat &&
                        w.is_contiguous() && w.device().is_cpu(),
                    "rms_norm: weight must be contiguous float32 [", n, "], got ", w.sizes());
  at::Tensor y = x.new_empty({rows, n});
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t stride = x.stride(0);
  const float fe = static_cast<float>(eps);
  // rows are independent; below ~64 rows one thread is cheaper than waking the others
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      rms_row(xp + r * stride, wp, fe, n, yp + r * n);
    }
  });
  return y;
}
