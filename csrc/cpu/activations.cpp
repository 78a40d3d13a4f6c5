// Activation quantization, one routine for every kernel path: per row and block of 32,
// dx = max|x| / Q, q = round-to-nearest-even(x / dx) clamped to -Q..Q, sx = dx * sum(q), and
// the sum of the block's first 16 q (int6_g16's per-group bias comes off with it).
// 8 bits: Q = 127, one plane. 16 bits: Q = 32639 (= 127 * 256 + 127), q split exactly into
// two int8 planes q = 256 hi + lo, hi = floor((q + 128) / 256) in -127..127, lo in -128..127,
// so the kernels' u8 x s8 dot products take either plane. A NaN or infinite x makes its
// block's scale NaN (q = 0): the outputs it reaches are NaN, the other rows' are not.

#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant_gemv.h"

#if QUANT_GEMV_X86
#include <immintrin.h>
#endif

namespace pagedkern_cpu {
namespace {

// One block, plain C++ (the reference for the SIMD version below: the same operations).
void quantize_block(const float* xb, float qmax, int planes, int8_t* qb, float& d_out,
                    int32_t& sum_out, int32_t& half_out) {
  float amax = 0.f;
  bool finite = true;
  for (int i = 0; i < kBlock; ++i) {
    amax = std::max(amax, std::fabs(xb[i]));
    finite = finite && std::isfinite(xb[i]);
  }
  const float d = finite ? amax / qmax : std::nanf("");
  const float inv = d > 0.f ? 1.f / d : 0.f;
  int32_t sum = 0, half = 0;
  for (int i = 0; i < kBlock; ++i) {
    float v = std::nearbyint(xb[i] * inv);
    v = std::isnan(v) ? 0.f : std::min(qmax, std::max(-qmax, v));
    const int q = int(v);
    sum += q;
    if (i < kBlock / 2) half += q;
    if (planes == 2) {
      const int hi = (q + 128) >> 8;  // floor((q + 128) / 256): arithmetic shift
      qb[i] = int8_t(hi);
      qb[kBlock + i] = int8_t(q - 256 * hi);
    } else {
      qb[i] = int8_t(q);
    }
  }
  d_out = d;
  sum_out = sum;
  half_out = half;
}

#if QUANT_GEMV_X86
#define QUANT_AVX2 __attribute__((target("avx2,fma,f16c")))

QUANT_AVX2 inline int32_t hsum(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
}

QUANT_AVX2 inline void store_bytes(int8_t* dst, const __m256i q[4]) {
  // packs work within 128-bit lanes: reorder the 4-byte groups back into K order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                           _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// The same block with AVX2: max|x| is exact in any order, x * inv is one fp32 multiply,
// vcvtps2dq rounds to nearest even (the default MXCSR mode, as nearbyint): the same bits.
QUANT_AVX2 void quantize_block_avx2(const float* xb, float qmax, int planes, int8_t* qb,
                                    float& d_out, int32_t& sum_out, int32_t& half_out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 inf = _mm256_set1_ps(INFINITY);
  __m256 v[4], amax = _mm256_setzero_ps();
  int finite = 0xFF;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 a = _mm256_and_ps(v[i], abs_mask);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));
    amax = _mm256_max_ps(amax, a);
  }
  if (finite != 0xFF) {  // NaN or infinity: a NaN scale, zero q
    std::fill(qb, qb + planes * kBlock, int8_t(0));
    d_out = std::nanf("");
    sum_out = half_out = 0;
    return;
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float d = _mm_cvtss_f32(m4) / qmax;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  const __m256i lim = _mm256_set1_epi32(int(qmax));
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    q[i] = _mm256_min_epi32(lim, _mm256_max_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), lim), q[i]));
  }
  if (planes == 2) {
    __m256i hi[4], lo[4];
    for (int i = 0; i < 4; ++i) {
      hi[i] = _mm256_srai_epi32(_mm256_add_epi32(q[i], _mm256_set1_epi32(128)), 8);
      lo[i] = _mm256_sub_epi32(q[i], _mm256_slli_epi32(hi[i], 8));
    }
    store_bytes(qb, hi);
    store_bytes(qb + kBlock, lo);
  } else {
    store_bytes(qb, q);
  }
  d_out = d;
  half_out = hsum(_mm256_add_epi32(q[0], q[1]));
  sum_out = half_out + hsum(_mm256_add_epi32(q[2], q[3]));
}
#endif

}  // namespace

void QuantizedRows::resize(int m, int k, int planes_) {
  planes = planes_;
  blocks = k / kBlock;
  q.resize(size_t(m) * k * planes);
  dx.resize(size_t(m) * blocks);
  sx.resize(size_t(m) * blocks);
  qsum.resize(size_t(m) * blocks);
  qsum16.resize(size_t(m) * blocks);
}

void group_rows(int g0, int g1, QuantizedRows& out) {
  for (int g = g0; g < g1; ++g)
    for (int b = 0; b < out.blocks; ++b)
      for (int p = 0; p < out.planes; ++p) {
        int8_t* tile = &out.groups[out.group_at(16 * g, b, p)];
        for (int i = 0; i < 16; ++i)
          std::memcpy(tile + i * kBlock, out.block(16 * g + i, b) + p * kBlock, kBlock);
      }
}

void quantize_rows(const float* x, int64_t x_stride, int r0, int r1, bool simd,
                   QuantizedRows& out) {
  const int blocks = out.blocks, planes = out.planes;
  const float qmax = planes == 2 ? 32639.f : 127.f;
  auto block = quantize_block;
#if QUANT_GEMV_X86
  if (simd) block = quantize_block_avx2;
#endif
  for (int r = r0; r < r1; ++r)
    for (int b = 0; b < blocks; ++b) {
      const size_t at = out.at(r, b);
      block(x + r * x_stride + b * kBlock, qmax, planes, &out.q[at * planes * kBlock], out.dx[at],
            out.qsum[at], out.qsum16[at]);
      out.sx[at] = out.dx[at] * float(out.qsum[at]);
    }
}

}  // namespace pagedkern_cpu
