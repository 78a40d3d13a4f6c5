// The weight-only quantized GEMMs: quant_gemm (SIMT) and quant_gemm_marlin.

#include "bindings.h"
#include "quant_gemm.h"
#include "quant_gemm_marlin.h"

namespace pagedkern_bindings {

void bind_quant_gemm(py::module_& m) {
  // --- quant_gemm: weight-only int4/int8 GEMM for M <= quant_gemm_max_m ---------
  m.attr("quant_gemm_max_m") = pagedkern::kQuantGemmMaxM;
  m.def(
      "quant_gemm",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t qweight, std::uintptr_t scales,
         std::uintptr_t mins, int64_t m_rows, int64_t n, int64_t k, int64_t x_stride,
         int64_t out_stride, int bits, int group_size, int dtype, int device,
         std::uintptr_t stream) {
        pagedkern::QuantGemmParams p;
        p.out = as_ptr<void>(out);
        p.x = as_ptr<const void>(x);
        p.qweight = as_ptr<const void>(qweight);
        p.scales = as_ptr<const void>(scales);
        p.mins = as_ptr<const void>(mins);
        p.m = m_rows;
        p.n = n;
        p.k = k;
        p.x_stride = x_stride;
        p.out_stride = out_stride;
        p.bits = bits;
        p.group_size = group_size;
        p.dtype = static_cast<DType>(dtype);
        DeviceGuard guard(device);
        pagedkern::quant_gemm(p, as_stream(stream));
      },
      py::kw_only(), py::arg("out"), py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"),
      py::arg("m"), py::arg("n"), py::arg("k"), py::arg("x_stride"), py::arg("out_stride"),
      py::arg("bits"), py::arg("group_size"), py::arg("dtype"), py::arg("device"),
      py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  // --- quant_gemm_marlin: W4A16 on tensor cores over the tile-ordered int4 weight ----
  m.attr("quant_gemm_marlin_tile_n") = pagedkern::kQuantGemmMarlinTileN;
  m.attr("quant_gemm_marlin_tile_k") = pagedkern::kQuantGemmMarlinTileK;
  m.def(
      "quant_gemm_marlin",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t qweight, std::uintptr_t scales,
         std::uintptr_t mins, std::uintptr_t workspace, std::uintptr_t counters, int64_t m_rows,
         int64_t n, int64_t k,
         int64_t x_stride, int64_t out_stride, int group_size, int k_splits, int dtype, int device,
         std::uintptr_t stream) {
        pagedkern::QuantGemmMarlinParams p;
        p.out = as_ptr<void>(out);
        p.x = as_ptr<const void>(x);
        p.qweight = as_ptr<const void>(qweight);
        p.scales = as_ptr<const void>(scales);
        p.mins = as_ptr<const void>(mins);
        p.workspace = as_ptr<float>(workspace);
        p.counters = as_ptr<int>(counters);
        p.m = m_rows;
        p.n = n;
        p.k = k;
        p.x_stride = x_stride;
        p.out_stride = out_stride;
        p.group_size = group_size;
        p.k_splits = k_splits;
        p.dtype = static_cast<DType>(dtype);
        DeviceGuard guard(device);
        pagedkern::quant_gemm_marlin(p, as_stream(stream));
      },
      py::kw_only(), py::arg("out"), py::arg("x"), py::arg("qweight"), py::arg("scales"),
      py::arg("mins"), py::arg("workspace"), py::arg("counters"), py::arg("m"), py::arg("n"),
      py::arg("k"),
      py::arg("x_stride"), py::arg("out_stride"), py::arg("group_size"), py::arg("k_splits"),
      py::arg("dtype"), py::arg("device"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace pagedkern_bindings
