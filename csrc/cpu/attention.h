// pagedkern._cpu's attention: query rows over the paged K/V cache, prefill chunks and decode
// rows alike, out[t, h] = softmax(scale * q[t, h] . K[:pos+1]) V (causal; a window, soft-cap
// and sinks optional), fp32, bf16, fp16 or fp8 E4M3 caches (read as fp32, exactly), fp32 out.
//
// Design. A query row's result is a function of its own q, its keys and its position only,
// computed in one fixed order, so it is the same bits in a prefill chunk of any size, as a
// decode row, beside any other rows and on any thread count: the engine's batch invariance
// holds by construction, not by how a BLAS happens to block its GEMMs.
// - Rows of one sequence at consecutive positions form a block (the GQA group's q heads with
//   them) that shares each 8-key chunk while it is in L1; the block only shares loads.
// - Score of key j: eight fp32 lanes, lane l = fma chain over d = l, l + 8, ... of
//   (scale * q[d]) * k[d], then the lanes summed by one tree ((0+1)+(2+3))+((4+5)+(6+7)).
// - Softmax in two passes over the row's own keys [lo, pos]: the max (exact), then e^(s - max)
//   (a Cephes-style polynomial, fused multiply-adds) summed lane-wise over 8-key chunks at
//   absolute key positions (lane l holds keys = l mod 8), then the same tree.
// - P.V: per output lane an fma chain over the row's keys in ascending order, then times
//   1 / sum. Tiles of keys walked by the block only reload the accumulators (exact).
// - Paths: AVX-512 (attention_avx512.cpp: the hot loops over 16 lanes, two rows a register
//   for the scores), AVX2 + FMA (x86, by target attribute) and plain C++ with std::fma
//   written op for op alike, so every path gives the same bits.
// - Threads: (row block, KV head) tasks taken from a shared counter over OpenMP's threads
//   (parallel.h); a task's rows are computed by one thread, so the thread count changes no bit.

#pragma once

#include <cstdint>

namespace pagedkern_cpu {

enum CacheDtype { kCacheF32 = 0, kCacheBF16 = 1, kCacheF16 = 2, kCacheE4M3 = 3 };

struct AttentionArgs {
  const float* q;        // [T, Hq, D], rows q_row_stride apart, heads dense
  int64_t q_row_stride;  // elements
  float* out;            // [T, Hq, D] fp32, rows out_row_stride apart, heads dense
  int64_t out_row_stride;
  float* lse;               // [T, Hq] or null
  const void* k_cache;      // [blocks, Hkv, block_size, D] at the strides below, D dense
  const void* v_cache;
  int cache_dtype;          // CacheDtype
  int64_t block_stride, head_stride, slot_stride;  // elements, the same for k and v
  int64_t num_blocks;
  int hq, hkv, block_size, d;
  const int32_t* block_tables;  // [S, table_width], rows table_stride apart
  int64_t table_stride;
  int num_seqs, table_width;
  const int32_t* row_seq;  // [T]: the sequence (block-table row) of each query row
  const int32_t* row_pos;  // [T]: its position: keys [lo, pos] are visible (-1: none)
  int rows;
  float scale;       // applied to q
  float soft_cap;    // 0: none (HF's order: s / cap, tanh, * cap)
  int window;        // 0: none, else keys [pos - window + 1, pos]
  const float* sinks;  // [Hq] logits or null
  float out_scale;   // applied to the output (fp8 caches' v_scale; 1: none)
  int threads;
  int path;  // -1: the best this CPU runs; kPortable, kAvx2 or kAvx512Vnni
};

// Throws std::invalid_argument / std::out_of_range (before any thread starts) on bad shapes, a
// row's sequence outside the tables, a position past its table or a block id outside the cache.
void attention(const AttentionArgs& args);

// row_seq and row_pos [rows] for query chunks: chunk b's rows cu_seqlens[b] .. cu_seqlens[b + 1]
// - 1 are the last positions before seq_lens[b] (a decode row: seq_lens[b] - 1); rows past the
// last chunk see no key (sequence 0, position -1). Throws std::invalid_argument unless
// cu_seqlens rises from 0 within the rows.
void chunk_rows(const int32_t* cu_seqlens, const int32_t* seq_lens, int num_chunks, int rows,
                int32_t* row_seq, int32_t* row_pos);

// The paths of AttentionArgs::path this CPU runs: kAvx2 where AVX2 + FMA exist, kAvx512Vnni
// where quant_gemv's path of that name runs (AVX-512 F, BW, VL, VNNI; the kernel uses F and VL).
bool attention_path_supported(int path);

namespace attention_detail {
float e4m3_to_float(uint8_t x);  // exact (no infinities; S.1111.111 is NaN)
const float* e4m3_table();       // [256]: e4m3_to_float of every byte (what the pages read)
void portable(const AttentionArgs& args);
void avx2(const AttentionArgs& args);    // not called where not built (not x86)
void avx512(const AttentionArgs& args);  // (the same)
}  // namespace attention_detail

}  // namespace pagedkern_cpu
