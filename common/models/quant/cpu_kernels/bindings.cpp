// The Python module of the packed-weight kernels: the only translation unit that includes
// torch's Python headers (pybind11 and the tensor casters: about half the build's compile
// time), so it compiles beside the kernels instead of before them.
#include <torch/python.h>

#include "packed_api.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto release = [] { return py::call_guard<py::gil_scoped_release>(); };
  m.def("packed_gemm", &packed_gemm, "x @ W^T (+ bias) (+ residual), W GGUF-packed (CPU, fp32)",
        release(), py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.def("packed_gemm_silu_mul", &packed_gemm_silu_mul,
        "silu(x @ Wg^T + bg) * (x @ Wu^T + bu) for W = [gate; up] GGUF-packed (CPU, fp32)",
        release(), py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none());
  m.def("silu_mul", &silu_mul_rows, "silu(gate) * up of each [gate | up] row (CPU, fp32)",
        release(), py::arg("y"));
  m.def("dequantize", &dequantize, "fp32 rows of a GGUF-packed weight (CPU)", release(),
        py::arg("w"), py::arg("qtype"), py::arg("k"), py::arg("n0") = 0, py::arg("n1") = 0,
        py::arg("rows") = py::none());
  m.def("dequantize_blocked", &dequantize_blocked,
        "a GGUF-packed weight expanded into oneDNN's blocked fp32 layout Ab{ob}a (CPU)",
        release(), py::arg("w"), py::arg("qtype"), py::arg("k"), py::arg("out"), py::arg("ob"));
  m.def("packed_decode_layer", &packed_decode_layer,
        "One packed decoder layer for T < 4 decode tokens in one parallel region (CPU, fp32)",
        release(), py::arg("x"), py::arg("ln1"), py::arg("ln2"), py::arg("eps"),
        py::arg("qkv"), py::arg("qkv_qtype"), py::arg("qkv_bias"), py::arg("o"),
        py::arg("o_qtype"), py::arg("o_bias"), py::arg("gate_up"), py::arg("gate_up_qtype"),
        py::arg("gate_up_bias"), py::arg("down"), py::arg("down_qtype"), py::arg("down_bias"),
        py::arg("cos"), py::arg("sin"), py::arg("kv_cache"), py::arg("slot_mapping"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("num_heads"),
        py::arg("qkv_tail") = py::none(), py::arg("qkv_tail_qtype") = 0,
        py::arg("qkv_tail_bias") = py::none());
  m.def("packed_decode_layers", &packed_decode_layers,
        "A stack of packed decoder layers for T < 4 decode tokens in one parallel region",
        release(), py::arg("x"), py::arg("ln1"), py::arg("ln2"), py::arg("eps"),
        py::arg("qkv_w"), py::arg("o_w"), py::arg("gate_up_w"), py::arg("down_w"),
        py::arg("qtypes"), py::arg("biases"), py::arg("cos"), py::arg("sin"),
        py::arg("kv_caches"), py::arg("slot_mapping"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("num_heads"),
        py::arg("qkv_tails") = std::vector<c10::optional<at::Tensor>>{},
        py::arg("qkv_tail_qtypes") = std::vector<int64_t>{},
        py::arg("qkv_tail_biases") = std::vector<c10::optional<at::Tensor>>{});
  m.attr("fused_rows") = packed_fused_rows();  // packed_decode_layer takes fewer tokens than this
  m.attr("simd") = packed_simd();
}
