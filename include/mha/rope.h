// mha/rope.h — rotary position embeddings (RoPE, Su et al. 2021).
//
// For a vector x of head dim d at absolute position p, the first `dims` features (dims even,
// ≤ d) are rotated in pairs by the angle p·θ^(−2i/dims), i = 0 … dims/2 − 1; features past
// `dims` pass through (partial rotary, as in GPT-NeoX / Phi). Two pairings are in common use:
//
//   RopeLayout::HalfSplit    pair (i, i + dims/2): Hugging Face Llama's rotate_half
//       out[i]          = x[i]·cos − x[i + dims/2]·sin
//       out[i + dims/2] = x[i + dims/2]·cos + x[i]·sin
//   RopeLayout::Interleaved  pair (2i, 2i + 1): GPT-J and the original paper
//       out[2i]     = x[2i]·cos − x[2i + 1]·sin
//       out[2i + 1] = x[2i + 1]·cos + x[2i]·sin
//
// Angles are computed in double from the integer position, so the rotation at position 100 000
// is as accurate as at position 1 (float32 angles lose ~1e-2 rad there).
#pragma once

#include <cstdint>

#include "mha/tensor.h"

namespace mha {

enum class RopeLayout : uint8_t {
  HalfSplit,    ///< (i, i + dims/2): Hugging Face Llama / GPT-NeoX rotate_half
  Interleaved,  ///< (2i, 2i + 1): GPT-J, the original RoPE paper
};

/// Rotary embedding settings. Off by default; inside MultiheadAttention it is applied to Q and K
/// after the projections and before attention, at absolute positions (full forward: 0 … T − 1;
/// incremental forward: the cache length of each sequence + i).
struct Rope {
  bool enabled = false;
  double theta = 10000.0;  ///< base θ
  int64_t dims = 0;        ///< rotated features per head, even, ≤ d; 0 = all of d
  RopeLayout layout = RopeLayout::HalfSplit;

  static Rope half_split(double base = 10000.0, int64_t rotary_dims = 0) {
    return {true, base, rotary_dims, RopeLayout::HalfSplit};
  }
  static Rope interleaved(double base = 10000.0, int64_t rotary_dims = 0) {
    return {true, base, rotary_dims, RopeLayout::Interleaved};
  }
  int64_t rotary_dims(int64_t head_dim) const { return dims > 0 ? dims : head_dim; }
  /// Throws mha::Error when θ is not > 0 and finite, or dims is odd, negative or > head_dim.
  void validate(int64_t head_dim) const;
  bool operator==(const Rope&) const = default;
};

/// Rotates x (B, heads, T, d) in place; row t of batch b sits at absolute position
/// `start[b] + t` (`start` has B entries; nullptr = 0 for every batch). Validates its arguments.
void apply_rope(View4<float> x, const Rope& rope, const int64_t* start = nullptr);

}  // namespace mha
