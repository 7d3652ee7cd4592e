// Row helpers of the fused layer ops (rotary, cache-row store, RMSNorm), shared by layer_ops.cpp
// and the packed models' fused decoder layer (models/quant/cpu_kernels/fused_layer.cpp).
#pragma once

#include "kernels.h"

#include <cmath>
#include <cstring>

namespace {

// Rotate-half rotary of one head row: y = x * cos + rotate_half(x) * sin, rotate_half(x) =
// [-x2, x1]. fp-contract off: each product rounds on its own, as in torch's mul/mul/add, so the
// rotated keys and queries are bit-identical to the torch path's.
__attribute__((optimize("fp-contract=off"))) void rope_row(const float* x, const float* c,
                                                           const float* s, float* y,
                                                           int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) y[i] = x[i] * c[i] - x[i + half] * s[i];
  for (int64_t i = half; i < d; ++i) y[i] = x[i] * c[i] + x[i - half] * s[i];
}

// dst[0:n] = x[0:n] in the cache's type (fp32: a copy; bf16 / fp16: round to nearest even)
template <typename T>
inline void store_row(const float* x, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = pdserve_kernels::from_f32<T>(x[i]);
}

// sum of x[i]^2 in eight interleaved partial sums (a vector register under -O3)
inline float sum_squares(const float* x, int64_t n) {
  typedef float v8 __attribute__((vector_size(32)));
  v8 acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8 v;
    std::memcpy(&v, x + i, sizeof v);
    acc += v * v;
  }
  float s = 0.f;
  for (int k = 0; k < 8; ++k) s += acc[k];
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// y[0:n] = (x * rsqrt(mean(x^2) + eps)) * w, fp32
inline void rms_row(const float* xr, const float* wp, float eps, int64_t n, float* yr) {
  const float rstd = 1.f / std::sqrt(sum_squares(xr, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) yr[i] = (xr[i] * rstd) * wp[i];
}

}  // namespace
