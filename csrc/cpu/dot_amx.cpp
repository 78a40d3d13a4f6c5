// AMX tile kernels for every tile format: the int4 formats (int4, int4_sym, int4_k), int5_g32
// (Q5_0, Q5_1, Q5_K), int8 (a scale per channel), int8_g32 (Q8_0's blocks) and the formats
// with a scale per 16 along K (int8_g16, int6_g16, int6_k: Q6_K), on enough activation rows
// (prefill, large batches; gemv.cpp's amx_min_rows): the `avx512_amx` path. Fewer rows run
// the avx512_vnni kernels (dot_avx512.cpp).
//
// Design. Every integer dot of a block of 32 K is exact however it is summed, so a block's
// int32 sums from tdpbsud (signed activations x unsigned nibbles) or tdpbssd (x signed int8
// weights) equal the VNNI kernel's; the fp32 epilogue is that kernel's, op for op and block by
// block in order, so the two paths give the same bits.
// - A weight tile's blocks are unpacked once a call into AMX's B layout (8 rows of 16 columns x
//   4 K: the nibble planes' own dword order, low nibbles K 0-15, high 16-31) with their fp32
//   scales and mins, then reused by every group of 16 rows.
// - int5_g32's fifth bits (byte (r, i): k = 4j + i's at bit j) are in the B layout's byte order
//   too: K-quad j's row takes bit j of each byte as bit 4 of its codes (0..31, still unsigned).
// - int8's and the grouped int8 formats' stored blocks (codes q + 128, 8 K-quads x 16 rows x
//   4 K) are already the B layout: the unpack takes the bias off (tdpbssd's signed operand), so
//   the integer sums are the VNNI kernel's (which takes 128 sum(q) off instead), and copies the
//   group scales; int8's per-channel scales multiply the accumulators once, at the end, as
//   there. int6_g16 / int6_k's codes u = q + 32 (a nibble plane and a plane of 2-bit high
//   parts) unpack to the signed q, so their sums are the VNNI kernel's sum(u x) - 32 sum(x).
// - The group-16 formats run the tile loop over units of 16 K (A tiles 16 rows x 16 K, B tiles
//   4 K-quads): a block's two groups are a pair, each with its own sums, folded group by group
//   as the VNNI kernel folds them (fma(s_g dx, isum_g, acc)).
// - Per block and group: one B tile, one A tile a plane (16 rows x 32 K: 512 contiguous bytes
//   of the driver's grouped copy of the quantized rows, which measured 1.3x faster than
//   loading the rows in place, 2 KB and more apart), one tdpbsud a plane into a zeroed C,
//   stored and folded into 16 zmm accumulators (a row each, kept in registers) by the VNNI
//   kernel's epilogue.
// - Tiles: C0-C3 (16 x 16 int32: two units' planes, so two units' products are in flight
//   before the first is stored), B0, B1 (8 or 4 x 64), A0, A1 (16 x 32 or 16 int8). The configuration is
//   loaded at every call and released at its end (other code, such as a BLAS, uses the tiles
//   on the same threads with its own).

#include "int4_block_avx512.h"
#include "quant_gemv.h"

#if QUANT_GEMV_X86
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace pagedkern_cpu {
namespace {

#define AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,amx-tile,amx-int8")))

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kBBytes = kBlock * kRows;  // a block's B tile: 8 rows x 64 bytes

// The formats with a scale per 16 along K (two tile products a block)
constexpr bool group16(int format) {
  return format == kInt8G16 || format == kInt6G16 || format == kInt6K;
}

// The formats whose B tiles hold signed codes (tdpbssd); the others' are unsigned (tdpbsud)
constexpr bool signed_codes(int format) {
  return format == kInt8 || format == kInt8G32 || group16(format);
}

// unit_k: the K of one tile product (32, or 16 for the group-16 formats)
AMX_TARGET void configure(int unit_k) {
  TileConfig c;
  for (int t : {0, 1, 2, 3}) c.rows[t] = 16, c.colsb[t] = 64;  // C: 16 rows x 16 int32
  for (int t : {4, 5}) c.rows[t] = uint8_t(unit_k / 4), c.colsb[t] = 64;  // B: K / 4 x (16 x 4 K)
  for (int t : {6, 7}) c.rows[t] = 16, c.colsb[t] = uint16_t(unit_k);  // A: 16 rows x K int8
  // GCC's ldtilecfg builtin does not say it reads its operand, and the stores above were
  // dropped as dead (every tile then #UD): a compiler barrier keeps them
  __asm__ __volatile__("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// A tile's blocks as B tiles (b), and each block's 16 d and 16 m (int4_block_scales)
template <int F>
AMX_TARGET void unpack(const Args& a, int tile, uint8_t* b_tiles, float* dm) {
  constexpr bool K4 = F == kInt4K, Five = F == kInt5G32;
  const int blocks = a.k / kBlock;
  const uint8_t* base = int4_tile_base<F>(a, tile);
  const __m512i low = _mm512_set1_epi8(0x0F);
  Int4KCursor walk{base};
  for (int b = 0; b < blocks; ++b) {
    const Int4KBlock kb = K4 ? walk.next() : Int4KBlock{};
    const uint8_t* t = K4 ? kb.nibbles : base + size_t(b) * kInt4BlockBytes<F>;
    uint8_t* out = b_tiles + size_t(b) * kBBytes;
    for (int j = 0; j < 4; ++j) {
      const __m512i w = _mm512_loadu_si512(t + 64 * j);
      __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      if constexpr (Five) {  // bit j (K-quad j) and bit j + 4 (K-quad j + 4) to bit 4
        const __m512i fifth = _mm512_loadu_si512(t + kRows * kBlock / 2);
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(fifth, 4 - j), bit4));
        hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(fifth, j), bit4));
      }
      _mm512_storeu_si512(out + 64 * j, lo);
      _mm512_storeu_si512(out + 64 * (4 + j), hi);
    }
    __m512 d, mn;
    if constexpr (Five) {  // fp32 d and m after the codes and the fifth bits
      const float* scales = reinterpret_cast<const float*>(t + kRows * kBlock / 2 + kRows * 4);
      d = _mm512_loadu_ps(scales), mn = _mm512_loadu_ps(scales + kRows);
    } else {
      int4_block_scales<F>(t, kb, d, mn);
    }
    _mm512_storeu_ps(dm + 32 * b, d);
    _mm512_storeu_ps(dm + 32 * b + 16, mn);
  }
}

// int8's or the grouped int8 formats' blocks as B tiles (the codes' bias off) and the group
// scales (as d: 16 a unit of K, dm's 32 floats a unit)
template <int F>
AMX_TARGET void unpack_int8(const Args& a, int tile, uint8_t* b_tiles, float* dm) {
  constexpr int kBlockBytes = F == kInt8G32   ? int8_grouped_block_bytes(32)
                              : F == kInt8G16 ? int8_grouped_block_bytes(16)
                                              : kInt8TileBlockBytes;
  const int blocks = a.k / kBlock;
  const uint8_t* base = a.packed + size_t(tile) * blocks * kBlockBytes;
  const __m512i bias = _mm512_set1_epi8(char(kInt8Bias));
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* t = base + size_t(b) * kBlockBytes;
    for (int j = 0; j < kBBytes / 64; ++j)
      _mm512_storeu_si512(b_tiles + size_t(b) * kBBytes + 64 * j,
                          _mm512_xor_si512(_mm512_loadu_si512(t + 64 * j), bias));
    const float* scales = reinterpret_cast<const float*>(t + kBBytes);
    if constexpr (F == kInt8G32) _mm512_storeu_ps(dm + 32 * b, _mm512_loadu_ps(scales));
    if constexpr (F == kInt8G16)
      for (int g = 0; g < 2; ++g)
        _mm512_storeu_ps(dm + 32 * (2 * b + g), _mm512_loadu_ps(scales + kRows * g));
  }
}

// int6_g16's or int6_k's blocks as B tiles of the signed codes q = u - 32 (u: the low nibble,
// and the 2-bit high part of quad j at bits 2 (j / 2) of the second plane's quad j % 2, as
// dot_x86_256.inc's int6_quad reads them) and each group's 16 scales (int6_k: float(c) d, the
// product int6_g16 would store)
template <int F>
AMX_TARGET void unpack_int6(const Args& a, int tile, uint8_t* b_tiles, float* dm) {
  constexpr int kBlockBytes = F == kInt6K ? kInt6KBlockBytes : kInt6TileBlockBytes;
  const int blocks = a.k / kBlock;
  const uint8_t* base =
      a.packed + size_t(tile) * (F == kInt6K ? int6k_tile_bytes(a.k) : size_t(blocks) * kBlockBytes);
  const float* tile_d = int6k_d(base);  // int6_k's
  if constexpr (F == kInt6K) base = int6k_blocks(base, a.k);
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
  const __m512i bias = _mm512_set1_epi8(32);
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* t = base + size_t(b) * kBlockBytes;
    uint8_t* out = b_tiles + size_t(b) * kBBytes;
    for (int j = 0; j < 8; ++j) {
      const __m512i nib = _mm512_loadu_si512(t + 64 * (j % 4));
      const __m512i two = _mm512_loadu_si512(t + kRows * kBlock / 2 + 64 * (j % 2));
      const __m512i lo = _mm512_and_si512(j < 4 ? nib : _mm512_srli_epi16(nib, 4), low);
      const int up = 4 - 2 * (j / 2);  // the pair sits at bits 2 (j / 2)
      const __m512i hi = _mm512_and_si512(
          up > 0 ? _mm512_slli_epi16(two, up) : up < 0 ? _mm512_srli_epi16(two, -up) : two, high);
      _mm512_storeu_si512(out + 64 * j, _mm512_sub_epi8(_mm512_or_si512(lo, hi), bias));
    }
    for (int g = 0; g < 2; ++g) {
      __m512 s;
      if constexpr (F == kInt6K) {
        const int8_t* c = reinterpret_cast<const int8_t*>(t + kInt6CodeBytes) + kRows * g;
        const __m128i c16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
        s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c16)),
                          _mm512_loadu_ps(tile_d + kRows * (b / (kInt6KSuper / kBlock))));
      } else {
        s = _mm512_loadu_ps(reinterpret_cast<const float*>(t + kInt6CodeBytes) + kRows * g);
      }
      _mm512_storeu_ps(dm + 32 * (2 * b + g), s);
    }
  }
}

// A unit's int32 sums c[plane][row][column] (block b's, or one of its groups of 16) into the
// 16 rows' accumulators (int4_fold, as int4_tile folds; int8_g32 and the group-16 formats:
// s dx isum, as int8_grouped_rows and int6_rows fold; int8: dx isum, as int8_rows folds)
template <int P, int F>
AMX_TARGET __attribute__((always_inline)) inline void fold(__m512* acc, const int32_t (*c)[16][16],
                                                           const float* sc, const QuantizedRows& xq,
                                                           int g, int b) {
  const __m512 d = F == kInt8 ? _mm512_setzero_ps() : _mm512_loadu_ps(sc);  // (no block scales)
  const __m512 mn = signed_codes(F) ? _mm512_setzero_ps() : _mm512_loadu_ps(sc + 16);  // (no mins)
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    const __m512i isum =
        int4_planes(_mm512_load_si512(c[0][i]), _mm512_load_si512(c[P - 1][i]), P);
    if constexpr (F == kInt8) {
      const __m512 dx = _mm512_set1_ps(xq.dx[xq.at(g + i, b)]);
      acc[i] = _mm512_fmadd_ps(dx, _mm512_cvtepi32_ps(isum), acc[i]);
    } else if constexpr (signed_codes(F)) {  // int8_g32, the group-16 formats
      const __m512 dx = _mm512_set1_ps(xq.dx[xq.at(g + i, b)]);
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum), acc[i]);
    } else {
      acc[i] = int4_fold(acc[i], d, mn, isum, xq, xq.at(g + i, b));
    }
  }
}

// C += A B: activations signed; the weights unsigned codes, or int8's and int8_g32's signed (a
// macro: GCC's tile intrinsics spell their tile numbers into the assembly)
#define DOT_TILES(C, A, B) \
  if constexpr (signed_codes(F)) \
    _tile_dpbssd(C, A, B); \
  else \
    _tile_dpbsud(C, A, B)

template <int P, int F>
AMX_TARGET void tile_amx(const Args& a, int tile, int r0, int rc) {
  // whole groups of 16 rows the driver copied as tiles (group_rows); the rest on AVX-512 VNNI
  const QuantizedRows& xq = *a.xq;
  const int full = r0 % 16 ? 0 : std::min(rc, xq.grouped_rows - r0) / 16 * 16;
  if (full > 0) {
    // units of K a tile product: blocks, or the group-16 formats' groups
    constexpr int kUnitK = group16(F) ? 16 : kBlock, kPerBlock = kBlock / kUnitK;
    constexpr int kUnitBytes = kUnitK / 4 * 64;  // a unit's B tile
    const int blocks = a.k / kBlock, units = blocks * kPerBlock;
    thread_local std::vector<uint8_t> b_tiles;
    thread_local std::vector<float> dm;
    b_tiles.resize(size_t(blocks) * kBBytes);
    dm.resize(size_t(units) * 32);
    if constexpr (F == kInt6G16 || F == kInt6K)
      unpack_int6<F>(a, tile, b_tiles.data(), dm.data());
    else if constexpr (signed_codes(F))
      unpack_int8<F>(a, tile, b_tiles.data(), dm.data());
    else
      unpack<F>(a, tile, b_tiles.data(), dm.data());
    const uint8_t* bt = b_tiles.data();  // (a thread_local's address costs a call each use)
    const float* sc = dm.data();
    const int live = std::min(kRows, a.n - tile * kRows);
    const __mmask16 mask = __mmask16((1u << live) - 1);
    // int8's per-channel scales, applied to the sums at the end
    const __m512 scale =
        F == kInt8 ? _mm512_maskz_loadu_ps(mask, a.scales + tile * kRows) : _mm512_setzero_ps();
    // unit u's activation tile of plane p: its block's, from the unit's first K (the rows
    // kBlock bytes apart)
    const auto a_tile = [&](int g, int u, int p) {
      return xq.group_tile(g, u / kPerBlock, p) + kUnitK * (u % kPerBlock);
    };
    // two unit pairs' sums [pair][unit][plane]: a pair's fold reads what the tiles stored
    // one pair before (not the stores just issued)
    alignas(64) int32_t c[2][2][P][16][16];
    configure(kUnitK);
    for (int g = r0; g < r0 + full; g += 16) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int b = 0, cur = 0; b < units + 2; b += 2, cur ^= 1) {
        const int n = std::min(2, units - b);  // this pair's units (<= 0: none, fold only)
        if (n >= 1) {  // C0, C1: unit b's planes; C2, C3: unit b + 1's
          _tile_loadd(4, bt + size_t(b) * kUnitBytes, 64);
          _tile_zero(0);
          _tile_loadd(6, a_tile(g, b, 0), kBlock);
          DOT_TILES(0, 6, 4);
          if constexpr (P == 2) {
            _tile_zero(1);
            _tile_loadd(7, a_tile(g, b, 1), kBlock);
            DOT_TILES(1, 7, 4);
          }
        }
        if (n == 2) {
          _tile_loadd(5, bt + size_t(b + 1) * kUnitBytes, 64);
          _tile_zero(2);
          _tile_loadd(6, a_tile(g, b + 1, 0), kBlock);
          DOT_TILES(2, 6, 5);
          if constexpr (P == 2) {
            _tile_zero(3);
            _tile_loadd(7, a_tile(g, b + 1, 1), kBlock);
            DOT_TILES(3, 7, 5);
          }
        }
        if (b >= 2)  // the previous pair, in K order
          for (int h = 0; h < std::min(2, units - (b - 2)); ++h) {
            const int u = b - 2 + h;
            fold<P, F>(acc, c[cur ^ 1][h], sc + 32 * u, xq, g, u / kPerBlock);
          }
        if (n >= 1) {
          _tile_stored(0, c[cur][0][0], 64);
          if constexpr (P == 2) _tile_stored(1, c[cur][0][P - 1], 64);
        }
        if (n == 2) {
          _tile_stored(2, c[cur][1][0], 64);
          if constexpr (P == 2) _tile_stored(3, c[cur][1][P - 1], 64);
        }
      }
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        _mm512_mask_storeu_ps(a.y + (g + i) * a.y_stride + tile * kRows, mask,
                              F == kInt8 ? _mm512_mul_ps(acc[i], scale) : acc[i]);
    }
    _tile_release();
  }
  if (rc > full) avx512_tile(F, P)(a, tile, r0 + full, rc - full);
}

#undef DOT_TILES

}  // namespace

TileFn amx_tile(int format, int planes) {
  const bool two = planes == 2;
  switch (format) {
    case kInt4: return two ? tile_amx<2, kInt4> : tile_amx<1, kInt4>;
    case kInt4Sym: return two ? tile_amx<2, kInt4Sym> : tile_amx<1, kInt4Sym>;
    case kInt4Zp: return two ? tile_amx<2, kInt4Zp> : tile_amx<1, kInt4Zp>;
    case kInt5G32: return two ? tile_amx<2, kInt5G32> : tile_amx<1, kInt5G32>;
    case kInt8: return two ? tile_amx<2, kInt8> : tile_amx<1, kInt8>;
    case kInt8G32: return two ? tile_amx<2, kInt8G32> : tile_amx<1, kInt8G32>;
    case kInt8G16: return two ? tile_amx<2, kInt8G16> : tile_amx<1, kInt8G16>;
    case kInt6G16: return two ? tile_amx<2, kInt6G16> : tile_amx<1, kInt6G16>;
    case kInt6K: return two ? tile_amx<2, kInt6K> : tile_amx<1, kInt6K>;
    case kInt4K: return two ? tile_amx<2, kInt4K> : tile_amx<1, kInt4K>;
    default: return avx512_tile(format, planes);  // (no such format: as the VNNI path does)
  }
}

}  // namespace pagedkern_cpu
#else
namespace pagedkern_cpu {
TileFn amx_tile(int, int) { return nullptr; }
}  // namespace pagedkern_cpu
#endif
