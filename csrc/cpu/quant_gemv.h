// pagedkern._cpu: quantized GEMV/GEMM on the CPU, y[M, N] = x[M, K] @ W[N, K].T, fp32 in and out,
// for the weight formats of reference/quantized_weight.py: int4 (w = d * q + m, q in 0..15, d
// and m fp16 per group of 32 or 128 along K) and int8 per output channel (w = s * q, q in
// -127..127, s fp32).
//
// Design (llama.cpp's technique for Q4_1 x Q8_1 and Q8_0 x Q8_0, written for these formats):
// - Weights are repacked once at load (pack.cpp) into tiles of 16 rows, block by block of 32 K:
//   a 32-bit lane holds 4 consecutive weights of one row, so one 64-byte load feeds 16 rows.
//   int4: 4 loads of 64 bytes a block, low nibbles k-quad j (k = 4j..4j+3), high nibbles k-quad
//   j + 4 (k = 16 + 4j..), then the block's 16 d and 16 m (fp16; G = 128 repeats a group's pair
//   over its four blocks): 320 bytes a block, 5 bits a weight. int4_sym, chosen at pack time
//   when every group has m == -8 d exactly in fp16 (GGUF Q4_0, w = d (q - 8)): the same tiles
//   without the m (288 bytes a block, 4.5 bits a weight: llama.cpp's Q4_0 bytes), m = -8 d
//   formed in the kernel in fp32 (exact), so its bits equal the int4 tiles' for that weight.
//   A batch-1 decode is bound by the weight bytes it reads: ~1.1x the int4 tiles' speed.
//   int8: 8 loads of 64 bytes a block, k-quad j in load j, each weight stored biased as
//   q + 128 (u8: the unsigned operand of vpdpbusd). int8_g32 / int8_g16 (GGUF Q8_0 and Q6_K
//   exactly): the int8 block, then each row's fp32 scale per group of 32 / 16 of the block
//   (576 / 640 bytes a block); their dots use the sign trick (|x| u8 x w with x's sign) on
//   every x86 path, so no bias comes off per group. int6_g16 (Q6_K-like codes at 8 bits a
//   weight, where the scales do not factor as int6_k's): int8_g16 whose codes fit 6 bits,
//   stored as q + 32, in 384 code bytes a block; the x86 kernels feed those unsigned
//   codes to the u8 operand and take 32 * sum(x) off each group's integer sum, the same
//   integers as int8_g16's, so the same bits. int6_k (Q6_K at 6.625 bits a weight, its own
//   two-level scales): int6_g16's codes with each group's scale as an int8 c times an fp32 d
//   per row and 256 K (the pack factors the fp32 scales so that float(c) * d equals each one
//   exactly, as a GGUF Q6_K's fp16 d times int8 sc always does). A tile holds its d
//   ([K / 256][16] fp32), then its blocks: int6_g16's 384 code bytes and the block's c
//   ([2][16] int8). The kernels form each group's fp32 scales as float(c) * d, the values
//   int6_g16 stores, so the same bits.
//   int4_k (GGUF Q4_K at 4.75 bits a weight, its own two-level scales: w = s q + m, s and m
//   per 32 an unsigned 8-bit c times an fp32 d per row and 256 K, as a Q4_K's fp16 d times
//   its 6-bit sc and its fp16 dmin times its 6-bit m always factor): a tile is its
//   super-blocks of 256 K, each its rows' d and dm ([2][16] fp32), cs and cm ([8][16] uint8),
//   then its 8 blocks' nibble planes (int4's): 2432 bytes, every plane on cache lines of its
//   own (the c beside each block's 256 nibble bytes, 288 bytes a block, put every other
//   block's 64-byte loads across two lines, measurably slower:
//   bench/results/2026-12-06-xeon-int4-k.md).
//   The kernels form s = float(cs) d and m = float(cm) dm, the fp32 values int5_g32 would
//   store, so int4_k gives int5_g32's bits for codes in 0..15.
//   int4_zp (GPTQ / AWQ with zero points: w = d (q - z), d fp16 and z an integer 0..255 per
//   group): int4_sym's tiles with the block's 16 z bytes after its d (304 bytes a block, 4.75
//   bits a weight); the kernels form m = -(float(z) d) in fp32, exact (an fp16 d times an
//   8-bit integer), the fp32 min int5_g32 would store, so int4_zp gives int5_g32's bits at
//   two thirds of its bytes.
//   int5_g32 (GGUF Q5_0, Q5_1 and Q5_K exactly: w = s u + m, u in 0..31, fp32 s and m per
//   group of 32, i.e. per block): int4's nibble plane, 64 bytes of fifth bits (byte (r, i)
//   holds k = 4j + i's at bit j), then the block's 16 s and 16 m (fp32): 448 bytes a block,
//   7 bits a weight. Its dots and fp32 chain are int4's, with the fifth bit or-ed in.
// - Activations are quantized on the fly (activations.cpp), per row and per block of 32, to
//   8 or 16 bits: dx = max|x| / Q, q = round-to-nearest-even(x / dx) in -Q..Q (Q = 127, or
//   32639 for 16 bits), sx = dx * sum(q). A 16-bit q is held as two int8 planes, q = 256 hi +
//   lo (hi in -127..127, lo in -128..127), so the same u8 x s8 dot products serve both
//   widths: 8 bits is llama.cpp's Q8 (its error, ~0.5% a GEMM); 16 bits costs a second dot a
//   weight load and is ~250x closer to the fp32 product (closer than bf16 activations).
// - A block's integer dot products of 16 rows at once (dot_*.cpp): AVX-512 VNNI vpdpbusd
//   (zmm for int8 and the int4 formats; the others run the 256-bit body with EVEX vpdpbusd
//   ymm, faster than the AVX2 body), AVX-VNNI (256-bit vpdpbusd), AVX2 vpmaddubsw + vpmaddwd
//   (pairs fit in s16: int8 weights take the sign trick |x| x sign(x) w), Arm NEON SDOT (dotprod, s8 x s8: a 64-byte load is
//   four q registers of 4 rows; int8 weights XOR 0x80 are q, no bias to remove), or plain
//   C++. Integer sums are exact, so every path gives the same integers: isum = sum(w q)
//   (int8's bias removed as 128 * sum(q)).
// - Per row and block, in K order, in fp32 with explicit fused multiply-adds:
//     int4: acc = fma(d * dx, isum, acc); acc = fma(m, sx, acc)      y = acc
//           (int4_sym: m = -8 * d, in fp32; int4_zp: m = -(float(z) * d); int5_g32: d and m
//           stored in fp32)
//     int8: acc = fma(dx, isum, acc)                                 y = acc * s
//     int8_g: per group g of the block, acc = fma(s_g * dx, isum_g, acc)   y = acc
//   The same operations in the same order on every path (the portable one compiled without FP
//   contraction, std::fma), so every path returns the same bits, and a row's result depends
//   only on its own x row and the weights: never on M, the other rows, the thread count or the
//   split of N across threads.
// - Run-time ISA dispatch (isa.cpp: cpuid; on aarch64 HWCAP_ASIMDDP / FEAT_DotProd): the x86
//   and Arm dotprod kernels are compiled per function with target attributes, so the module
//   loads and runs on any x86-64 or aarch64 (and builds the portable path alone elsewhere); a
//   path asked for explicitly that the CPU lacks is an error, never SIGILL.
// - Threads (gemv.cpp): the N tiles split into contiguous ranges over OpenMP's threads, which
//   are torch's intra-op threads (the same libgomp, loaded by torch first): no second pool
//   competing with torch's spinning workers on a small host. At up to kRowChunk rows (decode)
//   the x86 kernels read several of a thread's tiles at once, their blocks interleaved
//   (TilesFn): one core's prefetchers keep more lines in flight over several streams.
//
// Pointers are passed as integers (as the CUDA extension takes them); the Python side
// (ops/cpu/quant_gemv.py) validates shapes, dtypes and contiguity.

#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace pagedkern_cpu {

constexpr int kRows = 16;   // weight rows a tile
constexpr int kBlock = 32;  // K a block
constexpr int kInt4TileBlockBytes = kRows * kBlock / 2 + kRows * 2 * 2;  // nibbles, d, m
constexpr int kInt4SymTileBlockBytes = kRows * kBlock / 2 + kRows * 2;   // nibbles, d
constexpr int kInt4ZpTileBlockBytes = kInt4SymTileBlockBytes + kRows;    // nibbles, d, z
constexpr int kInt8TileBlockBytes = kRows * kBlock;
// int8 with a scale per group of G along K (G = 32: GGUF Q8_0, Q5_0; 16: Q6_K): the int8 tile
// block, then each row's fp32 scales for the block ([32 / G][16])
constexpr int int8_grouped_block_bytes(int group) { return kRows * kBlock + kRows * 4 * (kBlock / group); }
// int6_g16: int8_g16 whose codes all lie in -32..31 (GGUF Q6_K's q - 32), held as q + 32 in 6
// bits: 256 bytes of low nibbles (int4's layout), 128 of 2-bit high parts, then the scales
constexpr int kInt6CodeBytes = kRows * kBlock / 2 + kRows * kBlock / 4;
constexpr int kInt6TileBlockBytes = kInt6CodeBytes + kRows * 4 * 2;
// int6_k: a tile's d [K / 256][16] fp32, then its blocks: the codes, then c [2][16] int8
constexpr int kInt6KSuper = 256;  // K a d
constexpr int kInt6KBlockBytes = kInt6CodeBytes + kRows * 2;
// int4_k: a super-block of 256 K is d, dm [2][16] fp32, cs, cm [2][8][16] uint8, then 8
// nibble planes
constexpr int kInt4KSuper = 256;  // K a d
constexpr int kInt4KHeaderBytes = kRows * 4 * 2 + kRows * 8 * 2;
constexpr int kInt4KSuperBytes = kInt4KHeaderBytes + 8 * kRows * kBlock / 2;
constexpr int kInt4KBlockBytes = kInt4KSuperBytes / 8;  // a block's share
constexpr int kInt5TileBlockBytes = kRows * kBlock / 2 + kRows * 4 + kRows * 4 * 2;
constexpr int kRowChunk = 4;  // AVX-512: activation rows computed together over one weight tile
constexpr int kInt8Bias = 128;  // int8 weights are stored as q + 128

// How far ahead of its current block an x86 kernel prefetches the tile it streams. A batch-1
// GEMV reads its weights once, from DRAM for a ~1B model, and one core's hardware prefetchers
// alone keep too few lines in flight; of 0.5, 1, 2 and 4 KB, 0.5 and 1 KB measured best
// (bench/results/2026-12-05-xeon-cpu-vs-llamacpp.md). A prefetch changes no result.
constexpr int kPrefetchBytes = 1024;

// Prefetches (prefetcht0 on x86) the lines of the `Bytes`-byte block kPrefetchBytes past
// `block`; the kernels that call it are built by GCC and clang only.
template <int Bytes>
inline void prefetch_ahead(const uint8_t* block) {
#if defined(__GNUC__) || defined(__clang__)
  for (int line = 0; line < Bytes; line += 64)
    __builtin_prefetch(block + kPrefetchBytes + line, 0, 3);
#endif
}

// The tile formats (pack.cpp); int4_sym: int4 whose every m is -8 d (m not stored).
// int8_g32 / int8_g16: int8 with an fp32 scale per group of 32 / 16 along K. int5_g32: 5-bit
// codes with an fp32 scale and min per 32. int6_k: int6_g16 with Q6_K's two-level scales.
// int4_k: int4's codes with Q4_K's two-level scales and mins. int4_zp: int4 whose every m is
// -z d with an integer z (z stored as a byte, m not stored).
enum Format {
  kInt8 = 0, kInt4 = 1, kInt4Sym = 2, kInt8G32 = 3, kInt8G16 = 4, kInt6G16 = 5, kInt5G32 = 6,
  kInt6K = 7, kInt4K = 8, kInt4Zp = 9, kNumFormats = 10
};
constexpr int int8_group(int format) {
  return format == kInt8G32 ? 32 : format == kInt8G16 || format == kInt6G16 || format == kInt6K ? 16 : 0;
}
const char* format_name(int format);
// The K a format's tiles take a multiple of: whole super-blocks for the two-level formats
constexpr int format_k_multiple(int format) {
  return format == kInt6K ? kInt6KSuper : format == kInt4K ? kInt4KSuper : kBlock;
}
// Throws std::invalid_argument unless k is a positive multiple of format_k_multiple(format)
void check_format_k(int format, int k);
constexpr const char* kFormatsMessage =
    "format must be 0..9 (int8, int4, int4_sym, int8_g32, int8_g16, int6_g16, int5_g32, int6_k, "
    "int4_k, int4_zp)";

// The tile accessors below take the tile's bytes as Byte: const uint8_t where the kernels read
// them, uint8_t where the pack writes them (and give float pointers of the same constness).
template <class Byte>
using FloatOf = std::conditional_t<std::is_const_v<Byte>, const float, float>;

// An int6_k tile's bytes (k a multiple of 256), its d, and its first block
inline size_t int6k_tile_bytes(int k) {
  return size_t(k / kInt6KSuper) * kRows * 4 + size_t(k / kBlock) * kInt6KBlockBytes;
}
template <class Byte>
inline FloatOf<Byte>* int6k_d(Byte* tile) {
  return reinterpret_cast<FloatOf<Byte>*>(tile);
}
template <class Byte>
inline Byte* int6k_blocks(Byte* tile, int k) {
  return tile + size_t(k / kInt6KSuper) * kRows * 4;
}

// An int4_k tile's bytes (k a multiple of 256), and block b's parts: its nibble plane, its 16
// rows' cs and cm, its super-block's 16 d and dm
inline size_t int4k_tile_bytes(int k) { return size_t(k / kInt4KSuper) * kInt4KSuperBytes; }
template <class Byte>
struct Int4KParts {
  Byte *nibbles, *cs, *cm;
  FloatOf<Byte> *d, *dm;
};
using Int4KBlock = Int4KParts<const uint8_t>;
template <class Byte>
inline Int4KParts<Byte> int4k_block_of(Byte* super, int i) {  // block i (0..7) of a super
  Byte* cs = super + kRows * 8 + i * kRows;
  FloatOf<Byte>* d = reinterpret_cast<FloatOf<Byte>*>(super);
  return {super + kInt4KHeaderBytes + i * (kRows * kBlock / 2), cs, cs + 8 * kRows, d, d + kRows};
}
template <class Byte>
inline Int4KParts<Byte> int4k_block(Byte* tile, int b) {
  return int4k_block_of(tile + size_t(b / 8) * kInt4KSuperBytes, b % 8);
}
// The blocks of an int4_k tile in order (the kernels' walk: no division a block)
struct Int4KCursor {
  const uint8_t* super;
  int i = 0;
  Int4KBlock next() {
    const Int4KBlock block = int4k_block_of(super, i);
    if (++i == 8) i = 0, super += kInt4KSuperBytes;
    return block;
  }
};

enum Path {
  kPortable = 0,
  kAvx2 = 1,
  kAvxVnni = 2,
  kAvx512Vnni = 3,
  kNeonDotprod = 4,  // aarch64
  kAvx512Amx = 5,    // avx512_vnni, with AMX tiles: the int4 formats on 32+ rows, int8_g32 16+
  kNumPaths = 6
};

bool path_supported(int path);
int best_path();
const char* path_name(int path);
// `path` checked for a GEMM named `op` (messages name it): -1 is best_path() (found once), any
// other must be a Path this CPU runs (std::invalid_argument / std::runtime_error otherwise)
int resolve_path(int path, const char* op);

// M rows of x, quantized per block of 32 into `planes` int8 planes (1: 8 bits, 2: 16 bits).
struct QuantizedRows {
  int planes = 1, blocks = 0;
  std::vector<int8_t> q;      // [M, blocks, planes, 32]: plane 0 = hi (16 bits) or q (8 bits)
  std::vector<float> dx;      // [M, blocks]
  std::vector<float> sx;      // [M, blocks]: dx * sum(q)
  std::vector<int32_t> qsum;    // [M, blocks]: sum(q)
  std::vector<int32_t> qsum16;  // [M, blocks]: sum(q) over the block's first 16
  // The AMX kernels' copy of rows [0, grouped_rows): [M / 16][blocks][planes][16 rows][32],
  // each block plane of 16 rows one contiguous tile (group_rows fills it; 0: none this call).
  std::vector<int8_t> groups;
  int grouped_rows = 0;
  const int8_t* block(int row, int b) const {
    return &q[(size_t(row) * blocks + b) * planes * kBlock];
  }
  size_t group_at(int row, int b, int p) const {  // row: a multiple of 16
    return ((size_t(row / 16) * blocks + b) * planes + p) * 16 * kBlock;
  }
  const int8_t* group_tile(int row, int b, int p) const { return &groups[group_at(row, b, p)]; }
  size_t at(int row, int b) const { return size_t(row) * blocks + b; }
  void resize(int m, int k, int planes);
};

// Groups [g0, g1) of 16 quantized rows into out.groups (sized for out.grouped_rows beforehand).
void group_rows(int g0, int g1, QuantizedRows& out);

// Rows [r0, r1) of x into `out` (resized for all M rows beforehand). simd: with AVX2 (the
// x86 SIMD paths; the same bits as the plain C++ the portable path runs).
void quantize_rows(const float* x, int64_t x_stride, int r0, int r1, bool simd,
                   QuantizedRows& out);

struct Args {
  float* y;
  int64_t y_stride;
  const QuantizedRows* xq;
  const uint8_t* packed;
  const float* scales;  // int8: per output channel
  int m, n, k;
};

// Rows [r0, r0 + rc) of x against weight tile `tile` (16 rows of W), written into y.
using TileFn = void (*)(const Args&, int tile, int r0, int rc);
TileFn portable_tile(int format, int planes);
TileFn avx2_tile(int format, int planes);     // nullptr where not built (not x86)
TileFn avxvnni_tile(int format, int planes);  // nullptr where not built (old compiler)
TileFn avx512_tile(int format, int planes);   // nullptr where not built
TileFn amx_tile(int format, int planes);      // (the same; every format has AMX kernels)
TileFn neon_tile(int format, int planes);     // nullptr where not built (not aarch64)
// Rows [r0, r0 + rc) of x against tiles [t0, t1), several tiles' weight streams read at once
// (few rows: a GEMV that reads its weights from DRAM once); nullptr: no such kernel (the
// driver runs the TileFn tile by tile). The same bits as the path's TileFn.
using TilesFn = void (*)(const Args&, int t0, int t1, int r0, int rc);
TilesFn avx512_tiles(int format, int planes);  // avx512_vnni and avx512_amx
TilesFn avxvnni_tiles(int format, int planes);
TilesFn avx2_tiles(int format, int planes);

float half_to_float(uint16_t h);

// Whether `count` (d, m) fp16 pairs all have m == -8 d, bit for bit (int4_sym's condition).
bool int4_symmetric(const uint16_t* scales, const uint16_t* mins, int64_t count);
int64_t packed_bytes(int format, int n, int k);
// int4 or int4_sym tiles (int4_sym drops the mins: int4_symmetric must hold)
void pack_int4(uint8_t* out, const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins,
               int n, int k, int group, int format);
// int4_zp tiles: int4 codes with fp16 scales and uint8 zero points [N, K / group]
void pack_int4_zp(uint8_t* out, const uint8_t* qweight, const uint16_t* scales,
                  const uint8_t* zeros, int n, int k, int group);
void pack_int8(uint8_t* out, const int8_t* qweight, int n, int k);
// int8 (-127..127) with fp32 scales [N, K / group] (group 32 or 16) into int8_g32 / int8_g16
void pack_int8_grouped(uint8_t* out, const int8_t* qweight, const float* scales, int n, int k,
                       int group);
// int8 codes in -32..31 with fp32 scales [N, K / 16] into int6_g16 tiles
void pack_int6(uint8_t* out, const int8_t* qweight, const float* scales, int n, int k);
// Factors fp32 scales [N, K / 16] (K a multiple of 256) as d [N, K / 256] fp32 times c
// [N, K / 16] int8 with float(c) * d equal to each scale bit for bit (+0 for a zero); false
// (d and c left partial) where some row's 16 scales of a 256 have no such factoring.
bool factor_int6_scales(const float* scales, int n, int k, float* d, int8_t* c);
// int8 codes in -32..31 with scales factored as c * d into int6_k tiles
void pack_int6_k(uint8_t* out, const int8_t* qweight, const int8_t* c, const float* d, int n,
                 int k);
// Factors int4's fp32 scales and mins [N, K / 32] (K a multiple of 256) as d, dm [N, K / 256]
// fp32 times cs, cm [N, K / 32] uint8, float(cs) * d and float(cm) * dm equal to each scale and
// min bit for bit (+0 for a zero); false (the outputs left partial) where some row's 8 scales
// or mins of a 256 have no such factoring.
bool factor_int4_scales(const float* scales, const float* mins, int n, int k, float* d,
                        float* dm, uint8_t* cs, uint8_t* cm);
// int4 codes (qweight [N, K / 2] as pack_int4's) with scales and mins factored into int4_k tiles
void pack_int4_k(uint8_t* out, const uint8_t* qweight, const uint8_t* cs, const uint8_t* cm,
                 const float* d, const float* dm, int n, int k);
// codes in 0..31 (one a byte) with fp32 scales and mins [N, K / 32] into int5_g32 tiles
void pack_int5(uint8_t* out, const uint8_t* qweight, const float* scales, const float* mins,
               int n, int k);

// y[M, N] (row stride y_stride) = x[M, K] (row stride x_stride) @ W.T, W packed in `format`;
// path -1: the best.
void gemv(int format, float* y, int64_t y_stride, const float* x, int64_t x_stride,
          const uint8_t* packed, const float* scales, int m, int n, int k, int threads, int path,
          int activation_bits);

}  // namespace pagedkern_cpu

// x86 kernels need GCC/clang target attributes (MSVC builds the portable path alone)
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QUANT_GEMV_X86 1
#endif
// AVX-VNNI's 256-bit vpdpbusd needs GCC 11 / clang 12 (and their target names)
#if QUANT_GEMV_X86 && ((defined(__clang__) && __clang_major__ >= 12) || \
                       (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define QUANT_GEMV_AVXVNNI 1
#endif
// Arm dotprod (SDOT) per function: GCC 9, or clang 16 (older clang's arm_neon.h declares the
// dot intrinsics only when the whole file is built for dotprod)
#if defined(__aarch64__) &&                                                            \
    ((defined(__clang__) && (__clang_major__ >= 16 || defined(__ARM_FEATURE_DOTPROD))) || \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 9))
#define QUANT_GEMV_NEON 1
#endif
