/*
 * flash_prefill: the shared scheduler and the dispatcher between the two kernel paths.
 *
 * Scheduler (flash_prefill_schedule_kernel, one CTA of 1024 threads, a few microseconds): builds
 * the work list on the device from cu_seqlens_q and seq_lens, so the host never reads lengths back
 * (no synchronisation, CUDA-graph safe). A work tile is (sequence b, query tile m of kBlockM rows);
 * its cost is the number of keys it visits, kv_end = min(q_pos_last + 1, seq_len). Tiles are
 * counting-sorted by decreasing cost (2048 bins of 64 keys in shared memory: histogram, scan,
 * scatter) and each tile expands into num_heads work items. The attention kernels are persistent
 * (one or two CTAs per SM) and take the next item with an atomic counter: longest-first greedy
 * list scheduling, which keeps every SM busy when one long sequence meets many short ones (its
 * makespan is within 4/3 of optimal; the long sequence's expensive tiles start first instead of
 * last). Tiles within a bin come out in arbitrary order; results do not depend on it.
 *
 * Dispatch: path 2 (wgmma + TMA, flash_prefill_sm90.cu) on sm_90 when the page layout allows
 * TMA page loads and the cache is 16-bit, else path 1 (mma.sync + cp.async,
 * flash_prefill_sm80.cu); a caller can force path 1 (the Python layer reads
 * PAGEDKERN_FLASH_PREFILL_PATH). An fp8 (E4M3) cache always runs path 1, on Hopper too: path 2
 * would need its TMA fp8 tiles converted into a 16-bit stage before wgmma (not written yet), so
 * an fp8 cache costs Hopper the path-2 speedup. Calls with a window, soft-cap or sinks run
 * path 1 unless the sm90_options variant (kFlashVariantSm90Options) selects path 2's options
 * kernel (not yet verified on a GPU). Head dim 256 runs path 1 (path 2 has 64 and
 * 128), in 64-row work items (two per list tile: flash_prefill_sm80.cu).
 */
#include <cmath>
#include <mutex>
#include <tuple>
#include <vector>

#include "flash_prefill_common.cuh"
#include "index_check.cuh"

namespace pagedkern {
namespace flash {
namespace {

constexpr int kScheduleThreads = 1024;
constexpr int kCostBins = 2 * kScheduleThreads;  // the scan gives each thread two bins
constexpr int kKeysPerBin = 64;

// Bin of a tile visiting kv_end keys: bin 0 = most keys, so ascending bins = decreasing cost.
__device__ __forceinline__ int cost_bin(int kv_end) {
  const int keys = min(max((kv_end + kKeysPerBin - 1) / kKeysPerBin, 0), kCostBins - 1);
  return kCostBins - 1 - keys;
}

// Calls f(b, m, bin) for every (sequence, query tile); a warp per sequence, a lane per tile.
template <class F>
__device__ __forceinline__ void for_each_tile(const int* cu_seqlens_q, const int* seq_lens,
                                              int batch, F&& f) {
  const int lane = threadIdx.x & 31;
  for (int b = threadIdx.x >> 5; b < batch; b += kScheduleThreads / 32) {
    const int n = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
    const int seq_len = seq_lens[b];
    const int tiles = n > 0 ? (n + kBlockM - 1) / kBlockM : 0;
    for (int m = lane; m < tiles; m += 32) {
      const int kv_end = min(seq_len - n + min((m + 1) * kBlockM, n), seq_len);
      f(b, m, cost_bin(kv_end));
    }
  }
}

__global__ void __launch_bounds__(kScheduleThreads)
    flash_prefill_schedule_kernel(const int* cu_seqlens_q, const int* seq_lens, int batch,
                                  int* workspace, int capacity) {
  __shared__ int bins[kCostBins];
  __shared__ int warp_totals[32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < kCostBins; i += kScheduleThreads) bins[i] = 0;
  __syncthreads();
  for_each_tile(cu_seqlens_q, seq_lens, batch, [&](int, int, int bin) { atomicAdd(&bins[bin], 1); });
  __syncthreads();

  // Exclusive scan of the histogram: thread t owns bins 2t and 2t+1.
  const int h0 = bins[2 * tid], h1 = bins[2 * tid + 1];
  int inclusive = h0 + h1;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += v;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int total = warp_totals[lane];
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, total, offset);
      if (lane >= offset) total += v;
    }
    warp_totals[lane] = total;
  }
  __syncthreads();
  const int exclusive = inclusive - h0 - h1 + (warp > 0 ? warp_totals[warp - 1] : 0);
  bins[2 * tid] = exclusive;
  bins[2 * tid + 1] = exclusive + h0;
  const int num_tiles = warp_totals[31];
  __syncthreads();

  int2* list = reinterpret_cast<int2*>(workspace + kWorkListHeader);
  for_each_tile(cu_seqlens_q, seq_lens, batch, [&](int b, int m, int bin) {
    const int slot = atomicAdd(&bins[bin], 1);
    if (slot < capacity) list[slot] = make_int2(b, m);
  });
  if (tid == 0) {
    workspace[0] = 0;  // the attention kernel's work counter
    workspace[1] = min(num_tiles, capacity);
  }
}

// Debug mode (check_indices): the lengths and page ids every work tile will follow, checked
// before the scheduler and the attention kernels read them; a thread per sequence.
__global__ void flash_prefill_check_kernel(const FlashPrefillParams p) {
  for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < p.batch; b += gridDim.x * blockDim.x) {
    const int lo = p.cu_seqlens_q[b], hi = p.cu_seqlens_q[b + 1], n = hi - lo;
    if (b == 0) check_index(true, lo, 1);                          // cu_seqlens_q[0] == 0
    if (b == p.batch - 1) check_index(true, p.total_q - hi, 1);    // cu_seqlens_q[B] == total_q
    check_index(true, n, int64_t(p.total_q) - lo + 1);              // lo <= hi <= total_q
    const int len = p.seq_lens[b];                                  // n <= len <= width * bs
    check_index(true, int64_t(len) - n, p.block_table_width * p.block_size - n + 1);
    const int* table = p.block_tables + int64_t(b) * p.block_table_stride;
    for (int i = 0; i < (len + p.block_size - 1) / p.block_size; ++i)
      check_index(true, table[i], p.num_blocks);
  }
}

}  // namespace

int persistent_grid(const void* kernel, int threads, size_t smem, int device, int64_t max_ctas) {
  // Occupancy per (kernel, device, smem), asked once: the query costs microseconds.
  static std::mutex mutex;
  static std::vector<std::tuple<const void*, int, size_t, int>> cache;
  int per_sm = -1;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& [k, d, s, n] : cache) {
      if (k == kernel && d == device && s == smem) per_sm = n;
    }
    if (per_sm < 0) {
      PK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(smem)));
      PK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
      require(per_sm > 0, "flash_prefill: the kernel does not fit on this device");
      cache.emplace_back(kernel, device, smem, per_sm);
    }
  }
  int sms = 0;
  PK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return int(std::max<int64_t>(1, std::min<int64_t>(int64_t(sms) * per_sm, max_ctas)));
}

}  // namespace flash

int64_t flash_prefill_workspace_ints(int64_t total_q, int64_t batch) {
  return flash::kWorkListHeader + 2 * flash::max_tiles(total_q, batch);
}

FlashPrefillPath flash_prefill_select_path(const FlashPrefillParams& p, int device,
                                           FlashPrefillPath requested, bool strict) {
  if (requested == FlashPrefillPath::kSm80) return requested;
  int major = 0, minor = 0;
  PK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  PK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  // sm_90a machine code runs on sm_90 only; newer GPUs take path 1 (JIT from compute_80 PTX).
  const bool hopper = major == 9 && minor == 0;
  // Path 2's options kernel runs under its own variant only, until a GPU has verified it.
  const bool options = (p.window > 0 || p.soft_cap > 0.f || p.sinks != nullptr) &&
                       p.variant != kFlashVariantSm90Options;
  const bool head_dim_ok = p.head_dim != 256;  // path 2: D 64 and 128
  const bool ok = hopper && !options && head_dim_ok && flash::flash_prefill_sm90_supports(p);
  if (requested == FlashPrefillPath::kSm90 && !ok && strict) {
    throw std::invalid_argument(
        !hopper ? "flash_prefill: path 2 (wgmma + TMA) needs an sm_90 GPU"
        : !head_dim_ok ? "flash_prefill: path 2 covers head_dim 64 and 128 (path 1 takes 256)"
        : options ? "flash_prefill: path 2 runs a window, soft-cap or sinks only under "
                    "PAGEDKERN_KERNELS=flash_prefill:sm90_options (not yet verified on a GPU)"
        : p.fp8_cache
            ? "flash_prefill: path 2 (wgmma + TMA) does not read fp8 caches (path 1 does)"
            : "flash_prefill: path 2 (TMA) needs a block size that divides or is a multiple "
              "of 128 and a multiple of 8, 16-byte aligned caches and q rows");
  }
  return ok ? FlashPrefillPath::kSm90 : FlashPrefillPath::kSm80;
}

FlashPrefillPath flash_prefill(const FlashPrefillParams& p, FlashPrefillPath path, bool strict,
                               cudaStream_t stream) {
  require(p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256,
          "flash_prefill: head_dim must be 64, 128 or 256");
  require(!p.fp8_cache || p.head_dim != 256,
          "flash_prefill: an fp8 cache at head_dim 256 is not in the kernels (64 and 128 are)");
  require(p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16,
          "flash_prefill: dtype must be float16 or bfloat16");
  require(p.scale > 0.f && p.out_scale > 0.f && std::isfinite(p.scale) &&
              std::isfinite(p.out_scale),
          "flash_prefill: scale and out_scale must be finite and positive");
  require(p.num_kv_heads > 0 && p.num_heads > 0 && p.num_heads % p.num_kv_heads == 0,
          "flash_prefill: num_heads must be a positive multiple of num_kv_heads");
  require(p.block_size > 0 && p.num_blocks > 0, "flash_prefill: empty KV cache");
  require(p.total_q >= 0 && p.batch >= 0, "flash_prefill: negative sizes");
  require(p.q_stride % 8 == 0 && p.out_stride % 8 == 0 && aligned16(p.q) && aligned16(p.out) &&
              aligned16(p.k_cache) && aligned16(p.v_cache),
          "flash_prefill: q, out and the caches need 16-byte aligned rows");
  require(p.workspace != nullptr, "flash_prefill: no workspace");
  require(p.window >= 0 && p.soft_cap >= 0.f && std::isfinite(p.soft_cap),
          "flash_prefill: window and soft_cap must be >= 0 (0: none), soft_cap finite");
  require(!p.fp8_cache || (p.window == 0 && p.soft_cap == 0.f && p.sinks == nullptr),
          "flash_prefill: the window, soft-cap and sinks kernels read 16-bit caches, not fp8");
  int device = 0;
  PK_CUDA_CHECK(cudaGetDevice(&device));
  path = flash_prefill_select_path(p, device, path, strict);
  if (p.total_q == 0 || p.batch == 0) return path;

  if (p.check_indices) {
    flash::flash_prefill_check_kernel<<<ceil_div(p.batch, 256), 256, 0, stream>>>(p);
    PK_CHECK_LAUNCH("flash_prefill_check_kernel");
  }
  const int64_t capacity = flash::max_tiles(p.total_q, p.batch);
  flash::flash_prefill_schedule_kernel<<<1, flash::kScheduleThreads, 0, stream>>>(
      p.cu_seqlens_q, p.seq_lens, p.batch, p.workspace, int(capacity));
  PK_CHECK_LAUNCH("flash_prefill_schedule_kernel");
  const flash::KernelParams kp = flash::make_kernel_params(p);
  if (path == FlashPrefillPath::kSm90) {
    flash::launch_flash_prefill_sm90(kp, device, stream);
  } else {
    flash::launch_flash_prefill_sm80(kp, device, stream);
  }
  return path;
}

}  // namespace pagedkern
