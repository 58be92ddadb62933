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

/// The reference oracle writes per-head weights only: averaged weights are formed here from a
/// per-head intermediate, summed over heads in double (as nn.MultiheadAttention's average).
void run_reference(kernels::SdpaParams p) {
  detail::KernelScratch workspace = detail::kernel_scratch(kernels::reference_workspace_floats(p));
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

void run(kernels::SdpaParams p, Backend backend, SdpaThreadStats* stats) {
  if (stats) {
    ++stats->calls;
    if (stats->busy_ms.size() < static_cast<size_t>(p.threads)) stats->busy_ms.resize(static_cast<size_t>(p.threads));
    p.thread_busy_ms = stats->busy_ms.data();
  }
  if (shape_numel(p.out.shape_vec()) == 0 && !p.weights.defined() && !p.weights_avg.defined()) return;
  if (p.heads() == 0) {
    // No heads: every output is empty but the averaged weights, zeros on every path (an average
    // over no head; the reference gave 0 / 0 = NaN, the fused kernel left them unwritten).
    const View4<float> avg = p.weights_avg;
    if (avg.defined())
      for (int64_t b = 0; b < avg.shape[0]; ++b)
        for (int64_t i = 0; i < avg.shape[2]; ++i)
          for (int64_t j = 0; j < avg.shape[3]; ++j) avg(b, 0, i, j) = 0.0f;
    return;
  }
  if (use_fused(p, backend, nullptr)) {
    detail::KernelScratch workspace = detail::kernel_scratch(kernels::fused_workspace_floats(p));
    kernels::sdpa_fused(p, workspace.get());
  } else {
    run_reference(p);
  }
}

/// A Want cast from an integer must name one of its values (the owning forms of sdpa and
/// sdpa_varlen both take one).
void check_want(const char* fn, Want want) {
  if (want != Want::Output && want != Want::Weights && want != Want::Lse && want != Want::WeightsAndLse)
    fail(fn, ": want ", static_cast<int>(want), " is not a Want (Output, Weights, Lse or WeightsAndLse)");
}

}  // namespace

void check_sdpa_args(View4<const float> q, View4<const float> k, View4<const float> v, const SdpaOptions& opt,
                     const SdpaOutputs& outputs) {
  detail::prepare_sdpa(kSdpa, q, k, v, opt, outputs);
  detail::check_outputs_apart(kSdpa, q, k, v, opt, outputs);
}

void sdpa(View4<const float> q, View4<const float> k, View4<const float> v, const SdpaOptions& opt,
          const SdpaOutputs& outputs) {
  kernels::SdpaParams p = detail::prepare_sdpa(kSdpa, q, k, v, opt, outputs);
  detail::check_outputs_apart(kSdpa, q, k, v, opt, outputs);
  run(p, opt.backend, opt.thread_stats);
}

void sdpa(View4<const bf16> q, View4<const bf16> k, View4<const bf16> v, const SdpaOptions& opt,
          const SdpaOutputs& outputs) {
  kernels::SdpaParams p = detail::prepare_sdpa(kSdpa, q, k, v, opt, outputs);
  detail::check_outputs_apart(kSdpa, q, k, v, opt, outputs);
  run(p, opt.backend, opt.thread_stats);
}

namespace {
constexpr const char* kVarlen = "sdpa_varlen";

template <class T>
void run_varlen(View4<const T> q, View4<const T> k, View4<const T> v, const VarlenBatch& seqs, const SdpaOptions& opt,
                const SdpaOutputs& outputs) {
  kernels::SdpaParams p = detail::prepare_sdpa(kVarlen, q, k, v, opt, outputs);
  detail::check_outputs_apart(kVarlen, q, k, v, opt, outputs);
  detail::attach_varlen(kVarlen, p, seqs, opt);
  run(p, opt.backend, opt.thread_stats);
}
}  // namespace

void sdpa_varlen(View4<const float> q, View4<const float> k, View4<const float> v, const VarlenBatch& seqs,
                 const SdpaOptions& opt, const SdpaOutputs& outputs) {
  run_varlen(q, k, v, seqs, opt, outputs);
}

void sdpa_varlen(View4<const bf16> q, View4<const bf16> k, View4<const bf16> v, const VarlenBatch& seqs,
                 const SdpaOptions& opt, const SdpaOutputs& outputs) {
  run_varlen(q, k, v, seqs, opt, outputs);
}

SdpaResult sdpa_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const VarlenBatch& seqs,
                       const SdpaOptions& opt, Want want) {
  if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3)
    fail(kVarlen, ": packed query, key and value must be 3-D (total, heads, d); got ", shape_str(q.shape()), ", ",
         shape_str(k.shape()), ", ", shape_str(v.shape()));
  check_want(kVarlen, want);
  if (want == Want::Weights || want == Want::WeightsAndLse)
    fail(kVarlen, ": attention weights are not returned for a packed batch");
  const int64_t Nq = q.size(0), H = q.size(1), Nk = k.size(0), Dv = v.size(2);
  // Every element of out and lse is written (Varlen.EveryOutputElementIsWrittenWhateverTheBuffersHeld).
  SdpaResult r;
  r.out = Tensor::uninitialized({Nq, H, Dv});
  SdpaOutputs outs;
  outs.out = packed_view(r.out.data(), Nq, H, Dv);
  if (want == Want::Lse) {
    r.lse = Tensor::uninitialized({Nq, H});
    outs.lse = packed_view(r.lse.data(), Nq, H, int64_t{1});
  }
  sdpa_varlen(packed_view(q.data(), Nq, H, q.size(2)), packed_view(k.data(), Nk, k.size(1), k.size(2)),
              packed_view(v.data(), v.size(0), v.size(1), Dv), seqs, opt, outs);
  return r;
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
  check_want(kSdpa, want);
  // Every element of out, weights and lse is written, on either path, whatever the buffers held
  // (SdpaOutputs.EveryElementIsWrittenWhateverTheBuffersHeld): no pass fills them first.
  SdpaResult r;
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Tk = k.size(2), Dv = v.size(3);
  r.out = Tensor::uninitialized({B, H, Tq, Dv});
  SdpaOutputs outs;
  outs.out = r.out.view4();
  if (want == Want::Weights || want == Want::WeightsAndLse) {
    r.weights = Tensor::uninitialized({B, H, Tq, Tk});
    outs.weights = r.weights.view4();
  }
  if (want == Want::Lse || want == Want::WeightsAndLse) {
    r.lse = Tensor::uninitialized({B, H, Tq});
    outs.lse = contiguous_view(r.lse.data(), B, H, Tq, 1);
  }
  sdpa(q.view4(), k.view4(), v.view4(), opt, outs);
  return r;
}

}  // namespace mha
