/*
 * The MoE router and the token grouping (parameters in moe.h).
 *
 * moe_route_kernel<T>: one warp per token, four tokens per block. Lane l owns experts l, l+32,
 *   ... (E <= 512: at most 16 per lane, in registers). The selection key is the logit itself
 *   (fp32): softmax and sigmoid are monotone, so the k largest logits are the k largest scores,
 *   and ids never depend on how exp rounds (the reference selects the same way, so the two
 *   agree exactly on ids). k passes, each a warp argmax over the experts not yet taken:
 *   larger key wins, equal keys go to the lower expert id (the reference's stable descending
 *   sort). Taken experts are a per-lane bit mask, so -inf logits still tie correctly. Softmax:
 *   max and sum of expf(l - max) over all E by warp shuffles; a weight is expf(l - max) / sum.
 *   Sigmoid: 1 / (1 + expf(-l)). Softmax over the top-k (gpt-oss): expf(l - max) of each
 *   selected logit (max = the first selected), always renormalised. Renormalisation divides by
 *   the sum of the k weights (slot order). Traffic: T*E logits read once, T*k*8 bytes
 *   written; latency bound at decode.
 *
 * moe_align_kernel: the (token, slot) pairs grouped by expert and padded to the GEMM row tile,
 *   in one block of 8 warps, stable (each expert's pairs in increasing pair index, as the
 *   reference's stable argsort) and deterministic, without atomics on global memory:
 *   1. warp w counts the experts of its contiguous segment of pairs into counts[w][e]
 *      (shared-memory atomics; counts do not depend on their order);
 *   2. per expert: exclusive prefix over warps, the padded size, then (one thread, E <= 512
 *      steps) the exclusive prefix over experts: where each warp's pairs of e start;
 *   3. each warp walks its segment 32 pairs at a time: __match_any_sync groups the lanes of
 *      one expert, a lane's rank among the lower lanes of its group gives its slot, and the
 *      group's highest lane advances the warp's offset for e.
 *   The unused rows hold the sentinel T*k, the unused tiles expert -1, so the GEMMs need no
 *   count read back to the host: their grid is the bound moe_padded_rows / tile_m.
 *   Single block: ~T*k/256 steps of a few shuffles; fine up to prefill sizes (T*k ~ 16k).
 *
 * Not yet verified on GPU.
 */
#include "device.cuh"
#include "moe.h"

namespace pagedkern {
namespace {

constexpr int kRouteWarps = 4;
constexpr int kPerLane = kMoeMaxExperts / 32;
constexpr int kAlignWarps = 8;

template <typename T>
__global__ void __launch_bounds__(kRouteWarps * 32) moe_route_kernel(const MoeRouteParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kRouteWarps + (threadIdx.x >> 5);
  if (t >= p.tokens) return;  // whole warps only
  const T* row = static_cast<const T*>(p.logits) + t * p.logits_stride;
  float key[kPerLane];
  float max_key = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    key[j] = e < p.experts ? to_float(row[e]) : -INFINITY;
    max_key = fmaxf(max_key, key[j]);
  }
  float sum = 0.f;
  if (p.scoring != MoeScoring::kSigmoid) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      max_key = fmaxf(max_key, __shfl_xor_sync(0xffffffffu, max_key, offset));
  }
  if (p.scoring == MoeScoring::kSoftmax) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j < p.experts) sum += expf(key[j] - max_key);
    sum = warp_sum(sum);
  }
  const bool renormalize = p.renormalize || p.scoring == MoeScoring::kSoftmaxTopk;
  uint32_t taken = 0;
  float total = 0.f;
  float my_weight = 0.f;  // lane s keeps slot s's weight (k <= E <= 512: slots past 31 below)
  int32_t* ids = p.ids + t * p.top_k;
  float* weights = p.weights + t * p.top_k;
  for (int s = 0; s < p.top_k; ++s) {
    float best = -INFINITY;
    int best_e = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      // increasing e within the lane: strict > keeps the lower id on ties
      if (e < p.experts && !(taken >> j & 1u) && (key[j] > best || best_e == 0x7fffffff)) {
        best = key[j];
        best_e = e;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_e = __shfl_xor_sync(0xffffffffu, best_e, offset);
      if (other_e != 0x7fffffff &&
          (best_e == 0x7fffffff || other > best || (other == best && other_e < best_e))) {
        best = other;
        best_e = other_e;
      }
    }
    if ((best_e & 31) == lane) taken |= 1u << (best_e >> 5);
    const float w = p.scoring == MoeScoring::kSoftmax   ? expf(best - max_key) / sum
                    : p.scoring == MoeScoring::kSigmoid ? 1.f / (1.f + expf(-best))
                                                        : expf(best - max_key);
    total += w;
    if (lane == 0) ids[s] = best_e;
    if (lane == (s & 31)) my_weight = w;
    if ((s & 31) == 31 || s == p.top_k - 1) {  // flush 32 slots' weights, scaled at the end
      const int s0 = s & ~31;
      if (lane <= s - s0) weights[s0 + lane] = my_weight;
    }
  }
  if (renormalize) {
    __syncwarp();
    for (int s = lane; s < p.top_k; s += 32) weights[s] = weights[s] / total;
  }
}

__global__ void __launch_bounds__(kAlignWarps * 32) moe_align_kernel(const MoeAlignParams p) {
  __shared__ int32_t counts[kAlignWarps][kMoeMaxExperts];  // then: each warp's next slot
  __shared__ int32_t padded[kMoeMaxExperts + 1];  // then: each expert's first row, and the end
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t rows = moe_padded_rows(p.pairs, p.experts, p.tile_m);
  const int32_t sentinel = int32_t(p.pairs);
  for (int64_t r = tid; r < rows; r += blockDim.x) p.sorted_pairs[r] = sentinel;
  for (int64_t r = tid; r < rows / p.tile_m; r += blockDim.x) p.tile_expert[r] = -1;
  for (int i = tid; i < kAlignWarps * kMoeMaxExperts; i += blockDim.x) (&counts[0][0])[i] = 0;
  __syncthreads();

  const int64_t segment = (p.pairs + kAlignWarps - 1) / kAlignWarps;
  const int64_t begin = warp * segment;
  const int64_t end = begin + segment < p.pairs ? begin + segment : p.pairs;
  for (int64_t i = begin + lane; i < end; i += 32) atomicAdd(&counts[warp][p.ids[i]], 1);
  __syncthreads();

  for (int e = tid; e < p.experts; e += blockDim.x) {
    int32_t running = 0;
    for (int w = 0; w < kAlignWarps; ++w) {
      const int32_t c = counts[w][e];
      counts[w][e] = running;
      running += c;
    }
    padded[e] = (running + p.tile_m - 1) / p.tile_m * p.tile_m;
  }
  __syncthreads();
  if (tid == 0) {
    int32_t start = 0;
    for (int e = 0; e < p.experts; ++e) {
      const int32_t size = padded[e];
      padded[e] = start;
      start += size;
    }
    padded[p.experts] = start;
  }
  __syncthreads();
  for (int e = tid; e < p.experts; e += blockDim.x) {
    const int32_t start = padded[e];
    for (int w = 0; w < kAlignWarps; ++w) counts[w][e] += start;
    for (int32_t tile = start / p.tile_m; tile < padded[e + 1] / p.tile_m; ++tile)
      p.tile_expert[tile] = e;
  }
  __syncthreads();

  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    const bool valid = i < end;
    const int e = valid ? p.ids[i] : -1 - lane;  // invalid lanes: groups of their own
    const unsigned group = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(group & ((1u << lane) - 1u));
    int32_t slot = 0;
    if (valid) slot = counts[warp][e] + rank;
    __syncwarp();
    if (valid) {
      p.sorted_pairs[slot] = int32_t(i);
      if (31 - __clz(int(group)) == lane) counts[warp][e] += __popc(group);
    }
    __syncwarp();
  }
}

}  // namespace

void moe_route(const MoeRouteParams& p, cudaStream_t stream) {
  require(p.experts > 0 && p.experts <= kMoeMaxExperts, "moe_route: experts must be in 1..512");
  require(p.top_k >= 1 && p.top_k <= p.experts, "moe_route: top_k must be in 1..experts");
  require(p.tokens >= 0 && p.tokens <= (int64_t(1) << 31) - kRouteWarps,
          "moe_route: tokens out of range");
  require(p.logits_stride >= p.experts, "moe_route: logits_stride must be >= experts");
  require(int(p.scoring) >= 0 && int(p.scoring) <= 2, "moe_route: scoring must be 0, 1 or 2");
  if (p.tokens == 0) return;
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>(ceil_div(p.tokens, kRouteWarps)));
    moe_route_kernel<T><<<grid, kRouteWarps * 32, 0, stream>>>(p);
    PK_CHECK_LAUNCH("moe_route_kernel");
  });
}

void moe_align(const MoeAlignParams& p, cudaStream_t stream) {
  require(p.experts > 0 && p.experts <= kMoeMaxExperts, "moe_align: experts must be in 1..512");
  require(p.tile_m == 16 || p.tile_m == 64, "moe_align: tile_m must be 16 or 64");
  require(p.pairs >= 0 && moe_padded_rows(p.pairs, p.experts, p.tile_m) < (int64_t(1) << 31),
          "moe_align: too many pairs");
  if (p.pairs == 0) return;
  moe_align_kernel<<<1, kAlignWarps * 32, 0, stream>>>(p);
  PK_CHECK_LAUNCH("moe_align_kernel");
}

}  // namespace pagedkern
