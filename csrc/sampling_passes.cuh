// The passes of sample v3 (sampling_fused.cu) and v4 (sampling_split.cu) over a range [begin,
// end) of a row: the processed logits element by element (Source), the block-uniform visit, the
// argmax, the row's plan, one warp-aggregated histogram pass of the radix descent, the kept
// mass and the draw. v3 runs them on whole rows, v4 on one slice per CTA.
#pragma once

#include "sampling_common.cuh"

namespace pagedkern {
namespace {

// The processed logits of one row (reference.logits_processing steps 1-2), element by element.
template <typename T, int kVec>
struct Source {
  const T* row;
  const int* mask;                       // null: every token allowed
  const float* entry_values = nullptr;   // null: no sparse entries
  const unsigned* entry_bits = nullptr;  // by this CTA or an earlier kernel: plain loads

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
  // Every lane of the warp ends with the warp's argmax (all 32 lanes must call it).
  __device__ __forceinline__ void warp_reduce() {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float b = __shfl_xor_sync(0xffffffffu, best, off);
      const int i = __shfl_xor_sync(0xffffffffu, index, off);
      const int inf = __shfl_xor_sync(0xffffffffu, posinf, off);
      add(b, i, inf);
    }
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
  a.warp_reduce();
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
  clear_bins(sh);
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
