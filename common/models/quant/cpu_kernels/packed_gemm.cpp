// Packed-weight GEMM for GGUF block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
// IQ4_XS and the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), exact fp32 arithmetic:
//   packed_gemm   out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) (+ residual[m, n])
//   dequantize    the fp32 rows of a packed weight (for large-M GEMMs and embedding lookups)
//   dequantize_blocked  the whole weight in oneDNN's blocked layout (the largest-M GEMMs;
//                 blocked_expand.h)
// Each 32-weight (sub-)block is expanded to fp32 in registers exactly as gguf-py's dequantize
// computes it (fp16 scales and mins widened to fp32; the products d * q are exact in fp32, so
// fma(d, q, m) rounds once, like numpy's (d * q) + m), then multiplied with fp32 activations and
// accumulated in fp32. The result equals the dequantized-fp32 GEMM up to summation order; the
// activations are never quantized (llama.cpp's Q8_1 activations change the answer).
//
// Layout: the weight is [N, row_bytes] uint8, each row its blocks back to back, as in the GGUF
// file (GGML type ids: Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11,
// Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23).
//   Q4_0 (18 bytes / 32): fp16 d, 16 bytes of nibbles; w[i] = d * (q[i] - 8)
//   Q4_1 (20 bytes / 32): fp16 d, fp16 m, 16 bytes of nibbles; w[i] = d * q[i] + m
//   Q5_0 (22 bytes / 32): fp16 d, 4 bytes qh (bit i: bit 4 of element i), 16 bytes of nibbles;
//     w[i] = d * (q[i] - 16)   (exact)
//   Q5_1 (24 bytes / 32): fp16 d, fp16 m, qh, nibbles; w[i] = d * q[i] + m   (one rounding)
//   Q8_0 (34 bytes / 32): fp16 d, 32 int8; w[i] = d * q[i]
//   IQ4_NL (18 bytes / 32): fp16 d, 16 bytes of nibbles; w[i] = d * grid[q[i]], the grid 16 int8
//     levels from -127 to 113 (what llama.cpp's IQ4_XS files hold for rows narrower than
//     256)   (exact)
//   Nibble order: byte j holds element j (low nibble) and element j + 16 (high nibble).
// K-quants: super-blocks of 256 weights = 8 sub-blocks of 32, each expanded like a block above.
//   Q2_K (84 bytes): scales[16] (one byte per 16 weights: low nibble sc, high nibble m), qs[64]
//     (2 bits; sub-block s: bits 2 (s % 4) of 32-byte chunk s / 4), fp16 d, fp16 dmin;
//     w = (d * sc[e / 16]) * q - dmin * m[e / 16]   (both products exact: one rounding, an FMA)
//   Q3_K (110 bytes): hmask[32] (bit s of hmask[i] set: element i of sub-block s has no -4),
//     qs[64] (low 2 bits, as Q2_K), 12 bytes of 6-bit scales sc[16] (bias 32), fp16 d;
//     w = (d * (sc[e / 16] - 32)) * (q - 4 * !hbit)   (exact: no rounding at all)
//   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8], 128 bytes
//     of nibbles (32-byte chunk c: sub-block 2c low nibbles, 2c + 1 high nibbles);
//     w = (d * sc[s]) * q - dmin * m[s]   (both products exact: one rounding, an FMA)
//   Q5_K (176 bytes): as Q4_K, with qh[32] after the scales (bit s of qh[i] is bit 4 of element
//     i of sub-block s) and the nibbles after qh
//   Q6_K (210 bytes): ql[128] (4 low bits), qh[64] (2 high bits), int8 scales[16] (one per 16
//     weights), fp16 d; w = (d * scale[e / 16]) * (q - 32)
//   IQ4_XS (136 bytes, IQ4_NL's grid in super-blocks): fp16 d, uint16 scales_h, 4 bytes
//     scales_l, 128 bytes of nibbles (sub-block s: 16 bytes at 8 + 16 s, Q4_0's order);
//     w = (d * (ls[s] - 32)) * grid[q], ls 6 bits (scales_l nibble s, scales_h bits 2 s)
//     (exact: at most 11 + 5 + 7 significant bits)
//
// ISA: AVX-512 (16 lanes), AVX2 + FMA (8 lanes) or plain C++, chosen at build time by the
// compile flags (quant/cpu_native.py). The K-quant bit unpacking is AVX2 code (256-bit byte
// ops, and a super-block's scales at once: super_scales) in both vector builds; AVX-512 widens
// its bytes to 16-lane floats. Threads:
// at::parallel_for over output rows (OpenMP).


#include <ATen/ops/empty.h>

#include "packed_api.h"
#include "blocked_expand.h"
#include "packed_kernels.h"

// x [M, K] fp32 (unit column stride; rows may be strided), w [N, K / block_size * block_bytes] uint8,
// bias [N] fp32 or None, residual [M, N] fp32 (unit column stride) or None -> [M, N] fp32.
at::Tensor packed_gemm(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                       const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual) {
  Gemm g = prepare("packed_gemm", x, w, qtype, bias, residual);
  const int64_t M = g.M, N = g.N;
  at::Tensor out = at::empty({M, N}, x.options());
  g.out = out.data_ptr<float>();
  if (M == 0 || N == 0) return out;
  // enough rows per task to amortize scheduling, few enough that both threads stay busy
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, N / (8 * at::get_num_threads())));
#if defined(__AVX2__) && defined(__FMA__)
  if (M >= PANEL_MIN_M) {  // expand each weight row once, reuse it from scratch for all rows
    dispatch(qtype, [&](auto qt) {
      at::parallel_for(0, (N + PANEL - 1) / PANEL, 1, [&](int64_t q0, int64_t q1) {
        PanelScratch scratch(g.K);
        gemm_panels<decltype(qt)::value>(g, q0 * PANEL, std::min(q1 * PANEL, N),
                                         scratch.data());
      });
    });
    return out;
  }
#endif
  dispatch(qtype, [&](auto qt) {
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      gemm_columns<decltype(qt)::value>(g, n0, n1);
    });
  });
  return out;
}

// Gate/up with SiLU-and-mul fused: w = [gate; up] [N, ...] (N even), bias [N] or None ->
// silu(x Wg^T + bg) * (x Wu^T + bu) [M, N / 2] fp32. A task computes gate columns [p0, p1) and
// the matching up columns, then combines them while they are in L1: one call where the unfused
// path ran a GEMM, a split, a SiLU and a product (four ops, an [M, N] round trip).
at::Tensor packed_gemm_silu_mul(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                                const c10::optional<at::Tensor>& bias) {
  Gemm g = prepare("packed_gemm_silu_mul", x, w, qtype, bias, c10::nullopt);
  TORCH_CHECK_VALUE(g.N % 2 == 0, "packed_gemm_silu_mul: w must have an even number of rows "
                    "([gate; up]), got ", g.N);
  const int64_t M = g.M, N = g.N, half = N / 2;
  at::Tensor y = at::empty({M, N}, x.options());  // [M, gate | up]
  at::Tensor out = at::empty({M, half}, x.options());
  g.out = y.data_ptr<float>();
  if (M == 0 || half == 0) return out;
  float* yp = g.out;
  float* op = out.data_ptr<float>();
  // from PANEL_MIN_M rows on, whole panels per task (32: a multiple of either build's PANEL)
  const int64_t grain = M >= PANEL_MIN_M
                            ? 32
                            : std::max<int64_t>(1, std::min<int64_t>(64, half / (8 * at::get_num_threads())));
  dispatch(qtype, [&](auto qt) {
    at::parallel_for(0, half, grain, [&](int64_t p0, int64_t p1) {
      columns<decltype(qt)::value>(g, p0, p1);
      columns<decltype(qt)::value>(g, half + p0, half + p1);
      silu_mul(yp, op, M, half, p0, p1);
    });
  });
  return out;
}

// y [T, 2 H] fp32 = [gate | up] per row (a plain GEMM's output: the large-M path and the fp32
// weights' merged gate/up GEMM) -> silu(gate) * up [T, H] in one pass. On an AVX2 Zen 1 this
// pass after one GEMM ran 1.07-1.17x faster than oneDNN's swish and binary-mul post-ops on two
// GEMMs at T 8 .. 2048.
at::Tensor silu_mul_rows(const at::Tensor& y) {
  TORCH_CHECK_VALUE(y.dim() == 2 && y.scalar_type() == at::kFloat && y.device().is_cpu() &&
                        y.stride(1) == 1 && y.size(1) % 2 == 0,
                    "silu_mul: y must be float32 CPU [T, 2 H] with unit column stride, got ",
                    y.sizes());
  const int64_t rows = y.size(0), h = y.size(1) / 2, stride = y.stride(0);
  at::Tensor out = at::empty({rows, h}, y.options());
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // ~16K elements a task: fewer rows run on one thread rather than wake the other
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(h, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      pdserve_exp::silu_mul_row(yp + r * stride, yp + r * stride + h, op + r * h, 0, h);
  });
  return out;
}

// w [N, K / block_size * block_bytes] uint8 -> fp32 [R, K]: rows n0 .. n1 of the weight, or the rows
// listed in `rows` (int64, each checked in [0, N)) when given.
at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t K, int64_t n0, int64_t n1,
                      const c10::optional<at::Tensor>& rows) {
  check_weight("dequantize", w, qtype, K);
  const int64_t N = w.size(0);
  const int64_t* ids = nullptr;
  int64_t R;
  if (rows.has_value() && rows->defined()) {
    TORCH_CHECK_VALUE(rows->dim() == 1 && rows->scalar_type() == at::kLong &&
                          rows->is_contiguous() && rows->device().is_cpu(),
                      "dequantize: rows must be contiguous int64 CPU [R]");
    ids = rows->data_ptr<int64_t>();
    R = rows->numel();
    for (int64_t i = 0; i < R; ++i)
      TORCH_CHECK_INDEX(ids[i] >= 0 && ids[i] < N, "dequantize: row ", ids[i],
                        " out of range [0, ", N, ")");
  } else {
    TORCH_CHECK_VALUE(0 <= n0 && n0 <= n1 && n1 <= N, "dequantize: rows [", n0, ", ", n1,
                      ") out of range [0, ", N, "]");
    R = n1 - n0;
  }
  at::Tensor out = at::empty({R, K}, w.options().dtype(at::kFloat));
  const uint8_t* base = w.data_ptr<uint8_t>();
  const int64_t rb = w.size(1);
  float* o = out.data_ptr<float>();
  // From 256K weights (~25 us on one Zen 5 core) every thread expands a share: a whole matrix
  // is expanded for the large-M GEMM that follows, which needs every thread anyway. Expanded on
  // the calling thread alone (4M weights a task before), the other thread went idle and the
  // GEMM had to wake it: 30 layers' expand + GEMM at M = 96 took 99 ms against 55 ms with
  // both threads expanding, and 51 ms with OMP_WAIT_POLICY=active (the wake, not the
  // expansion, was the cost; 2-core Zen 5 VM, whose wake-ups were slow that hour: 51-57 ms
  // against 48-50 in another). A decode's embedding rows stay on the calling thread.
  const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 18) / K);
  dispatch(qtype, [&](auto qt) {
    at::parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        expand_row<decltype(qt)::value>(base + (ids ? ids[r] : n0 + r) * rb, K, o + r * K);
    });
  });
  return out;
}

// w [N, K / block_size * block_bytes] uint8 -> the whole weight, fp32, written into `out` in
// oneDNN's blocked weight layout "Ab{ob}a": blocks of ob rows, each stored column by column,
// weight (n, k) at (n / ob) * ob * K + k * ob + n % ob; the rows past N that pad the last
// block to ob are written as zeros. It is the order `_reorder_linear_weight` gives an fp32
// [N, K] weight (its "AB16b64a" on AVX-512; quant/blocked.py checks it per shape). Written so,
// the GEMM that follows runs on a prepacked weight: handed a plain [N, K] one, oneDNN reorders
// it into this layout on every call.
void dequantize_blocked(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& out,
                        int64_t ob) {
  check_weight("dequantize_blocked", w, qtype, K);
  const int64_t N = w.size(0);
  TORCH_CHECK_VALUE(0 < ob && ob <= 1024, "dequantize_blocked: blocks must hold 1 .. 1024 "
                    "rows, got ", ob);
  const int64_t groups = (N + ob - 1) / ob;
  TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat && out.is_contiguous() &&
                        out.device().is_cpu() && out.numel() == groups * ob * K,
                    "dequantize_blocked: out must be contiguous float32 CPU with ",
                    groups * ob * K, " elements, got ", out.sizes());
  const uint8_t* base = w.data_ptr<uint8_t>();
  const int64_t rb = w.size(1);
  float* o = out.data_ptr<float>();
  dispatch(qtype, [&](auto qt) {
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      std::vector<float> rows(ob * K);  // a block's rows expanded plainly (L2-resident)
      for (int64_t g = g0; g < g1; ++g)
        expand_block_blocked<decltype(qt)::value>(base, rb, K, g * ob, std::min(ob, N - g * ob),
                                                  o + g * ob * K, ob, rows.data());
    });
  });
}

int64_t packed_fused_rows() { return PANEL_MIN_M; }

const char* packed_simd() { return PDSERVE_SIMD; }
