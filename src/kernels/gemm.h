// kernels/gemm.h — dense matrix products over a tuned GEMM: y = x · Wᵀ + b and its gradients.
//
// Every GEMM in mha goes through sgemm() here. It runs on oneDNN's sgemm, chosen by measurement on
// the 2-core Zen 4 this project targets (bench/gemm_compare.cpp; figures in the README): oneDNN
// uses AVX-512 and beat OpenBLAS 0.3.21 (which runs its AVX2 kernels here) by about 2× on the
// projection shapes, and BLIS 0.9 did not recognise the CPU. sgemm() cuts C into tiles fixed by
// the shape alone and runs each as one single-threaded oneDNN call on mha's OpenMP threads, so
// that its bits do not depend on the thread count (oneDNN's own threading splits k for some shapes
// on some CPUs).
#pragma once

#include <cstdint>

namespace mha::kernels {

enum class Trans : uint8_t { No, Yes };

/// Row-major C (m, n) = alpha · op(A) · op(B) + beta · C, where op(A) is (m, k) and op(B) is
/// (k, n); lda/ldb/ldc are row strides. threads: 0 = the library default (mha::num_threads()).
void sgemm(Trans trans_a, Trans trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc, int threads = 0);

/// x (rows, in) with row stride ldx; w (out, in) with row stride ldw (PyTorch's Linear layout);
/// bias (out) or nullptr; y (rows, out) with row stride ldy. Overwrites y. threads as sgemm's (the
/// caller's per-call option: a module's forward passes its own).
void linear(const float* x, int64_t rows, int64_t in, int64_t ldx, const float* w, int64_t out, int64_t ldw,
            const float* bias, float* y, int64_t ldy, int threads = 0);

/// The input gradient of linear(): dx (rows, in) = dy (rows, out) · w (out, in). Overwrites dx.
void linear_backward_input(const float* dy, int64_t rows, int64_t out, int64_t lddy, const float* w, int64_t in,
                           int64_t ldw, float* dx, int64_t lddx, int threads = 0);

/// The parameter gradients of linear(): dw (out, in) = dyᵀ · x and db (out) = Σ_rows dy (skipped
/// when db is nullptr; summed in double, rows in order). Overwrites dw and db.
void linear_backward_params(const float* dy, int64_t rows, int64_t out, int64_t lddy, const float* x, int64_t in,
                            int64_t ldx, float* dw, int64_t lddw, float* db, int threads = 0);

}  // namespace mha::kernels
