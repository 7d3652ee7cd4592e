// The paged decode attention's inner pieces (one (request, kv heads) item: online softmax over
// the request's blocks), shared by paged_decode (paged_attention.cpp, layouts and notes there)
// and the packed models' fused decoder layer (models/quant/cpu_kernels/fused_layer.cpp).
#pragma once

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#endif

namespace {

using pdserve_kernels::to_f32;
#ifdef PDSERVE_AVX2
using pdserve_kernels::load8;
#endif

#ifdef PDSERVE_AVX2

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp for x <= 0 (scores minus their running max): Cephes expf (range reduction to
// [-ln2/2, ln2/2] and a degree-5 polynomial, ~1 ulp). Inputs below -87 clamp to ~1e-38, which
// is 0 for any softmax weight that matters.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}

#endif  // PDSERVE_AVX2

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef PDSERVE_AVX2
  // two accumulators: head_dim 64/128 is 8/16 vectors, enough to hide the FMA latency
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8)
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), s0);
  s = hsum(_mm256_add_ps(s0, s1));
#endif
  for (; i < n; ++i) s += a[i] * to_f32(b[i]);
  return s;
}

// y[0:n] += a * x[0:n]
template <typename T>
inline void axpy(float* y, float a, const T* x, int64_t n) {
  int64_t i = 0;
#ifdef PDSERVE_AVX2
  const __m256 av = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, load8(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * to_f32(x[i]);
}

#ifndef PDSERVE_PF_LOCALITY  // 3: into L1 (2, into L2 only, ran 0.96-0.98x there)
#define PDSERVE_PF_LOCALITY 3
#endif
#ifndef PDSERVE_K_SPREAD  // the QK pass's prefetches spread over its loop (see kVInPv below)
#define PDSERVE_K_SPREAD 1
#endif
constexpr bool kKSpread = PDSERVE_K_SPREAD;
constexpr int64_t kLineBytes = 64;
template <typename T>
constexpr int64_t kLineElems = kLineBytes / sizeof(T);  // elements per cache line

// Ask for the cache lines of one d-element row (a GCC/Clang builtin: no ISA dependence).
template <typename T>
inline void prefetch_row(const T* row, int64_t d) {
  for (int64_t i = 0; i < d; i += kLineElems<T>)
    __builtin_prefetch(row + i, 0, PDSERVE_PF_LOCALITY);
}

inline void scale_inplace(float* y, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// max(x[0:n]), n >= 1: the value std::max_element finds (max is exact in any order), but 8 lanes
// at a time; std::max_element's scalar compare chain cost ~1-2 cycles per score, for every
// (query head, token) of a decode.
inline float max_of(const float* x, int64_t n) {
  int64_t i = 0;
  float mx = -std::numeric_limits<float>::infinity();
#ifdef PDSERVE_AVX2
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    mx = _mm_cvtss_f32(h);
  }
#endif
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// x[0:n] = exp(x[0:n] - m); returns the sum of the results.
inline float exp_sub_sum(float* x, float m, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef PDSERVE_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  return sum;
}

#ifdef __AVX512F__
using pdserve_kernels::load16;

// Lane j of the result = the sum of a[j]'s 16 lanes.
inline __m256 reduce8x16(const __m512* a) {
  __m256 h[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
    h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of 8 tokens against GC <= 3 queries, 16 lanes of d at a time: each K vector is loaded
// and widened once for all GC queries (8 * GC accumulators + GC queries fit the 32 registers;
// qk4_avx2 is the same for 4 tokens in 16). sc[g * sc_stride + j] = q[g] . k[j].
template <int GC, typename T>
inline void qk8_avx512(const float* q, int64_t d, const T* kt, int64_t row_stride, float* sc,
                       int64_t sc_stride) {
  __m512 a[GC][8];
#pragma GCC unroll 8
  for (int g = 0; g < GC; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) a[g][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    __m512 qv[GC];
#pragma GCC unroll 8
    for (int g = 0; g < GC; ++g) qv[g] = _mm512_loadu_ps(q + g * d + c);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512 kv = load16(kt + j * row_stride + c);
#pragma GCC unroll 8
      for (int g = 0; g < GC; ++g) a[g][j] = _mm512_fmadd_ps(qv[g], kv, a[g][j]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < GC; ++g) _mm256_storeu_ps(sc + g * sc_stride, reduce8x16(a[g]));
}
#endif

#ifdef PDSERVE_AVX2
// Scores of 4 tokens against GC <= 3 queries, 8 lanes of d at a time: each K vector is loaded
// and widened once for all GC queries. 4 * GC accumulators, GC queries and one K vector fill at
// most the 16 registers. Why not 8 tokens per query, one query at a time: that widened each K
// vector once per query (3x for SmolLM2's groups), and on a 128-bit datapath (Zen 1) a bf16
// widening costs as many micro-ops as the FMA it feeds. sc[g * sc_stride + j] = q[g] . k[j].
template <int GC, typename T>
inline void qk4_avx2(const float* q, int64_t d, const T* kt, int64_t row_stride, float* sc,
                     int64_t sc_stride, const T* pfa, const T* pfb) {
  constexpr int64_t kLine = kLineElems<T>;
  __m256 a[GC][4];
#pragma GCC unroll 4
  for (int g = 0; g < GC; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) a[g][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    if (c % kLine == 0) {  // the same 4 rows' line at c of the blocks ahead, spread over c
      for (int j = 0; j < 4; ++j) {
        if (pfa) __builtin_prefetch(pfa + j * row_stride + c, 0, PDSERVE_PF_LOCALITY);
        if (pfb) __builtin_prefetch(pfb + j * row_stride + c, 0, PDSERVE_PF_LOCALITY);
      }
    }
    __m256 qv[GC];
#pragma GCC unroll 4
    for (int g = 0; g < GC; ++g) qv[g] = _mm256_loadu_ps(q + g * d + c);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = load8(kt + j * row_stride + c);
#pragma GCC unroll 4
      for (int g = 0; g < GC; ++g) a[g][j] = _mm256_fmadd_ps(qv[g], kv, a[g][j]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GC; ++g) {
    // lanes 0-3 of u = the sums of a[g][0..3]'s lanes 0-3, lanes 4-7 those of lanes 4-7
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]),
                                    _mm256_hadd_ps(a[g][2], a[g][3]));
    _mm_storeu_ps(sc + g * sc_stride,
                  _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  }
}
#endif

// Scores of nt consecutive tokens of one block against the G queries:
// sc[g * sc_stride + t] = q[g] . k[t], K rows row_stride apart. Also prefetches the same rows
// of the blocks at pf_a and pf_b (either may be null) for the caller.
template <typename T>
void qk_block(const float* q, int64_t group, int64_t d, const T* k, int64_t row_stride,
              int64_t nt, float* sc, int64_t sc_stride, const T* pf_a, const T* pf_b) {
  int64_t t = 0;
#ifdef __AVX512F__
  if (d % 16 == 0) {  // 8 tokens at a time, queries in chunks of 3 (qk8_avx512)
    for (; t + 8 <= nt; t += 8) {
      for (int64_t j = t; j < t + 8; ++j) {
        if (pf_a) prefetch_row(pf_a + j * row_stride, d);
        if (pf_b) prefetch_row(pf_b + j * row_stride, d);
      }
      const T* kt = k + t * row_stride;
      for (int64_t g = 0; g < group; g += 3) {
        const float* qg = q + g * d;
        float* sg = sc + g * sc_stride + t;
        switch (std::min<int64_t>(3, group - g)) {
          case 1: qk8_avx512<1>(qg, d, kt, row_stride, sg, sc_stride); break;
          case 2: qk8_avx512<2>(qg, d, kt, row_stride, sg, sc_stride); break;
          default: qk8_avx512<3>(qg, d, kt, row_stride, sg, sc_stride); break;
        }
      }
    }
  }
#endif
#ifdef PDSERVE_AVX2
  // 4 tokens at a time, queries in chunks of 3 (qk4_avx2): each K vector widened once for the
  // chunk's queries
  if (d % 8 == 0) {
    for (; t + 4 <= nt; t += 4) {
      const T* pa = pf_a ? pf_a + t * row_stride : nullptr;
      const T* pb = pf_b ? pf_b + t * row_stride : nullptr;
      if (!kKSpread) {
        for (int64_t j = 0; j < 4; ++j) {
          if (pa) prefetch_row(pa + j * row_stride, d);
          if (pb) prefetch_row(pb + j * row_stride, d);
        }
        pa = pb = nullptr;
      }
      const T* kt = k + t * row_stride;
      for (int64_t g = 0; g < group; g += 3) {
        const float* qg = q + g * d;
        float* sg = sc + g * sc_stride + t;
        const T* ga = g == 0 ? pa : nullptr;
        const T* gb = g == 0 ? pb : nullptr;
        switch (std::min<int64_t>(3, group - g)) {
          case 1: qk4_avx2<1>(qg, d, kt, row_stride, sg, sc_stride, ga, gb); break;
          case 2: qk4_avx2<2>(qg, d, kt, row_stride, sg, sc_stride, ga, gb); break;
          default: qk4_avx2<3>(qg, d, kt, row_stride, sg, sc_stride, ga, gb); break;
        }
      }
    }
  }
#endif
  for (; t < nt; ++t) {
    if (pf_a) prefetch_row(pf_a + t * row_stride, d);
    if (pf_b) prefetch_row(pf_b + t * row_stride, d);
    for (int64_t g = 0; g < group; ++g)
      sc[g * sc_stride + t] = dot(q + g * d, k + t * row_stride, d);
  }
}

#ifdef PDSERVE_AVX2
// acc[g][c, c + 8 U) += sum_t p[g, t] * v[t][c, c + 8 U) for GC query heads, for each c from
// *c in steps of 8 U while the pass fits d (*c left at the first column not done): U * GC
// accumulators stay in registers over the tokens, each V vector is loaded once for all heads
// and each weight broadcast once per 8 U lanes. Why U > 1: an FMA's latency is 4-5 cycles, so
// with U = 1 and 3 heads the FMA units idled ~40% of the time. Every output element is the same
// sum in the same order whatever U.
template <int GC, int U, typename T>
void pv_lanes(float* acc, int64_t d, int64_t* c, const float* p, int64_t p_stride, const T* v,
              int64_t row_stride, int64_t nt, const T* pf) {
  constexpr int64_t kLine = kLineElems<T>;
  for (; *c + 8 * U <= d; *c += 8 * U) {
    float* out = acc + *c;
    const T* vc = v + *c;
    const T* pfc = pf ? pf + *c : nullptr;
    __m256 a[U][GC];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
      for (int g = 0; g < GC; ++g) a[u][g] = _mm256_loadu_ps(out + g * d + 8 * u);
    for (int64_t t = 0; t < nt; ++t) {
      if (pfc)  // the same lanes of a later block's row t: one or two lines per 12 FMAs
        for (int64_t i = 0; i < 8 * U; i += kLine)
          __builtin_prefetch(pfc + t * row_stride + i, 0, PDSERVE_PF_LOCALITY);
      if constexpr (U == 1) {  // up to 8 heads: each weight broadcast where it is used
        const __m256 vv = load8(vc + t * row_stride);
#pragma GCC unroll 8
        for (int g = 0; g < GC; ++g)
          a[0][g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * p_stride + t), vv, a[0][g]);
      } else {
        __m256 pw[GC];
#pragma GCC unroll 8
        for (int g = 0; g < GC; ++g) pw[g] = _mm256_broadcast_ss(p + g * p_stride + t);
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
          const __m256 vv = load8(vc + t * row_stride + 8 * u);
#pragma GCC unroll 8
          for (int g = 0; g < GC; ++g) a[u][g] = _mm256_fmadd_ps(pw[g], vv, a[u][g]);
        }
      }
    }
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
      for (int g = 0; g < GC; ++g) _mm256_storeu_ps(out + g * d + 8 * u, a[u][g]);
  }
}

// acc[g] += sum_t p[g, t] * v[t] for GC query heads, d a multiple of 8: the widest pass whose
// accumulators, weights and one V vector fit the 16 registers (32 lanes with GC <= 3, 16 with
// GC <= 4), then 8 lanes for what is left.
template <int GC, typename T>
void pv_chunk(float* acc, int64_t d, const float* p, int64_t p_stride, const T* v,
              int64_t row_stride, int64_t nt, const T* pf) {
  int64_t c = 0;
  if constexpr (GC <= 3) pv_lanes<GC, 4>(acc, d, &c, p, p_stride, v, row_stride, nt, pf);
  if constexpr (GC <= 4) pv_lanes<GC, 2>(acc, d, &c, p, p_stride, v, row_stride, nt, pf);
  pv_lanes<GC, 1>(acc, d, &c, p, p_stride, v, row_stride, nt, pf);
}
#endif

#ifdef __AVX512F__
// acc columns [c0, c0 + 16 NC) for GC query heads over nt tokens: NC 16-lane chunks of each V
// row at once, so GC * NC accumulators are in flight (each token's FMAs into one accumulator
// wait on the previous token's). Bit-equal to one chunk at a time (each element still sums its
// tokens in order). On an Intel Xeon (session 25, bench/attention_ab.py, B 64, 11 rounds) four
// chunks ran 1.04-1.08x (fp32, bf16, fp16 caches, contexts 320 and 1024); on the Zen 5
// (session 23) 1.01-1.06x fp32 and 0.98-0.99x bf16.
template <int GC, int NC, typename T>
inline void pv_cols16(float* acc, int64_t d, int64_t c0, const float* p, int64_t p_stride,
                      const T* v, int64_t row_stride, int64_t nt, const T* pf) {
  constexpr int64_t kLine = kLineElems<T>;
  __m512 a[GC][NC];
#pragma GCC unroll 8
  for (int g = 0; g < GC; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) a[g][j] = _mm512_loadu_ps(acc + g * d + c0 + 16 * j);
  for (int64_t t = 0; t < nt; ++t) {
    __m512 vv[NC];
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) {
      const int64_t c = c0 + 16 * j;
      if (pf != nullptr && c % kLine == 0)  // each line of the rows once
        __builtin_prefetch(pf + t * row_stride + c, 0, PDSERVE_PF_LOCALITY);
      vv[j] = load16(v + t * row_stride + c);
    }
#pragma GCC unroll 8
    for (int g = 0; g < GC; ++g) {
      const __m512 pb = _mm512_set1_ps(p[g * p_stride + t]);
#pragma GCC unroll 4
      for (int j = 0; j < NC; ++j) a[g][j] = _mm512_fmadd_ps(pb, vv[j], a[g][j]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < GC; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) _mm512_storeu_ps(acc + g * d + c0 + 16 * j, a[g][j]);
}

// pv_chunk with 16 lanes of d at a time: half the loads, widenings and FMAs per V row; up to
// four chunks of a row at once where the accumulators fit the 32 registers (GC <= 3).
template <int GC, typename T>
void pv_chunk16(float* acc, int64_t d, const float* p, int64_t p_stride, const T* v,
                int64_t row_stride, int64_t nt, const T* pf) {
  int64_t c = 0;
  if constexpr (GC <= 3)
    for (; c + 64 <= d; c += 64) pv_cols16<GC, 4>(acc, d, c, p, p_stride, v, row_stride, nt, pf);
  for (; c < d; c += 16) pv_cols16<GC, 1>(acc, d, c, p, p_stride, v, row_stride, nt, pf);
}
#endif

// f(std::integral_constant<int, n>{}) for n in 1..8: a runtime group count as a template one.
template <typename F>
inline void with_group_count(int64_t n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// acc[g] (d floats each) += sum_t p[g * p_stride + t] * v[t], V rows row_stride apart.
template <typename T>
void pv_block(float* acc, int64_t group, int64_t d, const float* p, int64_t p_stride,
              const T* v, int64_t row_stride, int64_t nt, const T* pf) {
#ifdef PDSERVE_AVX2  // (the AVX-512 builds are AVX2 builds too: cpu_native.compile_flags)
  if (d % 8 == 0) {
    for (int64_t g0 = 0; g0 < group; g0 += 8) {
      float* a = acc + g0 * d;
      const float* pg = p + g0 * p_stride;
      with_group_count(std::min<int64_t>(8, group - g0), [&](auto gc) {
        constexpr int GC = decltype(gc)::value;
#ifdef __AVX512F__
        if (d % 16 == 0) {
          pv_chunk16<GC>(a, d, pg, p_stride, v, row_stride, nt, g0 == 0 ? pf : nullptr);
          return;
        }
#endif
        pv_chunk<GC>(a, d, pg, p_stride, v, row_stride, nt, g0 == 0 ? pf : nullptr);
      });
    }
    return;
  }
#endif
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t g = 0; g < group; ++g)
      axpy(acc + g * d, p[g * p_stride + t], v + t * row_stride, d);
}

template <typename T>  // the cache's element type
struct DecodeProblem {
  const float* query;
  int64_t q_row_stride;  // elements between requests' query rows
  const T* k_cache;      // [NB, bs, kvh, d]
  const T* v_cache;
  const int32_t* block_tables;  // [D, W]
  const int32_t* seq_lens;      // [D]
  float* out;                   // [D, H, d]
  int64_t num_heads, num_kv_heads, head_dim, block_size, table_width;
  float scale;
};

// Prefetch distances in blocks. On the 2-core Zen 5 VM (B 64, context 320, in one process
// against main's 3 / 2, docs/half-precision.md) 2 / 1 ran 1.10x (bf16 KV) and 1.14x (fp32)
// faster, 5 / 4 ~0.9x: a block is 6-12 KB per request, so further ahead only fills the miss
// queue with lines not needed yet. PDSERVE_K_AHEAD / PDSERVE_V_AHEAD override them at build time
// (-D) for such comparisons.
#ifndef PDSERVE_K_AHEAD
#define PDSERVE_K_AHEAD 2
#endif
#ifndef PDSERVE_V_AHEAD
#define PDSERVE_V_AHEAD 1
#endif
// Where V's prefetches go. A tile runs a QK pass (K rows), the softmax, then a PV pass (V rows,
// already cached). With V prefetched in the QK pass beside K, that pass carried all the tile's
// memory traffic and the PV pass and the softmax none, so on the Zen 1 the kernel took the sum
// of its arithmetic and of its reads (docs/half-precision.md). PDSERVE_V_IN_PV moves V's
// prefetches into the PV pass (V kVAhead blocks ahead of the block it multiplies, a line or two
// per 12 FMAs), and PDSERVE_K_SPREAD spreads the QK pass's over its loop instead of a burst
// per 4 tokens. On the Zen 1 (bench/attention_ab.py, B 64, context 320, 2 threads, 7-9
// alternated rounds): 1.06-1.10x fp32 and bf16 KV, bit-equal; K moved into the PV pass as well
// ran 0.99x. The AVX-512 builds keep V in the QK pass (tuned on the Zen 5, not remeasured).
#ifndef PDSERVE_V_IN_PV
#ifdef __AVX512F__
#define PDSERVE_V_IN_PV 0
#else
#define PDSERVE_V_IN_PV 1
#endif
#endif
constexpr int64_t kKAhead = PDSERVE_K_AHEAD, kVAhead = PDSERVE_V_AHEAD;
constexpr bool kVInPv = PDSERVE_V_IN_PV;

// Tile reads (the AVX2 and scalar builds): before a tile's arithmetic, one tight loop loads
// every cache line of the tile's K and V blocks (the item's heads), asking first for one line
// per 4 KB page of the block after each (so its page walk and the hardware's stream start
// early); the per-line prefetches above are then off. Why: with those prefetches the kernel ran
// at ~12 GB/s on 2 threads, about the sum of its reads and its arithmetic, where a plain loop of
// loads over the same scattered blocks read 12-17 GB/s on one thread; reading each 6-12 KB
// block front to back, back to back, lets the hardware prefetcher stream it, and the QK and PV
// passes then find the tile in L2 (fp32: 96 KB at 64 tokens). On the Zen 3 (AVX2;
// bench/attention_ab.py, 2 threads, 5-7 alternated rounds, bit-equal), B 64: fp32 KV
// 1.09-1.24x, fp16 1.08-1.34x, bf16 0.99-1.08x; in the engine's batch-64 step
// (bench/attention_engine_ab.py) the fp32 cache's attention 1.15-1.18x, the half caches'
// within the VM's spread (docs/half-precision.md). The AVX-512 builds keep the prefetches: on
// the Zen 5 (bench/attention_ab.py with -DPDSERVE_TILE_READ=1 in b, B 64, 7 rounds, bit-equal)
// tile reads ran 0.74-0.96x fp32 KV and 0.67-0.78x half KV. There the prefetched kernel
// already reads at 57-80 GB/s, so a serial read pass only adds its own time.
#ifndef PDSERVE_TILE_READ
#ifdef __AVX512F__
#define PDSERVE_TILE_READ 0
#else
#define PDSERVE_TILE_READ 1
#endif
#endif
constexpr bool kTileRead = PDSERVE_TILE_READ;
constexpr int64_t kPageBytes = 4096;

// Loads the first byte of every cache line of [p, p + bytes) and returns them OR-ed (so the
// loads are not dropped): the line reads go out back to back. One byte: never past the range.
inline uint32_t read_lines(const void* p, int64_t bytes) {
  const uint8_t* c = static_cast<const uint8_t*>(p);
  uint32_t acc = 0;
  for (int64_t i = 0; i < bytes; i += kLineBytes) acc |= c[i];
  return acc;
}

// One prefetch (into L2) per kPageBytes of [p, p + bytes).
inline void prefetch_pages(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += kPageBytes) __builtin_prefetch(c + i, 0, 1);
}

// Per-thread scratch, reused across the items a thread runs; sized for all H query heads.
struct Scratch {
  std::vector<float> q, acc, scores, m, l;  // [H, d], [H, d], [H, tile], [H], [H]
  Scratch(int64_t heads, int64_t d, int64_t tile)
      : q(heads * d), acc(heads * d), scores(heads * tile), m(heads), l(heads) {}
};

// Request r's context tokens [tok0, tok1) (tok0 a multiple of the block size), kv heads [h0, h1)
// (query heads h0*G .. h1*G-1): online softmax over tiles of whole blocks, leaving the running
// max, sum and unnormalised output of the item's query heads in s.m [nh], s.l [nh] and
// s.acc [nh, d] (an empty range leaves -inf, 0 and 0). The kv-head loop sits inside the block
// loop so that, with the whole range, a block's K (then V) is read front to back,
// bs * kvh * d contiguous floats, which the hardware prefetcher and DRAM pages like better than
// one head's strided rows.
template <typename T>
void decode_range(const DecodeProblem<T>& p, int64_t r, int64_t h0, int64_t h1, int64_t tok0,
                  int64_t tok1, int64_t tile_blocks, Scratch& s) {
  const int64_t d = p.head_dim, bs = p.block_size, kvh = p.num_kv_heads;
  const int64_t group = p.num_heads / kvh;
  const int64_t nh = (h1 - h0) * group;  // query heads of this item
  const int64_t tile = tile_blocks * bs;
  const int32_t* table = p.block_tables + r * p.table_width;
  const int64_t row_stride = kvh * d;  // between consecutive tokens of one kv head in a block

  // the item's query heads are contiguous
  const float* q_in = p.query + r * p.q_row_stride + h0 * group * d;
  float* q = s.q.data();
  float* acc = s.acc.data();
  float* sc = s.scores.data();
  float* m = s.m.data();
  float* l = s.l.data();
  for (int64_t i = 0; i < nh * d; ++i) q[i] = q_in[i] * p.scale;
  std::fill(acc, acc + nh * d, 0.f);
  std::fill(m, m + nh, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nh, 0.f);

  const int64_t num_used = (tok1 + bs - 1) / bs;
  const int64_t block_elems = bs * kvh * d;
  auto k_block = [&](int64_t b) { return p.k_cache + table[b] * block_elems; };
  auto v_block = [&](int64_t b) { return p.v_cache + table[b] * block_elems; };
  auto prefetch_block = [&](const T* block) {
    for (int64_t t = 0; t < bs; ++t)
      for (int64_t h = h0; h < h1; ++h) prefetch_row(block + t * row_stride + h * d, d);
  };
  // the bytes from the item's first head of a block's first token to its last head of its last
  const int64_t item_bytes = ((bs - 1) * row_stride + (h1 - h0) * d) * int64_t(sizeof(T));
  const int64_t first = tok0 / bs;
  const int64_t k_ahead_blocks = kTileRead ? 0 : kKAhead, v_ahead_blocks = kTileRead ? 0 : kVAhead;
  for (int64_t b = first; b < std::min(first + k_ahead_blocks, num_used); ++b)
    prefetch_block(k_block(b));
  for (int64_t b = first; b < std::min(first + v_ahead_blocks, num_used); ++b)
    prefetch_block(v_block(b));
  uint32_t read_sink = 0;
  for (int64_t start = tok0; start < tok1; start += tile) {
    const int64_t n = std::min(tile, tok1 - start);
    if (kTileRead) {
      for (int64_t b = start / bs; b < (start + n + bs - 1) / bs; ++b) {
        if (b + 1 < num_used) {
          prefetch_pages(k_block(b + 1) + h0 * d, item_bytes);
          prefetch_pages(v_block(b + 1) + h0 * d, item_bytes);
        }
        read_sink |= read_lines(k_block(b) + h0 * d, item_bytes);
        read_sink |= read_lines(v_block(b) + h0 * d, item_bytes);
      }
    }
    // scores [nh, n]: each K row is loaded once for all G queries of its group (L1-hot after the
    // first). Without tile reads: pages are scattered and too short for the hardware
    // prefetcher to get ahead, so prefetch K kKAhead blocks and V kVAhead blocks ahead (the
    // first ones before the loop).
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
      const int64_t b = (start + t0) / bs;
      const T* k = k_block(b);
      const T* k_ahead = !kTileRead && b + kKAhead < num_used ? k_block(b + kKAhead) : nullptr;
      const T* v_ahead =
          !kTileRead && !kVInPv && b + kVAhead < num_used ? v_block(b + kVAhead) : nullptr;
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t j = (h - h0) * group;
        qk_block(q + j * d, group, d, k + h * d, row_stride, std::min(bs, n - t0),
                 sc + j * tile + t0, tile, k_ahead ? k_ahead + h * d : nullptr,
                 v_ahead ? v_ahead + h * d : nullptr);
      }
    }
    // online softmax: rescale the running sums only when the max grows
    for (int64_t j = 0; j < nh; ++j) {
      float* sj = sc + j * tile;
      const float mx = max_of(sj, n);
      if (mx > m[j]) {
        const float alpha = std::exp(m[j] - mx);  // exp(-inf) = 0 on the first tile
        scale_inplace(acc + j * d, alpha, d);
        l[j] *= alpha;
        m[j] = mx;
      }
      l[j] += exp_sub_sum(sj, m[j], n);
    }
    // acc[j] += sum_t p[j, t] * V[t]: each V row loaded once for all G heads of its group
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
      const int64_t b = (start + t0) / bs;
      const T* v = v_block(b);
      const T* v_ahead =
          !kTileRead && kVInPv && b + kVAhead < num_used ? v_block(b + kVAhead) : nullptr;
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t j = (h - h0) * group;
        pv_block(acc + j * d, group, d, sc + j * tile + t0, tile, v + h * d, row_stride,
                 std::min(bs, n - t0), v_ahead ? v_ahead + h * d : nullptr);
      }
    }
  }
  asm volatile("" : : "r"(read_sink));  // the tile reads' loads stay in the build
}

// Request r, kv heads [h0, h1), its whole context, normalised into p.out.
template <typename T>
void decode_item(const DecodeProblem<T>& p, int64_t r, int64_t h0, int64_t h1, int64_t tile_blocks,
                 Scratch& s) {
  decode_range(p, r, h0, h1, 0, p.seq_lens[r], tile_blocks, s);
  const int64_t d = p.head_dim, group = p.num_heads / p.num_kv_heads;
  float* o = p.out + (r * p.num_heads + h0 * group) * d;
  for (int64_t j = 0; j < (h1 - h0) * group; ++j) {
    const float inv = 1.f / s.l[j];
    for (int64_t i = 0; i < d; ++i) o[j * d + i] = s.acc[j * d + i] * inv;
  }
}

// One decode request (batch 1) runs as kDecodeParts block-aligned parts of its context, each
// over every kv head, merged after (split-KV, as flash-decoding does on GPUs). Why: by kv head
// SmolLM2's 3 heads left one of 2 threads idle for a third of every layer's attention, and a
// part reads whole blocks front to back. On the Zen 5 the batch-1 step ran 1.068x faster, in
// one process against the kernels before (bench/kernel_ab.py, docs/packed-weights.md). The parts are fixed, not one per thread, so the result is the
// same at any thread count, and every decode path (paged_decode, the fused packed layer) splits
// and merges alike: their outputs stay equal.
constexpr int64_t kDecodeParts = 2;

// The first context token of part `part` of a request of len tokens (part kDecodeParts: len).
inline int64_t part_start(int64_t len, int64_t bs, int64_t part) {
  return part >= kDecodeParts ? len : (len * part / kDecodeParts) / bs * bs;
}

// Each part's softmax partials for all H query heads: m, l [P, H]; acc [P, H, d].
struct DecodeParts {
  float *m, *l, *acc;
  static int64_t floats(int64_t heads, int64_t d) { return kDecodeParts * heads * (d + 2); }
  DecodeParts(float* buf, int64_t heads, int64_t d)
      : m(buf), l(buf + kDecodeParts * heads), acc(buf + 2 * kDecodeParts * heads) {}
};

// Part `part` of request r (every kv head) into parts' slots.
template <typename T>
void decode_part(const DecodeProblem<T>& p, int64_t r, int64_t part, int64_t tile_blocks,
                 Scratch& s, const DecodeParts& parts) {
  const int64_t len = p.seq_lens[r], H = p.num_heads, d = p.head_dim;
  decode_range(p, r, 0, p.num_kv_heads, part_start(len, p.block_size, part),
               part_start(len, p.block_size, part + 1), tile_blocks, s);
  std::copy(s.m.begin(), s.m.begin() + H, parts.m + part * H);
  std::copy(s.l.begin(), s.l.begin() + H, parts.l + part * H);
  std::copy(s.acc.begin(), s.acc.begin() + H * d, parts.acc + part * H * d);
}

// Parts [part0, part1) of request r on the calling thread (one scratch for them all).
template <typename T>
void decode_parts(const DecodeProblem<T>& p, int64_t r, int64_t part0, int64_t part1,
                  int64_t tile_blocks, const DecodeParts& parts) {
  Scratch scratch(p.num_heads, p.head_dim, tile_blocks * p.block_size);
  for (int64_t part = part0; part < part1; ++part)
    decode_part(p, r, part, tile_blocks, scratch, parts);
}

// Query heads [j0, j1) of the merged parts, normalised into out [H, d] (parts in order; an
// empty part weighs exp(-inf) = 0).
inline void merge_parts(const DecodeParts& parts, int64_t H, int64_t d, int64_t j0, int64_t j1,
                        float* out) {
  for (int64_t j = j0; j < j1; ++j) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t q = 0; q < kDecodeParts; ++q) mx = std::max(mx, parts.m[q * H + j]);
    float w[kDecodeParts], l = 0.f;
    for (int64_t q = 0; q < kDecodeParts; ++q) {
      w[q] = std::exp(parts.m[q * H + j] - mx);
      l += parts.l[q * H + j] * w[q];
    }
    const float inv = 1.f / l;
    for (int64_t i = 0; i < d; ++i) {
      float a = 0.f;
      for (int64_t q = 0; q < kDecodeParts; ++q) a += parts.acc[(q * H + j) * d + i] * w[q];
      out[j * d + i] = a * inv;
    }
  }
}

}  // namespace
