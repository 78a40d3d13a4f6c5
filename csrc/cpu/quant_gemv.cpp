// pagedkern._cpu: quantized GEMV/GEMM on the CPU, y[M, N] = x[M, K] @ W[N, K].T, fp32 in and out,
// for the weight formats of reference/quantized_weight.py: int4 (w = d * q + m, q in 0..15, d
// and m fp16 per group of 32 or 128 along K) and int8 per output channel (w = s * q, q in
// -127..127, s fp32).
//
// Design (llama.cpp's technique for Q4_1 x Q8_1 and Q8_0 x Q8_0, written for these formats):
// - Weights are repacked once at load into tiles of 16 rows, block by block of 32 K: a 32-bit
//   lane holds 4 consecutive weights of one row, so one 64-byte load feeds 16 rows at once.
//   int4: 4 loads of 64 bytes a block, low nibbles k-quad j (k = 4j..4j+3), high nibbles k-quad
//   j + 4 (k = 16 + 4j..), then the block's 16 d and 16 m (fp16; G = 128 repeats a group's pair
//   over its four blocks). int8: 8 loads of 64 bytes a block, k-quad j in load j.
// - Activations are quantized on the fly, per row and per block of 32: dx = max|x| / 127,
//   qx = round-to-nearest-even(x / dx) in -127..127, sx = dx * sum(qx). Each row's
//   quantization uses that row alone.
// - A block's integer dot products of 16 rows at once: AVX-512 VNNI vpdpbusd (u8 x s8 -> s32),
//   AVX2 vpmaddubsw + vpmaddwd (pairs fit in s16: 2 x 15 x 127; int8 weights take the sign
//   trick |x| x sign(x) w: 2 x 127 x 127), or plain C++. Integer sums are exact, so every path
//   gives the same integers.
// - Per row and block, in K order, in fp32 with explicit fused multiply-adds:
//     int4: acc = fma(d * dx, isum, acc); acc = fma(m, sx, acc)      y = acc
//     int8: acc = fma(dx, isum, acc)                                 y = acc * s
//   The same operations in the same order on every path (the portable one compiled without FP
//   contraction, std::fma), so every path returns the same bits, and a row's result depends
//   only on its own x row and the weights: never on M, the other rows, the thread count or the
//   split of N across threads.
// - Run-time ISA dispatch (__builtin_cpu_supports): the AVX-512 and AVX2 code is compiled per
//   function with target attributes, so the module loads and runs on any x86-64 (and builds
//   the portable path alone elsewhere); an unsupported path asked for explicitly is an error,
//   never SIGILL.
// - Threads: a persistent pool; the N tiles are split into contiguous ranges, the caller
//   thread takes the first.
//
// Pointers are passed as integers (as the CUDA extension takes them); the Python side
// (ops/cpu/quant_gemv.py) validates shapes, dtypes and contiguity.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define QUANT_GEMV_X86 1
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 16;   // weight rows a tile
constexpr int kBlock = 32;  // K a block
constexpr int kInt4TileBlockBytes = kRows * kBlock / 2 + kRows * 2 * 2;  // nibbles, d, m
constexpr int kInt8TileBlockBytes = kRows * kBlock;
constexpr int kRowChunk = 4;  // activation rows computed together over one weight tile

enum Path { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2 };

bool path_supported(int path) {
  if (path == kPortable) return true;
#if QUANT_GEMV_X86
  __builtin_cpu_init();
  if (path == kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                            __builtin_cpu_supports("f16c");
  if (path == kAvx512Vnni)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
  return false;
}

int best_path() {
  if (path_supported(kAvx512Vnni)) return kAvx512Vnni;
  if (path_supported(kAvx2)) return kAvx2;
  return kPortable;
}

// IEEE half -> float, exact (the portable path's vcvtph2ps).
float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while (!(man & 0x400));
    bits = sign | uint32_t(112 - e) << 23 | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- activation quantization: one routine for every path -----------------------------------

struct QuantizedRows {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> dx;   // [M, K / 32]
  std::vector<float> sx;   // [M, K / 32]
};

void quantize_rows(const float* x, int64_t x_stride, int m, int k, QuantizedRows& out) {
  const int blocks = k / kBlock;
  out.q.resize(size_t(m) * k);
  out.dx.resize(size_t(m) * blocks);
  out.sx.resize(size_t(m) * blocks);
  for (int r = 0; r < m; ++r) {
    const float* xr = x + r * x_stride;
    for (int b = 0; b < blocks; ++b) {
      const float* xb = xr + b * kBlock;
      float amax = 0.f;
      bool finite = true;
      for (int i = 0; i < kBlock; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        finite = finite && std::isfinite(xb[i]);
      }
      // a NaN or infinite input makes its block's scale NaN: the outputs it reaches are NaN
      const float d = finite ? amax / 127.f : std::nanf("");
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      int8_t* qb = &out.q[size_t(r) * k + b * kBlock];
      for (int i = 0; i < kBlock; ++i) {
        float v = std::nearbyint(xb[i] * inv);
        v = std::isnan(v) ? 0.f : std::min(127.f, std::max(-127.f, v));
        qb[i] = int8_t(v);
        sum += qb[i];
      }
      out.dx[size_t(r) * blocks + b] = d;
      out.sx[size_t(r) * blocks + b] = d * float(sum);
    }
  }
}

// ---- tile kernels: rows [r0, r0 + rc) of x against one tile of 16 weight rows ---------------

struct Args {
  float* y;
  int64_t y_stride;
  const QuantizedRows* xq;
  const uint8_t* packed;
  const float* scales;  // int8: per output channel
  int m, n, k;
};

void int4_tile_portable(const Args& a, int tile, int r0, int rc) {
  const int blocks = a.k / kBlock;
  const uint8_t* base = a.packed + size_t(tile) * blocks * kInt4TileBlockBytes;
  for (int r = r0; r < r0 + rc; ++r) {
    float acc[kRows] = {};
    const int8_t* xr = &a.xq->q[size_t(r) * a.k];
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* t = base + size_t(b) * kInt4TileBlockBytes;
      const uint16_t* d16 = reinterpret_cast<const uint16_t*>(t + kRows * kBlock / 2);
      const int8_t* xb = xr + b * kBlock;
      const float dx = a.xq->dx[size_t(r) * blocks + b], sx = a.xq->sx[size_t(r) * blocks + b];
      for (int row = 0; row < kRows; ++row) {
        int isum = 0;
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = t[64 * j + 4 * row + i];
            isum += int(byte & 0x0F) * xb[4 * j + i] + int(byte >> 4) * xb[16 + 4 * j + i];
          }
        const float d = half_to_float(d16[row]), mn = half_to_float(d16[kRows + row]);
        const float ddx = d * dx;
        acc[row] = std::fma(ddx, float(isum), acc[row]);
        acc[row] = std::fma(mn, sx, acc[row]);
      }
    }
    for (int row = 0; row < kRows && tile * kRows + row < a.n; ++row)
      a.y[r * a.y_stride + tile * kRows + row] = acc[row];
  }
}

void int8_tile_portable(const Args& a, int tile, int r0, int rc) {
  const int blocks = a.k / kBlock;
  const int8_t* base =
      reinterpret_cast<const int8_t*>(a.packed) + size_t(tile) * blocks * kInt8TileBlockBytes;
  for (int r = r0; r < r0 + rc; ++r) {
    float acc[kRows] = {};
    const int8_t* xr = &a.xq->q[size_t(r) * a.k];
    for (int b = 0; b < blocks; ++b) {
      const int8_t* t = base + size_t(b) * kInt8TileBlockBytes;
      const int8_t* xb = xr + b * kBlock;
      const float dx = a.xq->dx[size_t(r) * blocks + b];
      for (int row = 0; row < kRows; ++row) {
        int isum = 0;
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 4; ++i) isum += int(t[64 * j + 4 * row + i]) * xb[4 * j + i];
        acc[row] = std::fma(dx, float(isum), acc[row]);
      }
    }
    for (int row = 0; row < kRows && tile * kRows + row < a.n; ++row)
      a.y[r * a.y_stride + tile * kRows + row] = acc[row] * a.scales[tile * kRows + row];
  }
}

#if QUANT_GEMV_X86
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

AVX2_TARGET inline __m256i avx2_dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

AVX2_TARGET void int4_tile_avx2(const Args& a, int tile, int r0, int rc) {
  const int blocks = a.k / kBlock;
  const uint8_t* base = a.packed + size_t(tile) * blocks * kInt4TileBlockBytes;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int r = r0; r < r0 + rc; ++r) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const int8_t* xr = &a.xq->q[size_t(r) * a.k];
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* t = base + size_t(b) * kInt4TileBlockBytes;
      const int8_t* xb = xr + b * kBlock;
      const __m256 dx = _mm256_set1_ps(a.xq->dx[size_t(r) * blocks + b]);
      const __m256 sx = _mm256_set1_ps(a.xq->sx[size_t(r) * blocks + b]);
      for (int h = 0; h < 2; ++h) {
        __m256i isum = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          int32_t qa, qb;
          std::memcpy(&qa, xb + 4 * j, 4);
          std::memcpy(&qb, xb + 16 + 4 * j, 4);
          const __m256i w =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 * j + 32 * h));
          isum = _mm256_add_epi32(
              isum, avx2_dot_u8s8(_mm256_and_si256(w, low), _mm256_set1_epi32(qa)));
          isum = _mm256_add_epi32(
              isum, avx2_dot_u8s8(_mm256_and_si256(_mm256_srli_epi16(w, 4), low),
                                  _mm256_set1_epi32(qb)));
        }
        const uint8_t* dm = t + kRows * kBlock / 2;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + 16 * h)));
        const __m256 mn =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dm + 32 + 16 * h)));
        acc[h] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum), acc[h]);
        acc[h] = _mm256_fmadd_ps(mn, sx, acc[h]);
      }
    }
    alignas(32) float out[kRows];
    _mm256_store_ps(out, acc[0]);
    _mm256_store_ps(out + 8, acc[1]);
    for (int row = 0; row < kRows && tile * kRows + row < a.n; ++row)
      a.y[r * a.y_stride + tile * kRows + row] = out[row];
  }
}

AVX2_TARGET void int8_tile_avx2(const Args& a, int tile, int r0, int rc) {
  const int blocks = a.k / kBlock;
  const uint8_t* base = a.packed + size_t(tile) * blocks * kInt8TileBlockBytes;
  for (int r = r0; r < r0 + rc; ++r) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const int8_t* xr = &a.xq->q[size_t(r) * a.k];
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* t = base + size_t(b) * kInt8TileBlockBytes;
      const int8_t* xb = xr + b * kBlock;
      const __m256 dx = _mm256_set1_ps(a.xq->dx[size_t(r) * blocks + b]);
      for (int h = 0; h < 2; ++h) {
        __m256i isum = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          int32_t q;
          std::memcpy(&q, xb + 4 * j, 4);
          const __m256i xv = _mm256_set1_epi32(q);
          const __m256i w =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 * j + 32 * h));
          isum = _mm256_add_epi32(
              isum, avx2_dot_u8s8(_mm256_abs_epi8(xv), _mm256_sign_epi8(w, xv)));
        }
        acc[h] = _mm256_fmadd_ps(dx, _mm256_cvtepi32_ps(isum), acc[h]);
      }
    }
    alignas(32) float out[kRows];
    _mm256_store_ps(out, acc[0]);
    _mm256_store_ps(out + 8, acc[1]);
    for (int row = 0; row < kRows && tile * kRows + row < a.n; ++row)
      a.y[r * a.y_stride + tile * kRows + row] = out[row] * a.scales[tile * kRows + row];
  }
}

// AVX-512 VNNI: kRowChunk activation rows share each weight load.
AVX512_TARGET void int4_tile_avx512(const Args& a, int tile, int r0, int rc) {
  const int blocks = a.k / kBlock;
  const uint8_t* base = a.packed + size_t(tile) * blocks * kInt4TileBlockBytes;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (; rc > 0; r0 += kRowChunk, rc -= kRowChunk) {
    const int rows = std::min(rc, kRowChunk);
    __m512 acc[kRowChunk];
    for (int i = 0; i < kRowChunk; ++i) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* t = base + size_t(b) * kInt4TileBlockBytes;
      __m512i wl[4], wh[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i w = _mm512_loadu_si512(t + 64 * j);
        wl[j] = _mm512_and_si512(w, low);
        wh[j] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      }
      const uint8_t* dm = t + kRows * kBlock / 2;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm)));
      const __m512 mn =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + 32)));
      for (int i = 0; i < rows; ++i) {
        const int r = r0 + i;
        const int8_t* xb = &a.xq->q[size_t(r) * a.k + b * kBlock];
        __m512i isum = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          int32_t qa, qb;
          std::memcpy(&qa, xb + 4 * j, 4);
          std::memcpy(&qb, xb + 16 + 4 * j, 4);
          isum = _mm512_dpbusd_epi32(isum, wl[j], _mm512_set1_epi32(qa));
          isum = _mm512_dpbusd_epi32(isum, wh[j], _mm512_set1_epi32(qb));
        }
        const __m512 dx = _mm512_set1_ps(a.xq->dx[size_t(r) * blocks + b]);
        const __m512 sx = _mm512_set1_ps(a.xq->sx[size_t(r) * blocks + b]);
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum), acc[i]);
        acc[i] = _mm512_fmadd_ps(mn, sx, acc[i]);
      }
    }
    const int live = std::min(kRows, a.n - tile * kRows);
    const __mmask16 mask = __mmask16((1u << live) - 1);
    for (int i = 0; i < rows; ++i)
      _mm512_mask_storeu_ps(a.y + (r0 + i) * a.y_stride + tile * kRows, mask, acc[i]);
  }
}

AVX512_TARGET void int8_tile_avx512(const Args& a, int tile, int r0, int rc) {
  const int blocks = a.k / kBlock;
  const uint8_t* base = a.packed + size_t(tile) * blocks * kInt8TileBlockBytes;
  const __m512i zero = _mm512_setzero_si512();
  const int live = std::min(kRows, a.n - tile * kRows);
  const __mmask16 mask = __mmask16((1u << live) - 1);
  const __m512 s = _mm512_maskz_loadu_ps(mask, a.scales + tile * kRows);
  for (; rc > 0; r0 += kRowChunk, rc -= kRowChunk) {
    const int rows = std::min(rc, kRowChunk);
    __m512 acc[kRowChunk];
    for (int i = 0; i < kRowChunk; ++i) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* t = base + size_t(b) * kInt8TileBlockBytes;
      __m512i isum[kRowChunk];
      for (int i = 0; i < kRowChunk; ++i) isum[i] = zero;
      for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_loadu_si512(t + 64 * j);
        for (int i = 0; i < rows; ++i) {
          int32_t q;
          std::memcpy(&q, &a.xq->q[size_t(r0 + i) * a.k + b * kBlock + 4 * j], 4);
          const __m512i xv = _mm512_set1_epi32(q);
          // |x| (u8) times w with x's sign: vpdpbusd wants one unsigned operand
          const __m512i sw = _mm512_mask_sub_epi8(w, _mm512_movepi8_mask(xv), zero, w);
          isum[i] = _mm512_dpbusd_epi32(isum[i], _mm512_abs_epi8(xv), sw);
        }
      }
      for (int i = 0; i < rows; ++i) {
        const __m512 dx = _mm512_set1_ps(a.xq->dx[size_t(r0 + i) * blocks + b]);
        acc[i] = _mm512_fmadd_ps(dx, _mm512_cvtepi32_ps(isum[i]), acc[i]);
      }
    }
    for (int i = 0; i < rows; ++i)
      _mm512_mask_storeu_ps(a.y + (r0 + i) * a.y_stride + tile * kRows, mask,
                            _mm512_mul_ps(acc[i], s));
  }
}
#endif  // QUANT_GEMV_X86

using TileFn = void (*)(const Args&, int, int, int);

TileFn tile_fn(bool int4, int path) {
#if QUANT_GEMV_X86
  if (path == kAvx512Vnni) return int4 ? int4_tile_avx512 : int8_tile_avx512;
  if (path == kAvx2) return int4 ? int4_tile_avx2 : int8_tile_avx2;
#endif
  return int4 ? int4_tile_portable : int8_tile_portable;
}

// ---- a persistent thread pool: the caller runs part 0, workers parts 1.. --------------------

class Pool {
 public:
  void run(int parts, const std::function<void(int)>& fn) {
    if (parts <= 1) {
      fn(0);
      return;
    }
    std::lock_guard<std::mutex> call(call_mu_);  // one parallel call at a time
    while (int(workers_.size()) < parts - 1) {
      const int id = int(workers_.size()) + 1;
      const uint64_t now = generation_.load();
      workers_.emplace_back([this, id, now] { work(id, now); });
      workers_.back().detach();  // the pool lives as long as the process
    }
    fn_ = &fn;
    parts_ = parts;
    pending_.store(parts - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(0);
    while (pending_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  }

 private:
  // Spins a little before sleeping: a decode step calls GEMVs back to back, tens of
  // microseconds apart, and a condition-variable wake-up costs about as much as a GEMV.
  void work(int id, uint64_t seen) {
    for (;;) {
      for (int spin = 0; spin < 20000 && generation_.load(std::memory_order_acquire) == seen;
           ++spin) {
#if QUANT_GEMV_X86
        _mm_pause();
#endif
      }
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load() != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (id < parts_) {
        (*fn_)(id);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* fn_ = nullptr;
  int parts_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: workers may outlive interpreter teardown
  return *p;
}

int resolve_path(int path) {
  if (path < 0) return best_path();
  if (path > kAvx512Vnni) throw std::invalid_argument("path must be -1, 0, 1 or 2");
  if (!path_supported(path))
    throw std::runtime_error("this CPU does not support the requested quant_gemv path " +
                             std::to_string(path));
  return path;
}

void gemv(bool int4, uintptr_t y, int64_t y_stride, uintptr_t x, int64_t x_stride,
          uintptr_t packed, uintptr_t scales, int m, int n, int k, int threads, int path) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0 || k % kBlock) throw std::invalid_argument("k must be a positive multiple of 32");
  const TileFn fn = tile_fn(int4, resolve_path(path));
  QuantizedRows xq;
  quantize_rows(reinterpret_cast<const float*>(x), x_stride, m, k, xq);
  Args args{reinterpret_cast<float*>(y), y_stride, &xq,
            reinterpret_cast<const uint8_t*>(packed), reinterpret_cast<const float*>(scales),
            m, n, k};
  const int tiles = (n + kRows - 1) / kRows;
  const int parts = std::max(1, std::min(threads, tiles));
  pool().run(parts, [&](int part) {
    const int t0 = int(int64_t(tiles) * part / parts), t1 = int(int64_t(tiles) * (part + 1) / parts);
    for (int t = t0; t < t1; ++t) fn(args, t, 0, m);
  });
}

// ---- packing ------------------------------------------------------------------------------

int64_t int4_packed_bytes(int n, int k) {
  return int64_t((n + kRows - 1) / kRows) * (k / kBlock) * kInt4TileBlockBytes;
}
int64_t int8_packed_bytes(int n, int k) {
  return int64_t((n + kRows - 1) / kRows) * (k / kBlock) * kInt8TileBlockBytes;
}

// qweight [N, K/2] uint8 (weight 2i in the low nibble of byte i), scales/mins [N, K/G] fp16.
void pack_int4(uintptr_t out, uintptr_t qweight, uintptr_t scales, uintptr_t mins, int n, int k,
               int group) {
  if (k % kBlock || group % kBlock || k % group)
    throw std::invalid_argument("k and the group size must be multiples of 32, k of the group");
  const uint8_t* q = reinterpret_cast<const uint8_t*>(qweight);
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales);
  const uint16_t* mn = reinterpret_cast<const uint16_t*>(mins);
  uint8_t* o = reinterpret_cast<uint8_t*>(out);
  const int blocks = k / kBlock, tiles = (n + kRows - 1) / kRows, groups = k / group;
  auto nibble = [&](int row, int col) -> uint8_t {
    const uint8_t byte = q[size_t(row) * (k / 2) + col / 2];
    return col % 2 ? byte >> 4 : byte & 0x0F;
  };
  for (int t = 0; t < tiles; ++t)
    for (int b = 0; b < blocks; ++b) {
      uint8_t* dst = o + (size_t(t) * blocks + b) * kInt4TileBlockBytes;
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

// qweight [N, K] int8.
void pack_int8(uintptr_t out, uintptr_t qweight, int n, int k) {
  if (k % kBlock) throw std::invalid_argument("k must be a multiple of 32");
  const int8_t* q = reinterpret_cast<const int8_t*>(qweight);
  int8_t* o = reinterpret_cast<int8_t*>(out);
  const int blocks = k / kBlock, tiles = (n + kRows - 1) / kRows;
  for (int t = 0; t < tiles; ++t)
    for (int b = 0; b < blocks; ++b) {
      int8_t* dst = o + (size_t(t) * blocks + b) * kInt8TileBlockBytes;
      for (int r = 0; r < kRows; ++r) {
        const int row = t * kRows + r;
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 4; ++i)
            dst[64 * j + 4 * r + i] = row < n ? q[size_t(row) * k + b * kBlock + 4 * j + i] : 0;
      }
    }
}

}  // namespace

namespace py = pybind11;

PYBIND11_MODULE(_cpu, mod) {
  mod.doc() = "pagedkern's CPU kernels: quantized GEMV with run-time ISA dispatch";
  mod.attr("PORTABLE") = int(kPortable);
  mod.attr("AVX2") = int(kAvx2);
  mod.attr("AVX512_VNNI") = int(kAvx512Vnni);
  mod.def("path_supported", &path_supported, py::arg("path"));
  mod.def("best_path", &best_path);
  mod.def("int4_packed_bytes", &int4_packed_bytes, py::arg("n"), py::arg("k"));
  mod.def("int8_packed_bytes", &int8_packed_bytes, py::arg("n"), py::arg("k"));
  mod.def("pack_int4", &pack_int4, py::kw_only(), py::arg("out"), py::arg("qweight"),
          py::arg("scales"), py::arg("mins"), py::arg("n"), py::arg("k"), py::arg("group"));
  mod.def("pack_int8", &pack_int8, py::kw_only(), py::arg("out"), py::arg("qweight"), py::arg("n"),
          py::arg("k"));
  mod.def(
      "gemv_int4",
      [](uintptr_t y, int64_t y_stride, uintptr_t x, int64_t x_stride, uintptr_t packed, int m,
         int n, int k, int threads, int path) {
        py::gil_scoped_release release;
        gemv(true, y, y_stride, x, x_stride, packed, 0, m, n, k, threads, path);
      },
      py::kw_only(), py::arg("y"), py::arg("y_stride"), py::arg("x"), py::arg("x_stride"),
      py::arg("packed"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads"),
      py::arg("path"));
  mod.def(
      "gemv_int8",
      [](uintptr_t y, int64_t y_stride, uintptr_t x, int64_t x_stride, uintptr_t packed,
         uintptr_t scales, int m, int n, int k, int threads, int path) {
        py::gil_scoped_release release;
        gemv(false, y, y_stride, x, x_stride, packed, scales, m, n, k, threads, path);
      },
      py::kw_only(), py::arg("y"), py::arg("y_stride"), py::arg("x"), py::arg("x_stride"),
      py::arg("packed"), py::arg("scales"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("threads"), py::arg("path"));
}
