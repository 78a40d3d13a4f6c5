// Which kernel paths this CPU runs (cpuid through the compiler's builtins), checked before any
// ISA-specific function is called: a path the CPU lacks is never entered.

#include "quant_gemv.h"

namespace pagedkern_cpu {

bool path_supported(int path) {
  if (path == kPortable) return true;
#if QUANT_GEMV_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (path == kAvx2) return avx2;
#if QUANT_GEMV_AVXVNNI
  if (path == kAvxVnni) return avx2 && __builtin_cpu_supports("avxvnni");
#endif
  if (path == kAvx512Vnni)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
  return false;
}

int best_path() {
  for (int path : {kAvx512Vnni, kAvxVnni, kAvx2})
    if (path_supported(path)) return path;
  return kPortable;
}

const char* path_name(int path) {
  switch (path) {
    case kPortable: return "portable";
    case kAvx2: return "avx2";
    case kAvxVnni: return "avx_vnni";
    case kAvx512Vnni: return "avx512_vnni";
    default: return "?";
  }
}

}  // namespace pagedkern_cpu
