/*
 * The MoE experts over weight-only quantized weights (parameters and formats in moe_quant.h):
 * W4A16 and W8A16 versions of moe_gemm.cu's two grouped GEMMs and combine, over the pairs
 * moe_align sorted by expert and padded to the row tile kBM (16 or 64).
 *
 * moe_gemm_quant_kernel<T, kBM, kGated, kBits, Act>: the same work split as moe_gemm_kernel:
 *   grid (ceil(N / kBN), padded_rows / kBM), block (n tile, m tile) reads its tile's expert
 *   (-1: exit) and computes kBM x kBN of
 *     kGated: h[row, n] = act(round(x_t . wg_e[n])) * round(x_t . wu_e[n])   (N = I, K = H)
 *             (rows n and I + n of the expert's gate_up weight in the same block: the
 *             activation is fused into the epilogue; gate_up never reaches memory)
 *     down:   y[pair, n] = round(h[row] . wd_e[n])                            (N = H, K = I)
 *   4 warps (kBM = 16: side by side over n, kBM = 64: stacked over m), K in steps of kBK = 32.
 *
 * Weights stay in the QuantizedWeight formats (no repack of the codes): an int4 row's 16 bytes
 * per K step, an int8 row's 32, staged by 16-byte cp.async (LDGSTS) into shared memory with
 * the activation tile, kStages steps in flight (more at kBM = 16, where a CTA must keep more
 * weight bytes in flight; all under 48 KiB static shared memory). The int4 scales are the
 * only repacked part: (scale, min) pairs in the activation dtype, [E, K / G, N], one 4-byte
 * cp.async per weight row and step (coalesced over n).
 * The mma.sync m16n8k16 B fragment of lane (g, c) is the pair k = 2c, 2c + 1 (and + 8) of row
 * n = g: in the int4 rows that is exactly byte c (and 4 + c) of the step's 8 bytes, low nibble
 * first; in the int8 rows the 16-bit word at 2c (and 8 + 2c). So the fragment is read straight
 * from the staged rows (int4 rows are 16 bytes apart: the 8 rows g hit distinct banks, and
 * the 4 lanes c of a row one word; int8 rows are padded to 48 bytes for the same) and
 * dequantized in registers:
 *   int4: the byte spread to bits 0-3 / 16-19, then int4_dequant.cuh's LOP3 + HSUB2 + HFMA2:
 *         round_T(q * scale + min), as quant_gemm_marlin computes it;
 *   int8: fp16: PRMT + LOP3 into 1024 + (q + 128), HSUB2 of 1152 (exact); bf16: each byte
 *         under the fp32 magic 2^23 (exact), minus 2^23 + 128, packed to bf16 (exact: |q| <=
 *         128); the per-channel scale multiplies the fp32 sum in the epilogue, before the
 *         rounding, so W8A16 rounds where the float path does.
 *   No integer-to-float conversion, no division in the loop (the group is a shift).
 * Padding rows (sentinel pairs) and weight rows past N load zeros (codes and scales: w = 0)
 * and store nothing. K (H and I) is a multiple of 32 (the formats'), so there is no partial
 * K step; hidden's rows must be 16-byte aligned (the op copies them otherwise).
 * moe_quant_combine_kernel<T>: out[t, n] = round(sum_slot w[t, slot] * y[t*k + slot, n]) in
 *   fp32, slot order: deterministic, no atomics (moe_gemm.cu's combine, over this y).
 *
 * Traffic at decode: each routed expert's codes (3 H I / 2 bytes int4, 3 H I int8) and scales
 * are read once; the floor is those bytes / copy bandwidth. At kBM = 64 each of the 4 warps
 * dequantizes every B fragment of the tile (4x the dequantization work of one; the MMAs
 * dominate there). Not in this version: ldmatrix for A, split-K for decode shapes with few
 * CTAs, wgmma on sm_90a, gpt-oss's biases and clamped SwiGLU. Not yet verified on GPU.
 */
#include <cuda_pipeline_primitives.h>

#include "device.cuh"
#include "gated_activation.cuh"
#include "int4_dequant.cuh"
#include "mma_fragments.cuh"
#include "moe.h"
#include "moe_quant.h"

namespace pagedkern {
namespace {

constexpr int kWarps = 4;
constexpr int kBN = 64;
constexpr int kBK = 32;
constexpr int kLd = kBK + 8;  // activation tile row length in shared memory (elements)

// Shared-memory bytes of one weight row per K step (int8: 32, padded to 48 against bank
// conflicts), and its 16-byte copies.
template <int kBits>
constexpr int kRowBytes = kBits == 4 ? 16 : 48;
template <int kBits>
constexpr int kRowChunks = kBits == 4 ? 1 : 2;
// K steps in flight.
template <int kBM, int kBits>
constexpr int kStages = kBM == 16 ? (kBits == 4 ? 8 : 5) : (kBits == 4 ? 4 : 3);

struct NoAct {
  __device__ __forceinline__ float operator()(float g) const { return g; }
};

// Two int8 codes (bits 0-7: k even, bits 8-15: k odd) as a T2 pair, exactly.
template <typename T>
__device__ __forceinline__ uint32_t int8_pair(uint32_t v) {
#ifdef __CUDA_ARCH__
  if constexpr (std::is_same_v<T, __half>) {
    const uint32_t biased = (__byte_perm(v, 0, 0x4140) ^ 0x00800080u) | 0x64006400u;
    const uint32_t magic = 0x64806480u;  // 1152 = 1024 + 128 in both halves
    const __half2 q = __hsub2(*reinterpret_cast<const __half2*>(&biased),
                              *reinterpret_cast<const __half2*>(&magic));
    return *reinterpret_cast<const uint32_t*>(&q);
  } else {
    const float lo = __uint_as_float(0x4B000000u | ((v & 0xffu) ^ 0x80u)) - 8388736.f;
    const float hi = __uint_as_float(0x4B000000u | (((v >> 8) & 0xffu) ^ 0x80u)) - 8388736.f;
    return mma::pack2<T>(lo, hi);
  }
#else
  return mma::pack2<T>(float(static_cast<int8_t>(v & 0xffu)),
                       float(static_cast<int8_t>((v >> 8) & 0xffu)));
#endif
}

__device__ __forceinline__ uint32_t word_at(const void* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <typename T, int kBM, bool kGated, int kBits, typename Act>
__global__ void __launch_bounds__(kWarps * 32) moe_gemm_quant_kernel(const MoeExpertsQuantParams p) {
  constexpr int kBRows = kGated ? 2 * kBN : kBN;
  constexpr int kWM = kBM / 16;      // warps over m
  constexpr int kWN = kWarps / kWM;  // warps over n
  constexpr int kNF = kBN / kWN / 8;  // n8 fragments per warp
  constexpr int kHalves = kGated ? 2 : 1;
  constexpr int kS = kStages<kBM, kBits>;
  constexpr int kRB = kRowBytes<kBits>, kRC = kRowChunks<kBits>;
  constexpr int kStepBytes = kBK * kBits / 8;  // one row's code bytes per K step
  alignas(16) __shared__ T a_tile[kS][kBM][kLd];
  alignas(16) __shared__ uint8_t b_tile[kS][kBRows][kRB];
  alignas(16) __shared__ uint32_t s_tile[kS][kBits == 4 ? kBRows : 1];  // (scale, min)
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
  const int64_t w_rows = kGated ? 2 * n_total : n_total;  // rows of one expert's weight
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

  const int64_t row_bytes = k_total * kBits / 8;
  const uint8_t* q_base = static_cast<const uint8_t*>(kGated ? p.gate_up_q : p.down_q) +
                          int64_t(expert) * w_rows * row_bytes;
  const int group_shift = p.group_size == 128 ? 2 : 0;  // int4: K steps per group, 1 or 4
  const uint32_t* s_base = static_cast<const uint32_t*>(kGated ? p.gate_up_scales : p.down_scales) +
                           int64_t(expert) * ((k_total / kBK) >> group_shift) * w_rows;

  float acc[kHalves][kNF][4];
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int f = 0; f < kNF; ++f)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[h][f][i] = 0.f;

  // This thread's 16-byte chunks of each K step, their sources fixed for the whole K loop
  // (nullptr: zeros). A: column (tid % 4) * 8 of rows tid / 4 + 32 i; B: chunk tid + 128 i of
  // the tile's kBRows * kRC; the (scale, min) pair of weight row tid.
  constexpr int kALoads = (kBM + 31) / 32;
  constexpr int kBChunks = kBRows * kRC;
  constexpr int kBLoads = (kBChunks + kWarps * 32 - 1) / (kWarps * 32);
  const int col = (tid % 4) * 8;
  const T* a_src[kALoads];
  const uint8_t* b_src[kBLoads];
  auto weight_row = [&](int r) -> int64_t {  // the expert's weight row of tile row r, or -1
    const int64_t n = n0 + (r % kBN);
    return n < n_total ? (r >= kBN ? n_total + n : n) : -1;
  };
#pragma unroll
  for (int i = 0; i < kALoads; ++i) {
    const int r = tid / 4 + 32 * i;
    a_src[i] = r < kBM ? row_a[r] : nullptr;
  }
#pragma unroll
  for (int i = 0; i < kBLoads; ++i) {
    const int chunk = tid + kWarps * 32 * i;
    const int64_t wr = chunk < kBChunks ? weight_row(chunk / kRC) : -1;
    b_src[i] = wr < 0 ? nullptr : q_base + wr * row_bytes + (chunk % kRC) * 16;
  }
  const int64_t s_row = kBits == 4 && tid < kBRows ? weight_row(tid) : -1;
  const uint32_t* s_src = s_row < 0 ? nullptr : s_base + s_row;
  const void* dummy = q_base;  // any aligned address for zero-filled copies (never read)

  auto load = [&](int step, int stage) {
    const int64_t k = int64_t(step) * kBK + col;
#pragma unroll
    for (int i = 0; i < kALoads; ++i) {
      const int r = tid / 4 + 32 * i;
      if (r < kBM) {
        const bool valid = a_src[i] != nullptr;
        __pipeline_memcpy_async(&a_tile[stage][r][col], valid ? a_src[i] + k : dummy, 16,
                                valid ? 0 : 16);
      }
    }
#pragma unroll
    for (int i = 0; i < kBLoads; ++i) {
      const int chunk = tid + kWarps * 32 * i;
      if (chunk < kBChunks) {
        const bool valid = b_src[i] != nullptr;
        __pipeline_memcpy_async(&b_tile[stage][chunk / kRC][(chunk % kRC) * 16],
                                valid ? b_src[i] + int64_t(step) * kStepBytes : dummy, 16,
                                valid ? 0 : 16);
      }
    }
    if constexpr (kBits == 4) {
      if (tid < kBRows) {
        const int64_t group = step >> group_shift;
        __pipeline_memcpy_async(&s_tile[stage][tid], s_src ? s_src + group * w_rows : dummy, 4,
                                s_src ? 0 : 4);
      }
    }
  };
  const int steps = int(k_total / kBK);
#pragma unroll
  for (int s = 0; s < kS - 1; ++s) {
    if (s < steps) load(s, s);
    __pipeline_commit();
  }
  for (int step = 0; step < steps; ++step) {
    __pipeline_wait_prior(kS - 2);  // committed: steps 0..step+kS-2; `step` landed
    __syncthreads();  // ... for every thread, and the stage read at step - 1 is free again
    if (step + kS - 1 < steps) load(step + kS - 1, (step + kS - 1) % kS);
    __pipeline_commit();
    const int stage = step % kS;
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
          uint32_t b[2];
          if constexpr (kBits == 4) {
            const uint8_t* codes = &b_tile[stage][bn][ks / 2];
            const uint32_t pair = s_tile[stage][bn];
            const T s = reinterpret_cast<const T*>(&pair)[0];
            const T mn = reinterpret_cast<const T*>(&pair)[1];
            const uint32_t lo = codes[c], hi = codes[4 + c];
            b[0] = dequant_int4_pair<T>(lo | (lo << 12), s, mn);
            b[1] = dequant_int4_pair<T>(hi | (hi << 12), s, mn);
          } else {
            const uint8_t* codes = &b_tile[stage][bn][ks];
            b[0] = int8_pair<T>(*reinterpret_cast<const uint16_t*>(codes + 2 * c));
            b[1] = int8_pair<T>(*reinterpret_cast<const uint16_t*>(codes + 8 + 2 * c));
          }
          mma::mma_16816<T>(acc[h][f], a, b);
        }
      }
    }
  }
  __pipeline_wait_prior(0);

  const Act act;
  T* out = static_cast<T*>(kGated ? p.h : p.y);
  const int64_t out_stride = kGated ? p.inter_size : p.hidden_size;
  const float* channel_scales =
      static_cast<const float*>(kGated ? p.gate_up_scales : p.down_scales) +
      int64_t(expert) * w_rows;  // (int8 only)
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
        float first = acc[0][f][2 * half + j], second = acc[kHalves - 1][f][2 * half + j];
        if constexpr (kBits == 8) {
          first *= channel_scales[n];
          if constexpr (kGated) second *= channel_scales[n_total + n];
        }
        float v = to_float(from_float<T>(first));
        if constexpr (kGated) {
          v = act(v) * to_float(from_float<T>(second));
        } else {
          v = act(v);  // NoAct: the down projection's value as rounded
        }
        out[out_row * out_stride + n] = from_float<T>(v);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(256) moe_quant_combine_kernel(const MoeExpertsQuantParams p) {
  const int64_t n = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (n >= p.hidden_size) return;
  const int64_t t = blockIdx.x;
  const T* y = static_cast<const T*>(p.y) + t * p.top_k * p.hidden_size + n;
  const float* w = p.weights + t * p.top_k;
  float sum = 0.f;
  for (int s = 0; s < p.top_k; ++s) sum += to_float(y[s * p.hidden_size]) * w[s];
  static_cast<T*>(p.out)[t * p.out_stride + n] = from_float<T>(sum);
}

template <typename T, int kBM, bool kGated, int kBits, typename Act>
void launch_gemm(const MoeExpertsQuantParams& p, cudaStream_t stream) {
  const int64_t n_total = kGated ? p.inter_size : p.hidden_size;
  const dim3 grid(static_cast<unsigned>(ceil_div(n_total, kBN)),
                  static_cast<unsigned>(p.padded_rows / kBM));
  moe_gemm_quant_kernel<T, kBM, kGated, kBits, Act><<<grid, kWarps * 32, 0, stream>>>(p);
  PK_CHECK_LAUNCH(kGated ? "moe_gemm_quant_kernel (gate_up)" : "moe_gemm_quant_kernel (down)");
}

template <typename T, int kBM, int kBits>
void launch_all(const MoeExpertsQuantParams& p, cudaStream_t stream) {
  if (p.activation == 1) {
    launch_gemm<T, kBM, true, kBits, GeluTanh>(p, stream);
  } else {
    launch_gemm<T, kBM, true, kBits, Silu>(p, stream);
  }
  launch_gemm<T, kBM, false, kBits, NoAct>(p, stream);
  const int threads = int(std::min<int64_t>(256, (p.hidden_size + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>(p.tokens),
                  static_cast<unsigned>(ceil_div(p.hidden_size, threads)));
  moe_quant_combine_kernel<T><<<grid, threads, 0, stream>>>(p);
  PK_CHECK_LAUNCH("moe_quant_combine_kernel");
}

template <typename T, int kBits>
void launch_tile(const MoeExpertsQuantParams& p, cudaStream_t stream) {
  if (p.tile_m == 16) {
    launch_all<T, 16, kBits>(p, stream);
  } else {
    launch_all<T, 64, kBits>(p, stream);
  }
}

}  // namespace

void moe_experts_quant(const MoeExpertsQuantParams& p, cudaStream_t stream) {
  require(p.tile_m == 16 || p.tile_m == 64, "moe_experts_quant: tile_m must be 16 or 64");
  require(p.experts > 0 && p.top_k >= 1 && p.top_k <= p.experts,
          "moe_experts_quant: top_k/experts");
  require(p.bits == 4 || p.bits == 8, "moe_experts_quant: bits must be 4 or 8");
  require(p.bits == 8 || p.group_size == 32 || p.group_size == 128,
          "moe_experts_quant: int4 group_size must be 32 or 128");
  const int64_t multiple = p.bits == 4 ? p.group_size : 32;
  require(p.hidden_size > 0 && p.inter_size > 0 && p.hidden_size % multiple == 0 &&
              p.inter_size % multiple == 0,
          "moe_experts_quant: hidden_size and inter_size must be positive multiples of 32 and "
          "of the group size");
  require(p.tokens >= 0 && p.tokens <= 0x7fffffff, "moe_experts_quant: tokens out of range");
  require(p.padded_rows == moe_padded_rows(p.tokens * p.top_k, p.experts, p.tile_m),
          "moe_experts_quant: padded_rows must be moe_padded_rows(T*k, E, tile_m)");
  require(p.padded_rows / p.tile_m <= 65535, "moe_experts_quant: too many row tiles");
  require(p.hidden_stride >= p.hidden_size && p.hidden_stride % 8 == 0 &&
              p.out_stride >= p.hidden_size,
          "moe_experts_quant: hidden_stride must be >= hidden_size and % 8, out_stride >= "
          "hidden_size");
  require(aligned16(p.hidden) && aligned16(p.h) && aligned16(p.gate_up_q) && aligned16(p.down_q),
          "moe_experts_quant: hidden, h and the weight codes must be 16-byte aligned");
  require(p.gate_up_scales != nullptr && p.down_scales != nullptr &&
              (reinterpret_cast<uintptr_t>(p.gate_up_scales) & 3) == 0 &&
              (reinterpret_cast<uintptr_t>(p.down_scales) & 3) == 0,
          "moe_experts_quant: the scales must be 4-byte aligned");
  require(p.activation == 0 || p.activation == 1, "moe_experts_quant: activation must be 0 or 1");
  if (p.tokens == 0) return;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    if (p.bits == 4) {
      launch_tile<T, 4>(p, stream);
    } else {
      launch_tile<T, 8>(p, stream);
    }
  };
  switch (p.dtype) {
    case DType::kFloat16: run(__half{}); break;
    case DType::kBFloat16: run(__nv_bfloat16{}); break;
    default: throw std::invalid_argument("moe_experts_quant: dtype must be float16 or bfloat16");
  }
}

}  // namespace pagedkern
