// attention.h's driver (checks, the path) and its portable path: attention_body.inc's lane
// ops in plain C++, each the AVX2 path's instruction written out lane by lane (std::fma; the
// module is compiled without FP contraction), so both paths give the same bits.

#include "attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel.h"
#include "quant_gemv.h"

namespace pagedkern_cpu {
namespace attention_portable {

#define ATT_FN inline

struct V {
  float x[8];
};
#define LANES(expr)                      \
  V r;                                   \
  for (int i = 0; i < 8; ++i) r.x[i] = expr; \
  return r
ATT_FN V vzero() { LANES(0.0f); }
ATT_FN V vset1(float v) { LANES(v); }
ATT_FN V vload(const float* p) { LANES(p[i]); }
ATT_FN void vstore(float* p, V v) { std::memcpy(p, v.x, sizeof v.x); }
ATT_FN float bf16(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
ATT_FN V vload_bf16(const uint16_t* p) { LANES(bf16(p[i])); }
ATT_FN V vload_f16(const uint16_t* p) { LANES(half_to_float(p[i])); }
ATT_FN V vadd(V a, V b) { LANES(a.x[i] + b.x[i]); }
ATT_FN V vsub(V a, V b) { LANES(a.x[i] - b.x[i]); }
ATT_FN V vmul(V a, V b) { LANES(a.x[i] * b.x[i]); }
ATT_FN V vfma(V a, V b, V c) { LANES(std::fma(a.x[i], b.x[i], c.x[i])); }
ATT_FN V vmax(V a, V b) { LANES(a.x[i] > b.x[i] ? a.x[i] : b.x[i]); }
ATT_FN V vround(V a) { LANES(std::nearbyint(a.x[i])); }
ATT_FN float ldexp_bits(float p, float n) {
  uint32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += uint32_t(int32_t(n)) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}
ATT_FN V vldexp(V p, V n) { LANES(ldexp_bits(p.x[i], n.x[i])); }
ATT_FN V vzero_below(V a, float t, V e) { LANES(a.x[i] < t ? 0.0f : e.x[i]); }
ATT_FN float tree(const float* x) {
  return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}
ATT_FN V vsum_tree(const V* a) { LANES(tree(a[i].x)); }
ATT_FN void vlanes(V v, float* out) { std::memcpy(out, v.x, sizeof v.x); }
#undef LANES

#include "attention_body.inc"

#undef ATT_FN

}  // namespace attention_portable

void attention_detail::portable(const AttentionArgs& args) { attention_portable::run(args); }

float attention_detail::e4m3_to_float(uint8_t x) {
  const int e = (x >> 3) & 0xF, m = x & 7;
  float value;
  if (e == 15 && m == 7)
    value = NAN;
  else if (e == 0)
    value = std::ldexp(float(m), -9);  // subnormal: m / 8 * 2^-6
  else
    value = std::ldexp(float(8 + m), e - 10);  // (1 + m / 8) * 2^(e - 7)
  return (x & 0x80) ? -value : value;
}

const float* attention_detail::e4m3_table() {
  // a lookup a byte (the conversion's branches and ldexp cost ~10 ns an element: 7x a decode
  // step's attention at 256 keys)
  static const struct Table {
    float value[256];
    Table() {
      for (int x = 0; x < 256; ++x) value[x] = e4m3_to_float(uint8_t(x));
    }
  } table;
  return table.value;
}

bool attention_path_supported(int path) {
  return path == kPortable || ((path == kAvx2 || path == kAvx512Vnni) && path_supported(path));
}

namespace {

void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("attention: " + message);
}

}  // namespace

void chunk_rows(const int32_t* cu, const int32_t* seq_lens, int num_chunks, int rows,
                int32_t* row_seq, int32_t* row_pos) {
  if (num_chunks < 0 || rows < 0 || cu[0] != 0)
    throw std::invalid_argument("cu_seqlens must start at 0");
  std::fill_n(row_seq, rows, 0);
  std::fill_n(row_pos, rows, -1);
  for (int b = 0; b < num_chunks; ++b) {
    if (cu[b + 1] < cu[b] || cu[b + 1] > rows)
      throw std::invalid_argument("cu_seqlens[" + std::to_string(b + 1) + "] = " +
                                  std::to_string(cu[b + 1]) +
                                  " must be within [cu_seqlens[b], rows]");
    for (int r = cu[b]; r < cu[b + 1]; ++r) {
      row_seq[r] = b;
      row_pos[r] = int32_t(int64_t(seq_lens[b]) - (cu[b + 1] - r));
    }
  }
}

void attention(const AttentionArgs& a) {
  check(a.d > 0 && a.d % 8 == 0, "head size must be a positive multiple of 8, got " + std::to_string(a.d));
  check(a.hkv > 0 && a.hq > 0 && a.hq % a.hkv == 0,
        "query heads (" + std::to_string(a.hq) + ") must be a multiple of KV heads (" +
            std::to_string(a.hkv) + ")");
  check(a.block_size > 0 && a.num_blocks > 0, "the cache must have blocks of at least one slot");
  check(a.rows >= 0 && a.num_seqs >= 0 && a.table_width >= 0, "negative counts");
  check(a.window >= 0 && a.soft_cap >= 0.0f, "window and soft_cap must be >= 0");
  check(a.cache_dtype >= kCacheF32 && a.cache_dtype <= kCacheE4M3, "unknown cache dtype code");
  int path = a.path;
  if (path < 0)
    for (int best : {kAvx512Vnni, kAvx2, kPortable})
      if (attention_path_supported(best)) {
        path = best;
        break;
      }
  if (path != kPortable && path != kAvx2 && path != kAvx512Vnni)
    throw std::invalid_argument("attention: path must be -1, portable, avx2 or avx512");
  if (!attention_path_supported(path))
    throw std::runtime_error(std::string("attention: this CPU (or this build) does not run the ") +
                             path_name(path) + " path");
  // every block a row reads, before any thread starts (then no row reads out of bounds)
  std::vector<int> reach(a.num_seqs, -1);
  for (int t = 0; t < a.rows; ++t) {
    const int seq = a.row_seq[t], pos = a.row_pos[t];
    if (seq < 0 || seq >= a.num_seqs)
      throw std::out_of_range("attention: row " + std::to_string(t) + "'s sequence " +
                              std::to_string(seq) + " is outside the " +
                              std::to_string(a.num_seqs) + " block tables");
    if (pos >= int64_t(a.table_width) * a.block_size)
      throw std::out_of_range("attention: row " + std::to_string(t) + "'s position " +
                              std::to_string(pos) + " is past its block table (" +
                              std::to_string(a.table_width) + " blocks of " +
                              std::to_string(a.block_size) + ")");
    reach[seq] = std::max(reach[seq], pos);
  }
  for (int s = 0; s < a.num_seqs; ++s)
    for (int i = 0; i <= reach[s] / a.block_size && reach[s] >= 0; ++i) {
      const int32_t block = a.block_tables[int64_t(s) * a.table_stride + i];
      if (block < 0 || block >= a.num_blocks)
        throw std::out_of_range("attention: block_tables[" + std::to_string(s) + ", " +
                                std::to_string(i) + "] = " + std::to_string(block) +
                                " is outside the cache's " + std::to_string(a.num_blocks) +
                                " blocks");
    }
  for (int t = 0; t < a.rows; ++t) {  // rows that see no key: out 0, lse the sink or -inf
    if (a.row_pos[t] >= 0) continue;
    for (int h = 0; h < a.hq; ++h) {
      std::fill_n(a.out + int64_t(t) * a.out_row_stride + int64_t(h) * a.d, a.d, 0.0f);
      if (a.lse) a.lse[int64_t(t) * a.hq + h] = a.sinks ? a.sinks[h] : -INFINITY;
    }
  }
  if (path == kAvx512Vnni)
    attention_detail::avx512(a);
  else if (path == kAvx2)
    attention_detail::avx2(a);
  else
    attention_detail::portable(a);
}

}  // namespace pagedkern_cpu
