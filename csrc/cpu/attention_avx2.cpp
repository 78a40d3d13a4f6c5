// attention.h's kernel on AVX2 + FMA (+ F16C) (attention_body.inc's lane ops as 256-bit intrinsics),
// compiled by target attribute: entered only where isa.cpp finds AVX2, FMA and F16C.

#include "attention.h"

#include "quant_gemv.h"  // QUANT_GEMV_X86

#if QUANT_GEMV_X86
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"

namespace pagedkern_cpu {
namespace attention_avx2 {

#define ATT_FN __attribute__((target("avx2,fma,f16c"))) inline

using V = __m256;
ATT_FN V vzero() { return _mm256_setzero_ps(); }
ATT_FN V vset1(float x) { return _mm256_set1_ps(x); }
ATT_FN V vload(const float* p) { return _mm256_loadu_ps(p); }
ATT_FN void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
ATT_FN V vload_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
ATT_FN V vload_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
ATT_FN V vadd(V a, V b) { return _mm256_add_ps(a, b); }
ATT_FN V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
ATT_FN V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
ATT_FN V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
ATT_FN V vmax(V a, V b) { return _mm256_max_ps(a, b); }  // maxps: a > b ? a : b
ATT_FN V vround(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
ATT_FN V vldexp(V p, V n) {
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
ATT_FN V vzero_below(V x, float t, V e) {
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(t), _CMP_LT_OQ), e);
}
ATT_FN V vsum_tree(const V* a) {
  // hadd pairs lanes (0+1, 2+3 per half), again (01+23), then the halves: lane k is
  // ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)) of a[k]
  const V t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const V t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const V u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
ATT_FN void vlanes(V v, float* out) { _mm256_storeu_ps(out, v); }

#include "attention_body.inc"

#undef ATT_FN

}  // namespace attention_avx2

void attention_detail::avx2(const AttentionArgs& args) { attention_avx2::run(args); }

}  // namespace pagedkern_cpu
#else
namespace pagedkern_cpu {
void attention_detail::avx2(const AttentionArgs&) {}
}  // namespace pagedkern_cpu
#endif
