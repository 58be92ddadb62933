// `mha demo`: the layer step by step on the textbook example, every number computed for real.
#include <malloc.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

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
  fopt.backend = Backend::Reference;  // the readable path, as in step 5
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

/// Deterministic values in [−1, 1) (a small LCG; the demo's numbers are reproducible).
Tensor demo_random(const Shape& shape, uint64_t seed) {
  Tensor t(shape);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& v : t.values()) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<float>(static_cast<int64_t>(state >> 40) % 2001 - 1000) / 1000.0f;
  }
  return t;
}

// ---- the seed's claims, shown with real modules and real runs ----------------------------------

/// Elements actually held by a module's parameter tensors.
int64_t held_parameters(const MultiheadAttention& m) {
  const MhaParameters& p = m.params();
  int64_t n = 0;
  for (const Tensor* t : {&p.in_proj_weight, &p.q_proj_weight, &p.k_proj_weight, &p.v_proj_weight, &p.in_proj_bias,
                          &p.bias_k, &p.bias_v, &p.out_proj_weight, &p.out_proj_bias})
    n += t->numel();
  return n;
}

void parameters_do_not_depend_on_heads() {
  section("3. Parameters: 4·d_model² (+ 4·d_model biases), whatever the number of heads");
  constexpr int64_t E = 256;
  std::printf("  d_model = %lld; each row is a real module, its parameter tensors counted element by element\n",
              static_cast<long long>(E));
  std::printf("  %4s %5s %18s %10s %8s %10s %14s\n", "h", "d_k", "W_Q+W_K+W_V", "W_O", "biases", "total", "4·E² + 4·E");
  for (int64_t h : {1, 2, 4, 8, 16}) {
    MhaConfig c;
    c.embed_dim = E;
    c.num_heads = h;
    const MultiheadAttention m(c);
    const MhaParameters& p = m.params();
    std::printf("  %4lld %5lld %18lld %10lld %8lld %10lld %14lld\n", static_cast<long long>(h),
                static_cast<long long>(c.head_dim()), static_cast<long long>(p.in_proj_weight.numel()),
                static_cast<long long>(p.out_proj_weight.numel()),
                static_cast<long long>(p.in_proj_bias.numel() + p.out_proj_bias.numel()),
                static_cast<long long>(held_parameters(m)), static_cast<long long>(4 * E * E + 4 * E));
  }
  std::printf("  Splitting into heads reshapes the same matrices: more heads means smaller d_k, not more weights.\n");
}

void gqa_kv_cache() {
  section("4. Grouped-query attention: what sharing K/V heads saves in the KV cache");
  // The cache holds, per token and layer, one K row and one V row per K/V head: 2·kv·d values.
  // The widths below come from real modules' K/V projections (d = 16 to keep them small); the
  // bytes are then for d = 128 and bfloat16, LLaMA-3-70B's geometry (64 query heads, d_model 8192).
  constexpr int64_t H = 64, d_small = 16, d = 128, layers = 80, tokens = 8192;
  std::printf("  %-6s %4s %10s %26s %22s %8s\n", "", "kv", "K+V width", "cache / token / layer (bf16)",
              "8192 tokens x 80 layers", "saving");
  double full = 0;
  for (int64_t kv : {64, 8, 1}) {
    MhaConfig c;
    c.embed_dim = H * d_small;
    c.num_heads = H;
    c.num_kv_heads = kv;
    const MultiheadAttention m(c);
    // in_proj_weight rows are [Q: h·d][K: kv·d][V: kv·d]: the K+V part is what gets cached.
    const int64_t kv_width = (m.params().in_proj_weight.size(0) - H * d_small) / d_small;  // 2·kv
    const double bytes = static_cast<double>(kv_width * d * 2);
    if (kv == H) full = bytes;
    std::printf("  %-6s %4lld %8lld·d %22.1f KiB %17.2f GiB %7.0fx\n",
                kv == H   ? "MHA"
                : kv == 1 ? "MQA"
                          : "GQA",
                static_cast<long long>(kv), static_cast<long long>(kv_width), bytes / 1024.0,
                bytes * layers * tokens / (1024.0 * 1024.0 * 1024.0), full / bytes);
  }
  std::printf("  64 query heads over 8 K/V heads: each K/V head serves 8 query heads, so the cache is 8x smaller.\n");
}

/// A line of /proc/self/status in KiB (VmRSS, VmHWM), or −1 where unavailable.
long status_kib(const char* key) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long value = -1;
  const size_t n = std::strlen(key);
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, key, n) == 0 && line[n] == ':') value = std::strtol(line + n + 1, nullptr, 10);
  std::fclose(f);
  return value;
}

/// Returns freed heap pages to the system, then resets the peak resident set (VmHWM) to the
/// current one; false where the kernel does not allow it.
bool reset_peak_rss() {
  malloc_trim(0);
  std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (!f) return false;
  const bool ok = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && ok;
}

void naive_vs_fused_memory(bool full_size) {
  section("5. Memory: materialising the attention weights vs the fused kernel");
  constexpr int64_t H = 32, d = 64, T_big = 8192;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double naive_big = static_cast<double>(H * T_big * T_big * 4);
  std::printf(
      "  naive attention at h=%lld, T=%lld keeps B·h·T² float32 weights: %lld·%lld² x 4 bytes = %.2f GiB per "
      "sequence\n",
      static_cast<long long>(H), static_cast<long long>(T_big), static_cast<long long>(H),
      static_cast<long long>(T_big), naive_big / gib);
  std::printf(
      "  the fused kernel never stores them; its extra memory, measured as the rise of peak RSS over the\n"
      "  inputs and output during one causal sdpa() call (B=1, h=%lld, d=%lld), after malloc_trim so that\n"
      "  freed heap pages cannot hide new ones%s:\n",
      static_cast<long long>(H), static_cast<long long>(d),
      full_size ? "" : "; up to T=2048 to keep the demo quick (--full-size runs T=8192 too)");
  std::printf("  %6s %16s %18s %12s  %s\n", "T", "naive weights", "fused extra (RSS)", "time", "backend");
  double last_secs = 0, last_extra_mib = -1;
  std::vector<int64_t> lengths = {256, 512, 1024, 2048};
  if (full_size) lengths.push_back(T_big);
  for (int64_t T : lengths) {
    const Tensor q = demo_random({1, H, T, d}, 1), k = demo_random({1, H, T, d}, 2), v = demo_random({1, H, T, d}, 3);
    Tensor out({1, H, T, d});
    SdpaOptions opt;
    opt.masks.causal = Causal::top_left();
    SdpaOutputs outs;
    outs.out = out.view4();
    const std::string why = sdpa_dispatch_reason(q.view4(), k.view4(), v.view4(), opt, outs);
    const bool can_measure = reset_peak_rss();
    const long before = status_kib("VmRSS");
    const auto t0 = std::chrono::steady_clock::now();
    sdpa(q.view4(), k.view4(), v.view4(), opt, outs);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const long peak = status_kib("VmHWM");
    char extra[64];
    last_secs = secs;
    last_extra_mib = -1;
    if (can_measure && before >= 0 && peak >= 0) {
      last_extra_mib = static_cast<double>(peak - before) / 1024.0;
      std::snprintf(extra, sizeof extra, "%.2f MiB", last_extra_mib);
    } else {
      std::snprintf(extra, sizeof extra, "n/a");
    }
    std::printf("  %6lld %12.2f MiB %18s %10.3f s  %s\n", static_cast<long long>(T),
                static_cast<double>(H * T * T * 4) / (1024.0 * 1024.0), extra, secs, why.c_str());
  }
  std::printf(
      "  The naive column grows as T² (x4 per doubling); the fused kernel's extra memory grows as T (x2 per\n"
      "  doubling): long sequences get K and V packed once per call, a workspace the size of K and V\n"
      "  (2·h·T·d floats), beside per-thread scratch for a block of keys; never T² (last row: %s).\n",
      last_extra_mib >= 0 ? "measured" : "not measurable here");
  if (!full_size)
    std::printf(
        "  Extrapolated, not run: at T=8192 the naive weights take %.0f GiB; the fused run would take about 16x the\n"
        "  T=2048 time (~%.0f s here) with scratch of the same order as above.\n",
        naive_big / gib, 16 * last_secs);
}
}  // namespace

static void add_demo_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("demo", "Walk through multi-head attention step by step on the textbook example.");
  auto full_size = std::make_shared<bool>(false);
  cmd->add_flag("--full-size", *full_size, "section 5 also runs the fused kernel at h=32, T=8192 (seconds, 256 MiB)");
  cmd->callback([full_size] {
    std::printf("mha demo: multi-head attention, every step computed by the library\n");
    worked_example();
    random_batch();
    parameters_do_not_depend_on_heads();
    gqa_kv_cache();
    naive_vs_fused_memory(*full_size);
  });
}

static const CommandRegistrar registered{10, add_demo_command};

}  // namespace mha::cli
