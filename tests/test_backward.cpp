// Gradients: the SDPA backward (reference and fused) and the module backward, checked against
// finite differences in double, PyTorch autograd goldens, and each other.
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/attention_backward.h"
#include "kernels/dropout_rng.h"
#include "mha/safetensors.h"
#include "mha/training.h"
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
  float dropout = 0.0f;
  std::optional<float> scale;
};

struct SdpaSetup {
  Tensor q, k, v, dout;
  BoolTensor allowed, padding;
  Tensor bias, key_bias;
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
  return s;
}

/// Padded K/V rows get NaN: the backward must never read them (SEMANTICS 5).
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

/// The forward in double from double inputs (an independent check, written from SEMANTICS.md):
/// L = Σ out · dout. Masks come from the same key_hidden()/additive_terms() definitions.
double loss_double(const SdpaSetup& s, const std::vector<double>& q, const std::vector<double>& k,
                   const std::vector<double>& v) {
  kernels::SdpaParams p;
  p.q = s.q.view4(), p.k = s.k.view4(), p.v = s.v.view4();
  const int64_t B = p.batch(), H = p.heads(), KV = p.kv_heads(), Tq = p.t_q(), Tk = p.t_k(), D = p.d(), Dv = p.d_v();
  const std::array<int64_t, 4> full{B, H, Tq, Tk};
  auto bc = [&](auto view, std::array<int64_t, 4> shape) {
    if (view.empty()) return view;
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
      for (float x : t->values()) ASSERT_TRUE(std::isfinite(x)), biggest = std::max(biggest, std::fabs(double(x)));
    if (c.Tk > 0) EXPECT_GT(biggest, 1e-3);
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

}  // namespace
}  // namespace mha
