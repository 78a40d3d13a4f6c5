// fused_moe over weight-only quantized experts (W4A16 / W8A16): the grouped GEMMs and combine
// of moe_experts (moe.h) with int4 or int8 expert weights dequantized in registers (kernel in
// moe_gemm_quant.cu). Routing and grouping are moe.h's moe_route and moe_align.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern {

// As MoeExpertsParams, with each projection's weight W [E, N, K] (gate_up: N = 2I, K = H, gate
// rows then up rows; down: N = H, K = I) stored as
//   bits == 4: q uint8 [E, N, K / 2] (byte j = q[2j] | q[2j+1] << 4, q in 0..15: the
//              QuantizedWeight int4 rows), scales [E, K / G, N] of 32-bit (scale, min) pairs in
//              dtype (scale in the low half): w = round_dtype(q * scale + min)
//   bits == 8: q int8 [E, N, K], scales fp32 [E, N]: w = scale[n] * q, the scale applied to
//              the fp32 sum
// K (H and I) a multiple of 32 and of G (32 or 128).
struct MoeExpertsQuantParams {
  void* out = nullptr;             // [T, H], rows out_stride apart
  void* h = nullptr;               // workspace [padded_rows, I] (dtype), 16-byte aligned
  void* y = nullptr;               // workspace [T*k, H] (dtype), row = pair
  float* workspace = nullptr;      // split-K partial sums, as MoeExpertsParams', or none
  const void* hidden = nullptr;    // [T, H], rows hidden_stride apart, 16-byte aligned rows
  const void* gate_up_q = nullptr;
  const void* gate_up_scales = nullptr;
  const void* down_q = nullptr;
  const void* down_scales = nullptr;
  const float* weights = nullptr;  // [T, k]
  const int32_t* sorted_pairs = nullptr;  // moe_align's, for this tile_m
  const int32_t* tile_expert = nullptr;
  int64_t tokens = 0;
  int64_t hidden_size = 0;
  int64_t inter_size = 0;
  int64_t hidden_stride = 0;
  int64_t out_stride = 0;
  int64_t padded_rows = 0;
  int experts = 0;
  int top_k = 0;
  int tile_m = 16;     // 16 or 64
  int gate_up_splits = 1;  // K splits, as MoeExpertsParams'
  int down_splits = 1;
  int activation = 0;  // 0 silu, 1 gelu_tanh
  int bits = 4;        // 4 or 8
  int group_size = 32;  // int4: 32 or 128
  DType dtype = DType::kBFloat16;
};
void moe_experts_quant(const MoeExpertsQuantParams& p, cudaStream_t stream);

}  // namespace pagedkern
