// AVX2 tile kernels (vpmaddubsw + vpmaddwd: u8 x s8 pairs in s16, exact here): the shared
// 256-bit body in dot_x86_256.inc, compiled for avx2 + fma + f16c by target attribute.

#include "quant_gemv.h"

#if QUANT_GEMV_X86
#include <immintrin.h>

#include <cstring>
#include <type_traits>

namespace pagedkern_cpu {

#define DOT256_TARGET __attribute__((target("avx2,fma,f16c")))
#define DOT256_VNNI 0
#define DOT256_NS avx2
#include "dot_x86_256.inc"

TileFn avx2_tile(int format, int planes) { return avx2::tile_fn(format, planes); }
TilesFn avx2_tiles(int format, int planes) { return avx2::tiles_fn(format, planes); }

}  // namespace pagedkern_cpu
#else
namespace pagedkern_cpu {
TileFn avx2_tile(int, int) { return nullptr; }
TilesFn avx2_tiles(int, int) { return nullptr; }
}  // namespace pagedkern_cpu
#endif
