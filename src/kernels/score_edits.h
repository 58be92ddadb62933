// kernels/score_edits.h — the score edits every attention kernel applies in the same order:
// logit softcapping, ALiBi, and learned attention sinks (docs/semantics.md, 'Score edits').
//
// Per score (query row i at position q_pos, key j at position k_pos, head h):
//   t   = scale · q·k                                   (the scaled dot product)
//   s   = c · tanh(t / c)            when softcap c > 0  (Gemma 2, FlashAttention: before masks)
//   s  += additive masks − m_h · (q_pos − k_pos)         (ALiBi: the relative distance, never a T×T tensor)
//   hidden keys: s = −inf
// Per row, a sink logit z_h joins the softmax denominator with no value:
//   p_j = exp(s_j) / (exp(z_h) + Σ_k exp(s_k)),   lse = log(exp(z_h) + Σ_k exp(s_k)).
// A row with no visible key then gives out = 0 and lse = z_h.
// The public layer has checked: slopes and sinks have h finite entries, c is finite and ≥ 0.
#pragma once

#include <cmath>
#include <cstdint>

namespace mha::kernels {

struct ScoreEdits {
  const float* alibi_slopes = nullptr;  ///< (h) ALiBi slope per query head, or null
  float softcap = 0.0f;                 ///< c > 0: s → c·tanh(s / c); 0 = off
  const float* sinks = nullptr;         ///< (h) sink logit per query head, or null

  bool any() const { return alibi_slopes != nullptr || softcap > 0.0f || sinks != nullptr; }
  bool alibi() const { return alibi_slopes != nullptr; }
  bool capped() const { return softcap > 0.0f; }
};

/// c · tanh(t / c): the capped score (float; the reference calls it in double).
inline float softcap_score(float t, float c) { return c * std::tanh(t / c); }
inline double softcap_score(double t, double c) { return c * std::tanh(t / c); }

/// −m · (q_pos − k_pos) = m · (k_pos − q_pos), with the distance formed exactly as a float.
inline float alibi_bias(float slope, int64_t q_pos, int64_t k_pos) { return slope * static_cast<float>(k_pos - q_pos); }

}  // namespace mha::kernels
