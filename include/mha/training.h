// mha/training.h — gradients: the backward pass of sdpa() and of MultiheadAttention.
//
// SDPA level:   sdpa(q, k, v, opt) → out, lse          sdpa_backward(…, out, d_out, lse, opt) → dq, dk, dv
// Module level: forward_train(module, q, k, v, opt) → output + MhaContext
//               backward(module, ctx, d_output) → d query / key / value and every parameter's gradient
//
// The backward pass obeys every promise of docs/semantics.md that the forward does: the same masks and
// causal alignment, fully masked rows give zero gradient, padded keys are never read (their dK and
// dV are 0), grouped-query dK/dV are summed over each group's query heads, dropout regenerates the
// forward's mask from the counter-based generator (same seed), and results are bitwise identical for
// any thread count.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mha/module.h"
#include "mha/sdpa.h"
#include "mha/tensor.h"

namespace mha {

// ---- scaled dot-product attention --------------------------------------------------------------

/// Where sdpa_backward writes (each overwritten): dq (B, h, T_q, d), dk (B, kv, T_k, d),
/// dv (B, kv, T_k, d_v). Strided views, like the forward's inputs.
struct SdpaGrads {
  View4<float> dq;
  View4<float> dk;
  View4<float> dv;
  /// (h): ∂loss/∂(sink logit) per head, summed over batches and rows; written when opt.sinks is
  /// set and this is not empty (then it must have h entries).
  std::span<float> dsinks = {};
};

/// Gradients of sdpa() with respect to q, k and v, given d_out = ∂loss/∂out.
/// `out` and `lse` (B, h, T_q, 1) are what sdpa() wrote for the same inputs and the same options
/// (ask for lse in SdpaOutputs); dropout uses opt.dropout's seed, so pass the forward's options.
/// The reference backend recomputes everything in double and does not read out/lse's values (their
/// views are still required and checked).
void sdpa_backward(View4<const float> q, View4<const float> k, View4<const float> v, View4<const float> out,
                   View4<const float> d_out, View4<const float> lse, const SdpaOptions& opt, const SdpaGrads& grads);

/// Which backward kernel Backend::Auto would use for this request, and why.
std::string sdpa_backward_dispatch_reason(View4<const float> q, View4<const float> k, View4<const float> v,
                                          const SdpaOptions& opt);

/// Owning convenience form: q (B, h, T_q, d), k/v (B, kv, T_k, ·), out and d_out (B, h, T_q, d_v),
/// lse (B, h, T_q) as sdpa(…, Want::Lse) returns it.
struct SdpaGradTensors {
  Tensor dq, dk, dv;
  Tensor dsinks = {};  ///< (h) when opt.sinks is set, else empty
};
SdpaGradTensors sdpa_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& d_out,
                              const Tensor& lse, const SdpaOptions& opt = {});

/// Gradients of sdpa_varlen() (mha/sdpa.h): the same packed views and offsets as the forward,
/// out / d_out (1, h, total_q, d_v), lse (1, h, total_q, 1) and grads dq (1, h, total_q, d),
/// dk (1, kv, total_k, d), dv (1, kv, total_k, d_v), all views of packed arrays.
void sdpa_backward_varlen(View4<const float> q, View4<const float> k, View4<const float> v, View4<const float> out,
                          View4<const float> d_out, View4<const float> lse, const VarlenBatch& seqs,
                          const SdpaOptions& opt, const SdpaGrads& grads);
/// Owning form on packed tensors: q (total_q, h, d), k/v (total_k, kv, ·), out and d_out
/// (total_q, h, d_v), lse (total_q, h) as sdpa_varlen(…, Want::Lse) returns it.
SdpaGradTensors sdpa_backward_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                     const Tensor& d_out, const Tensor& lse, const VarlenBatch& seqs,
                                     const SdpaOptions& opt = {});

// ---- the multi-head module -----------------------------------------------------------------------

namespace detail {
struct TrainBuffers;  // layers/module_backward.cpp: the context's buffers, checked out of the module's pool
}  // namespace detail

/// What forward_train saves for backward. Move-only: its views point into its own storage.
/// The query/key/value tensors passed to forward_train are referenced, not copied (they are needed
/// for the weight gradients): keep them alive and unchanged until backward() has run.
/// The large buffers (the projected rows and the attention heads) are checked out of the module's
/// workspace (MultiheadAttention::release_workspace) and go back to it when the context is
/// destroyed, so the next step reuses them instead of allocating; contexts alive at the same time
/// each hold their own.
struct MhaContext {
  MhaContext() = default;
  MhaContext(MhaContext&&) = default;
  MhaContext& operator=(MhaContext&&) = default;
  MhaContext(const MhaContext&) = delete;
  MhaContext& operator=(const MhaContext&) = delete;

  MhaConfig config;  ///< the module's configuration at forward time (checked by backward)
  const Tensor* query = nullptr;
  const Tensor* key = nullptr;
  const Tensor* value = nullptr;
  bool unbatched = false;
  bool packed_self_attention = false;  ///< Q, K and V came from one GEMM into `qkv`

  std::span<float> qkv;           ///< projected Q (N_q, h·d), K and V (N_k, kv·d) rows (or one (N, (h+2kv)·d) block)
  Tensor k_ext, v_ext;            ///< (B, kv, S, d): K/V with bias_k / zero positions appended, when any
  View4<float> q_heads;           ///< (B, h, T_q, d) over qkv
  View4<float> k_heads, v_heads;  ///< (B, kv, S, d) over qkv or k_ext / v_ext
  std::span<const float> heads;   ///< (N_q, h·d): the attention output before W_O, in the query's row layout
  Tensor lse;                     ///< (B, h, T_q): log-sum-exp of each score row (−inf when fully masked)
  BoolTensor allowed, key_padding;  ///< masks widened to S key positions (empty when absent)
  Tensor additive, key_bias;
  std::optional<VarlenBatch> packed;  ///< the packed batch's offsets, when the input was packed
  SdpaOptions sdpa_options;           ///< scale, masks (views into the tensors above), dropout seed, backend, threads
  std::shared_ptr<detail::TrainBuffers> buffers;  ///< owns the storage of qkv and heads
};

struct MhaTrainOutput {
  Tensor output;  ///< same as MultiheadAttention::forward's output
  MhaContext context;
};

/// The module's forward pass in training form: the same result as module.forward(…, options)
/// (options.mode decides whether dropout is active), plus what backward() needs.
/// Attention weights are not returned here (options.need_weights must be None).
MhaTrainOutput forward_train(const MultiheadAttention& module, const Tensor& query, const Tensor& key,
                             const Tensor& value, const MhaForwardOptions& options = {});

/// Gradients, named like the parameters. Parameters the configuration does not use stay empty.
/// query/key/value are reported per argument even when the forward got the same tensor three
/// times (self-attention): the caller sums them.
struct MhaGradients {
  Tensor query, key, value;  ///< same shapes as the forward's inputs
  MhaParameters params;      ///< d in_proj_weight (or q/k/v_proj_weight), in_proj_bias, bias_k, bias_v, out_proj
};

/// Backpropagates d_output (the output's shape) through the forward that produced `ctx`.
MhaGradients backward(const MultiheadAttention& module, const MhaContext& ctx, const Tensor& d_output);

}  // namespace mha
