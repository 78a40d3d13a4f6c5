// pagedkern._cpu: rows of a QuantizedWeight (reference/quantized_weight.py) as fp32, by id: an
// embedding lookup from a quantized table (an embedding tied to a quantized LM head).
//
// Design: dequantize_rows's own arithmetic, q * scale, then + min, each rounded to fp32 (no
// fused multiply-add: the module builds with -ffp-contract=off), so a row is its bits. What it
// removes is the reference's torch passes (gather, unpack, widen, scale, add): ~17 us of a
// batch-1 decode step's host work, and more with the caches cold after the layers. Every id is
// checked before a row is written.

#pragma once

#include <cstdint>

namespace pagedkern_cpu {

struct DequantizeRowsArgs {
  bool int4;            // int4 (qweight uint8 [n, k / 2], low nibble first), else int8 [n, k]
  const void* qweight;
  const void* scales;   // [n] (int8 per channel: group 0) or [n, k / group]
  const void* mins;     // [n, k / group], or null (int8 without mins)
  bool half_scales;     // scales and mins fp16 (else fp32)
  int64_t n, k;
  int group;            // 0: a scale per row (int8 only)
  const int32_t* ids;   // [m] in [0, n)
  int m;
  float* out;           // [m, k]
  int threads;
};

void dequantize_rows(const DequantizeRowsArgs& a);

}  // namespace pagedkern_cpu
