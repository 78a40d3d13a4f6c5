/*
 * The MoE experts on Hopper (sm_90a): the two grouped GEMMs of moe_experts (moe.h, the same
 * contract and roundings as moe_gemm.cu's mma.sync kernels) on wgmma, weights brought in by TMA.
 * The moe_gemm:sm90_wgmma variant (ops/variants.py); refused on GPUs other than sm_90. Not yet
 * verified on GPU: compiled and statically checked (HGMMA, UTMALDG, no spills), its layouts
 * checked on the host (tests/moe_gemm_sm90_layouts.cu).
 *
 * moe_gemm_sm90_kernel<Traits<T, C>, kGated>: one launch over all experts, grid (N tiles,
 *   padded_rows / 64); CTA (x, y) takes row tile y of moe_align's grouping (tile_m = 64: the
 *   padded per-expert offsets, read on the device, no host synchronisation, capturable) and its
 *   expert tile_expert[y] (-1: an unused tile, exit), and N tile x:
 *     kGated: h[row, n] = act(x_t . wg_e[n] + bg, x_t . wu_e[n] + bu) for 64 C columns of I
 *     down:   y[pair, n] = h[row] . wd_e[n] + bd                     for 128 C columns of H
 *   (roundings, activations and biases as moe_gemm.cu's epilogue; the activation a run-time
 *   switch there, outside the K loop).
 *  Warp specialisation (flash_prefill_sm90's scheme): warpgroup 0 produces, warpgroups 1..C
 *   consume (C = 1 at decode, T*k < 32 E: twice the CTAs over the weights; else C = 2); a ring
 *   of kStages (8 for C = 1, 5 for C = 2) K steps of 64, each with a full mbarrier (TMA
 *   transaction bytes + producer arrivals) and an empty one (one arrival per consumer warp).
 *  B (weights, [E, N rows, K] with K contiguous): TMA, a 3-D tensor map (K, rows, E) with
 *   128-byte swizzle, boxes of 64 K columns into each consumer's own 128-row tile: down, 128
 *   rows of wd_e; gate_up, 64 gate rows n.. and the same columns' 64 up rows I + n.., so one
 *   m64n128k16 wgmma gives a thread both halves of its columns (accumulator column c and
 *   c + 64) and the activation is fused in registers. Rows and K past the tensor are zeros
 *   (TMA's out-of-bounds fill); a consumer whose columns all lie past N gets no box.
 *  A (activations): down reads h in sorted order, so TMA loads its 64 rows (a map over h; its
 *   padding rows, never written, reach only the product's padding rows, which are not stored).
 *   gate_up's rows are hidden's token rows gathered by pair / top_k: TMA cannot gather rows, so
 *   the producer warpgroup's 128 threads copy them with 16-byte cp.async (zero-fill past K and
 *   for padding rows) into the same swizzled layout (addresses from the CuTe layout the wgmma
 *   descriptors use) and arrive with cp.async.mbarrier.arrive.noinc. Pre-permuting hidden into
 *   grouped order in the grouping step would let TMA load A too, but costs a pass writing
 *   T*k*H elements and a buffer that size; gathered, each token row is read from L2 by the
 *   CTAs that need it. The consumers fence (generic -> async proxy) after the full barrier and
 *   before the wgmma reads what cp.async wrote.
 *  Consumers: per K step one wgmma batch (4 x m64n128k16, SS, fp32 accumulators in
 *   registers, bf16/fp16 in), one batch left in flight: the previous stage is released when
 *   it completes. Epilogue from registers: 4-byte stores of column pairs; padding rows store
 *   nothing. kGated writes h by sorted position, down writes y by pair.
 * Then moe_gemm.cu's combine (moe_combine: the sum over slots in fp32, slot order, one
 *   rounding; deterministic, no atomics), so the variant's output equals the default's up to
 *   the GEMMs' summation order.
 *
 * Traffic and targets as moe_gemm.cu's (decode: the routed experts' weights once, >= 70% of copy
 * bandwidth; prefill: 6*T*k*H*I FLOPs, >= 60% of the bf16 GEMM ceiling); not measured yet.
 * Needs H and I multiples of 8 (TMA strides), 16-byte aligned operands and hidden rows
 * (ops/moe.py runs the default kernels otherwise). Not in this version: 128-row tiles (two
 * consumers on one expert's rows, half the B traffic per FLOP at prefill), persistent CTAs,
 * split-K at decode, TMA multicast across a cluster, a shared-memory staged epilogue.
 * On sm_80 and in the compute_80 PTX the kernel body is a trap (never launched there).
 */
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "device.cuh"
#include "gated_activation.cuh"
#include "moe.h"
#include "moe_gemm_pipeline.cuh"  // moe_combine
#include "moe_gemm_sm90.cuh"
#include "tma_descriptor.cuh"

namespace pagedkern {
namespace moe_sm90 {
namespace {

struct KernelParams {
  MoeExpertsParams p;
  CUtensorMap tma_b;  // the GEMM's weights as (K, N rows, E), box (64, 64 gated / 128 down, 1)
  CUtensorMap tma_a;  // down: h as (I, padded_rows, 1), box (64, 64, 1); gate_up: unused
};

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
using flash::fence_async_shared;
using flash::mbar_arrive;
using flash::mbar_arrive_expect_tx;
using flash::mbar_init;
using flash::mbar_wait;
using flash::tma_load_3d;

// C columns a CTA covers: 64 (gate_up) or 128 (down) per consumer.
template <class Tr, bool kGated>
constexpr int kColsPerConsumer = kGated ? Tr::kGatedCols : Tr::kBRows;

template <class Tr, bool kGated>
__device__ __forceinline__ void producer(const KernelParams& params,
                                         typename Tr::SharedStorage& s, int expert,
                                         int64_t row0) {
  using T = typename Tr::T;
  constexpr int S = Tr::kStages, kBK = Tr::kBK, kCols = kColsPerConsumer<Tr, kGated>;
  const MoeExpertsParams& p = params.p;
  const int pt = threadIdx.x;  // 0 .. 127
  const int64_t n_total = kGated ? p.inter_size : p.hidden_size;
  const int64_t k_total = kGated ? p.hidden_size : p.inter_size;
  const int steps = int((k_total + kBK - 1) / kBK);
  const int64_t n0 = int64_t(blockIdx.x) * kCols * Tr::kConsumers;
  int live = 0;  // consumers with a column < n_total: they get boxes
#pragma unroll
  for (int w = 0; w < Tr::kConsumers; ++w) live += n0 + w * kCols < n_total ? 1 : 0;
  const uint32_t bytes = uint32_t((live * Tr::kBTileElems + (kGated ? 0 : Tr::kATileElems)) *
                                  sizeof(T));

  // Gather (gate_up): this thread's chunk of its rows (Traits::gather_row), their sources.
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename Tr::SmemLayoutA{});
  constexpr int kRowsPerThread = Tr::kGatherRows;
  const int chunk = Tr::gather_chunk(pt);
  const T* src[kRowsPerThread];
  if constexpr (kGated) {
    const T* hidden = static_cast<const T*>(p.hidden);
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int32_t pair = s.row_pair[Tr::gather_row(pt, i)];
      src[i] = pair < 0 ? nullptr : hidden + int64_t(pair / p.top_k) * p.hidden_stride + chunk * 8;
    }
  }

  int stage = 0, phase = 0;
  for (int step = 0; step < steps; ++step) {
    mbar_wait(&s.empty[stage], phase ^ 1);  // the consumers are done with this stage
    if (pt == 0) {
      mbar_arrive_expect_tx(&s.full[stage], bytes);
      const int k0 = step * kBK;
      for (int w = 0; w < live; ++w) {
        T* dst = s.b[w] + stage * Tr::kBTileElems;
        const int n = int(n0 + w * kCols);
        if constexpr (kGated) {
          tma_load_3d(dst, &params.tma_b, &s.full[stage], k0, n, expert);  // gate rows
          tma_load_3d(dst + kCols * kBK, &params.tma_b, &s.full[stage], k0, int(n_total + n),
                      expert);  // up rows
        } else {
          tma_load_3d(dst, &params.tma_b, &s.full[stage], k0, n, expert);
        }
      }
      if constexpr (!kGated) {
        tma_load_3d(s.a + stage * Tr::kATileElems, &params.tma_a, &s.full[stage], k0, int(row0),
                    0);
      }
    }
    if constexpr (kGated) {
      const int64_t k = int64_t(step) * kBK + chunk * 8;
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const bool valid = src[i] != nullptr && k < k_total;
        cp_async_16(&sA(Tr::gather_row(pt, i), chunk * 8, stage),
                    valid ? src[i] + int64_t(step) * kBK : p.hidden, valid ? 16 : 0);
      }
      cp_async_arrive_noinc(&s.full[stage]);
    }
    if (++stage == S) stage = 0, phase ^= 1;
  }
  if constexpr (kGated) cp_async_wait_all();  // no copy outlives its thread
}

template <class Tr, bool kGated>
__device__ __forceinline__ void consumer(const KernelParams& params,
                                         typename Tr::SharedStorage& s, int expert,
                                         int64_t row0) {
  using T = typename Tr::T;
  using R = std::conditional_t<Tr::kHalf, __half, __nv_bfloat16>;  // the same bits, CUDA's type
  using R2 = std::conditional_t<Tr::kHalf, __half2, __nv_bfloat162>;
  constexpr int S = Tr::kStages, kCols = kColsPerConsumer<Tr, kGated>;
  const MoeExpertsParams& p = params.p;
  const int ct = threadIdx.x - 128;
  const int w = ct / 128;  // this consumer warpgroup
  const bool warp_leader = threadIdx.x % 32 == 0;

  typename Tr::TiledMma mma;
  auto thr = mma.get_thread_slice(ct % 128);
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename Tr::SmemLayoutA{});     // (64, 64, S)
  Tensor sB = make_tensor(make_smem_ptr(s.b[w]), typename Tr::SmemLayoutB{});  // (128, 64, S)
  Tensor tA = thr.partition_fragment_A(sA);  // wgmma descriptors (MMA, 1, 4, S)
  Tensor tB = thr.partition_fragment_B(sB);  // (MMA, 1, 4, S)
  Tensor acc = partition_fragment_C(mma, Shape<Int<Tr::kBM>, Int<Tr::kBRows>>{});
  clear(acc);

  const int64_t k_total = kGated ? p.hidden_size : p.inter_size;
  const int steps = int((k_total + Tr::kBK - 1) / Tr::kBK);
  int stage = 0, phase = 0, previous = -1;
  for (int step = 0; step < steps; ++step) {
    mbar_wait(&s.full[stage], phase);
    if constexpr (kGated) fence_async_shared();  // cp.async's A rows -> the wgmma's reads
    wgmma_ss(mma, tA(_, _, _, stage), tB(_, _, _, stage), acc);
    warpgroup_wait<1>();  // the previous step's batch has completed: release its stage
    if (previous >= 0 && warp_leader) mbar_arrive(&s.empty[previous]);
    previous = stage;
    if (++stage == S) stage = 0, phase ^= 1;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);

  // Epilogue: thread's rows (2) x columns (32: 16 column pairs) of the 64 x 128 accumulator;
  // gate_up: columns c < 16 are gate columns, c + 16 the same output column's up value.
  Tensor cC = thr.partition_C(make_identity_tensor(Shape<Int<Tr::kBM>, Int<Tr::kBRows>>{}));
  Tensor c_rc = make_tensor(cC.data(), flash::rowcol_layout(cC.layout()));
  Tensor acc_rc = make_tensor(acc.data(), flash::rowcol_layout(acc.layout()));
  constexpr int kRows = decltype(size<0>(acc_rc))::value;
  constexpr int kAccCols = decltype(size<1>(acc_rc))::value;
  constexpr int kOutCols = kGated ? kAccCols / 2 : kAccCols;
  const int64_t n_total = kGated ? p.inter_size : p.hidden_size;
  const int64_t n_base = int64_t(blockIdx.x) * kCols * Tr::kConsumers + w * kCols;
  R* out = static_cast<R*>(kGated ? p.h : p.y);
  const R* bias = static_cast<const R*>(kGated ? p.gate_up_bias : p.down_bias);
  if (bias != nullptr) bias += int64_t(expert) * (kGated ? 2 * n_total : n_total);
  const ClampedSwiGLU swiglu{p.swiglu_alpha, p.swiglu_limit};
  auto act = [&](float g, float u) {
    return p.activation == 2 ? swiglu(g, u) : p.activation == 1 ? GeluTanh{}(g) * u : Silu{}(g) * u;
  };
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(c_rc(r, 0));
    const int32_t pair = s.row_pair[row];
    if (pair < 0) continue;
    R* out_row = out + (kGated ? row0 + row : int64_t(pair)) * n_total;
#pragma unroll
    for (int c = 0; c < kOutCols; c += 2) {
      const int64_t n = n_base + get<1>(c_rc(r, c));  // even; n + 1 < n_total with it (N % 8 == 0)
      if (n >= n_total) continue;
      float v[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float g = acc_rc(r, c + j);
        if (bias != nullptr) g += to_float(bias[n + j]);
        g = to_float(from_float<R>(g));
        if constexpr (kGated) {
          float u = acc_rc(r, c + j + kOutCols);
          if (bias != nullptr) u += to_float(bias[n_total + n + j]);
          g = act(g, to_float(from_float<R>(u)));
        }
        v[j] = g;
      }
      R2 both;
      both.x = from_float<R>(v[0]);
      both.y = from_float<R>(v[1]);
      *reinterpret_cast<R2*>(out_row + n) = both;  // 4-byte aligned: n even, rows of N % 8 == 0
    }
  }
}
#endif  // sm_90a or host

template <class Tr, bool kGated>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    moe_gemm_sm90_kernel(const __grid_constant__ KernelParams params) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // never launched: the variant is refused off sm_90
#else
  using Storage = typename Tr::SharedStorage;
  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle is a function of the address: buffers start on 1024-byte boundaries.
  Storage& s = *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                           ~uintptr_t(1023));
  const MoeExpertsParams& p = params.p;
  const int expert = p.tile_expert[blockIdx.y];
  if (expert < 0) return;  // an unused tile: the whole block, before any barrier
  const int64_t row0 = int64_t(blockIdx.y) * Tr::kBM;
  if (threadIdx.x < Tr::kBM) {
    const int32_t pair = p.sorted_pairs[row0 + threadIdx.x];
    s.row_pair[threadIdx.x] = pair < p.tokens * p.top_k ? pair : -1;
  }
  if (threadIdx.x == 0) {
    for (int i = 0; i < Tr::kStages; ++i) {
      // full: the TMA thread's expect_tx arrival (+ each gathering thread's cp.async arrival)
      mbar_init(&s.full[i], 1 + (kGated ? Tr::kGatherThreads : 0));
      mbar_init(&s.empty[i], 4 * Tr::kConsumers);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    producer<Tr, kGated>(params, s, expert, row0);
  } else {
    consumer<Tr, kGated>(params, s, expert, row0);
  }
#endif
}

// ---- host --------------------------------------------------------------------------------------

// A rank-3 map of 16-bit elements (dims innermost first, the two outer strides in bytes), 128-byte
// swizzle, out-of-bounds elements read as zeros.
CUtensorMap tensor_map(bool half, const void* base, uint64_t d0, uint64_t d1, uint64_t d2,
                       uint32_t box_rows) {
  return tma::tensor_map("moe_experts_sm90",
                         half ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                         base, {d0, d1, d2}, {d0 * 2, d0 * d1 * 2}, {64, box_rows, 1});
}

// The dynamic shared memory a kernel needs, allowed once per (kernel, device): not again during
// a CUDA graph capture.
void allow_smem(const void* kernel, size_t bytes, int device) {
  static std::mutex mutex;
  static std::vector<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& d : done) {
    if (d.first == kernel && d.second == device) return;
  }
  PK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(bytes)));
  done.emplace_back(kernel, device);
}

template <class Tr, bool kGated>
void launch_gemm(const MoeExpertsParams& p, int device, cudaStream_t stream) {
  constexpr int kCols = kGated ? Tr::kGatedCols : Tr::kBRows;
  const int64_t n_total = kGated ? p.inter_size : p.hidden_size;
  const int64_t k_total = kGated ? p.hidden_size : p.inter_size;
  KernelParams params;
  params.p = p;
  // weights [E, rows, K]: gate_up rows 2I (boxes of 64: gate or up), down rows H (boxes of 128)
  params.tma_b = tensor_map(Tr::kHalf, kGated ? p.w_gate_up : p.w_down, uint64_t(k_total),
                            uint64_t(kGated ? 2 * n_total : n_total), uint64_t(p.experts),
                            kGated ? Tr::kGatedCols : Tr::kBRows);
  params.tma_a = kGated ? params.tma_b  // (unused)
                        : tensor_map(Tr::kHalf, p.h, uint64_t(p.inter_size),
                                     uint64_t(p.padded_rows), 1, Tr::kBM);
  auto kernel = moe_gemm_sm90_kernel<Tr, kGated>;
  allow_smem(reinterpret_cast<const void*>(kernel), Tr::kSmemBytes, device);
  const dim3 grid(unsigned(ceil_div(n_total, int64_t(kCols) * Tr::kConsumers)),
                  unsigned(p.padded_rows / Tr::kBM));
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(params);
  PK_CHECK_LAUNCH(kGated ? "moe_gemm_sm90_kernel (gate_up)" : "moe_gemm_sm90_kernel (down)");
}

template <class T>
void launch_all(const MoeExpertsParams& p, int device, cudaStream_t stream) {
  // Decode-sized calls (fewer than 32 rows per expert on average, moe_tile_m's rule): one
  // consumer per CTA, twice the CTAs over the weights; prefill: two, A read once per 256 rows.
  if (p.tokens * p.top_k < 32 * int64_t(p.experts)) {
    launch_gemm<Traits<T, 1>, true>(p, device, stream);
    launch_gemm<Traits<T, 1>, false>(p, device, stream);
  } else {
    launch_gemm<Traits<T, 2>, true>(p, device, stream);
    launch_gemm<Traits<T, 2>, false>(p, device, stream);
  }
  moe_combine(moe_gemm::finish_params(p), stream);  // (one split: it reads y)
}

}  // namespace
}  // namespace moe_sm90

void moe_experts_sm90(const MoeExpertsParams& p, cudaStream_t stream) {
  int device = 0, major = 0, minor = 0;
  PK_CUDA_CHECK(cudaGetDevice(&device));
  PK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  PK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0) {
    throw std::invalid_argument(
        "moe_experts_sm90 (PAGEDKERN_KERNELS=moe_gemm:sm90_wgmma) needs an sm_90 GPU (wgmma + "
        "TMA, built for sm_90a); this one is sm_" + std::to_string(major * 10 + minor) +
        ": leave moe_gemm at its default (mma.sync)");
  }
  require(p.tile_m == 64, "moe_experts_sm90: tile_m must be 64 (the wgmma's 64 rows)");
  require(p.gate_up_splits == 1 && p.down_splits == 1,
          "moe_experts_sm90: no split-K (gate_up_splits and down_splits 1)");
  require(p.experts > 0 && p.top_k >= 1 && p.top_k <= p.experts,
          "moe_experts_sm90: top_k/experts");
  require(p.hidden_size > 0 && p.inter_size > 0 && p.hidden_size % 8 == 0 &&
              p.inter_size % 8 == 0,
          "moe_experts_sm90: hidden_size and inter_size must be positive multiples of 8");
  require(p.tokens >= 0 && p.tokens <= 0x7fffffff, "moe_experts_sm90: tokens out of range");
  require(p.padded_rows == moe_padded_rows(p.tokens * p.top_k, p.experts, p.tile_m),
          "moe_experts_sm90: padded_rows must be moe_padded_rows(T*k, E, 64)");
  require(p.padded_rows / p.tile_m <= 65535, "moe_experts_sm90: too many row tiles");
  require(p.hidden_stride >= p.hidden_size && p.hidden_stride % 8 == 0 &&
              p.out_stride >= p.hidden_size,
          "moe_experts_sm90: hidden_stride must be a multiple of 8, both strides >= hidden_size");
  require(aligned16(p.hidden) && aligned16(p.h) && aligned16(p.y) && aligned16(p.w_gate_up) &&
              aligned16(p.w_down),
          "moe_experts_sm90: hidden, h, y and the weights must be 16-byte aligned");
  require(2 * p.inter_size < (int64_t(1) << 31) && p.hidden_size < (int64_t(1) << 31),
          "moe_experts_sm90: sizes past the TMA coordinates' int32");
  require(p.activation >= 0 && p.activation <= 2,
          "moe_experts_sm90: activation must be 0, 1 or 2");
  if (p.tokens == 0) return;
  switch (p.dtype) {
    case DType::kFloat16: moe_sm90::launch_all<cutlass::half_t>(p, device, stream); break;
    case DType::kBFloat16:
      moe_sm90::launch_all<cutlass::bfloat16_t>(p, device, stream);
      break;
    default: throw std::invalid_argument("moe_experts_sm90: dtype must be float16 or bfloat16");
  }
}

}  // namespace pagedkern
