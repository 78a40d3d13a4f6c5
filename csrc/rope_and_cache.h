// rope_and_cache: parameters and launcher (kernel in rope_and_cache.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern {

// For every token t with (cos, sin) = cos_sin[positions[t]] split at D/2: rotate q[t] and k[t]
// in place (rotate-half: x' = [x1 cos - x2 sin, x2 cos + x1 sin] in fp32, rounded once), and
// when slot_mapping[t] >= 0 write the rotated k[t] and v[t] into page slot / block_size at offset
// slot % block_size of k_cache / v_cache ([num_blocks, Hkv, block_size, D]). kv_fp8: the caches
// are E4M3 and receive e4m3(x * scale_inv) of the fp32 value x (the rotated k before its rounding
// to T, v as read), saturating (fp8.cuh); T is then float16 or bfloat16.
// QK-norm (q_norm and k_norm set, Qwen3 / Gemma 3): each q and k head is first RMS-normalised,
// x = T(x * rsqrt(mean(x^2) + norm_eps) * w) in fp32 (rms_norm's formula and rounding, so the
// fused op equals rms_norm per head, then rope_and_cache), then rotated and cached as above.
// Gemma's (1 + w) norms need no flag: the loaders hand the model 1 + w.
struct RopeAndCacheParams {
  void* q = nullptr;        // [T, Hq, D], heads packed, token stride q_stride
  void* k = nullptr;        // [T, Hkv, D], token stride k_stride
  const void* v = nullptr;  // [T, Hkv, D], token stride v_stride
  const int* positions = nullptr;     // [T]
  const float* cos_sin = nullptr;     // [max_positions, D]
  void* k_cache = nullptr;            // [num_blocks, Hkv, block_size, D], contiguous, T or E4M3
  void* v_cache = nullptr;
  const int* slot_mapping = nullptr;  // [T], -1 = no cache write
  int64_t q_stride = 0;  // in elements
  int64_t k_stride = 0;
  int64_t v_stride = 0;
  int64_t tokens = 0;
  int64_t max_positions = 0;  // rows of cos_sin (check_indices: positions in [0, max_positions))
  int64_t num_blocks = 0;     // pages in each cache (check_indices: slots < num_blocks * bs)
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // even
  int block_size = 16;
  DType dtype = DType::kBFloat16;
  bool kv_fp8 = false;        // E4M3 caches (T float16 or bfloat16)
  float k_scale_inv = 1.f;    // kv_fp8: fp32(1 / k_scale), the stored value is k / k_scale
  float v_scale_inv = 1.f;
  bool check_indices = false;  // trap on an out-of-range position or slot (debug mode)
  int variant = 0;  // 0: v2 (4 heads per thread), 1: v1 (PAGEDKERN_KERNELS)
  const void* q_norm = nullptr;  // [D] of T: QK-norm weights (both or neither), else nullptr
  const void* k_norm = nullptr;
  float norm_eps = 1e-6f;
};
void rope_and_cache(const RopeAndCacheParams& p, cudaStream_t stream);

}  // namespace pagedkern
