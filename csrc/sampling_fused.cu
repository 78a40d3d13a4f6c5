/*
 * sample, variant v3 (PAGEDKERN_SAMPLE_VARIANT=v3, the default): logits processing, sampling and
 * the logprob outputs (sampled token + top-N) in ONE kernel per row; semantics of
 * python/pagedkern/reference/sampling.py and reference/logits_processing.py, the same draws as
 * v1/v2 (sampling.cu: same keys, fixed-point masses, descent and inverse CDF).
 *
 * Mapping: one CTA of 512 threads per row. Streaming passes: in each step of 4 x 512 x kVec
 *   elements thread t reads runs t, t + 512, ... of kVec elements (16-byte loads); every thread
 *   runs the same number of steps (elements past the row are flagged invalid), so warp
 *   intrinsics inside a pass are never divergent. Ordered passes (draw, top-N ties): thread t
 *   owns the contiguous span [t * 4 kVec, (t + 1) * 4 kVec) of each chunk, block scans between.
 * Processing without a workspace pass over V: before the first pass the row's sparse entries
 *   (one thread each) write their processed value (penalties, bias, mask) to entry_values[id] of
 *   the workspace row and set bit id of the row's entry bitmap (ceil(V / 32) words, zeroed by the
 *   CTA). Every pass then reads per 16-byte run of logits one bitmap word and one grammar-mask
 *   word (both L1/L2-resident, V / 8 bytes) and takes the entry value where the bit is set:
 *   traffic O(nnz + V / 8) bytes instead of v2's extra V x (sizeof(T) + 4) pass and fp32 re-reads.
 * Histograms (issue 18): the lanes of a warp that hit the same bin are grouped with
 *   __match_any_sync; the group's count is its popcount and its mass a __reduce_add_sync of two
 *   32-bit halves (20 + 21 bits of the <= 2^40 fixed-point mass); one lane per group does the
 *   shared atomics. A warp with no candidate skips (one vote), as most do after the first digit.
 * Logprob outputs, from the distribution after processing and temperature, before min-p / top-k /
 *   top-p (temperature 1 for greedy rows): top-N (N <= 20) without a sort: a count-mode radix
 *   descent (the top-k machinery, no masses) finds the N-th largest key; one ordered pass then
 *   sums Z = sum exp(s - s_max) and collects the keys above the N-th's bin plus, in vocabulary
 *   order, the first ties inside it (ties to the lower id); one thread orders the <= 20.
 *   logprob = s - s_max - log Z.
 * Passes over the row (each V x sizeof(T) from L2/HBM): argmax 1, top-k / top-p descents 1-4
 *   each, draw ~0.5, logprobs +1, top-N +1-4 (count-only digits, mostly skipped warps).
 * Target: within 1.2x of plain sampling with all processing on, >= 5x the same chain of torch
 *   ops (bench/test_bench_sampling.py). Not yet verified on a GPU: v2 stays selectable.
 * Not here yet: several CTAs per row at small batch (issue 18); rows still map 1:1 to CTAs.
 */
#include "sampling_common.cuh"

namespace pagedkern {
namespace {

constexpr int kMaxTop = 20;

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

// Calls f(index, value, valid) for every element slot; block-uniform trip count (see the top).
template <typename T, int kVec, typename F>
__device__ __forceinline__ void visit(const Source<T, kVec>& src, int64_t vocab, F&& f) {
  constexpr int64_t kStep = int64_t(kThreads) * kVec;
  for (int64_t base = 0; base < vocab; base += kStep * kUnroll) {
    float x[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kStep + int64_t(threadIdx.x) * kVec;
      if (i < vocab) {
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
      for (int e = 0; e < kVec; ++e) f(i + e, x[u][e], i < vocab);
    }
  }
}

struct Descent {
  unsigned threshold;   // keys >= threshold: the selected set (with the bin below)
  int bits;             // digits fixed: the last bin is [threshold, threshold + 2^(32 - bits))
  unsigned above;       // keys at or above the end of that bin
};

// Radix descent as sampling.cu's, with warp-aggregated histogram updates.
template <typename T, int kVec>
__device__ __forceinline__ Descent descend(const Source<T, kVec>& src, int64_t vocab,
                                           const RowMath& rm, Shared& sh, bool mass_mode,
                                           bool with_mass, unsigned floor_key, unsigned k,
                                           float top_p) {
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.bits = 0;
    sh.above_count = 0;
    sh.above_mass = 0;
    sh.done = 0;
  }
  const int lane = threadIdx.x % 32;
  for (;;) {
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
      sh.count[b] = 0;
      sh.mass_lo[b] = 0;
      sh.mass_hi[b] = 0;
    }
    __syncthreads();
    const int bits = sh.bits;
    const unsigned prefix = sh.prefix;
    visit<T, kVec>(src, vocab, [&](int64_t, float x, bool valid) {
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
    if (threadIdx.x < 32) select_bin(sh, mass_mode, k, top_p);
    __syncthreads();
    const Descent d{sh.prefix, sh.bits, sh.above_count};
    const bool done = sh.done;
    __syncthreads();  // everyone has read the state before it changes
    if (done) return d;
  }
}

// The top-N list being collected (unordered) and Z's per-warp partial sums.
struct TopShared {
  int id[kMaxTop];
  unsigned key[kMaxTop];
  float s[kMaxTop];
  int size;
  float z[kWarps];
};

// Logprob outputs of row r under lm (no min-p): the sampled token's and the top-N. Called by
// every thread of the block.
template <typename T, int kVec>
__device__ __forceinline__ void write_outputs(const Source<T, kVec>& src, int64_t vocab,
                                              const RowMath& lm, bool finite, int token,
                                              const SampleParams& p, int64_t r, Shared& sh,
                                              TopShared& top) {
  const int n = p.top_n;
  Descent d{0u, 32, 0u};
  if (n > 0) d = descend<T, kVec>(src, vocab, lm, sh, false, false, 0, unsigned(n), 0.f);
  // keys >= tie_end are taken; of the ties in [threshold, tie_end), the first `need` by id
  const unsigned long long tie_end = (unsigned long long)d.threshold + (1ull << (32 - d.bits));
  const unsigned need = unsigned(n) - d.above;
  if (threadIdx.x == 0) top.size = 0;
  __syncthreads();
  auto take = [&](int64_t i, unsigned key, float s) {
    const int slot = atomicAdd(&top.size, 1);
    if (slot >= kMaxTop) return;  // cannot happen: the descent leaves exactly n to take
    top.id[slot] = int(i);
    top.key[slot] = key;
    top.s[slot] = s;
  };
  float z = 0.f;
  constexpr int kOwn = kUnroll * kVec;
  constexpr int64_t kChunk = int64_t(kThreads) * kOwn;
  unsigned long long running = 0;  // ties before this chunk
  for (int64_t base = 0; base < vocab; base += kChunk) {
    const int64_t i0 = base + int64_t(threadIdx.x) * kOwn;
    float x[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u * kVec < vocab) src.load(i0 + u * kVec, x[u]);
    }
    unsigned ties = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u * kVec < vocab) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          float s;
          const unsigned key = lm.key(x[u][e], s);
          if (finite && s != -INFINITY) z += expf(s - lm.s_max);
          if (n > 0 && key >= tie_end) take(i0 + u * kVec + e, key, s);
          ties += n > 0 && key >= d.threshold && key < tie_end;
        }
      }
    }
    if (n > 0) {  // block-uniform
      unsigned long long total;
      const unsigned long long before = running + block_exclusive_scan(ties, total, sh);
      if (ties && before < need) {  // this span holds some of the first `need` ties
        unsigned long long rank = before;
        for (int64_t i = i0; i < i0 + kOwn && i < vocab && rank < need; ++i) {
          float s;
          const unsigned key = lm.key(src.at(i), s);
          if (key >= d.threshold && key < tie_end) {
            take(i, key, s);
            ++rank;
          }
        }
      }
      running += total;
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) z += __shfl_xor_sync(0xffffffffu, z, off);
  if (threadIdx.x % 32 == 0) top.z[threadIdx.x / 32] = z;
  __syncthreads();
  if (threadIdx.x != 0) return;
  float total = 0.f;
  for (int w = 0; w < kWarps; ++w) total += top.z[w];
  const float log_z = logf(total);
  auto logprob = [&](float s) {
    return finite && s != -INFINITY ? s - lm.s_max - log_z : -INFINITY;
  };
  if (p.logprobs) {
    float s;
    lm.key(src.at(token), s);
    p.logprobs[r] = logprob(s);
  }
  // order the n collected: key descending, id ascending (insertion sort of <= 20)
  for (int a = 1; a < n; ++a) {
    const int id = top.id[a];
    const unsigned key = top.key[a];
    const float s = top.s[a];
    int b = a - 1;
    for (; b >= 0 && (top.key[b] < key || (top.key[b] == key && top.id[b] > id)); --b) {
      top.id[b + 1] = top.id[b];
      top.key[b + 1] = top.key[b];
      top.s[b + 1] = top.s[b];
    }
    top.id[b + 1] = id;
    top.key[b + 1] = key;
    top.s[b + 1] = s;
  }
  for (int j = 0; j < n; ++j) {
    p.top_ids[r * n + j] = top.id[j];
    p.top_logprobs[r * n + j] = logprob(top.s[j]);
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, 1) sample_fused_kernel(const SampleParams p) {
  __shared__ Shared sh;
  __shared__ TopShared top;
  const int64_t r = blockIdx.x;
  const int64_t vocab = p.vocab;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int mask_row = p.bitmask_rows ? p.bitmask_rows[r] : -1;
  Source<T, kVec> src{static_cast<const T*>(p.logits) + r * p.logits_stride,
                      mask_row >= 0 ? p.bitmask + int64_t(mask_row) * p.bitmask_words : nullptr};

  // Processing: the sparse entries' values and bits (O(nnz + V / 32) work, see the top).
  const int first = p.token_offsets ? p.token_offsets[r] : 0;
  const int last = p.token_offsets ? p.token_offsets[r + 1] : 0;
  if (last > first) {  // block-uniform
    float* values = p.workspace + r * p.workspace_stride;
    unsigned* bits = reinterpret_cast<unsigned*>(values + sample_entry_bits_offset(vocab));
    for (int64_t w = threadIdx.x; w < (vocab + 31) / 32; w += kThreads) bits[w] = 0u;
    __syncthreads();
    for (int j = first + int(threadIdx.x); j < last; j += kThreads) {
      const int id = p.token_ids[j];
      values[id] = processed_entry(p, r, j, to_float(src.row[id]), src.mask);
      atomicOr(&bits[id >> 5], 1u << (id & 31));
    }
    __syncthreads();  // the block's global writes are visible to the block after the barrier
    src.entry_values = values;
    src.entry_bits = bits;
  }

  // Pass 1: argmax (ties to the lowest id, NaN = -inf) and +inf count.
  float best = -INFINITY;
  int best_i = 0x7fffffff;
  int posinf = 0;
  visit<T, kVec>(src, vocab, [&](int64_t i, float x, bool valid) {
    if (!valid) return;
    if (x > best || (x == best && int(i) < best_i)) {
      best = x;
      best_i = int(i);
    }
    posinf += x == INFINITY;
  });
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, off);
    const int oi = __shfl_xor_sync(0xffffffffu, best_i, off);
    if (ob > best || (ob == best && oi < best_i)) {
      best = ob;
      best_i = oi;
    }
    posinf += __shfl_xor_sync(0xffffffffu, posinf, off);
  }
  if (lane == 0) {
    sh.best_value[warp] = best;
    sh.best_index[warp] = best_i;
    sh.posinf[warp] = posinf;
  }
  __syncthreads();
  best = sh.best_value[0];
  best_i = sh.best_index[0];
  posinf = 0;
  for (int w = 0; w < kWarps; ++w) {
    const float b = sh.best_value[w];
    const int i = sh.best_index[w];
    if (b > best || (b == best && i < best_i)) {
      best = b;
      best_i = i;
    }
    posinf += sh.posinf[w];
  }
  const bool outputs = p.logprobs || p.top_n > 0;

  const float temperature = p.temperature[r];
  const bool posinf_row = posinf > 0;
  const float s_max = posinf_row ? 0.f : __fdiv_rn(best, temperature);
  // Greedy: asked for, nothing finite to sample from, or s overflowed (reference: total NaN).
  if (!(temperature > 0.f) || best == -INFINITY || s_max == INFINITY) {
    if (threadIdx.x == 0) p.out[r] = best_i;
    if (outputs) {  // greedy rows: log softmax at temperature 1 (s overflowing: -inf)
      const bool t1 = !(temperature > 0.f);
      const RowMath unit{t1 ? 1.f : temperature, t1 ? (posinf_row ? 0.f : best) : s_max,
                         posinf_row};
      const bool finite = best != -INFINITY && unit.s_max != INFINITY;
      write_outputs<T, kVec>(src, vocab, unit, finite, best_i, p, r, sh, top);
    }
    return;
  }
  RowMath rm{temperature, s_max, posinf_row};
  const float min_p = p.min_p ? p.min_p[r] : 0.f;
  if (min_p > 0.f) rm.s_min = s_max + logf(min_p);
  const int top_k = p.top_k[r];
  const float top_p = p.top_p[r];
  const bool use_p = top_p < 1.f;  // NaN: off
  const unsigned k = top_k > 0 && top_k < vocab ? unsigned(top_k) : unsigned(vocab);

  unsigned tau = 0;  // top-k (masses only needed for Z without top-p), then top-p
  if (k < unsigned(vocab) || !use_p)
    tau = descend<T, kVec>(src, vocab, rm, sh, false, !use_p, 0, k, 0.f).threshold;
  if (use_p)
    tau = max(tau, descend<T, kVec>(src, vocab, rm, sh, true, true, tau, 0, top_p).threshold);
  const unsigned long long z = sh.kept_mass;  // mass of {key >= tau}
  const unsigned long long target =
      __umul64hi(z, (unsigned long long)philox_word0(p.seeds[r], p.offsets[r]) << 32);

  // Draw: the first id whose cumulative kept mass exceeds target (spans in vocabulary order,
  // one block scan per chunk; the thread whose range holds target walks its span).
  if (threadIdx.x == 0) sh.found = best_i;  // unreachable fallback: the argmax
  __syncthreads();
  constexpr int kOwn = kUnroll * kVec;
  constexpr int64_t kChunk = int64_t(kThreads) * kOwn;
  auto kept_mass = [&](float x) {
    float s;
    return rm.key(x, s) >= tau ? rm.mass(s) : 0ull;
  };
  unsigned long long running = 0;
  for (int64_t base = 0; base < vocab; base += kChunk) {
    const int64_t i0 = base + int64_t(threadIdx.x) * kOwn;
    float x[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u * kVec < vocab) src.load(i0 + u * kVec, x[u]);
    }
    unsigned long long local = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u * kVec < vocab) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) local += kept_mass(x[u][e]);
      }
    }
    unsigned long long total;
    const unsigned long long before = running + block_exclusive_scan(local, total, sh);
    if (target >= before && target < before + local) {
      unsigned long long acc = before;
      for (int64_t i = i0; i < i0 + kOwn && i < vocab; ++i) {
        const unsigned long long m = kept_mass(src.at(i));
        acc += m;
        if (acc > target && acc - m <= target) sh.found = int(i);
      }
    }
    running += total;
    if (running > target) break;  // uniform: every thread has the same running
  }
  __syncthreads();
  const int token = sh.found;
  if (threadIdx.x == 0) p.out[r] = token;
  if (outputs) {  // from the distribution before min-p / top-k / top-p
    rm.s_min = -INFINITY;
    write_outputs<T, kVec>(src, vocab, rm, true, token, p, r, sh, top);
  }
}

template <typename T>
void launch(const SampleParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable =
      aligned16(p.logits) && p.vocab % kVec == 0 && p.logits_stride % kVec == 0;
  const dim3 grid(static_cast<unsigned>(p.rows));
  if (vectorizable) {
    sample_fused_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(p);
  } else {
    sample_fused_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p);
  }
  PK_CHECK_LAUNCH("sample_fused_kernel");
}

}  // namespace

void sample_fused(const SampleParams& p, cudaStream_t stream) {
  dispatch_float(p.dtype, [&](auto tag) { launch<decltype(tag)>(p, stream); });
}

}  // namespace pagedkern
