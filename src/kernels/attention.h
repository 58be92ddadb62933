// kernels/attention.h — the kernel-level interface for scaled dot-product attention.
//
// Kernels take a params struct of views (pointers, extents, strides) that the public layer has
// already validated and broadcast: every mask view here has the full (B, h, T_q, T_k) extents
// (key masks: (B, 1, 1, T_k)), with stride 0 along broadcast dimensions. Kernels neither allocate
// nor do I/O: scratch comes from the caller, sized by the matching *_workspace_floats().
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/common.h"
#include "kernels/masking.h"
#include "kernels/score_edits.h"
#include "mha/masks.h"

namespace mha::kernels {

/// Q, K or V as a kernel reads it: a strided (B, heads, T, d) view whose element type is the
/// params' dtype; as<T>() gives the typed view.
struct InputView {
  const void* data = nullptr;
  std::array<int64_t, 4> shape{0, 0, 0, 0};
  std::array<int64_t, 4> stride{0, 0, 0, 0};

  InputView() = default;
  bool defined() const { return data != nullptr; }
  template <class T>
  InputView(View4<T> v) : data(v.data), shape(v.shape), stride(v.stride) {}  // NOLINT: a view is an input view
  template <class T>
  View4<const T> as() const {
    return {static_cast<const T*>(data), shape, stride};
  }
};

/// A packed batch of variable-length sequences (FlashAttention's varlen): when defined, q/k/v/out/lse
/// are packed (total, heads, ·) arrays viewed as (1, heads, total, ·), and sequence s owns query rows
/// [cu_q[s], cu_q[s+1]) and key rows [cu_k[s], cu_k[s+1]); no row attends across sequences and the
/// causal rule is aligned per sequence. The public layer has checked the offsets (kernels/varlen.h).
struct Varlen {
  const int64_t* cu_q = nullptr;  // (seqs + 1), non-decreasing, cu_q[0] = 0, cu_q[seqs] = total_q
  const int64_t* cu_k = nullptr;  // (seqs + 1), likewise for keys
  int64_t seqs = 0;
  bool defined() const { return cu_q != nullptr; }
};

struct SdpaParams {
  DType dtype = DType::F32;  // of q, k and v (outputs, masks and the softmax are float32)
  InputView q;               // (B, h, T_q, d)
  InputView k;               // (B, kv, T_k, d)
  InputView v;               // (B, kv, T_k, d_v)
  float scale = 1.0f;
  Masks masks;  // broadcast to full extents (see above)
  Dropout dropout;
  ScoreEdits edits;          // softcap, ALiBi, sinks (kernels/score_edits.h); off by default
  View4<float> out;          // (B, h, T_q, d_v), required
  View4<float> weights;      // (B, h, T_q, T_k), optional
  View4<float> lse;          // (B, h, T_q, 1), optional
  View4<float> weights_avg;  // (B, 1, T_q, T_k), optional: weights averaged over the h heads
  int threads = 1;
  Varlen varlen;  // packed sequences; when defined the masks are only causal (no dropout, no weights)
  double* thread_busy_ms = nullptr;  // optional, `threads` entries: the fused kernel adds each thread's busy time
  // The fused kernel's bound on its one-pass weights scratch in bytes (0: its own,
  // fused::kOnePassWeightsMaxBytes); tests lower it to reach the two-pass path on small shapes.
  int64_t weights_one_pass_max_bytes = 0;
  // The weights outputs' size in bytes from which the fused kernel writes them with non-temporal
  // stores (0: its own, fused::kStreamWeightsBytes); tests set 1 to reach them on small shapes.
  int64_t weights_stream_min_bytes = 0;

  int64_t batch() const { return q.shape[0]; }
  int64_t heads() const { return q.shape[1]; }
  int64_t kv_heads() const { return k.shape[1]; }
  int64_t t_q() const { return q.shape[2]; }
  int64_t t_k() const { return k.shape[2]; }
  int64_t d() const { return q.shape[3]; }
  int64_t d_v() const { return v.shape[3]; }
  int64_t group() const { return heads() / kv_heads(); }  // query heads per K/V head
};

/// True when key j of batch b is hidden from every query: padded, or its key_bias is −inf
/// (PyTorch's float key_padding_mask). Such a key is never read — its K and V rows are not touched —
/// on any path (docs/semantics.md, 'Padded keys are never read').
inline bool key_dropped(const Masks& m, int64_t b, int64_t j) {
  if (m.key_padding.view.defined() && m.key_padding.view(b, 0, 0, j)) return true;
  return m.key_bias.view.defined() && m.key_bias.view(b, 0, 0, j) == kNegInf;
}

/// True when key j is hidden from query i of batch b, head h by any mask other than an additive
/// −inf in the per-position bias (those are found when the score is formed). Shared by every
/// kernel so they agree exactly.
inline bool key_hidden(const SdpaParams& p, int64_t b, int64_t h, int64_t i, int64_t j, int64_t causal_offset) {
  const Masks& m = p.masks;
  if (key_dropped(m, b, j)) return true;
  if (!CausalRule{m.causal.enabled(), causal_offset, m.causal.window}.sees(i, j)) return true;
  if (m.allowed.view.defined() && !m.allowed.view(b, h, i, j)) return true;
  return false;
}

/// The additive terms for one score (bias + key_bias), 0 when there are none.
inline float additive_terms(const SdpaParams& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  float add = 0.0f;
  if (p.masks.bias.view.defined()) add += p.masks.bias.view(b, h, i, j);
  if (p.masks.key_bias.view.defined()) add += p.masks.key_bias.view(b, 0, 0, j);
  return add;
}

/// Query row i's position minus its key row index's position offset, for ALiBi: q_pos = i + this,
/// k_pos = j. Aligned like the causal rule in use; bottom-right (T_k − T_q) without one.
inline int64_t alibi_offset(const SdpaParams& p) {
  return p.masks.causal.enabled() ? p.masks.causal.offset_for(p.t_q(), p.t_k()) : p.t_k() - p.t_q();
}

// ---- the reference oracle ------------------------------------------------------------------
/// Plain loops, double accumulation, one row at a time; single-threaded; float32 or bfloat16
/// inputs (widened exactly as they are read). Workspace: 2·T_k floats (a row's scores and which keys it cannot see).
size_t reference_workspace_floats(const SdpaParams& p);
void sdpa_reference(const SdpaParams& p, float* workspace);

// ---- the fused kernel (tiled, online softmax, SIMD, threads; float32 or bfloat16 inputs) ----
/// Whether the fused kernel handles this request; when not, *why says which feature is missing.
bool fused_supports(const SdpaParams& p, std::string* why);
size_t fused_workspace_floats(const SdpaParams& p);
void sdpa_fused(const SdpaParams& p, float* workspace);

}  // namespace mha::kernels
