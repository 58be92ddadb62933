// kernels/gemm.h — dense linear layers over a tuned BLAS: y = x · Wᵀ + b.
#pragma once

#include <cstdint>

namespace mha::kernels {

/// x (rows, in) with row stride ldx; w (out, in) with row stride ldw (PyTorch's Linear layout);
/// bias (out) or nullptr; y (rows, out) with row stride ldy. Overwrites y.
void linear(const float* x, int64_t rows, int64_t in, int64_t ldx, const float* w, int64_t out, int64_t ldw,
            const float* bias, float* y, int64_t ldy);

/// The input gradient of linear(): dx (rows, in) = dy (rows, out) · w (out, in). Overwrites dx.
void linear_backward_input(const float* dy, int64_t rows, int64_t out, int64_t lddy, const float* w, int64_t in,
                           int64_t ldw, float* dx, int64_t lddx);

/// The parameter gradients of linear(): dw (out, in) = dyᵀ · x and db (out) = Σ_rows dy (skipped
/// when db is nullptr; summed in double, rows in order). Overwrites dw and db.
void linear_backward_params(const float* dy, int64_t rows, int64_t out, int64_t lddy, const float* x, int64_t in,
                            int64_t ldx, float* dw, int64_t lddw, float* db);

/// Sets the BLAS library's thread count (0 = leave as is).
void set_blas_threads(int threads);

}  // namespace mha::kernels
