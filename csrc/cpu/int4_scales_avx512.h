// One block's 16 scales d and mins m as fp32 lanes, for the AVX-512 int4 kernels
// (dot_avx512.cpp's VNNI tiles, dot_amx.cpp's AMX tiles), formed alike so both give the same
// bits: int4's fp16 d and m; int4_sym's fp16 d and m = -8 d in fp32 (the stored m's bits);
// int4_k's float(c) times its super-block's fp32 d or dm.

#pragma once

#include "quant_gemv.h"

#if QUANT_GEMV_X86
#include <immintrin.h>

namespace pagedkern_cpu {

#define INT4_SCALES_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

// 16 bytes at p (unsigned) as fp32 lanes
INT4_SCALES_TARGET inline __m512 u8_floats(const uint8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// F: kInt4, kInt4Sym or kInt4K. nibbles: the block's 256 nibble bytes (int4 and int4_sym: its
// scales follow them); kb: int4_k's block.
template <int F>
INT4_SCALES_TARGET inline void int4_block_scales(const uint8_t* nibbles, const Int4KBlock& kb,
                                                 __m512& d, __m512& mn) {
  if constexpr (F == kInt4K) {
    d = _mm512_mul_ps(u8_floats(kb.cs), _mm512_loadu_ps(kb.d));
    mn = _mm512_mul_ps(u8_floats(kb.cm), _mm512_loadu_ps(kb.dm));
  } else {
    const uint8_t* scales = nibbles + kRows * kBlock / 2;
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
    mn = F == kInt4Sym
             ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f))
             : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
  }
}

#undef INT4_SCALES_TARGET

}  // namespace pagedkern_cpu
#endif
