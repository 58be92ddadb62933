// `mha forward`: the conformance contract of shared/conformance/README.md.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "load_inputs.h"
#include "mha/module.h"
#include "mha/safetensors.h"
#include "mha/weights.h"
#include "registry.h"

namespace mha::cli {

namespace {

/// Outputs at least this large get progress lines on stderr while they are written.
constexpr int64_t kProgressBytes = int64_t{256} << 20;

struct ForwardArgs {
  std::string weights, inputs, output;
  int threads = 0;
};

void run_forward(const ForwardArgs& a) {
  const io::SafetensorsFile weights = io::SafetensorsFile::open(a.weights);
  MultiheadAttention module = io::load_module(weights);
  const LoadedInputs in = load_inputs(weights, a.inputs);
  MhaForwardOptions opt = in.options;
  opt.threads = a.threads;
  const bool need_weights = in.need_weights;
  opt.need_weights = !need_weights ? NeedWeights::None : in.average ? NeedWeights::Averaged : NeedWeights::PerHead;

  // forward() checks up front that its outputs fit in memory (naming the shape and the bytes).
  const auto start = std::chrono::steady_clock::now();
  const MhaOutput out = module.forward(in.query, in.key, in.value, opt);
  // The outputs are written from where they are, not copied into the writer (they can be most of
  // the machine's memory); large files report progress on stderr.
  io::SafetensorsWriter writer;
  writer.add_ref("output", out.output);
  if (need_weights) writer.add_ref("attn_weights", out.attn_weights);
  if (opt.need_lse) writer.add_ref("lse", out.lse);
  const int64_t out_bytes = 4 * (out.output.numel() + out.attn_weights.numel() + out.lse.numel());
  io::SafetensorsWriter::Progress progress;
  if (out_bytes >= kProgressBytes) {
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "mha forward: computed in %.1f s; writing %s to %s\n", secs,
                 bytes_str(static_cast<double>(out_bytes)).c_str(), a.output.c_str());
    progress = [last = -1](uint64_t done, uint64_t total) mutable {
      const int pct = static_cast<int>(100 * done / std::max<uint64_t>(total, 1));
      if (pct / 10 == last / 10 && pct != 100) return;
      last = pct;
      std::fprintf(stderr, "mha forward: written %d%%\n", pct);
    };
  }
  writer.write(a.output, progress);
}

}  // namespace

static void add_forward_command(CLI::App& app) {
  auto args = std::make_shared<ForwardArgs>();
  CLI::App* cmd = app.add_subcommand(
      "forward",
      "Run the module forward on inputs from a safetensors file and write `output` (and `attn_weights` when the "
      "weights file's metadata says need_weights=true, and `lse` (B, h, T_q); (h, T_q) unbatched; (h, total_q) "
      "packed, when need_lse=true) to a float32 safetensors file.\n"
      "The configuration comes from the weights file's __metadata__ (embed_dim, num_heads, num_kv_heads, "
      "head_dim, kdim, vdim, bias, add_bias_kv, add_zero_attn, batch_first, need_weights, average_attn_weights, "
      "is_causal, need_lse, scale, softcap, alibi_slopes (comma-separated, one per head), attention_sinks (then "
      "the weights hold `sinks`, one logit per head), rope (none, half_split or interleaved), rope_theta, "
      "rope_dims); "
      "weights under PyTorch or Hugging Face names. Inputs: query, key, value, and optional attn_mask (BOOL or U8: "
      "true = may NOT attend, PyTorch's convention; F16, BF16, F32 or F64: added) and key_padding_mask (BOOL or U8: "
      "true = padding; a float dtype: added); integer masks are refused.\n"
      "Packed variable-length batch: 2-D query (total_q, E) / key / value (total_k, ·) with I32 or I64 offset "
      "tensors cu_seqlens_q and cu_seqlens_k (B + 1 each; k defaults to q), optional inputs metadata "
      "max_seqlen_q / max_seqlen_k; weights metadata causal_align = top_left (default) or bottom_right "
      "aligns is_causal per sequence.");
  cmd->add_option("--weights", args->weights, "safetensors file with the weights and the configuration metadata")
      ->required();
  cmd->add_option("--inputs", args->inputs, "safetensors file with query, key, value and optional masks")->required();
  cmd->add_option("--output", args->output, "where to write the results (written atomically)")
      ->required()
      ->check(path_to_write());
  cmd->add_option("--threads", args->threads,
                  "threads to use (0 = OMP_NUM_THREADS, else every CPU this process may use)")
      ->check(whole_number_at_least(0));
  cmd->callback([args] { run_forward(*args); });
}

static const CommandRegistrar registered{20, add_forward_command};

}  // namespace mha::cli
