// pybind11 module pagedkern._C: raw pointers (as Python ints), shapes, strides, a dtype code, a
// device index and a stream handle in; kernels launched; C++ exceptions out as Python errors
// (std::invalid_argument -> ValueError, std::runtime_error -> RuntimeError). The Python layer
// (python/pagedkern/ops) has already validated everything a user can get wrong.
#include <pybind11/pybind11.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "rms_norm.h"
#include "silu_and_mul.h"

namespace py = pybind11;
using pagedkern::DeviceGuard;
using pagedkern::DType;

namespace {

template <typename P>
P* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<P*>(address);
}

cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// (count, error message): a machine without a GPU or driver reports 0 and why.
std::tuple<int, std::string> device_count() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so later calls start clean
    return {0, std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err)};
  }
  return {count, ""};
}

// Device that owns a pointer, or -1 for host or unknown memory.
int pointer_device(std::uintptr_t address) {
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, as_ptr<const void>(address));
  if (err != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged ? attr.device
                                                                                 : -1;
}

py::dict build_info() {
  py::dict info;
  info["cuda_runtime_version"] = CUDART_VERSION;
#ifdef PAGEDKERN_CUDA_ARCHS
  info["cuda_architectures"] = PAGEDKERN_CUDA_ARCHS;
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedkern CUDA kernels (raw-pointer interface; use pagedkern.ops)";
  m.def("device_count", &device_count);
  m.def("pointer_device", &pointer_device, py::arg("address"));
  m.def("build_info", &build_info);

  m.def(
      "rms_norm",
      [](std::uintptr_t out, std::uintptr_t x, std::uintptr_t residual, std::uintptr_t weight,
         int64_t rows, int64_t hidden, int64_t out_stride, int64_t x_stride,
         int64_t residual_stride, double eps, int dtype, int device, std::uintptr_t stream) {
        pagedkern::RmsNormParams p;
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
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "silu_and_mul",
      [](std::uintptr_t out, std::uintptr_t x, int64_t rows, int64_t d, int64_t out_stride,
         int64_t x_stride, int dtype, int device, std::uintptr_t stream) {
        pagedkern::SiluAndMulParams p;
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
      py::call_guard<py::gil_scoped_release>());
}
