// The GEMV/GEMM driver: checks, the kernel path, activation quantization, and the split of
// the weight's 16-row tiles over threads. Threads are OpenMP's, which in the loaded module are
// torch's intra-op threads: torch links libgomp.so.1 and is imported first, so this module's
// libgomp.so.1 resolves to the same runtime and team (no second pool competing with torch's
// spinning workers). Each output row is computed by one thread in a fixed order, so the bits
// never depend on the thread count. Built without OpenMP (a compiler without it), one thread.

#include <algorithm>
#include <stdexcept>
#include <string>

#include "quant_gemv.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace pagedkern_cpu {
namespace {

TileFn tile_fn(bool int4, int path, int planes) {
  switch (path) {
    case kAvx512Vnni: return avx512_tile(int4, planes);
    case kAvxVnni: return avxvnni_tile(int4, planes);
    case kAvx2: return avx2_tile(int4, planes);
    default: return portable_tile(int4, planes);
  }
}

int resolve_path(int path) {
  if (path < 0) return best_path();
  if (path >= kNumPaths) throw std::invalid_argument("path must be -1 or 0.." + std::to_string(kNumPaths - 1));
  if (!path_supported(path))
    throw std::runtime_error(std::string("this CPU (or this build) does not run the ") +
                             path_name(path) + " quant_gemv path");
  return path;
}

// Runs body(part, parts) on up to `threads` threads (parts <= threads, the caller's thread
// being part 0).
template <typename Body>
void parallel(int threads, const Body& body) {
#ifdef _OPENMP
  if (threads > 1 && !omp_in_parallel()) {
#pragma omp parallel
    {
      const int parts = std::min(omp_get_num_threads(), threads), part = omp_get_thread_num();
      if (part < parts) body(part, parts);
    }
    return;
  }
#endif
  body(0, 1);
}

}  // namespace

void gemv(bool int4, float* y, int64_t y_stride, const float* x, int64_t x_stride,
          const uint8_t* packed, const float* scales, int m, int n, int k, int threads, int path,
          int activation_bits) {
  if (k <= 0 || k % kBlock) throw std::invalid_argument("k must be a positive multiple of 32");
  if (activation_bits != 8 && activation_bits != 16)
    throw std::invalid_argument("activation_bits must be 8 or 16");
  const int resolved = resolve_path(path);
  const TileFn fn = tile_fn(int4, resolved, activation_bits / 8);
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
  parallel(std::min(threads, tiles), [&](int part, int parts) {
    const int t0 = int(int64_t(tiles) * part / parts), t1 = int(int64_t(tiles) * (part + 1) / parts);
    for (int t = t0; t < t1; ++t) fn(args, t, 0, m);
  });
}

}  // namespace pagedkern_cpu
