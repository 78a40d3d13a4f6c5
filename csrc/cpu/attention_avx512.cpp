// attention.h's kernel on AVX-512: attention_body.inc in 256-bit lanes (the AVX2 path's ops,
// EVEX-encoded, 32 registers), its three hot loops over 512-bit registers with the same
// operations a lane, so it gives the AVX2 and portable paths' bits. Compiled by target
// attribute: entered only where isa.cpp finds AVX-512 (F, BW, VL; the VNNI path's CPUs).
//
// Design (the 256-bit loops are load-bound: 9 loads for 8 FMAs on scores, one a FMA on P.V):
// - Scores: a register holds two rows' 8 lanes, [row r | row r + 1] (the body keeps q in such
//   pairs), against one key's 8 lanes broadcast to both halves; three pairs x 8 keys are 24
//   accumulators, 11 loads for 24 FMAs of 16 lanes. The tree sums each half as vsum_tree does
//   (shuffle + add is hadd's add).
// - e^x: 16 scores a register (lane-wise: any width gives the same bits), summed in 8-lane
//   chunks in order.
// - P.V: 16 output lanes a register, up to 4 rows x 64 lanes (16 accumulators) over the keys
//   the rows share, each key's V loaded once for the rows; the keys only some rows see run a
//   row at a time before and after, so each row's fma chain stays in ascending key order.

#include "attention.h"

#include "quant_gemv.h"  // QUANT_GEMV_X86

#if QUANT_GEMV_X86
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's 512-bit intrinsics self-initialise their _mm512_undefined_* operands: false alarms
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"

namespace pagedkern_cpu {
namespace attention_avx512 {

#define ATT_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline

#include "attention_x86_256.inc"

// The ops vexp uses, 16 lanes (declared before the body: its template finds them there).
using W = __m512;
ATT_FN W vlike(W, float x) { return _mm512_set1_ps(x); }
ATT_FN W vadd(W a, W b) { return _mm512_add_ps(a, b); }
ATT_FN W vmul(W a, W b) { return _mm512_mul_ps(a, b); }
ATT_FN W vfma(W a, W b, W c) { return _mm512_fmadd_ps(a, b, c); }
ATT_FN W vmax(W a, W b) { return _mm512_max_ps(a, b); }  // a > b ? a : b, as maxps
ATT_FN W vround(W x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
ATT_FN W vldexp(W p, W n) {
  const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}
ATT_FN W vzero_below(W x, float t, W e) {
  return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_LT_OQ), e);
}

#include "attention_body.inc"

// 8 floats at p in both halves (one load)
ATT_FN W load8_twice(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(p))));
}
// hadd's lane pairs within each 128 bits: [a0 + a1, a2 + a3, b0 + b1, b2 + b3] a quarter
ATT_FN W hadd(W a, W b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

struct Avx512Kernels {
  // A 16-bit row 16 elements a register: half the stores of the 8-lane body's (its conversion
  // loop was store-bound)
  ATT_FN static void to_fp32(int dtype, const void* cache, int64_t at, float* out, int d) {
    if (dtype == kCacheE4M3 || d % 16 != 0)
      return convert_row(dtype, cache, at, out, d);
    const uint16_t* x = static_cast<const uint16_t*>(cache) + at;
    if (dtype == kCacheF16) {
      for (int c = 0; c < d; c += 16)
        _mm512_storeu_ps(out + c, _mm512_cvtph_ps(_mm256_loadu_si256(
                                      reinterpret_cast<const __m256i*>(x + c))));
    } else {
      for (int c = 0; c < d; c += 16) {
        const __m512i h = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c)));
        _mm512_storeu_ps(out + c, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
      }
    }
  }

  // P pairs of rows from r (even): rows r + 2p, r + 2p + 1 against the 8 keys of kc
  template <int P>
  ATT_FN static void score_pairs(const float* qs, int d, const float* const* kc, float* scores,
                                 int64_t nk, int r) {
    W acc[P][8];
    for (int p = 0; p < P; ++p)
      for (int k = 0; k < 8; ++k) acc[p][k] = _mm512_setzero_ps();
    const float* q = qs + q_lanes(r, d, 0);  // pair p's lanes dd: q + 2 d p + 2 dd
    for (int dd = 0; dd < d; dd += 8) {
      W qp[P];
      for (int p = 0; p < P; ++p) qp[p] = _mm512_loadu_ps(q + size_t(2 * d) * p + 2 * dd);
      for (int k = 0; k < 8; ++k) {
        const W key = load8_twice(kc[k] + dd);
        for (int p = 0; p < P; ++p) acc[p][k] = vfma(qp[p], key, acc[p][k]);
      }
    }
    // vsum_tree in each half: lanes [row r: keys 0-3 | row r + 1: 0-3 | r: 4-7 | r + 1: 4-7]
    const __m512i rows = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    for (int p = 0; p < P; ++p) {
      const W* a = acc[p];
      const W u0 = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));
      const W u1 = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
      const W lo = _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0));
      const W hi = _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1));
      const W both = _mm512_permutexvar_ps(rows, _mm512_add_ps(lo, hi));
      _mm256_storeu_ps(scores + size_t(r + 2 * p) * nk, _mm512_castps512_ps256(both));
      _mm256_storeu_ps(scores + size_t(r + 2 * p + 1) * nk,
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(both), 1)));
    }
  }

  ATT_FN static void scores(const float* qs, int d, const float* const* kc, float* scores,
                            int64_t nk, int r0, int r1) {
    int r = r0;
    if (r % 2 == 1) RowKernels::scores(qs, d, kc, scores, nk, r, r + 1), ++r;  // to a pair
    for (; r + 6 <= r1; r += 6) score_pairs<3>(qs, d, kc, scores, nk, r);
    if (r + 4 <= r1) score_pairs<2>(qs, d, kc, scores, nk, r), r += 4;
    if (r + 2 <= r1) score_pairs<1>(qs, d, kc, scores, nk, r), r += 2;
    if (r < r1) RowKernels::scores(qs, d, kc, scores, nk, r, r1);
  }

  ATT_FN static float max(const float* s, int n) {  // four chains (maxps' latency)
    W mx[4];
    for (int i = 0; i < 4; ++i) mx[i] = _mm512_set1_ps(-INFINITY);
    int c = 0;
    for (; c + 64 <= n; c += 64)
      for (int i = 0; i < 4; ++i) mx[i] = vmax(mx[i], _mm512_loadu_ps(s + c + 16 * i));
    for (; c + 16 <= n; c += 16) mx[0] = vmax(mx[0], _mm512_loadu_ps(s + c));
    const float m = _mm512_reduce_max_ps(vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3])));
    const float tail = c < n ? RowKernels::max(s + c, n - c) : -INFINITY;
    return tail > m ? tail : m;
  }

  ATT_FN static V exp_sum(float* s, int n, float m) {
    const W vm = _mm512_set1_ps(m);
    V total = vzero();
    int c = 0;
    for (; c + 16 <= n; c += 16) {
      const W e = vexp(_mm512_sub_ps(_mm512_loadu_ps(s + c), vm));
      _mm512_storeu_ps(s + c, e);
      total = vadd(total, _mm512_castps512_ps256(e));
      total = vadd(total, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    if (c < n) total = vadd(total, RowKernels::exp_sum(s + c, n - c, m));
    return total;
  }

  // R rows' lanes [dc, dc + 16 NZ + 8 Y) over keys [j0, j1): rows' acc and e at `acc[i]`, `e[i]`
  template <int R, int NZ, bool Y>
  ATT_FN static void pv_lanes(float* const* acc, const float* const* e, const float* const* vp,
                              int j0, int j1, int dc) {
    W z[R][NZ > 0 ? NZ : 1];
    V y[R];
    for (int i = 0; i < R; ++i) {
      for (int n = 0; n < NZ; ++n) z[i][n] = _mm512_loadu_ps(acc[i] + dc + 16 * n);
      if (Y) y[i] = vload(acc[i] + dc + 16 * NZ);
    }
    for (int j = j0; j < j1; ++j) {
      const float* vj = vp[j] + dc;
      W vz[NZ > 0 ? NZ : 1];
      for (int n = 0; n < NZ; ++n) vz[n] = _mm512_loadu_ps(vj + 16 * n);
      const V vy = Y ? vload(vj + 16 * NZ) : vzero();
      for (int i = 0; i < R; ++i) {
        const W ez = _mm512_set1_ps(e[i][j]);
        for (int n = 0; n < NZ; ++n) z[i][n] = vfma(ez, vz[n], z[i][n]);
        if (Y) y[i] = vfma(_mm512_castps512_ps256(ez), vy, y[i]);
      }
    }
    for (int i = 0; i < R; ++i) {
      for (int n = 0; n < NZ; ++n) _mm512_storeu_ps(acc[i] + dc + 16 * n, z[i][n]);
      if (Y) vstore(acc[i] + dc + 16 * NZ, y[i]);
    }
  }

  template <int R>
  ATT_FN static void pv_span(float* const* acc, const float* const* e, const float* const* vp,
                             int j0, int j1, int d) {
    if (j0 >= j1) return;
    int dc = 0;
    for (; dc + 64 <= d; dc += 64) pv_lanes<R, 4, false>(acc, e, vp, j0, j1, dc);
    switch ((d - dc) / 8) {  // 0 .. 7 lanes of 8 left
      case 1: pv_lanes<R, 0, true>(acc, e, vp, j0, j1, dc); break;
      case 2: pv_lanes<R, 1, false>(acc, e, vp, j0, j1, dc); break;
      case 3: pv_lanes<R, 1, true>(acc, e, vp, j0, j1, dc); break;
      case 4: pv_lanes<R, 2, false>(acc, e, vp, j0, j1, dc); break;
      case 5: pv_lanes<R, 2, true>(acc, e, vp, j0, j1, dc); break;
      case 6: pv_lanes<R, 3, false>(acc, e, vp, j0, j1, dc); break;
      case 7: pv_lanes<R, 3, true>(acc, e, vp, j0, j1, dc); break;
      default: break;
    }
  }

  ATT_FN static void pv_rows(float* acc, int d, const float* e, int64_t nk,
                             const float* const* vp, const int* j0, const int* j1, int rows) {
    for (int r = 0; r < rows; r += 4) {
      const int n = std::min(4, rows - r);
      float* accs[4];
      const float* es[4];
      int lo = j0[r], hi = j1[r];
      for (int i = 0; i < n; ++i) {
        accs[i] = acc + size_t(r + i) * d;
        es[i] = e + size_t(r + i) * nk;
        lo = std::max(lo, j0[r + i]);
        hi = std::min(hi, j1[r + i]);
      }
      if (lo >= hi) lo = hi = j1[r];  // no shared keys: each row alone (below)
      for (int i = 0; i < n; ++i)  // keys before the shared ones
        pv_span<1>(accs + i, es + i, vp, j0[r + i], std::min(lo, j1[r + i]), d);
      switch (n) {
        case 4: pv_span<4>(accs, es, vp, lo, hi, d); break;
        case 3: pv_span<3>(accs, es, vp, lo, hi, d); break;
        case 2: pv_span<2>(accs, es, vp, lo, hi, d); break;
        default: pv_span<1>(accs, es, vp, lo, hi, d); break;
      }
      for (int i = 0; i < n; ++i)  // keys after them
        pv_span<1>(accs + i, es + i, vp, std::max(hi, j0[r + i]), j1[r + i], d);
    }
  }
};

#undef ATT_FN

}  // namespace attention_avx512

void attention_detail::avx512(const AttentionArgs& args) {
  attention_avx512::run<attention_avx512::Avx512Kernels>(args);
}

}  // namespace pagedkern_cpu
#else
namespace pagedkern_cpu {
void attention_detail::avx512(const AttentionArgs&) {}
}  // namespace pagedkern_cpu
#endif
