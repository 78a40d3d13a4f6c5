/*
 * sample, variant v4 (PAGEDKERN_KERNELS=sample:v4): v3's passes (sampling_fused.cu,
 * the same functions of sampling_passes.cuh) with each row split over S CTAs when the batch is
 * too small to fill the GPU (at B <= 8 one CTA per row leaves <= 6% of the SMs busy).
 * ops/sampling.py picks S (split_slices: about SMs / B, each slice >= 512 x 16 bytes); S = 1, or
 * a call asking for logprobs / top-N, runs v3's kernel instead.
 *
 * Combining the slices: a global-memory merge, several kernels, no CTA ever waiting for another.
 *   Not a cluster with DSMEM: sm_90a only (sm_80 has none), at most 8 CTAs per cluster (16
 *   non-portable), and not emulated. Not one kernel spinning on an arrival counter: that needs
 *   every CTA of the grid resident at once (a cooperative launch), and the emulator runs blocks
 *   one after another. Instead each merge is done by the LAST CTA of the row to arrive
 *   (__threadfence + an atomic arrival counter, CUDA's threadFenceReduction pattern), and the
 *   next step is the next kernel on the stream: deadlock-free, graph-capturable, emulated.
 *
 * Mapping: grid (S, rows); CTA (s, r) of 512 threads owns the contiguous slice
 *   [s L, min(V, (s + 1) L)) of row r, L = sample_split_slice(V, S) (a multiple of 32: each word of
 *   the mask and entry bitmaps belongs to one slice); inside its slice, v3's thread mapping.
 * Kernels, one stream, in order (2 + kDescentSteps = 10 launches whatever the rows ask for):
 *   1. sample_split_argmax_kernel: the slice's sparse entries (values + bitmap words of its own
 *      ids: no other CTA reads them before a kernel boundary), then the slice's argmax and +inf
 *      count -> the row's partials. CTA 0 zeroes the row's control words and histograms.
 *   2. sample_split_descend_kernel x 8 (top-k <= 4 digits, then top-p <= 4): every CTA merges the
 *      S partials (S words: the row's plan, the same in every CTA) and reads the row's descent
 *      state; while a descent runs it adds its slice's histogram of the current digit (v3's
 *      warp-aggregated shared histogram) to the row's global one, non-empty bins only, with
 *      64-bit integer atomics; the last CTA picks the bin (select_bin, v3's) and writes the next
 *      state (double-buffered histograms: the last CTA zeroes the one it read, for step + 2). A
 *      row whose descent is over (or greedy) returns at once.
 *   3. sample_split_draw_kernel: each CTA's slice kept mass; the last CTA takes the prefix over
 *      the slices in slice order, finds the slice holding target and walks it (draw_in_range).
 * Exactness: every cross-CTA sum is over 64-bit integers (fixed-point masses, counts) and the
 *   argmax merge is a max with ties to the lowest id: the histograms, Z, target and cumulative
 *   masses are bit for bit v3's, so the drawn id is v3's (the reference's), draw for draw.
 * Processing: penalties, bias and bans (sparse entries), bitmasks and min-p as v3. The logprob
 *   outputs are not here: ops.sample gives S = 1 (v3's kernel) to a call that asks for them.
 * Traffic and target: v3's passes (1 + 1-4 + 1-4 + ~1.5 over V x sizeof(T)), spread over
 *   B x S SMs instead of B (one wave: B x S <= SMs); per descent step per CTA <= 512 global
 *   atomics and, for the last CTA, a 4 KB histogram read. At B = 1, V = 128k fp32 (S = 62,
 *   8 KB per CTA) a pass is latency-bound: the target is launch + a few L2/HBM latencies per
 *   kernel, ~25-40 us per call against v3's ~100 us (>= 3x at B <= 8). Greedy rows still pay
 *   the 10 launches (ops.sample runs v3 when the host knows the batch is greedy). Static: grid
 *   (S, B), 512 threads, __launch_bounds__(512, 1) as v3, 48-104 registers, 3.4 KB (sm_80) /
 *   4.5 KB (sm_90a) shared, no spills. Not yet verified on a GPU: v3 and v2 stay selectable.
 */
#include "sampling_passes.cuh"

namespace pagedkern {
namespace {

constexpr int kDescentSteps = 8;  // two descents of at most 32 / 8 digits each
// Row state layout (64-bit words), sample_split_state_words(S) per row.
enum : int {
  kArrivals,   // CTAs of the current kernel done with the row (reset by the last)
  kPhase,      // below
  kPrefix,     // descent state between steps: select_bin's fields of Shared
  kBits,
  kAboveCount,
  kAboveMass,
  kPz,         // double bits
  kTau,        // top-k threshold (the top-p descent's floor), then the kept set's
  kKeptMass,   // Z: mass of {key >= tau}
  kControlWords = 16,
  kHistograms = kControlWords,      // [2][kBins] counts, then [2][kBins] masses
  kPartials = kHistograms + 4 * kBins,  // [S] best value bits << 32 | index, [S] +inf counts,
                                        // [S] slice kept masses
};
enum : int { kPhaseStart, kPhaseTopK, kPhaseTopP, kPhaseReady };

struct Slice {
  int64_t begin, end;
};
__device__ __forceinline__ Slice slice_of(const SampleParams& p, int64_t slice_len) {
  const int64_t begin = int64_t(blockIdx.x) * slice_len;
  return {begin, min(p.vocab, begin + slice_len)};
}

// Row r's logits with its mask and, when it has sparse entries, the entries' values and bits
// (written by sample_split_argmax_kernel).
template <typename T, int kVec>
__device__ __forceinline__ Source<T, kVec> row_source(const SampleParams& p, int64_t r) {
  Source<T, kVec> src{static_cast<const T*>(p.logits) + r * p.logits_stride, row_mask(p, r)};
  const EntryRange entries = row_entries(p, r);
  if (entries.last > entries.first) {
    float* values = p.workspace + r * p.workspace_stride;
    src.entry_values = values;
    src.entry_bits = reinterpret_cast<unsigned*>(values + sample_entry_bits_offset(p.vocab));
  }
  return src;
}

// The row's pass-1 result merged from the S partials; the same in every CTA and thread.
__device__ __forceinline__ Argmax merged_argmax(const unsigned long long* st, Shared& sh) {
  const int slices = int(gridDim.x);
  if (threadIdx.x < 32) {
    Argmax a;
    for (int s = threadIdx.x; s < slices; s += 32) {
      const unsigned long long w = st[kPartials + s];
      a.add(__uint_as_float(unsigned(w >> 32)), int(unsigned(w)),
            int(st[kPartials + slices + s]));
    }
    a.warp_reduce();
    if (threadIdx.x == 0) {
      sh.best_value[0] = a.best;
      sh.best_index[0] = a.index;
      sh.posinf[0] = a.posinf;
    }
  }
  __syncthreads();
  Argmax merged;
  merged.add(sh.best_value[0], sh.best_index[0], sh.posinf[0]);
  __syncthreads();
  return merged;
}

// True (in every thread) in the last CTA of the row to get here, which then sees the global
// writes the others made before; it resets the counter for the next kernel.
__device__ __forceinline__ bool arrive_last(unsigned long long* st, int& flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) flag = atomicAdd(&st[kArrivals], 1ull) == gridDim.x - 1;
  __syncthreads();
  const bool last = flag;
  if (last) {
    __threadfence();
    if (threadIdx.x == 0) st[kArrivals] = 0;
  }
  return last;
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, 1)
    sample_split_argmax_kernel(const SampleParams p, int64_t slice_len) {
  __shared__ Shared sh;
  const int64_t r = blockIdx.y;
  const Slice slice = slice_of(p, slice_len);
  unsigned long long* st = p.split_state + r * p.split_state_stride;
  if (blockIdx.x == 0) {
    for (int w = threadIdx.x; w < kPartials; w += kThreads) st[w] = 0ull;
  }
  Source<T, kVec> src = row_source<T, kVec>(p, r);
  if (src.entry_bits) {  // block-uniform: this slice's entries (v3's processing, per slice)
    unsigned* bits = const_cast<unsigned*>(src.entry_bits);
    float* values = const_cast<float*>(src.entry_values);
    for (int64_t w = slice.begin / 32 + threadIdx.x; w < (slice.end + 31) / 32; w += kThreads)
      bits[w] = 0u;
    __syncthreads();
    const EntryRange entries = row_entries(p, r);
    for (int j = entries.first + int(threadIdx.x); j < entries.last; j += kThreads) {
      const int id = p.token_ids[j];
      if (id < slice.begin || id >= slice.end) continue;
      values[id] = processed_entry(p, r, j, to_float(src.row[id]), src.mask);
      atomicOr(&bits[id >> 5], 1u << (id & 31));
    }
    __syncthreads();  // the block's global writes are visible to the block after the barrier
  }
  const Argmax a = block_argmax<T, kVec>(src, slice.begin, slice.end, sh);
  if (threadIdx.x == 0) {
    st[kPartials + blockIdx.x] =
        static_cast<unsigned long long>(__float_as_uint(a.best)) << 32 | unsigned(a.index);
    st[kPartials + gridDim.x + blockIdx.x] = unsigned(a.posinf);
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, 1)
    sample_split_descend_kernel(const SampleParams p, int64_t slice_len, int step) {
  __shared__ Shared sh;
  __shared__ int last;
  const int64_t r = blockIdx.y;
  unsigned long long* st = p.split_state + r * p.split_state_stride;
  const RowPlan plan = plan_row(p, r, merged_argmax(st, sh));
  int phase = int(st[kPhase]);
  if (plan.greedy || phase == kPhaseReady) return;  // block-uniform
  if (phase == kPhaseStart)  // the state words are zero: a descent from the top
    phase = plan.k < unsigned(p.vocab) || !plan.use_p ? kPhaseTopK : kPhaseTopP;
  const bool mass_mode = phase == kPhaseTopP;
  const bool with_mass = mass_mode || !plan.use_p;  // masses only needed for Z without top-p
  const unsigned floor_key = mass_mode ? unsigned(st[kTau]) : 0u;
  if (threadIdx.x == 0) {  // read by histogram_pass after its first barrier
    sh.prefix = unsigned(st[kPrefix]);
    sh.bits = int(st[kBits]);
  }
  const Slice slice = slice_of(p, slice_len);
  histogram_pass<T, kVec>(row_source<T, kVec>(p, r), slice.begin, slice.end, plan.rm, sh,
                          with_mass, floor_key);
  unsigned long long* counts = st + kHistograms + (step & 1) * kBins;
  unsigned long long* masses = st + kHistograms + (2 + (step & 1)) * kBins;
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    const unsigned long long m =
        static_cast<unsigned long long>(sh.mass_hi[b]) << 32 | sh.mass_lo[b];
    if (sh.count[b]) atomicAdd(&counts[b], static_cast<unsigned long long>(sh.count[b]));
    if (m) atomicAdd(&masses[b], m);
  }
  if (!arrive_last(st, last)) return;

  // The last CTA: the row's histogram -> v3's bin choice -> the next step's state.
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    const unsigned long long m = __ldcg(masses + b);
    sh.count[b] = unsigned(__ldcg(counts + b));
    sh.mass_lo[b] = unsigned(m);
    sh.mass_hi[b] = unsigned(m >> 32);
    counts[b] = 0ull;  // for step + 2
    masses[b] = 0ull;
  }
  if (threadIdx.x == 0) {
    sh.above_count = unsigned(st[kAboveCount]);
    sh.above_mass = st[kAboveMass];
    sh.pz = __longlong_as_double((long long)st[kPz]);
    sh.kept_mass = st[kKeptMass];  // as v3's shared state between digits
    sh.done = 0;
  }
  __syncthreads();
  if (threadIdx.x < 32) select_bin(sh, mass_mode, plan.k, plan.top_p);
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (!sh.done) {
    st[kPhase] = unsigned(phase);
    st[kPrefix] = sh.prefix;
    st[kBits] = unsigned(sh.bits);
    st[kAboveCount] = sh.above_count;
    st[kAboveMass] = sh.above_mass;
    st[kPz] = (unsigned long long)__double_as_longlong(sh.pz);
    st[kKeptMass] = sh.kept_mass;
    return;
  }
  const unsigned threshold = sh.prefix;
  const bool then_top_p = !mass_mode && plan.use_p;
  st[kPhase] = unsigned(then_top_p ? kPhaseTopP : kPhaseReady);
  st[kTau] = mass_mode ? max(floor_key, threshold) : threshold;
  st[kKeptMass] = sh.kept_mass;
  st[kPrefix] = 0ull;  // a fresh descent (top-p) starts from the top
  st[kBits] = 0ull;
  st[kAboveCount] = 0ull;
  st[kAboveMass] = 0ull;
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, 1)
    sample_split_draw_kernel(const SampleParams p, int64_t slice_len) {
  __shared__ Shared sh;
  __shared__ int last;
  __shared__ int chosen;
  __shared__ unsigned long long before_chosen;
  const int64_t r = blockIdx.y;
  unsigned long long* st = p.split_state + r * p.split_state_stride;
  const Argmax am = merged_argmax(st, sh);
  const RowPlan plan = plan_row(p, r, am);
  if (plan.greedy || st[kPhase] != kPhaseReady) {  // (not ready: cannot happen) the argmax
    if (blockIdx.x == 0 && threadIdx.x == 0) p.out[r] = am.index;
    return;
  }
  const unsigned tau = unsigned(st[kTau]);
  const unsigned long long target = __umul64hi(
      st[kKeptMass], (unsigned long long)philox_word0(p.seeds[r], p.offsets[r]) << 32);
  const Source<T, kVec> src = row_source<T, kVec>(p, r);
  const Slice slice = slice_of(p, slice_len);
  unsigned long long local = 0;
  visit<T, kVec>(src, slice.begin, slice.end, [&](int64_t, float x, bool valid) {
    if (valid) local += kept_mass(plan.rm, tau, x);
  });
  unsigned long long total;
  block_exclusive_scan(local, total, sh);
  unsigned long long* slice_mass = st + kPartials + 2 * gridDim.x;
  if (threadIdx.x == 0) slice_mass[blockIdx.x] = total;
  if (!arrive_last(st, last)) return;

  // The last CTA: the slice holding target (prefix in slice order), walked as v3 walks a row.
  if (threadIdx.x == 0) {
    unsigned long long before = 0;
    chosen = -1;
    for (int s = 0; s < int(gridDim.x); ++s) {
      const unsigned long long m = __ldcg(slice_mass + s);
      if (target < before + m) {
        chosen = s;
        break;
      }
      before += m;
    }
    before_chosen = before;
    sh.found = am.index;  // unreachable fallback: the argmax
  }
  __syncthreads();
  if (chosen >= 0) {  // block-uniform
    const int64_t begin = int64_t(chosen) * slice_len;
    draw_in_range<T, kVec>(src, begin, min(p.vocab, begin + slice_len), plan.rm, tau, target,
                           before_chosen, sh);
  }
  __syncthreads();
  if (threadIdx.x == 0) p.out[r] = sh.found;
}

template <typename T, int kVec>
void launch_split(const SampleParams& p, cudaStream_t stream) {
  const int64_t slice = sample_split_slice(p.vocab, p.slices);
  const dim3 grid(static_cast<unsigned>((p.vocab + slice - 1) / slice),
                  static_cast<unsigned>(p.rows));
  sample_split_argmax_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(p, slice);
  PK_CHECK_LAUNCH("sample_split_argmax_kernel");
  for (int step = 0; step < kDescentSteps; ++step) {
    sample_split_descend_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(p, slice, step);
    PK_CHECK_LAUNCH("sample_split_descend_kernel");
  }
  sample_split_draw_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(p, slice);
  PK_CHECK_LAUNCH("sample_split_draw_kernel");
}

template <typename T>
void launch(const SampleParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable =
      aligned16(p.logits) && p.vocab % kVec == 0 && p.logits_stride % kVec == 0;
  if (vectorizable) {
    launch_split<T, kVec>(p, stream);
  } else {
    launch_split<T, 1>(p, stream);
  }
}

}  // namespace

void sample_split(const SampleParams& p, cudaStream_t stream) {
  dispatch_float(p.dtype, [&](auto tag) { launch<decltype(tag)>(p, stream); });
}

}  // namespace pagedkern
