// Host entry points of every kernel: one parameter struct per operator (pointers, shapes, strides
// in elements, dtype) and one launcher that validates what it cannot trust, picks the kernel variant
// and launches it on the caller's stream. No torch here: bindings.cpp passes raw values from Python.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern {

// out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight          (residual == nullptr)
// residual[r, :] += x[r, :]; out[r, :] = rms_norm(residual[r, :])      (fused add; out may == x)
struct RmsNormParams {
  void* out = nullptr;
  const void* x = nullptr;
  void* residual = nullptr;
  const void* weight = nullptr;
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t out_stride = 0;  // between rows, in elements
  int64_t x_stride = 0;
  int64_t residual_stride = 0;
  float eps = 1e-6f;
  DType dtype = DType::kBFloat16;
};
void rms_norm(const RmsNormParams& p, cudaStream_t stream);

// out[r, :] = silu(x[r, :d]) * x[r, d:2d]
struct SiluAndMulParams {
  void* out = nullptr;
  const void* x = nullptr;
  int64_t rows = 0;
  int64_t d = 0;
  int64_t out_stride = 0;
  int64_t x_stride = 0;
  DType dtype = DType::kBFloat16;
};
void silu_and_mul(const SiluAndMulParams& p, cudaStream_t stream);

}  // namespace pagedkern
