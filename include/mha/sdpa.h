// mha/sdpa.h — scaled dot-product attention over strided views.
//
//   out[b, i, q, :] = Σ_k P[b, i, q, k] · V[b, g(i), k, :]
//   P = softmax_k( scale · Q[b,i,q,:]·K[b,g(i),k,:] + bias + key_bias , masked )
// with the optional score edits (softcap c·tanh(·/c) of the scaled product, ALiBi −m_h·(q_pos −
// k_pos), a sink logit per head in the denominator; docs/semantics.md, 'Score edits'):
//   P = softmax_k∪sink( softcap(scale·q·k) + bias + key_bias + alibi , masked ), sink column dropped
//
// Shapes: Q (B, h, T_q, d), K (B, kv, T_k, d), V (B, kv, T_k, d_v), out (B, h, T_q, d_v);
// h must be a multiple of kv and query head i reads K/V head g(i) = i / (h / kv)
// (grouped-query and multi-query attention; K/V are never copied per query head).
// Every promise of docs/semantics.md holds on every backend: masks named by meaning, causal with an
// explicit alignment, fully masked rows give zeros (lse = −inf), padded keys (and keys whose
// key_bias is −inf) are never read, a visible NaN makes its row NaN (lse NaN), dropout from a
// counter-based generator, bitwise-identical results for any thread count. Empty inputs (B, h,
// T_q or T_k = 0) give empty outputs; T_k = 0 with T_q > 0 gives fully masked rows.
// One documented limit (docs/semantics.md, 'Padded keys are never read'): a key hidden only from
// some queries (causal, window, AllowedMask, −inf in AdditiveMask) may still be loaded by the fused
// kernels, so a NaN or ±inf in its V row (fused forward and decode) or K row (fused backward's dQ)
// can make other rows of the same tile NaN; the reference kernels never read it for a query
// that cannot see it. With finite K and V every path gives the same answer.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "mha/masks.h"
#include "mha/tensor.h"
#include "mha/threads.h"

namespace mha {

enum class Backend : uint8_t {
  Auto,       ///< the fastest path that supports the request
  Reference,  ///< the readable oracle: plain loops, double accumulation
  Fused,      ///< the tiled online-softmax kernel
};

struct SdpaOptions {
  std::optional<float> scale;  ///< default 1/√d (d of Q/K, not of V)
  Masks masks;
  Dropout dropout;
  Backend backend = Backend::Auto;
  int threads = 0;         ///< 0 = library default (mha/threads.h)
  Alibi alibi{};           ///< ALiBi slopes, one per query head (mha/masks.h); off when empty
  float softcap = 0.0f;    ///< c > 0: scores s → c·tanh(s/c) after scaling, before masks; 0 = off
  AttentionSinks sinks{};  ///< learned sink logit per query head (mha/masks.h); off when empty
};

/// Where the results go. `out` is required; `weights` (B, h, T_q, T_k) and `lse` (B, h, T_q, 1)
/// are written only when defined() (they point at data). Weights are the probabilities actually
/// used (after dropout).
struct SdpaOutputs {
  View4<float> out;
  View4<float> weights;
  View4<float> lse;
};

/// Checks every shape and mask against the inputs; throws mha::Error naming what is wrong.
void check_sdpa_args(View4<const float> q, View4<const float> k, View4<const float> v, const SdpaOptions& opt,
                     const SdpaOutputs& outputs);

/// Scaled dot-product attention into caller-owned outputs.
void sdpa(View4<const float> q, View4<const float> k, View4<const float> v, const SdpaOptions& opt,
          const SdpaOutputs& outputs);

/// bfloat16 inputs: Q/K/V stored as bf16, products accumulated and the softmax computed in
/// float32, float32 outputs. Same shapes, masks and promises as the float32 form.
void sdpa(View4<const bf16> q, View4<const bf16> k, View4<const bf16> v, const SdpaOptions& opt,
          const SdpaOutputs& outputs);

/// Owning convenience form: Q (B, h, T_q, d), K/V (B, kv, T_k, ·) as tensors.
struct SdpaResult {
  Tensor out;      ///< (B, h, T_q, d_v)
  Tensor weights;  ///< (B, h, T_q, T_k), empty unless requested
  Tensor lse;      ///< (B, h, T_q), empty unless requested
};
enum class Want : uint8_t { Output = 0, Weights = 1, Lse = 2, WeightsAndLse = 3 };
SdpaResult sdpa(const Tensor& q, const Tensor& k, const Tensor& v, const SdpaOptions& opt = {},
                Want want = Want::Output);

/// Which backend `Auto` would pick for this request, and why (for --verbose and diagnostics).
std::string sdpa_dispatch_reason(View4<const float> q, View4<const float> k, View4<const float> v,
                                 const SdpaOptions& opt, const SdpaOutputs& outputs);

}  // namespace mha
