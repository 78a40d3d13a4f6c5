// silu_and_mul: parameters and launcher (kernel in silu_and_mul.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern {

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
