// flash_prefill: causal varlen prefill attention over the paged KV cache; parameters and launcher
// (kernels in flash_prefill_sm80.cu and flash_prefill_sm90.cu, scheduler in flash_prefill.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern {

// Sequence b owns query rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 (n_b rows) and seq_lens[b]
// keys in the cache, read through block_tables[b, :]; query i of the chunk sits at position
// seq_lens[b] - n_b + i and sees keys 0..that position. GQA: query head h reads KV head
// h / (num_heads / num_kv_heads). Options (reference.attention.ATTENTION_OPTIONS; path 1, and
// path 2 under kFlashVariantSm90Options only, the dispatcher routes the rest): window > 0
// hides keys window or more positions before the query (KV tiles wholly before a query tile's window are never loaded,
// keys before it in the first tile are zero-filled); soft_cap > 0 turns each scaled score s
// into soft_cap * tanh(s / soft_cap); sinks [Hq] fp32 logits join each row's denominator.
struct FlashPrefillParams {
  void* out = nullptr;              // [total_q, num_heads, head_dim], token stride out_stride
  float* lse = nullptr;             // [total_q, num_heads] natural-log LSE, or nullptr
  const void* q = nullptr;          // [total_q, num_heads, head_dim], token stride q_stride
  const void* k_cache = nullptr;    // [num_blocks, num_kv_heads, block_size, head_dim]
  const void* v_cache = nullptr;    // same shape as k_cache
  // K/V caches of float8_e4m3fn (q and out stay `dtype`; path 1 only), else of `dtype`.
  bool fp8_cache = false;
  const int* cu_seqlens_q = nullptr;  // [batch + 1]
  const int* block_tables = nullptr;  // [batch, block_table_width], row stride block_table_stride
  const int* seq_lens = nullptr;      // [batch]
  int* workspace = nullptr;  // flash_prefill_workspace_ints(total_q, batch) int32, device memory
  int64_t q_stride = 0;      // elements between tokens
  int64_t out_stride = 0;
  int64_t num_blocks = 0;          // pages in each cache (check_indices: ids in [0, num_blocks))
  int64_t block_table_stride = 0;
  int64_t block_table_width = 0;   // entries per row (check_indices: seq_lens fit the row)
  int total_q = 0;
  int batch = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  float scale = 0.f;  // softmax scale (the Python layer: head_dim^-0.5 by default, times k_scale)
  float out_scale = 1.f;  // multiplies the output (the Python layer's v_scale)
  DType dtype = DType::kBFloat16;
  // Debug mode: trap on an out-of-range block id, cu_seqlens_q not rising from 0 to total_q, or
  // seq_lens[b] outside [chunk length, block_table_width * block_size].
  bool check_indices = false;
  int variant = 0;  // kFlashVariantV2 or kFlashVariantV1 (kernel schedule, both paths)
  int window = 0;                // sliding window in keys; 0: none
  float soft_cap = 0.f;          // logit soft-cap (of the scaled scores); 0: none
  const float* sinks = nullptr;  // [num_heads] attention-sink logits, or nullptr
};

// Kernel schedules, kept selectable until a GPU run has verified v2 (PAGEDKERN_KERNELS).
// v2 (default): page ids fetched a tile ahead (both paths), P double-buffered (path 2).
// v1: the first schedule (table lookups on the copy path, one P buffer).
constexpr int kFlashVariantV2 = 0;
constexpr int kFlashVariantV1 = 1;
// v2, and calls with a window, soft-cap or sinks run path 2 where it can run (Hopper): its
// options kernel, not yet verified on a GPU (v2 sends them to path 1).
constexpr int kFlashVariantSm90Options = 2;

// Path 1: mma.sync + cp.async (sm_80 and newer). Path 2: wgmma + TMA, warp specialised (sm_90).
enum class FlashPrefillPath : int { kAuto = 0, kSm80 = 1, kSm90 = 2 };

// int32 entries of the workspace: the work list the scheduler kernel builds on the device.
int64_t flash_prefill_workspace_ints(int64_t total_q, int64_t batch);

// The path a call with these parameters takes on `device` (kAuto resolved; kSm90 where the
// device or the page layout cannot take it falls back to kSm80 unless `strict`, which throws).
FlashPrefillPath flash_prefill_select_path(const FlashPrefillParams& p, int device,
                                           FlashPrefillPath requested, bool strict);

// Launches the scheduler and the attention kernel on `stream` (no host synchronisation); returns
// the path that ran. The caller has made `device` current.
FlashPrefillPath flash_prefill(const FlashPrefillParams& p, FlashPrefillPath path, bool strict,
                               cudaStream_t stream);

}  // namespace pagedkern
