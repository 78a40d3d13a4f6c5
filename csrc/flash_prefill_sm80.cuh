// flash_prefill path 1 (flash_prefill_sm80.cu): tile shapes and layouts, in a header so the host
// layout check (tests/flash_prefill_layouts.cu) verifies the very types the kernel uses.
#pragma once

// cute/tensor.hpp first: its algorithms need the atoms declared in a fixed order.
#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/numeric_types.h>
#include <cuda_fp8.h>

#include "flash_prefill_common.cuh"

namespace pagedkern {
namespace flash {

using namespace cute;

// T: q, out and the mma inputs (bf16/fp16); TCache: the K/V cache elements, T or
// cutlass::float_e4m3_t (fp8 pages, converted to T in shared memory before the fragments).
template <class T_, int kHeadDim_, class TCache_ = T_>
struct Sm80Traits {
  using T = T_;
  using TCache = TCache_;
  static constexpr bool kFp8 = std::is_same_v<TCache, cutlass::float_e4m3_t>;
  static_assert(kFp8 || std::is_same_v<TCache, T>, "a 16-bit cache is in q's dtype");
  static constexpr int kHeadDim = kHeadDim_;
  // Query rows per work item: the scheduler's 128-row tile, or at D = 256 each half of it (its
  // own work item): 64 x 256 fp32 output accumulators over 4 warps are 128 registers per thread,
  // as at D = 128, and Q + one K and V stage (96 KiB) fit the 99 KiB of sm_86/89 too.
  static constexpr int kBlockM = kHeadDim == 256 ? 64 : flash::kBlockM;
  static constexpr int kItemsPerTile = flash::kBlockM / kBlockM;
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
  // 16-bit K and V buffers the fragments read: one per stage, or for fp8 one each (the stages
  // are fp8 staging buffers, converted into it; see the fp8 mapping below).
  static constexpr int kBuffers16(int stages) { return kFp8 ? 1 : stages; }
  static constexpr size_t smem_bytes(int stages) {
    return sizeof(T) * size_t(kQElems + 2 * kBuffers16(stages) * kKVElems) +
           (kFp8 ? size_t(2) * stages * kKVElems : 0);
  }
  // fp8: byte offset of the staging buffer of K (is_v = 0) or V at `slot`, after Q and the two
  // 16-bit tiles, K and V of a slot side by side: a compile-time base plus slot * 2 tiles, so no
  // pointer has to stay live in a register through the persistent loop (two did, and spilled).
  static CUTE_HOST_DEVICE int fp8_stage_bytes(int is_v, int slot) {
    return int(sizeof(T)) * (kQElems + 2 * kKVElems) + (2 * slot + is_v) * kKVElems;
  }

  // ---- fp8 cache: the same 16-byte cp.async carry 16 elements ----------------------------------
  // Thread t copies 16-element chunk t % kFp8ChunksPerRow of rows t / kFp8ChunksPerRow +
  // kFp8RowsPerPass * m (m < kFp8Passes) into staging slot m * kThreads + t (16 bytes, its own:
  // consecutive threads, consecutive 16 bytes, no bank conflicts), and after its own cp.async
  // wait converts exactly those slots into the swizzled 16-bit tile (two 8-element chunks each),
  // so the conversion needs no barrier of its own: the kernel's existing barriers order it
  // against the readers of the 16-bit tile (flash_prefill_sm80.cu).
  static constexpr int kFp8ChunksPerRow = kHeadDim / 16;
  static constexpr int kFp8RowsPerPass = kThreads / kFp8ChunksPerRow;
  static constexpr int kFp8Passes = kBlockN / kFp8RowsPerPass;
  static CUTE_HOST_DEVICE int fp8_chunk_row(int tid) { return tid / kFp8ChunksPerRow; }
  static CUTE_HOST_DEVICE int fp8_chunk_col(int tid) { return tid % kFp8ChunksPerRow * 16; }
  // Byte offset of thread tid's pass-m chunk in a staging buffer (kKVElems bytes).
  static CUTE_HOST_DEVICE int fp8_stage_offset(int tid, int m) { return (m * kThreads + tid) * 16; }
  // Element offset of (row, col) in a swizzled [kBlockN, D] K/V buffer (== SmemLayoutKV).
  static CUTE_HOST_DEVICE int kv_offset(int row, int col) {
    return col / 64 * kBlockN * 64 + row * 64 + ((col % 64 / 8) ^ (row % 8)) * kChunkCols +
           col % 8;
  }
  // 8 E4M3 bytes (w0: elements 0..3, w1: 4..7) -> 8 elements of T, exactly (E4M3 has 3
  // mantissa bits and exponents 2^-9 .. 2^8: every value, NaN included, is an f16 and a bf16).
  // CUDA's cvt: the hardware F2FP unpack on sm_89+, a software path on sm_80 and on the host.
  static CUTE_HOST_DEVICE uint4 e4m3x8_to_16bit(uint32_t w0, uint32_t w1) {
    const uint32_t words[2] = {w0, w1};
    uint32_t out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>(words[i / 2] >> (16 * (i % 2)));
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
      if constexpr (std::is_same_v<T, cutlass::half_t>) {
        out[i] = uint32_t(h.x) | uint32_t(h.y) << 16;
      } else {
        const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(__half2(h)));
        out[i] = uint32_t(__bfloat16_as_ushort(b.x)) | uint32_t(__bfloat16_as_ushort(b.y)) << 16;
      }
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
  }
  // Thread tid's staged chunks (stage: a staging buffer) into the swizzled 16-bit tile. One
  // chunk at a time (unroll 1): 4 words in, 4 out live at once, next to the O accumulators.
  static CUTE_HOST_DEVICE void convert_staged(const uint8_t* stage, T* tile, int tid) {
#pragma unroll 1
    for (int m = 0; m < kFp8Passes; ++m) {
      const int row = fp8_chunk_row(tid) + kFp8RowsPerPass * m, col = fp8_chunk_col(tid);
      const uint4 in = *reinterpret_cast<const uint4*>(stage + fp8_stage_offset(tid, m));
      // Threads of an odd 64-column slab store their high 8 elements first: the 8 threads of a
      // 16-byte store phase then hit 8 distinct bank groups (D = 128; D = 64 is conflict-free
      // either way: a phase spans two rows of opposite swizzle parity).
      const bool swap = col / 64 % 2 == 1;
      const int first = col + (swap ? 8 : 0), second = col + (swap ? 0 : 8);
      *reinterpret_cast<uint4*>(tile + kv_offset(row, first)) =
          e4m3x8_to_16bit(swap ? in.z : in.x, swap ? in.w : in.y);
      *reinterpret_cast<uint4*>(tile + kv_offset(row, second)) =
          e4m3x8_to_16bit(swap ? in.x : in.z, swap ? in.y : in.w);
    }
  }

  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256);
  static_assert(kBlockM * kItemsPerTile == flash::kBlockM);
  static_assert(size(TiledMma{}) == kThreads);
  static_assert(cosize(SmemLayoutQ{}) == kQElems && cosize(SmemLayoutKV{}) == kKVElems);
  static_assert(kBlockM % 64 == 0 && kBlockN % 16 == 0, "whole copy passes and MMA tiles");
  static_assert(kBlockN % kFp8RowsPerPass == 0, "whole fp8 copy passes");
};

}  // namespace flash
}  // namespace pagedkern
