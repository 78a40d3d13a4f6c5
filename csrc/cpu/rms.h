// The CPU kernels' RMSNorm statistic, one fixed order for every caller (the layer tail's norms,
// QK-norm in rope_cache): 16 partial sums of squares, element i into lane i % 16 in ascending
// order, combined by a halving tree. A row's result depends on the row only, on every CPU.

#pragma once

#include <cmath>

namespace pagedkern_cpu {

// 1 / sqrt(mean(x^2) + eps) of x[0 .. n)
inline float inv_rms(const float* x, int n, float eps) {
  constexpr int kLanes = 16;
  float partial[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) partial[l] += x[i + l] * x[i + l];
  for (; i < n; ++i) partial[i % kLanes] += x[i] * x[i];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) partial[l] += partial[l + width];
  return 1.0f / std::sqrt(partial[0] / float(n) + eps);
}

// out[j] = x[j] * inv_rms(x) * weight[j] (out may be x)
inline void rms_norm_row(const float* x, float* out, const float* weight, float eps, int n) {
  const float inv = inv_rms(x, n, eps);
  for (int j = 0; j < n; ++j) out[j] = x[j] * inv * weight[j];
}

}  // namespace pagedkern_cpu
