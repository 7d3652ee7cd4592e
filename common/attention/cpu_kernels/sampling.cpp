// Fused temperature sampling (pdserve/common/engine/sample_ops.py is the reference):
//   sample_weights  w = exp((x - max) * inv_temp), clamped and flushed as sample_ops.weights
//   sample_rows     per row: the max, then one pass that makes the weights (min-p applied) and
//                   their 256-wide block sums in float64, then the two-level inverse-CDF pick;
//                   the picked block's weights are made again (same code, same bits) instead of
//                   keeping a [V] weight row, so nothing of V floats is written at all.
// Rows run in parallel. The torch path does the same work in ~8 full-vocabulary tensor passes
// (sub, mul, clamp, exp, threshold, min-p, fp64 block sums), 9-11 ms at 64 x 49,152.
//
// exp: Cody-Waite reduction x = n ln2 + r (|r| <= ln2 / 2) and Cephes' degree-7 polynomial,
// within 2 ulp of the exact value on [-87, 0] (measured: at most 1.02 ulp over 5 million
// points, all three builds; torch's Sleef exp 0.56), exactly 1 at 0, so the top token weighs
// exactly 1 as in the reference. Inputs are clamped at the floor (-87) first, so no result is
// subnormal (exp(-87) = 1.65e-38 > 1.18e-38): subnormal results run ~25x slower.

#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 256;  // tokens per block of the two-level search (sample_ops.BLOCK)
// rows per thread at least: a 49,152-token row takes ~25 us, so a few rows are cheaper on one
// thread than waking the other (and waiting for it on a busy core)
constexpr int64_t GRAIN = 8;

// Cephes expf: exp(r) ~ 1 + r + r^2 P(r) on [-ln2/2, ln2/2]
constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f;  // ln2 split so n * LN2_HI is exact for |n| < 2^9
constexpr float LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f,
                P3 = 4.1665795894e-2f, P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;

// What a row's weights depend on besides its logits.
struct RowParams {
  float max;       // the row's largest logit (NaN if any logit is NaN)
  float inv_temp;  // 1 / temperature, fp32 as the reference multiplies it
  float floor;     // sample_ops.EXP_FLOOR: (x - max) * inv_temp is clamped here before exp
  float flush;     // sample_ops.FLUSH_BELOW: weights at or under it are 0
  float min_p;     // weights under it are 0 (0: no min-p)
};

inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);  // one instruction with -mfma
#else
  return a * b + c;  // no FMA unit: a libm fma would be a slow call
#endif
}

// exp(x) for x in [-87, 0], the scalar twin of the vector versions below
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

inline float weight_scalar(float x, const RowParams& p) {
  float v = (x - p.max) * p.inv_temp;
  v = v > p.floor ? v : p.floor;  // NaN -> the floor -> flushed to 0 (torch keeps a NaN
                                  // weight; both then pick token 0 of such a row)
  const float e = exp_scalar(v);
  return (e > p.flush && e >= p.min_p) ? e : 0.f;
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

// w[0:n] = the weights of logits x[0:n]; returns their sum in float64. The same call on the
// same slice gives the same bits (the pick relies on it to make one block's weights again).
double block_weights(const float* x, float* w, int64_t n, const RowParams& p) {
  int64_t i = 0;
  double sum = 0.0;
#ifdef __AVX512F__
  const __m512 mx = _mm512_set1_ps(p.max), it = _mm512_set1_ps(p.inv_temp);
  const __m512 fl = _mm512_set1_ps(p.floor), fb = _mm512_set1_ps(p.flush);
  const __m512 mp = _mm512_set1_ps(p.min_p);
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mx), it);
    v = _mm512_max_ps(v, fl);  // a NaN first operand gives the floor (as weight_scalar)
    const __m512 e = exp16(v);
    const __mmask16 keep = _mm512_cmp_ps_mask(e, fb, _CMP_GT_OQ) &
                           _mm512_cmp_ps_mask(e, mp, _CMP_GE_OQ);
    const __m512 k = _mm512_maskz_mov_ps(keep, e);
    _mm512_storeu_ps(w + i, k);
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(k)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                               _mm512_castps_pd(k), 1))));
  }
  sum = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 mx = _mm256_set1_ps(p.max), it = _mm256_set1_ps(p.inv_temp);
  const __m256 fl = _mm256_set1_ps(p.floor), fb = _mm256_set1_ps(p.flush);
  const __m256 mp = _mm256_set1_ps(p.min_p);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mx), it);
    v = _mm256_max_ps(v, fl);  // a NaN first operand gives the floor (as weight_scalar)
    const __m256 e = exp8(v);
    const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(e, fb, _CMP_GT_OQ),
                                      _mm256_cmp_ps(e, mp, _CMP_GE_OQ));
    const __m256 k = _mm256_and_ps(e, keep);
    _mm256_storeu_ps(w + i, k);
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(k)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(k, 1)));
  }
  double s4[4];
  _mm256_storeu_pd(s4, _mm256_add_pd(lo, hi));
  sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
#endif
  for (; i < n; ++i) {
    w[i] = weight_scalar(x[i], p);
    sum += w[i];
  }
  return sum;
}

// The row's max; NaN if any logit is NaN, as torch's amax: every weight of such a row is then
// 0 here (NaN in torch), and both paths pick its token 0.
float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 vm = _mm512_set1_ps(m);
  __mmask16 un = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    vm = _mm512_max_ps(vm, v);
    un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  m = _mm512_reduce_max_ps(vm);
  nan = un != 0;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 vm = _mm256_set1_ps(m), un = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vm = _mm256_max_ps(vm, v);
    un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float m8[8];
  _mm256_storeu_ps(m8, vm);
  for (float v : m8) m = v > m ? v : m;
  nan = _mm256_movemask_ps(un) != 0;
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// Inverse CDF over non-negative masses [0, m) with their inclusive float64 prefix sums cum:
// the first j with cum[j] > target, or, when rounding puts the target at or past the total,
// the first j reaching the total (the last positive mass), so a zero mass is never picked.
// *before = cum[j - 1] (0 for j = 0). As sample_ops.pick.
int64_t pick(const double* cum, int64_t m, double target, double* before) {
  int64_t j = 0;
  while (j < m && !(cum[j] > target)) ++j;
  if (j == m) {
    j = 0;
    while (j < m - 1 && cum[j] < cum[m - 1]) ++j;
  }
  *before = j > 0 ? cum[j - 1] : 0.0;
  return j;
}

// The first index of the row's max, as torch.argmax: the first NaN if the row has one.
int64_t row_argmax(const float* x, int64_t n) {
  const float m = row_max(x, n);
  if (std::isnan(m)) return std::find_if(x, x + n, [](float v) { return std::isnan(v); }) - x;
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vm, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(eq);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vm = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz(eq);
  }
#endif
  while (i < n && x[i] != m) ++i;
  return i;
}

void check_rows(const char* fn, const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                        logits.device().is_cpu() && logits.stride(1) == 1 &&
                        logits.size(1) >= 1,
                    fn, ": logits must be float32 CPU [n, V] with unit column stride, got ",
                    logits.sizes());
}

// a contiguous CPU tensor of n values of type t (any shape: [n] or [n, 1])
void check_per_row(const char* fn, const char* what, const at::Tensor& t, at::ScalarType type,
                   int64_t n) {
  TORCH_CHECK_VALUE(t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu() &&
                        t.numel() == n,
                    fn, ": ", what, " must be a contiguous ", type, " CPU tensor of ", n,
                    " values, got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

// logits [n, V] fp32, inv_temp [n] (or [n, 1]) fp32 -> weights [n, V] fp32 (as
// sample_ops.weights: the top one exactly 1, none subnormal).
at::Tensor sample_weights(const at::Tensor& logits, const at::Tensor& inv_temp, double floor,
                          double flush) {
  check_rows("sample_weights", logits);
  const int64_t n = logits.size(0), v = logits.size(1);
  check_per_row("sample_weights", "inv_temp", inv_temp, at::kFloat, n);
  at::Tensor w = logits.new_empty({n, v});
  const float* xp = logits.data_ptr<float>();
  const float* tp = inv_temp.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, n, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * stride;
      const RowParams p{row_max(x, v), tp[r], static_cast<float>(floor),
                        static_cast<float>(flush), 0.f};
      block_weights(x, wp + r * v, v, p);
    }
  });
  return w;
}

// logits [n, V] fp32, inv_temp and min_p [n] (or [n, 1]) fp32, u [n] fp64 in [0, 1) -> token
// ids [n] int64: each row's token drawn from its weights (sample_ops.weights, then min_p_) by
// inverse CDF at u * total, as sample_ops.sample_rows.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& inv_temp,
                       const at::Tensor& min_p, const at::Tensor& u, double floor,
                       double flush) {
  check_rows("sample_rows", logits);
  const int64_t n = logits.size(0), v = logits.size(1);
  check_per_row("sample_rows", "inv_temp", inv_temp, at::kFloat, n);
  check_per_row("sample_rows", "min_p", min_p, at::kFloat, n);
  check_per_row("sample_rows", "u", u, at::kDouble, n);
  at::Tensor tokens = u.new_empty({n}, u.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  const float* tp = inv_temp.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  const int64_t nb = (v + BLOCK - 1) / BLOCK;
  at::parallel_for(0, n, GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<double> cum(nb);  // per block, then per token of the picked block
    std::vector<float> w(BLOCK);
    std::vector<double> inner(BLOCK);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * stride;
      const RowParams p{row_max(x, v), tp[r], static_cast<float>(floor),
                        static_cast<float>(flush), mp[r]};
      double c = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t len = std::min(BLOCK, v - b * BLOCK);
        c += block_weights(x + b * BLOCK, w.data(), len, p);
        cum[b] = c;
      }
      double before = 0.0;
      const int64_t b = pick(cum.data(), nb, up[r] * c, &before);
      const double rest = up[r] * c - before;
      const int64_t len = std::min(BLOCK, v - b * BLOCK);
      block_weights(x + b * BLOCK, w.data(), len, p);  // the same bits as in the sums
      double ci = 0.0;
      for (int64_t j = 0; j < len; ++j) inner[j] = ci += w[j];
      out[r] = b * BLOCK + pick(inner.data(), len, rest, &before);
    }
  });
  return tokens;
}

// logits [n, V] fp32 -> [n] int64: each row's torch.argmax (greedy rows), two vector passes
// (the max, then its first index) in one call where torch's blocked form took seven ops.
at::Tensor argmax_rows(const at::Tensor& logits) {
  check_rows("argmax_rows", logits);
  const int64_t n = logits.size(0), v = logits.size(1);
  at::Tensor tokens = logits.new_empty({n}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, n, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = row_argmax(xp + r * stride, v);
  });
  return tokens;
}
