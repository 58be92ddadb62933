// kernels/fused_forward.h — what the fused forward kernel tells about its SIMD targets (so tests
// can run every one of them).
//
// Its entry points (fused_supports, fused_workspace_floats, sdpa_fused, for float32 and bfloat16
// inputs by SdpaParams::dtype) are declared in kernels/attention.h with the rest of the kernel
// interface.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/attention.h"

namespace mha::kernels {

/// Highway target bits (HWY_AVX3_DL, HWY_AVX2, …) of every target the kernel was compiled for.
std::vector<int64_t> fused_compiled_targets();
/// The target a call would dispatch to now (honours hwy::SetSupportedTargetsForTest).
int64_t fused_dispatch_target();
/// Whether bf16 Q·Kᵀ and P·V would use the CPU's bf16 dot-product instruction (vdpbf16ps) now.
bool fused_bf16_uses_dot_instructions();
/// Where bf16 Q·Kᵀ and P·V of a call with head dim d would run now: "amx" (tiles: AVX3_DL on a
/// CPU with AMX-BF16 and d a multiple of 32), "vdpbf16ps" (the dot-product instruction) or
/// "float32" (bf16 widened when packed, float32 FMAs).
const char* fused_bf16_products(int64_t d);
/// Whether a call with attention weights takes the one-pass path (each block's probabilities kept
/// and normalised once at the end) rather than the two-pass one: false without weights, and
/// when its scratch would exceed the bound (SdpaParams::weights_one_pass_max_bytes).
bool fused_weights_one_pass(const SdpaParams& p);
/// exp(x[i] − m) for i < n as the bf16 path forms its probabilities (exp_before_bf16 in
/// kernels/exp-inl.h) on the target a call would dispatch to now: for the tests of its error.
void fused_exp_before_bf16(const float* x, float m, float* out, int64_t n);

}  // namespace mha::kernels
