// pagedkern._cpu: the fp32 GEMM of unquantized weights, y[M, N] = x[M, K] @ W[N, K].T, in a fixed
// order: each output's 16 lanes run fused multiply-add chains over K, lane l taking k = l,
// l + 16, l + 32, ... in ascending order (a last partial 16 zero-padded), then a halving tree
// sums the lanes (l += l + 8, then + 4, + 2, + 1):
//   acc[l] = 0; for k0 in 0, 16, ..: acc[l] = fma(x[m, k0 + l], W[n, k0 + l], acc[l])
//   y[m, n] = tree(acc)
// so an output's bits depend on its own x row and W row only: never on M, the other rows, the
// thread count, the split of N over threads or the ISA path (AVX-512, AVX2 as two 8-lane
// halves, and the portable std::fma loop compute the same lanes and tree). A BLAS's bits
// depend on the rows in the product (another kernel for few rows, another blocking of K),
// which breaks batch invariance: a token sampled beside other requests, or recomputed after a
// preemption, could differ.
//
// Design (llama.cpp's and a BLAS GEMV's dot-product form, register-tiled for many rows):
// - W stays row-major [N, K] (the checkpoint's layout, nothing repacked): x rows and W rows
//   are both read along K, 16 floats a load, so no transposes, and a GEMV streams each W row
//   once (a few rows at a time: few streams for the prefetchers).
// - A tile of R x rows by C W rows keeps R * C accumulators in registers over the whole of K
//   (AVX-512: 4 x 6, 10 loads for 24 fmas; one x row: 1 x 8). No chain is split over K, so one
//   order serves every shape.
// - Many rows: K in blocks of 2048 (each output's lanes stored exactly between blocks: no bit
//   changes), W in blocks of rows that stay in L2 while every group of a block of x rows
//   passes them.
// - W may be bf16 or fp16 (a 16-bit checkpoint's weights at half the bytes): each load widens
//   16 weights to fp32 exactly (a shift; vcvtph2ps), or under many rows a block of W is widened
//   once into an L2-sized buffer; either way the fma chains are the fp32 copy's.
// - Threads split W's rows (parallel.h: torch's OpenMP team); x, W and y are the caller's.
//
// Pointers are passed as integers (as the CUDA extension takes them); the Python side
// (ops/cpu/dense_linear.py) validates shapes, dtypes and strides.

#pragma once

#include <cstdint>

namespace pagedkern_cpu {

// W's element type. 16-bit weights (a bf16 or fp16 checkpoint's, kept at half the bytes) are
// widened to fp32 exactly before their fma: the bits of the fp32 copy's GEMM.
enum WeightType { kWeightF32 = 0, kWeightBF16 = 1, kWeightF16 = 2 };

// y[m, n] (row stride y_stride) = x[m, :] (row stride x_stride) . w[n, :] (row stride
// w_stride, in elements of w_type) in the order above. path: -1 the best this CPU runs, else
// quant_gemv.h's Path numbers (the AVX-512 kernels on both AVX-512 paths, AVX2 on AVX2 and
// AVX-VNNI, the std::fma loop on the others); a path the CPU lacks is an error.
void dense_gemm(float* y, int64_t y_stride, const float* x, int64_t x_stride, const void* w,
                int64_t w_stride, int m, int n, int k, int threads, int path, int w_type);
void dense_gemm(float* y, int64_t y_stride, const float* x, int64_t x_stride, const float* w,
                int64_t w_stride, int m, int n, int k, int threads, int path);

// The experts' GEMMs of a mixture-of-experts layer: x's rows [P, K] grouped by expert (counts[e]
// rows of expert e after those of the experts before it) times w[e] ([E, N, K], contiguous) into
// y [P, N]: dense_gemm per expert with rows, so a row's bits are its own as above.
void dense_gemm_grouped(float* y, const float* x, const void* w, const int64_t* counts,
                        int experts, int n, int k, int threads, int path, int w_type);

}  // namespace pagedkern_cpu
