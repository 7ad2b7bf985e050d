// The Python module of the decode kernels (blend_engine/native.py builds it once per machine).
#include <torch/extension.h>

#include "gemv.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mm", &ragblend::int4_mm, "int4 weights (blocks of nibbles, bf16 scale/zero per 32) x int8-quantized fp32 rows");
  m.def("int8_mm", &ragblend::int8_mm, "int8 weights (bf16 scale per row) x int8-quantized fp32 rows");
  m.def("int8_attention", &ragblend::int8_attention, "one token's attention over a layer of the int8 decode cache",
        py::arg("q"), py::arg("keys"), py::arg("key_scales"), py::arg("values_t"), py::arg("value_scales"),
        py::arg("bias") = py::none());
  m.def("rms_norm", &ragblend::rms_norm, "RMSNorm of fp32 rows, torch's F.rms_norm bit for bit", py::arg("x"),
        py::arg("weight"), py::arg("eps"));
  m.def("int8_write", &ragblend::int8_write, "k, v quantized into the int8 decode cache's slots from start");
}
