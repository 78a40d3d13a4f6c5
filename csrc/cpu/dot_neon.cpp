// Arm NEON dot-product tile kernels (ARMv8.2 dotprod, SDOT): a tile's 16 rows are four q
// registers of 4 rows (32-bit lanes), so a 64-byte load of the packed tile is four 16-byte loads
// and vdotq_laneq_s32 takes k-quad j of a row of x from lane j of the block's 16 bytes of x.
// SDOT is s8 x s8: int4 nibbles 0..15 are s8 as they are; int8 weights (stored q + 128) XOR 0x80
// are q, so no bias comes off. The integer sums equal the other paths' (exact), and the fp32
// epilogue is the portable one's operations in its order (vmulq then vfmaq: no contraction), so
// this path returns the portable path's bits. kRowChunk rows of x share each weight load.
// Built per function with a target attribute (the module stays baseline aarch64); isa.cpp
// checks the CPU's dotprod (HWCAP_ASIMDDP, FEAT_DotProd) before any of it runs.

#include "quant_gemv.h"

#if QUANT_GEMV_NEON
#include <arm_neon.h>

#include <algorithm>

namespace pagedkern_cpu {
namespace {

#if defined(__clang__)
#define NEON_DOTPROD_TARGET __attribute__((target("dotprod")))
#else
#define NEON_DOTPROD_TARGET __attribute__((target("arch=armv8.2-a+dotprod")))
#endif

// sum over k-quads j = 0..3 of w[j] (4 rows) . x's k-quad j (lane j of x): the lane is an
// immediate, hence written out
NEON_DOTPROD_TARGET inline int32x4_t dot4(int32x4_t acc, const int8x16_t w[4], int8x16_t x) {
  acc = vdotq_laneq_s32(acc, w[0], x, 0);
  acc = vdotq_laneq_s32(acc, w[1], x, 1);
  acc = vdotq_laneq_s32(acc, w[2], x, 2);
  return vdotq_laneq_s32(acc, w[3], x, 3);
}

// fp16 x 4 -> fp32 (exact, as half_to_float)
NEON_DOTPROD_TARGET inline float32x4_t halves(const uint16_t* h) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
}

// 16 bytes at p (unsigned) as four fp32 vectors of 4 (exact)
NEON_DOTPROD_TARGET inline void u8_floats(const uint8_t* p, float32x4_t out[4]) {
  const uint8x16_t v = vld1q_u8(p);
  const uint16x8_t lo = vmovl_u8(vget_low_u8(v)), hi = vmovl_u8(vget_high_u8(v));
  out[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
  out[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo)));
  out[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
  out[3] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi)));
}

// F: int4, int4_sym (no m stored, m = -8 d in fp32: the same bits as the stored m) or int4_k
// (d and m as float(c) times the super-block's d / dm)
template <int P, int F>
NEON_DOTPROD_TARGET void int4_tile(const Args& a, int tile, int r0, int rc) {
  constexpr bool Sym = F == kInt4Sym, K4 = F == kInt4K;
  constexpr int kBlockBytes =
      Sym ? kInt4SymTileBlockBytes : K4 ? kInt4KBlockBytes : kInt4TileBlockBytes;
  const int blocks = a.k / kBlock;
  const uint8_t* base =
      a.packed + size_t(tile) * (K4 ? int4k_tile_bytes(a.k) : size_t(blocks) * kBlockBytes);
  const uint8x16_t low = vdupq_n_u8(0x0F);
  for (; rc > 0; r0 += kRowChunk, rc -= kRowChunk) {
    const int rows = std::min(rc, kRowChunk);
    float32x4_t acc[kRowChunk][4];
    for (int i = 0; i < kRowChunk; ++i)
      for (int c = 0; c < 4; ++c) acc[i][c] = vdupq_n_f32(0.f);
    Int4KCursor walk{base};  // int4_k's
    for (int b = 0; b < blocks; ++b) {
      const Int4KBlock kb = K4 ? walk.next() : Int4KBlock{};
      const uint8_t* t = K4 ? kb.nibbles : base + size_t(b) * kBlockBytes;
      const uint16_t* d16 = reinterpret_cast<const uint16_t*>(t + kRows * kBlock / 2);
      float32x4_t cs[4], cm[4];  // int4_k's c as floats, by rows 4c..4c+3
      if (K4) {
        u8_floats(kb.cs, cs);
        u8_floats(kb.cm, cm);
      }
      for (int c = 0; c < 4; ++c) {  // rows 4c..4c+3 of the tile
        int8x16_t wl[4], wh[4];
        for (int j = 0; j < 4; ++j) {
          const uint8x16_t w = vld1q_u8(t + 64 * j + 16 * c);
          wl[j] = vreinterpretq_s8_u8(vandq_u8(w, low));
          wh[j] = vreinterpretq_s8_u8(vshrq_n_u8(w, 4));
        }
        float32x4_t d, mn;
        if (K4) {
          d = vmulq_f32(cs[c], vld1q_f32(kb.d + 4 * c));
          mn = vmulq_f32(cm[c], vld1q_f32(kb.dm + 4 * c));
        } else {
          d = halves(d16 + 4 * c);
          mn = Sym ? vmulq_f32(vdupq_n_f32(-8.0f), d) : halves(d16 + kRows + 4 * c);
        }
        for (int i = 0; i < rows; ++i) {
          const int r = r0 + i;
          const int8_t* xb = a.xq->block(r, b);
          int32x4_t isum[P];
          for (int p = 0; p < P; ++p) {
            const int8_t* xp = xb + p * kBlock;
            isum[p] = dot4(dot4(vdupq_n_s32(0), wl, vld1q_s8(xp)), wh, vld1q_s8(xp + 16));
          }
          const int32x4_t s = P == 2 ? vaddq_s32(vshlq_n_s32(isum[0], 8), isum[P - 1]) : isum[0];
          const size_t at = a.xq->at(r, b);
          const float32x4_t ddx = vmulq_f32(d, vdupq_n_f32(a.xq->dx[at]));
          acc[i][c] = vfmaq_f32(acc[i][c], ddx, vcvtq_f32_s32(s));
          acc[i][c] = vfmaq_f32(acc[i][c], mn, vdupq_n_f32(a.xq->sx[at]));
        }
      }
    }
    for (int i = 0; i < rows; ++i) {
      float out[kRows];
      for (int c = 0; c < 4; ++c) vst1q_f32(out + 4 * c, acc[i][c]);
      for (int row = 0; row < kRows && tile * kRows + row < a.n; ++row)
        a.y[(r0 + i) * a.y_stride + tile * kRows + row] = out[row];
    }
  }
}

template <int P>
NEON_DOTPROD_TARGET void int8_tile(const Args& a, int tile, int r0, int rc) {
  const int blocks = a.k / kBlock;
  const uint8_t* base = a.packed + size_t(tile) * blocks * kInt8TileBlockBytes;
  const uint8x16_t bias = vdupq_n_u8(0x80);
  for (; rc > 0; r0 += kRowChunk, rc -= kRowChunk) {
    const int rows = std::min(rc, kRowChunk);
    float32x4_t acc[kRowChunk][4];
    for (int i = 0; i < kRowChunk; ++i)
      for (int c = 0; c < 4; ++c) acc[i][c] = vdupq_n_f32(0.f);
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* t = base + size_t(b) * kInt8TileBlockBytes;
      for (int c = 0; c < 4; ++c) {
        int8x16_t w[8];  // k-quads 0..3, then 4..7: q = (q + 128) ^ 0x80 as s8
        for (int j = 0; j < 8; ++j)
          w[j] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(t + 64 * j + 16 * c), bias));
        for (int i = 0; i < rows; ++i) {
          const int r = r0 + i;
          const int8_t* xb = a.xq->block(r, b);
          int32x4_t isum[P];
          for (int p = 0; p < P; ++p) {
            const int8_t* xp = xb + p * kBlock;
            isum[p] = dot4(dot4(vdupq_n_s32(0), w, vld1q_s8(xp)), w + 4, vld1q_s8(xp + 16));
          }
          const int32x4_t s = P == 2 ? vaddq_s32(vshlq_n_s32(isum[0], 8), isum[P - 1]) : isum[0];
          const float32x4_t dx = vdupq_n_f32(a.xq->dx[a.xq->at(r, b)]);
          acc[i][c] = vfmaq_f32(acc[i][c], dx, vcvtq_f32_s32(s));
        }
      }
    }
    for (int i = 0; i < rows; ++i) {
      float out[kRows];
      for (int c = 0; c < 4; ++c) vst1q_f32(out + 4 * c, acc[i][c]);
      for (int row = 0; row < kRows && tile * kRows + row < a.n; ++row)
        a.y[(r0 + i) * a.y_stride + tile * kRows + row] = out[row] * a.scales[tile * kRows + row];
    }
  }
}

}  // namespace

TileFn neon_tile(int format, int planes) {
  const bool two = planes == 2;
  switch (format) {
    case kInt8G32:
    case kInt8G16:
    case kInt6G16:
    case kInt6K:
    case kInt5G32:
    case kInt4Zp: return portable_tile(format, planes);  // no NEON kernel yet: the same bits
    case kInt4: return two ? int4_tile<2, kInt4> : int4_tile<1, kInt4>;
    case kInt4Sym: return two ? int4_tile<2, kInt4Sym> : int4_tile<1, kInt4Sym>;
    case kInt4K: return two ? int4_tile<2, kInt4K> : int4_tile<1, kInt4K>;
    default: return two ? int8_tile<2> : int8_tile<1>;
  }
}

}  // namespace pagedkern_cpu
#else
namespace pagedkern_cpu {
TileFn neon_tile(int, int) { return nullptr; }
}  // namespace pagedkern_cpu
#endif
