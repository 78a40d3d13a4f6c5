// What the AVX-512 int4 kernels (dot_avx512.cpp's VNNI tiles, dot_amx.cpp's AMX tiles) share,
// so both give the same bits: where a weight tile starts, a block's 16 scales d and mins m as
// fp32 lanes (int4's fp16 d and m; int4_sym's fp16 d and m = -8 d in fp32, the stored m's
// bits; int4_zp's fp16 d and m = -(float(z) d); int4_k's float(c) times its super-block's fp32
// d or dm), and the fold of a block's
// int32 sums into a row's fp32 accumulator.

#pragma once

#include "quant_gemv.h"

#if QUANT_GEMV_X86
#include <immintrin.h>

namespace pagedkern_cpu {

#define INT4_BLOCK_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

// 16 bytes at p (unsigned) as fp32 lanes
INT4_BLOCK_TARGET inline __m512 u8_floats(const uint8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// F: kInt4, kInt4Sym, kInt4Zp or kInt4K. nibbles: the block's 256 nibble bytes (int4, int4_sym
// and int4_zp: its scales follow them); kb: int4_k's block.
template <int F>
INT4_BLOCK_TARGET inline void int4_block_scales(const uint8_t* nibbles, const Int4KBlock& kb,
                                                 __m512& d, __m512& mn) {
  if constexpr (F == kInt4K) {
    d = _mm512_mul_ps(u8_floats(kb.cs), _mm512_loadu_ps(kb.d));
    mn = _mm512_mul_ps(u8_floats(kb.cm), _mm512_loadu_ps(kb.dm));
  } else {
    const uint8_t* scales = nibbles + kRows * kBlock / 2;
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
    if constexpr (F == kInt4Sym) {
      mn = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    } else if constexpr (F == kInt4Zp) {  // -(z d): the sign flipped as bits (AVX512F has no xor_ps)
      const __m512 zd = _mm512_mul_ps(u8_floats(scales + 32), d);
      mn = _mm512_castsi512_ps(
          _mm512_xor_si512(_mm512_castps_si512(zd), _mm512_set1_epi32(int(0x80000000u))));
    } else {
      mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
    }
  }
}

// Bytes a block takes in an int4, int4_sym, int4_zp or int5_g32 tile (int4_k: its share of a
// super-block)
template <int F>
constexpr int kInt4BlockBytes = F == kInt4Sym   ? kInt4SymTileBlockBytes
                                : F == kInt4Zp  ? kInt4ZpTileBlockBytes
                                : F == kInt4K   ? kInt4KBlockBytes
                                : F == kInt5G32 ? kInt5TileBlockBytes
                                                : kInt4TileBlockBytes;

// Weight tile `tile`'s first byte
template <int F>
inline const uint8_t* int4_tile_base(const Args& a, int tile) {
  const size_t bytes =
      F == kInt4K ? int4k_tile_bytes(a.k) : size_t(a.k / kBlock) * kInt4BlockBytes<F>;
  return a.packed + size_t(tile) * bytes;
}

// P activation planes' int32 sums of one block (plane 0 the high byte) as one
INT4_BLOCK_TARGET inline __m512i int4_planes(__m512i plane0, __m512i plane1, int planes) {
  return planes == 2 ? _mm512_add_epi32(_mm512_slli_epi32(plane0, 8), plane1) : plane0;
}

// acc + d dx isum + m sx: row r's block b (the activation's scale dx and dx * its sum, sx)
INT4_BLOCK_TARGET inline __m512 int4_fold(__m512 acc, __m512 d, __m512 mn, __m512i isum,
                                           const QuantizedRows& xq, size_t at) {
  const __m512 dx = _mm512_set1_ps(xq.dx[at]), sx = _mm512_set1_ps(xq.sx[at]);
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum), acc);
  return _mm512_fmadd_ps(mn, sx, acc);
}

#undef INT4_BLOCK_TARGET

}  // namespace pagedkern_cpu
#endif
