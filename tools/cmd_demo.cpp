// `mha demo`: the layer step by step on the textbook example, every number computed for real.
#include <cmath>
#include <cstdio>
#include <string>

#include "mha/module.h"
#include "mha/sdpa.h"
#include "registry.h"

namespace mha::cli {

namespace {

void print_matrix(const char* title, const float* data, int64_t rows, int64_t cols, int64_t row_stride) {
  std::printf("%s (%lld, %lld)\n", title, static_cast<long long>(rows), static_cast<long long>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    std::printf("    [");
    for (int64_t c = 0; c < cols; ++c)
      std::printf("%s%6.2f", c ? ", " : "", static_cast<double>(data[r * row_stride + c]));
    std::printf("]\n");
  }
}

void section(const char* title) { std::printf("\n== %s ==\n", title); }

void worked_example() {
  section("1. The worked example: B=1, n=3, d_model=4, h=2, W_Q = W_K = W_V = W_O = I");
  constexpr int64_t n = 3, E = 4, H = 2, d = E / H;
  const Tensor X({n, E}, std::vector<float>{1, 0, 1, 0, 0, 1, 0, 1, 1, 1, 0, 0});
  print_matrix("X, the input tokens", X.data(), n, E, E);

  // The module, with identity projections and zero biases.
  MhaConfig config;
  config.embed_dim = E;
  config.num_heads = H;
  config.layout = Layout::BatchFirst;
  MultiheadAttention module(config);
  MhaParameters& w = module.params();
  std::fill(w.in_proj_weight.values().begin(), w.in_proj_weight.values().end(), 0.0f);
  std::fill(w.out_proj_weight.values().begin(), w.out_proj_weight.values().end(), 0.0f);
  for (int64_t block = 0; block < 3; ++block)
    for (int64_t i = 0; i < E; ++i) w.in_proj_weight.at({block * E + i, i}) = 1.0f;
  for (int64_t i = 0; i < E; ++i) w.out_proj_weight.at({i, i}) = 1.0f;
  std::printf(
      "\nStep 1, project: Q = X·W_Qᵀ, K = X·W_Kᵀ, V = X·W_Vᵀ, each (3, 4); with identity weights Q = K = V = X.\n");

  // Step 2: split into heads, (n, E) → (B=1, h, n, d).
  Tensor Qh({1, H, n, d});
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < d; ++c) Qh.at({0, h, t, c}) = X.at({t, h * d + c});
  std::printf("\nStep 2, split into h=2 heads of d=2 columns each: (1, 3, 4) → (1, 2, 3, 2)\n");
  for (int64_t h = 0; h < H; ++h) {
    const std::string title = "  head " + std::to_string(h) + " Q (= K = V)";
    print_matrix(title.c_str(), Qh.data() + h * n * d, n, d, d);
  }

  // Step 3: scaled scores per head, Q·Kᵀ/√d.
  std::printf("\nStep 3, scaled scores S = Q·Kᵀ / √d = Q·Kᵀ / %.3f, per head (3, 3)\n", std::sqrt(double(d)));
  for (int64_t h = 0; h < H; ++h) {
    float scores[n * n];
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float dot = 0;
        for (int64_t c = 0; c < d; ++c) dot += Qh.at({0, h, i, c}) * Qh.at({0, h, j, c});
        scores[i * n + j] = dot / std::sqrt(static_cast<float>(d));
      }
    const std::string title = "  head " + std::to_string(h) + " scores";
    print_matrix(title.c_str(), scores, n, n, n);
  }

  // Step 4 and 5: softmax weights and head outputs, from the library's SDPA (the reference oracle).
  SdpaOptions sopt;
  sopt.backend = Backend::Reference;
  const SdpaResult att = sdpa(Qh, Qh, Qh, sopt, Want::WeightsAndLse);
  std::printf("\nStep 4, softmax over each row: weights (1, 2, 3, 3); every row sums to 1\n");
  for (int64_t h = 0; h < H; ++h) {
    const std::string title = "  head " + std::to_string(h) + " weights";
    print_matrix(title.c_str(), att.weights.data() + h * n * n, n, n, n);
    std::printf("    row sums:");
    for (int64_t i = 0; i < n; ++i) {
      double s = 0;
      for (int64_t j = 0; j < n; ++j) s += att.weights.at({0, h, i, j});
      std::printf(" %.4f", s);
    }
    std::printf("\n");
  }
  std::printf("\nStep 5, head outputs = weights · V, (1, 2, 3, 2)\n");
  for (int64_t h = 0; h < H; ++h) {
    const std::string title = "  head " + std::to_string(h) + " output";
    print_matrix(title.c_str(), att.out.data() + h * n * d, n, d, d);
  }

  // Step 6 and 7: concatenate heads, project with W_O.
  Tensor concat({n, E});
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < d; ++c) concat.at({t, h * d + c}) = att.out.at({0, h, t, c});
  std::printf("\nStep 6, concatenate the heads: (1, 2, 3, 2) → (1, 3, 4)\n");
  print_matrix("  concat", concat.data(), n, E, E);
  MhaForwardOptions fopt;
  fopt.need_weights = NeedWeights::PerHead;
  const Tensor Xb = X.reshaped({1, n, E});
  const MhaOutput y = module.forward(Xb, Xb, Xb, fopt);
  std::printf("\nStep 7, output projection: output = concat · W_Oᵀ (+ b_O), (1, 3, 4)\n");
  print_matrix("  output (from MultiheadAttention.forward)", y.output.data(), n, E, E);
  double worst = 0;
  for (int64_t i = 0; i < n * E; ++i) worst = std::max(worst, std::fabs(double(y.output.data()[i] - concat.data()[i])));
  std::printf("  the module's forward agrees with the steps above: max |difference| = %.2g\n", worst);
}

void random_batch() {
  section("2. Self-attention over a random batch");
  MhaConfig config;
  config.embed_dim = 64;
  config.num_heads = 8;
  config.layout = Layout::BatchFirst;
  MultiheadAttention module(config, 42);
  Tensor x({2, 10, 64});
  uint64_t state = 7;
  for (float& v : x.values()) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<float>(static_cast<int64_t>(state >> 40) % 2001 - 1000) / 1000.0f;
  }
  MhaForwardOptions opt;
  opt.need_weights = NeedWeights::PerHead;
  opt.causal = Causal::top_left();
  const MhaOutput y = module.forward(x, x, x, opt);
  std::printf("  input             %s   (B, T, E), batch_first\n", shape_str(x.shape()).c_str());
  std::printf("  Q, K, V per head  (2, 8, 10, 8)  (B, h, T, d), d = E / h = 8\n");
  std::printf("  weights           %s  (B, h, T_q, T_k), causal (top-left)\n",
              shape_str(y.attn_weights.shape()).c_str());
  std::printf("  output            %s   (B, T, E)\n", shape_str(y.output.shape()).c_str());
  std::printf("  parameters        %lld = 4·E² + 4·E = 4·64² + 4·64\n",
              static_cast<long long>(module.parameter_count()));
  std::printf("  batch 0, head 0, query 3 attends to keys 0..3 only:");
  for (int64_t j = 0; j < 10; ++j) std::printf(" %.3f", static_cast<double>(y.attn_weights.at({0, 0, 3, j})));
  std::printf("\n");
}

}  // namespace

static void add_demo_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("demo", "Walk through multi-head attention step by step on the textbook example.");
  cmd->callback([] {
    std::printf("mha demo: multi-head attention, every step computed by the library\n");
    worked_example();
    random_batch();
  });
}

static const CommandRegistrar registered{10, add_demo_command};

}  // namespace mha::cli
