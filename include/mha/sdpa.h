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
// can make other rows of the same tile NaN, as can a NaN in d out reach dV of keys hidden from
// its row (fused backward); the reference kernels never read it for a query that cannot see it.
// With finite K, V and d out every path gives the same answer.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mha/masks.h"
#include "mha/tensor.h"
#include "mha/threads.h"

namespace mha {

enum class Backend : uint8_t {
  Auto,       ///< the fastest path that supports the request
  Reference,  ///< the readable oracle: plain loops, double accumulation
  Fused,      ///< the tiled online-softmax kernel
};

/// How long each thread worked in the fused kernel (for benchmarks and load-balance checks). Every
/// call given one (SdpaOptions::thread_stats) counts itself in `calls`, sizes busy_ms to at least
/// its thread count and, on the fused path, adds to busy_ms[t] thread t's time from entering the
/// parallel region to finishing its last work item, waits at barriers left out. The reference
/// path adds no time.
struct SdpaThreadStats {
  std::vector<double> busy_ms;
  int64_t calls = 0;
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
  /// When set, each thread's busy time is added here (SdpaThreadStats); off by default.
  SdpaThreadStats* thread_stats = nullptr;
  /// sdpa_backward only: the lse passed in came from a softmax over more keys than this call's (a
  /// block of ring attention's keys with the whole row's lse: FlashAttention's way of splitting a
  /// backward over keys), and the fused backward uses it as given. By default it renormalises the
  /// rows with |lse| ≥ 64 over this call's keys first (docs/semantics.md, 'Large common offsets'),
  /// which assumes they are all the keys. The reference backward recomputes its own lse and takes
  /// neither.
  bool lse_over_more_keys = false;
};

/// Where the results go. `out` is required; `weights` (B, h, T_q, T_k) and `lse` (B, h, T_q, 1)
/// are written only when defined() (they point at data). Weights are the probabilities actually
/// used (after dropout). No output's byte range may overlap that of q, k, v, a mask or another
/// output, and no output may name an element twice: such a call is refused (docs/semantics.md,
/// 'Bad input is an error'; check_sdpa_args checks this too).
struct SdpaOutputs {
  View4<float> out;
  View4<float> weights;
  View4<float> lse;
  /// (B, 1, T_q, T_k): the weights averaged over the h query heads (nn.MultiheadAttention's
  /// average_attn_weights), written without a per-head intermediate on the fused path.
  View4<float> averaged_weights{};  // (a default initializer: {out, weights, lse} stays complete)
};

/// Checks every shape and mask against the inputs; throws mha::Error naming what is wrong.
void check_sdpa_args(View4<const float> q, View4<const float> k, View4<const float> v, const SdpaOptions& opt,
                     const SdpaOutputs& outputs);

/// Scaled dot-product attention into caller-owned outputs. Every element of each output given is
/// written, on every path; what the buffers held before is never read.
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

// ---- packed variable-length sequences (FlashAttention's varlen, xFormers' BlockDiagonalMask) ----
//
// A batch of B sequences of different lengths stored back to back, with no padding: Q as
// (total_q, h, d), K as (total_k, kv, d), V as (total_k, kv, d_v), out as (total_q, h, d_v).
// Sequence s owns query rows [cu_seqlens_q[s], cu_seqlens_q[s+1]) and key rows
// [cu_seqlens_k[s], cu_seqlens_k[s+1]); no query attends a key of another sequence, and
// opt.masks.causal (with its window) is aligned per sequence: top-left, bottom-right (offset
// T_k,s − T_q,s) or an explicit offset, for each sequence's own lengths. Work is Σ_s T_q,s·T_k,s
// (nothing padded is stored or computed); the fused kernel deals (sequence, kv-head, block of
// queries) items longest first to the threads, and the result does not depend on the thread count.
// Only causal masking is available here (the other masks index a padded (B, T) layout), and no
// dropout or attention weights.

/// Cumulative sequence offsets of a packed batch: B + 1 values, non-decreasing, from 0 to the
/// total number of rows (a zero-length sequence repeats a value). From int32 or int64 values.
class SeqOffsets {
 public:
  SeqOffsets() = default;
  SeqOffsets(std::span<const int64_t> offsets) : v_(offsets.begin(), offsets.end()) {}     // NOLINT: implicit
  SeqOffsets(std::span<const int32_t> offsets) : v_(offsets.begin(), offsets.end()) {}     // NOLINT: implicit
  SeqOffsets(std::initializer_list<int64_t> offsets) : v_(offsets) {}                      // NOLINT: implicit
  SeqOffsets(const std::vector<int64_t>& offsets) : v_(offsets) {}                         // NOLINT: implicit
  SeqOffsets(const std::vector<int32_t>& offsets) : v_(offsets.begin(), offsets.end()) {}  // NOLINT: implicit

  const std::vector<int64_t>& values() const { return v_; }
  int64_t seqs() const { return v_.empty() ? 0 : static_cast<int64_t>(v_.size()) - 1; }
  /// Length of sequence s (offsets assumed checked).
  int64_t length(int64_t s) const { return v_[static_cast<size_t>(s + 1)] - v_[static_cast<size_t>(s)]; }

 private:
  std::vector<int64_t> v_;
};

/// Where the sequences of a packed batch lie. max_seqlen_q / _k, when > 0, are checked as upper
/// bounds of every sequence's length (FlashAttention takes them for its grid; here they guard
/// against offsets that do not match what the caller meant); 0 = not checked.
struct VarlenBatch {
  SeqOffsets cu_seqlens_q;
  SeqOffsets cu_seqlens_k;  ///< same number of sequences as cu_seqlens_q
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;

  int64_t seqs() const { return cu_seqlens_q.seqs(); }
};

/// A packed (total, heads, d) row-major array as the (1, heads, total, d) view the packed entry
/// points take: strides (total·heads·d, d, heads·d, 1). No copy.
template <class T>
View4<T> packed_view(T* data, int64_t total, int64_t heads, int64_t d) {
  return {data, {1, heads, total, d}, {total * heads * d, d, heads * d, 1}};
}

/// Checks a packed batch's offsets against the totals; throws mha::Error naming what is wrong
/// (offsets not starting at 0, decreasing, last ≠ total, a length over its max, counts differing).
void check_varlen(const char* fn, const VarlenBatch& seqs, int64_t total_q, int64_t total_k);

/// Attention over a packed batch. q (1, h, total_q, d), k (1, kv, total_k, d), v (1, kv, total_k,
/// d_v) and outputs.out (1, h, total_q, d_v), outputs.lse (1, h, total_q, 1) are views of packed
/// arrays (packed_view(), or any strides); outputs.weights must be empty.
void sdpa_varlen(View4<const float> q, View4<const float> k, View4<const float> v, const VarlenBatch& seqs,
                 const SdpaOptions& opt, const SdpaOutputs& outputs);
void sdpa_varlen(View4<const bf16> q, View4<const bf16> k, View4<const bf16> v, const VarlenBatch& seqs,
                 const SdpaOptions& opt, const SdpaOutputs& outputs);

/// Owning form: q (total_q, h, d), k (total_k, kv, d), v (total_k, kv, d_v) tensors; out
/// (total_q, h, d_v) and, with Want::Lse, lse (total_q, h). Want::Weights is refused.
SdpaResult sdpa_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const VarlenBatch& seqs,
                       const SdpaOptions& opt = {}, Want want = Want::Output);

/// Which backend `Auto` would pick for this request, and why (for --verbose and diagnostics).
std::string sdpa_dispatch_reason(View4<const float> q, View4<const float> k, View4<const float> v,
                                 const SdpaOptions& opt, const SdpaOutputs& outputs);

}  // namespace mha
