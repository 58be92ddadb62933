// mha/rope.h — rotary position embeddings (RoPE, Su et al. 2021).
//
// For a vector x of head dim d at absolute position p, the first `dims` features (dims even,
// ≤ d) are rotated in pairs by the angle p·θ^(−2i/dims), i = 0 … dims/2 − 1; features past
// `dims` pass through (partial rotary, as in GPT-NeoX / Phi). Two pairings are in common use:
//
//   RopePairing::HalfSplit    pair (i, i + dims/2): Hugging Face Llama's rotate_half
//       out[i]          = x[i]·cos − x[i + dims/2]·sin
//       out[i + dims/2] = x[i + dims/2]·cos + x[i]·sin
//   RopePairing::Interleaved  pair (2i, 2i + 1): GPT-J and the original paper
//       out[2i]     = x[2i]·cos − x[2i + 1]·sin
//       out[2i + 1] = x[2i + 1]·cos + x[2i]·sin
//
// Angles are computed in double from the integer position, so the rotation at position 100 000
// is as accurate as at position 1 (float32 angles lose ~1e-2 rad there).
//
// RopeDirection::Unrotate applies the inverse rotation (by −angle, i.e. sin negated), which is also
// the transpose: the gradient of a rotation is the same primitive run inverted.
#pragma once

#include <cstdint>

#include "mha/tensor.h"

namespace mha {

/// Which features are rotated together.
enum class RopePairing : uint8_t {
  HalfSplit,    ///< (i, i + dims/2): Hugging Face Llama / GPT-NeoX rotate_half
  Interleaved,  ///< (2i, 2i + 1): GPT-J, the original RoPE paper
};

/// Rotate by +angle (the embedding) or by −angle (its inverse and transpose, for gradients).
enum class RopeDirection : uint8_t { Rotate, Unrotate };

/// Rotary embedding settings. Off by default; inside MultiheadAttention it is applied to Q and K
/// after the projections and before attention, at absolute positions (full forward: 0 … T − 1;
/// incremental forward: the cache length of each sequence + i).
struct Rope {
  bool enabled = false;
  double theta = 10000.0;  ///< base θ
  int64_t dims = 0;        ///< rotated features per head, even, ≤ d; 0 = all of d
  RopePairing pairing = RopePairing::HalfSplit;

  static Rope half_split(double base = 10000.0, int64_t rotary_dims = 0) {
    return {true, base, rotary_dims, RopePairing::HalfSplit};
  }
  static Rope interleaved(double base = 10000.0, int64_t rotary_dims = 0) {
    return {true, base, rotary_dims, RopePairing::Interleaved};
  }
  int64_t rotary_dims(int64_t head_dim) const { return dims > 0 ? dims : head_dim; }
  /// Throws mha::Error when θ is not > 0 and finite, or dims is odd, negative or > head_dim.
  void validate(int64_t head_dim) const;
  bool operator==(const Rope&) const = default;
};

/// Rotates x (B, heads, T, d) in place; row t of batch b sits at absolute position
/// `start[b] + t` (`start` has B entries; nullptr = 0 for every batch). Unrotate rotates by the
/// negated angles instead, undoing Rotate (up to float rounding). Validates its arguments (each
/// start[b] in [0, 2⁴⁰ − T], as positions are everywhere).
void apply_rope(View4<float> x, const Rope& rope, const int64_t* start = nullptr,
                RopeDirection direction = RopeDirection::Rotate);

}  // namespace mha
