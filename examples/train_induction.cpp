// train_induction — a two-layer attention-only model, built from mha alone, learns induction.
//
// Task: sequences of i.i.d. random tokens (vocab 10, length 24, so tokens recur). At every
// position whose token occurred before, predict the token that followed its most recent earlier
// occurrence. The answer depends on content, not position, so no positional shortcut exists; chance
// is 1/vocab. Two attention layers solve it by an "induction head": layer 1 copies each position's
// previous token into it, layer 2 attends from the current token to the most recent position whose
// previous token matches it, and reads off the token there.
//
// Model (batch-first rows (B, T, E), causal attention):
//   x  = tok_emb[token] + pos_emb[t]            (plain matrices)
//   h1 = x  + MHA_1(x, x, x)                    (mha::forward_train)
//   h2 = h1 + MHA_2(h1, h1, h1)
//   logits = h2 · W_outᵀ; loss = cross-entropy over the repeat's positions
// Backward with mha::backward (gradients per argument: the residual sums query + key + value),
// Adam in a few lines. Fixed seed; prints loss and accuracy per step.
//
//   example_train_induction [--steps N] [--csv FILE] [--plot FILE.png] [--save PREFIX] [--quick]
// --save writes, for N = 1, 2, PREFIX.layerN.safetensors (the layer's weights, config and
// is_causal=true) and PREFIX.layerN.inputs.safetensors (query = key = value = the layer's input on
// a few evaluation sequences, plus their token ids), ready for
//   mha analyze --weights PREFIX.layerN.safetensors --inputs PREFIX.layerN.inputs.safetensors
// (docs/images/trained_heads_layer{1,2}.png: --save /tmp/ind, then analyze --batch 0 --tokens with
// the printed evaluation sequence 0 — a previous-token head in layer 1, induction stripes in layer 2).
// --quick runs a short schedule and exits 1 unless the loss fell.
//
// After training, the model is evaluated on fresh sequences twice: by the full causal forward, and
// by decoding token by token through MultiheadAttention::forward_incremental with a KV cache per
// layer in float32, bfloat16, int8, and int8 with per-channel key scales (KIVI, groups of 8
// of the 24 positions; mha/kv_cache.h); it prints the accuracy of each and the
// largest logit difference from the full forward, so a cache dtype's cost in accuracy shows.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "mha/image.h"
#include "mha/kv_cache.h"
#include "mha/random.h"
#include "mha/safetensors.h"
#include "mha/training.h"
#include "mha/weights.h"

namespace {

using mha::Tensor;

constexpr int64_t kVocab = 10, kT = 24, kE = 48, kHeads = 2, kBatch = 32;
// Evaluation sequences saved by --save: short enough that a picture can label every cell.
constexpr int64_t kEvalBatch = 4, kEvalT = 16;

using Rng = mha::SplitMix64;  // started from a raw state: Rng{12345}

Tensor random_matrix(int64_t rows, int64_t cols, double scale, Rng& rng) {
  Tensor t({rows, cols});
  for (float& x : t.values()) x = static_cast<float>((2 * rng.uniform() - 1) * scale);
  return t;
}

/// Adam (Kingma & Ba) on one tensor; m and v are its moment estimates.
struct Adam {
  double lr = 3e-3, b1 = 0.9, b2 = 0.98, eps = 1e-8;
  int64_t step = 0;
  void update(Tensor& p, const Tensor& g, Tensor& m, Tensor& v) const {
    if (m.numel() != p.numel()) m = Tensor(p.shape()), v = Tensor(p.shape());
    const double c1 = 1 - std::pow(b1, double(step)), c2 = 1 - std::pow(b2, double(step));
    for (int64_t i = 0; i < p.numel(); ++i) {
      const double gi = g.data()[i];
      m.data()[i] = static_cast<float>(b1 * m.data()[i] + (1 - b1) * gi);
      v.data()[i] = static_cast<float>(b2 * v.data()[i] + (1 - b2) * gi * gi);
      p.data()[i] -= static_cast<float>(lr * (m.data()[i] / c1) / (std::sqrt(v.data()[i] / c2) + eps));
    }
  }
};

/// Every trainable tensor of an attention layer, paired with its gradient.
std::vector<std::pair<Tensor*, const Tensor*>> layer_params(mha::MhaParameters& p, const mha::MhaParameters& g) {
  return {{&p.in_proj_weight, &g.in_proj_weight},
          {&p.in_proj_bias, &g.in_proj_bias},
          {&p.out_proj_weight, &g.out_proj_weight},
          {&p.out_proj_bias, &g.out_proj_bias}};
}

/// A batch of i.i.d. random tokens (B, T) and the induction label of each position: the token
/// that followed the most recent earlier occurrence of the current token, or −1 when the current
/// token has not occurred before (not scored).
struct Batch {
  std::vector<int> tokens, labels;
};

Batch make_batch(Rng& rng) {
  Batch batch{std::vector<int>(kBatch * kT), std::vector<int>(kBatch * kT, -1)};
  for (int64_t b = 0; b < kBatch; ++b) {
    int* x = &batch.tokens[b * kT];
    for (int64_t t = 0; t < kT; ++t) x[t] = static_cast<int>(rng.next() % kVocab);
    for (int64_t t = 1; t < kT; ++t)
      for (int64_t s = t - 1; s >= 0; --s)
        if (x[s] == x[t]) {
          batch.labels[b * kT + t] = x[s + 1];
          break;
        }
  }
  return batch;
}

/// Evaluation tokens (kEvalBatch, kEvalT). The first two sequences are the classic induction probe:
/// kEvalT/2 distinct tokens, then the same run again, so in the second half an induction head
/// attends to the position after the current token's first occurrence (a stripe kEvalT/2 − 1 below
/// the diagonal). The others are i.i.d. like the training data.
std::vector<int> make_eval_tokens(Rng& rng) {
  std::vector<int> tokens(kEvalBatch * kEvalT);
  constexpr int64_t half = kEvalT / 2;
  static_assert(half <= kVocab, "the repeated run needs distinct tokens");
  for (int64_t b = 0; b < kEvalBatch; ++b) {
    int* x = &tokens[b * kEvalT];
    if (b < 2) {
      std::vector<int> perm(kVocab);
      for (int v = 0; v < kVocab; ++v) perm[v] = v;
      for (int64_t t = 0; t < half; ++t) {  // partial Fisher–Yates: the first `half` are distinct
        std::swap(perm[t], perm[t + static_cast<int64_t>(rng.next() % uint64_t(kVocab - t))]);
        x[t] = x[t + half] = perm[t];
      }
    } else {
      for (int64_t t = 0; t < kEvalT; ++t) x[t] = static_cast<int>(rng.next() % kVocab);
    }
  }
  return tokens;
}

/// x = tok_emb[token] + pos_emb[t], (B, T, E) batch-first; T ≤ kT.
Tensor embed(const std::vector<int>& tokens, int64_t B, int64_t T, const Tensor& tok_emb, const Tensor& pos_emb) {
  Tensor x({B, T, kE});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < kE; ++e) x.at({b, t, e}) = tok_emb.at({tokens[b * T + t], e}) + pos_emb.at({t, e});
  return x;
}

/// PREFIX.NAME.safetensors (weights, config, is_causal) and PREFIX.NAME.inputs.safetensors (the
/// layer's self-attention input and the token ids) for `mha analyze`.
void save_layer(const std::string& prefix, const std::string& name, const mha::MultiheadAttention& layer,
                const Tensor& input, const std::vector<int>& tokens) {
  mha::io::SafetensorsWriter weights;
  mha::io::add_weights(weights, layer, mha::io::WeightNames::PyTorch);
  weights.set_metadata("is_causal", "true");  // trained with Causal::top_left(); analyze applies it
  weights.write(prefix + "." + name + ".safetensors");
  mha::io::SafetensorsWriter inputs;
  inputs.add("query", input);
  inputs.add("key", input);
  inputs.add("value", input);
  std::vector<float> ids(tokens.begin(), tokens.end());
  inputs.add("tokens", Tensor({input.size(0), input.size(1)}, std::move(ids)));
  inputs.write(prefix + "." + name + ".inputs.safetensors");
}

/// The read-out's logits h · W_outᵀ for one position's row h (kE values).
std::vector<double> logits_of(const float* h, const Tensor& w_out) {
  std::vector<double> logits(kVocab);
  for (int64_t v = 0; v < kVocab; ++v) {
    double s = 0;
    for (int64_t e = 0; e < kE; ++e) s += double(h[e]) * w_out.at({v, e});
    logits[static_cast<size_t>(v)] = s;
  }
  return logits;
}

/// h2 (B, T, E) of the whole model on x: by the full causal forward when `cache` is empty, else by
/// decoding token by token with one KV cache of that dtype per layer.
Tensor run_model(const mha::MultiheadAttention& layer1, const mha::MultiheadAttention& layer2, const Tensor& x,
                 const std::string& cache) {
  const int64_t B = x.size(0), T = x.size(1);
  const auto residual = [](Tensor h, const Tensor& a) {
    for (int64_t i = 0; i < h.numel(); ++i) h.data()[i] += a.data()[i];
    return h;
  };
  if (cache.empty()) {
    mha::MhaForwardOptions eo;
    eo.causal = mha::Causal::top_left(), eo.threads = 2;
    const Tensor h1 = residual(x, layer1.forward(x, x, x, eo).output);
    return residual(h1, layer2.forward(h1, h1, h1, eo).output);
  }
  mha::KvCacheConfig cc;
  cc.batch = B, cc.kv_heads = kHeads, cc.head_dim = kE / kHeads, cc.capacity = T;
  cc.dtype = cache == "bf16" ? mha::CacheDtype::BF16 : cache == "f32" ? mha::CacheDtype::F32 : mha::CacheDtype::I8;
  if (cache == "int8-channel") cc.int8_keys = mha::Int8KeyScales::PerChannel, cc.key_group = 8;
  mha::KvCache c1(cc), c2(cc);
  mha::IncrementalOptions io;
  io.threads = 2;
  Tensor h2({B, T, kE});
  for (int64_t t = 0; t < T; ++t) {
    Tensor xt({B, 1, kE});
    for (int64_t b = 0; b < B; ++b) std::copy_n(&x.at({b, t, 0}), kE, &xt.at({b, 0, 0}));
    const Tensor h1 = residual(xt, layer1.forward_incremental(xt, xt, xt, c1, io).output);
    const Tensor out = residual(h1, layer2.forward_incremental(h1, h1, h1, c2, io).output);
    for (int64_t b = 0; b < B; ++b) std::copy_n(&out.at({b, 0, 0}), kE, &h2.at({b, t, 0}));
  }
  return h2;
}

/// Accuracy of full-forward and KV-cache decoding on `batches` fresh batches, and each cache
/// dtype's largest |logit − full forward's logit|.
void evaluate_decoding(const mha::MultiheadAttention& layer1, const mha::MultiheadAttention& layer2,
                       const Tensor& tok_emb, const Tensor& pos_emb, const Tensor& w_out, int batches) {
  Rng rng{777};  // its own stream: evaluating changes nothing in training
  const std::vector<std::string> ways{"", "f32", "bf16", "int8", "int8-channel"};
  std::vector<int64_t> correct(ways.size(), 0);
  std::vector<double> worst(ways.size(), 0.0);
  int64_t n = 0;
  for (int i = 0; i < batches; ++i) {
    const Batch batch = make_batch(rng);
    const Tensor x = embed(batch.tokens, kBatch, kT, tok_emb, pos_emb);
    std::vector<Tensor> h;
    for (const std::string& w : ways) h.push_back(run_model(layer1, layer2, x, w));
    for (int64_t b = 0; b < kBatch; ++b)
      for (int64_t t = 0; t < kT; ++t) {
        const int target = batch.labels[b * kT + t];
        if (target < 0) continue;
        ++n;
        const std::vector<double> full = logits_of(&h[0].at({b, t, 0}), w_out);
        for (size_t k = 0; k < ways.size(); ++k) {
          const std::vector<double> l = logits_of(&h[k].at({b, t, 0}), w_out);
          correct[k] += std::max_element(l.begin(), l.end()) - l.begin() == target;
          for (int64_t v = 0; v < kVocab; ++v)
            worst[k] = std::max(worst[k], std::fabs(l[static_cast<size_t>(v)] - full[static_cast<size_t>(v)]));
        }
      }
  }
  std::printf("evaluation, %lld scored positions: full forward accuracy %.4f", static_cast<long long>(n),
              double(correct[0]) / double(n));
  for (size_t k = 1; k < ways.size(); ++k)
    std::printf("; decoding with a %s KV cache %.4f (max |Δlogit| %.2g)", ways[k].c_str(),
                double(correct[k]) / double(n), worst[k]);
  std::printf("\n");
}

/// dst += the three per-argument input gradients of a self-attention layer.
void add_input_grads(Tensor& dst, const mha::MhaGradients& g) {
  for (int64_t i = 0; i < dst.numel(); ++i) dst.data()[i] += g.query.data()[i] + g.key.data()[i] + g.value.data()[i];
}

/// Whether a file could be created at `path` (its directory exists and takes new files): checked
/// before training, so that a bad --plot or --save fails at once, not after the whole run.
bool writable_place(const std::string& path) {
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  const std::string d = dir.empty() ? "." : dir.string();
  return std::filesystem::is_directory(d) && ::access(d.c_str(), W_OK) == 0;
}

int run(int argc, char** argv) {
  int64_t steps = 1000;
  bool quick = false;
  std::string csv, plot, save;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "train_induction: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--quick")
      quick = true, steps = 100;
    else if (a == "--steps") {
      const std::string v = value();
      const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), steps);
      if (ec != std::errc() || end != v.data() + v.size()) {  // "3x" was taken as 3
        std::fprintf(stderr, "train_induction: --steps must be a whole number, got '%s'\n", v.c_str());
        return 2;
      }
    } else if (a == "--csv")
      csv = value();
    else if (a == "--plot")
      plot = value();
    else if (a == "--save")
      save = value();
    else {
      const bool help = a == "--help" || a == "-h";
      std::fprintf(help ? stdout : stderr,
                   "usage: %s [--steps N] [--csv FILE] [--plot FILE.png] [--save PREFIX] [--quick]\n", argv[0]);
      return help ? 0 : 2;
    }
  }
  if (steps < 1) {
    std::fprintf(stderr, "train_induction: --steps must be ≥ 1\n");
    return 2;
  }
  for (const auto& [option, path] : {std::pair{"--plot", plot}, std::pair{"--save", save}})
    if (!path.empty() && !writable_place(path)) {
      std::fprintf(stderr, "train_induction: %s %s: its directory does not exist or is not writable\n", option,
                   path.c_str());
      return 1;
    }

  mha::MhaConfig cfg;
  cfg.embed_dim = kE, cfg.num_heads = kHeads, cfg.layout = mha::Layout::BatchFirst;
  mha::MultiheadAttention layer1(cfg, 1), layer2(cfg, 2);
  Rng rng{12345};
  Tensor tok_emb = random_matrix(kVocab, kE, 1.0, rng), pos_emb = random_matrix(kT, kE, 1.0, rng);
  Tensor w_out = random_matrix(kVocab, kE, 1.0 / std::sqrt(double(kE)), rng);
  mha::MhaForwardOptions fo;
  fo.causal = mha::Causal::top_left(), fo.mode = mha::Mode::Training, fo.threads = 2;

  Adam adam;
  std::vector<Tensor> moments(64);  // m, v per trainable tensor, in a fixed order
  std::vector<double> loss_curve, acc_curve;
  std::FILE* csv_file = csv.empty() ? nullptr : std::fopen(csv.c_str(), "w");
  if (!csv.empty() && !csv_file) {
    std::fprintf(stderr, "train_induction: cannot write %s\n", csv.c_str());
    return 1;
  }
  if (csv_file) std::fprintf(csv_file, "step,loss,accuracy\n");

  for (int64_t step = 1; step <= steps; ++step) {
    const Batch batch = make_batch(rng);
    const std::vector<int>& tokens = batch.tokens;
    // ---- forward ----
    const Tensor x = embed(tokens, kBatch, kT, tok_emb, pos_emb);
    mha::MhaTrainOutput a1 = mha::forward_train(layer1, x, x, x, fo);
    Tensor h1 = x;
    for (int64_t i = 0; i < h1.numel(); ++i) h1.data()[i] += a1.output.data()[i];
    mha::MhaTrainOutput a2 = mha::forward_train(layer2, h1, h1, h1, fo);
    Tensor h2 = h1;
    for (int64_t i = 0; i < h2.numel(); ++i) h2.data()[i] += a2.output.data()[i];

    // ---- loss: softmax cross-entropy at the scored positions; d logits = (p − onehot) / n ----
    double loss = 0;
    int64_t n = 0, correct = 0;
    Tensor dh2({kBatch, kT, kE}), dw_out({kVocab, kE});
    std::vector<double> logits(kVocab);
    for (int64_t b = 0; b < kBatch; ++b)
      for (int64_t t = 0; t < kT; ++t) n += batch.labels[b * kT + t] >= 0;
    for (int64_t b = 0; b < kBatch; ++b)
      for (int64_t t = 0; t < kT; ++t) {
        const int target = batch.labels[b * kT + t];
        if (target < 0) continue;
        const float* h = &h2.at({b, t, 0});
        for (int64_t v = 0; v < kVocab; ++v) {
          double s = 0;
          for (int64_t e = 0; e < kE; ++e) s += double(h[e]) * w_out.at({v, e});
          logits[v] = s;
        }
        const double mx = *std::max_element(logits.begin(), logits.end());
        double z = 0;
        for (double l : logits) z += std::exp(l - mx);
        loss -= logits[target] - mx - std::log(z);
        correct += std::max_element(logits.begin(), logits.end()) - logits.begin() == target;
        for (int64_t v = 0; v < kVocab; ++v) {
          const double g = (std::exp(logits[v] - mx) / z - (v == target ? 1.0 : 0.0)) / double(n);
          for (int64_t e = 0; e < kE; ++e) {
            dw_out.at({v, e}) += static_cast<float>(g * h[e]);
            dh2.at({b, t, e}) += static_cast<float>(g * w_out.at({v, e}));
          }
        }
      }
    loss /= double(n);
    const double acc = double(correct) / double(n);

    // ---- backward: through the residuals and both attention layers ----
    const mha::MhaGradients g2 = mha::backward(layer2, a2.context, dh2);
    Tensor dh1 = dh2;  // h2 = h1 + MHA_2(h1, h1, h1)
    add_input_grads(dh1, g2);
    const mha::MhaGradients g1 = mha::backward(layer1, a1.context, dh1);
    Tensor dx = dh1;  // h1 = x + MHA_1(x, x, x)
    add_input_grads(dx, g1);
    Tensor dtok({kVocab, kE}), dpos({kT, kE});
    for (int64_t b = 0; b < kBatch; ++b)
      for (int64_t t = 0; t < kT; ++t)
        for (int64_t e = 0; e < kE; ++e) {
          dtok.at({tokens[b * kT + t], e}) += dx.at({b, t, e});
          dpos.at({t, e}) += dx.at({b, t, e});
        }

    // ---- Adam ----
    adam.step = step;
    std::vector<std::pair<Tensor*, const Tensor*>> all = {{&tok_emb, &dtok}, {&pos_emb, &dpos}, {&w_out, &dw_out}};
    for (auto& pg : layer_params(layer1.params(), g1.params)) all.push_back(pg);
    for (auto& pg : layer_params(layer2.params(), g2.params)) all.push_back(pg);
    for (size_t i = 0; i < all.size(); ++i)
      adam.update(*all[i].first, *all[i].second, moments[2 * i], moments[2 * i + 1]);

    loss_curve.push_back(loss);
    acc_curve.push_back(acc);
    std::printf("step %4lld  loss %.4f  accuracy %.3f\n", static_cast<long long>(step), loss, acc);
    if (csv_file) std::fprintf(csv_file, "%lld,%.6f,%.4f\n", static_cast<long long>(step), loss, acc);
  }
  if (csv_file) std::fclose(csv_file);

  if (!plot.empty()) {
    mha::Series loss_series{"loss", {}, loss_curve}, acc_series{"accuracy", {}, acc_curve};
    for (size_t i = 0; i < loss_curve.size(); ++i) {
      loss_series.xs.push_back(double(i + 1));
      acc_series.xs.push_back(double(i + 1));
    }
    mha::write_line_plot_png(plot, "induction: two attention layers", "step", "loss / accuracy",
                             {loss_series, acc_series});
  }
  if (!save.empty()) {
    // Each layer's input on the evaluation sequences: x for layer 1, h1 = x + MHA_1(x) for layer 2.
    Rng eval_rng{2024};  // its own stream, so saving changes nothing in the training run
    const std::vector<int> eval_tokens = make_eval_tokens(eval_rng);
    const Tensor x = embed(eval_tokens, kEvalBatch, kEvalT, tok_emb, pos_emb);
    mha::MhaForwardOptions eo;
    eo.causal = mha::Causal::top_left(), eo.threads = 2;
    Tensor h1 = x;
    const Tensor a1 = layer1.forward(x, x, x, eo).output;
    for (int64_t i = 0; i < h1.numel(); ++i) h1.data()[i] += a1.data()[i];
    save_layer(save, "layer1", layer1, x, eval_tokens);
    save_layer(save, "layer2", layer2, h1, eval_tokens);
    std::printf("saved %s.layer{1,2}{,.inputs}.safetensors; evaluation sequence 0:", save.c_str());
    for (int64_t t = 0; t < kEvalT; ++t) std::printf(" %d", eval_tokens[t]);
    std::printf("\n");
  }

  evaluate_decoding(layer1, layer2, tok_emb, pos_emb, w_out, quick ? 2 : 20);

  // Average over the first and last tenth of the run, so one lucky batch decides nothing.
  const size_t w = std::max<size_t>(1, loss_curve.size() / 10);
  double first = 0, last = 0, last_acc = 0;
  for (size_t i = 0; i < w; ++i) {
    first += loss_curve[i] / double(w);
    last += loss_curve[loss_curve.size() - 1 - i] / double(w);
    last_acc += acc_curve[acc_curve.size() - 1 - i] / double(w);
  }
  std::printf("loss %.4f → %.4f, final accuracy %.3f (chance %.3f)\n", first, last, last_acc, 1.0 / kVocab);
  if (quick && !(last < 0.8 * first)) {
    std::fprintf(stderr, "train_induction --quick: the loss did not fall (%.4f → %.4f)\n", first, last);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // a failed save or plot: one line, not an abort
    std::fprintf(stderr, "train_induction: %s\n", e.what());
    return 1;
  }
}
