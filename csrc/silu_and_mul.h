// The gated activations silu_and_mul and gelu_tanh_and_mul: parameters and launcher (kernels in
// silu_and_mul.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern {

enum class GatedActivation : int { kSilu = 0, kGeluTanh = 1 };

// out[r, :] = act(x[r, :d]) * x[r, d:2d], act = silu or gelu with the tanh approximation
struct SiluAndMulParams {
  void* out = nullptr;
  const void* x = nullptr;
  int64_t rows = 0;
  int64_t d = 0;
  int64_t out_stride = 0;
  int64_t x_stride = 0;
  DType dtype = DType::kBFloat16;
  GatedActivation activation = GatedActivation::kSilu;
};
void silu_and_mul(const SiluAndMulParams& p, cudaStream_t stream);

}  // namespace pagedkern
