// The gated MLP's activation, one row: out[j] = act(g[j]) * g[intermediate + j], act SiLU or
// GELU-tanh (layer_tail.h's Activation), e^x by a polynomial (~3e-7 relative, no libm call).
//
// Design: plain C++, and an AVX2 version of the very same operations in the same order (no
// fused multiply-adds: the module builds with -ffp-contract=off), so both give the same bits on
// every input, NaN and infinities included. The plain loop does not vectorize by itself: its
// clamps are branches, and the if-converted loop GCC makes of them measured 4x slower than the
// scalar one.

#pragma once

namespace pagedkern_cpu {

// simd: the AVX2 version where the CPU has AVX2 (else the plain loop)
void gated_activation(int activation, const float* g, float* out, int intermediate, bool simd);

}  // namespace pagedkern_cpu
