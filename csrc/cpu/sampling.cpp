// sampling.h: a row at a time, rows split over the threads.

#include "sampling.h"

// The dense passes select with ?: around arithmetic that may raise FP flags (x / T, the exp):
// GCC if-converts, and so vectorizes, them only without trapping math. Nothing here reads FP
// flags, and the values are the same.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <queue>
#include <utility>
#include <vector>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#include "parallel.h"

namespace pagedkern_cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kHeapTopK = 1024;  // top-k up to this by a min-heap scan, beyond by nth_element
constexpr int kSparseTopK = 4096;  // top-k up to this: only the kept tokens are exponentiated
constexpr int kBlock = 16;  // the scans skip blocks of this many tokens by their max
constexpr int kLanes = 16;  // the dense passes' independent sums (the compiler's vector lanes)
constexpr int kChunk = 256;  // the draw's chunk: chunk sums first, then a walk inside one

uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// e^x for x <= 0 (-inf gives 0): Cephes' expf (x = n ln2 + r, e^r by its degree-7 polynomial,
// 2^n into the exponent), branch-free so that the dense pass vectorizes; ~1 ulp.
inline float exp_nonpositive(float x) {
  const float c = x < -87.0f ? -87.0f : x;
  const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = n * -0.693359375f + c;
  r = n * 2.12194440e-4f + r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&y, &bits, sizeof y);
  return x < -87.0f ? 0.0f : y;
}

// The largest of n values (NaN counts as -inf; -inf when n is 0). SSE2 (every x86-64) in
// 16-value blocks where there is one: the scans below skip whole blocks by it.
#if defined(__SSE2__) || defined(_M_X64)
inline float max_of(const float* x, int n) {
  // maxps(a, b) is a > b ? a : b: b whenever a is NaN, so x always goes first against a running
  // maximum that never holds NaN (x against x would let a NaN hide the other's values)
  __m128 m0 = _mm_set1_ps(-kInf), m1 = m0, m2 = m0, m3 = m0;
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm_max_ps(_mm_loadu_ps(x + i), m0);
    m1 = _mm_max_ps(_mm_loadu_ps(x + i + 4), m1);
    m2 = _mm_max_ps(_mm_loadu_ps(x + i + 8), m2);
    m3 = _mm_max_ps(_mm_loadu_ps(x + i + 12), m3);
  }
  __m128 m = _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  float out = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  for (; i < n; ++i) out = x[i] > out ? x[i] : out;
  return out;
}
#else
inline float max_of(const float* x, int n) {
  float out = -kInf;
  for (int i = 0; i < n; ++i) out = x[i] > out ? x[i] : out;
  return out;
}
#endif
// The sum of n values in a fixed order (kLanes running sums, then those in double).
double sum_of(const float* x, int n) {
  float lanes[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[i + l];
  double sum = 0.0;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; i < n; ++i) sum += x[i];
  return sum;
}

// s = x / t as the reference scales a row: a row holding +inf is uniform over its +inf entries
// (0 there, -inf elsewhere); NaN, and an x / t that overflows to +inf, count as -inf.
void scale_row(const float* x, int vocab, float x_max, float t, float* s) {
  if (x_max == kInf) {
    for (int i = 0; i < vocab; ++i) s[i] = x[i] == kInf ? 0.0f : -kInf;
    return;
  }
  for (int i = 0; i < vocab; ++i) {
    const float q = x[i] / t;
    s[i] = q != q || q == kInf ? -kInf : q;
  }
}

// The largest x (NaN counts as -inf) and the first id holding it (0 when nothing is above -inf).
std::pair<float, int> max_and_argmax(const float* x, int vocab) {
  const float m = max_of(x, vocab);
  if (m == -kInf) return {m, 0};
  int at = 0;
  while (at + kBlock <= vocab && max_of(x + at, kBlock) != m) at += kBlock;
  while (at < vocab - 1 && x[at] != m) ++at;
  return {m, at};
}

// The k-th largest of the values of s at or above `lo` (-inf when fewer than k are finite).
float kth_largest(const float* s, int vocab, int k, float lo, std::vector<float>& scratch) {
  if (k <= kHeapTopK) {
    std::priority_queue<float, std::vector<float>, std::greater<float>> heap;
    float floor = std::max(lo, std::nextafter(-kInf, 0.0f));  // what enters: v >= floor
    for (int i = 0; i < vocab; i += kBlock) {
      const int end = std::min(vocab, i + kBlock);
      if (!(max_of(s + i, end - i) >= floor)) continue;  // nothing enters
      for (int j = i; j < end; ++j) {
        const float v = s[j];
        if (!(v >= floor)) continue;
        heap.push(v);
        if (static_cast<int>(heap.size()) > k) heap.pop();
        if (static_cast<int>(heap.size()) == k)  // full: only a larger value changes the k-th
          floor = std::max(floor, std::nextafter(heap.top(), kInf));
      }
    }
    return static_cast<int>(heap.size()) < k ? -kInf : heap.top();
  }
  scratch.clear();
  for (int i = 0; i < vocab; ++i)
    if (s[i] >= lo && s[i] != -kInf) scratch.push_back(s[i]);
  if (static_cast<int>(scratch.size()) < k) return -kInf;
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(),
                   std::greater<float>());
  return scratch[k - 1];
}

using Candidate = std::pair<float, int>;  // (probability, id)

// top-p's threshold among candidate probabilities that hold every kept token, below `above`
// (the mass of every larger probability, itself below top_p): the value of the last tie group
// whose preceding mass is below top_p (the first group always kept). Only a growing prefix of
// the largest candidates is sorted.
float top_p_cut(std::vector<Candidate>& candidates, float top_p, double above) {
  const auto larger = [](const Candidate& a, const Candidate& b) { return a.first > b.first; };
  const size_t n = candidates.size();
  if (n == 0) return 0.0f;
  for (size_t m = std::min<size_t>(n, 64);; m = std::min(n, m * 4)) {
    if (m < n)
      std::nth_element(candidates.begin(), candidates.begin() + m, candidates.end(), larger);
    std::sort(candidates.begin(), candidates.begin() + m, larger);
    double before = above;
    float kept = candidates[0].first;
    for (size_t j = 0; j < m;) {
      const float group = candidates[j].first;
      if (j > 0 && !(static_cast<float>(before) < top_p)) return kept;  // this group and after: out
      kept = group;
      do {  // (at least one: the loop ends whatever the values)
        before += candidates[j++].first;
      } while (j < m && candidates[j].first == group);
    }
    if (m == n) return kept;  // every candidate kept
    // nth_element left nothing larger than candidates[m] past m: the next group starts at m
    if (candidates[m].first < kept && !(static_cast<float>(before) < top_p)) return kept;
  }
}

// The candidates: every probability at or above tau (and above 0), with their mass.
double gather(const float* p, int vocab, float tau, std::vector<Candidate>& candidates) {
  candidates.clear();
  double mass = 0.0;
  for (int i = 0; i < vocab; i += kBlock) {
    const int end = std::min(vocab, i + kBlock);
    const float block = max_of(p + i, end - i);
    if (!(block >= tau && block > 0.0f)) continue;
    for (int j = i; j < end; ++j) {
      if (p[j] > 0.0f && p[j] >= tau) {
        candidates.emplace_back(p[j], j);
        mass += p[j];
      }
    }
  }
  return mass;
}

// top-p over the dense probabilities p. Most rows: the few probabilities within 2^-8 of the
// largest hold top_p, and only they are sorted (a token below them has at least top_p above
// it: out). Else (a flat row): the mass per bin of the probabilities' top 12 bits (their
// order), the bin where the mass from the top reaches top_p, and only that bin's tokens sorted.
float top_p_threshold(const float* p, int vocab, float top_p, std::vector<Candidate>& candidates) {
  const float p_max = max_of(p, vocab);
  if (static_cast<float>(gather(p, vocab, p_max * 0x1p-8f, candidates)) >= top_p)
    return top_p_cut(candidates, top_p, 0.0);
  constexpr int kShift = 19, kBins = 1 << (31 - kShift);  // positive floats: 31 bits in order
  thread_local std::vector<double> bins;
  bins.assign(kBins, 0.0);
  const auto bin = [](float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    return bits >> kShift;
  };
  for (int i = 0; i < vocab; ++i)
    if (p[i] > 0.0f) bins[bin(p[i])] += p[i];
  double before = 0.0;
  int b = kBins - 1;
  for (; b >= 0; --b) {
    if (static_cast<float>(before + bins[b]) >= top_p) break;
    before += bins[b];
  }
  if (b < 0) return 0.0f;  // (the whole mass rounds below top_p: everything kept)
  candidates.clear();
  for (int i = 0; i < vocab; ++i)
    if (p[i] > 0.0f && bin(p[i]) == static_cast<uint32_t>(b)) candidates.emplace_back(p[i], i);
  return top_p_cut(candidates, top_p, before);
}

// The first id with p > 0 whose cumulative probability in id order exceeds u * (the total):
// chunk sums, then a walk inside the chunk that crosses.
int draw_dense(const float* p, int vocab, double u, int fallback) {
  const int chunks = (vocab + kChunk - 1) / kChunk;
  thread_local std::vector<double> sums;
  sums.resize(chunks);
  double total = 0.0;
  for (int c = 0; c < chunks; ++c) {
    sums[c] = sum_of(p + c * kChunk, std::min(vocab - c * kChunk, kChunk));
    total += sums[c];
  }
  if (!(total > 0.0) || !std::isfinite(total)) return fallback;
  const double target = u * total;
  double cdf = 0.0;
  int c = 0;
  while (c < chunks - 1 && !(cdf + sums[c] > target)) cdf += sums[c++];
  while (sums[c] == 0.0) cdf -= sums[--c];  // (rounding ran past the end: the last with mass)
  int last = fallback;
  for (int i = c * kChunk, end = std::min(vocab, i + kChunk); i < end; ++i) {
    if (!(p[i] > 0.0f)) continue;
    cdf += p[i];
    last = i;
    if (cdf > target) return i;
  }
  return last;  // (the chunk's walk rounded below its sum: its last kept id)
}

// draw_dense over a few kept tokens, (probability, id) in id order.
int draw_sparse(const std::vector<Candidate>& kept, double u, int fallback) {
  double total = 0.0;
  for (const auto& [p, id] : kept) total += p;
  if (!(total > 0.0) || !std::isfinite(total)) return fallback;
  const double target = u * total;
  double cdf = 0.0;
  int last = fallback;
  for (const auto& [p, id] : kept) {
    if (!(p > 0.0f)) continue;
    cdf += p;
    last = id;
    if (cdf > target) return id;
  }
  return last;
}

// x_max and argmax: max_and_argmax(x) (the argmax is greedy rows' id, and the fallback of a row
// with nothing to draw from).
int sample_row(const float* x, int vocab, float x_max, int argmax, float temperature, float top_p,
               int top_k, float min_p, int64_t seed, int64_t offset) {
  if (!(temperature > 0.0f)) return argmax;

  // s = x / T; dividing by T > 0 keeps the order, so s_max = x_max / T (an overflowed s_max:
  // the greedy fallback, before any overflowed s is read)
  thread_local std::vector<float> s_buffer, scratch;
  thread_local std::vector<Candidate> candidates;
  s_buffer.resize(vocab);
  float* s = s_buffer.data();
  const float s_max = x_max == kInf ? 0.0f : x_max / temperature;
  if (!std::isfinite(s_max)) return argmax;  // nothing finite, or s overflowed
  scale_row(x, vocab, x_max, temperature, s);

  // min-p and top-k: one lower bound on s
  float lo = -kInf;
  if (min_p > 0.0f) lo = s_max + std::log(min_p);
  const bool top_k_on = top_k > 0 && top_k < vocab;
  if (top_k_on) lo = std::max(lo, kth_largest(s, vocab, top_k, lo, scratch));
  const double u = philox_uniform(seed, offset);

  if (top_k_on && top_k <= kSparseTopK) {  // few kept tokens: exponentiate only those
    thread_local std::vector<Candidate> kept;  // (probability, id) in id order
    kept.clear();
    double sum = 0.0;
    for (int i = 0; i < vocab; i += kBlock) {
      const int end = std::min(vocab, i + kBlock);
      if (!(max_of(s + i, end - i) >= lo)) continue;  // none kept
      for (int j = i; j < end; ++j) {
        if (s[j] >= lo && s[j] != -kInf) {
          const float e = exp_nonpositive(s[j] - s_max);
          kept.emplace_back(e, j);
          sum += e;
        }
      }
    }
    if (!(sum > 0.0)) return argmax;  // (min-p above 1 drops everything)
    const float inv = static_cast<float>(1.0 / sum);
    for (auto& c : kept) c.first *= inv;
    if (top_p < 1.0f) {  // top-p's cut: below it, out
      candidates.assign(kept.begin(), kept.end());
      const float p_lo = top_p_cut(candidates, top_p, 0.0);
      kept.erase(std::remove_if(kept.begin(), kept.end(),
                                [&](const Candidate& c) { return !(c.first >= p_lo); }),
                 kept.end());
    }
    return draw_sparse(kept, u, argmax);
  }

  // every token may be kept: exponentiate the row in vectorized passes (s becomes p)
  for (int i = 0; i < vocab; ++i) {
    const float e = exp_nonpositive(s[i] - s_max);
    s[i] = s[i] >= lo ? e : 0.0f;
  }
  const double sum = sum_of(s, vocab);
  if (!(sum > 0.0)) return argmax;  // (min-p above 1 drops everything)
  const float inv = static_cast<float>(1.0 / sum);
  for (int j = 0; j < vocab; ++j) s[j] *= inv;
  if (top_p < 1.0f) {  // top-p's cut: below it, out
    const float p_lo = top_p_threshold(s, vocab, top_p, candidates);
    for (int j = 0; j < vocab; ++j) s[j] = s[j] >= p_lo ? s[j] : 0.0f;
  }
  return draw_dense(s, vocab, u, argmax);
}

// The row's log-probabilities as reference/logits_processing.py's logprobs_of defines them
// (log_softmax of s = x / T, T = 1 for greedy rows; a row holding +inf uniform over its +inf
// entries; NaN and an overflowed +inf as -inf): the sampled id's, and the top_n largest
// (descending, ties to the lower id). x_max: max_of(x).
void row_logprobs(const float* x, int vocab, float x_max, float temperature, int id,
                  float* logprob, int32_t* top_ids, float* top_values, int top_n) {
  thread_local std::vector<float> s_buffer, e_buffer;
  s_buffer.resize(vocab);
  e_buffer.resize(vocab);
  float* s = s_buffer.data();
  float* e = e_buffer.data();
  scale_row(x, vocab, x_max, temperature > 0.0f ? temperature : 1.0f, s);
  const float s_max = max_of(s, vocab);
  float log_sum = kInf;  // (nothing finite: every log-probability -inf)
  if (s_max != -kInf) {
    for (int i = 0; i < vocab; ++i) e[i] = exp_nonpositive(s[i] - s_max);
    log_sum = static_cast<float>(std::log(sum_of(e, vocab)));
  }
  const auto value = [&](int i) { return s_max == -kInf ? -kInf : (s[i] - s_max) - log_sum; };
  if (logprob != nullptr) *logprob = value(id);
  if (top_n <= 0) return;
  // the top_n by (s descending, id ascending): a scan in id order where only a strictly larger
  // s displaces the heap's worst (an equal one has a larger id)
  const auto better = [](const Candidate& a, const Candidate& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  thread_local std::vector<Candidate> heap;  // a heap whose front is the worst kept
  heap.clear();
  for (int i = 0; i < vocab; i += kBlock) {
    const int end = std::min(vocab, i + kBlock);
    if (static_cast<int>(heap.size()) == top_n && !(max_of(s + i, end - i) > heap.front().first))
      continue;
    for (int j = i; j < end; ++j) {
      if (static_cast<int>(heap.size()) < top_n) {
        heap.emplace_back(s[j], j);
        std::push_heap(heap.begin(), heap.end(), better);
      } else if (s[j] > heap.front().first) {
        std::pop_heap(heap.begin(), heap.end(), better);
        heap.back() = {s[j], j};
        std::push_heap(heap.begin(), heap.end(), better);
      }
    }
  }
  std::sort(heap.begin(), heap.end(), better);
  for (int n = 0; n < top_n; ++n) {
    top_ids[n] = heap[n].second;
    top_values[n] = value(heap[n].second);
  }
}

}  // namespace

double philox_uniform(int64_t seed, int64_t offset) {
  const auto o = static_cast<uint64_t>(offset), k = static_cast<uint64_t>(seed);
  uint32_t c0 = static_cast<uint32_t>(o), c1 = static_cast<uint32_t>(o >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(k), k1 = static_cast<uint32_t>(k >> 32);
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = mulhilo(0xCD9E8D57u, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return static_cast<double>(c0) / 4294967296.0;
}

void sample(const SampleArgs& a) {
  parallel(std::min(a.threads, a.rows), [&](int part, int parts) {
    for (int r = part; r < a.rows; r += parts) {
      const float* x = a.logits + r * a.logits_stride;
      const auto [x_max, argmax] = max_and_argmax(x, a.vocab);
      a.out[r] = sample_row(x, a.vocab, x_max, argmax, a.temperature[r], a.top_p[r], a.top_k[r],
                            a.min_p[r], a.seeds[r], a.offsets[r]);
      if (a.logprobs != nullptr || a.top_n > 0) {
        row_logprobs(x, a.vocab, x_max, a.temperature[r], a.out[r],
                     a.logprobs != nullptr ? a.logprobs + r : nullptr,
                     a.top_n > 0 ? a.top_ids + static_cast<int64_t>(r) * a.top_n : nullptr,
                     a.top_n > 0 ? a.top_logprobs + static_cast<int64_t>(r) * a.top_n : nullptr,
                     a.top_n);
      }
    }
  });
}

}  // namespace pagedkern_cpu
