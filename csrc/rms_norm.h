// rms_norm / fused_add_rms_norm: parameters and launcher (kernels in rms_norm.cu).
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
  int variant = 0;  // 0: v3 (weight loaded before the reduction), 1: v1 (PAGEDKERN_KERNELS)
};
void rms_norm(const RmsNormParams& p, cudaStream_t stream);

}  // namespace pagedkern
