// One whole decoder layer of a packed model for a few decode tokens, in ONE native call and ONE
// OpenMP parallel region:
//   RMSNorm -> qkv GEMM -> rotary + KV write -> paged decode attention -> o GEMM + residual
//   -> RMSNorm -> gate/up GEMM + SiLU * up -> down GEMM + residual
// with a barrier between phases. Why: at batch 1 a SmolLM2 step ran ~120 short parallel
// regions (seven native calls per layer) and Python between them; its GEMMs ran at ~29 G
// weights/s inside the engine against ~42 back to back. Here the threads stay in one region per
// layer and only wait at the barriers.
//
// Exactness: every output element is computed by the same inner function, in the same summation
// order, as the seven calls of the module path (packed_kernels.h's gemm_columns, the same
// silu_mul, rms_row, rope_row, store_row and decode_item): only which thread computes which
// GEMM row or attention head differs, and no result depends on that. So the layer's output is
// bit-identical to packed_layer.py's seven calls.
//
// Only for decodes at fewer rows than the packed GEMM's panel path (M < PANEL_MIN_M): the
// caller (packed_layer.py) takes the seven calls otherwise.

#include "packed_kernels.h"

#include "../../../attention/cpu_kernels/decode_attention.h"
#include "../../../attention/cpu_kernels/layer_rows.h"

#include <omp.h>

#include <algorithm>
#include <vector>

namespace {

// One packed linear's weight and bias, checked for K input columns.
struct Linear {
  const uint8_t* w;
  int64_t row_bytes, qtype, N;
  const float* bias;
};

Linear linear(const char* what, const at::Tensor& w, int64_t qtype,
              const c10::optional<at::Tensor>& bias, int64_t K, int64_t N) {
  check_weight(what, w, qtype, K);
  TORCH_CHECK_VALUE(w.size(0) == N, what, ": weight must have ", N, " rows, got ", w.size(0));
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                          bias->device().is_cpu() && bias->numel() == N,
                      what, ": bias must be contiguous float32 CPU [", N, "]");
    b = bias->data_ptr<float>();
  }
  return Linear{w.data_ptr<uint8_t>(), w.size(1), qtype, N, b};
}

// x [M, K] (row stride sx) @ l^T (+ residual [M, N], row stride sr) -> out [M, N]
Gemm gemm_of(const Linear& l, const float* x, int64_t sx, int64_t M, int64_t K,
             const float* res, int64_t sr, float* out) {
  return Gemm{x, sx, M, K, l.w, l.row_bytes, l.bias, res, sr, out, l.N};
}

// Output columns [N * i / n, N * (i + 1) / n) of g: thread i of n's share, by the kernel
// packed_gemm runs below PANEL_MIN_M rows.
void columns_share(const Gemm& g, int64_t qtype, int64_t n0, int64_t n1) {
  if (n0 < n1) dispatch(qtype, [&](auto qt) { gemm_columns<decltype(qt)::value>(g, n0, n1); });
}
inline int64_t split(int64_t n, int i, int parts) { return n * i / parts; }

struct Layer {
  const float* x;  // [T, hidden], row stride sx
  int64_t sx, T, hidden, heads, kvh, d, inter;
  const float *ln1, *ln2;
  float eps;
  Linear qkv, o, gate_up, down;
  const float *cos, *sin;  // [T, d]
  const int64_t* slots;    // [T]
  float* buf;  // h [nt, T, hidden] | qkv [T, (H + 2 kvh) d] | q, attn [T, H d] | x1 [T, hidden]
               // | y [T, 2 I] | g [T, I]
  float* out;  // [T, hidden]
};

template <typename T>
void run_layer(const Layer& L, const DecodeProblem<T>& att, T* kc, T* vc,
               int64_t tile_blocks, int nt) {
  const int64_t Tn = L.T, hid = L.hidden, H = L.heads, kvh = L.kvh, d = L.d, I = L.inter;
  const int64_t nqkv = (H + 2 * kvh) * d, group = H / kvh;
  float* hbuf = L.buf;                    // [nt, T, hidden]: each thread's own normed rows
  float* qkv = hbuf + nt * Tn * hid;      // [T, nqkv]
  float* q = qkv + Tn * nqkv;             // [T, H, d] rotated queries
  float* attn = q + Tn * H * d;           // [T, H, d] == att.out
  float* x1 = attn + Tn * H * d;          // [T, hidden]
  float* y = x1 + Tn * hid;               // [T, 2 I]
  float* g = y + Tn * 2 * I;              // [T, I]
  const int64_t items = Tn * kvh;         // (token, kv head)
#pragma omp parallel num_threads(nt)
  {
    const int n = omp_get_num_threads(), i = omp_get_thread_num();
    float* h = hbuf + i * Tn * hid;
    // RMSNorm on every thread (a few hundred floats): no barrier before the qkv GEMM
    for (int64_t r = 0; r < Tn; ++r) rms_row(L.x + r * L.sx, L.ln1, L.eps, hid, h + r * hid);
    columns_share(gemm_of(L.qkv, h, hid, Tn, hid, nullptr, 0, qkv), L.qkv.qtype,
                  split(nqkv, i, n), split(nqkv, i + 1, n));
#pragma omp barrier
    {  // rotary on the queries and keys of this thread's (token, kv head) items, K/V written
      std::vector<float> k(d);
      for (int64_t it = split(items, i, n); it < split(items, i + 1, n); ++it) {
        const int64_t r = it / kvh, kh = it % kvh;
        const float* row = qkv + r * nqkv;
        const float* c = L.cos + r * d;
        const float* s = L.sin + r * d;
        for (int64_t j = kh * group; j < (kh + 1) * group; ++j)
          rope_row(row + j * d, c, s, q + (r * H + j) * d, d);
        rope_row(row + (H + kh) * d, c, s, k.data(), d);
        store_row(k.data(), kc + (L.slots[r] * kvh + kh) * d, d);
        store_row(row + (H + kvh + kh) * d, vc + (L.slots[r] * kvh + kh) * d, d);
      }
    }
#pragma omp barrier
    {
      Scratch scratch(H, d, tile_blocks * att.block_size);
      for (int64_t it = split(items, i, n); it < split(items, i + 1, n); ++it)
        decode_item(att, it / kvh, it % kvh, it % kvh + 1, tile_blocks,
                                            scratch);
    }
#pragma omp barrier
    columns_share(gemm_of(L.o, attn, H * d, Tn, H * d, L.x, L.sx, x1), L.o.qtype,
                  split(hid, i, n), split(hid, i + 1, n));
#pragma omp barrier
    for (int64_t r = 0; r < Tn; ++r) rms_row(x1 + r * hid, L.ln2, L.eps, hid, h + r * hid);
    {  // gate columns [p0, p1) and the matching up columns, combined while in cache
      const int64_t p0 = split(I, i, n), p1 = split(I, i + 1, n);
      const Gemm gu = gemm_of(L.gate_up, h, hid, Tn, hid, nullptr, 0, y);
      columns_share(gu, L.gate_up.qtype, p0, p1);
      columns_share(gu, L.gate_up.qtype, I + p0, I + p1);
      silu_mul(y, g, Tn, I, p0, p1);
    }
#pragma omp barrier
    columns_share(gemm_of(L.down, g, I, Tn, I, x1, hid, L.out), L.down.qtype,
                  split(hid, i, n), split(hid, i + 1, n));
  }
}

}  // namespace

// x [T, hidden] fp32 (unit column stride), T < PANEL_MIN_M decode tokens (request r is token
// r) -> the layer's output [T, hidden]. Weights as packed_gemm takes them; cos, sin [T, d] fp32
// contiguous; kv_cache [2, NB, bs, kvh, d] (fp32, bf16 or fp16) contiguous; slot_mapping [T]
// int64; block_tables [T, W], seq_lens [T] int32.
at::Tensor packed_decode_layer(
    const at::Tensor& x, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
    const at::Tensor& qkv_w, int64_t qkv_qt, const c10::optional<at::Tensor>& qkv_b,
    const at::Tensor& o_w, int64_t o_qt, const c10::optional<at::Tensor>& o_b,
    const at::Tensor& gu_w, int64_t gu_qt, const c10::optional<at::Tensor>& gu_b,
    const at::Tensor& down_w, int64_t down_qt, const c10::optional<at::Tensor>& down_b,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    double scale, int64_t num_heads) {
  const char* fn = "packed_decode_layer";
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
                        x.stride(1) == 1 && x.size(0) >= 1 && x.size(0) < PANEL_MIN_M,
                    fn, ": x must be float32 CPU [T, hidden], 1 <= T < ", PANEL_MIN_M,
                    ", unit column stride, got ", x.sizes());
  const int64_t T = x.size(0), hidden = x.size(1);
  for (const at::Tensor* w : {&ln1, &ln2})
    TORCH_CHECK_VALUE(w->dim() == 1 && w->size(0) == hidden && w->scalar_type() == at::kFloat &&
                          w->is_contiguous() && w->device().is_cpu(),
                      fn, ": norm weights must be contiguous float32 [", hidden, "]");
  TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                        kv_cache.device().is_cpu(),
                    fn, ": kv_cache must be a contiguous CPU tensor [2, blocks, block_size, "
                    "kv_heads, head_dim], got ", kv_cache.sizes());
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), kvh = kv_cache.size(3);
  const int64_t d = kv_cache.size(4);
  TORCH_CHECK_VALUE(d % 2 == 0, fn, ": head_dim must be even, got ", d);
  pdserve_kernels::check_heads(fn, num_heads, kvh);
  const int64_t q_size = num_heads * d, nqkv = q_size + 2 * kvh * d;
  TORCH_CHECK_VALUE(gu_w.dim() == 2 && gu_w.size(0) % 2 == 0, fn,
                    ": gate_up must stack two equal halves, got ", gu_w.sizes());
  const int64_t inter = gu_w.size(0) / 2;
  const Linear qkv = linear("packed_decode_layer qkv", qkv_w, qkv_qt, qkv_b, hidden, nqkv);
  const Linear o = linear("packed_decode_layer o", o_w, o_qt, o_b, q_size, hidden);
  const Linear gu = linear("packed_decode_layer gate_up", gu_w, gu_qt, gu_b, hidden, 2 * inter);
  const Linear down = linear("packed_decode_layer down", down_w, down_qt, down_b, inter, hidden);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                          t->numel() == T * d && t->device().is_cpu(),
                      fn, ": cos and sin must be contiguous float32 [T, head_dim]");
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                        slot_mapping.device().is_cpu() && slot_mapping.numel() == T,
                    fn, ": slot_mapping must be contiguous int64 CPU [T]");
  // everything the attention reads is checked before the cache is written
  pdserve_kernels::check_batch_metadata(fn, block_tables, seq_lens, nullptr, bs, num_blocks);
  TORCH_CHECK_VALUE(seq_lens.size(0) == T, fn, ": one decode request per token: seq_lens [",
                    seq_lens.size(0), "] for ", T, " tokens");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < T; ++r)
    TORCH_CHECK_VALUE(slots[r] >= 0 && slots[r] < num_blocks * bs, fn, ": slot_mapping[", r,
                      "] = ", slots[r], " is outside the cache's ", num_blocks * bs, " slots");

  const int nt = std::max(1, at::get_num_threads());
  at::Tensor buf = x.new_empty({(nt + 1) * T * hidden + T * nqkv + 2 * T * q_size + 3 * T * inter});
  at::Tensor out = x.new_empty({T, hidden});
  float* bp = buf.data_ptr<float>();
  const Layer L{x.data_ptr<float>(), x.stride(0), T, hidden, num_heads, kvh, d, inter,
                ln1.data_ptr<float>(), ln2.data_ptr<float>(), static_cast<float>(eps),
                qkv, o, gu, down, cos.data_ptr<float>(), sin.data_ptr<float>(), slots, bp,
                out.data_ptr<float>()};
  float* attn = bp + nt * T * hidden + T * nqkv + T * q_size;
  const float* q = attn - T * q_size;
  const int64_t tile_blocks = std::max<int64_t>(1, 64 / bs);  // as paged_decode
  pdserve_kernels::dispatch_kv(fn, kv_cache.scalar_type(), [&](auto zero) {
    using KT = decltype(zero);
    KT* kc = static_cast<KT*>(kv_cache.data_ptr());
    KT* vc = kc + num_blocks * bs * kvh * d;
    const DecodeProblem<KT> att{
        q, q_size, kc, vc, block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), attn,
        num_heads, kvh, d, bs, block_tables.size(1), static_cast<float>(scale)};
    run_layer(L, att, kc, vc, tile_blocks, nt);
  });
  return out;
}
