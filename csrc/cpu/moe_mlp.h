// pagedkern._cpu: a mixture-of-experts layer's MLP in one call, fp32 rows (Qwen3-MoE,
// Qwen2-MoE, Mixtral, OLMoE on the CPU backend):
//   logits = h @ router.T (+ router_bias)                        [m, experts], fp32
//   ids    = each row's top_k logits, descending (ties: the lower expert first; NaN above all)
//   w      = softmax over all experts at ids | sigmoid(logit) | softmax over the top_k logits,
//            divided by their sum if `renormalize`
//   out    = moe_experts(h, ids, w) (+ sigmoid(h . shared_gate) * down(silu(g) * u) of the
//            shared expert's gate_up(h) = [g | u], Qwen2-MoE)
// reference/moe.py's moe_route and model/moe.py's moe_mlp, with the expert GEMVs of
// moe_experts.h.
//
// Design: the layer tail (layer_tail.h) runs this in place of its dense MLP, so a MoE layer runs
// in the same one call as a dense one, in the layer loop and in the one-call decoder alike (the
// same function on the same buffers: the same bits either way). What it removes is the Python
// between the router GEMM, the routing's ~8 torch ops and the experts' call, and with it the
// layer's attention glue once the decoder takes the whole stack (measured:
// bench/results/2026-12-06-epyc-avx2-moe-decoder.md).
// The router is an fp32 GEMM (the loaders keep it float: llama.cpp's files hold it F32) and the
// shared expert's gate an fp32 dot, both dense_gemm's fixed order (dense_gemm.h): the bits of
// linear() on the CPU backend, so the layer loop's ops and this call route alike, and a row's
// logits never depend on the batch, the thread count or the ISA. The selection compares
// logits (the scorings are monotone in them),
// so the ids never depend on how e^x rounds.

#pragma once

#include <cstdint>
#include <vector>

#include "layer_tail.h"

namespace pagedkern_cpu {

enum MoeScoring { kSoftmax = 0, kSigmoid = 1, kSoftmaxTopk = 2 };

struct MoeMlp {
  int hidden;
  const float* router;       // [experts, hidden] fp32
  const float* router_bias;  // [experts] or null
  int experts, top_k, scoring;
  bool renormalize;
  std::vector<QuantLinear> gate_up, down;  // [experts]: [2 I, hidden], [hidden, I] (+ bias)
  int intermediate, activation;            // the experts' I and gate (layer_tail.h)
  QuantLinear shared_gate_up{}, shared_down{};  // the shared expert (n == 0: none)
  const float* shared_gate = nullptr;           // [hidden] fp32, with the shared expert
};

// Throws std::invalid_argument where the weights do not chain (what moe_mlp checks first).
void check_moe_mlp(const MoeMlp& moe);

// ids [m, top_k] and weights [m, top_k] of rows h [m, hidden]
void moe_route(const MoeMlp& moe, const float* h, int m, const GemvRun& run, int32_t* ids,
               float* weights);

// out [m, hidden] = the MoE MLP of h [m, hidden] (check_moe_mlp first, before writing)
void moe_mlp(const MoeMlp& moe, const float* h, int m, const GemvRun& run, float* out);

}  // namespace pagedkern_cpu
