/*
 * quant_gemm_marlin: W4A16 GEMM for decode-shaped M (1..64) on tensor cores, after Marlin
 * (Frantar et al.): out[M, N] = x[M, K] @ W[N, K]^T, W int4 with a scale and a min per group
 * of G = 32 or 128 weights along K (QuantizedWeight's int4 format), x / out fp16 or bf16.
 *
 * Weight layout (made once per weight at load by reference/quant_gemm_marlin_layout.py): the
 * weight is cut into n16 x k64 tiles, stored [N / 16][K / 64][32 lanes][16 bytes], so that the
 * 16 bytes lane l of a warp reads are exactly the int4 B operands of that lane for the tile's
 * 4 k16 steps x 2 n8 fragments of mma.sync m16n8k16. With g = l / 4, c = l % 4, 32-bit word ks
 * (0..3) of the lane holds, at bit 16 e + 4 (2 nt + h), q[n = 8 nt + g][k = 16 ks + 8 h + 2 c + e]
 * for nt, h, e in {0, 1}: shifting the word right by 4 (2 nt + h) leaves fragment register
 * b[h] of n-tile nt in bits 0-3 and 16-19. Scales and mins are stored [K / G, N] in x's dtype.
 *
 * Dequantization in registers (Marlin's magic-number trick): one LOP3 computes
 * (word & 0x000f000f) | magic, magic = 0x6400 (fp16 1024) or 0x4300 (bf16 128) in each half,
 * giving the half2 / bf162 pair (magic + q0, magic + q1) exactly; HSUB2 of the magic gives q
 * exactly, one HFMA2 gives q * s + min rounded once to x's dtype (the reference rounds the same
 * way: dequantize_marlin). No integer-to-float conversion, no division anywhere in the loop
 * (the group is a shift). Under the CPU emulator (no inline PTX) the same value comes from a
 * portable fp32 fma rounded to T.
 *
 * Work split: a block of 4 warps owns a 64-wide N tile (warp w: columns 16 w .. 16 w + 15, two
 * n8 fragments) and all M rows (kMT = ceil(M / 16) m16 tiles; rows >= M are zero-filled and
 * never stored), over a slice of K: blockIdx.y = slice of k_splits, chosen on the host so that
 * about four blocks per SM stream weights. K runs in 64-wide tiles through a kStages = 6 (kMT
 * <= 2) or 4 deep cp.async pipeline (__pipeline_memcpy_async, 16-byte copies): per stage the block copies its
 * 4 x 512 weight bytes (each lane its own 16), the x tile [16 kMT][64] (rows padded to 72
 * elements so the 8 ldmatrix rows hit distinct banks) and the scales / mins of the tile's
 * groups. Per k16 step a warp loads A by ldmatrix.x4 per m-tile, dequantizes 2 B fragments
 * and issues 2 kMT mma.sync (fp32 accumulate). With k_splits > 1 the slices write fp32 partial
 * sums to a workspace and count themselves in counters[N tile] (threadfence, then one atomic);
 * the last slice of an N tile to arrive adds the k_splits partials in slice order (the result
 * does not depend on which block came last), rounds to T once, and sets the counter back to 0
 * for the next launch: one kernel, as Marlin reduces in place.
 *
 * Traffic: N K / 2 weight bytes + 2 N K / G * 2 scale bytes, read once; x (M K) is re-read by
 * every N tile from L2. The roofline is those bytes / copy bandwidth at M <= 16.
 * Not in this version: Marlin's striped K partition (its reduction goes through C in place; we
 * use an fp32 workspace of k_splits M N floats), wgmma on sm_90a, int8 weights, N or K not
 * multiples of 64. Not yet verified on GPU.
 */
#include <cuda_pipeline_primitives.h>

#include "device.cuh"
#include "int4_dequant.cuh"
#include "mma_fragments.cuh"
#include "quant_gemm_marlin.h"

namespace pagedkern {
namespace {

constexpr int kWarps = 4;
constexpr int kTileN = int(kQuantGemmMarlinTileN);
constexpr int kTileK = int(kQuantGemmMarlinTileK);
constexpr int kXLd = kTileK + 8;  // x tile row length in shared memory (elements)
// K tiles in flight: 6 for 1-2 m16 tiles (little shared memory per stage), 4 above (48 KB).
template <int kMT>
constexpr int kStagesFor = kMT <= 2 ? 6 : 4;

template <typename T, int kMT, int kGroupShift>
__global__ void __launch_bounds__(kWarps * 32)
    quant_gemm_marlin_kernel(const QuantGemmMarlinParams p, const int tiles_per_split) {
  constexpr int kRows = 16 * kMT;
  constexpr int kStages = kStagesFor<kMT>;
  constexpr int kGroupsPerTile = kGroupShift >= 6 ? 1 : kTileK >> kGroupShift;
  constexpr int kScaleChunks = 2 * kGroupsPerTile * (kTileN / 8);  // 16-byte chunks per stage
  static_assert(kScaleChunks <= kWarps * 32, "one scale chunk per thread at most");
  alignas(16) __shared__ T x_tile[kStages][kRows][kXLd];
  alignas(16) __shared__ uint4 w_tile[kStages][kWarps][32];
  alignas(16) __shared__ T s_tile[kStages][2][kGroupsPerTile][kTileN];  // [scale / min]

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int64_t n0 = int64_t(blockIdx.x) * kTileN;
  const int64_t k_tiles = p.k >> 6;
  const int64_t kt_begin = int64_t(blockIdx.y) * tiles_per_split;
  const int64_t kt_end = kt_begin + tiles_per_split < k_tiles ? kt_begin + tiles_per_split : k_tiles;
  const int tiles = kt_end > kt_begin ? int(kt_end - kt_begin) : 0;
  const T* x = static_cast<const T*>(p.x);
  const T* scales = static_cast<const T*>(p.scales);
  const T* mins = static_cast<const T*>(p.mins);
  const uint8_t* wq = static_cast<const uint8_t*>(p.qweight) +
                      ((n0 / 16 + warp) * k_tiles + kt_begin) * 512 + lane * 16;

  auto load_stage = [&](int stage, int t) {
    const int64_t k0 = (kt_begin + t) * kTileK;
    __pipeline_memcpy_async(&w_tile[stage][warp][lane], wq + int64_t(t) * 512, 16);
#pragma unroll
    for (int i = 0; i < kMT; ++i) {  // x rows: 8 chunks each, zero-filled past M
      const int chunk = tid + kWarps * 32 * i;
      const int row = chunk >> 3, col = (chunk & 7) * 8;
      const bool valid = row < p.m;
      const T* src = valid ? x + row * p.x_stride + k0 + col : x;
      __pipeline_memcpy_async(&x_tile[stage][row][col], src, 16, valid ? 0 : 16);
    }
    if (tid < kScaleChunks) {
      const int which = tid / (kGroupsPerTile * (kTileN / 8));  // 0: scales, 1: mins
      const int slot = (tid / (kTileN / 8)) % kGroupsPerTile;
      const int col = (tid % (kTileN / 8)) * 8;
      const int64_t group = (k0 >> kGroupShift) + slot;
      const T* src = (which ? mins : scales) + group * p.n + n0 + col;
      __pipeline_memcpy_async(&s_tile[stage][which][slot][col], src, 16);
    }
  };

  float acc[kMT][2][4];
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mi][nt][i] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) load_stage(s, s);
    __pipeline_commit();
  }
  int stage = 0;
  for (int t = 0; t < tiles; ++t) {
    __pipeline_wait_prior(kStages - 2);  // tile t has landed (this thread's copies)
    __syncthreads();  // ... every thread's; and stage t - 1 is free: everyone computed it
    const int ahead = t + kStages - 1;
    if (ahead < tiles) load_stage(stage == 0 ? kStages - 1 : stage - 1, ahead);
    __pipeline_commit();

    const uint4 wv = w_tile[stage][warp][lane];
    const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi)
        mma::ldmatrix_x4<false>(a[mi], &x_tile[stage][mi * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]);
      const int slot = kGroupsPerTile == 2 ? ks >> 1 : 0;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = warp * 16 + nt * 8 + g;
        const T s = s_tile[stage][0][slot][col], mn = s_tile[stage][1][slot][col];
        const uint32_t b[2] = {dequant_int4_pair<T>(words[ks] >> (8 * nt), s, mn),
                               dequant_int4_pair<T>(words[ks] >> (8 * nt + 4), s, mn)};
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) mma::mma_16816<T>(acc[mi][nt], a[mi], b);
      }
    }
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }

  // C fragment: c[2 h + e] = (row g + 8 h, column 2 c + e) of the m16 x n8 tile.
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = mi * 16 + g + 8 * h;
        const int64_t col = n0 + warp * 16 + nt * 8 + 2 * c;
        if (row >= p.m) continue;
        if (p.k_splits == 1) {
          *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + row * p.out_stride + col) =
              mma::pack2<T>(acc[mi][nt][2 * h], acc[mi][nt][2 * h + 1]);
        } else {
          *reinterpret_cast<float2*>(p.workspace + (blockIdx.y * p.m + row) * p.n + col) =
              make_float2(acc[mi][nt][2 * h], acc[mi][nt][2 * h + 1]);
        }
      }
  if (p.k_splits == 1) return;

  // The last slice of this N tile to finish adds the partials, in slice order.
  __shared__ int is_last;
  __threadfence();  // this thread's partial sums visible device-wide before the count
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(p.counters + blockIdx.x, 1) == p.k_splits - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int64_t slice = p.m * p.n;
  for (int i = tid; i < p.m * (kTileN / 4); i += kWarps * 32) {
    const int64_t row = i / (kTileN / 4), col = n0 + (i % (kTileN / 4)) * 4;
    const float* src = p.workspace + row * p.n + col;
    float4 sum = __ldcg(reinterpret_cast<const float4*>(src));  // L2: other SMs wrote it
    for (int s = 1; s < p.k_splits; ++s) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(src + s * slice));
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    uint32_t* dst = reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + row * p.out_stride + col);
    dst[0] = mma::pack2<T>(sum.x, sum.y);
    dst[1] = mma::pack2<T>(sum.z, sum.w);
  }
  if (tid == 0) p.counters[blockIdx.x] = 0;  // ready for the next launch
}

template <typename T, int kMT, int kGroupShift>
void launch_tiles(const QuantGemmMarlinParams& p, int tiles_per_split, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.n / kTileN), static_cast<unsigned>(p.k_splits));
  quant_gemm_marlin_kernel<T, kMT, kGroupShift><<<grid, kWarps * 32, 0, stream>>>(p, tiles_per_split);
  PK_CHECK_LAUNCH("quant_gemm_marlin_kernel");
}

template <typename T, int kGroupShift>
void launch_m(const QuantGemmMarlinParams& p, int tiles_per_split, cudaStream_t stream) {
  switch ((p.m + 15) / 16) {
    case 1: launch_tiles<T, 1, kGroupShift>(p, tiles_per_split, stream); break;
    case 2: launch_tiles<T, 2, kGroupShift>(p, tiles_per_split, stream); break;
    case 3: launch_tiles<T, 3, kGroupShift>(p, tiles_per_split, stream); break;
    default: launch_tiles<T, 4, kGroupShift>(p, tiles_per_split, stream); break;
  }
}

template <typename T>
void launch(const QuantGemmMarlinParams& p, cudaStream_t stream) {
  const int64_t k_tiles = p.k / kTileK;
  const int tiles_per_split = ceil_div(k_tiles, p.k_splits);
  if (p.group_size == 32) {
    launch_m<T, 5>(p, tiles_per_split, stream);
  } else {
    launch_m<T, 7>(p, tiles_per_split, stream);
  }
}

}  // namespace

void quant_gemm_marlin(const QuantGemmMarlinParams& p, cudaStream_t stream) {
  require(p.m >= 0 && p.m <= kQuantGemmMarlinMaxM, "quant_gemm_marlin: m must be in 0..64");
  require(p.n > 0 && p.n % kTileN == 0 && p.n / kTileN <= (int64_t(1) << 31) - 1,
          "quant_gemm_marlin: n (" + std::to_string(p.n) + ") must be a positive multiple of 64");
  require(p.k > 0 && p.k % kTileK == 0,
          "quant_gemm_marlin: k (" + std::to_string(p.k) + ") must be a positive multiple of 64");
  require((p.group_size == 32 || p.group_size == 128) && p.k % p.group_size == 0,
          "quant_gemm_marlin: group_size (" + std::to_string(p.group_size) +
              ") must be 32 or 128 and divide k");
  require(p.k_splits >= 1 && p.k_splits <= p.k / kTileK && p.k_splits <= 65535,
          "quant_gemm_marlin: k_splits must be in 1..k / 64");
  require(p.k_splits == 1 || (p.workspace != nullptr && p.counters != nullptr),
          "quant_gemm_marlin: k_splits > 1 needs a workspace of k_splits * m * n floats and "
          "n / 64 zeroed counters");
  require(aligned16(p.qweight) && aligned16(p.x) && aligned16(p.scales) && aligned16(p.mins),
          "quant_gemm_marlin: qweight, x, scales and mins must be 16-byte aligned");
  require(p.workspace == nullptr || aligned16(p.workspace),
          "quant_gemm_marlin: the workspace must be 16-byte aligned");
  require(p.x_stride >= p.k && p.x_stride % 8 == 0, "quant_gemm_marlin: x_stride must be >= k, % 8");
  require(p.out_stride >= p.n && p.out_stride % 4 == 0 && (reinterpret_cast<uintptr_t>(p.out) & 7) == 0,
          "quant_gemm_marlin: out must be 8-byte aligned with out_stride >= n, % 4");
  if (p.m == 0) return;
  switch (p.dtype) {
    case DType::kFloat16: launch<__half>(p, stream); break;
    case DType::kBFloat16: launch<__nv_bfloat16>(p, stream); break;
    default: throw std::invalid_argument("quant_gemm_marlin: x must be float16 or bfloat16");
  }
}

}  // namespace pagedkern
