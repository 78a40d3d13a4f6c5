// attention.h's kernel on AVX2 + FMA (+ F16C) (attention_body.inc's lane ops: attention_x86_256.inc),
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

#include "attention_x86_256.inc"

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
