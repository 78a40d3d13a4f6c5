// The GEMV/GEMM driver: checks, the kernel path, activation quantization, and the split of
// the weight's 16-row tiles over threads (parallel.h: torch's OpenMP team). Each output row is
// computed by one thread in a fixed order, so the bits never depend on the thread count.

#include <algorithm>
#include <stdexcept>
#include <string>

#include "parallel.h"
#include "quant_gemv.h"

namespace pagedkern_cpu {
namespace {

TileFn tile_fn(int format, int path, int planes) {
  switch (path) {
    case kAvx512Amx: return amx_tile(format, planes);
    case kAvx512Vnni: return avx512_tile(format, planes);
    case kAvxVnni: return avxvnni_tile(format, planes);
    case kAvx2: return avx2_tile(format, planes);
    case kNeonDotprod: return neon_tile(format, planes);
    default: return portable_tile(format, planes);
  }
}

TilesFn tiles_fn(int format, int path, int planes) {
  switch (path) {
    case kAvx512Amx:
    case kAvx512Vnni: return avx512_tiles(format, planes);
    case kAvxVnni: return avxvnni_tiles(format, planes);
    case kAvx2: return avx2_tiles(format, planes);
    default: return nullptr;
  }
}

// The most rows the streamed kernels take: beyond, each weight tile is read once for many
// rows, and one tile at a time keeps it in L1 for them
constexpr int kStreamedRows = kRowChunk;

// The fewest rows the AMX tiles take: each call unpacks the weight tiles into AMX's layout
// once for all its groups of 16 rows. For one group (16-31 rows) the int4 formats' and int8's
// VNNI kernels (512 bits wide) measured as fast or faster (Xeon, Q4_0 8192 x 2048, 2 threads:
// 1.13x at 16 rows, 1.09x at 24; 0.88x at 32; int8 0.95-1.13x at 16 and 24); the other
// formats' VNNI kernels run 256 bits wide, and their AMX tiles measured 1.4-3.4x them at 16
// rows (int6_k 1.4-1.5x, int8_g16 2.2-2.3x, int5_g32 2.6x, int8_g32 2.4-3.4x).
int amx_min_rows(int format) {
  return format == kInt4 || format == kInt4Sym || format == kInt4Zp || format == kInt4K ||
                 format == kInt8
             ? 32
             : 16;
}

}  // namespace

void gemv(int format, float* y, int64_t y_stride, const float* x, int64_t x_stride,
          const uint8_t* packed, const float* scales, int m, int n, int k, int threads, int path,
          int activation_bits) {
  if (k <= 0 || k % kBlock) throw std::invalid_argument("k must be a positive multiple of 32");
  if (format < 0 || format >= kNumFormats)
    throw std::invalid_argument(kFormatsMessage);
  check_format_k(format, k);
  if (activation_bits != 8 && activation_bits != 16)
    throw std::invalid_argument("activation_bits must be 8 or 16");
  const int resolved = resolve_path(path, "quant_gemv");
  const TileFn fn = tile_fn(format, resolved, activation_bits / 8);
  if (m <= 0 || n <= 0) return;
  // reused: a decode step makes hundreds of calls. The lambdas below use `xq`, the caller's
  // (a thread_local named inside them would be each worker's own).
  thread_local QuantizedRows caller_rows;
  QuantizedRows& xq = caller_rows;
  xq.resize(m, k, activation_bits / 8);
  const Args args{y, y_stride, &xq, packed, scales, m, n, k};
  const int tiles = (n + kRows - 1) / kRows;
  parallel(std::min(threads, m), [&](int part, int parts) {
    quantize_rows(x, x_stride, int(int64_t(m) * part / parts),
                  int(int64_t(m) * (part + 1) / parts), resolved != kPortable, xq);
  });
  // the AMX kernels read 16 rows' block plane as one contiguous tile
  const bool amx = resolved == kAvx512Amx && m >= amx_min_rows(format);
  const int groups = amx ? m / 16 : 0;
  xq.grouped_rows = 16 * groups;
  if (groups > 0) {
    xq.groups.resize(size_t(xq.grouped_rows) * xq.blocks * xq.planes * kBlock);
    parallel(std::min(threads, groups), [&](int part, int parts) {
      group_rows(int(int64_t(groups) * part / parts), int(int64_t(groups) * (part + 1) / parts),
                 xq);
    });
  }
  // few rows: the kernels that read several tiles' weights at once, where the path has them
  const TilesFn streamed =
      m <= kStreamedRows ? tiles_fn(format, resolved, activation_bits / 8) : nullptr;
  parallel(std::min(threads, tiles), [&](int part, int parts) {
    const int t0 = int(int64_t(tiles) * part / parts), t1 = int(int64_t(tiles) * (part + 1) / parts);
    if (streamed != nullptr) return streamed(args, t0, t1, 0, m);
    for (int t = t0; t < t1; ++t) fn(args, t, 0, m);
  });
}

}  // namespace pagedkern_cpu
