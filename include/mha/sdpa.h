// mha/sdpa.h — scaled dot-product attention over strided views.
//
//   out[b, i, q, :] = Σ_k P[b, i, q, k] · V[b, g(i), k, :]
//   P = softmax_k( scale · Q[b,i,q,:]·K[b,g(i),k,:] + bias + key_bias , masked )
//
// Shapes: Q (B, h, T_q, d), K (B, kv, T_k, d), V (B, kv, T_k, d_v), out (B, h, T_q, d_v);
// h must be a multiple of kv and query head i reads K/V head g(i) = i / (h / kv)
// (grouped-query and multi-query attention; K/V are never copied per query head).
// Every promise of docs/semantics.md holds on every backend: masks named by meaning, causal with an
// explicit alignment, fully masked rows give zeros (lse = −inf), padded keys are never read,
// dropout from a counter-based generator, bitwise-identical results for any thread count.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "mha/tensor.h"
#include "mha/threads.h"

namespace mha {

/// Which keys a causal mask lets query q (of T_q) see: key k is visible when k ≤ q + offset.
struct Causal {
  enum class Align : uint8_t {
    None,         ///< no causal mask
    TopLeft,      ///< offset 0: PyTorch's is_causal (query 0 sees key 0 only)
    BottomRight,  ///< offset T_k − T_q: the last query sees every key (FlashAttention, KV-cache decoding)
    Offset,       ///< an explicit offset, e.g. the absolute position of query 0 in a cache
  };
  Align align = Align::None;
  int64_t offset = 0;  ///< used with Align::Offset only
  /// Sliding window: when > 0, key k is visible only if q + offset − window < k ≤ q + offset, i.e.
  /// the last `window` positions up to and including the query's own. 0 = unlimited.
  int64_t window = 0;

  static Causal none() { return {}; }
  static Causal top_left() { return {Align::TopLeft, 0}; }
  static Causal bottom_right() { return {Align::BottomRight, 0}; }
  static Causal with_offset(int64_t off) { return {Align::Offset, off}; }

  /// The same alignment, limited to the last `w` positions (sliding-window attention).
  Causal with_window(int64_t w) const {
    Causal c = *this;
    c.window = w;
    return c;
  }

  bool enabled() const { return align != Align::None; }
  /// The offset for these lengths (meaningless when !enabled()).
  int64_t offset_for(int64_t t_q, int64_t t_k) const {
    switch (align) {
      case Align::BottomRight:
        return t_k - t_q;
      case Align::Offset:
        return offset;
      default:
        return 0;
    }
  }
};

/// Positions that MAY be attended: nonzero = allowed. Broadcastable to (B, h, T_q, T_k):
/// each extent is either the full size or 1 (stride 0 is fine too).
struct AllowedMask {
  View4<const uint8_t> view;
};

/// A float bias added to the scores after scaling, broadcastable to (B, h, T_q, T_k).
/// −inf entries mask a position out.
struct AdditiveMask {
  View4<const float> view;
};

/// Per-batch key padding, shape (B, T_k) as a view (B, 1, 1, T_k): nonzero = padding.
/// Padded keys are skipped entirely: their K and V rows are never read.
struct KeyPadding {
  View4<const uint8_t> view;
};

/// A float bias per key, (B, T_k) as a view (B, 1, 1, T_k), added to every query's scores
/// (PyTorch's float key_padding_mask). −inf entries mask the key out.
struct KeyBias {
  View4<const float> view;
};

/// Every mask the kernels understand, applied together (a position is visible only when every
/// mask allows it). A view that is not defined() (no data) means "no such mask".
struct Masks {
  AllowedMask allowed;
  AdditiveMask bias;
  KeyPadding key_padding;
  KeyBias key_bias;
  Causal causal;
};

/// Dropout on the normalised probabilities, scaled by 1/(1 − p). Active when p > 0: the caller
/// (the module in training mode) decides. Keep-decisions come from a counter-based generator keyed
/// on (seed, batch, head, query, key) so tiling and threads cannot change them.
struct Dropout {
  float p = 0.0f;
  uint64_t seed = 0;
  bool active() const { return p > 0.0f; }
};

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
  int threads = 0;  ///< 0 = library default (mha/threads.h)
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
