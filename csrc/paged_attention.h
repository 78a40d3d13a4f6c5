// paged_attention (decode, split-KV): parameters and launcher (kernels in paged_attention.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern {

// out[b, h] = softmax(q[b, h] . K_b^T * scale) V_b over keys 0..seq_lens[b]-1 of sequence b, read
// through block_tables[b] from HND pages [num_blocks, Hkv, block_size, D]; query head h reads KV
// head h / (Hq / Hkv). seq_lens[b] <= 0: zeros (lse -inf). With num_splits > 1 the keys are cut
// into splits of split_size tokens (the last split takes the rest), each written to the fp32
// workspace with its log-sum-exp, and a second kernel merges them. kv_fp8: E4M3 pages (fp8.cuh),
// dequantized on load; scores use scale * k_scale and the output is multiplied by v_scale, i.e.
// attention over the dequantized cache k_scale * K, v_scale * V (both scales 1 for 16-bit caches).
// Options (reference.attention.ATTENTION_OPTIONS): window > 0 keeps keys len - window..len - 1
// (older ones are neither read nor counted: splits start at the window); soft_cap > 0 turns each
// scaled score s into soft_cap * tanh(s / soft_cap); sinks [Hq] fp32 logits join each query
// head's softmax denominator (not its numerator; the lse includes them).
struct PagedAttentionParams {
  void* out = nullptr;             // [B, Hq, D], token stride out_stride
  float* lse = nullptr;            // [B, Hq] natural-log LSE of the scaled scores, or nullptr
  const void* q = nullptr;         // [B, Hq, D], token stride q_stride
  const void* k_cache = nullptr;   // [num_blocks, Hkv, block_size, D], contiguous, T or E4M3
  const void* v_cache = nullptr;
  const int* block_tables = nullptr;  // [B, block_table_width], row stride block_table_stride
  const int* seq_lens = nullptr;      // [B]
  float* workspace = nullptr;  // num_splits > 1: B*Hq*num_splits*(D + 1) floats (partials, LSEs)
  int64_t q_stride = 0;        // in elements
  int64_t out_stride = 0;
  int64_t block_table_stride = 0;
  int64_t block_table_width = 0;  // entries per row (check_indices: seq_lens[b] <= width * bs)
  int64_t num_blocks = 0;         // pages in each cache (check_indices: ids in [0, num_blocks))
  int batch = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;      // 64, 128 or 256
  int block_size = 16;   // a power of two
  int num_splits = 1;
  int split_size = 0;    // tokens per split, a multiple of 64 (num_splits > 1)
  float scale = 1.f;
  float k_scale = 1.f;             // kv_fp8: dequantization scales of the cache
  float v_scale = 1.f;
  DType dtype = DType::kBFloat16;  // float16 or bfloat16 (q and out)
  bool kv_fp8 = false;             // E4M3 caches
  bool check_indices = false;      // trap on an out-of-range block id or seq_len (debug mode)
  int variant = 0;  // kPagedAttentionSimt or kPagedAttentionMma (PAGEDKERN_KERNELS)
  int window = 0;                  // sliding window in keys; 0: none
  float soft_cap = 0.f;            // logit soft-cap; 0: none
  const float* sinks = nullptr;    // [Hq] attention-sink logits, or nullptr
};
// The first key sequence b's query sees: len - window with a window, else 0.
__host__ __device__ inline int paged_attention_first_key(int len, int window) {
  return window > 0 && len > window ? len - window : 0;
}
// The kernel that runs (ops/paged_attention.py resolves the variant "auto" to one of them).
constexpr int kPagedAttentionSimt = 0;  // paged_attention_kernel, fp32 SIMT math, any D
constexpr int kPagedAttentionMma = 1;   // paged_attention_mma_kernel, mma.sync, D = 64 and 128
void paged_attention(const PagedAttentionParams& p, cudaStream_t stream);

}  // namespace pagedkern
