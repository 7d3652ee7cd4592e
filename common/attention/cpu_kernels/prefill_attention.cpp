// Paged prefill / extend attention for the CPU: each prompt chunk attends causally to its whole
// context (cached prefix and the chunk itself), K/V read straight from the paged cache through
// the block table, for all the chunks of a batch in one call.
//
// Why not torch's SDPA: on the CPU it runs one request at a time from Python, a chunk with a
// cached prefix first gathers its K/V into dense tensors, and its GEMMs go to MKL, which takes a
// generic path on AMD CPUs (~70-90 GFLOP/s here). This kernel reaches ~250-330 GFLOP/s with
// AVX-512 on the same machine.
//
// Shape of the computation: a work item is (request, kv head, 16 consecutive query tokens); its
// G = heads / kv_heads query heads share every K/V row. Vectors run across the item's query
// tokens (GCC vector extensions, 16 lanes with AVX-512, 8 with AVX2), so
//   scores S[g][j] (a vector over tokens) = sum_c Qt[g][c] * K[j][c]   (K[j][c] broadcast)
//   O[g][c]       (a vector over tokens) += P[g][j] * V[j][c]          (V[j][c] broadcast)
// need no horizontal reductions, and the softmax over keys is lane-wise. Keys go in tiles of 64
// with an online softmax (running max and sum per token), fp32 throughout; keys after a token's
// position are masked in the tiles that reach past the item's first token.
//
// Layouts: query [T, H, d] (rows may be strided); kv_cache [2, NB, bs, kvh, d] contiguous
// (fp32, bf16 or fp16; a half cache's tile of K / V rows is widened to fp32 into scratch first,
// 16 or 8 elements per instruction, exact, so the tiles below broadcast fp32 straight from
// memory whatever the cache's type);
// block_tables [R, W] int32; seq_lens [R] int32 (context incl. the chunk); query_start_loc
// [R + 1] int32; out [T, H, d] contiguous. Requests first_req .. R - 1 are done; a request's
// chunk of q tokens sits at positions seq_len - q .. seq_len - 1.

#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Query tokens per vector, and the vector registers the tiles below budget for.
#ifdef __AVX512F__
constexpr int kW = 16, kRegs = 32;
#else
constexpr int kW = 8, kRegs = 16;  // AVX2 (the loader only uses this kernel with AVX2 or wider)
#endif
typedef float vf __attribute__((vector_size(kW * 4)));
typedef int32_t vi __attribute__((vector_size(kW * 4)));

constexpr int64_t kKT = 64;  // keys per softmax tile
constexpr int kMaxGC = kRegs >= 32 ? 4 : 3;  // query heads per pass

// Register tiles that fit: qk_tile holds keys x GC accumulators, GC queries and `keys`
// broadcasts; pv_tile holds GC x dims accumulators, GC weights and one broadcast.
// (With AVX-512 and G = 3: 4 keys and 8 dims; with AVX2: 3 keys and 4 dims.)
constexpr int qk_keys(int gc) {
  return 4 * gc + gc + 4 <= kRegs ? 4 : 3 * gc + gc + 3 <= kRegs ? 3 : 2;
}
constexpr int pv_dims(int gc) {
  return 8 * gc + gc + 1 <= kRegs ? 8 : 4 * gc + gc + 1 <= kRegs ? 4 : 2;
}
constexpr float kInf = std::numeric_limits<float>::infinity();

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf splat(float x) { return vf{} + x; }
inline vi splati(int32_t x) { return vi{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// exp for x <= 0 (scores minus their running max): the decode kernel's Cephes expf. Inputs
// below -87 clamp to ~1e-38; masked keys are zeroed explicitly instead of relying on that.
inline vf vexp(vf x) {
  x = vmax(x, splat(-87.0f));
  vf fx = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(fx, vi);         // truncates toward zero ...
  n = n + (fx < __builtin_convertvector(n, vf));  // ... so step down where that rounded up
  fx = __builtin_convertvector(n, vf);
  x = x - fx * 0.693359375f;
  x = x - fx * -2.12194440e-4f;
  vf y = splat(1.9875691500E-4f);
  y = y * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * (x * x) + (x + 1.0f);
  const vi bits = (n + 127) << 23;
  vf pow2n;
  std::memcpy(&pow2n, &bits, sizeof pow2n);
  return y * pow2n;
}

template <typename T>  // the cache's element type (fp32, bf16, fp16), widened when loaded
struct Problem {
  const float* query;
  int64_t q_row_stride;
  const T* k_cache;  // [NB, bs, kvh, d]
  const T* v_cache;
  const int32_t* block_tables;
  int64_t table_width;
  float* out;
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  float scale;
};

struct Item {
  int64_t req, kv_head;
  int64_t q_start;  // the request's first row in query / out
  int64_t q_len;    // its chunk length
  int64_t first;    // the item's first token within the chunk
  int64_t pos0;     // that token's position (= keys it sees - 1)
};

// Per-thread scratch: transposed queries, one tile of scores, output accumulators, the tile's
// K / V rows (in the cache, or widened into kw / vw for a half cache).
struct Scratch {
  std::vector<vf> qt, s, o;              // [GC, d], [GC, kKT], [GC, d]
  std::vector<const float*> krow, vrow;  // the tile's fp32 K / V rows
  std::vector<float> kw, vw;             // [kKT, d] each: a half cache's rows, widened
  Scratch(int64_t d, bool half)
      : qt(kMaxGC * d), s(kMaxGC * kKT), o(kMaxGC * d), krow(kKT), vrow(kKT),
        kw(half ? kKT * d : 0), vw(half ? kKT * d : 0) {}
};

// Row jj of the tile, K and V, as fp32: the cache's own rows, or a half cache's widened into scratch.
template <typename T>
void tile_rows(const T* k, const T* v, int64_t jj, int64_t d, Scratch& sc) {
  if constexpr (std::is_same_v<T, float>) {
    sc.krow[jj] = k, sc.vrow[jj] = v;
  } else {
    float* kw = sc.kw.data() + jj * d;
    float* vw = sc.vw.data() + jj * d;
    pdserve_kernels::widen_row(k, kw, d);
    pdserve_kernels::widen_row(v, vw, d);
    sc.krow[jj] = kw, sc.vrow[jj] = vw;
  }
}

// s[g][jj] = sum_c qt[g][c] * K[jj][c], KJ keys at a time (KJ x GC accumulators in registers)
template <int GC>
void qk_tile(const vf* qt, int64_t d, const float* const* krow, int64_t n, vf* s) {
  constexpr int KJ = qk_keys(GC);
  int64_t jj = 0;
  for (; jj + KJ <= n; jj += KJ) {
    vf a[KJ][GC] = {};
    for (int64_t c = 0; c < d; ++c) {
      vf b[KJ];
#pragma GCC unroll 4
      for (int u = 0; u < KJ; ++u) b[u] = splat(krow[jj + u][c]);
#pragma GCC unroll 4
      for (int g = 0; g < GC; ++g) {
        const vf q = qt[g * d + c];
#pragma GCC unroll 4
        for (int u = 0; u < KJ; ++u) a[u][g] += q * b[u];
      }
    }
    for (int g = 0; g < GC; ++g)
      for (int u = 0; u < KJ; ++u) s[g * kKT + jj + u] = a[u][g];
  }
  for (; jj < n; ++jj) {
    vf a[GC] = {};
    for (int64_t c = 0; c < d; ++c) {
      const vf b = splat(krow[jj][c]);
      for (int g = 0; g < GC; ++g) a[g] += qt[g * d + c] * b;
    }
    for (int g = 0; g < GC; ++g) s[g * kKT + jj] = a[g];
  }
}

// o[g][c] += sum_jj s[g][jj] * V[jj][c], CD dims x GC heads of accumulators in registers
template <int GC>
void pv_tile(const vf* s, int64_t d, const float* const* vrow, int64_t n, vf* o) {
  constexpr int CD = pv_dims(GC);
  int64_t c0 = 0;
  for (; c0 + CD <= d; c0 += CD) {
    vf a[GC][CD];
    for (int g = 0; g < GC; ++g)
      for (int u = 0; u < CD; ++u) a[g][u] = o[g * d + c0 + u];
    for (int64_t jj = 0; jj < n; ++jj) {
      const float* v = vrow[jj] + c0;
      vf p[GC];
      for (int g = 0; g < GC; ++g) p[g] = s[g * kKT + jj];
#pragma GCC unroll 8
      for (int u = 0; u < CD; ++u) {
        const vf b = splat(v[u]);
        for (int g = 0; g < GC; ++g) a[g][u] += p[g] * b;
      }
    }
    for (int g = 0; g < GC; ++g)
      for (int u = 0; u < CD; ++u) o[g * d + c0 + u] = a[g][u];
  }
  for (; c0 < d; ++c0)
    for (int64_t jj = 0; jj < n; ++jj) {
      const vf b = splat(vrow[jj][c0]);
      for (int g = 0; g < GC; ++g) o[g * d + c0] += s[g * kKT + jj] * b;
    }
}

// Online softmax of one tile's scores for GC heads, in place (scores -> weights); rescales the
// running sums l and accumulators o when the running max m grows.
template <int GC>
void softmax_tile(vf* s, int64_t n, int64_t j0, vi pos, bool masked, vf* m, vf* l, vf* o,
                  int64_t d) {
  for (int g = 0; g < GC; ++g) {
    vf* sg = s + g * kKT;
    if (masked)
      for (int64_t jj = 0; jj < n; ++jj)
        sg[jj] = splati(static_cast<int32_t>(j0 + jj)) > pos ? splat(-kInf) : sg[jj];
    vf mx = m[g];
    for (int64_t jj = 0; jj < n; ++jj) mx = vmax(mx, sg[jj]);
    const vf alpha = vexp(m[g] - mx);  // first tile: exp(-inf) ~ 0, while l and o are still 0
    m[g] = mx;
    vf sum = splat(0.f);
    for (int64_t jj = 0; jj < n; ++jj) {
      vf e = vexp(sg[jj] - mx);
      if (masked) e = splati(static_cast<int32_t>(j0 + jj)) > pos ? splat(0.f) : e;
      sg[jj] = e;
      sum += e;
    }
    l[g] = l[g] * alpha + sum;
    for (int64_t c = 0; c < d; ++c) o[g * d + c] *= alpha;
  }
}

// Query heads g0 .. g0 + GC - 1 of the item's kv-head group.
template <int GC, typename T>
void heads_pass(const Problem<T>& p, const Item& it, int64_t g0, Scratch& sc) {
  const int64_t d = p.head_dim, bs = p.block_size, kvh = p.num_kv_heads;
  const int64_t head0 = it.kv_head * (p.num_heads / kvh) + g0;
  const int64_t nt = std::min<int64_t>(kW, it.q_len - it.first);  // valid tokens
  const int64_t row0 = it.q_start + it.first;
  // missing lanes (a chunk's last, partial vector) repeat its last token: finite, never stored
  for (int g = 0; g < GC; ++g)
    for (int64_t c = 0; c < d; ++c) {
      float col[kW];
      for (int64_t t = 0; t < kW; ++t)
        col[t] = p.query[(row0 + std::min(t, nt - 1)) * p.q_row_stride + (head0 + g) * d + c] *
                 p.scale;
      sc.qt[g * d + c] = vload(col);
    }
  vi pos;
  for (int t = 0; t < kW; ++t)
    pos[t] = static_cast<int32_t>(it.pos0 + std::min<int64_t>(t, nt - 1));
  vf m[GC], l[GC];
  for (int g = 0; g < GC; ++g) m[g] = splat(-kInf), l[g] = splat(0.f);
  std::fill(sc.o.begin(), sc.o.begin() + GC * d, splat(0.f));
  const int32_t* table = p.block_tables + it.req * p.table_width;
  const int64_t num_keys = it.pos0 + nt;
  for (int64_t j0 = 0; j0 < num_keys; j0 += kKT) {
    const int64_t n = std::min(kKT, num_keys - j0);
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = j0 + jj;
      const int64_t row = (static_cast<int64_t>(table[j / bs]) * bs + j % bs) * kvh + it.kv_head;
      tile_rows(p.k_cache + row * d, p.v_cache + row * d, jj, d, sc);
    }
    qk_tile<GC>(sc.qt.data(), d, sc.krow.data(), n, sc.s.data());
    softmax_tile<GC>(sc.s.data(), n, j0, pos, /*masked=*/j0 + n - 1 > it.pos0, m, l,
                     sc.o.data(), d);
    pv_tile<GC>(sc.s.data(), d, sc.vrow.data(), n, sc.o.data());
  }
  for (int g = 0; g < GC; ++g) {
    const vf inv = 1.f / l[g];
    for (int64_t c = 0; c < d; ++c) {
      const vf r = sc.o[g * d + c] * inv;
      for (int64_t t = 0; t < nt; ++t) p.out[((row0 + t) * p.num_heads + head0 + g) * d + c] = r[t];
    }
  }
}

template <typename T>
void run_item(const Problem<T>& p, const Item& it, Scratch& sc) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  for (int64_t g0 = 0; g0 < group; g0 += kMaxGC) {
    switch (std::min<int64_t>(kMaxGC, group - g0)) {
      case 1: heads_pass<1, T>(p, it, g0, sc); break;
      case 2: heads_pass<2, T>(p, it, g0, sc); break;
      case 3: heads_pass<3, T>(p, it, g0, sc); break;
      default: heads_pass<kMaxGC, T>(p, it, g0, sc); break;
    }
  }
}

}  // namespace

void paged_prefill(const at::Tensor& query_in, const at::Tensor& kv_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& query_start_loc, int64_t first_req, double scale,
                   const at::Tensor& out) {
  TORCH_CHECK_VALUE(query_in.dim() == 3 && query_in.scalar_type() == at::kFloat &&
                        query_in.device().is_cpu(),
                    "paged_prefill: query must be float32 CPU [T, heads, head_dim], got ",
                    query_in.sizes());
  // a strided row stride (query sliced out of a fused qkv) is fine; heads must be dense
  const at::Tensor query =
      query_in.stride(2) == 1 && query_in.stride(1) == query_in.size(2) ? query_in
                                                                        : query_in.contiguous();
  TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                        kv_cache.device().is_cpu() && kv_cache.size(4) == query.size(2),
                    "paged_prefill: kv_cache must be contiguous (fp32, bf16 or fp16) CPU "
                    "[2, blocks, block_size, kv_heads, head_dim], got ", kv_cache.sizes());
  const int64_t heads = query.size(1), d = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), kvh = kv_cache.size(3);
  pdserve_kernels::check_heads("paged_prefill", heads, kvh);
  pdserve_kernels::check_batch_metadata("paged_prefill", block_tables, seq_lens,
                                        &query_start_loc, bs, num_blocks);
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK_VALUE(first_req >= 0 && first_req <= num_reqs, "paged_prefill: first_req = ",
                    first_req, " must be in [0, ", num_reqs, "]");
  TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat && out.is_contiguous() &&
                        out.device().is_cpu() && out.sizes() == query.sizes(),
                    "paged_prefill: out must be a contiguous float32 CPU tensor of query's "
                    "shape");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  pdserve_kernels::check_chunks("paged_prefill", qsl, lens, first_req, num_reqs, query.size(0));
  std::vector<Item> items;
  for (int64_t r = first_req; r < num_reqs; ++r) {
    const int64_t q_len = static_cast<int64_t>(qsl[r + 1]) - qsl[r];
    for (int64_t first = 0; first < q_len; first += kW)
      for (int64_t h = 0; h < kvh; ++h)
        items.push_back({r, h, qsl[r], q_len, first, lens[r] - q_len + first});
  }
  // One (request, kv head) after another, most keys first within each, taken dynamically:
  // the threads work on neighbouring items of one head, which read the same K/V rows, so those
  // come from the caches once instead of from memory once per item. Sorted by keys alone, the
  // items went round the requests, and a chunk after a long cached prefix overflowed the L3
  // (fp32, 8 chunks of 256 after 768 cached tokens: 12 MB of K/V; 1.29x faster this way on a
  // Zen 1, whole prompts unchanged). The largest items no longer all come first: only within
  // one (request, head) do they, so with very uneven requests the threads may finish less
  // evenly than under the old order.
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.req != b.req) return a.req < b.req;
    if (a.kv_head != b.kv_head) return a.kv_head < b.kv_head;
    return a.pos0 > b.pos0;
  });
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n_items);
  pdserve_kernels::dispatch_kv("paged_prefill", kv_cache.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* kv = static_cast<const T*>(kv_cache.data_ptr());
    const Problem<T> p{query.data_ptr<float>(), query.stride(0), kv,
                       kv + num_blocks * bs * kvh * d, tables, block_tables.size(1),
                       out.data_ptr<float>(), heads, kvh, d, bs, static_cast<float>(scale)};
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      Scratch sc(d, !std::is_same_v<T, float>);
      for (int64_t i; (i = next.fetch_add(1)) < n_items;) run_item(p, items[i], sc);
    });
  });
}
