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
  // Logits processing (python/pagedkern/reference/logits_processing.py), each null = off.
  // Sparse entries of row r: token_offsets[r] .. token_offsets[r + 1], distinct ids per row.
  const int* token_offsets = nullptr;  // [rows + 1]
  const int* token_ids = nullptr;      // [nnz]
  const int* token_counts = nullptr;   // [nnz]; >= 0: in the penalty set, -1: bias only
  const float* token_bias = nullptr;   // [nnz]
  const float* presence_penalty = nullptr;    // [rows]
  const float* frequency_penalty = nullptr;   // [rows]
  const float* repetition_penalty = nullptr;  // [rows]
  const int* bitmask = nullptr;       // [masks, bitmask_words]: bit t % 32 of word t / 32
  const int* bitmask_rows = nullptr;  // [rows]; < 0: no mask
  int64_t bitmask_words = 0;
  // The arrays' lengths, which bound what the kernels read: a bitmask row >= num_masks is no
  // mask, token_offsets that do not rise within [0, nnz] give the row no entries (the values
  // are never read back to the host); with check_indices either traps (debug mode).
  int64_t num_masks = 0;
  int64_t nnz = 0;
  bool check_indices = false;
  const float* min_p = nullptr;  // [rows]; <= 0: off
  float* logprobs = nullptr;     // [rows] out: the sampled token's log-probability
  // Top-N outputs (variant 0 only; N <= 20 and <= vocab): the N most likely tokens of the
  // logprob distribution, descending, ties to the lower id.
  int* top_ids = nullptr;         // [rows, top_n]
  float* top_logprobs = nullptr;  // [rows, top_n]
  int top_n = 0;
  // [rows, workspace_stride] fp32. Variant 0 (fused, needed with sparse entries): the entries'
  // processed values at their ids (nothing else written), then from float
  // sample_entry_bits_offset(vocab) on ceil(vocab / 32) words marking the entries. Variant 1
  // (needed with sparse entries or masks): the processed logits, the whole row.
  float* workspace = nullptr;
  int64_t workspace_stride = 0;
  // 0: v3, one fused kernel (sampling_fused.cu); 1: v2, processing stage + v1 passes; 2: v4,
  // the row split over `slices` CTAs (sampling_split.cu; slices = 1: v3's kernel).
  int variant = 0;
  // Variant 2 with slices > 1 (no logprob outputs): CTAs per row, and the rows' merge state,
  // [rows, split_state_stride >= sample_split_state_words(slices)] 64-bit words (any contents).
  int slices = 1;
  unsigned long long* split_state = nullptr;
  int64_t split_state_stride = 0;
};
void sample(const SampleParams& p, cudaStream_t stream);

// Variant 0's launcher (sampling_fused.cu), called by sample() once the arguments are checked.
void sample_fused(const SampleParams& p, cudaStream_t stream);
__host__ __device__ inline int64_t sample_entry_bits_offset(int64_t vocab) {
  return (vocab + 3) / 4 * 4;
}

// Variant 2's launcher (sampling_split.cu) for slices > 1.
void sample_split(const SampleParams& p, cudaStream_t stream);
// Elements per slice: ceil(vocab / slices) rounded up to 32 (one word of the mask and entry
// bitmaps, a multiple of every kVec); the grid has ceil(vocab / slice) CTAs per row.
__host__ __device__ inline int64_t sample_split_slice(int64_t vocab, int64_t slices) {
  return ((vocab + slices - 1) / slices + 31) / 32 * 32;
}
// Per row: 16 control words, two histograms of 256 (count, mass) pairs, 3 words per slice.
__host__ __device__ inline int64_t sample_split_state_words(int64_t slices) {
  return 16 + 4 * 256 + 3 * slices;
}

}  // namespace pagedkern
