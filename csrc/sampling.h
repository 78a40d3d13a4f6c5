// sample (fused temperature / top-k / top-p / greedy sampling): parameters and launcher (kernel in
// sampling.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern {

// out[r] = one token id drawn for logits row r with the row's temperature, top_k, top_p, seed and
// offset; semantics of python/pagedkern/reference/sampling.py (its distribution; ids may differ).
struct SampleParams {
  int* out = nullptr;             // [rows]
  const void* logits = nullptr;   // [rows, vocab], row stride logits_stride
  const float* temperature = nullptr;  // [rows]; <= 0 (or NaN): greedy
  const float* top_p = nullptr;        // [rows]; >= 1: off
  const int* top_k = nullptr;          // [rows]; <= 0 or >= vocab: off
  const int64_t* seeds = nullptr;      // [rows]
  const int64_t* offsets = nullptr;    // [rows]
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t logits_stride = 0;  // in elements
  DType dtype = DType::kFloat32;
};
void sample(const SampleParams& p, cudaStream_t stream);

}  // namespace pagedkern
