// Device code shared by the sampling kernels (sampling.cu: v1/v2, sampling_fused.cu: v3,
// sampling_split.cu: v4): launch shape, the descent's shared state, Philox, the per-element order
// key and fixed-point mass, the 16-byte runs, the block scan, the radix-select bin choice, and one
// sparse entry's processing. The v3 / v4 passes over a range of a row: sampling_passes.cuh.
#pragma once

#include "device.cuh"
#include "index_check.cuh"
#include "philox.cuh"
#include "sampling.h"

namespace pagedkern {
namespace {
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;
constexpr int kUnroll = 4;  // loads in flight per thread
constexpr float kMassScale = 1099511627776.f;  // 2^40: fixed-point masses

struct Shared {
  unsigned count[kBins];
  unsigned mass_lo[kBins];  // 64-bit bin masses as two words: native 32-bit shared atomics
  unsigned mass_hi[kBins];
  unsigned long long scan[kWarps];
  float best_value[kWarps];
  int best_index[kWarps];
  int posinf[kWarps];
  // descent state
  unsigned prefix;
  int bits;
  unsigned above_count;
  unsigned long long above_mass;
  unsigned long long kept_mass;
  double pz;
  int done;
  int found;
};

// A histogram pass's start: every bin's count and mass zeroed (block-strided; the caller's
// barrier follows).
__device__ __forceinline__ void clear_bins(Shared& sh) {
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    sh.count[b] = 0;
    sh.mass_lo[b] = 0;
    sh.mass_hi[b] = 0;
  }
}

// Philox4x32-10 word 0: the uniform `sample` draws with (reference.sampling.uniform).
__device__ __forceinline__ unsigned philox_word0(unsigned long long seed,
                                                 unsigned long long offset) {
  return philox_words(seed, offset).x;
}

// Per-element math shared by every pass after the first: value s, order key, fixed-point mass.
struct RowMath {
  float temperature;
  float s_max;
  bool posinf_row;
  float s_min = -INFINITY;  // min-p: s below s_max + log(min_p) is out (as -inf)
  __device__ __forceinline__ unsigned key(float x, float& s) const {
    if (x != x) x = -INFINITY;
    if (posinf_row) x = x == INFINITY ? 0.f : -INFINITY;
    s = __fdiv_rn(x, temperature);
    if (s == 0.f) s = 0.f;      // -0 and +0 are one value (a tie)
    if (s != s) s = -INFINITY;  // -inf / inf (temperature = inf): never drawn
    if (s < s_min) s = -INFINITY;
    const unsigned bits = __float_as_uint(s);
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
  }
  __device__ __forceinline__ unsigned long long mass(float s) const {
    return s == -INFINITY ? 0ull : (unsigned long long)(expf(s - s_max) * kMassScale);
  }
};

// kVec consecutive elements of a row: one 16-byte load, or kVec scalar loads.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Run {
  T v[kVec];
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (sizeof(T) * kVec == 16) {
      *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(p);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] = p[e];
    }
  }
};

// Exclusive prefix sum over the block; also returns the block total.
__device__ __forceinline__ unsigned long long block_exclusive_scan(unsigned long long v,
                                                                   unsigned long long& total,
                                                                   Shared& sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned long long incl = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned long long t = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += t;
  }
  if (lane == 31) sh.scan[warp] = incl;
  __syncthreads();
  unsigned long long before = 0;
  total = 0;
  for (int w = 0; w < kWarps; ++w) {
    const unsigned long long s = sh.scan[w];
    before += w < warp ? s : 0ull;
    total += s;
  }
  __syncthreads();  // sh.scan is reused by the next call
  return before + incl - v;
}

// Warp 0: picks the bin of the current digit that holds the threshold and updates the descent.
// Count mode (top-k): the bin holding the k-th largest key. Mass mode (top-p): the lowest
// non-empty bin whose mass above is < pz or 0.
__device__ __forceinline__ void select_bin(Shared& sh, bool mass_mode, unsigned k,
                                           float top_p) {
  const int lane = threadIdx.x;
  unsigned c[8];
  unsigned long long m[8];
  unsigned lane_c = 0;
  unsigned long long lane_m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // lane 0 holds bins 255..248, lane 1 247..240, ...
    const int bin = kBins - 1 - 8 * lane - i;
    c[i] = sh.count[bin];
    m[i] = (static_cast<unsigned long long>(sh.mass_hi[bin]) << 32) | sh.mass_lo[bin];
    lane_c += c[i];
    lane_m += m[i];
  }
  unsigned incl_c = lane_c;
  unsigned long long incl_m = lane_m;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned tc = __shfl_up_sync(0xffffffffu, incl_c, off);
    const unsigned long long tm = __shfl_up_sync(0xffffffffu, incl_m, off);
    if (lane >= off) {
      incl_c += tc;
      incl_m += tm;
    }
  }
  const int bits = sh.bits;
  const double total = double(__shfl_sync(0xffffffffu, incl_m, 31));
  const double pz = bits == 0 ? double(top_p) * total : sh.pz;  // Z_k: all candidates
  unsigned cc = sh.above_count + incl_c - lane_c;
  unsigned long long mm = sh.above_mass + incl_m - lane_m;
  int chosen = -1;
  unsigned sel_before_c = 0, sel_c = 0;
  unsigned long long sel_before_m = 0, sel_m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const bool take = mass_mode ? c[i] > 0 && (double(mm) < pz || mm == 0)
                                : cc < k && k <= cc + c[i];
    if (take) {  // mass mode: the last one taken is the lowest qualifying bin
      chosen = i;
      sel_before_c = cc;
      sel_before_m = mm;
      sel_c = c[i];
      sel_m = m[i];
    }
    cc += c[i];
    mm += m[i];
  }
  const unsigned lanes = __ballot_sync(0xffffffffu, chosen >= 0);
  const int src = lanes ? 31 - __clz(int(lanes)) : 0;  // highest lane = lowest bins
  chosen = __shfl_sync(0xffffffffu, chosen, src);
  sel_before_c = __shfl_sync(0xffffffffu, sel_before_c, src);
  sel_c = __shfl_sync(0xffffffffu, sel_c, src);
  sel_before_m = __shfl_sync(0xffffffffu, sel_before_m, src);
  sel_m = __shfl_sync(0xffffffffu, sel_m, src);
  if (lane == 0) {
    if (chosen < 0) {  // cannot happen (the invariant keeps the threshold in range): stop here
      sh.done = 1;
      return;
    }
    const unsigned bin = unsigned(kBins - 1 - 8 * src - chosen);
    sh.prefix |= bin << (24 - bits);
    sh.bits = bits + 8;
    sh.above_count = sel_before_c;
    sh.above_mass = sel_before_m;
    sh.kept_mass = sel_before_m + sel_m;
    if (bits == 0) sh.pz = pz;
    sh.done = bits + 8 == 32 || (mass_mode ? sel_c == 1 : sel_before_c + sel_c == k);
  }
}


// Row r's mask (nullptr: none) and sparse entries [first, last), never outside the arrays
// (SampleParams: num_masks, nnz); a bad index traps in debug mode (index_check.cuh).
__device__ __forceinline__ const int* row_mask(const SampleParams& p, int64_t r) {
  const int row = p.bitmask_rows ? p.bitmask_rows[r] : -1;
  if (row < 0) return nullptr;
  check_index(p.check_indices, row, p.num_masks);
  return row < p.num_masks ? p.bitmask + int64_t(row) * p.bitmask_words : nullptr;
}

struct EntryRange {
  int first = 0, last = 0;
};

__device__ __forceinline__ EntryRange row_entries(const SampleParams& p, int64_t r) {
  if (p.token_offsets == nullptr) return {};
  const int first = p.token_offsets[r], last = p.token_offsets[r + 1];
  if (first < 0 || last < first || last > p.nnz) {
    if (p.check_indices) __trap();
    return {};
  }
  return {first, last};
}

__device__ __forceinline__ bool allowed(const int* mask, int64_t i) {
  return mask == nullptr || (unsigned(mask[i >> 5]) >> (i & 31)) & 1u;
}

// Sparse entry j of row r recomputed from the raw logit x (reference.logits_processing step 1,
// IEEE steps in the reference's order, no contraction into FMAs), then the row's mask.
__device__ __forceinline__ float processed_entry(const SampleParams& p, int64_t r, int j,
                                                 float x, const int* mask) {
  if (x != x) x = -INFINITY;
  const int count = p.token_counts[j];
  if (count >= 0) {
    const float repetition = p.repetition_penalty[r];
    x = x > 0.f ? __fdiv_rn(x, repetition) : __fmul_rn(x, repetition);
    const float presence = p.presence_penalty[r];
    const float penalty = __fadd_rn(__fmul_rn(p.frequency_penalty[r], float(count)),
                                    count > 0 ? presence : __fmul_rn(presence, 0.f));
    x = __fsub_rn(x, penalty);
  }
  x = __fadd_rn(x, p.token_bias[j]);
  return x != x || !allowed(mask, p.token_ids[j]) ? -INFINITY : x;
}

}  // namespace
}  // namespace pagedkern
