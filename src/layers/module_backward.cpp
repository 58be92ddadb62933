// layers/module_backward.cpp — the multi-head module in training: forward_train saves what the
// backward needs, backward runs the forward's data flow (layers/module.cpp) in reverse.
//
// Forward (N_q = B·T_q rows in the caller's layout, no transposes), as in module.cpp:
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
#include <cmath>
#include <vector>

#include "kernels/gemm.h"
#include "layers/module_masks.h"
#include "mha/training.h"

namespace mha {

namespace {

constexpr const char* kTrain = "forward_train";
constexpr const char* kBack = "backward";

/// Row-major placement of (batch, time) rows for a layout: row = b·stride_b + t·stride_t
/// (the same placement module.cpp uses).
struct RowLayout {
  int64_t batch = 1, time = 0, stride_b = 0, stride_t = 0;
};

RowLayout row_layout(const Shape& shape, Layout layout, bool unbatched) {
  if (unbatched) return {1, shape[0], 0, 1};
  if (layout == Layout::BatchFirst) return {shape[0], shape[1], shape[1], 1};
  return {shape[1], shape[0], 1, shape[1]};
}

/// A (B, heads, T, d) view of `heads` column blocks of width d starting at column `col0` of a
/// row-major (rows, ld) buffer whose rows are placed by `rows`.
View4<float> head_view(float* base, const RowLayout& rows, int64_t ld, int64_t col0, int64_t heads, int64_t d) {
  return {base + col0, {rows.batch, heads, rows.time, d}, {rows.stride_b * ld, d, rows.stride_t * ld, 1}};
}

/// The input checks of MultiheadAttention::forward, for the training entry point.
void check_inputs(const MhaConfig& c, const Tensor& query, const Tensor& key, const Tensor& value,
                  const MhaForwardOptions& options) {
  if (query.dim() != 2 && query.dim() != 3)
    fail(kTrain, ": query must be 3-D (batched) or 2-D (T, E) unbatched, got ", shape_str(query.shape()));
  const bool unbatched = query.dim() == 2;
  if (key.dim() != query.dim() || value.dim() != query.dim())
    fail(kTrain, ": query ", shape_str(query.shape()), ", key ", shape_str(key.shape()), " and value ",
         shape_str(value.shape()), " must all be ", unbatched ? "2-D (unbatched)" : "3-D (batched)");
  const struct {
    const Tensor& t;
    int64_t features;
    const char* name;
  } args[] = {{query, c.embed_dim, "query"}, {key, c.key_dim(), "key"}, {value, c.value_dim(), "value"}};
  for (const auto& a : args)
    if (a.t.size(-1) != a.features)
      fail(kTrain, ": ", a.name, " ", shape_str(a.t.shape()), " must have ", a.features, " features in its last dim");
  const RowLayout q = row_layout(query.shape(), c.layout, unbatched), k = row_layout(key.shape(), c.layout, unbatched),
                  v = row_layout(value.shape(), c.layout, unbatched);
  if (k.batch != q.batch || v.batch != q.batch)
    fail(kTrain, ": batch sizes differ: query ", shape_str(query.shape()), ", key ", shape_str(key.shape()), ", value ",
         shape_str(value.shape()));
  if (k.time != v.time)
    fail(kTrain, ": key ", shape_str(key.shape()), " and value ", shape_str(value.shape()),
         " must have the same sequence length");
  const AttnMask& am = options.attn_mask;
  if (am.allowed.defined() && am.additive.defined())
    fail(kTrain, ": attn_mask must be either allowed positions or an additive bias, not both");
  if (am.present()) {
    const Shape& s = am.allowed.defined() ? am.allowed.shape() : am.additive.shape();
    const Shape want2{q.time, k.time}, want3{q.batch * c.num_heads, q.time, k.time};
    if (s != want2 && s != want3)
      fail(kTrain, ": attn_mask has shape ", shape_str(s), ", expected ", shape_str(want2), " or ", shape_str(want3),
           " (B·num_heads, T_q, T_k)");
  }
  const KeyPaddingMask& kpm = options.key_padding_mask;
  if (kpm.is_padding.defined() && kpm.additive.defined())
    fail(kTrain, ": key_padding_mask must be either boolean padding or an additive bias, not both");
  if (kpm.present()) {
    const Shape& s = kpm.is_padding.defined() ? kpm.is_padding.shape() : kpm.additive.shape();
    const Shape want = unbatched ? Shape{k.time} : Shape{q.batch, k.time};
    if (s != want) fail(kTrain, ": key_padding_mask has shape ", shape_str(s), ", expected ", shape_str(want));
  }
  if (options.need_weights != NeedWeights::None)
    fail(kTrain, ": attention weights are not returned in training; use forward() for them");
}

/// The projection weights of Q, K and V and their row strides (packed or separate).
struct InProj {
  const float *wq, *wk, *wv;
  int64_t ldq, ldk, ldv;
};
InProj in_proj(const MhaConfig& c, const MhaParameters& p) {
  const int64_t E = c.embed_dim, H = c.num_heads, KV = c.kv_heads(), d = c.head_dim();
  if (c.packed_in_proj()) {
    const float* w = p.in_proj_weight.data();
    return {w, w + H * d * E, w + (H + KV) * d * E, E, E, E};
  }
  return {p.q_proj_weight.data(), p.k_proj_weight.data(), p.v_proj_weight.data(), E, c.key_dim(), c.value_dim()};
}

/// The transpose of apply_rope (rotation by −angle), for gradients: with out_a = x_a c − x_b s and
/// out_b = x_b c + x_a s, dx_a = g_a c + g_b s and dx_b = g_b c − g_a s. Same angles as
/// kernels/rope.cpp (double, positions 0 … T − 1), rounded to float the same way.
void rope_transpose(View4<float> g, const Rope& rope) {
  const int64_t B = g.shape[0], H = g.shape[1], T = g.shape[2], dims = rope.rotary_dims(g.shape[3]);
  const int64_t half = dims / 2;
  const bool interleaved = rope.pairing == RopePairing::Interleaved;
  const int64_t a_step = interleaved ? 2 : 1, b_off = interleaved ? 1 : half;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double angle =
          static_cast<double>(t) * std::pow(rope.theta, -static_cast<double>(2 * i) / static_cast<double>(dims));
      const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
      const int64_t ia = i * a_step, ib = i * a_step + b_off;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
          float* row = g.row(b, h, t);
          const float ga = row[ia], gb = row[ib];
          row[ia] = ga * c + gb * s;
          row[ib] = gb * c - ga * s;
        }
    }
}

bool same_config(const MhaConfig& a, const MhaConfig& b) {
  return a.embed_dim == b.embed_dim && a.num_heads == b.num_heads && a.kv_heads() == b.kv_heads() &&
         a.key_dim() == b.key_dim() && a.value_dim() == b.value_dim() && a.bias == b.bias &&
         a.add_bias_kv == b.add_bias_kv && a.add_zero_attn == b.add_zero_attn && a.layout == b.layout &&
         a.head_dim() == b.head_dim() && a.rope.enabled == b.rope.enabled && a.rope.theta == b.rope.theta &&
         a.rope.dims == b.rope.dims && a.rope.pairing == b.rope.pairing;
}

}  // namespace

MhaTrainOutput forward_train(const MultiheadAttention& module, const Tensor& query, const Tensor& key,
                             const Tensor& value, const MhaForwardOptions& options) {
  module.check_params();
  const MhaConfig& c = module.config();
  const MhaParameters& params = module.params();
  check_inputs(c, query, key, value, options);
  const int64_t E = c.embed_dim, d = c.head_dim(), H = c.num_heads, KV = c.kv_heads();
  const bool unbatched = query.dim() == 2;
  const RowLayout qrows = row_layout(query.shape(), c.layout, unbatched);
  const RowLayout krows = row_layout(key.shape(), c.layout, unbatched);
  const int64_t B = qrows.batch, Tq = qrows.time, Tk = krows.time, Nq = B * Tq, Nk = B * Tk;
  const int64_t extra = (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0), S = Tk + extra;

  MhaTrainOutput result;
  MhaContext& ctx = result.context;
  ctx.config = c;
  ctx.query = &query, ctx.key = &key, ctx.value = &value;
  ctx.unbatched = unbatched;

  // ---- projections (module.cpp: one packed GEMM for self-attention, else three) ----
  const float* in_bias = c.bias ? params.in_proj_bias.data() : nullptr;
  const InProj w = in_proj(c, params);
  ctx.packed_self_attention = c.packed_in_proj() && query.data() == key.data() && key.data() == value.data() &&
                              query.shape() == key.shape() && key.shape() == value.shape();
  if (ctx.packed_self_attention) {
    const int64_t ld = c.in_proj_rows();
    ctx.qkv.resize(static_cast<size_t>(Nq * ld));
    kernels::linear(query.data(), Nq, E, E, params.in_proj_weight.data(), ld, E, in_bias, ctx.qkv.data(), ld);
    ctx.q_heads = head_view(ctx.qkv.data(), qrows, ld, 0, H, d);
    ctx.k_heads = head_view(ctx.qkv.data(), krows, ld, H * d, KV, d);
    ctx.v_heads = head_view(ctx.qkv.data(), krows, ld, (H + KV) * d, KV, d);
  } else {
    ctx.qkv.resize(static_cast<size_t>(Nq * H * d + 2 * Nk * KV * d));
    float* q_out = ctx.qkv.data();
    float* k_out = q_out + Nq * H * d;
    float* v_out = k_out + Nk * KV * d;
    kernels::linear(query.data(), Nq, E, E, w.wq, H * d, w.ldq, in_bias, q_out, H * d);
    kernels::linear(key.data(), Nk, c.key_dim(), c.key_dim(), w.wk, KV * d, w.ldk, in_bias ? in_bias + H * d : nullptr,
                    k_out, KV * d);
    kernels::linear(value.data(), Nk, c.value_dim(), c.value_dim(), w.wv, KV * d, w.ldv,
                    in_bias ? in_bias + (H + KV) * d : nullptr, v_out, KV * d);
    ctx.q_heads = head_view(q_out, qrows, H * d, 0, H, d);
    ctx.k_heads = head_view(k_out, krows, KV * d, 0, KV, d);
    ctx.v_heads = head_view(v_out, krows, KV * d, 0, KV, d);
  }

  // ---- rotary embeddings at positions 0 … T − 1, before bias_k is appended (it has no position) ----
  if (c.rope.enabled) {
    apply_rope(ctx.q_heads, c.rope);
    apply_rope(ctx.k_heads, c.rope);
  }

  // ---- bias_k / bias_v, then the zero position, appended after the real keys ----
  if (extra > 0) {
    ctx.k_ext = Tensor({B, KV, S, d});
    ctx.v_ext = Tensor({B, KV, S, d});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < KV; ++g) {
        for (int64_t t = 0; t < Tk; ++t)
          for (int64_t x = 0; x < d; ++x) {
            ctx.k_ext.at({b, g, t, x}) = ctx.k_heads(b, g, t, x);
            ctx.v_ext.at({b, g, t, x}) = ctx.v_heads(b, g, t, x);
          }
        if (c.add_bias_kv)
          for (int64_t x = 0; x < d; ++x) {
            ctx.k_ext.at({b, g, Tk, x}) = params.bias_k.data()[g * d + x];
            ctx.v_ext.at({b, g, Tk, x}) = params.bias_v.data()[g * d + x];
          }
      }
    ctx.k_heads = ctx.k_ext.view4();
    ctx.v_heads = ctx.v_ext.view4();
  }

  detail::ModuleMasks masks;
  detail::widen_module_masks(options, B, H, Tq, Tk, extra, masks, ctx.sdpa_options);
  // The vectors move with their buffers, so the views just set stay valid.
  ctx.allowed = std::move(masks.allowed);
  ctx.additive = std::move(masks.additive);
  ctx.key_padding = std::move(masks.key_padding);
  ctx.key_bias = std::move(masks.key_bias);
  SdpaOptions& sopt = ctx.sdpa_options;
  sopt.backend = options.backend;
  sopt.threads = options.threads;
  if (options.mode == Mode::Training && c.dropout > 0.0f) sopt.dropout = {c.dropout, options.dropout_seed};

  // ---- attention into (N_q, h·d) rows, saving lse for the backward ----
  ctx.heads = Tensor({Nq, H * d});
  ctx.lse = Tensor({B, H, Tq});
  SdpaOutputs souts;
  souts.out = head_view(ctx.heads.data(), qrows, H * d, 0, H, d);
  souts.lse = contiguous_view(ctx.lse.data(), B, H, Tq, int64_t{1});
  sdpa(View4<const float>(ctx.q_heads), View4<const float>(ctx.k_heads), View4<const float>(ctx.v_heads), sopt, souts);

  result.output = Tensor(query.shape());
  kernels::linear(ctx.heads.data(), Nq, H * d, H * d, params.out_proj_weight.data(), E, H * d,
                  c.bias ? params.out_proj_bias.data() : nullptr, result.output.data(), E);
  return result;
}

MhaGradients backward(const MultiheadAttention& module, const MhaContext& ctx, const Tensor& d_output) {
  const MhaConfig& c = module.config();
  if (!ctx.query || !ctx.key || !ctx.value) fail(kBack, ": the context is empty (it must come from forward_train)");
  if (!same_config(c, ctx.config)) fail(kBack, ": the module's configuration differs from the one forward_train saw");
  module.check_params();
  const Tensor &query = *ctx.query, &key = *ctx.key, &value = *ctx.value;
  if (d_output.shape() != query.shape())
    fail(kBack, ": d_output has shape ", shape_str(d_output.shape()), ", expected the output's ",
         shape_str(query.shape()));
  const MhaParameters& params = module.params();
  const int64_t E = c.embed_dim, d = c.head_dim(), H = c.num_heads, KV = c.kv_heads();
  const int64_t kdim = c.key_dim(), vdim = c.value_dim();
  const RowLayout qrows = row_layout(query.shape(), c.layout, ctx.unbatched);
  const RowLayout krows = row_layout(key.shape(), c.layout, ctx.unbatched);
  const int64_t B = qrows.batch, Tq = qrows.time, Tk = krows.time, Nq = B * Tq, Nk = B * Tk;
  const int64_t extra = (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0), S = Tk + extra;

  MhaGradients g;
  MhaParameters& gp = g.params;

  // output = heads · W_Oᵀ + b_O  ⇒  dW_O = dYᵀ · heads, db_O = Σ dY, d_heads = dY · W_O.
  gp.out_proj_weight = Tensor({E, H * d});
  if (c.bias) gp.out_proj_bias = Tensor({E});
  kernels::linear_backward_params(d_output.data(), Nq, E, E, ctx.heads.data(), H * d, H * d, gp.out_proj_weight.data(),
                                  H * d, c.bias ? gp.out_proj_bias.data() : nullptr);
  std::vector<float> d_heads(static_cast<size_t>(Nq * H * d));
  kernels::linear_backward_input(d_output.data(), Nq, E, E, params.out_proj_weight.data(), H * d, H * d, d_heads.data(),
                                 H * d);

  // heads = sdpa(Q, K, V)  ⇒  dQ, dK, dV. They land in row buffers shaped like the forward's
  // projections (one packed block for self-attention); with extra positions dK/dV go to
  // (B, kv, S, d) first and the real positions are copied back below.
  const bool packed = ctx.packed_self_attention;
  const int64_t ldq = packed ? c.in_proj_rows() : H * d, ldkv = packed ? c.in_proj_rows() : KV * d;
  std::vector<float> dqkv(static_cast<size_t>(packed ? Nq * ldq : Nq * H * d + 2 * Nk * KV * d));
  float* dq_rows = dqkv.data();
  float* dk_rows = packed ? dq_rows + H * d : dq_rows + Nq * H * d;
  float* dv_rows = packed ? dq_rows + (H + KV) * d : dk_rows + Nk * KV * d;
  Tensor dk_ext, dv_ext;
  SdpaGrads grads{head_view(dq_rows, qrows, ldq, 0, H, d), head_view(dk_rows, krows, ldkv, 0, KV, d),
                  head_view(dv_rows, krows, ldkv, 0, KV, d)};
  if (extra > 0) {
    dk_ext = Tensor({B, KV, S, d});
    dv_ext = Tensor({B, KV, S, d});
    grads.dk = dk_ext.view4();
    grads.dv = dv_ext.view4();
  }
  View4<float> heads_view = head_view(const_cast<float*>(ctx.heads.data()), qrows, H * d, 0, H, d);
  sdpa_backward(View4<const float>(ctx.q_heads), View4<const float>(ctx.k_heads), View4<const float>(ctx.v_heads),
                View4<const float>(heads_view), View4<const float>(head_view(d_heads.data(), qrows, H * d, 0, H, d)),
                contiguous_view(ctx.lse.data(), B, H, Tq, int64_t{1}), ctx.sdpa_options, grads);

  // K_S = [K; bias_k; 0]  ⇒  dK = dK_S[:, :, :T_k], d bias_k = Σ_b dK_S[b, :, T_k] (V likewise).
  if (extra > 0) {
    const View4<float> dk_real = head_view(dk_rows, krows, ldkv, 0, KV, d);
    const View4<float> dv_real = head_view(dv_rows, krows, ldkv, 0, KV, d);
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

  // Q ← rope(Q), K ← rope(K) (real positions only)  ⇒  dQ ← ropeᵀ(dQ), dK ← ropeᵀ(dK).
  if (c.rope.enabled) {
    rope_transpose(head_view(dq_rows, qrows, ldq, 0, H, d), c.rope);
    rope_transpose(head_view(dk_rows, krows, ldkv, 0, KV, d), c.rope);
  }

  // Q = query · W_Qᵀ + b_Q  ⇒  dW_Q = dQᵀ · query, db_Q = Σ dQ, d query = dQ · W_Q (K, V alike).
  const InProj w = in_proj(c, params);
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
  if (packed) {
    // One input for all three: the packed weight's gradient is one GEMM over the whole block.
    kernels::linear_backward_params(dqkv.data(), Nq, c.in_proj_rows(), ldq, query.data(), E, E, dwq, E, db);
  } else {
    kernels::linear_backward_params(dq_rows, Nq, H * d, ldq, query.data(), E, E, dwq, lddq, db);
    kernels::linear_backward_params(dk_rows, Nk, KV * d, ldkv, key.data(), kdim, kdim, dwk, lddk,
                                    db ? db + H * d : nullptr);
    kernels::linear_backward_params(dv_rows, Nk, KV * d, ldkv, value.data(), vdim, vdim, dwv, lddv,
                                    db ? db + (H + KV) * d : nullptr);
  }
  g.query = Tensor(query.shape());
  g.key = Tensor(key.shape());
  g.value = Tensor(value.shape());
  kernels::linear_backward_input(dq_rows, Nq, H * d, ldq, w.wq, E, w.ldq, g.query.data(), E);
  kernels::linear_backward_input(dk_rows, Nk, KV * d, ldkv, w.wk, kdim, w.ldk, g.key.data(), kdim);
  kernels::linear_backward_input(dv_rows, Nk, KV * d, ldkv, w.wv, vdim, w.ldv, g.value.data(), vdim);
  return g;
}

}  // namespace mha
