// exp in fp32 for the native kernels (sampling weights, the fused SiLU): Cody-Waite reduction
// x = n ln2 + r (|r| <= ln2 / 2) and Cephes' degree-7 polynomial, within 2 ulp of the exact
// value (measured on [-87, 0]: at most 1.02 ulp over 5 million points, all three builds;
// torch's Sleef exp 0.56), exactly 1 at 0. Valid for x in [-87, 88]: callers clamp first, so
// 2^n stays a normal float (exp(-87) = 1.65e-38 > 1.18e-38; subnormal results run ~25x
// slower). exp_scalar is the twin of the vector versions: the same n, the same polynomial, the
// same fused multiply-adds where the build has FMA, so a row's vector body and scalar tail agree.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve_exp {

constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f;  // ln2 split so n * LN2_HI is exact for |n| < 2^9
constexpr float LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f,
                P3 = 4.1665795894e-2f, P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;
constexpr float X_MIN = -87.f, X_MAX = 88.f;  // the valid range

inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);  // one instruction with -mfma
#else
  return a * b + c;  // no FMA unit: a libm fma would be a slow call
#endif
}

// exp(x) for x in [X_MIN, X_MAX]
inline float exp_scalar(float x) {
  const float magic = 12582912.f;  // 1.5 * 2^23: adding and subtracting rounds to an integer
  const float n = (x * LOG2E + magic) - magic;
  float r = madd(n, -LN2_HI, x);
  r = madd(n, -LN2_LO, r);
  float p = madd(madd(madd(madd(madd(P0, r, P1), r, P2), r, P3), r, P4), r, P5);
  p = madd(p * r, r, r) + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef __AVX512F__
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(P0), r, _mm512_set1_ps(P1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P5));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);  // p * 2^n, exact (n >= -126: a normal result)
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(P0), r, _mm256_set1_ps(P1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));  // 2^n built in the exponent field
}
#endif

}  // namespace pdserve_exp
