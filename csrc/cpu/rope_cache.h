// pagedkern._cpu's rope_and_cache for fp32 rows and an fp32, bf16, fp16 or fp8 (E4M3) paged
// cache: QK-norm if given (each head RMS-normalised, rms.h), RoPE of q and k in place, then k
// and v stored at each row's slot, one call a layer. A 16-bit cache receives them rounded to
// nearest even, as torch's casts round; fp8 receives k * fp32(1 / k_scale), likewise v, clamped
// to +-448 and rounded to nearest even, as reference.quantize_e4m3 writes them.
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
  void* k_cache;             // [blocks, Hkv, block_size, D] at the strides below, D dense
  void* v_cache;
  int64_t block_stride, head_stride, slot_stride;  // elements, the same for k and v
  int64_t num_blocks;
  int block_size;
  int threads;  // rows split over this many of OpenMP's threads (a prefill chunk's thousands)
  const float* q_norm = nullptr;  // [D] QK-norm weights (Qwen3, Gemma 3), both or neither
  const float* k_norm = nullptr;
  float norm_eps = 1e-6f;
  int cache_dtype = 0;       // attention.h's CacheDtype
  float k_inv_scale = 1.0f;  // fp8: fp32(1 / k_scale), fp32(1 / v_scale)
  float v_inv_scale = 1.0f;
};

// x (|x| <= 448 or NaN) to E4M3, rounded to nearest even; NaN keeps its sign (0x7F / 0xFF)
uint8_t e4m3_from_float(float x);
// x rounded to nearest even, as torch casts: NaN as torch's scalar casts write it (bf16 0x7FC0,
// fp16 0x7E00 with x's sign), overflow to fp16 gives infinity
uint16_t bf16_from_float(float x);
uint16_t f16_from_float(float x);

// Throws std::out_of_range before writing anything if a position or slot is out of range.
void rope_cache(const RopeCacheArgs& args);

}  // namespace pagedkern_cpu
