// Head metrics and classes on weights with known answers, head pruning against ablation, and
// pictures read back from PNG.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "mha/analysis.h"
#include "mha/image.h"
#include "mha/module.h"
#include "mha/prune.h"
#include "support/test_support.h"

namespace mha {
namespace {

using mha::testing::all_close;
using mha::testing::random_tensor;

constexpr double kTol = 1e-12;  // metrics are double sums of exact 0/1 or 1/n floats

/// (B, h=1, T, T) with row i putting weight 1 on key f(i).
template <class F>
Tensor one_hot_head(int64_t B, int64_t T, F key_of_row) {
  Tensor w({B, 1, T, T});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < T; ++i) w.at({b, 0, i, key_of_row(i)}) = 1.0f;
  return w;
}

TEST(HeadMetrics, PureSinkHead) {
  const int64_t T = 8;
  const auto m = head_metrics(one_hot_head(2, T, [](int64_t) { return int64_t{0}; }));
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].rows, 2 * T);
  EXPECT_NEAR(m[0].sink, 1.0, kTol);
  EXPECT_NEAR(m[0].entropy, 0.0, kTol);
  EXPECT_NEAR(m[0].focus, 1.0, kTol);
  EXPECT_NEAR(m[0].prev_token, 1.0 / (T - 1), kTol);  // only row 1's previous key is key 0
  EXPECT_NEAR(m[0].self, 1.0 / T, kTol);              // only row 0 attends to itself
  EXPECT_EQ(m[0].cls, HeadClass::AttentionSink);
}

TEST(HeadMetrics, PurePreviousTokenHead) {
  const int64_t T = 10;  // causal: row 0 can only look at itself
  const auto m = head_metrics(one_hot_head(1, T, [](int64_t i) { return std::max<int64_t>(i - 1, 0); }));
  EXPECT_NEAR(m[0].prev_token, 1.0, kTol);
  EXPECT_NEAR(m[0].sink, 2.0 / T, kTol);
  EXPECT_NEAR(m[0].self, 1.0 / T, kTol);
  EXPECT_NEAR(m[0].entropy, 0.0, kTol);
  EXPECT_EQ(m[0].cls, HeadClass::PrevToken);
}

TEST(HeadMetrics, IdentityHeadAttendsToItself) {
  const int64_t T = 8;
  const auto m = head_metrics(one_hot_head(1, T, [](int64_t i) { return i; }));
  EXPECT_NEAR(m[0].self, 1.0, kTol);
  EXPECT_NEAR(m[0].prev_token, 0.0, kTol);
  EXPECT_NEAR(m[0].sink, 1.0 / T, kTol);
  EXPECT_EQ(m[0].cls, HeadClass::SelfAttend);
}

TEST(HeadMetrics, OneHotElsewhereIsFocused) {
  const int64_t T = 12;
  const auto m = head_metrics(one_hot_head(1, T, [&](int64_t i) { return (i + 3) % T; }));
  EXPECT_NEAR(m[0].entropy, 0.0, kTol);
  EXPECT_NEAR(m[0].focus, 1.0, kTol);
  EXPECT_EQ(m[0].cls, HeadClass::Focused);
}

TEST(HeadMetrics, UniformHeadHasEntropyLogT) {
  const int64_t T = 16;
  const Tensor w({2, 3, T, T}, 1.0f / T);  // 1/16 is exact in float
  const auto m = head_metrics(w);
  ASSERT_EQ(m.size(), 3u);
  for (const auto& h : m) {
    EXPECT_NEAR(h.entropy, std::log(double(T)), 1e-12);
    EXPECT_NEAR(h.sink, 1.0 / T, kTol);
    EXPECT_NEAR(h.prev_token, 1.0 / T, kTol);
    EXPECT_NEAR(h.self, 1.0 / T, kTol);
    EXPECT_NEAR(h.focus, 1.0 / T, kTol);
    EXPECT_EQ(h.cls, HeadClass::Broad);
  }
  // (h, T_q, T_k) is the same as a batch of one.
  const auto m3 = head_metrics(Tensor({3, T, T}, 1.0f / T));
  EXPECT_EQ(m3.size(), 3u);
  EXPECT_NEAR(m3[2].entropy, m[2].entropy, kTol);
  EXPECT_EQ(m3[2].rows, T);
}

TEST(HeadMetrics, FullyMaskedRowsAreExcludedFromEveryMean) {
  const int64_t T = 8;
  Tensor w = one_hot_head(1, T, [](int64_t i) { return std::max<int64_t>(i - 1, 0); });
  for (int64_t i : {3, 6})
    for (int64_t j = 0; j < T; ++j) w.at({0, 0, i, j}) = 0.0f;  // rows 3 and 6 fully masked
  const auto m = head_metrics(w);
  EXPECT_EQ(m[0].rows, T - 2);
  EXPECT_NEAR(m[0].prev_token, 1.0, kTol);
  EXPECT_NEAR(m[0].sink, 2.0 / (T - 2), kTol);
  EXPECT_NEAR(m[0].focus, 1.0, kTol);
  // A head with every row masked has nothing to measure.
  const auto empty = head_metrics(Tensor({1, 2, 3, 3}, 0.0f));
  EXPECT_EQ(empty[1].rows, 0);
  EXPECT_EQ(empty[1].cls, HeadClass::Empty);
  EXPECT_STREQ(head_class_name(empty[1].cls), "empty");
}

TEST(HeadMetrics, RectangularWeightsAlignBottomRightByDefault) {
  // T_q = 2 new queries at positions 3 and 4 of T_k = 5 keys (as in decoding with a cache).
  Tensor w({1, 1, 2, 5});
  w.at({0, 0, 0, 2}) = 1.0f;  // query at position 3 → key 2: previous token
  w.at({0, 0, 1, 3}) = 1.0f;  // query at position 4 → key 3: previous token
  EXPECT_NEAR(head_metrics(w)[0].prev_token, 1.0, kTol);
  EXPECT_NEAR(head_metrics(w)[0].self, 0.0, kTol);
  // With an explicit offset 0 (top-left), query 0 has no previous key and query 1's is key 0.
  MetricsOptions top_left;
  top_left.query_offset = 0;
  const auto m = head_metrics(w, top_left);
  EXPECT_NEAR(m[0].prev_token, 0.0, kTol);
  EXPECT_NEAR(m[0].self, 0.0, kTol);
  // T = 1: no previous token exists; the mean over no rows is 0.
  EXPECT_NEAR(head_metrics(Tensor({1, 1, 1, 1}, 1.0f))[0].prev_token, 0.0, kTol);
}

TEST(HeadMetrics, ClassThresholdsAreStrictAndInTheLessonsOrder) {
  const HeadThresholds t;
  HeadMetrics m;
  m.rows = 1;
  m.entropy = 3.0;
  const auto above = [](double x) { return std::nextafter(x, 1e9); };
  EXPECT_EQ(classify(m, t), HeadClass::Broad);
  m.sink = 0.4;
  EXPECT_EQ(classify(m, t), HeadClass::Broad) << "sink = 0.4 is not > 0.4";
  m.sink = above(0.4);
  EXPECT_EQ(classify(m, t), HeadClass::AttentionSink);
  m.sink = 0.0, m.prev_token = 0.3;
  EXPECT_EQ(classify(m, t), HeadClass::Broad);
  m.prev_token = above(0.3);
  EXPECT_EQ(classify(m, t), HeadClass::PrevToken);
  m.prev_token = 0.0, m.self = 0.4;
  EXPECT_EQ(classify(m, t), HeadClass::Broad);
  m.self = above(0.4);
  EXPECT_EQ(classify(m, t), HeadClass::SelfAttend);
  m.self = 0.0, m.entropy = 0.5;
  EXPECT_EQ(classify(m, t), HeadClass::Broad) << "entropy = 0.5 is not < 0.5";
  m.entropy = std::nextafter(0.5, 0.0);
  EXPECT_EQ(classify(m, t), HeadClass::Focused);
  // Order: a head over every threshold is a sink; without the sink, previous-token; and so on.
  m.sink = 0.9, m.prev_token = 0.9, m.self = 0.9;
  EXPECT_EQ(classify(m, t), HeadClass::AttentionSink);
  m.sink = 0.0;
  EXPECT_EQ(classify(m, t), HeadClass::PrevToken);
  m.prev_token = 0.0;
  EXPECT_EQ(classify(m, t), HeadClass::SelfAttend);
  // Configurable.
  HeadThresholds strict;
  strict.self_attend = 0.95;
  EXPECT_EQ(classify(m, strict), HeadClass::Focused);
}

TEST(HeadMetrics, RejectsBadInput) {
  EXPECT_THROW(head_metrics(Tensor({4, 4}, 0.25f)), Error);
  EXPECT_THROW(head_metrics(Tensor({1, 1, 1, 4, 4}, 0.25f)), Error);
  Tensor neg({1, 2, 2}, 0.5f);
  neg.at({0, 1, 1}) = -0.5f;
  EXPECT_THROW(head_metrics(neg), Error);
  Tensor nan({1, 2, 2}, 0.5f);
  nan.at({0, 0, 0}) = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(head_metrics(nan), Error);
  try {
    head_metrics(neg);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_metrics"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(1, 2, 2)"), std::string::npos) << e.what();
  }
}

// ---- pruning -----------------------------------------------------------------------------------

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
    prune_heads(m, {1});
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
    prune_heads(m, {1, 0});
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

// ---- pictures ----------------------------------------------------------------------------------

TEST(Image, PngRoundTripsExactly) {
  Image img(7, 5);
  for (int64_t y = 0; y < 5; ++y)
    for (int64_t x = 0; x < 7; ++x)
      img.set(x, y, {static_cast<uint8_t>(x * 30), static_cast<uint8_t>(y * 50), static_cast<uint8_t>(x + y)});
  const std::string path = mha::testing::temp_dir() + "/rt.png";
  write_png(path, img);
  const Image back = read_png(path);
  EXPECT_EQ(back.width, 7);
  EXPECT_EQ(back.height, 5);
  EXPECT_EQ(back.rgb, img.rgb);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(Image, ReadPngRejectsOtherFiles) {
  const std::string path = mha::testing::temp_dir() + "/not.png";
  std::ofstream(path) << "definitely not a png";
  EXPECT_THROW(read_png(path), Error);
  EXPECT_THROW(read_png(path + ".missing"), Error);
  EXPECT_THROW(write_png(path, Image()), Error);
}

TEST(Image, HeatmapShowsDiagonalMaskedCellsAndMaskedRows) {
  const int64_t T = 6;
  Tensor w({3, T, T});
  for (int64_t i = 0; i < T; ++i) {
    w.at({0, i, i}) = 1.0f;                                                               // head 0: the diagonal
    for (int64_t j = 0; j <= i; ++j) w.at({1, i, j}) = 1.0f / static_cast<float>(i + 1);  // causal uniform
    if (i != 2)
      for (int64_t j = 0; j < T; ++j) w.at({2, i, j}) = 1.0f / T;  // row 2 fully masked
  }
  HeatmapOptions opt;
  opt.title = "test";
  opt.panel_titles = {"head 0: self_attend", "head 1: broad", "head 2: broad"};
  opt.query_labels = opt.key_labels = {"The", "cat", "sat", "on", "the", "mat"};
  const std::string path = mha::testing::temp_dir() + "/heads.png";
  write_heatmap_png(path, w, opt);
  const Image img = read_png(path);
  const Image direct = render_heatmap_grid(w, opt);
  EXPECT_EQ(img.width, direct.width);
  EXPECT_EQ(img.height, direct.height);
  EXPECT_EQ(img.rgb, direct.rgb);
  const HeatmapPlacement L = heatmap_placement(w, opt);
  EXPECT_GE(L.cell, 8);
  const Rgb hot = heat_color(1.0);
  for (int64_t i = 0; i < T; ++i) {
    EXPECT_EQ(img.pixel(L.center_x(0, i), L.center_y(0, i)), hot) << "diagonal cell " << i;
    if (i + 1 < T) {
      EXPECT_EQ(img.pixel(L.center_x(0, i + 1), L.center_y(0, i)), masked_color());
    }
  }
  EXPECT_EQ(img.pixel(L.center_x(1, 5), L.center_y(1, 0)), masked_color()) << "causally masked cell is blank";
  EXPECT_EQ(img.pixel(L.center_x(1, 0), L.center_y(1, 0)), hot);
  EXPECT_EQ(img.pixel(L.center_x(1, 0), L.center_y(1, 3)), heat_color(0.25));
  for (int64_t j = 0; j < T; ++j) {
    EXPECT_EQ(img.pixel(L.center_x(2, j), L.center_y(2, 2)), masked_color()) << "fully masked row";
    EXPECT_EQ(img.pixel(L.center_x(2, j), L.center_y(2, 1)), heat_color(1.0 / T));
  }
  // Colours on the scale are never the masked colour.
  for (int n = 0; n <= 100; ++n) EXPECT_NE(heat_color(n / 100.0), masked_color());
  // Text was drawn: the title row has black pixels.
  bool ink = false;
  for (int64_t x = 0; x < img.width && !ink; ++x)
    for (int64_t y = 12; y < 26 && !ink; ++y) ink = img.pixel(x, y) == Rgb{0, 0, 0};
  EXPECT_TRUE(ink);

  const std::string svg = mha::testing::temp_dir() + "/heads.svg";
  write_heatmap_svg(svg, w, opt);
  std::ifstream f(svg);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.rfind("<svg", 0), 0u);
  EXPECT_NE(text.find("head 0: self_attend"), std::string::npos);
  EXPECT_NE(text.find("</svg>"), std::string::npos);
}

TEST(Image, HeatmapRejectsBadOptions) {
  const Tensor w({2, 3, 3}, 0.25f);
  HeatmapOptions o;
  o.key_labels = {"a", "b"};
  EXPECT_THROW(render_heatmap_grid(w, o), Error);
  EXPECT_THROW(render_heatmap_grid(Tensor({3}, 1.0f)), Error);
  HeatmapOptions v;
  v.vmax = 0;
  EXPECT_THROW(render_heatmap_grid(w, v), Error);
  EXPECT_NO_THROW(render_heatmap_grid(Tensor({3, 4}, 0.25f)));  // a single (T_q, T_k) panel
}

TEST(Image, LinePlotDrawsSeriesAndLegend) {
  Series a{"loss", {1, 10, 100, 1000}, {4.0, 2.0, 1.0, 0.5}};
  Series b{"baseline", {1, 1000}, {3.0, 3.0}};
  LinePlotOptions o;
  o.log_x = true;
  const std::string path = mha::testing::temp_dir() + "/plot.png";
  write_line_plot_png(path, "training loss", "step", "loss", {a, b}, o);
  const Image img = read_png(path);
  EXPECT_EQ(img.width, o.width);
  EXPECT_EQ(img.height, o.height);
  int64_t blue = 0, orange = 0;
  for (int64_t y = 0; y < img.height; ++y)
    for (int64_t x = 0; x < img.width; ++x) {
      blue += img.pixel(x, y) == Rgb{31, 119, 180};
      orange += img.pixel(x, y) == Rgb{230, 110, 10};
    }
  EXPECT_GT(blue, 200);  // a 2-px line across the plot
  EXPECT_GT(orange, 200);
  EXPECT_THROW(render_line_plot("t", "x", "y", {{"bad", {0, 1}, {1, 2}}}, o), Error);  // x = 0 on log axis
  EXPECT_THROW(render_line_plot("t", "x", "y", {{"bad", {1, 2}, {1}}}), Error);
  EXPECT_NO_THROW(render_line_plot("empty", "x", "y", {}));
  EXPECT_NO_THROW(render_line_plot("flat", "x", "y", {{"c", {1, 2, 3}, {5, 5, 5}}}));
  const std::string svg = mha::testing::temp_dir() + "/plot.svg";
  write_line_plot_svg(svg, "training loss", "step", "loss", {a, b}, o);
  EXPECT_TRUE(std::filesystem::file_size(svg) > 500);
}

}  // namespace
}  // namespace mha
