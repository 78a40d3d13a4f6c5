// Device code shared by the sampling kernels (sampling.cu: v1/v2, sampling_fused.cu: v3,
// sampling_split.cu: v4): launch shape, the descent's shared state, Philox, the per-element order
// key and fixed-point mass, the 16-byte runs, the block scan, the radix-select bin choice, one
// sparse entry's processing, and the v3/v4 passes over a range of a row (argmax, histogram,
// kept mass, draw), which v4 runs on one slice per CTA.
#pragma once

#include "device.cuh"
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

// The processed logits of one row (reference.logits_processing steps 1-2), element by element.
template <typename T, int kVec>
struct Source {
  const T* row;
  const int* mask;                       // null: every token allowed
  const float* entry_values = nullptr;   // null: no sparse entries
  const unsigned* entry_bits = nullptr;  // written by this CTA: plain (coherent) loads

  // The kVec values at i (a multiple of kVec: the run's bits lie in one word).
  __device__ __forceinline__ void load(int64_t i, float (&x)[kVec]) const {
    Run<T, kVec> run;
    run.load(row + i);
    const unsigned shift = unsigned(i & 31);
    const unsigned entries = entry_bits ? entry_bits[i >> 5] >> shift : 0u;
    const unsigned ok = mask ? unsigned(__ldg(mask + (i >> 5))) >> shift : ~0u;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      float v = to_float(run.v[e]);
      if (v != v) v = -INFINITY;
      if ((entries >> e) & 1u) v = entry_values[i + e];
      x[e] = (ok >> e) & 1u ? v : -INFINITY;
    }
  }
  __device__ __forceinline__ float at(int64_t i) const {
    float v = to_float(row[i]);
    if (v != v) v = -INFINITY;
    if (entry_bits && (entry_bits[i >> 5] >> (i & 31)) & 1u) v = entry_values[i];
    return allowed(mask, i) ? v : -INFINITY;
  }
};

// Calls f(index, value, valid) for every element slot of [begin, end) (begin a multiple of
// kVec); block-uniform trip count (elements past end are flagged invalid), so warp intrinsics
// inside f are never divergent.
template <typename T, int kVec, typename F>
__device__ __forceinline__ void visit(const Source<T, kVec>& src, int64_t begin, int64_t end,
                                      F&& f) {
  constexpr int64_t kStep = int64_t(kThreads) * kVec;
  for (int64_t base = begin; base < end; base += kStep * kUnroll) {
    float x[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kStep + int64_t(threadIdx.x) * kVec;
      if (i < end) {
        src.load(i, x[u]);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) x[u][e] = -INFINITY;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kStep + int64_t(threadIdx.x) * kVec;
#pragma unroll
      for (int e = 0; e < kVec; ++e) f(i + e, x[u][e], i < end);
    }
  }
}

// Argmax (ties to the lowest id, NaN = -inf) and the count of +inf entries.
struct Argmax {
  float best = -INFINITY;
  int index = 0x7fffffff;
  int posinf = 0;
  __device__ __forceinline__ void add(float b, int i, int inf) {
    if (b > best || (b == best && i < index)) {
      best = b;
      index = i;
    }
    posinf += inf;
  }
};

// The argmax of [begin, end), the same in every thread. Called by every thread of the block.
template <typename T, int kVec>
__device__ __forceinline__ Argmax block_argmax(const Source<T, kVec>& src, int64_t begin,
                                               int64_t end, Shared& sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  Argmax a;
  visit<T, kVec>(src, begin, end, [&](int64_t i, float x, bool valid) {
    if (valid) a.add(x, int(i), x == INFINITY);
  });
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, a.best, off);
    const int oi = __shfl_xor_sync(0xffffffffu, a.index, off);
    const int op = __shfl_xor_sync(0xffffffffu, a.posinf, off);
    a.add(ob, oi, op);
  }
  if (lane == 0) {
    sh.best_value[warp] = a.best;
    sh.best_index[warp] = a.index;
    sh.posinf[warp] = a.posinf;
  }
  __syncthreads();
  Argmax block;
  for (int w = 0; w < kWarps; ++w) block.add(sh.best_value[w], sh.best_index[w], sh.posinf[w]);
  __syncthreads();  // sh.best_* may be reused
  return block;
}

// A row's parameters once pass 1 (argmax) is known: greedy, or the math and the filters.
struct RowPlan {
  bool greedy;  // temperature <= 0 (or NaN), nothing finite to sample from, or s overflowing
  RowMath rm;   // temperature, s_max, +inf row, min-p
  unsigned k;   // top-k; vocab when off
  float top_p;
  bool use_p;   // top_p < 1 (NaN: off)
};
__device__ __forceinline__ RowPlan plan_row(const SampleParams& p, int64_t r, const Argmax& am) {
  const float temperature = p.temperature[r];
  const bool posinf_row = am.posinf > 0;
  const float s_max = posinf_row ? 0.f : __fdiv_rn(am.best, temperature);
  RowPlan plan{!(temperature > 0.f) || am.best == -INFINITY || s_max == INFINITY,
               RowMath{temperature, s_max, posinf_row}, 0u, 1.f, false};
  const float min_p = p.min_p ? p.min_p[r] : 0.f;
  if (min_p > 0.f) plan.rm.s_min = s_max + logf(min_p);
  const int top_k = p.top_k[r];
  plan.top_p = p.top_p[r];
  plan.use_p = plan.top_p < 1.f;
  plan.k = top_k > 0 && top_k < p.vocab ? unsigned(top_k) : unsigned(p.vocab);
  return plan;
}

// One histogram pass of the descent over [begin, end): the current digit's (sh.bits, sh.prefix)
// bin counts and, with_mass, fixed-point masses of the keys >= floor_key still in the running,
// into sh.count / mass_lo / mass_hi (cleared first). The lanes of a warp that hit the same bin
// are grouped with __match_any_sync; the group's count is its popcount and its mass a
// __reduce_add_sync of two 32-bit halves (20 + 21 bits of the <= 2^40 fixed-point mass); one
// lane per group does the shared atomics. A warp with no candidate skips (one vote). Called by
// every thread; ends with a barrier.
template <typename T, int kVec>
__device__ __forceinline__ void histogram_pass(const Source<T, kVec>& src, int64_t begin,
                                               int64_t end, const RowMath& rm, Shared& sh,
                                               bool with_mass, unsigned floor_key) {
  const int lane = threadIdx.x % 32;
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    sh.count[b] = 0;
    sh.mass_lo[b] = 0;
    sh.mass_hi[b] = 0;
  }
  __syncthreads();
  const int bits = sh.bits;
  const unsigned prefix = sh.prefix;
  visit<T, kVec>(src, begin, end, [&](int64_t, float x, bool valid) {
    float s;
    const unsigned key = rm.key(x, s);
    const bool counted =
        valid && key >= floor_key && !(bits > 0 && (key ^ prefix) >> (32 - bits));
    if (!__any_sync(0xffffffffu, counted)) return;  // warp-uniform
    const unsigned bin = counted ? (key >> (24 - bits)) & (kBins - 1) : unsigned(kBins);
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    unsigned long long mass = 0;
    if (with_mass) {  // block-uniform; halves of <= 2^40: sums of 32 fit in 32 bits
      const unsigned long long m = counted ? rm.mass(s) : 0ull;
      const unsigned lo = __reduce_add_sync(peers, unsigned(m) & 0xFFFFFu);
      const unsigned hi = __reduce_add_sync(peers, unsigned(m >> 20));
      mass = (static_cast<unsigned long long>(hi) << 20) + lo;
    }
    if (!counted || lane != __ffs(int(peers)) - 1) return;
    atomicAdd(&sh.count[bin], unsigned(__popc(peers)));
    if (mass) {  // (hi, lo) += mass, the carry of the low word going to the high word
      const unsigned lo = unsigned(mass);
      const unsigned old = atomicAdd(&sh.mass_lo[bin], lo);
      atomicAdd(&sh.mass_hi[bin], unsigned(mass >> 32) + (old + lo < old ? 1u : 0u));
    }
  });
  __syncthreads();
}

// The fixed-point mass of x if its key is in the kept set {key >= tau}, else 0.
__device__ __forceinline__ unsigned long long kept_mass(const RowMath& rm, unsigned tau,
                                                        float x) {
  float s;
  return rm.key(x, s) >= tau ? rm.mass(s) : 0ull;
}

// Draw within [begin, end) (begin a multiple of kVec): the first id whose cumulative kept mass,
// starting at `running` (the mass before begin), exceeds target goes to sh.found (left as it is
// when the range ends first). Spans in vocabulary order, thread t owning [t * kOwn, (t + 1) *
// kOwn) of each chunk, one block scan per chunk; the thread whose span holds target walks it
// again. Integer sums: the same id whatever the split of the row. Called by every thread.
template <typename T, int kVec>
__device__ __forceinline__ void draw_in_range(const Source<T, kVec>& src, int64_t begin,
                                              int64_t end, const RowMath& rm, unsigned tau,
                                              unsigned long long target,
                                              unsigned long long running, Shared& sh) {
  constexpr int kOwn = kUnroll * kVec;
  constexpr int64_t kChunk = int64_t(kThreads) * kOwn;
  for (int64_t base = begin; base < end; base += kChunk) {
    const int64_t i0 = base + int64_t(threadIdx.x) * kOwn;
    float x[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u * kVec < end) src.load(i0 + u * kVec, x[u]);
    }
    unsigned long long local = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u * kVec < end) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) local += kept_mass(rm, tau, x[u][e]);
      }
    }
    unsigned long long total;
    const unsigned long long before = running + block_exclusive_scan(local, total, sh);
    if (target >= before && target < before + local) {
      unsigned long long acc = before;
      for (int64_t i = i0; i < i0 + kOwn && i < end; ++i) {
        const unsigned long long m = kept_mass(rm, tau, src.at(i));
        acc += m;
        if (acc > target && acc - m <= target) sh.found = int(i);
      }
    }
    running += total;
    if (running > target) break;  // uniform: every thread has the same running
  }
}

}  // namespace
}  // namespace pagedkern
