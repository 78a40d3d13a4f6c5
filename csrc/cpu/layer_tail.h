// pagedkern._cpu: a Llama-family layer after attention in one call, fp32 rows:
//   h = attn @ Wo.T (+ bo);              residual += h;  h = rms_norm(residual) * post_norm
//   g = h @ Wgu.T (+ bgu);               a = silu(g[:, :I]) * g[:, I:]   (or GELU-tanh: GeGLU)
//   h = a @ Wd.T (+ bd);                 residual += h;  h = rms_norm(residual) * next_norm
// and, with sandwich norms (Gemma 2/3), each product's output normed before its residual add,
// with the quantized GEMV of quant_gemv.h for the three products. A mixture-of-experts layer
// runs its MLP (moe_mlp.h: router, top-k, experts, shared expert) in place of the two.
//
// Design: at batch 1 the layer's math between GEMVs is ~10 kFLOP, while the ops that express it
// in torch cost ~10 µs of dispatch each (Python, then ATen); one call here replaces ~15 of them
// and the three GEMVs' Python wrappers. The elementwise passes run over rows split across
// torch's OpenMP team (parallel.h) and are written as plain loops the compiler vectorizes for
// the baseline ISA (the module's one build serves every x86-64), but for the gated activation's
// AVX2 twin of its loop (gated_activation.h, the same operations): the bits are the same on every
// CPU and a row's result never depends on the other rows, M, or the thread count, so the
// engine's outputs stay independent of batch make-up. The statistics and products are fp32 as
// the reference defines them (reference/norm.py, reference/activation.py); the sums run in a
// fixed order of 16 partial sums, so they round differently from torch's (~1e-7 relative).

#pragma once

#include <cstdint>

namespace pagedkern_cpu {

struct MoeMlp;  // moe_mlp.h

struct QuantLinear {
  int format;             // the tiles' Format (quant_gemv.h)
  const uint8_t* packed;  // pack.cpp's tiles
  const float* scales;    // int8: per output channel; int4: unused
  const float* bias;      // [n] or nullptr
  int n, k;
  const int64_t* input_index = nullptr;  // act-order: column j reads x[input_index[j]] (k of them)
};

enum Activation { kSilu = 0, kGeluTanh = 1 };

struct GemvRun {  // how a GEMV call runs over m rows
  int m;
  int threads;  // the team's size from `parallel_min_macs` multiply-adds up
  int64_t parallel_min_macs;
  int path, activation_bits;
};

struct LayerTailArgs {
  QuantLinear o, gate_up, down;
  const float* post_norm;  // [hidden]
  const float* next_norm;  // [hidden]
  float eps;
  int m, hidden, intermediate;
  int threads;             // the team's size for the GEMVs and row passes from
                           // `parallel_min_macs` multiply-adds (or elementwise steps) up
  int64_t parallel_min_macs;
  int path, activation_bits;
  int activation = kSilu;                // Activation
  const float* attn_out_norm = nullptr;  // [hidden]: sandwich norms, or null
  const float* mlp_out_norm = nullptr;
  const MoeMlp* moe = nullptr;  // a MoE layer's MLP (gate_up, down, intermediate unused)

  GemvRun gemv() const { return {m, threads, parallel_min_macs, path, activation_bits}; }
};

// y [run.m, w.n] (dense) = x [run.m, w.k] (row stride x_stride) @ W.T (+ bias): the tail's
// GEMV, on run.threads from run.parallel_min_macs multiply-adds, run.path, run.activation_bits
// (an act-order weight's x gathered by its input_index first).
void linear(const QuantLinear& w, const GemvRun& run, const float* x, int64_t x_stride,
            float* y);

// y [run.m, down.n] (dense) = down(act(g) * u) of [g | u] = gate_up(x), x [run.m, gate_up.k]
// rows x_stride apart: a gated MLP (the dense layer's, each routed expert's, a shared
// expert's). act: SiLU or GELU-tanh, e^x by a polynomial (~3e-7 relative); its rows split over
// run.threads from run.parallel_min_macs steps up, as the GEMVs.
void gated_mlp(const QuantLinear& gate_up, const QuantLinear& down, int activation,
               const GemvRun& run, const float* x, int64_t x_stride, float* y);

// attn [m, o.k] (row stride attn_stride), residual [m, hidden] in place, h_out [m, hidden].
void layer_tail(const LayerTailArgs& args, const float* attn, int64_t attn_stride,
                float* residual, float* h_out);

}  // namespace pagedkern_cpu
