// `mha forward`: the conformance contract of shared/conformance/README.md.
#include <string>

#include "load_inputs.h"
#include "mha/module.h"
#include "mha/safetensors.h"
#include "mha/weights.h"
#include "registry.h"

namespace mha::cli {

namespace {

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

  const MhaOutput out = module.forward(in.query, in.key, in.value, opt);
  io::SafetensorsWriter writer;
  writer.add("output", out.output);
  if (need_weights) writer.add("attn_weights", out.attn_weights);
  writer.write(a.output);
}

}  // namespace

static void add_forward_command(CLI::App& app) {
  auto args = std::make_shared<ForwardArgs>();
  CLI::App* cmd = app.add_subcommand(
      "forward",
      "Run the module forward on inputs from a safetensors file and write `output` (and `attn_weights` when the "
      "weights file's metadata says need_weights=true) to a float32 safetensors file.\n"
      "The configuration comes from the weights file's __metadata__ (embed_dim, num_heads, num_kv_heads, kdim, "
      "vdim, bias, add_bias_kv, add_zero_attn, batch_first, need_weights, average_attn_weights, is_causal); "
      "weights under PyTorch or Hugging Face names. Inputs: query, key, value, and optional attn_mask (BOOL: true "
      "= may NOT attend, PyTorch's convention; F32: added) and key_padding_mask (BOOL: true = padding; F32: added).");
  cmd->add_option("--weights", args->weights, "safetensors file with the weights and the configuration metadata")
      ->required();
  cmd->add_option("--inputs", args->inputs, "safetensors file with query, key, value and optional masks")->required();
  cmd->add_option("--output", args->output, "where to write the results (written atomically)")->required();
  cmd->add_option("--threads", args->threads, "threads to use (0 = all cores)")->check(CLI::NonNegativeNumber);
  cmd->callback([args] { run_forward(*args); });
}

static const CommandRegistrar registered{20, add_forward_command};

}  // namespace mha::cli
