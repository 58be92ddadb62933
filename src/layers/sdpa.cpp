// layers/sdpa.cpp — the public SDPA forward: prepare once (layers/sdpa_prepare.h), pick a kernel,
// carve its workspace.
#include "mha/sdpa.h"

#include <memory>
#include <vector>

#include "kernels/attention.h"
#include "layers/sdpa_prepare.h"

namespace mha {

namespace {

constexpr const char* kSdpa = "sdpa";

bool use_fused(const kernels::SdpaParams& p, Backend backend, std::string* why) {
  std::string reason;
  const bool ok = backend != Backend::Reference && kernels::fused_supports(p, &reason);
  return detail::choose_fused(kSdpa, backend, ok, reason, why);
}

/// Scratch the kernel fully overwrites before reading: allocated without zero-filling.
std::unique_ptr<float[]> scratch(size_t floats) { return std::make_unique_for_overwrite<float[]>(floats); }

/// The reference oracle writes per-head weights only: averaged weights are formed here from a
/// per-head intermediate, summed over heads in double (as nn.MultiheadAttention's average).
void run_reference(kernels::SdpaParams p) {
  std::unique_ptr<float[]> workspace = scratch(kernels::reference_workspace_floats(p));
  if (!p.weights_avg.defined()) return kernels::sdpa_reference(p, workspace.get());
  const View4<float> avg = p.weights_avg;
  const int64_t B = p.batch(), H = p.heads(), Tq = p.t_q(), Tk = p.t_k();
  Tensor per_head;
  if (!p.weights.defined()) {
    per_head = Tensor({B, H, Tq, Tk});
    p.weights = per_head.view4();
  }
  p.weights_avg = {};
  kernels::sdpa_reference(p, workspace.get());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Tq; ++i)
      for (int64_t j = 0; j < Tk; ++j) {
        double sum = 0.0;
        for (int64_t h = 0; h < H; ++h) sum += p.weights(b, h, i, j);
        avg(b, 0, i, j) = static_cast<float>(sum / static_cast<double>(H));
      }
}

void run(const kernels::SdpaParams& p, Backend backend) {
  if (shape_numel(p.out.shape_vec()) == 0 && !p.weights.defined() && !p.weights_avg.defined()) return;
  if (use_fused(p, backend, nullptr)) {
    std::unique_ptr<float[]> workspace = scratch(kernels::fused_workspace_floats(p));
    kernels::sdpa_fused(p, workspace.get());
  } else {
    run_reference(p);
  }
}

}  // namespace

void check_sdpa_args(View4<const float> q, View4<const float> k, View4<const float> v, const SdpaOptions& opt,
                     const SdpaOutputs& outputs) {
  detail::prepare_sdpa(kSdpa, q, k, v, opt, outputs);
}

void sdpa(View4<const float> q, View4<const float> k, View4<const float> v, const SdpaOptions& opt,
          const SdpaOutputs& outputs) {
  run(detail::prepare_sdpa(kSdpa, q, k, v, opt, outputs), opt.backend);
}

void sdpa(View4<const bf16> q, View4<const bf16> k, View4<const bf16> v, const SdpaOptions& opt,
          const SdpaOutputs& outputs) {
  run(detail::prepare_sdpa(kSdpa, q, k, v, opt, outputs), opt.backend);
}

std::string sdpa_dispatch_reason(View4<const float> q, View4<const float> k, View4<const float> v,
                                 const SdpaOptions& opt, const SdpaOutputs& outputs) {
  std::string why;
  use_fused(detail::prepare_sdpa(kSdpa, q, k, v, opt, outputs), opt.backend, &why);
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
