// head_patterns — five attention heads built by hand to do the five jobs the analysis names, saved
// as ordinary weights so that `mha analyze` can look at them like at any other module.
//
// Inputs are one-hot positions x_t = e_t (T = 8 tokens, E = 40, d = 8), causal attention. A head's
// score for query i and key j is q_i·k_j/√d with q_i = W_Q e_i + b_Q and k_j = W_K e_j, so each
// head is chosen by which columns of W_Q / W_K are non-zero (G = 30: the chosen key wins by
// e^(30/√8) ≈ 40000 to 1):
//   head 0  attention_sink  q = G·u for every query (bias), only key 0 has k = u
//   head 1  prev_token      q_i = G·e_i, k_j = e_{j+1}: query i matches key i − 1
//   head 2  self_attend     q_i = G·e_i, k_j = e_j
//   head 3  focused         q_i = G·e_i, k_j = e_{j+2}: two back, one sharp peak but not i − 1
//   head 4  broad           q = 0: uniform over the visible keys
//
//   example_head_patterns [--out-dir DIR] [--quick]
// writes DIR/head_patterns.safetensors (weights, is_causal=true) and
// DIR/head_patterns_inputs.safetensors, checks the classes, and prints the command that draws them:
//   mha analyze --weights DIR/head_patterns.safetensors --inputs DIR/head_patterns_inputs.safetensors
//     --tokens "<s> the cat sat on the mat ." --image heads.png  (one line)
// --quick writes into a temporary directory (the test suite's run).
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>

#include "mha/analysis.h"
#include "mha/module.h"
#include "mha/safetensors.h"
#include "mha/weights.h"

namespace {

int run(int argc, char** argv) {
  std::string dir = ".";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      dir = (std::filesystem::temp_directory_path() / "mha_head_patterns").string();
    } else if (a == "--out-dir" && i + 1 < argc) {
      dir = argv[++i];
    } else {
      const bool help = a == "--help" || a == "-h";
      std::fprintf(help ? stdout : stderr, "usage: %s [--out-dir DIR] [--quick]\n", argv[0]);
      return help ? 0 : 2;
    }
  }
  std::filesystem::create_directories(dir);

  constexpr int64_t T = 8, H = 5, d = 8, E = H * d;
  constexpr float G = 30.0f;
  mha::MhaConfig config;
  config.embed_dim = E;
  config.num_heads = H;
  config.layout = mha::Layout::BatchFirst;
  mha::MultiheadAttention module(config);
  mha::MhaParameters& p = module.params();
  for (mha::Tensor* t : {&p.in_proj_weight, &p.in_proj_bias, &p.out_proj_weight, &p.out_proj_bias})
    std::fill(t->values().begin(), t->values().end(), 0.0f);
  // in_proj_weight rows: Q of head h at h·d, K at E + h·d, V at 2E + h·d.
  const auto q = [&](int64_t h, int64_t row, int64_t col) -> float& { return p.in_proj_weight.at({h * d + row, col}); };
  const auto k = [&](int64_t h, int64_t row, int64_t col) -> float& {
    return p.in_proj_weight.at({E + h * d + row, col});
  };
  p.in_proj_bias.at({0}) = G;  // head 0: the same query everywhere…
  k(0, 0, 0) = 1.0f;           // …matches key 0 only
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h : {1, 2, 3}) q(h, t, t) = G;
    if (t + 1 < T) k(1, t + 1, t) = 1.0f;                                                // key t answers query t + 1
    k(2, t, t) = 1.0f;                                                                   // key t answers query t
    if (t + 2 < T) k(3, t + 2, t) = 1.0f;                                                // key t answers query t + 2
    for (int64_t h = 0; h < H; ++h) p.in_proj_weight.at({2 * E + h * d + t, t}) = 1.0f;  // V: the position
  }
  for (int64_t i = 0; i < E; ++i) p.out_proj_weight.at({i, i}) = 1.0f;

  mha::Tensor x({1, T, E});
  for (int64_t t = 0; t < T; ++t) x.at({0, t, t}) = 1.0f;
  const std::string weights = dir + "/head_patterns.safetensors", inputs = dir + "/head_patterns_inputs.safetensors";
  mha::io::SafetensorsWriter w;
  mha::io::add_weights(w, module, mha::io::WeightNames::PyTorch);
  w.set_metadata("is_causal", "true");
  w.write(weights);
  mha::io::SafetensorsWriter in;
  for (const char* name : {"query", "key", "value"}) in.add(name, x);
  in.write(inputs);

  mha::MhaForwardOptions opt;
  opt.causal = mha::Causal::top_left();
  opt.need_weights = mha::NeedWeights::PerHead;
  const auto metrics = mha::head_metrics(module.forward(x, x, x, opt).attn_weights);
  const mha::HeadClass want[H] = {mha::HeadClass::AttentionSink, mha::HeadClass::PrevToken, mha::HeadClass::SelfAttend,
                                  mha::HeadClass::Focused, mha::HeadClass::Broad};
  int wrong = 0;
  for (const mha::HeadMetrics& m : metrics) {
    std::printf("head %lld: %-14s entropy %.3f  sink %.3f  prev %.3f  self %.3f  focus %.3f\n",
                static_cast<long long>(m.head), mha::head_class_name(m.cls), m.entropy, m.sink, m.prev_token, m.self,
                m.focus);
    if (m.cls != want[m.head]) {
      std::fprintf(stderr, "head %lld: expected %s\n", static_cast<long long>(m.head),
                   mha::head_class_name(want[m.head]));
      ++wrong;
    }
  }
  std::printf(
      "\nwrote %s and %s; draw them with\n  mha analyze --weights %s --inputs %s --tokens \"<s> the cat sat "
      "on the mat .\" --image heads.png\n",
      weights.c_str(), inputs.c_str(), weights.c_str(), inputs.c_str());
  return wrong ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // an unwritable --out-dir, a failed save: one line, not an abort
    std::fprintf(stderr, "head_patterns: %s\n", e.what());
    return 1;
  }
}
