// The reference SDPA (the oracle) against hand-computed values and every promise of docs/semantics.md.
#include <cmath>
#include <limits>

#include "mha/sdpa.h"
#include "support/test_support.h"

namespace {

using mha::Backend;
using mha::Causal;
using mha::SdpaOptions;
using mha::Tensor;
using mha::testing::random_tensor;

SdpaOptions reference() {
  SdpaOptions opt;
  opt.backend = Backend::Reference;
  return opt;
}

TEST(Reference, WorkedExampleHead0) {
  // Head 0 of the textbook example: Q = K = V = [[1,0],[0,1],[1,1]], d = 2.
  const Tensor x({1, 1, 3, 2}, std::vector<float>{1, 0, 0, 1, 1, 1});
  const auto r = mha::sdpa(x, x, x, reference(), mha::Want::WeightsAndLse);
  const double s = 1.0 / std::sqrt(2.0);  // scaled scores are 0, 1/√2 or 2/√2
  const double scores[3][3] = {{s, 0, s}, {0, s, s}, {s, s, 2 * s}};
  const double v[3][2] = {{1, 0}, {0, 1}, {1, 1}};
  for (int i = 0; i < 3; ++i) {
    double sum = 0;
    for (int j = 0; j < 3; ++j) sum += std::exp(scores[i][j]);
    double out[2] = {0, 0};
    for (int j = 0; j < 3; ++j) {
      const double p = std::exp(scores[i][j]) / sum;
      EXPECT_NEAR(r.weights.at({0, 0, i, j}), p, 1e-6);
      out[0] += p * v[j][0];
      out[1] += p * v[j][1];
    }
    EXPECT_NEAR(r.out.at({0, 0, i, 0}), out[0], 1e-6);
    EXPECT_NEAR(r.out.at({0, 0, i, 1}), out[1], 1e-6);
    EXPECT_NEAR(r.lse.at({0, 0, i}), std::log(sum), 1e-6);
  }
  // Row 0 by hand: weights ∝ (e^0.7071, 1, e^0.7071) = (0.4011, 0.1978, 0.4011).
  EXPECT_NEAR(r.weights.at({0, 0, 0, 0}), 0.4011, 1e-4);
  EXPECT_NEAR(r.weights.at({0, 0, 0, 1}), 0.1978, 1e-4);
}

TEST(Reference, ScaleDefaultsToOneOverSqrtDOfQueryNotValue) {
  const Tensor q = random_tensor({1, 1, 2, 4}, 1), k = random_tensor({1, 1, 3, 4}, 2),
               v = random_tensor({1, 1, 3, 7}, 3);
  SdpaOptions explicit_scale = reference();
  explicit_scale.scale = 0.5f;  // 1/√4
  EXPECT_TRUE(mha::testing::bitwise_equal(mha::sdpa(q, k, v, reference()).out, mha::sdpa(q, k, v, explicit_scale).out));
}

TEST(Reference, CausalAlignments) {
  const Tensor q = random_tensor({1, 1, 2, 3}, 4), k = random_tensor({1, 1, 4, 3}, 5),
               v = random_tensor({1, 1, 4, 2}, 6);
  SdpaOptions opt = reference();
  opt.masks.causal = Causal::top_left();  // query i sees keys 0..i
  auto r = mha::sdpa(q, k, v, opt, mha::Want::Weights);
  EXPECT_GT(r.weights.at({0, 0, 0, 0}), 0.0f);
  EXPECT_EQ(r.weights.at({0, 0, 0, 1}), 0.0f);
  EXPECT_EQ(r.weights.at({0, 0, 1, 2}), 0.0f);
  EXPECT_NEAR(r.weights.at({0, 0, 0, 0}), 1.0f, 1e-6);
  opt.masks.causal = Causal::bottom_right();  // offset T_k − T_q = 2: query 1 sees all 4 keys
  r = mha::sdpa(q, k, v, opt, mha::Want::Weights);
  EXPECT_GT(r.weights.at({0, 0, 1, 3}), 0.0f);
  EXPECT_GT(r.weights.at({0, 0, 0, 2}), 0.0f);
  EXPECT_EQ(r.weights.at({0, 0, 0, 3}), 0.0f);
  opt.masks.causal = Causal::with_offset(1);
  r = mha::sdpa(q, k, v, opt, mha::Want::Weights);
  EXPECT_GT(r.weights.at({0, 0, 0, 1}), 0.0f);
  EXPECT_EQ(r.weights.at({0, 0, 0, 2}), 0.0f);
}

TEST(Reference, SlidingWindowKeepsTheLastWPositions) {
  const Tensor x = random_tensor({1, 1, 6, 4}, 7);
  SdpaOptions opt = reference();
  opt.masks.causal = Causal::top_left().with_window(2);
  const auto r = mha::sdpa(x, x, x, opt, mha::Want::Weights);
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 6; ++j) {
      const bool visible = j <= i && j > i - 2;
      EXPECT_EQ(r.weights.at({0, 0, i, j}) > 0.0f, visible) << i << "," << j;
    }
  SdpaOptions no_causal = reference();
  no_causal.masks.causal.window = 2;
  EXPECT_THROW(mha::sdpa(x, x, x, no_causal), mha::Error);
}

TEST(Reference, FullyMaskedRowGivesZerosAndMinusInfLse) {
  const Tensor q = random_tensor({1, 2, 3, 4}, 8), k = random_tensor({1, 2, 5, 4}, 9),
               v = random_tensor({1, 2, 5, 3}, 10);
  mha::BoolTensor allowed({1, 1, 3, 5}, 1);
  for (int j = 0; j < 5; ++j) allowed.at({0, 0, 1, j}) = 0;  // row 1 sees nothing
  SdpaOptions opt = reference();
  opt.masks.allowed.view = allowed.view4();
  auto r = mha::sdpa(q, k, v, opt, mha::Want::WeightsAndLse);
  for (int h = 0; h < 2; ++h) {
    for (int c = 0; c < 3; ++c) EXPECT_EQ(r.out.at({0, h, 1, c}), 0.0f);
    for (int j = 0; j < 5; ++j) EXPECT_EQ(r.weights.at({0, h, 1, j}), 0.0f);
    EXPECT_EQ(r.lse.at({0, h, 1}), -std::numeric_limits<float>::infinity());
    EXPECT_TRUE(std::isfinite(r.out.at({0, h, 0, 0})));
  }
  // The same through an additive −inf bias.
  Tensor bias({1, 1, 3, 5}, 0.0f);
  for (int j = 0; j < 5; ++j) bias.at({0, 0, 2, j}) = -std::numeric_limits<float>::infinity();
  SdpaOptions by_bias = reference();
  by_bias.masks.bias.view = bias.view4();
  r = mha::sdpa(q, k, v, by_bias, mha::Want::WeightsAndLse);
  EXPECT_EQ(r.out.at({0, 0, 2, 0}), 0.0f);
  EXPECT_EQ(r.lse.at({0, 1, 2}), -std::numeric_limits<float>::infinity());
}

TEST(Reference, PaddedKeysAreNeverRead) {
  Tensor k = random_tensor({2, 1, 4, 3}, 11), v = random_tensor({2, 1, 4, 3}, 12);
  const Tensor q = random_tensor({2, 1, 2, 3}, 13);
  mha::BoolTensor padding({2, 1, 1, 4}, 0);
  padding.at({0, 0, 0, 3}) = 1;
  padding.at({1, 0, 0, 0}) = 1;
  SdpaOptions opt = reference();
  opt.masks.key_padding.view = padding.view4();
  const auto clean = mha::sdpa(q, k, v, opt, mha::Want::Weights);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int c = 0; c < 3; ++c) {
    k.at({0, 0, 3, c}) = nan, v.at({0, 0, 3, c}) = nan;
    k.at({1, 0, 0, c}) = nan, v.at({1, 0, 0, c}) = nan;
  }
  const auto poisoned = mha::sdpa(q, k, v, opt, mha::Want::Weights);
  EXPECT_TRUE(mha::testing::bitwise_equal(poisoned.out, clean.out));
  EXPECT_TRUE(mha::testing::bitwise_equal(poisoned.weights, clean.weights));
  EXPECT_EQ(clean.weights.at({0, 0, 1, 3}), 0.0f);
}

TEST(Reference, GroupedQueryHeadsShareKv) {
  // 4 query heads over 2 K/V heads equals 4 heads with K/V repeated (i → i / 2).
  const Tensor q = random_tensor({2, 4, 3, 5}, 14), k = random_tensor({2, 2, 6, 5}, 15),
               v = random_tensor({2, 2, 6, 4}, 16);
  Tensor k_rep({2, 4, 6, 5}), v_rep({2, 4, 6, 4});
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 4; ++h)
      for (int t = 0; t < 6; ++t) {
        for (int c = 0; c < 5; ++c) k_rep.at({b, h, t, c}) = k.at({b, h / 2, t, c});
        for (int c = 0; c < 4; ++c) v_rep.at({b, h, t, c}) = v.at({b, h / 2, t, c});
      }
  EXPECT_TRUE(
      mha::testing::bitwise_equal(mha::sdpa(q, k, v, reference()).out, mha::sdpa(q, k_rep, v_rep, reference()).out));
}

TEST(Reference, MasksCombineAndBroadcast) {
  const Tensor q = random_tensor({2, 2, 3, 4}, 17), k = random_tensor({2, 2, 5, 4}, 18),
               v = random_tensor({2, 2, 5, 4}, 19);
  Tensor bias = random_tensor({1, 2, 1, 5}, 20);  // broadcast over batch and queries
  Tensor key_bias = random_tensor({2, 1, 1, 5}, 21);
  SdpaOptions opt = reference();
  opt.masks.bias.view = bias.view4();
  opt.masks.key_bias.view = key_bias.view4();
  const auto got = mha::sdpa(q, k, v, opt, mha::Want::Weights);
  // The same as one full bias.
  Tensor full({2, 2, 3, 5});
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 5; ++j) full.at({b, h, i, j}) = bias.at({0, h, 0, j}) + key_bias.at({b, 0, 0, j});
  SdpaOptions one = reference();
  one.masks.bias.view = full.view4();
  EXPECT_TRUE(mha::testing::all_close(got.out, mha::sdpa(q, k, v, one).out, 1e-6, 1e-6));
  // A mask that does not broadcast is an error naming the shapes.
  Tensor wrong({1, 3, 1, 5});
  SdpaOptions bad = reference();
  bad.masks.bias.view = wrong.view4();
  try {
    mha::sdpa(q, k, v, bad);
    FAIL() << "expected mha::Error";
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("(1, 3, 1, 5)"), std::string::npos) << e.what();
  }
}

TEST(Reference, DropoutIsSeededScaledAndIndependentOfEverythingElse) {
  const Tensor q = random_tensor({1, 2, 16, 8}, 22), k = random_tensor({1, 2, 32, 8}, 23),
               v = random_tensor({1, 2, 32, 8}, 24);
  SdpaOptions opt = reference();
  opt.dropout = {0.25f, 1234};
  const auto a = mha::sdpa(q, k, v, opt, mha::Want::Weights);
  const auto b = mha::sdpa(q, k, v, opt, mha::Want::Weights);
  EXPECT_TRUE(mha::testing::bitwise_equal(a.weights, b.weights));
  const auto clean = mha::sdpa(q, k, v, reference(), mha::Want::Weights);
  int64_t dropped = 0;
  for (int64_t i = 0; i < a.weights.numel(); ++i) {
    if (a.weights.data()[i] == 0.0f) {
      ++dropped;
    } else {
      EXPECT_NEAR(a.weights.data()[i], clean.weights.data()[i] / 0.75f, 1e-6);
    }
  }
  const double rate = static_cast<double>(dropped) / static_cast<double>(a.weights.numel());
  EXPECT_NEAR(rate, 0.25, 0.05);  // 1024 draws: 5 standard deviations is ≈ 0.07
  opt.dropout.seed = 99;
  EXPECT_FALSE(mha::testing::bitwise_equal(mha::sdpa(q, k, v, opt).out, a.out));
}

TEST(Reference, EmptyAndUnitShapes) {
  const Tensor q0({1, 1, 0, 4}), k = random_tensor({1, 1, 3, 4}, 25), v = random_tensor({1, 1, 3, 2}, 26);
  EXPECT_EQ(mha::sdpa(q0, k, v, reference()).out.shape(), (mha::Shape{1, 1, 0, 2}));
  const Tensor q = random_tensor({1, 1, 2, 4}, 27), k0({1, 1, 0, 4}), v0({1, 1, 0, 2});
  const auto r = mha::sdpa(q, k0, v0, reference(), mha::Want::Lse);  // no keys: every row fully masked
  EXPECT_EQ(r.out.at({0, 0, 1, 1}), 0.0f);
  EXPECT_EQ(r.lse.at({0, 0, 0}), -std::numeric_limits<float>::infinity());
  const Tensor one_q = random_tensor({1, 1, 1, 1}, 28), one_k = random_tensor({1, 1, 1, 1}, 29);
  const Tensor one_v({1, 1, 1, 1}, std::vector<float>{3.5f});
  EXPECT_EQ(mha::sdpa(one_q, one_k, one_v, reference()).out.at({0, 0, 0, 0}), 3.5f);
}

TEST(Reference, BadArgumentsNameTheShapes) {
  const Tensor q = random_tensor({1, 3, 2, 4}, 30), k = random_tensor({1, 2, 5, 4}, 31),
               v = random_tensor({1, 2, 5, 4}, 32);
  try {
    mha::sdpa(q, k, v, reference());
    FAIL() << "3 query heads over 2 K/V heads must be rejected";
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("(1, 3, 2, 4)"), std::string::npos) << e.what();
  }
  const Tensor k_bad_d = random_tensor({1, 3, 5, 3}, 33), v_ok = random_tensor({1, 3, 5, 4}, 34);
  EXPECT_THROW(mha::sdpa(q, k_bad_d, v_ok, reference()), mha::Error);
  const Tensor v_bad_t = random_tensor({1, 3, 4, 4}, 35), k_ok = random_tensor({1, 3, 5, 4}, 36);
  EXPECT_THROW(mha::sdpa(q, k_ok, v_bad_t, reference()), mha::Error);
  const Tensor q_batch = random_tensor({2, 3, 2, 4}, 37);
  EXPECT_THROW(mha::sdpa(q_batch, k_ok, v_ok, reference()), mha::Error);
  SdpaOptions bad_p = reference();
  bad_p.dropout.p = 1.0f;
  EXPECT_THROW(mha::sdpa(q, k_ok, v_ok, bad_p), mha::Error);
  EXPECT_THROW(mha::sdpa(Tensor({1, 3, 2}), k_ok, v_ok, reference()), mha::Error);
  SdpaOptions fused = reference();
  fused.backend = Backend::Fused;
  fused.masks.causal = Causal::top_left();
  // Either the fused kernel runs, or asking for it explicitly says why it cannot.
  try {
    mha::sdpa(q, k_ok, v_ok, fused);
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Fused"), std::string::npos);
  }
}

}  // namespace
