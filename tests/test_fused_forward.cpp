// The fused forward kernel against the reference oracle, on every compiled SIMD target: lengths
// around the block size, head dims, every mask and their combinations, GQA ratios, strided and
// misaligned views, dropout, lse, bf16 inputs, and bitwise-identical results for 1, 2, 3 threads.
#include <hwy/targets.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/amx.h"
#include "kernels/fused_forward.h"
#include "layers/sdpa_prepare.h"
#include "mha/sdpa.h"
#include "support/test_support.h"

namespace mha {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::f32_lse_tol;
using testing::f32_out_tol;
using testing::for_each_fused_target;
using testing::max_abs;
using testing::random_tensor;
using testing::to_bf16_tensor;
using testing::widened;

constexpr double kEps = std::numeric_limits<float>::epsilon();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int64_t kQBlock = 128;  // the kernel's query block
constexpr int64_t kKBlock = 64;   // and key block

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

/// One request: inputs, masks (owned here so the views in opt stay valid) and options.
struct Case {
  int64_t B = 1, H = 2, KV = 2, Tq = 5, Tk = 5, D = 8, Dv = 8;
  Tensor q, k, v, bias, key_bias;
  BoolTensor allowed, key_padding;
  std::vector<float> slopes, sinks;  // score edits (borrowed by opt when set)
  SdpaOptions opt;
  double slack = 1.0;  // scales the tolerances (2 where score edits add roundings)

  void make_inputs(uint64_t seed) {
    q = random_tensor({B, H, Tq, D}, seed);
    k = random_tensor({B, KV, Tk, D}, seed + 1);
    v = random_tensor({B, KV, Tk, Dv}, seed + 2, -2.0f, 2.0f);
  }
  float scale() const { return opt.scale ? *opt.scale : 1.0f / std::sqrt(static_cast<float>(D)); }
  /// Score magnitude bound: |scale·q·k| (at most the softcap) + |bias| + |key_bias| + ALiBi's
  /// largest term (its slope times the farthest distance, causal offsets up to 30 included);
  /// errors scale with it.
  double score_bound() const {
    double dot = scale() * static_cast<double>(D) * max_abs(q) * max_abs(k);
    if (opt.softcap > 0) dot = std::min(dot, static_cast<double>(opt.softcap));
    const double alibi = slopes.empty() ? 0.0 : slopes[0] * static_cast<double>(Tq + Tk + 30);
    return dot + max_abs(bias) + max_abs(key_bias) + alibi;
  }
  /// float32 tolerance for out: score errors (a few ε·bound) and exp's error move each
  /// probability relatively, the weighted sum adds ε·√T_k; all scaled by max|v|. A sink counts
  /// as one more key.
  double out_tol() const { return f32_out_tol(max_abs(v), Tk + !sinks.empty(), score_bound(), slack); }
  double lse_tol() const { return f32_lse_tol(Tk + !sinks.empty(), score_bound(), slack); }
  /// ALiBi with the standard slopes, softcap c and a sink logit per head (each off when not asked).
  void set_edits(bool alibi, float softcap, bool with_sinks) {
    slopes = alibi ? alibi_slopes(H) : std::vector<float>{};
    opt.alibi.slopes = slopes;
    opt.softcap = softcap;
    sinks.clear();
    for (int64_t h = 0; h < H && with_sinks; ++h) sinks.push_back(0.75f * static_cast<float>(h % 3) - 0.5f);
    opt.sinks.logits = sinks;
    slack = 2.0;
  }
};

struct Result {
  Tensor out, lse;
};

/// out and lse of the case on inputs q, k, v (float32 or bf16 tensors of its shapes).
template <class Inputs>
Result run(const Case& c, const Inputs& q, const Inputs& k, const Inputs& v, Backend backend, int threads = 2) {
  Result r{Tensor({c.B, c.H, c.Tq, c.Dv}), Tensor({c.B, c.H, c.Tq, 1})};
  SdpaOptions opt = c.opt;
  opt.backend = backend;
  opt.threads = threads;
  sdpa(q.view4(), k.view4(), v.view4(), opt, {r.out.view4(), {}, r.lse.view4()});
  return r;
}
Result run(const Case& c, Backend backend, int threads = 2) { return run(c, c.q, c.k, c.v, backend, threads); }

void expect_close(const Case& c, const Result& got, const Result& want, double extra_out_tol = 0) {
  EXPECT_TRUE(all_close(got.out, want.out, c.out_tol() + extra_out_tol, 0));
  // lse: relative to its size (it carries the max score); −inf must match exactly.
  EXPECT_TRUE(all_close(got.lse, want.lse, c.lse_tol(), 4 * kEps));
}

/// Fused on every target against one reference run.
void check_all_targets(const Case& c) {
  const Result want = run(c, Backend::Reference);
  for_each_fused_target([&] { expect_close(c, run(c, Backend::Fused), want); });
}

std::vector<int64_t> lengths(int64_t block) {
  if (kSanitized) return {0, 1, 7, block, block + 1, 3 * block + 5};
  return {0, 1, 2, 7, block - 1, block, block + 1, 3 * block + 5, 250};
}

TEST(FusedForward, LengthsAroundTheBlockSize) {
  for (int64_t tq : lengths(kQBlock))
    for (int64_t tk : lengths(kKBlock))
      for (Causal causal : {Causal::none(), Causal::bottom_right()}) {
        SCOPED_TRACE(::testing::Message() << "T_q " << tq << " T_k " << tk << " causal " << causal.enabled());
        Case c;
        c.H = 2, c.KV = 1, c.Tq = tq, c.Tk = tk, c.D = 16, c.Dv = 24;
        c.opt.masks.causal = causal;
        c.make_inputs(static_cast<uint64_t>(tq * 1000 + tk));
        check_all_targets(c);
        if (HasFatalFailure()) return;
      }
}

TEST(FusedForward, HeadDims) {
  for (int64_t d : {1, 8, 16, 32, 40, 64, 80, 96, 128, 256})
    for (int64_t dv : {d, d == 1 ? int64_t{3} : d / 2 + 1}) {
      SCOPED_TRACE(::testing::Message() << "d " << d << " d_v " << dv);
      Case c;
      c.Tq = kSanitized ? 20 : 70, c.Tk = kSanitized ? 30 : 133, c.D = d, c.Dv = dv;
      c.opt.masks.causal = Causal::top_left();
      c.make_inputs(static_cast<uint64_t>(d * 7 + dv));
      check_all_targets(c);
    }
}

/// Sets a mask configuration on a case with B=2, H=4, KV=2.
struct MaskCase {
  const char* name;
  std::function<void(Case&)> apply;
};

BoolTensor random_bools(const Shape& shape, uint64_t seed, float p_true) {
  const Tensor u = random_tensor(shape, seed, 0.0f, 1.0f);
  BoolTensor b(shape);
  for (int64_t i = 0; i < u.numel(); ++i) b.data()[i] = u.data()[i] < p_true;
  return b;
}

void set_allowed(Case& c, bool broadcast) {
  c.allowed = broadcast ? random_bools({1, 1, c.Tq, c.Tk}, 11, 0.7f) : random_bools({c.B, c.H, c.Tq, c.Tk}, 12, 0.7f);
  const int64_t heads = broadcast ? 1 : c.H, batch = broadcast ? 1 : c.B;
  for (int64_t j = 0; j < c.Tk; ++j) c.allowed.data()[3 * c.Tk + j] = 0;  // (0, 0, 3): fully masked
  c.opt.masks.allowed.view = contiguous_view<const uint8_t>(c.allowed.data(), batch, heads, c.Tq, c.Tk);
}

void set_bias(Case& c, bool broadcast) {
  c.bias = broadcast ? random_tensor({1, 1, c.Tq, c.Tk}, 21) : random_tensor({c.B, c.H, c.Tq, c.Tk}, 22);
  const Tensor u = random_tensor(c.bias.shape(), 23, 0.0f, 1.0f);
  for (int64_t i = 0; i < c.bias.numel(); ++i)
    if (u.data()[i] < 0.2f) c.bias.data()[i] = -kInf;
  for (int64_t j = 0; j < c.Tk; ++j) c.bias.data()[5 * c.Tk + j] = -kInf;  // a fully masked row
  const int64_t heads = broadcast ? 1 : c.H, batch = broadcast ? 1 : c.B;
  c.opt.masks.bias.view = contiguous_view<const float>(c.bias.data(), batch, heads, c.Tq, c.Tk);
}

void set_key_bias(Case& c) {
  c.key_bias = random_tensor({c.B, 1, 1, c.Tk}, 31);
  for (int64_t j = 0; j < c.Tk; j += 5) c.key_bias.data()[j] = -kInf;
  c.opt.masks.key_bias.view = c.key_bias.view4();
}

/// Scores spread (Q times 3) so that rows' maxima move from key block to key block: the online
/// softmax's rescaling (and the one-pass weights' fix-up factors exp(m_j − m)) are then not all 1.
void spread_scores(Case& c) {
  for (int64_t i = 0; i < c.q.numel(); ++i) c.q.data()[i] *= 3.0f;
}

/// check(q, k, v) on the case's float32 inputs, then on them rounded to bf16.
template <class Check>
void with_f32_and_bf16(const Case& c, const Check& check) {
  {
    SCOPED_TRACE("float32");
    check(c.q, c.k, c.v);
  }
  SCOPED_TRACE("bf16");
  check(to_bf16_tensor(c.q), to_bf16_tensor(c.k), to_bf16_tensor(c.v));
}

/// Padding: batch 0 pads its last keys and a few in the middle, batch 1 pads every key. The
/// padded K and V rows hold NaN: if any were read, NaN would reach the output.
void set_key_padding(Case& c) {
  c.key_padding = BoolTensor({c.B, 1, 1, c.Tk});
  for (int64_t j = 0; j < c.Tk; ++j) {
    c.key_padding.data()[j] = j >= c.Tk - 40 || (j % 9 == 4);
    if (c.B > 1) c.key_padding.data()[c.Tk + j] = 1;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t g = 0; g < c.KV; ++g)
      for (int64_t j = 0; j < c.Tk; ++j) {
        if (!c.key_padding.data()[b * c.Tk + j]) continue;
        for (int64_t e = 0; e < c.D; ++e) c.k.at({b, g, j, e}) = nan;
        for (int64_t e = 0; e < c.Dv; ++e) c.v.at({b, g, j, e}) = nan;
      }
  c.opt.masks.key_padding.view = c.key_padding.view4();
}

std::vector<MaskCase> mask_cases() {
  return {
      {"allowed", [](Case& c) { set_allowed(c, false); }},
      {"allowed broadcast", [](Case& c) { set_allowed(c, true); }},
      {"bias with -inf", [](Case& c) { set_bias(c, false); }},
      {"bias broadcast", [](Case& c) { set_bias(c, true); }},
      {"key bias", [](Case& c) { set_key_bias(c); }},
      {"key padding (NaN in padded rows)", [](Case& c) { set_key_padding(c); }},
      {"causal top-left", [](Case& c) { c.opt.masks.causal = Causal::top_left(); }},
      {"causal bottom-right", [](Case& c) { c.opt.masks.causal = Causal::bottom_right(); }},
      {"causal offset -5", [](Case& c) { c.opt.masks.causal = Causal::with_offset(-5); }},
      {"causal offset 30", [](Case& c) { c.opt.masks.causal = Causal::with_offset(30); }},
      {"causal offset hides all", [](Case& c) { c.opt.masks.causal = Causal::with_offset(-1000); }},
      {"window 1", [](Case& c) { c.opt.masks.causal = Causal::bottom_right().with_window(1); }},
      {"window 17 top-left", [](Case& c) { c.opt.masks.causal = Causal::top_left().with_window(17); }},
      {"window 70 bottom-right", [](Case& c) { c.opt.masks.causal = Causal::bottom_right().with_window(70); }},
      {"scale override", [](Case& c) { c.opt.scale = 0.5f; }},
      {"everything",
       [](Case& c) {
         set_allowed(c, false);
         set_bias(c, true);
         set_key_bias(c);
         set_key_padding(c);
         c.opt.masks.causal = Causal::bottom_right().with_window(50);
       }},
      {"padding + causal + dropout",
       [](Case& c) {
         set_key_padding(c);
         c.opt.masks.causal = Causal::top_left();
         c.opt.dropout = {0.3f, 1234};
       }},
  };
}

TEST(FusedForward, EveryMaskKindAndCombination) {
  for (const MaskCase& mc : mask_cases())
    for (int64_t tq : {int64_t{70}, int64_t{150}}) {
      SCOPED_TRACE(::testing::Message() << mc.name << ", T_q " << tq);
      Case c;
      c.B = 2, c.H = 4, c.KV = 2, c.Tq = tq, c.Tk = 150, c.D = 32, c.Dv = 16;
      c.make_inputs(7);
      mc.apply(c);
      check_all_targets(c);
    }
}

TEST(FusedForward, GroupedQueryRatios) {
  for (int64_t kv : {8, 4, 2, 1}) {
    SCOPED_TRACE(::testing::Message() << "kv heads " << kv);
    Case c;
    c.B = 1, c.H = 8, c.KV = kv, c.Tq = 67, c.Tk = 90, c.D = 16, c.Dv = 16;
    c.opt.masks.causal = Causal::bottom_right();
    c.make_inputs(static_cast<uint64_t>(kv));
    check_all_targets(c);
  }
}

TEST(FusedForward, DropoutMatchesTheReference) {
  for (float p : {0.1f, 0.5f}) {
    Case c;
    c.B = 2, c.H = 2, c.KV = 1, c.Tq = 80, c.Tk = 130, c.D = 24, c.Dv = 20;
    c.opt.dropout = {p, 99};
    c.make_inputs(3);
    // Kept weights are scaled by 1/(1 − p), and so is the rounding error.
    const Result want = run(c, Backend::Reference);
    for_each_fused_target([&] { expect_close(c, run(c, Backend::Fused), want, c.out_tol() / (1.0 - p)); });
  }
}

/// A window into a bigger buffer: offset by one element (misaligned), rows further apart than
/// their length, elements `step` apart; of float32 (gather() reads it back) or bf16 inputs.
template <class T>
struct StridedOf {
  std::vector<T> buf;
  View4<T> view;
  StridedOf(const Shape& s, int64_t step) {
    const int64_t row = s[3] * step + 3;
    buf.assign(static_cast<size_t>(1 + s[0] * s[1] * s[2] * row), fill());
    view = {buf.data() + 1, {s[0], s[1], s[2], s[3]}, {s[1] * s[2] * row, s[2] * row, row, step}};
  }
  StridedOf(const BasicTensor<T>& t, int64_t step) : StridedOf(t.shape(), step) {
    for (int64_t a = 0; a < t.size(0); ++a)
      for (int64_t b = 0; b < t.size(1); ++b)
        for (int64_t c = 0; c < t.size(2); ++c)
          for (int64_t e = 0; e < t.size(3); ++e) view(a, b, c, e) = t.at({a, b, c, e});
  }
  static T fill() {
    if constexpr (std::is_same_v<T, bf16>)
      return to_bf16(-7.0f);
    else
      return -7.0f;
  }
  Tensor gather() const {
    Tensor t({view.shape[0], view.shape[1], view.shape[2], view.shape[3]});
    for (int64_t a = 0; a < view.shape[0]; ++a)
      for (int64_t b = 0; b < view.shape[1]; ++b)
        for (int64_t c = 0; c < view.shape[2]; ++c)
          for (int64_t e = 0; e < view.shape[3]; ++e) t.at({a, b, c, e}) = view(a, b, c, e);
    return t;
  }
};
using Strided = StridedOf<float>;

TEST(FusedForward, StridedAndMisalignedViews) {
  Case c;
  c.B = 2, c.H = 4, c.KV = 2, c.Tq = 70, c.Tk = 100, c.D = 20, c.Dv = 12;
  c.opt.masks.causal = Causal::bottom_right();
  c.make_inputs(5);
  set_key_padding(c);
  const Result want = run(c, Backend::Reference);
  for_each_fused_target([&] {
    const Result contiguous = run(c, Backend::Fused);
    expect_close(c, contiguous, want);
    for (int64_t step : {1, 2}) {
      const Strided q(c.q, step), k(c.k, step), v(c.v, step + 1);
      Strided out(Shape{c.B, c.H, c.Tq, c.Dv}, step), lse(Shape{c.B, c.H, c.Tq, 1}, 2);
      SdpaOptions opt = c.opt;
      opt.backend = Backend::Fused;
      sdpa(q.view, k.view, v.view, opt, {out.view, {}, lse.view});
      // Packing makes the arithmetic independent of the layout: bitwise the same result.
      EXPECT_TRUE(bitwise_equal(out.gather(), contiguous.out)) << "step " << step;
      EXPECT_TRUE(bitwise_equal(lse.gather(), contiguous.lse)) << "step " << step;
    }
    // bf16 inputs are copied (into bf16 pairs for the dot-product tiles, or widened) from any
    // strides and alignment: the bits of contiguous ones.
    const BF16Tensor qb = to_bf16_tensor(c.q), kb = to_bf16_tensor(c.k), vb = to_bf16_tensor(c.v);
    const Result contiguous16 = run(c, qb, kb, vb, Backend::Fused);
    for (int64_t step : {1, 2}) {
      const StridedOf<bf16> q(qb, step), k(kb, step), v(vb, step + 1);
      Strided out(Shape{c.B, c.H, c.Tq, c.Dv}, step), lse(Shape{c.B, c.H, c.Tq, 1}, 2);
      SdpaOptions opt = c.opt;
      opt.backend = Backend::Fused;
      sdpa(View4<const bf16>(q.view), View4<const bf16>(k.view), View4<const bf16>(v.view), opt,
           {out.view, {}, lse.view});
      EXPECT_TRUE(bitwise_equal(out.gather(), contiguous16.out)) << "bf16, step " << step;
      EXPECT_TRUE(bitwise_equal(lse.gather(), contiguous16.lse)) << "bf16, step " << step;
    }
  });
}

/// float32 Q and V with contiguous rows are read where they lie (V when d_v is whole vectors and
/// no key is padded or biased), else copied and packed: the same values in the same order, so the
/// same bits, for rows of any stride and alignment, partial key blocks and GQA included.
TEST(FusedForward, QAndVReadInPlaceGiveTheSameBitsAsPacked) {
  for (int64_t dv : {16, 48, 64})
    for (bool causal : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "d_v " << dv << " causal " << causal);
      Case c;
      c.B = 2, c.H = 4, c.KV = 2, c.Tq = 150, c.Tk = 197, c.D = 64, c.Dv = dv;
      if (causal) c.opt.masks.causal = Causal::bottom_right();
      c.make_inputs(static_cast<uint64_t>(dv + causal));
      const Result want = run(c, Backend::Reference);
      for_each_fused_target([&] {
        const Result contiguous = run(c, Backend::Fused);
        expect_close(c, contiguous, want);
        for (int64_t step : {1, 2}) {  // rows 3 floats apart, misaligned; then strided elements (packed)
          const Strided q(c.q, step), k(c.k, step), v(c.v, step);
          Strided out(Shape{c.B, c.H, c.Tq, c.Dv}, 1), lse(Shape{c.B, c.H, c.Tq, 1}, 1);
          SdpaOptions opt = c.opt;
          opt.backend = Backend::Fused;
          sdpa(q.view, k.view, v.view, opt, {out.view, {}, lse.view});
          EXPECT_TRUE(bitwise_equal(out.gather(), contiguous.out)) << "step " << step;
          EXPECT_TRUE(bitwise_equal(lse.gather(), contiguous.lse)) << "step " << step;
        }
      });
      if (HasFailure()) return;
    }
}

TEST(FusedForward, ThreadCountDoesNotChangeABit) {
  Case c;
  c.B = 2, c.H = 4, c.KV = 2, c.Tq = kSanitized ? 140 : 300, c.Tk = kSanitized ? 100 : 260, c.D = 64, c.Dv = 64;
  c.opt.masks.causal = Causal::bottom_right();
  c.opt.dropout = {0.2f, 5};
  c.make_inputs(9);
  for_each_fused_target([&] {
    const Result one = run(c, Backend::Fused, 1);
    for (int threads : {2, 3}) {
      const Result many = run(c, Backend::Fused, threads);
      EXPECT_TRUE(bitwise_equal(many.out, one.out)) << threads << " threads";
      EXPECT_TRUE(bitwise_equal(many.lse, one.lse)) << threads << " threads";
    }
  });
}

// Every mask kind and combination (per-element masks, fully masked rows, padded keys holding NaN,
// causal offsets and windows, dropout), float32 and bf16, on every target: 1, 2 and 3 threads give
// the same bits. Two query blocks per (batch, kv-head), so threads keep the key blocks they packed
// and take the items in any order.
TEST(FusedForward, EveryMaskKindGivesTheSameBitsOnAnyThreadCount) {
  for (const MaskCase& mc : mask_cases()) {
    SCOPED_TRACE(mc.name);
    Case c;
    c.B = 2, c.H = 4, c.KV = 2, c.Tq = kQBlock + 22, c.Tk = 150, c.D = 32, c.Dv = 16;
    c.make_inputs(71);
    mc.apply(c);
    with_f32_and_bf16(c, [&](const auto& q, const auto& k, const auto& v) {
      for_each_fused_target([&] {
        const Result one = run(c, q, k, v, Backend::Fused, 1);
        for (int threads : {2, 3}) {
          const Result many = run(c, q, k, v, Backend::Fused, threads);
          EXPECT_TRUE(bitwise_equal(many.out, one.out)) << threads << " threads";
          EXPECT_TRUE(bitwise_equal(many.lse, one.lse)) << threads << " threads";
        }
      });
    });
    if (HasFailure()) return;
  }
}

// Many short sequences (B = 32): items are taken by whichever thread is free, causal ones last
// query block first; whichever thread runs an item, its rows get the same bits. Each batch pads
// a different number of its last keys (NaN behind the padding); the last pads every key.
TEST(FusedForward, ManyShortSequencesGiveTheSameBitsOnAnyThreadCount) {
  for (const int64_t T : {kQBlock, 2 * kQBlock + 3}) {
    for (const Causal causal : {Causal::none(), Causal::top_left(), Causal::bottom_right()}) {
      Case c;
      c.B = kSanitized ? 9 : 32, c.H = 2, c.KV = 1, c.Tq = T, c.Tk = T + (causal.enabled() ? 5 : 0), c.D = 16,
      c.Dv = 16;
      c.opt.masks.causal = causal;
      c.make_inputs(static_cast<uint64_t>(T) + 3);
      c.key_padding = BoolTensor({c.B, 1, 1, c.Tk});
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t j = 0; j < c.Tk; ++j) {
          const bool pad = b == c.B - 1 || j >= c.Tk - (b * 7) % c.Tk;
          c.key_padding.data()[b * c.Tk + j] = pad;
          for (int64_t g = 0; g < c.KV && pad; ++g)
            for (int64_t e = 0; e < c.D; ++e) c.k.at({b, g, j, e}) = c.v.at({b, g, j, e}) = kNaN;
        }
      c.opt.masks.key_padding.view = c.key_padding.view4();
      for_each_fused_target([&] {
        const Result one = run(c, Backend::Fused, 1);
        EXPECT_FALSE(
            std::any_of(one.out.values().begin(), one.out.values().end(), [](float x) { return std::isnan(x); }));
        for (int threads : {2, 3}) {
          const Result many = run(c, Backend::Fused, threads);
          EXPECT_TRUE(bitwise_equal(many.out, one.out)) << threads << " threads, T=" << T;
          EXPECT_TRUE(bitwise_equal(many.lse, one.lse)) << threads << " threads, T=" << T;
        }
      });
    }
  }
}

// The per-thread busy time a benchmark asks for: one entry per thread, added by every call.
TEST(FusedForward, ThreadStatsCountEachThreadsBusyTime) {
  Case c;
  c.B = 8, c.H = 2, c.KV = 2, c.Tq = 2 * kQBlock, c.Tk = 2 * kQBlock, c.D = 16, c.Dv = 16;
  c.make_inputs(5);
  SdpaThreadStats stats;
  c.opt.thread_stats = &stats;
  for (int call = 1; call <= 2; ++call) {
    run(c, Backend::Fused, 3);
    EXPECT_EQ(stats.calls, call);
    ASSERT_EQ(stats.busy_ms.size(), 3u);
    for (double ms : stats.busy_ms) EXPECT_TRUE(std::isfinite(ms) && ms >= 0.0) << ms;
    EXPECT_GT(stats.busy_ms[0] + stats.busy_ms[1] + stats.busy_ms[2], 0.0);
  }
  // The reference path has no work items: it counts the call, and no thread time.
  SdpaThreadStats ref;
  c.opt.thread_stats = &ref;
  run(c, Backend::Reference, 2);
  EXPECT_EQ(ref.calls, 1);
  EXPECT_EQ(ref.busy_ms, std::vector<double>(2, 0.0));
}

// A team no larger than the work: one item asked for 1024 threads started (or woke) 1024 of them
// for one to work (~20 ms a call). Only threads that ran can have busy time; the result is the
// same bits as on one thread.
TEST(FusedForward, TeamIsNoLargerThanTheWork) {
  Case c;
  c.B = 1, c.H = 1, c.KV = 1, c.Tq = 5, c.Tk = 40, c.D = 16, c.Dv = 16;
  c.make_inputs(6);
  SdpaThreadStats stats;
  c.opt.thread_stats = &stats;
  const Result many = run(c, Backend::Fused, 64);
  ASSERT_EQ(stats.busy_ms.size(), 64u);
  for (size_t t = 1; t < stats.busy_ms.size(); ++t) EXPECT_EQ(stats.busy_ms[t], 0.0) << "thread " << t;
  c.opt.thread_stats = nullptr;
  EXPECT_TRUE(bitwise_equal(many.out, run(c, Backend::Fused, 1).out));
}

/// The fused kernel on the case's inputs, or on them rounded to bf16.
Result run_fused(const Case& c, bool bf16, int threads = 2) {
  if (!bf16) return run(c, Backend::Fused, threads);
  return run(c, to_bf16_tensor(c.q), to_bf16_tensor(c.k), to_bf16_tensor(c.v), Backend::Fused, threads);
}

/// Rows [i0, i0 + n) of a request as a request of their own (n ≤ one query block, so the kernel
/// packs K/V per item instead of once per call), with the causal rule shifted to match.
Result rows_alone(const Case& c, int64_t i0, int64_t n, Causal causal, bool bf16 = false) {
  Case part = c;
  part.Tq = n;
  part.q = Tensor({c.B, c.H, n, c.D});
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t x = 0; x < c.D; ++x) part.q.view4()(b, h, i, x) = c.q.view4()(b, h, i0 + i, x);
  part.opt.masks.causal = causal;
  return run_fused(part, bf16);
}

/// Whether `part` (rows_alone from row i0) has the bits of those rows of `whole`, out and lse.
::testing::AssertionResult same_bits_as_rows_alone(const Case& c, const Result& whole, int64_t i0, const Result& part) {
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < part.out.size(2); ++i) {
        for (int64_t x = 0; x < c.Dv; ++x)
          if (std::bit_cast<uint32_t>(part.out.view4()(b, h, i, x)) !=
              std::bit_cast<uint32_t>(whole.out.view4()(b, h, i0 + i, x)))
            return ::testing::AssertionFailure() << "out: b " << b << " h " << h << " row " << i0 + i << " x " << x;
        if (std::bit_cast<uint32_t>(part.lse.view4()(b, h, i, 0)) !=
            std::bit_cast<uint32_t>(whole.lse.view4()(b, h, i0 + i, 0)))
          return ::testing::AssertionFailure() << "lse: b " << b << " h " << h << " row " << i0 + i;
      }
  return ::testing::AssertionSuccess();
}

// From 8 query blocks (1024 queries) on the kernel packs each K/V block once per call
// (prepacked) and every item reads it, unless a thread's kept blocks hold them (up to 1 MiB: here
// d = 12 and 1099 keys); a single block packs per item. Each must give the same bits, including a
// causal diagonal cutting a key block short, odd T_k, key padding and a key bias — and a NaN in
// the V row of a key that rows of a causal run cannot see: which of them it reaches (those of its
// own piece of P·V rows) is fixed by the shape and the mask, not by how the blocks were packed.
TEST(FusedForward, PrepackedKeyBlocksGiveTheSameBitsAsPerItemPacking) {
  for (bool causal : {false, true})
    for (int64_t d : {12, 64}) {
      Case c;
      const int64_t tk = d == 64 ? 16 * kQBlock + 70 : 8 * kQBlock + 5 + 70;  // at d = 64 over 1 MiB: prepacked
      c.B = 1, c.H = 2, c.KV = 1, c.Tq = 8 * kQBlock + 5, c.Tk = tk, c.D = d, c.Dv = d == 64 ? 64 : 20;
      c.make_inputs(causal ? 31 : 37);
      set_key_padding(c);  // NaN in the padded K/V rows: a prepacked block must not read them either
      set_key_bias(c);
      const int64_t offset = c.Tk - c.Tq;  // bottom-right alignment
      c.opt.masks.causal = causal ? Causal::bottom_right() : Causal::none();
      if (causal) {
        // Row 394 is the first to see this key (neither padded nor biased away): rows 384–393
        // hide it, in the same 16-row run; in the same piece of P·V rows only rows 390–393.
        const int64_t key = offset + 3 * kQBlock + 10;
        ASSERT_TRUE(key % 9 != 4 && key % 5 != 0 && key < c.Tk - 40);
        for (int64_t x = 0; x < c.Dv; ++x) c.v.at({0, 0, key, x}) = kNaN;
      }
      for_each_fused_target([&] {
        const Result whole = run(c, Backend::Fused);
        for (int64_t i0 = 0; i0 < c.Tq; i0 += kQBlock) {
          const int64_t n = std::min(kQBlock, c.Tq - i0);
          const Result part = rows_alone(c, i0, n, causal ? Causal::with_offset(offset + i0) : Causal::none());
          ASSERT_TRUE(same_bits_as_rows_alone(c, whole, i0, part)) << "causal " << causal << " d " << d;
        }
      });
    }
}

// Prepacked K/V from bf16 inputs (blocks of bf16 pairs for the dot-product tiles where the CPU
// has them) gives the bits of per-item packing too; and the blocks, packed by a static share of
// the threads before the items, give the same bits on 1, 2 and 3 threads, float32 and bf16. A
// causal diagonal, padded keys holding NaN and a key bias; d = 64 over 1 MiB of key blocks.
TEST(FusedForward, PrepackedKeyBlocksGiveTheSameBitsInBf16AndOnAnyThreadCount) {
  Case c;
  c.B = 1, c.H = 1, c.KV = 1, c.Tq = 8 * kQBlock + 5, c.Tk = 16 * kQBlock + 70, c.D = 64, c.Dv = 64;
  c.make_inputs(43);
  set_key_padding(c);
  set_key_bias(c);
  c.opt.masks.causal = Causal::bottom_right();
  const int64_t offset = c.Tk - c.Tq;
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "float32");
    for_each_fused_target([&] {
      const Result whole = run_fused(c, bf16);
      for (int64_t i0 = 0; i0 < c.Tq && bf16; i0 += kQBlock) {  // float32: the test above
        const Result part = rows_alone(c, i0, std::min(kQBlock, c.Tq - i0), Causal::with_offset(offset + i0), true);
        ASSERT_TRUE(same_bits_as_rows_alone(c, whole, i0, part));
      }
      for (const int threads : {1, 3}) {
        const Result r = run_fused(c, bf16, threads);
        EXPECT_TRUE(bitwise_equal(r.out, whole.out) && bitwise_equal(r.lse, whole.lse)) << threads << " threads";
      }
    });
  }
}

// From 2 to 7 query blocks each thread keeps the K/V blocks it packed for its last (batch,
// kv-head) and the next item of that pair reads them; a call of one query block packs per item.
// Both must give the same bits: several pairs (a thread's kept blocks belong to one at a time),
// any thread count, K/V packed or V read in place, a causal diagonal or a window's lower edge
// cutting blocks short (the window's blocks start off the block grid), padded keys and a key bias.
TEST(FusedForward, KeptKeyBlocksGiveTheSameBitsAsPerItemPacking) {
  struct Variant {
    int64_t Tk, D, Dv;
    bool key_masks;
    Causal causal;
  };
  const int64_t Tq = 3 * kQBlock + 5;
  const std::vector<Variant> variants = {
      {Tq + 70, 12, 20, true, Causal::bottom_right()},
      {Tq + 70, 16, 16, false, Causal::none()},  // V read in place
      {2 * kKBlock + 3, 16, 16, false, Causal::top_left()},
      {Tq, 16, 32, true, Causal::top_left().with_window(150)},
      {Tq, 16, 16, false, Causal::bottom_right().with_window(70)},
      // 1,100 keys: an item whose thread kept every one of its ≥ 16 blocks runs its products
      // whole, without the drip's chunks (all_kept in run_group).
      {1100, 16, 16, true, Causal::bottom_right()},
  };
  for (const Variant& var : variants) {
    Case c;
    c.B = 3, c.H = 4, c.KV = 2, c.Tq = Tq, c.Tk = var.Tk, c.D = var.D, c.Dv = var.Dv;
    c.make_inputs(static_cast<uint64_t>(41 + var.Tk + var.Dv));
    if (var.key_masks) {
      set_key_padding(c);  // NaN in the padded K/V rows: a kept block must not read them either
      set_key_bias(c);
    }
    c.opt.masks.causal = var.causal;
    const int64_t offset = var.causal.enabled() ? var.causal.offset_for(c.Tq, c.Tk) : 0;
    SCOPED_TRACE(::testing::Message() << "Tk " << var.Tk << " D " << var.D << " Dv " << var.Dv << " window "
                                      << var.causal.window);
    for_each_fused_target([&] {
      std::vector<Result> parts;
      for (int64_t i0 = 0; i0 < c.Tq; i0 += kQBlock) {
        Causal shifted = Causal::with_offset(offset + i0).with_window(var.causal.window);
        parts.push_back(
            rows_alone(c, i0, std::min(kQBlock, c.Tq - i0), var.causal.enabled() ? shifted : Causal::none()));
      }
      for (int threads : {1, 2, 3}) {
        const Result whole = run(c, Backend::Fused, threads);
        for (int64_t i0 = 0; i0 < c.Tq; i0 += kQBlock)
          ASSERT_TRUE(same_bits_as_rows_alone(c, whole, i0, parts[static_cast<size_t>(i0 / kQBlock)]))
              << threads << " threads";
      }
    });
  }
}

// ---- bfloat16 ------------------------------------------------------------------------------

/// bf16 inputs against the reference on the same values widened to float. The inputs are exact,
/// so Q·Kᵀ is as accurate as in float32; P·V may round P to bf16 (relative error ≤ 2⁻⁹ per
/// probability), which moves the output by at most 2⁻⁹·Σp|v| ≤ 2⁻⁹·max|v|, doubled for margin.
void check_bf16(Case& c) {
  const BF16Tensor qb = to_bf16_tensor(c.q), kb = to_bf16_tensor(c.k), vb = to_bf16_tensor(c.v);
  c.q = widened(qb), c.k = widened(kb), c.v = widened(vb);
  const Result want = run(c, Backend::Reference);
  const double bf16_tol = 2.0 * std::ldexp(1.0, -9) * max_abs(c.v);
  for_each_fused_target([&] {
    Result got{Tensor({c.B, c.H, c.Tq, c.Dv}), Tensor({c.B, c.H, c.Tq, 1})};
    SdpaOptions opt = c.opt;
    opt.backend = Backend::Fused;
    sdpa(qb.view4(), kb.view4(), vb.view4(), opt, {got.out.view4(), {}, got.lse.view4()});
    expect_close(c, got, want, bf16_tol);
  });
}

TEST(FusedForward, Bf16MatchesTheReference) {
  // 32, 64 and 128 run on AMX tiles where the CPU has them (whole tiles of 32 dims), the others
  // on vdpbf16ps; d_v = d + 1 leaves an odd column tile.
  for (int64_t d : {1, 7, 32, 64, 80, 128}) {
    for (const MaskCase& mc : mask_cases()) {
      if (d != 64 && std::string(mc.name) != "everything") continue;
      SCOPED_TRACE(::testing::Message() << mc.name << ", d " << d);
      Case c;
      c.B = 2, c.H = 4, c.KV = 2, c.Tq = 70, c.Tk = kSanitized ? 80 : 150, c.D = d, c.Dv = d + 1;
      c.make_inputs(13);
      mc.apply(c);
      check_bf16(c);
    }
  }
}

TEST(FusedForward, Bf16Lengths) {
  // 3·kQBlock + 5 queries: 4 items per (batch, kv-head), which keep their packed blocks (bf16
  // pairs; an odd last block short of its width is packed per item).
  for (int64_t tq : {int64_t{0}, int64_t{1}, int64_t{65}, 3 * kQBlock + 5})
    for (int64_t tk : {0, 1, 2, 63, 197}) {
      SCOPED_TRACE(::testing::Message() << "T_q " << tq << " T_k " << tk);
      Case c;
      c.B = 2, c.H = 4, c.KV = 1, c.Tq = tq, c.Tk = tk, c.D = 32, c.Dv = 48;
      c.opt.masks.causal = Causal::bottom_right();
      c.make_inputs(17);
      check_bf16(c);
    }
}

// Score edits meet every mask kind: a softcapped, ALiBi-shifted score then takes the per-element
// masks (allowed, an additive bias with −inf, a key bias), padding, causal offsets and windows, and
// a sink joins the denominator of rows that see nothing else, as in the reference; on every target,
// float32 and bf16, across the key and query block edges.
TEST(FusedForward, ScoreEditsUnderEveryMaskKindMatchTheReference) {
  struct Edits {
    bool alibi;
    float softcap;
    bool sinks;
  };
  for (const Edits e : {Edits{false, 2.0f, true}, Edits{true, 1.5f, true}})
    for (const MaskCase& mc : mask_cases()) {
      SCOPED_TRACE(::testing::Message() << mc.name << ", alibi " << e.alibi << " softcap " << e.softcap << " sinks "
                                        << e.sinks);
      Case c;
      c.B = 2, c.H = 4, c.KV = 2, c.Tq = kQBlock + 3, c.Tk = kKBlock + 5, c.D = 16, c.Dv = 12;
      c.make_inputs(83);
      spread_scores(c);
      mc.apply(c);
      c.set_edits(e.alibi, e.softcap, e.sinks);
      check_all_targets(c);
      check_bf16(c);
      if (HasFailure()) return;
    }
}

/// Where no block needs a per-element mask, the AVX-512 targets' softmax runs 16 rows at a time
/// and AVX2's 8, the score tiles having scaled S and taken each row's max (softmax_rows16, bf16
/// writing P as bf16 pairs directly; softmax_rows8); it must be bitwise the general softmax. An all-true `allowed` mask
/// sends every block through the general one without changing a score, so out and lse must be identical, NaN rows,
/// fully padded rows, partial row groups and partial register tiles included.
template <class Inputs>
void expect_fast_softmax_is_the_general_one(const Case& c, const Inputs& q, const Inputs& k, const Inputs& v) {
  BoolTensor all({c.B, c.H, c.Tq, c.Tk});
  std::fill(all.data(), all.data() + all.numel(), uint8_t{1});
  for_each_fused_target([&] {
    Result fast{Tensor({c.B, c.H, c.Tq, c.Dv}), Tensor({c.B, c.H, c.Tq, 1})};
    Result general{Tensor({c.B, c.H, c.Tq, c.Dv}), Tensor({c.B, c.H, c.Tq, 1})};
    SdpaOptions opt = c.opt;
    opt.backend = Backend::Fused;
    sdpa(q.view4(), k.view4(), v.view4(), opt, {fast.out.view4(), {}, fast.lse.view4()});
    opt.masks.allowed.view = contiguous_view<const uint8_t>(all.data(), c.B, c.H, c.Tq, c.Tk);
    sdpa(q.view4(), k.view4(), v.view4(), opt, {general.out.view4(), {}, general.lse.view4()});
    EXPECT_TRUE(bitwise_equal(fast.out, general.out));
    EXPECT_TRUE(bitwise_equal(fast.lse, general.lse));
  });
}

TEST(FusedForward, FastSoftmaxIsBitwiseTheGeneralOne) {
  for (int64_t tq : {1, 7, 15, 17, 130})
    for (int64_t tk : {1, 31, 64, 65, 150})
      for (int variant = 0; variant < 4; ++variant) {  // plain; key padding + causal, odd d; NaN in Q; d = 1
        SCOPED_TRACE(::testing::Message() << "T_q " << tq << " T_k " << tk << " variant " << variant);
        Case c;
        c.B = variant == 1 ? 2 : 1, c.H = 4, c.KV = 2, c.Tq = tq, c.Tk = tk, c.Dv = 33;
        c.D = variant == 1 ? 7 : variant == 3 ? 1 : 64;
        c.make_inputs(static_cast<uint64_t>(tq * 100 + tk + variant));
        spread_scores(c);
        if (variant == 1) {
          set_key_padding(c);
          c.opt.masks.causal = Causal::bottom_right();
        }
        if (variant == 2) c.q.at({0, 1, tq / 2, 3}) = std::numeric_limits<float>::quiet_NaN();
        with_f32_and_bf16(c, [&](const auto& q, const auto& k, const auto& v) {
          expect_fast_softmax_is_the_general_one(c, q, k, v);
        });
        if (HasFailure()) return;
      }
}

// Under a causal mask (and window) a query block's rows meet each key block in runs of 16: rows
// that see none of its keys skip it, rows that see all take the unmasked softmax, and the rest
// stop their products at the last key any of them sees. Every such split must give the bits of the
// element-by-element path, which scores each row over the whole block (P·V, there as here, stops
// for each piece of 6 rows at the last key the piece sees).
TEST(FusedForward, CausalRowRunsAreBitwiseTheMaskedPath) {
  const Causal kinds[] = {Causal::top_left(), Causal::bottom_right(), Causal::top_left().with_window(23),
                          Causal::bottom_right().with_window(70), Causal::with_offset(-40)};
  for (int64_t tq : {1, 16, 17, 100, 128, 129, 300})
    for (int64_t tk : {1, 64, 65, 200})
      for (size_t kind = 0; kind < std::size(kinds); ++kind) {
        SCOPED_TRACE(::testing::Message() << "T_q " << tq << " T_k " << tk << " causal kind " << kind);
        Case c;
        c.H = 4, c.KV = 2, c.Tq = tq, c.Tk = tk, c.D = 64, c.Dv = 40;
        c.opt.masks.causal = kinds[kind];
        c.make_inputs(static_cast<uint64_t>(tq * 1000 + tk * 10 + kind));
        spread_scores(c);
        with_f32_and_bf16(c, [&](const auto& q, const auto& k, const auto& v) {
          expect_fast_softmax_is_the_general_one(c, q, k, v);
        });
        if (HasFailure()) return;
      }
}

// A key hidden by the causal rule from a whole run of rows is not read for them: a NaN in its V
// row reaches at most the rows of its own 16-row run (docs/semantics.md: keys hidden from some
// queries may reach other rows of the same tile), never rows a run or more before it; in float32
// only those of its own piece of 6 P·V rows. bf16 too: its products (vdpbf16ps pairs, AMX tiles
// of 32 keys) stop at the run's last key pair.
TEST(FusedForward, CausalRowsBeforeAKeysRunNeverReadIt) {
  for (bool bf16 : {false, true})
    for (int64_t t : {100, 128, 200}) {
      SCOPED_TRACE(::testing::Message() << "T " << t << (bf16 ? " bf16" : " f32"));
      Case c;
      c.H = 2, c.KV = 1, c.Tq = t, c.Tk = t, c.D = 32, c.Dv = 32;
      c.opt.masks.causal = Causal::top_left();
      c.make_inputs(static_cast<uint64_t>(t));
      const int64_t key = t - 3;  // V row of a late key: NaN
      for (int64_t x = 0; x < c.Dv; ++x) c.v.at({0, 0, key, x}) = kNaN;
      // Rows of the runs before the key's own; in float32 of the pieces before its own.
      const int64_t clean_rows = bf16 ? key / 16 * 16 : key / 16 * 16 + key % 16 / 6 * 6;
      const BF16Tensor qb = to_bf16_tensor(c.q), kb = to_bf16_tensor(c.k), vb = to_bf16_tensor(c.v);
      // Which rows the NaN reaches depends on the shapes and masks alone: the same for any thread count.
      for_each_fused_target([&] {
        for (int threads : {1, 2, 3}) {
          SCOPED_TRACE(::testing::Message() << threads << " threads");
          Result r = run(c, Backend::Fused, threads);
          if (bf16) {
            SdpaOptions opt = c.opt;
            opt.backend = Backend::Fused;
            opt.threads = threads;
            sdpa(qb.view4(), kb.view4(), vb.view4(), opt, {r.out.view4(), {}, r.lse.view4()});
          }
          for (int64_t h = 0; h < c.H; ++h) {
            for (int64_t i = 0; i < clean_rows; ++i)
              for (int64_t x = 0; x < c.Dv; ++x) ASSERT_TRUE(std::isfinite(r.out.at({0, h, i, x}))) << h << " " << i;
            for (int64_t i = key; i < t; ++i) EXPECT_TRUE(std::isnan(r.out.at({0, h, i, 0}))) << h << " " << i;
          }
        }
      });
    }
}

TEST(FusedForward, Bf16UsesTheDotProductWhereTheCpuHasIt) {
  const bool avx3_dl = (hwy::SupportedTargets() & HWY_AVX3_DL) != 0 && __builtin_cpu_supports("avx512bf16");
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_EQ(kernels::fused_bf16_uses_dot_instructions(), avx3_dl);
  std::string names;
  for (int64_t t : kernels::fused_compiled_targets()) names += std::string(hwy::TargetName(t)) + " ";
  std::printf("compiled targets: %s; dispatching to %s; bf16 dot product: %s\n", names.c_str(),
              hwy::TargetName(kernels::fused_dispatch_target()), avx3_dl ? "yes" : "no");
}

// The bf16 path's exp (exp_before_bf16): within its stated error of exp(x − m) wherever the result
// is a normal float, exactly 0 below that and for −inf, NaN kept. On every target: only AVX3_DL
// runs it in the kernel, but the portable form is held to the same bound.
TEST(FusedForward, Bf16ExpWithinItsErrorZeroBelowAndNaNKept) {
  std::vector<float> x;
  for (double z = -90.0; z <= 0.01; z += 1.0 / 1024 + 1e-7) x.push_back(static_cast<float>(z));
  // One period of the polynomial (t = (x − m)·log2 e in [−1, 0]) densely: 2²⁰ points find its
  // largest error to within a hair of the fitted 2.97e-6.
  for (int64_t i = 0; i <= (1 << 20); ++i) x.push_back(static_cast<float>(-0.6931471805599453 * i / (1 << 20)));
  for (float z : {0.0f, -0.0f, 1e-7f, -1e-30f, -87.3f, -87.34f, -87.35f, -88.0f, -103.0f, -1e30f, -kInf, kNaN})
    x.push_back(z);
  for_each_fused_target([&] {
    for (float m : {0.0f, 3.7f, -12.5f, 40.25f}) {
      SCOPED_TRACE(::testing::Message() << "m " << m);
      std::vector<float> xs(x.size()), got(x.size());
      for (size_t i = 0; i < x.size(); ++i) xs[i] = x[i] + m;  // x − m ≈ the sweep (NaN, −inf kept)
      kernels::fused_exp_before_bf16(xs.data(), m, got.data(), static_cast<int64_t>(xs.size()));
      int bad = 0;
      double worst = 0.0;  // over one period (|x − m| ≤ ln 2), where forming t adds next to nothing
      for (size_t i = 0; i < xs.size() && bad < 5; ++i) {
        const double z = static_cast<double>(xs[i]) - m, want = std::exp(z);
        // 3.0e-6 of the polynomial, plus what t = (x − m)·log2(e) gets wrong (times ln 2 < 1): the
        // float log2(e)'s 1.9e-8 times |z| and half an ulp each of x − m and of t.
        const double t = z * 1.4426950408889634;
        const double tol = 3.0e-6 + 2e-8 * std::abs(z) + 0x1p-24 * (std::abs(z) + std::abs(t));
        bool ok;
        if (std::isnan(xs[i]))
          ok = std::isnan(got[i]);
        else if (xs[i] == m)
          ok = got[i] == 1.0f;  // the row's max: exactly 1
        else if (t < -126.01)
          ok = got[i] == 0.0f && !std::signbit(got[i]);
        else if (t > -125.99)
          ok = std::abs(got[i] / want - 1.0) <= tol && std::fpclassify(got[i]) == FP_NORMAL;
        else
          ok = got[i] == 0.0f || (std::abs(got[i] / want - 1.0) <= tol && std::fpclassify(got[i]) == FP_NORMAL);
        if (!ok) ++bad;
        EXPECT_TRUE(ok) << "x − m = " << z << ": got " << got[i] << ", exp " << want;
        if (std::abs(z) <= 0.6931471805599453) worst = std::max(worst, std::abs(got[i] / want - 1.0));
      }
      if (m == 0.0f)
        std::printf("%s: largest relative error over a period %.3g\n",
                    hwy::TargetName(kernels::fused_dispatch_target()), worst);
    }
  });
}

// AMX where the CPU (and OS) have it, for head dims that fill its tiles; never without the dot
// product's target, and never once switched off.
TEST(FusedForward, Bf16UsesAmxTilesWhereTheCpuHasThem) {
  hwy::SetSupportedTargetsForTest(0);
  const bool dot = kernels::fused_bf16_uses_dot_instructions(), amx = kernels::amx::available();
  std::printf("AMX tiles: %s\n", amx ? "yes" : "no");
  for (int64_t d : {32, 64, 128, 256})
    EXPECT_STREQ(kernels::fused_bf16_products(d), !dot ? "float32" : amx ? "amx" : "vdpbf16ps") << d;
  for (int64_t d : {1, 16, 48, 80}) EXPECT_STREQ(kernels::fused_bf16_products(d), dot ? "vdpbf16ps" : "float32") << d;
  kernels::amx::set_allowed_for_test(false);
  EXPECT_STREQ(kernels::fused_bf16_products(64), dot ? "vdpbf16ps" : "float32");
  kernels::amx::set_allowed_for_test(true);
  if (amx) {  // the tiles are usable: a 16 × 16 × 32 product of ones gives 32 everywhere
    std::vector<uint32_t> q2(16 * 16, 0x3f803f80u), k2(16 * 16, 0x3f803f80u);
    std::vector<float> s(16 * 16, 0.0f);
    kernels::amx::configure();
    kernels::amx::scores(q2.data(), 16, 16, 16, k2.data(), 16, 1, s.data(), 16);
    kernels::amx::release();
    for (float x : s) ASSERT_EQ(x, 32.0f);
  }
}

// ---- attention weights from the fused kernel ----------------------------------------------

/// out, lse, per-head weights (B, h, T_q, T_k) and averaged weights (B, 1, T_q, T_k).
struct WeightsResult {
  Tensor out, lse, w, avg;
};

enum WantWeights : uint8_t { kPerHead = 1, kAveraged = 2, kBoth = 3 };

/// Output buffers for `want`, weights pre-filled so that anything left unwritten shows.
WeightsResult weights_buffers(const Case& c, WantWeights want, SdpaOutputs& outs) {
  WeightsResult r{Tensor({c.B, c.H, c.Tq, c.Dv}), Tensor({c.B, c.H, c.Tq, 1}), {}, {}};
  outs = {r.out.view4(), {}, r.lse.view4(), {}};
  if (want & kPerHead) {
    r.w = Tensor({c.B, c.H, c.Tq, c.Tk}, 123.0f);
    outs.weights = r.w.view4();
  }
  if (want & kAveraged) {
    r.avg = Tensor({c.B, 1, c.Tq, c.Tk}, 123.0f);
    outs.averaged_weights = r.avg.view4();
  }
  return r;
}

template <class Q>
WeightsResult run_weights(const Case& c, const Q& q, const Q& k, const Q& v, Backend backend, int threads = 2,
                          WantWeights want = kBoth) {
  SdpaOutputs outs;
  WeightsResult r = weights_buffers(c, want, outs);
  SdpaOptions opt = c.opt;
  opt.backend = backend;
  opt.threads = threads;
  sdpa(q.view4(), k.view4(), v.view4(), opt, outs);
  return r;
}
WeightsResult run_weights(const Case& c, Backend backend, int threads = 2, WantWeights want = kBoth) {
  return run_weights(c, c.q, c.k, c.v, backend, threads, want);
}

/// Probabilities: each moves relatively by the scores' rounding (a few ε·bound) and exp's error;
/// kept ones are scaled by 1/(1 − p) under dropout.
double weights_tol(const Case& c) {
  const double keep = c.opt.dropout.active() ? 1.0 / (1.0 - c.opt.dropout.p) : 1.0;
  return kEps * keep * (8.0 * c.score_bound() + 32.0);
}

void expect_weights_close(const Case& c, const WeightsResult& got, const WeightsResult& want,
                          double extra_out_tol = 0) {
  const double keep = c.opt.dropout.active() ? 1.0 / (1.0 - c.opt.dropout.p) : 1.0;
  EXPECT_TRUE(all_close(got.out, want.out, keep * c.out_tol() + extra_out_tol, 0));
  EXPECT_TRUE(all_close(got.lse, want.lse, c.lse_tol(), 4 * kEps));
  if (want.w.defined()) {
    EXPECT_TRUE(all_close(got.w, want.w, weights_tol(c), 0));
  }
  if (want.avg.defined()) {
    EXPECT_TRUE(all_close(got.avg, want.avg, weights_tol(c), 0));
  }
}

void check_weights_all_targets(const Case& c) {
  const WeightsResult want = run_weights(c, Backend::Reference);
  for_each_fused_target([&] { expect_weights_close(c, run_weights(c, Backend::Fused), want); });
}

TEST(FusedWeights, AutoPicksTheFusedKernel) {
  Case c;
  c.Tq = 9, c.Tk = 11;
  c.make_inputs(1);
  Tensor out({c.B, c.H, c.Tq, c.Dv}), w({c.B, c.H, c.Tq, c.Tk}), avg({c.B, 1, c.Tq, c.Tk});
  EXPECT_EQ(sdpa_dispatch_reason(c.q.view4(), c.k.view4(), c.v.view4(), c.opt, {out.view4(), w.view4(), {}}),
            "fused: supported");
  EXPECT_EQ(sdpa_dispatch_reason(c.q.view4(), c.k.view4(), c.v.view4(), c.opt, {out.view4(), {}, {}, avg.view4()}),
            "fused: supported");
  // A wrongly shaped averaged output is refused, naming both shapes.
  Tensor bad({c.B, c.H, c.Tq, c.Tk});
  const std::string e = testing::error_of([&] {
    sdpa(c.q.view4(), c.k.view4(), c.v.view4(), c.opt, {out.view4(), {}, {}, bad.view4()});
  });
  EXPECT_NE(e.find("averaged weights have shape (1, 2, 9, 11), expected (1, 1, 9, 11)"), std::string::npos) << e;
}

TEST(FusedWeights, LengthsAroundTheBlockSizes) {
  const std::vector<int64_t> tqs = kSanitized ? std::vector<int64_t>{0, 1, 7, kQBlock + 1}
                                              : std::vector<int64_t>{0, 1, 7, kQBlock - 1, kQBlock, kQBlock + 1, 261};
  const std::vector<int64_t> tks = kSanitized ? std::vector<int64_t>{0, 1, kKBlock + 1}
                                              : std::vector<int64_t>{0, 1, 2, kKBlock - 1, kKBlock, kKBlock + 1, 197};
  for (int64_t tq : tqs)
    for (int64_t tk : tks)
      for (Causal causal : {Causal::none(), Causal::bottom_right()}) {
        SCOPED_TRACE(::testing::Message() << "T_q " << tq << " T_k " << tk << " causal " << causal.enabled());
        Case c;
        c.H = 4, c.KV = 2, c.Tq = tq, c.Tk = tk, c.D = 16, c.Dv = 24;
        c.opt.masks.causal = causal;
        c.make_inputs(static_cast<uint64_t>(tq * 1000 + tk));
        check_weights_all_targets(c);
        if (HasFatalFailure()) return;
      }
}

TEST(FusedWeights, EveryMaskKindAndCombination) {
  for (const MaskCase& mc : mask_cases())
    for (int64_t tq : {int64_t{70}, int64_t{150}}) {
      SCOPED_TRACE(::testing::Message() << mc.name << ", T_q " << tq);
      Case c;
      c.B = 2, c.H = 4, c.KV = 2, c.Tq = tq, c.Tk = 150, c.D = 32, c.Dv = 16;
      c.make_inputs(7);
      mc.apply(c);
      check_weights_all_targets(c);
    }
}

TEST(FusedWeights, GroupedQueryRatiosAndHeadDims) {
  for (int64_t kv : {8, 4, 2, 1})
    for (int64_t d : {1, 8, 33, 64}) {
      SCOPED_TRACE(::testing::Message() << "kv heads " << kv << ", d " << d);
      Case c;
      c.B = 1, c.H = 8, c.KV = kv, c.Tq = 67, c.Tk = 90, c.D = d, c.Dv = d + 2;
      c.opt.masks.causal = Causal::top_left();
      c.make_inputs(static_cast<uint64_t>(kv * 100 + d));
      check_weights_all_targets(c);
    }
}

TEST(FusedWeights, DropoutFollowsTheReference) {
  // Weights are the probabilities actually used: kept ones scaled by 1/(1 − p), dropped ones 0,
  // decided by the same counter-based generator as every other path.
  for (float p : {0.1f, 0.5f}) {
    Case c;
    c.B = 2, c.H = 2, c.KV = 1, c.Tq = 80, c.Tk = 130, c.D = 24, c.Dv = 20;
    c.opt.dropout = {p, 99};
    c.make_inputs(3);
    const WeightsResult want = run_weights(c, Backend::Reference);
    for_each_fused_target([&] {
      const WeightsResult got = run_weights(c, Backend::Fused);
      expect_weights_close(c, got, want);
      int64_t zeros_got = 0, zeros_want = 0;
      for (int64_t i = 0; i < got.w.numel(); ++i)
        zeros_got += got.w.data()[i] == 0.0f, zeros_want += want.w.data()[i] == 0.0f;
      EXPECT_EQ(zeros_got, zeros_want);
    });
  }
}

TEST(FusedWeights, NaNRowsAreNaNThroughout) {
  Case c;
  c.B = 1, c.H = 4, c.KV = 2, c.Tq = 40, c.Tk = 90, c.D = 16, c.Dv = 16;
  c.make_inputs(21);
  c.q.at({0, 1, 5, 3}) = std::numeric_limits<float>::quiet_NaN();  // head 1, query 5
  c.opt.masks.causal = Causal::bottom_right();
  const WeightsResult want = run_weights(c, Backend::Reference);
  for (int64_t j = 0; j < c.Tk; ++j) ASSERT_TRUE(std::isnan(want.w.at({0, 1, 5, j})));
  for (int64_t j = 0; j < c.Tk; ++j) ASSERT_TRUE(std::isnan(want.avg.at({0, 0, 5, j})));
  for_each_fused_target([&] { expect_weights_close(c, run_weights(c, Backend::Fused), want); });
}

TEST(FusedWeights, WindowPastTheLastKeyGivesZeroRows) {
  // Top-left with T_q > T_k + window: the last query block's window starts past the last key, so
  // its rows see nothing and are zeros, and nothing is written past the rows' T_k elements.
  Case c;
  c.B = 1, c.H = 2, c.KV = 1, c.Tq = 2 * kQBlock + 5, c.Tk = 40, c.D = 8, c.Dv = 8;
  c.make_inputs(23);
  c.opt.masks.causal = Causal::top_left().with_window(8);
  check_weights_all_targets(c);
}

TEST(FusedWeights, PerHeadAveragedOrBothGiveTheSameBits) {
  Case c;
  c.B = 2, c.H = 6, c.KV = 3, c.Tq = 150, c.Tk = 140, c.D = 32, c.Dv = 32;
  c.make_inputs(31);
  set_key_padding(c);
  c.opt.masks.causal = Causal::bottom_right().with_window(90);
  for_each_fused_target([&] {
    const WeightsResult both = run_weights(c, Backend::Fused, 2, kBoth);
    const WeightsResult per_head = run_weights(c, Backend::Fused, 2, kPerHead);
    const WeightsResult averaged = run_weights(c, Backend::Fused, 2, kAveraged);
    EXPECT_TRUE(bitwise_equal(per_head.w, both.w));
    EXPECT_TRUE(bitwise_equal(averaged.avg, both.avg));
    EXPECT_TRUE(bitwise_equal(per_head.out, both.out));
    EXPECT_TRUE(bitwise_equal(averaged.out, both.out));
    EXPECT_TRUE(bitwise_equal(averaged.lse, both.lse));
  });
}

TEST(FusedWeights, ThreadCountDoesNotChangeABit) {
  Case c;
  c.B = 2, c.H = 4, c.KV = 2, c.Tq = kSanitized ? 140 : 300, c.Tk = kSanitized ? 100 : 260, c.D = 64, c.Dv = 64;
  c.opt.masks.causal = Causal::bottom_right();
  c.opt.dropout = {0.2f, 5};
  c.make_inputs(9);
  for_each_fused_target([&] {
    for (WantWeights want : {kPerHead, kAveraged, kBoth}) {
      const WeightsResult one = run_weights(c, Backend::Fused, 1, want);
      for (int threads : {2, 3}) {
        const WeightsResult many = run_weights(c, Backend::Fused, threads, want);
        EXPECT_TRUE(bitwise_equal(many.out, one.out)) << threads << " threads";
        EXPECT_TRUE(bitwise_equal(many.lse, one.lse)) << threads << " threads";
        if (want & kPerHead) {
          EXPECT_TRUE(bitwise_equal(many.w, one.w)) << threads << " threads";
        }
        if (want & kAveraged) {
          EXPECT_TRUE(bitwise_equal(many.avg, one.avg)) << threads << " threads";
        }
      }
    }
  });
}

TEST(FusedWeights, StridedWeightsViewGivesTheSameBits) {
  Case c;
  c.B = 2, c.H = 2, c.KV = 1, c.Tq = 70, c.Tk = 100, c.D = 16, c.Dv = 16;
  c.opt.masks.causal = Causal::top_left();
  c.make_inputs(41);
  for_each_fused_target([&] {
    const WeightsResult contiguous = run_weights(c, Backend::Fused);
    Strided w(Shape{c.B, c.H, c.Tq, c.Tk}, 2), avg(Shape{c.B, 1, c.Tq, c.Tk}, 3);
    Tensor out({c.B, c.H, c.Tq, c.Dv});
    SdpaOptions opt = c.opt;
    opt.backend = Backend::Fused;
    sdpa(c.q.view4(), c.k.view4(), c.v.view4(), opt, {out.view4(), w.view, {}, avg.view});
    EXPECT_TRUE(bitwise_equal(w.gather(), contiguous.w));
    EXPECT_TRUE(bitwise_equal(avg.gather(), contiguous.avg));
    EXPECT_TRUE(bitwise_equal(out, contiguous.out));
  });
}

// ---- attention weights in one pass, and the two-pass path beyond its scratch bound ---------

/// The fused kernel called directly with its one-pass weights' scratch bounded to max_bytes
/// (SdpaParams::weights_one_pass_max_bytes; 0: the kernel's own bound): how a test reaches the
/// two-pass path on small shapes. *one_pass (if given): which path the call took.
template <class Inputs>
WeightsResult run_weights_bounded(const Case& c, const Inputs& q, const Inputs& k, const Inputs& v, int64_t max_bytes,
                                  int threads = 2, WantWeights want = kBoth, bool* one_pass = nullptr) {
  SdpaOutputs outs;
  WeightsResult r = weights_buffers(c, want, outs);
  SdpaOptions opt = c.opt;
  opt.backend = Backend::Fused;
  opt.threads = threads;
  kernels::SdpaParams p = detail::prepare_sdpa("sdpa", q.view4(), k.view4(), v.view4(), opt, outs);
  p.weights_one_pass_max_bytes = max_bytes;
  if (one_pass) *one_pass = kernels::fused_weights_one_pass(p);
  std::vector<float> workspace(kernels::fused_workspace_floats(p));
  kernels::sdpa_fused(p, workspace.data());
  return r;
}
WeightsResult run_weights_bounded(const Case& c, int64_t max_bytes, int threads = 2, WantWeights want = kBoth,
                                  bool* one_pass = nullptr) {
  return run_weights_bounded(c, c.q, c.k, c.v, max_bytes, threads, want, one_pass);
}

TEST(FusedWeights, ContiguousRowsAtAnyAlignmentGiveTheSameBits) {
  // Large weights rows are written with non-temporal stores between scalar head and tail pieces
  // (write_row; reached here by lowering SdpaParams::weights_stream_min_bytes), small ones with
  // ordinary stores: rows starting at every offset from a vector boundary, short and odd lengths,
  // zeros written outside a causal row's keys, on both weights paths, per-head weights alone (each
  // block scaled on its way out) or with the averaged ones, give the same bits.
  for (const int64_t tk : {int64_t{1}, int64_t{15}, int64_t{17}, int64_t{70}}) {
    Case c;
    c.B = 2, c.H = 2, c.KV = 1, c.Tq = 37, c.Tk = tk, c.D = 16, c.Dv = 16;
    c.opt.masks.causal = Causal::bottom_right().with_window(20);
    c.make_inputs(53);
    for_each_fused_target([&] {
      const WeightsResult want = run_weights(c, Backend::Fused);
      for (const int64_t max_bytes : {int64_t{0}, int64_t{1}})            // one pass; two (a 1-byte bound)
        for (const int64_t stream_from : {int64_t{1}, int64_t{1} << 40})  // streamed; ordinary stores
          for (const bool with_avg : {true, false}) {
            // Strided(.., 1): contiguous rows 3 floats longer than T_k, from one float past the start.
            Strided w(Shape{c.B, c.H, c.Tq, c.Tk}, 1), avg(Shape{c.B, 1, c.Tq, c.Tk}, 1);
            Tensor out({c.B, c.H, c.Tq, c.Dv});
            SdpaOptions opt = c.opt;
            opt.backend = Backend::Fused;
            const SdpaOutputs outs{out.view4(), w.view, {}, with_avg ? avg.view : View4<float>{}};
            kernels::SdpaParams p = detail::prepare_sdpa("sdpa", c.q.view4(), c.k.view4(), c.v.view4(), opt, outs);
            p.weights_one_pass_max_bytes = max_bytes;
            p.weights_stream_min_bytes = stream_from;
            EXPECT_EQ(kernels::fused_weights_one_pass(p), max_bytes == 0);
            std::vector<float> workspace(kernels::fused_workspace_floats(p));
            kernels::sdpa_fused(p, workspace.data());
            EXPECT_TRUE(bitwise_equal(w.gather(), want.w))
                << "T_k " << tk << ", bound " << max_bytes << ", stream from " << stream_from;
            if (with_avg) {
              EXPECT_TRUE(bitwise_equal(avg.gather(), want.avg))
                  << "T_k " << tk << ", bound " << max_bytes << ", stream from " << stream_from;
            }
            EXPECT_TRUE(all_close(out, want.out, c.out_tol(), 0))
                << "T_k " << tk << ", bound " << max_bytes << ", stream from " << stream_from;
            // The 3 floats after each row and the one before the first stay untouched.
            EXPECT_EQ(w.buf.front(), -7.0f);
            for (int64_t r = 0; r < c.B * c.H * c.Tq; ++r)
              for (int64_t e = 0; e < 3; ++e) EXPECT_EQ(w.buf[static_cast<size_t>(1 + r * (tk + 3) + tk + e)], -7.0f);
          }
    });
  }
}

/// The per-head weights summed over heads in head order and divided by h, as float32.
Tensor head_order_mean(const Tensor& w) {
  const int64_t B = w.shape()[0], H = w.shape()[1], Tq = w.shape()[2], Tk = w.shape()[3];
  Tensor avg({B, 1, Tq, Tk});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Tq; ++i)
      for (int64_t j = 0; j < Tk; ++j) {
        float sum = 0.0f;
        for (int64_t h = 0; h < H; ++h) sum += w.at({b, h, i, j});
        avg.at({b, 0, i, j}) = sum / static_cast<float>(H);
      }
  return avg;
}

TEST(FusedWeights, AveragedAreThePerHeadWeightsSummedInHeadOrderOverH) {
  // What "averaged" means, bit for bit, on the one-pass path (each head's fix-up writes, adds or
  // divides as it goes) and on the two-pass one; with zero rows, a NaN row, sinks and dropout.
  Case c;
  c.B = 2, c.H = 6, c.KV = 2, c.Tq = kQBlock + 9, c.Tk = kKBlock + 37, c.D = 16, c.Dv = 16;
  c.make_inputs(57);
  spread_scores(c);
  c.opt.masks.causal = Causal::top_left().with_window(40);
  c.q.at({1, 4, 3, 0}) = kNaN;
  c.opt.dropout = {0.2f, 11};
  const std::vector<float> sinks = {0.5f, -1.0f, 2.0f, 0.0f, 1.0f, -0.5f};
  c.opt.sinks.logits = {sinks.data(), sinks.size()};
  for_each_fused_target([&] {
    for (int64_t bound : {int64_t{0}, int64_t{1}}) {  // the kernel's own bound: one pass; 1 byte: two passes
      bool one_pass = false;
      const WeightsResult r = run_weights_bounded(c, bound, 2, kBoth, &one_pass);
      EXPECT_EQ(one_pass, bound == 0);
      EXPECT_TRUE(bitwise_equal(r.avg, head_order_mean(r.w))) << "one pass " << one_pass;
      const WeightsResult averaged = run_weights_bounded(c, bound, 2, kAveraged);
      EXPECT_TRUE(bitwise_equal(averaged.avg, r.avg)) << "one pass " << one_pass;
    }
  });
}

TEST(FusedWeights, OnePassMatchesTheReferenceAcrossBlockEdgesEveryMaskAndDropout) {
  using Len = std::pair<int64_t, int64_t>;
  const std::vector<Len> lens = kSanitized ? std::vector<Len>{{kQBlock + 1, kKBlock + 1}}
                                           : std::vector<Len>{{kQBlock - 1, kKBlock - 1},
                                                              {kQBlock, kKBlock},
                                                              {kQBlock + 1, kKBlock + 1},
                                                              {kQBlock + 2, 3 * kKBlock + 1}};
  for (auto [tq, tk] : lens)
    for (const MaskCase& mc : mask_cases())
      for (float drop : {0.0f, 0.25f}) {
        SCOPED_TRACE(::testing::Message() << mc.name << ", T_q " << tq << " T_k " << tk << " dropout " << drop);
        Case c;
        c.B = 2, c.H = 4, c.KV = 2, c.Tq = tq, c.Tk = tk, c.D = 16, c.Dv = 8;
        c.make_inputs(static_cast<uint64_t>(tq * 7 + tk));
        spread_scores(c);
        mc.apply(c);
        if (drop > 0) c.opt.dropout = {drop, 77};
        check_weights_all_targets(c);
        if (HasFatalFailure()) return;
      }
}

/// With weights in one pass, out and lse are the weights-free path's, bit for bit: the same key
/// loop runs (the 16-row softmax included), and the weights are only kept on the side.
template <class Inputs>
void expect_out_and_lse_as_without_weights(const Case& c, const Inputs& q, const Inputs& k, const Inputs& v) {
  for_each_fused_target([&] {
    Result plain{Tensor({c.B, c.H, c.Tq, c.Dv}), Tensor({c.B, c.H, c.Tq, 1})};
    SdpaOptions opt = c.opt;
    opt.backend = Backend::Fused;
    sdpa(q.view4(), k.view4(), v.view4(), opt, {plain.out.view4(), {}, plain.lse.view4()});
    for (WantWeights want : {kPerHead, kAveraged, kBoth}) {
      const WeightsResult got = run_weights(c, q, k, v, Backend::Fused, 2, want);
      EXPECT_TRUE(bitwise_equal(got.out, plain.out)) << "weights " << int{want};
      EXPECT_TRUE(bitwise_equal(got.lse, plain.lse)) << "weights " << int{want};
    }
  });
}

TEST(FusedWeights, OutAndLseAreTheWeightsFreePathsBits) {
  for (auto [tq, tk] : std::vector<std::pair<int64_t, int64_t>>{{7, 1}, {kQBlock + 1, kKBlock + 1}, {70, 197}})
    for (const MaskCase& mc : mask_cases()) {
      SCOPED_TRACE(::testing::Message() << mc.name << ", T_q " << tq << " T_k " << tk);
      Case c;
      c.B = 2, c.H = 4, c.KV = 2, c.Tq = tq, c.Tk = tk, c.D = 32, c.Dv = 33;
      c.make_inputs(static_cast<uint64_t>(tq + tk));
      spread_scores(c);
      mc.apply(c);
      if (tq == 70) c.q.at({1, 2, 9, 0}) = kNaN;  // a NaN row among them
      with_f32_and_bf16(
          c, [&](const auto& q, const auto& k, const auto& v) { expect_out_and_lse_as_without_weights(c, q, k, v); });
      if (HasFailure()) return;
    }
}

TEST(FusedWeights, TwoPassBeyondTheScratchBound) {
  // The bound: group × 128 query rows × T_k (rounded to 16) floats of scratch, 16 MiB by default,
  // i.e. T_k·group ≤ 32768; the same choice for per-head, averaged or both.
  for (int64_t tk : {8192, 8193})
    for (WantWeights want : {kPerHead, kAveraged, kBoth}) {
      Case c;
      c.H = 8, c.KV = 2, c.Tq = 1, c.Tk = tk, c.D = 1, c.Dv = 1;
      c.make_inputs(3);
      SdpaOutputs outs;
      const WeightsResult r = weights_buffers(c, want, outs);
      const kernels::SdpaParams p = detail::prepare_sdpa("sdpa", c.q.view4(), c.k.view4(), c.v.view4(), c.opt, outs);
      EXPECT_EQ(kernels::fused_weights_one_pass(p), tk == 8192) << "T_k " << tk << ", weights " << int{want};
    }
  // Forced below any shape: the two-pass path, against the reference and on 1, 2, 3 threads
  // bitwise; one byte short of the scratch or exactly it picks the path as the bound says.
  for (const MaskCase& mc : mask_cases()) {
    SCOPED_TRACE(mc.name);
    Case c;
    c.B = 2, c.H = 4, c.KV = 2, c.Tq = kQBlock + 3, c.Tk = 2 * kKBlock + 5, c.D = 16, c.Dv = 12;
    c.make_inputs(61);
    spread_scores(c);
    mc.apply(c);
    const int64_t scratch_bytes = 2 * kQBlock * 144 * static_cast<int64_t>(sizeof(float));  // group 2, T_k to 144
    const WeightsResult want = run_weights(c, Backend::Reference);
    for_each_fused_target([&] {
      bool one_pass = true;
      const WeightsResult two = run_weights_bounded(c, 1, 1, kBoth, &one_pass);
      EXPECT_FALSE(one_pass);
      expect_weights_close(c, two, want);
      for (int threads : {2, 3}) {
        const WeightsResult many = run_weights_bounded(c, 1, threads, kBoth);
        EXPECT_TRUE(bitwise_equal(many.out, two.out) && bitwise_equal(many.lse, two.lse) &&
                    bitwise_equal(many.w, two.w) && bitwise_equal(many.avg, two.avg))
            << threads << " threads";
      }
      const WeightsResult averaged = run_weights_bounded(c, 1, 2, kAveraged);
      EXPECT_TRUE(bitwise_equal(averaged.avg, two.avg));
      run_weights_bounded(c, scratch_bytes - 1, 1, kAveraged, &one_pass);
      EXPECT_FALSE(one_pass);
      const WeightsResult fits = run_weights_bounded(c, scratch_bytes, 1, kAveraged, &one_pass);
      EXPECT_TRUE(one_pass);
      EXPECT_TRUE(bitwise_equal(fits.avg, run_weights(c, Backend::Fused, 1, kAveraged).avg));
    });
    if (HasFatalFailure()) return;
  }
}

/// On every target, the one-pass path (bound 0: the kernel's own) and the two-pass one (1), per-head,
/// averaged or both weights: 2 and 3 threads give the bits of 1.
template <class Inputs>
void expect_weights_paths_same_bits_on_any_thread_count(const Case& c, const Inputs& q, const Inputs& k,
                                                        const Inputs& v) {
  for_each_fused_target([&] {
    for (int64_t bound : {0, 1})
      for (WantWeights want : {kPerHead, kAveraged, kBoth}) {
        const WeightsResult one = run_weights_bounded(c, q, k, v, bound, 1, want);
        for (int threads : {2, 3}) {
          const WeightsResult many = run_weights_bounded(c, q, k, v, bound, threads, want);
          EXPECT_TRUE(bitwise_equal(many.out, one.out) && bitwise_equal(many.lse, one.lse)) << threads << " threads";
          if (want & kPerHead) {
            EXPECT_TRUE(bitwise_equal(many.w, one.w)) << threads << " threads, bound " << bound;
          }
          if (want & kAveraged) {
            EXPECT_TRUE(bitwise_equal(many.avg, one.avg)) << threads << " threads, bound " << bound;
          }
        }
      }
  });
}

TEST(FusedWeights, EitherPathGivesTheSameBitsOnAnyThreadCount) {
  // Several query blocks and items per thread, maxima moving between key blocks, padding, a
  // window and dropout; the one-pass path (bound 0: the kernel's own) and the two-pass one (1).
  Case c;
  c.B = 2, c.H = 6, c.KV = 3, c.Tq = kSanitized ? 140 : 3 * kQBlock + 7, c.Tk = kSanitized ? 100 : 5 * kKBlock + 3;
  c.D = 24, c.Dv = 40;
  c.make_inputs(19);
  spread_scores(c);
  set_key_padding(c);
  c.opt.masks.causal = Causal::bottom_right().with_window(150);
  c.opt.dropout = {0.15f, 8};
  expect_weights_paths_same_bits_on_any_thread_count(c, c.q, c.k, c.v);
}

// The same from bf16 inputs, whose one-pass path keeps P as float32 and pairs it for the products.
TEST(FusedWeights, Bf16EitherPathGivesTheSameBitsOnAnyThreadCount) {
  Case c;
  c.B = 2, c.H = 6, c.KV = 3, c.Tq = kQBlock + 7, c.Tk = 2 * kKBlock + 3, c.D = 24, c.Dv = 40;
  c.make_inputs(23);
  spread_scores(c);
  set_key_padding(c);
  c.opt.masks.causal = Causal::bottom_right().with_window(100);
  c.opt.dropout = {0.15f, 8};
  expect_weights_paths_same_bits_on_any_thread_count(c, to_bf16_tensor(c.q), to_bf16_tensor(c.k), to_bf16_tensor(c.v));
}

// ---- dispatch -------------------------------------------------------------------------------

TEST(FusedWeights, Bf16MatchesTheReferenceOnWidenedValues) {
  // Weights are float32 probabilities from exact bf16 products (P is rounded to bf16 only inside
  // P·V), so they meet the float32 tolerance; out gets the bf16 P·V allowance of check_bf16.
  for (const MaskCase& mc : mask_cases()) {
    SCOPED_TRACE(mc.name);
    Case c;
    c.B = 2, c.H = 4, c.KV = 2, c.Tq = 70, c.Tk = kSanitized ? 80 : 150, c.D = 64, c.Dv = 65;
    c.make_inputs(13);
    mc.apply(c);
    const BF16Tensor qb = to_bf16_tensor(c.q), kb = to_bf16_tensor(c.k), vb = to_bf16_tensor(c.v);
    c.q = widened(qb), c.k = widened(kb), c.v = widened(vb);
    const WeightsResult want = run_weights(c, Backend::Reference);
    const double keep = c.opt.dropout.active() ? 1.0 / (1.0 - c.opt.dropout.p) : 1.0;
    const double bf16_tol = 2.0 * keep * std::ldexp(1.0, -9) * max_abs(c.v);
    for_each_fused_target([&] { expect_weights_close(c, run_weights(c, qb, kb, vb, Backend::Fused), want, bf16_tol); });
    // The reference on bf16 inputs: the same answer as on the widened values.
    const WeightsResult ref16 = run_weights(c, qb, kb, vb, Backend::Reference);
    EXPECT_TRUE(bitwise_equal(ref16.w, want.w));
    EXPECT_TRUE(bitwise_equal(ref16.avg, want.avg));
  }
}

/// Out, lse and (with `weights`) both kinds of weights computed into buffers first filled with `fill`.
template <class Q>
WeightsResult run_into(const Case& c, const Q& q, const Q& k, const Q& v, Backend backend, bool weights, float fill) {
  SdpaOutputs outs;
  WeightsResult r = weights_buffers(c, weights ? kBoth : WantWeights{0}, outs);
  for (Tensor* t : {&r.out, &r.lse, &r.w, &r.avg}) std::fill(t->data(), t->data() + t->numel(), fill);
  SdpaOptions opt = c.opt;
  opt.backend = backend;
  sdpa(q.view4(), k.view4(), v.view4(), opt, outs);
  return r;
}

// The outputs are written whole, whatever they held: sdpa(const Tensor&…) and the module hand the
// kernels memory that is not zero-filled. Buffers full of NaN must give the bits of buffers full
// of zeros, on both paths, with every mask (rows and whole batch items that see no key), dropout,
// NaN inputs, no keys and no queries.
TEST(SdpaOutputs, EveryElementIsWrittenWhateverTheBuffersHeld) {
  struct Shape {
    int64_t tq, tk, dv;
  };
  for (const Shape sh : {Shape{70, 150, 16}, Shape{kQBlock + 1, kKBlock + 1, 17}, Shape{5, 0, 8}, Shape{0, 5, 8}})
    for (const MaskCase& mc : mask_cases()) {
      // (The mask cases hide rows 3 and 5 and keys: the edge shapes take one of them.)
      if ((sh.tq < 6 || sh.tk == 0) && std::string(mc.name) != "causal top-left") continue;
      SCOPED_TRACE(::testing::Message() << mc.name << ", T_q " << sh.tq << " T_k " << sh.tk << " d_v " << sh.dv);
      Case c;
      c.B = 2, c.H = 4, c.KV = 2, c.Tq = sh.tq, c.Tk = sh.tk, c.D = 32, c.Dv = sh.dv;
      c.make_inputs(static_cast<uint64_t>(sh.tq + sh.tk));
      mc.apply(c);
      if (sh.tq > 9 && sh.tk > 0) c.q.at({1, 2, 9, 0}) = kNaN;  // a NaN row
      with_f32_and_bf16(c, [&](const auto& q, const auto& k, const auto& v) {
        for (const Backend backend : {Backend::Fused, Backend::Reference})
          for (const bool weights : {false, true}) {
            if (backend == Backend::Reference && !std::is_same_v<std::decay_t<decltype(q)>, Tensor>) continue;
            const WeightsResult clean = run_into(c, q, k, v, backend, weights, 0.0f);
            const WeightsResult dirty = run_into(c, q, k, v, backend, weights, kNaN);
            const char* path = backend == Backend::Fused ? "fused" : "reference";
            EXPECT_TRUE(bitwise_equal(dirty.out, clean.out)) << path << " out, weights " << weights;
            EXPECT_TRUE(bitwise_equal(dirty.lse, clean.lse)) << path << " lse, weights " << weights;
            if (weights) {
              EXPECT_TRUE(bitwise_equal(dirty.w, clean.w)) << path << " per-head weights";
              EXPECT_TRUE(bitwise_equal(dirty.avg, clean.avg)) << path << " averaged weights";
            }
          }
      });
      if (HasFailure()) return;
    }
}

}  // namespace
}  // namespace mha
