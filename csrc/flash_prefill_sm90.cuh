// flash_prefill path 2 (flash_prefill_sm90.cu): tile shapes, wgmma atoms and shared-memory
// layouts, in a header so the host layout check (tests/flash_prefill_layouts.cu) verifies the
// very types the kernel uses.
#pragma once

// cute/tensor.hpp first: its algorithms need the atoms declared in a fixed order.
#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/numeric_types.h>

#include <cuda.h>  // CUtensorMap (header only: the encoder comes from the driver at run time)

#include "flash_prefill_common.cuh"

namespace pagedkern {
namespace flash {

using namespace cute;

template <class T_, int kHeadDim_>
struct Sm90Traits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = 128;
  // K/V ring depth: what fits beside Q and the output staging buffer (227 KiB per CTA).
  static constexpr int kStages = kHeadDim == 64 ? 4 : 2;
  static constexpr int kConsumers = 2;  // math warpgroups, 64 query rows each
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kConsumerWarps = 4 * kConsumers;
  static constexpr int kSlabs = kHeadDim / 64;  // 64-column (128-byte) slabs of a row

  static constexpr bool kHalf = std::is_same_v<T, cutlass::half_t>;
  using MmaQK = std::conditional_t<kHalf, SM90_64x128x16_F32F16F16_SS<GMMA::Major::K, GMMA::Major::K>,
                                   SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>>;
  // P (registers, K-major) x V: V's tile is [keys, D] with D contiguous, i.e. MN-major for B.
  using MmaPV = std::conditional_t<
      kHeadDim == 64,
      std::conditional_t<kHalf, SM90_64x64x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>,
                         SM90_64x64x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>>,
      std::conditional_t<kHalf, SM90_64x128x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>,
                         SM90_64x128x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>>>;
  using TiledMmaQK = decltype(make_tiled_mma(MmaQK{}, Layout<Shape<Int<kConsumers>, _1, _1>>{}));
  using TiledMmaPV = decltype(make_tiled_mma(MmaPV{}, Layout<Shape<Int<kConsumers>, _1, _1>>{}));

  // 128-byte swizzled tiles (the layout TMA writes with SWIZZLE_128B): rows of one 64-column slab
  // are 128 B apart, slabs follow each other, 8-row groups are 1024-byte swizzle atoms.
  using SmemLayoutQ =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                              Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // The same V bytes seen as V^T (D x keys), MN-major for the P V product.
  using SmemLayoutVt =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                             Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{}));

  static constexpr int kQElems = kBlockM * kHeadDim;
  static constexpr int kKVTileElems = kBlockN * kHeadDim;

  struct alignas(1024) SharedStorage {
    T q[kQElems];
    T k[kStages * kKVTileElems];
    T v[kStages * kKVTileElems];
    T o[kQElems];  // output staging; separate from q so the next tile's Q load overlaps it
    uint64_t q_full, q_empty;
    uint64_t k_full[kStages], k_empty[kStages], v_full[kStages], v_empty[kStages];
    WorkTile tile;  // the current work tile, published by the producer with q_full
    int work;       // its index, or -1: no more work
  };
  static constexpr size_t kSmemBytes = sizeof(SharedStorage) + 1024;  // + manual 1 KiB alignment

  static_assert(kHeadDim == 64 || kHeadDim == 128);
  static_assert(size(TiledMmaQK{}) == 128 * kConsumers && size(TiledMmaPV{}) == 128 * kConsumers);
  static_assert(kBlockM == 64 * kConsumers, "one 64-row wgmma per consumer warpgroup");
  static_assert(cosize(SmemLayoutQ{}) == kQElems);
  static_assert(cosize(SmemLayoutKV{}) == kStages * kKVTileElems);
  static_assert(cosize(SmemLayoutVt{}) == kStages * kKVTileElems);
  static_assert(kQElems * sizeof(T) % 1024 == 0 && kKVTileElems * sizeof(T) % 1024 == 0,
                "every buffer starts on a 1024-byte swizzle atom");
  static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KiB a Hopper CTA may use");
};

// ---- Hopper synchronisation and TMA primitives (PTX) ----------------------------------------
// Compiled only where they exist: the sm_90a pass (and the host pass, which skips device code).
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Named barriers (0 is __syncthreads): ping-pong between the consumer warpgroups, and one per
// consumer warpgroup for its own shared-memory hand-offs.
constexpr int kBarTurn0 = 1;       // + warpgroup: "your turn to issue GEMMs"
constexpr int kBarWarpgroup0 = 3;  // + warpgroup
constexpr int kBarVTail = 5;       // v2: V's rows past seq_len are zeroed (one-tile items)

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
// Arrives and expects `bytes` more bytes of TMA transactions before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Waits until the phase with this parity has completed (a fresh barrier counts its phase -1, of
// parity 1, as completed: producers start by waiting on parity 1 of their empty barriers).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Generic-proxy shared-memory writes become visible to wgmma (async proxy).
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
#endif

}  // namespace flash
}  // namespace pagedkern
