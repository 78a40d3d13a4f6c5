// Weight repacking, once at load: QuantizedWeight's int4 / int8 rows into 16-row tiles, block
// by block of 32 K (layout: quant_gemv.h); int4 whose every m is -8 d into int4_sym tiles (no
// m), or -z d into int4_zp tiles (z a byte). Rows past N are zeros (their outputs are never stored).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "quant_gemv.h"

namespace pagedkern_cpu {

const char* format_name(int format) {
  switch (format) {
    case kInt8: return "int8";
    case kInt4: return "int4";
    case kInt4Sym: return "int4_sym";
    case kInt8G32: return "int8_g32";
    case kInt8G16: return "int8_g16";
    case kInt6G16: return "int6_g16";
    case kInt5G32: return "int5_g32";
    case kInt6K: return "int6_k";
    case kInt4K: return "int4_k";
    case kInt4Zp: return "int4_zp";
    default: return "unknown";
  }
}

void check_format_k(int format, int k) {
  const int multiple = format_k_multiple(format);
  if (k <= 0 || k % multiple)
    throw std::invalid_argument(std::string(format_name(format)) + " tiles need k a positive " +
                                "multiple of " + std::to_string(multiple));
}

int64_t packed_bytes(int format, int n, int k) {
  int block_bytes;
  switch (format) {
    case kInt8: block_bytes = kInt8TileBlockBytes; break;
    case kInt4: block_bytes = kInt4TileBlockBytes; break;
    case kInt4Sym: block_bytes = kInt4SymTileBlockBytes; break;
    case kInt4Zp: block_bytes = kInt4ZpTileBlockBytes; break;
    case kInt8G32:
    case kInt8G16: block_bytes = int8_grouped_block_bytes(int8_group(format)); break;
    case kInt6G16: block_bytes = kInt6TileBlockBytes; break;
    case kInt5G32: block_bytes = kInt5TileBlockBytes; break;
    case kInt6K:
      check_format_k(format, k);
      return int64_t((n + kRows - 1) / kRows) * int64_t(int6k_tile_bytes(k));
    case kInt4K:
      check_format_k(format, k);
      return int64_t((n + kRows - 1) / kRows) * int64_t(int4k_tile_bytes(k));
    default: throw std::invalid_argument(kFormatsMessage);
  }
  return int64_t((n + kRows - 1) / kRows) * (k / kBlock) * block_bytes;
}

// Compared as fp32 bit patterns: -8 d is exact in fp32, and equal bits (not only equal values:
// +0 and -0, NaN) make the kernel's fp32 m the one the int4 tiles would convert from fp16.
bool int4_symmetric(const uint16_t* s, const uint16_t* mn, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const float d = half_to_float(s[i]), m = half_to_float(mn[i]), want = -8.0f * d;
    uint32_t mb, wb;
    std::memcpy(&mb, &m, 4);
    std::memcpy(&wb, &want, 4);
    if (mb != wb || want != want) return false;
  }
  return true;
}

namespace {

// Every live row of every tile block: row(dst, row of N, row of the tile, block), over blocks
// zeroed first (rows past N stay zeros).
template <typename Row>
void for_tile_rows(uint8_t* out, int n, int k, int block_bytes, const Row& row_fn) {
  if (k <= 0 || k % kBlock) throw std::invalid_argument("k must be a positive multiple of 32");
  const int blocks = k / kBlock, tiles = (n + kRows - 1) / kRows;
  for (int t = 0; t < tiles; ++t)
    for (int b = 0; b < blocks; ++b) {
      uint8_t* dst = out + (size_t(t) * blocks + b) * block_bytes;
      std::memset(dst, 0, block_bytes);
      for (int r = 0; r < kRows && t * kRows + r < n; ++r) row_fn(dst, t * kRows + r, r, b);
    }
}

// Row r's low 4 bits of its block's 32 codes into int4's nibble plane: byte (j, r, i) holds
// k = 4j + i low and 16 + 4j + i high.
template <typename Code>
void put_nibbles(uint8_t* dst, int r, const Code& code) {
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 4; ++i)
      dst[64 * j + 4 * r + i] = uint8_t((code(4 * j + i) & 15) | ((code(16 + 4 * j + i) & 15) << 4));
}

// Code c of block b of row `row` of int4 qweight [N, K / 2] (weight 2i in byte i's low nibble)
int int4_code(const uint8_t* q, int row, int k, int b, int c) {
  const uint8_t byte = q[size_t(row) * (k / 2) + (b * kBlock + c) / 2];
  return c % 2 ? byte >> 4 : byte & 0x0F;
}

}  // namespace

// qweight [N, K/2] uint8 (weight 2i in the low nibble of byte i), scales/mins [N, K/G] fp16.
// int4_sym: the same without the m (the caller checked int4_symmetric).
void pack_int4(uint8_t* out, const uint8_t* q, const uint16_t* s, const uint16_t* mn, int n, int k,
               int group, int format) {
  if (k <= 0 || k % kBlock || group <= 0 || group % kBlock || k % group)
    throw std::invalid_argument("k and the group size must be multiples of 32, k of the group");
  if (format != kInt4 && format != kInt4Sym)
    throw std::invalid_argument("pack_int4: format must be 1 (int4) or 2 (int4_sym)");
  const bool sym = format == kInt4Sym;
  const int groups = k / group;
  for_tile_rows(out, n, k, sym ? kInt4SymTileBlockBytes : kInt4TileBlockBytes,
                [&](uint8_t* dst, int row, int r, int b) {
                  put_nibbles(dst, r, [&](int c) { return int4_code(q, row, k, b, c); });
                  uint16_t* dm = reinterpret_cast<uint16_t*>(dst + kRows * kBlock / 2);
                  const size_t g = size_t(row) * groups + size_t(b) * kBlock / group;
                  dm[r] = s[g];
                  if (!sym) dm[kRows + r] = mn[g];
                });
}

// int4_sym's tiles with each block's 16 zero points (bytes) after its 16 d.
void pack_int4_zp(uint8_t* out, const uint8_t* q, const uint16_t* s, const uint8_t* z, int n,
                  int k, int group) {
  if (k <= 0 || k % kBlock || group <= 0 || group % kBlock || k % group)
    throw std::invalid_argument("k and the group size must be multiples of 32, k of the group");
  const int groups = k / group;
  for_tile_rows(out, n, k, kInt4ZpTileBlockBytes, [&](uint8_t* dst, int row, int r, int b) {
    put_nibbles(dst, r, [&](int c) { return int4_code(q, row, k, b, c); });
    uint8_t* scales = dst + kRows * kBlock / 2;
    const size_t g = size_t(row) * groups + size_t(b) * kBlock / group;
    std::memcpy(scales + 2 * r, &s[g], 2);
    scales[2 * kRows + r] = z[g];
  });
}

namespace {

// Row r (row `row` of N) of a tile block's fp32 scales ([32 / group][16], at `dst`): block b's
// groups of scales [N, K / group]; 0 past N.
void put_scales(uint8_t* dst, const float* scales, int row, int r, int n, int k, int b,
                int group) {
  for (int g = 0; g < kBlock / group; ++g) {
    const float s = row < n ? scales[size_t(row) * (k / group) + b * (kBlock / group) + g] : 0.0f;
    std::memcpy(dst + 4 * (kRows * g + r), &s, 4);
  }
}

// The int8 tiles of qweight [N, K] (stored as q + 128), blocks `block_bytes` apart; with
// `scales` ([N, K / group] fp32), each block's int8 part is followed by its rows' scales.
void pack_int8_tiles(uint8_t* out, const int8_t* q, const float* scales, int n, int k, int group,
                     int block_bytes) {
  if (k <= 0 || k % kBlock) throw std::invalid_argument("k must be a positive multiple of 32");
  const int blocks = k / kBlock, tiles = (n + kRows - 1) / kRows;
  for (int t = 0; t < tiles; ++t)
    for (int b = 0; b < blocks; ++b) {
      uint8_t* dst = out + (size_t(t) * blocks + b) * block_bytes;
      for (int r = 0; r < kRows; ++r) {
        const int row = t * kRows + r;
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 4; ++i) {
            const int w = row < n ? q[size_t(row) * k + b * kBlock + 4 * j + i] : 0;
            dst[64 * j + 4 * r + i] = uint8_t(w + kInt8Bias);
          }
        if (scales != nullptr) put_scales(dst + kRows * kBlock, scales, row, r, n, k, b, group);
      }
    }
}

}  // namespace

// qweight [N, K] int8 in -127..127, stored as q + 128.
void pack_int8(uint8_t* out, const int8_t* q, int n, int k) {
  pack_int8_tiles(out, q, nullptr, n, k, kBlock, kInt8TileBlockBytes);
}

void pack_int8_grouped(uint8_t* out, const int8_t* q, const float* scales, int n, int k,
                       int group) {
  if (group != 16 && group != 32) throw std::invalid_argument("group must be 16 or 32");
  pack_int8_tiles(out, q, scales, n, k, group, int8_grouped_block_bytes(group));
}

namespace {

// Row `row`'s block b of codes q + 32 (0..63) as row r of a tile block's 6-bit codes: the nibble
// plane, then byte (jj, r, i) of the 2-bit plane holds the high bits of k-quads jj, jj + 2,
// jj + 4, jj + 6 at bits 0, 2, 4, 6.
void put_int6_codes(uint8_t* dst, const int8_t* q, int row, int r, int k, int b) {
  auto code = [&](int c) {
    const int v = q[size_t(row) * k + b * kBlock + c] + 32;
    if (v < 0 || v > 63) throw std::invalid_argument("int6 codes must lie in -32..31");
    return v;
  };
  put_nibbles(dst, r, code);
  for (int jj = 0; jj < 2; ++jj)
    for (int i = 0; i < 4; ++i) {
      uint8_t bits = 0;
      for (int m = 0; m < 4; ++m) bits |= uint8_t((code(4 * (jj + 2 * m) + i) >> 4) << (2 * m));
      dst[kRows * kBlock / 2 + 64 * jj + 4 * r + i] = bits;
    }
}

// One row's `groups` scales of a 256 as float(c[g]) * d exactly, c in lo..hi: d = s / c for
// the largest |s|'s candidate c, `first` (what GGUF's quantizer gives the largest: Q6_K's
// -128, Q4_K's 63) tried first, then hi down to 1 (d of s's sign).
template <typename C>
bool factor_super_block(const float* s, int groups, int first, int lo, int hi, float& d, C* c) {
  int top = 0;
  for (int g = 0; g < groups; ++g) {
    if (!std::isfinite(s[g])) return false;
    if (std::fabs(s[g]) > std::fabs(s[top])) top = g;
  }
  if (s[top] == 0.0f) {  // all zero (either sign: a zero scale adds +0 to the chain either way)
    d = 0.0f;
    std::fill_n(c, groups, C(0));
    return true;
  }
  for (int i = 0; i <= hi; ++i) {
    const int ct = i == 0 ? first : hi + 1 - i;
    if (i > 0 && ct == first) continue;
    d = s[top] / float(ct);
    if (!std::isfinite(d) || d == 0.0f) continue;
    bool exact = true;
    for (int g = 0; g < groups && exact; ++g) {
      const float v = std::nearbyint(s[g] / d);
      exact = v >= float(lo) && v <= float(hi) && v * d == s[g];
      if (exact) c[g] = C(v);
    }
    if (exact) return true;
  }
  return false;
}

}  // namespace

// q + 32 (0..63) as put_int6_codes, then the scales. Rows past N are zeros: code -32 with
// scale 0.
void pack_int6(uint8_t* out, const int8_t* q, const float* scales, int n, int k) {
  for_tile_rows(out, n, k, kInt6TileBlockBytes, [&](uint8_t* dst, int row, int r, int b) {
    put_int6_codes(dst, q, row, r, k, b);
    put_scales(dst + kInt6CodeBytes, scales, row, r, n, k, b, 16);
  });
}

bool factor_int6_scales(const float* scales, int n, int k, float* d, int8_t* c) {
  check_format_k(kInt6K, k);
  const int64_t supers = int64_t(n) * (k / kInt6KSuper);
  for (int64_t i = 0; i < supers; ++i)
    if (!factor_super_block(scales + 16 * i, 16, -128, -128, 127, d[i], c + 16 * i)) return false;
  return true;
}

// Per tile: the rows' d, then each block's int6_g16 codes and its rows' c per group
// (quant_gemv.h). Rows past N are zeros: code -32, c 0, d 0.
void pack_int6_k(uint8_t* out, const int8_t* q, const int8_t* c, const float* d, int n, int k) {
  const int64_t bytes = packed_bytes(kInt6K, n, k);  // checks k
  std::memset(out, 0, size_t(bytes));
  const int blocks = k / kBlock, supers = k / kInt6KSuper, tiles = (n + kRows - 1) / kRows;
  for (int t = 0; t < tiles; ++t) {
    uint8_t* tile = out + size_t(t) * int6k_tile_bytes(k);
    float* tile_d = int6k_d(tile);
    uint8_t* first = int6k_blocks(tile, k);
    for (int r = 0; r < kRows && t * kRows + r < n; ++r) {
      const int row = t * kRows + r;
      for (int sb = 0; sb < supers; ++sb) tile_d[kRows * sb + r] = d[size_t(row) * supers + sb];
      for (int b = 0; b < blocks; ++b) {
        uint8_t* dst = first + size_t(b) * kInt6KBlockBytes;
        put_int6_codes(dst, q, row, r, k, b);
        for (int g = 0; g < 2; ++g)
          dst[kInt6CodeBytes + kRows * g + r] = uint8_t(c[size_t(row) * (k / 16) + 2 * b + g]);
      }
    }
  }
}

bool factor_int4_scales(const float* scales, const float* mins, int n, int k, float* d,
                        float* dm, uint8_t* cs, uint8_t* cm) {
  check_format_k(kInt4K, k);
  const int64_t supers = int64_t(n) * (k / kInt4KSuper);
  for (int64_t i = 0; i < supers; ++i)
    if (!factor_super_block(scales + 8 * i, 8, 63, 0, 255, d[i], cs + 8 * i) ||
        !factor_super_block(mins + 8 * i, 8, 63, 0, 255, dm[i], cm + 8 * i))
      return false;
  return true;
}

// Per tile and super-block: the rows' d and dm, cs and cm, then the blocks' nibble planes
// (quant_gemv.h). Rows past N are zeros: code 0, c 0, d 0.
void pack_int4_k(uint8_t* out, const uint8_t* q, const uint8_t* cs, const uint8_t* cm,
                 const float* d, const float* dm, int n, int k) {
  const int64_t bytes = packed_bytes(kInt4K, n, k);  // checks k
  std::memset(out, 0, size_t(bytes));
  const int blocks = k / kBlock, supers = k / kInt4KSuper, tiles = (n + kRows - 1) / kRows;
  for (int t = 0; t < tiles; ++t) {
    uint8_t* tile = out + size_t(t) * int4k_tile_bytes(k);
    for (int r = 0; r < kRows && t * kRows + r < n; ++r) {
      const int row = t * kRows + r;
      for (int b = 0; b < blocks; ++b) {
        const Int4KParts<uint8_t> kb = int4k_block(tile, b);
        put_nibbles(kb.nibbles, r, [&](int c) { return int4_code(q, row, k, b, c); });
        kb.cs[r] = cs[size_t(row) * blocks + b];
        kb.cm[r] = cm[size_t(row) * blocks + b];
        kb.d[r] = d[size_t(row) * supers + b / 8];
        kb.dm[r] = dm[size_t(row) * supers + b / 8];
      }
    }
  }
}

// u (0..31): the nibble plane; byte (r, i) of the 64-byte fifth-bit plane holds k = 4j + i's
// fifth bit at bit j; then the block's 16 scales and 16 mins (fp32). Rows past N: scale and
// min 0.
void pack_int5(uint8_t* out, const uint8_t* q, const float* scales, const float* mins, int n,
               int k) {
  const int blocks = k / kBlock;
  for_tile_rows(out, n, k, kInt5TileBlockBytes, [&](uint8_t* dst, int row, int r, int b) {
    auto code = [&](int c) {
      const int v = q[size_t(row) * k + b * kBlock + c];
      if (v > 31) throw std::invalid_argument("int5 codes must lie in 0..31");
      return v;
    };
    put_nibbles(dst, r, code);
    uint8_t* fifth = dst + kRows * kBlock / 2;
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 4; ++i) fifth[4 * r + i] |= uint8_t((code(4 * j + i) >> 4) << j);
    const size_t g = size_t(row) * blocks + b;
    std::memcpy(fifth + kRows * 4 + 4 * r, scales + g, 4);
    std::memcpy(fifth + kRows * 8 + 4 * r, mins + g, 4);
  });
}

}  // namespace pagedkern_cpu
