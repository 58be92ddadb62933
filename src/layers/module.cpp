// layers/module.cpp — the multi-head attention module: configuration, parameters and their
// initialisation, and forward() over the shared pipeline (layers/module_core.h, which also
// describes the data flow).
#include "mha/module.h"

#include <cmath>
#include <limits>
#include <sstream>

#include "layers/module_core.h"
#include "layers/scratch_pool.h"
#include "mha/random.h"

namespace mha {

namespace {

constexpr const char* kFwd = "MultiheadAttention.forward";

void fill_uniform(Tensor& t, SplitMix64& rng, double bound) {
  for (float& x : t.values()) x = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
}

void check_shape(const Tensor& t, const Shape& want, const char* name) {
  if (t.shape() != want)
    fail("MultiheadAttention: parameter ", name, " has shape ", shape_str(t.shape()), ", expected ", shape_str(want));
}

/// Every parameter size of `c` with overflow checks (the dimensions are ≥ 1 when this runs).
int64_t checked_parameter_count(const MhaConfig& c) {
  std::ostringstream os;
  os << "MhaConfig (embed_dim=" << c.embed_dim << ", num_heads=" << c.num_heads << ", num_kv_heads=" << c.kv_heads()
     << ", head_dim=" << c.head_dim() << ", kdim=" << c.key_dim() << ", vdim=" << c.value_dim() << ")";
  const std::string what = os.str();
  const int64_t E = c.embed_dim, d = c.head_dim(), h = c.num_heads, kv = c.kv_heads();
  const int64_t hd = checked_mul(h, d, what), kvd = checked_mul(kv, d, what);
  const int64_t rows = checked_add(hd, checked_mul(2, kvd, what), what);  // in_proj_rows()
  int64_t n = checked_mul(hd, E, what);
  n = checked_add(n, checked_mul(kvd, c.key_dim(), what), what);
  n = checked_add(n, checked_mul(kvd, c.value_dim(), what), what);
  n = checked_add(n, checked_mul(E, hd, what), what);
  (void)checked_mul(rows, E, what);  // the packed in_proj_weight
  if (c.bias) n = checked_add(n, checked_add(rows, E, what), what);
  if (c.add_bias_kv) n = checked_add(n, checked_mul(2, kvd, what), what);
  if (c.attention_sinks) n = checked_add(n, h, what);
  return n;
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
  if (layout != Layout::SeqFirst && layout != Layout::BatchFirst)
    fail("MhaConfig: layout ", static_cast<int>(layout), " is not a Layout (SeqFirst or BatchFirst)");
  if (rope.enabled) rope.validate(head_dim());
  if (scale && !std::isfinite(*scale)) fail("MhaConfig: scale must be finite, got ", *scale);
  if (!std::isfinite(softcap) || softcap < 0.0f)
    fail("MhaConfig: softcap must be a finite c > 0 (or 0 = off), got ", softcap);
  if (!alibi_slopes.empty()) {
    if (static_cast<int64_t>(alibi_slopes.size()) != num_heads)
      fail("MhaConfig: alibi_slopes has ", alibi_slopes.size(), " entries, expected one per head (", num_heads, ")");
    for (float m : alibi_slopes)
      if (!std::isfinite(m)) fail("MhaConfig: alibi slope ", m, " is not finite");
    if (add_bias_kv || add_zero_attn)
      fail("MhaConfig: ALiBi needs key positions; add_bias_kv / add_zero_attn append keys that have none");
  }
  // Configurations come from files' metadata too: every size the module derives from one must fit
  // in int64, so that in_proj_rows(), the parameter shapes and parameter_count() need no checks.
  (void)checked_parameter_count(*this);
}

int64_t parameter_count(const MhaConfig& c) {
  c.validate();
  return checked_parameter_count(c);
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
  SplitMix64 rng = SplitMix64::seeded(init_seed);
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
  if (config_.attention_sinks) params_.sinks = Tensor({h});  // zeros: every sink starts at logit 0
}

MultiheadAttention::MultiheadAttention(const MhaConfig& config, MhaParameters params)
    : config_(config), params_(std::move(params)) {
  config_.validate();
  check_params();
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
  if (c.attention_sinks) check_shape(params_.sinks, {h}, "sinks");
}

int64_t MultiheadAttention::parameter_count() const { return mha::parameter_count(config_); }

MhaOutput MultiheadAttention::forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                      const MhaForwardOptions& options) const {
  detail::PassOutputs keep;
  keep.weights = options.need_weights == NeedWeights::PerHead;
  keep.averaged_weights = options.need_weights == NeedWeights::Averaged;
  keep.lse = options.need_lse;
  detail::ModulePass pass = detail::run_module(kFwd, *this, query, key, value, options, keep, scratch_.pool.get());
  MhaOutput result;
  result.output = std::move(pass.output);
  if (options.need_lse)
    result.lse = pass.call.unbatched ? pass.lse.reshaped({config_.num_heads, pass.call.t_q()}) : std::move(pass.lse);

  // Attention weights, per head or averaged over heads.
  const int64_t B = pass.call.batch(), Tq = pass.call.t_q(), H = config_.num_heads;
  const int64_t S = pass.call.t_k() + detail::extra_positions(config_);
  if (options.need_weights == NeedWeights::PerHead) {
    result.attn_weights =
        pass.call.unbatched ? Tensor({H, Tq, S}, std::move(pass.weights.storage())) : std::move(pass.weights);
  } else if (options.need_weights == NeedWeights::Averaged) {
    const Shape shape = pass.call.unbatched ? Shape{Tq, S} : Shape{B, Tq, S};
    result.attn_weights = Tensor(shape, std::move(pass.averaged_weights.storage()));
  }
  return result;
}

void MultiheadAttention::release_workspace() const { scratch_.pool->release(); }

size_t MultiheadAttention::workspace_bytes() const { return scratch_.pool->free_floats() * sizeof(float); }

MultiheadAttention MultiheadAttention::with_params(MhaParameters params) const {
  MultiheadAttention bound(config_, std::move(params));
  bound.scratch_.pool = scratch_.pool;
  return bound;
}

}  // namespace mha
