// kernels/backward_fused.h — the fused backward kernel's SIMD targets, so tests can run every one.
//
// The kernel's entry points (fused_backward_supports, fused_backward_workspace_floats,
// sdpa_backward_fused) are declared in kernels/attention_backward.h.
#pragma once

#include <cstdint>
#include <vector>

namespace mha::kernels {

/// Highway target bits (HWY_AVX3, HWY_AVX2, …) of every target the fused backward was compiled for.
std::vector<int64_t> fused_backward_compiled_targets();
/// The target a call would dispatch to now (honours hwy::SetSupportedTargetsForTest).
int64_t fused_backward_dispatch_target();

}  // namespace mha::kernels
