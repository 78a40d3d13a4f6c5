// Device-side pieces shared by every kernel: fp32 conversions, 16-byte vector access and block-wide
// reductions.
#pragma once

#include "common.h"

namespace pagedkern {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Sixteen bytes of T, moved with one 128-bit load or store (LDG.E.128 / STG.E.128).
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];

  __device__ __forceinline__ static Vec16 load(const T* p) {
    Vec16 r;
    *reinterpret_cast<uint4*>(&r) = *reinterpret_cast<const uint4*>(p);
    return r;
  }
  // Read-only data shared by all rows (weights): through the non-coherent cache.
  __device__ __forceinline__ static Vec16 load_ldg(const T* p) {
    Vec16 r;
    *reinterpret_cast<uint4*>(&r) = __ldg(reinterpret_cast<const uint4*>(p));
    return r;
  }
  __device__ __forceinline__ void store(T* p) const {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(this);
  }
};

// 2^x for softmax weights (x <= 0): one MUFU.EX2 (ftz; 2^-inf = 0). The accurate exp2f adds a
// denormal fix-up (FSETP x < -126, two predicated FMULs) around every MUFU.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef __CUDA_ARCH__
  float y;
#ifdef EXP_VOLATILE
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
#else
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
#endif
  return y;
#else
  return exp2f(x);
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block; every thread gets the result. blockDim.x must be a multiple of 32.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int num_warps = blockDim.x >> 5;
  v = lane < num_warps ? partial[lane] : 0.f;
  return warp_sum(v);
}

}  // namespace pagedkern
