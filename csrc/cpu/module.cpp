// pagedkern._cpu's Python module: the quantized GEMV (quant_gemv.h) with the GIL released.

#include <pybind11/pybind11.h>

#include "quant_gemv.h"

namespace py = pybind11;
using namespace pagedkern_cpu;

namespace {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

PYBIND11_MODULE(_cpu, mod) {
  mod.doc() = "pagedkern's CPU kernels: quantized GEMV with run-time ISA dispatch";
  py::dict paths;
  for (int path = 0; path < kNumPaths; ++path) paths[path_name(path)] = path;
  mod.attr("PATHS") = paths;
#ifdef _OPENMP
  mod.attr("OPENMP") = true;
#else
  mod.attr("OPENMP") = false;
#endif
  mod.def("path_supported", &path_supported, py::arg("path"));
  mod.def("best_path", &best_path);
  mod.def("int4_packed_bytes", &int4_packed_bytes, py::arg("n"), py::arg("k"));
  mod.def("int8_packed_bytes", &int8_packed_bytes, py::arg("n"), py::arg("k"));
  mod.def(
      "pack_int4",
      [](uintptr_t out, uintptr_t qweight, uintptr_t scales, uintptr_t mins, int n, int k,
         int group) {
        pack_int4(ptr<uint8_t>(out), ptr<const uint8_t>(qweight), ptr<const uint16_t>(scales),
                  ptr<const uint16_t>(mins), n, k, group);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("scales"), py::arg("mins"),
      py::arg("n"), py::arg("k"), py::arg("group"));
  mod.def(
      "pack_int8",
      [](uintptr_t out, uintptr_t qweight, int n, int k) {
        pack_int8(ptr<uint8_t>(out), ptr<const int8_t>(qweight), n, k);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("n"), py::arg("k"));
  mod.def(
      "gemv",
      [](bool int4, uintptr_t y, int64_t y_stride, uintptr_t x, int64_t x_stride,
         uintptr_t packed, uintptr_t scales, int m, int n, int k, int threads, int path,
         int activation_bits) {
        py::gil_scoped_release release;
        gemv(int4, ptr<float>(y), y_stride, ptr<const float>(x), x_stride,
             ptr<const uint8_t>(packed), ptr<const float>(scales), m, n, k, threads, path,
             activation_bits);
      },
      py::kw_only(), py::arg("int4"), py::arg("y"), py::arg("y_stride"), py::arg("x"),
      py::arg("x_stride"), py::arg("packed"), py::arg("scales"), py::arg("m"), py::arg("n"),
      py::arg("k"), py::arg("threads"), py::arg("path"), py::arg("activation_bits"));
}
