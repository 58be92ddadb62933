// layers/sdpa_prepare.h — the one preparation step behind every attention entry point: the SDPA
// forward (float32 and bfloat16), its backward and attention over a KV cache. Internal.
//
// prepare_sdpa checks the arguments once, broadcasts the masks to full extents (stride 0 along
// broadcast dimensions), and resolves the scale and thread defaults, giving the params struct a
// kernel takes; choose_backend makes the Auto / Reference / Fused choice the same way for both
// directions and says why.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "kernels/attention.h"
#include "mha/sdpa.h"

namespace mha::detail {

/// The softmax scale: the caller's, else 1/√d (d of Q/K).
float resolve_scale(const std::optional<float>& scale, int64_t d);

/// Checks q/k/v, the options and the outputs' shapes (weights and lse only when given) and returns
/// the kernel params with masks broadcast and defaults resolved. Throws mha::Error prefixed with
/// `fn`, naming the shapes.
kernels::SdpaParams prepare_sdpa(const char* fn, View4<const float> q, View4<const float> k, View4<const float> v,
                                 const SdpaOptions& opt, const SdpaOutputs& outputs);
kernels::SdpaParams prepare_sdpa(const char* fn, View4<const bf16> q, View4<const bf16> k, View4<const bf16> v,
                                 const SdpaOptions& opt, const SdpaOutputs& outputs);

/// Fails, naming both views, when an output the forward writes (out, weights, averaged weights,
/// lse) overlaps q, k, v, a mask or another output, or names an element twice (layers/view_overlap.h).
void check_outputs_apart(const char* fn, View4<const float> q, View4<const float> k, View4<const float> v,
                         const SdpaOptions& opt, const SdpaOutputs& outputs);
void check_outputs_apart(const char* fn, View4<const bf16> q, View4<const bf16> k, View4<const bf16> v,
                         const SdpaOptions& opt, const SdpaOutputs& outputs);
/// A packed variable-length request (mha/sdpa.h, sdpa_varlen): checks that the views are packed
/// (batch 1), the offsets against their totals, and that no mask but causal, no dropout and no
/// weights are asked for; then points p.varlen at the offsets (which must outlive p).
void attach_varlen(const char* fn, kernels::SdpaParams& p, const VarlenBatch& seqs, const SdpaOptions& opt);

/// Checks ALiBi slopes, softcap and sinks against `heads` query heads (lengths, finiteness, c ≥ 0)
/// and returns them as the kernels take them. Throws mha::Error prefixed with `fn`.
kernels::ScoreEdits check_score_edits(const char* fn, int64_t heads, const Alibi& alibi, float softcap,
                                      const AttentionSinks& sinks);

/// Whether to run the fused kernel: false for Backend::Reference; for Auto, whether the fused
/// kernel supports the request (`fused_ok`, else `reason` says what it lacks); Backend::Fused on
/// an unsupported request throws. *why (if given) gets "fused: supported" or "reference: …".
bool choose_fused(const char* fn, Backend requested, bool fused_ok, const std::string& reason, std::string* why);

/// Gives a kernel_scratch buffer back: a large one to the cache of freed blocks, else delete[].
struct KernelScratchDeleter {
  size_t bytes = 0;
  void operator()(float* p) const noexcept;
};
using KernelScratch = std::unique_ptr<float[], KernelScratchDeleter>;

/// Scratch that a kernel fully overwrites before it reads it (the forward's and the backward's
/// workspaces): allocated without zero-filling. A large one (the forward's prepacked K/V, the
/// backward's dense copies of Q and dO: 16 MiB each at T = 4096, E = 512) comes from the cache of
/// freed tensor blocks (mha::tensor_cache_limit), on huge pages where the OS allows: a fresh one
/// was mapped anew by every call, and zeroing its pages in the kernel cost ~4% of a T = 4096
/// forward.
KernelScratch kernel_scratch(size_t floats);

/// For tests: every kernel_scratch() buffer from now on filled with `value` (NaN shows that the
/// kernels read no scratch they did not write first), or left as allocated (nullopt, the
/// default). Not for use while other threads call the library.
void fill_kernel_scratch_for_testing(std::optional<float> value);

}  // namespace mha::detail
