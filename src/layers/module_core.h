// layers/module_core.h — the one pipeline behind MultiheadAttention::forward, forward_train and
// forward_incremental. Internal to the library.
//
//   checked inputs ─▶ projected heads ─▶ [RoPE] ─▶ [extra positions] ─▶ attention ─▶ output projection
//   check_inputs      project_inputs               append_extra_positions  sdpa       project_output
//
// forward() and forward_train() run all of it through run_module() and differ only in what they
// keep (weights, or lse and the buffers the backward reads); forward_incremental() shares the
// checks, the projections and the output projection and puts a KV cache in the middle; backward()
// reads the projections' buffer plan to lay out dQ/dK/dV the way the forward laid out Q/K/V.
#pragma once

#include <cstdint>
#include <vector>

#include "layers/module_masks.h"
#include "layers/scratch_pool.h"
#include "mha/module.h"

namespace mha::detail {

/// Where the (batch, time) rows of a (…, features) input sit in its row-major storage:
/// row index = b·per_batch + t·per_step. A 2-D input is unbatched (batch 1) in either layout.
struct RowPlacement {
  int64_t batch = 1, steps = 0, per_batch = 0, per_step = 0;

  static RowPlacement of(const Shape& shape, Layout layout);
  int64_t rows() const { return batch * steps; }
  /// (batch, n_heads, steps, d) over `n_heads` column blocks of width d, starting at column
  /// `col0`, of a row-major (rows, ld) buffer whose rows are placed like this input's.
  View4<float> heads(float* buffer, int64_t ld, int64_t col0, int64_t n_heads, int64_t d) const {
    return {buffer + col0, {batch, n_heads, steps, d}, {per_batch * ld, d, per_step * ld, 1}};
  }
};

/// The checked shape of one module call. Value rows are placed like key rows (checked).
struct ModuleCall {
  bool unbatched = false;
  RowPlacement q_rows, k_rows;

  int64_t batch() const { return q_rows.batch; }
  int64_t t_q() const { return q_rows.steps; }
  int64_t t_k() const { return k_rows.steps; }
};

/// Whether key/value must hold as many tokens as the query (the incremental forward's new tokens).
enum class KvTokens : uint8_t { AnyLength, SameAsQuery };

/// Checks ranks, feature sizes, batch sizes and sequence lengths of query/key/value for `config`;
/// throws mha::Error prefixed with `fn`, naming the shapes.
ModuleCall check_inputs(const char* fn, const MhaConfig& config, const Tensor& query, const Tensor& key,
                        const Tensor& value, KvTokens kv_tokens = KvTokens::AnyLength);

/// Checks attn_mask and key_padding_mask against the call's shapes.
void check_masks(const char* fn, const MhaConfig& config, const ModuleCall& call, const MhaForwardOptions& options);

/// The input projection weights of Q, K and V and their row strides (packed or separate).
struct InProjWeights {
  const float *q, *k, *v;
  int64_t ld_q, ld_k, ld_v;
  const float *bias_q, *bias_k, *bias_v;  ///< null without bias
};
InProjWeights in_proj_weights(const MhaConfig& config, const MhaParameters& params);

/// True when query, key and value are one tensor and the weight is packed: then Q, K and V come
/// from one GEMM into (N, (h + 2kv)·d) rows whose column blocks are Q, K and V.
bool packed_self_attention(const MhaConfig& config, const Tensor& query, const Tensor& key, const Tensor& value);

/// Where Q, K and V (or their gradients) live in one row buffer: packed, one (N, (h+2kv)·d)
/// block; otherwise Q (N_q, h·d), then K (N_k, kv·d), then V (N_k, kv·d).
struct ProjectionPlan {
  bool packed = false;
  int64_t floats = 0;           ///< buffer size
  int64_t ld_q = 0, ld_kv = 0;  ///< row strides of the Q block and of the K/V blocks
  int64_t q = 0, k = 0, v = 0;  ///< offset of each block's first element
  static ProjectionPlan make(const MhaConfig& config, const ModuleCall& call, bool packed);
  View4<float> q_heads(float* buffer, const ModuleCall& call, const MhaConfig& config) const;
  View4<float> k_heads(float* buffer, const ModuleCall& call, const MhaConfig& config) const;
  View4<float> v_heads(float* buffer, const ModuleCall& call, const MhaConfig& config) const;
};

/// Q (B, h, T_q, d), K and V (B, kv, T_k, d) as views over one owned row buffer, in the inputs'
/// layouts (no transposes). Move-only: the views point into `rows`, whose storage moves with it.
struct Projections {
  Projections() = default;
  Projections(Projections&&) = default;
  Projections& operator=(Projections&&) = default;
  Projections(const Projections&) = delete;
  Projections& operator=(const Projections&) = delete;

  ProjectionPlan plan;
  std::vector<float> rows;     ///< the buffer, when no pool was given
  ScratchPool::Lease scratch;  ///< or the buffer checked out of a module's pool
  View4<float> q, k, v;
};

/// The projections of the inputs (one GEMM for packed self-attention, else three), into a buffer
/// of `pool` (reused, never zero-filled) when one is given, else into Projections::rows; on
/// `threads` threads (the call's option; 0 = the library default).
Projections project_inputs(const MhaConfig& config, const MhaParameters& params, const Tensor& query, const Tensor& key,
                           const Tensor& value, const ModuleCall& call, ScratchPool* pool, int threads);

/// Key positions appended after the real keys: bias_k/bias_v (1) and the zero position (1).
int64_t extra_positions(const MhaConfig& config);

/// K/V over S = T_k + extra positions, bias_k/bias_v first (PyTorch's order), then the zero
/// position: copies K/V into k_ext/v_ext (B, kv, S, d) and points k/v at them. No-op without extras.
void append_extra_positions(const MhaConfig& config, const MhaParameters& params, View4<float>& k, View4<float>& v,
                            Tensor& k_ext, Tensor& v_ext);

/// output (the query's shape) = heads (N_q, h·d) · W_Oᵀ + b_O, on `threads` threads.
Tensor project_output(const MhaConfig& config, const MhaParameters& params, const float* heads,
                      const Shape& query_shape, int64_t rows, int threads);

/// What one pass of forward()/forward_train() produces. Move-only (views into its own buffers).
struct ModulePass {
  ModuleCall call;
  Projections proj;     ///< Q, K, V after RoPE; k/v over S positions when extras were appended
  Tensor k_ext, v_ext;  ///< (B, kv, S, d) when extra positions exist
  ModuleMasks masks;    ///< owners of the widened masks sdpa_options points into
  SdpaOptions sdpa_options;
  Tensor heads;                      ///< (N_q, h·d): attention output before W_O, in the query's row layout (no pool)
  ScratchPool::Lease heads_scratch;  ///< or checked out of the module's pool
  Tensor lse;                        ///< (B, h, T_q) when asked for
  Tensor weights;                    ///< (B, h, T_q, S) when asked for
  Tensor averaged_weights;           ///< (B, 1, T_q, S) when asked for
  Tensor output;                     ///< the query's shape
};

/// What run_module keeps besides the output.
struct PassOutputs {
  bool lse = false;
  bool weights = false;           ///< per-head weights (B, h, T_q, S)
  bool averaged_weights = false;  ///< weights averaged over heads (B, 1, T_q, S)
  /// The pass owns copies of its masks (forward_train's context keeps them past the call); else a
  /// mask that needs no widening is read where the caller keeps it.
  bool masks = false;
};

/// Bytes of physical memory on this machine (0 if unknown).
int64_t physical_memory_bytes();

/// Throws mha::Error when the tensors a pass would allocate (float32) cannot fit in this machine's
/// memory, naming the largest one and what it would take: "attention weights (1, 8, 200000, 200000)
/// need 1.16 TiB …". Checked before anything is computed, instead of a bare std::bad_alloc later.
void check_pass_memory(const char* fn, const MhaConfig& c, const ModuleCall& call, PassOutputs keep);

/// RoPE at positions 0 … T_s − 1 of each packed sequence: rows [cu[s], cu[s+1]) of x (1, heads,
/// total, d).
void rope_per_sequence(View4<float> x, const Rope& rope, const SeqOffsets& cu,
                       RopeDirection direction = RopeDirection::Rotate);

/// Checks a packed module call (MhaForwardOptions::packed) against the config and options.
void check_packed(const char* fn, const MhaConfig& c, const ModuleCall& call, const MhaForwardOptions& options);

/// The config's scale, ALiBi slopes, softcap and the sink parameters as SdpaOptions (views into
/// `c` and `params`, which must outlive the options).
void set_score_options(const MhaConfig& c, const MhaParameters& params, SdpaOptions& sopt);

/// options.mode and options.need_weights, cast from integers, must name one of their values
/// (docs/semantics.md, 'Bad input is an error'): run_module checks them, and forward_train before
/// its own test of need_weights, so that a NeedWeights of 9 is named as such there too.
void check_forward_enums(const char* fn, const MhaForwardOptions& options);

/// The whole module forward: checks, projections, RoPE at positions 0 … T − 1, extra positions,
/// masks widened to S keys, attention, output projection. With a pool, the projections and heads
/// live in buffers checked out of it (returned when the pass ends); without, the pass owns them.
ModulePass run_module(const char* fn, const MultiheadAttention& module, const Tensor& query, const Tensor& key,
                      const Tensor& value, const MhaForwardOptions& options, PassOutputs keep,
                      ScratchPool* pool = nullptr);

}  // namespace mha::detail
