/*
 * rms_norm and fused_add_rms_norm (the seed's "RMSNorm + residual").
 *
 *   rms_norm:            out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w
 *   fused_add_rms_norm:  residual[r] = T(x[r] + residual[r]);  out[r] = rms_norm(residual[r])
 *                        (out is normally x itself: the op works in place)
 * All arithmetic in fp32; the fused variant normalises the rounded residual it stores, so the
 * output is exactly rms_norm of what the residual stream now holds.
 *
 * Versions:
 *  v1 rms_norm_vec_kernel<T, kIters, kFused>: one thread block per row. Thread t owns the 16-byte
 *     vectors t, t + blockDim, ... (kIters <= 4 of them, chosen so a block has at most 512
 *     threads, up to 1024 for the widest rows) and keeps them in registers, as T, between the
 *     sum-of-squares reduction and the scaled write: every byte of x and residual crosses HBM
 *     once. All loads of a thread are issued before any arithmetic so kIters loads are in flight.
 *     Needs hidden % (16 / sizeof(T)) == 0, 16-byte aligned row starts and hidden <= 4096 vectors
 *     (32768 bf16 elements).
 *  v3 (default; v1 stays selectable: PAGEDKERN_KERNELS=rms_norm:v1): the weight vectors are
 *     loaded with x, before the block reduction, instead of after its barrier (one L2 latency
 *     per row off the critical path; kIters more 16-byte registers per thread, so not at
 *     kIters = 4, hidden > 8192 bf16 elements, where 1024-thread blocks leave no room).
 *  v2 rms_norm_scalar_kernel<T, kFused>: any hidden size, stride or alignment (hidden 111, 500,
 *     views into odd offsets). Two passes over the row; the second re-reads from L1/L2 (for the
 *     fused variant, the residual elements this same thread just wrote).
 *
 * Traffic (weights stay in L2): rms_norm 2*R*H*s bytes, fused_add_rms_norm 4*R*H*s bytes.
 * Memory bound; target >= 90% of the measured device-copy bandwidth at 8192 x 4096 bf16.
 */
#include "device.cuh"
#include "rms_norm.h"

namespace pagedkern {
namespace {

// kMaxIters vectors per thread (1024-thread blocks, 64 registers): no room for the weights.
template <typename T, int kIters, bool kFused, bool kPrefetchWeight_>
__global__ void __launch_bounds__(1024) rms_norm_vec_kernel(const RmsNormParams p) {
  constexpr bool kPrefetchWeight = kPrefetchWeight_ && kIters < 4;
  using V = Vec16<T>;
  constexpr int kVec = V::kSize;
  const int64_t row = blockIdx.x;
  const int nvec = int(p.hidden / kVec);
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  T* residual = kFused ? static_cast<T*>(p.residual) + row * p.residual_stride : nullptr;

  const T* w = static_cast<const T*>(p.weight);
  V cache[kIters];
  V other[kFused ? kIters : 1];
  V weight[kPrefetchWeight ? kIters : 1];
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = threadIdx.x + it * blockDim.x;
    if (i < nvec) {
      cache[it] = V::load(x + i * kVec);
      if constexpr (kFused) other[it] = V::load(residual + i * kVec);
      if constexpr (kPrefetchWeight) weight[it] = V::load_ldg(w + i * kVec);
    }
  }

  float sumsq = 0.f;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = threadIdx.x + it * blockDim.x;
    if (i < nvec) {
      if constexpr (kFused) {
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          cache[it].v[j] = from_float<T>(to_float(cache[it].v[j]) + to_float(other[it].v[j]));
        cache[it].store(residual + i * kVec);
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float v = to_float(cache[it].v[j]);
        sumsq += v * v;
      }
    }
  }
  const float inv_rms = rsqrtf(block_sum(sumsq) / float(p.hidden) + p.eps);

  T* out = static_cast<T*>(p.out) + row * p.out_stride;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = threadIdx.x + it * blockDim.x;
    if (i < nvec) {
      const V wv = kPrefetchWeight ? weight[it] : V::load_ldg(w + i * kVec);
      V o;
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        o.v[j] = from_float<T>(to_float(cache[it].v[j]) * inv_rms * to_float(wv.v[j]));
      o.store(out + i * kVec);
    }
  }
}

template <typename T, bool kFused>
__global__ void __launch_bounds__(512) rms_norm_scalar_kernel(const RmsNormParams p) {
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  T* residual = kFused ? static_cast<T*>(p.residual) + row * p.residual_stride : nullptr;

  float sumsq = 0.f;
  for (int64_t i = threadIdx.x; i < p.hidden; i += blockDim.x) {
    float v = to_float(x[i]);
    if constexpr (kFused) {
      const T s = from_float<T>(v + to_float(residual[i]));
      residual[i] = s;
      v = to_float(s);
    }
    sumsq += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(sumsq) / float(p.hidden) + p.eps);

  const T* w = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out) + row * p.out_stride;
  for (int64_t i = threadIdx.x; i < p.hidden; i += blockDim.x) {
    const float v = kFused ? to_float(residual[i]) : to_float(x[i]);
    out[i] = from_float<T>(v * inv_rms * to_float(w[i]));
  }
}

// Vectors per thread held in registers: 4 x 16 B (x 2 for the fused residual) fits the 64
// registers a 1024-thread block allows without spilling; 8 did not.
constexpr int kMaxIters = 4;

template <typename T, bool kFused, bool kPrefetchWeight>
void launch_vec(const RmsNormParams& p, int iters, int threads, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.rows));
  switch (iters) {
    case 1: rms_norm_vec_kernel<T, 1, kFused, kPrefetchWeight><<<grid, threads, 0, stream>>>(p); break;
    case 2: rms_norm_vec_kernel<T, 2, kFused, kPrefetchWeight><<<grid, threads, 0, stream>>>(p); break;
    default:
      rms_norm_vec_kernel<T, kMaxIters, kFused, kPrefetchWeight><<<grid, threads, 0, stream>>>(p);
      break;
  }
  PK_CHECK_LAUNCH("rms_norm_vec_kernel");
}

template <typename T, bool kFused>
void launch(const RmsNormParams& p, cudaStream_t stream) {
  constexpr int kVec = Vec16<T>::kSize;
  const bool vectorizable = p.hidden % kVec == 0 && p.hidden / kVec <= kMaxIters * 1024 &&
                            aligned16(p.x) && aligned16(p.out) && aligned16(p.weight) &&
                            p.x_stride % kVec == 0 && p.out_stride % kVec == 0 &&
                            (!kFused || (aligned16(p.residual) && p.residual_stride % kVec == 0));
  const dim3 grid(static_cast<unsigned>(p.rows));
  if (!vectorizable) {
    const int threads = int(std::min<int64_t>(512, (p.hidden + 31) / 32 * 32));
    rms_norm_scalar_kernel<T, kFused><<<grid, threads, 0, stream>>>(p);
    PK_CHECK_LAUNCH("rms_norm_scalar_kernel");
    return;
  }
  const int nvec = int(p.hidden / kVec);
  int iters = 1;
  while (iters < kMaxIters && ceil_div(nvec, iters) > 512) iters *= 2;
  const int threads = (ceil_div(nvec, iters) + 31) / 32 * 32;
  if (p.variant == 1) {
    launch_vec<T, kFused, false>(p, iters, threads, stream);
  } else {
    launch_vec<T, kFused, true>(p, iters, threads, stream);
  }
}

}  // namespace

void rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  require(p.hidden > 0, "rms_norm: hidden size must be positive");
  require(p.rows >= 0 && p.rows <= 0x7fffffff, "rms_norm: rows out of range");
  if (p.rows == 0) return;
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.residual != nullptr) {
      launch<T, true>(p, stream);
    } else {
      launch<T, false>(p, stream);
    }
  });
}

}  // namespace pagedkern
