// Head metrics and classes on weights with known answers. (Pruning: test_prune.cpp; pictures:
// test_image.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "mha/analysis.h"
#include "mha/module.h"
#include "support/test_support.h"

namespace mha {
namespace {

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

// Columns after the real keys (the bias_k / zero-attention keys a module appends) are no query's
// own or previous position: a head that puts most of its weight on an appended bias_k column has
// no self or previous-token mass there, even for queries whose i + offset reaches that column.
TEST(HeadMetrics, AppendedKeyColumnsAreNoPosition) {
  constexpr int64_t kTq = 4, kReal = 2;
  Tensor w({1, 1, kTq, kReal + 1});
  for (int64_t i = 0; i < kTq; ++i) {  // every query: half on bias_k, a quarter on each real key
    w.at({0, 0, i, kReal}) = 0.5f;
    for (int64_t j = 0; j < kReal; ++j) w.at({0, 0, i, j}) = 0.25f;
  }
  MetricsOptions o;
  o.query_offset = 0;  // a top-left causal mask, T_q > T_k
  o.key_positions = kReal;
  auto m = head_metrics(w, o)[0];
  EXPECT_NEAR(m.self, 0.25, kTol);        // queries 0 and 1; query 2's own key would be bias_k
  EXPECT_NEAR(m.prev_token, 0.25, kTol);  // queries 1 and 2; query 3's previous key would be bias_k
  EXPECT_EQ(m.rows, kTq);
  EXPECT_NEAR(m.focus, 0.5, kTol);  // the appended column's mass still counts in focus and entropy
  EXPECT_NE(m.cls, HeadClass::PrevToken);
  // Counted as a position, the column was query 2's own key and query 3's previous one.
  o.key_positions.reset();
  m = head_metrics(w, o)[0];
  EXPECT_NEAR(m.self, (0.25 + 0.25 + 0.5) / 3, kTol);
  EXPECT_NEAR(m.prev_token, (0.25 + 0.25 + 0.5) / 3, kTol);
  // The default offset is bottom-right over the positions: key_positions − T_q.
  Tensor last({1, 1, 2, kReal + 2 + 1});  // 4 real keys and one appended: queries at positions 2, 3
  last.at({0, 0, 0, 1}) = 1.0f, last.at({0, 0, 1, 2}) = 1.0f;
  MetricsOptions four;
  four.key_positions = 4;
  EXPECT_NEAR(head_metrics(last, four)[0].prev_token, 1.0, kTol);
  EXPECT_EQ(head_metrics(last)[0].prev_token, 0.0);  // counted as 5 positions: queries at 3, 4
  // Outside [0, T_k]: an error naming it.
  for (const int64_t bad : {int64_t{-1}, kReal + 2}) {
    o.key_positions = bad;
    try {
      head_metrics(w, o);
      ADD_FAILURE() << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("key_positions"), std::string::npos) << e.what();
    }
  }
}

// Rows whose only visible keys are the appended bias_k / zero-attention ones (every real key
// hidden: weight exactly 0 there) put all their weight on those columns. Counted, they read as
// focus 1 and entropy 0 and made a broad head look focused; they are left out like fully masked
// rows. A row with any weight on a real key, however little, is measured.
TEST(HeadMetrics, RowsThatSeeOnlyAppendedKeysAreNotMeasured) {
  constexpr int64_t kTq = 6, kReal = 4;
  Tensor w({2, 1, kTq, kReal + 2});  // bias_k, then the zero-attention key
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < kTq; ++i) {
      float* row = &w.at({b, 0, i, 0});
      if (b == 0 && i < 2) {  // queries 0, 1 of sequence 0 see no real key
        row[kReal] = 0.75f, row[kReal + 1] = 0.25f;
        continue;
      }
      for (int64_t j = 0; j < kReal + 2; ++j) row[j] = 1.0f / (kReal + 2);  // uniform over all six
    }
  w.at({1, 0, 5, kReal}) = 1.0f - 1e-30f;  // one real key barely seen: still measured
  for (int64_t j = 0; j < kReal + 2; ++j)
    if (j != kReal) w.at({1, 0, 5, j}) = j == 1 ? 1e-30f : 0.0f;
  MetricsOptions o;
  o.key_positions = kReal;
  const HeadMetrics m = head_metrics(w, o)[0];
  EXPECT_EQ(m.rows, 2 * kTq - 2);
  const double uniform_rows = 2 * kTq - 3;
  EXPECT_NEAR(m.entropy, uniform_rows * std::log(6.0) / (2 * kTq - 2), 1e-6);
  EXPECT_NEAR(m.focus, (uniform_rows * static_cast<double>(1.0f / (kReal + 2)) + 1.0) / (2 * kTq - 2), kTol);
  EXPECT_EQ(m.cls, HeadClass::Broad);
  // As positions (key_positions unset), every row has weight on one: all are measured.
  EXPECT_EQ(head_metrics(w)[0].rows, 2 * kTq);
  // key_positions = 0: no row sees a position, so the head has nothing to measure.
  o.key_positions = 0;
  EXPECT_EQ(head_metrics(w, o)[0].rows, 0);
  EXPECT_EQ(head_metrics(w, o)[0].cls, HeadClass::Empty);
  // A head whose every row sees only the appended keys is empty, not focused.
  Tensor only_appended({1, 1, kTq, kReal + 1});
  for (int64_t i = 0; i < kTq; ++i) only_appended.at({0, 0, i, kReal}) = 1.0f;
  o.key_positions = kReal;
  EXPECT_EQ(head_metrics(only_appended, o)[0].cls, HeadClass::Empty);
}

// Through the module: weights of add_bias_kv and add_zero_attn under a bottom-right causal mask
// with T_q > T_k (queries 0, 1 see no real key) and a key padding mask that hides all but the
// last real key of sequence 1 (then queries 0 … 4 see none there). The masks give those rows
// weight exactly 0 on every real key, so the rows measured are the rows that see a real key.
TEST(HeadMetrics, ModuleRowsWhoseMasksHideEveryRealKeyAreNotMeasured) {
  constexpr int64_t kE = 8, kH = 2, kTq = 6, kTk = 4, kB = 2;
  MhaConfig c;
  c.embed_dim = kE, c.num_heads = kH, c.add_bias_kv = true, c.add_zero_attn = true;
  c.layout = Layout::BatchFirst;
  const MultiheadAttention module(c, 3);
  MhaForwardOptions opt;
  opt.causal = Causal::bottom_right();
  opt.need_weights = NeedWeights::PerHead;
  opt.key_padding_mask.is_padding = BoolTensor({kB, kTk});
  for (int64_t j = 0; j < kTk - 1; ++j) opt.key_padding_mask.is_padding.at({1, j}) = 1;
  const Tensor q = testing::random_tensor({kB, kTq, kE}, 4), kv = testing::random_tensor({kB, kTk, kE}, 5);
  const Tensor w = module.forward(q, kv, kv, opt).attn_weights;
  ASSERT_EQ(w.size(3), kTk + 2);
  // Query i sees real key j when j ≤ i − (T_q − T_k) and j is not padding.
  int64_t seeing = 0;
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t i = 0; i < kTq; ++i) {
      bool sees = false;
      for (int64_t j = 0; j < kTk; ++j)
        sees = sees || (j <= i - (kTq - kTk) && opt.key_padding_mask.is_padding.at({b, j}) == 0);
      seeing += sees;
      for (int64_t h = 0; h < kH; ++h) {
        float appended = 0;
        for (int64_t j = kTk; j < kTk + 2; ++j) appended += w.at({b, h, i, j});
        if (!sees) {
          EXPECT_NEAR(appended, 1.0f, 1e-6) << b << " " << i;  // all of it on bias_k and the zero key
        }
      }
    }
  EXPECT_EQ(seeing, kB * kTq - 2 - 5);
  MetricsOptions o;
  o.key_positions = kTk;
  o.query_offset = opt.causal.offset_for(kTq, kTk);
  o.key_padding = opt.key_padding_mask.is_padding;
  for (const HeadMetrics& m : head_metrics(w, o)) EXPECT_EQ(m.rows, seeing) << "head " << m.head;
}

// Padding (true = padding): the sink is each sequence's first real key (left padding puts none of
// the weight on key 0), and padded query rows are not measured.
TEST(HeadMetrics, PaddingMovesTheSinkAndLeavesPaddedQueriesOut) {
  Tensor w({2, 1, 3, 3});
  for (int64_t i = 0; i < 3; ++i) {
    w.at({0, 0, i, 0}) = 1.0f;  // batch 0, no padding: every row on key 0
    w.at({1, 0, i, 1}) = 1.0f;  // batch 1, key 0 padded: every row on key 1, its first real key
  }
  BoolTensor keys({2, 3}), queries({2, 3});
  keys.data()[3] = 1;     // batch 1, key 0
  queries.data()[3] = 1;  // batch 1, query 0
  MetricsOptions o;
  EXPECT_NEAR(head_metrics(w, o)[0].sink, 0.5, kTol);  // key 0 in both sequences
  o.key_padding = keys;
  EXPECT_NEAR(head_metrics(w, o)[0].sink, 1.0, kTol);
  EXPECT_EQ(head_metrics(w, o)[0].rows, 6);
  o.query_padding = queries;
  EXPECT_EQ(head_metrics(w, o)[0].rows, 5);
  // One sequence's (h, T_q, T_k) weights take (T) masks as well as (1, T).
  const Tensor one({1, 3, 3}, 1.0f / 3.0f);
  MetricsOptions flat;
  flat.key_padding = BoolTensor({3});
  flat.key_padding.data()[0] = 1;
  EXPECT_EQ(head_metrics(one, flat)[0].sink, static_cast<double>(1.0f / 3.0f));
  // Wrong shapes name the mask and the shape expected.
  MetricsOptions bad;
  bad.query_padding = BoolTensor({2, 4});
  try {
    head_metrics(w, bad);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("query_padding (2, 4) must be (B, 3) = (2, 3)"), std::string::npos)
        << e.what();
  }
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
  // Offsets past ±2⁴⁰ (where i + offset and the key before it would overflow near ±2⁶³) are errors;
  // the edge itself is valid and puts every query's own key outside the row.
  MetricsOptions far;
  for (const int64_t offset : {std::numeric_limits<int64_t>::min(), -(int64_t{1} << 40) - 1, (int64_t{1} << 40) + 1,
                               std::numeric_limits<int64_t>::max()}) {
    far.query_offset = offset;
    EXPECT_THROW(head_metrics(Tensor({1, 2, 2}, 0.5f), far), Error) << offset;
  }
  far.query_offset = int64_t{1} << 40;
  EXPECT_EQ(head_metrics(Tensor({1, 2, 2}, 0.5f), far)[0].self, 0.0);
}

}  // namespace
}  // namespace mha
