// rope_cache.h: checks, then per row the rotation of its q and k heads and the k/v store.

#include "rope_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "attention.h"  // CacheDtype
#include "parallel.h"
#include "rms.h"

namespace pagedkern_cpu {
namespace {

// x normalised by `norm` (if given), then rotated
void rotate(float* x, const float* f, int d, const float* norm, float eps) {
  if (norm != nullptr) rms_norm_row(x, x, norm, eps, d);
  const int half = d / 2;
  const float* cos2 = f;      // [cos, cos]
  const float* sin2 = f + d;  // [-sin, sin]
  float rolled[512];
  for (int i = 0; i < half; ++i) {
    rolled[i] = x[i + half] * sin2[i];
    rolled[i + half] = x[i] * sin2[i + half];
  }
  for (int i = 0; i < d; ++i) x[i] = x[i] * cos2[i] + rolled[i];
}

// d values x * inv, clamped to +-448, as E4M3 (reference.quantize_e4m3)
void store_e4m3(uint8_t* out, const float* x, float inv, int d) {
  for (int c = 0; c < d; ++c) {
    const float y = x[c] * inv;
    out[c] = e4m3_from_float(std::isnan(y) ? y : std::fmin(std::fmax(y, -448.0f), 448.0f));
  }
}

// d values as 16 bits (bf16_from_float or f16_from_float)
template <uint16_t (*Round)(float)>
void store_16(uint16_t* out, const float* x, int d) {
  for (int c = 0; c < d; ++c) out[c] = Round(x[c]);
}

uint32_t bits_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

float float_of(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

}  // namespace

uint16_t bf16_from_float(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const uint32_t bits = bits_of(x);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// The FP16 library's fp16_ieee_from_fp32_value (torch's c10::Half): the float adds round the
// mantissa to nearest even at fp16's precision, subnormals included; overflow scales to inf.
uint16_t f16_from_float(float x) {
  const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(x) * scale_to_inf) * scale_to_zero;
  const uint32_t w = bits_of(x), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = float_of((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = bits_of(base);
  const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

uint8_t e4m3_from_float(float x) {
  const uint32_t bits = bits_of(x);
  const uint8_t sign = uint8_t((bits >> 24) & 0x80);
  if (std::isnan(x)) return sign | 0x7F;
  const float a = std::fabs(x);
  if (a < 0.015625f)  // below 2^-6: subnormals m * 2^-9 (m = 8 rounds up to the first normal)
    return sign | uint8_t(std::nearbyint(a * 512.0f));
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): a in [2^(e-1), 2^e)
  const int exponent = e - 1;
  const float mantissa = std::ldexp(a, -exponent) - 1.0f;  // [0, 1), exact
  int q = int(std::nearbyint(mantissa * 8.0f));            // round to nearest even
  int biased = exponent + 7;
  if (q == 8) q = 0, ++biased;
  return sign | uint8_t(biased << 3 | q);
}

void rope_cache(const RopeCacheArgs& a) {
  if (a.d <= 0 || a.d % 2 || a.d > 512)
    throw std::invalid_argument("rope_cache: head size must be even and at most 512, got " +
                                std::to_string(a.d));
  if ((a.q_norm == nullptr) != (a.k_norm == nullptr))
    throw std::invalid_argument("rope_cache: q_norm and k_norm come together");
  if (a.cache_dtype < kCacheF32 || a.cache_dtype > kCacheE4M3)
    throw std::invalid_argument("rope_cache: unknown cache dtype code " +
                                std::to_string(a.cache_dtype));
  const int64_t slots = a.num_blocks * a.block_size;
  for (int t = 0; t < a.rows; ++t) {
    if (a.positions[t] < 0 || a.positions[t] >= a.num_positions)
      throw std::out_of_range("rope_cache: positions[" + std::to_string(t) + "] = " +
                              std::to_string(a.positions[t]) + " is outside the table's " +
                              std::to_string(a.num_positions) + " positions");
    if (a.slots[t] < -1 || a.slots[t] >= slots)
      throw std::out_of_range("rope_cache: slot_mapping[" + std::to_string(t) + "] = " +
                              std::to_string(a.slots[t]) + " is outside the cache's " +
                              std::to_string(slots) + " slots");
  }
  constexpr int kRowsPerThread = 64;  // below, the team's wake-up costs more than the rows
  const int threads = std::max(1, std::min(a.threads, a.rows / kRowsPerThread));
  parallel(threads, [&](int part, int parts) {
    const int t1 = int(int64_t(a.rows) * (part + 1) / parts);
    for (int t = int(int64_t(a.rows) * part / parts); t < t1; ++t) {
      const float* f = a.factors + a.positions[t] * 2 * a.d;
      for (int h = 0; h < a.hq; ++h)
        rotate(a.q + t * a.q_row_stride + h * a.d, f, a.d, a.q_norm, a.norm_eps);
      float* k = a.k + t * a.k_row_stride;
      for (int h = 0; h < a.hkv; ++h) rotate(k + h * a.d, f, a.d, a.k_norm, a.norm_eps);
      const int64_t slot = a.slots[t];
      if (slot < 0) continue;
      const int64_t at =
          slot / a.block_size * a.block_stride + slot % a.block_size * a.slot_stride;
      const float* v = a.v + t * a.v_row_stride;
      for (int h = 0; h < a.hkv; ++h) {
        const int64_t to = at + h * a.head_stride;
        const float *kh = k + h * a.d, *vh = v + h * a.d;
        switch (a.cache_dtype) {
          case kCacheE4M3:
            store_e4m3(static_cast<uint8_t*>(a.k_cache) + to, kh, a.k_inv_scale, a.d);
            store_e4m3(static_cast<uint8_t*>(a.v_cache) + to, vh, a.v_inv_scale, a.d);
            break;
          case kCacheBF16:
            store_16<bf16_from_float>(static_cast<uint16_t*>(a.k_cache) + to, kh, a.d);
            store_16<bf16_from_float>(static_cast<uint16_t*>(a.v_cache) + to, vh, a.d);
            break;
          case kCacheF16:
            store_16<f16_from_float>(static_cast<uint16_t*>(a.k_cache) + to, kh, a.d);
            store_16<f16_from_float>(static_cast<uint16_t*>(a.v_cache) + to, vh, a.d);
            break;
          default:
            std::memcpy(static_cast<float*>(a.k_cache) + to, kh, a.d * sizeof(float));
            std::memcpy(static_cast<float*>(a.v_cache) + to, vh, a.d * sizeof(float));
        }
      }
    }
  });
}

}  // namespace pagedkern_cpu
