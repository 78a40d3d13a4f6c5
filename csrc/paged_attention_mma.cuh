/*
 * paged_attention_mma_kernel: the tensor-core decode variant (mma.sync m16n8k16, fp32
 * accumulate) for GQA groups >= 4 (ops/paged_attention.py picks it; the SIMT kernel in
 * paged_attention.cu stays for small groups and D = 256, PAGEDKERN_KERNELS
 * forces either). Included by paged_attention.cu; same parameters, split-KV workspace layout and
 * merge kernel as the SIMT kernel.
 *
 * Why: the SIMT kernel spends ~100 warp-instructions per (token, KV head) on fp32 dot products,
 * shuffle reductions and bf16 unpacks, about the HBM time at 4 query heads per KV head. Here a
 * warp handles 16 tokens x 8 query heads with 2 * D / 16 mma.sync, one ldmatrix each: the
 * sm_90a main loop is 456 instructions per warp and tile at D = 128 (254 at D = 64), ~29 (16)
 * per (token, KV head), most of it the cp.async copies and their addresses.
 *
 * Mapping: one CTA per (8 query heads of a KV head's group, sequence, split): kWarps warps
 * (4 for D = 64, 2 for D = 128), kTile = 16 * kWarps tokens per pipeline stage, warp w owning
 * tokens [16 w, 16 w + 16) of every tile with its own online softmax; the warps merge through
 * shared memory at the end.
 *   S^T = K Q^T: A = the warp's 16 tokens x 16 dims of K (ldmatrix.x4 from the stage),
 *     B = Q^T (16 dims x 8 heads: the group's heads are the n dimension; held in registers for
 *     the whole kernel, heads past the group zero), D / 16 mma per tile. A lane holds the scores
 *     of tokens g, g+8 for heads 2c, 2c+1 (mma_fragments.cuh), in fp32; the scale (and log2 e)
 *     multiplies them there, so q keeps its own rounding.
 *   Softmax per head over the warp's tokens: max over the 8 lanes sharing c (3 shuffles),
 *     2^(s - m) with ex2.approx, sums kept per lane and reduced once at the end.
 *   O^T += V^T P^T: A = V^T (16 dims x 16 tokens, ldmatrix.x4.trans from the same stage),
 *     B = P^T in 16-bit: the scores' C fragments are P^T's rows, one movmatrix.trans per 8
 *     tokens turns them into the B fragment. D / 16 mma per tile; a lane accumulates dims
 *     16 i + g (+8) for heads 2c, 2c+1.
 * Shared memory: kStages = 3 stages of kTile tokens of K and V (16 KB each stage, 48 KB, the SIMT
 *   kernel's budget: 4 CTAs per H100/H200 SM), 16-byte chunks XOR-swizzled by token % 8 so that
 *   the 8 rows of every ldmatrix hit distinct banks. cp.async (LDGSTS.128, L1 bypass) fills
 *   them, two tiles in flight while one is consumed, page ids looked up a tile ahead; tokens
 *   past the split are zero-filled (their scores are masked to -inf, and V must hold no NaN:
 *   0 * NaN would poison the product).
 * Traffic: as the SIMT kernel, B * L * 2 * Hkv * D * sizeof(T) bytes of K/V (read once per 8
 *   query heads; groups above 8 take several CTAs per KV head, the later reads mostly from L2).
 * fp8 cache (C = Fp8): E4M3 pages, f16 mma. Twice the warps (8 for D = 64, 4 for
 *   D = 128), so a stage is still 16 KB and each 16-byte cp.async carries 16 elements. The
 *   fragments come from ldmatrix on the bytes taken as b16 pairs, and the fp8 -> f16 widening is
 *   cvt.rn.f16x2.e4m3x2 (exact; F2FP on sm_89+, software on sm_80) in registers:
 *   K: ldmatrix.x4 gives lane (g, c) dims 4c..4c+3 of token g (g + 8) for two 16-dim chunks;
 *     the dot product does not care in which order the k dimension is summed, so the mma's
 *     logical k 2c, 2c+1 / 2c+8, 2c+9 are dims 4c, 4c+1 / 4c+2, 4c+3, and Q^T's B fragment is
 *     loaded in that order (one 8-byte load per 16 dims). One ldmatrix per 2 mma.
 *   V^T: ldmatrix.x4.trans of b16 pairs gives lane (g, c) tokens 2c, 2c+1 of dims 2g, 2g+1; one
 *     byte permute (PRMT) splits them into (dim 2g: tokens 2c, 2c+1) and (dim 2g + 1: ...),
 *     i.e. the A fragment with its m rows g / g + 8 standing for dims 2g / 2g + 1: only the
 *     accumulators' dims change (16 i + 2g (+1)), P^T stays as it is. One ldmatrix per 2 mma.
 *   Why f16 and not bf16: sm_89/sm_90 convert E4M3 to f16 in hardware but not to bf16, and f16
 *   holds every E4M3 value exactly. q (bf16) is rounded to f16 once (exact for
 *   2^-14 <= |q| <= 65504 since bf16 keeps 8 significant bits; smaller values lose bits as f16
 *   subnormals, larger ones saturate at 65504), P in [0, 1] keeps 11 bits instead of bf16's 8;
 *   accumulation stays fp32. k_scale is folded into the scores' scale, v_scale into 1 / sum.
 *   Rows of 4 chunks (D = 64) swizzle on (token / 2) % 4 (two tokens per 128-byte bank line).
 *   sm_90a main loop: 372 instructions per warp and tile at D = 128 (242 at D = 64), of them
 *   D / 2 F2FP and D / 16 PRMT. Bytes per (token, KV head) halve, FLOPs stay: 16 FLOP/byte at
 *   D = 128, still far below the ridge.
 * Roofline: 4 * 8 * D tensor-core FLOPs per 4 * D bytes (D = 128: 8 FLOP/byte, padded to 8
 *   heads), far below the mma ridge: memory bound. Target >= 85% of the measured device-copy
 *   bandwidth at B=64, L=4096, Hq/Hkv=32/8, D=128, bs=16 (not yet measured: no GPU has run it).
 */
#pragma once

#include <cuda_pipeline_primitives.h>

#include <type_traits>

#include "device.cuh"
#include "fp8.cuh"
#include "index_check.cuh"
#include "mma_fragments.cuh"
#include "paged_attention.h"

namespace pagedkern {

// A sink logit (log2 units) joins a softmax whose max is mx and sum total (log2 units): they
// become those of the scores and the sink together; keep is the factor the keys' weighted sum
// takes (the sink adds to the denominator only).
__device__ __forceinline__ void sink_into(float sink, float& mx, float& total, float& keep) {
  const float m = fmaxf(mx, sink);
  keep = exp2f(mx - m);
  total = total * keep + exp2f(sink - m);
  mx = m;
}

namespace mma_decode {

constexpr int kHeads = 8;   // query heads per CTA: the n of m16n8k16
constexpr int kStages = 3;  // shared-memory ring of K/V tiles
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// C: the cache element (T, or Fp8 for E4M3 pages).
template <int D, typename C>
struct Shape {
  // 4 (D = 64), 2 (D = 128); fp8: 8, 4 (a stage is 8 KB of K either way)
  static constexpr int kWarps = 8192 / int(sizeof(C)) / D / 16;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTile = 16 * kWarps;               // tokens per stage
  static constexpr int kChunks = D * int(sizeof(C)) / 16;  // 16-byte chunks per token
  static constexpr int kChunkElems = 16 / int(sizeof(C));
  static constexpr int kOutChunks = D / 8;                 // 16-byte chunks of an output head
  static constexpr int kCopyRows = kThreads / kChunks;    // tokens one pass of copies covers
  static constexpr int kTokensPerThread = kTile / kCopyRows;
  static_assert((D == 64 || D == 128) && kTile % kCopyRows == 0, "unsupported head dim");
};

struct Layout {
  int block_shift;  // log2(block_size)
  int group;        // query heads per KV head
  int head_chunks;  // CTAs per KV head (ceil(group / 8))
};

// Element offset of chunk `chunk` of token `token` in a stage, XOR-swizzled so that 8
// consecutive tokens' chunk lands in 8 distinct 16-byte bank groups: on token % 8 for rows of
// >= 8 chunks, on (token / 2) % 4 for the 4-chunk rows of fp8 D = 64 (two tokens per 128 bytes).
template <int D, typename C>
__device__ __forceinline__ int swizzled(int token, int chunk) {
  constexpr int kChunks = Shape<D, C>::kChunks;
  const int x = kChunks >= 8 ? token & 7 : (token >> 1) & 3;
  return token * D + (chunk ^ x) * Shape<D, C>::kChunkElems;
}

// 16 bytes by cp.async (L1 bypass), or 16 zero bytes when !valid (src-size 0: nothing is read).
__device__ __forceinline__ void copy16_or_zero(void* dst, const void* src, bool valid) {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(mma::smem_address(dst)),
               "l"(src), "r"(valid ? 16 : 0));
#else
  __pipeline_memcpy_async(dst, src, 16, valid ? 0 : 16);
#endif
}

// kSoftCap: the soft-cap's tanh in the tile loop (compiled only where used: the plain loop stays
// pure tensor-core work).
template <typename T, typename C, int D, bool kSoftCap>
__global__ void __launch_bounds__(Shape<D, C>::kThreads)
    paged_attention_mma_kernel(const PagedAttentionParams p, const Layout lay) {
  using S = Shape<D, C>;
  constexpr bool kFp8 = std::is_same_v<C, Fp8>;
  using M = std::conditional_t<kFp8, __half, T>;  // the mma's 16-bit type
  struct alignas(128) Ring {
    C k[kStages][S::kTile * D];
    C v[kStages][S::kTile * D];
  };
  __shared__ Ring ring;
  static_assert(sizeof(float) * S::kWarps * kHeads * (D + 2) <= sizeof(Ring),
                "the warps' merge must fit in the ring");

  const int b = blockIdx.y;
  const int split = blockIdx.z;
  const int kv_head = blockIdx.x / lay.head_chunks;
  const int first = (blockIdx.x % lay.head_chunks) * kHeads;  // first head of the group here
  const int heads = min(kHeads, lay.group - first);
  const int head0 = kv_head * lay.group + first;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;

  const int len = p.seq_lens[b];
  // A window moves the splits: they cover keys first_key..len-1 (older pages are never read).
  const int start = paged_attention_first_key(len, p.window) + split * p.split_size;
  if (start >= len) {  // CTA-uniform
    if (p.num_splits == 1) {  // padding entry: zeros, lse -inf
      for (int i = threadIdx.x; i < heads * S::kOutChunks; i += S::kThreads) {
        Vec16<T> zero;
#pragma unroll
        for (int e = 0; e < 8; ++e) zero.v[e] = from_float<T>(0.f);
        zero.store(static_cast<T*>(p.out) + b * p.out_stride + (head0 + i / S::kOutChunks) * D +
                   (i % S::kOutChunks) * 8);
      }
      if (p.lse != nullptr && threadIdx.x < heads) p.lse[b * p.num_heads + head0 + threadIdx.x] =
          -INFINITY;
    }
    return;
  }
  const int end = split == p.num_splits - 1 ? len : min(len, start + p.split_size);
  const int num_tiles = (end - start + S::kTile - 1) / S::kTile;

  // B fragments of Q^T: head g of this CTA, dims 16 i + 2c (+1) and 16 i + 8 + 2c (+1); fp8:
  // dims 16 i + 4c (+1) and 16 i + 4c + 2 (+1), in f16 (the K fragment's order, header).
  uint32_t qb[D / 16][2];
  if constexpr (kFp8) {
    const T* qrow = static_cast<const T*>(p.q) + b * p.q_stride + (head0 + g) * D + 4 * c;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      const uint2 w = g < heads ? *reinterpret_cast<const uint2*>(qrow + 16 * i) : make_uint2(0, 0);
      qb[i][0] = mma::q_pair_as_half2<T>(w.x);
      qb[i][1] = mma::q_pair_as_half2<T>(w.y);
    }
  } else {
    const T* qrow = static_cast<const T*>(p.q) + b * p.q_stride + (head0 + g) * D + 2 * c;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      qb[i][0] = g < heads ? *reinterpret_cast<const uint32_t*>(qrow + 16 * i) : 0u;
      qb[i][1] = g < heads ? *reinterpret_cast<const uint32_t*>(qrow + 16 * i + 8) : 0u;
    }
  }
  const float qscale = p.scale * p.k_scale * kLog2e;  // scores in log2 units (k_scale: fp8)
  // Soft-cap in log2 units: c * tanh(s / c), c = cap * log2(e).
  const float cap = p.soft_cap * kLog2e;
  const float inv_cap = kSoftCap ? 1.f / cap : 0.f;

  const int* table = p.block_tables + b * p.block_table_stride;
  if (p.check_indices) {  // debug mode: this split's page ids, before any of them is followed
    check_index(true, (len - 1) >> lay.block_shift, p.block_table_width);
    for (int i = (start >> lay.block_shift) + threadIdx.x; i <= (end - 1) >> lay.block_shift;
         i += blockDim.x)
      check_index(true, table[i], p.num_blocks);
    __syncthreads();  // no thread follows a page id before all of them are checked
  }
  const C* k_cache = static_cast<const C*>(p.k_cache);
  const C* v_cache = static_cast<const C*>(p.v_cache);
  const int block_mask = (1 << lay.block_shift) - 1;
  // This thread copies chunk `chunk` of tokens row + i * kCopyRows of every tile.
  const int chunk = threadIdx.x % S::kChunks;
  const int row = threadIdx.x / S::kChunks;
  int pages[S::kTokensPerThread];
  auto lookup = [&](int tile) {
#pragma unroll
    for (int i = 0; i < S::kTokensPerThread; ++i) {
      const int t = start + tile * S::kTile + row + i * S::kCopyRows;
      pages[i] = t < end ? table[t >> lay.block_shift] : 0;
    }
  };
  // Page rows ([N, Hkv, bs] flattened) fit in 32 bits (the launcher checks): one wide multiply
  // per copy instead of 64-bit index arithmetic.
  const C* k_chunk_base = k_cache + chunk * S::kChunkElems;
  const C* v_chunk_base = v_cache + chunk * S::kChunkElems;
  auto issue = [&](int tile) {
    if (tile >= num_tiles) return;
    const int stage = tile % kStages;
#pragma unroll
    for (int i = 0; i < S::kTokensPerThread; ++i) {
      const int j = row + i * S::kCopyRows;
      const int t = start + tile * S::kTile + j;
      const bool valid = t < end;
      const uint32_t page_row =
          (uint32_t(pages[i]) * uint32_t(p.num_kv_heads) + uint32_t(kv_head)) << lay.block_shift;
      const int64_t offset = int64_t(page_row + uint32_t(t & block_mask)) * D;
      // Past the split: zero-filled (nothing read), so V never brings NaN into P V.
      copy16_or_zero(&ring.k[stage][swizzled<D, C>(j, chunk)], k_chunk_base + offset, valid);
      copy16_or_zero(&ring.v[stage][swizzled<D, C>(j, chunk)], v_chunk_base + offset, valid);
    }
  };

  lookup(0);
  issue(0);
  __pipeline_commit();
  lookup(1);
  issue(1);
  __pipeline_commit();
  lookup(2);

  float acc[D / 16][4];  // O^T: dims 16 i + g (+8 for [2], [3]; fp8: 16 i + 2g (+1)) x heads 2c, 2c+1
#pragma unroll
  for (int i = 0; i < D / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // running max of heads 2c, 2c+1 (log2 units)
  float l[2] = {0.f, 0.f};              // this lane's part of the sums of 2^(s - m)
  // ldmatrix row addresses: lane gives row lane % 8 of matrix lane / 8.
  const int mat = lane / 8, mrow = lane % 8;
  const int k_token = 16 * warp + mrow + 8 * (mat % 2), k_chunk = mat / 2;  // K as A (m=token)
  // V^T as A (k=token); fp8: the same tokens and chunks as K (the .trans splits b16 pairs).
  const int v_token = kFp8 ? k_token : 16 * warp + mrow + 8 * (mat / 2);
  const int v_chunk = kFp8 ? k_chunk : mat % 2;

  for (int tile = 0; tile < num_tiles; ++tile) {
    __pipeline_wait_prior(1);  // committed: tiles 0..tile+1; this one has landed
    __syncthreads();           // for every thread; and nobody still reads stage (tile + 2) % 3
    issue(tile + 2);
    __pipeline_commit();
    lookup(tile + 3);

    const C* ks = ring.k[tile % kStages];
    const C* vs = ring.v[tile % kStages];
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (kFp8) {
#pragma unroll
      for (int i = 0; i < D / 32; ++i) {
        // r[2h], r[2h + 1]: tokens g, g + 8, dims 4c..4c+3 of chunk 2i + h.
        uint32_t r[4];
        mma::ldmatrix_x4<false>(r, ks + swizzled<D, C>(k_token, 2 * i + k_chunk));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t a[4] = {mma::e4m3_lo(r[2 * h]), mma::e4m3_lo(r[2 * h + 1]), mma::e4m3_hi(r[2 * h]),
                                 mma::e4m3_hi(r[2 * h + 1])};
          mma::mma_16816<M>(s, a, qb[2 * i + h]);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        uint32_t a[4];
        mma::ldmatrix_x4<false>(a, ks + swizzled<D, C>(k_token, 2 * i + k_chunk));
        mma::mma_16816<M>(s, a, qb[i]);
      }
    }
    // s: tokens g (s[0], s[1]) and g + 8 (s[2], s[3]) of the warp's 16, heads 2c and 2c + 1.
    const int t0 = start + tile * S::kTile + 16 * warp + g;
    float mx[2];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool valid = t0 + (e / 2) * 8 < end;
      float x = s[e] * qscale;
      if constexpr (kSoftCap) x = cap * tanhf(x * inv_cap);
      s[e] = valid ? x : -INFINITY;
    }
    mx[0] = fmaxf(s[0], s[2]);
    mx[1] = fmaxf(s[1], s[3]);
#pragma unroll
    for (int offset = 4; offset < 32; offset <<= 1) {
      mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], offset));
      mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], offset));
    }
    float m_ref[2], alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m[h], mx[h]);
      m_ref[h] = m_new == -INFINITY ? 0.f : m_new;  // no token yet: keep 0 * 0
      alpha[h] = fast_exp2(m[h] - m_ref[h]);
      m[h] = m_new;
    }
    float pr[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) pr[e] = fast_exp2(s[e] - m_ref[e % 2]);
    l[0] = l[0] * alpha[0] + pr[0] + pr[2];
    l[1] = l[1] * alpha[1] + pr[1] + pr[3];
    // P^T as the B fragment: rows g (tokens 0..7) and g + 8 (8..15), transposed in registers.
    const uint32_t pb[2] = {mma::movmatrix_trans(mma::pack2<M>(pr[0], pr[1])),
                            mma::movmatrix_trans(mma::pack2<M>(pr[2], pr[3]))};
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      acc[i][0] *= alpha[0];
      acc[i][1] *= alpha[1];
      acc[i][2] *= alpha[0];
      acc[i][3] *= alpha[1];
    }
    if constexpr (kFp8) {
#pragma unroll
      for (int i = 0; i < D / 32; ++i) {
        // r[2h] (tokens 0-7), r[2h + 1] (8-15) of chunk 2i + h: bytes (token 2c: dims 2g, 2g+1;
        // token 2c+1: dims 2g, 2g+1), permuted to (dim 2g: tokens 2c, 2c+1; dim 2g+1: ...).
        uint32_t r[4];
        mma::ldmatrix_x4<true>(r, vs + swizzled<D, C>(v_token, 2 * i + v_chunk));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t lo = __byte_perm(r[2 * h], 0, 0x3120);
          const uint32_t hi = __byte_perm(r[2 * h + 1], 0, 0x3120);
          const uint32_t a[4] = {mma::e4m3_lo(lo), mma::e4m3_hi(lo), mma::e4m3_lo(hi), mma::e4m3_hi(hi)};
          mma::mma_16816<M>(acc[2 * i + h], a, pb);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        uint32_t a[4];
        mma::ldmatrix_x4<true>(a, vs + swizzled<D, C>(v_token, 2 * i + v_chunk));
        mma::mma_16816<M>(acc[i], a, pb);
      }
    }
  }

  // Per-head sums over the warp (lanes sharing c), then the warps merge through shared memory.
#pragma unroll
  for (int offset = 4; offset < 32; offset <<= 1) {
    l[0] += __shfl_xor_sync(0xffffffffu, l[0], offset);
    l[1] += __shfl_xor_sync(0xffffffffu, l[1], offset);
  }
  __pipeline_wait_prior(0);
  __syncthreads();
  float* red = reinterpret_cast<float*>(&ring);  // [kWarps][kHeads][D] accumulators
  float* red_ml = red + S::kWarps * kHeads * D;   // [kWarps][kHeads][2] (max, sum)
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int head = 2 * c + e % 2;
      const int dim = kFp8 ? 16 * i + 2 * g + e / 2 : 16 * i + g + 8 * (e / 2);
      red[(warp * kHeads + head) * D + dim] = acc[i][e];
    }
  }
  if (g == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      red_ml[2 * (warp * kHeads + 2 * c + h)] = m[h];
      red_ml[2 * (warp * kHeads + 2 * c + h) + 1] = l[h];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < heads * S::kOutChunks; i += S::kThreads) {
    const int h = i / S::kOutChunks, d0 = (i % S::kOutChunks) * 8;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < S::kWarps; ++w) mx = fmaxf(mx, red_ml[2 * (w * kHeads + h)]);
    float total = 0.f;
    float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < S::kWarps; ++w) {
      const float wgt = exp2f(red_ml[2 * (w * kHeads + h)] - mx);  // warps without tokens: 0
      total += wgt * red_ml[2 * (w * kHeads + h) + 1];
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] += wgt * red[(w * kHeads + h) * D + d0 + e];
    }
    const int head = head0 + h;
    float keep = 1.f;  // the keys' share after a sink joins the denominator
    if (p.sinks != nullptr && p.num_splits == 1) sink_into(p.sinks[head] * kLog2e, mx, total, keep);
    const float inv = p.v_scale * keep / total;  // v_scale: fp8 (the merge is linear in parts)
    const float lse = (mx + log2f(total)) * kLn2;
    if (p.num_splits == 1) {
      Vec16<T> ov;
#pragma unroll
      for (int e = 0; e < 8; ++e) ov.v[e] = from_float<T>(o[e] * inv);
      ov.store(static_cast<T*>(p.out) + b * p.out_stride + head * D + d0);
      if (p.lse != nullptr && d0 == 0) p.lse[b * p.num_heads + head] = lse;
    } else {
      const int64_t slot = (int64_t(b) * p.num_heads + head) * p.num_splits + split;
      float4* dst = reinterpret_cast<float4*>(p.workspace + slot * D + d0);
      dst[0] = make_float4(o[0] * inv, o[1] * inv, o[2] * inv, o[3] * inv);
      dst[1] = make_float4(o[4] * inv, o[5] * inv, o[6] * inv, o[7] * inv);
      if (d0 == 0) {
        const int64_t lse_base = int64_t(p.batch) * p.num_heads * p.num_splits * D;
        p.workspace[lse_base + slot] = lse;
      }
    }
  }
}

// The launch itself is in paged_attention.cu (the emulator rewrites launches in .cu files only).
inline Layout layout_for(const PagedAttentionParams& p, int block_shift) {
  require(p.num_blocks * p.num_kv_heads * p.block_size <= (int64_t(1) << 32),
          "paged_attention (mma): the cache has more than 2^32 page rows");
  const int group = p.num_heads / p.num_kv_heads;
  return Layout{block_shift, group, ceil_div(group, kHeads)};
}

}  // namespace mma_decode
}  // namespace pagedkern
