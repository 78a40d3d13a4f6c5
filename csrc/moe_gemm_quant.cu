/*
 * The MoE experts over weight-only quantized weights (parameters and formats in moe_quant.h):
 * W4A16 and W8A16 grouped GEMMs over the pairs moe_align sorted by expert and padded to the row
 * tile kBM (16 or 64). The pipeline, the work split, split-K and the epilogue are
 * moe_gemm_pipeline.cuh's (moe_gemm.cu's float experts run the same one); this file has the
 * dequantizing B loader, QuantB. The passes after the GEMMs (gate_up's split reduce, the
 * routed combine) are moe_gemm.cu's.
 *
 * moe_gemm_quant_kernel<T, kBM, kGated, kBits, Act> = moe_gemm_body over QuantB:
 *     kGated: h[row, n] = act(round(x_t . wg_e[n])) * round(x_t . wu_e[n])   (N = I, K = H)
 *     down:   y[pair, n] = round(h[row] . wd_e[n])                            (N = H, K = I)
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
 *         128); the per-channel scale multiplies the fp32 sum in the epilogue (kChannelScales),
 *         before the rounding (and before the split sum, which it distributes over), so W8A16
 *         rounds where the float path does.
 *   No integer-to-float conversion, no division in the loop (the group is a shift).
 * Padding rows (sentinel pairs) and weight rows past N load zeros (codes and scales: w = 0)
 * and store nothing. K (H and I) is a multiple of 32 (the formats'), so there is no partial
 * K step; hidden's rows must be 16-byte aligned (the op copies them otherwise).
 *
 * Traffic at decode: each routed expert's codes (3 H I / 2 bytes int4, 3 H I int8) and scales
 * are read once; the floor is those bytes / copy bandwidth (split-K: the pipeline's header). At
 * kBM = 64 each of the 4 warps dequantizes every B fragment of the tile (4x the dequantization
 * work of one; the MMAs dominate there). Not in this version: ldmatrix for A, wgmma on sm_90a,
 * gpt-oss's biases and clamped SwiGLU. Not yet verified on GPU.
 */
#include "int4_dequant.cuh"
#include "moe.h"
#include "moe_gemm_pipeline.cuh"
#include "moe_quant.h"

namespace pagedkern {
namespace {

using namespace moe_gemm;

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

// int4 / int8 codes [E, weight rows, K * kBits / 8] (+ int4 (scale, min) pairs [E, K / G,
// weight rows], int8 fp32 channel scales [E, weight rows]): the tile's kBRows rows per K step
template <typename T_, int kBM, int kBRows, int kBits>
struct QuantB {
  using T = T_;
  static constexpr bool kVec = true;
  static constexpr bool kChannelScales = kBits == 8;
  static constexpr int kStages = kBM == 16 ? (kBits == 4 ? 8 : 5) : (kBits == 4 ? 4 : 3);
  // one row's shared-memory bytes per K step (int8: 32, padded to 48 against bank conflicts)
  static constexpr int kRowBytes = kBits == 4 ? 16 : 48;
  static constexpr int kRowChunks = kBits == 4 ? 1 : 2;  // its 16-byte copies
  static constexpr int kStepBytes = kBK * kBits / 8;     // one row's code bytes per K step
  static constexpr int kChunks = kBRows * kRowChunks;
  static constexpr int kLoads = (kChunks + kWarps * 32 - 1) / (kWarps * 32);
  struct alignas(16) Stage {
    uint8_t codes[kBRows][kRowBytes];
    uint32_t scales[kBits == 4 ? kBRows : 1];  // (scale, min) of each row's group
  };
  const uint8_t* src[kLoads];  // chunk tid + 128 i of the tile's rows at K = 0, or nullptr
  const uint32_t* s_src;       // the (scale, min) pairs of weight row tid (int4), or nullptr
  int64_t w_rows;
  int group_shift;
  const void* dummy;

  __device__ __forceinline__ QuantB(const Args& p, int expert, int64_t n0, int tid)
      : w_rows(kBRows > kBN ? 2 * p.n_total : p.n_total), group_shift(p.group_shift),
        dummy(p.b) {
    const int64_t row_bytes = p.k_total * kBits / 8;
    const uint8_t* q = static_cast<const uint8_t*>(p.b) + int64_t(expert) * w_rows * row_bytes;
    auto weight_row = [&](int r) -> int64_t {  // the expert's weight row of tile row r, or -1
      const int64_t n = n0 + (r % kBN);
      return n < p.n_total ? (r >= kBN ? p.n_total + n : n) : -1;
    };
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int chunk = tid + kWarps * 32 * i;
      const int64_t wr = chunk < kChunks ? weight_row(chunk / kRowChunks) : -1;
      src[i] = wr < 0 ? nullptr : q + wr * row_bytes + (chunk % kRowChunks) * 16;
    }
    const int64_t s_row = kBits == 4 && tid < kBRows ? weight_row(tid) : -1;
    s_src = s_row < 0 ? nullptr
                      : static_cast<const uint32_t*>(p.scales) +
                            int64_t(expert) * ((p.k_total / kBK) >> group_shift) * w_rows + s_row;
  }
  __device__ __forceinline__ void load(Stage& s, int step, int tid) const {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int chunk = tid + kWarps * 32 * i;
      if (chunk < kChunks) {
        const bool valid = src[i] != nullptr;
        __pipeline_memcpy_async(&s.codes[chunk / kRowChunks][(chunk % kRowChunks) * 16],
                                valid ? src[i] + int64_t(step) * kStepBytes : dummy, 16,
                                valid ? 0 : 16);
      }
    }
    if constexpr (kBits == 4) {
      if (tid < kBRows) {
        const int64_t group = step >> group_shift;
        __pipeline_memcpy_async(&s.scales[tid], s_src ? s_src + group * w_rows : dummy, 4,
                                s_src ? 0 : 4);
      }
    }
  }
  __device__ __forceinline__ void fragment(const Stage& s, int bn, int ks, int c,
                                           uint32_t (&b)[2]) const {
    if constexpr (kBits == 4) {
      const uint8_t* codes = &s.codes[bn][ks / 2];
      const uint32_t pair = s.scales[bn];
      const T scale = reinterpret_cast<const T*>(&pair)[0];
      const T mn = reinterpret_cast<const T*>(&pair)[1];
      const uint32_t lo = codes[c], hi = codes[4 + c];
      b[0] = dequant_int4_pair<T>(lo | (lo << 12), scale, mn);
      b[1] = dequant_int4_pair<T>(hi | (hi << 12), scale, mn);
    } else {
      const uint8_t* codes = &s.codes[bn][ks];
      b[0] = int8_pair<T>(*reinterpret_cast<const uint16_t*>(codes + 2 * c));
      b[1] = int8_pair<T>(*reinterpret_cast<const uint16_t*>(codes + 8 + 2 * c));
    }
  }
};

template <typename T, int kBM, bool kGated, int kBits, typename Act>
__global__ void __launch_bounds__(kWarps * 32) moe_gemm_quant_kernel(const Args p) {
  moe_gemm_body<kBM, kGated, QuantB<T, kBM, kGated ? 2 * kBN : kBN, kBits>, Act>(p);
}

template <typename T, int kBM, bool kGated, int kBits, typename Act>
void launch_gemm(const Args& a, const MoeExpertsQuantParams& p, cudaStream_t stream) {
  moe_gemm_quant_kernel<T, kBM, kGated, kBits, Act>
      <<<gemm_grid(a, p.padded_rows, kBM), kWarps * 32, 0, stream>>>(a);
  PK_CHECK_LAUNCH(kGated ? "moe_gemm_quant_kernel (gate_up)" : "moe_gemm_quant_kernel (down)");
}

template <typename T, int kBM, int kBits>
void launch_all(const MoeExpertsQuantParams& p, cudaStream_t stream) {
  Args gate_up = gemm_args(p, true), down = gemm_args(p, false);
  gate_up.b = p.gate_up_q;
  gate_up.scales = p.gate_up_scales;
  down.b = p.down_q;
  down.scales = p.down_scales;
  gate_up.group_shift = down.group_shift = p.bits == 4 && p.group_size == 128 ? 2 : 0;
  if (p.activation == 1) {
    launch_gemm<T, kBM, true, kBits, TimesUp<GeluTanh>>(gate_up, p, stream);
  } else {
    launch_gemm<T, kBM, true, kBits, TimesUp<Silu>>(gate_up, p, stream);
  }
  MoeFinishParams f = finish_params(p);
  if (p.gate_up_splits > 1) moe_reduce_gate_up(f, stream);
  launch_gemm<T, kBM, false, kBits, NoAct>(down, p, stream);
  f.splits = p.down_splits;
  moe_combine(f, stream);
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
  require_common(p, "moe_experts_quant");
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
