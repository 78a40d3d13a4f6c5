// Host-side pieces shared by every launcher: the dtype tag passed from Python, error checks, a
// device guard and dtype dispatch. Plain C++ (bindings.cpp includes it through ops.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace pagedkern {

// Mirrored by python/pagedkern/ops/arrays.py DTYPE_CODES (exported as _C.DTYPE_CODES; a test
// compares the two).
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kInt32 = 3, kInt64 = 4 };

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file,
                                          int line) {
  throw std::runtime_error(std::string("CUDA error in ") + what + " (" + file + ":" +
                           std::to_string(line) + "): " + cudaGetErrorName(err) + ": " +
                           cudaGetErrorString(err));
}

#define PK_CUDA_CHECK(expr)                                                         \
  do {                                                                              \
    cudaError_t pk_err_ = (expr);                                                   \
    if (pk_err_ != cudaSuccess) ::pagedkern::throw_cuda_error(pk_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After every <<<...>>>: launch-configuration errors surface here, named after the kernel.
#define PK_CHECK_LAUNCH(kernel_name)                                                      \
  do {                                                                                    \
    cudaError_t pk_err_ = cudaGetLastError();                                             \
    if (pk_err_ != cudaSuccess) ::pagedkern::throw_cuda_error(pk_err_, kernel_name, __FILE__, __LINE__); \
  } while (0)

inline void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// Makes `device` current for the launch and restores the caller's device afterwards, so torch's or
// CuPy's notion of the current device is never changed behind their back.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    PK_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) PK_CUDA_CHECK(cudaSetDevice(device));
    changed_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Calls f(T{}) with T the C++ type of a floating dtype.
template <typename F>
void dispatch_float(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat16: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
    default: throw std::invalid_argument("unsupported dtype code " + std::to_string(int(dtype)));
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15) == 0; }

inline int ceil_div(long long a, long long b) { return int((a + b - 1) / b); }

}  // namespace pagedkern
