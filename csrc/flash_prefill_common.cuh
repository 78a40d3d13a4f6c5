// Pieces both flash_prefill paths share: the work list the scheduler builds, the causal KV-tile
// bounds of a query tile, accumulator layout views and the fp32 online softmax. Mirrored in
// Python by tests/test_flash_prefill_schedule.py.
#pragma once

#include <climits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "device.cuh"
#include "flash_prefill.h"

namespace pagedkern {
namespace flash {

// Query rows per work tile, in both paths (the scheduler's unit).
constexpr int kBlockM = 128;

// Workspace (int32): [0] work counter (atomic), [1] number of tiles T, [2..3] padding, then T
// (sequence, query-tile) pairs sorted by decreasing cost. Work item w is tile w / num_heads of the
// list with head w % num_heads, so the heads of one tile (and of one GQA group) run side by side.
constexpr int kWorkListHeader = 4;

// Upper bound on sum_b ceil(n_b / kBlockM) for sum_b n_b = total_q.
inline int64_t max_tiles(int64_t total_q, int64_t batch) { return total_q / kBlockM + batch + 1; }

// FlashPrefillParams plus what the host derives once per call; kernel parameters live in the
// constant bank, so these cost the kernels no registers.
struct KernelParams : FlashPrefillParams {
  int64_t page_stride = 0;   // elements between pages: num_kv_heads * block_size * head_dim
  uint32_t page_mul = 0;     // key / block_size = umulhi(key, page_mul) >> page_shift
  uint32_t page_shift = 0;   //   (page_mul = 0: block_size 1)
  float scale_log2 = 0.f;    // scale * log2(e)
  float cap_raw = 0.f;       // soft-cap in raw-score units: soft_cap / scale
  float inv_cap_raw = 0.f;   // scale / soft_cap
};

inline KernelParams make_kernel_params(const FlashPrefillParams& p) {
  KernelParams k;
  static_cast<FlashPrefillParams&>(k) = p;
  k.page_stride = int64_t(p.num_kv_heads) * p.block_size * p.head_dim;
  if (p.block_size > 1) {
    int log2 = 0;
    while ((1ll << log2) < p.block_size) ++log2;  // ceil(log2(block_size))
    k.page_mul = uint32_t(((1ull << (31 + log2)) + p.block_size - 1) / p.block_size);
    k.page_shift = uint32_t(log2 - 1);
  }
  k.scale_log2 = p.scale * 1.4426950408889634f;
  if (p.soft_cap > 0.f) {
    k.cap_raw = p.soft_cap / p.scale;
    k.inv_cap_raw = p.scale / p.soft_cap;
  }
  return k;
}

// (page index, slot) of a key: key / block_size, key % block_size, for 0 <= key < 2^31.
__device__ __forceinline__ void page_of(const KernelParams& p, int key, int& page, int& slot) {
  page = p.page_mul ? int(__umulhi(uint32_t(key), p.page_mul) >> p.page_shift) : key;
  slot = key - page * p.block_size;
}

// One work item, decoded: which queries, which keys.
struct WorkTile {
  int head;
  int kv_head;
  int q_row0;     // first query row of the tile in q / out
  int rows;       // valid query rows, 1..kBlockM (<= 0: an empty part of a split tile)
  int seq;        // sequence index b
  int seq_len;    // keys of the sequence in the cache
  int q_pos0;     // position of query row 0 (prefix + m * kBlockM; < 0 only for invalid input)
  int n_tiles;    // KV tiles 0 .. n_tiles-1 hold visible keys
  int n_unmasked; // KV tiles 0 .. n_unmasked-1 are visible to every row: no mask needed
  int n_visits;   // path 1 visits KV tiles n_tiles-1 down to n_tiles-n_visits (a window's)
  int key_lo;     // keys below are before every row's window (0 without one): zero-filled
};

// Causal KV-tile bounds of a query tile whose first row sits at q_pos0 and which holds `rows`
// rows, over seq_len keys: keys 0 .. min(q_pos0 + rows, seq_len) - 1 are visible to some row and
// keys 0 .. q_pos0 to all rows.
__host__ __device__ inline void kv_tile_bounds(int q_pos0, int rows, int seq_len, int block_n,
                                               int& n_tiles, int& n_unmasked) {
  const int kv_end = min(q_pos0 + rows, seq_len);
  n_tiles = kv_end > 0 ? (kv_end + block_n - 1) / block_n : 0;
  n_unmasked = q_pos0 + 1 > 0 ? min((q_pos0 + 1) / block_n, n_tiles) : 0;
}

// x, as a value the compiler cannot hoist out of a loop or share between uses.
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// kRecomputeGroup: the group size from an opaque copy of num_heads, recomputed per call (path
// 1's fp8 kernels: hoisted out of the persistent loop, that quotient stayed live through it and
// spilled at 255 registers; the 16-bit kernels allocate without spills as they are).
// kOptions: the attention options' kernel (a window's tile range; the others read it as is).
// kItemRows < kBlockM (path 1 at D = 256): each list tile splits into kBlockM / kItemRows work
// items of kItemRows rows (item w: tile w / (num_heads * split), part w / num_heads % split,
// head w % num_heads); a part past the chunk's last row is empty (rows <= 0, no KV tile).
template <int kBlockN, bool kRecomputeGroup = false, bool kOptions = false,
          int kItemRows = kBlockM>
__device__ __forceinline__ WorkTile decode_work(const FlashPrefillParams& p, int work) {
  constexpr int kSplit = kBlockM / kItemRows;
  static_assert(kSplit * kItemRows == kBlockM);
  const int entry = work / (p.num_heads * kSplit);
  const int rest = work - entry * p.num_heads * kSplit;
  const int part = kSplit > 1 ? rest / p.num_heads : 0;
  WorkTile t;
  t.head = rest - part * p.num_heads;
  t.kv_head = t.head / ((kRecomputeGroup ? opaque(p.num_heads) : p.num_heads) / p.num_kv_heads);
  const int2 bm = reinterpret_cast<const int2*>(p.workspace + kWorkListHeader)[entry];
  t.seq = bm.x;
  const int start = p.cu_seqlens_q[bm.x];
  const int n = p.cu_seqlens_q[bm.x + 1] - start;
  const int row0 = bm.y * kBlockM + part * kItemRows;  // first row within the chunk
  t.seq_len = p.seq_lens[bm.x];
  t.q_row0 = start + row0;
  t.rows = min(kItemRows, n - row0);
  t.q_pos0 = t.seq_len - n + row0;
  kv_tile_bounds(t.q_pos0, t.rows, t.seq_len, kBlockN, t.n_tiles, t.n_unmasked);
  if (kSplit > 1 && t.rows <= 0) t.n_tiles = t.n_unmasked = 0;
  t.n_visits = t.n_tiles;
  t.key_lo = 0;
  if (kOptions && p.window > 0) {  // the window's lower edge cuts every tile it crosses: all masked
    t.key_lo = max(0, t.q_pos0 + 1 - p.window);
    t.n_visits = max(0, t.n_tiles - t.key_lo / kBlockN);
    t.n_unmasked = 0;
  }
  return t;
}

// ---- accumulator views -------------------------------------------------------------------------
// An mma accumulator partition is ((v0, v1[, g]), M, N): v0 = column +1, v1 = row +8 (both the
// m16n8 mma.sync atom and the m64nN wgmma atom, whose g = N/8 column groups come third).

// (rows, cols) view: rows = (v1, M), cols = (v0[, g], N).
template <class L>
CUTE_HOST_DEVICE constexpr auto rowcol_layout(L const& acc) {
  using namespace cute;
  if constexpr (decltype(rank<0>(acc))::value == 3) {
    return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                       make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
  } else {
    return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                       make_layout(get<0, 0>(acc), get<2>(acc)));
  }
}

// The S = Q K^T accumulator reread as the A operand (k16 slices) of O += P V: the C fragments of
// two adjacent 8-column groups are exactly the A fragment of one 16-wide k slice.
template <class L>
CUTE_HOST_DEVICE constexpr auto acc_as_a_layout(L const& acc) {
  using namespace cute;
  if constexpr (decltype(rank<0>(acc))::value == 3) {
    auto g = logical_divide(get<0, 2>(acc), Tile<_2>{});  // ((2, N/16))
    return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(g)), get<1>(acc),
                       coalesce(make_layout(get<0, 1>(g), get<2>(acc))));
  } else {
    auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // ((2,2), M, (2, N/2))
    return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
  }
}

// Rounds a register fragment to the element type of dst (packed cvt.rn.bf16x2 / f16x2). dst is
// the same registers, possibly seen through another layout (acc_as_a_layout): storage order is
// kept, so storage element i of dst becomes storage element i of src.
template <class TensorSrc, class TensorDst>
__device__ __forceinline__ void convert_storage(const TensorSrc& src, TensorDst& dst) {
  using namespace cute;
  using From = typename TensorSrc::value_type;
  using To = typename TensorDst::value_type;
  constexpr int N = decltype(cosize(src.layout()))::value;
  static_assert(N == decltype(size(src))::value, "a compact register fragment");
  static_assert(N == decltype(cosize(dst.layout()))::value, "the same number of registers");
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(raw_pointer_cast(dst.data())) =
      convert(*reinterpret_cast<const cutlass::Array<From, N>*>(raw_pointer_cast(src.data())));
}

// ---- online softmax ------------------------------------------------------------------------------
// Four threads (lanes 4r .. 4r+3) share each row of an accumulator: row reductions finish with
// two xor shuffles.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// One KV tile of the online softmax. s: raw scores (rows, cols), replaced by p = exp(s*scale -
// max*scale) through exp2 (fast_exp2: one MUFU.EX2 each) with log2(e) folded into scale_log2;
// row_max in raw-score units, row_sum thread-partial; alpha[r] = factor the output row must be
// rescaled by. A row that has seen only masked keys keeps max = -inf and uses 0 as its exponent
// base, so no inf - inf.
template <int kRows, class TS>
__device__ __forceinline__ void softmax_step(TS& s, float (&row_max)[kRows],
                                             float (&row_sum)[kRows], float (&alpha)[kRows],
                                             float scale_log2) {
  using namespace cute;
  static_assert(decltype(size<0>(s))::value == kRows);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float mx = row_max[r];
#pragma unroll
    for (int c = 0; c < size<1>(s); ++c) mx = fmaxf(mx, s(r, c));
    mx = quad_max(mx);
    const float base = mx == -INFINITY ? 0.f : mx * scale_log2;
#ifdef EXP_ALPHA_SLOW
    alpha[r] = exp2f(row_max[r] * scale_log2 - base);
#else
    alpha[r] = fast_exp2(row_max[r] * scale_log2 - base);
#endif
    row_max[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < size<1>(s); ++c) {
      s(r, c) = fast_exp2(fmaf(s(r, c), scale_log2, -base));
      sum += s(r, c);
    }
    row_sum[r] = row_sum[r] * alpha[r] + sum;
  }
}

template <int kRows, class TO>
__device__ __forceinline__ void rescale_rows(TO& o, const float (&factor)[kRows]) {
  using namespace cute;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int c = 0; c < size<1>(o); ++c) o(r, c) *= factor[r];
  }
}

// Normalises the output rows by their softmax sums and multiplies them by out_scale (v_scale);
// lse[r] = natural-log log-sum-exp of the scaled scores (-inf, with a zero output row, for a row
// that saw no key).
// sink: an attention-sink logit (natural units) that joins every row's denominator, -inf for
// none (a row without keys stays empty either way).
template <int kRows, class TO>
__device__ __forceinline__ void softmax_finalize(TO& o, const float (&row_max)[kRows],
                                                 const float (&row_sum)[kRows], float scale,
                                                 float out_scale, float (&lse)[kRows],
                                                 float sink = -INFINITY) {
  float inv[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float sum = quad_sum(row_sum[r]);
    const bool empty = !(sum > 0.f);  // 0 or NaN
    float mx = row_max[r] * scale, keep = 1.f;
    if (sink != -INFINITY && !empty) {
      constexpr float kLog2e = 1.4426950408889634f;
      const float m = fmaxf(mx, sink);
      keep = fast_exp2((mx - m) * kLog2e);
      sum = sum * keep + fast_exp2((sink - m) * kLog2e);
      mx = m;
    }
    inv[r] = empty ? 1.f : out_scale * keep / sum;
    lse[r] = empty ? -INFINITY : mx + __logf(sum);
  }
  rescale_rows(o, inv);
}

// Soft-cap of raw scores: cap * tanh(s * scale / cap) / scale (KernelParams' cap_raw), tanh as
// 1 - 2 / (e^2x + 1) with one MUFU.EX2 and a fast reciprocal: absolute error ~1e-7 of tanh
// (cap * 1e-7 in the logit), without tanhf's registers and denormal fix-ups.
template <class TS>
__device__ __forceinline__ void soft_cap_scores(TS& s, float cap_raw, float inv_cap_raw) {
  using namespace cute;
  const float k = 2.f * 1.4426950408889634f * inv_cap_raw;
#pragma unroll
  for (int i = 0; i < size(s); ++i) {
    const float e = fast_exp2(s(i) * k);  // e^(2x), x = s / cap_raw; inf or 0 at the ends
    s(i) = cap_raw * (1.f - __fdividef(2.f, e + 1.f));
  }
}

// Scores of keys beyond the row's last visible key -> -inf. s and coords are rowcol views of the
// scores and of their (row, column) coordinates in the (kBlockM, kBlockN) tile.
// window > 0: keys window or more positions before the row's are hidden too.
template <class TS, class TC>
__device__ __forceinline__ void causal_mask(TS& s, const TC& coords, const WorkTile& t, int key0,
                                            int window = 0) {
  using namespace cute;
  const int last_key = t.seq_len - 1;
#pragma unroll
  for (int r = 0; r < size<0>(s); ++r) {
    // keys <= limit are visible: the row's own position, and never a key past the sequence.
    const int pos = t.q_pos0 + int(get<0>(coords(r, 0)));
    const int limit = min(pos, last_key) - key0;
    const int lowest = window > 0 ? pos + 1 - window - key0 : INT_MIN;
#pragma unroll
    for (int c = 0; c < size<1>(s); ++c) {
      const int col = int(get<1>(coords(r, c)));
      if (col > limit || col < lowest) s(r, c) = -INFINITY;
    }
  }
}

// The launchers of the two paths (flash_prefill.cu schedules, then calls one).
void launch_flash_prefill_sm80(const KernelParams& p, int device, cudaStream_t stream);
void launch_flash_prefill_sm90(const KernelParams& p, int device, cudaStream_t stream);
// Whether path 2's TMA page loads can serve this page layout (else path 1 runs).
bool flash_prefill_sm90_supports(const FlashPrefillParams& p);
// CTAs of a persistent grid for `kernel` on `device`, at most `max_ctas`.
int persistent_grid(const void* kernel, int threads, size_t smem, int device, int64_t max_ctas);

}  // namespace flash
}  // namespace pagedkern
