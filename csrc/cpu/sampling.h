// pagedkern._cpu: one token id per row of processed logits, reference/sampling.py's semantics
// (greedy, temperature, min-p, top-k, top-p, the philox draw by inverse CDF in vocabulary order).
//
// Design: torch's reference spends its time on whole-vocabulary sorts (top-k and top-p sort
// every row: ~8 ms a row at V = 49k, ~22 ms at 152k) and on the dispatch of ~40 small ops
// (~0.1-0.3 ms a greedy step). Here a row is a few passes over its V floats, with no sort of the
// vocabulary:
//   1. s = x / T (a row holding +inf: 0 at its +inf entries, -inf elsewhere), its max, and the
//      argmax of x (ties to the lowest id) for greedy rows and the greedy fallback;
//   2. min-p is a threshold on s (s_max + log min_p), and so is top-k: the k-th largest s,
//      found by a scan with a k-entry min-heap (nth_element over a copy for large k);
//   3. the kept tokens' exp(s - s_max) and their sum (only those: top-k's cost is O(V + k));
//   4. top-p is then a threshold on p: most rows' cut lies among the few probabilities within
//      2^-8 of the largest, and only those are sorted; a flat row's is found by a histogram of
//      the mass over the probabilities' top 12 bits, and only the bin it falls in is sorted;
//   5. the draw walks the kept probabilities in id order, summing in double, to the first id
//      whose cumulative mass exceeds u * total.
// Logprob outputs follow reference/logits_processing.py: log_softmax of s (at T = 1 for greedy
// rows) before any truncation, one pass for the sum of every exponential and a top-N heap scan.
// Sums run in a fixed order, so a row's id depends only on the row and its parameters (never
// on the batch or the thread count). The probabilities round differently from torch's softmax
// (~1 ulp), so an id can differ from the reference's only where u * total falls within that
// rounding of a boundary: the same distribution, the same ids in all but such rows.

#pragma once

#include <cstdint>

namespace pagedkern_cpu {

struct SampleArgs {
  int32_t* out;              // [rows] ids
  const float* logits;       // [rows, vocab], row stride logits_stride; NaN counts as -inf
  int64_t logits_stride;
  int rows, vocab;
  const float* temperature;  // [rows] (<= 0: greedy)
  const float* top_p;        // [rows] (>= 1: off)
  const int32_t* top_k;      // [rows] (<= 0 or >= vocab: off)
  const float* min_p;        // [rows] (<= 0: off)
  const int64_t* seeds;      // [rows]
  const int64_t* offsets;    // [rows]
  int threads;               // rows are split over up to this many threads
  // optional outputs (null: not written): the sampled id's log-probability [rows], and the
  // top_n largest [rows, top_n] (ids, values; descending, ties to the lower id)
  float* logprobs = nullptr;
  int32_t* top_ids = nullptr;
  float* top_logprobs = nullptr;
  int top_n = 0;
};

void sample(const SampleArgs& args);

// Word 0 of philox4x32_10(counter=(offset, 0), key=seed) / 2^32: the draw's u in [0, 1).
double philox_uniform(int64_t seed, int64_t offset);

}  // namespace pagedkern_cpu
