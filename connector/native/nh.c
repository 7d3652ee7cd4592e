/* NH, the universal hash of UMAC and Adiantum, in the variant Adiantum specifies (4 passes,
 * 32-bit words, stride 2, 1024-byte chunks; Crowley & Biggers, "Adiantum: length-preserving
 * encryption for entry-level processors", ToSC 2018, section 6.3). connector/nh.py loads this
 * through ctypes (so a call releases the GIL) and turns the chunk hashes into a MAC with
 * Poly1305 under a one-time key; its numpy `nh_reference` is the specification these loops
 * must equal bit for bit (tests/unit/test_nh.py).
 *
 * For each 16-byte unit u of a chunk (little-endian words m0..m3) and pass p = 0..3, with
 * k = key + 4u + 4p (32-bit words):
 *     sum[p] += (u64)(u32)(m0 + k0) * (u32)(m2 + k2) + (u64)(u32)(m1 + k1) * (u32)(m3 + k3)
 * all mod 2^64; a chunk's hash is sum[0..3] as four little-endian u64 (32 bytes). The key is
 * 1024 + 48 bytes (268 words), every chunk starting again at word 0. A final partial unit is
 * zero-padded (the caller authenticates the length separately). x86-64 only: little-endian.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define NH_PASSES 4
#define NH_UNIT 16
#define NH_CHUNK 1024
#define NH_HASH 32

static void unit_scalar(const uint32_t *k, const uint8_t *unit, uint64_t s[NH_PASSES]) {
    uint32_t m[4];
    memcpy(m, unit, NH_UNIT);
    for (int p = 0; p < NH_PASSES; p++) {
        const uint32_t *kp = k + 4 * p;
        s[p] += (uint64_t)(uint32_t)(m[0] + kp[0]) * (uint32_t)(m[2] + kp[2]);
        s[p] += (uint64_t)(uint32_t)(m[1] + kp[1]) * (uint32_t)(m[3] + kp[3]);
    }
}

/* Units [from, units) of a chunk, then its zero-padded tail of `tail` bytes (< 16). */
static void rest_scalar(const uint32_t *key, const uint8_t *msg, size_t from, size_t units,
                        size_t tail, uint64_t s[NH_PASSES]) {
    for (size_t u = from; u < units; u++)
        unit_scalar(key + 4 * u, msg + NH_UNIT * u, s);
    if (tail) {
        uint8_t pad[NH_UNIT] = {0};
        memcpy(pad, msg + NH_UNIT * units, tail);
        unit_scalar(key + 4 * units, pad, s);
    }
}

static void chunk_scalar(const uint32_t *key, const uint8_t *msg, size_t len, uint8_t *out) {
    uint64_t s[NH_PASSES] = {0, 0, 0, 0};
    rest_scalar(key, msg, 0, len / NH_UNIT, len % NH_UNIT, s);
    memcpy(out, s, NH_HASH);
}

/* Two units per step: t = m + k (8 lanes); shuffles put t0,t1 and t2,t3 of each 128-bit lane
 * in the even dwords, so one vpmuludq gives (t0*t2, t1*t3) as two u64 per lane. */
#define NH_PASS_AVX2(acc, off)                                                            \
    do {                                                                                  \
        __m256i t = _mm256_add_epi32(m, _mm256_loadu_si256((const __m256i *)(k + (off)))); \
        acc = _mm256_add_epi64(acc, _mm256_mul_epu32(_mm256_shuffle_epi32(t, 0x10),      \
                                                     _mm256_shuffle_epi32(t, 0x32)));    \
    } while (0)

__attribute__((target("avx2"))) static uint64_t hsum_avx2(__m256i v) {
    __m128i x = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return (uint64_t)_mm_cvtsi128_si64(x) + (uint64_t)_mm_extract_epi64(x, 1);
}

__attribute__((target("avx2"))) static void chunk_avx2(const uint32_t *key, const uint8_t *msg,
                                                       size_t len, uint8_t *out) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t units = len / NH_UNIT, u = 0;
    for (; u + 2 <= units; u += 2) {
        __m256i m = _mm256_loadu_si256((const __m256i *)(msg + NH_UNIT * u));
        const uint32_t *k = key + 4 * u;
        NH_PASS_AVX2(a0, 0);
        NH_PASS_AVX2(a1, 4);
        NH_PASS_AVX2(a2, 8);
        NH_PASS_AVX2(a3, 12);
    }
    uint64_t s[NH_PASSES] = {hsum_avx2(a0), hsum_avx2(a1), hsum_avx2(a2), hsum_avx2(a3)};
    rest_scalar(key, msg, u, units, len % NH_UNIT, s);
    memcpy(out, s, NH_HASH);
}

/* Four units per step: the AVX2 loop's shuffles in each 128-bit lane of a 512-bit vector. */
#define NH_PASS_AVX512(acc, off)                                                           \
    do {                                                                                   \
        __m512i t = _mm512_add_epi32(m, _mm512_loadu_si512((const void *)(k + (off))));   \
        acc = _mm512_add_epi64(acc, _mm512_mul_epu32(_mm512_shuffle_epi32(t, 0x10),       \
                                                     _mm512_shuffle_epi32(t, 0x32)));     \
    } while (0)

__attribute__((target("avx512f"))) static void chunk_avx512(const uint32_t *key,
                                                            const uint8_t *msg, size_t len,
                                                            uint8_t *out) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t units = len / NH_UNIT, u = 0;
    for (; u + 4 <= units; u += 4) {
        __m512i m = _mm512_loadu_si512((const void *)(msg + NH_UNIT * u));
        const uint32_t *k = key + 4 * u;
        NH_PASS_AVX512(a0, 0);
        NH_PASS_AVX512(a1, 4);
        NH_PASS_AVX512(a2, 8);
        NH_PASS_AVX512(a3, 12);
    }
    uint64_t s[NH_PASSES] = {_mm512_reduce_add_epi64(a0), _mm512_reduce_add_epi64(a1),
                             _mm512_reduce_add_epi64(a2), _mm512_reduce_add_epi64(a3)};
    rest_scalar(key, msg, u, units, len % NH_UNIT, s);
    memcpy(out, s, NH_HASH);
}

/* The instruction sets pdserve_nh_chunks may use; the caller checked the CPU and any ISA cap. */
enum { NH_SCALAR = 0, NH_AVX2 = 1, NH_AVX512 = 2 };

/* NH of msg in 1024-byte chunks: out receives ceil(len / 1024) hashes of 32 bytes (none for
 * len 0). isa: one of the NH_* levels above. Returns the bytes written. */
size_t pdserve_nh_chunks(const uint32_t *key, const uint8_t *msg, size_t len, uint8_t *out,
                         int isa) {
    size_t written = 0;
    for (size_t at = 0; at < len; at += NH_CHUNK, written += NH_HASH) {
        size_t n = len - at < NH_CHUNK ? len - at : NH_CHUNK;
        if (isa >= NH_AVX512)
            chunk_avx512(key, msg + at, n, out + written);
        else if (isa == NH_AVX2)
            chunk_avx2(key, msg + at, n, out + written);
        else
            chunk_scalar(key, msg + at, n, out + written);
    }
    return written;
}
