// Score edits — ALiBi, logit softcapping, learned attention sinks — on every path: the reference
// against an independent naive computation, the fused forward (float32, bf16) and backward against
// the reference over sweeps of odd lengths, block edges, masks, GQA, every SIMD target and 1/2/3
// threads bitwise; finite differences for the gradients (d sink included); decode over a KV cache
// against the full forward; fully masked rows with a sink; NaN; bad arguments.
#include <hwy/targets.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <ranges>
#include <span>
#include <tuple>
#include <type_traits>
#include <vector>

#include "mha/kv_cache.h"
#include "mha/module.h"
#include "mha/prune.h"
#include "mha/safetensors.h"
#include "mha/sdpa.h"
#include "mha/training.h"
#include "mha/weights.h"
#include "support/test_support.h"

namespace mha {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::error_of;
using testing::f32_lse_tol;
using testing::f32_out_tol;
using testing::for_each_fused_target;
using testing::max_abs;
using testing::random_tensor;

constexpr double kEps = std::numeric_limits<float>::epsilon();

/// Which edits a case turns on.
struct Edits {
  bool alibi = false;
  float softcap = 0.0f;
  bool sinks = false;
};

std::vector<Edits> edit_kinds() {
  return {{true, 0.0f, false}, {false, 1.5f, false}, {false, 0.0f, true}, {true, 2.0f, true}};
}

struct Case {
  int64_t B = 1, H = 2, KV = 1, Tq = 5, Tk = 7, D = 8, Dv = 8;
  Tensor q, k, v;
  BoolTensor key_padding;
  std::vector<float> slopes, sinks;
  SdpaOptions opt;

  void make(uint64_t seed, const Edits& e) {
    q = random_tensor({B, H, Tq, D}, seed, -2.0f, 2.0f);
    k = random_tensor({B, KV, Tk, D}, seed + 1, -2.0f, 2.0f);
    v = random_tensor({B, KV, Tk, Dv}, seed + 2, -2.0f, 2.0f);
    if (e.alibi) {
      slopes = alibi_slopes(H);
      opt.alibi.slopes = slopes;
    }
    opt.softcap = e.softcap;
    if (e.sinks) {
      const Tensor z = random_tensor({H}, seed + 3, -1.0f, 2.0f);
      sinks.assign(z.data(), z.data() + H);
      opt.sinks.logits = sinks;
    }
  }
  /// Score magnitude bound: |scale·q·k| (or the cap) plus ALiBi's largest term.
  double score_bound() const {
    const double scale = opt.scale ? *opt.scale : 1.0 / std::sqrt(static_cast<double>(D));
    double b = scale * static_cast<double>(D) * max_abs(q) * max_abs(k);
    if (opt.softcap > 0) b = opt.softcap;
    if (!slopes.empty()) b += slopes[0] * static_cast<double>(Tq + Tk);
    return b;
  }
  // The int8 decode path rounds queries and probabilities to 16 bits (2⁻¹⁶ where float32's
  // rounding is 2⁻²³ in the tolerance's model): slack × 128 there.
  double slack = 2.0;
  double out_tol() const { return f32_out_tol(max_abs(v), Tk, score_bound(), slack); }
  double lse_tol() const { return f32_lse_tol(Tk + 1, score_bound(), slack); }  // the sink: one more term
};

struct Result {
  Tensor out, lse;
};

Result run(const Case& c, Backend backend, int threads = 2) {
  Result r{Tensor({c.B, c.H, c.Tq, c.Dv}), Tensor({c.B, c.H, c.Tq, 1})};
  SdpaOptions opt = c.opt;
  opt.backend = backend;
  opt.threads = threads;
  sdpa(c.q.view4(), c.k.view4(), c.v.view4(), opt, {r.out.view4(), {}, r.lse.view4()});
  return r;
}

/// An independent naive computation in double, straight from docs/semantics.md's formulas.
Result naive(const Case& c) {
  Result r{Tensor({c.B, c.H, c.Tq, c.Dv}), Tensor({c.B, c.H, c.Tq, 1})};
  const double scale = c.opt.scale ? *c.opt.scale : 1.0 / std::sqrt(static_cast<double>(c.D));
  const Causal& causal = c.opt.masks.causal;
  const int64_t off = causal.enabled() ? causal.offset_for(c.Tq, c.Tk) : c.Tk - c.Tq;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.Tq; ++i) {
        const int64_t g = h / (c.H / c.KV);
        std::vector<double> s(static_cast<size_t>(c.Tk), -INFINITY);
        double m = c.sinks.empty() ? -INFINITY : c.sinks[static_cast<size_t>(h)];
        for (int64_t j = 0; j < c.Tk; ++j) {
          if (causal.enabled() && j > i + off) continue;
          if (c.key_padding.defined() && c.key_padding.at({b, j})) continue;
          double t = 0;
          for (int64_t x = 0; x < c.D; ++x) t += static_cast<double>(c.q.at({b, h, i, x})) * c.k.at({b, g, j, x});
          t *= scale;
          if (c.opt.softcap > 0) t = c.opt.softcap * std::tanh(t / c.opt.softcap);
          if (!c.slopes.empty()) t -= c.slopes[static_cast<size_t>(h)] * static_cast<double>(i + off - j);
          s[static_cast<size_t>(j)] = t;
          m = std::max(m, t);
        }
        double sum = c.sinks.empty() ? 0.0 : std::exp(c.sinks[static_cast<size_t>(h)] - m);
        for (double t : s) sum += std::isinf(t) ? 0.0 : std::exp(t - m);
        for (int64_t x = 0; x < c.Dv; ++x) {
          double acc = 0;
          for (int64_t j = 0; j < c.Tk; ++j)
            if (!std::isinf(s[static_cast<size_t>(j)]))
              acc += std::exp(s[static_cast<size_t>(j)] - m) / sum * c.v.at({b, g, j, x});
          r.out.at({b, h, i, x}) = m == -INFINITY ? 0.0f : static_cast<float>(acc);
        }
        r.lse.at({b, h, i, 0}) = m == -INFINITY ? -INFINITY : static_cast<float>(m + std::log(sum));
      }
  return r;
}

void expect_close(const Case& c, const Result& got, const Result& want, double extra = 0) {
  EXPECT_TRUE(all_close(got.out, want.out, c.out_tol() + extra, 0)) << "out";
  EXPECT_TRUE(all_close(got.lse, want.lse, c.lse_tol(), 0)) << "lse";
}

// The options' slopes and sink logits borrow the caller's floats: a vector that dies at the end of
// the statement must not compile into them (it did, and dangled); the caller's own vector does.
static_assert(!std::is_assignable_v<BorrowedFloats&, std::vector<float>&&>);
static_assert(!std::is_assignable_v<BorrowedFloats&, const std::vector<float>&&>);
static_assert(std::is_assignable_v<BorrowedFloats&, std::vector<float>&>);
static_assert(std::is_assignable_v<BorrowedFloats&, const std::vector<float>&>);
static_assert(std::is_assignable_v<BorrowedFloats&, std::span<const float>>);
static_assert(std::is_convertible_v<BorrowedFloats, std::span<const float>>);
static_assert(!std::is_assignable_v<BorrowedFloats&, std::array<float, 2>&&>);
static_assert(!std::is_assignable_v<BorrowedFloats&, std::initializer_list<float>>);
static_assert(std::is_assignable_v<BorrowedFloats&, std::array<float, 2>&>);
static_assert(std::ranges::borrowed_range<BorrowedFloats>);

TEST(AlibiSlopes, StandardSchedule) {
  const std::vector<float> s8 = alibi_slopes(8);
  ASSERT_EQ(s8.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_FLOAT_EQ(s8[static_cast<size_t>(i)], std::exp2(-(i + 1.0f)));
  // 12 heads (BLOOM's recipe): the 8-head schedule, then 2^(−(2i+1)/2) for i = 0..3.
  const std::vector<float> s12 = alibi_slopes(12);
  ASSERT_EQ(s12.size(), 12u);
  for (int i = 0; i < 8; ++i) EXPECT_FLOAT_EQ(s12[static_cast<size_t>(i)], s8[static_cast<size_t>(i)]);
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(s12[static_cast<size_t>(8 + i)], std::exp2(-(2 * i + 1) / 2.0f));
  EXPECT_EQ(alibi_slopes(1), std::vector<float>{std::exp2(-8.0f)});
  EXPECT_TRUE(alibi_slopes(0).empty());
  EXPECT_EQ(alibi_slopes(5).size(), 5u);
  EXPECT_NE(error_of([] { (void)alibi_slopes(-1); }).find("heads"), std::string::npos);
}

TEST(ScoreEditsReference, MatchesNaiveComputation) {
  for (const Edits& e : edit_kinds())
    for (Causal causal : {Causal::none(), Causal::top_left(), Causal::bottom_right()}) {
      Case c;
      c.H = 4, c.KV = 2, c.Tq = 5, c.Tk = 9;
      c.opt.masks.causal = causal;
      c.make(11, e);
      SCOPED_TRACE(::testing::Message() << "alibi " << e.alibi << " softcap " << e.softcap << " sinks " << e.sinks);
      expect_close(c, run(c, Backend::Reference), naive(c));
    }
}

TEST(ScoreEditsFused, MatchesReferenceOnEveryTargetAndThreadCount) {
  for_each_fused_target([] {
    uint64_t seed = 100;
    for (const Edits& e : edit_kinds())
      for (auto [tq, tk] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {7, 13}, {63, 64}, {65, 129}, {130, 70}})
        for (Causal causal : {Causal::none(), Causal::bottom_right(), Causal::top_left().with_window(17)}) {
          Case c;
          c.B = 2, c.H = 4, c.KV = 2, c.Tq = tq, c.Tk = tk, c.D = tq % 2 ? 17 : 16, c.Dv = 9;
          c.opt.masks.causal = causal;
          c.make(seed++, e);
          if (tk > 10) {  // a padded key: never read, on every path
            c.key_padding = BoolTensor({c.B, c.Tk}, 0);
            c.key_padding.at({1, 3}) = 1;
            c.opt.masks.key_padding.view = {c.key_padding.data(), {c.B, 1, 1, c.Tk}, {c.Tk, 0, 0, 1}};
          }
          SCOPED_TRACE(::testing::Message() << "Tq " << tq << " Tk " << tk << " alibi " << e.alibi << " softcap "
                                            << e.softcap << " sinks " << e.sinks);
          const Result want = run(c, Backend::Reference);
          const Result one = run(c, Backend::Fused, 1);
          expect_close(c, one, want);
          for (int threads : {2, 3}) {
            const Result r = run(c, Backend::Fused, threads);
            EXPECT_TRUE(bitwise_equal(r.out, one.out)) << threads << " threads";
            EXPECT_TRUE(bitwise_equal(r.lse, one.lse)) << threads << " threads";
          }
        }
  });
}

// The fused kernel's weights path (each block's probabilities kept with the running max they were
// taken against, normalised once at the end with the sink in the denominator) matches the
// reference's weights, per head and averaged, and leaves out and lse exactly as without weights.
TEST(ScoreEditsFused, WeightsMatchTheReferenceOnEveryTargetAndThreadCount) {
  for_each_fused_target([] {
    uint64_t seed = 500;
    for (const Edits& e : edit_kinds())
      for (auto [tq, tk] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {7, 13}, {65, 129}})
        for (Causal causal : {Causal::none(), Causal::top_left()}) {
          Case c;
          c.B = 2, c.H = 4, c.KV = 2, c.Tq = tq, c.Tk = tk, c.D = 16, c.Dv = 9;
          c.opt.masks.causal = causal;
          c.make(seed++, e);
          SCOPED_TRACE(::testing::Message() << "Tq " << tq << " Tk " << tk << " alibi " << e.alibi << " softcap "
                                            << e.softcap << " sinks " << e.sinks);
          const auto weights = [&](Backend backend, int threads) {
            Result r{Tensor({c.B, c.H, c.Tq, c.Dv}), Tensor({c.B, c.H, c.Tq, 1})};
            Tensor w({c.B, c.H, c.Tq, c.Tk}), avg({c.B, 1, c.Tq, c.Tk});
            SdpaOptions opt = c.opt;
            opt.backend = backend;
            opt.threads = threads;
            SdpaOutputs outs{r.out.view4(), w.view4(), r.lse.view4()};
            outs.averaged_weights = avg.view4();
            sdpa(c.q.view4(), c.k.view4(), c.v.view4(), opt, outs);
            return std::tuple{r, w, avg};
          };
          const auto [want, w_want, avg_want] = weights(Backend::Reference, 1);
          const auto [one, w_one, avg_one] = weights(Backend::Fused, 1);
          expect_close(c, one, want);
          const Result plain = run(c, Backend::Fused, 1);
          EXPECT_TRUE(bitwise_equal(one.out, plain.out) && bitwise_equal(one.lse, plain.lse)) << "as without weights";
          EXPECT_TRUE(all_close(w_one, w_want, 8 * kEps * (1 + c.score_bound()), 0)) << "per-head weights";
          EXPECT_TRUE(all_close(avg_one, avg_want, 8 * kEps * (1 + c.score_bound()), 0)) << "averaged weights";
          for (int threads : {2, 3}) {
            const auto [r, w, avg] = weights(Backend::Fused, threads);
            EXPECT_TRUE(bitwise_equal(r.out, one.out) && bitwise_equal(w, w_one) && bitwise_equal(avg, avg_one))
                << threads << " threads";
          }
        }
  });
}

TEST(ScoreEditsFused, DropoutWithEditsMatchesReferenceForwardAndBackward) {
  // Dropout acts on the probabilities after the sink took its share; both paths regenerate the
  // same keep decisions, so they agree, and the backward sees the same mask.
  for (const Edits& e : edit_kinds()) {
    Case c;
    c.B = 2, c.H = 4, c.KV = 2, c.Tq = 70, c.Tk = 67, c.D = 16, c.Dv = 8;
    c.opt.masks.causal = Causal::bottom_right();
    c.opt.dropout = {0.25f, 1234};
    c.make(500, e);
    const Result want = run(c, Backend::Reference);
    expect_close(c, run(c, Backend::Fused, 3), want);
    SdpaOptions opt = c.opt;
    const Tensor lse3 = want.lse.reshaped({c.B, c.H, c.Tq});
    const Tensor d_out = random_tensor(want.out.shape(), 501);
    opt.backend = Backend::Reference;
    const SdpaGradTensors gr = sdpa_backward(c.q, c.k, c.v, want.out, d_out, lse3, opt);
    opt.backend = Backend::Fused;
    const SdpaGradTensors gf = sdpa_backward(c.q, c.k, c.v, want.out, d_out, lse3, opt);
    const double tol = 1e-4;
    EXPECT_TRUE(all_close(gf.dq, gr.dq, tol, tol) && all_close(gf.dk, gr.dk, tol, tol) &&
                all_close(gf.dv, gr.dv, tol, tol) && all_close(gf.dsinks, gr.dsinks, tol, tol));
  }
}

BF16Tensor to_bf16_tensor(const Tensor& t) {
  BF16Tensor b(t.shape());
  for (int64_t i = 0; i < t.numel(); ++i) b.data()[i] = to_bf16(t.data()[i]);
  return b;
}

TEST(ScoreEditsFused, Bf16MatchesReferenceOnWidenedValues) {
  for_each_fused_target([] {
    for (const Edits& e : edit_kinds()) {
      Case c;
      c.H = 4, c.KV = 2, c.Tq = 67, c.Tk = 131, c.D = 16, c.Dv = 16;
      c.opt.masks.causal = Causal::bottom_right();
      c.make(7, e);
      const BF16Tensor qb = to_bf16_tensor(c.q), kb = to_bf16_tensor(c.k), vb = to_bf16_tensor(c.v);
      for (int64_t i = 0; i < c.q.numel(); ++i) c.q.data()[i] = to_float(qb.data()[i]);
      for (int64_t i = 0; i < c.k.numel(); ++i) c.k.data()[i] = to_float(kb.data()[i]);
      for (int64_t i = 0; i < c.v.numel(); ++i) c.v.data()[i] = to_float(vb.data()[i]);
      const Result want = run(c, Backend::Reference);
      Result got{Tensor({c.B, c.H, c.Tq, c.Dv}), Tensor({c.B, c.H, c.Tq, 1})};
      SdpaOptions opt = c.opt;
      opt.backend = Backend::Fused;
      sdpa(View4<const bf16>(qb.view4()), View4<const bf16>(kb.view4()), View4<const bf16>(vb.view4()), opt,
           {got.out.view4(), {}, got.lse.view4()});
      expect_close(c, got, want, 2.0 * std::ldexp(1.0, -9) * max_abs(c.v));
    }
  });
}

TEST(ScoreEdits, FullyMaskedRowWithSinkGivesZerosAndSinkLse) {
  for (Backend backend : {Backend::Reference, Backend::Fused}) {
    Case c;
    c.Tq = 3, c.Tk = 4;
    c.make(5, {true, 3.0f, true});
    c.key_padding = BoolTensor({c.B, c.Tk}, 1);  // every key padded
    c.opt.masks.key_padding.view = {c.key_padding.data(), {c.B, 1, 1, c.Tk}, {c.Tk, 0, 0, 1}};
    const Result r = run(c, backend);
    for (float x : r.out.values()) EXPECT_EQ(x, 0.0f);
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.Tq; ++i) EXPECT_EQ(r.lse.at({0, h, i, 0}), c.sinks[static_cast<size_t>(h)]);
    // Gradient: out is a constant, so everything is 0 (the sink's included), also with a NaN in
    // d out (the fused d sinks once summed 0 · NaN over such rows).
    Tensor d_out = random_tensor(r.out.shape(), 9);
    SdpaOptions opt = c.opt;
    opt.backend = backend;
    const Tensor lse3 = Tensor({c.B, c.H, c.Tq}, std::vector<float>(r.lse.values().begin(), r.lse.values().end()));
    for (const bool nan_in_d_out : {false, true}) {
      SCOPED_TRACE(nan_in_d_out);
      if (nan_in_d_out) d_out.data()[0] = std::numeric_limits<float>::quiet_NaN();
      const SdpaGradTensors g = sdpa_backward(c.q, c.k, c.v, r.out, d_out, lse3, opt);
      for (const Tensor* t : {&g.dq, &g.dk, &g.dv, &g.dsinks})
        for (float x : t->values()) EXPECT_EQ(x, 0.0f);
    }
  }
}

TEST(ScoreEdits, VisibleNanMakesTheRowNanOnEveryPath) {
  for (Backend backend : {Backend::Reference, Backend::Fused}) {
    Case c;
    c.Tq = 4, c.Tk = 6;
    c.make(3, {true, 2.0f, true});
    c.q.at({0, 1, 2, 0}) = std::numeric_limits<float>::quiet_NaN();
    const Result r = run(c, backend);
    for (int64_t x = 0; x < c.Dv; ++x) EXPECT_TRUE(std::isnan(r.out.at({0, 1, 2, x})));
    EXPECT_TRUE(std::isnan(r.lse.at({0, 1, 2, 0})));
    EXPECT_FALSE(std::isnan(r.out.at({0, 1, 1, 0})));
  }
}

// ---- backward ------------------------------------------------------------------------------

struct Grads {
  Tensor dq, dk, dv, dsinks;
};

Grads backward(const Case& c, const Tensor& d_out, Backend backend, int threads = 2) {
  SdpaOptions opt = c.opt;
  opt.backend = Backend::Reference;  // one forward for both backward paths
  const SdpaResult fwd = sdpa(c.q, c.k, c.v, opt, Want::Lse);
  opt.backend = backend;
  opt.threads = threads;
  SdpaGradTensors g = sdpa_backward(c.q, c.k, c.v, fwd.out, d_out, fwd.lse, opt);
  return {std::move(g.dq), std::move(g.dk), std::move(g.dv), std::move(g.dsinks)};
}

/// L = Σ out ∘ d_out, in double through the naive forward.
double loss(const Case& c, const Tensor& d_out) {
  const Result r = naive(c);
  double l = 0;
  for (int64_t i = 0; i < d_out.numel(); ++i) l += static_cast<double>(r.out.data()[i]) * d_out.data()[i];
  return l;
}

TEST(ScoreEditsBackward, ReferenceMatchesFiniteDifferences) {
  for (const Edits& e : edit_kinds()) {
    Case c;
    c.H = 2, c.KV = 1, c.Tq = 3, c.Tk = 5, c.D = 4, c.Dv = 3;
    c.opt.masks.causal = Causal::bottom_right();
    c.make(21, e);
    const Tensor d_out = random_tensor({c.B, c.H, c.Tq, c.Dv}, 22);
    const Grads g = backward(c, d_out, Backend::Reference);
    const float step = 1e-2f;
    // Central differences in float inputs: error ~ step² · L''' + ε·|L| / step.
    const double tol = 2e-3;
    auto check = [&](Tensor& x, const Tensor& grad, const char* name) {
      for (int64_t i = 0; i < x.numel(); ++i) {
        const float keep = x.data()[i];
        x.data()[i] = keep + step;
        const double up = loss(c, d_out);
        x.data()[i] = keep - step;
        const double down = loss(c, d_out);
        x.data()[i] = keep;
        EXPECT_NEAR(grad.data()[i], (up - down) / (2 * step), tol) << name << " " << i;
      }
    };
    check(c.q, g.dq, "dq");
    check(c.k, g.dk, "dk");
    check(c.v, g.dv, "dv");
    if (e.sinks) {
      ASSERT_EQ(g.dsinks.numel(), c.H);
      for (int64_t h = 0; h < c.H; ++h) {
        const float keep = c.sinks[static_cast<size_t>(h)];
        c.sinks[static_cast<size_t>(h)] = keep + step;
        const double up = loss(c, d_out);
        c.sinks[static_cast<size_t>(h)] = keep - step;
        const double down = loss(c, d_out);
        c.sinks[static_cast<size_t>(h)] = keep;
        EXPECT_NEAR(g.dsinks.data()[h], (up - down) / (2 * step), tol) << "dsinks " << h;
      }
    } else {
      EXPECT_EQ(g.dsinks.numel(), 0);
    }
  }
}

TEST(ScoreEditsBackward, FusedMatchesReferenceOnEveryTargetAndThreadCount) {
  for_each_fused_target([] {
    uint64_t seed = 300;
    for (const Edits& e : edit_kinds())
      for (auto [tq, tk] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {9, 13}, {65, 63}, {70, 130}})
        for (Causal causal : {Causal::none(), Causal::bottom_right()}) {
          Case c;
          c.B = 2, c.H = 4, c.KV = 2, c.Tq = tq, c.Tk = tk, c.D = 12, c.Dv = 7;
          c.opt.masks.causal = causal;
          c.make(seed++, e);
          SCOPED_TRACE(::testing::Message() << "Tq " << tq << " Tk " << tk << " alibi " << e.alibi << " softcap "
                                            << e.softcap << " sinks " << e.sinks);
          const Tensor d_out = random_tensor({c.B, c.H, c.Tq, c.Dv}, seed++);
          const Grads want = backward(c, d_out, Backend::Reference);
          const Grads one = backward(c, d_out, Backend::Fused, 1);
          // Errors grow with the score bound (through P) and the lengths summed over.
          const double tol = kEps * (64.0 + 16.0 * c.score_bound()) * std::sqrt(static_cast<double>(tq + tk)) * 8.0;
          EXPECT_TRUE(all_close(one.dq, want.dq, tol, tol)) << "dq";
          EXPECT_TRUE(all_close(one.dk, want.dk, tol, tol)) << "dk";
          EXPECT_TRUE(all_close(one.dv, want.dv, tol, tol)) << "dv";
          EXPECT_TRUE(all_close(one.dsinks, want.dsinks, tol * c.Tq, tol)) << "dsinks";
          for (int threads : {2, 3}) {
            const Grads r = backward(c, d_out, Backend::Fused, threads);
            EXPECT_TRUE(bitwise_equal(r.dq, one.dq) && bitwise_equal(r.dk, one.dk) && bitwise_equal(r.dv, one.dv) &&
                        bitwise_equal(r.dsinks, one.dsinks))
                << threads << " threads";
          }
        }
  });
}

// ---- decode over a KV cache ----------------------------------------------------------------

void decode_matches_full_forward() {
  for (CacheDtype dtype : {CacheDtype::F32, CacheDtype::BF16, CacheDtype::I8})
    for (const Edits& e : edit_kinds()) {
      Case c;
      c.H = 4, c.KV = 2, c.Tq = 37, c.Tk = 37, c.D = 16, c.Dv = 16;
      c.opt.masks.causal = Causal::top_left();
      c.make(41, e);
      if (dtype == CacheDtype::BF16) {  // values exact in bf16, so both paths see the same inputs
        for (Tensor* t : {&c.k, &c.v})
          for (int64_t i = 0; i < t->numel(); ++i) t->data()[i] = to_float(to_bf16(t->data()[i]));
      }
      if (dtype == CacheDtype::I8) {
        c.slack *= 128;  // the int8 path's 16-bit q and p (Case::slack)
        // Each row's int8 round trip (max|x|/127 steps): stored again within an ulp.
        for (Tensor* t : {&c.k, &c.v})
          for (int64_t r = 0; r < t->numel() / t->size(3); ++r) {
            float* row = t->data() + r * t->size(3);
            float absmax = 0;
            for (int64_t x = 0; x < t->size(3); ++x) absmax = std::max(absmax, std::fabs(row[x]));
            const float step = absmax / 127.0f;
            for (int64_t x = 0; x < t->size(3); ++x) row[x] = step > 0 ? std::nearbyint(row[x] / step) * step : 0.0f;
          }
      }
      SCOPED_TRACE(::testing::Message() << cache_dtype_name(dtype) << " alibi " << e.alibi << " softcap " << e.softcap
                                        << " sinks " << e.sinks);
      const Result full = run(c, Backend::Reference);
      KvCacheConfig cc;
      cc.batch = c.B, cc.kv_heads = c.KV, cc.head_dim = c.D, cc.capacity = c.Tk, cc.dtype = dtype;
      KvCache cache(cc);
      CacheAttentionOptions copt;
      copt.alibi = c.opt.alibi, copt.softcap = c.opt.softcap, copt.sinks = c.opt.sinks;
      copt.splits = 3;
      for (int64_t t = 0; t < c.Tq; ++t) {
        // Append token t's K/V, then attend query t (at position t) to positions 0 … t.
        const Tensor kt = Tensor({c.B, c.KV, 1, c.D}), vt = Tensor({c.B, c.KV, 1, c.Dv});
        Tensor kk = kt, vv = vt;
        for (int64_t g = 0; g < c.KV; ++g)
          for (int64_t x = 0; x < c.D; ++x)
            kk.at({0, g, 0, x}) = c.k.at({0, g, t, x}), vv.at({0, g, 0, x}) = c.v.at({0, g, t, x});
        cache.append(View4<const float>(kk.view4()), View4<const float>(vv.view4()));
        Tensor qt({c.B, c.H, 1, c.D});
        for (int64_t h = 0; h < c.H; ++h)
          for (int64_t x = 0; x < c.D; ++x) qt.at({0, h, 0, x}) = c.q.at({0, h, t, x});
        Tensor out({c.B, c.H, 1, c.Dv}), lse({c.B, c.H, 1, 1});
        const std::vector<int64_t> start{t};
        attend_cache(View4<const float>(qt.view4()), cache, start, copt, out.view4(), lse.view4());
        for (int64_t h = 0; h < c.H; ++h) {
          for (int64_t x = 0; x < c.Dv; ++x) EXPECT_NEAR(out.at({0, h, 0, x}), full.out.at({0, h, t, x}), c.out_tol());
          EXPECT_NEAR(lse.at({0, h, 0, 0}), full.lse.at({0, h, t, 0}), c.lse_tol());
        }
      }
    }
}

// On every target the decode kernel was compiled for (its softcap is Highway's vector Tanh).
TEST(ScoreEditsDecode, CacheAttentionMatchesFullForwardTokenByTokenOnEveryTarget) {
  testing::for_each_decode_target([&] { decode_matches_full_forward(); });
}

// ---- bad arguments -------------------------------------------------------------------------

TEST(ScoreEdits, BadArgumentsAreClearErrors) {
  Case c;
  c.make(1, {});
  Tensor out({c.B, c.H, c.Tq, c.Dv});
  auto call = [&](const SdpaOptions& opt) {
    return error_of([&] { sdpa(c.q.view4(), c.k.view4(), c.v.view4(), opt, {out.view4(), {}, {}}); });
  };
  const std::vector<float> three{0.5f, 0.25f, 0.125f}, two_nan{0.5f, NAN};
  SdpaOptions opt;
  opt.alibi.slopes = three;
  EXPECT_NE(call(opt).find("alibi slopes has 3 entries, expected one per query head (2)"), std::string::npos)
      << call(opt);
  opt = {};
  opt.alibi.slopes = two_nan;
  EXPECT_NE(call(opt).find("alibi slope 1 is not finite"), std::string::npos) << call(opt);
  for (float cap : {-1.0f, NAN, INFINITY}) {
    opt = {};
    opt.softcap = cap;
    EXPECT_NE(call(opt).find("softcap must be a finite c > 0"), std::string::npos) << call(opt);
  }
  opt = {};
  opt.sinks.logits = three;
  EXPECT_NE(call(opt).find("sinks has 3 entries, expected one per query head (2)"), std::string::npos) << call(opt);
  opt = {};
  opt.sinks.logits = two_nan;
  EXPECT_NE(call(opt).find("sink logit 1 is not finite"), std::string::npos) << call(opt);
  // The same checks guard attention over a KV cache.
  KvCacheConfig cc;
  cc.batch = 1, cc.kv_heads = 1, cc.head_dim = c.D, cc.capacity = 4;
  KvCache cache(cc);
  CacheAttentionOptions copt;
  copt.sinks.logits = three;
  Tensor q1({1, 2, 1, c.D}), o1({1, 2, 1, c.D});
  const std::string err =
      error_of([&] { attend_cache(View4<const float>(q1.view4()), cache, {}, copt, o1.view4(), {}); });
  EXPECT_NE(err.find("attend_cache: sinks has 3 entries"), std::string::npos) << err;
}

// ---- the module ------------------------------------------------------------------------------

MhaConfig edited_config() {
  MhaConfig c;
  c.embed_dim = 24, c.num_heads = 6, c.num_kv_heads = 3;  // 6 heads: a non-power-of-two schedule
  c.layout = Layout::BatchFirst;
  c.alibi_slopes = alibi_slopes(6);
  c.softcap = 2.5f;
  c.attention_sinks = true;
  c.scale = 0.3f;
  return c;
}

MultiheadAttention edited_module() {
  MultiheadAttention m(edited_config(), 5);
  for (int64_t h = 0; h < 6; ++h) m.params().sinks.data()[h] = 0.4f * static_cast<float>(h) - 1.0f;
  for (float& x : m.params().in_proj_bias.values()) x = 0.01f * static_cast<float>(&x - m.params().in_proj_bias.data());
  return m;
}

TEST(ScoreEditsModule, ForwardEqualsSdpaWithTheConfigsEditsAndReturnsLse) {
  const MultiheadAttention m = edited_module();
  const Tensor x = random_tensor({2, 9, 24}, 61);
  MhaForwardOptions o;
  o.causal = Causal::top_left();
  o.need_lse = true;
  o.backend = Backend::Reference;
  const MhaOutput y = m.forward(x, x, x, o);
  ASSERT_EQ(y.lse.shape(), (Shape{2, 6, 9}));
  // Same options through forward_train: the lse it saves is the one returned.
  o.need_lse = false;
  const MhaTrainOutput t = forward_train(m, x, x, x, o);
  EXPECT_TRUE(bitwise_equal(t.output, y.output));
  EXPECT_TRUE(bitwise_equal(t.context.lse, y.lse));
  // The fused path agrees.
  o.backend = Backend::Fused;
  o.need_lse = true;
  const MhaOutput f = m.forward(x, x, x, o);
  EXPECT_TRUE(all_close(f.output, y.output, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(f.lse, y.lse, 1e-5, 1e-5));
  // Each edit changes the result (so none is silently dropped).
  for (int which = 0; which < 4; ++which) {
    MhaConfig c = edited_config();
    if (which == 0) c.alibi_slopes.clear();
    if (which == 1) c.softcap = 0.0f;
    if (which == 2) c.attention_sinks = false;
    if (which == 3) c.scale.reset();
    MhaParameters p = m.params();
    if (!c.attention_sinks) p.sinks = Tensor();
    const MultiheadAttention other(c, p);
    EXPECT_FALSE(all_close(other.forward(x, x, x, o).output, y.output, 1e-4, 1e-4)) << which;
  }
  // A fully masked row (every key padded) with sinks: lse = the sink logit.
  MhaForwardOptions pad;
  pad.need_lse = true;
  pad.key_padding_mask.is_padding = BoolTensor({2, 9}, 1);
  const MhaOutput z = m.forward(x, x, x, pad);
  for (int64_t h = 0; h < 6; ++h) EXPECT_EQ(z.lse.at({1, h, 4}), m.params().sinks.data()[h]);
  static_assert(MultiheadAttention::deterministic());
}

TEST(ScoreEditsModule, IncrementalDecodingEqualsFullForward) {
  const MultiheadAttention m = edited_module();
  const int64_t T = 11;
  const Tensor x = random_tensor({1, T, 24}, 71);
  MhaForwardOptions o;
  o.causal = Causal::top_left();
  const Tensor full = m.forward(x, x, x, o).output;
  KvCacheConfig cc;
  cc.batch = 1, cc.kv_heads = 3, cc.head_dim = 4, cc.capacity = T;
  KvCache cache(cc);
  const int64_t prefill = 4;
  for (int64_t t = 0; t < T;) {
    const int64_t n = t == 0 ? prefill : 1;
    Tensor in({1, n, 24});
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < 24; ++e) in.at({0, i, e}) = x.at({0, t + i, e});
    const Tensor y = m.forward_incremental(in, in, in, cache, {}).output;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < 24; ++e) EXPECT_NEAR(y.at({0, i, e}), full.at({0, t + i, e}), 2e-5) << t + i;
    t += n;
  }
}

TEST(ScoreEditsModule, SinkGradientMatchesFiniteDifferences) {
  MultiheadAttention m = edited_module();
  const Tensor x = random_tensor({2, 5, 24}, 81);
  const Tensor d_out = random_tensor({2, 5, 24}, 82);
  MhaForwardOptions o;
  o.causal = Causal::bottom_right();
  const MhaTrainOutput t = forward_train(m, x, x, x, o);
  const MhaGradients g = backward(m, t.context, d_out);
  ASSERT_EQ(g.params.sinks.shape(), (Shape{6}));
  auto loss = [&] {
    const Tensor y = m.forward(x, x, x, o).output;
    double l = 0;
    for (int64_t i = 0; i < y.numel(); ++i) l += static_cast<double>(y.data()[i]) * d_out.data()[i];
    return l;
  };
  const float step = 1e-2f;
  for (int64_t h = 0; h < 6; ++h) {
    float& z = m.params().sinks.data()[h];
    const float keep = z;
    z = keep + step;
    const double up = loss();
    z = keep - step;
    const double down = loss();
    z = keep;
    EXPECT_NEAR(g.params.sinks.data()[h], (up - down) / (2 * step), 2e-3) << h;
  }
}

// The context keeps the sink logits the forward used (its lse includes them): a backward through
// another module of the same configuration, after the forward's module changed its sinks and was
// destroyed, gives what that forward's own backward gives (it read the freed sinks before).
TEST(ScoreEditsModule, ContextOwnsTheSinksItsForwardUsed) {
  const Tensor x = random_tensor({2, 5, 24}, 83);
  const Tensor d_out = random_tensor({2, 5, 24}, 84);
  const MultiheadAttention same = edited_module();
  const MhaGradients want = backward(same, forward_train(same, x, x, x).context, d_out);
  MhaTrainOutput t;
  {
    MultiheadAttention m = edited_module();
    t = forward_train(m, x, x, x);
    std::fill(m.params().sinks.values().begin(), m.params().sinks.values().end(), 7.0f);
    m.params().sinks = Tensor({6}, -3.0f);
  }
  const MhaGradients got = backward(same, t.context, d_out);
  EXPECT_TRUE(bitwise_equal(got.params.sinks, want.params.sinks));
  EXPECT_TRUE(bitwise_equal(got.query, want.query));
  // A moved context keeps them too.
  const MhaContext moved = std::move(t.context);
  EXPECT_TRUE(bitwise_equal(backward(same, moved, d_out).params.sinks, want.params.sinks));
}

TEST(ScoreEditsModule, SaveAndLoadKeepTheEditsAndTheSinks) {
  using namespace io;
  const MultiheadAttention m = edited_module();
  for (WeightNames names : {WeightNames::PyTorch, WeightNames::HuggingFace}) {
    const std::string path = testing::temp_dir() + "/edits.safetensors";
    save_module(path, m, names);
    const auto file = SafetensorsFile::open(path);
    EXPECT_TRUE(file.contains("sinks"));
    const MultiheadAttention loaded = load_module(file);
    EXPECT_EQ(loaded.config().alibi_slopes, m.config().alibi_slopes);
    EXPECT_EQ(loaded.config().softcap, m.config().softcap);
    EXPECT_EQ(loaded.config().scale, m.config().scale);
    EXPECT_TRUE(loaded.config().attention_sinks);
    EXPECT_TRUE(bitwise_equal(loaded.params().sinks, m.params().sinks));
  }
  MhaConfig plain = edited_config();
  plain.attention_sinks = false;
  EXPECT_EQ(m.parameter_count(), parameter_count(plain) + 6);
}

TEST(ScoreEditsModule, BadConfigurationsAreClearErrors) {
  auto err = [](MhaConfig c) { return error_of([&] { c.validate(); }); };
  MhaConfig c = edited_config();
  c.alibi_slopes = {0.5f};
  EXPECT_NE(err(c).find("alibi_slopes has 1 entries, expected one per head (6)"), std::string::npos) << err(c);
  c = edited_config();
  c.softcap = -1.0f;
  EXPECT_NE(err(c).find("softcap must be a finite c > 0"), std::string::npos) << err(c);
  c = edited_config();
  c.scale = NAN;
  EXPECT_NE(err(c).find("scale must be finite"), std::string::npos) << err(c);
  c = edited_config();
  c.add_zero_attn = true;
  EXPECT_NE(err(c).find("ALiBi needs key positions"), std::string::npos) << err(c);
  MultiheadAttention m = edited_module();
  m.params().sinks = Tensor({5});
  const std::string e = error_of([&] { m.check_params(); });
  EXPECT_NE(e.find("sinks"), std::string::npos) << e;
}

// ---- PyTorch goldens (tests/golden/generate_score_edits.py) ----------------------------------

TEST(ScoreEditsGolden, EveryPathMatchesPyTorchAutograd) {
  // On every SIMD target: the fused kernels and decode dispatch to it.
  for_each_fused_target([] {
    for (const char* name : {"alibi_causal_gqa", "softcap_noncausal", "sinks_causal", "all_edits_decode_shape"}) {
      SCOPED_TRACE(name);
      const io::SafetensorsFile f =
          io::SafetensorsFile::open(std::string(MHA_GOLDEN_DIR) + "/edits/" + name + ".safetensors");
      const Tensor q = f.read_f32("q"), k = f.read_f32("k"), v = f.read_f32("v"), d_out = f.read_f32("d_out");
      const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Tk = k.size(2);
      std::vector<float> slopes, sinks;
      SdpaOptions opt;
      if (f.contains("slopes")) {
        const Tensor t = f.read_f32("slopes");
        slopes.assign(t.data(), t.data() + t.numel());
        EXPECT_EQ(slopes, alibi_slopes(H)) << "the standard schedule is BLOOM's";
        opt.alibi.slopes = slopes;
      }
      if (f.contains("sinks")) {
        const Tensor t = f.read_f32("sinks");
        sinks.assign(t.data(), t.data() + t.numel());
        opt.sinks.logits = sinks;
      }
      opt.softcap = std::stof(f.metadata().at("softcap"));
      const bool causal = f.metadata().at("causal") == "true";
      if (causal) opt.masks.causal = Causal::bottom_right();
      const Tensor want_out = f.read_f32("out"), want_lse = f.read_f32("lse");
      // float32 against float64: a few ε of the score bound (|s| ≤ 4·√d·4 here) per element.
      const double tol = 2e-5;
      for (Backend backend : {Backend::Reference, Backend::Fused}) {
        opt.backend = backend;
        const SdpaResult r = sdpa(q, k, v, opt, Want::Lse);
        EXPECT_TRUE(all_close(r.out, want_out, tol, tol)) << "out";
        EXPECT_TRUE(all_close(r.lse, want_lse, tol, tol)) << "lse";
        const SdpaGradTensors g = sdpa_backward(q, k, v, r.out, d_out, r.lse, opt);
        EXPECT_TRUE(all_close(g.dq, f.read_f32("dq"), 1e-4, 1e-4)) << "dq";
        EXPECT_TRUE(all_close(g.dk, f.read_f32("dk"), 1e-4, 1e-4)) << "dk";
        EXPECT_TRUE(all_close(g.dv, f.read_f32("dv"), 1e-4, 1e-4)) << "dv";
        if (!sinks.empty()) {
          EXPECT_TRUE(all_close(g.dsinks, f.read_f32("dsinks"), 1e-4, 1e-4)) << "dsinks";
        }
      }
      // Decode: the keys in a cache, the queries at positions T_k − T_q … T_k − 1.
      if (!causal) continue;
      KvCacheConfig cc;
      cc.batch = B, cc.kv_heads = k.size(1), cc.head_dim = k.size(3), cc.capacity = Tk;
      KvCache cache(cc);
      cache.append(View4<const float>(k.view4()), View4<const float>(v.view4()));
      CacheAttentionOptions copt;
      copt.alibi = opt.alibi, copt.softcap = opt.softcap, copt.sinks = opt.sinks;
      Tensor out({B, H, Tq, v.size(3)}), lse({B, H, Tq, 1});
      const std::vector<int64_t> start(static_cast<size_t>(B), Tk - Tq);
      attend_cache(View4<const float>(q.view4()), cache, start, copt, out.view4(), lse.view4());
      EXPECT_TRUE(all_close(out, want_out, tol, tol)) << "decode out";
      EXPECT_TRUE(all_close(lse.reshaped({B, H, Tq}), want_lse, tol, tol)) << "decode lse";
    }
  });
}

// ---- the CLI -----------------------------------------------------------------------------------

TEST(ScoreEditsCli, BenchTakesTheFlagsAndRejectsABadCap) {
  const std::string cli = MHA_CLI_PATH;
  const auto r = testing::run_command(cli +
                                      " bench --core --alibi --softcap 2 --sinks --causal --seq 70 --embed-dim 64 "
                                      "--heads 4 --repeat 1 --sgemm-size 64 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"alibi\":true"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"sinks\":true"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"softcap\":2"), std::string::npos) << r.out;
  const auto bad = testing::run_command(cli + " bench --core --softcap -1 --seq 8 --embed-dim 16 --heads 2");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("--softcap must be a finite C > 0"), std::string::npos) << bad.err;
}

TEST(ScoreEditsCli, ForwardReadsTheEditsFromMetadataAndWritesLse) {
  const MultiheadAttention m = edited_module();
  const std::string dir = testing::temp_dir();
  io::SafetensorsWriter w;
  io::add_weights(w, m, io::WeightNames::PyTorch);
  w.set_metadata("need_lse", "true");
  w.set_metadata("is_causal", "true");
  w.write(dir + "/edits_w.safetensors");
  const Tensor x = random_tensor({2, 7, 24}, 91);
  io::SafetensorsWriter in;
  in.add("query", x);
  in.add("key", x);
  in.add("value", x);
  in.write(dir + "/edits_in.safetensors");
  const auto r =
      testing::run_command(std::string(MHA_CLI_PATH) + " forward --weights " + dir + "/edits_w.safetensors --inputs " +
                           dir + "/edits_in.safetensors --output " + dir + "/edits_out.safetensors");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  MhaForwardOptions o;
  o.causal = Causal::top_left();
  o.need_lse = true;
  const MhaOutput want = m.forward(x, x, x, o);
  const io::SafetensorsFile out = io::SafetensorsFile::open(dir + "/edits_out.safetensors");
  EXPECT_TRUE(all_close(out.read_f32("output"), want.output, 1e-6, 1e-6));
  EXPECT_TRUE(all_close(out.read_f32("lse"), want.lse, 1e-6, 1e-6));
}

TEST(ScoreEditsModule, PruningKeepsTheKeptHeadsSlopesAndSinks) {
  const MultiheadAttention m = edited_module();
  const MultiheadAttention p = prune_heads(m, {2, 3});  // the middle K/V group: heads 0, 1, 4, 5 stay
  ASSERT_EQ(p.config().num_heads, 4);
  const std::vector<int64_t> kept{0, 1, 4, 5};
  for (size_t n = 0; n < kept.size(); ++n) {
    EXPECT_EQ(p.config().alibi_slopes[n], m.config().alibi_slopes[static_cast<size_t>(kept[n])]);
    EXPECT_EQ(p.params().sinks.data()[n], m.params().sinks.data()[kept[n]]);
  }
}

}  // namespace
}  // namespace mha
