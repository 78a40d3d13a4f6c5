/*
 * The MoE experts over bf16/fp16 weights (parameters in moe.h): two grouped GEMMs on tensor
 * cores and a combine, over the pairs moe_align sorted by expert and padded to the row tile kBM
 * (16 or 64). The pipeline, the work split, split-K and the epilogue are moe_gemm_pipeline.cuh's
 * (shared with the quantized experts, moe_gemm_quant.cu); this file has the dense B loader and
 * the passes after the GEMMs, which both files launch.
 *
 * moe_gemm_kernel<T, kBM, kGated, kVec, Act> = moe_gemm_body over DenseB: per K step each
 *   weight row's 32 elements staged in shared memory (rows padded to 40 elements so the 32-bit
 *   B fragment loads of the 8 rows g hit distinct banks), 4 stages at kBM = 16 (few CTAs, each
 *   must keep more weight bytes in flight) or 3 (kBM = 64: static shared memory < 48 KiB).
 *   kVec: 16-byte cp.async copies (K % 8 == 0 and aligned rows), zero-filled past K, past N
 *   and for padding rows; else element loads stored into the same stages. Any H and I work.
 *   The expert's biases (gpt-oss), if any, are added in fp32 before the rounding; activation 2
 *   is gpt-oss's clamped SwiGLU.
 * moe_reduce_gate_up_kernel<T, Act> (gate_up split over K only): h[row, n] = act(round(sum_z
 *   gate partial), round(sum_z up partial)), split order, for the real rows of sorted_pairs.
 * moe_combine_kernel<T>: out[t, n] = round(sum_slot w[t, slot] * y[t*k + slot, n]) in fp32,
 *   slot order (a deterministic reduce, no atomics); y read from the down GEMM's output, or
 *   with the down GEMM split, rounded from its partials' sum (y never written).
 *
 * Traffic at decode (T*k pairs on distinct experts): each routed expert's weights are read once
 * (3*H*I elements); the floor is those bytes / copy bandwidth. Split-K multiplies the blocks
 * streaming them (ops/moe.py's moe_split_k chooses the splits) for an fp32 partial of each real
 * row (a few KiB at decode) written and read once. At prefill the FLOPs are 6*T*k*H*I.
 * Not in this version: ldmatrix, wgmma/TMA on sm_90a. Not yet verified on GPU.
 */
#include "moe.h"
#include "moe_gemm_pipeline.cuh"

namespace pagedkern {
namespace {

using namespace moe_gemm;

// bf16/fp16 weight rows [E, weight rows, K]: the tile's kBRows rows (gate then up for gate_up)
template <typename T_, int kBM, int kBRows, bool kVec_>
struct DenseB {
  using T = T_;
  static constexpr bool kVec = kVec_;
  static constexpr bool kChannelScales = false;
  static constexpr int kStages = kBM == 16 ? 4 : 3;
  struct alignas(16) Stage {
    T rows[kBRows][kLd];
  };
  static constexpr int kLoads = kBRows / 32;
  const T* src[kLoads];  // this thread's rows (tid / 4 + 32 i) from K = 0, or nullptr: zeros
  int64_t k_total;
  const void* dummy;

  __device__ __forceinline__ DenseB(const Args& p, int expert, int64_t n0, int tid)
      : k_total(p.k_total), dummy(p.b) {
    const int64_t w_rows = kBRows > kBN ? 2 * p.n_total : p.n_total;
    const T* w = static_cast<const T*>(p.b) + int64_t(expert) * w_rows * p.k_total;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int r = tid / 4 + 32 * i;
      const int64_t n = n0 + (r % kBN);
      src[i] = n < p.n_total ? w + (r >= kBN ? p.n_total + n : n) * p.k_total : nullptr;
    }
  }
  __device__ __forceinline__ void load(Stage& s, int step, int tid) const {
    const int col = (tid % 4) * 8;
#pragma unroll
    for (int i = 0; i < kLoads; ++i)
      stage8<T, kVec>(&s.rows[tid / 4 + 32 * i][col], src[i], int64_t(step) * kBK + col,
                      k_total, dummy);
  }
  __device__ __forceinline__ void fragment(const Stage& s, int bn, int ks, int c,
                                           uint32_t (&b)[2]) const {
    b[0] = word_at(&s.rows[bn][ks + 2 * c]);
    b[1] = word_at(&s.rows[bn][ks + 2 * c + 8]);
  }
};

template <typename T, int kBM, bool kGated, bool kVec, typename Act>
__global__ void __launch_bounds__(kWarps * 32) moe_gemm_kernel(const Args p) {
  moe_gemm_body<kBM, kGated, DenseB<T, kBM, kGated ? 2 * kBN : kBN, kVec>, Act>(p);
}

template <typename T, typename Act>
__global__ void __launch_bounds__(256) moe_reduce_gate_up_kernel(const MoeFinishParams p) {
  const int64_t row = blockIdx.y;
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= p.inter_size || p.sorted_pairs[row] >= p.tokens * p.top_k) return;  // padding
  const int64_t width = 2 * p.inter_size, plane = p.padded_rows * width;
  const float* part = p.partials + row * width + n;
  float gate = 0.f, up = 0.f;
  for (int z = 0; z < p.splits; ++z) {
    gate += part[z * plane];
    up += part[z * plane + p.inter_size];
  }
  const Act act = make_act<Act>(p.swiglu_alpha, p.swiglu_limit);
  static_cast<T*>(p.h)[row * p.inter_size + n] = finish<T, true>(act, gate, up);
}

template <typename T>
__global__ void __launch_bounds__(256) moe_combine_kernel(const MoeFinishParams p) {
  const int64_t n = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (n >= p.hidden_size) return;
  const int64_t t = blockIdx.x, pairs = p.tokens * p.top_k;
  const float* w = p.weights + t * p.top_k;
  float sum = 0.f;
  for (int s = 0; s < p.top_k; ++s) {
    const int64_t at = (t * p.top_k + s) * p.hidden_size + n;
    float y;
    if (p.splits == 1) {
      y = to_float(static_cast<const T*>(p.y)[at]);
    } else {
      float pre = 0.f;
      for (int z = 0; z < p.splits; ++z) pre += p.partials[z * pairs * p.hidden_size + at];
      y = to_float(from_float<T>(pre));
    }
    sum += y * w[s];
  }
  static_cast<T*>(p.out)[t * p.out_stride + n] = from_float<T>(sum);
}

template <typename T, int kBM, bool kGated, typename Act>
void launch_gemm(const Args& a, const MoeExpertsParams& p, bool vec, cudaStream_t stream) {
  const dim3 grid = gemm_grid(a, p.padded_rows, kBM);
  if (vec) {
    moe_gemm_kernel<T, kBM, kGated, true, Act><<<grid, kWarps * 32, 0, stream>>>(a);
  } else {
    moe_gemm_kernel<T, kBM, kGated, false, Act><<<grid, kWarps * 32, 0, stream>>>(a);
  }
  PK_CHECK_LAUNCH(kGated ? "moe_gemm_kernel (gate_up)" : "moe_gemm_kernel (down)");
}

template <typename T, int kBM>
void launch_all(const MoeExpertsParams& p, cudaStream_t stream) {
  // 16-byte loads: every row start of every operand 16-byte aligned
  const bool vec_gate_up = p.hidden_size % 8 == 0 && p.hidden_stride % 8 == 0 &&
                           aligned16(p.hidden) && aligned16(p.w_gate_up);
  const bool vec_down = p.inter_size % 8 == 0 && aligned16(p.h) && aligned16(p.w_down);
  Args gate_up = gemm_args(p, true), down = gemm_args(p, false);
  gate_up.b = p.w_gate_up;
  gate_up.bias = p.gate_up_bias;
  down.b = p.w_down;
  down.bias = p.down_bias;
  for (Args* a : {&gate_up, &down}) {
    a->swiglu_alpha = p.swiglu_alpha;
    a->swiglu_limit = p.swiglu_limit;
  }
  if (p.activation == 2) {
    launch_gemm<T, kBM, true, ClampedSwiGLU>(gate_up, p, vec_gate_up, stream);
  } else if (p.activation == 1) {
    launch_gemm<T, kBM, true, TimesUp<GeluTanh>>(gate_up, p, vec_gate_up, stream);
  } else {
    launch_gemm<T, kBM, true, TimesUp<Silu>>(gate_up, p, vec_gate_up, stream);
  }
  MoeFinishParams f = finish_params(p);
  f.swiglu_alpha = p.swiglu_alpha;
  f.swiglu_limit = p.swiglu_limit;
  if (p.gate_up_splits > 1) moe_reduce_gate_up(f, stream);
  launch_gemm<T, kBM, false, NoAct>(down, p, vec_down, stream);
  f.splits = p.down_splits;
  moe_combine(f, stream);
}

template <typename T, typename Act>
void launch_reduce(const MoeFinishParams& p, cudaStream_t stream) {
  const int threads = int(std::min<int64_t>(256, (p.inter_size + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>(ceil_div(p.inter_size, threads)),
                  static_cast<unsigned>(p.padded_rows));
  moe_reduce_gate_up_kernel<T, Act><<<grid, threads, 0, stream>>>(p);
  PK_CHECK_LAUNCH("moe_reduce_gate_up_kernel");
}

template <typename T>
void launch_reduce_for(const MoeFinishParams& p, cudaStream_t stream) {
  if (p.activation == 2) {
    launch_reduce<T, ClampedSwiGLU>(p, stream);
  } else if (p.activation == 1) {
    launch_reduce<T, TimesUp<GeluTanh>>(p, stream);
  } else {
    launch_reduce<T, TimesUp<Silu>>(p, stream);
  }
}

}  // namespace

void moe_reduce_gate_up(const MoeFinishParams& p, cudaStream_t stream) {
  if (p.dtype == DType::kFloat16) {
    launch_reduce_for<__half>(p, stream);
  } else {
    launch_reduce_for<__nv_bfloat16>(p, stream);
  }
}

void moe_combine(const MoeFinishParams& p, cudaStream_t stream) {
  const int threads = int(std::min<int64_t>(256, (p.hidden_size + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>(p.tokens),
                  static_cast<unsigned>(ceil_div(p.hidden_size, threads)));
  if (p.dtype == DType::kFloat16) {
    moe_combine_kernel<__half><<<grid, threads, 0, stream>>>(p);
  } else {
    moe_combine_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(p);
  }
  PK_CHECK_LAUNCH("moe_combine_kernel");
}

void moe_experts(const MoeExpertsParams& p, cudaStream_t stream) {
  require(p.tile_m == 16 || p.tile_m == 64, "moe_experts: tile_m must be 16 or 64");
  require(p.experts > 0 && p.top_k >= 1 && p.top_k <= p.experts, "moe_experts: top_k/experts");
  require(p.hidden_size > 0 && p.inter_size > 0, "moe_experts: sizes must be positive");
  require(p.hidden_stride >= p.hidden_size && p.out_stride >= p.hidden_size,
          "moe_experts: strides must be >= hidden_size");
  require(p.activation >= 0 && p.activation <= 2, "moe_experts: activation must be 0, 1 or 2");
  require_common(p, "moe_experts");
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
