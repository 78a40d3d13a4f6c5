// The portable tile kernels: plain C++ (built everywhere, compiled without FP contraction),
// the same integer sums and the same fp32 operations in the same order as the SIMD paths
// (quant_gemv.h), so they return the same bits.

#include <cmath>
#include <cstring>

#include "quant_gemv.h"

namespace pagedkern_cpu {

// IEEE half -> float, exact (the SIMD paths' vcvtph2ps).
float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while (!(man & 0x400));
    bits = sign | uint32_t(112 - e) << 23 | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

namespace {

// sum over the planes of a block: 8 bits q, 16 bits 256 hi + lo
template <int P, typename Dot>
int32_t planes_dot(const int8_t* xb, Dot dot) {
  return P == 2 ? 256 * dot(xb) + dot(xb + kBlock) : dot(xb);
}

// F: int4, int4_sym (no m stored, m = -8 d in fp32: the same bits as the stored m), int4_zp
// (m = -(float(z) d), z a byte after the d: int5_g32's fp32 m), int5_g32
// (a fifth bit a code; d and m stored in fp32) or int4_k (d = float(cs) * the super-block's d,
// m = float(cm) * its dm: int5_g32's fp32 values)
template <int P, int F>
void int4_tile(const Args& a, int tile, int r0, int rc) {
  constexpr bool Five = F == kInt5G32, K4 = F == kInt4K;
  constexpr int kBlockBytes = F == kInt4Sym ? kInt4SymTileBlockBytes
                              : F == kInt4Zp ? kInt4ZpTileBlockBytes
                              : Five        ? kInt5TileBlockBytes
                              : K4          ? kInt4KBlockBytes
                                            : kInt4TileBlockBytes;
  const int blocks = a.k / kBlock;
  const uint8_t* base =
      a.packed + size_t(tile) * (K4 ? int4k_tile_bytes(a.k) : size_t(blocks) * kBlockBytes);
  for (int r = r0; r < r0 + rc; ++r) {
    float acc[kRows] = {};
    Int4KCursor walk{base};  // int4_k's
    for (int b = 0; b < blocks; ++b) {
      const Int4KBlock kb = K4 ? walk.next() : Int4KBlock{};
      const uint8_t* t = K4 ? kb.nibbles : base + size_t(b) * kBlockBytes;
      const uint8_t* fifth = t + kRows * kBlock / 2;
      const uint8_t* dm = t + kRows * kBlock / 2 + (Five ? kRows * 4 : 0);
      const float dx = a.xq->dx[a.xq->at(r, b)], sx = a.xq->sx[a.xq->at(r, b)];
      for (int row = 0; row < kRows; ++row) {
        const int32_t isum = planes_dot<P>(a.xq->block(r, b), [&](const int8_t* xb) {
          int32_t s = 0;
          for (int j = 0; j < 4; ++j)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = t[64 * j + 4 * row + i];
              int lo = byte & 0x0F, hi = byte >> 4;
              if (Five) {
                lo |= ((fifth[4 * row + i] >> j) & 1) << 4;
                hi |= ((fifth[4 * row + i] >> (j + 4)) & 1) << 4;
              }
              s += lo * xb[4 * j + i] + hi * xb[16 + 4 * j + i];
            }
          return s;
        });
        float d, mn;
        if (K4) {
          d = float(kb.cs[row]) * kb.d[row];
          mn = float(kb.cm[row]) * kb.dm[row];
        } else if (Five) {
          std::memcpy(&d, dm + 4 * row, 4);
          std::memcpy(&mn, dm + 4 * (kRows + row), 4);
        } else {
          const uint16_t* d16 = reinterpret_cast<const uint16_t*>(dm);
          d = half_to_float(d16[row]);
          mn = F == kInt4Sym  ? -8.0f * d
               : F == kInt4Zp ? -(float(dm[2 * kRows + row]) * d)
                              : half_to_float(d16[kRows + row]);
        }
        const float ddx = d * dx;
        acc[row] = std::fma(ddx, float(isum), acc[row]);
        acc[row] = std::fma(mn, sx, acc[row]);
      }
    }
    for (int row = 0; row < kRows && tile * kRows + row < a.n; ++row)
      a.y[r * a.y_stride + tile * kRows + row] = acc[row];
  }
}

// A row's integer sum over k-quads [j0, j1) of an int8 tile block (stored q + 128).
template <int P>
int32_t int8_quads(const uint8_t* t, int row, const int8_t* x, int j0, int j1) {
  return planes_dot<P>(x, [&](const int8_t* xb) {
    int32_t s = 0;
    for (int j = j0; j < j1; ++j)
      for (int i = 0; i < 4; ++i) s += (int(t[64 * j + 4 * row + i]) - kInt8Bias) * xb[4 * j + i];
    return s;
  });
}

template <int P>
void int8_tile(const Args& a, int tile, int r0, int rc) {
  const int blocks = a.k / kBlock;
  const uint8_t* base = a.packed + size_t(tile) * blocks * kInt8TileBlockBytes;
  for (int r = r0; r < r0 + rc; ++r) {
    float acc[kRows] = {};
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* t = base + size_t(b) * kInt8TileBlockBytes;
      const float dx = a.xq->dx[a.xq->at(r, b)];
      for (int row = 0; row < kRows; ++row)
        acc[row] = std::fma(dx, float(int8_quads<P>(t, row, a.xq->block(r, b), 0, 8)), acc[row]);
    }
    for (int row = 0; row < kRows && tile * kRows + row < a.n; ++row)
      a.y[r * a.y_stride + tile * kRows + row] = acc[row] * a.scales[tile * kRows + row];
  }
}

// An int6_g16 block's codes as an int8 tile block (q + 128), so the int8 sums read them.
void int6_as_int8(const uint8_t* t, uint8_t* out) {
  for (int j = 0; j < 8; ++j)
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < 4; ++i) {
        const uint8_t nib = t[64 * (j % 4) + 4 * r + i];
        const uint8_t low = j < 4 ? nib & 15 : nib >> 4;
        const uint8_t high = (t[kRows * kBlock / 2 + 64 * (j % 2) + 4 * r + i] >> (2 * (j / 2))) & 3;
        out[64 * j + 4 * r + i] = uint8_t((low | high << 4) - 32 + kInt8Bias);
      }
}

// int8_g32 / int8_g16 (S = 32 / G groups a block): per group, acc = fma(s_g * dx, isum_g, acc);
// int6_g16 and int6_k (F) unpack their codes first; int6_k's scale is float(c) * d.
template <int P, int S, int F>
void int8_grouped_tile(const Args& a, int tile, int r0, int rc) {
  constexpr bool Six = F == kInt6G16 || F == kInt6K;
  constexpr int kCodeBytes = Six ? kInt6CodeBytes : kRows * kBlock;
  constexpr int kBlockBytes = kCodeBytes + kRows * 4 * S, kQuads = 8 / S;
  const int blocks = a.k / kBlock;
  const uint8_t* base = a.packed + size_t(tile) * blocks * kBlockBytes;
  const float* tile_d = nullptr;  // int6_k's
  if (F == kInt6K) {
    const uint8_t* start = a.packed + size_t(tile) * int6k_tile_bytes(a.k);
    tile_d = int6k_d(start);
    base = int6k_blocks(start, a.k);
  }
  uint8_t codes[kRows * kBlock];
  for (int r = r0; r < r0 + rc; ++r) {
    float acc[kRows] = {};
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* block = base + size_t(b) * (F == kInt6K ? kInt6KBlockBytes : kBlockBytes);
      if (Six) int6_as_int8(block, codes);
      const uint8_t* t = Six ? codes : block;
      const float dx = a.xq->dx[a.xq->at(r, b)];
      for (int row = 0; row < kRows; ++row)
        for (int g = 0; g < S; ++g) {
          const int32_t isum =
              int8_quads<P>(t, row, a.xq->block(r, b), g * kQuads, (g + 1) * kQuads);
          float scale;
          if (F == kInt6K)
            scale = float(int8_t(block[kCodeBytes + kRows * g + row])) *
                    tile_d[kRows * (b * kBlock / kInt6KSuper) + row];
          else
            std::memcpy(&scale, block + kCodeBytes + 4 * (kRows * g + row), 4);
          acc[row] = std::fma(scale * dx, float(isum), acc[row]);
        }
    }
    for (int row = 0; row < kRows && tile * kRows + row < a.n; ++row)
      a.y[r * a.y_stride + tile * kRows + row] = acc[row];
  }
}

}  // namespace

TileFn portable_tile(int format, int planes) {
  const bool two = planes == 2;
  switch (format) {
    case kInt4: return two ? int4_tile<2, kInt4> : int4_tile<1, kInt4>;
    case kInt4Sym: return two ? int4_tile<2, kInt4Sym> : int4_tile<1, kInt4Sym>;
    case kInt4Zp: return two ? int4_tile<2, kInt4Zp> : int4_tile<1, kInt4Zp>;
    case kInt5G32: return two ? int4_tile<2, kInt5G32> : int4_tile<1, kInt5G32>;
    case kInt4K: return two ? int4_tile<2, kInt4K> : int4_tile<1, kInt4K>;
    case kInt8G32: return two ? int8_grouped_tile<2, 1, kInt8G32> : int8_grouped_tile<1, 1, kInt8G32>;
    case kInt8G16: return two ? int8_grouped_tile<2, 2, kInt8G16> : int8_grouped_tile<1, 2, kInt8G16>;
    case kInt6G16: return two ? int8_grouped_tile<2, 2, kInt6G16> : int8_grouped_tile<1, 2, kInt6G16>;
    case kInt6K: return two ? int8_grouped_tile<2, 2, kInt6K> : int8_grouped_tile<1, 2, kInt6K>;
    default: return two ? int8_tile<2> : int8_tile<1>;
  }
}

}  // namespace pagedkern_cpu
