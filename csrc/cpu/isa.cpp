// Which kernel paths this CPU runs (x86: cpuid through the compiler's builtins; aarch64: the
// kernel's HWCAP_ASIMDDP on Linux, FEAT_DotProd on macOS), checked before any ISA-specific
// function is called: a path the CPU lacks is never entered.

#include "quant_gemv.h"

#include <stdexcept>
#include <string>

#if QUANT_GEMV_X86
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#if QUANT_GEMV_NEON && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)  // arch/arm64/include/uapi/asm/hwcap.h
#endif
#elif QUANT_GEMV_NEON && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace pagedkern_cpu {
namespace {

// ARMv8.2 dotprod (SDOT/UDOT); false where the OS does not say
bool arm_dotprod() {
#if QUANT_GEMV_NEON && defined(__linux__)
  return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif QUANT_GEMV_NEON && defined(__APPLE__)
  int value = 0;
  size_t size = sizeof(value);
  return sysctlbyname("hw.optional.arm.FEAT_DotProd", &value, &size, nullptr, 0) == 0 &&
         value != 0;
#else
  return false;
#endif
}

// AMX tiles with int8 dots, usable by this process: the CPU has them (cpuid 7.0 EDX bits 24,
// 25) and Linux grants the tile data's state (arch_prctl ARCH_REQ_XCOMP_PERM, once a process;
// a kernel or VM that refuses it leaves the path off). Elsewhere: false.
bool amx_int8() {
#if QUANT_GEMV_X86 && defined(__linux__)
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
      return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ready;
#else
  return false;
#endif
}

}  // namespace

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
  if (path == kAvx512Amx) return path_supported(kAvx512Vnni) && amx_int8();
#endif
  if (path == kNeonDotprod) return arm_dotprod();
  return false;
}

int best_path() {
  for (int path : {kAvx512Amx, kAvx512Vnni, kAvxVnni, kAvx2, kNeonDotprod})
    if (path_supported(path)) return path;
  return kPortable;
}

int resolve_path(int path, const char* op) {
  if (path < 0) {
    static const int best = best_path();
    return best;
  }
  if (path >= kNumPaths)
    throw std::invalid_argument("path must be -1 or 0.." + std::to_string(kNumPaths - 1));
  if (!path_supported(path))
    throw std::runtime_error(std::string("this CPU (or this build) does not run the ") +
                             path_name(path) + " " + op + " path");
  return path;
}

const char* path_name(int path) {
  switch (path) {
    case kPortable: return "portable";
    case kAvx2: return "avx2";
    case kAvxVnni: return "avx_vnni";
    case kAvx512Vnni: return "avx512_vnni";
    case kNeonDotprod: return "neon_dotprod";
    case kAvx512Amx: return "avx512_amx";
    default: return "?";
  }
}

}  // namespace pagedkern_cpu
