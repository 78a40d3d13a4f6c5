// flash_prefill path 1 (flash_prefill_sm80.cu): tile shapes and layouts, in a header so the host
// layout check (tests/flash_prefill_layouts.cu) verifies the very types the kernel uses.
#pragma once

// cute/tensor.hpp first: its algorithms need the atoms declared in a fixed order.
#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/numeric_types.h>

#include "flash_prefill_common.cuh"

namespace pagedkern {
namespace flash {

using namespace cute;

template <class T_, int kHeadDim_>
struct Sm80Traits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kHeadDim == 64 ? 128 : 64;
  static constexpr int kThreads = 128;
  using MmaOp = std::conditional_t<std::is_same_v<T, cutlass::half_t>,
                                   SM80_16x8x16_F32F16F16F32_TN, SM80_16x8x16_F32BF16BF16F32_TN>;
  using TiledMma = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<_4, _1, _1>>, Tile<_64, _16, _16>>;
  // 8 rows of 64 elements (128 B), 16-byte chunk index xor row.
  using SmemAtom = decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V^T (D x kBlockN) as a view of the V buffer, for ldmatrix.trans.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  // Global <-> shared, 16 bytes per thread and copy: thread t moves chunk t % 8 of each 64-column
  // slab of rows t / 8 + 16 m. In a swizzled buffer of R rows that chunk (slab k) sits at
  // chunk_offset(t) + m * 16 * 64 + k * R * 64 elements (the swizzle only permutes chunks
  // within a row, by row % 8, which is the same for every m).
  static constexpr int kChunkCols = 8;
  static CUTE_HOST_DEVICE int chunk_row(int tid) { return tid / 8; }
  static CUTE_HOST_DEVICE int chunk_col(int tid) { return tid % 8 * kChunkCols; }
  static CUTE_HOST_DEVICE int chunk_offset(int tid) {
    const int row = tid / 8;
    return row * 64 + ((tid % 8) ^ (row % 8)) * kChunkCols;
  }
  static constexpr int kQElems = kBlockM * kHeadDim;
  static constexpr int kKVElems = kBlockN * kHeadDim;
  static constexpr size_t smem_bytes(int stages) {
    return sizeof(T) * size_t(kQElems + 2 * stages * kKVElems);
  }

  static_assert(kHeadDim == 64 || kHeadDim == 128);
  static_assert(size(TiledMma{}) == kThreads);
  static_assert(cosize(SmemLayoutQ{}) == kQElems && cosize(SmemLayoutKV{}) == kKVElems);
  static_assert(kBlockM % 64 == 0 && kBlockN % 16 == 0, "whole copy passes and MMA tiles");
};

}  // namespace flash
}  // namespace pagedkern
