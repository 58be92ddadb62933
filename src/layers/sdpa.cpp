// layers/sdpa.cpp — the public SDPA entry point: validate once, broadcast the masks, pick a
// kernel, carve its workspace.
#include "mha/sdpa.h"

#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "kernels/attention.h"
#include "kernels/fused_forward.h"

namespace mha {

namespace {

std::atomic<int> g_default_threads{0};

std::string view_shape(const auto& v) { return shape_str(v.shape_vec()); }

/// Checks that `view` broadcasts to `full` (each extent equal or 1) and returns it with stride 0
/// along broadcast dimensions, so kernels can index it with full-size indices.
template <class T>
View4<T> broadcast_to(View4<T> view, const std::array<int64_t, 4>& full, const char* what) {
  if (view.empty()) return view;
  const View4<T> original = view;
  for (size_t a = 0; a < 4; ++a) {
    if (view.shape[a] == full[a]) continue;
    if (view.shape[a] != 1)
      fail("sdpa: ", what, " has shape ", view_shape(original),
           ", which does not broadcast to (B, h, T_q, T_k) = ", shape_str({full[0], full[1], full[2], full[3]}));
    view.stride[a] = 0;
    view.shape[a] = full[a];
  }
  return view;
}

int resolve_threads(int requested) {
  if (requested > 0) return requested;
  const int global = g_default_threads.load();
  if (global > 0) return global;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

/// The float views a kernel reads; for bf16 inputs, views with the same shapes and no data
/// (the bf16 kernel takes the data separately, kernels/fused_forward.h).
View4<const float> params_view(View4<const float> x) { return x; }
View4<const float> params_view(View4<const bf16> x) { return {nullptr, x.shape, x.stride}; }

template <class T>
void check_args(View4<const T> q, View4<const T> k, View4<const T> v, const SdpaOptions& opt,
                const SdpaOutputs& outputs);

template <class T>
kernels::SdpaParams make_params(View4<const T> q, View4<const T> k, View4<const T> v, const SdpaOptions& opt,
                                const SdpaOutputs& outputs) {
  check_args(q, k, v, opt, outputs);
  kernels::SdpaParams p;
  p.q = params_view(q);
  p.k = params_view(k);
  p.v = params_view(v);
  p.scale = opt.scale ? *opt.scale : (q.shape[3] > 0 ? 1.0f / std::sqrt(static_cast<float>(q.shape[3])) : 1.0f);
  const std::array<int64_t, 4> full{q.shape[0], q.shape[1], q.shape[2], k.shape[2]};
  const std::array<int64_t, 4> per_key{q.shape[0], 1, 1, k.shape[2]};
  p.masks.causal = opt.masks.causal;
  p.masks.allowed.view = broadcast_to(opt.masks.allowed.view, full, "allowed mask");
  p.masks.bias.view = broadcast_to(opt.masks.bias.view, full, "additive mask");
  p.masks.key_padding.view = broadcast_to(opt.masks.key_padding.view, per_key, "key padding");
  p.masks.key_bias.view = broadcast_to(opt.masks.key_bias.view, per_key, "key bias");
  p.dropout = opt.dropout;
  p.out = outputs.out;
  p.weights = outputs.weights;
  p.lse = outputs.lse;
  p.threads = resolve_threads(opt.threads);
  return p;
}

bool use_fused(const kernels::SdpaParams& p, Backend backend, std::string* why) {
  if (backend == Backend::Reference) {
    if (why) *why = "reference: requested";
    return false;
  }
  std::string reason;
  const bool ok = kernels::fused_supports(p, &reason);
  if (backend == Backend::Fused && !ok) fail("sdpa: Backend::Fused was requested but ", reason);
  if (why) *why = ok ? "fused: supported" : "reference: " + reason;
  return ok;
}

}  // namespace

void set_num_threads(int threads) {
  if (threads < 0) fail("set_num_threads: threads must be ≥ 0, got ", threads);
  g_default_threads.store(threads);
}
int num_threads() { return resolve_threads(0); }

namespace {
// One check for every storage type: only data pointers and shapes are looked at.
template <class T>
void check_args(View4<const T> q, View4<const T> k, View4<const T> v, const SdpaOptions& opt,
                const SdpaOutputs& outputs) {
  if (q.empty() && q.shape[0] * q.shape[1] * q.shape[2] * q.shape[3] != 0) fail("sdpa: query has no data");
  for (size_t a = 0; a < 4; ++a) {
    if (q.shape[a] < 0 || k.shape[a] < 0 || v.shape[a] < 0)
      fail("sdpa: negative extent in query ", view_shape(q), ", key ", view_shape(k), " or value ", view_shape(v));
  }
  if (q.shape[3] <= 0) fail("sdpa: head dim d must be ≥ 1, query is ", view_shape(q));
  if (v.shape[3] <= 0) fail("sdpa: value head dim d_v must be ≥ 1, value is ", view_shape(v));
  if (k.shape[0] != q.shape[0] || v.shape[0] != q.shape[0])
    fail("sdpa: batch sizes differ: query ", view_shape(q), ", key ", view_shape(k), ", value ", view_shape(v));
  if (k.shape[3] != q.shape[3])
    fail("sdpa: key head dim must equal the query's: query ", view_shape(q), ", key ", view_shape(k));
  if (k.shape[1] != v.shape[1] || k.shape[2] != v.shape[2])
    fail("sdpa: key ", view_shape(k), " and value ", view_shape(v), " must agree in heads and length");
  if (k.shape[1] <= 0 || q.shape[1] % k.shape[1] != 0)
    fail("sdpa: the ", q.shape[1], " query heads must be a multiple of the ", k.shape[1], " key/value heads: query ",
         view_shape(q), ", key ", view_shape(k));
  if (opt.scale && !std::isfinite(*opt.scale)) fail("sdpa: scale must be finite, got ", *opt.scale);
  if (opt.dropout.p < 0.0f || opt.dropout.p >= 1.0f || std::isnan(opt.dropout.p))
    fail("sdpa: dropout probability must be in [0, 1), got ", opt.dropout.p);
  const Shape want_out{q.shape[0], q.shape[1], q.shape[2], v.shape[3]};
  if (outputs.out.empty() && shape_numel(want_out) != 0) fail("sdpa: the output view is required");
  if (outputs.out.shape_vec() != want_out)
    fail("sdpa: output has shape ", view_shape(outputs.out), ", expected ", shape_str(want_out));
  const Shape want_w{q.shape[0], q.shape[1], q.shape[2], k.shape[2]};
  if (!outputs.weights.empty() && outputs.weights.shape_vec() != want_w)
    fail("sdpa: weights have shape ", view_shape(outputs.weights), ", expected ", shape_str(want_w));
  const Shape want_lse{q.shape[0], q.shape[1], q.shape[2], 1};
  if (!outputs.lse.empty() && outputs.lse.shape_vec() != want_lse)
    fail("sdpa: lse has shape ", view_shape(outputs.lse), ", expected ", shape_str(want_lse));
  // Mask broadcastability is checked where the masks are broadcast (make_params); do it here too
  // so that callers of check_sdpa_args alone get the same answer.
  const std::array<int64_t, 4> full{q.shape[0], q.shape[1], q.shape[2], k.shape[2]};
  const std::array<int64_t, 4> per_key{q.shape[0], 1, 1, k.shape[2]};
  broadcast_to(opt.masks.allowed.view, full, "allowed mask");
  broadcast_to(opt.masks.bias.view, full, "additive mask");
  broadcast_to(opt.masks.key_padding.view, per_key, "key padding");
  broadcast_to(opt.masks.key_bias.view, per_key, "key bias");
  if (opt.masks.causal.window < 0)
    fail("sdpa: sliding window must be ≥ 0 (0 = unlimited), got ", opt.masks.causal.window);
  if (opt.masks.causal.window > 0 && !opt.masks.causal.enabled())
    fail("sdpa: a sliding window of ", opt.masks.causal.window,
         " needs a causal alignment (Causal::bottom_right() etc.)");
  if (opt.masks.causal.align == Causal::Align::Offset && std::llabs(opt.masks.causal.offset) > (int64_t{1} << 40))
    fail("sdpa: causal offset ", opt.masks.causal.offset, " is out of range");
}
}  // namespace

void check_sdpa_args(View4<const float> q, View4<const float> k, View4<const float> v, const SdpaOptions& opt,
                     const SdpaOutputs& outputs) {
  check_args(q, k, v, opt, outputs);
}

void sdpa(View4<const float> q, View4<const float> k, View4<const float> v, const SdpaOptions& opt,
          const SdpaOutputs& outputs) {
  const kernels::SdpaParams p = make_params(q, k, v, opt, outputs);
  if (shape_numel(p.out.shape_vec()) == 0 && p.weights.empty()) return;
  if (use_fused(p, opt.backend, nullptr)) {
    std::vector<float> workspace(kernels::fused_workspace_floats(p));
    kernels::sdpa_fused(p, workspace.data());
  } else {
    std::vector<float> workspace(kernels::reference_workspace_floats(p));
    kernels::sdpa_reference(p, workspace.data());
  }
}

void sdpa(View4<const bf16> q, View4<const bf16> k, View4<const bf16> v, const SdpaOptions& opt,
          const SdpaOutputs& outputs) {
  const kernels::SdpaParams p = make_params(q, k, v, opt, outputs);
  if (shape_numel(p.out.shape_vec()) == 0 && p.weights.empty()) return;
  if (use_fused(p, opt.backend, nullptr)) {
    std::vector<float> workspace(kernels::fused_workspace_floats(p));
    kernels::sdpa_fused_bf16(p, {q, k, v}, workspace.data());
    return;
  }
  // The reference reads float32: widen the bf16 values (exactly) into contiguous copies.
  auto widen = [](View4<const bf16> x) {
    Tensor t({x.shape[0], x.shape[1], x.shape[2], x.shape[3]});
    float* dst = t.data();
    for (int64_t a = 0; a < x.shape[0]; ++a)
      for (int64_t b = 0; b < x.shape[1]; ++b)
        for (int64_t c = 0; c < x.shape[2]; ++c)
          for (int64_t e = 0; e < x.shape[3]; ++e) *dst++ = to_float(x(a, b, c, e));
    return t;
  };
  const Tensor qf = widen(q), kf = widen(k), vf = widen(v);
  sdpa(qf.view4(), kf.view4(), vf.view4(), opt, outputs);
}

std::string sdpa_dispatch_reason(View4<const float> q, View4<const float> k, View4<const float> v,
                                 const SdpaOptions& opt, const SdpaOutputs& outputs) {
  const kernels::SdpaParams p = make_params(q, k, v, opt, outputs);
  std::string why;
  use_fused(p, opt.backend, &why);
  return why;
}

SdpaResult sdpa(const Tensor& q, const Tensor& k, const Tensor& v, const SdpaOptions& opt, Want want) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    fail("sdpa: query, key and value must be 4-D (B, h, T, d); got ", shape_str(q.shape()), ", ", shape_str(k.shape()),
         ", ", shape_str(v.shape()));
  SdpaResult r;
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Tk = k.size(2), Dv = v.size(3);
  r.out = Tensor({B, H, Tq, Dv});
  SdpaOutputs outs;
  outs.out = r.out.view4();
  if (want == Want::Weights || want == Want::WeightsAndLse) {
    r.weights = Tensor({B, H, Tq, Tk});
    outs.weights = r.weights.view4();
  }
  if (want == Want::Lse || want == Want::WeightsAndLse) {
    r.lse = Tensor({B, H, Tq});
    outs.lse = contiguous_view(r.lse.data(), B, H, Tq, 1);
  }
  sdpa(q.view4(), k.view4(), v.view4(), opt, outs);
  return r;
}

}  // namespace mha
