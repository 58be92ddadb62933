// Inference decoding: the KV cache, incremental forward (prefill + token-by-token decode equals the
// full causal forward), the split-K decode kernel, sliding windows with a ring cache, and RoPE
// against PyTorch.
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kernels/decode.h"
#include "mha/kv_cache.h"
#include "mha/module.h"
#include "mha/rope.h"
#include "mha/safetensors.h"
#include "support/test_support.h"

namespace mha {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::random_tensor;

constexpr double kEps = 1.1920928955078125e-07;  // float32 ε
// Prefill/decode and the full forward add the same terms in different orders (split softmax
// merged by log-sum-exp vs one pass): a few hundred ε of the O(1) outputs covers it.
constexpr double kF32Tol = 256 * kEps;

/// Tokens [t0, t1) of a batch-first (B, T, E) tensor.
Tensor tokens(const Tensor& x, int64_t t0, int64_t t1) {
  const int64_t B = x.size(0), T = x.size(1), E = x.size(2);
  Tensor out({B, t1 - t0, E});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t e = 0; e < E; ++e) out.at({b, t - t0, e}) = x.data()[(b * T + t) * E + e];
  return out;
}

/// Writes `part` (B, n, E) into tokens [t0, t0 + n) of `all` (B, T, E).
void put_tokens(Tensor& all, const Tensor& part, int64_t t0) {
  const int64_t B = all.size(0), T = all.size(1), E = all.size(2), n = part.size(1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t e = 0; e < E; ++e) all.data()[(b * T + t0 + t) * E + e] = part.at({b, t, e});
}

struct DecodeSetup {
  int64_t E = 32, h = 4, kv = 4;
  int64_t window = 0;
  Rope rope;
  CacheDtype dtype = CacheDtype::F32;
  bool ring = false;
  int64_t key_group = 0;  // int8: > 0 = per-channel key scales over groups of this many positions
};

DecodeSetup setup(int64_t E = 32, int64_t h = 4, int64_t kv = 4, int64_t window = 0, Rope rope = {},
                  CacheDtype dtype = CacheDtype::F32, bool ring = false) {
  DecodeSetup s;
  s.E = E, s.h = h, s.kv = kv, s.window = window, s.rope = rope, s.dtype = dtype, s.ring = ring;
  return s;
}

MultiheadAttention make_module(const DecodeSetup& s) {
  MhaConfig c;
  c.embed_dim = s.E;
  c.num_heads = s.h;
  c.num_kv_heads = s.kv;
  c.layout = Layout::BatchFirst;
  c.rope = s.rope;
  MultiheadAttention m(c, 7);
  // Nonzero biases, so a bias added twice or at the wrong place would show.
  for (float& x : m.params().in_proj_bias.values()) x = 0.01f * static_cast<float>(&x - m.params().in_proj_bias.data());
  return m;
}

KvCache make_cache(const DecodeSetup& s, int64_t batch, int64_t capacity) {
  KvCacheConfig cc;
  cc.batch = batch;
  cc.kv_heads = s.kv;
  cc.head_dim = s.E / s.h;
  cc.capacity = s.ring ? s.window : capacity;
  cc.dtype = s.dtype;
  cc.ring = s.ring;
  if (s.key_group > 0) cc.int8_keys = Int8KeyScales::PerChannel, cc.key_group = s.key_group;
  return KvCache(cc);
}

/// Prefill `prefill` tokens, then decode the rest in chunks of `chunks` tokens (in turn, the last
/// one cut short), one by one by default; returns all outputs (B, T, E).
Tensor incremental(const MultiheadAttention& m, const DecodeSetup& s, const Tensor& x, int64_t prefill, int splits = 0,
                   const std::vector<int64_t>& chunks = {1}) {
  const int64_t T = x.size(1);
  KvCache cache = make_cache(s, x.size(0), T);
  IncrementalOptions o;
  o.window = s.window;
  o.splits = splits;
  Tensor all(x.shape());
  int64_t t = 0;
  for (size_t step = 0; t < T; ++step) {
    const int64_t n = std::min(T - t, t == 0 ? prefill : chunks[(step - 1) % chunks.size()]);
    const Tensor in = tokens(x, t, t + n);
    put_tokens(all, m.forward_incremental(in, in, in, cache, o).output, t);
    t += n;
  }
  EXPECT_EQ(cache.length(0), T);
  return all;
}

Tensor full_forward(const MultiheadAttention& m, const DecodeSetup& s, const Tensor& x) {
  MhaForwardOptions o;
  o.causal = Causal::top_left().with_window(s.window);
  return m.forward(x, x, x, o).output;
}

void expect_incremental_matches(const DecodeSetup& s, int64_t B, int64_t T, int64_t prefill, double tol = kF32Tol,
                                const std::vector<int64_t>& chunks = {1}) {
  const MultiheadAttention m = make_module(s);
  const Tensor x = random_tensor({B, T, s.E}, 11);
  EXPECT_TRUE(all_close(incremental(m, s, x, prefill, 0, chunks), full_forward(m, s, x), tol, tol));
}

TEST(Incremental, PrefillThenDecodeEqualsFullForward) { expect_incremental_matches(setup(), 2, 13, 5); }

TEST(Incremental, TokenByTokenFromEmptyCache) { expect_incremental_matches(setup(), 1, 9, 1); }

TEST(Incremental, GroupedAndMultiQuery) {
  expect_incremental_matches(setup(32, 4, 2), 2, 12, 4);
  expect_incremental_matches(setup(48, 6, 1), 1, 11, 3);
}

TEST(Incremental, SlidingWindow) {
  expect_incremental_matches(setup(32, 4, 2, 3), 2, 14, 6);
  expect_incremental_matches(setup(32, 4, 4, 1), 1, 7, 2);
}

TEST(Incremental, SlidingWindowRingCache) {
  // A ring of W positions; the prefill chunk (9) is longer than the ring (4).
  expect_incremental_matches(setup(32, 4, 2, 4, Rope{}, CacheDtype::F32, true), 2, 20, 9);
}

TEST(Incremental, Rope) {
  expect_incremental_matches(setup(32, 4, 2, 0, Rope::half_split()), 2, 12, 5);
  expect_incremental_matches(setup(48, 4, 4, 0, Rope::interleaved(500.0, 8)), 1, 10, 4);
  expect_incremental_matches(setup(32, 4, 1, 5, Rope::half_split(10000.0, 4), CacheDtype::F32, true), 1, 17, 7);
}

TEST(Incremental, Bf16CacheWithinBf16Rounding) {
  // K and V are rounded to bf16 (relative error 2⁻⁹); the outputs move by about that much.
  expect_incremental_matches(setup(32, 4, 2, 0, Rope{}, CacheDtype::BF16), 1, 12, 4, 8.0 / 512);
}

TEST(Incremental, Int8CacheWithinInt8Rounding) {
  // K and V rows are rounded to int8 steps of max|x| / 127 (error ≤ half a step, about 2⁻⁸ of the
  // row's largest value); the outputs move by about that much. A ring and a window too.
  expect_incremental_matches(setup(32, 4, 2, 0, Rope::half_split(), CacheDtype::I8), 2, 12, 4, 8.0 / 254);
  expect_incremental_matches(setup(32, 4, 2, 4, Rope{}, CacheDtype::I8, true), 1, 14, 6, 8.0 / 254);
  // Per-channel key scales (groups of 4: the prompt fills one and a half, decoding the rest, so
  // open groups are quantised again as tokens arrive). A key element is within half a step of its
  // channel's largest value in the group.
  DecodeSetup channel = setup(32, 4, 2, 0, Rope::half_split(), CacheDtype::I8);
  channel.key_group = 4;
  expect_incremental_matches(channel, 2, 13, 6, 8.0 / 254);
}

// Chunks of several tokens after the prefill: each attends the cache with as many query rows
// (several query tiles of the decode kernel: up to 16 rows a tile, the group's heads times the
// queries) and merges with its own causal part. Plain, GQA of 4, MQA of 16 heads, a window, a ring
// that the chunks wrap, and an int8 cache.
TEST(Incremental, ChunksOfSeveralTokensEqualFullForward) {
  const std::vector<int64_t> chunks = {3, 1, 7, 17};
  expect_incremental_matches(setup(32, 4, 4), 2, 40, 5, kF32Tol, chunks);
  expect_incremental_matches(setup(32, 8, 2), 2, 40, 5, kF32Tol, chunks);
  expect_incremental_matches(setup(64, 16, 1), 1, 40, 2, kF32Tol, chunks);
  expect_incremental_matches(setup(32, 4, 2, 6), 2, 40, 5, kF32Tol, chunks);
  expect_incremental_matches(setup(32, 4, 2, 6, Rope::half_split(), CacheDtype::F32, true), 2, 40, 5, kF32Tol, chunks);
  expect_incremental_matches(setup(32, 4, 2, 0, Rope{}, CacheDtype::I8), 2, 40, 5, 8.0 / 254, chunks);
}

TEST(Incremental, SplitCountDoesNotChangeTheAnswer) {
  const DecodeSetup s = setup(32, 4, 2);
  const MultiheadAttention m = make_module(s);
  const Tensor x = random_tensor({1, 40, s.E}, 5);
  EXPECT_TRUE(all_close(incremental(m, s, x, 3, 1), incremental(m, s, x, 3, 5), kF32Tol, kF32Tol));
}

TEST(Incremental, BatchOfDifferentLengths) {
  // Prompts of 6, 3 and 1 tokens, right-padded to 6, then 4 decoded tokens each; every sequence
  // must equal its own full causal forward. Padding holds NaN: it must never be read.
  const DecodeSetup s = setup(32, 4, 2, 0, Rope::half_split());
  const MultiheadAttention m = make_module(s);
  const std::vector<int64_t> prompt{6, 3, 1};
  const int64_t B = 3, P = 6, steps = 4;
  std::vector<Tensor> seq;
  for (int64_t b = 0; b < B; ++b) seq.push_back(random_tensor({1, prompt[b] + steps, s.E}, 100 + b));
  Tensor first({B, P, s.E}, std::numeric_limits<float>::quiet_NaN());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < prompt[b]; ++t)
      for (int64_t e = 0; e < s.E; ++e) first.at({b, t, e}) = seq[b].at({0, t, e});
  KvCache cache = make_cache(s, B, 16);
  IncrementalOptions o;
  o.new_lengths = prompt;
  const Tensor pre = m.forward_incremental(first, first, first, cache, o).output;
  std::vector<Tensor> got;
  for (int64_t b = 0; b < B; ++b) {
    Tensor mine({1, prompt[b] + steps, s.E});
    for (int64_t t = 0; t < prompt[b]; ++t)
      for (int64_t e = 0; e < s.E; ++e) mine.at({0, t, e}) = pre.at({b, t, e});
    got.push_back(std::move(mine));
    // Rows past a sequence's prompt are zero-attention rows: output = out_proj bias (0 here).
    for (int64_t t = prompt[b]; t < P; ++t)
      for (int64_t e = 0; e < s.E; ++e) ASSERT_EQ(pre.at({b, t, e}), 0.0f);
  }
  o.new_lengths.clear();
  for (int64_t k = 0; k < steps; ++k) {
    Tensor step({B, 1, s.E});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t e = 0; e < s.E; ++e) step.at({b, 0, e}) = seq[b].at({0, prompt[b] + k, e});
    const Tensor y = m.forward_incremental(step, step, step, cache, o).output;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t e = 0; e < s.E; ++e) got[b].at({0, prompt[b] + k, e}) = y.at({b, 0, e});
  }
  for (int64_t b = 0; b < B; ++b) {
    EXPECT_EQ(cache.length(b), prompt[b] + steps);
    EXPECT_TRUE(all_close(got[b], full_forward(m, s, seq[b]), kF32Tol, kF32Tol)) << "sequence " << b;
  }
}

TEST(Incremental, SeqFirstLayoutAndCrossInputs) {
  // Seq-first (T, B, E) inputs and distinct key/value inputs (kdim / vdim) go through the same path.
  MhaConfig c;
  c.embed_dim = 16, c.num_heads = 2, c.num_kv_heads = 1, c.kdim = 12, c.vdim = 20;
  const MultiheadAttention m(c, 3);
  const int64_t T = 7, B = 2;
  const Tensor q = random_tensor({T, B, 16}, 1), k = random_tensor({T, B, 12}, 2), v = random_tensor({T, B, 20}, 3);
  MhaForwardOptions fo;
  fo.causal = Causal::top_left();
  const Tensor want = m.forward(q, k, v, fo).output;
  KvCache cache(KvCacheConfig{.batch = B, .kv_heads = 1, .head_dim = 8, .capacity = T});
  auto rows = [&](const Tensor& x, int64_t t0, int64_t t1) {
    Tensor out({t1 - t0, B, x.size(2)});
    std::copy(x.data() + t0 * B * x.size(2), x.data() + t1 * B * x.size(2), out.data());
    return out;
  };
  Tensor got({T, B, 16});
  for (int64_t t0 : {0, 4, 5, 6}) {
    const int64_t t1 = t0 == 0 ? 4 : t0 + 1;
    const Tensor y = m.forward_incremental(rows(q, t0, t1), rows(k, t0, t1), rows(v, t0, t1), cache).output;
    std::copy(y.data(), y.data() + y.numel(), got.data() + t0 * B * 16);
  }
  EXPECT_TRUE(all_close(got, want, kF32Tol, kF32Tol));
}

// ---- the KV cache ----------------------------------------------------------------------------

TEST(KvCache, AppendLengthsResetClone) {
  KvCache cache(KvCacheConfig{.batch = 2, .kv_heads = 2, .head_dim = 3, .capacity = 5});
  const Tensor k = random_tensor({2, 2, 3, 3}, 1), v = random_tensor({2, 2, 3, 3}, 2);
  const std::vector<int64_t> counts{3, 1};
  cache.append(k.view4(), v.view4(), counts);
  EXPECT_EQ(cache.length(0), 3);
  EXPECT_EQ(cache.length(1), 1);
  EXPECT_EQ(cache.k_at(0, 1, 2, 2), k.at({0, 1, 2, 2}));
  EXPECT_EQ(cache.v_at(1, 0, 0, 1), v.at({1, 0, 0, 1}));
  KvCache copy = cache.clone();
  cache.reset(0);
  EXPECT_EQ(cache.length(0), 0);
  EXPECT_EQ(cache.length(1), 1);
  EXPECT_EQ(copy.length(0), 3);  // the clone is independent
  EXPECT_EQ(copy.k_at(0, 1, 2, 2), k.at({0, 1, 2, 2}));
  cache.reset();
  EXPECT_EQ(cache.length(1), 0);
  EXPECT_EQ(cache.bytes(), 2u * 2 * 2 * 5 * 3 * sizeof(float));
}

TEST(KvCache, CapacityErrorChangesNothing) {
  KvCache cache(KvCacheConfig{.batch = 2, .kv_heads = 1, .head_dim = 2, .capacity = 4});
  const Tensor k = random_tensor({2, 1, 3, 2}, 1);
  cache.append(k.view4(), k.view4());
  try {
    cache.append(k.view4(), k.view4());
    FAIL() << "expected mha::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("capacity"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.length(0), 3);
  EXPECT_EQ(cache.length(1), 3);
}

TEST(KvCache, RingKeepsTheLastPositions) {
  KvCache cache(KvCacheConfig{.batch = 1, .kv_heads = 1, .head_dim = 1, .capacity = 3, .ring = true});
  const Tensor k({1, 1, 5, 1}, {10, 11, 12, 13, 14});
  cache.append(k.view4(), k.view4());
  EXPECT_EQ(cache.length(0), 5);
  EXPECT_EQ(cache.first(0), 2);
  for (int64_t p = 2; p < 5; ++p) EXPECT_EQ(cache.k_at(0, 0, p, 0), 10.0f + static_cast<float>(p));
  EXPECT_THROW(cache.k_at(0, 0, 1, 0), Error);
}

TEST(KvCache, BadArguments) {
  EXPECT_THROW(KvCache(KvCacheConfig{.batch = 1, .kv_heads = 0, .head_dim = 4, .capacity = 4}), Error);
  EXPECT_THROW(KvCache(KvCacheConfig{.batch = 1, .kv_heads = 1, .head_dim = 4, .capacity = 0}), Error);
  KvCache cache(KvCacheConfig{.batch = 2, .kv_heads = 2, .head_dim = 4, .capacity = 8});
  const Tensor wrong = random_tensor({2, 1, 3, 4}, 1);
  EXPECT_THROW(cache.append(wrong.view4(), wrong.view4()), Error);
  const Tensor k = random_tensor({2, 2, 3, 4}, 1);
  const std::vector<int64_t> too_many{4, 1}, one{1};
  EXPECT_THROW(cache.append(k.view4(), k.view4(), too_many), Error);
  EXPECT_THROW(cache.append(k.view4(), k.view4(), one), Error);
  EXPECT_THROW(cache.length(2), Error);
  EXPECT_THROW(cache.reset(-1), Error);

  const DecodeSetup s = setup(32, 4, 2);
  const MultiheadAttention m = make_module(s);
  const Tensor x = random_tensor({2, 3, 32}, 1);
  KvCache bad_heads(KvCacheConfig{.batch = 2, .kv_heads = 4, .head_dim = 8, .capacity = 8});
  EXPECT_THROW(m.forward_incremental(x, x, x, bad_heads), Error);
  KvCache small = make_cache(s, 2, 4);
  m.forward_incremental(x, x, x, small);
  EXPECT_THROW(m.forward_incremental(x, x, x, small), Error);  // 6 > 4
  EXPECT_EQ(small.length(0), 3);
  KvCache ring(KvCacheConfig{.batch = 2, .kv_heads = 2, .head_dim = 8, .capacity = 4, .ring = true});
  EXPECT_THROW(m.forward_incremental(x, x, x, ring), Error);  // a ring needs a window ≤ 4
  IncrementalOptions o;
  o.new_lengths = {1};
  KvCache fresh = make_cache(s, 2, 8);
  EXPECT_THROW(m.forward_incremental(x, x, x, fresh, o), Error);
  o.new_lengths = {1, 4};
  EXPECT_THROW(m.forward_incremental(x, x, x, fresh, o), Error);

  MhaConfig c;
  c.embed_dim = 32, c.num_heads = 4, c.rope = Rope::half_split(10000.0, 5);
  EXPECT_THROW(c.validate(), Error);  // odd rotary dims
  c.rope = Rope::half_split(10000.0, 10);
  EXPECT_THROW(c.validate(), Error);  // more than d = 8
  c.rope = Rope::half_split(-1.0);
  EXPECT_THROW(c.validate(), Error);
}

// An empty cache — default-constructed, or the source of a move, whose defaulted move kept its
// sizes over no storage — is an error to use (every method segfaulted reading past its lengths),
// and a view with a negative T (which matched the shape checks, T being the view's own) is refused
// before anything changes (the length went negative and the next append wrote before the storage).
TEST(KvCache, EmptyCachesAndNegativeExtentsAreErrors) {
  const KvCacheConfig config{.batch = 2, .kv_heads = 1, .head_dim = 4, .capacity = 8};
  const Tensor k = random_tensor({2, 1, 3, 4}, 1), k1 = random_tensor({1, 1, 3, 4}, 3),
               q = random_tensor({2, 1, 1, 4}, 2);
  Tensor out({2, 1, 1, 4});
  KvCache source(config);
  source.append(k.view4(), k.view4());
  KvCache moved(std::move(source));
  EXPECT_EQ(moved.length(1), 3);
  KvCache assigned;
  assigned = std::move(moved);
  EXPECT_EQ(assigned.k_at(1, 0, 2, 3), k.at({1, 0, 2, 3}));
  KvCache empty;
  for (KvCache* c : {&empty, &source, &moved}) {
    KvCache& cache = *c;
    EXPECT_EQ(cache.batch(), 0);
    for (const auto& use : std::vector<std::function<void()>>{
             [&] { (void)cache.length(0); }, [&] { (void)cache.first(0); }, [&] { (void)cache.stored(0); },
             [&] { (void)cache.holds(0, 0); }, [&] { (void)cache.remaining(0); }, [&] { cache.reset(0); },
             [&] { (void)cache.k_at(0, 0, 0, 0); }, [&] { cache.append(k.view4(), k.view4()); },
             [&] { cache.append_sequence(0, k1.view4(), k1.view4()); },
             [&] { attend_cache(q.view4(), cache, {}, {}, out.view4()); }}) {
      const std::string e = testing::error_of(use);
      EXPECT_NE(e.find("empty"), std::string::npos) << e;
    }
    cache.reset();  // nothing to reset
  }
  KvCache cache(config);
  cache.append(k.view4(), k.view4());
  std::vector<float> buf(64);
  const View4<const float> negative{buf.data(), {1, 1, -100000, 4}, {4, 4, 4, 1}};
  const View4<const float> negative_batch{buf.data(), {2, 1, -3, 4}, {4, 4, 4, 1}};
  for (const std::string& e : {testing::error_of([&] { cache.append_sequence(0, negative, negative); }),
                               testing::error_of([&] { cache.append(negative_batch, negative_batch); })})
    EXPECT_NE(e.find("has a negative extent"), std::string::npos) << e;
  EXPECT_EQ(cache.length(0), 3);
  const View4<const float> negative_q{buf.data(), {2, 1, -1, 4}, {4, 4, 4, 1}};
  const View4<float> negative_out{out.data(), {2, 1, -1, 4}, {4, 4, 4, 1}};
  EXPECT_NE(testing::error_of([&] {
              attend_cache(negative_q, cache, {}, {}, negative_out);
            }).find("query has a negative extent"),
            std::string::npos);
  // A window past 2^40 is refused as sdpa refuses it.
  CacheAttentionOptions wide;
  wide.window = (int64_t{1} << 40) + 1;
  EXPECT_NE(testing::error_of([&] {
              attend_cache(q.view4(), cache, {}, wide, out.view4());
            }).find("window must be in [0, 2^40]"),
            std::string::npos);
  wide.window = int64_t{1} << 40;
  EXPECT_NO_THROW(attend_cache(q.view4(), cache, {}, wide, out.view4()));
}

// ---- the split-K decode kernel ---------------------------------------------------------------

struct CacheCase {
  KvCache cache;
  Tensor q;
  // Score edits, off unless set: ALiBi slopes and sink logits (one per query head), softcap.
  std::vector<float> slopes = {}, sinks = {};
  float softcap = 0.0f;
};

/// A cache of one sequence per entry of `lens`, holding that many positions (capacity the
/// longest), kv K/V heads, and `heads` queries of T_q rows; key_group > 0: int8 keys with
/// per-channel scales over groups of that many positions.
CacheCase cache_of(CacheDtype dtype, int64_t tq, int64_t d, const std::vector<int64_t>& lens, int64_t heads = 6,
                   int64_t kv = 2, int64_t key_group = 0, KeyLayout layout = KeyLayout::Rows) {
  const auto B = static_cast<int64_t>(lens.size());
  const int64_t capacity = std::max<int64_t>(1, *std::max_element(lens.begin(), lens.end()));
  KvCacheConfig config{.batch = B, .kv_heads = kv, .head_dim = d, .capacity = capacity, .dtype = dtype};
  if (key_group > 0) config.int8_keys = Int8KeyScales::PerChannel, config.key_group = key_group;
  config.key_layout = layout;
  CacheCase c{KvCache(config), random_tensor({B, heads, tq, d}, 9)};
  const Tensor k = random_tensor({B, kv, capacity, d}, 10, -2.0f, 2.0f), v = random_tensor({B, kv, capacity, d}, 11);
  c.cache.append(k.view4(), v.view4(), lens);
  return c;
}

/// A (B=2, kv=2) cache of different lengths per sequence (700 and 333) and h = 6 queries of T_q rows.
CacheCase cache_case(CacheDtype dtype, int64_t tq, int64_t d = 20, int64_t key_group = 0,
                     KeyLayout layout = KeyLayout::Rows) {
  return cache_of(dtype, tq, d, {700, 333}, 6, 2, key_group, layout);
}

Tensor attend(const CacheCase& c, int splits, int threads, int64_t window = 0, Tensor* lse = nullptr) {
  const int64_t B = c.q.size(0), H = c.q.size(1), tq = c.q.size(2);
  Tensor out({B, H, tq, c.cache.config().head_dim});
  CacheAttentionOptions o;
  o.splits = splits;
  o.threads = threads;
  o.window = window;
  o.alibi.slopes = c.slopes;
  o.softcap = c.softcap;
  o.sinks.logits = c.sinks;
  View4<float> lse_view;
  if (lse) {
    *lse = Tensor({B, H, tq});
    lse_view = contiguous_view(lse->data(), B, H, tq, 1);
  }
  attend_cache(c.q.view4(), c.cache, {}, o, out.view4(), lse_view);
  return out;
}

/// The reference SDPA over the same cache contents (as float), queries at positions length + t,
/// with the case's score edits.
Tensor oracle(const CacheCase& c, int64_t window) {
  const int64_t d = c.cache.config().head_dim, B = c.q.size(0), H = c.q.size(1), tq = c.q.size(2);
  const int64_t kv = c.cache.config().kv_heads;
  Tensor out({B, H, tq, d});
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = c.cache.length(b);
    Tensor k({1, kv, L + tq, d}), v({1, kv, L + tq, d}), q({1, H, tq, d});
    for (int64_t g = 0; g < kv; ++g)
      for (int64_t p = 0; p < L; ++p)
        for (int64_t x = 0; x < d; ++x) {
          k.at({0, g, p, x}) = c.cache.k_at(b, g, p, x);
          v.at({0, g, p, x}) = c.cache.v_at(b, g, p, x);
        }
    // Rows L … L+tq−1 are the queries' own positions, masked away below (not in the cache).
    BoolTensor pad({1, L + tq}, 0);
    for (int64_t p = L; p < L + tq; ++p) pad.at({0, p}) = 1;
    std::copy(c.q.data() + b * H * tq * d, c.q.data() + (b + 1) * H * tq * d, q.data());
    SdpaOptions o;
    o.backend = Backend::Reference;
    o.masks.causal = Causal::with_offset(L).with_window(window);
    o.masks.key_padding.view = {pad.data(), {1, 1, 1, L + tq}, {0, 0, 0, 1}};
    o.alibi.slopes = c.slopes;
    o.softcap = c.softcap;
    o.sinks.logits = c.sinks;
    const Tensor r = sdpa(q, k, v, o).out;
    std::copy(r.data(), r.data() + r.numel(), out.data() + b * H * tq * d);
  }
  return out;
}

/// Every kind of cache the decode kernel reads: each dtype in the row layout and with keys across
/// lanes, and int8 keys with per-channel scales (groups of 16 positions).
struct CacheKind {
  CacheDtype dtype;
  KeyLayout layout;
  int64_t key_group;
};
std::vector<CacheKind> cache_kinds() {
  std::vector<CacheKind> kinds;
  for (KeyLayout layout : {KeyLayout::Rows, KeyLayout::Transposed})
    for (CacheDtype dtype : {CacheDtype::F32, CacheDtype::BF16, CacheDtype::I8}) kinds.push_back({dtype, layout, 0});
  kinds.push_back({CacheDtype::I8, KeyLayout::Rows, 16});
  return kinds;
}
std::string kind_name(const CacheKind& k) {
  return std::string(cache_dtype_name(k.dtype)) + (k.layout == KeyLayout::Transposed ? ", keys across lanes" : "") +
         (k.key_group > 0 ? ", per-channel keys" : "");
}

/// attend() with each split count on 1 thread against the oracle, and with the last split count
/// the same bits on 2 and 3 threads.
void expect_matches_oracle_on_any_thread_count(const CacheCase& c, int64_t window, std::initializer_list<int> splits) {
  const Tensor want = oracle(c, window);
  for (const int n : splits) {
    SCOPED_TRACE(::testing::Message() << "window " << window << ", splits " << n);
    const Tensor one = attend(c, n, 1, window);
    EXPECT_TRUE(all_close(one, want, kF32Tol, kF32Tol));
    if (n != *(splits.end() - 1)) continue;
    for (int threads : {2, 3}) EXPECT_TRUE(bitwise_equal(attend(c, n, threads, window), one)) << threads << " threads";
  }
}

TEST(DecodeKernel, MatchesReferenceOnEveryTarget) {
  testing::for_each_decode_target([&] {
    for (int64_t tq : {1, 3}) {
      const CacheCase c = cache_case(CacheDtype::F32, tq);
      EXPECT_TRUE(all_close(attend(c, 3, 2), oracle(c, 0), kF32Tol, kF32Tol));
      EXPECT_TRUE(all_close(attend(c, 2, 2, 50), oracle(c, 50), kF32Tol, kF32Tol));
    }
    const CacheCase c16 = cache_case(CacheDtype::BF16, 2, 19);                    // odd d: vector tails
    EXPECT_TRUE(all_close(attend(c16, 4, 2), oracle(c16, 0), kF32Tol, kF32Tol));  // same bf16 values
    // d = 72: the kernel's widest register tiles (several vector chunks of d) plus a tail.
    for (CacheDtype dtype : {CacheDtype::F32, CacheDtype::BF16}) {
      const CacheCase wide = cache_case(dtype, 2, 72);
      EXPECT_TRUE(all_close(attend(wide, 3, 2), oracle(wide, 0), kF32Tol, kF32Tol));
    }
    // d = 64 and 96, bf16: whole vectors only on every target (no scalar tail); 96 also leaves a
    // narrower P·V tile after the widest.
    for (int64_t d : {64, 96}) {
      const CacheCase paired = cache_case(CacheDtype::BF16, 2, d);
      EXPECT_TRUE(all_close(attend(paired, 3, 2), oracle(paired, 0), kF32Tol, kF32Tol));
      EXPECT_TRUE(all_close(attend(paired, 2, 2, 50), oracle(paired, 50), kF32Tol, kF32Tol));
    }
  });
}

TEST(DecodeKernel, Int8CacheMatchesReferenceOnTheDequantisedCacheOnEveryTarget) {
  // The kernel applies each row's scale outside its loops over d (score = s_k · (q · k_int8), and
  // p · s_v before P·V) and takes both products in integers, q and p rounded to 16 bits; the
  // oracle reads the dequantised values (k_int8 · s_k) in float. The 16-bit rounding moves these
  // outputs by less than float32's tolerance here (errors ≤ 2⁻¹⁶ of a row's largest q and of a
  // block's largest p). Lengths 700 and 333 end inside kernel blocks of 128.
  testing::for_each_decode_target([&] {
    for (int64_t tq : {1, 3}) {
      const CacheCase c = cache_case(CacheDtype::I8, tq);
      EXPECT_TRUE(all_close(attend(c, 3, 2), oracle(c, 0), kF32Tol, kF32Tol));
      EXPECT_TRUE(all_close(attend(c, 2, 2, 50), oracle(c, 50), kF32Tol, kF32Tol));
    }
    // Odd d (vector tails), whole vectors only, and the widest register tiles plus a tail.
    for (int64_t d : {19, 64, 72, 96}) {
      const CacheCase c = cache_case(CacheDtype::I8, 2, d);
      EXPECT_TRUE(all_close(attend(c, 3, 2), oracle(c, 0), kF32Tol, kF32Tol));
    }
  });
}

TEST(DecodeKernel, Int8IntegerProductsHoldAtTheirRangeLimitsOnEveryTarget) {
  // The int8 path's int32 sums at their largest: every key and value element at ±127 steps, every
  // query element at its largest step count, keys of a row all of one sign (a score's sum is
  // ±steps · 127 · d), at d = 512 (the widest d with 32767 query steps) and d = 600 (fewer steps,
  // so the sums still fit). An overflow would flip the winning keys. Also a query row of zeros
  // (uniform attention over its keys) and one holding a NaN (its output NaN, the others not).
  testing::for_each_decode_target([&] {
    for (int64_t d : {512, 600}) {
      SCOPED_TRACE(::testing::Message() << "d " << d);
      KvCacheConfig config{.batch = 2, .kv_heads = 2, .head_dim = d, .capacity = 300, .dtype = CacheDtype::I8};
      CacheCase c{KvCache(config), Tensor({2, 6, 1, d}, 1.0f)};
      Tensor k({2, 2, 300, d}), v({2, 2, 300, d});
      for (int64_t i = 0; i < k.numel(); ++i) {
        const int64_t pos = i / d % 300, x = i % d;
        k.data()[i] = pos % 3 == 0 ? 1.0f : -1.0f;
        v.data()[i] = (pos + x) % 2 == 0 ? 1.0f : -1.0f;
      }
      c.cache.append(k.view4(), v.view4(), std::vector<int64_t>{300, 151});
      for (int64_t x = 0; x < d; ++x) c.q.at({0, 4, 0, x}) = 0.0f;
      c.q.at({1, 5, 0, d / 2}) = std::numeric_limits<float>::quiet_NaN();
      const Tensor got = attend(c, 2, 2), want = oracle(c, 0);
      EXPECT_TRUE(all_close(got, want, kF32Tol, kF32Tol));
      EXPECT_TRUE(std::isnan(got.at({1, 5, 0, 0})));
      EXPECT_FALSE(std::isnan(got.at({1, 4, 0, 0})));
      // Keys at positions 0, 3, 6, … win by e^{2√d}: the output is their values' mean.
      EXPECT_NEAR(got.at({0, 0, 0, 0}), 0.0f, 0.02);  // 100 keys, values alternating by position
    }
  });
}

TEST(DecodeKernel, Int8ChannelKeysMatchReferenceOnTheDequantisedCacheOnEveryTarget) {
  // Per-channel key scales fold into the query once per run of keys in one group; the oracle
  // reads k_int8 · scale[group][x]. Groups of 1, of an odd size, of a SIMD block's width, of a
  // kernel block (128) and wider than one, against lengths 700 and 333 and splits that cut
  // groups in the middle.
  testing::for_each_decode_target([&] {
    for (int64_t group : {1, 7, 32, 128, 200}) {
      SCOPED_TRACE(::testing::Message() << "key_group " << group);
      const CacheCase c = cache_case(CacheDtype::I8, 3, 20, group);
      EXPECT_TRUE(all_close(attend(c, 3, 2), oracle(c, 0), kF32Tol, kF32Tol));
      EXPECT_TRUE(all_close(attend(c, 2, 2, 50), oracle(c, 50), kF32Tol, kF32Tol));
    }
    for (int64_t d : {19, 64, 72}) {
      const CacheCase c = cache_case(CacheDtype::I8, 1, d, 32);
      EXPECT_TRUE(all_close(attend(c, 5, 2), oracle(c, 0), kF32Tol, kF32Tol));
    }
  });
}

TEST(DecodeKernel, TransposedKeysMatchReferenceOnEveryTarget) {
  // Keys across SIMD lanes: tiles of 16 slots (capacity 700 ends inside one; lengths 700 and 333
  // end inside tiles and blocks), every dtype with per-token scales, odd d, d = 64, and the
  // widest P·V tiles; windows start keys inside tiles (partial tiles through the scratch).
  testing::for_each_decode_target([&] {
    for (CacheDtype dtype : {CacheDtype::F32, CacheDtype::BF16, CacheDtype::I8})
      for (int64_t d : {19, 64, 72}) {
        SCOPED_TRACE(::testing::Message() << cache_dtype_name(dtype) << ", d " << d);
        for (int64_t tq : {1, 3}) {
          const CacheCase c = cache_case(dtype, tq, d, 0, KeyLayout::Transposed);
          EXPECT_TRUE(all_close(attend(c, 3, 2), oracle(c, 0), kF32Tol, kF32Tol));
          EXPECT_TRUE(all_close(attend(c, 2, 2, 50), oracle(c, 50), kF32Tol, kF32Tol));
        }
      }
  });
}

TEST(DecodeKernel, TransposedKeysHoldTheRowLayoutsValuesOnEveryTarget) {
  // The same appends into both layouts: every key element reads back the same, and attention
  // agrees to float rounding (only the order of each dot product's sum differs). Where int8 takes
  // integer products (AVX3, AVX3_DL) its scores are exact sums in either layout: the same bits.
  for (CacheDtype dtype : {CacheDtype::F32, CacheDtype::BF16, CacheDtype::I8}) {
    const CacheCase rows = cache_case(dtype, 2, 20), lanes = cache_case(dtype, 2, 20, 0, KeyLayout::Transposed);
    EXPECT_EQ(lanes.cache.config().key_slots(), 704);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t g = 0; g < 2; ++g)
        for (int64_t p = 0; p < rows.cache.length(b); p += 37)
          for (int64_t x = 0; x < 20; ++x) ASSERT_EQ(lanes.cache.k_at(b, g, p, x), rows.cache.k_at(b, g, p, x));
    for (uint32_t target : hwy::SupportedAndGeneratedTargets()) {
      if (target != HWY_AVX3 && target != HWY_AVX2 && target != HWY_SSE4) continue;  // the multi-lane x86 ones
      hwy::SetSupportedTargetsForTest(target);
      SCOPED_TRACE(::testing::Message() << hwy::TargetName(target) << ", " << cache_dtype_name(dtype));
      EXPECT_TRUE(all_close(attend(lanes, 3, 2), attend(rows, 3, 2), kF32Tol, kF32Tol));
      const bool integer_products = dtype == CacheDtype::I8 && target == HWY_AVX3;
      EXPECT_EQ(bitwise_equal(attend(lanes, 3, 2), attend(rows, 3, 2)), integer_products);  // else another kernel
    }
    hwy::SetSupportedTargetsForTest(0);
    // The best target (AVX3_DL where the CPU has it) takes integer products on any AVX-512 CPU;
    // an odd d too (its last channel paired with zeros in both layouts).
    if (dtype == CacheDtype::I8 && (hwy::SupportedTargets() & HWY_AVX3) != 0) {
      EXPECT_TRUE(bitwise_equal(attend(lanes, 3, 2), attend(rows, 3, 2)));
      const CacheCase odd_rows = cache_case(dtype, 3, 19),
                      odd_lanes = cache_case(dtype, 3, 19, 0, KeyLayout::Transposed);
      EXPECT_TRUE(bitwise_equal(attend(odd_lanes, 3, 2), attend(odd_rows, 3, 2)));
    }
  }
}

TEST(DecodeKernel, TransposedKeysInARingWithSinks) {
  // A ring wraps mid-tile: the slots of one kernel block are two runs, each cut into tile parts.
  for (CacheDtype dtype : {CacheDtype::F32, CacheDtype::I8}) {
    KvCacheConfig config{
        .batch = 1, .kv_heads = 2, .head_dim = 24, .capacity = 90, .dtype = dtype, .ring = true, .sinks = 5};
    KvCache rows(config);
    config.key_layout = KeyLayout::Transposed;
    KvCache lanes(config);
    const Tensor k = random_tensor({1, 2, 250, 24}, 3), v = random_tensor({1, 2, 250, 24}, 4);
    for (int64_t t0 = 0; t0 < 250; t0 += 50) {  // appended in parts: the ring wraps several times
      const Tensor kp = k.reshaped({2, 250, 24}), vp = v.reshaped({2, 250, 24});
      Tensor ks({1, 2, 50, 24}), vs({1, 2, 50, 24});
      for (int64_t g = 0; g < 2; ++g)
        for (int64_t t = 0; t < 50; ++t)
          for (int64_t x = 0; x < 24; ++x)
            ks.at({0, g, t, x}) = kp.at({g, t0 + t, x}), vs.at({0, g, t, x}) = vp.at({g, t0 + t, x});
      rows.append(ks.view4(), vs.view4());
      lanes.append(ks.view4(), vs.view4());
    }
    const Tensor q = random_tensor({1, 4, 1, 24}, 5);
    Tensor out_rows({1, 4, 1, 24}), out_lanes({1, 4, 1, 24});
    CacheAttentionOptions o;
    o.window = 80;
    testing::for_each_decode_target([&] {  // the ring's placement meets each target's tiles
      for (int splits : {1, 3}) {
        o.splits = splits;
        attend_cache(q.view4(), rows, {}, o, out_rows.view4());
        attend_cache(q.view4(), lanes, {}, o, out_lanes.view4());
        EXPECT_TRUE(all_close(out_lanes, out_rows, kF32Tol, kF32Tol))
            << cache_dtype_name(dtype) << ", splits " << splits;
      }
    });
  }
}

TEST(DecodeKernel, Int8RingWithSinksLongerThanABlockHoldsTheRowLayoutsBits) {
  // A ring of 300 slots (5 sinks) over 700 appended positions, a window of 280: items of several
  // kernel blocks (128 keys) whose slots wrap mid-tile, so the scales asked for a block ahead go
  // through the ring's placement and whole tiles come both two at a time and alone. With integer
  // products (AVX3, AVX3_DL) the scores are exact sums in either layout: the same bits; 10 query
  // heads over 2 K/V heads make 5 rows a group (a 4-row tile and a 1-row one).
  KvCacheConfig config{
      .batch = 1, .kv_heads = 2, .head_dim = 19, .capacity = 300, .dtype = CacheDtype::I8, .ring = true, .sinks = 5};
  KvCache rows(config);
  config.key_layout = KeyLayout::Transposed;
  KvCache lanes(config);
  for (int64_t t0 = 0; t0 < 700; t0 += 70) {
    const Tensor k = random_tensor({1, 2, 70, 19}, 30 + t0, -2.0f, 2.0f), v = random_tensor({1, 2, 70, 19}, 31 + t0);
    rows.append(k.view4(), v.view4());
    lanes.append(k.view4(), v.view4());
  }
  const Tensor q = random_tensor({1, 10, 1, 19}, 6);
  const bool integer_products = (hwy::SupportedTargets() & HWY_AVX3) != 0;
  for (int splits : {1, 2, 5}) {
    CacheAttentionOptions o;
    o.window = 280;
    o.splits = splits;
    o.threads = 2;
    Tensor out_rows({1, 10, 1, 19}), out_lanes({1, 10, 1, 19});
    attend_cache(q.view4(), rows, {}, o, out_rows.view4());
    attend_cache(q.view4(), lanes, {}, o, out_lanes.view4());
    EXPECT_TRUE(all_close(out_lanes, out_rows, kF32Tol, kF32Tol)) << "splits " << splits;
    if (integer_products) {
      EXPECT_TRUE(bitwise_equal(out_lanes, out_rows)) << "splits " << splits;
    }
  }
}

// Cache lengths around the kernel's blocks of 128 keys and the tiles of 16 slots of keys across
// lanes (0 and 1 included; each batch pairs two lengths), every kind of cache, with and without a
// window, in 1 and 3 splits: against the reference on the cache's values, on every target, and the
// same bits on 1, 2 and 3 threads (3 splits).
TEST(DecodeKernel, CacheLengthsAroundBlocksAndTilesMatchReferenceOnEveryTarget) {
  const std::vector<std::vector<int64_t>> lengths = {{0, 1}, {15, 16}, {17, 127}, {128, 129}, {255, 257}};
  testing::for_each_decode_target([&] {
    for (const CacheKind& kind : cache_kinds())
      for (const std::vector<int64_t>& lens : lengths) {
        SCOPED_TRACE(::testing::Message() << kind_name(kind) << ", lengths " << lens[0] << " and " << lens[1]);
        const CacheCase c = cache_of(kind.dtype, 2, 20, lens, 6, 2, kind.key_group, kind.layout);
        for (int64_t window : {0, 20}) expect_matches_oracle_on_any_thread_count(c, window, {1, 3});
      }
  });
}

// A work item takes up to 16 query rows: the G query heads of a K/V head times as many queries as
// fit, at least one. Several query tiles per group (7 queries of 3 heads: tiles of 5 and 2; 17 of
// one head: 16 and 1), a group of exactly 16 and one wider (a query a tile), every kind of cache:
// against the reference on every target, the same bits on 1, 2 and 3 threads.
TEST(DecodeKernel, QueryTilesAndWideGroupsMatchReferenceOnEveryTarget) {
  struct Heads {
    int64_t heads, kv, tq;
  };
  testing::for_each_decode_target([&] {
    for (const CacheKind& kind : cache_kinds())
      for (const Heads hd : {Heads{6, 2, 7}, Heads{4, 4, 17}, Heads{32, 2, 3}, Heads{20, 1, 2}}) {
        SCOPED_TRACE(::testing::Message()
                     << kind_name(kind) << ", " << hd.heads << " heads over " << hd.kv << ", T_q " << hd.tq);
        const CacheCase c = cache_of(kind.dtype, hd.tq, 20, {300, 131}, hd.heads, hd.kv, kind.key_group, kind.layout);
        for (int64_t window : {0, 50}) expect_matches_oracle_on_any_thread_count(c, window, {2});
      }
  });
}

// Score edits over caches longer than a block of keys: softcap, ALiBi by absolute positions (its
// distances formed per block) and a sink per head, every kind of cache, a window, splits that cut
// the positions into parts: against the reference with the same edits, on every target, the same
// bits on 1, 2 and 3 threads (3 splits).
TEST(DecodeKernel, ScoreEditsOverSeveralBlocksMatchReferenceOnEveryTarget) {
  testing::for_each_decode_target([&] {
    for (const CacheKind& kind : cache_kinds()) {
      SCOPED_TRACE(kind_name(kind));
      CacheCase c = cache_of(kind.dtype, 3, 20, {300, 131}, 6, 2, kind.key_group, kind.layout);
      c.slopes = alibi_slopes(6);
      c.softcap = 2.5f;
      c.sinks = {0.5f, -1.0f, 2.0f, 0.0f, 1.0f, -0.5f};
      for (int64_t window : {0, 200}) expect_matches_oracle_on_any_thread_count(c, window, {1, 3});
    }
  });
}

TEST(DecodeKernel, Int8CacheWithinItsQuantisationStepOfFloat32) {
  // Every int8 element is within s/2 of the float32 one (s = its row's max|x| / 127; here K in
  // [−2, 2): s_k ≤ 2/127, V in [−1, 1): s_v ≤ 1/127). A score scale·q·k then moves by at most
  // Δ = scale · Σ|q_x| · s_k/2, each probability by a factor within e^{±2Δ}, so the output by at
  // most (e^{2Δ} − 1)·max|v| from the scores plus s_v/2 from the values (the probabilities sum to 1).
  for (int64_t d : {20, 64}) {
    const CacheCase f = cache_case(CacheDtype::F32, 2, d), q8 = cache_case(CacheDtype::I8, 2, d);
    double q_l1 = 0;
    for (int64_t r = 0; r < f.q.numel() / d; ++r) {
      double sum = 0;
      for (int64_t x = 0; x < d; ++x) sum += std::fabs(f.q.data()[r * d + x]);
      q_l1 = std::max(q_l1, sum);
    }
    const double delta = q_l1 / std::sqrt(static_cast<double>(d)) * (2.0 / 127) / 2;
    const double bound = std::expm1(2 * delta) + (1.0 / 127) / 2 + kF32Tol;
    const Tensor want = attend(f, 3, 2), got = attend(q8, 3, 2);
    double worst = 0;
    for (int64_t i = 0; i < want.numel(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(got.data()[i] - want.data()[i])));
    SCOPED_TRACE(::testing::Message() << "d " << d << " max |int8 − f32| " << worst << ", bound " << bound);
    EXPECT_LE(worst, bound);
    EXPECT_GT(worst, 0.0);  // it really is quantised
  }
}

TEST(DecodeKernel, SplitMergeEqualsUnsplit) {
  const CacheCase c = cache_case(CacheDtype::F32, 2);
  Tensor lse1, lse7;
  const Tensor one = attend(c, 1, 1, 0, &lse1);
  EXPECT_TRUE(all_close(attend(c, 7, 1, 0, &lse7), one, kF32Tol, kF32Tol));
  EXPECT_TRUE(all_close(lse7, lse1, kF32Tol, kF32Tol));
  EXPECT_TRUE(all_close(attend(c, 64, 1), one, kF32Tol, kF32Tol));  // more splits than blocks
  // Past one split per 128-key block (700 held: 6) the parts are empty: the same bits, and a huge
  // count no longer sizes a workspace of its own (INT_MAX splits: std::bad_alloc).
  const Tensor six = attend(c, 6, 1);
  EXPECT_TRUE(bitwise_equal(attend(c, 7, 1), six));
  EXPECT_TRUE(bitwise_equal(attend(c, std::numeric_limits<int>::max(), 2), six));
  EXPECT_EQ(kernels::cap_decode_splits(std::numeric_limits<int>::max(), 700), 6);  // blocks of 128 keys
  EXPECT_EQ(kernels::cap_decode_splits(3, 700), 3);
  EXPECT_EQ(kernels::cap_decode_splits(0, 0), 1);
}

TEST(DecodeKernel, SameSplitsAnyThreadsBitwise) {
  for (auto [dtype, d] : {std::pair{CacheDtype::F32, 20},
                          {CacheDtype::BF16, 20},
                          {CacheDtype::BF16, 64},
                          {CacheDtype::I8, 20},
                          {CacheDtype::I8, 64}}) {
    for (int64_t key_group : {int64_t{0}, int64_t{32}})
      for (KeyLayout layout : {KeyLayout::Rows, KeyLayout::Transposed}) {
        if (key_group > 0 && (dtype != CacheDtype::I8 || layout == KeyLayout::Transposed)) continue;
        const CacheCase c = cache_case(dtype, 1, d, key_group, layout);
        const Tensor base = attend(c, 5, 1);
        EXPECT_TRUE(bitwise_equal(attend(c, 5, 2), base));
        EXPECT_TRUE(bitwise_equal(attend(c, 5, 3), base));
        EXPECT_TRUE(bitwise_equal(attend(c, 5, 2), attend(c, 5, 2)));
      }
  }
}

TEST(DecodeKernel, RowWithNoVisibleKeyGivesZeros) {
  KvCache cache(KvCacheConfig{.batch = 1, .kv_heads = 1, .head_dim = 4, .capacity = 4});
  const Tensor q = random_tensor({1, 2, 1, 4}, 1);
  Tensor out({1, 2, 1, 4}, 5.0f), lse({1, 2, 1}, 5.0f);
  attend_cache(q.view4(), cache, {}, {}, out.view4(), contiguous_view(lse.data(), 1, 2, 1, 1));
  for (float x : out.values()) EXPECT_EQ(x, 0.0f);
  for (float x : lse.values()) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
}

TEST(DecodeKernel, BadArguments) {
  const CacheCase c = cache_case(CacheDtype::F32, 1);
  Tensor out({2, 6, 1, 20});
  const Tensor q5 = random_tensor({2, 5, 1, 20}, 1);  // 5 heads over 2 kv heads
  EXPECT_THROW(attend_cache(q5.view4(), c.cache, {}, {}, out.view4()), Error);
  Tensor small({2, 6, 1, 19});
  EXPECT_THROW(attend_cache(c.q.view4(), c.cache, {}, {}, small.view4()), Error);
  CacheAttentionOptions o;
  o.window = -1;
  EXPECT_THROW(attend_cache(c.q.view4(), c.cache, {}, o, out.view4()), Error);
  const std::vector<int64_t> starts{1};
  EXPECT_THROW(attend_cache(c.q.view4(), c.cache, starts, {}, out.view4()), Error);
}

// A first query position near INT64_MAX overflowed q_start + T_q in the kernel and hid every key
// (zeros, lse −inf) instead of failing: q_start is bounded by Causal::kMaxPosition − T_q, as
// sdpa bounds its causal offset, and the edge itself still sees every cached key.
TEST(DecodeKernel, FirstQueryPositionBeyondTwoToTheFortyIsAnError) {
  KvCache cache(KvCacheConfig{.batch = 1, .kv_heads = 1, .head_dim = 4, .capacity = 8});
  const Tensor kv = random_tensor({1, 1, 5, 4}, 2);
  cache.append(kv.view4(), kv.view4());
  const Tensor q = random_tensor({1, 1, 3, 4}, 1);
  Tensor out({1, 1, 3, 4}), lse({1, 1, 3});
  const auto lse_view = contiguous_view(lse.data(), 1, 1, 3, 1);
  const int64_t edge = Causal::kMaxPosition - 3;
  for (const int64_t start : {edge + 1, std::numeric_limits<int64_t>::max() - 2, std::numeric_limits<int64_t>::max()}) {
    const std::vector<int64_t> starts{start};
    const std::string msg = testing::error_of([&] { attend_cache(q.view4(), cache, starts, {}, out.view4()); });
    EXPECT_NE(msg.find("attend_cache: q_start[0] = " + std::to_string(start) + " is outside [0, 2^40 − T_q]"),
              std::string::npos)
        << msg;
  }
  const std::vector<int64_t> at_edge{edge}, at_zero{5};
  Tensor out_zero({1, 1, 3, 4}), lse_zero({1, 1, 3});
  attend_cache(q.view4(), cache, at_edge, {}, out.view4(), lse_view);
  attend_cache(q.view4(), cache, at_zero, {}, out_zero.view4(), contiguous_view(lse_zero.data(), 1, 1, 3, 1));
  EXPECT_TRUE(bitwise_equal(out, out_zero));  // every row sees all 5 keys either way
  EXPECT_TRUE(bitwise_equal(lse, lse_zero));
}

TEST(KvCacheIndex, EachAccessorNamesItself) {
  KvCache cache(KvCacheConfig{.batch = 2, .kv_heads = 1, .head_dim = 4, .capacity = 5});
  EXPECT_NE(testing::error_of([&] { (void)cache.stored(7); }).find("KvCache::stored: sequence 7"), std::string::npos);
  EXPECT_NE(testing::error_of([&] { (void)cache.remaining(-3); }).find("KvCache::remaining: sequence -3"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] { (void)cache.first(2); }).find("KvCache::first: sequence 2"), std::string::npos);
}

// ---- RoPE against PyTorch --------------------------------------------------------------------

Rope rope_from(const io::SafetensorsFile& f) {
  const auto& meta = f.metadata();
  Rope r;
  r.enabled = true;
  r.theta = std::stod(meta.at("theta"));
  r.dims = std::stoll(meta.at("dims"));
  r.pairing = meta.at("layout") == "interleaved" ? RopePairing::Interleaved : RopePairing::HalfSplit;
  return r;
}

std::string golden(const std::string& name) { return std::string(MHA_GOLDEN_DIR) + "/rope/" + name + ".safetensors"; }

TEST(RopeGolden, KernelMatchesPyTorch) {
  for (const char* name :
       {"rope_half_split_full", "rope_half_split_partial", "rope_interleaved_partial", "rope_interleaved_full"}) {
    SCOPED_TRACE(name);
    const io::SafetensorsFile f = io::SafetensorsFile::open(golden(name));
    Tensor x = f.read_f32("x");
    const Tensor start_f = f.read_f32("start");
    std::vector<int64_t> start;
    for (float s : start_f.values()) start.push_back(static_cast<int64_t>(s));
    apply_rope(x.view4(), rope_from(f), start.data());
    // One float32 rounding of cos/sin and of the products: a few ε of |x| ≤ 1.
    EXPECT_TRUE(all_close(x, f.read_f32("expected"), 8 * kEps, 8 * kEps));
  }
}

// ---- RoPE's two directions -------------------------------------------------------------------

/// Random x (B, heads, T, d) for the direction tests, with positions far apart per batch.
struct RopeCase {
  Rope rope;
  Tensor x = random_tensor({2, 3, 5, 10}, 41);
  std::vector<int64_t> start{3, 100000};
};

std::vector<RopeCase> rope_cases() {
  std::vector<RopeCase> cs(4);
  cs[0].rope = Rope::half_split(10000.0);      // all 10 features
  cs[1].rope = Rope::half_split(500.0, 6);     // partial: 6 of 10 rotated
  cs[2].rope = Rope::interleaved(10000.0);     // all 10 features
  cs[3].rope = Rope::interleaved(10000.0, 4);  // partial: 4 of 10 rotated
  return cs;
}

TEST(RopeDirection, UnrotateUndoesRotate) {
  for (const RopeCase& c : rope_cases()) {
    SCOPED_TRACE(c.rope.pairing == RopePairing::Interleaved ? "interleaved" : "half_split");
    SCOPED_TRACE(c.rope.dims);
    Tensor y = c.x;
    apply_rope(y.view4(), c.rope, c.start.data());
    EXPECT_FALSE(bitwise_equal(y, c.x));
    apply_rope(y.view4(), c.rope, c.start.data(), RopeDirection::Unrotate);
    // Two rotations, each a float32 rounding of cos/sin and of two products and a sum, of |x| ≤ 1.
    EXPECT_TRUE(all_close(y, c.x, 8 * kEps, 8 * kEps));
  }
}

TEST(RopeDirection, UnrotateIsRotationByMinusTheAngle) {
  for (const RopeCase& c : rope_cases()) {
    SCOPED_TRACE(c.rope.pairing == RopePairing::Interleaved ? "interleaved" : "half_split");
    SCOPED_TRACE(c.rope.dims);
    Tensor y = c.x;
    apply_rope(y.view4(), c.rope, c.start.data(), RopeDirection::Unrotate);
    const int64_t d = c.x.size(3), dims = c.rope.rotary_dims(d), half = dims / 2;
    const bool inter = c.rope.pairing == RopePairing::Interleaved;
    Tensor in_double = c.x, transposed = c.x;
    for (int64_t b = 0; b < c.x.size(0); ++b)
      for (int64_t h = 0; h < c.x.size(1); ++h)
        for (int64_t t = 0; t < c.x.size(2); ++t)
          for (int64_t i = 0; i < half; ++i) {
            const int64_t ia = inter ? 2 * i : i, ib = inter ? 2 * i + 1 : i + half;
            const double angle = static_cast<double>(c.start[b] + t) *
                                 std::pow(c.rope.theta, -static_cast<double>(2 * i) / static_cast<double>(dims));
            const float xa = c.x.at({b, h, t, ia}), xb = c.x.at({b, h, t, ib});
            // Rotation by −angle, in double.
            in_double.at({b, h, t, ia}) = static_cast<float>(xa * std::cos(-angle) - xb * std::sin(-angle));
            in_double.at({b, h, t, ib}) = static_cast<float>(xb * std::cos(-angle) + xa * std::sin(-angle));
            // The transpose of the rotation with the same float cos and sin, as a gradient forms it.
            const float cf = static_cast<float>(std::cos(angle)), sf = static_cast<float>(std::sin(angle));
            transposed.at({b, h, t, ia}) = xa * cf + xb * sf;
            transposed.at({b, h, t, ib}) = xb * cf - xa * sf;
          }
    EXPECT_TRUE(all_close(y, in_double, 4 * kEps, 4 * kEps));
    EXPECT_TRUE(bitwise_equal(y, transposed));  // features past dims pass through untouched
  }
}

TEST(RopeGolden, ModuleFullAndIncrementalMatchPyTorch) {
  for (const char* name : {"module_llama_gqa", "module_gptj_partial"}) {
    SCOPED_TRACE(name);
    const io::SafetensorsFile f = io::SafetensorsFile::open(golden(name));
    const auto& meta = f.metadata();
    MhaConfig c;
    c.embed_dim = std::stoll(meta.at("embed_dim"));
    c.num_heads = std::stoll(meta.at("num_heads"));
    c.num_kv_heads = std::stoll(meta.at("num_kv_heads"));
    c.bias = false;
    c.layout = Layout::BatchFirst;
    c.rope = rope_from(f);
    MultiheadAttention m(c);
    m.params().in_proj_weight = f.read_f32("in_proj_weight");
    m.params().out_proj_weight = f.read_f32("out_proj_weight");
    const Tensor x = f.read_f32("query"), want = f.read_f32("expected");
    MhaForwardOptions o;
    o.causal = Causal::top_left();
    EXPECT_TRUE(all_close(m.forward(x, x, x, o).output, want, 2e-5, 2e-4));  // the shared checker's tolerance
    const DecodeSetup s = setup(c.embed_dim, c.num_heads, c.num_kv_heads);
    EXPECT_TRUE(all_close(incremental(m, s, x, 2), want, 2e-5, 2e-4));
  }
}

}  // namespace
}  // namespace mha
