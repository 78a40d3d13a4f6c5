/*
 * sample, variant v3 (PAGEDKERN_KERNELS=sample:v3): logits processing, sampling and
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
 *   CTA); an id outside [0, V) is skipped, so bad input never writes outside its row. Every
 *   pass then reads per 16-byte run of logits one bitmap word and one grammar-mask
 *   word (both L1/L2-resident, V / 8 bytes) and takes the entry value where the bit is set:
 *   traffic O(nnz + V / 8) bytes instead of v2's extra V x (sizeof(T) + 4) pass and fp32 re-reads.
 * Histograms: the lanes of a warp that hit the same bin are grouped with
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
 * Several CTAs per row at small batch: v4 (sampling_split.cu) runs these passes on slices.
 */
#include "sampling_passes.cuh"

namespace pagedkern {
namespace {

constexpr int kMaxTop = 20;

struct Descent {
  unsigned threshold;   // keys >= threshold: the selected set (with the bin below)
  int bits;             // digits fixed: the last bin is [threshold, threshold + 2^(32 - bits))
  unsigned above;       // keys at or above the end of that bin
};

// Radix descent as sampling.cu's, with warp-aggregated histogram updates (histogram_pass).
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
  for (;;) {
    histogram_pass<T, kVec>(src, 0, vocab, rm, sh, with_mass, floor_key);
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
  Source<T, kVec> src{static_cast<const T*>(p.logits) + r * p.logits_stride, row_mask(p, r)};

  // Processing: the sparse entries' values and bits (O(nnz + V / 32) work, see the top).
  const auto [first, last] = row_entries(p, r);
  if (last > first) {  // block-uniform
    float* values = p.workspace + r * p.workspace_stride;
    unsigned* bits = reinterpret_cast<unsigned*>(values + sample_entry_bits_offset(vocab));
    for (int64_t w = threadIdx.x; w < (vocab + 31) / 32; w += kThreads) bits[w] = 0u;
    __syncthreads();
    for (int j = first + int(threadIdx.x); j < last; j += kThreads) {
      const int id = p.token_ids[j];
      if (id < 0 || id >= vocab) continue;  // a bad id never reads or writes outside its row
      values[id] = processed_entry(p, r, j, to_float(src.row[id]), src.mask);
      atomicOr(&bits[id >> 5], 1u << (id & 31));
    }
    __syncthreads();  // the block's global writes are visible to the block after the barrier
    src.entry_values = values;
    src.entry_bits = bits;
  }

  // Pass 1: argmax (ties to the lowest id, NaN = -inf) and +inf count.
  const Argmax am = block_argmax<T, kVec>(src, 0, vocab, sh);
  const float best = am.best;
  const int best_i = am.index;
  const bool outputs = p.logprobs || p.top_n > 0;

  RowPlan plan = plan_row(p, r, am);
  RowMath& rm = plan.rm;
  // Greedy: asked for, nothing finite to sample from, or s overflowed (reference: total NaN).
  if (plan.greedy) {
    if (threadIdx.x == 0) p.out[r] = best_i;
    if (outputs) {  // greedy rows: log softmax at temperature 1 (s overflowing: -inf)
      const float temperature = rm.temperature;
      const bool posinf_row = rm.posinf_row;
      const bool t1 = !(temperature > 0.f);
      const RowMath unit{t1 ? 1.f : temperature, t1 ? (posinf_row ? 0.f : best) : rm.s_max,
                         posinf_row};
      const bool finite = best != -INFINITY && unit.s_max != INFINITY;
      write_outputs<T, kVec>(src, vocab, unit, finite, best_i, p, r, sh, top);
    }
    return;
  }
  const unsigned k = plan.k;
  const bool use_p = plan.use_p;
  const float top_p = plan.top_p;
  unsigned tau = 0;  // top-k (masses only needed for Z without top-p), then top-p
  if (k < unsigned(vocab) || !use_p)
    tau = descend<T, kVec>(src, vocab, rm, sh, false, !use_p, 0, k, 0.f).threshold;
  if (use_p)
    tau = max(tau, descend<T, kVec>(src, vocab, rm, sh, true, true, tau, 0, top_p).threshold);
  const unsigned long long z = sh.kept_mass;  // mass of {key >= tau}
  const unsigned long long target =
      __umul64hi(z, (unsigned long long)philox_word0(p.seeds[r], p.offsets[r]) << 32);

  // Draw: the first id whose cumulative kept mass exceeds target (draw_in_range).
  if (threadIdx.x == 0) sh.found = best_i;  // unreachable fallback: the argmax
  __syncthreads();
  draw_in_range<T, kVec>(src, 0, vocab, rm, tau, target, 0, sh);
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
