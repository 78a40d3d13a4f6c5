// The sm_90a grouped GEMM of fused_moe (moe_gemm_sm90.cu): tile shapes, the wgmma atom, the
// shared-memory layouts and the gather's cp.async, in a header so the host layout check
// (tests/moe_gemm_sm90_layouts.cu) verifies the very types the kernel uses. The TMA, mbarrier
// and fence primitives are flash_prefill_sm90.cuh's (the ones its H200 runs verified).
#pragma once

#include "flash_prefill_sm90.cuh"

namespace pagedkern {
namespace moe_sm90 {

using namespace cute;

template <class T_, int kConsumers_>
struct Traits {
  using T = T_;  // cutlass::half_t or cutlass::bfloat16_t
  static constexpr int kConsumers = kConsumers_;  // math warpgroups, 128 B rows each
  static constexpr int kBM = 64;      // rows per CTA: one wgmma.m64, the grouping's tile
  static constexpr int kBK = 64;      // K per stage: one 128-byte swizzled row
  static constexpr int kBRows = 128;  // B rows per consumer: wgmma n128
  // gate_up: a consumer's 128 rows are 64 gate rows then the same 64 columns' up rows
  static constexpr int kGatedCols = kBRows / 2;
  // ring depth: what fits in the 227 KiB a Hopper CTA may use
  static constexpr int kStages = kConsumers == 1 ? 8 : 5;
  static constexpr int kThreads = 128 * (kConsumers + 1);  // + the producer warpgroup
  static constexpr int kGatherThreads = 128;                // the producer warpgroup
  // gate_up's A rows, gathered by cp.async: producer thread pt copies the 16-byte chunk
  // gather_chunk(pt) of rows gather_row(pt, i), i < kGatherRows (a row's 8 chunks by 8 lanes).
  static constexpr int kGatherRows = kBM * (kBK / 8) / kGatherThreads;
  CUTE_HOST_DEVICE static constexpr int gather_chunk(int pt) { return pt % 8; }
  CUTE_HOST_DEVICE static constexpr int gather_row(int pt, int i) {
    return pt / 8 + (kGatherThreads / 8) * i;
  }

  static constexpr bool kHalf = std::is_same_v<T, cutlass::half_t>;
  using Mma = std::conditional_t<kHalf, SM90_64x128x16_F32F16F16_SS<GMMA::Major::K, GMMA::Major::K>,
                                 SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>>;
  using TiledMma = decltype(make_tiled_mma(Mma{}));  // one warpgroup

  // 128-byte swizzled tiles, K-major (the layout TMA writes with SWIZZLE_128B): a row's 64
  // elements are 128 bytes, 8-row groups are 1024-byte swizzle atoms, stages follow each other.
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                             Shape<Int<kBM>, Int<kBK>, Int<kStages>>{}));
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                             Shape<Int<kBRows>, Int<kBK>, Int<kStages>>{}));
  static constexpr int kATileElems = kBM * kBK;
  static constexpr int kBTileElems = kBRows * kBK;

  struct alignas(1024) SharedStorage {
    T a[kStages * kATileElems];
    T b[kConsumers][kStages * kBTileElems];  // each consumer's own B rows
    uint64_t full[kStages], empty[kStages];
    int32_t row_pair[kBM];  // the pair of each row, -1 for padding
  };
  static constexpr size_t kSmemBytes = sizeof(SharedStorage) + 1024;  // + manual 1 KiB alignment

  static_assert(kConsumers == 1 || kConsumers == 2);
  static_assert(size(TiledMma{}) == 128);
  static_assert(cosize(SmemLayoutA{}) == kStages * kATileElems);
  static_assert(cosize(SmemLayoutB{}) == kStages * kBTileElems);
  static_assert(kATileElems * sizeof(T) % 1024 == 0 && kBTileElems * sizeof(T) % 1024 == 0,
                "every stage starts on a 1024-byte swizzle atom");
  static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KiB a Hopper CTA may use");
};

// ---- the gather's cp.async and the wgmma batch (sm_90a pass and host pass only) --------------
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
using flash::smem_u32;

// 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros (src is not read then).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src),
               "r"(src_bytes)
               : "memory");
}
// One arrival on `bar` once this thread's cp.async copies so far have landed (counted in the
// barrier's expected arrivals: noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// acc += A B over one K stage, issued as one wgmma batch and not waited for.
template <class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma_ss(Mma& mma, const TA& a, const TB& b, TC& c) {
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) cute::gemm(mma, a(_, _, k), b(_, _, k), c);
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
}

#endif

}  // namespace moe_sm90
}  // namespace pagedkern
