// E4M3 (torch.float8_e4m3fn) KV-cache elements: the two conversions the cache kernels need, both
// from CUDA's own <cuda_fp8.h>. On sm_89+ (sm_90a here) each is one instruction
// (cvt.rn.satfinite.e4m3x2.f32 = F2FP.SATFINITE.E4M3.F32.PACK_AB, cvt.rn.f16x2.e4m3x2 =
// F2FP.F16.E4M3.UNPACK_B); on sm_80 and on the host (the CPU emulator) cuda_fp8.h computes them
// in software with the same results, exact but slow: the sm_80 fp8 mma decode loop is ~5700
// instructions per warp and tile against 372 on sm_90a (SASS of the D = 128 kernel), so an fp8
// cache on an A100 is correct but far from memory bound.
//
// Semantics (= reference/rope.py `quantize_e4m3`, i.e. torch's `clamp(-448, 448).to(float8_e4m3fn)`):
// round to nearest even, |x| beyond 448 (inf included) saturates to +-448, -0.0 stays -0.0,
// subnormals (2^-9 spacing) kept. NaN becomes an E4M3 NaN: cuda_fp8.h writes 0x7F whatever the
// input's sign, torch keeps the sign (0xFF for -NaN); readers treat both as NaN.
// E4M3 -> f16 is exact (f16 holds every E4M3 value, subnormals included; NaN -> f16 NaN).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "device.cuh"

namespace pagedkern {

// The cache element type of the fp8 kernel instantiations (one byte, __nv_fp8_storage_t inside).
using Fp8 = __nv_fp8_e4m3;

// Two fp32 values -> two E4M3 bytes (lo in the low byte), saturating.
__device__ __forceinline__ uint16_t e4m3x2_from_floats(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ uint8_t e4m3_from_float(float x) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

// Two E4M3 bytes (lo in the low byte) -> f16x2 bits (lo in the low half), exact.
__device__ __forceinline__ uint32_t e4m3x2_to_half2_bits(uint16_t x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(x, __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// Two E4M3 bytes -> two floats, exact (through f16).
__device__ __forceinline__ void e4m3x2_to_floats(uint16_t x, float& lo, float& hi) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(x, __NV_E4M3);
  lo = __half2float(__half(__half_raw{h.x}));
  hi = __half2float(__half(__half_raw{h.y}));
}

}  // namespace pagedkern
