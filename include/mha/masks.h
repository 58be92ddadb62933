// mha/masks.h — which keys a query may see, named by meaning, and dropout: the value types that
// sdpa() takes in SdpaOptions and the kernels read. (docs/semantics.md says what each promises.)
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <ranges>
#include <span>
#include <vector>

#include "mha/tensor.h"

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
  /// The largest |offset| and window accepted (2⁴⁰; beyond, an error): positions q + offset −
  /// window are then formed far inside int64.
  static constexpr int64_t kMaxPosition = int64_t{1} << 40;

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
/// A key hidden by this mask (or by Causal, or by −inf in AdditiveMask) from some queries only is
/// not promised to be unread: the fused kernels load every key of a tile that one of its queries
/// sees, so NaN or ±inf in its K/V rows may reach other rows of that tile (docs/semantics.md,
/// 'Padded keys are never read'). Use KeyPadding or a −inf KeyBias for keys that must not be read.
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
/// (PyTorch's float key_padding_mask). A −inf entry masks the key out exactly like KeyPadding:
/// its K and V rows are never read, on every path.
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

// ---- score edits: ALiBi, logit softcapping, attention sinks (docs/semantics.md, 'Score edits') --
// Order for each score: t = scale·q·k; s = c·tanh(t/c) (softcap); s += additive masks + ALiBi;
// hidden keys −inf; softmax with the sinks in the denominator.

/// Floats the caller owns and keeps alive while the options are used: std::span<const float>,
/// except that a temporary vector, array or brace list does not compile into it.
/// `options.alibi.slopes = alibi_slopes(h);` compiled and left the span pointing into a vector
/// freed at the semicolon (the kernels read whatever came there next); keep the vector in a
/// variable and assign that. (A span made explicitly, std::span<const float>(temporary), is the
/// caller's to keep alive, as any span.)
struct BorrowedFloats : std::span<const float> {
  using std::span<const float>::span;
  BorrowedFloats() = default;
  BorrowedFloats(std::span<const float> s) : std::span<const float>(s) {}  // NOLINT: implicit, as a span
  BorrowedFloats(std::vector<float>&&) = delete;
  BorrowedFloats(const std::vector<float>&&) = delete;
  template <std::size_t N>
  BorrowedFloats(std::array<float, N>&&) = delete;
  template <std::size_t N>
  BorrowedFloats(const std::array<float, N>&&) = delete;
  BorrowedFloats(std::initializer_list<float>) = delete;
};

/// ALiBi (Press et al., BLOOM, MPT): adds −m_h · (q_pos − k_pos) to the scores of query head h,
/// computed from positions in the kernels (no T_q × T_k tensor). Positions align like the causal
/// mask in use (q_pos = i + offset, k_pos = j; bottom-right, offset T_k − T_q, without one), so the
/// term is the relative distance and KV-cache decoding agrees with the full forward. Keys after
/// the query (non-causal use) get +m_h · distance. Slopes are constants: no gradient.
struct Alibi {
  BorrowedFloats slopes;  ///< one finite slope per query head; empty = off (the caller keeps them)
  bool enabled() const { return !slopes.empty(); }
};

/// The standard ALiBi slope schedule for `heads` heads (Press et al.; BLOOM's recipe for a head
/// count that is not a power of two): for n = 2^k, m_i = 2^(−8(i+1)/n); otherwise the n' = 2^⌊log₂ h⌋
/// schedule followed by every other slope of the 2n' schedule. Throws for heads < 0.
[[nodiscard]] std::vector<float> alibi_slopes(int64_t heads);

/// Learned attention sinks (gpt-oss): per query head h a logit z_h that joins every row's softmax
/// denominator without a value: p_j = e^{s_j} / (e^{z_h} + Σ_k e^{s_k}). The returned lse
/// includes it; a row with no visible key gives out = 0 and lse = z_h (not −inf).
struct AttentionSinks {
  BorrowedFloats logits;  ///< one finite logit per query head; empty = off (the caller keeps them)
  bool enabled() const { return !logits.empty(); }
};

}  // namespace mha

// A view, like std::span: algorithms may return iterators into it from a temporary BorrowedFloats.
template <>
inline constexpr bool std::ranges::enable_borrowed_range<mha::BorrowedFloats> = true;
