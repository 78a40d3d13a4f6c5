// pagedkern._cpu: a step's whole stack of plain Llama-family layers in one call, fp32 rows:
// per layer the QKV GEMV (+ bias), RoPE + the k/v store (rope_cache.h), attention over the
// paged cache (attention.h), then the layer tail (layer_tail.h).
//
// Design: each piece is the function the per-op path calls, in the same order on the same
// buffers, so the call gives that path's bits (a row's result still depends on its own inputs
// only: batch invariance holds). What it removes is the Python between them: ~6 calls and ~12
// torch ops a layer, ~100 µs of dispatch a layer on one core against ~40 µs of 135M-shape
// GEMVs at batch 1. The model (ops/cpu/decoder.py) runs it where every layer has this shape.

#pragma once

#include <cstdint>
#include <vector>

#include "layer_tail.h"

namespace pagedkern_cpu {

struct DecoderLayer {
  QuantLinear qkv, o, gate_up, down;
  const float* post_norm;  // [hidden]
  const float* next_norm;  // [hidden]: the next layer's input norm, the final norm last
  float* k_cache;          // [blocks, Hkv, block_size, D] (Decoder's strides)
  float* v_cache;
};

struct DecoderShape {
  int hq, hkv, d, hidden, intermediate;
  float eps, scale;  // the RMSNorms' epsilon, the attention's score scale
  int64_t block_stride, head_stride, slot_stride, num_blocks;
  int block_size;
  const float* factors;  // [num_positions, 2D] RoPE rows (rope_cache.h)
  int64_t num_positions;
  int64_t parallel_min_macs;
};

struct DecoderStep {
  int m;                     // rows
  float* h;                  // [m, hidden]: the first layer's normed input, then the output
  float* residual;           // [m, hidden], updated in place
  const int64_t* positions;  // [m]
  const int64_t* slots;      // [m]
  const int32_t* row_seq;    // [m] (attention.h)
  const int32_t* row_pos;    // [m]
  const int32_t* block_tables;
  int64_t table_stride;
  int num_seqs, table_width;
  int threads, path, activation_bits;
};

// Throws where rope_cache or attention would refuse: at the first layer, whose indices are
// every layer's.
void decoder(const DecoderShape& shape, const std::vector<DecoderLayer>& layers,
             const DecoderStep& step);

}  // namespace pagedkern_cpu
