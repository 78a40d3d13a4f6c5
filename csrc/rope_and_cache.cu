/*
 * rope_and_cache: rotary embedding of q and k (rotate-half, in place) fused with the paged KV-cache
 * write of k and v (the seed's "RoPE + KV cache write").
 *
 *   (cos, sin) = cos_sin[positions[t]] split at D/2;  x = [x1, x2] split at D/2
 *   x' = [x1 cos - x2 sin, x2 cos + x1 sin]   (fp32 without FMA contraction, as the reference and
 *   torch compute it, rounded once to T: bit-identical results; the cache gets the rotated k)
 *   slot = slot_mapping[t] >= 0: k_cache/v_cache[slot / bs, :, slot % bs, :] = k'[t], v[t]
 * Frequencies (plain, Llama 3 scaled, ...) live in the cos_sin table, not in the kernel.
 *
 * Versions:
 *  v1 rope_and_cache_kernel<T, kVec>: grid (tokens, ceil(items / 128)), one item per thread.
 *     Items of a token: (Hq + Hkv) x (D/2 / kVec) rotations, each the chunk pair [c, c + kVec) and
 *     [D/2 + c, ...) of one q or k head with its cos/sin chunks (float4 loads), then Hkv x
 *     (D / kVec) copies of v chunks, present only when the slot is >= 0. Every element of q, k, v
 *     is read once and written once (plus once more into the cache for k and v): one pass.
 *     kVec = 16 / sizeof(T) (16-byte accesses) when D/2 is a multiple of it and every pointer and
 *     token stride is 16-byte aligned; kVec = 1 otherwise (any even D, any alignment).
 *     q, k, v may be views into one fused QKV output: token strides are free, heads packed.
 *  v2 (default; v1 selectable, PAGEDKERN_KERNELS=rope_and_cache:v1): a rotation item is one chunk
 *     pair of kHeads = 4 consecutive q/k heads: the cos/sin chunks (64 B per 32 B of data in v1)
 *     are loaded once for 4 heads and the 8 data loads are all issued before the math.
 *
 *  fp8 cache (kv_fp8, kFp8): same items; the cache receives the fp32 values (the
 *     rotation before its rounding to T, v as read) times fp32(1 / scale), converted once to
 *     E4M3 with saturation (fp8.cuh: one F2FP per pair on sm_89+, software on sm_80), so the
 *     model needs no k / k_scale, v / v_scale passes. A chunk of kVec elements is kVec bytes in
 *     the cache (8-byte stores for 16-bit T); q, k, v are still read and written with 16 bytes.
 *
 *  QK-norm (q_norm / k_norm set): rope_norm_and_cache_kernel<T, kFp8>, one warp per q or k
 *     head (4 warps per CTA, grid (tokens, ceil((Hq + Hkv) / 4)); the CTAs of y = 0 also copy
 *     v). A lane holds pairs (i, D/2 + i), i = lane + 32 j (D <= 512: 8 pairs): sum of squares,
 *     3+2 xor shuffles, the normalised head rounded to T as rms_norm rounds it, then the same
 *     rotation and cache write as above. Scalar accesses (a warp reads 64 contiguous bytes of a
 *     16-bit head per instruction); the norm's extra pass over q and k is what it saves: the
 *     unfused path reads and writes q and k once more, plus a copy out of the fused QKV view.
 * Traffic: T * (2 * (Hq + Hkv) + 3 * Hkv) * D * sizeof(T) bytes (q, k read and written, v read,
 * k and v written to the cache; fp8: the cache writes are 1 byte per element) + the cos/sin
 * rows (L2). Memory bound; target >= 80% of copy bandwidth for prefill-sized T.
 */
#include "device.cuh"
#include "fp8.cuh"
#include "index_check.cuh"
#include "rope_and_cache.h"

#include <cmath>
#include <type_traits>

namespace pagedkern {
namespace {

constexpr int kThreads = 128;

// kVec elements of T moved as one access (16 bytes) or element by element (kVec == 1).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Chunk {
  T v[kVec];
  __device__ __forceinline__ static Chunk load(const T* p) {
    Chunk c;
    if constexpr (sizeof(T) * kVec == 16) {
      *reinterpret_cast<uint4*>(c.v) = *reinterpret_cast<const uint4*>(p);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) c.v[e] = p[e];
    }
    return c;
  }
  __device__ __forceinline__ void store(T* p) const {
    if constexpr (sizeof(T) * kVec == 16) {
      *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) p[e] = v[e];
    }
  }
};

template <int kVec>
__device__ __forceinline__ void load_floats(const float* p, float (&out)[kVec]) {
  if constexpr (kVec % 4 == 0) {
#pragma unroll
    for (int e = 0; e < kVec; e += 4) {
      const float4 f = __ldg(reinterpret_cast<const float4*>(p + e));
      out[e] = f.x;
      out[e + 1] = f.y;
      out[e + 2] = f.z;
      out[e + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) out[e] = __ldg(p + e);
  }
}

// kVec fp32 values times `inv` into kVec E4M3 bytes at dst (8-byte store for kVec = 8).
template <int kVec>
__device__ __forceinline__ void store_e4m3(uint8_t* dst, const float (&x)[kVec], float inv) {
  if constexpr (kVec % 2 == 0) {
    uint16_t pairs[kVec / 2];
#pragma unroll
    for (int e = 0; e < kVec; e += 2)
      pairs[e / 2] = e4m3x2_from_floats(__fmul_rn(x[e], inv), __fmul_rn(x[e + 1], inv));
    if constexpr (kVec == 8) {
      *reinterpret_cast<uint2*>(dst) =
          make_uint2(pairs[0] | uint32_t(pairs[1]) << 16, pairs[2] | uint32_t(pairs[3]) << 16);
    } else {
#pragma unroll
      for (int e = 0; e < kVec / 2; ++e) *reinterpret_cast<uint16_t*>(dst + 2 * e) = pairs[e];
    }
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) dst[e] = e4m3_from_float(__fmul_rn(x[e], inv));
  }
}

template <typename T, int kVec, int kHeads, bool kFp8>
__global__ void __launch_bounds__(kThreads) rope_and_cache_kernel(const RopeAndCacheParams p) {
  using C = Chunk<T, kVec>;
  const int64_t token = blockIdx.x;
  const int D = p.head_dim;
  const int half = D / 2;
  const int rot_chunks = half / kVec;  // per head
  const int copy_chunks = D / kVec;
  const int heads = p.num_heads + p.num_kv_heads;
  const int n_rot = (heads + kHeads - 1) / kHeads * rot_chunks;
  const int slot = p.slot_mapping[token];
  if (p.check_indices) {  // debug mode: slot -1 (no write) or a slot of the cache; a table row
    check_index(true, int64_t(slot) + 1, p.num_blocks * p.block_size + 1);
    check_index(true, p.positions[token], p.max_positions);
  }
  const int item = blockIdx.y * kThreads + threadIdx.x;
  if (item >= n_rot + (slot >= 0 ? p.num_kv_heads * copy_chunks : 0)) return;

  const int64_t page = slot / p.block_size;  // cache row of this token's heads (slot >= 0)
  const int64_t cache_row = page * p.num_kv_heads * p.block_size + slot % p.block_size;
  if (item < n_rot) {
    const int head0 = item / rot_chunks * kHeads;
    const int c = item % rot_chunks * kVec;
    auto head_ptr = [&](int head) {
      return head >= p.num_heads
                 ? static_cast<T*>(p.k) + token * p.k_stride + (head - p.num_heads) * D
                 : static_cast<T*>(p.q) + token * p.q_stride + head * D;
    };
    // Every load first (2 * kHeads chunks in flight), one cos/sin chunk pair for all heads.
    C x1[kHeads], x2[kHeads];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      if (head0 + h < heads) {
        x1[h] = C::load(head_ptr(head0 + h) + c);
        x2[h] = C::load(head_ptr(head0 + h) + half + c);
      }
    }
    const float* cs = p.cos_sin + int64_t(p.positions[token]) * D;
    float cosv[kVec], sinv[kVec];
    load_floats<kVec>(cs + c, cosv);
    load_floats<kVec>(cs + half + c, sinv);
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      const int head = head0 + h;
      if (head >= heads) break;
      C y1, y2;
      float f1[kVec], f2[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float a = to_float(x1[h].v[e]), b = to_float(x2[h].v[e]);
        // Rounded products, no FMA contraction: bit-identical to the reference's fp32 math.
        f1[e] = __fsub_rn(__fmul_rn(a, cosv[e]), __fmul_rn(b, sinv[e]));
        f2[e] = __fadd_rn(__fmul_rn(b, cosv[e]), __fmul_rn(a, sinv[e]));
        y1.v[e] = from_float<T>(f1[e]);
        y2.v[e] = from_float<T>(f2[e]);
      }
      T* x = head_ptr(head);
      y1.store(x + c);
      y2.store(x + half + c);
      if (head >= p.num_heads && slot >= 0) {
        const int64_t row = (cache_row + int64_t(head - p.num_heads) * p.block_size) * D;
        if constexpr (kFp8) {
          uint8_t* dst = static_cast<uint8_t*>(p.k_cache) + row;
          store_e4m3<kVec>(dst + c, f1, p.k_scale_inv);
          store_e4m3<kVec>(dst + half + c, f2, p.k_scale_inv);
        } else {
          T* dst = static_cast<T*>(p.k_cache) + row;
          y1.store(dst + c);
          y2.store(dst + half + c);
        }
      }
    }
  } else {
    const int j = item - n_rot;
    const int head = j / copy_chunks;
    const int c = j % copy_chunks * kVec;
    const C v = C::load(static_cast<const T*>(p.v) + token * p.v_stride + head * D + c);
    const int64_t offset = (cache_row + int64_t(head) * p.block_size) * D + c;
    if constexpr (kFp8) {
      float f[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) f[e] = to_float(v.v[e]);
      store_e4m3<kVec>(static_cast<uint8_t*>(p.v_cache) + offset, f, p.v_scale_inv);
    } else {
      v.store(static_cast<T*>(p.v_cache) + offset);
    }
  }
}

constexpr int kNormWarps = 4;
constexpr int kNormMaxPairs = 8;  // D <= 512

// rotate-half of (a, b) by (cos, sin): rounded products, no FMA contraction (the reference's).
__device__ __forceinline__ void rotate_pair(float a, float b, float c, float s, float& y1,
                                            float& y2) {
  y1 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  y2 = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

template <typename T, bool kFp8>
__global__ void __launch_bounds__(kNormWarps * 32)
    rope_norm_and_cache_kernel(const RopeAndCacheParams p) {
  const int64_t token = blockIdx.x;
  const int D = p.head_dim;
  const int half = D / 2;
  const int lane = threadIdx.x % 32;
  const int head = blockIdx.y * kNormWarps + threadIdx.x / 32;
  const int slot = p.slot_mapping[token];
  if (p.check_indices) {
    check_index(true, int64_t(slot) + 1, p.num_blocks * p.block_size + 1);
    check_index(true, p.positions[token], p.max_positions);
  }
  const int64_t page = slot / p.block_size;
  const int64_t cache_row = page * p.num_kv_heads * p.block_size + slot % p.block_size;
  if (head < p.num_heads + p.num_kv_heads) {  // warp-uniform
    const bool is_k = head >= p.num_heads;
    T* x = is_k ? static_cast<T*>(p.k) + token * p.k_stride + (head - p.num_heads) * D
                : static_cast<T*>(p.q) + token * p.q_stride + head * D;
    const T* w = static_cast<const T*>(is_k ? p.k_norm : p.q_norm);
    float a[kNormMaxPairs], b[kNormMaxPairs];
    float sumsq = 0.f;
#pragma unroll
    for (int j = 0; j < kNormMaxPairs; ++j) {
      const int i = lane + 32 * j;
      a[j] = i < half ? to_float(x[i]) : 0.f;
      b[j] = i < half ? to_float(x[half + i]) : 0.f;
      sumsq += a[j] * a[j] + b[j] * b[j];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      sumsq += __shfl_xor_sync(0xffffffffu, sumsq, offset);
    const float inv = 1.f / sqrtf(sumsq / float(D) + p.norm_eps);
    const float* cs = p.cos_sin + int64_t(p.positions[token]) * D;
#pragma unroll
    for (int j = 0; j < kNormMaxPairs; ++j) {
      const int i = lane + 32 * j;
      if (i >= half) break;
      // rms_norm's value rounded to T, as the unfused path stores it before rotating
      const float na = to_float(from_float<T>(__fmul_rn(__fmul_rn(a[j], inv), to_float(w[i]))));
      const float nb =
          to_float(from_float<T>(__fmul_rn(__fmul_rn(b[j], inv), to_float(w[half + i]))));
      float y1, y2;
      rotate_pair(na, nb, __ldg(cs + i), __ldg(cs + half + i), y1, y2);
      x[i] = from_float<T>(y1);
      x[half + i] = from_float<T>(y2);
      if (is_k && slot >= 0) {
        const int64_t row = (cache_row + int64_t(head - p.num_heads) * p.block_size) * D;
        if constexpr (kFp8) {
          uint8_t* dst = static_cast<uint8_t*>(p.k_cache) + row;
          dst[i] = e4m3_from_float(__fmul_rn(y1, p.k_scale_inv));
          dst[half + i] = e4m3_from_float(__fmul_rn(y2, p.k_scale_inv));
        } else {
          T* dst = static_cast<T*>(p.k_cache) + row;
          dst[i] = from_float<T>(y1);
          dst[half + i] = from_float<T>(y2);
        }
      }
    }
  }
  if (blockIdx.y != 0 || slot < 0) return;
  for (int e = threadIdx.x; e < p.num_kv_heads * D; e += kNormWarps * 32) {
    const int h = e / D, c = e % D;
    const T v = static_cast<const T*>(p.v)[token * p.v_stride + h * D + c];
    const int64_t offset = (cache_row + int64_t(h) * p.block_size) * D + c;
    if constexpr (kFp8) {
      static_cast<uint8_t*>(p.v_cache)[offset] = e4m3_from_float(__fmul_rn(to_float(v), p.v_scale_inv));
    } else {
      static_cast<T*>(p.v_cache)[offset] = v;
    }
  }
}

template <typename T, bool kFp8>
void launch_norm(const RopeAndCacheParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned(p.tokens), unsigned(ceil_div(p.num_heads + p.num_kv_heads, kNormWarps)));
  rope_norm_and_cache_kernel<T, kFp8><<<grid, kNormWarps * 32, 0, stream>>>(p);
  PK_CHECK_LAUNCH("rope_norm_and_cache_kernel");
}

// Query/key heads rotated per thread: v2 4 (each cos/sin chunk pair loaded once for 4 heads),
// v1 1.
template <typename T, int kHeads, bool kFp8>
void launch(const RopeAndCacheParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable = (p.head_dim / 2) % kVec == 0 && aligned16(p.q) && aligned16(p.k) &&
                            aligned16(p.v) && aligned16(p.k_cache) && aligned16(p.v_cache) &&
                            aligned16(p.cos_sin) && p.q_stride % kVec == 0 &&
                            p.k_stride % kVec == 0 && p.v_stride % kVec == 0;
  const int vec = vectorizable ? kVec : 1;
  const int items = ceil_div(p.num_heads + p.num_kv_heads, kHeads) * (p.head_dim / 2 / vec) +
                    p.num_kv_heads * (p.head_dim / vec);
  const dim3 grid(unsigned(p.tokens), unsigned(ceil_div(items, kThreads)));
  if (vectorizable) {
    rope_and_cache_kernel<T, kVec, kHeads, kFp8><<<grid, kThreads, 0, stream>>>(p);
  } else {
    rope_and_cache_kernel<T, 1, kHeads, kFp8><<<grid, kThreads, 0, stream>>>(p);
  }
  PK_CHECK_LAUNCH("rope_and_cache_kernel");
}

}  // namespace

void rope_and_cache(const RopeAndCacheParams& p, cudaStream_t stream) {
  require(p.head_dim > 0 && p.head_dim % 2 == 0, "rope_and_cache: head_dim must be even");
  require(p.num_kv_heads > 0 && p.num_heads >= 0 && p.block_size > 0,
          "rope_and_cache: bad head counts or block size");
  require(p.tokens >= 0 && p.tokens <= 0x7fffffff, "rope_and_cache: tokens out of range");
  require(!p.kv_fp8 || p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16,
          "rope_and_cache: an fp8 cache needs float16 or bfloat16 q, k, v");
  require(std::isfinite(p.k_scale_inv) && p.k_scale_inv > 0 && std::isfinite(p.v_scale_inv) &&
              p.v_scale_inv > 0,
          "rope_and_cache: k_scale and v_scale must be finite and positive");
  require((p.q_norm == nullptr) == (p.k_norm == nullptr),
          "rope_and_cache: q_norm and k_norm go together");
  require(p.q_norm == nullptr || (p.head_dim <= 2 * 32 * kNormMaxPairs && p.norm_eps >= 0.f),
          "rope_and_cache: QK-norm covers head_dim <= 512 and needs norm_eps >= 0");
  if (p.tokens == 0) return;
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto fp8) {  // std::true_type: E4M3 caches
      if (p.q_norm != nullptr) {
        launch_norm<T, decltype(fp8)::value>(p, stream);
      } else if (p.variant == 1) {
        launch<T, 1, decltype(fp8)::value>(p, stream);
      } else {
        launch<T, 4, decltype(fp8)::value>(p, stream);
      }
    };
    if constexpr (std::is_same_v<T, float>) {
      run(std::false_type{});  // fp8 caches: 16-bit T only (checked above)
    } else if (p.kv_fp8) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  });
}

}  // namespace pagedkern
