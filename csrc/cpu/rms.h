// The CPU kernels' fixed-order sums of squares (the layer tail's norms, QK-norm in
// rope_cache): 16 partial sums, element i into lane i % 16 in ascending order, combined by a
// halving tree. A row's result depends on the row only, on every CPU. (Dot products of a
// weight: dense_gemm.h's order, with fused multiply-adds.)

#pragma once

#include <cmath>

namespace pagedkern_cpu {

// x . w of x[0 .. n), w[0 .. n) in the fixed order
inline float fixed_order_dot(const float* x, const float* w, int n) {
  constexpr int kLanes = 16;
  float partial[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) partial[l] += x[i + l] * w[i + l];
  for (; i < n; ++i) partial[i % kLanes] += x[i] * w[i];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) partial[l] += partial[l + width];
  return partial[0];
}

// 1 / sqrt(mean(x^2) + eps) of x[0 .. n)
inline float inv_rms(const float* x, int n, float eps) {
  return 1.0f / std::sqrt(fixed_order_dot(x, x, n) / float(n) + eps);
}

// out[j] = x[j] * inv_rms(x) * weight[j] (out may be x)
inline void rms_norm_row(const float* x, float* out, const float* weight, float eps, int n) {
  const float inv = inv_rms(x, n, eps);
  for (int j = 0; j < n; ++j) out[j] = x[j] * inv * weight[j];
}

}  // namespace pagedkern_cpu
