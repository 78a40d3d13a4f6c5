/*
 * The MoE experts (parameters in moe.h): two grouped GEMMs on tensor cores and a combine,
 * over the pairs moe_align sorted by expert and padded to the row tile kBM (16 or 64).
 *
 * moe_gemm_kernel<T, kBM, kGated, kVec, Act>: grid (ceil(N / kBN), padded_rows / kBM); block
 *   (n tile, m tile) reads its tile's expert from tile_expert (-1: an unused tile, exit) and
 *   computes a kBM x kBN tile of
 *     kGated: h[row, n] = act(round(x_t . wg_e[n] + bg), round(x_t . wu_e[n] + bu))
 *             (N = I, K = H; act(g, u) = act(g) * u, or gpt-oss's clamped SwiGLU; the
 *             expert's biases, if any, added in fp32 before the rounding)
 *             rows gathered from hidden by token t = pair / k; h indexed by sorted position;
 *             the gate and up tiles (rows n and I + n of w_gate_up[e]) in the same block, so
 *             the activation is fused into the epilogue and gate_up never reaches memory.
 *     down:   y[pair, n] = round(h[row] . wd_e[n] + bd)                       (N = H, K = I)
 *             rows of h in place; y indexed by pair, so the combine reads each token's k
 *             rows contiguously.
 *   Padding rows (sentinel pairs) load zeros and store nothing. 4 warps: kBM = 16 puts them
 *   side by side over n (16 columns each), kBM = 64 stacks them over m (16 rows each, all 64
 *   columns). K runs in steps of kBK = 32 through a shared-memory pipeline of 4 stages
 *   (kBM = 16) or 3: the next steps' A and B tiles are in flight while one computes (rows
 *   padded to 40 elements so the 32-bit fragment loads of the 8 rows g hit distinct banks),
 *   each step two m16n8k16 mma.sync (mma_fragments.cuh; bf16/fp16 in, fp32 accumulate). kVec: 16-byte cp.async
 *   copies (K % 8 == 0 and aligned rows), zero-filled past K, past N and for padding rows;
 *   else element loads stored into the same stages. Any H and I work.
 * moe_combine_kernel<T>: out[t, n] = round(sum_slot w[t, slot] * y[t*k + slot, n]) in fp32,
 *   slot order: a deterministic reduce (no atomics), the same result on every run.
 *
 * Traffic at decode (T*k pairs on distinct experts): each routed expert's weights are read once
 * (3*H*I elements); the floor is those bytes / copy bandwidth. At prefill the FLOPs are
 * 6*T*k*H*I. Not in this version: ldmatrix, wgmma/TMA on sm_90a, split-K for decode shapes
 * with few CTAs, quantized experts. Not yet verified on GPU.
 */
#include <cuda_pipeline_primitives.h>

#include <type_traits>

#include "device.cuh"
#include "gated_activation.cuh"
#include "mma_fragments.cuh"
#include "moe.h"

namespace pagedkern {
namespace {

constexpr int kWarps = 4;
constexpr int kBN = 64;
constexpr int kBK = 32;
constexpr int kLd = kBK + 8;  // shared-memory row length (elements)

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
__device__ __forceinline__ Act make_act(const MoeExpertsParams& p) {
  if constexpr (std::is_same_v<Act, ClampedSwiGLU>) {
    return ClampedSwiGLU{p.swiglu_alpha, p.swiglu_limit};
  } else {
    return Act{};
  }
}

// Eight elements k0 .. k0+7 of row `src` (nullptr: zeros) into shared memory. kVec: one
// 16-byte cp.async (zero-filled past the row or for padding; `dummy` is any aligned address,
// never read), waited for by the pipeline; else element loads and stores, done on return.
template <typename T, bool kVec>
__device__ __forceinline__ void stage8(T* dst, const T* src, int64_t k0, int64_t k,
                                       const T* dummy) {
  if constexpr (kVec) {
    const bool valid = src != nullptr && k0 < k;
    __pipeline_memcpy_async(dst, valid ? src + k0 : dummy, 16, valid ? 0 : 16);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      dst[j] = src != nullptr && k0 + j < k ? src[k0 + j] : from_float<T>(0.f);
  }
}

__device__ __forceinline__ uint32_t word_at(const void* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <typename T, int kBM, bool kGated, bool kVec, typename Act>
__global__ void __launch_bounds__(kWarps * 32) moe_gemm_kernel(const MoeExpertsParams p) {
  constexpr int kBRows = kGated ? 2 * kBN : kBN;
  constexpr int kWM = kBM / 16;           // warps over m
  constexpr int kWN = kWarps / kWM;       // warps over n
  constexpr int kNF = kBN / kWN / 8;      // n8 fragments per warp
  constexpr int kHalves = kGated ? 2 : 1;
  // K steps in flight (cp.async pipeline): 4 at the decode tile, whose CTAs are few and each
  // must keep more weight bytes in flight; 3 at 64 rows (static shared memory < 48 KiB)
  constexpr int kStages = kBM == 16 ? 4 : 3;
  alignas(16) __shared__ T a_tile[kStages][kBM][kLd];
  alignas(16) __shared__ T b_tile[kStages][kBRows][kLd];
  __shared__ int32_t row_pair[kBM];  // the pair of each row, -1 for padding
  __shared__ const T* row_a[kBM];    // its A row (hidden's token row or h's row), or nullptr

  const int tile = blockIdx.y;
  const int expert = p.tile_expert[tile];
  if (expert < 0) return;  // whole block: no barrier reached
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int warp_m = warp / kWN, warp_n = warp % kWN;
  const int64_t pairs = p.tokens * p.top_k;
  const int64_t n_total = kGated ? p.inter_size : p.hidden_size;
  const int64_t k_total = kGated ? p.hidden_size : p.inter_size;
  const int64_t n0 = int64_t(blockIdx.x) * kBN;
  const int64_t row0 = int64_t(tile) * kBM;
  const T* a_base = static_cast<const T*>(kGated ? p.hidden : p.h);
  for (int r = tid; r < kBM; r += kWarps * 32) {
    const int32_t pair = p.sorted_pairs[row0 + r];
    row_pair[r] = pair < pairs ? pair : -1;
    row_a[r] = pair >= pairs ? nullptr
               : kGated      ? a_base + int64_t(pair / p.top_k) * p.hidden_stride
                             : a_base + (row0 + r) * p.inter_size;
  }
  __syncthreads();

  const T* w_base = static_cast<const T*>(kGated ? p.w_gate_up : p.w_down) +
                    int64_t(expert) * (kGated ? 2 * n_total : n_total) * k_total;

  float acc[kHalves][kNF][4];
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int f = 0; f < kNF; ++f)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[h][f][i] = 0.f;

  // This thread's 16-byte chunks of each K step: column (tid % 4) * 8 of rows tid / 4 + 32 i,
  // their row pointers fixed for the whole K loop (nullptr: zeros)
  constexpr int kALoads = (kBM + 31) / 32, kBLoads = kBRows / 32;
  const int col = (tid % 4) * 8;
  const T* a_src[kALoads];
  const T* b_src[kBLoads];
#pragma unroll
  for (int i = 0; i < kALoads; ++i) {
    const int r = tid / 4 + 32 * i;
    a_src[i] = r < kBM ? row_a[r] : nullptr;
  }
#pragma unroll
  for (int i = 0; i < kBLoads; ++i) {
    const int r = tid / 4 + 32 * i;
    const int64_t n = n0 + (r % kBN);
    b_src[i] = n < n_total ? w_base + (r >= kBN ? n_total + n : n) * k_total : nullptr;
  }
  // K step `step` into stage `stage` (cp.async, or plain stores for the element path)
  auto load = [&](int step, int stage) {
    const int64_t k = int64_t(step) * kBK + col;
#pragma unroll
    for (int i = 0; i < kALoads; ++i) {
      const int r = tid / 4 + 32 * i;
      if (r < kBM) stage8<T, kVec>(&a_tile[stage][r][col], a_src[i], k, k_total, w_base);
    }
#pragma unroll
    for (int i = 0; i < kBLoads; ++i)
      stage8<T, kVec>(&b_tile[stage][tid / 4 + 32 * i][col], b_src[i], k, k_total, w_base);
  };
  const int steps = int((k_total + kBK - 1) / kBK);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load(s, s);
    __pipeline_commit();
  }
  for (int step = 0; step < steps; ++step) {
    __pipeline_wait_prior(kStages - 2);  // committed: steps 0..step+kStages-2; `step` landed
    __syncthreads();  // ... for every thread, and the stage read at step - 1 is free again
    if (step + kStages - 1 < steps) load(step + kStages - 1, (step + kStages - 1) % kStages);
    __pipeline_commit();
    const int stage = step % kStages;
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
          const uint32_t b[2] = {word_at(&b_tile[stage][bn][ks + 2 * c]),
                                 word_at(&b_tile[stage][bn][ks + 2 * c + 8])};
          mma::mma_16816<T>(acc[h][f], a, b);
        }
      }
    }
  }
  __pipeline_wait_prior(0);

  const Act act = make_act<Act>(p);
  T* out = static_cast<T*>(kGated ? p.h : p.y);
  const int64_t out_stride = kGated ? p.inter_size : p.hidden_size;
  // this expert's biases ([2I]: gate then up; [H]), or none
  const T* bias = static_cast<const T*>(kGated ? p.gate_up_bias : p.down_bias);
  if (bias != nullptr) bias += int64_t(expert) * (kGated ? 2 * n_total : n_total);
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
        if (n >= n_total) continue;
        float v = acc[0][f][2 * half + j];
        if (bias != nullptr) v += to_float(bias[n]);
        v = to_float(from_float<T>(v));
        if constexpr (kGated) {
          float u = acc[kHalves - 1][f][2 * half + j];
          if (bias != nullptr) u += to_float(bias[n_total + n]);
          v = act(v, to_float(from_float<T>(u)));
        }  // (down: the projection's value as rounded)
        out[out_row * out_stride + n] = from_float<T>(v);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(256) moe_combine_kernel(const MoeExpertsParams p) {
  const int64_t n = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (n >= p.hidden_size) return;
  const int64_t t = blockIdx.x;
  const T* y = static_cast<const T*>(p.y) + t * p.top_k * p.hidden_size + n;
  const float* w = p.weights + t * p.top_k;
  float sum = 0.f;
  for (int s = 0; s < p.top_k; ++s) sum += to_float(y[s * p.hidden_size]) * w[s];
  static_cast<T*>(p.out)[t * p.out_stride + n] = from_float<T>(sum);
}

template <typename T, int kBM, bool kGated, typename Act>
void launch_gemm(const MoeExpertsParams& p, bool vec, cudaStream_t stream) {
  const int64_t n_total = kGated ? p.inter_size : p.hidden_size;
  const dim3 grid(static_cast<unsigned>(ceil_div(n_total, kBN)),
                  static_cast<unsigned>(p.padded_rows / kBM));
  if (vec) {
    moe_gemm_kernel<T, kBM, kGated, true, Act><<<grid, kWarps * 32, 0, stream>>>(p);
  } else {
    moe_gemm_kernel<T, kBM, kGated, false, Act><<<grid, kWarps * 32, 0, stream>>>(p);
  }
  PK_CHECK_LAUNCH(kGated ? "moe_gemm_kernel (gate_up)" : "moe_gemm_kernel (down)");
}

template <typename T, int kBM>
void launch_all(const MoeExpertsParams& p, cudaStream_t stream) {
  // 16-byte loads: every row start of every operand 16-byte aligned
  const bool vec_gate_up = p.hidden_size % 8 == 0 && p.hidden_stride % 8 == 0 &&
                           aligned16(p.hidden) && aligned16(p.w_gate_up);
  const bool vec_down = p.inter_size % 8 == 0 && aligned16(p.h) && aligned16(p.w_down);
  if (p.activation == 2) {
    launch_gemm<T, kBM, true, ClampedSwiGLU>(p, vec_gate_up, stream);
  } else if (p.activation == 1) {
    launch_gemm<T, kBM, true, TimesUp<GeluTanh>>(p, vec_gate_up, stream);
  } else {
    launch_gemm<T, kBM, true, TimesUp<Silu>>(p, vec_gate_up, stream);
  }
  launch_gemm<T, kBM, false, NoAct>(p, vec_down, stream);
  const int threads = int(std::min<int64_t>(256, (p.hidden_size + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>(p.tokens),
                  static_cast<unsigned>(ceil_div(p.hidden_size, threads)));
  moe_combine_kernel<T><<<grid, threads, 0, stream>>>(p);
  PK_CHECK_LAUNCH("moe_combine_kernel");
}

}  // namespace

void moe_experts(const MoeExpertsParams& p, cudaStream_t stream) {
  require(p.tile_m == 16 || p.tile_m == 64, "moe_experts: tile_m must be 16 or 64");
  require(p.experts > 0 && p.top_k >= 1 && p.top_k <= p.experts, "moe_experts: top_k/experts");
  require(p.hidden_size > 0 && p.inter_size > 0, "moe_experts: sizes must be positive");
  require(p.tokens >= 0 && p.tokens <= 0x7fffffff, "moe_experts: tokens out of range");
  require(p.padded_rows == moe_padded_rows(p.tokens * p.top_k, p.experts, p.tile_m),
          "moe_experts: padded_rows must be moe_padded_rows(T*k, E, tile_m)");
  require(p.padded_rows / p.tile_m <= 65535, "moe_experts: too many row tiles");
  require(p.hidden_stride >= p.hidden_size && p.out_stride >= p.hidden_size,
          "moe_experts: strides must be >= hidden_size");
  require(p.activation >= 0 && p.activation <= 2, "moe_experts: activation must be 0, 1 or 2");
  if (p.tokens == 0) return;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    if (p.tile_m == 16) {
      launch_all<T, 16>(p, stream);
    } else {
      launch_all<T, 64>(p, stream);
    }
  };
  switch (p.dtype) {
    case DType::kFloat16: run(__half{}); break;
    case DType::kBFloat16: run(__nv_bfloat16{}); break;
    default: throw std::invalid_argument("moe_experts: dtype must be float16 or bfloat16");
  }
}

}  // namespace pagedkern
