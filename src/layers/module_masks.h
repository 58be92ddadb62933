// layers/module_masks.h — the module's masks as the SDPA kernels see them. Internal: shared by the
// forward (module.cpp), the training forward (module_backward.cpp) and anything else that runs
// the module's attention, so every path widens and combines masks the same way.
#pragma once

#include <cstdint>

#include "mha/module.h"

namespace mha::detail {

/// Owners of the widened masks; the views in SdpaOptions::masks point into them.
struct ModuleMasks {
  BoolTensor allowed;      ///< (planes, T_q, S), nonzero = may attend
  Tensor additive;         ///< (planes, T_q, S)
  BoolTensor key_padding;  ///< (B, S), 1 = padding
  Tensor key_bias;         ///< (B, S)
};

/// Turns the module's attn_mask / key_padding_mask / causal options into SDPA masks over
/// S = T_k + extra key positions (the appended bias_k / zero positions, which stay visible:
/// PyTorch pads its masks with visible columns for them). With extra positions, causal masking
/// speaks of the real keys only, so it is folded into an allowed mask over those columns.
/// attn_mask is (T_q, T_k) or (B·h, T_q, T_k); key padding (B, T_k). Shapes are the caller's to
/// have checked. Writes the owners into `owned` and points `sopt.masks` at them; an attn_mask that
/// needs no widening is not copied unless `own` (the views then point into `options`, which must
/// outlive them): at T = 8192 a float mask is 256 MiB, and the module copied it on every call.
void widen_module_masks(const MhaForwardOptions& options, int64_t batch, int64_t heads, int64_t t_q, int64_t t_k,
                        int64_t extra, bool own, ModuleMasks& owned, SdpaOptions& sopt);

}  // namespace mha::detail
