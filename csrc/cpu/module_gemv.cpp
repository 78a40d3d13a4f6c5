// pagedkern._cpu: weight packing (pack.cpp), the quantized GEMV (gemv.cpp), rows of a
// quantized weight (dequantize_rows.cpp) and the fixed-order fp32 GEMM (dense_gemm.cpp), the
// GIL released.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "dense_gemm.h"
#include "dequantize_rows.h"
#include "module.h"
#include "quant_gemv.h"

namespace py = pybind11;

namespace pagedkern_cpu {

void bind_gemv(py::module_& mod) {
  mod.def(
      "dequantize_rows",
      [](bool int4, uintptr_t qweight, uintptr_t scales, uintptr_t mins, bool half_scales,
         int64_t n, int64_t k, int group, uintptr_t ids, int m, uintptr_t out, int threads) {
        const DequantizeRowsArgs args{int4, ptr<const void>(qweight), ptr<const void>(scales),
                                      ptr<const void>(mins), half_scales, n, k, group,
                                      ptr<const int32_t>(ids), m, ptr<float>(out), threads};
        py::gil_scoped_release release;
        dequantize_rows(args);
      },
      "int4, qweight, scales, mins, half_scales, n, k, group, ids, m, out, threads "
      "(positional: a step's embedding lookup)");
  mod.def("packed_bytes", &packed_bytes, py::kw_only(), py::arg("format"), py::arg("n"),
          py::arg("k"));
  mod.def(
      "int4_symmetric",
      [](uintptr_t scales, uintptr_t mins, int64_t count) {
        py::gil_scoped_release release;
        return int4_symmetric(ptr<const uint16_t>(scales), ptr<const uint16_t>(mins), count);
      },
      py::kw_only(), py::arg("scales"), py::arg("mins"), py::arg("count"));
  mod.def(
      "pack_int4",
      [](uintptr_t out, uintptr_t qweight, uintptr_t scales, uintptr_t mins, int n, int k,
         int group, int format) {
        pack_int4(ptr<uint8_t>(out), ptr<const uint8_t>(qweight), ptr<const uint16_t>(scales),
                  ptr<const uint16_t>(mins), n, k, group, format);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("scales"), py::arg("mins"),
      py::arg("n"), py::arg("k"), py::arg("group"), py::arg("format"));
  mod.def(
      "pack_int4_zp",
      [](uintptr_t out, uintptr_t qweight, uintptr_t scales, uintptr_t zeros, int n, int k,
         int group) {
        pack_int4_zp(ptr<uint8_t>(out), ptr<const uint8_t>(qweight), ptr<const uint16_t>(scales),
                     ptr<const uint8_t>(zeros), n, k, group);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("scales"), py::arg("zeros"),
      py::arg("n"), py::arg("k"), py::arg("group"));
  mod.def(
      "pack_int8",
      [](uintptr_t out, uintptr_t qweight, int n, int k) {
        pack_int8(ptr<uint8_t>(out), ptr<const int8_t>(qweight), n, k);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("n"), py::arg("k"));
  mod.def(
      "pack_int8_grouped",
      [](uintptr_t out, uintptr_t qweight, uintptr_t scales, int n, int k, int group) {
        pack_int8_grouped(ptr<uint8_t>(out), ptr<const int8_t>(qweight), ptr<const float>(scales),
                          n, k, group);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("scales"), py::arg("n"),
      py::arg("k"), py::arg("group"));
  mod.def(
      "pack_int6",
      [](uintptr_t out, uintptr_t qweight, uintptr_t scales, int n, int k) {
        pack_int6(ptr<uint8_t>(out), ptr<const int8_t>(qweight), ptr<const float>(scales), n, k);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("scales"), py::arg("n"),
      py::arg("k"));
  mod.def(
      "factor_int6_scales",
      [](uintptr_t scales, int n, int k, uintptr_t d, uintptr_t c) {
        py::gil_scoped_release release;
        return factor_int6_scales(ptr<const float>(scales), n, k, ptr<float>(d), ptr<int8_t>(c));
      },
      py::kw_only(), py::arg("scales"), py::arg("n"), py::arg("k"), py::arg("d"), py::arg("c"));
  mod.def(
      "pack_int6_k",
      [](uintptr_t out, uintptr_t qweight, uintptr_t c, uintptr_t d, int n, int k) {
        pack_int6_k(ptr<uint8_t>(out), ptr<const int8_t>(qweight), ptr<const int8_t>(c),
                    ptr<const float>(d), n, k);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("c"), py::arg("d"),
      py::arg("n"), py::arg("k"));
  mod.def(
      "factor_int4_scales",
      [](uintptr_t scales, uintptr_t mins, int n, int k, uintptr_t d, uintptr_t dm, uintptr_t cs,
         uintptr_t cm) {
        py::gil_scoped_release release;
        return factor_int4_scales(ptr<const float>(scales), ptr<const float>(mins), n, k,
                                  ptr<float>(d), ptr<float>(dm), ptr<uint8_t>(cs),
                                  ptr<uint8_t>(cm));
      },
      py::kw_only(), py::arg("scales"), py::arg("mins"), py::arg("n"), py::arg("k"),
      py::arg("d"), py::arg("dm"), py::arg("cs"), py::arg("cm"));
  mod.def(
      "pack_int4_k",
      [](uintptr_t out, uintptr_t qweight, uintptr_t cs, uintptr_t cm, uintptr_t d, uintptr_t dm,
         int n, int k) {
        pack_int4_k(ptr<uint8_t>(out), ptr<const uint8_t>(qweight), ptr<const uint8_t>(cs),
                    ptr<const uint8_t>(cm), ptr<const float>(d), ptr<const float>(dm), n, k);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("cs"), py::arg("cm"),
      py::arg("d"), py::arg("dm"), py::arg("n"), py::arg("k"));
  mod.def(
      "pack_int5",
      [](uintptr_t out, uintptr_t qweight, uintptr_t scales, uintptr_t mins, int n, int k) {
        pack_int5(ptr<uint8_t>(out), ptr<const uint8_t>(qweight), ptr<const float>(scales),
                  ptr<const float>(mins), n, k);
      },
      py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("scales"), py::arg("mins"),
      py::arg("n"), py::arg("k"));
  mod.def(
      "gemv",
      [](int format, uintptr_t y, int64_t y_stride, uintptr_t x, int64_t x_stride,
         uintptr_t packed, uintptr_t scales, int m, int n, int k, int threads, int path,
         int activation_bits) {
        py::gil_scoped_release release;
        gemv(format, ptr<float>(y), y_stride, ptr<const float>(x), x_stride,
             ptr<const uint8_t>(packed), ptr<const float>(scales), m, n, k, threads, path,
             activation_bits);
      },
      py::kw_only(), py::arg("format"), py::arg("y"), py::arg("y_stride"), py::arg("x"),
      py::arg("x_stride"), py::arg("packed"), py::arg("scales"), py::arg("m"), py::arg("n"),
      py::arg("k"), py::arg("threads"), py::arg("path"), py::arg("activation_bits"));
  mod.def(
      "dense_gemm",
      [](uintptr_t y, int64_t y_stride, uintptr_t x, int64_t x_stride, uintptr_t w,
         int64_t w_stride, int m, int n, int k, int threads, int path, int w_type) {
        py::gil_scoped_release release;
        dense_gemm(ptr<float>(y), y_stride, ptr<const float>(x), x_stride, ptr<const void>(w),
                   w_stride, m, n, k, threads, path, w_type);
      },
      py::kw_only(), py::arg("y"), py::arg("y_stride"), py::arg("x"), py::arg("x_stride"),
      py::arg("w"), py::arg("w_stride"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("threads"), py::arg("path"), py::arg("w_type") = 0);
  mod.def(
      "dense_gemm_grouped",
      [](uintptr_t y, uintptr_t x, uintptr_t w, uintptr_t counts, int experts, int n, int k,
         int threads, int path, int w_type) {
        py::gil_scoped_release release;
        dense_gemm_grouped(ptr<float>(y), ptr<const float>(x), ptr<const void>(w),
                           ptr<const int64_t>(counts), experts, n, k, threads, path, w_type);
      },
      py::kw_only(), py::arg("y"), py::arg("x"), py::arg("w"), py::arg("counts"),
      py::arg("experts"), py::arg("n"), py::arg("k"), py::arg("threads"), py::arg("path"),
      py::arg("w_type") = 0);
  // (tests: the plain loop and the AVX2 one give the same bits)
}

}  // namespace pagedkern_cpu
