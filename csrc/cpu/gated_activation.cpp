// The gated MLP's activation (gated_activation.h): the plain loop and its AVX2 twin.

#include "gated_activation.h"

#include <cstdint>
#include <cstring>

#include "layer_tail.h"
#include "quant_gemv.h"

#if QUANT_GEMV_X86
#include <immintrin.h>
#endif

namespace pagedkern_cpu {
namespace {

// e^x within ~3e-7 relative: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial, 2^n by exponent bits. Saturates below -87.3 (to ~1e-38) and above 88.3 (to
// ~2e38, n <= 127); NaN stays NaN.
constexpr float kExpLow = -87.3f, kExpHigh = 88.3f;
constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
constexpr float kLog2e = 1.44269504f;
constexpr float kLn2High = 0.693145752f, kLn2Low = 1.42860677e-6f;  // (an exact n * ln2_hi)
constexpr float kTaylor[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f,
                              0.5f,          1.0f,          1.0f};
constexpr int32_t kShifterBits = 0x4B400000;  // kShifter's bits: t's low bits hold n

inline float fast_exp(float x) {
  x = x < kExpLow ? kExpLow : x;
  x = x > kExpHigh ? kExpHigh : x;
  const float t = x * kLog2e + kShifter;
  const float n = t - kShifter;
  float r = x - n * kLn2High;
  r = r - n * kLn2Low;
  float p = kTaylor[0];
  for (int i = 1; i < 7; ++i) p = p * r + kTaylor[i];
  int32_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  bits = (bits - kShifterBits + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float silu_times(float x, float up) { return x / (1.0f + fast_exp(-x)) * up; }

// gelu_tanh(x) * up, tanh(u) = 1 - 2 / (e^(2u) + 1) (exact at both ends)
inline float gelu_tanh_times(float x, float up) {
  const float u = 0.7978845608f * (x + 0.044715f * x * x * x);
  const float tanh_u = 1.0f - 2.0f / (fast_exp(2.0f * u) + 1.0f);
  return 0.5f * x * (1.0f + tanh_u) * up;
}

void plain(int activation, const float* g, float* out, int from, int intermediate) {
  for (int j = from; j < intermediate; ++j)
    out[j] = activation == kGeluTanh ? gelu_tanh_times(g[j], g[intermediate + j])
                                     : silu_times(g[j], g[intermediate + j]);
}

#if QUANT_GEMV_X86
#define ACT_AVX2 __attribute__((target("avx2")))

ACT_AVX2 inline __m256 set(float v) { return _mm256_set1_ps(v); }

// fast_exp, 8 lanes: the same operations (blend for the clamps: NaN compares false and stays)
ACT_AVX2 inline __m256 fast_exp8(__m256 x) {
  x = _mm256_blendv_ps(x, set(kExpLow), _mm256_cmp_ps(x, set(kExpLow), _CMP_LT_OQ));
  x = _mm256_blendv_ps(x, set(kExpHigh), _mm256_cmp_ps(x, set(kExpHigh), _CMP_GT_OQ));
  const __m256 t = _mm256_add_ps(_mm256_mul_ps(x, set(kLog2e)), set(kShifter));
  const __m256 n = _mm256_sub_ps(t, set(kShifter));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, set(kLn2High)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, set(kLn2Low)));
  __m256 p = set(kTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_add_ps(_mm256_mul_ps(p, r), set(kTaylor[i]));
  __m256i bits = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(kShifterBits));
  bits = _mm256_slli_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

ACT_AVX2 void avx2(int activation, const float* g, float* out, int intermediate) {
  const __m256 one = set(1.0f);
  int j = 0;
  for (; j + 8 <= intermediate; j += 8) {
    const __m256 x = _mm256_loadu_ps(g + j), up = _mm256_loadu_ps(g + intermediate + j);
    __m256 y;
    if (activation == kGeluTanh) {
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(set(0.044715f), x), x), x);
      const __m256 u = _mm256_mul_ps(set(0.7978845608f), _mm256_add_ps(x, cube));
      const __m256 e = fast_exp8(_mm256_mul_ps(set(2.0f), u));
      const __m256 tanh_u = _mm256_sub_ps(one, _mm256_div_ps(set(2.0f), _mm256_add_ps(e, one)));
      y = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(set(0.5f), x), _mm256_add_ps(one, tanh_u)),
                        up);
    } else {
      const __m256 e = fast_exp8(_mm256_xor_ps(x, set(-0.0f)));  // e^-x
      y = _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), up);
    }
    _mm256_storeu_ps(out + j, y);
  }
  plain(activation, g, out, j, intermediate);
}

bool has_avx2() {
  static const bool avx2 = path_supported(kAvx2);
  return avx2;
}
#endif

}  // namespace

void gated_activation(int activation, const float* g, float* out, int intermediate, bool simd) {
#if QUANT_GEMV_X86
  if (simd && has_avx2()) return avx2(activation, g, out, intermediate);
#endif
  plain(activation, g, out, 0, intermediate);
}

}  // namespace pagedkern_cpu
