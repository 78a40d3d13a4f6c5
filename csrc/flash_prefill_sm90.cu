/*
 * flash_prefill, path 2 (Hopper, sm_90a): warp-specialised flash attention with wgmma, K/V
 * pages brought in by TMA. Same math as path 1 (flash_prefill_sm80.cu); chosen at run time on
 * sm_90 when the page layout allows TMA (block size a multiple of 8 that divides 128 or is a
 * multiple of it: 16, 32, 64, 128, ...), path 1 otherwise.
 *
 * Version: v1 flash_prefill_sm90_kernel<Traits>, persistent (one CTA per SM), 3 warpgroups.
 *  Work: the shared scheduler's (sequence, 128-query tile, head) items, longest first; the
 *    producer warp takes each with an atomic and publishes it to the consumers with Q.
 *  Warp specialisation: warpgroup 0 is the producer (setmaxnreg 24; one warp issues every TMA),
 *    warpgroups 1-2 are consumers (setmaxnreg 240), 64 query rows each: the 128-row tile is two
 *    wgmma.m64 slices. Barriers: q_full/q_empty for Q (the tile index rides along), and a ring of
 *    kStages (2 for D = 128, 4 for D = 64) buffers each for K and V with full (TMA transaction
 *    count) and empty (one arrival per consumer warp) mbarriers.
 *  Pages by TMA: a 3-D tensor map over the cache viewed as (D, block_size, num_blocks * Hkv)
 *    with a (64, rows, 1) box and 128-byte swizzle; KV tile j (128 keys) is 128 / block_size
 *    boxes per 64-column slab, lane i of the producer warp looking up page i in the block table
 *    and loading it into rows i*block_size.. of the tile, exactly where the 128B-swizzled wgmma
 *    layout expects them (8-row swizzle atoms, so block_size % 8 == 0). Boxes wholly past
 *    seq_len are not loaded; the consumers zero V's rows past seq_len (the tail of the last page
 *    holds whatever the cache holds) before P V, K's are masked to -inf.
 *  Consumer loop (per warpgroup, intra-warpgroup overlap): S_i = Q K_i^T and O += P_{i-1} V_{i-1}
 *    are issued back to back (wgmma SS, then RS with P in registers); the softmax of S_i runs
 *    while the P V product is in flight, then O is rescaled. The two consumer warpgroups take
 *    turns issuing their GEMMs (two named barriers, "ping-pong"), so one's softmax overlaps the
 *    other's tensor-core work. Q is released after the last Q K^T of the tile, so the next tile's
 *    Q load overlaps this tile's last P V and epilogue.
 *  Epilogue: normalise, round, stage in a separate shared buffer (swizzled), 16-byte stores of
 *    the valid rows; LSE from the lane that holds column 0.
 * v2 flash_prefill_sm90_kernel<Traits, true> (default; v1 = <Traits, false>, selected by
 *    PAGEDKERN_KERNELS): in v1's SASS every MUFU.EX2 of the softmax sat after the wait
 *    for the in-flight P V (ptxas hoists wgmma.wait_group to the top of its basic block, which
 *    began after the mask branch): no overlap. v2 runs the softmax inside both arms of that
 *    branch, so the exps precede the wait (static test). The producer decodes the next work item
 *    and looks up each tile's page ids before its barrier waits (v1: a dependent table load
 *    between the wait and every TMA); V's tail is zeroed by warpgroup 0 only, ordered before
 *    warpgroup 1's wgmma by the turn barrier or a named barrier (v1: both warpgroups wrote it).
 *    Not yet considered: sharing the O staging buffer with Q for a third K/V stage at D = 128.
 * Options, flash_prefill_sm90_options_kernel<Tr> (the v2 body with kOptions; selected only by
 *    the sm90_options variant, PAGEDKERN_KERNELS=flash_prefill:sm90_options, until a GPU run has
 *    verified it; otherwise calls with an option run path 1): a window visits KV tiles n_tiles-1
 *    down to the one holding the tile's first visible key (key_lo); in that oldest tile the
 *    producer loads no TMA box lying wholly before key_lo (its pages may be released) and the
 *    consumers zero V's rows before key_lo as they zero its tail (same barriers), so P = 0
 *    never meets stale or non-finite values; every tile is masked (causal_mask with the window).
 *    The soft-cap's tanh (one MUFU.EX2) precedes the mask inside both arms of v2's mask branch,
 *    so the exps still precede the wait for P V; sinks join the denominators in
 *    softmax_finalize. Not yet verified on a GPU.
 *
 * FLOPs and bytes as path 1. Target on H200 (causal, D = 128, 16k tokens): >= 600 TFLOP/s
 * (FlashAttention-3 ~620 on an H100), ahead of cuDNN's SDPA.
 *
 * On sm_80 and in the compute_80 PTX this kernel has an empty body (the dispatcher never launches
 * it there); it exists in every cubin so the build carries the same kernels for every target.
 */
#include <string>

#include "flash_prefill_sm90.cuh"
#include "tma_descriptor.cuh"

namespace pagedkern {
namespace flash {
namespace {

struct Sm90Params {
  KernelParams p;
  CUtensorMap tma_q;  // q as (D, num_heads, total_q), box (64, 1, kBlockM)
  CUtensorMap tma_k;  // k_cache as (D, block_size, num_blocks * num_kv_heads), box (64, rows, 1)
  CUtensorMap tma_v;
};

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

// acc (+)= A B as one wgmma batch, not waited for. A from shared memory (descriptors) or
// registers (RS: P); the fences keep the compiler from touching operands while in flight.
template <bool kZeroInit, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma(Mma& mma, const TA& a, const TB& b, TC& c) {
  constexpr bool kRegA =
      !std::is_base_of_v<GMMA::DescriptorIterator, std::remove_cv_t<typename TA::iterator>>;
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(a));
}

// kV2 (producer): the next work item decoded and each tile's page ids looked up one tile ahead,
// before the waits on the empty barriers. v1: after them, as first built.
// kOptions (with kV2): a window's tiles only (n_visits of them), and in the oldest one no box
// that lies wholly before the window (its pages may be released): the consumers mask those
// keys and zero those V rows.
template <class Tr, bool kV2, bool kOptions = false>
__device__ __forceinline__ void producer(const Sm90Params& params,
                                         typename Tr::SharedStorage& s) {
  using T = typename Tr::T;
  constexpr int BN = Tr::kBlockN, S = Tr::kStages, kSlabs = Tr::kSlabs;
  const KernelParams& p = params.p;
  const int lane = threadIdx.x % 32;
  const int total_work = p.workspace[1] * p.num_heads;
  const int box_rows = min(p.block_size, BN);  // rows per TMA box: one page, or a tile of it
  int q_phase = 0, k_stage = 0, k_phase = 0, v_stage = 0, v_phase = 0;

  auto boxes_of = [&](const WorkTile& t, int j) {
    return (min(BN, t.seq_len - j * BN) + box_rows - 1) / box_rows;
  };
  // The first box of KV tile j holding a key inside the window (0 without options).
  auto first_box = [&](const WorkTile& t, int j) {
    return kOptions ? max(0, t.key_lo - j * BN) / box_rows : 0;
  };
  // The cache block holding lane i's box of KV tile j (or 0 where the box holds no key).
  auto block_of = [&](const WorkTile& t, int j) {
    if (lane >= boxes_of(t, j) || lane < first_box(t, j)) return 0;
    int page, slot;
    page_of(p, j * BN + lane * box_rows, page, slot);
    return p.block_tables[int64_t(t.seq) * p.block_table_stride + page];
  };
  // KV tile j (keys j*BN ..) of K or V into `buf`: lane i loads box i (keys j*BN + i*box_rows
  // ..) from its page (cache block `block`, v1: looked up here), if any of its keys is <
  // seq_len. Lane 0 first announces the bytes.
  auto load_kv = [&](const CUtensorMap* map, T* buf, uint64_t* full, const WorkTile& t, int j,
                     int block) {
    const int key0 = j * BN;
    const int boxes = boxes_of(t, j), first = first_box(t, j);
    if (lane == 0) {
      mbar_arrive_expect_tx(full, uint32_t((boxes - first) * kSlabs * box_rows * 128));
    }
    __syncwarp();
    if (lane < boxes && lane >= first) {
      int page, slot;
      page_of(p, key0 + lane * box_rows, page, slot);
      if constexpr (!kV2) block = p.block_tables[int64_t(t.seq) * p.block_table_stride + page];
      const int plane = block * p.num_kv_heads + t.kv_head;
#pragma unroll
      for (int slab = 0; slab < kSlabs; ++slab) {
        tma_load_3d(buf + slab * BN * 64 + lane * box_rows * 64, map, full, slab * 64, slot,
                    plane);
      }
    }
  };

  for (;;) {
    int work = 0;
    if (lane == 0) work = atomicAdd(p.workspace, 1);
    work = __shfl_sync(0xffffffffu, work, 0);
    WorkTile t{};
    int block_next = 0;  // kV2: the page of this lane's box of the next K/V tile to load
    if constexpr (kV2) {  // the loads of the work list and the first table entry overlap the wait
      if (work < total_work) {
        t = decode_work<BN, false, kOptions>(p, work);
        if (t.n_tiles > 0) block_next = block_of(t, t.n_tiles - 1);
      }
    }
    mbar_wait(&s.q_empty, q_phase ^ 1);  // the consumers are done with the previous Q and tile
    if (work >= total_work) {
      if (lane == 0) {
        s.work = -1;
        mbar_arrive(&s.q_full);
      }
      return;
    }
    if constexpr (!kV2) t = decode_work<BN>(p, work);
    if (lane == 0) {
      s.tile = t;
      s.work = work;
      mbar_arrive_expect_tx(&s.q_full, uint32_t(Tr::kQElems * sizeof(T)));
#pragma unroll
      for (int slab = 0; slab < kSlabs; ++slab) {
        tma_load_3d(s.q + slab * kBlockM * 64, &params.tma_q, &s.q_full, slab * 64, t.head,
                    t.q_row0);
      }
    }
    q_phase ^= 1;
    // In the consumers' order: K_0, K_1, V_0, K_2, V_1, ..., V_{n-1} (step i = KV tile n-1-i).
    // kV2: V of a tile reuses the page ids of its K; the next tile's are loaded before the waits.
    int block_k = 0, block_v = 0;
    const int visits = kOptions ? t.n_visits : t.n_tiles;
    for (int i = 0; i <= visits; ++i) {
      if (i < visits) {
        block_k = block_next;
        if (kV2 && i + 1 < visits) block_next = block_of(t, t.n_tiles - 2 - i);
        mbar_wait(&s.k_empty[k_stage], k_phase ^ 1);
        load_kv(&params.tma_k, s.k + k_stage * Tr::kKVTileElems, &s.k_full[k_stage], t,
                t.n_tiles - 1 - i, block_k);
        if (++k_stage == S) k_stage = 0, k_phase ^= 1;
      }
      if (i > 0) {
        mbar_wait(&s.v_empty[v_stage], v_phase ^ 1);
        load_kv(&params.tma_v, s.v + v_stage * Tr::kKVTileElems, &s.v_full[v_stage], t,
                t.n_tiles - i, block_v);
        if (++v_stage == S) v_stage = 0, v_phase ^= 1;
      }
      block_v = block_k;
    }
  }
}

// kOptions (with kV2): the window's tiles only, each masked (the window's lower edge too) and
// soft-capped before the softmax; V rows before the window zeroed in the oldest tile, as the
// tail past seq_len; sinks in softmax_finalize.
template <class Tr, bool kV2, bool kOptions = false>
__device__ __forceinline__ void consumer(const Sm90Params& params,
                                         typename Tr::SharedStorage& s) {
  using T = typename Tr::T;
  constexpr int BN = Tr::kBlockN, D = Tr::kHeadDim, S = Tr::kStages;
  const KernelParams& p = params.p;
  const int ct = threadIdx.x - 128;  // 0 .. 255 over both consumer warpgroups
  const int wg = ct / 128;
  const bool warp_leader = threadIdx.x % 32 == 0;

  typename Tr::TiledMmaQK mma_qk;
  typename Tr::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(ct);
  auto thr_pv = mma_pv.get_thread_slice(ct);
  Tensor sQ = make_tensor(make_smem_ptr(s.q), typename Tr::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(s.k), typename Tr::SmemLayoutKV{});   // (BN, D, S)
  Tensor sV = make_tensor(make_smem_ptr(s.v), typename Tr::SmemLayoutKV{});   // (BN, D, S)
  Tensor sVt = make_tensor(make_smem_ptr(s.v), typename Tr::SmemLayoutVt{});  // (D, BN, S)
  Tensor sO = make_tensor(make_smem_ptr(s.o), typename Tr::SmemLayoutQ{});
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // wgmma descriptors (MMA, 1, D/16)
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, 1, D/16, S)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, 1, BN/16, S)
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<BN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), rowcol_layout(cS.layout()));
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<D>>{}));
  Tensor cO_rc = make_tensor(cO.data(), rowcol_layout(cO.layout()));
  constexpr int kRows = decltype(size<0>(cO_rc))::value;
  using AccS = decltype(partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<BN>>{}));
  Tensor rP = make_tensor<T>(acc_as_a_layout(typename AccS::layout_type{}));  // P, A operand

  int q_phase = 0, k_stage = 0, k_phase = 0, v_stage = 0, v_phase = 0;
  auto release = [&](uint64_t* bar) {
    if (warp_leader) mbar_arrive(bar);  // one arrival per consumer warp
  };
  auto next_k = [&] {
    if (++k_stage == S) k_stage = 0, k_phase ^= 1;
  };
  auto next_v = [&] {
    if (++v_stage == S) v_stage = 0, v_phase ^= 1;
  };
  // V rows past seq_len hold whatever the cache's last page holds there (or an earlier tile):
  // zero them so that P = 0 never meets a non-finite value. v1: both warpgroups zero the same
  // rows (identical values), each ordering its own writes before its wgmma -- but one's generic
  // stores may meet the other's wgmma reading the stage. kV2: warpgroup 0 zeroes and fences
  // (generic -> async proxy); warpgroup 1's wgmma is ordered after that by the turn barrier
  // (in_turn: warpgroup 0 zeroes before it hands over the turn) or, in the last P V of a
  // one-tile item, which takes no turns, by named barrier kBarVTail (both warpgroups sync).
  // The window's first key, recomputed from q_pos0 (live anyway) where used: held through the
  // main loop, t.key_lo and the visit count cost the options kernel spills at D = 128.
  auto key_lo = [&](const WorkTile& t) {
    return p.window > 0 ? max(0, opaque(t.q_pos0) + 1 - p.window) : 0;
  };
  // kHead (kOptions): rows before the window's first key too, in the oldest tile visited.
  auto zero_v_tail = [&](const WorkTile& t, int j, int stage, bool in_turn, auto head) {
    constexpr bool kHead = kOptions && decltype(head)::value;
    const int first = t.seq_len - j * BN;
    const int before = kHead ? min(key_lo(t) - j * BN, BN) : 0;  // rows 0 .. before-1
    if (first >= BN && before <= 0) return;
    if (kV2 && wg == 1) {
      if (!in_turn) named_sync(kBarVTail, 256);
      return;
    }
    for (int c = ct % 128; c < max(BN - first, 0) * (D / 8); c += 128) {
      *reinterpret_cast<uint4*>(&sV(first + c / (D / 8), c % (D / 8) * 8, stage)) =
          make_uint4(0, 0, 0, 0);
    }
    if constexpr (kHead) {
      for (int c = ct % 128; c < max(before, 0) * (D / 8); c += 128) {
        *reinterpret_cast<uint4*>(&sV(c / (D / 8), c % (D / 8) * 8, stage)) =
            make_uint4(0, 0, 0, 0);
      }
    }
    fence_async_shared();
    named_sync(kBarWarpgroup0 + wg, 128);
    if (kV2 && !in_turn) named_sync(kBarVTail, 256);
  };

  if (wg == 0) named_arrive(kBarTurn0, 256);  // warpgroup 0 issues first
  for (;;) {
    mbar_wait(&s.q_full, q_phase);
    q_phase ^= 1;
    if (s.work < 0) return;
    const WorkTile t = s.tile;  // copied before Q is released: the producer rewrites it then
    const int n = t.n_tiles;
    // KV tiles n-1 down to n-visits (decode_work's n_visits, recomputed where used)
    auto visits = [&] { return kOptions ? max(0, n - key_lo(t) / BN) : n; };
    // The options' score transform: soft-cap, then the causal mask with the window.
    auto cap_and_mask = [&](auto& s_rc, int tile) {
      if (p.soft_cap > 0.f) soft_cap_scores(s_rc, p.cap_raw, p.inv_cap_raw);
      causal_mask(s_rc, cS_rc, t, tile * BN, p.window);
    };

    Tensor acc_o = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<D>>{});
    Tensor o_rc = make_tensor(acc_o.data(), rowcol_layout(acc_o.layout()));
    clear(acc_o);
    float row_max[kRows], row_sum[kRows], alpha[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) row_max[r] = -INFINITY, row_sum[r] = 0.f;

    if (visits() == 0) {
      release(&s.q_empty);
    } else {
      {  // KV tile n-1: S = Q K^T alone
        AccS acc_s;
        mbar_wait(&s.k_full[k_stage], k_phase);
        wgmma<true>(mma_qk, tSrQ, tSrK(_, _, _, k_stage), acc_s);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_s);
        release(&s.k_empty[k_stage]);
        next_k();
        if (visits() == 1) release(&s.q_empty);
        Tensor s_rc = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
        if constexpr (kOptions) {
          cap_and_mask(s_rc, n - 1);
        } else {
          if (n - 1 >= t.n_unmasked) causal_mask(s_rc, cS_rc, t, (n - 1) * BN);
        }
        softmax_step(s_rc, row_max, row_sum, alpha, p.scale_log2);
        convert_storage(acc_s, rP);
      }
      // Step i: S_i = Q K_i^T and O += P_{i-1} V_{i-1} in flight together, the softmax of S_i
      // in between (kV2: really; v1: ptxas moved it after the wait), then P_i into rP.
      auto step = [&](int i) {
        const int tile = n - 1 - i;
        AccS acc_s;
        mbar_wait(&s.k_full[k_stage], k_phase);
        named_sync(kBarTurn0 + wg, 256);  // our turn to issue
        wgmma<true>(mma_qk, tSrQ, tSrK(_, _, _, k_stage), acc_s);
        mbar_wait(&s.v_full[v_stage], v_phase);
        if (i == 1) zero_v_tail(t, n - 1, v_stage, true, cute::false_type{});
        wgmma<false>(mma_pv, rP, tOrV(_, _, _, v_stage), acc_o);
        named_arrive(kBarTurn0 + (1 - wg), 256);  // the other warpgroup's turn
        warpgroup_wait<1>();  // S_i is ready, P_{i-1} V_{i-1} may still run
        warpgroup_fence_operand(acc_s);
        release(&s.k_empty[k_stage]);
        next_k();
        if (i == visits() - 1) release(&s.q_empty);  // the tile's last Q K^T is done
        Tensor s_rc = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
        if constexpr (kOptions) {  // every tile masked (n_unmasked = 0 under a window)
          if (tile >= t.n_unmasked) {
            cap_and_mask(s_rc, tile);
            softmax_step(s_rc, row_max, row_sum, alpha, p.scale_log2);
          } else {
            if (p.soft_cap > 0.f) soft_cap_scores(s_rc, p.cap_raw, p.inv_cap_raw);
            softmax_step(s_rc, row_max, row_sum, alpha, p.scale_log2);
          }
          warpgroup_fence_operand(acc_s);
        } else if constexpr (kV2) {
          // The softmax inside both arms of the mask branch: ptxas hoists the wait below to the
          // top of its basic block, so it must not share one with the exps.
          if (tile >= t.n_unmasked) {
            causal_mask(s_rc, cS_rc, t, tile * BN);
            softmax_step(s_rc, row_max, row_sum, alpha, p.scale_log2);
          } else {
            softmax_step(s_rc, row_max, row_sum, alpha, p.scale_log2);
          }
          warpgroup_fence_operand(acc_s);
        } else {
          if (tile >= t.n_unmasked) causal_mask(s_rc, cS_rc, t, tile * BN);
          softmax_step(s_rc, row_max, row_sum, alpha, p.scale_log2);
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        warpgroup_fence_operand(rP);
        release(&s.v_empty[v_stage]);
        next_v();
        rescale_rows(o_rc, alpha);
        convert_storage(acc_s, rP);
      };
      auto last_pv = [&] {  // KV tile n - visits (0 without a window): the last P V
        mbar_wait(&s.v_full[v_stage], v_phase);
        if (kOptions || n == 1) {
          zero_v_tail(t, n - visits(), v_stage, false, cute::true_type{});
        }
        wgmma<false>(mma_pv, rP, tOrV(_, _, _, v_stage), acc_o);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        warpgroup_fence_operand(rP);
        release(&s.v_empty[v_stage]);
        next_v();
      };
      for (int i = 1; i < visits(); ++i) step(i);
      last_pv();
    }

    // Epilogue, per warpgroup (its 64 rows of sO).
    float lse[kRows];
    if constexpr (kOptions) {
      softmax_finalize(o_rc, row_max, row_sum, p.scale, p.out_scale, lse,
                       p.sinks != nullptr ? p.sinks[t.head] : -INFINITY);
    } else {
      softmax_finalize(o_rc, row_max, row_sum, p.scale, p.out_scale, lse);
    }
    named_sync(kBarWarpgroup0 + wg, 128);  // done reading sO for the previous tile
    {
      Tensor o_frag = make_tensor<T>(acc_o.layout());
      convert_storage(acc_o, o_frag);
      auto copy_o =
          make_tiled_copy_C(Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, T>{}, mma_pv);
      auto thr_copy_o = copy_o.get_thread_slice(ct);
      copy(copy_o, thr_copy_o.retile_S(o_frag), thr_copy_o.partition_D(sO));
    }
    if (p.lse != nullptr) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(cO_rc(r, 0));
        if (get<1>(cO_rc(r, 0)) == 0 && row < t.rows) {
          p.lse[int64_t(t.q_row0 + row) * p.num_heads + t.head] = lse[r];
        }
      }
    }
    named_sync(kBarWarpgroup0 + wg, 128);
    T* out = static_cast<T*>(p.out) + int64_t(t.q_row0) * p.out_stride + t.head * D;
    for (int c = ct % 128; c < 64 * (D / 8); c += 128) {
      const int row = 64 * wg + c / (D / 8), col = c % (D / 8) * 8;
      if (row < t.rows) {
        *reinterpret_cast<uint4*>(out + row * p.out_stride + col) =
            *reinterpret_cast<const uint4*>(&sO(row, col));
      }
    }
  }
}

#endif  // sm_90a or host

template <class Tr, bool kV2, bool kOptions>
__device__ __forceinline__ void flash_prefill_sm90_body(const Sm90Params& params) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // never launched: path 2 is chosen on sm_90 only
#else
  using Storage = typename Tr::SharedStorage;
  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle is a function of the address: buffers start on 1024-byte boundaries.
  Storage& s = *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                           ~uintptr_t(1023));
  if (threadIdx.x == 0) {
    mbar_init(&s.q_full, 1);
    mbar_init(&s.q_empty, Tr::kConsumerWarps);
    for (int i = 0; i < Tr::kStages; ++i) {
      mbar_init(&s.k_full[i], 1);
      mbar_init(&s.k_empty[i], Tr::kConsumerWarps);
      mbar_init(&s.v_full[i], 1);
      mbar_init(&s.v_empty[i], Tr::kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (threadIdx.x < 32) producer<Tr, kV2, kOptions>(params, s);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    consumer<Tr, kV2, kOptions>(params, s);
  }
#endif
}

template <class Tr, bool kV2>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_prefill_sm90_kernel(const __grid_constant__ Sm90Params params) {
  flash_prefill_sm90_body<Tr, kV2, false>(params);
}

// The attention options (window, soft-cap, sinks; v2 schedule): a kernel of its own, so the
// plain ones carry none of it. Selected by the sm90_options variant only until a GPU run has
// verified it (the dispatcher sends calls with an option to path 1 otherwise).
template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    flash_prefill_sm90_options_kernel(const __grid_constant__ Sm90Params params) {
  flash_prefill_sm90_body<Tr, true, true>(params);
}

// ---- host --------------------------------------------------------------------------------------

// A rank-3 tensor map with 128-byte swizzle; dims and box innermost first, strides in bytes.
CUtensorMap tensor_map(CUtensorMapDataType type, const void* base, const uint64_t (&dims)[3],
                       const uint64_t (&strides)[2], const uint32_t (&box)[3]) {
  return tma::tensor_map("flash_prefill", type, base, dims, strides, box);
}

template <class Tr, bool kV2, bool kOptions = false>
void launch(const KernelParams& p, int device, cudaStream_t stream) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim;
  const CUtensorMapDataType type =
      Tr::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const uint64_t e = sizeof(T);
  const uint32_t box_rows = uint32_t(std::min(p.block_size, Tr::kBlockN));
  Sm90Params params;
  params.p = p;
  params.tma_q = tensor_map(type, p.q, {D, uint64_t(p.num_heads), uint64_t(p.total_q)},
                            {D * e, uint64_t(p.q_stride) * e}, {64, 1, kBlockM});
  const uint64_t planes = uint64_t(p.num_blocks) * p.num_kv_heads;
  const uint64_t page_dims[3] = {D, uint64_t(p.block_size), planes};
  const uint64_t page_strides[2] = {D * e, uint64_t(p.block_size) * D * e};
  params.tma_k = tensor_map(type, p.k_cache, page_dims, page_strides, {64, box_rows, 1});
  params.tma_v = tensor_map(type, p.v_cache, page_dims, page_strides, {64, box_rows, 1});

  auto kernel = flash_prefill_sm90_kernel<Tr, kV2>;
  if constexpr (kOptions) kernel = flash_prefill_sm90_options_kernel<Tr>;
  const int grid = persistent_grid(reinterpret_cast<const void*>(kernel), Tr::kThreads,
                                   Tr::kSmemBytes, device,
                                   max_tiles(p.total_q, p.batch) * p.num_heads);
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(params);
  PK_CHECK_LAUNCH("flash_prefill_sm90_kernel");
}

template <class T, bool kV2, bool kOptions = false>
void launch_dtype(const KernelParams& p, int device, cudaStream_t stream) {
  if (p.head_dim == 64) {
    launch<Sm90Traits<T, 64>, kV2, kOptions>(p, device, stream);
  } else {
    launch<Sm90Traits<T, 128>, kV2, kOptions>(p, device, stream);
  }
}

template <bool kV2, bool kOptions = false>
void launch_variant(const KernelParams& p, int device, cudaStream_t stream) {
  if (p.dtype == DType::kFloat16) {
    launch_dtype<cutlass::half_t, kV2, kOptions>(p, device, stream);
  } else {
    launch_dtype<cutlass::bfloat16_t, kV2, kOptions>(p, device, stream);
  }
}

}  // namespace

bool flash_prefill_sm90_supports(const FlashPrefillParams& p) {
  const int bs = p.block_size;
  // Whole 8-row swizzle atoms per box, and boxes that tile a 128-key tile exactly.
  const bool pages = bs % 8 == 0 && bs <= 256 && (128 % bs == 0 || bs % 128 == 0);
  return !p.fp8_cache && pages && p.q_stride % 8 == 0 && aligned16(p.q) && aligned16(p.k_cache) &&
         aligned16(p.v_cache) && p.num_blocks * p.num_kv_heads < (int64_t(1) << 31);
}

void launch_flash_prefill_sm90(const KernelParams& p, int device, cudaStream_t stream) {
  if (p.window > 0 || p.soft_cap > 0.f || p.sinks != nullptr) {
    launch_variant<true, true>(p, device, stream);  // (the sm90_options variant only)
  } else if (p.variant == kFlashVariantV1) {
    launch_variant<false>(p, device, stream);
  } else {
    launch_variant<true>(p, device, stream);
  }
}

}  // namespace flash
}  // namespace pagedkern
