// Gradients: the SDPA backward (reference and fused) and the module backward, checked against
// finite differences in double, PyTorch autograd goldens, and each other.
#include <hwy/targets.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/attention.h"
#include "kernels/attention_backward.h"
#include "kernels/backward_fused.h"
#include "kernels/dropout_rng.h"
#include "layers/scratch_pool.h"
#include "layers/sdpa_prepare.h"
#include "mha/safetensors.h"
#include "mha/training.h"
#include "mha/weights.h"
#include "support/test_support.h"

namespace mha {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::random_tensor;

constexpr double kEpsF32 = 0x1.0p-24;  // float32 unit roundoff

// ---- an SDPA case: inputs, masks (owned), options ------------------------------------------------

struct SdpaCase {
  std::string name;
  int64_t B = 1, H = 2, KV = 2, Tq = 4, Tk = 5, D = 3, Dv = 3;
  Causal causal;
  bool allowed = false, bias = false, padding = false, key_bias = false, dead_row = false;
  bool edits = false;  // ALiBi (the standard slopes), softcap 2 and a sink logit per head
  float dropout = 0.0f;
  std::optional<float> scale;
};

struct SdpaSetup {
  Tensor q, k, v, dout;
  BoolTensor allowed, padding;
  Tensor bias, key_bias;
  std::vector<float> slopes, sinks;  // borrowed by opt
  SdpaOptions opt;
};

SdpaSetup make_setup(const SdpaCase& c, uint64_t seed) {
  SdpaSetup s;
  s.q = random_tensor({c.B, c.H, c.Tq, c.D}, seed + 1);
  s.k = random_tensor({c.B, c.KV, c.Tk, c.D}, seed + 2);
  s.v = random_tensor({c.B, c.KV, c.Tk, c.Dv}, seed + 3);
  s.dout = random_tensor({c.B, c.H, c.Tq, c.Dv}, seed + 4);
  s.opt.scale = c.scale;
  s.opt.masks.causal = c.causal;
  s.opt.dropout = {c.dropout, seed + 99};
  const Tensor r = random_tensor({c.B, c.H, c.Tq, c.Tk}, seed + 5, 0.0f, 1.0f);
  if (c.allowed) {  // (B, 1, T_q, T_k), broadcast over heads
    s.allowed = BoolTensor({c.B, 1, c.Tq, c.Tk});
    for (int64_t x = 0; x < s.allowed.numel(); ++x) s.allowed.data()[x] = r.data()[x] > 0.3f;
    if (c.dead_row && c.Tq > 1)
      for (int64_t j = 0; j < c.Tk; ++j) s.allowed.at({0, 0, 1, j}) = 0;
    s.opt.masks.allowed.view = {s.allowed.data(), {c.B, 1, c.Tq, c.Tk}, {c.Tq * c.Tk, 0, c.Tk, 1}};
  }
  if (c.bias) {  // (1, h, T_q, T_k) with some −inf
    s.bias = random_tensor({1, c.H, c.Tq, c.Tk}, seed + 6);
    for (int64_t x = 0; x < s.bias.numel(); ++x)
      if (r.data()[s.bias.numel() - 1 - x] < 0.15f) s.bias.data()[x] = -std::numeric_limits<float>::infinity();
    s.opt.masks.bias.view = s.bias.view4();
  }
  if (c.padding) {  // trailing padding, more in later batches; garbage in padded K/V rows
    s.padding = BoolTensor({c.B, c.Tk}, 0);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t j = std::max<int64_t>(1, c.Tk - 1 - b); j < c.Tk; ++j) s.padding.at({b, j}) = 1;
    s.opt.masks.key_padding.view = {s.padding.data(), {c.B, 1, 1, c.Tk}, {c.Tk, 0, 0, 1}};
  }
  if (c.key_bias) {
    s.key_bias = random_tensor({c.B, c.Tk}, seed + 7);
    s.opt.masks.key_bias.view = {s.key_bias.data(), {c.B, 1, 1, c.Tk}, {c.Tk, 0, 0, 1}};
  }
  if (c.edits) {
    s.slopes = alibi_slopes(c.H);
    const Tensor z = random_tensor({c.H}, seed + 8, -1.0f, 2.0f);
    s.sinks.assign(z.data(), z.data() + c.H);
    s.opt.alibi.slopes = s.slopes;
    s.opt.sinks.logits = s.sinks;
    s.opt.softcap = 2.0f;
  }
  return s;
}

/// Padded K/V rows get NaN: the backward must never read them (docs/semantics.md, 'Padded keys are never read').
void poison_padding(SdpaSetup& s) {
  if (!s.padding.defined()) return;
  const int64_t B = s.k.size(0), KV = s.k.size(1), Tk = s.k.size(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < KV; ++g)
      for (int64_t j = 0; j < Tk; ++j) {
        if (!s.padding.at({b, j})) continue;
        for (int64_t c = 0; c < s.k.size(3); ++c) s.k.at({b, g, j, c}) = std::nanf("");
        for (int64_t c = 0; c < s.v.size(3); ++c) s.v.at({b, g, j, c}) = std::nanf("");
      }
}

/// The forward in double from double inputs (an independent check, written from docs/semantics.md):
/// L = Σ out · dout. Masks come from the same key_hidden()/additive_terms() definitions.
double loss_double(const SdpaSetup& s, const std::vector<double>& q, const std::vector<double>& k,
                   const std::vector<double>& v) {
  kernels::SdpaParams p;
  p.q = s.q.view4(), p.k = s.k.view4(), p.v = s.v.view4();
  const int64_t B = p.batch(), H = p.heads(), KV = p.kv_heads(), Tq = p.t_q(), Tk = p.t_k(), D = p.d(), Dv = p.d_v();
  const std::array<int64_t, 4> full{B, H, Tq, Tk};
  auto bc = [&](auto view, std::array<int64_t, 4> shape) {
    if (!view.defined()) return view;
    for (size_t a = 0; a < 4; ++a)
      if (view.shape[a] != shape[a]) view.shape[a] = shape[a], view.stride[a] = 0;
    return view;
  };
  p.masks = s.opt.masks;
  p.masks.allowed.view = bc(p.masks.allowed.view, full);
  p.masks.bias.view = bc(p.masks.bias.view, full);
  const double scale = s.opt.scale ? *s.opt.scale : 1.0 / std::sqrt(static_cast<double>(D));
  p.scale = static_cast<float>(scale);
  const int64_t off = p.masks.causal.offset_for(Tq, Tk);
  double loss = 0.0;
  std::vector<double> sc(static_cast<size_t>(Tk));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / KV);
      for (int64_t i = 0; i < Tq; ++i) {
        double mx = -INFINITY;
        for (int64_t j = 0; j < Tk; ++j) {
          sc[j] = -INFINITY;
          if (kernels::key_hidden(p, b, h, i, j, off)) continue;
          double dot = 0;
          for (int64_t c = 0; c < D; ++c) dot += q[((b * H + h) * Tq + i) * D + c] * k[((b * KV + g) * Tk + j) * D + c];
          sc[j] = scale * dot + kernels::additive_terms(p, b, h, i, j);
          mx = std::max(mx, sc[j]);
        }
        if (mx == -INFINITY) continue;
        double z = 0;
        for (int64_t j = 0; j < Tk; ++j) z += sc[j] == -INFINITY ? 0.0 : std::exp(sc[j] - mx);
        for (int64_t j = 0; j < Tk; ++j) {
          if (sc[j] == -INFINITY) continue;
          double pr = std::exp(sc[j] - mx) / z;
          if (s.opt.dropout.active())
            pr = kernels::dropout_keep(s.opt.dropout.seed, s.opt.dropout.p, b, h, i, j) ? pr / (1.0 - s.opt.dropout.p)
                                                                                        : 0.0;
          if (pr == 0.0) continue;
          for (int64_t c = 0; c < Dv; ++c) loss += pr * v[((b * KV + g) * Tk + j) * Dv + c] * s.dout.at({b, h, i, c});
        }
      }
    }
  return loss;
}

std::vector<double> to_double(const Tensor& t) { return {t.values().begin(), t.values().end()}; }

/// Central differences of loss_double with respect to one input (0 = q, 1 = k, 2 = v).
Tensor fd_grad(const SdpaSetup& s, int which) {
  std::vector<double> x[3] = {to_double(s.q), to_double(s.k), to_double(s.v)};
  const Tensor& shape_of = which == 0 ? s.q : which == 1 ? s.k : s.v;
  Tensor g(shape_of.shape());
  const double h = 1e-6;
  for (size_t e = 0; e < x[which].size(); ++e) {
    if (std::isnan(x[which][e])) continue;  // a poisoned padded row: its gradient must be 0
    const double keep = x[which][e];
    x[which][e] = keep + h;
    const double up = loss_double(s, x[0], x[1], x[2]);
    x[which][e] = keep - h;
    const double down = loss_double(s, x[0], x[1], x[2]);
    x[which][e] = keep;
    g.data()[e] = static_cast<float>((up - down) / (2 * h));
  }
  return g;
}

SdpaGradTensors run_backward(const SdpaSetup& s, Backend backend, int threads = 1) {
  SdpaOptions opt = s.opt;
  opt.backend = Backend::Reference;
  const SdpaResult fwd = sdpa(s.q, s.k, s.v, opt, Want::Lse);
  opt.backend = backend;
  opt.threads = threads;
  return sdpa_backward(s.q, s.k, s.v, fwd.out, s.dout, fwd.lse, opt);
}

std::vector<SdpaCase> fd_cases() {
  std::vector<SdpaCase> cs;
  auto add = [&](std::string name, auto&& edit) {
    SdpaCase c;
    c.name = std::move(name);
    edit(c);
    cs.push_back(c);
  };
  add("basic", [](SdpaCase&) {});
  add("dv_ne_d_cross", [](SdpaCase& c) { c.Tq = 3, c.Tk = 6, c.D = 2, c.Dv = 4, c.B = 2; });
  add("gqa_h4_kv2", [](SdpaCase& c) { c.H = 4, c.KV = 2; });
  add("mqa_h3_kv1", [](SdpaCase& c) { c.H = 3, c.KV = 1, c.Dv = 2; });
  add("causal_top_left", [](SdpaCase& c) { c.causal = Causal::top_left(), c.Tq = c.Tk = 5; });
  add("causal_bottom_right_dead_rows", [](SdpaCase& c) { c.causal = Causal::bottom_right(), c.Tq = 5, c.Tk = 3; });
  add("causal_window", [](SdpaCase& c) { c.causal = Causal::bottom_right().with_window(2), c.Tq = 4, c.Tk = 6; });
  add("allowed_dead_row", [](SdpaCase& c) { c.allowed = true, c.dead_row = true, c.B = 2; });
  add("bias_neg_inf", [](SdpaCase& c) { c.bias = true; });
  add("key_padding_nan", [](SdpaCase& c) { c.padding = true, c.B = 2, c.Tk = 6; });
  add("key_bias", [](SdpaCase& c) { c.key_bias = true; });
  add("dropout", [](SdpaCase& c) { c.dropout = 0.3f, c.B = 2; });
  add("everything_gqa", [](SdpaCase& c) {
    c.H = 4, c.KV = 2, c.B = 2, c.Tq = 4, c.Tk = 6, c.allowed = c.bias = c.padding = c.key_bias = true;
    c.causal = Causal::bottom_right(), c.dropout = 0.2f, c.scale = 0.7f;
  });
  add("T1_d1", [](SdpaCase& c) { c.Tq = c.Tk = 1, c.D = c.Dv = 1, c.H = c.KV = 1; });
  add("empty_keys", [](SdpaCase& c) { c.Tk = 0; });
  return cs;
}

// The reference backward against central differences of an independent double forward.
// Tolerance: the reference accumulates in double and rounds once (|err| ≤ ε|g|); the central
// difference with h = 1e-6 is exact to ~1e-9 here. So atol = rtol = 8ε covers both.
TEST(SdpaBackwardReference, MatchesFiniteDifferences) {
  uint64_t seed = 100;
  for (const SdpaCase& c : fd_cases()) {
    SCOPED_TRACE(c.name);
    SdpaSetup s = make_setup(c, seed += 10);
    poison_padding(s);
    const SdpaGradTensors g = run_backward(s, Backend::Reference);
    const double tol = 8 * kEpsF32 + 1e-8;
    EXPECT_TRUE(all_close(g.dq, fd_grad(s, 0), tol, tol)) << "dq";
    EXPECT_TRUE(all_close(g.dk, fd_grad(s, 1), tol, tol)) << "dk";
    EXPECT_TRUE(all_close(g.dv, fd_grad(s, 2), tol, tol)) << "dv";
    double biggest = 0;  // the check must not pass vacuously
    for (const Tensor* t : {&g.dq, &g.dk, &g.dv})
      for (float x : t->values()) {
        ASSERT_TRUE(std::isfinite(x));
        biggest = std::max(biggest, std::fabs(double(x)));
      }
    if (c.Tk > 0) {
      EXPECT_GT(biggest, 1e-3);
    }
  }
}

TEST(SdpaBackward, RejectsBadShapes) {
  const Tensor q({1, 2, 3, 4}), k({1, 2, 5, 4}), v({1, 2, 5, 4}), out({1, 2, 3, 4}), lse({1, 2, 3});
  EXPECT_THROW(sdpa_backward(q, k, v, out, Tensor({1, 2, 3, 5}), lse), Error);
  EXPECT_THROW(sdpa_backward(q, k, v, out, out, Tensor({1, 2, 4})), Error);
  EXPECT_THROW(sdpa_backward(q, Tensor({1, 3, 5, 4}), v, out, out, lse), Error);
  try {
    sdpa_backward(q, k, v, out, Tensor({1, 2, 3, 5}), lse);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("d_out"), std::string::npos) << e.what();
  }
}

// ---- the fused kernel against the reference, over sweeps -----------------------------------------------

/// Fused float32 against the double reference: each gradient entry is a sum over ≈ T_k (or T_q·group)
/// products of O(1) terms, each rounded at ε, so the error grows like ε·√n·max|g|. `slack` scales
/// the bound where the scores are larger than O(1) (each probability then moves by ε·|score|).
::testing::AssertionResult fused_close(const Tensor& got, const Tensor& want, int64_t n, double slack = 1.0) {
  double biggest = 0;
  for (float x : want.values()) biggest = std::max(biggest, std::fabs(double(x)));
  const double tol = slack * 64 * kEpsF32 * std::sqrt(double(n) + 1) * (1 + biggest);
  return all_close(got, want, tol, tol);
}

/// dQ, dK and dV of `got` each fused_close to `want`'s: a dQ entry sums over `keys` products, a dK
/// or dV entry over `rows` (query rows times the group); d sinks, where the call has them, over
/// every row of its head (`rows` times the batch is enough). `what` prefixes each failure's message.
void expect_grads_close(const SdpaGradTensors& got, const SdpaGradTensors& want, int64_t keys, int64_t rows,
                        const std::string& what = "", double slack = 1.0) {
  EXPECT_TRUE(fused_close(got.dq, want.dq, keys, slack)) << what << "dq";
  EXPECT_TRUE(fused_close(got.dk, want.dk, rows, slack)) << what << "dk";
  EXPECT_TRUE(fused_close(got.dv, want.dv, rows, slack)) << what << "dv";
  EXPECT_EQ(got.dsinks.numel(), want.dsinks.numel()) << what << "dsinks";
  if (want.dsinks.numel() > 0) {
    EXPECT_TRUE(fused_close(got.dsinks, want.dsinks, rows * want.dq.size(0), slack)) << what << "dsinks";
  }
}

/// The same gradients, bit for bit (d sinks included).
void expect_grads_bitwise(const SdpaGradTensors& got, const SdpaGradTensors& want, const std::string& what) {
  EXPECT_TRUE(bitwise_equal(got.dq, want.dq)) << what << ", dq";
  EXPECT_TRUE(bitwise_equal(got.dk, want.dk)) << what << ", dk";
  EXPECT_TRUE(bitwise_equal(got.dv, want.dv)) << what << ", dv";
  EXPECT_TRUE(bitwise_equal(got.dsinks, want.dsinks)) << what << ", dsinks";
}

/// The fused backward of s on every target it was compiled for: close to the reference on 2
/// threads (expect_grads_close, with its `slack`), and bitwise the same on 1 and 3 threads (other
/// work schemes where B·kv is small).
void expect_fused_matches_reference_on_every_target(const SdpaSetup& s, const SdpaCase& c, double slack = 1.0) {
  const SdpaGradTensors want = run_backward(s, Backend::Reference);
  testing::for_each_fused_backward_target([&] {
    const SdpaGradTensors got = run_backward(s, Backend::Fused, 2);
    expect_grads_close(got, want, c.Tk, c.Tq * c.H / c.KV, "", slack);
    for (const int threads : {1, 3})
      expect_grads_bitwise(run_backward(s, Backend::Fused, threads), got, std::to_string(threads) + " threads");
  });
}

std::vector<SdpaCase> sweep_cases() {
  std::vector<SdpaCase> cs;
  const int64_t lengths[] = {0, 1, 2, 7, 63, 64, 65, 197};
  int n = 0;
  for (int64_t t : lengths)
    for (int64_t d : {1, 8, 64}) {
      SdpaCase c;
      c.name = std::string("T");
      c.name += std::to_string(t);
      c.name += "_d";
      c.name += std::to_string(d);
      c.Tq = t, c.Tk = t == 0 ? 3 : t, c.D = d, c.Dv = d == 1 ? 3 : d;
      // Rotate the options over the sweep so every length meets masks, GQA and dropout.
      switch (n++ % 7) {
        case 0:
          c.causal = Causal::top_left();
          break;
        case 1:
          c.H = 4, c.KV = 2, c.padding = true, c.B = 2;
          break;
        case 2:
          c.allowed = c.bias = true, c.dead_row = true;
          break;
        case 3:
          c.dropout = 0.25f, c.causal = Causal::bottom_right(), c.Tk = t + 5;
          break;
        case 4:
          c.H = 3, c.KV = 1, c.key_bias = true, c.causal = Causal::bottom_right().with_window(9);
          break;
        case 5:  // a causal offset of its own: rows up to 2 see nothing at t ≥ 6
          c.causal = Causal::with_offset(t / 3 - 2), c.Tk = t + 3;
          break;
        default:
          c.Tk = 2 * t + 1;
          break;
      }
      cs.push_back(c);
    }
  return cs;
}

// The sweep on every target the fused backward was compiled for: against the reference on 2
// threads, and bitwise the same on 1 and 3 (other work schemes where B·kv is small).
TEST(SdpaBackwardFused, MatchesReferenceOverSweeps) {
  uint64_t seed = 500;
  for (const SdpaCase& c : sweep_cases()) {
    SCOPED_TRACE(c.name);
    SdpaSetup s = make_setup(c, seed += 10);
    poison_padding(s);
    expect_fused_matches_reference_on_every_target(s, c);
  }
}

// Wide heads: a query block holds 2¹⁸ / (64 · max(d, d_v)) rows, 32 at 128 and 16 at 256, instead of
// 64. Lengths around those block edges, with a causal diagonal, padded keys and GQA, wide Q/K or
// wide V alone, on every target against the reference, and bitwise on 1 and 3 threads.
TEST(SdpaBackwardFused, WideHeadsQueryBlocksMatchReferenceOnEveryTarget) {
  for (const auto& [d, dv] : {std::pair<int64_t, int64_t>{128, 128}, {40, 256}}) {
    const int64_t rows = 262144 / (64 * std::max(d, dv));
    for (const int64_t tq : {rows - 1, rows, rows + 1, 2 * rows + 3}) {
      SdpaCase c;
      c.name = "d " + std::to_string(d) + " d_v " + std::to_string(dv) + " T_q " + std::to_string(tq);
      c.B = 2, c.H = 4, c.KV = 2, c.Tq = tq, c.Tk = 70, c.D = d, c.Dv = dv, c.padding = true;
      c.causal = Causal::bottom_right();
      SCOPED_TRACE(c.name);
      SdpaSetup s = make_setup(c, static_cast<uint64_t>(d + dv + tq));
      poison_padding(s);
      expect_fused_matches_reference_on_every_target(s, c);
    }
  }
}

// Score edits (softcap, ALiBi, a sink per head) meet every mask kind in the backward: the softcap's
// derivative, ALiBi's distances and the sink's share of each row under per-element masks, a fully
// masked row, padded keys holding NaN, a causal offset, windows and dropout; on every target
// against the reference (d sinks included), and bitwise on 1 and 3 threads.
TEST(SdpaBackwardFused, ScoreEditsUnderEveryMaskKindMatchTheReferenceOnEveryTarget) {
  std::vector<SdpaCase> cases;
  const auto add = [&](const std::string& name, const std::function<void(SdpaCase&)>& edit) {
    SdpaCase c;
    c.name = name;
    c.B = 2, c.H = 4, c.KV = 2, c.Tq = 70, c.Tk = 67, c.D = 12, c.Dv = 7, c.edits = true;
    edit(c);
    cases.push_back(c);
  };
  add("allowed, dead row", [](SdpaCase& c) { c.allowed = c.dead_row = true; });
  add("bias with -inf", [](SdpaCase& c) { c.bias = true; });
  add("key bias", [](SdpaCase& c) { c.key_bias = true; });
  add("padding", [](SdpaCase& c) { c.padding = true; });
  add("causal offset -5", [](SdpaCase& c) { c.causal = Causal::with_offset(-5); });
  add("window 13 top-left", [](SdpaCase& c) { c.causal = Causal::top_left().with_window(13); });
  add("dropout, causal", [](SdpaCase& c) { c.dropout = 0.2f, c.causal = Causal::bottom_right(); });
  add("everything", [](SdpaCase& c) {
    c.allowed = c.dead_row = c.bias = c.padding = c.key_bias = true;
    c.causal = Causal::bottom_right().with_window(20), c.dropout = 0.1f;
  });
  uint64_t seed = 1200;
  for (const SdpaCase& c : cases) {
    SCOPED_TRACE(c.name);
    SdpaSetup s = make_setup(c, seed += 10);
    poison_padding(s);
    // Scores up to the cap plus ALiBi's largest term (slope 1/4 over T_q + T_k positions): ~36.
    expect_fused_matches_reference_on_every_target(s, c, (2.0 + s.slopes[0] * static_cast<double>(c.Tq + c.Tk)) / 4);
  }
}

// Rows whose scores all carry one large common offset: a finite mask of −1e9 (or finfo.min) over a
// whole row, or a large shift. float32 lse = M + log Σ rounds to M there, and P = exp(S − lse)
// summed to T_k instead of 1 (dV 4× too large at T_k = 4, found by a sweep); the fused backward now
// renormalises such rows (|lse| ≥ 64) and matches the reference. The offset rows' Q is zero, so
// their scores are the bias exactly on both paths (S's own float32 rounding is not what is tested).
TEST(SdpaBackwardFused, RowsUnderALargeCommonOffsetMatchTheReference) {
  for (const float offset : {-1e9f, -3.0e38f, -3.0e4f, 100.0f, 2.0e9f}) {
    for (int variant = 0; variant < 4; ++variant) {
      SdpaCase c;
      c.name = "offset " + std::to_string(offset) + " variant " + std::to_string(variant);
      c.Tq = 70, c.Tk = 67, c.D = 8, c.Dv = 5, c.bias = true;
      if (variant == 1) c.B = 1, c.H = 4, c.KV = 1, c.causal = Causal::bottom_right();  // GQA: PerHead at 2 threads
      if (variant == 2) c.dropout = 0.2f, c.padding = true, c.B = 2;
      if (variant == 3) c.Tq = 130, c.Tk = 150, c.causal = Causal::top_left();
      SCOPED_TRACE(c.name);
      SdpaSetup s = make_setup(c, 900 + static_cast<uint64_t>(variant));
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.H; ++h)
          for (int64_t i = 1; i < c.Tq; i += 3) {  // every third row: zero Q, the offset on every key
            for (int64_t x = 0; x < c.D; ++x) s.q.at({b, h, i, x}) = 0.0f;
            if (b == 0)
              for (int64_t j = 0; j < c.Tk; ++j) s.bias.at({0, h, i, j}) += offset;
          }
      poison_padding(s);
      // The renormalisation (refine_lse) is vector code of its own: on every target.
      expect_fused_matches_reference_on_every_target(s, c);
    }
  }
}

// Flagged rows in some (batch, head)s only, the rest untouched: the renormalisation's zero must
// reach the others (a head without a flagged row once got −inf there and NaN gradients, whenever
// another head of the call had one: a Hugging Face key padding mask of finfo.min over one whole
// sequence of a batch). Per batch and head, and a packed batch of two sequences.
TEST(SdpaBackwardFused, RowsUnderALargeOffsetInOneHeadLeaveTheOthersExact) {
  SdpaCase c;
  c.B = 2, c.H = 3, c.KV = 3, c.Tq = 20, c.Tk = 19, c.D = 8, c.Dv = 8;
  SdpaSetup s = make_setup(c, 970);
  Tensor bias({c.B, c.H, c.Tq, c.Tk}, 0.0f);
  for (int64_t i = 0; i < c.Tq; i += 4) {  // batch 1, head 2: a few rows at −1e9 on every key
    for (int64_t x = 0; x < c.D; ++x) s.q.at({1, 2, i, x}) = 0.0f;
    for (int64_t j = 0; j < c.Tk; ++j) bias.at({1, 2, i, j}) = -1e9f;
  }
  s.opt.masks.bias.view = bias.view4();
  const SdpaGradTensors want = run_backward(s, Backend::Reference);
  for (const int threads : {1, 2, 3}) {
    const SdpaGradTensors got = run_backward(s, Backend::Fused, threads);
    expect_grads_close(got, want, c.Tk, c.Tq, std::to_string(threads) + " threads, ");
  }
  // A packed batch (each sequence its own call): in the first sequence, head 0's scores are all
  // 14² / 2 = 98 (equal Q and K rows: lse ≥ 64, renormalised), head 1's ordinary; the second
  // sequence ordinary.
  const int64_t total = 11, H = 2, D = 4;
  Tensor q = random_tensor({total, H, D}, 971), k = random_tensor({total, H, D}, 972);
  const Tensor v = random_tensor({total, H, D}, 973), d_out = random_tensor({total, H, D}, 974);
  for (int64_t t = 0; t < 5; ++t)
    for (int64_t x = 0; x < D; ++x) q.at({t, 0, x}) = k.at({t, 0, x}) = x == 0 ? 14.0f : 0.0f;
  VarlenBatch seqs;
  seqs.cu_seqlens_q = seqs.cu_seqlens_k = SeqOffsets({0, 5, total});
  const std::vector<float> sinks = {0.25f, -0.5f};
  for (const bool with_sinks : {false, true}) {
    SdpaOptions o;
    if (with_sinks) o.sinks.logits = std::span<const float>(sinks);
    o.backend = Backend::Reference;
    const SdpaResult f = sdpa_varlen(q, k, v, seqs, o, Want::Lse);
    ASSERT_GT(std::fabs(f.lse.at({0, 0})), 64.0f);
    SdpaGradTensors g[2];
    for (int which = 0; which < 2; ++which) {
      o.backend = which == 0 ? Backend::Reference : Backend::Fused;
      g[which] = sdpa_backward_varlen(q, k, v, f.out, d_out, f.lse, seqs, o);
    }
    for (const float x : g[1].dq.values()) ASSERT_TRUE(std::isfinite(x)) << "sinks " << with_sinks;
    expect_grads_close(g[1], g[0], total, total, with_sinks ? "sinks, " : "no sinks, ");
  }
}

// The same with a sink logit per head: the sink's share of the denominator, exp(z − lse), enters
// the renormalisation and d sinks.
TEST(SdpaBackwardFused, RowsUnderALargeCommonOffsetWithSinksMatchTheReference) {
  SdpaCase c;
  c.Tq = 9, c.Tk = 4, c.D = 4, c.Dv = 4, c.H = 2, c.KV = 2, c.bias = true;
  SdpaSetup s = make_setup(c, 950);
  for (int64_t h = 0; h < c.H; ++h)
    for (int64_t i = 0; i < c.Tq; i += 2) {
      for (int64_t x = 0; x < c.D; ++x) s.q.at({0, h, i, x}) = 0.0f;
      for (int64_t j = 0; j < c.Tk; ++j) s.bias.at({0, h, i, j}) = -1e9f;  // finite, every key
    }
  // Sinks near the offset rows' scores, so that their share is neither 0 nor 1.
  const std::vector<float> sinks = {-1e9f + 64.0f, -1e9f - 64.0f};
  s.opt.sinks.logits = std::span<const float>(sinks);
  std::vector<float> dsinks_ref(2), dsinks_fused(2);
  SdpaOptions opt = s.opt;
  opt.backend = Backend::Reference;
  const SdpaResult fwd = sdpa(s.q, s.k, s.v, opt, Want::Lse);
  const Tensor lse = fwd.lse.reshaped({1, c.H, c.Tq, 1});
  Tensor dq[2] = {Tensor(s.q.shape()), Tensor(s.q.shape())}, dk[2] = {Tensor(s.k.shape()), Tensor(s.k.shape())},
         dv[2] = {Tensor(s.v.shape()), Tensor(s.v.shape())};
  for (int which = 0; which < 2; ++which) {
    opt.backend = which == 0 ? Backend::Reference : Backend::Fused;
    sdpa_backward(s.q.view4(), s.k.view4(), s.v.view4(), fwd.out.view4(), s.dout.view4(), lse.view4(), opt,
                  {dq[which].view4(), dk[which].view4(), dv[which].view4(),
                   std::span<float>(which == 0 ? dsinks_ref : dsinks_fused)});
  }
  EXPECT_TRUE(fused_close(dq[1], dq[0], c.Tk)) << "dq";
  EXPECT_TRUE(fused_close(dk[1], dk[0], c.Tq)) << "dk";
  EXPECT_TRUE(fused_close(dv[1], dv[0], c.Tq)) << "dv";
  for (int h = 0; h < 2; ++h) EXPECT_NEAR(dsinks_fused[h], dsinks_ref[h], 1e-5 * (1 + std::fabs(dsinks_ref[h]))) << h;
}

/// Keys [lo, hi) of a view along `axis` (K or V rows: 2; a key mask's columns: 3), nothing copied.
template <class T>
View4<T> keys_of(View4<T> v, int axis, int64_t lo, int64_t hi) {
  if (v.data != nullptr) v.data += lo * v.stride[static_cast<size_t>(axis)];
  v.shape[static_cast<size_t>(axis)] = hi - lo;
  return v;
}

/// The backward of s in blocks of keys [cuts[n], cuts[n + 1]), as ring attention takes it: each block
/// given the whole rows' out and lse (from `fwd`), its own keys, padding and causal offset, and
/// `lse_over_more_keys`; the blocks' dQ summed in block order, their dK and dV side by side.
SdpaGradTensors backward_by_key_blocks(const SdpaSetup& s, const SdpaResult& fwd, const std::vector<int64_t>& cuts,
                                       bool lse_over_more_keys, int threads) {
  const int64_t B = s.q.size(0), H = s.q.size(1), Tq = s.q.size(2), Tk = s.k.size(2);
  SdpaGradTensors sum{Tensor(s.q.shape()), Tensor(s.k.shape()), Tensor(s.v.shape())};
  const View4<const float> lse = contiguous_view<const float>(fwd.lse.data(), B, H, Tq, int64_t{1});
  const int64_t offset = s.opt.masks.causal.enabled() ? s.opt.masks.causal.offset_for(Tq, Tk) : 0;
  for (size_t n = 0; n + 1 < cuts.size(); ++n) {
    const int64_t lo = cuts[n], hi = cuts[n + 1];
    SdpaOptions o = s.opt;
    o.backend = Backend::Fused, o.threads = threads, o.lse_over_more_keys = lse_over_more_keys;
    if (o.masks.causal.enabled()) o.masks.causal = Causal::with_offset(offset - lo);
    o.masks.key_padding.view = keys_of(o.masks.key_padding.view, 3, lo, hi);
    Tensor dq(s.q.shape()), dk({B, s.k.size(1), hi - lo, s.k.size(3)}), dv({B, s.v.size(1), hi - lo, s.v.size(3)});
    sdpa_backward(s.q.view4(), keys_of(s.k.view4(), 2, lo, hi), keys_of(s.v.view4(), 2, lo, hi), fwd.out.view4(),
                  s.dout.view4(), lse, o, {dq.view4(), dk.view4(), dv.view4(), {}});
    for (int64_t x = 0; x < dq.numel(); ++x) sum.dq.data()[x] += dq.data()[x];
    for (const auto& [part, whole] : {std::pair{&dk, &sum.dk}, std::pair{&dv, &sum.dv}})
      for (int64_t b = 0; b < B; ++b)
        for (int64_t g = 0; g < part->size(1); ++g)
          for (int64_t j = lo; j < hi; ++j)
            for (int64_t x = 0; x < part->size(3); ++x) whole->at({b, g, j, x}) = part->at({b, g, j - lo, x});
  }
  return sum;
}

// Ring attention's backward (SdpaOptions::lse_over_more_keys): each block of a row's keys gets the
// whole row's out and lse and gives that block's share of the gradients. Summed over the blocks
// (dQ) and side by side (dK, dV) the shares are the whole backward: against the reference on every
// target, for blocks that end inside a key block, a causal diagonal, padded keys, GQA and rows
// whose scores reach ~100 (|lse| ≥ 64, which the fused backward renormalises over a call's keys
// unless told they are some of the row's: then the sum is wrong); bitwise on 1 and 3 threads.
TEST(SdpaBackwardFused, KeyBlocksWithTheWholeRowsLseAddUpToTheWholeBackward) {
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "no causal mask");
    SdpaCase c;
    c.B = 2, c.H = 4, c.KV = 2, c.Tq = 70, c.Tk = 150, c.D = 8, c.Dv = 6, c.padding = true;
    if (causal) c.causal = Causal::bottom_right();
    SdpaSetup s = make_setup(c, causal ? 61 : 67);
    poison_padding(s);
    // Every third query row is 100 times the key of its own index (a key every row sees): that
    // key scores ~100·|k|²/√d ≈ 94, far above the rest.
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.Tq; i += 3)
          for (int64_t x = 0; x < c.D; ++x) s.q.at({b, h, i, x}) = 100.0f * s.k.at({b, h / 2, i, x});
    SdpaOptions opt = s.opt;
    opt.backend = Backend::Reference;
    const SdpaResult fwd = sdpa(s.q, s.k, s.v, opt, Want::Lse);
    int64_t large = 0;
    for (const float x : fwd.lse.values()) large += std::fabs(x) >= 64.0f ? 1 : 0;
    ASSERT_GT(large, 20);
    const SdpaGradTensors want = sdpa_backward(s.q, s.k, s.v, fwd.out, s.dout, fwd.lse, opt);
    const std::vector<int64_t> cuts = {0, 45, 130, c.Tk};  // 45, 85 (across a key block's edge) and 20 keys
    const int64_t rows = c.Tq * c.H / c.KV;
    testing::for_each_fused_backward_target([&] {
      const SdpaGradTensors got = backward_by_key_blocks(s, fwd, cuts, true, 2);
      expect_grads_close(got, want, c.Tk, rows);
      for (const int threads : {1, 3})
        expect_grads_bitwise(backward_by_key_blocks(s, fwd, cuts, true, threads), got,
                             std::to_string(threads) + " threads");
    });
    // Renormalised over each block alone, the large rows' probabilities sum to 1 per block.
    const SdpaGradTensors renormalised = backward_by_key_blocks(s, fwd, cuts, false, 2);
    EXPECT_FALSE(fused_close(renormalised.dv, want.dv, rows));
  }
}

// 1, 2, 3 and 5 threads, and the three work schemes they select here (an item per batch·kv-head;
// per batch·query head with the heads' dK/dV shares summed after; per key block with a second dQ
// pass), give bitwise the same gradients.
TEST(SdpaBackwardFused, BitwiseIdenticalForAnyThreadCount) {
  SdpaCase big;
  big.name = "gqa_padding_dropout_causal";
  big.B = 2, big.H = 4, big.KV = 2, big.Tq = 150, big.Tk = 170, big.D = 16, big.Dv = 8, big.padding = true;
  big.dropout = 0.1f, big.causal = Causal::bottom_right();
  SdpaCase single = big;
  single.name = "one_kv_head_masks";
  single.B = 1, single.KV = 1, single.dropout = 0, single.allowed = single.bias = true;
  single.causal = Causal::none();
  for (const SdpaCase& c : {big, single}) {
    SCOPED_TRACE(c.name);
    SdpaSetup s = make_setup(c, 77);
    poison_padding(s);
    const SdpaGradTensors one = run_backward(s, Backend::Fused, 1);
    for (int threads : {2, 3, 5})
      expect_grads_bitwise(run_backward(s, Backend::Fused, threads), one, std::to_string(threads) + " threads");
  }
}

// Every SIMD target the fused backward was compiled for (and this CPU runs), with dispatch forced
// to it, against the reference: odd sizes, block edges (kBc = 64 keys, 64 query rows at these
// head dims), GQA and every mask kind.
TEST(SdpaBackwardFused, MatchesReferenceOnEveryTarget) {
  std::vector<SdpaCase> cases;
  SdpaCase c;
  c.name = "odd_causal", c.Tq = 7, c.Tk = 9, c.D = 5, c.Dv = 3, c.causal = Causal::top_left();
  cases.push_back(c);
  c = {};
  c.name = "block_edges_window_gqa", c.H = 4, c.KV = 2, c.Tq = 64, c.Tk = 65, c.D = 8, c.Dv = 8;
  c.causal = Causal::bottom_right().with_window(9);
  cases.push_back(c);
  c = {};
  c.name = "padding", c.B = 2, c.Tq = 65, c.Tk = 63, c.D = 16, c.Dv = 12, c.padding = true;
  cases.push_back(c);
  c = {};
  c.name = "one_query_key_bias_dropout", c.Tq = 1, c.Tk = 130, c.D = 64, c.Dv = 64, c.key_bias = true;
  c.dropout = 0.2f;
  cases.push_back(c);
  c = {};
  c.name = "allowed_bias_dead_row", c.H = 3, c.KV = 1, c.Tq = 33, c.Tk = 70, c.D = 9, c.Dv = 7;
  c.allowed = c.bias = c.dead_row = true;
  cases.push_back(c);
  c = {};  // wide heads: products wider than one register tile, d not a whole number of vectors,
  // query blocks of 51 rows (not a multiple of the tile's rows)
  c.name = "wide_heads", c.H = 2, c.KV = 1, c.Tq = 70, c.Tk = 67, c.D = 80, c.Dv = 72, c.causal = Causal::top_left();
  cases.push_back(c);

  testing::for_each_fused_backward_target([&] {
    uint64_t seed = 900;
    for (const SdpaCase& k : cases) {
      SCOPED_TRACE(k.name);
      SdpaSetup s = make_setup(k, seed += 10);
      poison_padding(s);
      const SdpaGradTensors want = run_backward(s, Backend::Reference);
      const SdpaGradTensors got = run_backward(s, Backend::Fused, 2);
      expect_grads_close(got, want, k.Tk, k.Tq * k.H / k.KV);
    }
  });
}

// A block cut by the causal rule alone takes a vector cut per row; with a mask that allows every
// pair, the same block takes key_hidden per score. Both must give the same bits, on every target.
TEST(SdpaBackwardFused, CausalCutIsBitwiseTheElementwisePath) {
  const Causal kinds[] = {Causal::top_left(), Causal::bottom_right(), Causal::top_left().with_window(23),
                          Causal::bottom_right().with_window(70), Causal::with_offset(-40)};
  testing::for_each_fused_backward_target([&] {
    for (int64_t t : {1, 63, 64, 65, 130})
      for (size_t kind = 0; kind < std::size(kinds); ++kind) {
        SCOPED_TRACE(::testing::Message() << "T " << t << " causal kind " << kind);
        SdpaCase c;
        c.H = 2, c.KV = 1, c.Tq = t, c.Tk = t + 7, c.D = 16, c.Dv = 16, c.causal = kinds[kind];
        SdpaSetup s = make_setup(c, static_cast<uint64_t>(t * 10 + kind));
        const SdpaGradTensors cut = run_backward(s, Backend::Fused, 2);
        BoolTensor all({c.B, c.H, c.Tq, c.Tk}, 1);
        s.opt.masks.allowed.view = all.view4();
        const SdpaGradTensors elementwise = run_backward(s, Backend::Fused, 2);
        EXPECT_TRUE(bitwise_equal(cut.dq, elementwise.dq)) << "dq";
        EXPECT_TRUE(bitwise_equal(cut.dk, elementwise.dk)) << "dk";
        EXPECT_TRUE(bitwise_equal(cut.dv, elementwise.dv)) << "dv";
      }
  });
}

/// Every kernel scratch buffer filled with `value` while it lives (layers/sdpa_prepare.h).
struct ScratchFill {
  explicit ScratchFill(float value) { detail::fill_kernel_scratch_for_testing(value); }
  ~ScratchFill() { detail::fill_kernel_scratch_for_testing(std::nullopt); }
  ScratchFill(const ScratchFill&) = delete;
  ScratchFill& operator=(const ScratchFill&) = delete;
};

/// The forward (out, lse) and backward (dQ, dK, dV) of one case, the gradients written into
/// views of tensors that hold `grads_fill` beforehand.
std::array<Tensor, 5> forward_backward_into(const SdpaSetup& s, Backend backend, int threads, float grads_fill) {
  SdpaOptions opt = s.opt;
  opt.backend = backend;
  opt.threads = threads;
  const SdpaResult fwd = sdpa(s.q, s.k, s.v, opt, Want::Lse);
  Tensor dq(s.q.shape(), grads_fill), dk(s.k.shape(), grads_fill), dv(s.v.shape(), grads_fill);
  const View4<const float> lse =
      contiguous_view<const float>(fwd.lse.data(), s.q.size(0), s.q.size(1), s.q.size(2), int64_t{1});
  sdpa_backward(s.q.view4(), s.k.view4(), s.v.view4(), fwd.out.view4(), s.dout.view4(), lse, opt,
                {dq.view4(), dk.view4(), dv.view4(), {}});
  return {fwd.out, fwd.lse, dq, dk, dv};
}

// Workspaces and gradient buffers are never zero-filled (the module reuses its buffers across
// steps; sdpa_backward's own allocates them uninitialised): every kernel must write what it reads
// of its scratch, and every gradient element, itself. Scratch and gradient buffers full of NaN
// give the bits of zeroed ones, on both backends, over the sweep (every mask kind, GQA, dropout,
// rows that see no key, lengths 0 to 197 around the block edges) and the three work schemes. (The
// reference backward's own double-precision workspace stays a zero-filled vector: there only its
// gradients and the forward's scratch are filled.)
TEST(SdpaBackward, ReadsNoScratchOrGradientItDidNotWrite) {
  std::vector<std::pair<SdpaCase, int>> cases;
  for (const SdpaCase& c : sweep_cases()) cases.push_back({c, 2});
  SdpaCase big;
  big.name = "schemes";
  big.B = 2, big.H = 4, big.KV = 2, big.Tq = 150, big.Tk = 170, big.D = 16, big.Dv = 8, big.padding = true;
  big.dropout = 0.1f, big.causal = Causal::bottom_right();
  for (int threads : {1, 3, 5}) cases.push_back({big, threads});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  uint64_t seed = 900;
  for (const auto& [c, threads] : cases)
    for (Backend backend : {Backend::Fused, Backend::Reference}) {
      SCOPED_TRACE(c.name + (backend == Backend::Fused ? " fused, " : " reference, ") + std::to_string(threads) +
                   " threads");
      SdpaSetup s = make_setup(c, seed += 10);
      poison_padding(s);
      const std::array<Tensor, 5> clean = forward_backward_into(s, backend, threads, 0.0f);
      std::array<Tensor, 5> dirty;
      {
        const ScratchFill fill(nan);
        dirty = forward_backward_into(s, backend, threads, nan);
      }
      const char* names[] = {"out", "lse", "dq", "dk", "dv"};
      for (size_t x = 0; x < clean.size(); ++x) EXPECT_TRUE(bitwise_equal(dirty[x], clean[x])) << names[x];
    }
}

TEST(SdpaBackwardFused, PaddedKeysGetZeroGradient) {
  SdpaCase c;
  c.B = 2, c.Tq = 70, c.Tk = 80, c.D = 8, c.Dv = 8, c.padding = true;
  SdpaSetup s = make_setup(c, 9);
  poison_padding(s);
  const SdpaGradTensors g = run_backward(s, Backend::Fused, 2);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t j = 0; j < c.Tk; ++j)
      for (int64_t x = 0; x < c.D; ++x) {
        if (!s.padding.at({b, j})) continue;
        EXPECT_EQ(g.dk.at({b, 0, j, x}), 0.0f);
        EXPECT_EQ(g.dv.at({b, 0, j, x}), 0.0f);
      }
  for (float x : g.dq.values()) ASSERT_TRUE(std::isfinite(x));
}

TEST(SdpaBackwardFused, StridedInnerDimensionFallsBackToReference) {
  const Tensor q = random_tensor({1, 1, 4, 6}, 1), k = random_tensor({1, 1, 5, 6}, 2);
  // Every other column of q/k as a view: inner stride 2.
  const View4<const float> qs{q.data(), {1, 1, 4, 3}, {24, 24, 6, 2}}, ks{k.data(), {1, 1, 5, 3}, {30, 30, 6, 2}};
  EXPECT_NE(sdpa_backward_dispatch_reason(qs, ks, ks, {}).find("reference"), std::string::npos);
  EXPECT_EQ(sdpa_backward_dispatch_reason(q.view4(), k.view4(), k.view4(), {}), "fused: supported");
}

/// x (B, h, T, d) laid out as (B, T, h, d) in `storage`, viewed as (B, h, T, d): rows h·d apart,
/// as in a module's projection buffer or a transposed PyTorch tensor.
View4<float> interleaved_heads(const Tensor& x, std::vector<float>& storage) {
  const auto& sh = x.shape();
  const int64_t B = sh[0], H = sh[1], T = sh[2], D = sh[3];
  storage.assign(static_cast<size_t>(x.numel()), std::numeric_limits<float>::quiet_NaN());
  View4<float> view{storage.data(), {B, H, T, D}, {T * H * D, D, H * D, 1}};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < D; ++e) view(b, h, t, e) = x.at({b, h, t, e});
  return view;
}

bool same_bits(View4<float> got, const Tensor& want) {
  for (int64_t b = 0; b < got.shape[0]; ++b)
    for (int64_t h = 0; h < got.shape[1]; ++h)
      for (int64_t t = 0; t < got.shape[2]; ++t)
        for (int64_t e = 0; e < got.shape[3]; ++e) {
          const float x = got(b, h, t, e), y = want.at({b, h, t, e});
          if (std::memcmp(&x, &y, sizeof(float)) != 0) return false;
        }
  return true;
}

// The fused backward copies Q, dO and K rows that are not dense (a few KiB apart, they thrash a
// handful of cache sets) before its products, Q and dO once per call, and accumulates a strided
// dQ in dense rows that it copies out at the end: the gradients must keep the contiguous call's
// bits, for whole-vector and padded head dims, causal and masked blocks, with the outputs strided
// too, in the three work schemes (at B=2, h=4, kv=2: 1 thread an item per
// (batch, kv-head), 3 threads per (batch, query head), 5 threads per key block and then dQ per
// query block).
TEST(SdpaBackwardFused, InterleavedHeadRowsGiveTheBitsOfContiguousOnes) {
  for (int64_t d : {64, 24})
    for (bool causal : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "d " << d << (causal ? " causal" : ""));
      SdpaCase c;
      c.B = 2, c.H = 4, c.KV = 2, c.Tq = 150, c.Tk = 130, c.D = d, c.Dv = d;
      c.padding = !causal;
      if (causal) c.causal = Causal::bottom_right();
      SdpaSetup s = make_setup(c, 900 + static_cast<uint64_t>(d));
      SdpaOptions opt = s.opt;
      opt.backend = Backend::Fused;
      const SdpaResult fwd = sdpa(s.q, s.k, s.v, opt, Want::Lse);
      std::vector<float> q, k, v, o, dout, dq, dk, dv;
      const View4<float> qv = interleaved_heads(s.q, q), kv = interleaved_heads(s.k, k), vv = interleaved_heads(s.v, v);
      const View4<float> ov = interleaved_heads(fwd.out, o), dov = interleaved_heads(s.dout, dout);
      // The dense copies and their vector products on every target.
      testing::for_each_fused_backward_target([&] {
        opt.threads = 2;
        const SdpaGradTensors want = sdpa_backward(s.q, s.k, s.v, fwd.out, s.dout, fwd.lse, opt);
        const SdpaGrads grads{
            interleaved_heads(want.dq, dq), interleaved_heads(want.dk, dk), interleaved_heads(want.dv, dv), {}};
        for (int threads : {1, 3, 5}) {
          SCOPED_TRACE(::testing::Message() << threads << " threads");
          opt.threads = threads;
          for (std::vector<float>* g : {&dq, &dk, &dv})
            std::fill(g->begin(), g->end(), std::numeric_limits<float>::quiet_NaN());  // every row written
          sdpa_backward(View4<const float>(qv), View4<const float>(kv), View4<const float>(vv), View4<const float>(ov),
                        View4<const float>(dov),
                        View4<const float>{fwd.lse.data(), {c.B, c.H, c.Tq, 1}, {c.H * c.Tq, c.Tq, 1, 1}}, opt, grads);
          EXPECT_TRUE(same_bits(grads.dq, want.dq)) << "dq";
          EXPECT_TRUE(same_bits(grads.dk, want.dk)) << "dk";
          EXPECT_TRUE(same_bits(grads.dv, want.dv)) << "dv";
        }
      });
    }
}

TEST(BackwardFused, WorkspacesComeBackToTheTensorCache) {
  // The forward's prepacked K/V (4.5 MiB here: 1024 queries, 4 heads of 2176 keys, d = 64) and,
  // with Q and dO rows apart as in a module's projection buffers, the backward's dense copies of
  // them (4 MiB at T = 1024, h = 8, d = 64) go back to the cache of freed blocks after each call,
  // and the next call of that shape takes them again (holding what the last call left there),
  // with the same bits.
  const size_t limit_before = tensor_cache_limit();
  release_cached_tensors();
  set_tensor_cache_limit(size_t{256} << 20);
  SdpaOptions opt;
  opt.backend = Backend::Fused;
  opt.masks.causal = Causal::bottom_right();
  {
    const Tensor q = random_tensor({1, 4, 1024, 64}, 15), k = random_tensor({1, 4, 2176, 64}, 16),
                 v = random_tensor({1, 4, 2176, 64}, 17);
    const SdpaResult first = sdpa(q, k, v, opt, Want::Lse);
    const size_t after_forward = cached_tensor_bytes();
    EXPECT_GE(after_forward, size_t{4} << 20);
    const SdpaResult again = sdpa(q, k, v, opt, Want::Lse);
    EXPECT_EQ(cached_tensor_bytes(), after_forward);
    EXPECT_TRUE(bitwise_equal(again.out, first.out));
    EXPECT_TRUE(bitwise_equal(again.lse, first.lse));
  }
  opt.masks.causal = Causal::top_left();
  const Tensor q = random_tensor({1, 8, 1024, 64}, 11), k = random_tensor({1, 8, 1024, 64}, 12),
               v = random_tensor({1, 8, 1024, 64}, 13), d_out = random_tensor({1, 8, 1024, 64}, 14);
  const SdpaResult first = sdpa(q, k, v, opt, Want::Lse);
  const size_t after_forward = cached_tensor_bytes();
  std::vector<float> qs, ks, vs, os, dos, dq, dk, dv;
  const View4<float> qv = interleaved_heads(q, qs), kv = interleaved_heads(k, ks), vv = interleaved_heads(v, vs);
  const View4<float> ov = interleaved_heads(first.out, os), dov = interleaved_heads(d_out, dos);
  const View4<const float> lse{first.lse.data(), {1, 8, 1024, 1}, {8 * 1024, 1024, 1, 1}};
  const SdpaGradTensors want = sdpa_backward(q, k, v, first.out, d_out, first.lse, opt);
  const SdpaGrads grads{
      interleaved_heads(want.dq, dq), interleaved_heads(want.dk, dk), interleaved_heads(want.dv, dv), {}};
  size_t after_backward = 0;
  for (int round = 0; round < 2; ++round) {
    sdpa_backward(View4<const float>(qv), View4<const float>(kv), View4<const float>(vv), View4<const float>(ov),
                  View4<const float>(dov), lse, opt, grads);
    if (round == 0) {
      after_backward = cached_tensor_bytes();
      EXPECT_GE(after_backward, after_forward + (size_t{4} << 20));
    }
    EXPECT_EQ(cached_tensor_bytes(), after_backward);
    EXPECT_TRUE(same_bits(grads.dq, want.dq)) << "dq";
    EXPECT_TRUE(same_bits(grads.dk, want.dk)) << "dk";
    EXPECT_TRUE(same_bits(grads.dv, want.dv)) << "dv";
  }
  release_cached_tensors();
  set_tensor_cache_limit(limit_before);
}

// ---- PyTorch autograd goldens ----------------------------------------------------------------------

std::vector<std::string> golden_files(const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(std::string(MHA_GOLDEN_DIR) + "/grad"))
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

/// float32 arithmetic against a float64 truth: the forward goldens' tolerance (2e-5 + 2e-4·|x|),
/// scaled by the gradient's magnitude, since a gradient is a sum of many such products.
::testing::AssertionResult grad_close(const Tensor& got, const Tensor& want) {
  double biggest = 0;
  for (float x : want.values()) biggest = std::max(biggest, std::fabs(double(x)));
  return all_close(got, want, 2e-5 * std::max(1.0, biggest), 2e-4);
}

Causal causal_from(const std::string& s) {
  if (s == "top_left") return Causal::top_left();
  if (s == "bottom_right") return Causal::bottom_right();
  return Causal::none();
}

TEST(SdpaBackwardGolden, MatchesPyTorchAutograd) {
  const auto files = golden_files("sdpa_");
  ASSERT_GE(files.size(), 10u);
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    const io::SafetensorsFile f = io::SafetensorsFile::open(path);
    const Tensor q = f.read_f32("q"), k = f.read_f32("k"), v = f.read_f32("v"), dout = f.read_f32("d_out");
    SdpaOptions opt;
    opt.masks.causal = causal_from(f.metadata().at("causal"));
    if (f.metadata().count("scale")) opt.scale = std::stof(f.metadata().at("scale"));
    BoolTensor allowed;
    Tensor bias;
    if (f.contains("allowed")) {
      allowed = f.read_bool("allowed");
      opt.masks.allowed.view = allowed.view4();
    }
    if (f.contains("bias")) {
      bias = f.read_f32("bias");
      opt.masks.bias.view = bias.view4();
    }
    for (Backend backend : {Backend::Reference, Backend::Auto}) {
      opt.backend = backend;
      const SdpaResult fwd = sdpa(q, k, v, opt, Want::Lse);
      const SdpaGradTensors g = sdpa_backward(q, k, v, fwd.out, dout, fwd.lse, opt);
      EXPECT_TRUE(grad_close(g.dq, f.read_f32("grad.q"))) << "dq";
      EXPECT_TRUE(grad_close(g.dk, f.read_f32("grad.k"))) << "dk";
      EXPECT_TRUE(grad_close(g.dv, f.read_f32("grad.v"))) << "dv";
    }
  }
}

/// A module golden case: the module, its inputs and forward options.
struct ModuleCase {
  MultiheadAttention module;
  Tensor query, key, value, d_output;
  bool self_attention = false;
  MhaForwardOptions options;
};

ModuleCase load_module_case(const io::SafetensorsFile& f) {
  ModuleCase c{io::load_module(f),
               f.read_f32("query"),
               f.read_f32("key"),
               f.read_f32("value"),
               f.read_f32("d_output"),
               false,
               {}};
  c.self_attention = c.query.storage() == c.key.storage() && c.key.storage() == c.value.storage() &&
                     c.query.shape() == c.key.shape() && c.key.shape() == c.value.shape();
  if (f.contains("attn_mask")) {
    c.options.attn_mask = f.info("attn_mask").dtype == io::DType::BOOL
                              ? AttnMask::from_torch_bool(f.read_bool("attn_mask"))
                              : AttnMask::add(f.read_f32("attn_mask"));
  }
  if (f.contains("key_padding_mask")) {
    if (f.info("key_padding_mask").dtype == io::DType::BOOL)
      c.options.key_padding_mask.is_padding = f.read_bool("key_padding_mask");
    else
      c.options.key_padding_mask.additive = f.read_f32("key_padding_mask");
  }
  if (f.metadata().at("is_causal") == "true") c.options.causal = Causal::top_left();
  return c;
}

std::vector<std::pair<std::string, const Tensor*>> named_grads(const MhaGradients& g) {
  std::vector<std::pair<std::string, const Tensor*>> named = {
      {"query", &g.query}, {"key", &g.key}, {"value", &g.value}};
  for (const auto& entry : mha::testing::named_parameters(g.params)) named.push_back(entry);
  return named;
}

TEST(ModuleBackwardGolden, MatchesPyTorchAutograd) {
  const auto files = golden_files("module_");
  ASSERT_GE(files.size(), 20u);
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    const io::SafetensorsFile f = io::SafetensorsFile::open(path);
    ModuleCase c = load_module_case(f);
    for (Backend backend : {Backend::Reference, Backend::Auto}) {
      c.options.backend = backend;
      const Tensor& key = c.self_attention ? c.query : c.key;  // the same object: the packed path
      const Tensor& value = c.self_attention ? c.query : c.value;
      MhaTrainOutput fwd = forward_train(c.module, c.query, key, value, c.options);
      EXPECT_TRUE(all_close(fwd.output, f.read_f32("expected.output"), 2e-5, 2e-4));
      const MhaGradients g = backward(c.module, fwd.context, c.d_output);
      int checked = 0;
      for (const auto& [name, got] : named_grads(g)) {
        const bool expected = f.contains("grad." + name);
        EXPECT_EQ(got->defined(), expected) << name;
        if (!expected || !got->defined()) continue;
        EXPECT_TRUE(grad_close(*got, f.read_f32("grad." + name))) << name;
        ++checked;
      }
      EXPECT_GE(checked, 5);
    }
  }
}

// ---- module: training forward = forward; finite differences for what goldens cannot cover -----------

struct ModuleFdCase {
  std::string name;
  MhaConfig config;
  int64_t B = 2, Tq = 4, Tk = 5;  // B = 0: unbatched
  Causal causal;
  bool padding = false, mask = false, self = false;
};

Tensor make_input(const MhaConfig& c, int64_t B, int64_t T, int64_t F, uint64_t seed) {
  if (B == 0) return random_tensor({T, F}, seed);
  return c.layout == Layout::BatchFirst ? random_tensor({B, T, F}, seed) : random_tensor({T, B, F}, seed);
}

MhaConfig config(int64_t E, int64_t h) {
  MhaConfig c;
  c.embed_dim = E, c.num_heads = h;
  return c;
}

TEST(ModuleBackward, TrainingForwardEqualsForward) {
  MhaConfig cfg = config(8, 2);
  cfg.add_bias_kv = cfg.add_zero_attn = true, cfg.dropout = 0.25f;
  const MultiheadAttention m(cfg, 3);
  const Tensor x = make_input(cfg, 2, 5, 8, 1);
  for (Mode mode : {Mode::Eval, Mode::Training}) {
    MhaForwardOptions o;
    o.mode = mode, o.dropout_seed = 42, o.causal = Causal::top_left();
    const MhaTrainOutput t = forward_train(m, x, x, x, o);
    EXPECT_TRUE(all_close(t.output, m.forward(x, x, x, o).output, 1e-6, 1e-6));
  }
}

std::vector<ModuleFdCase> module_fd_cases() {
  std::vector<ModuleFdCase> cases;
  auto add = [&](std::string name, MhaConfig cfg, auto&& edit) {
    ModuleFdCase c;
    c.name = std::move(name);
    c.config = cfg;
    edit(c);
    cases.push_back(c);
  };
  add("dropout_seq_first", config(8, 2), [](ModuleFdCase& c) { c.config.dropout = 0.3f; });
  add("dropout_gqa_bias_kv_zero_attn_causal", config(8, 4), [](ModuleFdCase& c) {
    c.config.num_kv_heads = 2, c.config.add_bias_kv = c.config.add_zero_attn = true, c.config.dropout = 0.2f;
    c.config.layout = Layout::BatchFirst, c.causal = Causal::bottom_right(), c.Tq = 3;
  });
  add("kdim_vdim_padding_mask_unbatched", config(6, 3),
      [](ModuleFdCase& c) { c.config.kdim = 4, c.config.vdim = 5, c.B = 0, c.padding = c.mask = true; });
  add("causal_window_bias_kv", config(8, 2), [](ModuleFdCase& c) {
    c.config.add_bias_kv = true, c.causal = Causal::bottom_right().with_window(2), c.Tq = 4, c.Tk = 6;
  });
  add("self_attention_packed_dropout", config(8, 2),
      [](ModuleFdCase& c) { c.config.dropout = 0.2f, c.Tk = c.Tq, c.self = true; });
  add("rope_half_split_gqa_causal", config(8, 2), [](ModuleFdCase& c) {
    c.config.num_kv_heads = 1, c.config.rope = Rope::half_split(100.0), c.causal = Causal::top_left(), c.Tk = c.Tq;
  });
  add("rope_interleaved_partial_bias_kv", config(16, 2),
      [](ModuleFdCase& c) { c.config.rope = Rope::interleaved(50.0, 4), c.config.add_bias_kv = true; });
  return cases;
}

// Every parameter tensor of `p` (a module's parameters or their gradients), in one fixed order.
template <class Params>
auto parameter_tensors(Params& p) {
  return std::array{&p.in_proj_weight, &p.q_proj_weight, &p.k_proj_weight,   &p.v_proj_weight, &p.in_proj_bias,
                    &p.bias_k,         &p.bias_v,        &p.out_proj_weight, &p.out_proj_bias, &p.sinks};
}

// Central differences of the float forward, on a few entries of every gradient. Error bound: the
// loss L = Σ out·G carries ≈ ε·Σ|out·G| of rounding, divided by 2h; plus the h² term (O(1) inputs,
// bounded generously by 2e-3 relative).
TEST(ModuleBackward, MatchesFiniteDifferences) {
  for (const ModuleFdCase& c : module_fd_cases()) {
    SCOPED_TRACE(c.name);
    MultiheadAttention m(c.config, 7);
    for (float& x : m.params().in_proj_bias.values()) x = 0.05f;  // nonzero biases
    const int64_t E = c.config.embed_dim;
    Tensor query = make_input(c.config, c.B, c.Tq, E, 11);
    Tensor key = make_input(c.config, c.B, c.Tk, c.config.key_dim(), 12);
    Tensor value = make_input(c.config, c.B, c.Tk, c.config.value_dim(), 13);
    MhaForwardOptions o;
    o.mode = Mode::Training, o.dropout_seed = 5, o.causal = c.causal, o.backend = Backend::Reference;
    if (c.padding) {
      o.key_padding_mask.is_padding = c.B == 0 ? BoolTensor({c.Tk}, 0) : BoolTensor({c.B, c.Tk}, 0);
      o.key_padding_mask.is_padding.data()[c.Tk - 1] = 1;
    }
    if (c.mask) o.attn_mask = AttnMask::add(random_tensor({c.Tq, c.Tk}, 14));
    const Tensor G = random_tensor(query.shape(), 15);
    auto run = [&]() {
      return c.self ? forward_train(m, query, query, query, o) : forward_train(m, query, key, value, o);
    };
    MhaTrainOutput fwd = run();
    const MhaGradients g = backward(m, fwd.context, G);
    auto loss = [&]() {
      const Tensor out = run().output;
      double l = 0, mag = 0;
      for (int64_t x = 0; x < out.numel(); ++x) {
        l += double(out.data()[x]) * G.data()[x];
        mag += std::fabs(double(out.data()[x]) * G.data()[x]);
      }
      return std::pair{l, mag};
    };
    const float h = 1e-2f;
    auto check = [&](Tensor& x, const Tensor& grad, const std::string& name, const Tensor* also = nullptr,
                     const Tensor* also2 = nullptr) {
      ASSERT_EQ(grad.shape(), x.shape()) << name;
      for (int64_t e = 0; e < x.numel(); e += std::max<int64_t>(1, x.numel() / 7)) {
        const float keep = x.data()[e];
        x.data()[e] = keep + h;
        const auto [up, mag] = loss();
        x.data()[e] = keep - h;
        const auto [down, mag2] = loss();
        x.data()[e] = keep;
        const double fd = (up - down) / (2.0 * h);
        double analytic = grad.data()[e];
        if (also) analytic += also->data()[e];
        if (also2) analytic += also2->data()[e];
        const double tol = 16 * kEpsF32 * std::max(mag, mag2) / h + 2e-3 * (1 + std::fabs(fd));
        EXPECT_NEAR(analytic, fd, tol) << name << "[" << e << "]";
      }
    };
    if (c.self) {
      // One tensor fed three times: its gradient is the sum of the three per-argument ones.
      check(query, g.query, "query+key+value", &g.key, &g.value);
    } else {
      check(query, g.query, "query");
      check(key, g.key, "key");
      check(value, g.value, "value");
    }
    const auto params = parameter_tensors(m.params());
    const auto grads = parameter_tensors(g.params);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i]->defined(), grads[i]->defined()) << "parameter " << i;
      if (params[i]->defined()) check(*params[i], *grads[i], "parameter " + std::to_string(i));
    }
  }
}

// Every gradient of `got` bitwise equal to `want`'s (the same shapes, the same parameters present).
void expect_same_gradients(const MhaGradients& got, const MhaGradients& want) {
  EXPECT_TRUE(bitwise_equal(got.query, want.query)) << "query";
  EXPECT_TRUE(bitwise_equal(got.key, want.key)) << "key";
  EXPECT_TRUE(bitwise_equal(got.value, want.value)) << "value";
  const auto g = parameter_tensors(got.params), w = parameter_tensors(want.params);
  for (size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(bitwise_equal(*g[i], *w[i])) << "parameter " << i;
}

// A padded key enters no product, forward or backward (SEMANTICS 5): NaN or inf in its rows of the
// key and value inputs reaches no output and no gradient — the projection weights' included, where
// dW_K = dKᵀ · key would otherwise multiply its zero dK row by the NaN. Boolean and −inf float key
// padding, the packed in_proj weight (kdim = vdim = E) and separate k/v weights, both layouts,
// with bias_k / zero attention positions after the real keys: the step's every result is the one
// it gives with finite values there, bit for bit.
TEST(ModuleBackward, PaddedKeyRowsHoldingNaNReachNoGradient) {
  for (const bool separate : {false, true})
    for (const bool float_mask : {false, true})
      for (const Layout layout : {Layout::SeqFirst, Layout::BatchFirst}) {
        SCOPED_TRACE(std::string(separate ? "kdim/vdim" : "in_proj") + (float_mask ? ", float" : ", bool") +
                     (layout == Layout::BatchFirst ? ", batch first" : ", seq first"));
        MhaConfig cfg = config(8, 2);
        cfg.layout = layout, cfg.add_bias_kv = cfg.add_zero_attn = float_mask;
        if (separate) cfg.kdim = 6, cfg.vdim = 5;
        const MultiheadAttention m(cfg, 3);
        const int64_t B = 2, Tq = 3, Tk = 5;
        const Tensor query = make_input(cfg, B, Tq, 8, 21);
        const Tensor key = make_input(cfg, B, Tk, cfg.key_dim(), 22),
                     value = make_input(cfg, B, Tk, cfg.value_dim(), 23);
        MhaForwardOptions o;
        o.mode = Mode::Training, o.dropout_seed = 9;
        // Sequence 1's keys 3 and 4 are padding.
        const auto padded = [&](int64_t b, int64_t t) { return b == 1 && t >= 3; };
        if (float_mask) {
          o.key_padding_mask.additive = Tensor({B, Tk}, 0.25f);
          for (int64_t t = 0; t < Tk; ++t)
            if (padded(1, t)) o.key_padding_mask.additive.at({1, t}) = -std::numeric_limits<float>::infinity();
        } else {
          o.key_padding_mask.is_padding = BoolTensor({B, Tk}, 0);
          for (int64_t t = 0; t < Tk; ++t) o.key_padding_mask.is_padding.at({1, t}) = padded(1, t) ? 1 : 0;
        }
        Tensor bad_key = key, bad_value = value;
        for (Tensor* x : {&bad_key, &bad_value})
          for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < Tk; ++t)
              if (padded(b, t))
                for (int64_t c = 0; c < x->shape().back(); ++c)
                  (layout == Layout::BatchFirst ? x->at({b, t, c}) : x->at({t, b, c})) =
                      c % 2 ? std::numeric_limits<float>::infinity() : std::nanf("");
        const Tensor G = random_tensor(query.shape(), 24);
        const MhaTrainOutput good = forward_train(m, query, key, value, o);
        const MhaTrainOutput bad = forward_train(m, query, bad_key, bad_value, o);
        EXPECT_TRUE(bitwise_equal(bad.output, good.output));
        const MhaGradients g = backward(m, bad.context, G);
        expect_same_gradients(g, backward(m, good.context, G));
        for (const Tensor* t : parameter_tensors(g.params))
          for (const float x : t->values()) ASSERT_TRUE(std::isfinite(x));
      }
}

// A query row that sees no key (SEMANTICS 4: output 0, gradient 0) gives nothing to any gradient
// either: NaN or inf in its query input row must not reach dW_Q through dW_Q = dQᵀ · query and its
// zero dQ row (0 · NaN). Cross-attention with the packed in_proj weight and with separate q/k/v
// weights (kdim/vdim), and self-attention's one packed block, where the row is also a padded key
// (else its NaN reaches the other queries through K and V); a boolean attn_mask, (T_q, T_k) or per
// head; both layouts, 1–3 threads: every result is the one the step gives with finite values
// there, bit for bit. (A −inf float mask row is no such row: NaN + −inf is a NaN score, and the
// row's output is NaN on every path, as in PyTorch.)
TEST(ModuleBackward, QueryRowThatSawNoKeyHoldingNaNReachesNoGradient) {
  enum class Kind { InProj, Separate, SelfAttention };
  for (const Kind kind : {Kind::InProj, Kind::Separate, Kind::SelfAttention})
    for (const bool per_head : {false, true})
      for (const Layout layout : {Layout::SeqFirst, Layout::BatchFirst})
        for (const int threads : {1, 2, 3}) {
          SCOPED_TRACE(std::string(kind == Kind::InProj     ? "in_proj"
                                   : kind == Kind::Separate ? "kdim/vdim"
                                                            : "self") +
                       (per_head ? ", per-head mask" : "") + (layout == Layout::BatchFirst ? ", batch first" : "") +
                       ", " + std::to_string(threads) + " threads");
          MhaConfig cfg = config(8, 2);
          cfg.layout = layout;
          if (kind == Kind::Separate) cfg.kdim = 6, cfg.vdim = 5;
          const MultiheadAttention m(cfg, 3);
          const bool self = kind == Kind::SelfAttention;
          const int64_t B = 2, Tq = 4, Tk = self ? Tq : 5;
          const Tensor query = make_input(cfg, B, Tq, 8, 31);
          const Tensor key = self ? query : make_input(cfg, B, Tk, cfg.key_dim(), 32);
          const Tensor value = self ? query : make_input(cfg, B, Tk, cfg.value_dim(), 33);
          MhaForwardOptions o;
          o.mode = Mode::Training, o.dropout_seed = 9, o.threads = threads;
          // Query 2 sees no key: its row of the (T_q, T_k) mask hides every one.
          // Per head: a (B·h, T_q, T_k) mask that hides them from that query of sequence 1 in every head.
          BoolTensor allowed = per_head ? BoolTensor({B * 2, Tq, Tk}, 1) : BoolTensor({Tq, Tk}, 1);
          for (int64_t j = 0; j < Tk; ++j)
            if (per_head)
              allowed.at({2, 2, j}) = allowed.at({3, 2, j}) = 0;
            else
              allowed.at({2, j}) = 0;
          o.attn_mask.allowed = allowed;
          if (self) {  // position 2 of sequence 1 is padding too
            o.key_padding_mask.is_padding = BoolTensor({B, Tk}, 0);
            o.key_padding_mask.is_padding.at({1, 2}) = 1;
          }
          Tensor bad_query = query;
          for (int64_t c = 0; c < 8; ++c)
            (layout == Layout::BatchFirst ? bad_query.at({1, 2, c}) : bad_query.at({2, 1, c})) =
                c % 2 ? std::numeric_limits<float>::infinity() : std::nanf("");
          const Tensor& bad_key = self ? bad_query : key;
          const Tensor& bad_value = self ? bad_query : value;
          const Tensor G = random_tensor(query.shape(), 34);
          const MhaTrainOutput good = forward_train(m, query, key, value, o);
          const MhaTrainOutput bad = forward_train(m, bad_query, bad_key, bad_value, o);
          EXPECT_TRUE(bitwise_equal(bad.output, good.output));
          const MhaGradients g = backward(m, bad.context, G);
          const MhaGradients want = backward(m, good.context, G);
          for (const Tensor* t : parameter_tensors(g.params))
            for (const float x : t->values()) ASSERT_TRUE(std::isfinite(x));
          // The input gradients' other rows and every parameter's, bit for bit; the bad row's own
          // input gradient is dQ · W_Q = 0 (self-attention: also its zero dK and dV rows).
          expect_same_gradients(g, want);
        }
}

// One training step's shapes: self-attention (one packed GEMM) or cross-attention (three).
struct TrainStep {
  Shape q, kv;
  bool causal;
};

struct TrainInputs {
  Tensor q, k, v;
  MhaForwardOptions options;
  TrainInputs(const TrainStep& step, uint64_t seed) : q(random_tensor(step.q, seed)) {
    const bool self = step.q == step.kv;
    k = self ? q : random_tensor(step.kv, seed + 1);
    v = self ? q : random_tensor(step.kv, seed + 2);
    options.mode = Mode::Training, options.dropout_seed = seed;
    if (step.causal) options.causal = Causal::top_left();
  }
  // A training step of `m` (its workspace as it is) on these inputs.
  MhaGradients run(const MultiheadAttention& m, const Tensor& d_out) const {
    const MhaTrainOutput t = forward_train(m, q, k, v, options);
    return backward(m, t.context, d_out);
  }
};

MhaConfig workspace_config() {
  MhaConfig c = config(32, 4);
  c.num_kv_heads = 2, c.dropout = 0.1f, c.add_bias_kv = true, c.layout = Layout::BatchFirst;
  return c;
}

// The training step borrows its projections and heads from the module's workspace and gives them
// back: consecutive steps of different shapes on one module (reusing larger buffers that hold the
// previous step's values) give bitwise the gradients of a fresh module.
TEST(ModuleBackward, ConsecutiveStepsOnOneModuleMatchFreshModules) {
  const MultiheadAttention m(workspace_config(), 31);
  const TrainStep steps[] = {
      {{4, 50, 32}, {4, 50, 32}, false},  // self-attention, packed GEMM
      {{2, 9, 32}, {2, 9, 32}, true},     // smaller: reuses
      {{3, 20, 32}, {3, 61, 32}, false},  // cross-attention, 3 GEMMs
      {{6, 70, 32}, {6, 70, 32}, true},   // larger: grows
      {{5, 32}, {7, 32}, false},          // unbatched
      {{1, 1, 32}, {1, 1, 32}, false},    // one token
      {{1, 0, 32}, {1, 5, 32}, false},    // empty query
      {{4, 50, 32}, {4, 50, 32}, false},  // the first again
  };
  uint64_t seed = 40;
  for (int round = 0; round < 2; ++round)
    for (const TrainStep& step : steps) {
      SCOPED_TRACE(::testing::Message() << "round " << round << ", query " << shape_str(step.q));
      const TrainInputs in(step, seed += 3);
      const Tensor d_out = random_tensor(step.q, seed + 100);
      const MultiheadAttention fresh = m;  // a copy starts with an empty workspace
      expect_same_gradients(in.run(m, d_out), in.run(fresh, d_out));
      EXPECT_LE(m.workspace_pool()->free_buffers(), size_t{8});
    }
  EXPECT_GT(m.workspace_pool()->free_buffers(), size_t{0});  // the steps gave their buffers back
  m.release_workspace();
  EXPECT_EQ(m.workspace_pool()->free_buffers(), size_t{0});
}

// Contexts alive at the same time hold buffers of their own: two forwards, then both backwards
// (in either order), each give the gradients of a step run alone; a context may outlive its module.
TEST(ModuleBackward, ContextsAliveAtOnceKeepTheirOwnBuffers) {
  const MhaConfig cfg = workspace_config();
  const TrainInputs a({{3, 20, 32}, {3, 20, 32}, true}, 7), b({{2, 13, 32}, {2, 17, 32}, false}, 70);
  const Tensor da = random_tensor(a.q.shape(), 8), db = random_tensor(b.q.shape(), 9);
  const MultiheadAttention fresh(cfg, 5);
  const MhaGradients want_a = a.run(MultiheadAttention(fresh), da);
  const MhaGradients want_b = b.run(MultiheadAttention(fresh), db);
  for (bool a_first : {true, false}) {
    SCOPED_TRACE(a_first ? "backward a, then b" : "backward b, then a");
    auto m = std::make_unique<MultiheadAttention>(fresh);
    const MhaTrainOutput ta = forward_train(*m, a.q, a.k, a.v, a.options);
    const MhaTrainOutput tb = forward_train(*m, b.q, b.k, b.v, b.options);
    EXPECT_NE(ta.context.qkv.data(), tb.context.qkv.data());
    EXPECT_NE(ta.context.heads.data(), tb.context.heads.data());
    if (a_first) {
      expect_same_gradients(backward(*m, ta.context, da), want_a);
      expect_same_gradients(backward(*m, tb.context, db), want_b);
    } else {
      expect_same_gradients(backward(*m, tb.context, db), want_b);
      expect_same_gradients(backward(*m, ta.context, da), want_a);
    }
    m.reset();  // the contexts outlive the module: their buffers stay valid until they go
  }
}

// Training steps on one module from several threads at once, each with its own inputs, give the
// gradients of a fresh module (the workspace hands each call its own buffers).
TEST(ModuleBackward, ConcurrentStepsOnOneModuleMatchFreshModules) {
  const MultiheadAttention m(workspace_config(), 11);
  constexpr int kThreads = 3, kSteps = 4;
  std::vector<std::vector<MhaGradients>> got(kThreads);
  std::vector<TrainInputs> inputs;
  std::vector<Tensor> d_outs;
  for (int t = 0; t < kThreads; ++t) {
    const int64_t T = 5 + 7 * t;
    inputs.emplace_back(TrainStep{{2, T, 32}, {2, T + (t % 2), 32}, t == 1}, 200 + 10 * t);
    d_outs.push_back(random_tensor({2, T, 32}, 300 + t));
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int s = 0; s < kSteps; ++s) got[t].push_back(inputs[t].run(m, d_outs[t]));
    });
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    const MhaGradients want = inputs[t].run(MultiheadAttention(m), d_outs[t]);
    for (const MhaGradients& g : got[t]) expect_same_gradients(g, want);
  }
}

TEST(ModuleBackward, RejectsMismatches) {
  const MultiheadAttention m(config(8, 2), 1);
  const Tensor x = random_tensor({3, 2, 8}, 1);
  MhaTrainOutput t = forward_train(m, x, x, x);
  EXPECT_THROW(backward(m, t.context, random_tensor({3, 2, 7}, 2)), Error);
  const MultiheadAttention other(config(8, 4), 1);
  EXPECT_THROW(backward(other, t.context, x), Error);
  EXPECT_THROW(backward(m, MhaContext{}, x), Error);
  MhaForwardOptions o;
  o.need_weights = NeedWeights::PerHead;
  EXPECT_THROW(forward_train(m, x, x, x, o), Error);
  EXPECT_THROW(forward_train(m, x, random_tensor({3, 3, 8}, 3), x), Error);
}

}  // namespace
}  // namespace mha
