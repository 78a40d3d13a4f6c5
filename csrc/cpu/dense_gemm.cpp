// dense_gemm.h: the fixed-order fp32 GEMM: tiles of R x rows by C W rows, each output 16 lanes
// of fma chains over K and a halving tree.

#include "dense_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "quant_gemv.h"  // Path, resolve_path

#if QUANT_GEMV_X86
#include <immintrin.h>
#endif

namespace pagedkern_cpu {
namespace {

constexpr int kLanes = 16;

// The lanes' halving tree (every path's)
inline float lane_tree(float* lanes) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

// A block of K's span: from zero or the lanes a previous block left, to y or back to the lanes
enum Span { kFirst = 1, kLast = 2 };

// The weights' element types: 16-bit weights are widened to fp32 exactly before their fma, so
// a 16-bit W gives the bits of its fp32 copy
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline float widen(float v) { return v; }
inline float widen(Bf16 v) {
  const uint32_t u = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float widen(F16 v) { return half_to_float(v.bits); }  // (exact: quant_gemv.h)

// A tile on the portable path: std::fma (exact fused), so its lanes are the vector paths'
template <class W>
void tile_portable(const float* x, int64_t x_stride, int rows, const W* w, int64_t w_stride,
                   int cols, int k, float* y, int64_t y_stride, float* lanes, int span) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const float* xr = x + r * x_stride;
      const W* wc = w + c * w_stride;
      float* saved = span == (kFirst | kLast) ? nullptr : lanes + (c * rows + r) * kLanes;
      float acc[kLanes] = {};
      if (!(span & kFirst)) std::memcpy(acc, saved, sizeof acc);
      for (int k0 = 0; k0 < k; k0 += kLanes)
        for (int l = 0; l < kLanes; ++l) {
          const bool in = k0 + l < k;  // the last partial 16 zero-padded, as the masked loads
          acc[l] = std::fma(in ? xr[k0 + l] : 0.0f, in ? widen(wc[k0 + l]) : 0.0f, acc[l]);
        }
      if (span & kLast)
        y[r * y_stride + c] = lane_tree(acc);
      else
        std::memcpy(saved, acc, sizeof acc);
    }
}

#if QUANT_GEMV_X86
// 16 weights as fp32: whole, or the first `n` < 16 with the rest zero (as a masked load)
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const Bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx512f"))) inline __m512 load16(const F16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
__attribute__((target("avx512f"))) inline __m512 load16_tail(const float* p, int n) {
  return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p);
}
template <class W>
__attribute__((target("avx512f"))) inline __m512 load16_tail(const W* p, int n) {
  W part[kLanes] = {};
  std::memcpy(part, p, n * sizeof(W));
  return load16(part);
}

// R x rows by C W rows, 16-lane accumulators, over one block of K: from zero (kFirst) or from
// the lanes the previous block left in `lanes` ([C][R][16]), and to y (kLast) or back there.
// The lanes are stored exactly, so blocking K changes no bit.
template <int R, int C, class W>
__attribute__((target("avx512f"))) void tile_avx512(const float* x, int64_t x_stride,
                                                    const void* wv_, int64_t w_stride, int k,
                                                    float* y, int64_t y_stride, float* lanes,
                                                    int span) {
  const W* w = static_cast<const W*>(wv_);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = span & kFirst ? _mm512_setzero_ps() : _mm512_loadu_ps(lanes + (c * R + r) * kLanes);
  int k0 = 0;
  for (; k0 + kLanes <= k; k0 += kLanes) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * x_stride + k0);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 wv = load16(w + c * w_stride + k0);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  if (k0 < k) {  // (the last block only: the others are whole 16s)
    const __mmask16 mask = __mmask16((1u << (k - k0)) - 1);
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(mask, x + r * x_stride + k0);
    for (int c = 0; c < C; ++c) {
      const __m512 wv = load16_tail(w + c * w_stride + k0, k - k0);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  if (!(span & kLast)) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(lanes + (c * R + r) * kLanes, acc[r][c]);
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      // the tree: + 8 lanes, + 4, + 2, + 1
      const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(acc[r][c]),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                          _mm512_castps_pd(acc[r][c]), 1)));
      const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
      const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
      const __m128 h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1));
      y[r * y_stride + c] = _mm_cvtss_f32(h1);
    }
}

// 8 weights as fp32
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const Bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The same lanes as two 8-lane halves
template <int R, int C, class W>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const float* x, int64_t x_stride,
                                                        const void* wv_, int64_t w_stride, int k,
                                                        float* y, int64_t y_stride, float* lanes,
                                                        int span) {
  const W* w = static_cast<const W*>(wv_);
  __m256 lo[R][C], hi[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      if (span & kFirst) {
        lo[r][c] = hi[r][c] = _mm256_setzero_ps();
      } else {
        lo[r][c] = _mm256_loadu_ps(lanes + (c * R + r) * kLanes);
        hi[r][c] = _mm256_loadu_ps(lanes + (c * R + r) * kLanes + 8);
      }
    }
  alignas(32) static const int32_t ramp[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int k0 = 0; k0 < k; k0 += kLanes) {
    __m256 xl[R], xh[R];
    if (k0 + kLanes <= k) {
      for (int r = 0; r < R; ++r) {
        xl[r] = _mm256_loadu_ps(x + r * x_stride + k0);
        xh[r] = _mm256_loadu_ps(x + r * x_stride + k0 + 8);
      }
      for (int c = 0; c < C; ++c) {
        const __m256 wl = load8(w + c * w_stride + k0);
        const __m256 wh = load8(w + c * w_stride + k0 + 8);
        for (int r = 0; r < R; ++r) {
          lo[r][c] = _mm256_fmadd_ps(xl[r], wl, lo[r][c]);
          hi[r][c] = _mm256_fmadd_ps(xh[r], wh, hi[r][c]);
        }
      }
    } else {
      const __m256i left = _mm256_set1_epi32(k - k0);
      const __m256i ml = _mm256_cmpgt_epi32(left, _mm256_load_si256((const __m256i*)ramp));
      const __m256i mh = _mm256_cmpgt_epi32(left, _mm256_load_si256((const __m256i*)(ramp + 8)));
      for (int r = 0; r < R; ++r) {
        xl[r] = _mm256_maskload_ps(x + r * x_stride + k0, ml);
        xh[r] = _mm256_maskload_ps(x + r * x_stride + k0 + 8, mh);
      }
      for (int c = 0; c < C; ++c) {
        W part[kLanes] = {};  // (the last 16, zero-padded as the masked loads)
        std::memcpy(part, w + c * w_stride + k0, (k - k0) * sizeof(W));
        const __m256 wl = load8(part);
        const __m256 wh = load8(part + 8);
        for (int r = 0; r < R; ++r) {
          lo[r][c] = _mm256_fmadd_ps(xl[r], wl, lo[r][c]);
          hi[r][c] = _mm256_fmadd_ps(xh[r], wh, hi[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      alignas(32) float local[kLanes];
      float* saved = span & kLast ? local : lanes + (c * R + r) * kLanes;  // (kLast: lanes may be null)
      _mm256_storeu_ps(saved, lo[r][c]);
      _mm256_storeu_ps(saved + 8, hi[r][c]);
      if (span & kLast) y[r * y_stride + c] = lane_tree(saved);
    }
}
#endif

using TileFn = void (*)(const float*, int64_t, const void*, int64_t, int, float*, int64_t, float*,
                        int);

enum Kernel { kScalar, kYmm, kZmm };

// The tile shapes: x rows by W rows. AVX-512: 4 x 6 (24 accumulators), one row 1 x 8;
// AVX2: 2 x 3 (12 pairs of halves), one row 1 x 6. The W rows left at a range's end go one at
// a time.
struct Shape {
  int rows, cols, one_row_cols;
};
constexpr Shape shape_of(Kernel kernel) {
  return kernel == kZmm ? Shape{4, 6, 8} : kernel == kYmm ? Shape{2, 3, 6} : Shape{4, 4, 4};
}

#if QUANT_GEMV_X86
template <template <int, int> class T>
TileFn tile_of(int rows, int cols) {
  switch (rows * 16 + cols) {
    case 1 * 16 + 1: return T<1, 1>::fn;
    case 1 * 16 + 6: return T<1, 6>::fn;
    case 1 * 16 + 8: return T<1, 8>::fn;
    case 2 * 16 + 1: return T<2, 1>::fn;
    case 2 * 16 + 3: return T<2, 3>::fn;
    case 2 * 16 + 6: return T<2, 6>::fn;
    case 3 * 16 + 1: return T<3, 1>::fn;
    case 3 * 16 + 6: return T<3, 6>::fn;
    case 4 * 16 + 1: return T<4, 1>::fn;
    case 4 * 16 + 6: return T<4, 6>::fn;
    default: return nullptr;
  }
}
template <class W>
struct Avx512Tiles {
  template <int R, int C>
  struct Tile {
    static constexpr TileFn fn = &tile_avx512<R, C, W>;
  };
};
template <class W>
struct Avx2Tiles {
  template <int R, int C>
  struct Tile {
    static constexpr TileFn fn = &tile_avx2<R, C, W>;
  };
};
#endif

Kernel kernel_for(int path) {
  path = resolve_path(path, "dense_gemm");
#if QUANT_GEMV_X86
  if (path == kAvx512Vnni || path == kAvx512Amx) return kZmm;
  if (path == kAvx2 || path == kAvxVnni) return kYmm;
#endif
  return kScalar;
}

// A row group's tiles: W rows [n0, n1), `cols` at a time (the rest one by one), over one block
// of K; lanes: the group's, W row j's at lanes + j * rows * 16
template <class W>
void run_tiles(Kernel kernel, const float* x, int64_t x_stride, int rows, const W* w,
               int64_t w_stride, int n0, int n1, int cols, int k, float* y, int64_t y_stride,
               float* lanes, int span) {
  if (kernel == kScalar) {
    tile_portable(x, x_stride, rows, w + int64_t(n0) * w_stride, w_stride, n1 - n0, k, y + n0,
                  y_stride, lanes, span);
    return;
  }
#if QUANT_GEMV_X86
  const bool zmm = kernel == kZmm;
  using Zmm = Avx512Tiles<W>;
  using Ymm = Avx2Tiles<W>;
  const TileFn full = zmm ? tile_of<Zmm::template Tile>(rows, cols)
                          : tile_of<Ymm::template Tile>(rows, cols);
  const TileFn one = zmm ? tile_of<Zmm::template Tile>(rows, 1) : tile_of<Ymm::template Tile>(rows, 1);
  const auto lanes_of = [&](int j) { return lanes ? lanes + (j - n0) * rows * kLanes : nullptr; };
  int j = n0;
  for (; j + cols <= n1; j += cols)
    full(x, x_stride, w + int64_t(j) * w_stride, w_stride, k, y + j, y_stride, lanes_of(j), span);
  for (; j < n1; ++j)
    one(x, x_stride, w + int64_t(j) * w_stride, w_stride, k, y + j, y_stride, lanes_of(j), span);
#else
  (void)cols;
#endif
}

// `buffer` holding n floats from a 64-byte boundary (a tile's loads then never split a cache
// line; malloc aligns to 16 bytes)
float* aligned(std::vector<float>& buffer, size_t n) {
  buffer.resize(n + kLanes);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - at % 64) % 64) / sizeof(float);
}

#if QUANT_GEMV_X86
template <class W>
__attribute__((target("avx512f"))) void widen_rows_avx512(const W* src, int64_t stride, int rows,
                                                          int kb, float* dst, int64_t dst_stride) {
  for (int r = 0; r < rows; ++r) {
    int k0 = 0;
    for (; k0 + kLanes <= kb; k0 += kLanes)
      _mm512_storeu_ps(dst + r * dst_stride + k0, load16(src + r * stride + k0));
    if (k0 < kb) _mm512_storeu_ps(dst + r * dst_stride + k0, load16_tail(src + r * stride + k0, kb - k0));
  }
}
#endif

// rows x kb weights -> fp32 rows of dst_stride (the last 16 of each zero-padded)
template <class W>
void widen_rows(Kernel kernel, const W* src, int64_t stride, int rows, int kb, float* dst,
                int64_t dst_stride) {
#if QUANT_GEMV_X86
  if (kernel == kZmm) return widen_rows_avx512(src, stride, rows, kb, dst, dst_stride);
#endif
  (void)kernel;
  for (int r = 0; r < rows; ++r)
    for (int64_t i = 0; i < dst_stride; ++i)
      dst[r * dst_stride + i] = i < kb ? widen(src[r * stride + i]) : 0.0f;
}

// The blocking (per thread): W rows a block, x rows a block and K a block, so that the W
// block's K block (~256 KiB) and the lanes (x block x W block x 16 floats) stay in L2 while
// every row group of the x block passes them. Measured on a Xeon (2 MiB L2, 512 rows, K =
// 576 / 2048 / 8192): K blocks of 2048, 32 rows and 256 KiB ran 210-227 GFLOP/s at every K;
// 1024, 64 and 512 KiB 150-224, slowest at K = 8192; no K blocks 149-176.
constexpr int kKBlock = 2048, kXBlock = 32, kWidenRows = 128;
int block_rows(int k, int cols) {
  const int rows = int((256 << 10) / (int64_t(std::min(k, kKBlock)) * 4));
  return std::max(cols, rows / cols * cols);
}

template <class W>
void gemm(float* y, int64_t y_stride, const float* x, int64_t x_stride, const W* w,
          int64_t w_stride, int m, int n, int k, int threads, Kernel kernel) {
  const Shape shape = shape_of(kernel);
  const int tiles = (n + shape.cols - 1) / shape.cols;
  // one row group (decode): W streams once, each row whole (K blocks would only cut its
  // streams short); more: K in blocks
  const int kblock = m <= shape.rows ? std::max(k, 1) : kKBlock;
  const int kblocks = std::max(1, (k + kblock - 1) / kblock);
  parallel(std::min(threads, tiles), [&](int part, int parts) {
    // whole tiles of W rows a part, so the same tiles whatever the split
    const int n0 = std::min(n, int(int64_t(tiles) * part / parts) * shape.cols);
    const int n1 = std::min(n, int(int64_t(tiles) * (part + 1) / parts) * shape.cols);
    const int block = m <= shape.rows ? n1 - n0 : block_rows(k, shape.cols);
    thread_local std::vector<float> lanes;  // this thread's own; one K block needs none
    thread_local std::vector<float> wide_buffer;
    if (kblocks > 1) lanes.resize(size_t(std::min(m, kXBlock)) * std::max(block, 1) * kLanes);
    for (int b0 = n0; b0 < n1; b0 += block) {
      const int b1 = std::min(n1, b0 + block);
      // 16-bit W under many rows: the block widened to fp32 once (its every K), not in each
      // tile (~10-15% slower at hundreds of rows); under fewer rows the copy costs more than
      // the tiles' widening
      const bool widened = !std::is_same<W, float>::value && m >= kWidenRows;
      const int64_t wide_stride = (k + kLanes - 1) / kLanes * kLanes;
      float* wide = widened ? aligned(wide_buffer, size_t(b1 - b0) * wide_stride) : nullptr;
      if (widened)
        widen_rows(kernel, w + int64_t(b0) * w_stride, w_stride, b1 - b0, k, wide, wide_stride);
      for (int a0 = 0; a0 < m; a0 += kXBlock) {
        const int a1 = std::min(m, a0 + kXBlock);
        for (int kb0 = 0; kb0 < kblocks; ++kb0) {  // (K = 0: one empty block, y = 0)
          const int k0 = kb0 * kblock, kb = std::min(kblock, k - k0);
          const int span = (kb0 == 0 ? kFirst : 0) | (kb0 == kblocks - 1 ? kLast : 0);
          for (int r0 = a0; r0 < a1; r0 += shape.rows) {
            const int rows = std::min(shape.rows, a1 - r0);
            const int cols = rows == 1 ? shape.one_row_cols : shape.cols;
            float* l = kblocks > 1 ? lanes.data() + size_t(r0 - a0) * (b1 - b0) * kLanes : nullptr;
            if (widened)
              run_tiles(kernel, x + r0 * x_stride + k0, x_stride, rows,
                        static_cast<const float*>(wide) + k0, wide_stride, 0, b1 - b0, cols, kb,
                        y + r0 * y_stride + b0, y_stride, l, span);
            else
              run_tiles(kernel, x + r0 * x_stride + k0, x_stride, rows, w + k0, w_stride, b0, b1,
                        cols, kb, y + r0 * y_stride, y_stride, l, span);
          }
        }
      }
    }
  });
}

}  // namespace

void dense_gemm(float* y, int64_t y_stride, const float* x, int64_t x_stride, const void* w,
                int64_t w_stride, int m, int n, int k, int threads, int path, int w_type) {
  if (m < 0 || n < 0 || k < 0) throw std::invalid_argument("dense_gemm: negative m, n or k");
  const Kernel kernel = kernel_for(path);
  if (m == 0 || n == 0) return;
  switch (w_type) {
    case kWeightF32:
      return gemm(y, y_stride, x, x_stride, static_cast<const float*>(w), w_stride, m, n, k,
                  threads, kernel);
    case kWeightBF16:
      return gemm(y, y_stride, x, x_stride, static_cast<const Bf16*>(w), w_stride, m, n, k,
                  threads, kernel);
    case kWeightF16:
      return gemm(y, y_stride, x, x_stride, static_cast<const F16*>(w), w_stride, m, n, k,
                  threads, kernel);
    default:
      throw std::invalid_argument("dense_gemm: w_type must be 0 (fp32), 1 (bf16) or 2 (fp16), got " +
                                  std::to_string(w_type));
  }
}

void dense_gemm(float* y, int64_t y_stride, const float* x, int64_t x_stride, const float* w,
                int64_t w_stride, int m, int n, int k, int threads, int path) {
  dense_gemm(y, y_stride, x, x_stride, static_cast<const void*>(w), w_stride, m, n, k, threads,
             path, kWeightF32);
}

void dense_gemm_grouped(float* y, const float* x, const void* w, const int64_t* counts,
                        int experts, int n, int k, int threads, int path, int w_type) {
  const int64_t element = w_type == kWeightF32 ? 4 : 2;
  int64_t start = 0;
  for (int e = 0; e < experts; ++e) {
    const int64_t rows = counts[e];
    if (rows < 0) throw std::invalid_argument("dense_gemm_grouped: a negative count");
    if (rows > 0)
      dense_gemm(y + start * n, n, x + start * k, k,
                 static_cast<const char*>(w) + int64_t(e) * n * k * element, k, int(rows), n, k,
                 threads, path, w_type);
    start += rows;
  }
}

}  // namespace pagedkern_cpu
