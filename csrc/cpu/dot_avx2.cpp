// AVX2 tile kernels (vpmaddubsw + vpmaddwd: u8 x s8 pairs in s16, exact here): the shared
// 256-bit body in dot_x86_256.inc, compiled for avx2 + fma + f16c by target attribute.

#include "quant_gemv.h"

#if QUANT_GEMV_X86
#include <immintrin.h>

#include <cstring>

namespace pagedkern_cpu {

#define DOT256_TARGET __attribute__((target("avx2,fma,f16c")))
#define DOT256_VNNI 0
#define DOT256_NS avx2
#include "dot_x86_256.inc"

TileFn avx2_tile(bool int4, int planes) {
  if (planes == 2) return int4 ? avx2::int4_tile<2> : avx2::int8_tile<2>;
  return int4 ? avx2::int4_tile<1> : avx2::int8_tile<1>;
}

}  // namespace pagedkern_cpu
#else
namespace pagedkern_cpu {
TileFn avx2_tile(bool, int) { return nullptr; }
}  // namespace pagedkern_cpu
#endif
