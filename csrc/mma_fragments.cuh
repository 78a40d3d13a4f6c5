// Warp-level tensor-core fragments for m16n8k16 (fp16 / bf16 in, fp32 accumulate): ldmatrix,
// movmatrix and mma.sync. On the device each is one PTX instruction; elsewhere (the CPU emulator
// in tests/emulator, which runs threads as coroutines and supports shuffles but no inline PTX)
// each is spelled out with warp shuffles from the fragment layouts of the PTX ISA, so a kernel
// built on them runs, index maps included, under the emulator.
//
// Layouts (g = lane / 4, c = lane % 4; a 32-bit register holds two 16-bit elements, the lower
// index in the low half):
//   A 16x16 (row-major, m x k): a[0] = (g, 2c..2c+1), a[1] = (g+8, 2c..), a[2] = (g, 2c+8..),
//                               a[3] = (g+8, 2c+8..)
//   B 16x8  (k x n, "col"):     b[0] = (k 2c..2c+1, n g), b[1] = (k 2c+8.., n g)
//   C 16x8  (fp32, m x n):      c[0..1] = (g, 2c..2c+1), c[2..3] = (g+8, 2c..2c+1)
//   ldmatrix .x4: lanes 8j..8j+7 give the row addresses of 8x8 matrix j (16 bytes each); matrix
//     j lands in r[j] as row g, columns 2c..2c+1 (.trans: the transposed matrix).
//   movmatrix .trans: an 8x8 matrix held as one register per lane (row g, columns 2c..) becomes
//     its transpose in the same layout.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "device.cuh"
#include "fp8.cuh"

namespace pagedkern {
namespace mma {

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

#ifdef __CUDA_ARCH__

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices from shared memory; this lane gives the address of row lane % 8 of
// matrix lane / 8.
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(row)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(row)));
  }
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// c += a b (m16n8k16, fp32 accumulators).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

#else  // the same operations from warp shuffles (the CPU emulator)

template <typename T>
__device__ __forceinline__ float half_of(uint32_t x, int i) {
  const uint16_t bits = uint16_t(x >> (16 * i));
  T v;
  std::memcpy(&v, &bits, 2);
  return to_float(v);
}

template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const int lane = threadIdx.x % 32;
  for (int j = 0; j < 4; ++j) {
    uint32_t e[2];
    for (int i = 0; i < 2; ++i) {
      // Not transposed: element (g, 2c + i) of matrix j is column 2c + i of row g's address.
      // Transposed: element (g, 2c + i) is column g of row 2c + i.
      const int src = kTrans ? 8 * j + 2 * (lane % 4) + i : 8 * j + lane / 4;
      const auto address = static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(row));
      const auto* p =
          reinterpret_cast<const uint16_t*>(uintptr_t(__shfl_sync(0xffffffffu, address, src)));
      e[i] = p[kTrans ? lane / 4 : 2 * (lane % 4) + i];
    }
    r[j] = e[0] | (e[1] << 16);
  }
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  // Element (g, 2c + i) of the transpose is (2c + i, g), held by lane 4 (2c + i) + g / 2.
  const int lane = threadIdx.x % 32;
  uint32_t e[2];
  for (int i = 0; i < 2; ++i) {
    const uint32_t w = __shfl_sync(0xffffffffu, x, 4 * (2 * (lane % 4) + i) + (lane / 4) / 2);
    e[i] = (w >> (16 * ((lane / 4) % 2))) & 0xffffu;
  }
  return e[0] | (e[1] << 16);
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  for (int hi = 0; hi < 2; ++hi) {    // k in [8 hi, 8 hi + 8)
    for (int kq = 0; kq < 4; ++kq) {  // k = 8 hi + 2 kq + e, held by lanes with c = kq
      const uint32_t row_lo = __shfl_sync(0xffffffffu, a[2 * hi], 4 * g + kq);      // row g
      const uint32_t row_hi = __shfl_sync(0xffffffffu, a[2 * hi + 1], 4 * g + kq);  // row g+8
      const uint32_t col0 = __shfl_sync(0xffffffffu, b[hi], 4 * (2 * q) + kq);      // col 2c
      const uint32_t col1 = __shfl_sync(0xffffffffu, b[hi], 4 * (2 * q + 1) + kq);  // col 2c+1
      for (int e = 0; e < 2; ++e) {
        c[0] += half_of<T>(row_lo, e) * half_of<T>(col0, e);
        c[1] += half_of<T>(row_lo, e) * half_of<T>(col1, e);
        c[2] += half_of<T>(row_hi, e) * half_of<T>(col0, e);
        c[3] += half_of<T>(row_hi, e) * half_of<T>(col1, e);
      }
    }
  }
}

#endif

// ---- fp8 (E4M3) pages: fragments for the f16 mma (paged_attention_mma.cuh) ----

// Two elements of q as f16x2 bits for the f16 mma of the fp8 cache: as is for __half; bf16
// rounded to f16, saturating at +-65504 (see the header comment).
template <typename T>
__device__ __forceinline__ uint32_t q_pair_as_half2(uint32_t x);
template <>
__device__ __forceinline__ uint32_t q_pair_as_half2<__half>(uint32_t x) {
  return x;
}
template <>
__device__ __forceinline__ uint32_t q_pair_as_half2<__nv_bfloat16>(uint32_t x) {
  constexpr float kMax = 65504.f;
  const float lo = fminf(fmaxf(__uint_as_float(x << 16), -kMax), kMax);
  const float hi = fminf(fmaxf(__uint_as_float(x & 0xffff0000u), -kMax), kMax);
  return pack2<__half>(lo, hi);
}

// Two E4M3 bytes (the low / high half of x) as the f16x2 an A fragment register holds.
__device__ __forceinline__ uint32_t e4m3_lo(uint32_t x) { return e4m3x2_to_half2_bits(uint16_t(x)); }
__device__ __forceinline__ uint32_t e4m3_hi(uint32_t x) {
  return e4m3x2_to_half2_bits(uint16_t(x >> 16));
}

}  // namespace mma
}  // namespace pagedkern
