// pagedkern._cpu: a step's whole stack of Llama-family layers in one call, fp32 rows:
// per layer the QKV GEMV (+ bias), QK-norm, RoPE + the k/v store (rope_cache.h), attention
// over the paged cache with the layer's window, sinks and the model's soft-cap (attention.h),
// then the layer tail with its sandwich norms and activation, or a mixture-of-experts layer's
// MLP (layer_tail.h, moe_mlp.h). Llama, Mistral, Qwen2/3, Qwen2/3-MoE, Mixtral and Gemma 2/3
// layers over fp32, bf16, fp16 or fp8 (E4M3, per-layer scales) caches; a hybrid cache's layers
// read their group's tables.
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
#include "moe_mlp.h"

namespace pagedkern_cpu {

struct DecoderLayer {
  QuantLinear qkv, o, gate_up, down;  // (gate_up, down: unused by a MoE layer)
  const float* post_norm;      // [hidden]
  const float* next_norm;      // [hidden]: the next layer's input norm, the final norm last
  const float* attn_out_norm;  // [hidden] sandwich norms (Gemma 2/3), or null
  const float* mlp_out_norm;
  const float* q_norm;  // [D] QK-norm (Qwen3, Gemma 3), or null
  const float* k_norm;
  const float* sinks;  // [hq] attention sinks, or null
  int window;          // sliding window (attention.h), 0: none
  const float* factors;  // [num_positions, 2D] this layer's RoPE rows (rope_cache.h)
  int64_t num_positions;
  int group;      // the KV layer group whose block tables and slots it reads
  void* k_cache;  // [blocks, Hkv, block_size, D] (Decoder's strides), of DecoderShape's dtype
  void* v_cache;
  float scale;      // the attention's score scale (an fp8 cache's k_scale in it)
  float out_scale;  // an fp8 cache's v_scale (1: none)
  float k_inv_scale, v_inv_scale;  // fp8: fp32(1 / k_scale), fp32(1 / v_scale) (rope_cache.h)
  const MoeMlp* moe = nullptr;     // a mixture-of-experts layer's MLP, or null
};

struct DecoderShape {
  int hq, hkv, d, hidden, intermediate;
  float eps, soft_cap;  // the RMSNorms' epsilon, the attention's soft-cap
  int activation;       // layer_tail.h's Activation
  int cache_dtype;      // attention.h's CacheDtype
  int64_t block_stride, head_stride, slot_stride, num_blocks;
  int block_size;
  int64_t parallel_min_macs;
};

struct DecoderTables {  // one KV layer group's (a cache of one table: one)
  const int32_t* slots;  // [m] (-1: no write)
  const int32_t* block_tables;
  int64_t table_stride;
  int table_width;
};

struct DecoderStep {
  int m;                      // rows
  float* h;                   // [m, hidden]: the first layer's normed input, then the output
  float* residual;            // [m, hidden], updated in place
  const int32_t* positions;   // [m]
  const int32_t* cu_seqlens;  // [num_chunks + 1]: chunk b's rows are cu[b] .. cu[b + 1] - 1
  const int32_t* seq_lens;    // [num_chunks]: a chunk's rows are its sequence's last positions
  int num_chunks;
  std::vector<DecoderTables> groups;
  int num_seqs;  // block-table rows
  int threads, path, activation_bits;
};

// Throws where rope_cache or attention would refuse: at a group's first layer, whose indices
// are the group's.
void decoder(const DecoderShape& shape, const std::vector<DecoderLayer>& layers,
             const DecoderStep& step);

}  // namespace pagedkern_cpu
