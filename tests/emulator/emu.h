// CPU emulation of the CUDA execution model, for checking kernels without a GPU.
//
// Force-included (g++ -include emu.h) before a kernel file that has been rewritten so that
// `k<<<grid, block, smem, stream>>>(args)` reads `::emu::launch(k, grid, block, smem, stream, args)`.
// Blocks run one after another; the threads of a block run as coroutines (ucontext) on one OS
// thread and switch only at barriers (__syncthreads, shuffles, __syncwarp), so atomics are trivially
// atomic and `__shared__` can be a plain static. Barriers reached by only part of a warp or block
// (divergent shuffles, a __syncthreads skipped by some threads) are reported as errors, as are
// shuffles in a warp with exited lanes. cp.async (__pipeline_memcpy_async) copies are deferred until
// the __pipeline_wait_prior that covers their group, so a kernel that reads a stage too early reads
// stale data.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>  // host build: its E4M3 conversions are cuda_fp8.hpp's software paths
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// cuda_pipeline_primitives.h does not compile for the host: pretend it was included.
#define _CUDA_PIPELINE_PRIMITIVES_H_
#define _CUDA_PIPELINE_H_

#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __forceinline__
#define __forceinline__ inline

namespace emu {

struct CopyOp {
  void* dst;
  const void* src;
  size_t size;
  size_t zfill;
};


uint3 thread_idx();
uint3 block_idx();
dim3 block_dim();
dim3 grid_dim();
void block_barrier();
void warp_barrier();
unsigned lane_id();
// Exchange of one 64-bit word per lane: returns the word lane `src` wrote in this round.
uint64_t warp_exchange(uint64_t word, int src, bool check_full = true);
uint32_t warp_ballot(bool pred);
// One round: every lane's word (lanes past the block's end read 0).
void warp_gather(uint64_t word, uint64_t (&words)[32]);
std::vector<CopyOp>& open_copies();
std::deque<std::vector<CopyOp>>& copy_groups();

void run_grid(dim3 grid, dim3 block, const std::function<void()>& body);

template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t /*smem*/, cudaStream_t /*stream*/,
            A&&... args) {
  std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
  run_grid(grid, block, [&] { std::apply(kernel, params); });
}

template <typename T>
uint64_t to_word(T v) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 64 bits");
  uint64_t w = 0;
  std::memcpy(&w, &v, sizeof(T));
  return w;
}
template <typename T>
T from_word(uint64_t w) {
  T v;
  std::memcpy(&v, &w, sizeof(T));
  return v;
}

}  // namespace emu

using std::max;
using std::min;

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx())
#define blockDim (::emu::block_dim())
#define gridDim (::emu::grid_dim())

inline void __syncthreads() { ::emu::block_barrier(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::emu::warp_barrier(); }

template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  const int lane = int(::emu::lane_id());
  int src = lane ^ lane_mask;
  if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
  return ::emu::from_word<T>(::emu::warp_exchange(::emu::to_word(v), src));
}
template <typename T>
T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
  const int lane = int(::emu::lane_id());
  const int src = (lane & ~(width - 1)) + (src_lane & (width - 1));
  return ::emu::from_word<T>(::emu::warp_exchange(::emu::to_word(v), src));
}
template <typename T>
T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
  const int lane = int(::emu::lane_id());
  const int src = (lane & (width - 1)) >= int(delta) ? lane - int(delta) : lane;
  return ::emu::from_word<T>(::emu::warp_exchange(::emu::to_word(v), src));
}
template <typename T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
  const int lane = int(::emu::lane_id());
  const int src = (lane & (width - 1)) + int(delta) < width ? lane + int(delta) : lane;
  return ::emu::from_word<T>(::emu::warp_exchange(::emu::to_word(v), src));
}
inline unsigned __ballot_sync(unsigned, int pred) { return ::emu::warp_ballot(pred != 0); }
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __all_sync(unsigned m, int pred) { return __ballot_sync(m, !pred) == 0; }

// Lanes whose value equals mine (every lane of the warp must take part, as the kernels here do).
template <typename T>
unsigned __match_any_sync(unsigned, T v) {
  uint64_t words[32];
  ::emu::warp_gather(::emu::to_word(v), words);
  const dim3 dim = ::emu::block_dim();
  const int first = int(::emu::thread_idx().x + dim.x * (::emu::thread_idx().y + dim.y * ::emu::thread_idx().z)) / 32 * 32;
  const int live = std::min(32, int(dim.x * dim.y * dim.z) - first);
  unsigned peers = 0;
  for (int i = 0; i < live; ++i) peers |= words[i] == ::emu::to_word(v) ? 1u << i : 0u;
  return peers;
}
// Sum over the lanes in mask (each lane passes its own group as mask, as labeled partitions do).
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
  uint64_t words[32];
  ::emu::warp_gather(v, words);
  unsigned sum = 0;
  for (int i = 0; i < 32; ++i) sum += (mask >> i) & 1u ? unsigned(words[i]) : 0u;
  return sum;
}
// PRMT: byte i of the result is byte (s >> 4i) & 7 of the 8 bytes {y:x} (no sign replication).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t bytes = uint64_t(y) << 32 | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned((bytes >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x ? __builtin_clz(unsigned(x)) : 32; }
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __frcp_rn(float x) { return 1.f / x; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __uint_as_float(unsigned u) { return ::emu::from_word<float>(u); }
inline unsigned __float_as_uint(float f) { return unsigned(::emu::to_word(f)); }
inline float __int_as_float(int i) { return ::emu::from_word<float>(unsigned(i)); }
inline int __float_as_int(float f) { return int(::emu::to_word(f)); }
inline unsigned long long __float2ull_rz(float f) { return (unsigned long long)f; }
inline unsigned long long __double2ull_rz(double f) { return (unsigned long long)f; }
template <typename T>
T __ldg(const T* p) {
  return *p;
}
template <typename T>
T __ldcs(const T* p) {
  return *p;
}
template <typename T>
void __stcs(T* p, T v) {
  *p = v;
}
template <typename T>
T __ldcg(const T* p) {
  return *p;
}
// Blocks run one after another: every write is visible to later blocks without a fence.
inline void __threadfence() {}
inline double __longlong_as_double(long long v) { return ::emu::from_word<double>(uint64_t(v)); }
inline long long __double_as_longlong(double v) { return (long long)::emu::to_word(v); }
template <typename T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
template <typename T>
T atomicOr(T* p, T v) {
  const T old = *p;
  *p = old | v;
  return old;
}
template <typename T>
T atomicMax(T* p, T v) {
  const T old = *p;
  if (v > old) *p = v;
  return old;
}
inline void __trap() { throw std::runtime_error("emu: __trap()"); }

inline void __pipeline_memcpy_async(void* dst, const void* src, size_t size, size_t zfill = 0) {
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & (size - 1))
    throw std::runtime_error("emu: misaligned __pipeline_memcpy_async");
  ::emu::open_copies().push_back({dst, src, size, zfill});
}
inline void __pipeline_commit() {
  ::emu::copy_groups().push_back(std::move(::emu::open_copies()));
  ::emu::open_copies().clear();
}
inline void __pipeline_wait_prior(size_t prior) {
  auto& groups = ::emu::copy_groups();
  while (groups.size() > prior) {
    for (const auto& c : groups.front()) {
      std::memcpy(c.dst, c.src, c.size - c.zfill);
      std::memset(static_cast<char*>(c.dst) + c.size - c.zfill, 0, c.zfill);
    }
    groups.pop_front();
  }
}
