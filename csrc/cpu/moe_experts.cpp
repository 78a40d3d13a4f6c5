// moe_experts.h: route the pairs to their experts, each expert's two GEMVs over its rows, the
// weighted sum per token.

#include "moe_experts.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel.h"

namespace pagedkern_cpu {

void moe_experts(const MoeExpertsArgs& a) {
  const int h = a.hidden_size, inter = a.intermediate, pairs = a.m * a.top_k;
  for (int e = 0; e < a.experts; ++e)
    if (a.gate_up[e].n != 2 * inter || a.gate_up[e].k != h || a.down[e].n != h ||
        a.down[e].k != inter)
      throw std::invalid_argument("moe_experts: expert " + std::to_string(e) +
                                  "'s weights do not chain");
  std::vector<int> count(a.experts + 1, 0);
  for (int p = 0; p < pairs; ++p) {
    const int e = a.ids[p];
    if (e < 0 || e >= a.experts)
      throw std::invalid_argument("moe_experts: ids[" + std::to_string(p) + "] = " +
                                  std::to_string(e) + " is outside the " +
                                  std::to_string(a.experts) + " experts");
    ++count[e + 1];
  }
  std::fill(a.out, a.out + int64_t(a.m) * h, 0.0f);
  if (pairs == 0) return;
  for (int e = 0; e < a.experts; ++e) count[e + 1] += count[e];  // row offsets per expert
  thread_local std::vector<int> order;                           // pairs by (expert, pair)
  thread_local std::vector<float> x_buf, y_buf;
  order.resize(pairs);
  {
    std::vector<int> next(count.begin(), count.end() - 1);
    for (int p = 0; p < pairs; ++p) order[next[a.ids[p]]++] = p;
  }
  x_buf.resize(size_t(pairs) * h);
  for (int i = 0; i < pairs; ++i)
    std::copy_n(a.hidden + int64_t(order[i] / a.top_k) * h, h, x_buf.data() + int64_t(i) * h);
  y_buf.resize(size_t(pairs) * h);
  // (the buffers are this thread's: the region below reads them through these pointers)
  const float* x = x_buf.data();
  float* y_all = y_buf.data();
  std::vector<int> active;  // the experts with rows
  for (int e = 0; e < a.experts; ++e)
    if (count[e + 1] > count[e]) active.push_back(e);
  // one expert's gated MLP over its rows (each GEMV split over `threads` from
  // parallel_min_macs up)
  const auto expert = [&](int e, int threads) {
    const int first = count[e], n = count[e + 1] - first;
    const GemvRun gemv{n, threads, a.parallel_min_macs, a.path, a.activation_bits};
    gated_mlp(a.gate_up[e], a.down[e], a.activation, gemv, x + int64_t(first) * h, h,
              y_all + int64_t(first) * h);
  };
  if (a.threads > 1 && int(active.size()) >= 2 * a.threads) {
    // whole experts per thread, taken from a shared counter: one parallel region a layer
    // instead of two a GEMV (a GEMV row's bits do not depend on the thread count)
    std::atomic<int> next{0};
    parallel(a.threads, [&](int, int) {
      for (int i = next++; i < int(active.size()); i = next++) expert(active[i], 1);
    });
  } else {
    for (int e : active) expert(e, a.threads);
  }
  for (int i = 0; i < pairs; ++i) {  // each token's pairs in expert order
    const int p = order[i];
    const float w = a.weights[p];
    float* o = a.out + int64_t(p / a.top_k) * h;
    const float* y = y_all + int64_t(i) * h;
    for (int c = 0; c < h; ++c) o[c] += w * y[c];
  }
}

}  // namespace pagedkern_cpu
