// kernels/fused_forward.h — the fused forward kernel's extra entry points: bfloat16 inputs and
// the SIMD targets it was compiled for (so tests can run every one of them).
//
// The float32 entry points (fused_supports, fused_workspace_floats, sdpa_fused) are declared in
// kernels/attention.h with the rest of the kernel interface.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/attention.h"

namespace mha::kernels {

/// bfloat16 Q/K/V. The SdpaParams passed alongside carry everything else (masks, outputs,
/// scale, threads); their q/k/v views give the shapes only (data may be null).
struct Bf16Qkv {
  View4<const bf16> q;  // (B, h, T_q, d)
  View4<const bf16> k;  // (B, kv, T_k, d)
  View4<const bf16> v;  // (B, kv, T_k, d_v)
};

/// bf16 inputs, float32 accumulation and softmax; same workspace size as the float32 kernel.
void sdpa_fused_bf16(const SdpaParams& p, const Bf16Qkv& in, float* workspace);

/// Highway target bits (HWY_AVX3_DL, HWY_AVX2, …) of every target the kernel was compiled for.
std::vector<int64_t> fused_compiled_targets();
/// The target a call would dispatch to now (honours hwy::SetSupportedTargetsForTest).
int64_t fused_dispatch_target();
/// Whether bf16 Q·Kᵀ and P·V would use the CPU's bf16 dot-product instruction (vdpbf16ps) now.
bool fused_bf16_uses_dot_instructions();

}  // namespace mha::kernels
