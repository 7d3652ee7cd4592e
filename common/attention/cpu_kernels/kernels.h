// Declarations shared by the native CPU kernels' translation units (built together into one
// module by pdserve/common/attention/cpu_native.py).
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace pdserve_kernels {

// Checks up front (serially, before any thread starts) so bad metadata is a ValueError, never an
// out-of-bounds read.
inline void check_metadata(const int32_t* tables, const int32_t* lens, int64_t num_reqs,
                           int64_t width, int64_t block_size, int64_t num_blocks) {
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t len = lens[r];
    TORCH_CHECK_VALUE(len >= 1 && len <= width * block_size, "seq_lens[", r, "] = ", len,
                      " must be in [1, ", width * block_size, "] (block table width ", width,
                      " x block size ", block_size, ")");
    const int64_t used = (len + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t id = tables[r * width + b];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_tables[", r, ", ", b, "] = ", id,
                        " is outside the cache's ", num_blocks, " blocks");
    }
  }
}

}  // namespace pdserve_kernels

// paged_attention.cpp
at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& kv_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        c10::optional<at::Tensor> out_opt, int64_t heads_per_item);

// prefill_attention.cpp
void paged_prefill(const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& query_start_loc, int64_t first_req, double scale,
                   const at::Tensor& out);
