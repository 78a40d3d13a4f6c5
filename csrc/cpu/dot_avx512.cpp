// AVX-512 VNNI tile kernels (int8, int4, int4_sym, int4_k; the other formats run the 256-bit
// body, dot_x86_256.inc, with EVEX vpdpbusd): a tile's 16 rows are one zmm of 32-bit lanes;
// up to kRowChunk activation rows share each weight load (prefill, batched decode), and at up
// to kRowChunk rows several tiles are read at once (int4_rows). vpdpbusd: u8 x s8: int4
// nibbles are u8 as they are, int8 weights are stored biased (q + 128) and the bias comes off
// as 128 * sum(q) a block.

#include "int4_block_avx512.h"
#include "quant_gemv.h"

#if QUANT_GEMV_X86
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace pagedkern_cpu {

// The formats without a 512-bit kernel: the 256-bit body with EVEX vpdpbusd (every AVX-512 VNNI
// CPU has it with VL; VEX AVX-VNNI came later), the same bits as the other paths
#define DOT256_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define DOT256_VNNI 2
#define DOT256_NS avx512_256
#include "dot_x86_256.inc"

namespace {

using avx512_256::in_chunks;
using avx512_256::streamed;

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

AVX512_TARGET inline __m512i x4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R rows from r0 of x against T int4-family weight tiles from `tile`, their blocks interleaved
// one by one, so one core reads T weight streams at once: its hardware prefetchers keep more
// lines in flight over several streams than over one (a batch-1 GEMV from DRAM on the Xeon,
// 1 thread: 10 GB/s at T = 1, 12.6-13 GB/s at T = 8; spans of 4 and 8 blocks a stream
// measured no faster than one stream). Each (tile, row) runs its blocks in order with the same
// operations whatever T and R, so the bits never depend on them.
// F: int4, int4_sym (no m stored, m = -8 d in fp32: the same bits as the stored m), int4_zp
// (m = -(float(z) d)) or int4_k (d and m as float(c) times the super-block's d / dm).
template <int P, int F, int R, int T>
AVX512_TARGET void int4_rows(const Args& a, int tile, int r0) {
  constexpr bool K4 = F == kInt4K;
  constexpr int kBlockBytes = kInt4BlockBytes<F>;
  const int blocks = a.k / kBlock;
  const QuantizedRows& xq = *a.xq;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* base[T];
  Int4KCursor walk[T];  // int4_k's
  __m512 acc[T][R];
  for (int s = 0; s < T; ++s) {
    base[s] = int4_tile_base<F>(a, tile + s), walk[s] = Int4KCursor{base[s]};
    for (int i = 0; i < R; ++i) acc[s][i] = _mm512_setzero_ps();
  }
  for (int b = 0; b < blocks; ++b)
    for (int s = 0; s < T; ++s) {
      const Int4KBlock kb = K4 ? walk[s].next() : Int4KBlock{};
      const uint8_t* t = K4 ? kb.nibbles : base[s] + size_t(b) * kBlockBytes;
      prefetch_ahead<kBlockBytes>(base[s] + size_t(b) * kBlockBytes);  // (int4_k: its share)
      __m512i wl[4], wh[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i w = _mm512_loadu_si512(t + 64 * j);
        wl[j] = _mm512_and_si512(w, low);
        wh[j] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      }
      __m512 d, mn;
      int4_block_scales<F>(t, kb, d, mn);
      for (int i = 0; i < R; ++i) {
        const int8_t* xb = xq.block(r0 + i, b);
        __m512i lo[P], hi[P];  // per plane: low-nibble and high-nibble chains
        for (int p = 0; p < P; ++p) lo[p] = hi[p] = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j)
          for (int p = 0; p < P; ++p) {
            lo[p] = _mm512_dpbusd_epi32(lo[p], wl[j], x4(xb + p * kBlock + 4 * j));
            hi[p] = _mm512_dpbusd_epi32(hi[p], wh[j], x4(xb + p * kBlock + 16 + 4 * j));
          }
        const __m512i isum = int4_planes(_mm512_add_epi32(lo[0], hi[0]),
                                         _mm512_add_epi32(lo[P - 1], hi[P - 1]), P);
        acc[s][i] = int4_fold(acc[s][i], d, mn, isum, xq, xq.at(r0 + i, b));
      }
    }
  for (int s = 0; s < T; ++s) {
    const int live = std::min(kRows, a.n - (tile + s) * kRows);
    const __mmask16 mask = __mmask16((1u << live) - 1);
    for (int i = 0; i < R; ++i)
      _mm512_mask_storeu_ps(a.y + (r0 + i) * a.y_stride + (tile + s) * kRows, mask, acc[s][i]);
  }
}

template <int P, int F>
AVX512_TARGET void int4_tile(const Args& a, int tile, int r0, int rc) {
  in_chunks<kRowChunk>(r0, rc, [&](auto rows, int r) {
    int4_rows<P, F, decltype(rows)::value, 1>(a, tile, r);
  });
}

// T x R accumulators: 8 tiles at one row, 4 at two, 2 at four
constexpr int kTiles512 = 8;

template <int P, int F>
AVX512_TARGET void int4_tiles(const Args& a, int t0, int t1, int r0, int rc) {
  streamed<kTiles512>(t0, t1, r0, rc, [&](auto rows, auto tiles, int r, int t) {
    int4_rows<P, F, decltype(rows)::value, decltype(tiles)::value>(a, t, r);
  });
}

// int8: R rows against T tiles from `tile` (int4_rows' interleave), the bias off each block
// as 128 * sum(q), each output times its channel's scale
template <int P, int R, int T>
AVX512_TARGET void int8_rows(const Args& a, int tile, int r0) {
  const int blocks = a.k / kBlock;
  const QuantizedRows& xq = *a.xq;
  const uint8_t* base[T];
  __m512 acc[T][R];
  for (int s = 0; s < T; ++s) {
    base[s] = a.packed + size_t(tile + s) * blocks * kInt8TileBlockBytes;
    for (int i = 0; i < R; ++i) acc[s][i] = _mm512_setzero_ps();
  }
  for (int b = 0; b < blocks; ++b)
    for (int s = 0; s < T; ++s) {
      const uint8_t* t = base[s] + size_t(b) * kInt8TileBlockBytes;
      prefetch_ahead<kInt8TileBlockBytes>(t);
      __m512i part[R][P];
      for (int i = 0; i < R; ++i)
        for (int p = 0; p < P; ++p) part[i][p] = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_loadu_si512(t + 64 * j);
        for (int i = 0; i < R; ++i)
          for (int p = 0; p < P; ++p)
            part[i][p] = _mm512_dpbusd_epi32(part[i][p], w,
                                             x4(xq.block(r0 + i, b) + p * kBlock + 4 * j));
      }
      for (int i = 0; i < R; ++i) {
        const size_t at = xq.at(r0 + i, b);
        __m512i isum = P == 2 ? _mm512_add_epi32(_mm512_slli_epi32(part[i][0], 8), part[i][P - 1])
                              : part[i][0];
        isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(kInt8Bias * xq.qsum[at]));
        acc[s][i] = _mm512_fmadd_ps(_mm512_set1_ps(xq.dx[at]), _mm512_cvtepi32_ps(isum), acc[s][i]);
      }
    }
  for (int s = 0; s < T; ++s) {
    const int live = std::min(kRows, a.n - (tile + s) * kRows);
    const __mmask16 mask = __mmask16((1u << live) - 1);
    const __m512 scale = _mm512_maskz_loadu_ps(mask, a.scales + (tile + s) * kRows);
    for (int i = 0; i < R; ++i)
      _mm512_mask_storeu_ps(a.y + (r0 + i) * a.y_stride + (tile + s) * kRows, mask,
                            _mm512_mul_ps(acc[s][i], scale));
  }
}

template <int P>
AVX512_TARGET void int8_tile(const Args& a, int tile, int r0, int rc) {
  in_chunks<kRowChunk>(r0, rc, [&](auto rows, int r) {
    int8_rows<P, decltype(rows)::value, 1>(a, tile, r);
  });
}

template <int P>
AVX512_TARGET void int8_tiles(const Args& a, int t0, int t1, int r0, int rc) {
  streamed<kTiles512>(t0, t1, r0, rc, [&](auto rows, auto tiles, int r, int t) {
    int8_rows<P, decltype(rows)::value, decltype(tiles)::value>(a, t, r);
  });
}

}  // namespace

TilesFn avx512_tiles(int format, int planes) {
  const bool two = planes == 2;
  switch (format) {
    case kInt4: return two ? int4_tiles<2, kInt4> : int4_tiles<1, kInt4>;
    case kInt4Sym: return two ? int4_tiles<2, kInt4Sym> : int4_tiles<1, kInt4Sym>;
    case kInt4Zp: return two ? int4_tiles<2, kInt4Zp> : int4_tiles<1, kInt4Zp>;
    case kInt4K: return two ? int4_tiles<2, kInt4K> : int4_tiles<1, kInt4K>;
    case kInt8: return two ? int8_tiles<2> : int8_tiles<1>;
    default: return avx512_256::tiles_fn(format, planes);
  }
}

TileFn avx512_tile(int format, int planes) {
  const bool two = planes == 2;
  switch (format) {
    case kInt8G32:
    case kInt8G16:
    case kInt6G16:
    case kInt6K:
    case kInt5G32: return avx512_256::tile_fn(format, planes);
    case kInt4: return two ? int4_tile<2, kInt4> : int4_tile<1, kInt4>;
    case kInt4Sym: return two ? int4_tile<2, kInt4Sym> : int4_tile<1, kInt4Sym>;
    case kInt4Zp: return two ? int4_tile<2, kInt4Zp> : int4_tile<1, kInt4Zp>;
    case kInt4K: return two ? int4_tile<2, kInt4K> : int4_tile<1, kInt4K>;
    default: return two ? int8_tile<2> : int8_tile<1>;
  }
}

}  // namespace pagedkern_cpu
#else
namespace pagedkern_cpu {
TileFn avx512_tile(int, int) { return nullptr; }
TilesFn avx512_tiles(int, int) { return nullptr; }
}  // namespace pagedkern_cpu
#endif
