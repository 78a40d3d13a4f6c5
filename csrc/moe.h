// fused_moe: the mixture-of-experts MLP as five kernel launches (six with gate_up's K split),
// all on the caller's stream and with every size fixed by the shapes (no host synchronisation,
// so a decode step can be captured in a CUDA graph):
//   moe_route    router logits [T, E] -> expert ids [T, k] int32, weights [T, k] fp32
//   moe_align    ids -> the (token, slot) pairs sorted by expert, padded to the GEMM row tile
//   moe_experts  grouped GEMM gate_up + activation, grouped GEMM down, weighted combine
// Kernels: moe_route.cu (route, align), moe_gemm.cu (experts; the pipeline shared with the
// quantized experts in moe_gemm_pipeline.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern {

// Experts a router / grouping launch takes (shared-memory tables are sized by it).
constexpr int kMoeMaxExperts = 512;
// K splits a grouped GEMM takes (moe_experts' gate_up_splits, down_splits).
constexpr int kMoeMaxSplits = 64;

// kSoftmaxTopk (gpt-oss): the softmax over the k selected logits only (they sum to 1).
enum class MoeScoring : int { kSoftmax = 0, kSigmoid = 1, kSoftmaxTopk = 2 };

// Per token t: score[e] = softmax(logits[t])[e] (fp32) or sigmoid(logits[t, e]); the k experts
// with the largest logits (the score is monotone in the logit, so this is the k largest
// scores), ties to the lower expert id, in descending order; weights = their scores, divided
// by their sum if `renormalize` (kSoftmaxTopk: expf(l - max) of the selected, divided by their
// sum, whatever `renormalize` says). NaN logits: undefined.
struct MoeRouteParams {
  int32_t* ids = nullptr;      // [T, k]
  float* weights = nullptr;    // [T, k]
  const void* logits = nullptr;  // [T, E], rows logits_stride elements apart
  int64_t tokens = 0;
  int64_t logits_stride = 0;
  int experts = 0;
  int top_k = 0;
  bool renormalize = true;
  MoeScoring scoring = MoeScoring::kSoftmax;
  DType dtype = DType::kFloat32;  // of logits
};
void moe_route(const MoeRouteParams& p, cudaStream_t stream);

// Rows of the sorted pair list for `pairs` = T*k pairs and tile m: every expert's pairs padded
// to a multiple of m, at most min(E, pairs) experts non-empty; rounded up to whole tiles.
__host__ __device__ inline int64_t moe_padded_rows(int64_t pairs, int64_t experts,
                                                   int64_t tile_m) {
  const int64_t bound = pairs + (experts < pairs ? experts : pairs) * (tile_m - 1);
  return (bound + tile_m - 1) / tile_m * tile_m;
}

// Pair i = t*k + slot (expert ids[i]). sorted_pairs [padded_rows]: expert 0's pairs in
// increasing i, padded with the sentinel `pairs` to a multiple of tile_m, then expert 1's, ...,
// then sentinels to the end. tile_expert [padded_rows / tile_m]: each tile's expert, -1 for
// the unused tiles at the end. One block; ids must lie in [0, experts).
struct MoeAlignParams {
  int32_t* sorted_pairs = nullptr;
  int32_t* tile_expert = nullptr;
  const int32_t* ids = nullptr;  // [pairs]
  int64_t pairs = 0;
  int experts = 0;
  int tile_m = 16;
};
void moe_align(const MoeAlignParams& p, cudaStream_t stream);

// out[t] = sum_slot weights[t, slot] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t, slot],
// with the reference's roundings: gate/up and each expert's down output (each plus its bias,
// if given, in fp32) rounded to dtype, the activation in fp32 rounded once, the weighted sum
// in fp32 (slot order) rounded once. Activation 2 (gpt-oss's clamped SwiGLU) replaces
// act(gate) * up by (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
// gate_up_splits / down_splits > 1: that GEMM's K split over as many blocks, fp32 partial sums
// in `workspace` (at least max(gate_up_splits * padded_rows * 2I, down_splits * T*k * H)
// floats) added in split order before the rounding (moe_gemm_pipeline.cuh); 1: no split, no
// workspace needed.
struct MoeExpertsParams {
  void* out = nullptr;             // [T, H], rows out_stride apart
  void* h = nullptr;               // workspace [padded_rows, I] (dtype), row = sorted position
  void* y = nullptr;               // workspace [T*k, H] (dtype), row = pair
  float* workspace = nullptr;      // split-K partial sums (see above), or none
  const void* hidden = nullptr;    // [T, H], rows hidden_stride apart
  const void* w_gate_up = nullptr;  // [E, 2I, H] contiguous: gate rows, then up rows
  const void* w_down = nullptr;     // [E, H, I] contiguous
  const void* gate_up_bias = nullptr;  // [E, 2I] contiguous (dtype), or none
  const void* down_bias = nullptr;     // [E, H] contiguous (dtype), or none
  const float* weights = nullptr;   // [T, k]
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
  int tile_m = 16;  // 16 or 64
  int gate_up_splits = 1;  // K splits of each grouped GEMM, 1..kMoeMaxSplits
  int down_splits = 1;
  int activation = 0;  // GatedActivation: 0 silu, 1 gelu_tanh; 2 clamped SwiGLU (gpt-oss)
  float swiglu_alpha = 1.702f;  // activation 2's
  float swiglu_limit = 7.0f;
  DType dtype = DType::kBFloat16;
};
void moe_experts(const MoeExpertsParams& p, cudaStream_t stream);

// moe_experts on wgmma + TMA (moe_gemm_sm90.cu; the moe_gemm:sm90_wgmma variant, not yet
// verified on GPU): the same contract at tile_m 64, for sm_90 GPUs only (elsewhere
// std::invalid_argument), H and I multiples of 8, 16-byte aligned operands and hidden rows,
// one K split (gate_up_splits = down_splits = 1).
void moe_experts_sm90(const MoeExpertsParams& p, cudaStream_t stream);

}  // namespace pagedkern
