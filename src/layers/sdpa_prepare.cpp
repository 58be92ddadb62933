// layers/sdpa_prepare.cpp — checks, mask broadcasting and defaults for every attention entry
// (layers/sdpa_prepare.h).
#include "layers/sdpa_prepare.h"

#include "layers/view_overlap.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <new>

#include "mha/tensor.h"

namespace mha::detail {

namespace {

std::optional<float> g_scratch_fill;  // fill_kernel_scratch_for_testing()

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
  // Query heads are grouped over the K/V heads, so there must be at least one of those (0 query
  // heads is an empty call; 0 K/V heads would leave the group size undefined).
  if (k.shape[1] <= 0)
    fail(fn, ": key and value need at least one head (the query heads are grouped over them): query ", shape_str(q),
         ", key ", shape_str(k));
  if (q.shape[1] % k.shape[1] != 0)
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
  const Shape want_avg{q.shape[0], 1, q.shape[2], k.shape[2]};
  if (outputs.averaged_weights.defined() && outputs.averaged_weights.shape_vec() != want_avg)
    fail(fn, ": averaged weights have shape ", shape_str(outputs.averaged_weights), ", expected ", shape_str(want_avg));
  const Shape want_lse{q.shape[0], q.shape[1], q.shape[2], 1};
  if (outputs.lse.defined() && outputs.lse.shape_vec() != want_lse)
    fail(fn, ": lse has shape ", shape_str(outputs.lse), ", expected ", shape_str(want_lse));
  const Causal& causal = opt.masks.causal;
  // An enum cast from an integer may hold any value: one past Offset counted as causal (enabled()
  // tests != None) with an alignment no kernel knows.
  if (static_cast<unsigned>(causal.align) > static_cast<unsigned>(Causal::Align::Offset))
    fail(fn, ": causal alignment ", static_cast<unsigned>(causal.align), " is not a Causal::Align");
  if (causal.window < 0) fail(fn, ": sliding window must be ≥ 0 (0 = unlimited), got ", causal.window);
  if (causal.window > 0 && !causal.enabled())
    fail(fn, ": a sliding window of ", causal.window, " needs a causal alignment (Causal::bottom_right() etc.)");
  // Both bounds compared (std::llabs would pass INT64_MIN: its absolute value does not exist).
  constexpr int64_t kMaxPosition = Causal::kMaxPosition;
  if (causal.align == Causal::Align::Offset && (causal.offset < -kMaxPosition || causal.offset > kMaxPosition))
    fail(fn, ": causal offset ", causal.offset, " is out of range [", -kMaxPosition, ", ", kMaxPosition, "]");
  if (causal.window > kMaxPosition)
    fail(fn, ": sliding window ", causal.window, " is out of range [0, ", kMaxPosition, "] (0 = unlimited)");
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
  p.weights_avg = outputs.averaged_weights;
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

template <class T>
void check_outputs_apart_impl(const char* fn, View4<const T> q, View4<const T> k, View4<const T> v,
                              const SdpaOptions& opt, const SdpaOutputs& outputs) {
  check_output_layout(fn, "output", outputs.out);
  check_output_layout(fn, "weights", outputs.weights);
  check_output_layout(fn, "averaged weights", outputs.averaged_weights);
  check_output_layout(fn, "lse", outputs.lse);
  check_disjoint(fn,
                 {{"output", byte_span(outputs.out)},
                  {"weights", byte_span(outputs.weights)},
                  {"averaged weights", byte_span(outputs.averaged_weights)},
                  {"lse", byte_span(outputs.lse)}},
                 {{"query", byte_span(q)},
                  {"key", byte_span(k)},
                  {"value", byte_span(v)},
                  {"allowed mask", byte_span(opt.masks.allowed.view)},
                  {"additive mask", byte_span(opt.masks.bias.view)},
                  {"key padding", byte_span(opt.masks.key_padding.view)},
                  {"key bias", byte_span(opt.masks.key_bias.view)},
                  {"ALiBi slopes", byte_span(opt.alibi.slopes)},
                  {"sink logits", byte_span(opt.sinks.logits)}});
}

void check_outputs_apart(const char* fn, View4<const float> q, View4<const float> k, View4<const float> v,
                         const SdpaOptions& opt, const SdpaOutputs& outputs) {
  check_outputs_apart_impl(fn, q, k, v, opt, outputs);
}
void check_outputs_apart(const char* fn, View4<const bf16> q, View4<const bf16> k, View4<const bf16> v,
                         const SdpaOptions& opt, const SdpaOutputs& outputs) {
  check_outputs_apart_impl(fn, q, k, v, opt, outputs);
}

void attach_varlen(const char* fn, kernels::SdpaParams& p, const VarlenBatch& seqs, const SdpaOptions& opt) {
  if (p.q.shape[0] != 1 || p.k.shape[0] != 1)
    fail(fn, ": packed query ", shape_str({p.q.shape[0], p.q.shape[1], p.q.shape[2], p.q.shape[3]}), " and key ",
         shape_str({p.k.shape[0], p.k.shape[1], p.k.shape[2], p.k.shape[3]}),
         " must be (1, heads, total, d) views of (total, heads, d) arrays (mha::packed_view)");
  const Masks& m = opt.masks;
  if (m.allowed.view.defined() || m.bias.view.defined() || m.key_padding.view.defined() || m.key_bias.view.defined())
    fail(fn,
         ": a packed batch takes only a causal mask (allowed, additive, key padding and key bias masks index a "
         "padded (B, T) layout)");
  if (opt.dropout.active()) fail(fn, ": dropout is not supported on a packed batch (p = ", opt.dropout.p, ")");
  if (p.weights.defined() || p.weights_avg.defined())
    fail(fn, ": attention weights are not returned for a packed batch");
  check_varlen(fn, seqs, p.q.shape[2], p.k.shape[2]);
  p.varlen.cu_q = seqs.cu_seqlens_q.values().data();
  p.varlen.cu_k = seqs.cu_seqlens_k.values().data();
  p.varlen.seqs = seqs.seqs();
}

bool choose_fused(const char* fn, Backend requested, bool fused_ok, const std::string& reason, std::string* why) {
  if (requested != Backend::Auto && requested != Backend::Reference && requested != Backend::Fused)
    fail(fn, ": backend ", static_cast<unsigned>(requested), " is not a Backend (Auto, Reference or Fused)");
  if (requested == Backend::Reference) {
    if (why) *why = "reference: requested";
    return false;
  }
  if (requested == Backend::Fused && !fused_ok) fail(fn, ": Backend::Fused was requested but ", reason);
  if (why) *why = fused_ok ? "fused: supported" : "reference: " + reason;
  return fused_ok;
}

void KernelScratchDeleter::operator()(float* p) const noexcept {
  if (bytes >= kHugePageAdviceBytes)
    free_block(p, bytes);
  else
    delete[] p;
}

KernelScratch kernel_scratch(size_t floats) {
  if (floats > SIZE_MAX / sizeof(float)) throw std::bad_array_new_length();
  const size_t bytes = floats * sizeof(float);
  KernelScratch buf;
  if (bytes >= kHugePageAdviceBytes) {
    buf = KernelScratch(static_cast<float*>(allocate_block(bytes)), KernelScratchDeleter{bytes});
    advise_huge_pages(buf.get(), bytes);
  } else {
    buf = KernelScratch(new float[floats], KernelScratchDeleter{bytes});
  }
  if (g_scratch_fill) std::fill_n(buf.get(), floats, *g_scratch_fill);
  return buf;
}

void fill_kernel_scratch_for_testing(std::optional<float> value) { g_scratch_fill = value; }

}  // namespace mha::detail

namespace mha {

namespace {

void check_offsets(const char* fn, const char* name, const SeqOffsets& cu, int64_t total, int64_t max_len) {
  const std::vector<int64_t>& v = cu.values();
  if (v.empty()) fail(fn, ": ", name, " is empty; it needs B + 1 offsets (a batch of none is {0})");
  if (v.front() != 0) fail(fn, ": ", name, "[0] = ", v.front(), ", expected 0");
  for (size_t s = 0; s + 1 < v.size(); ++s) {
    if (v[s + 1] < v[s])
      fail(fn, ": ", name, " must not decrease, but ", name, "[", s + 1, "] = ", v[s + 1], " < ", name, "[", s,
           "] = ", v[s]);
    if (max_len > 0 && v[s + 1] - v[s] > max_len)
      fail(fn, ": sequence ", s, " has length ", v[s + 1] - v[s], " (", name, "[", s, "] = ", v[s], ", [", s + 1,
           "] = ", v[s + 1], "), more than the given maximum ", max_len);
  }
  if (v.back() != total)
    fail(fn, ": the last offset ", name, "[", v.size() - 1, "] = ", v.back(), " must equal the total rows, ", total);
}

}  // namespace

void check_varlen(const char* fn, const VarlenBatch& seqs, int64_t total_q, int64_t total_k) {
  if (seqs.max_seqlen_q < 0 || seqs.max_seqlen_k < 0)
    fail(fn, ": max_seqlen_q / max_seqlen_k must be ≥ 0 (0 = not checked), got ", seqs.max_seqlen_q, " / ",
         seqs.max_seqlen_k);
  check_offsets(fn, "cu_seqlens_q", seqs.cu_seqlens_q, total_q, seqs.max_seqlen_q);
  check_offsets(fn, "cu_seqlens_k", seqs.cu_seqlens_k, total_k, seqs.max_seqlen_k);
  if (seqs.cu_seqlens_q.seqs() != seqs.cu_seqlens_k.seqs())
    fail(fn, ": cu_seqlens_q has ", seqs.cu_seqlens_q.values().size(), " offsets and cu_seqlens_k ",
         seqs.cu_seqlens_k.values().size(), "; both need B + 1");
}

}  // namespace mha
