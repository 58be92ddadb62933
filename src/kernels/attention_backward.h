// kernels/attention_backward.h — the kernel-level interface of the SDPA backward pass.
//
// Forward (per query row i, head h, K/V head g = h / group):
//   s_j  = scale · q_i·k_j + add_ij          (hidden keys: s_j = −inf)
//   p_j  = exp(s_j − lse_i)                   lse_i = log Σ_j exp(s_j)
//   p̃_j  = p_j · keep_ij / (1 − p_drop)       (p̃ = p without dropout)
//   o_i  = Σ_j p̃_j v_j
// Backward, given do_i = ∂L/∂o_i:
//   dv_j += p̃_j do_i            dp̃_j = do_i·v_j         dp_j = dp̃_j · keep_ij / (1 − p_drop)
//   D_i   = Σ_j p_j dp_j = do_i·o_i
//   ds_j  = p_j (dp_j − D_i)    dq_i = scale Σ_j ds_j k_j     dk_j += scale ds_j q_i
// Score edits (kernels/score_edits.h): with softcap, ds_j is multiplied by 1 − tanh²(t_j / c)
// before the two products; ALiBi is an additive term (no gradient); a sink z (in lse) gives
//   dz = −Σ_{b,i} exp(z − lse_i) · D_i.
// Same masks, broadcast rules and workspace conventions as kernels/attention.h.
#pragma once

#include <cstddef>
#include <string>

#include "kernels/attention.h"

namespace mha::kernels {

struct SdpaBackwardParams {
  SdpaParams fwd;                   // q, k, v, scale, masks, dropout, threads (fwd.out/weights/lse unused)
  View4<const float> out;           // (B, h, T_q, d_v): the forward's output
  View4<const float> dout;          // (B, h, T_q, d_v)
  View4<const float> lse;           // (B, h, T_q, 1)
  View4<float> dq;                  // (B, h, T_q, d)
  View4<float> dk;                  // (B, kv, T_k, d)
  View4<float> dv;                  // (B, kv, T_k, d_v)
  float* dsinks = nullptr;          // (h): ∂L/∂(sink logit) when fwd.edits.sinks is set, else unused (may be null)
  bool lse_over_more_keys = false;  // SdpaOptions::lse_over_more_keys: lse used as given, no renormalising
};

/// Whether query row (b, h, i) saw no key in the forward: every key hidden from it or scoring −inf
/// (its output is then 0, a constant, and it gives nothing to any gradient). From lse where that
/// decides it (−inf: yes; without a sink, finite or NaN: no); with a sink, whose logit is then the
/// lse, by going over the row's keys (rare: a row whose lse is exactly the sink logit and whose
/// output is 0; a row that saw keys whose weight rounds away beside the sink's is not empty).
bool row_saw_no_key(const SdpaBackwardParams& p, int64_t b, int64_t h, int64_t i);

// ---- the reference oracle: plain loops, double accumulation, single-threaded ----------------
/// Recomputes each row's softmax in double from the scores rounded to float as the forward rounds
/// them (reads neither out nor lse, but for a packed batch's sink gradient, packed_sinks_gradient).
size_t reference_backward_workspace_doubles(const SdpaBackwardParams& p);
void sdpa_backward_reference(const SdpaBackwardParams& p, double* workspace);

// ---- the fused kernel: blocks of queries × keys, P recomputed from the saved lse -------------
bool fused_backward_supports(const SdpaBackwardParams& p, std::string* why);
size_t fused_backward_workspace_floats(const SdpaBackwardParams& p);
void sdpa_backward_fused(const SdpaBackwardParams& p, float* workspace);

}  // namespace mha::kernels
