// dequantize_rows.h: one row per id, its groups in order.

#include "dequantize_rows.h"

#include <stdexcept>
#include <string>

#include "parallel.h"
#include "quant_gemv.h"

namespace pagedkern_cpu {
namespace {

float number(const void* p, int64_t i, bool half) {
  return half ? half_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

void one_row(const DequantizeRowsArgs& a, int64_t row, float* out) {
  const int64_t group = a.group > 0 ? a.group : a.k, groups = a.k / group;
  const auto* q8 = static_cast<const int8_t*>(a.qweight) + row * a.k;
  const auto* q4 = static_cast<const uint8_t*>(a.qweight) + row * (a.k / 2);
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = number(a.scales, row * groups + g, a.half_scales);
    float* o = out + g * group;
    if (a.int4)  // (groups are even: a byte's two codes are one group's)
      for (int64_t j = 0; j < group / 2; ++j) {
        const uint8_t byte = q4[g * group / 2 + j];
        o[2 * j] = float(byte & 15) * scale;
        o[2 * j + 1] = float(byte >> 4) * scale;
      }
    else
      for (int64_t j = 0; j < group; ++j) o[j] = float(q8[g * group + j]) * scale;
    if (a.mins != nullptr) {
      const float min = number(a.mins, row * groups + g, a.half_scales);
      for (int64_t j = 0; j < group; ++j) o[j] = o[j] + min;
    }
  }
}

}  // namespace

void dequantize_rows(const DequantizeRowsArgs& a) {
  if (a.n < 0 || a.k <= 0 || a.m < 0 || a.group < 0 || (a.group > 0 && a.k % a.group != 0))
    throw std::invalid_argument("dequantize_rows: k must be a positive multiple of the group");
  if (a.int4 && (a.group == 0 || a.k % 2 != 0 || a.mins == nullptr))
    throw std::invalid_argument("dequantize_rows: int4 needs groups, an even k and mins");
  if (a.group == 0 && a.mins != nullptr)
    throw std::invalid_argument("dequantize_rows: a scale per row comes without mins");
  for (int t = 0; t < a.m; ++t)
    if (a.ids[t] < 0 || a.ids[t] >= a.n)
      throw std::out_of_range("dequantize_rows: ids[" + std::to_string(t) + "] = " +
                              std::to_string(a.ids[t]) + " is outside the weight's " +
                              std::to_string(a.n) + " rows");
  // threads for a prompt's rows; a decode step's few rows stay on the caller's thread
  const int threads = int64_t(a.m) * a.k >= (int64_t(1) << 16) ? a.threads : 1;
  parallel(threads, [&](int part, int parts) {
    for (int t = part; t < a.m; t += parts) one_row(a, a.ids[t], a.out + int64_t(t) * a.k);
  });
}

}  // namespace pagedkern_cpu
