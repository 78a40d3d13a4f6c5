/*
 * paged_attention: decode attention over the paged KV cache, GQA-aware, with split-KV
 * (flash-decoding) for long contexts and small batches.
 *
 *   out[b, h] = softmax(q[b, h] . K^T * scale) V   over keys 0..seq_lens[b]-1 of sequence b,
 *   token t of sequence b in page block_tables[b, t / bs] at offset t % bs ([N, Hkv, bs, D] pages).
 *   fp32 scores, softmax and accumulation; exp2 with log2(e) folded into q; output rounded once.
 *
 * Versions:
 *  v1 one query head per thread, token slots clamped into the tile, exp2f: the SASS inner loop
 *     came to ~80 instructions per (token, head) per lane, more than the memory time at 4 query
 *     heads per KV head. v2 (below): head pairs share each K/V conversion, unclamped slots,
 *     ex2.approx: ~49, of which 16 are the FFMAs of the two dot products.
 *  v2 paged_attention_kernel<T, D, kHeads>: one CTA per (KV head, sequence, split) handles the
 *     query heads that share the KV head, so a page is read from HBM once per group, not once per
 *     query head. A thread works on kHeads query heads (2 when the group size is even, else 1):
 *     each K/V chunk it reads from shared memory and converts to fp32 serves both. Up to kRows
 *     head units per CTA (8, or 16 for D = 64); larger groups are cut into several CTAs.
 *     Threads: kRows rows of D/8 lanes (128 threads for D = 64 and 128, 256 for D = 256);
 *     lane x owns the 16-byte chunk [8x, 8x+8) of the head dim.
 *     Row y works on head unit g = y / Z and token slot z = y % Z, with Z = kRows / units (rows
 *     beyond units * Z idle in the math but copy like the others).
 *     Pipeline: tiles of kTile = 4096 / D tokens (8 KB of K + 8 KB of V), kStages = 3 stages in
 *     shared memory, filled by 16-byte cp.async (LDGSTS.128, L1 bypass), two tiles in flight
 *     while one is consumed, one barrier per tile. Each thread copies its chunk of kTile / kRows
 *     tokens per tile; their page ids are loaded one tile before the copies are issued.
 *     Math per tile: row (g, z) takes tokens z, z + Z, ... in groups of kGroup = 4: four 16-byte
 *     K reads from shared memory, partial dots reduced over the row's lanes with shuffles, one
 *     online-softmax rescale per group, then p * V accumulated in registers (8 floats per lane
 *     and head). Loop bounds are uniform across the CTA, so every shuffle is warp-convergent;
 *     slots past the tile get score -inf and skip V. At the end the Z rows of a head unit merge
 *     (max, sum, acc) through shared memory; row z = 0 writes out (16-byte stores) or the split's
 *     fp32 partial + LSE.
 *  paged_attention_merge_kernel<T>: one warp per (sequence, query head) merges the splits that
 *     hold keys: out = sum_s exp(lse_s - lse) o_s, lse = log sum_s exp(lse_s) (float4 reads).
 *
 *  fp8 cache (kv_fp8, C = Fp8): E4M3 pages, same mapping and 48 KB ring, but a stage
 *     holds kTile = 8192 / D tokens (the same 8 KB of K + 8 KB of V, so the same bytes in
 *     flight): each 16-byte cp.async carries 16 elements, a thread copies chunk
 *     threadIdx % (D / 16) of every (2 kRows)-th token. The math reads its 8 elements per lane
 *     as 8 bytes and widens them to fp32 (4 cvt e4m3x2 -> f16x2 on sm_89+); k_scale is folded
 *     into q's scale, v_scale into the final 1 / sum, so fp32 math and the merge are unchanged.
 *
 * Options (both variants): a sliding window starts every split at the window's first key
 *   (len - window), so the split plan covers min(L, window) keys and pages older than the window
 *   are never read (no per-key mask: every key from that start on is visible to the query).
 *   Soft-cap: cap * tanh(s / cap) on each score (in log2 units the cap is cap * log2 e, the same
 *   formula): a uniform runtime flag here, a template flag in the mma kernel (whose loop is
 *   otherwise pure tensor-core work). Sinks: each head's logit joins the denominator at the
 *   end (sink_into), or in the merge kernel for split partials (as a split with no output).
 * Traffic: B * L * 2 * Hkv * D * sizeof(C) bytes of K/V (L: min(len, window) with a window) (q, out and the workspace are small;
 * sizeof(C) = 1 for the fp8 cache: half the bytes of the 16-bit kernel).
 * Memory bound; target >= 80% of the measured device-copy bandwidth at B=64, L=4096, Hq/Hkv=32/8,
 * D=128, bs=16. Shared memory: 48 KB per CTA (4 CTAs per H100/H200 SM, 3 on A100).
 * Known limit: each K/V byte is read from shared memory once per head unit of the CTA, and the
 * SIMT math (fp32 dot products, shuffles) is close to the memory time at 4 heads per KV head;
 * so GQA groups >= 4 at D <= 128 run the tensor-core variant (paged_attention_mma.cuh) instead.
 * Speculative verification: the 1 + k query rows of a speculating sequence run through
 * this decode kernel as 1 + k decode rows that share its block table, row j with seq_len =
 * computed + j + 1: causal by construction, no 128-row Q tile wasted on a 5-row chunk, and a
 * step without prefill stays CUDA-graph replayable. Cost: the context is read 1 + k times
 * (after the first, mostly from L2).
 */
#include <cuda_pipeline_primitives.h>

#include <cmath>

#include "device.cuh"
#include "fp8.cuh"
#include "index_check.cuh"
#include "paged_attention.h"
#include "paged_attention_mma.cuh"

namespace pagedkern {
namespace {

constexpr int kStages = 3;  // shared-memory ring of K/V tiles
constexpr int kGroup = 4;   // tokens per online-softmax update
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// C: the cache element (T, or Fp8 for E4M3 pages).
template <int D, typename C>
struct Shape {
  static constexpr int kLanes = D / 8;                    // 8 elements of the head dim per lane
  static constexpr int kRows = D == 64 ? 16 : 8;          // = max head units per CTA
  static constexpr int kThreads = kLanes * kRows;         // 128, 128, 256
  static constexpr int kTile = 8192 / int(sizeof(C)) / D;  // tokens per stage (8 KB of K)
  static constexpr int kCopyChunks = D * int(sizeof(C)) / 16;  // 16-byte chunks per token
  static constexpr int kCopyRows = kThreads / kCopyChunks;     // tokens one pass of copies covers
  static constexpr int kTokensPerThread = kTile / kCopyRows;   // copies per thread per stage
  static_assert(D % 64 == 0 && kLanes <= 32 && kTile % kCopyRows == 0 && kTile % kRows == 0,
                "unsupported head dim");
  // Token slots past a tile (< kTile + 4 * kRows) must stay inside the K + V ring.
  static_assert(3 * kTile + 4 * kRows <= 6 * kTile, "stale slot reads would leave the ring");
};

// Derived by the launcher.
struct Layout {
  int block_shift;    // log2(block_size)
  int group;          // query heads per KV head
  int head_chunks;    // CTAs per KV head
  int units_per_cta;  // head units (kHeads query heads each) per CTA, <= Shape<D, C>::kRows
};

template <typename T>
__device__ __forceinline__ void to_floats(const Vec16<T>& v, float (&f)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = to_float(v.v[e]);
}

// 8 consecutive cache elements in shared memory as fp32: one 16-byte read of a 16-bit T, or
// one 8-byte read of E4M3 widened by 4 conversions (exact).
template <typename T>
__device__ __forceinline__ void cache_floats(const T* p, float (&f)[8]) {
  to_floats(Vec16<T>::load(p), f);
}
__device__ __forceinline__ void cache_floats(const Fp8* p, float (&f)[8]) {
  const uint2 w = *reinterpret_cast<const uint2*>(p);
  e4m3x2_to_floats(uint16_t(w.x), f[0], f[1]);
  e4m3x2_to_floats(uint16_t(w.x >> 16), f[2], f[3]);
  e4m3x2_to_floats(uint16_t(w.y), f[4], f[5]);
  e4m3x2_to_floats(uint16_t(w.y >> 16), f[6], f[7]);
}

// kHeads: query heads per thread (2 when the group size is even: each K/V chunk read from shared
// memory and converted once serves both).
template <typename T, typename C, int D, int kHeads>
__global__ void __launch_bounds__(Shape<D, C>::kThreads)
    paged_attention_kernel(const PagedAttentionParams p, const Layout lay) {
  using S = Shape<D, C>;
  using V = Vec16<T>;
  struct alignas(16) Ring {
    C k[kStages][S::kTile * D];
    C v[kStages][S::kTile * D];
  };
  __shared__ Ring ring;
  auto& smem_k = ring.k;
  auto& smem_v = ring.v;

  const int b = blockIdx.y;
  const int split = blockIdx.z;
  const int kv_head = blockIdx.x / lay.head_chunks;
  const int chunk = blockIdx.x % lay.head_chunks;
  const int first = chunk * lay.units_per_cta;  // first head unit of the group in this CTA
  const int units = min(lay.units_per_cta, lay.group / kHeads - first);
  const int zs = S::kRows / units;  // token slots per head unit
  const int lane = threadIdx.x % S::kLanes;
  const int row = threadIdx.x / S::kLanes;
  const int g = row / zs;
  const int z = row % zs;
  const bool active = g < units;
  // First query head of this row (idle rows alias unit 0 and never store).
  const int head = kv_head * lay.group + (first + (active ? g : 0)) * kHeads;

  const int len = p.seq_lens[b];
  // A window moves the splits: they cover keys first_key..len-1 (older pages are never read).
  const int start = paged_attention_first_key(len, p.window) + split * p.split_size;
  if (start >= len) {
    if (p.num_splits == 1 && active && z == 0) {  // padding entry: zeros, lse -inf
      V zero;
#pragma unroll
      for (int e = 0; e < 8; ++e) zero.v[e] = from_float<T>(0.f);
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        zero.store(static_cast<T*>(p.out) + b * p.out_stride + (head + h) * D + lane * 8);
        if (p.lse != nullptr && lane == 0) p.lse[b * p.num_heads + head + h] = -INFINITY;
      }
    }
    return;
  }
  const int end = split == p.num_splits - 1 ? len : min(len, start + p.split_size);
  const int num_tiles = (end - start + S::kTile - 1) / S::kTile;
  // Soft-cap in the scores' log2 units: c * tanh(s / c) with c = cap * log2(e) is
  // log2(e) * cap * tanh(s_nat / cap). Uniform flag: one branch per group when off.
  const bool capped = p.soft_cap > 0.f;
  const float cap = p.soft_cap * kLog2e;
  const float inv_cap = capped ? 1.f / cap : 0.f;

  // q of this row's heads, pre-scaled so that scores come out in log2 units.
  float qf[kHeads][8];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    const V qv = V::load(static_cast<const T*>(p.q) + b * p.q_stride + (head + h) * D + lane * 8);
    to_floats(qv, qf[h]);
#pragma unroll
    for (int e = 0; e < 8; ++e) qf[h][e] *= p.scale * p.k_scale * kLog2e;  // k_scale: fp8
  }

  const int* table = p.block_tables + b * p.block_table_stride;
  if (p.check_indices) {  // debug mode: this split's page ids, before any of them is followed
    check_index(true, (len - 1) >> lay.block_shift, p.block_table_width);
    for (int i = (start >> lay.block_shift) + threadIdx.x; i <= (end - 1) >> lay.block_shift;
         i += blockDim.x)
      check_index(true, table[i], p.num_blocks);
  }
  const C* k_cache = static_cast<const C*>(p.k_cache);
  const C* v_cache = static_cast<const C*>(p.v_cache);
  const int block_mask = (1 << lay.block_shift) - 1;
  // This thread copies 16-byte chunk `copy_chunk` of tokens copy_row + i * kCopyRows of every
  // tile (16-bit caches: copy_chunk = lane, copy_row = row).
  constexpr int kChunkElems = 16 / int(sizeof(C));
  const int copy_chunk = threadIdx.x % S::kCopyChunks;
  const int copy_row = threadIdx.x / S::kCopyChunks;
  int pages[S::kTokensPerThread];
  auto lookup = [&](int tile) {
#pragma unroll
    for (int i = 0; i < S::kTokensPerThread; ++i) {
      const int t = start + tile * S::kTile + copy_row + i * S::kCopyRows;
      pages[i] = t < end ? table[t >> lay.block_shift] : 0;
    }
  };
  auto issue = [&](int tile) {
    const int stage = tile % kStages;
#pragma unroll
    for (int i = 0; i < S::kTokensPerThread; ++i) {
      const int j = copy_row + i * S::kCopyRows;
      const int t = start + tile * S::kTile + j;
      if (t < end) {
        const int64_t offset =
            ((int64_t(pages[i]) * p.num_kv_heads + kv_head) * (block_mask + 1) + (t & block_mask)) *
                D + copy_chunk * kChunkElems;
        const int dst = j * D + copy_chunk * kChunkElems;
        __pipeline_memcpy_async(&smem_k[stage][dst], k_cache + offset, 16);
        __pipeline_memcpy_async(&smem_v[stage][dst], v_cache + offset, 16);
      }
    }
  };

  lookup(0);
  issue(0);
  __pipeline_commit();
  lookup(1);
  issue(1);
  __pipeline_commit();
  lookup(2);

  float acc[kHeads][8];
  float m[kHeads], d[kHeads];  // running max (log2 units) and sum of 2^(s - m)
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    m[h] = -INFINITY;
    d[h] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[h][e] = 0.f;
  }
  for (int tile = 0; tile < num_tiles; ++tile) {
    __pipeline_wait_prior(1);  // committed: tiles 0..tile+1; this one has landed
    __syncthreads();           // for every thread; and nobody still reads stage (tile + 2) % 3
    issue(tile + 2);           // no copies past the end
    __pipeline_commit();
    lookup(tile + 3);

    const int valid = min(S::kTile, end - start - tile * S::kTile);
    for (int base = 0; base < valid; base += kGroup * zs) {  // same trip count in every thread
      // Token slot u of this row is base + z + u * zs. Slots past the tile read stale bytes
      // that stay inside `ring` (at most 4 * kRows - 1 tokens past the last K stage, which is
      // followed by the V stages) and are masked to -inf below.
      const C* kp = &smem_k[tile % kStages][(base + z) * D + lane * 8];
      const C* vp = &smem_v[tile % kStages][(base + z) * D + lane * 8];
      const int limit = active ? valid - base - z : 0;  // slot u is a token iff u * zs < limit
      float s[kHeads][kGroup];
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        float kf[8];
        cache_floats(kp + u * zs * D, kf);
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          float dot = 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) dot += qf[h][e] * kf[e];
          s[h][u] = dot;
        }
      }
#pragma unroll
      for (int offset = S::kLanes / 2; offset > 0; offset >>= 1) {
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
#pragma unroll
          for (int u = 0; u < kGroup; ++u) s[h][u] += __shfl_xor_sync(0xffffffffu, s[h][u], offset);
        }
      }
      if (capped) {
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
#pragma unroll
          for (int u = 0; u < kGroup; ++u) s[h][u] = cap * tanhf(s[h][u] * inv_cap);
        }
      }
      float m_ref[kHeads];
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        float m_new = m[h];
#pragma unroll
        for (int u = 0; u < kGroup; ++u) {
          if (u * zs >= limit) s[h][u] = -INFINITY;
          m_new = fmaxf(m_new, s[h][u]);
        }
        m_ref[h] = m_new == -INFINITY ? 0.f : m_new;  // no token yet: keep 0 * 0
        const float alpha = fast_exp2(m[h] - m_ref[h]);
        m[h] = m_new;
        d[h] *= alpha;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] *= alpha;
      }
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        if (u * zs < limit) {
          float vf[8];
          cache_floats(vp + u * zs * D, vf);
#pragma unroll
          for (int h = 0; h < kHeads; ++h) {
            const float w = fast_exp2(s[h][u] - m_ref[h]);
            d[h] += w;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[h][e] += w * vf[e];
          }
        }
      }
    }
  }

  // Merge the zs rows of each head unit through shared memory (the ring is free now).
  __pipeline_wait_prior(0);
  __syncthreads();
  float* red = reinterpret_cast<float*>(&smem_k[0][0]);  // [kRows][kHeads][D] accumulators
  float* red_md = red + S::kRows * kHeads * D;              // [kRows][kHeads][2] (max, sum)
  if (active) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
#pragma unroll
      for (int e = 0; e < 8; ++e) red[(row * kHeads + h) * D + lane * 8 + e] = acc[h][e];
      if (lane == 0) {
        red_md[2 * (row * kHeads + h)] = m[h];
        red_md[2 * (row * kHeads + h) + 1] = d[h];
      }
    }
  }
  __syncthreads();
  if (!active || z != 0) return;
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    float mx = -INFINITY;
    for (int r = row; r < row + zs; ++r) mx = fmaxf(mx, red_md[2 * (r * kHeads + h)]);
    float total = 0.f;
    float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int r = row; r < row + zs; ++r) {
      const float w = exp2f(red_md[2 * (r * kHeads + h)] - mx);  // rows without tokens: 0
      total += w * red_md[2 * (r * kHeads + h) + 1];
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] += w * red[(r * kHeads + h) * D + lane * 8 + e];
    }
    float keep = 1.f;  // the keys' share after a sink joins the denominator
    if (p.sinks != nullptr && p.num_splits == 1) {  // (split partials: the merge adds it)
      sink_into(p.sinks[head + h] * kLog2e, mx, total, keep);
    }
    const float inv = p.v_scale * keep / total;  // v_scale: fp8 (the merge is linear in parts)
    const float lse = (mx + log2f(total)) * kLn2;
    if (p.num_splits == 1) {
      V ov;
#pragma unroll
      for (int e = 0; e < 8; ++e) ov.v[e] = from_float<T>(o[e] * inv);
      ov.store(static_cast<T*>(p.out) + b * p.out_stride + (head + h) * D + lane * 8);
      if (p.lse != nullptr && lane == 0) p.lse[b * p.num_heads + head + h] = lse;
    } else {
      const int64_t slot = (int64_t(b) * p.num_heads + head + h) * p.num_splits + split;
      float4* dst = reinterpret_cast<float4*>(p.workspace + slot * D + lane * 8);
      dst[0] = make_float4(o[0] * inv, o[1] * inv, o[2] * inv, o[3] * inv);
      dst[1] = make_float4(o[4] * inv, o[5] * inv, o[6] * inv, o[7] * inv);
      if (lane == 0) {
        const int64_t lse_base = int64_t(p.batch) * p.num_heads * p.num_splits * D;
        p.workspace[lse_base + slot] = lse;
      }
    }
  }
}

// One warp per (sequence, query head): merges the splits that hold keys.
template <typename T>
__global__ void __launch_bounds__(128) paged_attention_merge_kernel(const PagedAttentionParams p) {
  const int64_t pair = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (pair >= int64_t(p.batch) * p.num_heads) return;  // whole warps; no block barrier below
  const int b = int(pair / p.num_heads);
  const int head = int(pair % p.num_heads);
  const int D = p.head_dim;
  const int len = p.seq_lens[b];
  const int keys = len - paged_attention_first_key(len, p.window);
  const int n = len <= 0 ? 0 : min(p.num_splits, (keys + p.split_size - 1) / p.split_size);
  const float* parts = p.workspace + pair * p.num_splits * D;
  const float* lses =
      p.workspace + int64_t(p.batch) * p.num_heads * p.num_splits * D + pair * p.num_splits;

  float mx = -INFINITY;
  for (int s = 0; s < n; ++s) mx = fmaxf(mx, lses[s]);
  T* out = static_cast<T*>(p.out) + b * p.out_stride + head * D;
  if (mx == -INFINITY) {  // padding entry (no split holds keys)
    for (int i = lane; i < D; i += 32) out[i] = from_float<T>(0.f);
    if (p.lse != nullptr && lane == 0) p.lse[pair] = -INFINITY;
    return;
  }
  float total = 0.f;
  if (p.sinks != nullptr) {  // the sink joins the denominator: a split with lse = sink, no output
    const float sink = p.sinks[head];
    mx = fmaxf(mx, sink);
    total = expf(sink - mx);
  }
  for (int s = 0; s < n; ++s) total += expf(lses[s] - mx);
  const float inv = 1.f / total;
  for (int v = lane; v < D / 4; v += 32) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < n; ++s) {
      const float w = expf(lses[s] - mx);
      const float4 x = reinterpret_cast<const float4*>(parts + int64_t(s) * D)[v];
      acc.x += w * x.x;
      acc.y += w * x.y;
      acc.z += w * x.z;
      acc.w += w * x.w;
    }
    out[4 * v + 0] = from_float<T>(acc.x * inv);
    out[4 * v + 1] = from_float<T>(acc.y * inv);
    out[4 * v + 2] = from_float<T>(acc.z * inv);
    out[4 * v + 3] = from_float<T>(acc.w * inv);
  }
  if (p.lse != nullptr && lane == 0) p.lse[pair] = mx + logf(total);
}

// The tensor-core variant (paged_attention_mma.cuh), D = 64 and 128.
template <typename T, typename C, int D>
void launch_mma(const PagedAttentionParams& p, int block_shift, cudaStream_t stream) {
  const mma_decode::Layout lay = mma_decode::layout_for(p, block_shift);
  const dim3 grid(unsigned(p.num_kv_heads * lay.head_chunks), unsigned(p.batch),
                  unsigned(p.num_splits));
  if (p.soft_cap > 0.f) {
    mma_decode::paged_attention_mma_kernel<T, C, D, true>
        <<<grid, mma_decode::Shape<D, C>::kThreads, 0, stream>>>(p, lay);
  } else {
    mma_decode::paged_attention_mma_kernel<T, C, D, false>
        <<<grid, mma_decode::Shape<D, C>::kThreads, 0, stream>>>(p, lay);
  }
  PK_CHECK_LAUNCH("paged_attention_mma_kernel");
}

template <typename T, typename C, int D>
void launch(const PagedAttentionParams& p, Layout lay, cudaStream_t stream) {
  if constexpr (D != 256) {
    if (p.variant == kPagedAttentionMma) launch_mma<T, C, D>(p, lay.block_shift, stream);
  }
  if (p.variant == kPagedAttentionSimt) {
    const int units = lay.group % 2 == 0 ? lay.group / 2 : lay.group;  // kHeads = 2 or 1 below
    lay.head_chunks = ceil_div(units, Shape<D, C>::kRows);
    lay.units_per_cta = ceil_div(units, lay.head_chunks);
    const dim3 grid(unsigned(p.num_kv_heads * lay.head_chunks), unsigned(p.batch),
                    unsigned(p.num_splits));
    if (lay.group % 2 == 0) {
      paged_attention_kernel<T, C, D, 2><<<grid, Shape<D, C>::kThreads, 0, stream>>>(p, lay);
    } else {
      paged_attention_kernel<T, C, D, 1><<<grid, Shape<D, C>::kThreads, 0, stream>>>(p, lay);
    }
    PK_CHECK_LAUNCH("paged_attention_kernel");
  }
  if (p.num_splits > 1) {
    const unsigned blocks = unsigned(ceil_div(int64_t(p.batch) * p.num_heads, 4));
    paged_attention_merge_kernel<T><<<blocks, 128, 0, stream>>>(p);
    PK_CHECK_LAUNCH("paged_attention_merge_kernel");
  }
}

template <typename T, typename C>
void dispatch_head_dim(const PagedAttentionParams& p, const Layout& lay, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: launch<T, C, 64>(p, lay, stream); break;
    case 128: launch<T, C, 128>(p, lay, stream); break;
    case 256: launch<T, C, 256>(p, lay, stream); break;
    default: throw std::invalid_argument("paged_attention: head_dim must be 64, 128 or 256");
  }
}

}  // namespace

void paged_attention(const PagedAttentionParams& p, cudaStream_t stream) {
  require(p.batch >= 0 && p.batch <= 65535, "paged_attention: batch must be in [0, 65535]");
  require(p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0,
          "paged_attention: query heads must be a multiple of the KV heads");
  require(p.block_size > 0 && (p.block_size & (p.block_size - 1)) == 0,
          "paged_attention: block_size must be a power of two");
  require(p.num_splits >= 1 && p.num_splits <= 65535, "paged_attention: num_splits out of range");
  require(p.variant == kPagedAttentionSimt ||
              (p.variant == kPagedAttentionMma && (p.head_dim == 64 || p.head_dim == 128)),
          "paged_attention: variant must be simt (0) or, for D = 64 and 128, mma (1)");
  require(std::isfinite(p.k_scale) && p.k_scale > 0 && std::isfinite(p.v_scale) && p.v_scale > 0,
          "paged_attention: k_scale and v_scale must be finite and positive");
  require(p.window >= 0, "paged_attention: window must be >= 0 (0: none)");
  require(std::isfinite(p.soft_cap) && p.soft_cap >= 0,
          "paged_attention: soft_cap must be finite and >= 0 (0: none)");
  require(p.num_splits == 1 || (p.split_size > 0 && p.split_size % 64 == 0 && p.workspace),
          "paged_attention: splits need a split_size multiple of 64 and a workspace");
  require(aligned16(p.q) && aligned16(p.out) && aligned16(p.k_cache) && aligned16(p.v_cache) &&
              p.q_stride % 8 == 0 && p.out_stride % 8 == 0 && aligned16(p.workspace),
          "paged_attention: q, out and the caches need 16-byte aligned rows");
  if (p.batch == 0 || p.num_heads == 0) return;
  Layout lay{};
  while ((1 << lay.block_shift) < p.block_size) ++lay.block_shift;
  lay.group = p.num_heads / p.num_kv_heads;
  switch (p.dtype) {
    case DType::kFloat16:
      if (p.kv_fp8) dispatch_head_dim<__half, Fp8>(p, lay, stream);
      else dispatch_head_dim<__half, __half>(p, lay, stream);
      break;
    case DType::kBFloat16:
      if (p.kv_fp8) dispatch_head_dim<__nv_bfloat16, Fp8>(p, lay, stream);
      else dispatch_head_dim<__nv_bfloat16, __nv_bfloat16>(p, lay, stream);
      break;
    default: throw std::invalid_argument("paged_attention: dtype must be float16 or bfloat16");
  }
}

}  // namespace pagedkern
