// The multi-head module: configuration, layouts, masks, parameter counts and errors.
#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "layers/scratch_pool.h"
#include "mha/module.h"
#include "mha/training.h"
#include "support/test_support.h"

namespace {

using mha::Layout;
using mha::MhaConfig;
using mha::MultiheadAttention;
using mha::Tensor;
using mha::testing::random_tensor;

MhaConfig config(int64_t E, int64_t h, Layout layout = Layout::BatchFirst) {
  MhaConfig c;
  c.embed_dim = E;
  c.num_heads = h;
  c.layout = layout;
  return c;
}

/// (B, T, E) → (T, B, E)
Tensor swap01(const Tensor& x) {
  Tensor y({x.size(1), x.size(0), x.size(2)});
  for (int64_t a = 0; a < x.size(0); ++a)
    for (int64_t b = 0; b < x.size(1); ++b)
      for (int64_t c = 0; c < x.size(2); ++c) y.at({b, a, c}) = x.at({a, b, c});
  return y;
}

void expect_error_mentions(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected mha::Error mentioning " << needle;
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(TensorStorage, ConstructorsFillCopyMoveOrLeaveUnwritten) {
  EXPECT_EQ(Tensor({2, 2}).storage(), (mha::TensorStorage<float>{0, 0, 0, 0}));
  EXPECT_EQ(Tensor({3}, 1.5f).storage(), (mha::TensorStorage<float>{1.5f, 1.5f, 1.5f}));
  EXPECT_EQ(Tensor({3}, {1, 2, 3}).storage(), (mha::TensorStorage<float>{1, 2, 3}));
  const std::vector<float> values{4, 5};
  EXPECT_EQ(Tensor({2}, values).storage(), (mha::TensorStorage<float>{4, 5}));
  mha::TensorStorage<float> owned(6, 7.0f);
  const float* where = owned.data();
  const Tensor moved({2, 3}, std::move(owned));
  EXPECT_EQ(moved.data(), where);  // moved in, not copied
  Tensor blank = Tensor::uninitialized({4, 5});
  EXPECT_EQ(blank.shape(), (mha::Shape{4, 5}));
  EXPECT_EQ(blank.numel(), 20);
  for (int64_t i = 0; i < blank.numel(); ++i) blank.data()[i] = static_cast<float>(i);
  EXPECT_EQ(blank.at({3, 4}), 19.0f);
  EXPECT_EQ(Tensor::uninitialized({0, 3}).numel(), 0);
  expect_error_mentions([] { (void)Tensor::uninitialized({2, -1}); }, "negative extent");
  expect_error_mentions([] { (void)Tensor({2}, std::vector<float>{1, 2, 3}); }, "do not fill");
}

/// The cache of freed tensor blocks at a given limit for one test, restored (and emptied) after.
struct TensorCacheLimit {
  size_t before = mha::tensor_cache_limit();
  explicit TensorCacheLimit(size_t bytes) {
    mha::release_cached_tensors();
    mha::set_tensor_cache_limit(bytes);
  }
  ~TensorCacheLimit() {
    mha::release_cached_tensors();
    mha::set_tensor_cache_limit(before);
  }
};

constexpr int64_t kFourMiB = int64_t{1} << 20;  // floats

TEST(Tensor, AtTakesOneIndexPerAxisAndSizeAnAxisThatExists) {
  Tensor t({2, 3});
  t.at({1, 2}) = 5.0f;
  EXPECT_EQ(t.data()[5], 5.0f);
  EXPECT_EQ(t.size(-1), 3);
  EXPECT_EQ(t.size(-2), 2);
  // One index for a rank-2 tensor read element 1 (the rest flattened); three read past the shape.
  const std::string few = mha::testing::error_of([&] { t.at({1}) = 1.0f; });
  EXPECT_NE(few.find("Tensor::at: 1 indices for a rank-2 tensor (2, 3)"), std::string::npos) << few;
  const std::string many = mha::testing::error_of([&] { (void)std::as_const(t).at({0, 0, 1}); });
  EXPECT_NE(many.find("3 indices"), std::string::npos) << many;
  // size() threw std::out_of_range, not the mha::Error every bad argument gets.
  for (const int64_t axis : {2, -3}) {
    const std::string e = mha::testing::error_of([&] { (void)t.size(axis); });
    EXPECT_NE(e.find("Tensor::size: axis " + std::to_string(axis)), std::string::npos) << e;
  }
}

TEST(TensorCache, FreedLargeBlocksServeRequestsOfTheirSizeUpToTheLimit) {
  const TensorCacheLimit scope(size_t{11} << 20);
  constexpr size_t kMiB = size_t{1} << 20;
  const float* first = nullptr;
  {
    Tensor a = Tensor::uninitialized({kFourMiB});
    first = a.data();
  }
  EXPECT_EQ(mha::cached_tensor_bytes(), 4 * kMiB);
  {
    Tensor other = Tensor::uninitialized({kFourMiB + 16});  // another size: a new block
    EXPECT_NE(other.data(), first);
    Tensor same({2, kFourMiB / 2}, 1.0f);  // the same bytes, any shape, filled or not: the cached block
    EXPECT_EQ(same.data(), first);
    EXPECT_EQ(same.at({1, kFourMiB / 2 - 1}), 1.0f);
    EXPECT_EQ(mha::cached_tensor_bytes(), 0u);
  }  // `same` freed, then `other` (the most recent)
  EXPECT_EQ(mha::cached_tensor_bytes(), 8 * kMiB + 64);
  { Tensor six = Tensor::uninitialized({kFourMiB / 2 * 3}); }
  // 14 MiB + 64 bytes would pass the 11 MiB limit: the oldest block (`same`'s) is freed.
  EXPECT_EQ(mha::cached_tensor_bytes(), 10 * kMiB + 64);
  { Tensor small = Tensor::uninitialized({1000}); }  // under 4 MiB: never cached
  EXPECT_EQ(mha::cached_tensor_bytes(), 10 * kMiB + 64);
  mha::set_tensor_cache_limit(8 * kMiB);  // a lower limit frees the oldest beyond it
  EXPECT_EQ(mha::cached_tensor_bytes(), 6 * kMiB);
  EXPECT_EQ(mha::release_cached_tensors(), 6 * kMiB);
  EXPECT_EQ(mha::cached_tensor_bytes(), 0u);
  { Tensor big = Tensor::uninitialized({kFourMiB * 3}); }  // 12 MiB: over the limit, freed
  EXPECT_EQ(mha::cached_tensor_bytes(), 0u);
  mha::set_tensor_cache_limit(0);  // off: every freed block is freed
  { Tensor a = Tensor::uninitialized({kFourMiB}); }
  EXPECT_EQ(mha::cached_tensor_bytes(), 0u);
}

TEST(TensorCache, ThreadsAllocatingAndFreeingAtOnceKeepTheirOwnBlocks) {
  const TensorCacheLimit scope(size_t{12} << 20);
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t, &wrong] {
      for (int round = 0; round < 20; ++round) {
        Tensor a = Tensor::uninitialized({kFourMiB});
        const float mark = static_cast<float>(t * 1000 + round);
        for (int64_t i = 0; i < a.numel(); i += 4096) a.data()[i] = mark;
        for (int64_t i = 0; i < a.numel(); i += 4096)
          if (a.data()[i] != mark) ++wrong;
      }
    });
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_LE(mha::cached_tensor_bytes(), size_t{12} << 20);
}

TEST(TensorCache, ModuleOutputsOverReusedDirtyBlocksAreWhollyWritten) {
  // Per-head weights of 8 MiB and averaged ones of 4 MiB: a repeated call gets the blocks the last
  // one freed, here filled with NaN first; every element must be written again (zeros under the
  // causal mask included).
  const TensorCacheLimit scope(size_t{64} << 20);
  const MultiheadAttention m(config(8, 2), 5);
  const Tensor x = random_tensor({1, 1024, 8}, 6);
  for (const auto weights : {mha::NeedWeights::PerHead, mha::NeedWeights::Averaged}) {
    mha::MhaForwardOptions opt;
    opt.need_weights = weights;
    opt.causal = mha::Causal::top_left();
    const auto want = m.forward(x, x, x, opt);
    for (int round = 0; round < 2; ++round) {
      { Tensor dirty(want.attn_weights.shape(), std::nanf("")); }
      EXPECT_GE(mha::cached_tensor_bytes(), static_cast<size_t>(want.attn_weights.numel()) * sizeof(float));
      const auto got = m.forward(x, x, x, opt);
      EXPECT_TRUE(mha::testing::bitwise_equal(got.attn_weights, want.attn_weights));
      EXPECT_TRUE(mha::testing::bitwise_equal(got.output, want.output));
    }
  }
}

// An attn_mask the module need not widen (no bias_k / zero-attention columns) is read where the
// caller keeps it: the module copied it on every call (a float mask is 256 MiB at T = 8192, found
// by a sweep of the memory per path). The copy would have come back to the cache of freed blocks
// (at least 4 MiB); forward_train keeps its own, as its context outlives the caller's options.
TEST(TensorCache, ModuleForwardDoesNotCopyAnAttnMaskItNeedNotWiden) {
  const TensorCacheLimit scope(size_t{256} << 20);
  const MultiheadAttention m(config(8, 2), 5);
  constexpr int64_t T = 2048;
  const Tensor x = random_tensor({1, T, 8}, 7);
  Tensor bias({T, T}, 0.0f);
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = i + 1; j < T; ++j) bias.at({i, j}) = -1e9f;  // 16 MiB, causal-looking
  mha::MhaForwardOptions plain, masked;
  masked.attn_mask = mha::AttnMask::add(bias);
  mha::release_cached_tensors();
  (void)m.forward(x, x, x, plain);
  const size_t without_mask = mha::cached_tensor_bytes();
  mha::release_cached_tensors();
  const Tensor got = m.forward(x, x, x, masked).output;
  EXPECT_LT(mha::cached_tensor_bytes(), without_mask + (size_t{4} << 20)) << "a mask-sized block came and went";
  mha::MhaForwardOptions causal;
  causal.causal = mha::Causal::top_left();
  EXPECT_TRUE(mha::testing::all_close(got, m.forward(x, x, x, causal).output, 1e-5, 1e-5));
  // Training keeps a copy: the caller's mask may change before the backward.
  mha::MhaForwardOptions train = masked;
  train.attn_mask = mha::AttnMask::add(bias);
  const Tensor d_out = random_tensor({1, T, 8}, 8);
  const mha::MhaGradients want = mha::backward(m, mha::forward_train(m, x, x, x, train).context, d_out);
  mha::MhaTrainOutput t = mha::forward_train(m, x, x, x, train);
  train.attn_mask = mha::AttnMask{};  // the caller's mask freed,
  const Tensor reuse({T, T}, 5.0f);   // its block taken from the cache and overwritten
  EXPECT_TRUE(mha::testing::bitwise_equal(mha::backward(m, t.context, d_out).query, want.query));
}

// The module's output and weights are allocated without a fill (every kernel writes all of them):
// memory that a freed buffer of the same size left full of NaN must not show through, on either
// backend, for per-head and averaged weights, under masks that leave rows with nothing to see,
// NaN inputs and the extra key positions. (The shapes are small, so malloc hands the freed chunks
// back rather than fresh zeroed pages.)
void expect_same_over_dirty_memory(const MultiheadAttention& m, const Tensor& q, const Tensor& kv,
                                   const mha::MhaForwardOptions& opt, const std::string& what) {
  const auto want = m.forward(q, kv, kv, opt);
  for (int round = 0; round < 3; ++round) {
    {
      Tensor dirty_out(want.output.shape(), std::nanf(""));
      Tensor dirty_weights(want.attn_weights.defined() ? want.attn_weights.shape() : mha::Shape{1}, std::nanf(""));
    }
    const auto got = m.forward(q, kv, kv, opt);
    EXPECT_TRUE(mha::testing::bitwise_equal(got.output, want.output)) << what;
    EXPECT_TRUE(mha::testing::bitwise_equal(got.attn_weights, want.attn_weights)) << what;
  }
}

TEST(Module, OutputAndWeightsOverDirtyMemoryAreWhollyWritten) {
  MhaConfig c = config(16, 4);
  const Tensor x = random_tensor({2, 5, 16}, 3);
  Tensor kv = random_tensor({2, 7, 16}, 4);
  for (const bool extra : {false, true}) {
    MhaConfig ce = c;
    ce.add_bias_kv = extra;
    ce.add_zero_attn = extra;
    const MultiheadAttention m(ce, 11);
    for (const auto backend : {mha::Backend::Auto, mha::Backend::Reference})
      for (const auto weights : {mha::NeedWeights::None, mha::NeedWeights::PerHead, mha::NeedWeights::Averaged}) {
        mha::MhaForwardOptions opt;
        opt.backend = backend;
        opt.need_weights = weights;
        const std::string what = std::string(extra ? "bias_kv+zero_attn " : "") +
                                 (backend == mha::Backend::Reference ? "reference " : "auto ") +
                                 std::to_string(static_cast<int>(weights));
        expect_same_over_dirty_memory(m, x, kv, opt, what + " plain");
        opt.causal = mha::Causal::top_left();
        expect_same_over_dirty_memory(m, x, x, opt, what + " causal");
        opt.causal = {};
        mha::BoolTensor padding({2, 7}, 0);
        for (int64_t j = 0; j < 7; ++j) padding.at({1, j}) = 1;  // batch item 1: every key padded
        padding.at({0, 3}) = 1;
        opt.key_padding_mask.is_padding = padding;
        expect_same_over_dirty_memory(m, x, kv, opt, what + " key padding");
        opt.key_padding_mask = {};
        mha::BoolTensor allowed({5, 7}, 1);
        for (int64_t j = 0; j < 7; ++j) allowed.at({2, j}) = 0;  // query 2 sees no key
        opt.attn_mask = mha::AttnMask::allow(allowed);
        expect_same_over_dirty_memory(m, x, kv, opt, what + " attn_mask");
        opt.attn_mask = {};
        Tensor kv_nan = kv;
        kv_nan.at({0, 2, 5}) = std::nanf("");
        expect_same_over_dirty_memory(m, x, kv_nan, opt, what + " NaN key");
      }
  }
}

TEST(Module, ParameterCountIsFourDModelSquaredPlusBiasesWhateverTheHeads) {
  for (int64_t h : {1, 2, 4, 8, 12}) {
    MhaConfig c = config(768, h);
    EXPECT_EQ(mha::parameter_count(c), 4 * 768 * 768 + 4 * 768);  // BERT-base: 2,362,368
    c.bias = false;
    EXPECT_EQ(mha::parameter_count(c), 4 * 768 * 768);
  }
  EXPECT_EQ(mha::parameter_count(config(768, 12)), 2362368);
  MhaConfig gqa = config(4096, 32);
  gqa.num_kv_heads = 8;
  gqa.bias = false;
  // W_Q and W_O are E×E; W_K and W_V shrink by h / kv = 4.
  EXPECT_EQ(mha::parameter_count(gqa), 2 * 4096 * 4096 + 2 * 4096 * 1024);
  MultiheadAttention m(gqa);
  int64_t counted = 0;
  for (const Tensor* t : {&m.params().in_proj_weight, &m.params().out_proj_weight}) counted += t->numel();
  EXPECT_EQ(counted, m.parameter_count());
}

TEST(Module, ConfigErrors) {
  expect_error_mentions([] { MultiheadAttention m(config(10, 3)); }, "not divisible");
  expect_error_mentions([] { MultiheadAttention m(config(0, 1)); }, "embed_dim");
  expect_error_mentions([] { MultiheadAttention m(config(8, -2)); }, "num_heads");
  MhaConfig c = config(8, 4);
  c.num_kv_heads = 3;
  expect_error_mentions([&] { MultiheadAttention m(c); }, "num_kv_heads 3");
  c.num_kv_heads = 0;
  c.dropout = 1.0f;
  expect_error_mentions([&] { MultiheadAttention m(c); }, "dropout");
}

TEST(Module, SeqFirstEqualsBatchFirstTransposed) {
  const Tensor x = random_tensor({3, 5, 16}, 1);
  MultiheadAttention bf(config(16, 4, Layout::BatchFirst), 7);
  MultiheadAttention sf(config(16, 4, Layout::SeqFirst), 7);
  mha::MhaForwardOptions opt;
  opt.need_weights = mha::NeedWeights::PerHead;
  const auto a = bf.forward(x, x, x, opt);
  const Tensor xs = swap01(x);
  const auto b = sf.forward(xs, xs, xs, opt);
  EXPECT_TRUE(mha::testing::all_close(swap01(b.output), a.output, 1e-6, 1e-5));
  EXPECT_TRUE(mha::testing::all_close(b.attn_weights, a.attn_weights, 1e-6, 1e-5));
}

TEST(Module, UnbatchedEqualsBatchOfOne) {
  MultiheadAttention m(config(12, 3), 3);
  const Tensor x = random_tensor({4, 12}, 2), kv = random_tensor({6, 12}, 3);
  mha::MhaForwardOptions opt;
  opt.need_weights = mha::NeedWeights::Averaged;
  const auto u = m.forward(x, kv, kv, opt);
  const auto b = m.forward(x.reshaped({1, 4, 12}), kv.reshaped({1, 6, 12}), kv.reshaped({1, 6, 12}), opt);
  EXPECT_EQ(u.output.shape(), (mha::Shape{4, 12}));
  EXPECT_EQ(u.attn_weights.shape(), (mha::Shape{4, 6}));
  EXPECT_TRUE(mha::testing::bitwise_equal(u.output, b.output.reshaped({4, 12})));
}

TEST(Module, FusedSelfAttentionGemmEqualsSeparateProjections) {
  // Same values in distinct tensors take the three-GEMM path; the same tensor takes the fused one.
  MultiheadAttention m(config(16, 2), 4);
  const Tensor x = random_tensor({2, 7, 16}, 5);
  const Tensor x2 = x, x3 = x;
  EXPECT_TRUE(mha::testing::all_close(m.forward(x, x, x).output, m.forward(x, x2, x3).output, 1e-6, 1e-5));
}

TEST(Module, TorchBoolMaskMeansMaskedOut) {
  MultiheadAttention m(config(8, 2), 5);
  const Tensor x = random_tensor({1, 3, 8}, 6);
  mha::BoolTensor torch_mask({3, 3}, 0);
  torch_mask.at({0, 2}) = 1;  // PyTorch: query 0 may NOT attend key 2
  mha::MhaForwardOptions opt;
  opt.need_weights = mha::NeedWeights::PerHead;
  opt.attn_mask = mha::AttnMask::from_torch_bool(torch_mask);
  const auto r = m.forward(x, x, x, opt);
  EXPECT_EQ(r.attn_weights.at({0, 0, 0, 2}), 0.0f);
  EXPECT_GT(r.attn_weights.at({0, 0, 0, 1}), 0.0f);
  EXPECT_GT(r.attn_weights.at({0, 1, 1, 2}), 0.0f);
}

TEST(Module, DropoutOnlyInTrainingAndSeeded) {
  MhaConfig c = config(16, 4);
  c.dropout = 0.5f;
  MultiheadAttention m(c, 8);
  const Tensor x = random_tensor({2, 6, 16}, 9);
  mha::MhaForwardOptions eval;
  MhaConfig c0 = c;
  c0.dropout = 0.0f;
  MultiheadAttention m0(c0, 8);
  EXPECT_TRUE(mha::testing::bitwise_equal(m.forward(x, x, x, eval).output, m0.forward(x, x, x, eval).output));
  mha::MhaForwardOptions train;
  train.mode = mha::Mode::Training;
  train.dropout_seed = 1;
  train.need_weights = mha::NeedWeights::PerHead;
  const auto a = m.forward(x, x, x, train), b = m.forward(x, x, x, train);
  EXPECT_TRUE(mha::testing::bitwise_equal(a.output, b.output));
  EXPECT_FALSE(mha::testing::bitwise_equal(a.output, m.forward(x, x, x, eval).output));
  int zeros = 0;
  for (float w : a.attn_weights.values()) zeros += w == 0.0f;
  EXPECT_GT(zeros, 0);  // the returned weights are the ones used, after dropout
}

TEST(Module, GroupedQueryProjectionShapes) {
  MhaConfig c = config(32, 8);
  c.num_kv_heads = 2;
  MultiheadAttention m(c, 10);
  EXPECT_EQ(m.params().in_proj_weight.shape(), (mha::Shape{(8 + 2 * 2) * 4, 32}));
  const Tensor x = random_tensor({2, 5, 32}, 11);
  mha::MhaForwardOptions opt;
  opt.need_weights = mha::NeedWeights::PerHead;
  opt.causal = mha::Causal::top_left();
  const auto r = m.forward(x, x, x, opt);
  EXPECT_EQ(r.attn_weights.shape(), (mha::Shape{2, 8, 5, 5}));
  EXPECT_EQ(r.attn_weights.at({1, 7, 0, 1}), 0.0f);
}

/// The module's weights come from the fused kernel under Backend::Auto (per head, or averaged over
/// heads inside the kernel); Backend::Reference gives the double-precision oracle's. Masks 2-D and
/// 3-D (a plane per batch entry and head, widened with the causal rule for bias_kv / zero_attn),
/// on 1, 2 and 3 threads.
TEST(Module, WeightsFromTheFusedKernelMatchTheReference) {
  struct Variant {
    const char* name;
    int64_t kv_heads;
    bool bias_kv, zero_attn, masks, unbatched, training, masks3d = false;
  };
  const Variant variants[] = {
      {"plain", 0, false, false, false, false, false},
      {"GQA", 2, false, false, false, false, false},
      {"bias_kv + zero_attn", 0, true, true, false, false, false},
      {"masks", 2, false, false, true, false, false},
      {"unbatched", 0, false, false, false, true, false},
      {"dropout (training)", 0, false, false, true, false, true},
      {"3-D masks, GQA", 2, false, false, false, false, false, true},
      {"3-D masks, bias_kv + zero_attn", 0, true, true, false, false, false, true},
  };
  for (const Variant& v : variants)
    for (mha::NeedWeights nw : {mha::NeedWeights::PerHead, mha::NeedWeights::Averaged}) {
      SCOPED_TRACE(::testing::Message() << v.name << (nw == mha::NeedWeights::PerHead ? ", per head" : ", averaged"));
      MhaConfig c = config(32, 8);
      c.num_kv_heads = v.kv_heads;
      c.add_bias_kv = v.bias_kv;
      c.add_zero_attn = v.zero_attn;
      c.dropout = v.training ? 0.25f : 0.0f;
      const MultiheadAttention m(c, 21);
      const int64_t B = 3, T = 70, S = 133;
      const Tensor q = v.unbatched ? random_tensor({T, 32}, 22) : random_tensor({B, T, 32}, 22);
      const Tensor kv = v.unbatched ? random_tensor({S, 32}, 23) : random_tensor({B, S, 32}, 23);
      mha::MhaForwardOptions opt;
      opt.need_weights = nw;
      if (v.masks) {
        Tensor bias = random_tensor({T, S}, 24);
        for (int64_t j = 0; j < S; j += 7) bias.at({3, j}) = -INFINITY;
        opt.attn_mask = mha::AttnMask::add(bias);
        mha::BoolTensor pad({B, S}, 0);
        for (int64_t j = S - 20; j < S; ++j) pad.at({1, j}) = 1;
        opt.key_padding_mask.is_padding = pad;
        opt.causal = mha::Causal::bottom_right();
      }
      if (v.masks3d) {  // one (T, S) plane per batch entry and head: a bool one, a float key padding
        mha::BoolTensor masked_out({B * 8, T, S}, 0);
        const Tensor u = random_tensor({B * 8, T, S}, 25, 0.0f, 1.0f);
        for (int64_t x = 0; x < u.numel(); ++x) masked_out.data()[x] = u.data()[x] < 0.3f;
        for (int64_t j = 0; j < S; ++j) masked_out.at({5, 2, j}) = 1;  // batch 0, head 5, query 2: no key
        opt.attn_mask = mha::AttnMask::from_torch_bool(masked_out);
        Tensor key_bias({B, S}, 0.0f);
        for (int64_t j = 0; j < S; j += 3) key_bias.at({2, j}) = -INFINITY;
        opt.key_padding_mask.additive = key_bias;
        opt.causal = mha::Causal::top_left();
      }
      if (v.training) opt.mode = mha::Mode::Training, opt.dropout_seed = 5;
      opt.backend = mha::Backend::Reference;
      const auto want = m.forward(q, kv, kv, opt);
      for (int threads : {1, 2, 3}) {
        opt.backend = mha::Backend::Auto;
        opt.threads = threads;
        const auto got = m.forward(q, kv, kv, opt);
        EXPECT_EQ(got.attn_weights.shape(), want.attn_weights.shape());
        EXPECT_TRUE(mha::testing::all_close(got.attn_weights, want.attn_weights, 2e-6, 1e-5));
        EXPECT_TRUE(mha::testing::all_close(got.output, want.output, 2e-6, 1e-4));
        opt.threads = 1;
        EXPECT_TRUE(mha::testing::bitwise_equal(got.attn_weights, m.forward(q, kv, kv, opt).attn_weights));
      }
    }
}

/// forward() reuses its working buffers (projections, heads) across calls, never zero-filled: a
/// call after calls of other shapes must give bitwise what a module with no history gives.
TEST(Module, ReusedWorkspacesGiveTheResultsOfFreshOnes) {
  MhaConfig c = config(32, 4);
  c.num_kv_heads = 2;
  const MultiheadAttention m(c, 31);
  struct Call {
    mha::Shape q, kv;
    mha::NeedWeights weights;
    bool causal;
  };
  const Call calls[] = {
      {{4, 50, 32}, {4, 50, 32}, mha::NeedWeights::None, false},      // self-attention, packed GEMM
      {{2, 9, 32}, {2, 9, 32}, mha::NeedWeights::PerHead, true},      // smaller: reuses
      {{3, 20, 32}, {3, 61, 32}, mha::NeedWeights::Averaged, false},  // cross-attention, 3 GEMMs
      {{6, 70, 32}, {6, 70, 32}, mha::NeedWeights::None, true},       // larger: grows
      {{5, 32}, {7, 32}, mha::NeedWeights::None, false},              // unbatched
      {{1, 0, 32}, {1, 5, 32}, mha::NeedWeights::PerHead, false},     // empty query
      {{4, 50, 32}, {4, 50, 32}, mha::NeedWeights::None, false},      // the first again
  };
  uint64_t seed = 40;
  for (int round = 0; round < 2; ++round)
    for (const Call& call : calls) {
      SCOPED_TRACE(::testing::Message() << "round " << round << ", query " << mha::shape_str(call.q));
      const Tensor q = random_tensor(call.q, ++seed);
      const bool self = call.q == call.kv;
      const Tensor kv = self ? q : random_tensor(call.kv, ++seed);
      mha::MhaForwardOptions opt;
      opt.need_weights = call.weights;
      if (call.causal) opt.causal = mha::Causal::top_left();
      const MultiheadAttention fresh = m;  // a copy starts with no kept buffers
      const auto got = m.forward(q, kv, kv, opt);
      const auto want = fresh.forward(q, kv, kv, opt);
      EXPECT_TRUE(mha::testing::bitwise_equal(got.output, want.output));
      EXPECT_TRUE(mha::testing::bitwise_equal(got.attn_weights, want.attn_weights));
      EXPECT_LE(m.workspace_pool()->free_buffers(), size_t{8});
    }
  EXPECT_GT(m.workspace_pool()->free_buffers(), size_t{0});
  m.release_workspace();
  EXPECT_EQ(m.workspace_pool()->free_buffers(), size_t{0});
  const Tensor x = random_tensor({2, 11, 32}, 99);
  EXPECT_TRUE(mha::testing::bitwise_equal(m.forward(x, x, x).output, MultiheadAttention(m).forward(x, x, x).output));
}

TEST(Module, ScratchPoolKeepsTheLargestBuffersAndHandsEachToOneCaller) {
  const auto pool = mha::detail::ScratchPool::make();
  {
    auto a = pool->take(100), b = pool->take(100);
    EXPECT_NE(a.data(), b.data());  // both checked out: never the same buffer
    a.data()[99] = 1.0f, b.data()[99] = 2.0f;
  }
  EXPECT_EQ(pool->free_buffers(), size_t{2});
  {
    const auto big = pool->take(1000);  // nothing free fits: a new buffer
    EXPECT_GE(big.capacity(), size_t{1000});
    const auto small = pool->take(50);  // a kept one serves a smaller request
    EXPECT_EQ(small.capacity(), size_t{100});
  }
  EXPECT_EQ(pool->free_buffers(), size_t{3});
  std::vector<mha::detail::ScratchPool::Lease> many;
  for (int i = 0; i < 12; ++i) many.push_back(pool->take(static_cast<size_t>(10 + i)));
  many.clear();
  EXPECT_EQ(pool->free_buffers(), size_t{8});  // at most eight kept, the largest
  EXPECT_GE(pool->free_floats(), size_t{1000 + 100 + 100});
  auto moved = pool->take(5);
  moved = mha::detail::ScratchPool::fresh(7);  // the old lease goes back first
  EXPECT_EQ(pool->free_buffers(), size_t{8});
  pool->release();
  EXPECT_EQ(pool->free_buffers(), size_t{0});
}

// with_params binds other parameters to the same configuration and workspace (mha.torch does so on
// every call): the bound module computes with its own parameters, gives its buffers back to the
// shared pool, keeps sharing it when moved (a copy does not), and checks the shapes it is given.
TEST(Module, WithParamsSharesTheWorkspace) {
  MhaConfig c = config(32, 4);
  c.num_kv_heads = 2;
  const MultiheadAttention m(c, 31), other(c, 32);
  const Tensor x = random_tensor({3, 20, 32}, 5);
  MultiheadAttention bound = m.with_params(other.params());
  EXPECT_EQ(bound.workspace_pool(), m.workspace_pool());
  EXPECT_TRUE(
      mha::testing::bitwise_equal(bound.forward(x, x, x).output, MultiheadAttention(other).forward(x, x, x).output));
  EXPECT_GT(m.workspace_bytes(), size_t{0});  // the bound call's buffers, back in m's pool
  EXPECT_TRUE(mha::testing::bitwise_equal(m.forward(x, x, x).output, MultiheadAttention(m).forward(x, x, x).output));
  const MultiheadAttention moved = std::move(bound);
  EXPECT_EQ(moved.workspace_pool(), m.workspace_pool());
  EXPECT_NE(MultiheadAttention(moved).workspace_pool(), m.workspace_pool());
  m.release_workspace();
  EXPECT_EQ(moved.workspace_bytes(), size_t{0});
  mha::MhaParameters wrong = other.params();
  wrong.out_proj_weight = Tensor({32, 31});
  expect_error_mentions([&] { (void)m.with_params(wrong); }, "out_proj.weight has shape (32, 31)");
}

// Threads binding their own parameters to one module's workspace at once, for forwards and
// training steps of several shapes, get bitwise what modules with workspaces of their own get.
TEST(Module, ConcurrentCallsOnModulesSharingAWorkspaceMatchFreshModules) {
  MhaConfig c = config(32, 4);
  c.dropout = 0.1f;
  const MultiheadAttention m(c, 41);
  constexpr int kThreads = 3, kSteps = 4;
  struct Want {
    Tensor x, d_out, output, d_query, d_in_proj;
    MultiheadAttention module;
  };
  std::vector<Want> wants;
  mha::MhaForwardOptions train;
  train.mode = mha::Mode::Training, train.dropout_seed = 9, train.causal = mha::Causal::top_left();
  for (int t = 0; t < kThreads; ++t) {
    const MultiheadAttention fresh(c, 50 + static_cast<uint64_t>(t));
    const Tensor x = random_tensor({2, 9 + 13 * t, 32}, 60 + static_cast<uint64_t>(t));
    const Tensor d_out = random_tensor(x.shape(), 70 + static_cast<uint64_t>(t));
    const mha::MhaTrainOutput step = mha::forward_train(fresh, x, x, x, train);
    mha::MhaGradients g = mha::backward(fresh, step.context, d_out);
    wants.push_back(
        {x, d_out, fresh.forward(x, x, x).output, std::move(g.query), std::move(g.params.in_proj_weight), fresh});
  }
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      const Want& w = wants[static_cast<size_t>(t)];
      for (int s = 0; s < kSteps; ++s) {
        const MultiheadAttention bound = m.with_params(w.module.params());
        if (!mha::testing::bitwise_equal(bound.forward(w.x, w.x, w.x).output, w.output)) ++wrong;
        const mha::MhaTrainOutput step = mha::forward_train(bound, w.x, w.x, w.x, train);
        const mha::MhaGradients g = mha::backward(bound, step.context, w.d_out);
        if (!mha::testing::bitwise_equal(g.query, w.d_query) ||
            !mha::testing::bitwise_equal(g.params.in_proj_weight, w.d_in_proj))
          ++wrong;
      }
    });
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(m.workspace_pool()->free_buffers(), size_t{0});
}

TEST(Module, ForwardErrorsNameArgumentsAndShapes) {
  MultiheadAttention m(config(8, 2), 12);
  const Tensor x = random_tensor({2, 3, 8}, 13);
  expect_error_mentions([&] { m.forward(random_tensor({2, 3, 6}, 1), x, x); }, "(2, 3, 6)");
  expect_error_mentions(
      [&] {
        m.forward(x, random_tensor({4, 3, 8}, 1), random_tensor({4, 3, 8}, 2));
      },
      "batch sizes differ");
  expect_error_mentions([&] { m.forward(x, x, random_tensor({2, 4, 8}, 3)); }, "same sequence length");
  expect_error_mentions([&] { m.forward(random_tensor({8}, 1), x, x); }, "query must be");
  expect_error_mentions([&] { m.forward(x, random_tensor({3, 8}, 1), random_tensor({3, 8}, 2)); }, "3-D");
  mha::MhaForwardOptions opt;
  opt.attn_mask = mha::AttnMask::add(Tensor({3, 4}));
  expect_error_mentions([&] { m.forward(x, x, x, opt); }, "attn_mask has shape (3, 4)");
  opt.attn_mask = mha::AttnMask::add(Tensor({5, 3, 3}));
  expect_error_mentions([&] { m.forward(x, x, x, opt); }, "(4, 3, 3)");
  opt.attn_mask = {};
  opt.key_padding_mask.is_padding = mha::BoolTensor({3, 3});
  expect_error_mentions([&] { m.forward(x, x, x, opt); }, "key_padding_mask has shape (3, 3), expected (2, 3)");
  MultiheadAttention broken(config(8, 2), 1);
  broken.params().out_proj_weight = Tensor({8, 7});
  expect_error_mentions([&] { broken.forward(x, x, x); }, "out_proj.weight has shape (8, 7)");
}

TEST(Module, ZeroLengthSequences) {
  MultiheadAttention m(config(8, 2), 14);
  const Tensor q({2, 0, 8}), kv = random_tensor({2, 3, 8}, 15);
  EXPECT_EQ(m.forward(q, kv, kv).output.shape(), (mha::Shape{2, 0, 8}));
  const Tensor q1 = random_tensor({2, 2, 8}, 16), kv0({2, 0, 8});
  const auto r = m.forward(q1, kv0, kv0);  // nothing to attend to: heads are zero, output = b_O
  for (int64_t i = 0; i < r.output.numel(); ++i) EXPECT_EQ(r.output.data()[i], m.params().out_proj_bias.data()[i % 8]);
}

}  // namespace

namespace {

TEST(Module, BitwiseIdenticalForAnyThreadCount) {
  // docs/semantics.md, 'Determinism': projections (oneDNN) and attention give the same bits for 1, 2 or 3 threads.
  MhaConfig c = config(64, 8);
  c.num_kv_heads = 2;
  MultiheadAttention m(c, 17);
  const Tensor x = random_tensor({2, 150, 64}, 18);
  mha::MhaForwardOptions opt;
  opt.causal = mha::Causal::top_left();
  std::vector<Tensor> outputs;
  for (int threads : {1, 2, 3}) {
    mha::set_num_threads(threads);
    opt.threads = threads;
    outputs.push_back(m.forward(x, x, x, opt).output);
  }
  mha::set_num_threads(0);
  EXPECT_TRUE(mha::testing::bitwise_equal(outputs[1], outputs[0]));
  EXPECT_TRUE(mha::testing::bitwise_equal(outputs[2], outputs[0]));
}

// A request for a million threads sized a million workspaces (std::bad_alloc): at most
// kMaxThreads are used, whatever is asked, and the result is the one of any other count.
TEST(Module, AbsurdThreadCountsAreCapped) {
  EXPECT_EQ(mha::resolve_threads(1 << 20), mha::kMaxThreads);
  EXPECT_EQ(mha::resolve_threads(3), 3);
  mha::set_num_threads(1 << 20);
  EXPECT_EQ(mha::num_threads(), mha::kMaxThreads);
  mha::set_num_threads(0);
  EXPECT_LE(mha::num_threads(), mha::kMaxThreads);
}

}  // namespace
