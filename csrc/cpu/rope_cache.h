// pagedkern._cpu's rope_and_cache for fp32 rows and an fp32 paged cache: QK-norm if given
// (each head RMS-normalised, rms.h), RoPE of q and k in place, then k and v stored at each
// row's slot, one call a layer.
//
// The rotation is ops/cpu/rope.py's, operation for operation: x' = x * [cos, cos] +
// roll(x, D/2) * [-sin, sin], each product rounded, then their sum (the module is compiled
// without FP contraction), so it gives the torch path's bits (and the reference's). Rows are
// independent: a row's result never depends on the others.

#pragma once

#include <cstdint>

namespace pagedkern_cpu {

struct RopeCacheArgs {
  float* q;  // [T, Hq, D], rows q_row_stride apart, heads dense
  int64_t q_row_stride;
  float* k;  // [T, Hkv, D]
  int64_t k_row_stride;
  const float* v;  // [T, Hkv, D]
  int64_t v_row_stride;
  int rows, hq, hkv, d;
  const float* factors;  // [num_positions, 2D]: cos, cos, -sin, sin (ops/cpu/rope.py's table)
  int64_t num_positions;
  const int64_t* positions;  // [T]
  const int64_t* slots;      // [T]: block * block_size + offset, -1: not stored
  float* k_cache;            // [blocks, Hkv, block_size, D] at the strides below, D dense
  float* v_cache;
  int64_t block_stride, head_stride, slot_stride;  // elements, the same for k and v
  int64_t num_blocks;
  int block_size;
  int threads;  // rows split over this many of OpenMP's threads (a prefill chunk's thousands)
  const float* q_norm = nullptr;  // [D] QK-norm weights (Qwen3, Gemma 3), both or neither
  const float* k_norm = nullptr;
  float norm_eps = 1e-6f;
};

// Throws std::out_of_range before writing anything if a position or slot is out of range.
void rope_cache(const RopeCacheArgs& args);

}  // namespace pagedkern_cpu
