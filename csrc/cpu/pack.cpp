// Weight repacking, once at load: QuantizedWeight's int4 / int8 rows into 16-row tiles, block
// by block of 32 K (layout: quant_gemv.h). Rows past N are zeros (their outputs are never
// stored).

#include <stdexcept>

#include "quant_gemv.h"

namespace pagedkern_cpu {

int64_t int4_packed_bytes(int n, int k) {
  return int64_t((n + kRows - 1) / kRows) * (k / kBlock) * kInt4TileBlockBytes;
}
int64_t int8_packed_bytes(int n, int k) {
  return int64_t((n + kRows - 1) / kRows) * (k / kBlock) * kInt8TileBlockBytes;
}

// qweight [N, K/2] uint8 (weight 2i in the low nibble of byte i), scales/mins [N, K/G] fp16.
void pack_int4(uint8_t* out, const uint8_t* q, const uint16_t* s, const uint16_t* mn, int n, int k,
               int group) {
  if (k <= 0 || k % kBlock || group <= 0 || group % kBlock || k % group)
    throw std::invalid_argument("k and the group size must be multiples of 32, k of the group");
  const int blocks = k / kBlock, tiles = (n + kRows - 1) / kRows, groups = k / group;
  auto nibble = [&](int row, int col) -> uint8_t {
    const uint8_t byte = q[size_t(row) * (k / 2) + col / 2];
    return col % 2 ? byte >> 4 : byte & 0x0F;
  };
  for (int t = 0; t < tiles; ++t)
    for (int b = 0; b < blocks; ++b) {
      uint8_t* dst = out + (size_t(t) * blocks + b) * kInt4TileBlockBytes;
      uint16_t* dm = reinterpret_cast<uint16_t*>(dst + kRows * kBlock / 2);
      for (int r = 0; r < kRows; ++r) {
        const int row = t * kRows + r;
        const bool live = row < n;
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) {
            const int c = b * kBlock + 4 * j + i;
            dst[64 * j + 4 * r + i] =
                live ? uint8_t(nibble(row, c) | (nibble(row, c + 16) << 4)) : 0;
          }
        const size_t g = size_t(row) * groups + size_t(b) * kBlock / group;
        dm[r] = live ? s[g] : 0;
        dm[kRows + r] = live ? mn[g] : 0;
      }
    }
}

// qweight [N, K] int8 in -127..127, stored as q + 128.
void pack_int8(uint8_t* out, const int8_t* q, int n, int k) {
  if (k <= 0 || k % kBlock) throw std::invalid_argument("k must be a positive multiple of 32");
  const int blocks = k / kBlock, tiles = (n + kRows - 1) / kRows;
  for (int t = 0; t < tiles; ++t)
    for (int b = 0; b < blocks; ++b) {
      uint8_t* dst = out + (size_t(t) * blocks + b) * kInt8TileBlockBytes;
      for (int r = 0; r < kRows; ++r) {
        const int row = t * kRows + r;
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 4; ++i) {
            const int w = row < n ? q[size_t(row) * k + b * kBlock + 4 * j + i] : 0;
            dst[64 * j + 4 * r + i] = uint8_t(w + kInt8Bias);
          }
      }
    }
}

}  // namespace pagedkern_cpu
