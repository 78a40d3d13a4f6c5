/*
 * The gated activations: out[r, i] = act(x[r, i]) * x[r, d + i], i < d, computed in fp32 and
 * rounded once to T, with act one of
 *   silu_and_mul (SwiGLU, Llama):       silu(g) = g / (1 + exp(-g))
 *   gelu_tanh_and_mul (GeGLU, Gemma):   gelu(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
 * One kernel pair serves both (the activation is a template parameter).
 *
 * Versions:
 *  v1 silu_and_mul_vec_kernel<T>: grid (rows, column chunks); each thread loads one 16-byte vector
 *     of the gate half and the matching vector of the up half and stores one vector of out. The
 *     2-D grid keeps every SM busy for any rows/d ratio without integer division per element.
 *     Needs d % (16 / sizeof(T)) == 0 and 16-byte aligned row starts.
 *  v2 silu_and_mul_scalar_kernel<T>: same mapping, one element per thread: any d, stride or
 *     alignment.
 *
 * Traffic: reads 2*R*d*s, writes R*d*s bytes. Memory bound; target >= 90% of measured copy
 * bandwidth.
 */
#include "device.cuh"
#include "gated_activation.cuh"
#include "silu_and_mul.h"

namespace pagedkern {
namespace {

template <typename T, typename Act>
__global__ void __launch_bounds__(256) silu_and_mul_vec_kernel(const SiluAndMulParams p) {
  const Act act;
  using V = Vec16<T>;
  constexpr int kVec = V::kSize;
  const int64_t i = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * kVec;
  if (i >= p.d) return;
  const T* x = static_cast<const T*>(p.x) + int64_t(blockIdx.x) * p.x_stride;
  const V gate = V::load(x + i);
  const V up = V::load(x + p.d + i);
  V o;
#pragma unroll
  for (int j = 0; j < kVec; ++j)
    o.v[j] = from_float<T>(act(to_float(gate.v[j])) * to_float(up.v[j]));
  o.store(static_cast<T*>(p.out) + int64_t(blockIdx.x) * p.out_stride + i);
}

template <typename T, typename Act>
__global__ void __launch_bounds__(256) silu_and_mul_scalar_kernel(const SiluAndMulParams p) {
  const Act act;
  const int64_t i = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (i >= p.d) return;
  const T* x = static_cast<const T*>(p.x) + int64_t(blockIdx.x) * p.x_stride;
  T* out = static_cast<T*>(p.out) + int64_t(blockIdx.x) * p.out_stride;
  out[i] = from_float<T>(act(to_float(x[i])) * to_float(x[p.d + i]));
}

template <typename Act>
void launch(const SiluAndMulParams& p, cudaStream_t stream) {
  require(p.d > 0, "silu_and_mul: d must be positive");
  require(p.rows >= 0 && p.rows <= 0x7fffffff, "silu_and_mul: rows out of range");
  if (p.rows == 0) return;
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = Vec16<T>::kSize;
    const bool vectorizable = p.d % kVec == 0 && aligned16(p.x) && aligned16(p.out) &&
                              p.x_stride % kVec == 0 && p.out_stride % kVec == 0;
    const int64_t per_row = vectorizable ? p.d / kVec : p.d;
    const int threads = int(std::min<int64_t>(256, (per_row + 31) / 32 * 32));
    const int64_t chunks = (per_row + threads - 1) / threads;
    require(chunks <= 65535, "silu_and_mul: d too large");
    const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(chunks));
    if (vectorizable) {
      silu_and_mul_vec_kernel<T, Act><<<grid, threads, 0, stream>>>(p);
      PK_CHECK_LAUNCH("silu_and_mul_vec_kernel");
    } else {
      silu_and_mul_scalar_kernel<T, Act><<<grid, threads, 0, stream>>>(p);
      PK_CHECK_LAUNCH("silu_and_mul_scalar_kernel");
    }
  });
}

}  // namespace

void silu_and_mul(const SiluAndMulParams& p, cudaStream_t stream) {
  if (p.activation == GatedActivation::kGeluTanh) {
    launch<GeluTanh>(p, stream);
  } else {
    launch<Silu>(p, stream);
  }
}

}  // namespace pagedkern
