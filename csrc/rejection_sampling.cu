/*
 * rejection_sample: speculative verification (Leviathan et al. 2023; Chen et al. 2023). For each
 * request, accept its k proposals left to right with probability min(1, p(x) / q(x)), stop at the
 * first rejection, then draw the recovered token from norm(max(0, p - q)) (rejection) or the
 * bonus token from the target at position k (all accepted). Semantics, layout and Philox words:
 * python/pagedkern/reference/rejection_sampling.py.
 *
 * Mapping: rejection_sample_kernel<kVec>: one CTA of 512 threads per request.
 *   Verification: the k positions in order, every thread computing the same uniform decision
 *     (one Philox4x32-10 call and the two scalar loads p(x), q(x) per position, broadcast to the
 *     block), early exit at the first rejection; no barrier until the draw.
 *   Draw (once per request): inverse CDF over ids in vocabulary order, as csrc/sampling.cu draws.
 *     The vocabulary is cut into chunks of 512 x 16 ids. Pass 1 streams the row(s) once, fully
 *     coalesced (thread t reads 16-byte runs t, t + 512, ... of each chunk, 4 in flight per
 *     row), and adds each chunk's mass into a shared-memory total (one 64-bit atomic per warp
 *     per chunk, no barrier per chunk). Warp 0 then finds the chunk holding the target by a
 *     warp scan over the chunk totals. Pass 2 re-reads that one chunk only, in vocabulary order
 *     (thread t owns ids [16t, 16t + 16) of it), one block-wide exclusive scan, and the thread
 *     whose range holds the target walks its 16 ids in registers.
 * Precision: the acceptance test is the reference's float64 expression, u * q(x) < p(x) with u =
 *   word 1 / 2^32 (one IEEE double product and compare): identical decisions. The draw uses
 *   fixed-point masses m_i = floor(min(v_i, 1) * 2^F), F = 63 - ceil(log2 V) (46 at V = 128256),
 *   residual masses max(0, P_i - Q_i) of the fixed-point p and q; sums are 64-bit integers
 *   (exact, order-free: pass 1 and pass 2 agree, and a zero-mass id is never drawn). The id is
 *   the first whose cumulative mass exceeds floor(u0 * Z) (u0 = word 0 / 2^32, Z the total), the
 *   reference's rule on masses that differ from its float64 values by < 2^-F each, so the two
 *   draws differ only when u0 * Z falls within ~V * 2^-F (~2e-9 at V = 128256) of a cumulative
 *   boundary. A residual whose fixed-point mass is 0 falls back to p (the reference does so only
 *   at exactly 0); a row of mass 0 yields id V - 1, as the reference's searchsorted does.
 * Traffic per request: k * (4..8) bytes for the checks, then one pass over the row(s) the draw
 *   needs and one 32 KB chunk of each: V * 4 B (bonus, or a point-mass residual), 2 * V * 4 B
 *   (residual with draft probabilities), + 32-64 KB. Worst case ~2 V * 4 B + 64 KB (under the
 *   (k + 1) * V * 4 B of k + 1 full rows). ~100 registers (no spills under the 64 that two
 *   CTAs per SM would allow), so one CTA per SM: 4 16-byte loads in flight per thread and row,
 *   32-64 KB per SM. Memory bound: target >= 60% of the measured device-copy bandwidth at
 *   B >= 256; B = 1 is one CTA on one SM, latency bound (bench/test_bench_rejection_sampling.py).
 */
#include "device.cuh"
#include "index_check.cuh"
#include "philox.cuh"
#include "rejection_sampling.h"

namespace pagedkern {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kSpan = 16;                           // ids per thread per chunk
constexpr int64_t kChunk = int64_t(kThreads) * kSpan;  // 8192 ids
constexpr int64_t kMaxVocab = int64_t(1) << 23;
constexpr int kMaxChunks = int(kMaxVocab / kChunk);  // 1024: 8 KB of totals

struct Shared {
  unsigned long long chunk_mass[kMaxChunks];
  unsigned long long scan[kWarps];
  unsigned long long before;  // mass of the chunks before the target's
  unsigned long long target;
  int chunk;  // the target's chunk, -1: no mass
  int found;
};

// What one draw reads: target row p, draft row q (null: none), an id whose mass is 0 (the
// rejected point-mass proposal; -1: none), and the fixed-point scale 2^F.
struct DrawRows {
  const float* p;
  const float* q;
  int64_t excluded;
  float scale;

  __device__ __forceinline__ unsigned long long fixed(float v) const {  // NaN, <= 0: 0
    return v > 0.f ? (unsigned long long)(fminf(v, 1.f) * scale) : 0ull;
  }
  __device__ __forceinline__ unsigned long long mass(int64_t i, float pv, float qv) const {
    const unsigned long long mp = fixed(pv), mq = q ? fixed(qv) : 0ull;
    return i == excluded || mp <= mq ? 0ull : mp - mq;
  }
};

template <int kVec>
__device__ __forceinline__ void load_run(const float* ptr, float (&v)[kVec]) {
  if constexpr (kVec == 4) {
    const float4 t = *reinterpret_cast<const float4*>(ptr);
    v[0] = t.x;
    v[1] = t.y;
    v[2] = t.z;
    v[3] = t.w;
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = ptr[e];
  }
}

__device__ __forceinline__ unsigned long long warp_sum(unsigned long long v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ unsigned long long warp_inclusive_scan(unsigned long long v) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned long long t = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += t;
  }
  return v;
}

// Exclusive prefix sum over the block.
__device__ __forceinline__ unsigned long long block_exclusive_scan(unsigned long long v,
                                                                   Shared& sh) {
  const int warp = threadIdx.x / 32;
  const unsigned long long incl = warp_inclusive_scan(v);
  if (threadIdx.x % 32 == 31) sh.scan[warp] = incl;
  __syncthreads();
  unsigned long long before = 0;
  for (int w = 0; w < warp; ++w) before += sh.scan[w];
  __syncthreads();  // sh.scan is free again
  return before + incl - v;
}

// The first id whose cumulative mass exceeds floor(word0 / 2^32 * Z), or -1 when Z = 0. Called
// by every thread of the block (uniformly); every thread gets the id.
template <int kVec>
__device__ int draw(const DrawRows& d, int64_t vocab, unsigned word0, Shared& sh) {
  const int lane = threadIdx.x % 32;
  const int chunks = int((vocab + kChunk - 1) / kChunk);
  for (int c = threadIdx.x; c < chunks; c += kThreads) sh.chunk_mass[c] = 0;
  __syncthreads();

  // Pass 1: each chunk's total mass, coalesced 16-byte runs.
  constexpr int kRuns = kSpan / kVec;
  for (int c = 0; c < chunks; ++c) {
    float pv[kRuns][kVec], qv[kRuns][kVec] = {};
#pragma unroll
    for (int u = 0; u < kRuns; ++u) {
      const int64_t i = c * kChunk + (int64_t(u) * kThreads + threadIdx.x) * kVec;
      if (i < vocab) {
        load_run<kVec>(d.p + i, pv[u]);
        if (d.q) load_run<kVec>(d.q + i, qv[u]);
      }
    }
    unsigned long long local = 0;
#pragma unroll
    for (int u = 0; u < kRuns; ++u) {
      const int64_t i = c * kChunk + (int64_t(u) * kThreads + threadIdx.x) * kVec;
      if (i < vocab) {  // (a run is either wholly inside the row or outside)
#pragma unroll
        for (int e = 0; e < kVec; ++e) local += d.mass(i + e, pv[u][e], qv[u][e]);
      }
    }
    local = warp_sum(local);
    if (lane == 0 && local) atomicAdd(&sh.chunk_mass[c], local);
  }
  __syncthreads();

  // Warp 0: the total Z, the target and the chunk holding it.
  if (threadIdx.x < 32) {
    unsigned long long z = 0;
    for (int c = lane; c < chunks; c += 32) z += sh.chunk_mass[c];
    z = warp_sum(z);
    const unsigned long long target = __umul64hi(z, (unsigned long long)word0 << 32);  // < z
    if (lane == 0) {
      sh.chunk = -1;
      sh.target = target;
    }
    unsigned long long running = 0;
    for (int base = 0; z && base < chunks; base += 32) {  // uniform over the warp
      const int c = base + lane;
      const unsigned long long m = c < chunks ? sh.chunk_mass[c] : 0ull;
      const unsigned long long incl = warp_inclusive_scan(m);
      const unsigned hits = __ballot_sync(0xffffffffu, running + incl > target);
      if (hits) {
        if (lane == __ffs(int(hits)) - 1) {
          sh.chunk = c;
          sh.before = running + incl - m;
        }
        break;
      }
      running += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  __syncthreads();
  const int chunk = sh.chunk;
  if (chunk < 0) {
    __syncthreads();  // everyone has read sh.chunk before the next draw resets it
    return -1;
  }

  // Pass 2: the target's chunk in vocabulary order; thread t owns its ids [16t, 16t + 16).
  const int64_t i0 = chunk * kChunk + int64_t(threadIdx.x) * kSpan;
  float pv[kRuns][kVec], qv[kRuns][kVec] = {};
#pragma unroll
  for (int u = 0; u < kRuns; ++u) {
    if (i0 + u * kVec < vocab) {
      load_run<kVec>(d.p + i0 + u * kVec, pv[u]);
      if (d.q) load_run<kVec>(d.q + i0 + u * kVec, qv[u]);
    }
  }
  unsigned long long local = 0;
#pragma unroll
  for (int u = 0; u < kRuns; ++u) {
    if (i0 + u * kVec < vocab) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) local += d.mass(i0 + u * kVec + e, pv[u][e], qv[u][e]);
    }
  }
  const unsigned long long target = sh.target;
  const unsigned long long before = sh.before + block_exclusive_scan(local, sh);
  if (target >= before && target < before + local) {  // one thread: walk its ids (L1 hits)
    unsigned long long acc = before;
    int64_t found = -1;
    for (int64_t i = i0; i < i0 + kSpan && i < vocab && found < 0; ++i) {
      acc += d.mass(i, d.p[i], d.q ? d.q[i] : 0.f);
      if (acc > target) found = i;
    }
    sh.found = int(found);
  }
  __syncthreads();
  const int token = sh.found;
  __syncthreads();  // everyone has read sh before the next draw reuses it
  return token;
}

template <int kVec>
__global__ void __launch_bounds__(kThreads, 1)
    rejection_sample_kernel(const RejectionSampleParams p, float scale) {
  __shared__ Shared sh;
  const int64_t b = blockIdx.x;
  const int64_t cols = p.out_cols, vocab = p.vocab;
  int* out = p.out_token_ids + b * cols;
  const int64_t start = p.cu_draft[b], end = p.cu_draft[b + 1];
  const int64_t k = end - start;
  if (!(start >= 0 && start <= end && end <= p.num_draft && k <= cols - 1)) {
    if (p.check_indices) __trap();
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) out[c] = -1;
    if (threadIdx.x == 0) p.out_num_tokens[b] = 0;
    return;
  }
  const unsigned long long seed = p.seeds[b], offset = p.offsets[b];
  const float* target = p.target_probs + (start + b) * p.target_stride;  // position 0's row

  if (p.check_indices) {  // debug mode: every proposal of the request, also those never reached
    for (int64_t i = start + threadIdx.x; i < end; i += kThreads)
      check_index(true, p.draft_token_ids[i], vocab);
  }
  // Verification: identical, uniform decisions in every thread (the reference's float64 test).
  int64_t j = 0;
  DrawRows rows{nullptr, nullptr, -1, scale};
  for (; j < k; ++j) {
    const int64_t x = p.draft_token_ids[start + j];
    const bool in_vocab = x >= 0 && x < vocab;  // outside: rejected, never read
    const float* row = target + j * p.target_stride;
    const float* draft = p.draft_probs ? p.draft_probs + (start + j) * p.draft_stride : nullptr;
    const float px = in_vocab ? row[x] : 0.f;
    const float qx = draft ? (in_vocab ? draft[x] : 0.f) : 1.f;
    const double u = double(philox_words(seed, offset + j).y) * 0x1p-32;
    if (!(u * double(qx) < double(px))) {
      rows = DrawRows{row, draft, draft ? -1 : x, scale};
      break;
    }
    if (threadIdx.x == 0) out[j] = int(x);
  }
  // Rejected at j: the recovered token, from p itself if the residual has no mass. Every
  // proposal accepted (j = k): the bonus token from position k. One call site of draw.
  if (j == k) rows = DrawRows{target + k * p.target_stride, nullptr, -1, scale};
  const unsigned word0 = philox_words(seed, offset + j).x;
  int token;
  for (;;) {
    token = draw<kVec>(rows, vocab, word0, sh);
    if (token >= 0 || (rows.q == nullptr && rows.excluded < 0)) break;
    rows = DrawRows{rows.p, nullptr, -1, scale};
  }
  if (threadIdx.x == 0) {
    out[j] = token < 0 ? int(vocab - 1) : token;  // no mass at all: the reference's V - 1
    p.out_num_tokens[b] = int(j + 1);
  }
  for (int64_t c = j + 1 + threadIdx.x; c < cols; c += kThreads) out[c] = -1;
}

}  // namespace

void rejection_sample(const RejectionSampleParams& p, cudaStream_t stream) {
  require(p.vocab > 0 && p.vocab < kMaxVocab, "rejection_sample: vocab must be in [1, 2^23)");
  require(p.batch >= 0 && p.batch <= 0x7fffffff, "rejection_sample: batch out of range");
  require(p.num_draft >= 0 && p.out_cols >= 1, "rejection_sample: bad num_draft or out_cols");
  require(p.target_stride >= 0 && p.draft_stride >= 0, "rejection_sample: negative row stride");
  if (p.batch == 0) return;
  int ceil_log2 = 0;
  while ((int64_t(1) << ceil_log2) < p.vocab) ++ceil_log2;
  // 2^F with F = 63 - ceil(log2 V): V masses of at most 2^F sum below 2^64.
  const float scale = ldexpf(1.f, 63 - ceil_log2);
  const bool vectorizable = aligned16(p.target_probs) && p.vocab % 4 == 0 &&
                            p.target_stride % 4 == 0 &&
                            (p.draft_probs == nullptr ||
                             (aligned16(p.draft_probs) && p.draft_stride % 4 == 0));
  const dim3 grid(static_cast<unsigned>(p.batch));
  if (vectorizable) {
    rejection_sample_kernel<4><<<grid, kThreads, 0, stream>>>(p, scale);
  } else {
    rejection_sample_kernel<1><<<grid, kThreads, 0, stream>>>(p, scale);
  }
  PK_CHECK_LAUNCH("rejection_sample_kernel");
}

}  // namespace pagedkern
