// The gated MLP's activations of the gate half, in fp32: one definition for the standalone op
// (silu_and_mul.cu) and the fused MoE epilogue (moe_gemm.cu), so both round alike; and
// gpt-oss's clamped SwiGLU, which takes the up half too (the MoE epilogue's only).
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

// gpt-oss (transformers' GptOssExperts._apply_gate): g = min(gate, limit), u = up clamped to
// [-limit, limit], then (u + 1) * (g * sigmoid(alpha * g)); __expf as Silu's. NaN inputs:
// undefined (fminf drops a NaN where torch's clamp keeps it).
struct ClampedSwiGLU {
  float alpha = 1.702f;
  float limit = 7.0f;
  __device__ __forceinline__ float operator()(float gate, float up) const {
    const float g = fminf(gate, limit);
    const float u = fmaxf(fminf(up, limit), -limit);
    return (u + 1.f) * (g / (1.f + __expf(-alpha * g)));
  }
};

}  // namespace pagedkern
