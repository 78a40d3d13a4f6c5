// The layer tail (layer_tail.h): three GEMVs and the elementwise passes between them.

#include "layer_tail.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "gated_activation.h"
#include "moe_mlp.h"
#include "parallel.h"
#include "quant_gemv.h"
#include "rms.h"

namespace pagedkern_cpu {
namespace {

// residual[r] += y[r]; out[r] = residual[r] * rsqrt(mean(residual[r]^2) + eps) * weight
void add_rms_norm(float* residual, const float* y, float* out, const float* weight, float eps,
                  int h) {
  for (int i = 0; i < h; ++i) residual[i] += y[i];
  rms_norm_row(residual, out, weight, eps, h);
}

// body(r) for every row r of run.m, rows split over the team from the GEMVs' threshold of work
template <typename Body>
void for_rows(const GemvRun& run, int64_t work_per_row, const Body& body) {
  const int threads = int64_t(run.m) * work_per_row >= run.parallel_min_macs ? run.threads : 1;
  parallel(std::min(threads, run.m), [&](int part, int parts) {
    const int r1 = int(int64_t(run.m) * (part + 1) / parts);
    for (int r = int(int64_t(run.m) * part / parts); r < r1; ++r) body(r);
  });
}

}  // namespace

void linear(const QuantLinear& w, const GemvRun& run, const float* x, int64_t x_stride,
            float* y) {
  if (w.input_index != nullptr) {  // act-order: the stored columns' inputs, k values a row
    thread_local std::vector<float> gathered;  // (this thread's: experts run on every thread)
    gathered.resize(size_t(run.m) * w.k);
    for (int r = 0; r < run.m; ++r) {
      const float* row = x + int64_t(r) * x_stride;
      float* out = gathered.data() + int64_t(r) * w.k;
      for (int j = 0; j < w.k; ++j) out[j] = row[w.input_index[j]];
    }
    x = gathered.data();
    x_stride = w.k;
  }
  const int64_t macs = int64_t(run.m) * w.n * w.k;
  gemv(w.format, y, w.n, x, x_stride, w.packed, w.scales, run.m, w.n, w.k,
       macs >= run.parallel_min_macs ? run.threads : 1, run.path, run.activation_bits);
  if (w.bias != nullptr)
    for (int r = 0; r < run.m; ++r)
      for (int j = 0; j < w.n; ++j) y[int64_t(r) * w.n + j] += w.bias[j];
}

void gated_mlp(const QuantLinear& gate_up, const QuantLinear& down, int activation,
               const GemvRun& run, const float* x, int64_t x_stride, float* y) {
  const int inter = down.k;
  // this thread's (the routed experts run it on every thread of the team at once)
  thread_local std::vector<float> g_buf, act_buf;
  g_buf.resize(size_t(run.m) * 2 * inter);
  act_buf.resize(size_t(run.m) * inter);
  float *g = g_buf.data(), *act = act_buf.data();
  linear(gate_up, run, x, x_stride, g);
  const bool simd = run.path != kPortable;  // (the same bits either way)
  for_rows(run, int64_t(inter) * 8, [&](int r) {
    gated_activation(activation, g + int64_t(r) * 2 * inter, act + int64_t(r) * inter, inter,
                     simd);
  });
  linear(down, run, act, inter, y);
}

void layer_tail(const LayerTailArgs& a, const float* attn, int64_t attn_stride, float* residual,
                float* h_out) {
  const int h = a.hidden, inter = a.intermediate;
  const bool dense_chains = a.gate_up.n == 2 * inter && a.gate_up.k == h && a.down.n == h &&
                            a.down.k == inter;
  if (a.o.n != h || (a.moe == nullptr && !dense_chains))
    throw std::invalid_argument("layer_tail: the weights' shapes do not chain");
  if (a.moe != nullptr) {
    if (a.moe->hidden != h) throw std::invalid_argument("layer_tail: the MoE MLP's hidden size");
    check_moe_mlp(*a.moe);
  }
  if (a.m <= 0) return;
  // reused across the 30-odd layers of a step and across steps (a decode step's sizes repeat)
  thread_local std::vector<float> y_buf;
  y_buf.resize(size_t(a.m) * h);
  float* y = y_buf.data();

  linear(a.o, a.gemv(), attn, attn_stride, y);
  for_rows(a.gemv(), h, [&](int r) {
    const int64_t at = int64_t(r) * h;
    if (a.attn_out_norm != nullptr) rms_norm_row(y + at, y + at, a.attn_out_norm, a.eps, h);
    add_rms_norm(residual + at, y + at, h_out + at, a.post_norm, a.eps, h);
  });
  if (a.moe != nullptr)
    moe_mlp(*a.moe, h_out, a.m, a.gemv(), y);
  else
    gated_mlp(a.gate_up, a.down, a.activation, a.gemv(), h_out, h, y);
  for_rows(a.gemv(), h, [&](int r) {
    const int64_t at = int64_t(r) * h;
    if (a.mlp_out_norm != nullptr) rms_norm_row(y + at, y + at, a.mlp_out_norm, a.eps, h);
    add_rms_norm(residual + at, y + at, h_out + at, a.next_norm, a.eps, h);
  });
}

}  // namespace pagedkern_cpu
