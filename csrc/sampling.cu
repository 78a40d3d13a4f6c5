/*
 * sample: fused temperature / top-k / top-p sampling with greedy at temperature <= 0, one token id
 * per logits row, per-row parameters, no sort of the vocabulary. Semantics (kept set, ties, NaN,
 * +inf rows, overflow, fallbacks) are those of python/pagedkern/reference/sampling.py.
 *
 * Versions:
 *  v1 sample_kernel<T, kVec>: one CTA of 512 threads per row (1024 capped registers at 64 and
 *     spilled, per ptxas); the row is streamed from global memory (mostly L2) once per pass,
 *     kVec elements per 16-byte load, 4 loads in flight per thread.
 *     Pass 1: argmax (first index, NaN = -inf) and the count of +inf entries. Greedy rows
 *       (temperature <= 0, no finite logit, or logits / temperature overflowing) stop here.
 *     With s = logits / temperature (IEEE division, -0 -> +0; a row with +inf entries becomes 0
 *     there and -inf elsewhere), every later pass recomputes per element its 32-bit order key
 *     and, for elements still in the running, its mass e = expf(s - max s) in 40-bit fixed
 *     point (integer sums: exact, order-free, reproducible). The kept set is {key >= tau}: top-k
 *     (ties kept) and top-p (a token is kept iff the mass strictly above it is < p * Z_k, or is
 *     0) are both upper sets of the keys.
 *     Top-k (and, without filters, the total mass): radix select, 8 bits per pass from the top,
 *       256-bin shared-memory histograms of counts and masses; the bin holding the k-th largest
 *       key is refined until its lower bound is the threshold (at most 4 passes, fewer when a bin
 *       is taken whole).
 *     Top-p: the same descent over the top-k survivors with masses: the bin holding the last kept
 *       tie group is the lowest non-empty bin whose mass above is < p * Z_k (or 0); Z_k is the
 *       first histogram's total.
 *     Draw: u = philox4x32_10(counter = (offset, 0), key = seed) word 0; target = floor(u * Z);
 *       block-wide prefix sums over kept masses in vocabulary order, one per chunk of 512 x 64
 *       bytes, find the first id whose cumulative mass exceeds target (half a pass on average).
 *     Each row's draw depends only on its logits, parameters, seed and offset: independent of the
 *     batch. Exact w.r.t. the fixed-point masses (40 fractional bits: tokens with p < 2^-40 of the
 *     top token's are never drawn); the reference's fp32 cumulative sums can differ only when a
 *     top-p cut falls within ~1e-6 of a token's mass-above.
 *
 *  v2 logits processing, semantics of python/pagedkern/reference/logits_processing.py:
 *     process_kernel<T, kVec> (a stage before the passes above, same stream): one CTA of 512
 *       threads per row; thread t owns runs t, t + 512, ... of kVec elements (16-byte loads,
 *       16-byte fp32 stores): x = logits (NaN = -inf), -inf where the row's grammar /
 *       allowed-token bitmask (int32 words, 1 bit per token, L1/L2-resident: V / 8 bytes) has a
 *       0 bit, written to an fp32 workspace row; then, after a barrier, one thread per sparse
 *       entry (token id, count, bias) recomputes its token from the raw logit: repetition
 *       penalty (divide positive, multiply negative), frequency x count + presence, bias (-inf
 *       bans: bad words, EOS before min_tokens), mask. Host work is O(entries), never O(V).
 *     The sampling passes then run unchanged on the workspace (sample_kernel<float, 4>), with
 *       min-p as a lower cut on s (s < s_max + log min_p counts as -inf) and, when asked, one
 *       extra pass for log Z = log sum exp(s - s_max) over the distribution before min-p /
 *       top-k / top-p: logprob = s_token - s_max - log Z (temperature 1 for greedy rows).
 *     Why a workspace and not a per-element lookup of the sparse list in every pass: the list
 *       is unsorted and short, a lookup per element per pass would cost more than one extra
 *       streaming pass; the workspace row (4 V bytes, 512 KB at V = 128256) is written once and
 *       re-read by the passes mostly from L2 while the CTA's row is hot.
 *     Not in the kernel yet: the top-N logprobs (N <= 20), which ops.sample computes with the
 *       reference's torch ops when top_ids / top_logprobs are asked for.
 *
 * Traffic: (passes) x V x sizeof(T) per row from L2/HBM; greedy 1 pass, plain sampling ~2.5,
 * top-k or top-p ~3.5-5.5, both ~5-9.5. With processing: + V x (sizeof(T) + 4) for the stage
 * and the passes read 4-byte values (+1 pass for a logprob). Target: >= 5x faster than a
 * torch.sort-based top-p at B=128, V=128k; processing within 1.5x of plain sampling and well
 * ahead of the same chain of torch ops (bench/test_bench_sampling.py).
 */
#include "sampling_common.cuh"

namespace pagedkern {
namespace {

// Calls f(index, value) for every element; thread t owns the runs t, t + kThreads, ... (vocab is
// a multiple of kVec).
template <typename T, int kVec, typename F>
__device__ __forceinline__ void for_each(const T* row, int64_t vocab, F&& f) {
  constexpr int64_t kStep = int64_t(kThreads) * kVec;
  for (int64_t base = int64_t(threadIdx.x) * kVec; base < vocab; base += kStep * kUnroll) {
    Run<T, kVec> runs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kStep < vocab) runs[u].load(row + base + u * kStep);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kStep;
      if (i < vocab) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) f(i + e, to_float(runs[u].v[e]));
      }
    }
  }
}

// Radix descent over the keys >= floor_key; returns the threshold (kept: key >= it) and, with
// masses (always in mass mode), leaves the kept mass in sh.kept_mass.
template <typename T, int kVec>
__device__ __forceinline__ unsigned descend(const T* row, int64_t vocab, const RowMath& rm,
                                            Shared& sh, bool mass_mode, bool with_mass,
                                            unsigned floor_key, unsigned k, float top_p) {
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.bits = 0;
    sh.above_count = 0;
    sh.above_mass = 0;
    sh.done = 0;
  }
  for (;;) {
    clear_bins(sh);
    __syncthreads();
    const int bits = sh.bits;
    const unsigned prefix = sh.prefix;
    for_each<T, kVec>(row, vocab, [&](int64_t, float x) {
      float s;
      const unsigned key = rm.key(x, s);
      if (key < floor_key || (bits > 0 && (key ^ prefix) >> (32 - bits))) return;
      const unsigned bin = (key >> (24 - bits)) & (kBins - 1);
      atomicAdd(&sh.count[bin], 1u);
      const unsigned long long mass = with_mass ? rm.mass(s) : 0ull;
      if (mass) {  // (hi, lo) += mass, the carry of the low word going to the high word
        const unsigned lo = unsigned(mass);
        const unsigned old = atomicAdd(&sh.mass_lo[bin], lo);
        atomicAdd(&sh.mass_hi[bin], unsigned(mass >> 32) + (old + lo < old ? 1u : 0u));
      }
    });
    __syncthreads();
    if (threadIdx.x < 32) select_bin(sh, mass_mode, k, top_p);
    __syncthreads();
    const bool done = sh.done;
    const unsigned threshold = sh.prefix;
    __syncthreads();  // everyone has read the state before it changes
    if (done) return threshold;
  }
}

// log softmax(s)[token] under rm (its s_min off): one more pass for sum exp(s - s_max). Called
// by every thread of the block; thread 0 writes it.
template <typename T, int kVec>
__device__ __forceinline__ void write_logprob(const T* row, int64_t vocab, const RowMath& rm,
                                              bool finite_row, int token, Shared& sh,
                                              float* out) {
  float z = 0.f;
  if (finite_row) {
    for_each<T, kVec>(row, vocab, [&](int64_t, float x) {
      float s;
      rm.key(x, s);
      z += s == -INFINITY ? 0.f : expf(s - rm.s_max);
    });
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) z += __shfl_xor_sync(0xffffffffu, z, off);
  if (threadIdx.x % 32 == 0) sh.best_value[threadIdx.x / 32] = z;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += sh.best_value[w];
    float s;
    rm.key(to_float(row[token]), s);
    *out = finite_row && s != -INFINITY ? s - rm.s_max - logf(total) : -INFINITY;
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, 1) sample_kernel(const SampleParams p) {
  __shared__ Shared sh;
  const int64_t r = blockIdx.x;
  const T* row = static_cast<const T*>(p.logits) + r * p.logits_stride;
  const int64_t vocab = p.vocab;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  // Pass 1: argmax (ties to the lowest id, NaN = -inf) and +inf count.
  float best = -INFINITY;
  int best_i = 0x7fffffff;
  int posinf = 0;
  for_each<T, kVec>(row, vocab, [&](int64_t i, float x) {
    if (x != x) x = -INFINITY;
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

  const float temperature = p.temperature[r];
  const bool posinf_row = posinf > 0;
  const float s_max = posinf_row ? 0.f : __fdiv_rn(best, temperature);
  // Greedy: asked for, nothing finite to sample from, or s overflowed (reference: total NaN).
  if (!(temperature > 0.f) || best == -INFINITY || s_max == INFINITY) {
    if (threadIdx.x == 0) p.out[r] = best_i;
    if (p.logprobs) {  // greedy rows: log softmax at temperature 1 (s overflowing: -inf)
      const bool t1 = !(temperature > 0.f);
      const RowMath unit{t1 ? 1.f : temperature, t1 ? (posinf_row ? 0.f : best) : s_max,
                         posinf_row};
      const bool finite = best != -INFINITY && unit.s_max != INFINITY;
      write_logprob<T, kVec>(row, vocab, unit, finite, best_i, sh, p.logprobs + r);
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
    tau = descend<T, kVec>(row, vocab, rm, sh, false, !use_p, 0, k, 0.f);
  if (use_p) tau = max(tau, descend<T, kVec>(row, vocab, rm, sh, true, true, tau, 0, top_p));
  const unsigned long long z = sh.kept_mass;  // mass of {key >= tau}
  const unsigned long long target =
      __umul64hi(z, (unsigned long long)philox_word0(p.seeds[r], p.offsets[r]) << 32);

  // Draw: the first id whose cumulative kept mass exceeds target. Per chunk, thread t owns the
  // contiguous span [t * kSpan, (t + 1) * kSpan) (vocabulary order = thread order, 4 loads in
  // flight); one block-wide scan per chunk; the thread whose range holds target walks its span.
  if (threadIdx.x == 0) sh.found = best_i;  // unreachable fallback: the argmax
  __syncthreads();
  constexpr int kSpan = kUnroll * kVec;
  constexpr int64_t kChunk = int64_t(kThreads) * kSpan;
  unsigned long long running = 0;
  for (int64_t base = 0; base < vocab; base += kChunk) {
    const int64_t i0 = base + int64_t(threadIdx.x) * kSpan;
    Run<T, kVec> runs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u * kVec < vocab) runs[u].load(row + i0 + u * kVec);
    }
    auto kept_mass = [&](float x) {
      float s;
      return rm.key(x, s) >= tau ? rm.mass(s) : 0ull;
    };
    unsigned long long local = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u * kVec < vocab) {  // (a run is either wholly inside the row or outside)
#pragma unroll
        for (int e = 0; e < kVec; ++e) local += kept_mass(to_float(runs[u].v[e]));
      }
    }
    unsigned long long total;
    const unsigned long long before = running + block_exclusive_scan(local, total, sh);
    if (target >= before && target < before + local) {  // one thread: walk the span again
      unsigned long long acc = before;
      for (int64_t i = i0; i < i0 + kSpan && i < vocab; ++i) {
        const unsigned long long m = kept_mass(to_float(row[i]));
        acc += m;
        if (acc > target && acc - m <= target) sh.found = int(i);
      }
    }
    running += total;
    if (running > target) break;  // uniform: every thread has the same running
  }
  __syncthreads();
  if (threadIdx.x == 0) p.out[r] = sh.found;
  if (p.logprobs) {  // from the distribution before min-p / top-k / top-p
    const int token = sh.found;
    rm.s_min = -INFINITY;
    write_logprob<T, kVec>(row, vocab, rm, true, token, sh, p.logprobs + r);
  }
}

// Processing stage (before the sampling passes): row r of the workspace = the processed logits
// (NaN = -inf, bitmask applied; 16-byte loads and stores), then the row's sparse entries are
// recomputed from the raw logits with penalties and bias (one thread per entry; ids distinct).
// (min blocks 1: ptxas otherwise held the 16-bit rows' loop to 40 registers, spilling)
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, 1) process_kernel(const SampleParams p) {
  const int64_t r = blockIdx.x;
  const T* row = static_cast<const T*>(p.logits) + r * p.logits_stride;
  float* out = p.workspace + r * p.workspace_stride;
  const int* mask = row_mask(p, r);
  for (int64_t i = int64_t(threadIdx.x) * kVec; i < p.vocab; i += int64_t(kThreads) * kVec) {
    Run<T, kVec> run;
    run.load(row + i);
    float v[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float x = to_float(run.v[e]);
      v[e] = x != x || !allowed(mask, i + e) ? -INFINITY : x;
    }
    if constexpr (kVec % 4 == 0) {
#pragma unroll
      for (int e = 0; e < kVec; e += 4)
        *reinterpret_cast<float4*>(out + i + e) = make_float4(v[e], v[e + 1], v[e + 2], v[e + 3]);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) out[i + e] = v[e];
    }
  }
  __syncthreads();  // the dense writes land before the sparse entries overwrite theirs
  const EntryRange entries = row_entries(p, r);
  if (entries.last == entries.first) return;
  const float presence = p.presence_penalty[r], frequency = p.frequency_penalty[r];
  const float repetition = p.repetition_penalty[r];
  for (int j = entries.first + threadIdx.x; j < entries.last; j += kThreads) {
    const int id = p.token_ids[j];
    if (id < 0 || id >= p.vocab) continue;  // a bad id never reads or writes outside its row
    const int count = p.token_counts[j];
    float x = to_float(row[id]);
    if (x != x) x = -INFINITY;
    if (count >= 0) {  // IEEE steps in the reference's order (no contraction into FMAs)
      x = x > 0.f ? __fdiv_rn(x, repetition) : __fmul_rn(x, repetition);
      const float penalty = __fadd_rn(__fmul_rn(frequency, float(count)),
                                      count > 0 ? presence : __fmul_rn(presence, 0.f));
      x = __fsub_rn(x, penalty);
    }
    x = __fadd_rn(x, p.token_bias[j]);
    out[id] = x != x || !allowed(mask, id) ? -INFINITY : x;
  }
}
template <typename T>
void launch(const SampleParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable =
      aligned16(p.logits) && p.vocab % kVec == 0 && p.logits_stride % kVec == 0;
  const dim3 grid(static_cast<unsigned>(p.rows));
  if (vectorizable) {
    sample_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(p);
  } else {
    sample_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p);
  }
  PK_CHECK_LAUNCH("sample_kernel");
}

// With processing: the processing stage writes the workspace, the sampling passes read it.
template <typename T>
void launch_processed(const SampleParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable = aligned16(p.logits) && aligned16(p.workspace) &&
                            p.vocab % kVec == 0 && p.logits_stride % kVec == 0 &&
                            p.workspace_stride % 4 == 0;
  const dim3 grid(static_cast<unsigned>(p.rows));
  if (vectorizable) {
    process_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(p);
  } else {
    process_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p);
  }
  PK_CHECK_LAUNCH("process_kernel");
  SampleParams q = p;
  q.logits = p.workspace;
  q.logits_stride = p.workspace_stride;
  q.dtype = DType::kFloat32;
  launch<float>(q, stream);
}

}  // namespace

void sample(const SampleParams& p, cudaStream_t stream) {
  require(p.vocab > 0 && p.vocab < (int64_t(1) << 23), "sample: vocab must be in [1, 2^23)");
  require(p.rows >= 0 && p.rows <= 0x7fffffff, "sample: rows out of range");
  require(p.variant >= 0 && p.variant <= 2, "sample: variant must be 0 (v3), 1 (v2) or 2 (v4)");
  require(p.token_offsets == nullptr ||
              (p.token_ids && p.token_counts && p.token_bias && p.presence_penalty &&
               p.frequency_penalty && p.repetition_penalty),
          "sample: sparse entries need ids, counts, biases and the three penalties");
  require(p.bitmask_rows == nullptr || (p.bitmask && p.bitmask_words == (p.vocab + 31) / 32),
          "sample: bitmask_rows needs a bitmask of ceil(vocab / 32) words per row");
  require(p.top_n >= 0 && p.top_n <= 20 && p.top_n <= p.vocab &&
              (p.top_n == 0 || (p.top_ids && p.top_logprobs)),
          "sample: top_n must be in [0, min(20, vocab)], with top_ids and top_logprobs");
  require(p.slices >= 1 && p.slices <= 4096, "sample: slices must be in [1, 4096]");
  require(p.slices == 1 || p.variant == 2, "sample: slices > 1 needs variant 2 (v4)");
  if (p.rows == 0) return;
  if (p.variant == 2 && p.slices > 1) {
    require(p.rows <= 65535, "sample: v4 with slices > 1 takes at most 65535 rows");
    require(p.logprobs == nullptr && p.top_n == 0,
            "sample: v4 with slices > 1 writes no logprobs (run it with slices = 1)");
    require(p.split_state != nullptr &&
                p.split_state_stride >= sample_split_state_words(p.slices),
            "sample: v4 with slices > 1 needs split_state of [rows, >= 1040 + 3 x slices] words");
  }
  if (p.variant == 0 || p.variant == 2) {
    require(p.token_offsets == nullptr ||
                (p.workspace != nullptr &&
                 p.workspace_stride >= sample_entry_bits_offset(p.vocab) + (p.vocab + 31) / 32),
            "sample: sparse entries need a workspace of [rows, >= vocab + bitmask words] floats");
    if (p.slices > 1) {
      sample_split(p, stream);
    } else {
      sample_fused(p, stream);
    }
    return;
  }
  require(p.top_n == 0, "sample: variant 1 (v2) writes no top-N logprobs");
  const bool processing = p.token_offsets != nullptr || p.bitmask_rows != nullptr;
  require(!processing || (p.workspace != nullptr && p.workspace_stride >= p.vocab),
          "sample: logits processing needs a workspace of [rows, >= vocab] floats");
  if (processing) {
    dispatch_float(p.dtype, [&](auto tag) { launch_processed<decltype(tag)>(p, stream); });
  } else {
    dispatch_float(p.dtype, [&](auto tag) { launch<decltype(tag)>(p, stream); });
  }
}

}  // namespace pagedkern
