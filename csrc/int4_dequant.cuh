// Dequantizing int4 weights in registers for mma.sync B fragments (Marlin's magic-number trick):
// one definition for quant_gemm_marlin.cu and moe_gemm_quant.cu, so both round alike.
#pragma once

#include <cstdint>
#include <type_traits>

#include "device.cuh"
#include "mma_fragments.cuh"

namespace pagedkern {

template <typename T>
struct Int4Magic;
template <>
struct Int4Magic<__half> {
  static constexpr uint32_t kBits = 0x64006400u;  // 1024.0 in both halves
};
template <>
struct Int4Magic<__nv_bfloat16> {
  static constexpr uint32_t kBits = 0x43004300u;  // 128.0 in both halves
};

// The pair (q at bits 0-3, q at bits 16-19 of `word`) as T2 bits: round_T(q * s + mn) each.
// On the device: one LOP3 ((word & 0x000f000f) | magic: the pair magic + q exactly), HSUB2 of
// the magic (q exactly), one HFMA2 (rounded once). Under the CPU emulator (no inline PTX) the
// same value from a portable fp32 fma rounded to T.
template <typename T>
__device__ __forceinline__ uint32_t dequant_int4_pair(uint32_t word, T s, T mn) {
#ifdef __CUDA_ARCH__
  uint32_t biased;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;"
      : "=r"(biased)
      : "r"(word), "n"(0x000f000f), "n"(Int4Magic<T>::kBits));
  const uint32_t magic = Int4Magic<T>::kBits;
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 q = __hsub2(*reinterpret_cast<const __half2*>(&biased),
                              *reinterpret_cast<const __half2*>(&magic));
    const __half2 w = __hfma2(q, __half2half2(s), __half2half2(mn));
    return *reinterpret_cast<const uint32_t*>(&w);
  } else {
    const __nv_bfloat162 q = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&biased),
                                     *reinterpret_cast<const __nv_bfloat162*>(&magic));
    const __nv_bfloat162 w = __hfma2(q, __bfloat162bfloat162(s), __bfloat162bfloat162(mn));
    return *reinterpret_cast<const uint32_t*>(&w);
  }
#else
  const float sf = to_float(s), mf = to_float(mn);
  return mma::pack2<T>(fmaf(float(word & 15u), sf, mf), fmaf(float((word >> 16) & 15u), sf, mf));
#endif
}

}  // namespace pagedkern
