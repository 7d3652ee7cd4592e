// The packed-weight GEMM's inner pieces (block expansion, the per-row dot products, the
// panel path, argument checks and dispatch), shared by the Python entry points
// (packed_gemm.cpp) and the fused decoder layer (fused_layer.cpp). The format and ISA notes
// are at the top of packed_gemm.cpp. Only ATen headers here (see attention/cpu_kernels/
// kernels.h: torch's Python headers cost ~30 s of compile time per translation unit, so only
// bindings.cpp includes them).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "silu_mul.h"

namespace {

constexpr int QK = 32;  // weights per (sub-)block: the unit every path expands
enum QType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12,
  kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23
};

constexpr bool is_kquant(int64_t qt) { return qt >= kQ2_K && qt <= kQ6_K; }
constexpr bool is_q5(int64_t qt) { return qt == kQ5_0 || qt == kQ5_1; }
constexpr bool is_iq4(int64_t qt) { return qt == kIQ4_NL || qt == kIQ4_XS; }
constexpr bool valid_qtype(int64_t qt) {
  return qt == kQ4_0 || qt == kQ4_1 || qt == kQ8_0 || is_q5(qt) || is_kquant(qt) || is_iq4(qt);
}
// the types whose vector expansion goes through kq_quants (32 quant bytes) and expand_k
constexpr bool byte_quants(int64_t qt) { return is_kquant(qt) || is_q5(qt) || is_iq4(qt); }
// sub-blocks of 32 per block: the K-quants' and IQ4_XS's super-blocks of 256 hold 8
constexpr int subs(int64_t qt) { return is_kquant(qt) || qt == kIQ4_XS ? 8 : 1; }
constexpr int64_t block_size(int64_t qt) { return QK * subs(qt); }
constexpr int64_t block_bytes(int64_t qt) {
  return qt == kQ4_0 ? 18 : qt == kQ4_1 ? 20 : qt == kQ5_0 ? 22 : qt == kQ5_1 ? 24
       : qt == kQ8_0 ? 34 : qt == kQ2_K ? 84
       : qt == kQ3_K ? 110 : qt == kQ4_K ? 144 : qt == kQ5_K ? 176 : qt == kQ6_K ? 210
       : qt == kIQ4_NL ? 18 : qt == kIQ4_XS ? 136 : 0;
}

// IQ4_NL (18 bytes / 32: fp16 d, 16 bytes of nibbles in Q4_0's order): w[i] = d * kIQ4NL[q[i]],
// a non-linear grid of int8 levels (gguf-py's IQ4_NL.kvalues); the product is exact in fp32.
// IQ4_XS (136 bytes / 256): fp16 d, uint16 scales_h, 4 bytes scales_l, 128 bytes of nibbles
// (sub-block s: bytes 8 + 16 s .., Q4_0's order); w = (d * (ls[s] - 32)) * kIQ4NL[q], ls the
// 6-bit scale (low nibble of scales_l byte s / 2, then bits 2 s of scales_h). Every product is
// exact in fp32: d * (ls - 32) has at most 11 + 5 significant bits, times a level at most 23.
alignas(16) constexpr int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                           1,    13,   25,  38,  53,  69,  89,  113};
// the 4-bit types whose 16 possible weights per block make a lookup table (dot_q4_lut)
constexpr bool lut4(int64_t qt) { return qt == kQ4_0 || qt == kQ4_1 || is_iq4(qt); }

// The byte offset of (sub-)block s's 16 nibble bytes in its block (the 4-bit types).
template <int64_t QT>
constexpr int nibble_offset(int s) { return QT == kIQ4_XS ? 8 + 16 * s : QT == kQ4_1 ? 4 : 2; }

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// IQ4_XS sub-block s's scale d * (ls - 32) (exact), IQ4_NL's d.
template <int64_t QT>
inline float iq4_scale(const uint8_t* b, int s) {
  if constexpr (QT == kIQ4_NL) return half_at(b);
  uint16_t h;
  std::memcpy(&h, b + 2, 2);
  const int ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 0x0F) | (((h >> (2 * s)) & 3) << 4);
  return half_at(b) * static_cast<float>(ls - 32);
}

// Q4_K / Q5_K sub-block s: scale d * sc[s] and min dmin * m[s] (6-bit sc, m packed in bytes
// 4 .. 16 as gguf-py's Q4_K.get_scale_min unpacks them). Both products are exact in fp32.
inline void kq_scale_min(const uint8_t* b, int s, float& ds, float& ms) {
  const uint8_t* p = b + 4;
  int sc, m;
  if (s < 4) {
    sc = p[s] & 63;
    m = p[s + 4] & 63;
  } else {
    sc = (p[s + 4] & 0x0F) | ((p[s - 4] >> 6) << 4);
    m = (p[s + 4] >> 4) | ((p[s] >> 6) << 4);
  }
  ds = half_at(b) * static_cast<float>(sc);
  ms = half_at(b + 2) * static_cast<float>(m);
}

// Q2_K / Q3_K / Q6_K: the scale of weights 16 i .. 16 i + 15 of the super-block (exact).
template <int64_t QT>
inline float k16_scale(const uint8_t* b, int i) {
  if constexpr (QT == kQ2_K) {
    return half_at(b + 80) * static_cast<float>(b[i] & 0x0F);
  } else if constexpr (QT == kQ3_K) {  // low 4 bits from bytes 0 .. 7, high 2 from bytes 8 .. 11
    const int lo = (b[96 + i % 8] >> (4 * (i / 8))) & 0x0F;
    const int hi = (b[104 + i % 4] >> (2 * (i / 4))) & 3;
    return half_at(b + 108) * static_cast<float>((lo | (hi << 4)) - 32);
  } else {
    return half_at(b + 208) * static_cast<float>(static_cast<int8_t>(b[192 + i]));
  }
}
// Q2_K: the min of weights 16 i .. 16 i + 15 (exact).
inline float q2k_min(const uint8_t* b, int i) {
  return half_at(b + 82) * static_cast<float>(b[i] >> 4);
}

// Q5_0 / Q5_1: the 32-bit high-bit mask (bit i is bit 4 of element i) and the 16 nibble bytes
// (element i < 16 the low nibble of byte i, i >= 16 the high nibble of byte i - 16), after the
// fp16 d (and Q5_1's m).
template <int64_t QT>
constexpr int q5_qh() { return QT == kQ5_0 ? 2 : 4; }
template <int64_t QT>
constexpr int q5_qs() { return q5_qh<QT>() + 4; }

// The 32 quants of K-quant or IQ4_XS sub-block s (or of a Q5_0 / Q5_1 / IQ4_NL block), as
// integers (Q2_K 0..3, Q3_K -4..3, Q4_K 0..15, Q5_K 0..31, Q6_K -32..31, Q5_0 -16..15, Q5_1
// 0..31, IQ4_NL and IQ4_XS the grid's levels -127..113).
template <int64_t QT>
inline int kq_quant(const uint8_t* b, int s, int i) {
  if constexpr (is_iq4(QT)) {
    return kIQ4NL[(b[nibble_offset<QT>(s) + i % 16] >> (4 * (i / 16))) & 0x0F];
  } else if constexpr (is_q5(QT)) {
    uint32_t qh;
    std::memcpy(&qh, b + q5_qh<QT>(), 4);
    const int q = ((b[q5_qs<QT>() + i % 16] >> (4 * (i / 16))) & 0x0F) | (((qh >> i) & 1) << 4);
    return QT == kQ5_0 ? q - 16 : q;
  } else if constexpr (QT == kQ2_K) {
    return (b[16 + 32 * (s / 4) + i] >> (2 * (s % 4))) & 3;
  } else if constexpr (QT == kQ3_K) {
    const int lo = (b[32 + 32 * (s / 4) + i] >> (2 * (s % 4))) & 3;
    return ((b[i] >> s) & 1) ? lo : lo - 4;
  } else if constexpr (QT == kQ4_K) {
    return (b[16 + 32 * (s / 2) + i] >> (4 * (s % 2))) & 0x0F;
  } else if constexpr (QT == kQ5_K) {
    return ((b[48 + 32 * (s / 2) + i] >> (4 * (s % 2))) & 0x0F) | (((b[16 + i] >> s) & 1) << 4);
  } else {
    const int t = s % 4, h = s / 4;
    const int lo = (b[64 * h + 32 * (t & 1) + i] >> (4 * (t >> 1))) & 0x0F;
    const int hi = (b[128 + 32 * h + i] >> (2 * t)) & 3;
    return (lo | (hi << 4)) - 32;
  }
}

// Scalar expansion of (sub-)block s of the block at b into w[32]; the reference every vector
// variant matches.
template <int64_t QT>
inline void expand_scalar(const uint8_t* b, int s, float* w) {
  // Q5_0 and the IQ4 types: d * q, exact; Q5_1: fma(d, q, m), one rounding as numpy
  if constexpr (is_q5(QT) || is_iq4(QT)) {
    const float d = is_iq4(QT) ? iq4_scale<QT>(b, s) : half_at(b);
    const float m = QT == kQ5_1 ? half_at(b + 2) : 0.f;
    for (int i = 0; i < QK; ++i)
      w[i] = QT == kQ5_1 ? std::fma(d, static_cast<float>(kq_quant<QT>(b, s, i)), m)
                         : d * static_cast<float>(kq_quant<QT>(b, s, i));
    return;
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    float ds, ms;
    kq_scale_min(b, s, ds, ms);
    for (int i = 0; i < QK; ++i) w[i] = std::fma(ds, static_cast<float>(kq_quant<QT>(b, s, i)), -ms);
    return;
  } else if constexpr (QT == kQ6_K || QT == kQ3_K) {
    const float d0 = k16_scale<QT>(b, 2 * s), d1 = k16_scale<QT>(b, 2 * s + 1);
    for (int i = 0; i < QK; ++i)
      w[i] = (i < 16 ? d0 : d1) * static_cast<float>(kq_quant<QT>(b, s, i));
    return;
  } else if constexpr (QT == kQ2_K) {
    for (int h = 0; h < 2; ++h) {
      const float ds = k16_scale<QT>(b, 2 * s + h), ms = q2k_min(b, 2 * s + h);
      for (int i = 16 * h; i < 16 * h + 16; ++i)
        w[i] = std::fma(ds, static_cast<float>(kq_quant<QT>(b, s, i)), -ms);
    }
    return;
  }
  const float d = half_at(b);
  if constexpr (QT == kQ4_0) {
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>((b[2 + j] & 0x0F) - 8);
      w[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
    }
  } else if constexpr (QT == kQ4_1) {
    const float m = half_at(b + 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = std::fma(d, static_cast<float>(b[4 + j] & 0x0F), m);
      w[j + 16] = std::fma(d, static_cast<float>(b[4 + j] >> 4), m);
    }
  } else {
    for (int j = 0; j < QK; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
  }
}

#if defined(__AVX2__)
inline __m256i srl8(__m256i v, int n, int mask) {  // per byte: (v >> n) & mask
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(n)), _mm256_set1_epi8(mask));
}
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// The 16 bytes at p as 32 nibble bytes: byte j's low nibble is element j, its high nibble
// element j + 16 (Q4_0's order, which Q5_0 / Q5_1 and the IQ4 types share).
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), lo4), _mm_and_si128(qs, lo4));
}

// kq_quant for all 32 weights of sub-block s at once, as bytes (int8 for Q3_K and Q6_K, else
// uint8).
template <int64_t QT>
inline __m256i kq_quants(const uint8_t* b, int s) {
  if constexpr (is_iq4(QT)) {  // nibbles, then each looked up in the grid (one byte shuffle)
    const __m256i grid =
        _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4NL)));
    return _mm256_shuffle_epi8(grid, nibbles32(b + nibble_offset<QT>(s)));
  } else if constexpr (is_q5(QT)) {  // nibbles, then bit i of qh as bit 4 of byte i (llama.cpp)
    const __m256i nib = nibbles32(b + q5_qs<QT>());
    uint32_t qh;
    std::memcpy(&qh, b + q5_qh<QT>(), 4);
    const __m256i spread = _mm256_shuffle_epi8(  // byte i <- qh byte i / 8
        _mm256_set1_epi32(static_cast<int>(qh)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    const __m256i q = _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    return QT == kQ5_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(16)) : q;
  } else if constexpr (QT == kQ2_K) {
    return srl8(load32(b + 16 + 32 * (s / 4)), 2 * (s % 4), 3);
  } else if constexpr (QT == kQ3_K) {  // (lo | hbit << 2) - 4
    const __m256i hi = _mm256_slli_epi16(srl8(load32(b), s, 1), 2);
    const __m256i lo = srl8(load32(b + 32 + 32 * (s / 4)), 2 * (s % 4), 3);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(4));
  } else if constexpr (QT == kQ4_K) {
    return srl8(load32(b + 16 + 32 * (s / 2)), 4 * (s % 2), 0x0F);
  } else if constexpr (QT == kQ5_K) {
    const __m256i hi = _mm256_slli_epi16(srl8(load32(b + 16), s, 1), 4);
    return _mm256_or_si256(srl8(load32(b + 48 + 32 * (s / 2)), 4 * (s % 2), 0x0F), hi);
  } else {
    const int t = s % 4, h = s / 4;
    const __m256i lo = srl8(load32(b + 64 * h + 32 * (t & 1)), 4 * (t >> 1), 0x0F);
    const __m256i hi = _mm256_slli_epi16(srl8(load32(b + 128 + 32 * h), 2 * t, 3), 4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
  }
}

// A super-block's scales, all computed at once with vector integer ops (where the expansion
// took them one at a time: a scalar unpack, a half conversion and a broadcast per 16 or 32
// weights). d[i] multiplies weights 16 i .. 16 i + 15 (Q2_K, Q3_K, Q6_K) or sub-block i's 32
// (Q4_K, Q5_K, IQ4_XS; i < 8); nm[i] is the matching negated min (Q2_K, Q4_K, Q5_K). Each is
// the value k16_scale, q2k_min, kq_scale_min or iq4_scale gives, bit for bit: a half times a
// small integer, exact in fp32 (and so is the negation).
// At few rows (dot_tile, dot_q4_lut) they are computed one super-block ahead into a second
// SuperScales: read right after this vector store, each scalar broadcast waited on store-to-
// load forwarding, and ahead the whole Q2_K batch-1 step ran 1.03x faster (bench/kernel_ab.py,
// Zen 5); held in registers instead (a vpermps per broadcast) Q2_K and Q6_K lost their gain.
struct SuperScales {
  alignas(32) float d[16];
  alignas(32) float nm[16];
};

inline __m256i widen8(const uint8_t* p) {  // 8 bytes as uint32 lanes
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline void store_scaled(float* out, float d, __m256i q) {  // out[0 .. 8) = d * q
  _mm256_store_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q)));
}

template <int64_t QT>
inline void super_scales(const uint8_t* b, SuperScales& o) {
  const __m256i lo4 = _mm256_set1_epi32(15);
  if constexpr (QT == kQ6_K) {  // int8 scales at 192, d at 208
    for (int h = 0; h < 2; ++h) {
      const auto* p = reinterpret_cast<const __m128i*>(b + 192 + 8 * h);
      store_scaled(o.d + 8 * h, half_at(b + 208), _mm256_cvtepi8_epi32(_mm_loadl_epi64(p)));
    }
  } else if constexpr (QT == kQ2_K) {  // byte i: scale (low nibble), min (high); d, dmin at 80
    for (int h = 0; h < 2; ++h) {
      const __m256i v = widen8(b + 8 * h);
      store_scaled(o.d + 8 * h, half_at(b + 80), _mm256_and_si256(v, lo4));
      store_scaled(o.nm + 8 * h, -half_at(b + 82), _mm256_srli_epi32(v, 4));
    }
  } else if constexpr (QT == kQ3_K) {
    // scale i: low 4 bits from byte 96 + i % 8 (nibble i / 8), high 2 from bits
    // 8 (i % 4) + 2 (i / 4) of bytes 104 .. 107 read as one little-endian word; bias 32
    const __m256i lo = widen8(b + 96);
    uint32_t hbits;
    std::memcpy(&hbits, b + 104, 4);
    const __m256i shift = _mm256_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26);
    for (int h = 0; h < 2; ++h) {
      const __m256i l = h ? _mm256_srli_epi32(lo, 4) : _mm256_and_si256(lo, lo4);
      const __m256i hi = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(hbits)),
                            _mm256_add_epi32(shift, _mm256_set1_epi32(4 * h))),
          _mm256_set1_epi32(3));
      store_scaled(o.d + 8 * h, half_at(b + 108),
                   _mm256_sub_epi32(_mm256_or_si256(l, _mm256_slli_epi32(hi, 4)),
                                    _mm256_set1_epi32(32)));
    }
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    // the 12 scale bytes p = b + 4: sub-block s < 4 has sc = p[s] & 63, m = p[s + 4] & 63;
    // s >= 4 sc = (p[s + 4] & 15) | (p[s - 4] >> 6) << 4, m = (p[s + 4] >> 4) | (p[s] >> 6) << 4
    const __m256i a = widen8(b + 4), c = widen8(b + 8);  // lane s: p[s], p[s + 4]
    const __m256i a4 = _mm256_permutevar8x32_epi32(a, _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3));
    const __m256i six = _mm256_set1_epi32(63);
    const __m256i sc = _mm256_blend_epi32(
        _mm256_and_si256(a, six),
        _mm256_or_si256(_mm256_and_si256(c, lo4), _mm256_slli_epi32(_mm256_srli_epi32(a4, 6), 4)),
        0xF0);
    const __m256i m = _mm256_blend_epi32(
        _mm256_and_si256(c, six),
        _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_slli_epi32(_mm256_srli_epi32(a, 6), 4)),
        0xF0);
    store_scaled(o.d, half_at(b), sc);
    store_scaled(o.nm, -half_at(b + 2), m);
  } else {
    static_assert(QT == kIQ4_XS, "super_scales: a type with super-blocks");
    // sub-block s: the low 4 bits are bits 4 s of scales_l's 32 bits, the high 2 bits 2 s of
    // scales_h's 16 (little-endian); bias 32. Against iq4_scale per sub-block, a SmolLM2 whose
    // ffn_down is IQ4_XS ran its whole batch-1 step 1.10x faster (bench/kernel_ab.py, Zen 5).
    uint16_t h;
    uint32_t l;
    std::memcpy(&h, b + 2, 2);
    std::memcpy(&l, b + 4, 4);
    const __m256i lo = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(l)),
                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), lo4);
    const __m256i hi = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_set1_epi32(3));
    store_scaled(o.d, half_at(b), _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)),
                                                   _mm256_set1_epi32(32)));
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
template <int64_t QT, typename V>
inline void expand_k(const uint8_t* b, int s, V* w, const SuperScales& sc);
#endif

#if defined(__AVX512F__)
constexpr int VL = 16;
using vec = __m512;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline vec u8_to_f(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }

inline vec i8_to_f(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

// The bytes of vector j of a sub-block's 32 quants (j = 0, 1).
inline __m128i lane_bytes(__m256i q, int j) {
  return j == 0 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
}
inline vec vset1(float f) { return _mm512_set1_ps(f); }

// (sub-)block s of the block at b into w; sc: the block's super_scales (the super-block types)
template <int64_t QT>
inline void expand(const uint8_t* b, int s, vec* w, const SuperScales& sc) {  // 2 vectors
  if constexpr (byte_quants(QT)) {
    expand_k<QT>(b, s, w, sc);
    return;
  }
  const vec d = _mm512_set1_ps(half_at(b));
  if constexpr (QT == kQ8_0) {
    for (int j = 0; j < 2; ++j) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * j));
      w[j] = _mm512_mul_ps(d, i8_to_f(q));
    }
  } else {
    const uint8_t* qs = b + nibble_offset<QT>(0);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const vec lo = u8_to_f(_mm_and_si128(q, mask));
    const vec hi = u8_to_f(_mm_and_si128(_mm_srli_epi16(q, 4), mask));
    if constexpr (QT == kQ4_1) {
      const vec m = _mm512_set1_ps(half_at(b + 2));
      w[0] = _mm512_fmadd_ps(d, lo, m);
      w[1] = _mm512_fmadd_ps(d, hi, m);
    } else {
      const vec eight = _mm512_set1_ps(8.f);
      w[0] = _mm512_mul_ps(d, _mm512_sub_ps(lo, eight));
      w[1] = _mm512_mul_ps(d, _mm512_sub_ps(hi, eight));
    }
  }
}
#define PDSERVE_SIMD "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VL = 8;
using vec = __m256;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vec u8_to_f(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); }

inline vec i8_to_f(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }

// The bytes of vector j of a sub-block's 32 quants (j = 0 .. 3; the low 8 of the result).
inline __m128i lane_bytes(__m256i q, int j) {
  const __m128i half = j < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
  return j % 2 ? _mm_srli_si128(half, 8) : half;
}
inline vec vset1(float f) { return _mm256_set1_ps(f); }

// (sub-)block s of the block at b into w; sc: the block's super_scales (the super-block types)
template <int64_t QT>
inline void expand(const uint8_t* b, int s, vec* w, const SuperScales& sc) {  // 4 vectors
  if constexpr (byte_quants(QT)) {
    expand_k<QT>(b, s, w, sc);
    return;
  }
#if defined(__F16C__)
  // d (and Q4_1's m) from one 4-byte broadcast and one conversion: [d, m] in every pair
  uint32_t dm;
  std::memcpy(&dm, b, 4);
  const __m256 both = _mm256_cvtph_ps(_mm_set1_epi32(static_cast<int>(dm)));
  const vec d = _mm256_permute_ps(both, 0x00);
#else
  const vec d = _mm256_set1_ps(half_at(b));
#endif
  if constexpr (QT == kQ8_0) {
    for (int j = 0; j < 4; ++j) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j));
      w[j] = _mm256_mul_ps(d, i8_to_f(q));
    }
  } else {
    const uint8_t* qs = b + nibble_offset<QT>(0);
    // bytes 0 .. 7 and 8 .. 15 widened to dwords straight from memory (vpmovzxbd m64), then
    // split into nibbles at 32 bits (the upper bytes are zero, so >> 4 is the high nibble):
    // 10 vector ops per block where widening split nibble bytes took 14
    const auto* q0 = reinterpret_cast<const __m128i*>(qs);
    const auto* q1 = reinterpret_cast<const __m128i*>(qs + 8);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(q0));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(q1));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const vec e[4] = {_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)),
                      _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask)),
                      _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)),
                      _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
    if constexpr (QT == kQ4_1) {
#if defined(__F16C__)
      const vec m = _mm256_permute_ps(both, 0x55);
#else
      const vec m = _mm256_set1_ps(half_at(b + 2));
#endif
      for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(d, e[j], m);
    } else {
      const vec eight = _mm256_set1_ps(8.f);
      for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(d, _mm256_sub_ps(e[j], eight));
    }
  }
}
#define PDSERVE_SIMD "avx2"
#else
#define PDSERVE_SIMD "scalar"
#endif

#if defined(__AVX2__) && defined(__FMA__)
// K-quant or IQ4_XS sub-block s (or a Q5_0 / Q5_1 / IQ4_NL block): unpack its 32 quant bytes
// (AVX2 byte ops, either vector build), widen them to 32 / VL vectors and scale:
// fma(d * sc, q, -(dmin * m)), or Q3_K's and Q6_K's (d * scale) * q, or the IQ4 types'
// d_s * grid[q]; Q2_K, Q3_K and Q6_K change scale every 16 weights. The super-block types'
// scales come from sc.
template <int64_t QT, typename V>
inline void expand_k(const uint8_t* b, int s, V* w, const SuperScales& sc) {
  const __m256i q = kq_quants<QT>(b, s);
  if constexpr (QT == kQ5_0 || is_iq4(QT)) {  // d * q, exact
    const V d = vset1(QT == kIQ4_XS ? sc.d[s] : half_at(b));
    for (int j = 0; j < QK / VL; ++j) w[j] = vmul(d, i8_to_f(lane_bytes(q, j)));
  } else if constexpr (QT == kQ5_1) {  // fma(d, q, m): one rounding, as numpy's d * q + m
    const V d = vset1(half_at(b)), m = vset1(half_at(b + 2));
    for (int j = 0; j < QK / VL; ++j) w[j] = vfma(d, u8_to_f(lane_bytes(q, j)), m);
  } else if constexpr (QT == kQ6_K || QT == kQ3_K) {
    for (int j = 0; j < QK / VL; ++j)
      w[j] = vmul(vset1(sc.d[2 * s + j * VL / 16]), i8_to_f(lane_bytes(q, j)));
  } else if constexpr (QT == kQ2_K) {
    for (int j = 0; j < QK / VL; ++j) {
      const int i = 2 * s + j * VL / 16;
      w[j] = vfma(vset1(sc.d[i]), u8_to_f(lane_bytes(q, j)), vset1(sc.nm[i]));
    }
  } else {
    const V d = vset1(sc.d[s]), m = vset1(sc.nm[s]);
    for (int j = 0; j < QK / VL; ++j) w[j] = vfma(d, u8_to_f(lane_bytes(q, j)), m);
  }
}
#endif

struct Gemm {
  const float* x;  // [M, K], row stride sx
  int64_t sx, M, K;
  const uint8_t* w;  // [N, row_bytes]
  int64_t row_bytes;
  const float* bias;  // [N] or null
  const float* res;   // [M, N] (row stride sr) or null
  int64_t sr;
  float* out;  // [M, N], row stride so
  int64_t N;
  int64_t so;  // N, or wider when the product is some columns of a larger output

  inline void store(int64_t m, int64_t n, float s) const {
    if (bias) s += bias[n];
    if (res) s += res[m * sr + n];
    out[m * so + n] = s;
  }
};

// Bytes of weight rows requested ahead of the row being multiplied (prefetcht0). A decode
// step reads every weight once, from L3 or DRAM, and each GEMM is short (a few hundred KB per
// thread) for the hardware prefetcher's ramp-up; what bounds a thread's read rate is then the
// bytes it has in flight over the memory latency. Counted in bytes, not rows: SmolLM2's rows
// run from 360 bytes (Q4_1, K = 576) to 960 (Q4_1 down) and 612 (its Q8_0 LM head).
#ifndef PDSERVE_PREFETCH_BYTES
#define PDSERVE_PREFETCH_BYTES 4096
#endif
constexpr int64_t kPrefetchBytes = PDSERVE_PREFETCH_BYTES;

inline void prefetch_row(const Gemm& g, int64_t n) {
  const uint8_t* r = g.w + n * g.row_bytes;
  for (int64_t b = 0; b < g.row_bytes; b += 64) __builtin_prefetch(r + b, 0, 3);
}

// row(n) for n in [n0, n1), each row's bytes requested kPrefetchBytes ahead of its turn.
template <typename F>
inline void rows_prefetched(const Gemm& g, int64_t n0, int64_t n1, F&& row) {
  const int64_t ahead = std::max<int64_t>(1, (kPrefetchBytes + g.row_bytes - 1) / g.row_bytes);
  for (int64_t n = n0; n < std::min(n1, n0 + ahead); ++n) prefetch_row(g, n);
  for (int64_t n = n0; n < n1; ++n) {
    if (n + ahead < n1) prefetch_row(g, n + ahead);
    row(n);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr int NV = QK / VL;  // vectors per block
constexpr int MT = VL == 16 ? 4 : 2;  // activation rows per register tile (acc = MT * NV regs)

// Rows m0 .. m0 + R of output column n: each block expanded once per tile of R rows; NV
// independent accumulators per row, so the FMA chains overlap.
template <int64_t QT, int R>
inline void dot_tile(const Gemm& g, int64_t n, int64_t m0) {
  vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vzero();
  const uint8_t* wr = g.w + n * g.row_bytes;
  const int64_t nb = g.K / block_size(QT);
  SuperScales sc[2];  // super-block b's in sc[b % 2], computed a super-block ahead
  if constexpr (subs(QT) > 1) super_scales<QT>(wr, sc[0]);
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (subs(QT) > 1) {
      if (b + 1 < nb) super_scales<QT>(wr + (b + 1) * block_bytes(QT), sc[(b + 1) % 2]);
    }
    // unrolled, s is a constant: Q6_K's and Q3_K's bit shifts become immediates (Q6_K 1.13x)
#pragma GCC unroll 8
    for (int s = 0; s < subs(QT); ++s) {
      vec w[NV];
      expand<QT>(wr + b * block_bytes(QT), s, w, sc[b % 2]);
      for (int r = 0; r < R; ++r) {
        const float* xr = g.x + (m0 + r) * g.sx + (b * subs(QT) + s) * QK;
        for (int j = 0; j < NV; ++j) acc[r][j] = vfma(w[j], vload(xr + j * VL), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    vec s = acc[r][0];
    for (int j = 1; j < NV; ++j) s = vadd(s, acc[r][j]);
    g.store(m0 + r, n, vsum(s));
  }
}


#if defined(__AVX512F__)
// Q4_0 / Q4_1 / IQ4_NL / IQ4_XS (and Q5_0 / Q5_1: q5_lut_weights; Q4_K / Q5_K:
// kq4_lut_pair) at few activation rows (decode, AVX-512) by table lookup. A (sub-)block's 16
// possible weights are one vector, table[q] = fma(d, q, m) (Q4_1), d * (q - 8) (Q4_0),
// d_s * grid[q] (IQ4_NL, IQ4_XS) or fma(d * sc, q, -(dmin * m)) (Q4_K): the values expand()
// computes per element, bit for bit.
// Each weight is then one lane of a vpermps (which reads only the low 4 bits of each index
// lane, so the widened bytes index the low nibbles unmasked): 1 widening, 1 shift, 2 permutes
// and 1 FMA per 32 weights, where converting the nibbles to floats took ~3x the uops.
// Q4_0's and Q4_1's d (and m) come straight from the block header: one 4-byte broadcast [d, m],
// one conversion, two in-lane shuffles (d in every lane, m in every lane); the super-block
// types' scales from super_scales. On the Zen 5 this ran
// 1.2-1.4x faster (30 SmolLM2 layers at M = 1) than widening a row's scales into a buffer
// first (copied out one row ahead, then read back as broadcasts): the buffer's copy and
// widening cost as much as a third of a 576-wide row.
// The AVX2 build keeps the expansion (expand()): an 8-lane lookup needs two permutes and a
// blend per 8 weights (the table is two vectors), and ran 1.5x slower than expanding on the
// same machine (git history: the AVX2 lookup of 0f44d7b).
template <int64_t QT>
inline vec q4_table_d(const uint8_t* b, vec& m) {  // -> d in every lane; m: m in every lane
  uint32_t dm;
  std::memcpy(&dm, b, 4);
  const vec both = _mm512_cvtph_ps(_mm256_set1_epi32(static_cast<int>(dm)));  // [d, m, d, m ..]
  m = _mm512_permute_ps(both, 0x55);
  return _mm512_permute_ps(both, 0x00);
}

// A Q5_0 / Q5_1 block's 32 weights by table lookup: its 32 possible weights are two vectors,
// table[q] = d * (q - 16) (Q5_0, exact) or fma(d, q, m) (Q5_1), the values expand() computes,
// and vpermt2ps picks from both by the 5 low bits of each index: the nibble, with bit i of qh
// OR-ed in as bit 4 under a mask register (qh's 32 bits are the two halves' lane masks). This
// replaces the byte shuffles, widenings and conversions of the expansion.
template <int64_t QT>
inline void q5_lut_weights(const uint8_t* b, __m512 iota, vec& w0, vec& w1) {
  const vec d = vset1(half_at(b));
  vec lo, hi;  // the weights of quants 0..15 and 16..31
  if constexpr (QT == kQ5_1) {
    const vec m = vset1(half_at(b + 2));
    lo = _mm512_fmadd_ps(d, iota, m);
    hi = _mm512_fmadd_ps(d, _mm512_add_ps(iota, _mm512_set1_ps(16.f)), m);
  } else {
    lo = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16.f)));
    hi = _mm512_mul_ps(d, iota);
  }
  uint32_t qh;
  std::memcpy(&qh, b + q5_qh<QT>(), 4);
  const __m512i q = _mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + q5_qs<QT>())));
  const __m512i bit4 = _mm512_set1_epi32(16);
  const __m512i q0 = _mm512_and_si512(q, _mm512_set1_epi32(15));
  const __m512i q1 = _mm512_srli_epi32(q, 4);
  const __m512i i0 = _mm512_mask_or_epi32(q0, static_cast<__mmask16>(qh), q0, bit4);
  const __m512i i1 = _mm512_mask_or_epi32(q1, static_cast<__mmask16>(qh >> 16), q1, bit4);
  w0 = _mm512_permutex2var_ps(lo, i0, hi);
  w1 = _mm512_permutex2var_ps(lo, i1, hi);
}

// Q4_K / Q5_K sub-blocks 2c and 2c + 1 (64 weights, w[0 .. 4)) by table lookup, as Q4_1's /
// Q5_1's: table[q] = fma(d * sc[s], q, -(dmin * m[s])), the values expand_k computes, 16
// entries (Q4_K) or 32 (Q5_K: vpermt2ps, bit s of qh[i] as bit 4 of element i's index, taken
// to a mask register by one shift and a byte movemask). The two sub-blocks share their 32
// nibble bytes (low nibbles, then high), so a pair is widened once: per sub-block at a time
// the widenings and shifts doubled, and Q4_K ran slower than Q4_1's lookup.
template <int64_t QT>
inline void kq4_lut_pair(const uint8_t* b, int c, const SuperScales& sc, __m512 iota, vec* w) {
  const uint8_t* qs = b + (QT == kQ4_K ? 16 : 48) + 32 * c;
  const __m512i q0 =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m512i q1 =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
  const __m256i qh_bytes = load32(b + 16);  // Q5_K: bit s of byte i is element i's fifth bit
  for (int h = 0; h < 2; ++h) {
    const int s = 2 * c + h;
    const vec d = vset1(sc.d[s]), nm = vset1(sc.nm[s]);
    const vec lo = _mm512_fmadd_ps(d, iota, nm);  // the weights of quants 0..15
    if constexpr (QT == kQ4_K) {  // vpermps reads the low 4 bits: the high nibble is ignored
      w[2 * h] = _mm512_permutexvar_ps(h ? _mm512_srli_epi32(q0, 4) : q0, lo);
      w[2 * h + 1] = _mm512_permutexvar_ps(h ? _mm512_srli_epi32(q1, 4) : q1, lo);
    } else {
      const vec hi = _mm512_fmadd_ps(d, _mm512_add_ps(iota, _mm512_set1_ps(16.f)), nm);
      const auto qh = static_cast<uint32_t>(
          _mm256_movemask_epi8(_mm256_sll_epi16(qh_bytes, _mm_cvtsi32_si128(7 - s))));
      const __m512i lo4 = _mm512_set1_epi32(15), bit4 = _mm512_set1_epi32(16);
      const __m512i i0 = h ? _mm512_srli_epi32(q0, 4) : _mm512_and_si512(q0, lo4);
      const __m512i i1 = h ? _mm512_srli_epi32(q1, 4) : _mm512_and_si512(q1, lo4);
      w[2 * h] = _mm512_permutex2var_ps(
          lo, _mm512_mask_or_epi32(i0, static_cast<__mmask16>(qh), i0, bit4), hi);
      w[2 * h + 1] = _mm512_permutex2var_ps(
          lo, _mm512_mask_or_epi32(i1, static_cast<__mmask16>(qh >> 16), i1, bit4), hi);
    }
  }
}

// the types dot_q4_lut reads by table lookup
constexpr bool lut_path(int64_t qt) {
  return lut4(qt) || is_q5(qt) || qt == kQ4_K || qt == kQ5_K;
}

// Rows m0 .. m0 + R of output column n. Two blocks per iteration into separate accumulators,
// so consecutive blocks' FMA chains overlap.
template <int64_t QT, int R>
inline void dot_q4_lut(const Gemm& g, int64_t n, int64_t m0) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 lut_q = QT == kQ4_1    ? iota
                     : QT == kQ4_0    ? _mm512_sub_ps(iota, _mm512_set1_ps(8.f))
                                      : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(
                                            reinterpret_cast<const __m128i*>(kIQ4NL))));
  vec acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = vzero();
  const uint8_t* wr = g.w + n * g.row_bytes;
  const int64_t nb = g.K / QK;
  // IQ4_XS, Q4_K, Q5_K: super-block j's scales in sc[j % 2], computed a super-block ahead
  SuperScales sc[2];
  auto scales_ahead = [&](int64_t i) {  // (sub-)block i: the next super-block's scales
    if constexpr (subs(QT) > 1) {
      const int64_t j = i / subs(QT);
      if (i % subs(QT) == 0 && (j + 1) * subs(QT) < nb)
        super_scales<QT>(wr + (j + 1) * block_bytes(QT), sc[(j + 1) % 2]);
    }
  };
  if constexpr (subs(QT) > 1) super_scales<QT>(wr, sc[0]);
  auto block = [&](int64_t i, vec* w) {  // (sub-)block i of the row -> w[0 .. 2)
    const uint8_t* b = wr + i / subs(QT) * block_bytes(QT);
    const int s = static_cast<int>(i % subs(QT));
    if constexpr (QT == kIQ4_XS) scales_ahead(i);
    if constexpr (is_q5(QT)) {
      q5_lut_weights<QT>(b, iota, w[0], w[1]);
    } else {
      vec m;
      const vec d = QT == kIQ4_XS ? vset1(sc[i / subs(QT) % 2].d[s]) : q4_table_d<QT>(b, m);
      const vec table = QT == kQ4_1 ? _mm512_fmadd_ps(d, lut_q, m) : _mm512_mul_ps(d, lut_q);
      const __m512i q = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + nibble_offset<QT>(s))));
      w[0] = _mm512_permutexvar_ps(q, table);
      w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
    }
  };
  auto accumulate = [&](int64_t i, const vec* w, int nw) {  // nw vectors from (sub-)block i on
    for (int r = 0; r < R; ++r) {
      const float* xr = g.x + (m0 + r) * g.sx + i * QK;
      for (int j = 0; j < nw; ++j) acc[r][j] = vfma(w[j], vload(xr + j * VL), acc[r][j]);
    }
  };
  int64_t i = 0;
  for (; i + 2 <= nb; i += 2) {  // (sub-)blocks i, i + 1
    vec w[4];
    if constexpr (QT == kQ4_K || QT == kQ5_K) {  // nb is whole super-blocks: pairs only
      scales_ahead(i);
      kq4_lut_pair<QT>(wr + i / subs(QT) * block_bytes(QT), static_cast<int>(i % subs(QT)) / 2,
                       sc[i / subs(QT) % 2], iota, w);
    } else {
      block(i, w);
      block(i + 1, w + 2);
    }
    accumulate(i, w, 4);
  }
  if constexpr (QT != kQ4_K && QT != kQ5_K) {  // (those rows are whole super-blocks)
    if (i < nb) {
      vec w[2];
      block(i, w);
      accumulate(i, w, 2);
    }
  }
  for (int r = 0; r < R; ++r)
    g.store(m0 + r, n, vsum(vadd(vadd(acc[r][0], acc[r][1]), vadd(acc[r][2], acc[r][3]))));
}

template <int64_t QT>
void q4_lut_columns(const Gemm& g, int64_t n0, int64_t n1) {
  rows_prefetched(g, n0, n1, [&](int64_t n) {
    int64_t m = 0;
    for (; m + 2 <= g.M; m += 2) dot_q4_lut<QT, 2>(g, n, m);
    if (m < g.M) dot_q4_lut<QT, 1>(g, n, m);
  });
}
#define PDSERVE_Q4_LUT 1
#endif

// Out of line: each type's instance keeps its own inlining budget wherever it is dispatched
// (fused_layer.cpp's columns_share says what inlining them cost).
template <int64_t QT>
__attribute__((noinline)) void gemm_columns(const Gemm& g, int64_t n0, int64_t n1) {
#if defined(PDSERVE_Q4_LUT)
  if constexpr (lut_path(QT)) {
    q4_lut_columns<QT>(g, n0, n1);
    return;
  }
#endif
  rows_prefetched(g, n0, n1, [&](int64_t n) {
    int64_t m = 0;
    for (; m + MT <= g.M; m += MT) dot_tile<QT, MT>(g, n, m);
    for (; m < g.M; ++m) dot_tile<QT, 1>(g, n, m);
  });
}

template <int64_t QT>
void expand_row(const uint8_t* row, int64_t K, float* out) {
  SuperScales sc;
  for (int64_t b = 0; b < K / block_size(QT); ++b) {
    if constexpr (subs(QT) > 1) super_scales<QT>(row + b * block_bytes(QT), sc);
    for (int s = 0; s < subs(QT); ++s) {
      vec w[NV];
      expand<QT>(row + b * block_bytes(QT), s, w, sc);
      for (int j = 0; j < NV; ++j) vstore(out + (b * subs(QT) + s) * QK + j * VL, w[j]);
    }
  }
}

// Panel path, for more activation rows: PANEL weight rows are expanded once into an fp32
// scratch panel (L1/L2-resident), then a register-tiled micro-kernel multiplies R activation
// rows by C panel rows (R * C accumulators, each x and w vector loaded once per tile), over
// M in blocks of MBLOCK rows so the activations stay in L2 while the panel is reused.
// AVX-512: 16-row panels (37 KB at K = 576, inside L1 beside a 4-row activation tile) over
// 64-row blocks (a batch-64 decode in one pass); in one process against 32 / 32 on the Zen 5,
// 30 SmolLM2 Q4_1 layers, 1.02-1.06x at M 8-96 and Q8_0 1.02-1.06x. AVX2: 32 / 32, and
// 3 x 4 tiles (12 accumulators, 3 x and 4 panel loads per 12 FMAs, all 16 ymm registers):
// the 2 x 4 tile's 6 loads per 8 FMAs bound it on a Zen 1 (two 128-bit loads a cycle), and
// 3 x 4 ran those 30 layers 1.22-1.25x faster at M 16-96 (one process each, alternated;
// MBLOCK 48 was no different).
constexpr int NR = 4;
constexpr int MR = VL == 16 ? 4 : 3;
constexpr int64_t PANEL = VL == 16 ? 16 : 32, MBLOCK = VL == 16 ? 64 : 32;

// A thread's expanded panel (PANEL rows of K fp32), 64-byte aligned: K is a multiple of 32, so
// every row then starts on a cache line and no weight load of the micro-kernel splits one
// (std::vector's 16-byte alignment left most of them split).
class PanelScratch {
 public:
  explicit PanelScratch(int64_t K) : buf_(PANEL * K + 16) {}
  float* data() {
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf_.data()) + 63) &
                                    ~static_cast<uintptr_t>(63));
  }

 private:
  std::vector<float> buf_;
};

#if defined(__AVX512F__)
// The sums of 16 vectors, lane i = _mm512_reduce_add_ps(v[i]) bit for bit: the same pairing
// (lanes j + 8, then j + 4, j + 2, j + 1; float addition commutes), done for 16 vectors at once
// in 15 adds and 30 shuffles where 16 reductions take 64 of each (a tile at K = 576 is 36
// steps of 16 FMAs; with the aligned panels above, 1.04-1.05x at M 16-64 on the Zen 5).
inline __m512 sum16(const __m512* v) {
  __m512 h[8], q[4], r[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s 8 halves summed; 8-15: v[2i + 1]'s
    h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int i = 0; i < 4; ++i)  // 128-bit lane k: v[4i + k]'s quarters summed
    q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int i = 0; i < 2; ++i)  // lane k: v[8i + k]'s two pairs, then v[8i + 4 + k]'s
    r[i] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * i], q[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_ps(q[2 * i], q[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  // 128-bit lane k: the sums of v[k], v[4 + k], v[8 + k], v[12 + k]
  return _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)),
                       _mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)));
}
#endif

template <int R, int C>
inline void micro(const Gemm& g, const float* panel, int64_t n, int64_t m) {
  vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  for (int64_t k = 0; k < g.K; k += VL) {
    vec xv[R];
    for (int r = 0; r < R; ++r) xv[r] = vload(g.x + (m + r) * g.sx + k);
    for (int c = 0; c < C; ++c) {
      const vec w = vload(panel + c * g.K + k);
      for (int r = 0; r < R; ++r) acc[r][c] = vfma(xv[r], w, acc[r][c]);
    }
  }
#if defined(__AVX512F__)
  if constexpr (R == 4 && C == 4) {  // the full tile: its 16 sums in one pass
    __m512 v[16];  // v[c * 4 + r] = acc[r][c], so lane 4 r + c holds out[m + r, n + c]
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) v[c * 4 + r] = acc[r][c];
    alignas(64) float s[16];
    _mm512_store_ps(s, sum16(v));
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) g.store(m + r, n + c, s[4 * r + c]);
    return;
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) g.store(m + r, n + c, vsum(acc[r][c]));
}

template <int C>
inline void micro_rows(const Gemm& g, const float* panel, int64_t n, int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + MR <= m1; m += MR) micro<MR, C>(g, panel, n, m);
  if constexpr (MR > 2) {  // a leftover pair in one tile: two x loads per four panel loads
    if (m + 2 <= m1) {
      micro<2, C>(g, panel, n, m);
      m += 2;
    }
  }
  for (; m < m1; ++m) micro<1, C>(g, panel, n, m);
}

template <int64_t QT>
void gemm_panels(const Gemm& g, int64_t n0, int64_t n1, float* scratch) {
  for (int64_t p0 = n0; p0 < n1; p0 += PANEL) {
    const int64_t p1 = std::min(p0 + PANEL, n1);
    for (int64_t n = p0; n < p1; ++n) expand_row<QT>(g.w + n * g.row_bytes, g.K, scratch + (n - p0) * g.K);
    for (int64_t m0 = 0; m0 < g.M; m0 += MBLOCK) {
      const int64_t m1 = std::min(m0 + MBLOCK, g.M);
      int64_t n = p0;
      for (; n + NR <= p1; n += NR) micro_rows<NR>(g, scratch + (n - p0) * g.K, n, m0, m1);
      for (; n < p1; ++n) micro_rows<1>(g, scratch + (n - p0) * g.K, n, m0, m1);
    }
  }
}
#else
// Q4_0 / Q4_1 / IQ4_NL block (IQ4_XS sub-block s) at b by table lookup, the plain C++ form of
// the vector builds' lookup: the block's 16 possible weights (the values expand_scalar
// computes, bit for bit), then one load per weight.
template <int64_t QT>
inline void expand_q4_lut(const uint8_t* b, int s, float* w) {
  float t[16];
  if constexpr (QT == kQ4_1) {
    const float d = half_at(b), m = half_at(b + 2);
    for (int q = 0; q < 16; ++q) t[q] = std::fma(d, static_cast<float>(q), m);
  } else if constexpr (is_iq4(QT)) {
    const float d = iq4_scale<QT>(b, s);
    for (int q = 0; q < 16; ++q) t[q] = d * static_cast<float>(kIQ4NL[q]);
  } else {
    const float d = half_at(b);
    for (int q = 0; q < 16; ++q) t[q] = d * static_cast<float>(q - 8);
  }
  const uint8_t* qs = b + nibble_offset<QT>(s);
  for (int j = 0; j < 16; ++j) {
    w[j] = t[qs[j] & 0x0F];
    w[j + 16] = t[qs[j] >> 4];
  }
}

// Plain C++: each block expanded to a float[32] (the compiler vectorizes what it can); the
// 4-bit types (lut4) by table lookup.
template <int64_t QT>
__attribute__((noinline)) void gemm_columns(const Gemm& g, int64_t n0, int64_t n1) {
  float w[QK];
  const int64_t nb = g.K / QK;  // sub-blocks per row
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = g.w + n * g.row_bytes;
    for (int64_t m = 0; m < g.M; ++m) {
      float acc[QK] = {};
      const float* xr = g.x + m * g.sx;
      for (int64_t b = 0; b < nb; ++b) {
        if constexpr (lut4(QT))
          expand_q4_lut<QT>(wr + b / subs(QT) * block_bytes(QT), b % subs(QT), w);
        else
          expand_scalar<QT>(wr + b / subs(QT) * block_bytes(QT), b % subs(QT), w);
        for (int j = 0; j < QK; ++j) acc[j] += w[j] * xr[b * QK + j];
      }
      float s = 0.f;
      for (int j = 0; j < QK; ++j) s += acc[j];
      g.store(m, n, s);
    }
  }
}

template <int64_t QT>
void expand_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / QK; ++b)
    expand_scalar<QT>(row + b / subs(QT) * block_bytes(QT), b % subs(QT), out + b * QK);
}
#endif

void check_weight(const char* what, const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK_VALUE(valid_qtype(qtype), what, ": qtype must be Q4_0 (2), Q4_1 (3), Q5_0 (6), "
                    "Q5_1 (7), Q8_0 (8), Q2_K (10), Q3_K (11), Q4_K (12), Q5_K (13), Q6_K "
                    "(14), IQ4_NL (20) or IQ4_XS (23), got ", qtype);
  const int64_t bs = block_size(qtype);
  TORCH_CHECK_VALUE(K > 0 && K % bs == 0, what, ": K must be a positive multiple of ", bs,
                    ", got ", K);
  TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                        w.device().is_cpu() && w.size(1) == K / bs * block_bytes(qtype),
                    what, ": weight must be contiguous uint8 CPU [N, K / ", bs, " * ",
                    block_bytes(qtype), "], got ", w.sizes());
}

template <typename F>
void dispatch(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: f(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ5_0: f(std::integral_constant<int64_t, kQ5_0>{}); break;
    case kQ5_1: f(std::integral_constant<int64_t, kQ5_1>{}); break;
    case kQ8_0: f(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kIQ4_NL: f(std::integral_constant<int64_t, kIQ4_NL>{}); break;
    case kIQ4_XS: f(std::integral_constant<int64_t, kIQ4_XS>{}); break;
    case kQ2_K: f(std::integral_constant<int64_t, kQ2_K>{}); break;
    case kQ3_K: f(std::integral_constant<int64_t, kQ3_K>{}); break;
    case kQ4_K: f(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ5_K: f(std::integral_constant<int64_t, kQ5_K>{}); break;
    default: f(std::integral_constant<int64_t, kQ6_K>{}); break;  // check_weight ran first
  }
}

// From this many activation rows on, the panel path (expand once, register-tiled micro-kernel)
// beats re-expanding blocks in registers per row tile (quant/crossover.py measures both).
constexpr int64_t PANEL_MIN_M = 4;

// Output columns [n0, n1) on the calling thread, by the path that suits g.M.
template <int64_t QT>
void columns(const Gemm& g, int64_t n0, int64_t n1) {
#if defined(__AVX2__) && defined(__FMA__)
  if (g.M >= PANEL_MIN_M) {
    PanelScratch scratch(g.K);
    gemm_panels<QT>(g, n0, n1, scratch.data());
    return;
  }
#endif
  gemm_columns<QT>(g, n0, n1);
}

// The checked problem x @ w^T (+ bias) (+ residual); its `out` is for the caller to set.
Gemm prepare(const char* what, const at::Tensor& x, const at::Tensor& w, int64_t qtype,
             const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
                        (x.stride(1) == 1 || x.size(1) <= 1),
                    what, ": x must be float32 CPU [M, K] with unit column stride, got ",
                    x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.dim() == 2 ? w.size(0) : -1;
  check_weight(what, w, qtype, K);
  Gemm g{x.data_ptr<float>(), x.stride(0), M, K, w.data_ptr<uint8_t>(), w.size(1),
         nullptr, nullptr, 0, nullptr, N, N};
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                          bias->device().is_cpu() && bias->numel() == N,
                      what, ": bias must be contiguous float32 CPU [N]");
    g.bias = bias->data_ptr<float>();
  }
  if (residual.has_value() && residual->defined()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK_VALUE(r.dim() == 2 && r.size(0) == M && r.size(1) == N &&
                          r.scalar_type() == at::kFloat && r.device().is_cpu() &&
                          (r.stride(1) == 1 || N <= 1),
                      what, ": residual must be float32 CPU [M, N] with unit column "
                      "stride, got ", r.sizes());
    g.res = r.data_ptr<float>();
    g.sr = r.stride(0);
  }
  return g;
}

// op[m, p] = silu(y[m, p]) * y[m, half + p] for p in [p0, p1): y [M, 2 half] = [gate | up]
// (the GEMM's output), op [M, half].
inline void silu_mul(const float* yp, float* op, int64_t M, int64_t half, int64_t p0,
                     int64_t p1) {
  for (int64_t m = 0; m < M; ++m) {
    const float* g = yp + m * 2 * half;
    pdserve_exp::silu_mul_row(g, g + half, op + m * half, p0, p1);
  }
}

}  // namespace
