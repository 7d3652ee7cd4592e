// The packed kernels' entry points, as the Python module binds them (bindings.cpp). Kept apart
// from packed_kernels.h so that the bindings, the one translation unit that includes pybind11
// and torch's Python headers (the longest to compile), parse no kernel code, and the kernels
// no Python headers: the build compiles them side by side.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

// packed_gemm.cpp
at::Tensor packed_gemm(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                       const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual);
at::Tensor packed_gemm_silu_mul(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                                const c10::optional<at::Tensor>& bias);
at::Tensor silu_mul_rows(const at::Tensor& y);
at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t K, int64_t n0, int64_t n1,
                      const c10::optional<at::Tensor>& rows);
void dequantize_blocked(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& out,
                        int64_t ob);
int64_t packed_fused_rows();  // packed_decode_layer(s) take fewer tokens than this
const char* packed_simd();    // "avx512", "avx2" or "scalar": the build's instruction set

// fused_layer.cpp: one decoder layer for a few decode tokens in one call
at::Tensor packed_decode_layer(
    const at::Tensor& x, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
    const at::Tensor& qkv_w, int64_t qkv_qt, const c10::optional<at::Tensor>& qkv_b,
    const at::Tensor& o_w, int64_t o_qt, const c10::optional<at::Tensor>& o_b,
    const at::Tensor& gu_w, int64_t gu_qt, const c10::optional<at::Tensor>& gu_b,
    const at::Tensor& down_w, int64_t down_qt, const c10::optional<at::Tensor>& down_b,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    double scale, int64_t num_heads, const c10::optional<at::Tensor>& tail_w, int64_t tail_qt,
    const c10::optional<at::Tensor>& tail_b);
// fused_layer.cpp: a stack of such layers in one call
at::Tensor packed_decode_layers(
    const at::Tensor& x, const std::vector<at::Tensor>& ln1, const std::vector<at::Tensor>& ln2,
    double eps, const std::vector<at::Tensor>& qkv_w, const std::vector<at::Tensor>& o_w,
    const std::vector<at::Tensor>& gu_w, const std::vector<at::Tensor>& down_w,
    const std::vector<int64_t>& qtypes, const std::vector<c10::optional<at::Tensor>>& biases,
    const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& kv_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    double scale, int64_t num_heads, const std::vector<c10::optional<at::Tensor>>& tail_w,
    const std::vector<int64_t>& tail_qtypes,
    const std::vector<c10::optional<at::Tensor>>& tail_biases);
