// Host-side check of the layout assumptions of the sm_90a MoE grouped GEMM (csrc/moe_gemm_sm90.cu)
// on the very types it uses (no GPU): where TMA's SWIZZLE_128B boxes put each element against
// the CuTe layouts the wgmma descriptors and the cp.async gather address; each stage's and K
// slice's descriptor offset; that the gather's thread assignment covers the A tile exactly
// once; which accumulator element holds which (row, column), with gate column c and its up
// value at c + 64 in the same thread. Built and run by tests/test_moe_sm90.py (needs nvcc);
// prints "ok" or the first mismatches.
#include <cstddef>
#include <cstdio>
#include <set>
#include <utility>
#include <vector>

#include "moe_gemm_sm90.cuh"
#include "host_check.h"

using namespace cute;
using namespace pagedkern::moe_sm90;

// Byte offset, from a 1024-aligned tile, of element (row, col < 64) as a TMA SWIZZLE_128B box
// writes it: rows 128 B apart, each 16-byte chunk xor (row % 8).
int tma_sw128_offset(int row, int col) {
  return row * 128 + ((col / 8) ^ (row % 8)) * 16 + col % 8 * 2;
}

template <class Tr>
void check(const char* name) {
  using T = typename Tr::T;
  constexpr int S = Tr::kStages, BM = Tr::kBM, BK = Tr::kBK, BR = Tr::kBRows;
  // Shared memory as the kernel indexes it (CuTe applies the swizzle to the address: a
  // 1024-aligned stand-in buffer, nothing dereferenced) against where TMA puts each element.
  alignas(1024) static T buffer[S * BR * BK];
  const auto base = reinterpret_cast<uintptr_t>(buffer);
  Tensor sA = make_tensor(make_smem_ptr(buffer), typename Tr::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(buffer), typename Tr::SmemLayoutB{});
  for (int st = 0; st < S; ++st) {
    for (int c = 0; c < BK; ++c) {
      for (int r = 0; r < BM; ++r) {  // A: one box of 64 rows (TMA for down, cp.async gate_up)
        const int at = int(reinterpret_cast<uintptr_t>(&sA(r, c, st)) - base);
        const int want = st * Tr::kATileElems * int(sizeof(T)) + tma_sw128_offset(r, c);
        CHECK(at == want, "%s: A (%d, %d, %d) at %d, TMA writes %d", name, r, c, st, at, want);
      }
      // B: down, one box of 128 rows; gate_up, boxes of 64 rows at rows 0 and 64 (elements
      // kGatedCols * kBK past the stage's start): both are rows 128 B apart from the stage.
      for (int r = 0; r < BR; ++r) {
        const int at = int(reinterpret_cast<uintptr_t>(&sB(r, c, st)) - base);
        const int want = st * Tr::kBTileElems * int(sizeof(T)) + tma_sw128_offset(r, c);
        CHECK(at == want, "%s: B (%d, %d, %d) at %d, TMA writes %d", name, r, c, st, at, want);
      }
    }
  }
  CHECK(Tr::kGatedCols * BK * int(sizeof(T)) % 1024 == 0, "%s: the up box's swizzle atom", name);
  // The gather: every (row, 16-byte chunk) of the A tile by exactly one producer thread.
  std::set<std::pair<int, int>> gathered;
  for (int pt = 0; pt < Tr::kGatherThreads; ++pt) {
    for (int i = 0; i < Tr::kGatherRows; ++i) {
      const int r = Tr::gather_row(pt, i), chunk = Tr::gather_chunk(pt);
      CHECK(r >= 0 && r < BM && chunk >= 0 && chunk < BK / 8, "%s: thread %d", name, pt);
      CHECK(gathered.insert({r, chunk}).second, "%s: (%d, %d) gathered twice", name, r, chunk);
    }
  }
  CHECK(int(gathered.size()) == BM * BK / 8, "%s: %d chunks gathered", name, int(gathered.size()));

  // Accumulators of one consumer warpgroup (the epilogue's view): every element of the 64 x 128
  // tile exactly once; 2 rows x 32 columns a thread, column pairs (c, c + 1) adjacent and even
  // first; gate column c < 16 and its up value at c + 16 (tile columns j and j + 64).
  typename Tr::TiledMma mma;
  std::set<std::pair<int, int>> seen;
  for (int t = 0; t < 128; ++t) {
    auto thr = mma.get_thread_slice(t);
    Tensor cC = thr.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BR>>{}));
    Tensor c_rc = make_tensor(cC.data(), pagedkern::flash::rowcol_layout(cC.layout()));
    CHECK(size<0>(c_rc) == 2 && size<1>(c_rc) == 32, "%s: thread %d holds %d x %d", name, t,
          int(size<0>(c_rc)), int(size<1>(c_rc)));
    for (int i = 0; i < size(cC); ++i) {
      CHECK(seen.insert({get<0>(cC(i)), get<1>(cC(i))}).second, "%s: element held twice", name);
    }
    for (int r = 0; r < size<0>(c_rc); ++r) {
      for (int c = 0; c < size<1>(c_rc); ++c) {
        const int row = get<0>(c_rc(r, c)), col = get<1>(c_rc(r, c));
        CHECK(row == get<0>(c_rc(r, 0)), "%s: thread %d row %d not constant", name, t, r);
        if (c % 2 == 0) {
          CHECK(col % 2 == 0 && get<1>(c_rc(r, c + 1)) == col + 1,
                "%s: thread %d (%d, %d): columns %d, %d", name, t, r, c, col,
                int(get<1>(c_rc(r, c + 1))));
        }
        if (c < 16) {
          CHECK(col < 64 && get<1>(c_rc(r, c + 16)) == col + 64,
                "%s: thread %d (%d, %d): gate column %d, up %d", name, t, r, c, col,
                int(get<1>(c_rc(r, c + 16))));
        }
      }
    }
  }
  CHECK(int(seen.size()) == BM * BR, "%s: %d accumulator elements", name, int(seen.size()));
  // The wgmma descriptors of K slice k (16 columns) of stage st: the fragments' layouts (types
  // only: building the descriptors needs a shared-memory address) advance the start address by
  // the stage's bytes plus 32 bytes a slice, in the descriptors' 16-byte units.
  using FragA = decltype(typename Tr::TiledMma{}.get_thread_slice(0).partition_fragment_A(sA));
  using FragB = decltype(typename Tr::TiledMma{}.get_thread_slice(0).partition_fragment_B(sB));
  typename FragA::layout_type frag_a{};
  typename FragB::layout_type frag_b{};
  CHECK(size<1>(frag_a) == 1 && size<2>(frag_a) == BK / 16 && size<3>(frag_a) == S,
        "%s: A fragment shape", name);
  CHECK(size<1>(frag_b) == 1 && size<2>(frag_b) == BK / 16 && size<3>(frag_b) == S,
        "%s: B fragment shape", name);
  for (int st = 0; st < S; ++st) {
    for (int k = 0; k < BK / 16; ++k) {
      const int a = int(frag_a(0, 0, k, st)), b = int(frag_b(0, 0, k, st));
      const int want_a = (st * Tr::kATileElems * int(sizeof(T)) + 32 * k) / 16;
      const int want_b = (st * Tr::kBTileElems * int(sizeof(T)) + 32 * k) / 16;
      CHECK(a == want_a, "%s: A descriptor (k %d, stage %d) at %d, want %d", name, k, st, a,
            want_a);
      CHECK(b == want_b, "%s: B descriptor (k %d, stage %d) at %d, want %d", name, k, st, b,
            want_b);
    }
  }
  // Every buffer of the shared storage on a 1024-byte boundary.
  using Storage = typename Tr::SharedStorage;
  CHECK(offsetof(Storage, a) % 1024 == 0 && offsetof(Storage, b) % 1024 == 0 &&
            Tr::kStages * Tr::kBTileElems * sizeof(T) % 1024 == 0,
        "%s: buffer alignment", name);
}

int main() {
  check<Traits<cutlass::bfloat16_t, 1>>("bf16, 1 consumer");
  check<Traits<cutlass::bfloat16_t, 2>>("bf16, 2 consumers");
  check<Traits<cutlass::half_t, 1>>("f16, 1 consumer");
  check<Traits<cutlass::half_t, 2>>("f16, 2 consumers");
  return check_report();
}
