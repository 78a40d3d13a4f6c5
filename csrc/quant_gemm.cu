/*
 * quant_gemm: W4A16 / W8A16 GEMM for decode-shaped M (1..64): out[M, N] = x[M, K] @ W[N, K]^T,
 * W weight-only quantized (layout in quant_gemm.h), dequantized in registers, fp32 accumulate.
 *
 * Thread-to-data mapping: a block of 8 warps owns 8 consecutive output channels n, one per
 * warp. Lane l of a warp walks the row's weight bytes in 16-byte chunks c = l, l + 32, ...: one
 * LDG.128 brings 32 int4 weights (k = 32c .. 32c+31, inside one group since G is 32 or 128) or 16
 * int8 weights. The lane dequantizes them into fp32 registers (int4: fma(q, scale, min); int8:
 * q, the per-channel scale applied once at the end) and multiplies them with rows m0..m0+kTileM-1
 * of x (16-byte loads; x is small and shared by the block's 8 warps, so it comes from L1/L2),
 * accumulating kTileM fp32 partial sums. A warp shuffle reduction gives out[m, n]. M above
 * kTileM runs as further passes over the weights (re-read from L2 for n's row).
 *
 * Traffic: weight bytes N*K/2 (+ N*K/G*4 for scales/mins) for int4, N*K (+4N) for int8, read
 * once per kTileM rows of x; x and out are M*K and M*N elements. At M <= 16 on an H100/H200
 * that is ~99% of the bytes, so the roofline is weight bytes / copy bandwidth; the target is
 * >= 80% of the measured copy bandwidth for 4096x4096 and 4096x14336 at M = 1..4. The FMAs are
 * CUDA-core fp32 (M * N * K of them): at M = 16 the 4096x14336 case needs ~0.94 GFMA, which
 * is past the memory time on CUDA cores; tensor cores (mma.sync with in-register dequant, as
 * Marlin does) are the next step for M = 8..64 (not done: see README). Not yet verified on GPU.
 */
#include "device.cuh"
#include "quant_gemm.h"

namespace pagedkern {
namespace {

constexpr int kWarps = 8;
constexpr int kTileM = 8;

// acc[r] += dot(w[0..kW), x[row r, k0 .. k0 + kW)) for the rows of this pass.
template <typename T, int kW>
__device__ __forceinline__ void accumulate(const float (&w)[kW], const T* x, int64_t x_stride,
                                           int rows, float (&acc)[kTileM]) {
  using V = Vec16<T>;
#pragma unroll
  for (int r = 0; r < kTileM; ++r) {
    if (r < rows) {
      const T* xr = x + r * x_stride;
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < kW / V::kSize; ++v) {
        const V xv = V::load(xr + v * V::kSize);
#pragma unroll
        for (int j = 0; j < V::kSize; ++j) sum = fmaf(w[v * V::kSize + j], to_float(xv.v[j]), sum);
      }
      acc[r] += sum;
    }
  }
}

template <typename T, int kBits>
__global__ void __launch_bounds__(kWarps * 32) quant_gemm_kernel(const QuantGemmParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t n = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (n >= p.n) return;  // whole warps only: the shuffles below see full warps
  constexpr int kPerChunk = kBits == 4 ? 32 : 16;  // weights per 16-byte chunk
  const int64_t chunks = p.k / kPerChunk;
  const uint8_t* wrow = static_cast<const uint8_t*>(p.qweight) + n * (p.k * kBits / 8);
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  const int64_t groups = p.k / p.group_size;

  for (int64_t m0 = 0; m0 < p.m; m0 += kTileM) {
    const int rows = int(p.m - m0 < kTileM ? p.m - m0 : kTileM);
    float acc[kTileM];
#pragma unroll
    for (int r = 0; r < kTileM; ++r) acc[r] = 0.f;
    for (int64_t c = lane; c < chunks; c += 32) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(wrow) + c);
      const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&raw);
      float w[kPerChunk];
      if constexpr (kBits == 4) {
        const int64_t g = c * kPerChunk / p.group_size;
        const float scale = __half2float(static_cast<const __half*>(p.scales)[n * groups + g]);
        const float mn = __half2float(static_cast<const __half*>(p.mins)[n * groups + g]);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          w[2 * j] = fmaf(float(bytes[j] & 15), scale, mn);
          w[2 * j + 1] = fmaf(float(bytes[j] >> 4), scale, mn);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) w[j] = float(static_cast<int8_t>(bytes[j]));
      }
      accumulate<T, kPerChunk>(w, x + m0 * p.x_stride + c * kPerChunk, p.x_stride, rows, acc);
    }
    const float channel_scale =
        kBits == 8 ? static_cast<const float*>(p.scales)[n] : 1.f;
#pragma unroll
    for (int r = 0; r < kTileM; ++r) {
      const float total = warp_sum(acc[r]);
      if (lane == 0 && r < rows) out[(m0 + r) * p.out_stride + n] = from_float<T>(total * channel_scale);
    }
  }
}

template <typename T>
void launch(const QuantGemmParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(p.n, kWarps)));
  if (p.bits == 4) {
    quant_gemm_kernel<T, 4><<<grid, kWarps * 32, 0, stream>>>(p);
    PK_CHECK_LAUNCH("quant_gemm_kernel<4>");
  } else {
    quant_gemm_kernel<T, 8><<<grid, kWarps * 32, 0, stream>>>(p);
    PK_CHECK_LAUNCH("quant_gemm_kernel<8>");
  }
}

}  // namespace

void quant_gemm(const QuantGemmParams& p, cudaStream_t stream) {
  require(p.bits == 4 || p.bits == 8, "quant_gemm: bits must be 4 or 8");
  require(p.m >= 0 && p.m <= kQuantGemmMaxM, "quant_gemm: m must be in 0..64");
  require(p.n > 0 && p.n <= (int64_t(1) << 31) - kWarps, "quant_gemm: n out of range");
  require(p.k > 0 && p.k % 32 == 0, "quant_gemm: k must be a positive multiple of 32");
  require(p.bits == 8 || ((p.group_size == 32 || p.group_size == 128) && p.k % p.group_size == 0),
          "quant_gemm: int4 group_size must be 32 or 128 and divide k");
  require(aligned16(p.qweight) && aligned16(p.x), "quant_gemm: qweight and x must be 16-byte aligned");
  require(p.x_stride >= p.k && p.x_stride % 8 == 0, "quant_gemm: x_stride must be >= k, % 8");
  require(p.out_stride >= p.n, "quant_gemm: out_stride must be >= n");
  require(p.scales != nullptr && (p.bits == 8 || p.mins != nullptr), "quant_gemm: scales/mins");
  if (p.m == 0) return;
  switch (p.dtype) {
    case DType::kFloat16: launch<__half>(p, stream); break;
    case DType::kBFloat16: launch<__nv_bfloat16>(p, stream); break;
    default: throw std::invalid_argument("quant_gemm: x must be float16 or bfloat16");
  }
}

}  // namespace pagedkern
