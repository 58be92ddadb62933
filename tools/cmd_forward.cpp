// `mha forward`: the conformance contract of shared/conformance/README.md.
#include <map>
#include <string>

#include "mha/module.h"
#include "mha/safetensors.h"
#include "registry.h"

namespace mha::cli {

namespace {

bool metadata_flag(const std::map<std::string, std::string>& meta, const std::string& key, bool fallback) {
  auto it = meta.find(key);
  if (it == meta.end()) return fallback;
  if (it->second == "true") return true;
  if (it->second == "false") return false;
  fail("metadata '", key, "' must be true or false, got '", it->second, "'");
}

struct ForwardArgs {
  std::string weights, inputs, output;
  int threads = 0;
};

void run_forward(const ForwardArgs& a) {
  const io::SafetensorsFile weights = io::SafetensorsFile::open(a.weights);
  MultiheadAttention module = io::load_module(weights);
  const auto& meta = weights.metadata();

  // Inputs may be a different file from the weights (the same file in the conformance cases).
  const io::SafetensorsFile inputs_file =
      a.inputs == a.weights ? io::SafetensorsFile::open(a.weights) : io::SafetensorsFile::open(a.inputs);
  for (const char* name : {"query", "key", "value"})
    if (!inputs_file.contains(name)) fail(a.inputs, ": input tensor '", name, "' is missing");
  const Tensor query = inputs_file.read_f32("query");
  const Tensor key = inputs_file.read_f32("key");
  const Tensor value = inputs_file.read_f32("value");

  MhaForwardOptions opt;
  opt.threads = a.threads;
  if (inputs_file.contains("attn_mask")) {
    const io::DType dt = inputs_file.info("attn_mask").dtype;
    opt.attn_mask = (dt == io::DType::BOOL || dt == io::DType::U8)
                        ? AttnMask::from_torch_bool(inputs_file.read_bool("attn_mask"))
                        : AttnMask::add(inputs_file.read_f32("attn_mask"));
  }
  if (inputs_file.contains("key_padding_mask")) {
    const io::DType dt = inputs_file.info("key_padding_mask").dtype;
    if (dt == io::DType::BOOL || dt == io::DType::U8)
      opt.key_padding_mask.is_padding = inputs_file.read_bool("key_padding_mask");
    else
      opt.key_padding_mask.additive = inputs_file.read_f32("key_padding_mask");
  }
  if (metadata_flag(meta, "is_causal", false)) opt.causal = Causal::top_left();
  const bool need_weights = metadata_flag(meta, "need_weights", false);
  const bool average = metadata_flag(meta, "average_attn_weights", true);
  opt.need_weights = !need_weights ? NeedWeights::None : average ? NeedWeights::Averaged : NeedWeights::PerHead;

  const MhaOutput out = module.forward(query, key, value, opt);
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
