// Declarations shared by the native CPU kernels' translation units (built together into one
// module by pdserve/common/attention/cpu_native.py).
//
// Only ATen's tensor and parallel_for headers here (outputs come from Tensor::new_empty):
// torch's Python headers cost ~30 s of compile time per translation unit (<torch/python.h>;
// <torch/extension.h>, which adds all of torch's C++ API, ~45 s), so only the bindings
// (bindings.cpp) include them, and only <torch/python.h>.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve_kernels {

// KV cache element types: fp32, bf16, fp16. The kernels keep K/V in the cache's type and widen
// each element to fp32 when it is loaded (in registers), so all arithmetic stays fp32.
inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) {  // bf16 is the top half of an fp32: widening is exact
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_f32(c10::Half x) { return static_cast<float>(x); }  // exact
// fp32 -> cache type, rounding to nearest even (c10's conversions, as torch's .to() does)
template <typename T>
inline T from_f32(float x) { return static_cast<T>(x); }

#if defined(__AVX2__) && defined(__FMA__)
// 8 consecutive cache elements widened to fp32
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(f);
#endif
}
#endif

#ifdef __AVX512F__
// 16 consecutive cache elements widened to fp32 (bf16: zero-extend and shift, exact; fp16:
// vcvtph2ps, exact)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// dst[0:n] = src[0:n] widened to fp32 (16 or 8 at a time where the build has the vectors)
template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#endif
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = to_f32(src[i]);
}

// Runs f(T{}) with T the C++ type of a KV cache of scalar type t (fp32, bf16 or fp16).
template <typename F>
void dispatch_kv(const char* fn, at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default:
      TORCH_CHECK_VALUE(false, fn, ": kv_cache must be float32, bfloat16 or float16, got ", t);
  }
}

// Checks up front (serially, before any thread starts) so bad metadata is a ValueError, never an
// out-of-bounds read.
inline void check_metadata(const int32_t* tables, const int32_t* lens, int64_t num_reqs,
                           int64_t width, int64_t block_size, int64_t num_blocks) {
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t len = lens[r];
    TORCH_CHECK_VALUE(len >= 1 && len <= width * block_size, "seq_lens[", r, "] = ", len,
                      " must be in [1, ", width * block_size, "] (block table width ", width,
                      " x block size ", block_size, ")");
    const int64_t used = (len + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t id = tables[r * width + b];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_tables[", r, ", ", b, "] = ", id,
                        " is outside the cache's ", num_blocks, " blocks");
    }
  }
}

// The int32 metadata of a batch of R requests, checked before it is read: block_tables [R, W],
// seq_lens [R], query_start_loc [R + 1] (when given), contiguous CPU tensors, and every used
// block id inside the cache.
inline void check_batch_metadata(const char* fn, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, const at::Tensor* query_start_loc,
                                 int64_t block_size, int64_t num_blocks) {
  for (const at::Tensor* t : {&block_tables, &seq_lens, query_start_loc})
    if (t != nullptr)
      TORCH_CHECK_VALUE(t->scalar_type() == at::kInt && t->is_contiguous() &&
                            t->device().is_cpu(),
                        fn, ": block_tables, seq_lens and query_start_loc must be contiguous "
                        "int32 CPU tensors");
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && block_tables.dim() == 2 &&
                        block_tables.size(0) == seq_lens.size(0) &&
                        (query_start_loc == nullptr ||
                         (query_start_loc->dim() == 1 &&
                          query_start_loc->size(0) == seq_lens.size(0) + 1)),
                    fn, ": block_tables [R, W], seq_lens [R] and query_start_loc [R + 1] "
                    "disagree: ", block_tables.sizes(), ", ", seq_lens.sizes());
  check_metadata(block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                 seq_lens.size(0), block_tables.size(1), block_size, num_blocks);
}

// The prefill chunks of requests first .. R - 1: each non-empty, inside the num_rows query rows
// and no longer than its context (its last token sits at position seq_len - 1).
inline void check_chunks(const char* fn, const int32_t* qsl, const int32_t* lens, int64_t first,
                         int64_t num_reqs, int64_t num_rows) {
  for (int64_t r = first; r < num_reqs; ++r) {
    const int64_t begin = qsl[r], end = qsl[r + 1];
    TORCH_CHECK_VALUE(begin >= 0 && end > begin && end <= num_rows && end - begin <= lens[r],
                      fn, ": request ", r, "'s chunk [", begin, ", ", end,
                      ") must be non-empty, within the ", num_rows,
                      " query rows and no longer than its context ", lens[r]);
  }
}

// heads query heads over kv_heads kv heads (GQA groups of heads / kv_heads)
inline void check_heads(const char* fn, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK_VALUE(kv_heads >= 1 && heads >= 1 && heads % kv_heads == 0, fn, ": heads (",
                    heads, ") must be a positive multiple of kv heads (", kv_heads, ")");
}

}  // namespace pdserve_kernels

// paged_attention.cpp
at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& kv_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        c10::optional<at::Tensor> out_opt, int64_t heads_per_item);

// prefill_attention.cpp
void paged_prefill(const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& query_start_loc, int64_t first_req, double scale,
                   const at::Tensor& out);

// layer_ops.cpp
at::Tensor attention_step(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, int64_t num_decodes, double scale,
                          int64_t num_heads);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

// sampling.cpp
at::Tensor sample_weights(const at::Tensor& logits, const at::Tensor& inv_temp, double floor,
                          double flush);
at::Tensor argmax_rows(const at::Tensor& logits);
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& inv_temp,
                       const at::Tensor& min_p, const at::Tensor& u, double floor,
                       double flush);
at::Tensor sample_top_p_rows(const at::Tensor& logits, const at::Tensor& inv_temp,
                             const at::Tensor& top_p, const at::Tensor& min_p,
                             const at::Tensor& u, double floor, double flush);
