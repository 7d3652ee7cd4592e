// A packed weight expanded into oneDNN's blocked fp32 weight layout "Ab{ob}a" (blocks of ob
// rows, each stored column by column: weight (n, k) at (n / ob) * ob * K + k * ob + n % ob),
// for dequantize_blocked (packed_gemm.cpp; quant/blocked.py says why).
#pragma once

#include "packed_kernels.h"

namespace {

#if defined(__AVX512F__)
// v[a] = row a of a 16 x 16 tile -> v[c] = column c. Per 128-bit lane (columns 4L .. 4L + 3):
// unpack pairs rows, shuffle_ps makes s[4 i + j] = column 4 L + j of rows 4 i .. 4 i + 3,
// and two rounds of shuffle_f32x4 gather each column's four row quads.
inline void transpose_tile(__m512* v) {
  __m512 t[16], s[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    s[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {  // 0x88: 128-bit lanes 0, 2 of a then b; 0xDD: lanes 1, 3
    const __m512 u = _mm512_shuffle_f32x4(s[j], s[4 + j], 0x88);
    const __m512 w = _mm512_shuffle_f32x4(s[j], s[4 + j], 0xDD);
    const __m512 u2 = _mm512_shuffle_f32x4(s[8 + j], s[12 + j], 0x88);
    const __m512 w2 = _mm512_shuffle_f32x4(s[8 + j], s[12 + j], 0xDD);
    v[j] = _mm512_shuffle_f32x4(u, u2, 0x88);
    v[8 + j] = _mm512_shuffle_f32x4(u, u2, 0xDD);
    v[4 + j] = _mm512_shuffle_f32x4(w, w2, 0x88);
    v[12 + j] = _mm512_shuffle_f32x4(w, w2, 0xDD);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same for an 8 x 8 tile: s[4 i + j] holds column 4 L + j of rows 4 i .. 4 i + 3 in
// 128-bit lane L; permute2f128 joins the two row quads of each column.
inline void transpose_tile(__m256* v) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x20);
    v[4 + j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x31);
  }
}
#endif

// Rows [n0, n0 + nr) of a packed weight into one block of its blocked layout (dst: K columns
// of ob rows, dst[k * ob + r]; rows nr .. ob zero): the block's rows expanded plainly into
// `rows` (ob x K, L2-resident), then stored column by column. With ob a whole number of
// vectors, VL x VL tiles are transposed in registers, one VL-column slice (a 4 KB run of dst
// at ob = 64 on AVX-512) at a time. This costs ~3x a plain expansion (6 against 2 ms for 30
// SmolLM2 gate/up matrices on a Zen 5): the scratch round trip. Tried and slower: expanding
// 16 rows a block at a time in float registers (spilled: 8.8 ms), and with AVX-512 VBMI
// transposing 16 rows' Q4 nibble bytes (vpermt2b) and widening them straight into their
// columns (9.2-10 ms: the strided stores).
template <int64_t QT>
void expand_block_blocked(const uint8_t* base, int64_t rb, int64_t K, int64_t n0, int64_t nr,
                          float* dst, int64_t ob, float* rows) {
  for (int64_t a = 0; a < ob; ++a) {
    if (a < nr) expand_row<QT>(base + (n0 + a) * rb, K, rows + a * K);
    else std::fill(rows + a * K, rows + (a + 1) * K, 0.f);
  }
#if defined(__AVX2__) && defined(__FMA__)
  if (ob % VL == 0) {  // K is a multiple of 32, so of VL
    for (int64_t k0 = 0; k0 < K; k0 += VL) {
      for (int64_t r0 = 0; r0 < ob; r0 += VL) {
        vec v[VL];
        for (int a = 0; a < VL; ++a) v[a] = vload(rows + (r0 + a) * K + k0);
        transpose_tile(v);
        for (int c = 0; c < VL; ++c) vstore(dst + (k0 + c) * ob + r0, v[c]);
      }
    }
    return;
  }
#endif
  for (int64_t k = 0; k < K; ++k)
    for (int64_t r = 0; r < ob; ++r) dst[k * ob + r] = rows[r * K + k];
}

}  // namespace
