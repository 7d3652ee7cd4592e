// Fused temperature sampling (pdserve/common/engine/sample_ops.py is the reference):
//   sample_weights  w = exp((x - max) * inv_temp), clamped and flushed as sample_ops.weights
//   sample_rows     per row: the max, then one pass that makes the weights (min-p applied) and
//                   their 256-wide block sums in float64, then the two-level inverse-CDF pick;
//                   the picked block's weights are made again (same code, same bits) instead of
//                   keeping a [V] weight row, so nothing of V floats is written at all.
//   sample_top_p_rows  per row: the weights into a row buffer (no min-p) and their total, the
//                   top-p floor from a histogram of the mass by weight (32 buckets per octave,
//                   read off the float's bits), only the edge bucket sorted; then the same
//                   two-level pick over the weights at or above max(floor, min_p), in token order.
// Rows run in parallel. The torch path does the same work in ~8 full-vocabulary tensor passes
// (sub, mul, clamp, exp, threshold, min-p, fp64 block sums), 9-11 ms at 64 x 49,152.
//
// exp: cephes_exp.h, exactly 1 at 0, so the top token weighs exactly 1 as in the reference.
// Inputs are clamped at the floor (-87) first, so no result is subnormal.

#include "cephes_exp.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 256;  // tokens per block of the two-level search (sample_ops.BLOCK)
// rows per thread at least: a 49,152-token row takes ~25 us, so a few rows are cheaper on one
// thread than waking the other (and waiting for it on a busy core)
constexpr int64_t GRAIN = 8;

using pdserve_exp::exp_scalar;
#ifdef __AVX512F__
using pdserve_exp::exp16;
#endif
#if defined(__AVX2__) && defined(__FMA__)
using pdserve_exp::exp8;
#endif

// What a row's weights depend on besides its logits.
struct RowParams {
  float max;       // the row's largest logit (NaN if any logit is NaN)
  float inv_temp;  // 1 / temperature, fp32 as the reference multiplies it
  float floor;     // sample_ops.EXP_FLOOR: (x - max) * inv_temp is clamped here before exp
  float flush;     // sample_ops.FLUSH_BELOW: weights at or under it are 0
  float min_p;     // weights under it are 0 (0: no min-p)
};

inline float weight_scalar(float x, const RowParams& p) {
  float v = (x - p.max) * p.inv_temp;
  v = v > p.floor ? v : p.floor;  // NaN -> the floor -> flushed to 0 (torch keeps a NaN
                                  // weight; both then pick token 0 of such a row)
  const float e = exp_scalar(v);
  return (e > p.flush && e >= p.min_p) ? e : 0.f;
}

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

// Histogram buckets of a positive fp32 weight in (0, 1]: its exponent and top 5 mantissa bits,
// monotone in the weight (a positive float's bits order as the float), 32 per octave.
constexpr int KEY_SHIFT = 18;
constexpr int NUM_KEYS = (0x3F800000 >> KEY_SHIFT) + 1;  // the key of 1.0, the top weight

inline int weight_key(float w) {
  uint32_t bits;
  std::memcpy(&bits, &w, sizeof bits);
  return static_cast<int>(bits >> KEY_SHIFT);
}

// The smallest weight of bucket k: its bits are k's, then zeros (0 for bucket 0).
inline float key_weight(int k) {
  const uint32_t bits = static_cast<uint32_t>(k) << KEY_SHIFT;
  float w;
  std::memcpy(&w, &bits, sizeof w);
  return w;
}

// The lightest weight top-p keeps among w[0:n] (non-negative, the top one 1): going from the
// heaviest down, a token is kept while the mass before it is under `limit`; every token tied
// with the lightest kept is kept too (sample_ops.top_p_floor). mass and edge are scratch.
float top_p_floor(const float* w, int64_t n, double limit, std::vector<double>& mass,
                  std::vector<float>& edge) {
  // two interleaved histograms, even and odd tokens, so neighbours in one bucket do not chain
  // their read-add-writes through memory: with one, the loop ran 13.5 ms in some processes and
  // 26.8 in others (62 x 49,152, one Zen 1 thread, the same data); with two, 18.4 in every one
  std::fill(mass.begin(), mass.end(), 0.0);
  double* m0 = mass.data();
  double* m1 = m0 + NUM_KEYS;
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {  // a zero weight adds 0 to bucket 0, which stays empty
    m0[weight_key(w[i])] += w[i];
    m1[weight_key(w[i + 1])] += w[i + 1];
  }
  if (i < n) m0[weight_key(w[i])] += w[i];
  for (int k = 0; k < NUM_KEYS; ++k) m0[k] += m1[k];
  double above = 0.0;  // mass of the buckets heavier than the edge: all kept, under limit
  int e = -1, lowest = -1;
  for (int k = NUM_KEYS - 1; k >= 0; --k) {
    if (mass[k] == 0.0) continue;
    lowest = k;
    if (above + mass[k] >= limit) {
      e = k;
      break;
    }
    above += mass[k];
  }
  if (e < 0) e = lowest;  // rounding left the limit unreached: everything is kept
  edge.clear();
  // bucket e holds the weights in [lo, hi): two compares a value instead of its key
  const float lo = std::max(key_weight(e), std::numeric_limits<float>::denorm_min());  // > 0
  const float hi = key_weight(e + 1);
  i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(w + i);
    int in = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, vlo, _CMP_GE_OQ),
                                              _mm256_cmp_ps(v, vhi, _CMP_LT_OQ)));
    for (; in; in &= in - 1) edge.push_back(w[i + __builtin_ctz(in)]);
  }
#endif
  for (; i < n; ++i)
    if (w[i] >= lo && w[i] < hi) edge.push_back(w[i]);
  std::sort(edge.begin(), edge.end(), std::greater<float>());
  float floor = edge.front();  // above < limit: the edge's heaviest token is always kept
  double cum = above;
  for (float x : edge) {
    if (!(cum < limit)) break;
    floor = x;
    cum += x;
  }
  return floor;
}

// The float64 sum of x[0:n]'s values at or above keep (the others count as 0).
double kept_sum(const float* x, int64_t n, float keep) {
  int64_t i = 0;
  double sum = 0.0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 k = _mm256_set1_ps(keep);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 m = _mm256_and_ps(v, _mm256_cmp_ps(v, k, _CMP_GE_OQ));
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(m)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(m, 1)));
  }
  double s4[4];
  _mm256_storeu_pd(s4, _mm256_add_pd(lo, hi));
  sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
#endif
  for (; i < n; ++i) sum += x[i] >= keep ? x[i] : 0.f;
  return sum;
}

// Inverse CDF at u * total over the weights w[0:n] at or above `keep` (the rest count as 0), in
// token order: 256-wide float64 block sums, then the token inside the picked block.
int64_t pick_kept(const float* w, int64_t n, float keep, double u, std::vector<double>& cum,
                  std::vector<double>& inner) {
  const int64_t nb = (n + BLOCK - 1) / BLOCK;
  double c = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t len = std::min(BLOCK, n - b * BLOCK);
    cum[b] = c += kept_sum(w + b * BLOCK, len, keep);
  }
  double before = 0.0;
  const int64_t b = pick(cum.data(), nb, u * c, &before);
  const double rest = u * c - before;
  const int64_t len = std::min(BLOCK, n - b * BLOCK);
  const float* x = w + b * BLOCK;
  double ci = 0.0;
  for (int64_t j = 0; j < len; ++j) inner[j] = ci += x[j] >= keep ? x[j] : 0.f;
  return b * BLOCK + pick(inner.data(), len, rest, &before);
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

// The checked arguments every row sampler takes: logits [n, V] fp32 (unit column stride),
// inv_temp and min_p [n] fp32, u [n] fp64.
struct RowArgs {
  int64_t n, v, stride, nb;  // rows, vocabulary, row stride, 256-token blocks per row
  const float* x;
  const float* inv_temp;
  const float* min_p;
  const double* u;
};

RowArgs row_args(const char* fn, const at::Tensor& logits, const at::Tensor& inv_temp,
                 const at::Tensor& min_p, const at::Tensor& u) {
  check_rows(fn, logits);
  const int64_t n = logits.size(0), v = logits.size(1);
  check_per_row(fn, "inv_temp", inv_temp, at::kFloat, n);
  check_per_row(fn, "min_p", min_p, at::kFloat, n);
  check_per_row(fn, "u", u, at::kDouble, n);
  return {n, v, logits.stride(0), (v + BLOCK - 1) / BLOCK, logits.data_ptr<float>(),
          inv_temp.data_ptr<float>(), min_p.data_ptr<float>(), u.data_ptr<double>()};
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
  const RowArgs a = row_args("sample_rows", logits, inv_temp, min_p, u);
  const int64_t n = a.n, v = a.v, stride = a.stride, nb = a.nb;
  const float *xp = a.x, *tp = a.inv_temp, *mp = a.min_p;
  const double* up = a.u;
  at::Tensor tokens = u.new_empty({n}, u.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
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

// logits [n, V] fp32, inv_temp and min_p [n] (or [n, 1]) fp32, top_p and u [n] fp64 -> token ids
// [n] int64: each row's weights (sample_ops.weights), cut to the top-p set (top_p < 1, no top-k)
// and then by min-p, drawn by inverse CDF at u * their total in token order, as
// sample_ops.sample_top_p.
at::Tensor sample_top_p_rows(const at::Tensor& logits, const at::Tensor& inv_temp,
                             const at::Tensor& top_p, const at::Tensor& min_p,
                             const at::Tensor& u, double floor, double flush) {
  const RowArgs a = row_args("sample_top_p_rows", logits, inv_temp, min_p, u);
  const int64_t n = a.n, v = a.v, stride = a.stride, nb = a.nb;
  check_per_row("sample_top_p_rows", "top_p", top_p, at::kDouble, n);
  const float *xp = a.x, *tp = a.inv_temp, *mp = a.min_p;
  const double *up = a.u, *pp = top_p.data_ptr<double>();
  at::Tensor tokens = u.new_empty({n}, u.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, n, GRAIN, [&](int64_t begin, int64_t end) {
    // per thread, kept between calls: a [V] row buffer is past glibc's mmap threshold, so a
    // fresh one per call would be mapped and faulted in again every step
    thread_local std::vector<float> w, edge;
    thread_local std::vector<double> mass, cum, inner;
    w.resize(v);
    mass.resize(2 * NUM_KEYS);
    cum.resize(nb);
    inner.resize(BLOCK);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * stride;
      const RowParams p{row_max(x, v), tp[r], static_cast<float>(floor),
                        static_cast<float>(flush), 0.f};
      double total = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t len = std::min(BLOCK, v - b * BLOCK);
        total += block_weights(x + b * BLOCK, w.data() + b * BLOCK, len, p);
      }
      if (!(total > 0.0)) {  // a NaN row: every weight 0, token 0 as on the other paths
        out[r] = 0;
        continue;
      }
      const float keep = std::max(top_p_floor(w.data(), v, pp[r] * total, mass, edge), mp[r]);
      out[r] = pick_kept(w.data(), v, keep, up[r], cum, inner);
    }
  });
  return tokens;
}
