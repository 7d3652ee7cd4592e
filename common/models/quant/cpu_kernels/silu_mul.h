// SiLU-and-mul of a gate/up pair, vectorized (the packed GEMM's fused store, the fused decoder
// layer, and `silu_mul` after a plain GEMM on the large-M path all use it).
#pragma once

#include "../../../attention/cpu_kernels/cephes_exp.h"

#include <cstdint>

namespace pdserve_exp {

// silu(g) = g / (1 + exp(-g)), exp as cephes_exp.h (-g clamped to its range: below -87 the
// quotient is g, above 88 it is ~0 either way). Vectorized because a batch-64 decode step makes
// 3 million of them: with libm's scalar expf they took ~4% of the step on an AVX2 Zen 1.
inline float silu_scalar(float g) {
  float x = -g > X_MIN ? -g : X_MIN;  // NaN -> X_MIN (g stays NaN)
  x = x < X_MAX ? x : X_MAX;
  return g / (1.f + exp_scalar(x));
}

// op[p] = silu(g[p]) * u[p] for p in [p0, p1)
inline void silu_mul_row(const float* g, const float* u, float* op, int64_t p0, int64_t p1) {
  int64_t p = p0;
#if defined(__AVX512F__)
  const __m512 lo = _mm512_set1_ps(X_MIN), hi = _mm512_set1_ps(X_MAX);
  for (; p + 16 <= p1; p += 16) {
    const __m512 gv = _mm512_loadu_ps(g + p);
    const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), lo), hi);
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(x)));
    _mm512_storeu_ps(op + p, _mm512_mul_ps(s, _mm512_loadu_ps(u + p)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 lo = _mm256_set1_ps(X_MIN), hi = _mm256_set1_ps(X_MAX);
  for (; p + 8 <= p1; p += 8) {
    const __m256 gv = _mm256_loadu_ps(g + p);
    const __m256 x = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), lo), hi);
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(x)));
    _mm256_storeu_ps(op + p, _mm256_mul_ps(s, _mm256_loadu_ps(u + p)));
  }
#endif
  for (; p < p1; ++p) op[p] = silu_scalar(g[p]) * u[p];
}

}  // namespace pdserve_exp
