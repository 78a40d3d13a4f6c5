// Host-side check of the layout assumptions of the flash_prefill kernels, on the very types they
// use (no GPU): which accumulator element holds which (row, column), that the S accumulator reread
// as an A operand holds the (row, key) the P V product expects, that the quads of lanes the row
// reductions shuffle over hold whole rows, and the hand-written shared-memory addresses.
// Built and run by tests/test_flash_prefill_schedule.py (needs nvcc); prints "ok" or the first
// mismatch. The fp8-cache path's copy mapping and its E4M3 -> 16-bit conversion pass run here as
// the kernel runs them (the same host-device functions), against an independent E4M3 decoder.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "flash_prefill_sm80.cuh"
#include "flash_prefill_sm90.cuh"
#include "host_check.h"

using namespace cute;
using namespace pagedkern::flash;

// Accumulator (rows x cols of the tile) over all threads of `mma`: every element exactly once;
// rowcol rows constant along columns; every row held by one quad of lanes (4q .. 4q+3);
// acc_as_a_layout maps element i to the (row, key) the A operand of the P V product expects.
template <class MmaS, class MmaO, int kM, int kN, int kD>
void check_accumulators(const char* name, int threads) {
  MmaS mma;
  MmaO mma_o;
  std::set<std::pair<int, int>> seen;
  std::vector<int> row_owner_quad(kM, -1);
  for (int t = 0; t < threads; ++t) {
    auto thr = mma.get_thread_slice(t);
    auto thr_o = mma_o.get_thread_slice(t);
    Tensor cS = thr.partition_C(make_identity_tensor(Shape<Int<kM>, Int<kN>>{}));
    Tensor cS_rc = make_tensor(cS.data(), rowcol_layout(cS.layout()));
    Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<kM>, Int<kD>>{}));
    Tensor cO_rc = make_tensor(cO.data(), rowcol_layout(cO.layout()));
    CHECK(size<0>(cS_rc) == size<0>(cO_rc), "%s: S and O row counts differ", name);
    for (int i = 0; i < size(cS); ++i) {
      const int r = get<0>(cS(i)), c = get<1>(cS(i));
      CHECK(seen.insert({r, c}).second, "%s: (%d, %d) held twice", name, r, c);
    }
    for (int r = 0; r < size<0>(cS_rc); ++r) {
      const int row = get<0>(cS_rc(r, 0));
      CHECK(get<0>(cO_rc(r, 0)) == row, "%s: thread %d row %d: S row %d, O row %d", name, t, r,
            row, int(get<0>(cO_rc(r, 0))));
      for (int c = 0; c < size<1>(cS_rc); ++c) {
        CHECK(get<0>(cS_rc(r, c)) == row, "%s: thread %d rowcol row varies", name, t);
      }
      for (int c = 0; c < size<1>(cO_rc); ++c) {
        CHECK(get<0>(cO_rc(r, c)) == row, "%s: thread %d O rowcol row varies", name, t);
      }
      const int quad = t / 4;
      CHECK(row_owner_quad[row] == -1 || row_owner_quad[row] == quad,
            "%s: row %d held by quads %d and %d", name, row, row_owner_quad[row], quad);
      row_owner_quad[row] = quad;
      // Column 0 of the rowcol view is the thread's first column: lane % 4 == 0 holds column 0.
      CHECK((get<1>(cS_rc(r, 0)) == 0) == (t % 4 == 0), "%s: column-0 owner", name);
    }
    // P: the S accumulator reread as the A operand of O += P V (M = kM, K = kN).
    Tensor cA = thr_o.partition_A(make_identity_tensor(Shape<Int<kM>, Int<kN>>{}));
    Tensor cP = make_tensor(cS.data(), acc_as_a_layout(cS.layout()));
    CHECK(size(cA) == size(cP) && size<1>(cA) == size<1>(cP) && size<2>(cA) == size<2>(cP),
          "%s: A fragment shape", name);
    for (int i = 0; i < size(cA); ++i) {
      CHECK(get<0>(cA(i)) == get<0>(cP(i)) && get<1>(cA(i)) == get<1>(cP(i)),
            "%s: thread %d A element %d wants (%d, %d), P holds (%d, %d)", name, t, i,
            int(get<0>(cA(i))), int(get<1>(cA(i))), int(get<0>(cP(i))), int(get<1>(cP(i))));
    }
  }
  CHECK(int(seen.size()) == kM * kN, "%s: %d of %d elements covered", name, int(seen.size()),
        kM * kN);
}

template <class Tr>
void check_sm80(const char* name) {
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, D = Tr::kHeadDim;  // BM 64 at D = 256
  check_accumulators<typename Tr::TiledMma, typename Tr::TiledMma, BM, BN, D>(name, Tr::kThreads);
  typename Tr::SmemLayoutQ q_layout;
  typename Tr::SmemLayoutKV kv_layout;
  typename Tr::SmemLayoutVt vt_layout;
  // Hand-written 16-byte chunk addresses == the swizzled layouts; chunks contiguous.
  for (int t = 0; t < Tr::kThreads; ++t) {
    for (int m = 0; m < BN / 16; ++m) {
      for (int k = 0; k < D / 64; ++k) {
        const int row = Tr::chunk_row(t) + 16 * m, col = Tr::chunk_col(t) + 64 * k;
        for (int j = 0; j < 8; ++j) {
          CHECK(kv_layout(row, col + j) == Tr::chunk_offset(t) + m * 1024 + k * BN * 64 + j,
                "%s: KV chunk t=%d m=%d k=%d j=%d", name, t, m, k, j);
        }
      }
    }
    for (int m = 0; m < BM / 16; ++m) {
      for (int k = 0; k < D / 64; ++k) {
        const int row = Tr::chunk_row(t) + 16 * m, col = Tr::chunk_col(t) + 64 * k;
        CHECK(q_layout(row, col) == Tr::chunk_offset(t) + m * 1024 + k * BM * 64,
              "%s: Q chunk t=%d m=%d k=%d", name, t, m, k);
      }
    }
  }
  for (int n = 0; n < BN; ++n) {
    for (int d = 0; d < D; ++d) {
      CHECK(vt_layout(d, n) == kv_layout(n, d), "%s: V^T view (%d, %d)", name, d, n);
    }
  }
}

// E4M3 (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; S.1111.111 = NaN, no inf) decoded
// from its definition, independently of cuda_fp8.h.
float e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
  return b & 0x80 ? -mag : mag;
}

// The fp8 path of the sm80 kernel: the copy mapping covers the tile once, the staging slots are
// distinct and in bounds, kv_offset is SmemLayoutKV, and copy + conversion of every thread
// rebuild the tile exactly in the layout the fragments read (every byte value, NaN included).
template <class Tr>
void check_sm80_fp8(const char* name, uint32_t seed) {
  using T = typename Tr::T;
  constexpr int BN = Tr::kBlockN, D = Tr::kHeadDim, KV = Tr::kKVElems;
  static_assert(Tr::kFp8);
  typename Tr::SmemLayoutKV kv_layout;
  for (int r = 0; r < BN; ++r) {
    for (int c = 0; c < D; ++c) {
      CHECK(Tr::kv_offset(r, c) == kv_layout(r, c), "%s: kv_offset(%d, %d)", name, r, c);
    }
  }
  for (int stages = 1; stages <= 2; ++stages) {  // staging buffers: aligned, apart, in bounds
    std::set<int> starts;
    for (int slot = 0; slot < stages; ++slot) {
      for (int is_v = 0; is_v < 2; ++is_v) {
        const int at = Tr::fp8_stage_bytes(is_v, slot);
        CHECK(at % 16 == 0 && at >= int(sizeof(T)) * (kBlockM * D + 2 * KV) &&
                  at + KV <= int(Tr::smem_bytes(stages)) && starts.insert(at / KV).second,
              "%s: staging buffer (%d, %d) of %d stages at %d", name, is_v, slot, stages, at);
      }
    }
  }
  std::vector<uint8_t> tile(KV);  // the fp8 rows [BN, D] as gathered from the pages
  std::mt19937 rng(seed);
  for (int i = 0; i < KV; ++i) tile[i] = i < 256 ? uint8_t(i) : uint8_t(rng());
  std::shuffle(tile.begin(), tile.end(), rng);
  std::vector<uint8_t> stage(KV, 0xA5);
  std::set<int> covered, slots;
  for (int t = 0; t < Tr::kThreads; ++t) {  // load_kv: 16-byte chunks into own staging slots
    for (int m = 0; m < Tr::kFp8Passes; ++m) {
      const int row = Tr::fp8_chunk_row(t) + Tr::kFp8RowsPerPass * m, col = Tr::fp8_chunk_col(t);
      const int at = Tr::fp8_stage_offset(t, m);
      CHECK(row < BN && col + 16 <= D && col % 16 == 0, "%s: chunk (%d, %d)", name, row, col);
      CHECK(at % 16 == 0 && at + 16 <= KV && slots.insert(at).second, "%s: slot %d", name, at);
      for (int j = 0; j < 16; ++j) {
        CHECK(covered.insert(row * D + col + j).second, "%s: (%d, %d) twice", name, row, col + j);
      }
      std::memcpy(&stage[at], &tile[row * D + col], 16);
    }
  }
  CHECK(int(covered.size()) == KV, "%s: %d of %d elements copied", name, int(covered.size()), KV);
  alignas(16) static T out[KV];
  for (int i = 0; i < KV; ++i) out[i] = T(NAN);  // poisoned
  for (int t = 0; t < Tr::kThreads; ++t) Tr::convert_staged(stage.data(), out, t);
  int nans = 0;
  for (int r = 0; r < BN; ++r) {
    for (int c = 0; c < D; ++c) {
      const float want = e4m3_value(tile[r * D + c]), got = float(out[kv_layout(r, c)]);
      if (std::isnan(want)) {
        ++nans;
        CHECK(std::isnan(got), "%s: NaN byte at (%d, %d) became %g", name, r, c, got);
      } else {
        CHECK(got == want && std::signbit(got) == std::signbit(want),
              "%s: (%d, %d) byte 0x%02x: %g, want %g", name, r, c, tile[r * D + c], got, want);
      }
    }
  }
  CHECK(nans >= 2, "%s: both NaN encodings appear in the tile", name);
}

// Byte offset, from a 1024-aligned base, of element (row, col) of a [rows, D] tile stored as the
// TMA SWIZZLE_128B boxes of the kernel write it: 64-column slabs of rows 128 B apart, each
// 16-byte chunk xor (row % 8).
int tma_sw128_offset(int row, int col, int rows) {
  return (col / 64) * rows * 128 + row * 128 + ((col % 64 / 8) ^ (row % 8)) * 16 + col % 8 * 2;
}

template <class Tr>
void check_sm90(const char* name) {
  using T = typename Tr::T;
  constexpr int BN = Tr::kBlockN, D = Tr::kHeadDim, S = Tr::kStages;
  check_accumulators<typename Tr::TiledMmaQK, typename Tr::TiledMmaPV, kBlockM, BN, D>(
      name, 128 * Tr::kConsumers);
  // Shared memory as the kernel indexes it (CuTe applies the swizzle to the address, so use a
  // 1024-aligned stand-in buffer; nothing is dereferenced) against where TMA puts each element.
  alignas(1024) static T buffer[S * BN * D];
  const auto base = reinterpret_cast<uintptr_t>(buffer);
  Tensor sKV = make_tensor(make_smem_ptr(buffer), typename Tr::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(buffer), typename Tr::SmemLayoutVt{});
  Tensor sQ = make_tensor(make_smem_ptr(buffer), typename Tr::SmemLayoutQ{});
  for (int st = 0; st < S; ++st) {
    for (int r = 0; r < BN; ++r) {
      for (int c = 0; c < D; ++c) {
        const auto at = reinterpret_cast<uintptr_t>(&sKV(r, c, st)) - base;
        const int want = st * BN * D * int(sizeof(T)) + tma_sw128_offset(r, c, BN);
        CHECK(int(at) == want, "%s: K/V (%d, %d, %d) at %d, TMA writes %d", name, r, c, st,
              int(at), want);
        CHECK(&sVt(c, r, st) == &sKV(r, c, st), "%s: V^T view (%d, %d, %d)", name, c, r, st);
      }
    }
  }
  for (int r = 0; r < kBlockM; ++r) {
    for (int c = 0; c < D; ++c) {
      const auto at = reinterpret_cast<uintptr_t>(&sQ(r, c)) - base;
      CHECK(int(at) == tma_sw128_offset(r, c, kBlockM), "%s: Q (%d, %d)", name, r, c);
    }
  }
  // Every buffer of the shared storage on a 1024-byte boundary.
  using Storage = typename Tr::SharedStorage;
  CHECK(offsetof(Storage, q) % 1024 == 0 && offsetof(Storage, k) % 1024 == 0 &&
            offsetof(Storage, v) % 1024 == 0 && offsetof(Storage, o) % 1024 == 0,
        "%s: buffer alignment", name);
}

int main() {
  check_sm80<Sm80Traits<cutlass::bfloat16_t, 64>>("sm80 D=64");
  check_sm80<Sm80Traits<cutlass::bfloat16_t, 128>>("sm80 D=128");
  check_sm80<Sm80Traits<cutlass::half_t, 128, cutlass::float_e4m3_t>>("sm80 fp8 D=128");
  check_sm80<Sm80Traits<cutlass::bfloat16_t, 256>>("sm80 D=256");
  check_sm80<Sm80Traits<cutlass::half_t, 256>>("sm80 f16 D=256");
  using cutlass::bfloat16_t, cutlass::float_e4m3_t, cutlass::half_t;
  check_sm80_fp8<Sm80Traits<bfloat16_t, 64, float_e4m3_t>>("sm80 fp8 bf16 D=64", 1);
  check_sm80_fp8<Sm80Traits<bfloat16_t, 128, float_e4m3_t>>("sm80 fp8 bf16 D=128", 2);
  check_sm80_fp8<Sm80Traits<half_t, 64, float_e4m3_t>>("sm80 fp8 f16 D=64", 3);
  check_sm80_fp8<Sm80Traits<half_t, 128, float_e4m3_t>>("sm80 fp8 f16 D=128", 4);
  check_sm90<Sm90Traits<cutlass::bfloat16_t, 64>>("sm90 D=64");
  check_sm90<Sm90Traits<cutlass::half_t, 128>>("sm90 D=128");
  return check_report();
}
