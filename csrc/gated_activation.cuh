// The gated MLP's activations of the gate half, in fp32: one definition for the standalone op
// (silu_and_mul.cu) and the fused MoE epilogue (moe_gemm.cu), so both round alike.
#pragma once

namespace pagedkern {

struct Silu {
  __device__ __forceinline__ float operator()(float g) const { return g / (1.f + __expf(-g)); }
};

// tanhf, not a fast approximation: the result matches torch's gelu(approximate="tanh") in fp32.
struct GeluTanh {
  __device__ __forceinline__ float operator()(float g) const {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    return 0.5f * g * (1.f + tanhf(kSqrt2OverPi * (g + 0.044715f * g * g * g)));
  }
};

}  // namespace pagedkern
