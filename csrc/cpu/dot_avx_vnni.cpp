// AVX-VNNI tile kernels (256-bit vpdpbusd, e.g. Alder Lake and later client cores without
// AVX-512): the shared 256-bit body in dot_x86_256.inc, compiled for avx2 + avxvnni by target
// attribute.

#include "quant_gemv.h"

#if QUANT_GEMV_AVXVNNI
#include <immintrin.h>

#include <cstring>
#include <type_traits>

namespace pagedkern_cpu {

#define DOT256_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define DOT256_VNNI 1
#define DOT256_NS avx_vnni
#include "dot_x86_256.inc"

TileFn avxvnni_tile(int format, int planes) { return avx_vnni::tile_fn(format, planes); }
TilesFn avxvnni_tiles(int format, int planes) { return avx_vnni::tiles_fn(format, planes); }

}  // namespace pagedkern_cpu
#else
namespace pagedkern_cpu {
TileFn avxvnni_tile(int, int) { return nullptr; }
TilesFn avxvnni_tiles(int, int) { return nullptr; }
}  // namespace pagedkern_cpu
#endif
