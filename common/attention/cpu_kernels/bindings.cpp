// The Python module of the native CPU kernels: the only translation unit that includes
// <torch/python.h> (pybind11 and torch's tensor casters; not <torch/extension.h>, whose C++
// API the bindings do not use and which took 10 s more to compile), see kernels.h.
#include <torch/python.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a kernel runs (nothing here touches Python objects): the services
  // run the engine in a thread beside their asyncio loop, which goes on meanwhile.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode", &paged_decode, "Paged decode attention (CPU, fp32)", release(),
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("out") = py::none(),
        // kv heads per work item, 0 = auto (exposed for the benchmark and tests)
        py::arg("heads_per_item") = 0);
  m.def("paged_prefill", &paged_prefill,
        "Paged prefill attention of requests first_req.. into out (CPU, fp32)", release(),
        py::arg("query"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("first_req"), py::arg("scale"), py::arg("out"));
  m.def("attention_step", &attention_step,
        "Fused layer attention: rotary, KV write, paged decode + prefill attention (CPU, fp32)",
        release(),
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("kv_cache"),
        py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("num_decodes"), py::arg("scale"),
        py::arg("num_heads"));
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU, fp32)", release(), py::arg("x"),
        py::arg("weight"), py::arg("eps"));
  m.def("sample_weights", &sample_weights,
        "Sampling weights exp((x - max) * inv_temp), clamped and flushed (CPU, fp32)", release(),
        py::arg("logits"), py::arg("inv_temp"), py::arg("floor"), py::arg("flush"));
  m.def("argmax_rows", &argmax_rows, "The first index of each row's max, as torch.argmax (CPU, "
        "fp32)", release(), py::arg("logits"));
  m.def("sample_rows", &sample_rows,
        "Fused temperature + min-p inverse-CDF sampling of each row (CPU, fp32)", release(),
        py::arg("logits"), py::arg("inv_temp"), py::arg("min_p"), py::arg("u"),
        py::arg("floor"), py::arg("flush"));
  m.def("sample_top_p_rows", &sample_top_p_rows,
        "Fused temperature + top-p + min-p inverse-CDF sampling of each row (CPU, fp32)",
        release(), py::arg("logits"), py::arg("inv_temp"), py::arg("top_p"), py::arg("min_p"),
        py::arg("u"), py::arg("floor"), py::arg("flush"));
#if defined(__AVX512F__)
  m.attr("simd") = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  m.attr("simd") = "avx2";
#else
  m.attr("simd") = "scalar";
#endif
  // the prefill kernel's vectors only pay with AVX2 or wider (scalar code is ~6x slower than
  // torch's SDPA); callers use SDPA where this is false
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  m.attr("fast_prefill") = true;
#else
  m.attr("fast_prefill") = false;
#endif
}
