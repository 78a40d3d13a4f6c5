// rms_norm (with the fused residual add) and silu_and_mul (its gated activations).

#include "bindings.h"
#include "rms_norm.h"
#include "silu_and_mul.h"

namespace pagedkern_bindings {

void bind_elementwise(py::module_& m) {
  py::dict activations;  // silu_and_mul's `activation` (GatedActivation)
  activations["silu"] = int(pagedkern::GatedActivation::kSilu);
  activations["gelu_tanh"] = int(pagedkern::GatedActivation::kGeluTanh);
  m.attr("GATED_ACTIVATIONS") = activations;

  m.def(
      "rms_norm",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t residual, std::uintptr_t weight,
         int64_t rows, int64_t hidden, int64_t out_stride, int64_t x_stride,
         int64_t residual_stride, double eps, int dtype, int device, std::uintptr_t stream,
         int variant) {
        pagedkern::RmsNormParams p;
        p.variant = variant;
        p.out = as_ptr<void>(out);
        p.x = as_ptr<const void>(x);
        p.residual = as_ptr<void>(residual);
        p.weight = as_ptr<const void>(weight);
        p.rows = rows;
        p.hidden = hidden;
        p.out_stride = out_stride;
        p.x_stride = x_stride;
        p.residual_stride = residual_stride;
        p.eps = static_cast<float>(eps);
        p.dtype = static_cast<DType>(dtype);
        DeviceGuard guard(device);
        pagedkern::rms_norm(p, as_stream(stream));
      },
      py::kw_only(), py::arg("out"), py::arg("x"), py::arg("residual"), py::arg("weight"),
      py::arg("rows"), py::arg("hidden"), py::arg("out_stride"), py::arg("x_stride"),
      py::arg("residual_stride"), py::arg("eps"), py::arg("dtype"), py::arg("device"),
      py::arg("stream"), py::arg("variant"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "silu_and_mul",
      [](std::uintptr_t out, std::uintptr_t x, int64_t rows, int64_t d, int64_t out_stride,
         int64_t x_stride, int dtype, int activation, int device, std::uintptr_t stream) {
        pagedkern::SiluAndMulParams p;
        p.activation = static_cast<pagedkern::GatedActivation>(activation);
        p.out = as_ptr<void>(out);
        p.x = as_ptr<const void>(x);
        p.rows = rows;
        p.d = d;
        p.out_stride = out_stride;
        p.x_stride = x_stride;
        p.dtype = static_cast<DType>(dtype);
        DeviceGuard guard(device);
        pagedkern::silu_and_mul(p, as_stream(stream));
      },
      py::kw_only(), py::arg("out"), py::arg("x"), py::arg("rows"), py::arg("d"),
      py::arg("out_stride"), py::arg("x_stride"), py::arg("dtype"), py::arg("activation"),
      py::arg("device"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace pagedkern_bindings
