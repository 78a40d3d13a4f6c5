// pagedkern._C's device queries, build info and dtype codes.

#include <string>
#include <tuple>

#include "bindings.h"

namespace pagedkern_bindings {
namespace {

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

// (major, minor) compute capability of `device`.
std::tuple<int, int> compute_capability(int device) {
  int major = 0, minor = 0;
  PK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  PK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return {major, minor};
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

void bind_device(py::module_& m) {
  py::dict dtype_codes;
  dtype_codes["float32"] = int(DType::kFloat32);
  dtype_codes["float16"] = int(DType::kFloat16);
  dtype_codes["bfloat16"] = int(DType::kBFloat16);
  dtype_codes["int32"] = int(DType::kInt32);
  dtype_codes["int64"] = int(DType::kInt64);
  m.attr("DTYPE_CODES") = dtype_codes;

  m.def("device_count", &device_count);
  m.def("pointer_device", &pointer_device, py::kw_only(), py::arg("address"));
  m.def("compute_capability", &compute_capability, py::kw_only(), py::arg("device"));
  m.def("build_info", &build_info);

  m.def(
      "multiprocessor_count",
      [](int device) {
        int count = 0;
        PK_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
        return count;
      },
      py::kw_only(), py::arg("device"));
}

}  // namespace pagedkern_bindings
