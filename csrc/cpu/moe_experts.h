// pagedkern._cpu: a mixture-of-experts layer's routed experts over int4 / int8 weights in one
// call, fp32 rows (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE on the CPU backend):
//   for each expert e with routed rows (ascending e): x_e = its rows of hidden,
//   g = x_e @ Wgu[e].T (+ b), a = act(g[:, :I]) * g[:, I:], y = a @ Wd[e].T (+ b),
//   out[t] += w[t, j] * y for each of its pairs (t, j), in ascending (e, t, j) order.
//
// Design: the host loop it replaces makes ~10 torch calls and two GEMV wrappers per expert
// that received tokens (a Qwen3-MoE decode token: 8 experts a layer, ~100 calls), far more in
// dispatch than the GEMVs' arithmetic at batch 1. Here the grouping, the GEMVs (layer_tail.h's
// linear: quant_gemv.h's tiles), the activation and the weighted sum run in C++. The routing
// (top-k, renormalisation, scoring) stays the caller's: it is cheap and its ties are the
// reference's. A token's sum runs over its own pairs in expert order and each GEMV row depends
// on its own input only, so a row's result does not depend on the batch. Threads take whole
// experts from a shared counter where there are two or more routed experts a thread (one
// parallel region a layer), else split each GEMV's rows; either gives the same bits.

#pragma once

#include <cstdint>

#include "layer_tail.h"

namespace pagedkern_cpu {

struct MoeExpertsArgs {
  const float* hidden;  // [m, hidden_size]
  int m, hidden_size, intermediate, top_k, experts;
  const int32_t* ids;     // [m, top_k] expert ids
  const float* weights;   // [m, top_k] routing weights
  const QuantLinear* gate_up;  // [experts]: [2 * intermediate, hidden_size] (+ bias)
  const QuantLinear* down;     // [experts]: [hidden_size, intermediate] (+ bias)
  int activation;              // layer_tail.h's Activation
  float* out;                  // [m, hidden_size]
  int threads;
  int64_t parallel_min_macs;
  int path, activation_bits;
};

// Throws std::invalid_argument (before writing) on an expert id outside [0, experts) or
// weights whose shapes do not chain.
void moe_experts(const MoeExpertsArgs& args);

}  // namespace pagedkern_cpu
