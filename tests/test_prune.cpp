// Head pruning against ablation: a pruned module computes exactly what the original does with
// those heads' output columns zeroed, for MHA, cross-attention and grouped-query attention.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "mha/module.h"
#include "mha/prune.h"
#include "support/test_support.h"

namespace mha {
namespace {

using mha::testing::all_close;
using mha::testing::random_tensor;

/// Random weights and biases everywhere (the constructor leaves biases at zero).
MultiheadAttention random_module(MhaConfig c, uint64_t seed) {
  MultiheadAttention m(c, seed);
  MhaParameters& p = m.params();
  uint64_t s = seed * 100;
  for (Tensor* t : {&p.in_proj_bias, &p.out_proj_bias, &p.bias_k, &p.bias_v})
    if (t->defined()) *t = random_tensor(t->shape(), ++s, -0.5f, 0.5f);
  return m;
}

/// Output and kept heads' weights of prune_heads equal the original with those heads ablated.
void expect_prune_exact(const MultiheadAttention& m, const std::vector<int64_t>& heads, const Tensor& q,
                        const Tensor& k, const Tensor& v, const PruneOptions& po = {}) {
  const MultiheadAttention pruned = prune_heads(m, heads, po);
  const MultiheadAttention ablated = ablate_heads(m, heads);
  MhaForwardOptions opt;
  opt.need_weights = NeedWeights::PerHead;
  const MhaOutput a = ablated.forward(q, k, v, opt);
  const MhaOutput b = pruned.forward(q, k, v, opt);
  // Float32 sums over E and h·d terms of O(1) values, in different GEMM blockings: a few ulps of
  // the largest partial sum, 64·ε covers it.
  const double tol = 64 * std::numeric_limits<float>::epsilon();
  EXPECT_TRUE(all_close(b.output, a.output, tol, tol));
  // The kept heads' attention weights are the original's, in order.
  const int64_t H = m.config().num_heads, H2 = pruned.config().num_heads;
  ASSERT_EQ(H2, H - static_cast<int64_t>(heads.size()));
  const int64_t B = a.attn_weights.size(0), Tq = a.attn_weights.size(2), S = a.attn_weights.size(3);
  Tensor kept({B, H2, Tq, S});
  for (int64_t bb = 0; bb < B; ++bb) {
    int64_t n = 0;
    for (int64_t h = 0; h < H; ++h) {
      if (std::find(heads.begin(), heads.end(), h) != heads.end()) continue;
      for (int64_t i = 0; i < Tq; ++i)
        for (int64_t j = 0; j < S; ++j) kept.at({bb, n, i, j}) = a.attn_weights.at({bb, h, i, j});
      ++n;
    }
  }
  EXPECT_TRUE(all_close(b.attn_weights, kept, tol, tol));
  EXPECT_EQ(pruned.config().head_dim(), m.config().head_dim());
  // Duplicated K/V heads can outweigh the removed query heads; otherwise pruning only removes.
  if (po.uneven_groups == UnevenGroups::Refuse) {
    EXPECT_LT(pruned.parameter_count(), m.parameter_count());
  }
}

TEST(Prune, MhaEqualsAblation) {
  MhaConfig c;
  c.embed_dim = 16, c.num_heads = 4, c.layout = Layout::BatchFirst;
  const MultiheadAttention m = random_module(c, 3);
  const Tensor x = random_tensor({2, 5, 16}, 11);
  expect_prune_exact(m, {1, 3}, x, x, x);
  expect_prune_exact(m, {0}, x, x, x);
  const MultiheadAttention p = prune_heads(m, {2, 0});
  EXPECT_EQ(p.config().num_heads, 2);
  EXPECT_EQ(p.config().kv_heads(), 2);
  EXPECT_EQ(p.params().out_proj_weight.shape(), (Shape{16, 8}));
  EXPECT_EQ(p.params().in_proj_weight.shape(), (Shape{24, 16}));
}

TEST(Prune, CrossAttentionWithBiasKvAndSeparateProjections) {
  MhaConfig c;
  c.embed_dim = 12, c.num_heads = 3, c.kdim = 5, c.vdim = 7, c.add_bias_kv = true, c.add_zero_attn = true;
  const MultiheadAttention m = random_module(c, 5);
  const Tensor q = random_tensor({4, 2, 12}, 1), k = random_tensor({6, 2, 5}, 2), v = random_tensor({6, 2, 7}, 3);
  expect_prune_exact(m, {1}, q, k, v);
  expect_prune_exact(m, {0, 2}, q, k, v);
}

TEST(Prune, GqaWholeGroupsAndEvenGroups) {
  MhaConfig c;
  c.embed_dim = 32, c.num_heads = 8, c.num_kv_heads = 2, c.layout = Layout::BatchFirst;
  const MultiheadAttention m = random_module(c, 7);
  const Tensor x = random_tensor({2, 6, 32}, 13);
  expect_prune_exact(m, {0, 1, 2, 3}, x, x, x);  // all of group 0: its K/V go too
  EXPECT_EQ(prune_heads(m, {0, 1, 2, 3}).config().kv_heads(), 1);
  expect_prune_exact(m, {1, 5}, x, x, x);  // one from each group: 3 + 3, K/V kept
  const MultiheadAttention even = prune_heads(m, {1, 5});
  EXPECT_EQ(even.config().num_heads, 6);
  EXPECT_EQ(even.config().kv_heads(), 2);
}

TEST(Prune, GqaUnevenGroupsRefusedOrDuplicated) {
  MhaConfig c;
  c.embed_dim = 32, c.num_heads = 8, c.num_kv_heads = 2, c.layout = Layout::BatchFirst;
  const MultiheadAttention m = random_module(c, 9);
  try {
    (void)prune_heads(m, {1});
    FAIL() << "uneven groups must be refused by default";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("group 0 (heads 0..3) keeps 3 [0, 2, 3]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("group 1 (heads 4..7) keeps 4"), std::string::npos) << msg;
  }
  PruneOptions dup;
  dup.uneven_groups = UnevenGroups::DuplicateKV;
  const Tensor x = random_tensor({1, 5, 32}, 17);
  expect_prune_exact(m, {1}, x, x, x, dup);  // counts 3 and 4: gcd 1, one K/V copy per query head
  EXPECT_EQ(prune_heads(m, {1}, dup).config().kv_heads(), 7);
  expect_prune_exact(m, {0, 1, 4, 5, 6, 7}, x, x, x);  // 2 left in group 0 only: even
  MhaConfig c3 = c;
  c3.num_heads = 12, c3.num_kv_heads = 2, c3.embed_dim = 48;  // groups of 6
  const MultiheadAttention m3 = random_module(c3, 10);
  const Tensor x3 = random_tensor({1, 4, 48}, 19);
  expect_prune_exact(m3, {0, 1}, x3, x3, x3, dup);  // counts 4 and 6: gcd 2 → 2 + 3 K/V copies
  EXPECT_EQ(prune_heads(m3, {0, 1}, dup).config().kv_heads(), 5);
}

TEST(Prune, RefusesBadHeadLists) {
  MhaConfig c;
  c.embed_dim = 8, c.num_heads = 2;
  const MultiheadAttention m(c, 1);
  EXPECT_THROW(prune_heads(m, {0, 1}), Error);
  EXPECT_THROW(prune_heads(m, {2}), Error);
  EXPECT_THROW(prune_heads(m, {-1}), Error);
  EXPECT_THROW(prune_heads(m, {0, 0}), Error);
  EXPECT_THROW(ablate_heads(m, {5}), Error);
  try {
    (void)prune_heads(m, {1, 0});
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot prune every head"), std::string::npos) << e.what();
  }
  // Pruning nothing returns an equal module.
  const Tensor x = random_tensor({3, 1, 8}, 2);
  EXPECT_TRUE(all_close(prune_heads(m, {}).forward(x, x, x).output, m.forward(x, x, x).output, 0, 0));
}

TEST(Prune, HeadDimOverrideValidatesAndRoundTrips) {
  MhaConfig c;
  c.embed_dim = 10, c.num_heads = 3;
  EXPECT_THROW(c.validate(), Error);
  c.head_dim_override = 4;
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.head_dim(), 4);
  EXPECT_EQ(parameter_count(c), 4 * 3 * 4 * 10 + 3 * 12 + 10);
  c.head_dim_override = -1;
  EXPECT_THROW(c.validate(), Error);
}

TEST(Prune, ImportanceByAblation) {
  MhaConfig c;
  c.embed_dim = 16, c.num_heads = 4, c.layout = Layout::BatchFirst;
  MultiheadAttention m = random_module(c, 21);
  // Head 2 writes nothing: its W_O columns are zero, so removing it changes nothing.
  m = ablate_heads(m, {2});
  const Tensor x = random_tensor({2, 6, 16}, 23);
  const std::vector<double> imp = head_importance(m, x, x, x);
  ASSERT_EQ(imp.size(), 4u);
  EXPECT_EQ(imp[2], 0.0);
  for (int h : {0, 1, 3}) EXPECT_GT(imp[static_cast<size_t>(h)], 1e-3);
  // Head 0's score by hand: ‖y − y₋₀‖ / ‖y‖.
  const Tensor y = m.forward(x, x, x).output, y0 = ablate_heads(m, {0}).forward(x, x, x).output;
  double num = 0, den = 0;
  for (int64_t n = 0; n < y.numel(); ++n) {
    num += std::pow(double(y.data()[n]) - y0.data()[n], 2);
    den += std::pow(double(y.data()[n]), 2);
  }
  EXPECT_NEAR(imp[0], std::sqrt(num / den), 1e-12);
}

}  // namespace
}  // namespace mha
