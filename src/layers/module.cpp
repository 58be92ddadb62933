// layers/module.cpp — the multi-head attention module over the SDPA kernels.
//
// Data flow for one forward (N_q = B·T_q rows in the caller's layout, no transposes):
//   query (N_q, E) ──GEMM──▶ Q (N_q, h·d) ─┐
//   key   (N_k, kdim) ─GEMM─▶ K (N_k, kv·d) ├─ strided (B, heads, T, d) views ─▶ sdpa ─▶ heads (N_q, h·d)
//   value (N_k, vdim) ─GEMM─▶ V (N_k, kv·d) ┘                                          │
//   output (N_q, E) ◀──GEMM with W_O── heads ◀─────────────────────────────────────────┘
// Self-attention with a packed weight (query, key and value the same tensor) is one GEMM into
// (N, (h + 2kv)·d) whose column blocks are Q, K and V.
#include "mha/module.h"

#include <cmath>
#include <limits>

#include "kernels/gemm.h"
#include "layers/module_masks.h"

namespace mha {

namespace {

constexpr const char* kFwd = "MultiheadAttention.forward";

/// splitmix64: a small deterministic generator for parameter initialisation.
class InitRng {
 public:
  explicit InitRng(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull) {}
  double uniform() {  // [0, 1)
    state_ += 0x9E3779B97F4A7C15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1.0p-53;
  }
  double normal() {  // Box–Muller
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

void fill_uniform(Tensor& t, InitRng& rng, double bound) {
  for (float& x : t.values()) x = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
}

void check_shape(const Tensor& t, const Shape& want, const char* name) {
  if (t.shape() != want)
    fail("MultiheadAttention: parameter ", name, " has shape ", shape_str(t.shape()), ", expected ", shape_str(want));
}

/// Row-major placement of (batch, time) rows for a layout: row = b·stride_b + t·stride_t.
struct RowLayout {
  int64_t batch = 1, time = 0, stride_b = 0, stride_t = 0;
};

RowLayout row_layout(const Tensor& x, Layout layout, bool unbatched) {
  RowLayout r;
  if (unbatched) {
    r.batch = 1, r.time = x.size(0), r.stride_b = 0, r.stride_t = 1;
  } else if (layout == Layout::BatchFirst) {
    r.batch = x.size(0), r.time = x.size(1), r.stride_b = x.size(1), r.stride_t = 1;
  } else {
    r.batch = x.size(1), r.time = x.size(0), r.stride_b = 1, r.stride_t = x.size(1);
  }
  return r;
}

/// A (B, heads, T, d) view of `heads` column blocks of width d starting at column `col0` of a
/// row-major (rows, ld) buffer whose rows are placed by `rows`.
View4<float> head_view(float* base, const RowLayout& rows, int64_t ld, int64_t col0, int64_t heads, int64_t d) {
  return {base + col0, {rows.batch, heads, rows.time, d}, {rows.stride_b * ld, d, rows.stride_t * ld, 1}};
}

const char* layout_name(Layout layout, bool unbatched) {
  if (unbatched) return "(T, features)";
  return layout == Layout::BatchFirst ? "(B, T, features)" : "(T, B, features)";
}

}  // namespace

void MhaConfig::validate() const {
  if (embed_dim <= 0) fail("MhaConfig: embed_dim must be ≥ 1, got ", embed_dim);
  if (num_heads <= 0) fail("MhaConfig: num_heads must be ≥ 1, got ", num_heads);
  if (head_dim_override < 0)
    fail("MhaConfig: head_dim_override must be ≥ 1 (or 0 for embed_dim / num_heads), got ", head_dim_override);
  if (head_dim_override == 0 && embed_dim % num_heads != 0)
    fail("MhaConfig: embed_dim ", embed_dim, " is not divisible by num_heads ", num_heads,
         " (set head_dim_override for h·d ≠ embed_dim)");
  if (num_kv_heads < 0) fail("MhaConfig: num_kv_heads must be ≥ 1 (or 0 for num_heads), got ", num_kv_heads);
  if (num_heads % kv_heads() != 0)
    fail("MhaConfig: num_heads ", num_heads, " is not a multiple of num_kv_heads ", kv_heads());
  if (kdim < 0) fail("MhaConfig: kdim must be ≥ 1 (or 0 for embed_dim), got ", kdim);
  if (vdim < 0) fail("MhaConfig: vdim must be ≥ 1 (or 0 for embed_dim), got ", vdim);
  if (!(dropout >= 0.0f && dropout < 1.0f)) fail("MhaConfig: dropout must be in [0, 1), got ", dropout);
  if (rope.enabled) rope.validate(head_dim());
}

int64_t parameter_count(const MhaConfig& c) {
  c.validate();
  const int64_t E = c.embed_dim, d = c.head_dim(), h = c.num_heads, kv = c.kv_heads();
  int64_t n = h * d * E + kv * d * c.key_dim() + kv * d * c.value_dim() + E * h * d;
  if (c.bias) n += c.in_proj_rows() + E;
  if (c.add_bias_kv) n += 2 * kv * d;
  return n;
}

AttnMask AttnMask::allow(BoolTensor allowed_positions) {
  AttnMask m;
  m.allowed = std::move(allowed_positions);
  return m;
}
AttnMask AttnMask::add(Tensor bias) {
  AttnMask m;
  m.additive = std::move(bias);
  return m;
}
AttnMask AttnMask::from_torch_bool(const BoolTensor& masked_out) {
  // The one place where PyTorch's "true = masked out" polarity is turned into ours
  // (docs/semantics.md, 'Mask polarity is in the type').
  BoolTensor allowed(masked_out.shape());
  for (int64_t i = 0; i < masked_out.numel(); ++i) allowed.data()[i] = masked_out.data()[i] ? 0 : 1;
  return allow(std::move(allowed));
}

MultiheadAttention::MultiheadAttention(const MhaConfig& config, uint64_t init_seed) : config_(config) {
  config_.validate();
  const int64_t E = config_.embed_dim, d = config_.head_dim(), h = config_.num_heads, kv = config_.kv_heads();
  InitRng rng(init_seed);
  // Xavier-uniform on the input projections (as PyTorch's _reset_parameters), zero biases,
  // U(±1/√fan_in) on W_O (nn.Linear's default), Xavier-normal on bias_k / bias_v.
  if (config_.packed_in_proj()) {
    params_.in_proj_weight = Tensor({config_.in_proj_rows(), E});
    fill_uniform(params_.in_proj_weight, rng, std::sqrt(6.0 / static_cast<double>(E + config_.in_proj_rows())));
  } else {
    params_.q_proj_weight = Tensor({h * d, E});
    params_.k_proj_weight = Tensor({kv * d, config_.key_dim()});
    params_.v_proj_weight = Tensor({kv * d, config_.value_dim()});
    fill_uniform(params_.q_proj_weight, rng, std::sqrt(6.0 / static_cast<double>(E + h * d)));
    fill_uniform(params_.k_proj_weight, rng, std::sqrt(6.0 / static_cast<double>(config_.key_dim() + kv * d)));
    fill_uniform(params_.v_proj_weight, rng, std::sqrt(6.0 / static_cast<double>(config_.value_dim() + kv * d)));
  }
  params_.out_proj_weight = Tensor({E, h * d});
  fill_uniform(params_.out_proj_weight, rng, 1.0 / std::sqrt(static_cast<double>(h * d)));
  if (config_.bias) {
    params_.in_proj_bias = Tensor({config_.in_proj_rows()});
    params_.out_proj_bias = Tensor({E});
  }
  if (config_.add_bias_kv) {
    params_.bias_k = Tensor({1, 1, kv * d});
    params_.bias_v = Tensor({1, 1, kv * d});
    const double sd = std::sqrt(2.0 / static_cast<double>(2 * kv * d));
    for (float& x : params_.bias_k.values()) x = static_cast<float>(rng.normal() * sd);
    for (float& x : params_.bias_v.values()) x = static_cast<float>(rng.normal() * sd);
  }
}

void MultiheadAttention::check_params() const {
  const MhaConfig& c = config_;
  const int64_t E = c.embed_dim, d = c.head_dim(), h = c.num_heads, kv = c.kv_heads();
  if (c.packed_in_proj()) {
    check_shape(params_.in_proj_weight, {c.in_proj_rows(), E}, "in_proj_weight");
  } else {
    check_shape(params_.q_proj_weight, {h * d, E}, "q_proj_weight");
    check_shape(params_.k_proj_weight, {kv * d, c.key_dim()}, "k_proj_weight");
    check_shape(params_.v_proj_weight, {kv * d, c.value_dim()}, "v_proj_weight");
  }
  check_shape(params_.out_proj_weight, {E, h * d}, "out_proj.weight");
  if (c.bias) {
    check_shape(params_.in_proj_bias, {c.in_proj_rows()}, "in_proj_bias");
    check_shape(params_.out_proj_bias, {E}, "out_proj.bias");
  }
  if (c.add_bias_kv) {
    check_shape(params_.bias_k, {1, 1, kv * d}, "bias_k");
    check_shape(params_.bias_v, {1, 1, kv * d}, "bias_v");
  }
}

int64_t MultiheadAttention::parameter_count() const { return mha::parameter_count(config_); }

MhaOutput MultiheadAttention::forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                      const MhaForwardOptions& options) const {
  check_params();
  const MhaConfig& c = config_;
  const int64_t E = c.embed_dim, d = c.head_dim(), H = c.num_heads, KV = c.kv_heads();
  const int64_t kdim = c.key_dim(), vdim = c.value_dim();

  // ---- validate the inputs (docs/semantics.md, 'Bad input is an error': once, here, naming the shapes) ----
  if (query.dim() != 2 && query.dim() != 3)
    fail(kFwd, ": query must be 3-D ", layout_name(c.layout, false), " or 2-D (T, E) unbatched, got ",
         shape_str(query.shape()));
  const bool unbatched = query.dim() == 2;
  if (key.dim() != query.dim() || value.dim() != query.dim())
    fail(kFwd, ": query ", shape_str(query.shape()), ", key ", shape_str(key.shape()), " and value ",
         shape_str(value.shape()), " must all be ", unbatched ? "2-D (unbatched)" : "3-D (batched)");
  const RowLayout qrows = row_layout(query, c.layout, unbatched);
  const RowLayout krows = row_layout(key, c.layout, unbatched);
  const RowLayout vrows = row_layout(value, c.layout, unbatched);
  if (query.size(-1) != E)
    fail(kFwd, ": query ", shape_str(query.shape()), " must have embed_dim ", E, " features, laid out as ",
         layout_name(c.layout, unbatched));
  if (key.size(-1) != kdim)
    fail(kFwd, ": key ", shape_str(key.shape()), " must have kdim ", kdim, " features, laid out as ",
         layout_name(c.layout, unbatched));
  if (value.size(-1) != vdim)
    fail(kFwd, ": value ", shape_str(value.shape()), " must have vdim ", vdim, " features, laid out as ",
         layout_name(c.layout, unbatched));
  if (krows.batch != qrows.batch || vrows.batch != qrows.batch)
    fail(kFwd, ": batch sizes differ: query ", shape_str(query.shape()), ", key ", shape_str(key.shape()), ", value ",
         shape_str(value.shape()), " (layout ", layout_name(c.layout, unbatched), ")");
  if (krows.time != vrows.time)
    fail(kFwd, ": key ", shape_str(key.shape()), " and value ", shape_str(value.shape()),
         " must have the same sequence length");
  const int64_t B = qrows.batch, Tq = qrows.time, Tk = krows.time;
  const int64_t extra = (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0);
  const int64_t S = Tk + extra;  // key positions seen by the softmax

  const AttnMask& am = options.attn_mask;
  if (am.allowed.defined() && am.additive.defined())
    fail(kFwd, ": attn_mask must be either allowed positions or an additive bias, not both");
  const Shape& am_shape = am.allowed.defined() ? am.allowed.shape() : am.additive.shape();
  if (am.present()) {
    const Shape want2{Tq, Tk}, want3{B * H, Tq, Tk};
    if (am_shape != want2 && am_shape != want3)
      fail(kFwd, ": attn_mask has shape ", shape_str(am_shape), ", expected ", shape_str(want2), " or ",
           shape_str(want3), " (B·num_heads, T_q, T_k)");
  }
  const KeyPaddingMask& kpm = options.key_padding_mask;
  if (kpm.is_padding.defined() && kpm.additive.defined())
    fail(kFwd, ": key_padding_mask must be either boolean padding or an additive bias, not both");
  if (kpm.present()) {
    const Shape& s = kpm.is_padding.defined() ? kpm.is_padding.shape() : kpm.additive.shape();
    const Shape want = unbatched ? Shape{Tk} : Shape{B, Tk};
    if (s != want) fail(kFwd, ": key_padding_mask has shape ", shape_str(s), ", expected ", shape_str(want));
  }

  MhaOutput result;
  const int64_t Nq = B * Tq, Nk = B * Tk;

  // ---- projections ----
  const float* in_bias = c.bias ? params_.in_proj_bias.data() : nullptr;
  const float* bq = in_bias;
  const float* bk = in_bias ? in_bias + H * d : nullptr;
  const float* bv = in_bias ? in_bias + (H + KV) * d : nullptr;
  const float* wq = c.packed_in_proj() ? params_.in_proj_weight.data() : params_.q_proj_weight.data();
  const float* wk = c.packed_in_proj() ? params_.in_proj_weight.data() + H * d * E : params_.k_proj_weight.data();
  const float* wv =
      c.packed_in_proj() ? params_.in_proj_weight.data() + (H + KV) * d * E : params_.v_proj_weight.data();

  std::vector<float> qkv;  // projected activations
  View4<float> Qv, Kv, Vv;
  const bool self_attention = c.packed_in_proj() && query.data() == key.data() && key.data() == value.data() &&
                              query.shape() == key.shape() && key.shape() == value.shape();
  if (self_attention) {
    const int64_t ld = c.in_proj_rows();
    qkv.resize(static_cast<size_t>(Nq * ld));
    kernels::linear(query.data(), Nq, E, E, params_.in_proj_weight.data(), ld, E, in_bias, qkv.data(), ld);
    Qv = head_view(qkv.data(), qrows, ld, 0, H, d);
    Kv = head_view(qkv.data(), krows, ld, H * d, KV, d);
    Vv = head_view(qkv.data(), vrows, ld, (H + KV) * d, KV, d);
  } else {
    qkv.resize(static_cast<size_t>(Nq * H * d + 2 * Nk * KV * d));
    float* q_out = qkv.data();
    float* k_out = q_out + Nq * H * d;
    float* v_out = k_out + Nk * KV * d;
    kernels::linear(query.data(), Nq, E, E, wq, H * d, E, bq, q_out, H * d);
    kernels::linear(key.data(), Nk, kdim, kdim, wk, KV * d, c.packed_in_proj() ? E : kdim, bk, k_out, KV * d);
    kernels::linear(value.data(), Nk, vdim, vdim, wv, KV * d, c.packed_in_proj() ? E : vdim, bv, v_out, KV * d);
    Qv = head_view(q_out, qrows, H * d, 0, H, d);
    Kv = head_view(k_out, krows, KV * d, 0, KV, d);
    Vv = head_view(v_out, vrows, KV * d, 0, KV, d);
  }

  // ---- rotary embeddings at positions 0 … T − 1, before bias_k is appended (it has no position) ----
  if (c.rope.enabled) {
    apply_rope(Qv, c.rope);
    apply_rope(Kv, c.rope);
  }

  // ---- bias_k / bias_v and the zero position: S = T_k + extra key positions ----
  // Appended after the real keys, bias_kv first (PyTorch's order). K/V are copied into
  // (B, kv, S, d) only in this case.
  Tensor k_ext, v_ext;
  if (extra > 0) {
    k_ext = Tensor({B, KV, S, d});
    v_ext = Tensor({B, KV, S, d});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < KV; ++g) {
        for (int64_t t = 0; t < Tk; ++t)
          for (int64_t x = 0; x < d; ++x) {
            k_ext.at({b, g, t, x}) = Kv(b, g, t, x);
            v_ext.at({b, g, t, x}) = Vv(b, g, t, x);
          }
        if (c.add_bias_kv)
          for (int64_t x = 0; x < d; ++x) {
            k_ext.at({b, g, Tk, x}) = params_.bias_k.data()[g * d + x];
            v_ext.at({b, g, Tk, x}) = params_.bias_v.data()[g * d + x];
          }
        // The zero position (if any) is already 0.
      }
    Kv = k_ext.view4();
    Vv = v_ext.view4();
  }

  // ---- masks, widened to S columns where extra positions were appended (they stay visible) ----
  SdpaOptions sopt;
  sopt.backend = options.backend;
  sopt.threads = options.threads;
  if (options.mode == Mode::Training && c.dropout > 0.0f) sopt.dropout = {c.dropout, options.dropout_seed};
  detail::ModuleMasks masks;
  detail::widen_module_masks(options, B, H, Tq, Tk, extra, masks, sopt);

  // ---- attention: heads land directly in (N_q, h·d) rows, in the query's layout ----
  std::vector<float> heads(static_cast<size_t>(Nq * H * d));
  SdpaOutputs souts;
  souts.out = head_view(heads.data(), qrows, H * d, 0, H, d);
  Tensor per_head;
  if (options.need_weights != NeedWeights::None) {
    per_head = Tensor({B, H, Tq, S});
    souts.weights = per_head.view4();
  }
  sdpa(View4<const float>(Qv), View4<const float>(Kv), View4<const float>(Vv), sopt, souts);

  // ---- output projection ----
  result.output = Tensor(query.shape());  // (…, E): same layout as the query
  kernels::linear(heads.data(), Nq, H * d, H * d, params_.out_proj_weight.data(), E, H * d,
                  c.bias ? params_.out_proj_bias.data() : nullptr, result.output.data(), E);

  // ---- attention weights, per head or averaged over heads ----
  if (options.need_weights == NeedWeights::PerHead) {
    result.attn_weights = unbatched ? per_head.reshaped({H, Tq, S}) : std::move(per_head);
  } else if (options.need_weights == NeedWeights::Averaged) {
    Tensor avg({B, Tq, S});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < Tq; ++i)
        for (int64_t j = 0; j < S; ++j) {
          double sum = 0.0;
          for (int64_t h = 0; h < H; ++h) sum += per_head.at({b, h, i, j});
          avg.at({b, i, j}) = static_cast<float>(sum / static_cast<double>(H));
        }
    result.attn_weights = unbatched ? avg.reshaped({Tq, S}) : std::move(avg);
  }
  return result;
}

}  // namespace mha
