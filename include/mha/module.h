// mha/module.h — the multi-head attention module (torch.nn.MultiheadAttention, plus GQA/MQA).
//
//   Q = query · W_Qᵀ + b_Q   (…, h·d)      K = key · W_Kᵀ + b_K   (…, kv·d)
//   V = value · W_Vᵀ + b_V   (…, kv·d)     heads = sdpa(Q, K, V)  (B, h, T_q, d)
//   output = concat(heads) · W_Oᵀ + b_O   (…, E)
//
// d = embed_dim / num_heads, or head_dim_override when set (then h·d may differ from E, as in a
// module with some heads pruned). With num_kv_heads = kv < h, query head i uses K/V head i / (h / kv).
// Layouts: Layout::SeqFirst inputs are (T, B, E) (PyTorch's default), Layout::BatchFirst (B, T, E);
// a 2-D input (T, E) is unbatched in either layout.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mha/kv_cache.h"
#include "mha/rope.h"
#include "mha/sdpa.h"
#include "mha/tensor.h"

namespace mha {

class PagedKvCache;  // mha/paged_kv_cache.h

/// Where the batch axis is: SeqFirst (T, B, E), PyTorch's default and mha's; BatchFirst (B, T, E).
/// A batch-first tensor given to a SeqFirst module is not an error when its shape fits: set it.
enum class Layout : uint8_t { SeqFirst, BatchFirst };

struct MhaConfig {
  int64_t embed_dim = 0;       ///< E
  int64_t num_heads = 0;       ///< h; must divide E unless head_dim_override is set
  int64_t num_kv_heads = 0;    ///< kv; 0 means h. Must divide h. 1 = multi-query attention
  int64_t kdim = 0;            ///< feature size of the key input; 0 means E
  int64_t vdim = 0;            ///< feature size of the value input; 0 means E
  bool bias = true;            ///< in_proj_bias and out_proj.bias
  bool add_bias_kv = false;    ///< learned bias_k / bias_v appended as one extra key/value position
  bool add_zero_attn = false;  ///< one extra all-zero key/value position (after bias_kv)
  float dropout = 0.0f;        ///< dropout probability on attention weights, in training mode only
  Layout layout = Layout::SeqFirst;
  Rope rope;  ///< rotary embeddings on Q and K after projection (off by default; mha/rope.h)
  /// d; 0 means embed_dim / num_heads (which must then divide). Set when h·d ≠ E, e.g. after
  /// prune_heads (mha/prune.h); W_Q is then (h·d, E) and W_O (E, h·d).
  int64_t head_dim_override = 0;
  /// Softmax scale; default 1/√d (d of Q/K).
  std::optional<float> scale{};
  /// ALiBi slopes, one per query head (alibi_slopes(num_heads) for the standard schedule); empty =
  /// off. Not with add_bias_kv / add_zero_attn (their appended keys have no position).
  std::vector<float> alibi_slopes{};
  /// Logit softcap c > 0: scores s → c·tanh(s/c) after scaling, before masks (Gemma 2); 0 = off.
  float softcap = 0.0f;
  /// Learned attention sinks (gpt-oss): one logit per query head, the parameter `sinks` (h), that
  /// joins every row's softmax denominator without a value.
  bool attention_sinks = false;

  int64_t head_dim() const {
    if (head_dim_override > 0) return head_dim_override;
    return num_heads > 0 ? embed_dim / num_heads : 0;
  }
  int64_t kv_heads() const { return num_kv_heads > 0 ? num_kv_heads : num_heads; }
  int64_t key_dim() const { return kdim > 0 ? kdim : embed_dim; }
  int64_t value_dim() const { return vdim > 0 ? vdim : embed_dim; }
  /// Rows of the (possibly packed) input projection: (h + 2·kv)·d.
  int64_t in_proj_rows() const { return (num_heads + 2 * kv_heads()) * head_dim(); }
  /// True when Q, K and V projections share one packed weight ((h+2kv)·d, E): key and value
  /// inputs are E wide. (PyTorch's _qkv_same_embed_dim.)
  bool packed_in_proj() const { return key_dim() == embed_dim && value_dim() == embed_dim; }
  /// Throws mha::Error when a dimension is zero/negative or a head count does not divide.
  void validate() const;
  bool operator==(const MhaConfig&) const = default;
};

/// Parameters, under PyTorch's names. Tensors that the configuration does not use stay empty.
struct MhaParameters {
  Tensor in_proj_weight;   ///< ((h + 2kv)·d, E) when packed_in_proj()
  Tensor q_proj_weight;    ///< (h·d, E)       when !packed_in_proj()
  Tensor k_proj_weight;    ///< (kv·d, kdim)   when !packed_in_proj()
  Tensor v_proj_weight;    ///< (kv·d, vdim)   when !packed_in_proj()
  Tensor in_proj_bias;     ///< ((h + 2kv)·d) when bias
  Tensor bias_k;           ///< (1, 1, kv·d) when add_bias_kv
  Tensor bias_v;           ///< (1, 1, kv·d) when add_bias_kv
  Tensor out_proj_weight;  ///< (E, h·d)
  Tensor out_proj_bias;    ///< (E) when bias
  Tensor sinks{};          ///< (h) when attention_sinks: sink logit per query head (zeros at init)
};

/// attn_mask: (T_q, T_k) or (B·h, T_q, T_k). Exactly one of the two members is set.
struct AttnMask {
  BoolTensor allowed;  ///< nonzero = may attend
  Tensor additive;     ///< added to the scores (−inf masks out)

  bool present() const { return allowed.defined() || additive.defined(); }
  static AttnMask allow(BoolTensor allowed_positions);
  static AttnMask add(Tensor bias);
  /// PyTorch nn.MultiheadAttention's boolean mask, where true means "may NOT attend".
  static AttnMask from_torch_bool(const BoolTensor& masked_out);
};

/// key_padding_mask: (B, T_k), or (T_k) for unbatched input. Exactly one member is set.
struct KeyPaddingMask {
  BoolTensor is_padding;  ///< nonzero = padding: the key is ignored and never read
  Tensor additive;        ///< added to every query's score for that key

  bool present() const { return is_padding.defined() || additive.defined(); }
};

enum class Mode : uint8_t { Eval, Training };  ///< Eval by default: dropout off
/// Attention weights returned: none (the default: the fused path forms no T_q × T_k matrix, but for
/// a byte mask under causal with add_bias_kv / add_zero_attn: docs/semantics.md, 'Returned
/// attention weights'), per head (B, h, T_q, T_k), or averaged over heads (B, T_q, T_k).
enum class NeedWeights : uint8_t { None, PerHead, Averaged };

struct MhaForwardOptions {
  AttnMask attn_mask;
  KeyPaddingMask key_padding_mask;
  Causal causal;  ///< e.g. Causal::top_left() for PyTorch's is_causal
  NeedWeights need_weights = NeedWeights::None;
  Mode mode = Mode::Eval;  ///< dropout applies in Training mode only
  /// Dropout's masks are a function of (seed, batch, head, query, key): the same seed drops the
  /// same positions. Give each training step (and each layer) its own seed, as torch's generator
  /// gives each call fresh masks; the Python module counts it up per call for you.
  uint64_t dropout_seed = 0;
  Backend backend = Backend::Auto;
  int threads = 0;
  /// A packed batch of variable-length sequences (mha/sdpa.h, sdpa_varlen): query (total_q, E),
  /// key (total_k, kdim) and value (total_k, vdim) are 2-D, sequence s owning rows
  /// [cu_seqlens_q[s], cu_seqlens_q[s+1]) of query and likewise of key/value; no token attends
  /// another sequence, `causal` is aligned per sequence, RoPE positions restart at 0 in each.
  /// Not with attn_mask, key_padding_mask, weights, add_bias_kv / add_zero_attn or dropout.
  std::optional<VarlenBatch> packed;
  /// Also return each row's log-sum-exp of the (scaled, edited, masked) scores in MhaOutput::lse;
  /// it includes the sink when attention_sinks is set.
  bool need_lse = false;
};

struct IncrementalOptions {
  /// Valid new tokens per sequence (B entries; right padding): sequence b appends only its first
  /// new_lengths[b] tokens, and output rows past them are zero-attention rows (output = out_proj
  /// bias). Empty = every sequence takes all T_new tokens.
  std::vector<int64_t> new_lengths;
  int64_t window = 0;               ///< sliding window W (key p visible when q − W < p ≤ q); 0 = unlimited
  int splits = 0;                   ///< split-K count for the cache part (0 = from the shapes; see attend_cache)
  Backend backend = Backend::Auto;  ///< for the new tokens' attention among themselves
  int threads = 0;
};

struct MhaOutput {
  Tensor output;        ///< same layout as query: (T_q, B, E), (B, T_q, E) or (T_q, E)
  Tensor attn_weights;  ///< (B, h, T_q, S) per head or (B, T_q, S) averaged; no B when unbatched.
                        ///< S = T_k (+1 with add_bias_kv, +1 with add_zero_attn). Empty unless asked.
  Tensor lse{};         ///< (B, h, T_q), or (h, T_q) unbatched, or (h, total_q) for a packed batch,
                        ///< when need_lse: −inf for a fully masked row without sinks. Empty unless
                        ///< asked.
};

namespace detail {
class ScratchPool;
/// The working buffers a module's forward calls reuse (layers/scratch_pool.h). Not part of the
/// module's value: a copy starts with an empty pool of its own. A move keeps the pool (and leaves
/// the moved-from module sharing it, which is safe: the pool hands each call its own buffers), so
/// that a module returned by value (MultiheadAttention::with_params) keeps the one it was given.
struct ModuleScratch {
  ModuleScratch();
  ModuleScratch(const ModuleScratch&);
  ModuleScratch(ModuleScratch&& other) noexcept;
  ModuleScratch& operator=(const ModuleScratch&);
  ModuleScratch& operator=(ModuleScratch&& other) noexcept;
  ~ModuleScratch();
  std::shared_ptr<ScratchPool> pool;
};
}  // namespace detail

class MultiheadAttention {
 public:
  /// Validates the config and initialises the parameters as PyTorch does (Xavier-uniform input
  /// projections, zero biases), from a deterministic generator seeded with init_seed: modules
  /// built with the same seed start with the same weights, so give each layer its own.
  explicit MultiheadAttention(const MhaConfig& config, uint64_t init_seed = 0);
  /// A module with the given parameters (checked against the config with check_params); nothing
  /// is initialised or allocated beyond them.
  MultiheadAttention(const MhaConfig& config, MhaParameters params);

  const MhaConfig& config() const { return config_; }
  MhaParameters& params() { return params_; }
  const MhaParameters& params() const { return params_; }
  /// Throws mha::Error if a parameter tensor is missing or has the wrong shape for the config.
  void check_params() const;
  int64_t parameter_count() const;
  /// Always true: every forward and backward path of this library gives bitwise the same results
  /// run after run and for any thread count (docs/semantics.md, 'Determinism'); there is no
  /// faster non-deterministic mode to opt out of. For code written against PyTorch's
  /// use_deterministic_algorithms.
  static constexpr bool deterministic() { return true; }

  /// query (T_q, B, E) / (B, T_q, E) / (T_q, E); key (…, T_k, kdim); value (…, T_k, vdim).
  MhaOutput forward(const Tensor& query, const Tensor& key, const Tensor& value,
                    const MhaForwardOptions& options = {}) const;

  /// Incremental (KV-cache) forward: query_new / key_new / value_new hold T_new new tokens per
  /// sequence, laid out like forward()'s inputs (1 for decoding, many for prefill). Projects them,
  /// applies RoPE at absolute positions cache.length(b) + t, attends causally by absolute position
  /// to everything the cache holds plus the new tokens, then appends the new K/V to the cache.
  /// Prefill followed by token-by-token decoding equals forward() with Causal::top_left(), row
  /// for row. Not supported with add_bias_kv / add_zero_attn. Decoding is inference: no dropout
  /// (there is no training flag here; equal to forward() without it).
  MhaOutput forward_incremental(const Tensor& query_new, const Tensor& key_new, const Tensor& value_new, KvCache& cache,
                                const IncrementalOptions& options = {}) const;
  /// The same over a paged cache (mha/paged_kv_cache.h): batch row b reads and extends sequence
  /// seqs[b] (B distinct live ids). Bitwise equal to the contiguous-cache overload on the same
  /// tokens (for the same split count). Fails, changing nothing, when the pool lacks the blocks.
  MhaOutput forward_incremental(const Tensor& query_new, const Tensor& key_new, const Tensor& value_new,
                                PagedKvCache& cache, std::span<const int64_t> seqs,
                                const IncrementalOptions& options = {}) const;

  /// forward() keeps its large working buffers (projected Q/K/V, attention heads) between calls and
  /// reuses them when the next call is the same size or smaller, instead of allocating and
  /// page-faulting them afresh; concurrent calls each get their own. forward_train() and backward()
  /// (mha/training.h) borrow theirs from the same place: an MhaContext holds its buffers until it is
  /// destroyed. This frees the kept ones (not those a live context holds).
  void release_workspace() const;
  /// Bytes of the kept buffers that release_workspace() would free now (not those calls hold).
  size_t workspace_bytes() const;
  /// The same configuration with `params` (checked as the constructor checks them), keeping its
  /// working buffers where this module keeps its own: calls on either reuse the buffers the other's
  /// calls gave back, and concurrent calls on both still each get their own. For a caller that
  /// binds fresh parameters on every call (mha.torch binds its torch module's current tensors, so
  /// that threads may share it) and would otherwise allocate, and page-fault, a whole workspace
  /// each time. (A copy, by contrast, starts with an empty workspace of its own.)
  MultiheadAttention with_params(MhaParameters params) const;
  /// Internal (layers/module_core.cpp): where those buffers are kept.
  const std::shared_ptr<detail::ScratchPool>& workspace_pool() const { return scratch_.pool; }

 private:
  MhaConfig config_;
  MhaParameters params_;
  detail::ModuleScratch scratch_;
};

/// Parameter count for a configuration, without building the module.
int64_t parameter_count(const MhaConfig& config);

}  // namespace mha
