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
// silu_mul, rms_row, rope_row, store_row, and decode_item or, at batch 1, decode_part and
// merge_parts): only which thread computes which GEMM row, attention head or context part
// differs, and no result depends on that. So the layer's output is bit-identical to
// packed_layer.py's seven calls.
//
// Only for decodes at fewer rows than the packed GEMM's panel path (M < PANEL_MIN_M): the
// caller (packed_layer.py) takes the seven calls otherwise.

#include "packed_api.h"
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

// x [M, K] (row stride sx) @ l^T (+ residual [M, N], row stride sr) -> out [M, N], row
// stride so (default N)
Gemm gemm_of(const Linear& l, const float* x, int64_t sx, int64_t M, int64_t K,
             const float* res, int64_t sr, float* out, int64_t so = 0) {
  return Gemm{x, sx, M, K, l.w, l.row_bytes, l.bias, res, sr, out, l.N, so ? so : l.N};
}

// Output columns [N * i / n, N * (i + 1) / n) of g: thread i of n's share, by the kernel
// packed_gemm runs below PANEL_MIN_M rows. Not inlined, and neither is each gemm_columns
// (packed_kernels.h): inlined into layer_phases, one gemm_columns per GGUF type made that
// function large enough that GCC optimized the batch-1 layer worse (with Q5_0 / Q5_1 added,
// SmolLM2's Q4_1 batch-1 decode read 0.6-0.9x in alternated runs until both were out of line).
__attribute__((noinline)) void columns_share(const Gemm& g, int64_t qtype, int64_t n0,
                                             int64_t n1) {
  if (n0 < n1) dispatch(qtype, [&](auto qt) { gemm_columns<decltype(qt)::value>(g, n0, n1); });
}
inline int64_t split(int64_t n, int i, int parts) { return n * i / parts; }

// Columns [c0, c1) of the qkv GEMM h [T, hidden] -> qkv [T, nqkv], whose weight is one
// packed linear, or two when q/k and v differ in type (a Q4_K_M file's Q6_K v): the head's
// rows [0, head.N), the tail's after them. Each column is the one part's own product, as
// the module path's part-by-part GEMMs compute it.
void qkv_share(const Linear& head, const Linear& tail, const float* h, int64_t T,
               int64_t hidden, float* qkv, int64_t c0, int64_t c1) {
  const int64_t na = head.N, nqkv = na + tail.N;
  columns_share(gemm_of(head, h, hidden, T, hidden, nullptr, 0, qkv, nqkv), head.qtype, c0,
                std::min(c1, na));
  if (tail.N)
    columns_share(gemm_of(tail, h, hidden, T, hidden, nullptr, 0, qkv + na, nqkv), tail.qtype,
                  std::max(c0, na) - na, c1 - na);
}

struct Layer {
  const float* x;  // [T, hidden], row stride sx
  int64_t sx, T, hidden, heads, kvh, d, inter;
  const float *ln1, *ln2;
  float eps;
  Linear qkv, o, gate_up, down;
  Linear qkv_tail;  // qkv's last rows when they differ in type (N == 0: none)
  const float *cos, *sin;  // [T, d]
  const int64_t* slots;    // [T]
  float* buf;  // h [nt, T, hidden] | qkv [T, (H + 2 kvh) d] | q, attn [T, H d] | x1 [T, hidden]
               // | y [T, 2 I] | g [T, I] | batch 1: attention parts [DecodeParts::floats]
               // and each thread's own queries and attention [nt, 2, H d]
  float* out;  // [T, hidden]
};

// Token r's key of kv head kh rotated (into k [d]) and written to the cache with its value:
// row is the token's qkv row [(H + 2 kvh) d].
template <typename T>
void store_token_kv(const Layer& L, T* kc, T* vc, const float* row, int64_t r, int64_t kh,
                    float* k) {
  const int64_t H = L.heads, kvh = L.kvh, d = L.d;
  rope_row(row + (H + kh) * d, L.cos + r * d, L.sin + r * d, k, d);
  store_row(k, kc + (L.slots[r] * kvh + kh) * d, d);
  store_row(row + (H + kvh + kh) * d, vc + (L.slots[r] * kvh + kh) * d, d);
}

// Rotary on the queries and keys of thread i's (token, kv head) items of n, their K/V written:
// qkv [T, (H + 2 kvh) d] -> q [T, H, d] and the caches.
template <typename T>
void rope_items(const Layer& L, T* kc, T* vc, const float* qkv, float* q, int n, int i) {
  const int64_t H = L.heads, kvh = L.kvh, d = L.d, nqkv = (H + 2 * kvh) * d, group = H / kvh;
  std::vector<float> k(d);
  for (int64_t it = split(L.T * kvh, i, n); it < split(L.T * kvh, i + 1, n); ++it) {
    const int64_t r = it / kvh, kh = it % kvh;
    const float* row = qkv + r * nqkv;
    const float* c = L.cos + r * d;
    const float* s = L.sin + r * d;
    for (int64_t j = kh * group; j < (kh + 1) * group; ++j)
      rope_row(row + j * d, c, s, q + (r * H + j) * d, d);
    store_token_kv(L, kc, vc, row, r, kh, k.data());
  }
}

// Batch 1's attention on thread i of n, after the qkv GEMM (decode_attention.h's parts): every
// thread rotates all the query heads into its own rows, the last thread (it runs the last part,
// the one that holds the new token) also writes the token's K/V, the parts run, one barrier,
// and every thread merges every head into its own rows (a few hundred floats, the same values
// on each), which it returns [H d] for its share of the o GEMM. A part reads nothing another
// thread writes before the merge, so this takes one barrier where rotary, attention and a
// shared output took three. own: [2, H d] (queries, attention), this thread's.
template <typename T>
const float* attend_one(const Layer& L, const DecodeProblem<T>& att, T* kc, T* vc,
                        const float* qkv, int64_t tile_blocks, float* parts_buf, float* own,
                        int n, int i) {
  const int64_t H = L.heads, d = L.d;
  for (int64_t j = 0; j < H; ++j) rope_row(qkv + j * d, L.cos, L.sin, own + j * d, d);
  if (i == n - 1) {
    std::vector<float> k(d);
    for (int64_t kh = 0; kh < L.kvh; ++kh) store_token_kv(L, kc, vc, qkv, 0, kh, k.data());
  }
  DecodeProblem<T> mine = att;
  mine.query = own;
  const DecodeParts parts(parts_buf, H, d);
  decode_parts(mine, 0, split(kDecodeParts, i, n), split(kDecodeParts, i + 1, n), tile_blocks,
               parts);
#pragma omp barrier
  merge_parts(parts, H, d, 0, H, own + H * d);
  return own + H * d;
}

// The layer's phases on thread i of the n in the calling parallel region (buffers as Layer.buf
// lays them out for nt threads), a barrier between phases; the caller's region ends or
// barriers before anything reads L.out.
template <typename T>
void layer_phases(const Layer& L, const DecodeProblem<T>& att, T* kc, T* vc,
                  int64_t tile_blocks, int nt, int n, int i) {
  const int64_t Tn = L.T, hid = L.hidden, H = L.heads, kvh = L.kvh, d = L.d, I = L.inter;
  const int64_t nqkv = (H + 2 * kvh) * d;
  float* hbuf = L.buf;                    // [nt, T, hidden]: each thread's own normed rows
  float* qkv = hbuf + nt * Tn * hid;      // [T, nqkv]
  float* q = qkv + Tn * nqkv;             // [T, H, d] rotated queries
  float* attn = q + Tn * H * d;           // [T, H, d] == att.out
  float* x1 = attn + Tn * H * d;          // [T, hidden]
  float* y = x1 + Tn * hid;               // [T, 2 I]
  float* g = y + Tn * 2 * I;              // [T, I]
  const int64_t items = Tn * kvh;         // (token, kv head)
  {
    float* h = hbuf + i * Tn * hid;
    // RMSNorm on every thread (a few hundred floats): no barrier before the qkv GEMM
    for (int64_t r = 0; r < Tn; ++r) rms_row(L.x + r * L.sx, L.ln1, L.eps, hid, h + r * hid);
    qkv_share(L.qkv, L.qkv_tail, h, Tn, hid, qkv, split(nqkv, i, n), split(nqkv, i + 1, n));
#pragma omp barrier
    const float* o_in = attn;  // the o GEMM's input rows [T, H d]
    if (Tn == 1) {
      float* parts = g + I;  // batch 1's parts, then each thread's own [2, H d]
      o_in = attend_one(L, att, kc, vc, qkv, tile_blocks, parts,
                        parts + DecodeParts::floats(H, d) + i * 2 * H * d, n, i);
    } else {
      rope_items(L, kc, vc, qkv, q, n, i);
#pragma omp barrier
      Scratch scratch(H, d, tile_blocks * att.block_size);
      for (int64_t it = split(items, i, n); it < split(items, i + 1, n); ++it)
        decode_item(att, it / kvh, it % kvh, it % kvh + 1, tile_blocks, scratch);
#pragma omp barrier
    }
    columns_share(gemm_of(L.o, o_in, H * d, Tn, H * d, L.x, L.sx, x1), L.o.qtype,
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

template <typename T>
void run_layer(const Layer& L, const DecodeProblem<T>& att, T* kc, T* vc,
               int64_t tile_blocks, int nt) {
#pragma omp parallel num_threads(nt)
  layer_phases(L, att, kc, vc, tile_blocks, nt, omp_get_num_threads(), omp_get_thread_num());
}


// One step's shape and attention metadata, checked once for every layer it runs.
struct Step {
  int64_t T, hidden, num_blocks, bs, kvh, d, heads, q_size, nqkv;
  const float *cos, *sin;
  const int64_t* slots;
};

Step check_step(const char* fn, const at::Tensor& x, const at::Tensor& cos,
                const at::Tensor& sin, const at::Tensor& kv_cache,
                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                const at::Tensor& seq_lens, int64_t num_heads) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
                        x.stride(1) == 1 && x.size(0) >= 1 && x.size(0) < PANEL_MIN_M,
                    fn, ": x must be float32 CPU [T, hidden], 1 <= T < ", PANEL_MIN_M,
                    ", unit column stride, got ", x.sizes());
  const int64_t T = x.size(0);
  TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                        kv_cache.device().is_cpu(),
                    fn, ": kv_cache must be a contiguous CPU tensor [2, blocks, block_size, "
                    "kv_heads, head_dim], got ", kv_cache.sizes());
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), kvh = kv_cache.size(3);
  const int64_t d = kv_cache.size(4);
  TORCH_CHECK_VALUE(d % 2 == 0, fn, ": head_dim must be even, got ", d);
  pdserve_kernels::check_heads(fn, num_heads, kvh);
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
  const int64_t q_size = num_heads * d;
  return Step{T, x.size(1), num_blocks, bs, kvh, d, num_heads, q_size, q_size + 2 * kvh * d,
              cos.data_ptr<float>(), sin.data_ptr<float>(), slots};
}

// One packed linear's arguments as the caller passed them (checked by `linear`)
struct LinearArg {
  const at::Tensor& w;
  int64_t qtype;
  const c10::optional<at::Tensor>& bias;
};

// One layer's weights, checked against the step's shape by layer_of. qkv_tail: qkv's last
// rows in another type, or none (w undefined).
struct Weights {
  const at::Tensor &ln1, &ln2;
  LinearArg qkv, o, gate_up, down, qkv_tail;
};

// A layer's optional qkv tail (weight, type, bias) from the callers' optional arguments
const at::Tensor& tail_weight(const c10::optional<at::Tensor>& w) {
  static const at::Tensor none;
  return w.has_value() ? *w : none;
}

int64_t inter_of(const char* fn, const at::Tensor& gu_w) {
  TORCH_CHECK_VALUE(gu_w.dim() == 2 && gu_w.size(0) % 2 == 0, fn,
                    ": gate_up must stack two equal halves, got ", gu_w.sizes());
  return gu_w.size(0) / 2;
}

// The Layer for weights w reading x (row stride sx) and writing out; buf holds buf_floats.
Layer layer_of(const char* fn, const Step& s, const Weights& w, double eps, const float* x,
               int64_t sx, float* buf, float* out) {
  for (const at::Tensor* t : {&w.ln1, &w.ln2})
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == s.hidden && t->scalar_type() == at::kFloat &&
                          t->is_contiguous() && t->device().is_cpu(),
                      fn, ": norm weights must be contiguous float32 [", s.hidden, "]");
  const int64_t inter = inter_of(fn, w.gate_up.w);
  auto lin = [&](const char* what, const LinearArg& a, int64_t K, int64_t N) {
    return linear(what, a.w, a.qtype, a.bias, K, N);
  };
  Linear tail{nullptr, 0, 0, 0, nullptr};
  if (w.qkv_tail.w.defined()) {
    const at::Tensor& t = w.qkv_tail.w;
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) >= 1 && t.size(0) < s.nqkv, fn,
                      ": the qkv tail must have 1 to ", s.nqkv - 1, " rows, got ", t.sizes());
    tail = lin("packed_decode_layer qkv tail", w.qkv_tail, s.hidden, t.size(0));
  }
  return Layer{x, sx, s.T, s.hidden, s.heads, s.kvh, s.d, inter,
               w.ln1.data_ptr<float>(), w.ln2.data_ptr<float>(), static_cast<float>(eps),
               lin("packed_decode_layer qkv", w.qkv, s.hidden, s.nqkv - tail.N),
               lin("packed_decode_layer o", w.o, s.q_size, s.hidden),
               lin("packed_decode_layer gate_up", w.gate_up, s.hidden, 2 * inter),
               lin("packed_decode_layer down", w.down, inter, s.hidden),
               tail, s.cos, s.sin, s.slots, buf, out};
}

// Floats of Layer.buf for nt threads (see Layer)
int64_t buf_floats(const Step& s, int64_t inter, int nt) {
  return (nt + 1) * s.T * s.hidden + s.T * s.nqkv + 2 * s.T * s.q_size + 3 * s.T * inter +
         DecodeParts::floats(s.heads, s.d) + nt * 2 * s.q_size;
}

// The attention problem of a layer whose buffers are laid out from bp (see layer_phases)
template <typename KT>
DecodeProblem<KT> attention_of(const Step& s, const at::Tensor& kv_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens,
                               double scale, float* attn) {
  KT* kc = static_cast<KT*>(kv_cache.data_ptr());
  const int64_t cache = s.num_blocks * s.bs * s.kvh * s.d;  // K then V
  return DecodeProblem<KT>{attn - s.T * s.q_size, s.q_size, kc, kc + cache,
                           block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), attn,
                           s.heads, s.kvh, s.d, s.bs, block_tables.size(1),
                           static_cast<float>(scale)};
}

// Where layer_phases puts the attention output in buf (after h, qkv and q)
float* attn_in(const Step& s, float* bp, int nt) {
  return bp + nt * s.T * s.hidden + s.T * s.nqkv + s.T * s.q_size;
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
    double scale, int64_t num_heads, const c10::optional<at::Tensor>& tail_w, int64_t tail_qt,
    const c10::optional<at::Tensor>& tail_b) {
  const char* fn = "packed_decode_layer";
  const Step s = check_step(fn, x, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens,
                            num_heads);
  const int nt = std::max(1, at::get_num_threads());
  at::Tensor buf = x.new_empty({buf_floats(s, inter_of(fn, gu_w), nt)});
  at::Tensor out = x.new_empty({s.T, s.hidden});
  float* bp = buf.data_ptr<float>();
  const Weights w{ln1, ln2, {qkv_w, qkv_qt, qkv_b}, {o_w, o_qt, o_b}, {gu_w, gu_qt, gu_b},
                  {down_w, down_qt, down_b}, {tail_weight(tail_w), tail_qt, tail_b}};
  const Layer L = layer_of(fn, s, w, eps, x.data_ptr<float>(), x.stride(0), bp,
                           out.data_ptr<float>());
  const int64_t tile_blocks = std::max<int64_t>(1, 64 / s.bs);  // as paged_decode
  pdserve_kernels::dispatch_kv(fn, kv_cache.scalar_type(), [&](auto zero) {
    using KT = decltype(zero);
    const DecodeProblem<KT> att = attention_of<KT>(s, kv_cache, block_tables, seq_lens, scale,
                                                   attn_in(s, bp, nt));
    run_layer(L, att, const_cast<KT*>(att.k_cache), const_cast<KT*>(att.v_cache), tile_blocks, nt);
  });
  return out;
}

// A stack of packed layers (one per entry of every list, in order) for the same decode step as
// packed_decode_layer, in ONE call and ONE parallel region: each layer's phases as there, a
// barrier between layers. qtypes [L, 4]: the qkv, o, gate_up and down types of each layer.
// tail_w, tail_qtypes, tail_biases: empty, or one entry per layer (its qkv tail or none).
// kv_caches: one per layer, all of one shape and dtype. Bit-identical to calling
// packed_decode_layer layer by layer (the same phases on the same buffers' values).
at::Tensor packed_decode_layers(
    const at::Tensor& x, const std::vector<at::Tensor>& ln1, const std::vector<at::Tensor>& ln2,
    double eps, const std::vector<at::Tensor>& qkv_w, const std::vector<at::Tensor>& o_w,
    const std::vector<at::Tensor>& gu_w, const std::vector<at::Tensor>& down_w,
    const std::vector<int64_t>& qtypes, const std::vector<c10::optional<at::Tensor>>& biases,
    const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& kv_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    double scale, int64_t num_heads, const std::vector<c10::optional<at::Tensor>>& tail_w,
    const std::vector<int64_t>& tail_qtypes,
    const std::vector<c10::optional<at::Tensor>>& tail_biases) {
  const char* fn = "packed_decode_layers";
  const size_t n_layers = ln1.size();
  const bool tails = !tail_w.empty();
  TORCH_CHECK_VALUE(!tails || (tail_w.size() == n_layers && tail_qtypes.size() == n_layers &&
                               tail_biases.size() == n_layers),
                    fn, ": the qkv tails need one entry per layer (", n_layers, ") or none");
  const c10::optional<at::Tensor> no_tensor;
  TORCH_CHECK_VALUE(n_layers >= 1 && ln2.size() == n_layers && qkv_w.size() == n_layers &&
                        o_w.size() == n_layers && gu_w.size() == n_layers &&
                        down_w.size() == n_layers && kv_caches.size() == n_layers &&
                        qtypes.size() == 4 * n_layers && biases.size() == 4 * n_layers,
                    fn, ": every list needs one entry per layer (", n_layers,
                    "; qtypes and biases four per layer)");
  const Step s = check_step(fn, x, cos, sin, kv_caches[0], slot_mapping, block_tables,
                            seq_lens, num_heads);
  for (const at::Tensor& c : kv_caches)
    TORCH_CHECK_VALUE(c.sizes() == kv_caches[0].sizes() && c.is_contiguous() &&
                          c.device().is_cpu() && c.scalar_type() == kv_caches[0].scalar_type(),
                      fn, ": every layer's kv_cache must be contiguous, of one shape and dtype");
  const int nt = std::max(1, at::get_num_threads());
  int64_t inter = 0;
  for (const at::Tensor& w : gu_w) inter = std::max(inter, inter_of(fn, w));
  at::Tensor buf = x.new_empty({buf_floats(s, inter, nt)});
  at::Tensor outs = x.new_empty({2, s.T, s.hidden});  // layers write them in turn
  float* bp = buf.data_ptr<float>();
  std::vector<Layer> layers;
  for (size_t l = 0; l < n_layers; ++l) {
    const size_t j = 4 * l;  // this layer's qtypes and biases: qkv, o, gate_up, down
    const Weights w{ln1[l], ln2[l], {qkv_w[l], qtypes[j], biases[j]},
                    {o_w[l], qtypes[j + 1], biases[j + 1]},
                    {gu_w[l], qtypes[j + 2], biases[j + 2]},
                    {down_w[l], qtypes[j + 3], biases[j + 3]},
                    {tail_weight(tails ? tail_w[l] : no_tensor), tails ? tail_qtypes[l] : 0,
                     tails ? tail_biases[l] : no_tensor}};
    const float* in = l == 0 ? x.data_ptr<float>() : layers.back().out;
    const int64_t sx = l == 0 ? x.stride(0) : s.hidden;
    layers.push_back(layer_of(fn, s, w, eps, in, sx, bp, outs[l % 2].data_ptr<float>()));
  }
  const int64_t tile_blocks = std::max<int64_t>(1, 64 / s.bs);  // as paged_decode
  pdserve_kernels::dispatch_kv(fn, kv_caches[0].scalar_type(), [&](auto zero) {
    using KT = decltype(zero);
    std::vector<DecodeProblem<KT>> att;
    for (size_t l = 0; l < n_layers; ++l)
      att.push_back(attention_of<KT>(s, kv_caches[l], block_tables, seq_lens, scale,
                                     attn_in(s, bp, nt)));
#pragma omp parallel num_threads(nt)
    {
      const int n = omp_get_num_threads(), i = omp_get_thread_num();
      for (size_t l = 0; l < n_layers; ++l) {
        if (l) {
#pragma omp barrier
        }
        layer_phases(layers[l], att[l], const_cast<KT*>(att[l].k_cache),
                     const_cast<KT*>(att[l].v_cache),
                     tile_blocks, nt, n, i);
      }
    }
  });
  return outs[(n_layers - 1) % 2];
}
