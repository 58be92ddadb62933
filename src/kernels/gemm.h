// kernels/gemm.h — dense linear layers over a tuned BLAS: y = x · Wᵀ + b.
#pragma once

#include <cstdint>

namespace mha::kernels {

/// x (rows, in) with row stride ldx; w (out, in) with row stride ldw (PyTorch's Linear layout);
/// bias (out) or nullptr; y (rows, out) with row stride ldy. Overwrites y.
void linear(const float* x, int64_t rows, int64_t in, int64_t ldx, const float* w, int64_t out, int64_t ldw,
            const float* bias, float* y, int64_t ldy);

/// Sets the BLAS library's thread count (0 = leave as is).
void set_blas_threads(int threads);

}  // namespace mha::kernels
