// `mha analyze`: what each head does on given inputs — metrics, class, and a picture.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "load_inputs.h"
#include "mha/analysis.h"
#include "mha/image.h"
#include "mha/module.h"
#include "mha/prune.h"
#include "mha/safetensors.h"
#include "mha/weights.h"
#include "registry.h"

namespace mha::cli {

namespace {

struct AnalyzeArgs {
  std::string weights, inputs, image, svg, tokens, query_tokens;
  int64_t batch = 0;
  bool json = false, causal = false, importance = false;
  int threads = 0;
};

std::vector<std::string> split_words(const std::string& s) {
  std::istringstream is(s);
  std::vector<std::string> words;
  for (std::string w; is >> w;) words.push_back(w);
  return words;
}

/// A key_padding_mask as (B, T_k) booleans, true = padding: a boolean mask as it is, a float one
/// true where it is −inf or at most −1e30 (Hugging Face pads with finfo(float32).min, a key no
/// weight reaches); undefined without one.
BoolTensor key_padding_of(const KeyPaddingMask& m, int64_t B, int64_t Tk) {
  if (!m.present()) return {};
  BoolTensor padding({B, Tk});
  for (int64_t n = 0; n < B * Tk; ++n)
    padding.data()[n] = m.is_padding.defined() ? static_cast<uint8_t>(m.is_padding.data()[n] != 0)
                                               : static_cast<uint8_t>(m.additive.data()[n] <= -1e30f);
  return padding;
}

/// One batch element of per-head weights: (B, h, T_q, S) → (h, T_q, S).
Tensor batch_slice(const Tensor& w, int64_t b) {
  const int64_t H = w.size(1), Tq = w.size(2), S = w.size(3);
  const float* begin = w.data() + b * H * Tq * S;
  return Tensor({H, Tq, S}, std::vector<float>(begin, begin + H * Tq * S));
}

void run_analyze(const AnalyzeArgs& a) {
  const io::SafetensorsFile weights_file = io::SafetensorsFile::open(a.weights);
  const MultiheadAttention module = io::load_module(weights_file);
  const MhaConfig& c = module.config();
  const LoadedInputs in = load_inputs(weights_file, a.inputs);
  if (in.options.packed)
    fail(
        "analyze: a packed batch (cu_seqlens) returns no attention weights to measure: give padded (B, T, E) "
        "inputs with a key_padding_mask");
  MhaForwardOptions opt = in.options;
  opt.threads = a.threads;
  opt.need_weights = NeedWeights::PerHead;
  // --causal adds PyTorch's is_causal where the metadata has none, aligned as the metadata's
  // causal_align says (load_inputs has checked its spelling); a causal mask the metadata names
  // keeps its alignment.
  if (a.causal && !opt.causal.enabled()) {
    const auto& meta = weights_file.metadata();
    const auto align = meta.find("causal_align");
    opt.causal = align != meta.end() && align->second == "bottom_right" ? Causal::bottom_right() : Causal::top_left();
  }
  const MhaOutput out = module.forward(in.query, in.key, in.value, opt);
  // Unbatched input gives (h, T_q, S): treat it as a batch of one.
  const Tensor w =
      out.attn_weights.dim() == 3
          ? out.attn_weights.reshaped({1, out.attn_weights.size(0), out.attn_weights.size(1), out.attn_weights.size(2)})
          : out.attn_weights;
  const int64_t B = w.size(0), H = w.size(1), Tq = w.size(2), S = w.size(3);
  const int64_t extra = (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0), Tk = S - extra;

  // Positions: query i's own key is i + offset over the T_k real keys (the appended bias_k / zero
  // columns come after them and have no position: never a query's own or previous token): the
  // causal mask's offset where there is one (top-left: 0, so that previous-token and self are
  // measured at keys the query can see), else bottom-right, T_k − T_q.
  MetricsOptions mopt;
  mopt.key_positions = Tk;
  mopt.query_offset = opt.causal.enabled() ? opt.causal.offset_for(Tq, Tk) : Tk - Tq;
  // Padding: the key_padding_mask's padded keys (a float one's −inf entries), as (B, T_k). The
  // sink is then each sequence's first real key; and in self-attention (the query's values are the
  // key's) a padded position's query row is padding too, not measured.
  const bool self_attention = in.query.shape() == in.key.shape() &&
                              std::equal(in.query.values().begin(), in.query.values().end(), in.key.values().begin());
  mopt.key_padding = key_padding_of(opt.key_padding_mask, B, Tk);
  if (self_attention && mopt.key_padding.defined()) mopt.query_padding = mopt.key_padding;
  const std::vector<HeadMetrics> metrics = head_metrics(w, mopt);
  std::vector<double> importance;
  if (a.importance) importance = head_importance(module, in.query, in.key, in.value, opt);

  const bool drawing = !a.image.empty() || !a.svg.empty();
  // The picture's options without a picture would be ignored: an out-of-range --batch or labels of
  // the wrong length exited 0.
  if (!drawing && (a.batch != 0 || !a.tokens.empty() || !a.query_tokens.empty()))
    fail("analyze: --batch, --tokens and --query-tokens choose and label the picture: give --image or --svg");
  HeatmapOptions hopt;
  if (drawing) {
    if (a.batch < 0 || a.batch >= B) fail("analyze: --batch ", a.batch, " is out of range [0, ", B, ")");
    hopt.title = std::filesystem::path(a.weights).filename().string() + ", batch " + std::to_string(a.batch) +
                 " (rows: queries, columns: keys)";
    for (const HeadMetrics& m : metrics)
      hopt.panel_titles.push_back("head " + std::to_string(m.head) + ": " + head_class_name(m.cls));
    std::vector<std::string> keys = split_words(a.tokens), queries = split_words(a.query_tokens);
    if (!keys.empty()) {
      if (static_cast<int64_t>(keys.size()) != Tk)
        fail("analyze: --tokens has ", keys.size(), " words, but the keys have T_k = ", Tk, " positions");
      if (queries.empty()) {
        // Self-attention style: query i is the token at key position i + offset, the alignment the
        // metrics use (bottom-right: the last T_q tokens; a top-left causal mask: the first T_q).
        const int64_t first = *mopt.query_offset;
        if (first < 0 || first + Tq > Tk)
          fail("analyze: the queries are at key positions [", first, ", ", first + Tq,
               "), not all within the T_k = ", Tk, " --tokens: give their labels with --query-tokens");
        queries.assign(keys.begin() + first, keys.begin() + first + Tq);
      }
      if (c.add_bias_kv) keys.push_back("<bias_k>");
      if (c.add_zero_attn) keys.push_back("<zero>");
      hopt.key_labels = keys;
    }
    if (!queries.empty()) {
      if (static_cast<int64_t>(queries.size()) != Tq)
        fail("analyze: --query-tokens has ", queries.size(), " words, but T_q = ", Tq);
      hopt.query_labels = queries;
    }
  }
  const Tensor panel = drawing ? batch_slice(w, a.batch) : Tensor();
  // Pictures first: a path that cannot be written fails the command before anything reaches
  // stdout, so a script never reads a whole report from a call that exits 1.
  if (!a.image.empty()) write_heatmap_png(a.image, panel, hopt);
  if (!a.svg.empty()) write_heatmap_svg(a.svg, panel, hopt);

  if (a.json) {
    nlohmann::json j;
    j["weights"] = a.weights;
    j["num_heads"] = H, j["num_kv_heads"] = c.kv_heads(), j["head_dim"] = c.head_dim(), j["embed_dim"] = c.embed_dim;
    j["batch"] = B, j["t_q"] = Tq, j["t_k"] = Tk, j["extra_key_positions"] = extra;
    j["query_offset"] = *mopt.query_offset;
    j["key_padding"] = mopt.key_padding.defined();
    j["padded_query_rows_excluded"] = mopt.query_padding.defined();
    const HeadThresholds& t = mopt.thresholds;
    j["thresholds"] = {{"sink", t.sink},
                       {"prev_token", t.prev_token},
                       {"self_attend", t.self_attend},
                       {"focused_entropy", t.focused_entropy}};
    j["heads"] = nlohmann::json::array();
    for (const HeadMetrics& m : metrics) {
      nlohmann::json h = {{"head", m.head}, {"class", head_class_name(m.cls)}, {"rows", m.rows}, {"entropy", m.entropy},
                          {"sink", m.sink}, {"prev_token", m.prev_token},      {"self", m.self}, {"focus", m.focus}};
      if (a.importance) h["importance"] = importance[static_cast<size_t>(m.head)];
      j["heads"].push_back(h);
    }
    if (drawing) {
      // Where each head's matrix landed in the PNG, for anyone annotating or checking the picture.
      const HeatmapPlacement L = heatmap_placement(panel, hopt);
      j["image"] = {{"batch", a.batch}, {"cell_pixels", L.cell}, {"panel_x", L.panel_x}, {"panel_y", L.panel_y}};
      // The labels as drawn: the rows' (queries) and the columns' (keys, then <bias_k> / <zero>).
      if (!hopt.query_labels.empty()) j["image"]["query_labels"] = hopt.query_labels;
      if (!hopt.key_labels.empty()) j["image"]["key_labels"] = hopt.key_labels;
    }
    // A path need not be UTF-8 (POSIX names are bytes): such bytes are written as U+FFFD rather than
    // failing the whole report.
    std::printf("%s\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf(
        "%lld heads (d=%lld, kv_heads=%lld) on B=%lld, T_q=%lld, T_k=%lld%s; rows with no weight on a key position "
        "excluded\n",
        static_cast<long long>(H), static_cast<long long>(c.head_dim()), static_cast<long long>(c.kv_heads()),
        static_cast<long long>(B), static_cast<long long>(Tq), static_cast<long long>(Tk),
        extra ? " (+ appended bias_k / zero key positions)" : "");
    if (mopt.key_padding.defined())
      std::printf("key padding: the sink is each sequence's first real key%s\n",
                  mopt.query_padding.defined() ? "; padded query rows (self-attention) are not measured" : "");
    std::printf("%4s  %-14s %5s %8s %7s %7s %7s %7s%s\n", "head", "class", "rows", "entropy", "sink", "prev", "self",
                "focus", a.importance ? "  importance" : "");
    for (const HeadMetrics& m : metrics) {
      std::printf("%4lld  %-14s %5lld %8.3f %7.3f %7.3f %7.3f %7.3f", static_cast<long long>(m.head),
                  head_class_name(m.cls), static_cast<long long>(m.rows), m.entropy, m.sink, m.prev_token, m.self,
                  m.focus);
      if (a.importance) std::printf("  %10.4f", importance[static_cast<size_t>(m.head)]);
      std::printf("\n");
    }
    const HeadThresholds& t = mopt.thresholds;
    std::printf(
        "classes, first match: attention_sink (sink > %g), prev_token (prev > %g), self_attend (self > %g), "
        "focused (entropy < %g nats), else broad\n",
        t.sink, t.prev_token, t.self_attend, t.focused_entropy);
    if (a.importance) std::printf("importance: ‖y − y without head‖ / ‖y‖ on these inputs\n");
  }

  if (a.json) return;
  if (!a.image.empty()) std::printf("wrote %s\n", a.image.c_str());
  if (!a.svg.empty()) std::printf("wrote %s\n", a.svg.c_str());
}

}  // namespace

static void add_analyze_command(CLI::App& app) {
  auto a = std::make_shared<AnalyzeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "analyze",
      "Run the module with per-head attention weights and say what each head does: mean entropy, mass on the "
      "first key (sink), on the previous and on the own position, mean row maximum (focus), and a class "
      "(attention_sink > prev_token > self_attend > focused > broad). Inputs as for `mha forward` (but not a packed "
      "batch: weights are returned per padded batch). Appended bias_k / zero-attention keys count in the entropy "
      "and focus, never as a query's own or previous position; rows with no weight on a real key (fully masked, or "
      "left only the appended keys by the masks) are not measured. With a key_padding_mask (a float one: entries "
      "of -inf or at most -1e30) the sink is each sequence's first real key, and for self-attention inputs "
      "padded query rows are not measured.");
  cmd->add_option("--weights", a->weights, "safetensors file with the weights and the configuration metadata")
      ->required();
  cmd->add_option("--inputs", a->inputs, "safetensors file with query, key, value and optional masks")->required();
  cmd->add_flag("--json", a->json, "one JSON object on stdout instead of the table");
  cmd->add_option("--image", a->image, "write a PNG grid of per-head heat maps (one batch element)")
      ->check(path_to_write());
  cmd->add_option("--svg", a->svg, "write the same grid as SVG")->check(path_to_write());
  cmd->add_option("--tokens", a->tokens,
                  "space-separated labels of the T_k key positions (and of the queries, at the positions the "
                  "metrics use: the last T_q, or the first T_q under a top-left causal mask)");
  cmd->add_option("--query-tokens", a->query_tokens, "space-separated labels of the T_q queries (cross-attention)");
  cmd->add_option("--batch", a->batch, "which batch element to draw (default 0; with --image or --svg)");
  cmd->add_flag("--causal", a->causal,
                "apply a causal mask, as if the metadata said is_causal: aligned as its causal_align says "
                "(top-left by default); a causal mask the metadata names is kept as it is");
  cmd->add_flag("--importance", a->importance, "also score each head by ablation (relative change of the output)");
  cmd->add_option("--threads", a->threads, "threads to use (0 = OMP_NUM_THREADS, else every CPU this process may use)")
      ->check(whole_number_at_least(0));
  cmd->callback([a] { run_analyze(*a); });
}

static const CommandRegistrar registered{40, add_analyze_command};

}  // namespace mha::cli
