// rejection_sample (speculative verification): parameters and launcher (kernel in
// rejection_sampling.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace pagedkern {

// Request b proposed k_b = cu_draft[b + 1] - cu_draft[b] tokens (rows cu_draft[b] .. of the
// draft arrays) and owns target rows cu_draft[b] + b .. cu_draft[b + 1] + b. Out: row b of
// out_token_ids = the accepted proposals, then the recovered or bonus token, then -1 padding;
// out_num_tokens[b] = accepted + 1. Semantics of python/pagedkern/reference/rejection_sampling.py.
// A request whose cu_draft entries are inconsistent (decreasing, past num_draft, or k_b >
// out_cols - 1) gets a row of -1 and out_num_tokens 0, or a trap with check_indices; a draft id
// outside [0, vocab) is rejected without being read (trap with check_indices).
struct RejectionSampleParams {
  int* out_token_ids = nullptr;        // [batch, out_cols], contiguous
  int* out_num_tokens = nullptr;       // [batch]
  const float* target_probs = nullptr; // [num_draft + batch, vocab], row stride target_stride
  const float* draft_probs = nullptr;  // [num_draft, vocab], row stride draft_stride; null: point mass
  const int* draft_token_ids = nullptr;  // [num_draft]
  const int* cu_draft = nullptr;         // [batch + 1]
  const int64_t* seeds = nullptr;        // [batch]
  const int64_t* offsets = nullptr;      // [batch]: position j draws with offset offsets[b] + j
  int64_t batch = 0;
  int64_t vocab = 0;
  int64_t num_draft = 0;      // D = sum k_b (rows of draft_token_ids / draft_probs)
  int64_t out_cols = 1;       // max k + 1
  int64_t target_stride = 0;  // in elements
  int64_t draft_stride = 0;
  bool check_indices = false;  // trap on an inconsistent cu_draft or a draft id outside the vocab
};
void rejection_sample(const RejectionSampleParams& p, cudaStream_t stream);

}  // namespace pagedkern
