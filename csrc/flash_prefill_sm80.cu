/*
 * flash_prefill, path 1: tensor-core flash attention with mma.sync (sm_80 and every later GPU,
 * Hopper included), K/V tiles gathered from the paged cache with cp.async.
 *
 *   out[i, h] = softmax(q[i, h] K_b^T * scale, causal) V_b     for query i of sequence b
 *
 * Version: v1 flash_prefill_sm80_kernel<Traits>, persistent (one or two CTAs per SM), 4 warps.
 *  Work: (sequence, 128-query tile, head) items from the shared scheduler (flash_prefill.cu),
 *    taken with an atomic counter. KV tiles are visited from the last one down, so the tiles that
 *    need the causal mask come first; tiles wholly above the diagonal are never loaded.
 *  Tiles: kBlockM = 128 queries x kBlockN keys (64 for D = 128, 128 for D = 64). Warp w owns
 *    query rows 16w..16w+15 and 64+16w..64+16w+15; TiledMMA = 4 x 1 warps of
 *    mma.sync.m16n8k16 (bf16/fp16 in, fp32 accumulate), N permuted in 16s so one ldmatrix.x4
 *    feeds two n8 atoms. S = Q K^T: A and B from shared memory (ldmatrix); O += P V: P stays in
 *    registers (the S accumulator rounded to the input type, reread as the A operand), V^T read
 *    with ldmatrix.trans.
 *  Shared memory: Q [128, D], then `stages` K and V buffers [kBlockN, D]; rows of 64 elements
 *    (128 B) under Swizzle<3,3,3> (the 16-byte chunk index xor the row mod 8), so both the
 *    cp.async writes (8 threads per 128-byte row) and the ldmatrix reads are conflict-free.
 *  Pipeline: cp.async groups in the order K0 V0 K1 V1 ...; K of tile j+stages is issued once
 *    every thread finished Q K_j^T, V of tile j+stages-1 once every thread finished P V_{j-1},
 *    so loads of K overlap P V and loads of V overlap Q K^T. stages = 2 when two CTAs per SM
 *    still fit (H100/H200: 96 KiB for D = 128), else 1 (A100 at D = 128, sm_86/89).
 *  Page gather: thread t copies 16-byte chunks (t % 8) and (t % 8) + 8 of rows t / 8 + 16 i; a
 *    row's key k lives at page block_tables[b, k / block_size], slot k % block_size, so its
 *    address is ((page * Hkv + kv_head) * block_size + slot) * D: one table lookup per row and
 *    tile, any block size. Keys at or past seq_len are zero-filled (cp.async src-size 0) so
 *    P = 0 never meets a non-finite V.
 *  Softmax: fp32 online softmax per row (4 rows per thread, quads of lanes share a row), exp2
 *    with log2(e) * scale folded into one FFMA; the output is normalised once, rounded to the
 *    input type, staged through shared memory and stored with 16-byte writes.
 *
 * v2 flash_prefill_sm80_kernel<Traits, true> (default; v1 = <Traits, false>, selected by
 *    PAGEDKERN_KERNELS): v1 looked each copied row's page up in the block table right
 *    after a __syncthreads, BN / 16 dependent global loads per thread ahead of the next MMAs.
 *    v2 fetches a tile's page ids two K groups ahead into a 4-tile shared ring with 4-byte
 *    cp.async riding in the K groups, so the copies read them from shared memory (static test:
 *    no LDG between a barrier and the next HMMA). Both: exps by ex2.approx.ftz (one MUFU.EX2),
 *    row sums parked in shared memory between tiles and coordinates from a fresh thread index
 *    (at 255 registers ptxas otherwise spilled a few words).
 *
 * Options, flash_prefill_sm80_options_kernel<Tr> (the v2 body with kOptions; 16-bit caches;
 *    this path only: the dispatcher routes calls that set one here, on Hopper too; a kernel of
 *    its own so that the plain ones, at 255 registers, carry none of it): a window visits KV
 *    tiles n_tiles-1 down to the one holding the tile's first visible key (older tiles are
 *    never loaded), zero-fills keys below it in that tile (they may be pages a windowed model
 *    released) and masks every tile (causal_mask with the window); the soft-cap's tanh on the
 *    raw scores before the mask as 1 - 2 / (e^2x + 1) (one MUFU.EX2 and a fast reciprocal; a
 *    uniform branch per tile); sinks join the denominators in softmax_finalize. No spills
 *    (static checks); not yet verified on a GPU.
 *
 * Head dim 256 (Gemma 3; 16-bit caches; every schedule and the options): 128 x 256 fp32 output
 *    accumulators are 256 registers per thread on 4 warps, so each 128-row scheduler tile is two
 *    work items of 64 rows (decode_work's split; the second is empty under 65 rows): one m16
 *    tile per warp, 128 accumulator registers per thread as at D = 128, kBlockN = 64, Q [64, 256]
 *    + one K and V stage = 96 KiB, which fits sm_86/89 too (an 8-warp 128-row tile would need
 *    128 KiB). The price: each KV tile is read twice per 128 query rows (from L2). Not yet
 *    verified on a GPU.
 *
 * fp8 cache, flash_prefill_sm80_kernel<Sm80Traits<T, D, float_e4m3_t>, *> (q, out, mma in T):
 *    the same 16-byte cp.async carry 16 E4M3 elements (half the page bytes) into per-stage fp8
 *    staging buffers; each thread then converts exactly the chunks it copied (its own cp.async
 *    wait suffices) into one 16-bit K and one 16-bit V buffer in the swizzled layout, and the
 *    unchanged ldmatrix/mma code reads those. The K conversion of step i runs before the
 *    barrier that opens step i (every thread passed the barrier after Q K_{i-1}^T), the V
 *    conversion before the middle barrier (every thread finished P V_{i-1}): no extra barrier.
 *    E4M3 -> f16 -> T is exact (3 mantissa bits, exponents 2^-9 .. 2^8), so the fp32 math sees
 *    the dequantized cache; cuda_fp8.h's cvt is the F2FP unpack on sm_89+ (the sm_90a build),
 *    a short integer sequence on sm_80. Shared memory: Q + one K and one V tile in T + 2 x
 *    stages fp8 tiles (D = 128, 2 stages: 96 KiB, as bf16; 1 stage: 80 KiB vs 64 KiB, so
 *    A100 at D = 128 fits one CTA per SM instead of two). Rows past seq_len: zero bytes -> 0.
 *    k_scale / v_scale: folded by the host into scale and out_scale (softmax_finalize).
 *    Path 2 does not read fp8 (the dispatcher routes fp8 caches here, on Hopper too).
 *
 * FLOPs: 4 * D * sum over query rows of visible keys (x heads); bytes: Q, O once, K/V once per
 * query tile and head (L2 absorbs the reuse across query tiles and GQA heads). Compute bound:
 * target >= the FlashAttention-2 rate of torch SDPA's flash backend (~330-370 TFLOP/s for causal
 * D = 128 at 16k tokens on H100/H200, about half the mma.sync peak).
 */
#include "flash_prefill_sm80.cuh"

namespace pagedkern {
namespace flash {
namespace {

using namespace cute;

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0));
}
// 4 bytes (a page id) into shared memory, or 0 where !valid.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// threadIdx.x, read afresh: addresses derived from it are recomputed where they are used instead
// of being hoisted out of the persistent loop, where they would crowd the accumulators out of
// registers.
__device__ __forceinline__ int fresh_tid() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid;
}

// Waits for all but the 2 * (stages - 1) most recent groups (K_j or V_j and everything before).
__device__ __forceinline__ void cp_async_wait_tile(int stages) {
  if (stages == 2) {
    cp_async_wait<2>();
  } else {
    cp_async_wait<0>();
  }
}

// acc += A B over the k slices, loading slice k+1 from shared memory while slice k multiplies.
template <bool kAFromSmem, class Mma, class Acc, class RA, class RB, class SA, class SB, class CA,
          class CB, class VA, class VB>
__device__ __forceinline__ void gemm(Mma& mma, Acc& acc, RA& rA, RB& rB, const SA& sA,
                                     const SB& sB, const CA& copy_a, const CB& copy_b, VA& vA,
                                     VB& vB) {
  static_assert(decltype(size<2>(rA))::value == decltype(size<2>(rB))::value);
#pragma unroll
  for (int k = 0; k < size<2>(rA); ++k) {
    if constexpr (kAFromSmem) copy(copy_a, sA(_, _, k), vA(_, _, k));
    copy(copy_b, sB(_, _, k), vB(_, _, k));
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// Page-id ring (kPrefetchPages): the page of every key row of 4 consecutive KV tiles (by visit
// step i, slot i % 4). The ids of step i + 2 * stages ride along with the cp.async group of K of
// step i + stages, so they have landed (and a barrier has passed) before the K and V copies of
// that step read them: no block-table load between a barrier and the next MMAs (v1 did up to
// BN / 16 dependent ones per thread there).
constexpr int kPageRing = 4;

// kOptions: the attention options' body (window, soft-cap, sinks; v2 schedule, 16-bit caches),
// its own kernel below: the plain kernels carry none of its code (they sit at 255 registers).
template <class Tr, bool kPrefetchPages, bool kOptions>
__device__ __forceinline__ void flash_prefill_sm80_body(const KernelParams& p, const int stages) {
  using T = typename Tr::T;
  using TC = typename Tr::TCache;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, D = Tr::kHeadDim, KV = Tr::kKVElems;
  constexpr int kSlabs = D / 64;
  extern __shared__ __align__(128) unsigned char smem[];
  // The current and the next work tile, decoded once by thread 0: shared, not held in every
  // thread's registers through the main loop (the accumulators need them).
  __shared__ WorkTile tiles[2];
  __shared__ int page_ring[kPrefetchPages ? kPageRing : 1][kPrefetchPages ? BN : 1];
  T* const q_smem = reinterpret_cast<T*>(smem);
  T* const k_smem = q_smem + Tr::kQElems;
  T* const v_smem = k_smem + Tr::kBuffers16(stages) * KV;
  const int tid = threadIdx.x;

  typename Tr::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor sQ = make_tensor(make_smem_ptr(q_smem), typename Tr::SmemLayoutQ{});
  auto sK = [&](int slot) {
    return make_tensor(make_smem_ptr(k_smem + slot * KV), typename Tr::SmemLayoutKV{});
  };
  auto sVt = [&](int slot) {
    return make_tensor(make_smem_ptr(v_smem + slot * KV), typename Tr::SmemLayoutVt{});
  };
  Tensor rQ = thr_mma.partition_fragment_A(sQ);     // (MMA, MMA_M, MMA_K)
  Tensor rK = thr_mma.partition_fragment_B(sK(0));  // (MMA, MMA_N, MMA_K)
  Tensor rVt = thr_mma.partition_fragment_B(
      make_tensor(make_smem_ptr(v_smem), typename Tr::SmemLayoutVtNoSwizzle{}));

  auto copy_q = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, T>{}, mma);
  auto copy_k = make_tiled_copy_B(Copy_Atom<SM75_U32x4_LDSM_N, T>{}, mma);
  auto copy_v = make_tiled_copy_B(Copy_Atom<SM75_U16x8_LDSM_T, T>{}, mma);
  Tensor rQ_view = copy_q.get_thread_slice(tid).retile_D(rQ);
  Tensor rK_view = copy_k.get_thread_slice(tid).retile_D(rK);
  Tensor rVt_view = copy_v.get_thread_slice(tid).retile_D(rVt);

  // (row, column) of every accumulator element, as rows x columns; from a fresh thread index
  // where used (hoisted, the four row indices would be spilled).
  auto coords = [&](auto tile_shape) {
    Tensor c = mma.get_thread_slice(fresh_tid()).partition_C(make_identity_tensor(tile_shape));
    return make_tensor(c.data(), rowcol_layout(c.layout()));
  };
  using OShape = Shape<Int<BM>, Int<D>>;
  constexpr int kRows = decltype(size<0>(coords(OShape{})))::value;
  constexpr bool kSumsInSmem = true;
  __shared__ float row_sums[kSumsInSmem ? kRows : 1][Tr::kThreads];

  const int total_work = p.workspace[1] * p.num_heads * Tr::kItemsPerTile;
  __shared__ int works[2];
  if (tid == 0) {
    works[0] = atomicAdd(p.workspace, 1);
    if (works[0] < total_work) tiles[0] = decode_work<BN, Tr::kFp8, kOptions, BM>(p, works[0]);
  }
  __syncthreads();
  for (int parity = 0; works[parity] < total_work; parity ^= 1) {
    const WorkTile& t = tiles[parity];

    // Page ids of the key rows of the tile visited at step i (KV tile n_tiles-1-i) into the
    // ring, as one cp.async per row (rows past seq_len: 0, never used).
    auto fetch_pages = [&](int i) {
      const int tid = fresh_tid();
      const int key = (t.n_tiles - 1 - i) * BN + tid;
      if (tid < BN && i < (kOptions ? t.n_visits : t.n_tiles)) {
        int page, slot;
        page_of(p, key, page, slot);
        const bool valid = key < t.seq_len && (!kOptions || key >= t.key_lo);
        cp_async_4(&page_ring[i % kPageRing][tid],
                   p.block_tables + int64_t(t.seq) * p.block_table_stride + (valid ? page : 0),
                   valid);
      }
    };
    // Keys tile*BN .. tile*BN+BN-1 of K or V into buffer `slot` of that cache (fp8: its
    // staging buffer), gathered through the table (kPrefetchPages: through the ids of the ring,
    // tile = KV tile of step i).
    auto load_kv = [&](bool is_v, int slot, int tile) {
      const void* cache = is_v ? p.v_cache : p.k_cache;
      const int tid = fresh_tid();
      const int* table = p.block_tables + int64_t(t.seq) * p.block_table_stride;
      const int seq_len = t.seq_len;
      const int key_lo = kOptions ? t.key_lo : 0;  // (a window's: before it, released pages)
      // Key `key`'s row in the cache, its block from the prefetched ring (entry i of `ids`) or
      // the table (both copies below: fp8 staging and 16-bit tiles).
      auto row_offset = [&](int key, const int* ids, int i) -> int64_t {
        int page, slot_in_page;
        page_of(p, key, page, slot_in_page);
        const int block = kPrefetchPages ? ids[i] : table[page];
        return int64_t(block) * p.page_stride + slot_in_page * D;
      };
      if constexpr (Tr::kFp8) {
        const TC* base = static_cast<const TC*>(cache) + int64_t(t.kv_head) * p.block_size * D +
                         Tr::fp8_chunk_col(tid);
        const int* ids = &page_ring[kPrefetchPages ? (t.n_tiles - 1 - tile) % kPageRing : 0][0];
        uint8_t* dst = smem + Tr::fp8_stage_bytes(is_v, slot);
#pragma unroll
        for (int m = 0; m < Tr::kFp8Passes; ++m) {
          const int row = Tr::fp8_chunk_row(tid) + Tr::kFp8RowsPerPass * m;
          const int key = tile * BN + row;
          const bool valid = key < seq_len && key >= key_lo;
          const int64_t offset = valid ? row_offset(key, ids, row) : 0;
          cp_async_16(dst + Tr::fp8_stage_offset(tid, m), base + offset, valid);
        }
      } else {
        T* const dst = (is_v ? v_smem : k_smem) + slot * KV;
        const T* base = static_cast<const T*>(cache) + int64_t(t.kv_head) * p.block_size * D +
                        Tr::chunk_col(tid);
        const int* ids = &page_ring[kPrefetchPages ? (t.n_tiles - 1 - tile) % kPageRing : 0]
                                   [kPrefetchPages ? Tr::chunk_row(tid) : 0];
#pragma unroll
        for (int m = 0; m < BN / 16; ++m) {
          const int row = Tr::chunk_row(tid) + 16 * m;
          const int key = tile * BN + row;
          const bool valid = key < seq_len && key >= key_lo;
          const int64_t offset = valid ? row_offset(key, ids, 16 * m) : 0;
#pragma unroll
          for (int k = 0; k < kSlabs; ++k) {
            cp_async_16(dst + Tr::chunk_offset(tid) + m * 1024 + k * BN * 64,
                        base + offset + k * 64, valid);
          }
        }
      }
    };
    // fp8: this thread's staged chunks of buffer `slot` (landed: after its own cp.async wait)
    // into the 16-bit tile. Called just before the barrier that publishes the tile; the
    // barrier before it ordered every read of the tile's previous contents (flash_prefill_sm80.cu
    // opening comment).
    auto convert_kv = [&](bool is_v, int slot) {
      if constexpr (Tr::kFp8) {
        Tr::convert_staged(smem + Tr::fp8_stage_bytes(is_v, slot), is_v ? v_smem : k_smem,
                           fresh_tid());
      }
    };

    // Prologue: groups [Q + K0], V0, K1, ... V_{stages-2}, K_{stages-1}. Iteration i handles
    // KV tile n_tiles-1-i in buffer i % stages.
    const int n_tiles = t.n_tiles;
    const int n_visits = kOptions ? t.n_visits : n_tiles;  // fewer with a window
    if constexpr (kPrefetchPages) {
      // Ids of steps 0 .. 2 * stages - 1 now; later ones with the main loop's K groups.
      for (int i = 0; i < 2 * stages; ++i) fetch_pages(i);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
    }
    // Q rows past the chunk are zero-filled; their outputs are never stored.
    {
      const int tid = fresh_tid();
      const T* q = static_cast<const T*>(p.q) + int64_t(t.q_row0) * p.q_stride + t.head * D;
      const int rows = t.rows;
#pragma unroll
      for (int m = 0; m < BM / 16; ++m) {
        const int row = Tr::chunk_row(tid) + 16 * m;
        const bool valid = row < rows;
        const T* src = q + (valid ? row * p.q_stride : 0) + Tr::chunk_col(tid);
#pragma unroll
        for (int k = 0; k < kSlabs; ++k) {
          cp_async_16(q_smem + Tr::chunk_offset(tid) + m * 1024 + k * BM * 64, src + k * 64,
                      valid);
        }
      }
    }
    if (n_visits > 0) load_kv(false, 0, n_tiles - 1);
    cp_async_commit();
    for (int s = 1; s < stages; ++s) {
      if (s - 1 < n_visits) load_kv(true, s - 1, n_tiles - s);
      cp_async_commit();
      if (s < n_visits) load_kv(false, s, n_tiles - 1 - s);
      cp_async_commit();
    }

    Tensor acc_o = partition_fragment_C(mma, Shape<Int<BM>, Int<D>>{});
    Tensor o_rc = make_tensor(acc_o.data(), rowcol_layout(acc_o.layout()));
    clear(acc_o);
    // kSumsInSmem: the row sums wait in shared memory between tiles (one per thread and row,
    // each thread its own): carried in registers through the MMAs, ptxas spilled them at D = 64.
    float row_max[kRows], row_sum[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY, row_sum[r] = 0.f;
      if constexpr (kSumsInSmem) row_sums[r][fresh_tid()] = 0.f;
    }

    for (int i = 0; i < (kOptions ? t.n_visits : t.n_tiles); ++i) {
      const int tile = t.n_tiles - 1 - i;
      const int slot = stages == 1 ? 0 : (i & 1);
      const int slot16 = Tr::kFp8 ? 0 : slot;  // the 16-bit buffer the fragments read
      cp_async_wait_tile(stages);  // K_i (and Q) have landed
      convert_kv(false, slot);     // fp8: everyone passed the last barrier, done with Q K_{i-1}^T
      __syncthreads();             // ... for every thread; and everyone is done with V_{i-1}
      if (i + stages - 1 < (kOptions ? t.n_visits : t.n_tiles))
        load_kv(true, (i + stages - 1) % stages, tile - (stages - 1));
      cp_async_commit();

      Tensor acc_s = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
      clear(acc_s);
      const int ftid = fresh_tid();
      Tensor sQ_frag = copy_q.get_thread_slice(ftid).partition_S(sQ);
      Tensor sK_frag = copy_k.get_thread_slice(ftid).partition_S(sK(slot16));
      gemm<true>(mma, acc_s, rQ, rK, sQ_frag, sK_frag, copy_q, copy_k, rQ_view, rK_view);

      Tensor s_rc = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
      if constexpr (kOptions) {
        if (p.soft_cap > 0.f) soft_cap_scores(s_rc, p.cap_raw, p.inv_cap_raw);
        if (tile >= t.n_unmasked) {
          causal_mask(s_rc, coords(Shape<Int<BM>, Int<BN>>{}), t, tile * BN, p.window);
        }
      } else {
        if (tile >= t.n_unmasked) causal_mask(s_rc, coords(Shape<Int<BM>, Int<BN>>{}), t, tile * BN);
      }
      float alpha[kRows];
      if constexpr (kSumsInSmem) {
        const int ftid = fresh_tid();
#pragma unroll
        for (int r = 0; r < kRows; ++r) row_sum[r] = row_sums[r][ftid];
      }
      softmax_step(s_rc, row_max, row_sum, alpha, p.scale_log2);
      if constexpr (kSumsInSmem) {
        const int ftid = fresh_tid();
#pragma unroll
        for (int r = 0; r < kRows; ++r) row_sums[r][ftid] = row_sum[r];
      }
      rescale_rows(o_rc, alpha);
      Tensor rP = make_tensor<T>(acc_as_a_layout(acc_s.layout()));
      convert_storage(acc_s, rP);

      cp_async_wait_tile(stages);  // V_i has landed
      convert_kv(true, slot);      // fp8: everyone passed the last barrier, done with P V_{i-1}
      __syncthreads();             // ... for every thread; and everyone is done with K_i
      if (i + stages < (kOptions ? t.n_visits : t.n_tiles)) load_kv(false, slot, tile - stages);
      if constexpr (kPrefetchPages) fetch_pages(i + 2 * stages);
      cp_async_commit();

      Tensor sVt_frag = copy_v.get_thread_slice(fresh_tid()).partition_S(sVt(slot16));
      gemm<false>(mma, acc_o, rP, rVt, sVt_frag, sVt_frag, copy_v, copy_v, rVt_view, rVt_view);
    }

    // Epilogue: normalise, stage the tile in Q's buffer, 16-byte stores of the valid rows. The
    // next work item is claimed now (not at the start: a register held through the main loop
    // would spill); its latency hides behind the stores.
    // Straight into shared memory (nobody reads works[parity ^ 1] before the last barrier).
    if (tid == 0) works[parity ^ 1] = atomicAdd(p.workspace, 1);
    float lse[kRows];
    if constexpr (kSumsInSmem) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) row_sum[r] = row_sums[r][fresh_tid()];
    }
    if constexpr (kOptions) {
      softmax_finalize(o_rc, row_max, row_sum, p.scale, p.out_scale, lse,
                       p.sinks != nullptr ? p.sinks[t.head] : -INFINITY);
    } else {
      softmax_finalize(o_rc, row_max, row_sum, p.scale, p.out_scale, lse);
    }
    cp_async_wait<0>();  // only empty groups remain; Q's has landed (n_tiles == 0 included)
    __syncthreads();
    Tensor o_frag = make_tensor<T>(acc_o.layout());
    convert_storage(acc_o, o_frag);
    auto copy_o = make_tiled_copy_C(Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, T>{}, mma);
    auto thr_copy_o = copy_o.get_thread_slice(fresh_tid());
    copy(copy_o, thr_copy_o.retile_S(o_frag), thr_copy_o.partition_D(sQ));
    if (p.lse != nullptr) {
      const auto cO_rc = coords(OShape{});
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(cO_rc(r, 0));
        if (get<1>(cO_rc(r, 0)) == 0 && row < t.rows) {
          p.lse[int64_t(t.q_row0 + row) * p.num_heads + t.head] = lse[r];
        }
      }
    }
    __syncthreads();
    {
      const int tid = fresh_tid();
      T* out = static_cast<T*>(p.out) + int64_t(t.q_row0) * p.out_stride + t.head * D;
      const int rows = t.rows;
#pragma unroll
      for (int m = 0; m < BM / 16; ++m) {
        const int row = Tr::chunk_row(tid) + 16 * m;
        if (row < rows) {
#pragma unroll
          for (int k = 0; k < kSlabs; ++k) {
            *reinterpret_cast<uint4*>(out + row * p.out_stride + Tr::chunk_col(tid) + k * 64) =
                *reinterpret_cast<const uint4*>(q_smem + Tr::chunk_offset(tid) + m * 1024 +
                                                k * BM * 64);
          }
        }
      }
    }
    if (tid == 0) {
      const int next = works[parity ^ 1];
      if (next < total_work) tiles[parity ^ 1] = decode_work<BN, Tr::kFp8, kOptions, BM>(p, next);
    }
    __syncthreads();  // Q's buffer is free again; the next tile is decoded
  }
}

template <class Tr, bool kPrefetchPages>
__global__ void __launch_bounds__(Tr::kThreads, 2)
    flash_prefill_sm80_kernel(const __grid_constant__ KernelParams p, const int stages) {
  flash_prefill_sm80_body<Tr, kPrefetchPages, false>(p, stages);
}

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 2)
    flash_prefill_sm80_options_kernel(const __grid_constant__ KernelParams p, const int stages) {
  flash_prefill_sm80_body<Tr, true, true>(p, stages);
}

template <class Tr, bool kPrefetchPages, bool kOptions = false>
void launch(const KernelParams& p, int device, cudaStream_t stream) {
  int smem_per_sm = 0, smem_per_block = 0;
  PK_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  PK_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  auto kernel = flash_prefill_sm80_kernel<Tr, kPrefetchPages>;
  if constexpr (kOptions) kernel = flash_prefill_sm80_options_kernel<Tr>;  // (16-bit Tr only)
  cudaFuncAttributes attr{};
  PK_CUDA_CHECK(cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel)));
  // The most CTAs per SM (two: the register file's limit), then the most buffers per K and V;
  // static shared memory (v2: page-id ring and row sums, ~4 KB) and the 1 KB per-CTA reserve
  // included. H100/H200: two stages at D = 64 / 128, one (and two CTAs) at D = 256; A100: one
  // stage at D = 128, two (and one CTA) at D = 256; sm_86/89 (99 KiB): one CTA.
  auto fits = [&](int ctas, int stages) {
    const size_t bytes = Tr::smem_bytes(stages) + attr.sharedSizeBytes;
    return bytes <= size_t(smem_per_block) && ctas * (bytes + 1024) <= size_t(smem_per_sm);
  };
  const int stages = fits(2, 2) ? 2 : fits(2, 1) ? 1 : fits(1, 2) ? 2 : 1;
  const size_t smem = Tr::smem_bytes(stages);
  const int grid =
      persistent_grid(reinterpret_cast<const void*>(kernel), Tr::kThreads, smem, device,
                      max_tiles(p.total_q, p.batch) * p.num_heads * Tr::kItemsPerTile);
  kernel<<<grid, Tr::kThreads, smem, stream>>>(p, stages);
  PK_CHECK_LAUNCH("flash_prefill_sm80_kernel");
}

// D = 256: 16-bit caches only (the host refuses an fp8 cache there).
template <class T, class TCache, bool kPrefetchPages>
void launch_dtype(const KernelParams& p, int device, cudaStream_t stream) {
  if (p.head_dim == 64) {
    launch<Sm80Traits<T, 64, TCache>, kPrefetchPages>(p, device, stream);
  } else if (std::is_same_v<T, TCache> && p.head_dim == 256) {
    launch<Sm80Traits<T, 256, T>, kPrefetchPages>(p, device, stream);
  } else {
    launch<Sm80Traits<T, 128, TCache>, kPrefetchPages>(p, device, stream);
  }
}

template <class T, bool kPrefetchPages>
void launch_cache(const KernelParams& p, int device, cudaStream_t stream) {
  if (p.fp8_cache) {
    launch_dtype<T, cutlass::float_e4m3_t, kPrefetchPages>(p, device, stream);
  } else {
    launch_dtype<T, T, kPrefetchPages>(p, device, stream);
  }
}

template <bool kPrefetchPages>
void launch_variant(const KernelParams& p, int device, cudaStream_t stream) {
  if (p.dtype == DType::kFloat16) {
    launch_cache<cutlass::half_t, kPrefetchPages>(p, device, stream);
  } else {
    launch_cache<cutlass::bfloat16_t, kPrefetchPages>(p, device, stream);
  }
}

// The options' kernels: v2 schedule, 16-bit caches (the host refuses fp8 with options).
template <class T>
void launch_options(const KernelParams& p, int device, cudaStream_t stream) {
  if (p.head_dim == 64) {
    launch<Sm80Traits<T, 64, T>, true, true>(p, device, stream);
  } else if (p.head_dim == 256) {
    launch<Sm80Traits<T, 256, T>, true, true>(p, device, stream);
  } else {
    launch<Sm80Traits<T, 128, T>, true, true>(p, device, stream);
  }
}

}  // namespace

void launch_flash_prefill_sm80(const KernelParams& p, int device, cudaStream_t stream) {
  if (p.window > 0 || p.soft_cap > 0.f || p.sinks != nullptr) {
    if (p.dtype == DType::kFloat16) {
      launch_options<cutlass::half_t>(p, device, stream);
    } else {
      launch_options<cutlass::bfloat16_t>(p, device, stream);
    }
  } else if (p.variant == kFlashVariantV1) {
    launch_variant<false>(p, device, stream);
  } else {
    launch_variant<true>(p, device, stream);
  }
}

}  // namespace flash
}  // namespace pagedkern
