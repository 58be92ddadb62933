// layers/sdpa_backward.cpp — the public SDPA backward entry point: the forward's preparation
// (layers/sdpa_prepare.h) plus the gradient views' checks, the same backend choice, a workspace.
#include <cmath>
#include <memory>
#include <vector>

#include "kernels/attention_backward.h"
#include "layers/sdpa_prepare.h"
#include "layers/view_overlap.h"
#include "mha/training.h"

namespace mha {

namespace {

constexpr const char* kBwd = "sdpa_backward";

void check_grad_view(const View4<float>& got, const Shape& want, const char* name) {
  if (shape_numel(want) != 0 && !got.defined()) fail(kBwd, ": the gradient view ", name, " is required");
  if (got.shape_vec() != want) fail(kBwd, ": ", name, " has shape ", shape_str(got), ", expected ", shape_str(want));
}

kernels::SdpaBackwardParams make_params(View4<const float> q, View4<const float> k, View4<const float> v,
                                        View4<const float> out, View4<const float> d_out, View4<const float> lse,
                                        const SdpaOptions& opt, const SdpaGrads& grads) {
  // The forward's preparation checks q, k, v, masks, dropout and the shapes of out and lse (it
  // reads only the views' shapes, so the const views pass through a non-const view type here).
  SdpaOutputs shapes;
  shapes.out = {const_cast<float*>(out.data), out.shape, out.stride};
  shapes.lse = {const_cast<float*>(lse.data), lse.shape, lse.stride};
  kernels::SdpaBackwardParams p;
  p.fwd = detail::prepare_sdpa(kBwd, q, k, v, opt, shapes);
  p.fwd.out = {}, p.fwd.lse = {};
  const Shape want_out{q.shape[0], q.shape[1], q.shape[2], v.shape[3]};
  if (shape_numel(want_out) != 0 && !lse.defined())
    fail(kBwd, ": lse (B, h, T_q, 1) from the forward is required, expected ",
         shape_str({q.shape[0], q.shape[1], q.shape[2], 1}));
  if (d_out.shape_vec() != want_out || (!d_out.defined() && shape_numel(want_out) != 0))
    fail(kBwd, ": d_out has shape ", shape_str(d_out), ", expected ", shape_str(want_out));
  check_grad_view(grads.dq, q.shape_vec(), "dq");
  check_grad_view(grads.dk, k.shape_vec(), "dk");
  check_grad_view(grads.dv, v.shape_vec(), "dv");

  p.out = out, p.dout = d_out, p.lse = lse;
  p.dq = grads.dq, p.dk = grads.dk, p.dv = grads.dv;
  p.lse_over_more_keys = opt.lse_over_more_keys;
  if (opt.sinks.enabled() && !grads.dsinks.empty()) {
    if (static_cast<int64_t>(grads.dsinks.size()) != q.shape[1])
      fail(kBwd, ": dsinks has ", grads.dsinks.size(), " entries, expected one per query head (", q.shape[1], ")");
    p.dsinks = grads.dsinks.data();
  }
  return p;
}

/// Gradients written over what they are computed from gave wrong numbers (each path its own):
/// refused. dq, dk and dv may share one buffer, interleaved (the module's packed rows do), so their
/// spans are not compared with each other; each must still name every element once.
void check_grads_apart(View4<const float> q, View4<const float> k, View4<const float> v, View4<const float> out,
                       View4<const float> d_out, View4<const float> lse, const SdpaOptions& opt,
                       const SdpaGrads& grads) {
  detail::check_output_layout(kBwd, "dq", grads.dq);
  detail::check_output_layout(kBwd, "dk", grads.dk);
  detail::check_output_layout(kBwd, "dv", grads.dv);
  const detail::ByteSpan dq = detail::byte_span(grads.dq), dk = detail::byte_span(grads.dk),
                         dv = detail::byte_span(grads.dv), dsinks = detail::byte_span(grads.dsinks);
  detail::check_disjoint(kBwd, {{"dq", dq}, {"dk", dk}, {"dv", dv}, {"dsinks", dsinks}},
                         {{"q", detail::byte_span(q)},
                          {"k", detail::byte_span(k)},
                          {"v", detail::byte_span(v)},
                          {"out", detail::byte_span(out)},
                          {"d_out", detail::byte_span(d_out)},
                          {"lse", detail::byte_span(lse)},
                          {"allowed mask", detail::byte_span(opt.masks.allowed.view)},
                          {"additive mask", detail::byte_span(opt.masks.bias.view)},
                          {"key padding", detail::byte_span(opt.masks.key_padding.view)},
                          {"key bias", detail::byte_span(opt.masks.key_bias.view)},
                          {"ALiBi slopes", detail::byte_span(opt.alibi.slopes)},
                          {"sink logits", detail::byte_span(opt.sinks.logits)}},
                         /*outputs_apart=*/false);
  detail::check_disjoint(kBwd, {{"dsinks", dsinks}}, {{"dq", dq}, {"dk", dk}, {"dv", dv}});
  // Interleaved gradients start at different elements; two that start at the same one are the same
  // place (dq passed as dk, say), which the span test above leaves to this.
  const std::pair<const char*, const float*> starts[] = {{"dq", dq.empty() ? nullptr : grads.dq.data},
                                                         {"dk", dk.empty() ? nullptr : grads.dk.data},
                                                         {"dv", dv.empty() ? nullptr : grads.dv.data}};
  for (size_t i = 0; i < 3; ++i)
    for (size_t j = 0; j < i; ++j)
      if (starts[i].second && starts[i].second == starts[j].second)
        fail(kBwd, ": ", starts[i].first, " and ", starts[j].first,
             " start at the same element; each gradient needs its own");
}

bool use_fused(const kernels::SdpaBackwardParams& p, Backend backend, std::string* why) {
  std::string reason;
  const bool ok = backend != Backend::Reference && kernels::fused_backward_supports(p, &reason);
  return detail::choose_fused(kBwd, backend, ok, reason, why);
}

/// g.dsinks sized one per sink logit when opt has sinks (else left empty), as the span the kernels write.
std::span<float> sink_grads(const SdpaOptions& opt, SdpaGradTensors& g) {
  if (!opt.sinks.enabled()) return {};
  g.dsinks = Tensor({static_cast<int64_t>(opt.sinks.logits.size())});
  return {g.dsinks.data(), static_cast<size_t>(g.dsinks.numel())};
}

void run(const kernels::SdpaBackwardParams& p, Backend backend) {
  if (use_fused(p, backend, nullptr)) {
    const detail::KernelScratch workspace = detail::kernel_scratch(kernels::fused_backward_workspace_floats(p));
    kernels::sdpa_backward_fused(p, workspace.get());
  } else {
    std::vector<double> workspace(kernels::reference_backward_workspace_doubles(p));
    kernels::sdpa_backward_reference(p, workspace.data());
  }
}

}  // namespace

void sdpa_backward(View4<const float> q, View4<const float> k, View4<const float> v, View4<const float> out,
                   View4<const float> d_out, View4<const float> lse, const SdpaOptions& opt, const SdpaGrads& grads) {
  const kernels::SdpaBackwardParams p = make_params(q, k, v, out, d_out, lse, opt, grads);
  check_grads_apart(q, k, v, out, d_out, lse, opt, grads);
  run(p, opt.backend);
}

void sdpa_backward_varlen(View4<const float> q, View4<const float> k, View4<const float> v, View4<const float> out,
                          View4<const float> d_out, View4<const float> lse, const VarlenBatch& seqs,
                          const SdpaOptions& opt, const SdpaGrads& grads) {
  kernels::SdpaBackwardParams p = make_params(q, k, v, out, d_out, lse, opt, grads);
  check_grads_apart(q, k, v, out, d_out, lse, opt, grads);
  detail::attach_varlen("sdpa_backward_varlen", p.fwd, seqs, opt);
  run(p, opt.backend);
}

SdpaGradTensors sdpa_backward_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                     const Tensor& d_out, const Tensor& lse, const VarlenBatch& seqs,
                                     const SdpaOptions& opt) {
  const char* fn = "sdpa_backward_varlen";
  for (const Tensor* t : {&q, &k, &v, &out, &d_out})
    if (t->dim() != 3)
      fail(fn, ": q, k, v, out and d_out must be 3-D (total, heads, d); got ", shape_str(q.shape()), ", ",
           shape_str(k.shape()), ", ", shape_str(v.shape()), ", ", shape_str(out.shape()), ", ",
           shape_str(d_out.shape()));
  const int64_t Nq = q.size(0), H = q.size(1);
  const Shape want_lse{Nq, H};
  if (lse.shape() != want_lse)
    fail(fn, ": lse has shape ", shape_str(lse.shape()), ", expected ", shape_str(want_lse), " (total_q, h)");
  const auto pv = [](const Tensor& t) { return packed_view(t.data(), t.size(0), t.size(1), t.size(2)); };
  SdpaGradTensors g{Tensor::uninitialized(q.shape()), Tensor::uninitialized(k.shape()),
                    Tensor::uninitialized(v.shape()), Tensor()};
  const std::span<float> dsinks = sink_grads(opt, g);
  const auto pg = [](Tensor& t) { return packed_view(t.data(), t.size(0), t.size(1), t.size(2)); };
  sdpa_backward_varlen(pv(q), pv(k), pv(v), pv(out), pv(d_out), packed_view(lse.data(), Nq, H, int64_t{1}), seqs, opt,
                       {pg(g.dq), pg(g.dk), pg(g.dv), dsinks});
  return g;
}

std::string sdpa_backward_dispatch_reason(View4<const float> q, View4<const float> k, View4<const float> v,
                                          const SdpaOptions& opt) {
  // Shapes only: contiguous views of the right extents stand in for out, lse and the gradients
  // (never dereferenced: no kernel runs).
  const int64_t B = q.shape[0], H = q.shape[1], Tq = q.shape[2], Dv = v.shape[3];
  float dummy = 0.0f;
  const View4<float> o = contiguous_view(&dummy, B, H, Tq, Dv), l = contiguous_view(&dummy, B, H, Tq, int64_t{1});
  const auto like = [&](const View4<const float>& x) {
    return contiguous_view(&dummy, x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
  };
  const SdpaGrads g{like(q), like(k), like(v), {}};
  const kernels::SdpaBackwardParams p = make_params(q, k, v, o, o, l, opt, g);
  std::string why;
  use_fused(p, opt.backend, &why);
  return why;
}

SdpaGradTensors sdpa_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& d_out,
                              const Tensor& lse, const SdpaOptions& opt) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || out.dim() != 4 || d_out.dim() != 4)
    fail(kBwd, ": q, k, v, out and d_out must be 4-D (B, h, T, d); got ", shape_str(q.shape()), ", ",
         shape_str(k.shape()), ", ", shape_str(v.shape()), ", ", shape_str(out.shape()), ", ",
         shape_str(d_out.shape()));
  const Shape want_lse{q.size(0), q.size(1), q.size(2)};
  if (lse.shape() != want_lse)
    fail(kBwd, ": lse has shape ", shape_str(lse.shape()), ", expected ", shape_str(want_lse), " (B, h, T_q)");
  SdpaGradTensors g{Tensor::uninitialized(q.shape()), Tensor::uninitialized(k.shape()),
                    Tensor::uninitialized(v.shape()), Tensor()};
  const std::span<float> dsinks = sink_grads(opt, g);
  const View4<const float> lse_view = contiguous_view(lse.data(), want_lse[0], want_lse[1], want_lse[2], int64_t{1});
  sdpa_backward(q.view4(), k.view4(), v.view4(), out.view4(), d_out.view4(), lse_view, opt,
                {g.dq.view4(), g.dk.view4(), g.dv.view4(), dsinks});
  return g;
}

}  // namespace mha
