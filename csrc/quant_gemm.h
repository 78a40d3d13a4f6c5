// quant_gemm: weight-only quantized GEMM for decode-shaped M (kernel in quant_gemm.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern {

// out[m, n] = sum_k x[m, k] * w[n, k] for m < M, n < N, with w stored as
//   int4 (bits == 4): qweight uint8 [N, K/2] (byte j = q[2j] | q[2j+1] << 4), scales and mins
//                     fp16 [N, K/G]: w[n, k] = scales[n, k/G] * q + mins[n, k/G]
//   int8 (bits == 8): qweight int8 [N, K], scales fp32 [N], mins unused: w = scales[n] * q
// x, out: dtype (float16 / bfloat16), row strides in elements.
struct QuantGemmParams {
  void* out = nullptr;
  const void* x = nullptr;
  const void* qweight = nullptr;
  const void* scales = nullptr;
  const void* mins = nullptr;
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t x_stride = 0;
  int64_t out_stride = 0;
  int bits = 4;
  int group_size = 32;
  DType dtype = DType::kBFloat16;
};

// Largest M the kernel takes; larger (prefill-shaped) GEMMs dequantize to a bf16 workspace and
// use cuBLAS through torch (python/pagedkern/ops/quant_gemm.py).
constexpr int64_t kQuantGemmMaxM = 64;

void quant_gemm(const QuantGemmParams& p, cudaStream_t stream);

}  // namespace pagedkern
