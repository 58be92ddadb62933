// layers/module_core.cpp — the module pipeline shared by forward, forward_train and
// forward_incremental (layers/module_core.h).
//
// Data flow for one forward (N_q = B·T_q rows in the caller's layout, no transposes):
//   query (N_q, E) ──GEMM──▶ Q (N_q, h·d) ─┐
//   key   (N_k, kdim) ─GEMM─▶ K (N_k, kv·d) ├─ strided (B, heads, T, d) views ─▶ sdpa ─▶ heads (N_q, h·d)
//   value (N_k, vdim) ─GEMM─▶ V (N_k, kv·d) ┘                                          │
//   output (N_q, E) ◀──GEMM with W_O── heads ◀─────────────────────────────────────────┘
// Self-attention with a packed weight (query, key and value the same tensor) is one GEMM into
// (N, (h + 2kv)·d) whose column blocks are Q, K and V.
#include "layers/module_core.h"

#include "kernels/gemm.h"

#include <unistd.h>

#include <limits>
#include <string>
#include <vector>

namespace mha::detail {

namespace {

const char* layout_name(Layout layout, bool unbatched) {
  if (unbatched) return "(T, features)";
  return layout == Layout::BatchFirst ? "(B, T, features)" : "(T, B, features)";
}

}  // namespace

RowPlacement RowPlacement::of(const Shape& shape, Layout layout) {
  if (shape.size() == 2) return {1, shape[0], 0, 1};
  if (layout == Layout::BatchFirst) return {shape[0], shape[1], shape[1], 1};
  return {shape[1], shape[0], 1, shape[1]};
}

ModuleCall check_inputs(const char* fn, const MhaConfig& c, const Tensor& query, const Tensor& key, const Tensor& value,
                        KvTokens kv_tokens) {
  if (query.dim() != 2 && query.dim() != 3)
    fail(fn, ": query must be 3-D ", layout_name(c.layout, false), " or 2-D (T, E) unbatched, got ",
         shape_str(query.shape()));
  ModuleCall call;
  call.unbatched = query.dim() == 2;
  if (key.dim() != query.dim() || value.dim() != query.dim())
    fail(fn, ": query ", shape_str(query.shape()), ", key ", shape_str(key.shape()), " and value ",
         shape_str(value.shape()), " must all be ", call.unbatched ? "2-D (unbatched)" : "3-D (batched)");
  const struct {
    const Tensor& t;
    int64_t features;
    const char* name;
    const char* dim_name;
  } args[] = {{query, c.embed_dim, "query", "embed_dim"},
              {key, c.key_dim(), "key", "kdim"},
              {value, c.value_dim(), "value", "vdim"}};
  for (const auto& a : args)
    if (a.t.size(-1) != a.features)
      fail(fn, ": ", a.name, " ", shape_str(a.t.shape()), " must have ", a.dim_name, " ", a.features,
           " features, laid out as ", layout_name(c.layout, call.unbatched));
  call.q_rows = RowPlacement::of(query.shape(), c.layout);
  call.k_rows = RowPlacement::of(key.shape(), c.layout);
  const RowPlacement v_rows = RowPlacement::of(value.shape(), c.layout);
  if (call.k_rows.batch != call.q_rows.batch || v_rows.batch != call.q_rows.batch)
    fail(fn, ": batch sizes differ: query ", shape_str(query.shape()), ", key ", shape_str(key.shape()), ", value ",
         shape_str(value.shape()), " (layout ", layout_name(c.layout, call.unbatched), ")");
  if (call.k_rows.steps != v_rows.steps)
    fail(fn, ": key ", shape_str(key.shape()), " and value ", shape_str(value.shape()),
         " must have the same sequence length");
  if (kv_tokens == KvTokens::SameAsQuery && call.k_rows.steps != call.q_rows.steps)
    fail(fn, ": query ", shape_str(query.shape()), ", key ", shape_str(key.shape()), " and value ",
         shape_str(value.shape()), " must hold the same number of new tokens");
  return call;
}

void check_masks(const char* fn, const MhaConfig& c, const ModuleCall& call, const MhaForwardOptions& options) {
  const AttnMask& am = options.attn_mask;
  if (am.allowed.defined() && am.additive.defined())
    fail(fn, ": attn_mask must be either allowed positions or an additive bias, not both");
  if (am.present()) {
    const Shape& s = am.allowed.defined() ? am.allowed.shape() : am.additive.shape();
    const Shape want2{call.t_q(), call.t_k()}, want3{call.batch() * c.num_heads, call.t_q(), call.t_k()};
    if (s != want2 && s != want3)
      fail(fn, ": attn_mask has shape ", shape_str(s), ", expected ", shape_str(want2), " or ", shape_str(want3),
           " (B·num_heads, T_q, T_k)");
  }
  const KeyPaddingMask& kpm = options.key_padding_mask;
  if (kpm.is_padding.defined() && kpm.additive.defined())
    fail(fn, ": key_padding_mask must be either boolean padding or an additive bias, not both");
  if (kpm.present()) {
    const Shape& s = kpm.is_padding.defined() ? kpm.is_padding.shape() : kpm.additive.shape();
    const Shape want = call.unbatched ? Shape{call.t_k()} : Shape{call.batch(), call.t_k()};
    if (s != want) fail(fn, ": key_padding_mask has shape ", shape_str(s), ", expected ", shape_str(want));
  }
}

InProjWeights in_proj_weights(const MhaConfig& c, const MhaParameters& p) {
  const int64_t E = c.embed_dim, H = c.num_heads, KV = c.kv_heads(), d = c.head_dim();
  InProjWeights w{};
  if (c.packed_in_proj()) {
    const float* packed = p.in_proj_weight.data();
    w.q = packed, w.k = packed + H * d * E, w.v = packed + (H + KV) * d * E;
    w.ld_q = w.ld_k = w.ld_v = E;
  } else {
    w.q = p.q_proj_weight.data(), w.k = p.k_proj_weight.data(), w.v = p.v_proj_weight.data();
    w.ld_q = E, w.ld_k = c.key_dim(), w.ld_v = c.value_dim();
  }
  if (c.bias) {
    const float* b = p.in_proj_bias.data();
    w.bias_q = b, w.bias_k = b + H * d, w.bias_v = b + (H + KV) * d;
  } else {
    w.bias_q = w.bias_k = w.bias_v = nullptr;
  }
  return w;
}

bool packed_self_attention(const MhaConfig& c, const Tensor& query, const Tensor& key, const Tensor& value) {
  return c.packed_in_proj() && query.data() == key.data() && key.data() == value.data() &&
         query.shape() == key.shape() && key.shape() == value.shape();
}

ProjectionPlan ProjectionPlan::make(const MhaConfig& c, const ModuleCall& call, bool packed) {
  const int64_t d = c.head_dim(), H = c.num_heads, KV = c.kv_heads();
  const int64_t Nq = call.q_rows.rows(), Nk = call.k_rows.rows();
  ProjectionPlan plan;
  plan.packed = packed;
  if (packed) {
    plan.ld_q = plan.ld_kv = c.in_proj_rows();
    plan.floats = Nq * plan.ld_q;
    plan.q = 0, plan.k = H * d, plan.v = (H + KV) * d;
  } else {
    plan.ld_q = H * d, plan.ld_kv = KV * d;
    plan.floats = Nq * H * d + 2 * Nk * KV * d;
    plan.q = 0, plan.k = Nq * H * d, plan.v = plan.k + Nk * KV * d;
  }
  return plan;
}

View4<float> ProjectionPlan::q_heads(float* buffer, const ModuleCall& call, const MhaConfig& c) const {
  return call.q_rows.heads(buffer + q, ld_q, 0, c.num_heads, c.head_dim());
}
View4<float> ProjectionPlan::k_heads(float* buffer, const ModuleCall& call, const MhaConfig& c) const {
  return call.k_rows.heads(buffer + k, ld_kv, 0, c.kv_heads(), c.head_dim());
}
View4<float> ProjectionPlan::v_heads(float* buffer, const ModuleCall& call, const MhaConfig& c) const {
  return call.k_rows.heads(buffer + v, ld_kv, 0, c.kv_heads(), c.head_dim());
}

Projections project_inputs(const MhaConfig& c, const MhaParameters& params, const Tensor& query, const Tensor& key,
                           const Tensor& value, const ModuleCall& call, ScratchPool* pool, int threads) {
  const int64_t E = c.embed_dim, d = c.head_dim(), H = c.num_heads, KV = c.kv_heads();
  const int64_t Nq = call.q_rows.rows(), Nk = call.k_rows.rows();
  Projections p;
  p.plan = ProjectionPlan::make(c, call, packed_self_attention(c, query, key, value));
  // Every element is written by the GEMMs below before anything reads it.
  float* buf = nullptr;
  if (pool) {
    p.scratch = pool->take(static_cast<size_t>(p.plan.floats));
    buf = p.scratch.data();
  } else {
    p.rows.resize(static_cast<size_t>(p.plan.floats));
    buf = p.rows.data();
  }
  const InProjWeights w = in_proj_weights(c, params);
  if (p.plan.packed) {
    const int64_t ld = p.plan.ld_q;
    kernels::linear(query.data(), Nq, E, E, params.in_proj_weight.data(), ld, E, w.bias_q, buf, ld, threads);
  } else {
    kernels::linear(query.data(), Nq, E, E, w.q, H * d, w.ld_q, w.bias_q, buf + p.plan.q, p.plan.ld_q, threads);
    kernels::linear(key.data(), Nk, c.key_dim(), c.key_dim(), w.k, KV * d, w.ld_k, w.bias_k, buf + p.plan.k,
                    p.plan.ld_kv, threads);
    kernels::linear(value.data(), Nk, c.value_dim(), c.value_dim(), w.v, KV * d, w.ld_v, w.bias_v, buf + p.plan.v,
                    p.plan.ld_kv, threads);
  }
  p.q = p.plan.q_heads(buf, call, c);
  p.k = p.plan.k_heads(buf, call, c);
  p.v = p.plan.v_heads(buf, call, c);
  return p;
}

int64_t extra_positions(const MhaConfig& c) { return (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0); }

void append_extra_positions(const MhaConfig& c, const MhaParameters& params, View4<float>& k, View4<float>& v,
                            Tensor& k_ext, Tensor& v_ext) {
  const int64_t extra = extra_positions(c);
  if (extra == 0) return;
  const int64_t B = k.shape[0], KV = k.shape[1], Tk = k.shape[2], d = k.shape[3], S = Tk + extra;
  k_ext = Tensor({B, KV, S, d});
  v_ext = Tensor({B, KV, S, d});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < KV; ++g) {
      for (int64_t t = 0; t < Tk; ++t)
        for (int64_t x = 0; x < d; ++x) {
          k_ext.at({b, g, t, x}) = k(b, g, t, x);
          v_ext.at({b, g, t, x}) = v(b, g, t, x);
        }
      if (c.add_bias_kv)
        for (int64_t x = 0; x < d; ++x) {
          k_ext.at({b, g, Tk, x}) = params.bias_k.data()[g * d + x];
          v_ext.at({b, g, Tk, x}) = params.bias_v.data()[g * d + x];
        }
      // The zero position (if any) is already 0.
    }
  k = k_ext.view4();
  v = v_ext.view4();
}

Tensor project_output(const MhaConfig& c, const MhaParameters& params, const float* heads, const Shape& query_shape,
                      int64_t rows, int threads) {
  const int64_t E = c.embed_dim, hd = c.num_heads * c.head_dim();
  // (…, E): same layout as the query; linear() writes every element (no zero fill first).
  Tensor output = Tensor::uninitialized(query_shape);
  kernels::linear(heads, rows, hd, hd, params.out_proj_weight.data(), E, hd,
                  c.bias ? params.out_proj_bias.data() : nullptr, output.data(), E, threads);
  return output;
}

int64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return 0;
  int64_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<int64_t>(pages), static_cast<int64_t>(page), &bytes))
    return std::numeric_limits<int64_t>::max();
  return bytes;
}

void check_pass_memory(const char* fn, const MhaConfig& c, const ModuleCall& call, PassOutputs keep) {
  const int64_t B = call.batch(), Tq = call.t_q(), Tk = call.t_k(), H = c.num_heads, d = c.head_dim();
  const int64_t S = checked_add(Tk, extra_positions(c), fn);
  struct Need {
    const char* what;
    Shape shape;
  };
  std::vector<Need> needs{{"projected queries", {call.q_rows.rows(), H * d}},
                          {"projected keys and values", {2, call.k_rows.rows(), c.kv_heads() * d}},
                          {"attention heads", {call.q_rows.rows(), H * d}},
                          {"output", {call.q_rows.rows(), c.embed_dim}}};
  if (keep.weights) needs.push_back({"attention weights", {B, H, Tq, S}});
  if (keep.averaged_weights) needs.push_back({"averaged attention weights", {B, Tq, S}});
  if (keep.lse) needs.push_back({"log-sum-exp", {B, H, Tq}});
  int64_t total = 0;
  const Need* largest = nullptr;
  int64_t largest_bytes = -1;
  for (const Need& n : needs) {
    std::string what = std::string(fn) + ": " + n.what + " " + shape_str(n.shape);
    int64_t bytes = 0;
    try {
      bytes = checked_mul(shape_numel(n.shape), int64_t{4}, what);
    } catch (const Error&) {
      fail(what, " need more bytes than fit in 64 bits");
    }
    total = checked_add(total, bytes, what);
    if (bytes > largest_bytes) largest = &n, largest_bytes = bytes;
  }
  const int64_t memory = physical_memory_bytes();
  if (memory > 0 && total > memory)
    fail(fn, ": ", largest->what, " ", shape_str(largest->shape), " need ",
         bytes_str(static_cast<double>(largest_bytes)), " (", bytes_str(static_cast<double>(total)),
         " for the whole call); this machine has ", bytes_str(static_cast<double>(memory)), " of memory");
}

void rope_per_sequence(View4<float> x, const Rope& rope, const SeqOffsets& cu, RopeDirection direction) {
  for (int64_t s = 0; s < cu.seqs(); ++s) {
    View4<float> part = x;
    part.data += cu.values()[static_cast<size_t>(s)] * x.stride[2];
    part.shape[2] = cu.length(s);
    if (part.shape[2] > 0) apply_rope(part, rope, nullptr, direction);
  }
}

void check_packed(const char* fn, const MhaConfig& c, const ModuleCall& call, const MhaForwardOptions& options) {
  if (!call.unbatched)
    fail(fn, ": a packed batch (options.packed) takes 2-D inputs (total, features), one row per token");
  if (options.attn_mask.present() || options.key_padding_mask.present())
    fail(fn,
         ": a packed batch takes no attn_mask or key_padding_mask (the sequences' offsets say what each token sees)");
  if (options.need_weights != NeedWeights::None) fail(fn, ": attention weights are not returned for a packed batch");
  if (c.add_bias_kv || c.add_zero_attn) fail(fn, ": add_bias_kv / add_zero_attn are not supported with a packed batch");
  if (options.mode == Mode::Training && c.dropout > 0.0f)
    fail(fn, ": dropout is not supported with a packed batch (the module's dropout is ", c.dropout, ")");
  check_varlen(fn, *options.packed, call.t_q(), call.t_k());
}

void set_score_options(const MhaConfig& c, const MhaParameters& params, SdpaOptions& sopt) {
  sopt.scale = c.scale;
  sopt.alibi.slopes = c.alibi_slopes;
  sopt.softcap = c.softcap;
  if (c.attention_sinks) sopt.sinks.logits = {params.sinks.data(), static_cast<size_t>(params.sinks.numel())};
}

void check_forward_enums(const char* fn, const MhaForwardOptions& options) {
  // Enums cast from integers: a mode past Training ran as Eval (no dropout), a NeedWeights past
  // Averaged returned no weights, with no error (docs/semantics.md, 'Bad input is an error').
  if (options.mode != Mode::Eval && options.mode != Mode::Training)
    fail(fn, ": options.mode ", static_cast<int>(options.mode), " is not a Mode (Eval or Training)");
  if (options.need_weights != NeedWeights::None && options.need_weights != NeedWeights::PerHead &&
      options.need_weights != NeedWeights::Averaged)
    fail(fn, ": options.need_weights ", static_cast<int>(options.need_weights),
         " is not a NeedWeights (None, PerHead or Averaged)");
}

ModulePass run_module(const char* fn, const MultiheadAttention& module, const Tensor& query, const Tensor& key,
                      const Tensor& value, const MhaForwardOptions& options, PassOutputs keep, ScratchPool* pool) {
  module.check_params();
  const MhaConfig& c = module.config();
  const MhaParameters& params = module.params();
  ModulePass pass;
  check_forward_enums(fn, options);
  pass.call = check_inputs(fn, c, query, key, value);
  check_masks(fn, c, pass.call, options);
  if (options.packed) check_packed(fn, c, pass.call, options);
  const ModuleCall& call = pass.call;
  check_pass_memory(fn, c, call, keep);
  const int64_t B = call.batch(), Tq = call.t_q(), Tk = call.t_k(), H = c.num_heads, d = c.head_dim();
  const int64_t extra = extra_positions(c), S = Tk + extra;

  pass.proj = project_inputs(c, params, query, key, value, call, pool, options.threads);
  // Rotary embeddings at positions 0 … T − 1, before bias_k is appended (it has no position).
  if (c.rope.enabled && options.packed) {  // positions restart at 0 in each packed sequence
    rope_per_sequence(pass.proj.q, c.rope, options.packed->cu_seqlens_q);
    rope_per_sequence(pass.proj.k, c.rope, options.packed->cu_seqlens_k);
  } else if (c.rope.enabled) {
    apply_rope(pass.proj.q, c.rope);
    apply_rope(pass.proj.k, c.rope);
  }
  append_extra_positions(c, params, pass.proj.k, pass.proj.v, pass.k_ext, pass.v_ext);

  // Masks widened to S columns where extra positions were appended (they stay visible).
  SdpaOptions& sopt = pass.sdpa_options;
  sopt.backend = options.backend;
  sopt.threads = options.threads;
  if (options.mode == Mode::Training && c.dropout > 0.0f) sopt.dropout = {c.dropout, options.dropout_seed};
  set_score_options(c, params, sopt);
  widen_module_masks(options, B, H, Tq, Tk, extra, keep.masks, pass.masks, sopt);

  // Attention: heads land directly in (N_q, h·d) rows, in the query's layout (sdpa writes every one).
  float* heads = nullptr;
  if (pool) {
    pass.heads_scratch = pool->take(static_cast<size_t>(call.q_rows.rows() * H * d));
    heads = pass.heads_scratch.data();
  } else {
    pass.heads = Tensor::uninitialized({call.q_rows.rows(), H * d});
    heads = pass.heads.data();
  }
  SdpaOutputs souts;
  souts.out = call.q_rows.heads(heads, H * d, 0, H, d);
  if (keep.lse) {  // written for every row, as the heads are
    pass.lse = Tensor::uninitialized({B, H, Tq});
    souts.lse = contiguous_view(pass.lse.data(), B, H, Tq, int64_t{1});
  }
  // Weights are written in full by every kernel (zeros where a row sees nothing, NaN rows NaN),
  // so neither tensor is zero-filled first (128 MiB for per-head weights at T=2048, h=8).
  if (keep.weights) {
    pass.weights = Tensor::uninitialized({B, H, Tq, S});
    souts.weights = pass.weights.view4();
  }
  if (keep.averaged_weights) {  // averaged over heads by the attention itself, no per-head intermediate
    pass.averaged_weights = Tensor::uninitialized({B, 1, Tq, S});
    souts.averaged_weights = pass.averaged_weights.view4();
  }
  if (options.packed) {
    sopt.masks.causal = options.causal;  // aligned per sequence by sdpa_varlen
    sdpa_varlen(View4<const float>(pass.proj.q), View4<const float>(pass.proj.k), View4<const float>(pass.proj.v),
                *options.packed, sopt, souts);
  } else {
    sdpa(View4<const float>(pass.proj.q), View4<const float>(pass.proj.k), View4<const float>(pass.proj.v), sopt,
         souts);
  }

  pass.output = project_output(c, params, heads, query.shape(), call.q_rows.rows(), options.threads);
  return pass;
}

}  // namespace mha::detail
