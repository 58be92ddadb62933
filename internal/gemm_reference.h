// internal/gemm_reference.h — the library's GEMM, for the sgemm reference `mha bench` and
// bench/bench_attention.cpp measure in the same run as the attention they time.
//
// That reference must go through the GEMM the projections use (src/kernels/gemm.h), which is not
// public API. This small target exposes the one call the tools time; it is never installed, and
// the tools include no src/ header.
#pragma once

#include <cstdint>

namespace mha::internal {

/// y (n, n) = x (n, n) · wᵀ with w (n, n) in PyTorch's Linear layout, through kernels::linear.
void square_linear(const float* x, const float* w, float* y, int64_t n);

}  // namespace mha::internal
