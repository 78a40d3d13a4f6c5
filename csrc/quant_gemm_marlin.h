// quant_gemm_marlin: W4A16 GEMM on tensor cores over a pre-shuffled int4 weight (kernel and
// layout in quant_gemm_marlin.cu; the repack: python/pagedkern/reference/quant_gemm_marlin_layout.py).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern {

// out[m, n] = sum_k x[m, k] * w[n, k], m < M <= 64, with
//   w[n, k] = round_T(q * scales[k / G, n] + mins[k / G, n]), q the 4-bit weight from qweight in
//   the tile order of quant_gemm_marlin.cu, scales / mins in x's dtype T, [K / G, N].
// k_splits > 1: the K range is cut into k_splits slices (each a whole number of 64-wide K
// tiles); slice s writes fp32 partial sums to workspace[s, M, N], and the last slice of each
// 64-wide N tile to finish (counted in counters[N / 64], zero before the launch and left zero
// after it) adds the slices in order (deterministic), rounding once to T.
struct QuantGemmMarlinParams {
  void* out = nullptr;
  const void* x = nullptr;
  const void* qweight = nullptr;  // uint8, N * K / 2 bytes, tile order
  const void* scales = nullptr;   // T [K / G, N]
  const void* mins = nullptr;     // T [K / G, N]
  float* workspace = nullptr;     // fp32 [k_splits, M, N] when k_splits > 1
  int* counters = nullptr;        // int32 [N / 64], zero, when k_splits > 1
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t x_stride = 0;
  int64_t out_stride = 0;
  int group_size = 128;
  int k_splits = 1;
  DType dtype = DType::kBFloat16;
};

// The block's output tile: N must be a multiple of kQuantGemmMarlinTileN, K of
// kQuantGemmMarlinTileK (and of the group size).
constexpr int64_t kQuantGemmMarlinTileN = 64;
constexpr int64_t kQuantGemmMarlinTileK = 64;
constexpr int64_t kQuantGemmMarlinMaxM = 64;

void quant_gemm_marlin(const QuantGemmMarlinParams& p, cudaStream_t stream);

}  // namespace pagedkern
