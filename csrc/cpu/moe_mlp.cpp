// moe_mlp.h: the router GEMV, the top-k and its weights, the routed experts, the shared expert.

#include "moe_mlp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "moe_experts.h"
#include "parallel.h"
#include "quant_gemv.h"  // QUANT_GEMV_X86, path_supported
#include "rms.h"         // fixed_order_dot

namespace pagedkern_cpu {
namespace {

#if defined(__GNUC__) || defined(__clang__)
// The router's GEMM: fixed_order_dot's lanes as two 8-float vectors (GCC / clang vector
// extensions, so one source serves the baseline ISA and AVX2), a tile of 2 rows x 2 experts
// sharing each load.
// Each lane is a multiply then an add, as fixed_order_dot's (the module is built without FP
// contraction), so every tile and ISA gives fixed_order_dot's bits.
typedef float V8 __attribute__((vector_size(32)));

// (through a reference: a V8 returned by value would be an ABI question in the baseline build)
__attribute__((always_inline)) inline void load8(V8& v, const float* p) {
  std::memcpy(&v, p, sizeof v);
}

template <int R>
__attribute__((always_inline)) inline void dot_tile(const float* x, int64_t x_stride,
                                                    const float* w, int64_t w_stride, int n,
                                                    float* out, int64_t out_stride) {
  constexpr int X = 2, kLanes = 16;
  V8 lo[R][X] = {}, hi[R][X] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    V8 wl[X], wh[X];
    for (int c = 0; c < X; ++c) {
      load8(wl[c], w + c * w_stride + i);
      load8(wh[c], w + c * w_stride + i + 8);
    }
    for (int r = 0; r < R; ++r) {
      V8 xl, xh;
      load8(xl, x + r * x_stride + i);
      load8(xh, x + r * x_stride + i + 8);
      for (int c = 0; c < X; ++c) {
        lo[r][c] += xl * wl[c];
        hi[r][c] += xh * wh[c];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < X; ++c) {
      float partial[kLanes];
      std::memcpy(partial, &lo[r][c], sizeof lo[r][c]);
      std::memcpy(partial + 8, &hi[r][c], sizeof hi[r][c]);
      for (int j = i; j < n; ++j) partial[j % kLanes] += x[r * x_stride + j] * w[c * w_stride + j];
      for (int width = kLanes / 2; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) partial[l] += partial[l + width];
      out[r * out_stride + c] = partial[0];
    }
}

// logits[r, e] = x[r] . w[e] for rows [0, m) and experts [e0, e1), blocked so a block of rows
// stays in L2 while the experts' rows stream past it
__attribute__((always_inline)) inline void router_gemm_body(const float* x, int m, int n,
                                                            const float* w, int e0, int e1,
                                                            float* logits, int experts) {
  constexpr int kRowBlock = 32;
  for (int r0 = 0; r0 < m; r0 += kRowBlock) {
    const int r1 = std::min(m, r0 + kRowBlock);
    int e = e0;
    for (; e + 2 <= e1; e += 2) {
      const float* we = w + int64_t(e) * n;
      int r = r0;
      for (; r + 2 <= r1; r += 2)
        dot_tile<2>(x + int64_t(r) * n, n, we, n, n, logits + int64_t(r) * experts + e, experts);
      if (r < r1)
        dot_tile<1>(x + int64_t(r) * n, n, we, n, n, logits + int64_t(r) * experts + e, experts);
    }
    for (; e < e1; ++e)
      for (int r = r0; r < r1; ++r)
        logits[int64_t(r) * experts + e] =
            fixed_order_dot(x + int64_t(r) * n, w + int64_t(e) * n, n);
  }
}

void router_gemm_baseline(const float* x, int m, int n, const float* w, int e0, int e1,
                          float* logits, int experts) {
  router_gemm_body(x, m, n, w, e0, e1, logits, experts);
}

#if QUANT_GEMV_X86
__attribute__((target("avx2"))) void router_gemm_avx2(const float* x, int m, int n,
                                                      const float* w, int e0, int e1,
                                                      float* logits, int experts) {
  router_gemm_body(x, m, n, w, e0, e1, logits, experts);
}
#endif
#endif

// logits[r, e] = x[r] . w[e] (fixed_order_dot's bits) for experts [e0, e1)
void router_gemm(const float* x, int m, int n, const float* w, int e0, int e1, float* logits,
                 int experts) {
#if defined(__GNUC__) || defined(__clang__)
#if QUANT_GEMV_X86
  static const bool avx2 = path_supported(kAvx2);
  if (avx2) return router_gemm_avx2(x, m, n, w, e0, e1, logits, experts);
#endif
  router_gemm_baseline(x, m, n, w, e0, e1, logits, experts);
#else
  for (int e = e0; e < e1; ++e)
    for (int r = 0; r < m; ++r)
      logits[int64_t(r) * experts + e] =
          fixed_order_dot(x + int64_t(r) * n, w + int64_t(e) * n, n);
#endif
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// torch.sort(descending=True, stable=True)'s order: NaN first, then larger values, ties by
// the lower index
bool ranks_before(const float* logits, int a, int b) {
  const bool nan_a = std::isnan(logits[a]), nan_b = std::isnan(logits[b]);
  if (nan_a != nan_b) return nan_a;
  if (!nan_a && logits[a] != logits[b]) return logits[a] > logits[b];
  return a < b;
}

// one row's ids and weights from its logits
void route_row(const MoeMlp& moe, const float* logits, int* order, int32_t* ids, float* w) {
  const int e = moe.experts, k = moe.top_k;
  for (int i = 0; i < e; ++i) order[i] = i;
  std::partial_sort(order, order + k, order + e,
                    [&](int a, int b) { return ranks_before(logits, a, b); });
  for (int j = 0; j < k; ++j) ids[j] = order[j];
  if (moe.scoring == kSigmoid) {
    for (int j = 0; j < k; ++j) w[j] = sigmoid(logits[ids[j]]);
  } else {  // softmax over all experts, or over the k chosen
    const bool all = moe.scoring == kSoftmax;
    const float top = logits[ids[0]];  // the row's max (NaN: a NaN row's, as torch's softmax)
    float sum = 0.0f;
    if (all)
      for (int i = 0; i < e; ++i) sum += std::exp(logits[i] - top);
    for (int j = 0; j < k; ++j) {
      w[j] = std::exp(logits[ids[j]] - top);
      if (!all) sum += w[j];
    }
    for (int j = 0; j < k; ++j) w[j] /= sum;
  }
  if (moe.renormalize) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += w[j];
    for (int j = 0; j < k; ++j) w[j] /= sum;
  }
}

std::string shape(const QuantLinear& w) {
  return "[" + std::to_string(w.n) + ", " + std::to_string(w.k) + "]";
}

}  // namespace

void check_moe_mlp(const MoeMlp& moe) {
  const int h = moe.hidden, inter = moe.intermediate;
  if (moe.router == nullptr || moe.experts <= 0 || moe.top_k <= 0 || moe.top_k > moe.experts)
    throw std::invalid_argument("moe_mlp: a router of " + std::to_string(moe.experts) +
                                " experts choosing " + std::to_string(moe.top_k));
  if (moe.scoring < kSoftmax || moe.scoring > kSoftmaxTopk)
    throw std::invalid_argument("moe_mlp: scoring " + std::to_string(moe.scoring));
  if (int(moe.gate_up.size()) != moe.experts || int(moe.down.size()) != moe.experts)
    throw std::invalid_argument("moe_mlp: the router's experts and the weights' differ");
  for (int e = 0; e < moe.experts; ++e)
    if (moe.gate_up[e].n != 2 * inter || moe.gate_up[e].k != h || moe.down[e].n != h ||
        moe.down[e].k != inter)
      throw std::invalid_argument("moe_mlp: expert " + std::to_string(e) + "'s gate_up " +
                                  shape(moe.gate_up[e]) + " and down " + shape(moe.down[e]) +
                                  " do not chain with hidden " + std::to_string(h));
  const QuantLinear &sgu = moe.shared_gate_up, &sd = moe.shared_down;
  if (sgu.n != 0 && (sgu.k != h || sd.n != h || 2 * sd.k != sgu.n || moe.shared_gate == nullptr))
    throw std::invalid_argument("moe_mlp: the shared expert's gate_up " + shape(sgu) +
                                " and down " + shape(sd) + " do not chain with hidden " +
                                std::to_string(h));
}

void moe_route(const MoeMlp& moe, const float* h, int m, const GemvRun& run, int32_t* ids,
               float* weights) {
  const int e = moe.experts, hidden = moe.hidden;
  thread_local std::vector<float> logits_buf;
  logits_buf.resize(size_t(m) * e);
  float* logits = logits_buf.data();
  const int64_t macs = int64_t(m) * e * hidden;
  // experts split over the team (in pairs, the GEMM's tile): each logit is one dot, whoever
  // computes it
  const int pairs = (e + 1) / 2;
  parallel(macs >= run.parallel_min_macs ? std::min(run.threads, pairs) : 1,
           [&](int part, int parts) {
             const int e0 = 2 * int(int64_t(pairs) * part / parts);
             const int e1 = std::min(e, 2 * int(int64_t(pairs) * (part + 1) / parts));
             router_gemm(h, m, hidden, moe.router, e0, e1, logits, e);
           });
  if (moe.router_bias != nullptr)
    for (int r = 0; r < m; ++r)
      for (int x = 0; x < e; ++x) logits[int64_t(r) * e + x] += moe.router_bias[x];
  std::vector<int> order(e);
  for (int r = 0; r < m; ++r)
    route_row(moe, logits + int64_t(r) * e, order.data(), ids + int64_t(r) * moe.top_k,
              weights + int64_t(r) * moe.top_k);
}

void moe_mlp(const MoeMlp& moe, const float* h, int m, const GemvRun& run, float* out) {
  check_moe_mlp(moe);
  if (m <= 0) return;
  const int hidden = moe.hidden;
  thread_local std::vector<int32_t> ids;
  thread_local std::vector<float> weights, y_buf;
  ids.resize(size_t(m) * moe.top_k);
  weights.resize(size_t(m) * moe.top_k);
  moe_route(moe, h, m, run, ids.data(), weights.data());
  moe_experts({h, m, hidden, moe.intermediate, moe.top_k, moe.experts, ids.data(),
               weights.data(), moe.gate_up.data(), moe.down.data(), moe.activation, out,
               run.threads, run.parallel_min_macs, run.path, run.activation_bits});
  if (moe.shared_gate_up.n == 0) return;
  // the shared expert: out += sigmoid(h . shared_gate) * down(silu(g) * u)
  y_buf.resize(size_t(m) * hidden);
  gated_mlp(moe.shared_gate_up, moe.shared_down, kSilu, run, h, hidden, y_buf.data());
  for (int r = 0; r < m; ++r) {
    const float gate =
        sigmoid(fixed_order_dot(h + int64_t(r) * hidden, moe.shared_gate, hidden));
    float* o = out + int64_t(r) * hidden;
    const float* y = y_buf.data() + int64_t(r) * hidden;
    for (int c = 0; c < hidden; ++c) o[c] += gate * y[c];
  }
}

}  // namespace pagedkern_cpu
