// moe_mlp.h: the router GEMV, the top-k and its weights, the routed experts, the shared expert.

#include "moe_mlp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dense_gemm.h"
#include "moe_experts.h"

namespace pagedkern_cpu {
namespace {

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
  dense_gemm(logits, e, h, hidden, moe.router, hidden, m, e, hidden,
             macs >= run.parallel_min_macs ? run.threads : 1, -1);
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
  thread_local std::vector<float> gates;
  gates.resize(m);
  dense_gemm(gates.data(), 1, h, hidden, moe.shared_gate, hidden, m, 1, hidden, 1, -1);
  for (int r = 0; r < m; ++r) {
    const float gate = sigmoid(gates[r]);
    float* o = out + int64_t(r) * hidden;
    const float* y = y_buf.data() + int64_t(r) * hidden;
    for (int c = 0; c < hidden; ++c) o[c] += gate * y[c];
  }
}

}  // namespace pagedkern_cpu
