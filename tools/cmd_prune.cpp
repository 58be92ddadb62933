// `mha prune`: remove heads from saved weights; optionally score every head by ablation first.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "load_inputs.h"
#include "mha/module.h"
#include "mha/prune.h"
#include "mha/safetensors.h"
#include "mha/weights.h"
#include "registry.h"

namespace mha::cli {

namespace {

struct PruneArgs {
  std::string weights, output, inputs;
  std::vector<std::string> heads;  ///< --heads as given, each split at commas by head_indices
  bool importance = false, duplicate_kv = false;
  int threads = 0;
};

/// printf into a string.
template <class... Args>
std::string format(const char* fmt, Args... args) {
  const int n = std::snprintf(nullptr, 0, fmt, args...);
  std::string out(static_cast<size_t>(std::max(n, 0)), '\0');
  std::snprintf(out.data(), out.size() + 1, fmt, args...);
  return out;
}

double relative_l2(const Tensor& got, const Tensor& want) {
  double num = 0, den = 0;
  for (int64_t n = 0; n < want.numel(); ++n) {
    const double e = static_cast<double>(got.data()[n]) - want.data()[n];
    num += e * e;
    den += static_cast<double>(want.data()[n]) * want.data()[n];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

/// --heads as indices: every non-empty comma-separated item of every argument (--heads 0,3, --heads
/// 0 3 and --heads 0 --heads 3 alike) a whole decimal integer ("0," and "1,,2" skip the empty ones),
/// and at least one of them. (Split and parsed here rather than by CLI11, which read an empty
/// --heads "" as head 0 and removed it, and split --heads , into items that swallowed the next
/// option: '--output is required'.)
std::vector<int64_t> head_indices(const std::vector<std::string>& texts) {
  std::vector<int64_t> heads;
  for (const std::string& text : texts)
    for (size_t begin = 0; begin <= text.size();) {
      const size_t comma = std::min(text.find(',', begin), text.size());
      const std::string item = text.substr(begin, comma - begin);
      begin = comma + 1;
      if (item.empty()) continue;
      const std::optional<int64_t> h = whole_number(item);
      if (!h) fail("prune: --heads item '", item, "' is not a head index");
      heads.push_back(*h);
    }
  if (heads.empty()) fail("prune: --heads lists no head index (give them comma-separated, e.g. 0,3)");
  return heads;
}

void run_prune(const PruneArgs& a) {
  if (a.importance && a.inputs.empty()) fail("prune: --importance needs --inputs (the inputs to measure on)");
  const std::vector<int64_t> heads = head_indices(a.heads);
  const io::SafetensorsFile file = io::SafetensorsFile::open(a.weights);
  const MultiheadAttention module = io::load_module(file);
  const io::WeightNames names = io::detect_weight_names(file);
  PruneOptions po;
  po.uneven_groups = a.duplicate_kv ? UnevenGroups::DuplicateKV : UnevenGroups::Refuse;
  const MultiheadAttention pruned = prune_heads(module, heads, po);

  std::string report;
  if (!a.inputs.empty()) {
    const LoadedInputs in = load_inputs(file, a.inputs);
    MhaForwardOptions opt = in.options;
    opt.threads = a.threads;
    if (opt.attn_mask.present() && (opt.attn_mask.allowed.dim() == 3 || opt.attn_mask.additive.dim() == 3))
      fail(
          "prune: the inputs' attn_mask is per head (B·num_heads, T_q, T_k); the pruned module has other heads, "
          "so its effect cannot be measured with the same mask");
    if (a.importance) {
      const std::vector<double> imp = head_importance(module, in.query, in.key, in.value, opt);
      report += "head importance by ablation (‖y − y without head‖ / ‖y‖):\n";
      for (size_t h = 0; h < imp.size(); ++h) report += format("  head %2zu  %.6f\n", h, imp[h]);
    }
    const Tensor y = module.forward(in.query, in.key, in.value, opt).output;
    const Tensor yp = pruned.forward(in.query, in.key, in.value, opt).output;
    report += format("output change from pruning on these inputs: ‖y − y_pruned‖ / ‖y‖ = %.6f\n", relative_l2(yp, y));
  }
  // The report goes out once the file is written: a save that fails prints one line and nothing else.
  // With the module's configuration go the settings `mha forward` and `mha analyze` read beside it
  // (is_causal, need_weights, ...): without them a causal model's pruned file ran non-causal.
  io::SafetensorsWriter writer;
  io::add_weights(writer, pruned, names);
  for (const char* key : kRunSettingKeys)
    if (const auto it = file.metadata().find(key); it != file.metadata().end()) writer.set_metadata(key, it->second);
  writer.write(a.output);
  std::fputs(report.c_str(), stdout);
  const MhaConfig& c = module.config();
  const MhaConfig& p = pruned.config();
  std::printf(
      "pruned %zu of %lld heads: %lld heads (kv_heads %lld → %lld, d = %lld), parameters %lld → %lld; wrote %s\n",
      heads.size(), static_cast<long long>(c.num_heads), static_cast<long long>(p.num_heads),
      static_cast<long long>(c.kv_heads()), static_cast<long long>(p.kv_heads()), static_cast<long long>(p.head_dim()),
      static_cast<long long>(module.parameter_count()), static_cast<long long>(pruned.parameter_count()),
      a.output.c_str());
}

}  // namespace

static void add_prune_command(CLI::App& app) {
  auto a = std::make_shared<PruneArgs>();
  CLI::App* cmd = app.add_subcommand(
      "prune",
      "Remove attention heads: rows of W_Q (and of K/V for whole grouped-query groups) and columns of W_O. The "
      "pruned module's output equals the original's with those heads' contributions zeroed. Writes the weights "
      "with their configuration metadata (and the input's run settings: is_causal, causal_align, need_weights, "
      "average_attn_weights, need_lse), under the same naming scheme as the input.");
  cmd->add_option("--weights", a->weights, "safetensors file with the weights and the configuration metadata")
      ->required();
  cmd->add_option("--heads", a->heads, "comma-separated head indices to remove, e.g. 0,3")->required();
  cmd->add_option("--output", a->output, "where to write the pruned weights")->required()->check(path_to_write());
  cmd->add_option("--inputs", a->inputs, "inputs (as for `mha forward`) to measure the change of the output on");
  cmd->add_flag("--importance", a->importance, "print every head's importance by ablation (needs --inputs)");
  cmd->add_flag("--duplicate-kv", a->duplicate_kv,
                "grouped-query weights: when groups keep different numbers of heads, copy K/V heads to stay exact "
                "(instead of refusing)");
  cmd->add_option("--threads", a->threads, "threads to use (0 = OMP_NUM_THREADS, else every CPU this process may use)")
      ->check(whole_number_at_least(0));
  cmd->callback([a] { run_prune(*a); });
}

static const CommandRegistrar registered{45, add_prune_command};

}  // namespace mha::cli
