/*
 * The MoE grouped GEMMs' one pipeline, shared by the float experts (moe_gemm.cu) and the
 * quantized ones (moe_gemm_quant.cu), which differ only in their B-operand loader.
 *
 * moe_gemm_body<kBM, kGated, B, Act>: block (n tile, m tile, K split) = (blockIdx.x, .y, .z)
 *   reads its tile's expert from tile_expert (-1: an unused tile, exit) and computes a kBM x kBN
 *   tile over the K steps of its split:
 *     kGated: h[row, n] = act(round(x_t . wg_e[n] + bg), round(x_t . wu_e[n] + bu))
 *             (N = I, K = H; rows gathered from hidden by token t = pair / k; h indexed by
 *             sorted position; the gate and up rows n and I + n of the expert's weight in the
 *             same block, so the activation is fused and gate_up never reaches memory)
 *     down:   y[pair, n] = round(h[row] . wd_e[n] + bd)        (N = H, K = I; y indexed by pair)
 *   4 warps: kBM = 16 side by side over n (16 columns each), kBM = 64 stacked over m. K runs in
 *   steps of kBK = 32 through a shared-memory pipeline of B::kStages stages (cp.async: the next
 *   steps' A and B tiles in flight while one computes), each step two m16n8k16 mma.sync per n8
 *   fragment (mma_fragments.cuh; fp32 accumulate). A rows are padded to 40 elements so the
 *   32-bit fragment loads of the 8 rows g hit distinct banks. Padding rows (sentinel pairs) load
 *   zeros and store nothing.
 * The B loader (a class with kStages, kVec, kChannelScales, a Stage layout, load and fragment):
 *   moe_gemm.cu's DenseB stages bf16/fp16 weight rows; moe_gemm_quant.cu's QuantB stages the
 *   int4/int8 codes (and int4 scales) and dequantizes the fragments in registers.
 *
 * Split-K (decode: few experts x N tiles under-fill the SMs and each block streams a long K):
 *   split z of `splits` runs K steps [z s, min((z + 1) s, steps)), s = steps_per_split. The
 *   epilogue is one formula either way: pre = acc * channel scale (int8) + bias (split 0 only).
 *   splits == 1 finishes it in place: round to T, the activation, store. splits > 1 stores pre
 *   as fp32 partials [split][row][width] (gate_up: row = sorted position, width 2I, gate then
 *   up; down: row = pair, width H), and the finish runs after the split sum in slice order:
 *   moe_reduce_gate_up (a pass writing h) and moe_combine (reads the down partials in place of
 *   y). Deterministic: no atomics, the same sums on every run.
 */
#pragma once

#include <cuda_pipeline_primitives.h>

#include <string>
#include <type_traits>

#include "device.cuh"
#include "gated_activation.cuh"
#include "mma_fragments.cuh"
#include "moe.h"

namespace pagedkern {

namespace moe_gemm {

constexpr int kWarps = 4;
constexpr int kBN = 64;
constexpr int kBK = 32;
constexpr int kLd = kBK + 8;  // activation (and dense weight) tile row length in shared memory

// One grouped GEMM's operands, as both files' launches fill them.
struct Args {
  void* out = nullptr;         // splits == 1: h [padded_rows, I] (gated) or y [pairs, H] (T)
  float* partials = nullptr;   // splits > 1: [splits][partial_rows][partial_width] fp32
  const void* a = nullptr;     // hidden (gated: row = token) or h (down: row = sorted position)
  const void* b = nullptr;     // the experts' weights, or their codes (B's layout)
  const void* scales = nullptr;  // quantized weights' scales (B's layout), or none
  const void* bias = nullptr;  // [E, weight rows] (T), or none
  const int32_t* sorted_pairs = nullptr;
  const int32_t* tile_expert = nullptr;
  int64_t pairs = 0;
  int64_t a_stride = 0;        // elements between A rows
  int64_t n_total = 0;         // output columns: I (gated) or H
  int64_t k_total = 0;
  int64_t partial_rows = 0;
  int top_k = 1;
  int splits = 1;
  int steps_per_split = 0;
  int group_shift = 0;         // int4: log2(K steps per scale group)
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
};

struct NoAct {  // (the down GEMM: no activation)
  __device__ __forceinline__ float operator()(float g, float) const { return g; }
};

// act(gate) * up for the one-argument activations (gated_activation.cuh)
template <typename F>
struct TimesUp {
  F f;
  __device__ __forceinline__ float operator()(float g, float u) const { return f(g) * u; }
};

template <typename Act>
__device__ __forceinline__ Act make_act(float alpha, float limit) {
  if constexpr (std::is_same_v<Act, ClampedSwiGLU>) {
    return ClampedSwiGLU{alpha, limit};
  } else {
    return Act{};
  }
}

// The epilogue's finish: round(first) (down), or act(round(first), round(second)) (gate_up).
template <typename T, bool kGated, typename Act>
__device__ __forceinline__ T finish(const Act& act, float first, float second) {
  float v = to_float(from_float<T>(first));
  if constexpr (kGated) v = act(v, to_float(from_float<T>(second)));
  return from_float<T>(v);
}

__device__ __forceinline__ uint32_t word_at(const void* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Eight elements k0 .. k0+7 of row `src` (nullptr: zeros) into shared memory. kVec: one
// 16-byte cp.async (zero-filled past the row or for padding; `dummy` is any aligned address,
// never read), waited for by the pipeline; else element loads and stores, done on return.
template <typename T, bool kVec>
__device__ __forceinline__ void stage8(T* dst, const T* src, int64_t k0, int64_t k,
                                       const void* dummy) {
  if constexpr (kVec) {
    const bool valid = src != nullptr && k0 < k;
    __pipeline_memcpy_async(dst, valid ? static_cast<const void*>(src + k0) : dummy, 16,
                            valid ? 0 : 16);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      dst[j] = src != nullptr && k0 + j < k ? src[k0 + j] : from_float<T>(0.f);
  }
}

template <int kBM, bool kGated, typename B, typename Act>
__device__ __forceinline__ void moe_gemm_body(const Args& p) {
  using T = typename B::T;
  constexpr int kWM = kBM / 16;      // warps over m
  constexpr int kWN = kWarps / kWM;  // warps over n
  constexpr int kNF = kBN / kWN / 8;  // n8 fragments per warp
  constexpr int kHalves = kGated ? 2 : 1;
  constexpr int kStages = B::kStages;
  alignas(16) __shared__ T a_tile[kStages][kBM][kLd];
  __shared__ typename B::Stage b_tile[kStages];
  __shared__ int32_t row_pair[kBM];  // the pair of each row, -1 for padding
  __shared__ const T* row_a[kBM];    // its A row (hidden's token row or h's row), or nullptr

  const int tile = blockIdx.y;
  const int expert = p.tile_expert[tile];
  if (expert < 0) return;  // whole block: no barrier reached
  const int split = blockIdx.z;
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int warp_m = warp / kWN, warp_n = warp % kWN;
  const int64_t n0 = int64_t(blockIdx.x) * kBN;
  const int64_t row0 = int64_t(tile) * kBM;
  const T* a_base = static_cast<const T*>(p.a);
  for (int r = tid; r < kBM; r += kWarps * 32) {
    const int32_t pair = p.sorted_pairs[row0 + r];
    row_pair[r] = pair < p.pairs ? pair : -1;
    row_a[r] = pair >= p.pairs ? nullptr
               : kGated        ? a_base + int64_t(pair / p.top_k) * p.a_stride
                               : a_base + (row0 + r) * p.a_stride;
  }
  __syncthreads();

  B b(p, expert, n0, tid);
  float acc[kHalves][kNF][4];
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int f = 0; f < kNF; ++f)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[h][f][i] = 0.f;

  // This thread's 16-byte A chunks of each K step: column (tid % 4) * 8 of rows tid / 4 + 32 i,
  // their row pointers fixed for the whole K loop (nullptr: zeros)
  constexpr int kALoads = (kBM + 31) / 32;
  const int col = (tid % 4) * 8;
  const T* a_src[kALoads];
#pragma unroll
  for (int i = 0; i < kALoads; ++i) {
    const int r = tid / 4 + 32 * i;
    a_src[i] = r < kBM ? row_a[r] : nullptr;
  }
  const int all_steps = int((p.k_total + kBK - 1) / kBK);
  const int first = split * p.steps_per_split;
  const int left = all_steps - first;
  const int steps = left <= 0 ? 0 : left < p.steps_per_split ? left : p.steps_per_split;
  // this split's K step s into stage `stage` (cp.async, or plain stores for the element path)
  auto load = [&](int s, int stage) {
    const int step = first + s;
    const int64_t k = int64_t(step) * kBK + col;
#pragma unroll
    for (int i = 0; i < kALoads; ++i) {
      const int r = tid / 4 + 32 * i;
      if (r < kBM) stage8<T, B::kVec>(&a_tile[stage][r][col], a_src[i], k, p.k_total, p.b);
    }
    b.load(b_tile[stage], step, tid);
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load(s, s);
    __pipeline_commit();
  }
  for (int s = 0; s < steps; ++s) {
    __pipeline_wait_prior(kStages - 2);  // committed: steps 0..s+kStages-2; `s` landed
    __syncthreads();  // ... for every thread, and the stage read at s - 1 is free again
    if (s + kStages - 1 < steps) load(s + kStages - 1, (s + kStages - 1) % kStages);
    __pipeline_commit();
    const int stage = s % kStages;
#pragma unroll
    for (int ks = 0; ks < kBK; ks += 16) {
      const int ar = warp_m * 16 + g;
      const uint32_t a[4] = {word_at(&a_tile[stage][ar][ks + 2 * c]),
                             word_at(&a_tile[stage][ar + 8][ks + 2 * c]),
                             word_at(&a_tile[stage][ar][ks + 2 * c + 8]),
                             word_at(&a_tile[stage][ar + 8][ks + 2 * c + 8])};
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
#pragma unroll
        for (int f = 0; f < kNF; ++f) {
          const int bn = h * kBN + warp_n * (kBN / kWN) + f * 8 + g;
          uint32_t bf[2];
          b.fragment(b_tile[stage], bn, ks, c, bf);
          mma::mma_16816<T>(acc[h][f], a, bf);
        }
      }
    }
  }
  __pipeline_wait_prior(0);

  // Epilogue: pre = acc * channel scale + bias (split 0); finished here or after the split sum
  const int64_t w_rows = kGated ? 2 * p.n_total : p.n_total;  // one expert's weight rows
  const float* channel_scales = nullptr;
  if constexpr (B::kChannelScales)
    channel_scales = static_cast<const float*>(p.scales) + int64_t(expert) * w_rows;
  const T* bias = split == 0 && p.bias != nullptr
                      ? static_cast<const T*>(p.bias) + int64_t(expert) * w_rows
                      : nullptr;
  const Act act = make_act<Act>(p.swiglu_alpha, p.swiglu_limit);
  const int64_t width = kGated ? 2 * p.n_total : p.n_total;  // (partials)
#pragma unroll
  for (int f = 0; f < kNF; ++f) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_m * 16 + g + 8 * half;
      const int32_t pair = row_pair[r];
      if (pair < 0) continue;
      const int64_t out_row = kGated ? row0 + r : pair;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int64_t n = n0 + warp_n * (kBN / kWN) + f * 8 + 2 * c + j;
        if (n >= p.n_total) continue;
        float first = acc[0][f][2 * half + j], second = acc[kHalves - 1][f][2 * half + j];
        if (channel_scales != nullptr) {
          first *= channel_scales[n];
          if constexpr (kGated) second *= channel_scales[p.n_total + n];
        }
        if (bias != nullptr) {
          first += to_float(bias[n]);
          if constexpr (kGated) second += to_float(bias[p.n_total + n]);
        }
        if (p.splits > 1) {
          float* part = p.partials + (int64_t(split) * p.partial_rows + out_row) * width;
          part[n] = first;
          if constexpr (kGated) part[p.n_total + n] = second;
        } else {
          static_cast<T*>(p.out)[out_row * p.n_total + n] =
              finish<T, kGated>(act, first, second);
        }
      }
    }
  }
}

// One grouped GEMM's grid: (N tiles, row tiles, K splits).
inline dim3 gemm_grid(const Args& a, int64_t padded_rows, int tile_m) {
  return dim3(static_cast<unsigned>(ceil_div(a.n_total, kBN)),
              static_cast<unsigned>(padded_rows / tile_m), static_cast<unsigned>(a.splits));
}

// K steps per split for `splits` over k_total (the last split may run fewer).
inline int steps_per_split(int64_t k_total, int splits) {
  return ceil_div(ceil_div(k_total, kBK), splits);
}

}  // namespace moe_gemm

// The passes after the grouped GEMMs, launched by both files (defined in moe_gemm.cu).
struct MoeFinishParams {
  void* h = nullptr;             // [padded_rows, I] (gate_up reduce)
  void* out = nullptr;           // [T, H], rows out_stride apart (combine)
  const void* y = nullptr;       // [T*k, H] down outputs (combine, down_splits == 1)
  const float* partials = nullptr;
  const float* weights = nullptr;  // [T, k]
  const int32_t* sorted_pairs = nullptr;
  int64_t tokens = 0;
  int64_t hidden_size = 0;
  int64_t inter_size = 0;
  int64_t out_stride = 0;
  int64_t padded_rows = 0;
  int top_k = 1;
  int splits = 1;  // of the GEMM whose partials the pass sums
  int activation = 0;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  DType dtype = DType::kBFloat16;
};
// h[row, n] = act(round(sum_z gate partial), round(sum_z up partial)) for the real rows
void moe_reduce_gate_up(const MoeFinishParams& p, cudaStream_t stream);
// out[t, n] = round(sum_slot w[t, slot] * y[t*k + slot, n]) in fp32, slot order; with
// splits > 1, y[pair, n] = round(sum_z down partial[z, pair, n])
void moe_combine(const MoeFinishParams& p, cudaStream_t stream);

namespace moe_gemm {

// What MoeExpertsParams and MoeExpertsQuantParams have in common, for one GEMM (the weight
// operands, bias and activation parameters left to the caller).
template <class P>
Args gemm_args(const P& p, bool gated) {
  Args a;
  a.out = gated ? p.h : p.y;
  a.partials = p.workspace;
  a.a = gated ? p.hidden : p.h;
  a.sorted_pairs = p.sorted_pairs;
  a.tile_expert = p.tile_expert;
  a.pairs = p.tokens * p.top_k;
  a.a_stride = gated ? p.hidden_stride : p.inter_size;
  a.n_total = gated ? p.inter_size : p.hidden_size;
  a.k_total = gated ? p.hidden_size : p.inter_size;
  a.partial_rows = gated ? p.padded_rows : a.pairs;
  a.top_k = p.top_k;
  a.splits = gated ? p.gate_up_splits : p.down_splits;
  a.steps_per_split = steps_per_split(a.k_total, a.splits);
  return a;
}

template <class P>
MoeFinishParams finish_params(const P& p) {
  MoeFinishParams f;
  f.h = p.h;
  f.out = p.out;
  f.y = p.y;
  f.partials = p.workspace;
  f.weights = p.weights;
  f.sorted_pairs = p.sorted_pairs;
  f.tokens = p.tokens;
  f.hidden_size = p.hidden_size;
  f.inter_size = p.inter_size;
  f.out_stride = p.out_stride;
  f.padded_rows = p.padded_rows;
  f.top_k = p.top_k;
  f.splits = p.gate_up_splits;
  f.activation = p.activation;
  f.dtype = p.dtype;
  return f;
}

// The checks both entry points share: the row bound, the grid, the splits and their workspace
// (sized by the caller: max(gate_up_splits * padded_rows * 2I, down_splits * T*k * H) floats).
template <class P>
void require_common(const P& p, const std::string& op) {
  require(p.tokens >= 0 && p.tokens <= 0x7fffffff, op + ": tokens out of range");
  require(p.padded_rows == moe_padded_rows(p.tokens * p.top_k, p.experts, p.tile_m),
          op + ": padded_rows must be moe_padded_rows(T*k, E, tile_m)");
  require(p.padded_rows / p.tile_m <= 65535, op + ": too many row tiles");
  require(p.gate_up_splits >= 1 && p.gate_up_splits <= kMoeMaxSplits && p.down_splits >= 1 &&
              p.down_splits <= kMoeMaxSplits,
          op + ": gate_up_splits and down_splits must be in [1, " +
              std::to_string(kMoeMaxSplits) + "]");
  require(p.workspace != nullptr || (p.gate_up_splits == 1 && p.down_splits == 1),
          op + ": split K needs the fp32 workspace");
}

}  // namespace moe_gemm
}  // namespace pagedkern
