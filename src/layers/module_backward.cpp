// layers/module_backward.cpp — the multi-head module in training: forward_train saves what the
// backward needs, backward runs the forward's data flow (layers/module_core.cpp) in reverse.
//
// Forward (N_q = B·T_q rows in the caller's layout, no transposes), as in module_core.cpp:
//   Q = query · W_Qᵀ + b_Q      K = key · W_Kᵀ + b_K      V = value · W_Vᵀ + b_V
//   K, V ← append bias_k / bias_v, then a zero position (S = T_k + extra positions)
//   heads = sdpa(Q, K, V)  (N_q, h·d)          output = heads · W_Oᵀ + b_O
// Backward, given dY = ∂L/∂output:
//   dW_O = dYᵀ · heads, db_O = Σ_rows dY, d_heads = dY · W_O
//   dQ, dK_S, dV_S = sdpa_backward(d_heads)    (K/V over all S positions)
//   d bias_k = Σ_b dK_S[:, :, T_k], d bias_v likewise (the zero position has no parameter)
//   dW_Q = dQᵀ · query, db_Q = Σ_rows dQ, d query = dQ · W_Q     (same for K and V)
// Memory: the saved context holds Q/K/V, the attention output and lse; nothing of size T_q × T_k
// (the attention backward recomputes the probabilities from lse).
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "kernels/gemm.h"
#include "layers/module_core.h"
#include "mha/training.h"

namespace mha {

namespace detail {
/// The storage of an MhaContext's qkv and heads: buffers of the module's scratch pool, given back
/// when the context (the last owner) is destroyed.
struct TrainBuffers {
  ScratchPool::Lease qkv, heads;
  /// The sink logits the forward used (its lse includes them): backward must not read them from
  /// the module's parameters, which may have changed or gone since, or belong to another module
  /// of the same configuration.
  std::vector<float> sinks;
};
}  // namespace detail

namespace {

constexpr const char* kTrain = "forward_train";
constexpr const char* kBack = "backward";

/// Whether the `width` floats at `row` are all finite.
bool finite_row(const float* row, int64_t width) {
  return std::all_of(row, row + width, [](float v) { return std::isfinite(v); });
}

/// Zeroes row r of input x (`rows` × `width`) in the copy a weight gradient reads instead of x:
/// the copy (`copy`, `out` its data, null until then) is made at the first such row, so that an
/// input with none is read in place.
void zero_row_in_copy(const float* x, int64_t rows, int64_t width, int64_t r, Tensor& copy, float*& out) {
  if (!out) {
    copy = Tensor::uninitialized({rows, width});
    out = copy.data();
    std::copy(x, x + rows * width, out);
  }
  std::fill(out + r * width, out + (r + 1) * width, 0.0f);
}

/// The key or value input (`width` floats a row, placed as `rows` says) as the weight gradient
/// dW_K = dKᵀ · key (dW_V alike) may read it. A padded key — boolean key padding, or a −inf key
/// bias — enters no product (SEMANTICS 5), so its dK / dV rows are exactly 0; but 0 · NaN is NaN,
/// so a NaN or inf in its input row would still make the whole weight gradient NaN. Returns x itself
/// when no padded row holds a non-finite value (the usual case: a scan, no copy), else a copy in
/// `copy` with those rows zero — the products the finite rows give, bit for bit. With no query
/// rows (`no_queries`) no key is read at all, and every row counts as padded.
const float* padded_rows_finite(const float* x, int64_t width, const detail::RowPlacement& rows, const MhaContext& ctx,
                                bool no_queries, Tensor& copy) {
  const bool by_flag = ctx.key_padding.defined(), by_bias = ctx.key_bias.defined();
  if (!by_flag && !by_bias && !no_queries) return x;
  // (1, B, S): S key positions, the real T_k first.
  const int64_t S = by_flag ? ctx.key_padding.shape().back() : by_bias ? ctx.key_bias.shape().back() : 0;
  const auto padded = [&](int64_t b, int64_t t) {
    return no_queries || (by_flag && ctx.key_padding.data()[b * S + t] != 0) ||
           (by_bias && ctx.key_bias.data()[b * S + t] == -std::numeric_limits<float>::infinity());
  };
  float* out = nullptr;
  for (int64_t b = 0; b < rows.batch; ++b)
    for (int64_t t = 0; t < rows.steps; ++t) {
      const int64_t r = b * rows.per_batch + t * rows.per_step;
      if (padded(b, t) && !finite_row(x + r * width, width)) zero_row_in_copy(x, rows.rows(), width, r, copy, out);
    }
  return out ? out : x;
}

/// The query input (`rows` rows of `width` floats; with self-attention's one packed block, the
/// input of all three projections) as the weight gradient dW = dYᵀ · x may read it, dY being its
/// projections' gradient rows (`dy_cols` floats a row, `ldy` apart). A query row that saw no key
/// in any head — a fully masked row (SEMANTICS 4) — has a dY row of zeros, and 0 · NaN is NaN: a
/// NaN or inf in its input row would make the whole weight gradient NaN, where the row gives
/// nothing. (A row some head saw has a NaN dQ row then anyway: its output is NaN.) Returns x itself
/// when no row with a non-finite value has a zero dY row (the usual case: a scan, no copy), else a
/// copy in `copy` with those rows zero — the products the other rows give, bit for bit.
const float* unseen_rows_finite(const float* x, int64_t rows, int64_t width, const float* dy, int64_t ldy,
                                int64_t dy_cols, Tensor& copy) {
  float* out = nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const float* dr = dy + r * ldy;
    if (!finite_row(x + r * width, width) && std::all_of(dr, dr + dy_cols, [](float v) { return v == 0.0f; }))
      zero_row_in_copy(x, rows, width, r, copy, out);
  }
  return out ? out : x;
}

}  // namespace

MhaTrainOutput forward_train(const MultiheadAttention& module, const Tensor& query, const Tensor& key,
                             const Tensor& value, const MhaForwardOptions& options) {
  detail::check_forward_enums(kTrain, options);  // a NeedWeights of 9 is named as such, not as a request
  if (options.need_weights != NeedWeights::None)
    fail(kTrain, ": attention weights are not returned in training; use forward() for them");
  detail::PassOutputs keep;
  keep.lse = true;
  keep.masks = true;  // the context's backward reads them after the caller's options may be gone
  // The projections and heads come from the module's pool (never zero-filled: the pass writes
  // every element before reading); the context keeps them checked out until it is destroyed. A
  // module without a pool gets one of its own for this step (as backward() takes fresh buffers).
  const std::shared_ptr<detail::ScratchPool> pool =
      module.workspace_pool() ? module.workspace_pool() : detail::ScratchPool::make();
  detail::ModulePass pass = detail::run_module(kTrain, module, query, key, value, options, keep, pool.get());

  // Keep what backward() reads. The buffers move with their storage, so the views stay valid.
  MhaTrainOutput result;
  result.output = std::move(pass.output);
  MhaContext& ctx = result.context;
  ctx.config = module.config();
  ctx.query = &query, ctx.key = &key, ctx.value = &value;
  ctx.unbatched = pass.call.unbatched;
  ctx.packed_self_attention = pass.proj.plan.packed;
  auto buffers = std::make_shared<detail::TrainBuffers>();
  buffers->qkv = std::move(pass.proj.scratch);
  buffers->heads = std::move(pass.heads_scratch);
  ctx.qkv = {buffers->qkv.data(), static_cast<size_t>(pass.proj.plan.floats)};
  ctx.heads = {buffers->heads.data(),
               static_cast<size_t>(pass.call.q_rows.rows() * ctx.config.num_heads * ctx.config.head_dim())};
  ctx.buffers = std::move(buffers);
  ctx.q_heads = pass.proj.q, ctx.k_heads = pass.proj.k, ctx.v_heads = pass.proj.v;
  ctx.k_ext = std::move(pass.k_ext);
  ctx.v_ext = std::move(pass.v_ext);
  ctx.lse = std::move(pass.lse);
  ctx.allowed = std::move(pass.masks.allowed);
  ctx.additive = std::move(pass.masks.additive);
  ctx.key_padding = std::move(pass.masks.key_padding);
  ctx.key_bias = std::move(pass.masks.key_bias);
  ctx.sdpa_options = pass.sdpa_options;
  ctx.packed = options.packed;
  // Score edits as the context's own copies, never views of the module: the slopes in its config,
  // the sink logits in its buffers.
  ctx.sdpa_options.alibi.slopes = ctx.config.alibi_slopes;
  if (ctx.sdpa_options.sinks.enabled()) {
    ctx.buffers->sinks.assign(ctx.sdpa_options.sinks.logits.begin(), ctx.sdpa_options.sinks.logits.end());
    ctx.sdpa_options.sinks.logits = std::span<const float>(ctx.buffers->sinks);
  }
  return result;
}

MhaGradients backward(const MultiheadAttention& module, const MhaContext& ctx, const Tensor& d_output) {
  const MhaConfig& c = module.config();
  if (!ctx.query || !ctx.key || !ctx.value) fail(kBack, ": the context is empty (it must come from forward_train)");
  if (c != ctx.config) fail(kBack, ": the module's configuration differs from the one forward_train saw");
  module.check_params();
  const Tensor &query = *ctx.query, &key = *ctx.key, &value = *ctx.value;
  if (d_output.shape() != query.shape())
    fail(kBack, ": d_output has shape ", shape_str(d_output.shape()), ", expected the output's ",
         shape_str(query.shape()));
  const MhaParameters& params = module.params();
  const int64_t E = c.embed_dim, d = c.head_dim(), H = c.num_heads, KV = c.kv_heads();
  const int64_t kdim = c.key_dim(), vdim = c.value_dim();
  const detail::ModuleCall call = detail::check_inputs(kBack, c, query, key, value);
  const int64_t B = call.batch(), Tq = call.t_q(), Tk = call.t_k(), Nq = call.q_rows.rows(), Nk = call.k_rows.rows();
  const int64_t extra = detail::extra_positions(c), S = Tk + extra;
  const int threads = ctx.sdpa_options.threads;  // the forward's per-call option, for every GEMM here too

  MhaGradients g;
  MhaParameters& gp = g.params;

  // output = heads · W_Oᵀ + b_O  ⇒  dW_O = dYᵀ · heads, db_O = Σ dY, d_heads = dY · W_O.
  gp.out_proj_weight = Tensor({E, H * d});
  if (c.bias) gp.out_proj_bias = Tensor({E});
  kernels::linear_backward_params(d_output.data(), Nq, E, E, ctx.heads.data(), H * d, H * d, gp.out_proj_weight.data(),
                                  H * d, c.bias ? gp.out_proj_bias.data() : nullptr, threads);
  // The working buffers d_heads and dQ/dK/dV rows are fully overwritten before they are read: they
  // come from the module's scratch pool (reused across steps, never zero-filled; concurrent calls
  // each get their own), as the forward's do.
  const auto take = [&module](int64_t floats) {
    const auto& pool = module.workspace_pool();
    return pool ? pool->take(static_cast<size_t>(floats)) : detail::ScratchPool::fresh(static_cast<size_t>(floats));
  };
  const detail::ScratchPool::Lease d_heads_buf = take(Nq * H * d);
  float* d_heads = d_heads_buf.data();
  kernels::linear_backward_input(d_output.data(), Nq, E, E, params.out_proj_weight.data(), H * d, H * d, d_heads, H * d,
                                 threads);

  // heads = sdpa(Q, K, V)  ⇒  dQ, dK, dV. They land in row buffers shaped like the forward's
  // projections (one packed block for self-attention); with extra positions dK/dV go to
  // (B, kv, S, d) first and the real positions are copied back below.
  const detail::ProjectionPlan plan = detail::ProjectionPlan::make(c, call, ctx.packed_self_attention);
  const bool packed = plan.packed;
  const int64_t ldq = plan.ld_q, ldkv = plan.ld_kv;
  const detail::ScratchPool::Lease dqkv_buf = take(plan.floats);
  float* const dqkv = dqkv_buf.data();
  float* dq_rows = dqkv + plan.q;
  float* dk_rows = dqkv + plan.k;
  float* dv_rows = dqkv + plan.v;
  Tensor dk_ext, dv_ext;
  SdpaGrads grads{plan.q_heads(dqkv, call, c), plan.k_heads(dqkv, call, c), plan.v_heads(dqkv, call, c), {}};
  // Sinks: p_j = e^{s_j} / (e^{z_h} + Σ e^{s_k})  ⇒  d sinks from the SDPA backward.
  if (c.attention_sinks) {
    gp.sinks = Tensor({H});
    grads.dsinks = {gp.sinks.data(), static_cast<size_t>(H)};
  }
  if (extra > 0) {
    dk_ext = Tensor({B, KV, S, d});
    dv_ext = Tensor({B, KV, S, d});
    grads.dk = dk_ext.view4();
    grads.dv = dv_ext.view4();
  }
  const View4<float> heads_view = call.q_rows.heads(const_cast<float*>(ctx.heads.data()), H * d, 0, H, d);
  const View4<const float> d_heads_view = call.q_rows.heads(d_heads, H * d, 0, H, d);
  const View4<const float> lse_view = contiguous_view(ctx.lse.data(), B, H, Tq, int64_t{1});
  if (ctx.packed)
    sdpa_backward_varlen(View4<const float>(ctx.q_heads), View4<const float>(ctx.k_heads),
                         View4<const float>(ctx.v_heads), View4<const float>(heads_view), d_heads_view, lse_view,
                         *ctx.packed, ctx.sdpa_options, grads);
  else
    sdpa_backward(View4<const float>(ctx.q_heads), View4<const float>(ctx.k_heads), View4<const float>(ctx.v_heads),
                  View4<const float>(heads_view), d_heads_view, lse_view, ctx.sdpa_options, grads);

  // K_S = [K; bias_k; 0]  ⇒  dK = dK_S[:, :, :T_k], d bias_k = Σ_b dK_S[b, :, T_k] (V likewise).
  if (extra > 0) {
    const View4<float> dk_real = plan.k_heads(dqkv, call, c);
    const View4<float> dv_real = plan.v_heads(dqkv, call, c);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t gk = 0; gk < KV; ++gk)
        for (int64_t t = 0; t < Tk; ++t)
          for (int64_t x = 0; x < d; ++x) {
            dk_real(b, gk, t, x) = dk_ext.at({b, gk, t, x});
            dv_real(b, gk, t, x) = dv_ext.at({b, gk, t, x});
          }
    if (c.add_bias_kv) {
      gp.bias_k = Tensor({1, 1, KV * d});
      gp.bias_v = Tensor({1, 1, KV * d});
      for (int64_t gk = 0; gk < KV; ++gk)
        for (int64_t x = 0; x < d; ++x) {
          double sk = 0.0, sv = 0.0;
          for (int64_t b = 0; b < B; ++b) sk += dk_ext.at({b, gk, Tk, x}), sv += dv_ext.at({b, gk, Tk, x});
          gp.bias_k.data()[gk * d + x] = static_cast<float>(sk);
          gp.bias_v.data()[gk * d + x] = static_cast<float>(sv);
        }
    }
  }

  // Q ← rope(Q), K ← rope(K) (real positions only)  ⇒  dQ ← ropeᵀ(dQ), dK ← ropeᵀ(dK): the
  // transpose of a rotation is the rotation by −angle, the same primitive run Unrotate.
  if (c.rope.enabled && ctx.packed) {
    detail::rope_per_sequence(plan.q_heads(dqkv, call, c), c.rope, ctx.packed->cu_seqlens_q, RopeDirection::Unrotate);
    detail::rope_per_sequence(plan.k_heads(dqkv, call, c), c.rope, ctx.packed->cu_seqlens_k, RopeDirection::Unrotate);
  } else if (c.rope.enabled) {
    apply_rope(plan.q_heads(dqkv, call, c), c.rope, nullptr, RopeDirection::Unrotate);
    apply_rope(plan.k_heads(dqkv, call, c), c.rope, nullptr, RopeDirection::Unrotate);
  }

  // Q = query · W_Qᵀ + b_Q  ⇒  dW_Q = dQᵀ · query, db_Q = Σ dQ, d query = dQ · W_Q (K, V alike).
  const detail::InProjWeights w = detail::in_proj_weights(c, params);
  float* db = c.bias ? (gp.in_proj_bias = Tensor({c.in_proj_rows()})).data() : nullptr;
  float *dwq, *dwk, *dwv;
  int64_t lddq = E, lddk = kdim, lddv = vdim;
  if (c.packed_in_proj()) {
    gp.in_proj_weight = Tensor({c.in_proj_rows(), E});
    dwq = gp.in_proj_weight.data(), dwk = dwq + H * d * E, dwv = dwq + (H + KV) * d * E;
    lddk = lddv = E;
  } else {
    gp.q_proj_weight = Tensor({H * d, E});
    gp.k_proj_weight = Tensor({KV * d, kdim});
    gp.v_proj_weight = Tensor({KV * d, vdim});
    dwq = gp.q_proj_weight.data(), dwk = gp.k_proj_weight.data(), dwv = gp.v_proj_weight.data();
  }
  Tensor query_copy;
  if (packed) {
    // One input for all three: the packed weight's gradient is one GEMM over the whole block. (A
    // row that is both a padded key and a query that saw nothing has a zero dQ, dK and dV row.)
    const float* query_x = unseen_rows_finite(query.data(), Nq, E, dqkv, ldq, c.in_proj_rows(), query_copy);
    kernels::linear_backward_params(dqkv, Nq, c.in_proj_rows(), ldq, query_x, E, E, dwq, E, db, threads);
  } else {
    // Keys and values by their padding (a padded row's dK and dV rows are 0), queries by their dQ
    // rows. (Self-attention's packed block above needs only the latter: a padded position's input
    // row is also a query's, and its NaN reaches that query's output unless the row saw nothing.)
    Tensor key_copy, value_copy;
    const float* key_x = padded_rows_finite(key.data(), kdim, call.k_rows, ctx, Nq == 0, key_copy);
    const float* value_x = padded_rows_finite(value.data(), vdim, call.k_rows, ctx, Nq == 0, value_copy);
    const float* query_x = unseen_rows_finite(query.data(), Nq, E, dq_rows, ldq, H * d, query_copy);
    kernels::linear_backward_params(dq_rows, Nq, H * d, ldq, query_x, E, E, dwq, lddq, db, threads);
    kernels::linear_backward_params(dk_rows, Nk, KV * d, ldkv, key_x, kdim, kdim, dwk, lddk, db ? db + H * d : nullptr,
                                    threads);
    kernels::linear_backward_params(dv_rows, Nk, KV * d, ldkv, value_x, vdim, vdim, dwv, lddv,
                                    db ? db + (H + KV) * d : nullptr, threads);
  }
  // Each input gradient is written whole by its GEMM (beta = 0): no zero-fill first.
  g.query = Tensor::uninitialized(query.shape());
  g.key = Tensor::uninitialized(key.shape());
  g.value = Tensor::uninitialized(value.shape());
  kernels::linear_backward_input(dq_rows, Nq, H * d, ldq, w.q, E, w.ld_q, g.query.data(), E, threads);
  kernels::linear_backward_input(dk_rows, Nk, KV * d, ldkv, w.k, kdim, w.ld_k, g.key.data(), kdim, threads);
  kernels::linear_backward_input(dv_rows, Nk, KV * d, ldkv, w.v, vdim, w.ld_v, g.value.data(), vdim, threads);
  return g;
}

}  // namespace mha
