// layers/sdpa_prepare.cpp — checks, mask broadcasting and defaults for every attention entry
// (layers/sdpa_prepare.h).
#include "layers/sdpa_prepare.h"

#include <cmath>
#include <cstdlib>

namespace mha::detail {

namespace {

/// Checks that `view` broadcasts to `full` (each extent equal or 1) and returns it with stride 0
/// along broadcast dimensions, so kernels can index it with full-size indices.
template <class T>
View4<T> broadcast_to(const char* fn, View4<T> view, const std::array<int64_t, 4>& full, const char* what) {
  if (!view.defined()) return view;
  const View4<T> original = view;
  for (size_t a = 0; a < 4; ++a) {
    if (view.shape[a] == full[a]) continue;
    if (view.shape[a] != 1)
      fail(fn, ": ", what, " has shape ", shape_str(original),
           ", which does not broadcast to (B, h, T_q, T_k) = ", shape_str({full[0], full[1], full[2], full[3]}));
    view.stride[a] = 0;
    view.shape[a] = full[a];
  }
  return view;
}

/// One check for every storage type: only data pointers and shapes are looked at.
template <class T>
void check_args(const char* fn, View4<const T> q, View4<const T> k, View4<const T> v, const SdpaOptions& opt,
                const SdpaOutputs& outputs) {
  for (size_t a = 0; a < 4; ++a) {
    if (q.shape[a] < 0 || k.shape[a] < 0 || v.shape[a] < 0)
      fail(fn, ": negative extent in query ", shape_str(q), ", key ", shape_str(k), " or value ", shape_str(v));
  }
  // A view with elements must have data (an empty one may have none: docs/semantics.md, 'Empty inputs').
  const auto no_data = [](const auto& x) { return !x.defined() && shape_numel(x.shape_vec()) != 0; };
  if (no_data(q)) fail(fn, ": query ", shape_str(q), " has no data");
  if (no_data(k)) fail(fn, ": key ", shape_str(k), " has no data");
  if (no_data(v)) fail(fn, ": value ", shape_str(v), " has no data");
  if (q.shape[3] <= 0) fail(fn, ": head dim d must be ≥ 1, query is ", shape_str(q));
  if (v.shape[3] <= 0) fail(fn, ": value head dim d_v must be ≥ 1, value is ", shape_str(v));
  if (k.shape[0] != q.shape[0] || v.shape[0] != q.shape[0])
    fail(fn, ": batch sizes differ: query ", shape_str(q), ", key ", shape_str(k), ", value ", shape_str(v));
  if (k.shape[3] != q.shape[3])
    fail(fn, ": key head dim must equal the query's: query ", shape_str(q), ", key ", shape_str(k));
  if (k.shape[1] != v.shape[1] || k.shape[2] != v.shape[2])
    fail(fn, ": key ", shape_str(k), " and value ", shape_str(v), " must agree in heads and length");
  if (k.shape[1] <= 0 || q.shape[1] % k.shape[1] != 0)
    fail(fn, ": the ", q.shape[1], " query heads must be a multiple of the ", k.shape[1], " key/value heads: query ",
         shape_str(q), ", key ", shape_str(k));
  if (opt.scale && !std::isfinite(*opt.scale)) fail(fn, ": scale must be finite, got ", *opt.scale);
  if (opt.dropout.p < 0.0f || opt.dropout.p >= 1.0f || std::isnan(opt.dropout.p))
    fail(fn, ": dropout probability must be in [0, 1), got ", opt.dropout.p);
  const Shape want_out{q.shape[0], q.shape[1], q.shape[2], v.shape[3]};
  if (!outputs.out.defined() && shape_numel(want_out) != 0) fail(fn, ": the output view is required");
  if (outputs.out.shape_vec() != want_out)
    fail(fn, ": output has shape ", shape_str(outputs.out), ", expected ", shape_str(want_out));
  const Shape want_w{q.shape[0], q.shape[1], q.shape[2], k.shape[2]};
  if (outputs.weights.defined() && outputs.weights.shape_vec() != want_w)
    fail(fn, ": weights have shape ", shape_str(outputs.weights), ", expected ", shape_str(want_w));
  const Shape want_lse{q.shape[0], q.shape[1], q.shape[2], 1};
  if (outputs.lse.defined() && outputs.lse.shape_vec() != want_lse)
    fail(fn, ": lse has shape ", shape_str(outputs.lse), ", expected ", shape_str(want_lse));
  const Causal& causal = opt.masks.causal;
  if (causal.window < 0) fail(fn, ": sliding window must be ≥ 0 (0 = unlimited), got ", causal.window);
  if (causal.window > 0 && !causal.enabled())
    fail(fn, ": a sliding window of ", causal.window, " needs a causal alignment (Causal::bottom_right() etc.)");
  if (causal.align == Causal::Align::Offset && std::llabs(causal.offset) > (int64_t{1} << 40))
    fail(fn, ": causal offset ", causal.offset, " is out of range");
}

template <class T>
kernels::SdpaParams prepare(const char* fn, View4<const T> q, View4<const T> k, View4<const T> v,
                            const SdpaOptions& opt, const SdpaOutputs& outputs) {
  check_args(fn, q, k, v, opt, outputs);
  kernels::SdpaParams p;
  p.dtype = std::is_same_v<T, bf16> ? kernels::DType::BF16 : kernels::DType::F32;
  p.q = q, p.k = k, p.v = v;
  p.scale = resolve_scale(opt.scale, q.shape[3]);
  const std::array<int64_t, 4> full{q.shape[0], q.shape[1], q.shape[2], k.shape[2]};
  const std::array<int64_t, 4> per_key{q.shape[0], 1, 1, k.shape[2]};
  p.masks.causal = opt.masks.causal;
  p.masks.allowed.view = broadcast_to(fn, opt.masks.allowed.view, full, "allowed mask");
  p.masks.bias.view = broadcast_to(fn, opt.masks.bias.view, full, "additive mask");
  p.masks.key_padding.view = broadcast_to(fn, opt.masks.key_padding.view, per_key, "key padding");
  p.masks.key_bias.view = broadcast_to(fn, opt.masks.key_bias.view, per_key, "key bias");
  p.dropout = opt.dropout;
  p.edits = check_score_edits(fn, q.shape[1], opt.alibi, opt.softcap, opt.sinks);
  p.out = outputs.out;
  p.weights = outputs.weights;
  p.lse = outputs.lse;
  p.threads = resolve_threads(opt.threads);
  return p;
}

}  // namespace

float resolve_scale(const std::optional<float>& scale, int64_t d) {
  if (scale) return *scale;
  return d > 0 ? 1.0f / std::sqrt(static_cast<float>(d)) : 1.0f;
}

kernels::SdpaParams prepare_sdpa(const char* fn, View4<const float> q, View4<const float> k, View4<const float> v,
                                 const SdpaOptions& opt, const SdpaOutputs& outputs) {
  return prepare(fn, q, k, v, opt, outputs);
}

kernels::SdpaParams prepare_sdpa(const char* fn, View4<const bf16> q, View4<const bf16> k, View4<const bf16> v,
                                 const SdpaOptions& opt, const SdpaOutputs& outputs) {
  return prepare(fn, q, k, v, opt, outputs);
}

bool choose_fused(const char* fn, Backend requested, bool fused_ok, const std::string& reason, std::string* why) {
  if (requested == Backend::Reference) {
    if (why) *why = "reference: requested";
    return false;
  }
  if (requested == Backend::Fused && !fused_ok) fail(fn, ": Backend::Fused was requested but ", reason);
  if (why) *why = fused_ok ? "fused: supported" : "reference: " + reason;
  return fused_ok;
}

}  // namespace mha::detail
