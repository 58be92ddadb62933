// The paged KV cache (mha/paged_kv_cache.h) against the contiguous cache token by token (bitwise,
// same decode kernel, same splits), on every SIMD target, any thread count; fork with copy-on-write;
// free; bad block tables. And the StreamingLLM sink cache (KvCacheConfig::sinks) against the full
// forward under the explicit mask "p ≤ q and (p < sinks or p > q − window)".
#include <hwy/targets.h>

#include <cmath>
#include <string>
#include <vector>

#include "mha/kv_cache.h"
#include "mha/module.h"
#include "mha/paged_kv_cache.h"
#include "support/test_support.h"

namespace mha {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::error_of;
using testing::random_tensor;

constexpr double kEps = 1.1920928955078125e-07;

struct Dims {
  int64_t kv = 2, h = 4, d = 8;
};

/// One token's K or V for sequence b of a batch: (1, kv, 1, d) slices of (B, kv, 1, d).
View4<const float> one(const Tensor& t, int64_t b) {
  View4<const float> v = t.view4();
  v.data += b * v.stride[0];
  v.shape[0] = 1;
  return v;
}

/// Grows two sequences token by token in both caches (interleaved, so the paged blocks of a
/// sequence are not adjacent in the pool) and checks, after every token, that attention through
/// the block tables equals attention over the contiguous cache bitwise, for 1, 2 and 3 threads.
/// Transposed keys in both: tiles of the same positions, so the same arithmetic.
void paged_equals_contiguous(CacheDtype dtype, int64_t block_size, int64_t steps, int splits,
                             KeyLayout layout = KeyLayout::Rows) {
  const Dims dm;
  KvCacheConfig cc;
  cc.batch = 2, cc.kv_heads = dm.kv, cc.head_dim = dm.d, cc.capacity = steps, cc.dtype = dtype;
  cc.key_layout = layout;
  KvCache flat(cc);
  PagedKvCacheConfig pc;
  pc.kv_heads = dm.kv, pc.head_dim = dm.d, pc.block_size = block_size, pc.dtype = dtype;
  pc.key_layout = layout;
  pc.num_blocks = 2 * ((steps + block_size - 1) / block_size);
  PagedKvCache paged(pc);
  const std::vector<int64_t> ids{paged.add_sequence(), paged.add_sequence()};
  for (int64_t t = 0; t < steps; ++t) {
    const Tensor k = random_tensor({2, dm.kv, 1, dm.d}, 100 + t), v = random_tensor({2, dm.kv, 1, dm.d}, 200 + t);
    flat.append(k.view4(), v.view4());
    for (int64_t b = 0; b < 2; ++b) paged.append(ids[static_cast<size_t>(b)], one(k, b), one(v, b));
    const Tensor q = random_tensor({2, dm.h, 1, dm.d}, 300 + t);
    // Queries at the last position (they see everything) and a window of 5.
    const std::vector<int64_t> at{t, t};
    for (int64_t window : {int64_t{0}, int64_t{5}}) {
      CacheAttentionOptions o;
      o.splits = splits;
      o.window = window;
      Tensor want({2, dm.h, 1, dm.d}), want_lse({2, dm.h, 1, 1});
      o.threads = 1;
      attend_cache(q.view4(), flat, at, o, want.view4(), want_lse.view4());
      for (int threads : {1, 2, 3}) {
        o.threads = threads;
        Tensor got({2, dm.h, 1, dm.d}), got_lse({2, dm.h, 1, 1});
        attend_paged_cache(q.view4(), paged, ids, at, o, got.view4(), got_lse.view4());
        ASSERT_TRUE(bitwise_equal(got, want)) << "token " << t << ", threads " << threads << ", window " << window;
        ASSERT_TRUE(bitwise_equal(got_lse, want_lse));
      }
    }
  }
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t p = 0; p < steps; p += 7)
      EXPECT_EQ(paged.k_at(ids[static_cast<size_t>(b)], 1, p, 3), flat.k_at(b, 1, p, 3));
}

/// A pool of `blocks` blocks of 2 positions, one K/V head of d = 4: the error tests' cache.
PagedKvCacheConfig tiny_pool(int64_t blocks) {
  PagedKvCacheConfig pc;
  pc.kv_heads = 1, pc.head_dim = 4, pc.block_size = 2, pc.num_blocks = blocks;
  return pc;
}

TEST(PagedKvCache, EqualsContiguousCacheTokenByTokenOnEveryTarget) {
  testing::for_each_decode_target([&] {
    paged_equals_contiguous(CacheDtype::F32, 16, 40, 1);
    paged_equals_contiguous(CacheDtype::BF16, 3, 23, 2);
    paged_equals_contiguous(CacheDtype::I8, 5, 20, 2);  // rows and their scales through the tables
    // Keys across lanes, a block of one tile or of two; 40 and 70 positions end inside tiles.
    paged_equals_contiguous(CacheDtype::F32, 16, 40, 1, KeyLayout::Transposed);
    paged_equals_contiguous(CacheDtype::BF16, 32, 70, 2, KeyLayout::Transposed);
    paged_equals_contiguous(CacheDtype::I8, 16, 40, 2, KeyLayout::Transposed);
  });
  paged_equals_contiguous(CacheDtype::F32, 1, 9, 3);     // one position per block
  paged_equals_contiguous(CacheDtype::F32, 64, 300, 0);  // several kernel blocks, auto splits
  // int8 past a kernel block (128 keys), whose next block's scales are asked for through the
  // tables, and whose whole tiles go two at a time with keys across lanes.
  paged_equals_contiguous(CacheDtype::I8, 16, 140, 1, KeyLayout::Transposed);
  paged_equals_contiguous(CacheDtype::I8, 5, 140, 1);
}

// Several query rows per sequence (query tiles of 3 heads × 5 queries and 3 × 2), score edits
// (softcap, ALiBi by absolute positions, a sink per head), a window and splits, through the block
// tables: bitwise the contiguous cache's attention over the same positions, every dtype and key
// layout, on every target and on 1 and 3 threads.
TEST(PagedKvCache, QueryTilesAndScoreEditsEqualContiguousCacheOnEveryTarget) {
  const int64_t kv = 2, h = 6, d = 20, tq = 7;
  const std::vector<int64_t> lens{300, 131};
  const std::vector<float> slopes = alibi_slopes(h), sinks = {0.5f, -1.0f, 2.0f, 0.0f, 1.0f, -0.5f};
  for (KeyLayout layout : {KeyLayout::Rows, KeyLayout::Transposed})
    for (CacheDtype dtype : {CacheDtype::F32, CacheDtype::BF16, CacheDtype::I8}) {
      SCOPED_TRACE(::testing::Message() << cache_dtype_name(dtype)
                                        << (layout == KeyLayout::Transposed ? ", keys across lanes" : ""));
      KvCacheConfig cc;
      cc.batch = 2, cc.kv_heads = kv, cc.head_dim = d, cc.capacity = 300, cc.dtype = dtype, cc.key_layout = layout;
      KvCache flat(cc);
      PagedKvCacheConfig pc;
      pc.kv_heads = kv, pc.head_dim = d, pc.block_size = 32, pc.num_blocks = 16, pc.dtype = dtype;
      pc.key_layout = layout;
      PagedKvCache paged(pc);
      const std::vector<int64_t> ids{paged.add_sequence(), paged.add_sequence()};
      const Tensor k = random_tensor({2, kv, 300, d}, 7, -2.0f, 2.0f), v = random_tensor({2, kv, 300, d}, 8);
      flat.append(k.view4(), v.view4(), lens);
      for (int64_t b = 0; b < 2; ++b) {
        View4<const float> kb = one(k, b), vb = one(v, b);
        kb.shape[2] = vb.shape[2] = lens[static_cast<size_t>(b)];
        paged.append(ids[static_cast<size_t>(b)], kb, vb);
      }
      const Tensor q = random_tensor({2, h, tq, d}, 9);
      const std::vector<int64_t> at{300, 131};  // the tokens right after each sequence
      CacheAttentionOptions o;
      o.alibi.slopes = slopes, o.softcap = 2.5f, o.sinks.logits = sinks, o.window = 100, o.splits = 3;
      testing::for_each_decode_target([&] {
        Tensor want({2, h, tq, d}), want_lse({2, h, tq, 1});
        o.threads = 2;
        attend_cache(q.view4(), flat, at, o, want.view4(), want_lse.view4());
        for (int threads : {1, 3}) {
          o.threads = threads;
          Tensor got({2, h, tq, d}), got_lse({2, h, tq, 1});
          attend_paged_cache(q.view4(), paged, ids, at, o, got.view4(), got_lse.view4());
          EXPECT_TRUE(bitwise_equal(got, want)) << threads << " threads";
          EXPECT_TRUE(bitwise_equal(got_lse, want_lse)) << threads << " threads";
        }
      });
    }
}

/// Fork, then copy-on-write of the shared last block (int8: the rows' scales are copied with it).
void fork_shares_blocks_and_copies_on_write(CacheDtype dtype) {
  const Dims dm;
  PagedKvCacheConfig pc;
  pc.kv_heads = dm.kv, pc.head_dim = dm.d, pc.block_size = 4, pc.num_blocks = 6, pc.dtype = dtype;
  PagedKvCache cache(pc);
  const int64_t a = cache.add_sequence();
  const Tensor k = random_tensor({1, dm.kv, 6, dm.d}, 1), v = random_tensor({1, dm.kv, 6, dm.d}, 2);
  cache.append(a, k.view4(), v.view4());  // 6 positions: one full block, one half full
  EXPECT_EQ(cache.free_blocks(), 4);
  const int64_t b = cache.fork(a);  // no copy: the same two blocks, each held twice
  EXPECT_EQ(cache.free_blocks(), 4);
  EXPECT_EQ(std::vector<int32_t>(cache.block_table(b).begin(), cache.block_table(b).end()),
            std::vector<int32_t>(cache.block_table(a).begin(), cache.block_table(a).end()));
  for (int32_t blk : cache.block_table(a)) EXPECT_EQ(cache.refcount(blk), 2);
  const int32_t shared_last = cache.block_table(a)[1];

  // b writes into the shared half-full block: it gets its own copy first; a is untouched.
  const Tensor kb = random_tensor({1, dm.kv, 1, dm.d}, 3), vb = random_tensor({1, dm.kv, 1, dm.d}, 4);
  cache.append(b, kb.view4(), vb.view4());
  EXPECT_EQ(cache.block_table(b)[0], cache.block_table(a)[0]);  // the full block stays shared
  EXPECT_NE(cache.block_table(b)[1], shared_last);
  EXPECT_EQ(cache.refcount(shared_last), 1);
  EXPECT_EQ(cache.refcount(cache.block_table(a)[0]), 2);
  EXPECT_EQ(cache.free_blocks(), 3);  // a's two blocks, b's copy of the last
  EXPECT_EQ(cache.length(a), 6);
  EXPECT_EQ(cache.length(b), 7);
  // A contiguous cache of each sequence's own positions holds the same values (as stored).
  KvCacheConfig cc;
  cc.batch = 1, cc.kv_heads = dm.kv, cc.head_dim = dm.d, cc.capacity = 8, cc.dtype = dtype;
  KvCache flat_a(cc), flat_b(cc);
  flat_a.append(k.view4(), v.view4());
  flat_b.append(k.view4(), v.view4());
  flat_b.append(kb.view4(), vb.view4());
  for (int64_t p = 0; p < 6; ++p)
    for (int64_t g = 0; g < dm.kv; ++g) {
      EXPECT_EQ(cache.k_at(b, g, p, 5), flat_b.k_at(0, g, p, 5));  // the copy holds the prefix
      EXPECT_EQ(cache.v_at(a, g, p, 2), flat_a.v_at(0, g, p, 2));
    }
  EXPECT_EQ(cache.k_at(b, 1, 6, 0), flat_b.k_at(0, 1, 6, 0));
  EXPECT_NE(error_of([&] { (void)cache.k_at(a, 0, 6, 0); }).find("outside"), std::string::npos);

  // Attention for each equals the contiguous cache's, bitwise.
  const Tensor q = random_tensor({1, dm.h, 2, dm.d}, 5);
  for (int64_t id : {a, b}) {
    KvCache& flat = id == a ? flat_a : flat_b;
    const std::vector<int64_t> at{flat.length(0) - 2};
    Tensor want({1, dm.h, 2, dm.d}), got({1, dm.h, 2, dm.d});
    attend_cache(q.view4(), flat, at, {}, want.view4());
    const std::vector<int64_t> ids{id};
    attend_paged_cache(q.view4(), cache, ids, at, {}, got.view4());
    EXPECT_TRUE(bitwise_equal(got, want));
  }

  // Freeing returns only unshared blocks; freeing both returns everything.
  cache.free(a);
  EXPECT_EQ(cache.refcount(cache.block_table(b)[0]), 1);
  EXPECT_EQ(cache.free_blocks(), 4);
  cache.free(b);
  EXPECT_EQ(cache.free_blocks(), 6);
  EXPECT_NE(error_of([&] { cache.length(b); }).find("does not exist"), std::string::npos);
  EXPECT_EQ(cache.add_sequence(), a);  // ids are reused
}

TEST(PagedKvCache, TransposedKeysForkCopiesWholeTiles) {
  // Copy-on-write of a shared block copies its tiles; every key reads back as appended, in both.
  const Dims dm;
  PagedKvCacheConfig pc;
  pc.kv_heads = dm.kv, pc.head_dim = dm.d, pc.block_size = 16, pc.num_blocks = 4, pc.dtype = CacheDtype::I8;
  pc.key_layout = KeyLayout::Transposed;
  PagedKvCache cache(pc);
  KvCacheConfig cc;
  cc.batch = 1, cc.kv_heads = dm.kv, cc.head_dim = dm.d, cc.capacity = 24, cc.dtype = CacheDtype::I8;
  KvCache flat_a(cc), flat_b(cc);
  const int64_t a = cache.add_sequence();
  const Tensor k = random_tensor({1, dm.kv, 20, dm.d}, 7), v = random_tensor({1, dm.kv, 20, dm.d}, 8);
  cache.append(a, k.view4(), v.view4());
  const int64_t b = cache.fork(a);
  const Tensor kb = random_tensor({1, dm.kv, 3, dm.d}, 9), vb = random_tensor({1, dm.kv, 3, dm.d}, 10);
  cache.append(b, kb.view4(), vb.view4());
  flat_a.append(k.view4(), v.view4());
  flat_b.append(k.view4(), v.view4());
  flat_b.append(kb.view4(), vb.view4());
  EXPECT_NE(cache.block_table(b)[1], cache.block_table(a)[1]);
  for (int64_t g = 0; g < dm.kv; ++g)
    for (int64_t x = 0; x < dm.d; ++x) {
      for (int64_t p = 0; p < 20; ++p) ASSERT_EQ(cache.k_at(a, g, p, x), flat_a.k_at(0, g, p, x));
      for (int64_t p = 0; p < 23; ++p) ASSERT_EQ(cache.k_at(b, g, p, x), flat_b.k_at(0, g, p, x));
    }
  pc.block_size = 24;
  EXPECT_NE(error_of([&] { PagedKvCache{pc}; }).find("multiple of 16"), std::string::npos);
}

TEST(PagedKvCache, ForkSharesBlocksAndCopiesOnWrite) {
  for (CacheDtype dtype : {CacheDtype::F32, CacheDtype::I8}) {
    SCOPED_TRACE(cache_dtype_name(dtype));
    fork_shares_blocks_and_copies_on_write(dtype);
  }
}

// A moved-from pool kept its sizes over no storage (attend_paged_blocks then read freed memory); a
// negative T set a negative length, and the next append indexed its block table with it.
TEST(PagedKvCache, MovedFromPoolsAndNegativeExtentsAreErrors) {
  const PagedKvCacheConfig pc = tiny_pool(3);
  PagedKvCache source(pc);
  const int64_t s = source.add_sequence();
  const Tensor kv = random_tensor({1, 1, 3, 4}, 2);
  source.append(s, kv.view4(), kv.view4());
  PagedKvCache pool(std::move(source));
  EXPECT_EQ(pool.length(s), 3);
  EXPECT_EQ(source.config().num_blocks, 0);
  EXPECT_FALSE(source.alive(s));
  const Tensor q = random_tensor({1, 2, 1, 4}, 1);
  Tensor out({1, 2, 1, 4});
  const std::vector<int32_t> table{0, 1};
  const std::vector<int64_t> len{3};
  const std::string moved =
      error_of([&] { attend_paged_blocks(q.view4(), source, table, 2, len, {}, {}, out.view4()); });
  EXPECT_NE(moved.find("empty"), std::string::npos) << moved;
  std::vector<float> buf(64);
  const View4<const float> negative{buf.data(), {1, 1, -100000, 4}, {4, 4, 4, 1}};
  const std::string neg = error_of([&] { pool.append(s, negative, negative); });
  EXPECT_NE(neg.find("has a negative extent"), std::string::npos) << neg;
  EXPECT_EQ(pool.length(s), 3);
  const Tensor one = random_tensor({1, 1, 1, 4}, 4);
  pool.append(s, one.view4(), one.view4());  // the pool works on
  EXPECT_EQ(pool.length(s), 4);
}

TEST(PagedKvCache, GrowsWithoutReservingAndRefusesAFullPool) {
  const PagedKvCacheConfig pc = tiny_pool(3);
  PagedKvCache cache(pc);
  const int64_t a = cache.add_sequence(), b = cache.add_sequence();
  EXPECT_EQ(cache.free_blocks(), 3);  // nothing reserved per sequence
  const Tensor k = random_tensor({1, 1, 5, 4}, 1);
  cache.append(a, k.view4(), k.view4());
  EXPECT_EQ(cache.free_blocks(), 0);
  const std::string err = error_of([&] { cache.append(b, k.view4(), k.view4()); });
  EXPECT_NE(err.find("the pool has 0 of 3 free"), std::string::npos) << err;
  EXPECT_EQ(cache.length(b), 0);  // nothing changed
  EXPECT_NE(error_of([&] {
              cache.append(a, random_tensor({1, 2, 1, 4}, 2).view4(), k.view4());
            }).find("kv_heads"),
            std::string::npos);
  EXPECT_NE(error_of([&] { PagedKvCache bad(PagedKvCacheConfig{}); }).find("must be ≥ 1"), std::string::npos);
}

TEST(PagedKvCache, BlockTableOutsideThePoolIsAnError) {
  const PagedKvCacheConfig pc = tiny_pool(3);
  PagedKvCache cache(pc);
  const Tensor q = random_tensor({1, 2, 1, 4}, 1);
  Tensor out({1, 2, 1, 4});
  const std::vector<int64_t> len{3};
  for (std::vector<int32_t> table : {std::vector<int32_t>{0, 3}, std::vector<int32_t>{-1, 0}}) {
    const std::string err =
        error_of([&] { attend_paged_blocks(q.view4(), cache, table, 2, len, {}, {}, out.view4()); });
    EXPECT_NE(err.find("points outside the pool of 3 blocks"), std::string::npos) << err;
  }
  const std::vector<int32_t> table{0, 1};
  const std::vector<int64_t> too_long{5};
  EXPECT_NE(error_of([&] {
              attend_paged_blocks(q.view4(), cache, table, 2, too_long, {}, {}, out.view4());
            }).find("lengths[0] = 5 is outside [0, 4]"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              attend_paged_blocks(q.view4(), cache, {}, -1, len, {}, {}, out.view4());
            }).find("table_width must be ≥ 0, got -1"),
            std::string::npos);
  // B × table_width past int64 wrapped to 16 and matched the table's 16 entries, then read far
  // outside it; it is formed checked now.
  {
    const Tensor q16 = random_tensor({16, 2, 1, 4}, 3);
    Tensor out16({16, 2, 1, 4});
    const std::vector<int32_t> table16(16, 0);
    const std::vector<int64_t> len16(16, 1);
    const std::string err = error_of([&] {
      attend_paged_blocks(q16.view4(), cache, table16, (int64_t{1} << 60) + 1, len16, {}, {}, out16.view4());
    });
    EXPECT_NE(err.find("table_width"), std::string::npos) << err;
  }
  // Entries past a sequence's length are not read, so they may hold anything.
  const std::vector<int32_t> tail_garbage{0, 99};
  const std::vector<int64_t> short_len{2};
  EXPECT_NO_THROW(attend_paged_blocks(q.view4(), cache, tail_garbage, 2, short_len, {}, {}, out.view4()));
}

// attend_paged_cache named PagedKvCache::block_table for a dead id; it checks its ids first now.
// The same id twice is fine there (it only reads), and a first position beyond 2⁴⁰ fails as in
// attend_cache.
TEST(PagedKvCache, AttendNamesItsBadSequenceIds) {
  const PagedKvCacheConfig pc = tiny_pool(4);
  PagedKvCache cache(pc);
  const int64_t s = cache.add_sequence();
  const Tensor kv = random_tensor({1, 1, 3, 4}, 2);
  cache.append(s, kv.view4(), kv.view4());
  const Tensor q = random_tensor({1, 2, 1, 4}, 1);
  Tensor out({1, 2, 1, 4});
  for (const int64_t id : {int64_t{5}, int64_t{-1}}) {
    const std::vector<int64_t> seqs{id};
    const std::string err = error_of([&] { attend_paged_cache(q.view4(), cache, seqs, {}, {}, out.view4()); });
    EXPECT_NE(err.find("attend_paged_cache: seqs[0] = " + std::to_string(id) + " is not a live sequence"),
              std::string::npos)
        << err;
  }
  const Tensor q2 = random_tensor({2, 2, 1, 4}, 1);
  Tensor out2({2, 2, 1, 4});
  const std::vector<int64_t> twice{s, s};
  EXPECT_NO_THROW(attend_paged_cache(q2.view4(), cache, twice, {}, {}, out2.view4()));
  const std::vector<int64_t> one{s}, far{Causal::kMaxPosition};
  EXPECT_NE(error_of([&] {
              attend_paged_cache(q.view4(), cache, one, far, {}, out.view4());
            }).find("q_start[0] = 1099511627776 is outside"),
            std::string::npos);
}

// ---- StreamingLLM: a sliding-window cache that keeps the first n_sink positions --------------

/// The full forward under the sink rule, as an explicit mask (T, T): true = may attend.
Tensor sink_reference(const MultiheadAttention& m, const Tensor& x, int64_t sinks, int64_t window) {
  const int64_t T = x.size(1);
  BoolTensor allowed({T, T}, 0);
  for (int64_t q = 0; q < T; ++q)
    for (int64_t p = 0; p <= q; ++p) allowed.at({q, p}) = p < sinks || p > q - window;
  MhaForwardOptions o;
  o.attn_mask = AttnMask::allow(allowed);
  return m.forward(x, x, x, o).output;
}

TEST(SinkCache, IncrementalEqualsFullForwardUnderTheSinkMask) {
  MhaConfig c;
  c.embed_dim = 32, c.num_heads = 4, c.num_kv_heads = 2, c.layout = Layout::BatchFirst;
  c.rope = Rope::half_split();
  const MultiheadAttention m(c, 3);
  const int64_t T = 40;
  const Tensor x = random_tensor({1, T, 32}, 9);
  for (int64_t sinks : {1, 4}) {
    for (int64_t prefill : {1, 3, 12}) {  // 12: a prefill longer than the window, sinks inside it
      SCOPED_TRACE("sinks " + std::to_string(sinks) + ", prefill " + std::to_string(prefill));
      const int64_t window = 6;
      KvCacheConfig cc;
      cc.batch = 1, cc.kv_heads = 2, cc.head_dim = 8, cc.capacity = sinks + window, cc.ring = true, cc.sinks = sinks;
      KvCache cache(cc);
      IncrementalOptions o;
      o.window = window;
      Tensor got({1, T, 32});
      for (int64_t t = 0; t < T;) {
        const int64_t n = t == 0 ? prefill : 1;
        Tensor in({1, n, 32});
        for (int64_t i = 0; i < n * 32; ++i) in.data()[i] = x.data()[t * 32 + i];
        const Tensor y = m.forward_incremental(in, in, in, cache, o).output;
        for (int64_t i = 0; i < n * 32; ++i) got.data()[t * 32 + i] = y.data()[i];
        t += n;
      }
      EXPECT_EQ(cache.stored(0), sinks + window);
      EXPECT_TRUE(cache.holds(0, 0) && cache.holds(0, sinks - 1) && !cache.holds(0, sinks) && cache.holds(0, T - 1));
      EXPECT_TRUE(all_close(got, sink_reference(m, x, sinks, window), 256 * kEps, 256 * kEps));
    }
  }
}

// Chunks whose new tokens include sink positions, in a batch of two sequences of different lengths
// (new_lengths), with ALiBi, a softcap and learned sink logits: the new tokens' sinks part and
// window part (merged by log-sum-exp, where a (B, 1, T, T) mask once held the rule) give each
// sequence what the full forward gives under the explicit sink mask.
TEST(SinkCache, ChunksHoldingSinksInARaggedBatchEqualTheFullForward) {
  MhaConfig c;
  c.embed_dim = 32, c.num_heads = 4, c.num_kv_heads = 2, c.layout = Layout::BatchFirst;
  c.alibi_slopes = alibi_slopes(4);
  c.softcap = 3.0f;
  c.attention_sinks = true;
  MultiheadAttention m(c, 4);
  for (int64_t h = 0; h < 4; ++h) m.params().sinks.data()[h] = 0.3f * static_cast<float>(h) - 0.5f;
  const int64_t sinks = 3, window = 5;
  const int64_t len[2] = {12, 11}, first[2] = {2, 1};  // chunk 1 holds 2 and 1 tokens, chunk 2 the rest
  const Tensor x0 = random_tensor({1, len[0], 32}, 21), x1 = random_tensor({1, len[1], 32}, 22);
  const Tensor* xs[2] = {&x0, &x1};
  KvCacheConfig cc;
  cc.batch = 2, cc.kv_heads = 2, cc.head_dim = 8, cc.capacity = sinks + window, cc.ring = true, cc.sinks = sinks;
  KvCache cache(cc);
  IncrementalOptions o;
  o.window = window;
  Tensor got[2] = {Tensor({1, len[0], 32}), Tensor({1, len[1], 32})};
  for (int chunk = 0; chunk < 2; ++chunk) {
    const int64_t n[2] = {chunk == 0 ? first[0] : len[0] - first[0], chunk == 0 ? first[1] : len[1] - first[1]};
    const int64_t T = std::max(n[0], n[1]);
    Tensor in({2, T, 32}, 7.0f);  // rows past a sequence's new tokens: never read
    for (int b = 0; b < 2; ++b)
      for (int64_t t = 0; t < n[b]; ++t)
        for (int64_t x = 0; x < 32; ++x) in.at({b, t, x}) = xs[b]->at({0, (chunk ? first[b] : 0) + t, x});
    o.new_lengths = {n[0], n[1]};
    const Tensor y = m.forward_incremental(in, in, in, cache, o).output;
    for (int b = 0; b < 2; ++b)
      for (int64_t t = 0; t < n[b]; ++t)
        for (int64_t x = 0; x < 32; ++x) got[b].at({0, (chunk ? first[b] : 0) + t, x}) = y.at({b, t, x});
  }
  for (int b = 0; b < 2; ++b)
    EXPECT_TRUE(all_close(got[b], sink_reference(m, *xs[b], sinks, window), 256 * kEps, 256 * kEps)) << b;
}

// The decode kernel on a sink ring, every target, against the explicit rule in double.
TEST(SinkCache, DecodeKernelMatchesExplicitMaskOnEveryTarget) {
  const int64_t kv = 2, h = 4, d = 8, sinks = 3, window = 5, T = 300;
  KvCacheConfig cc;
  cc.batch = 1, cc.kv_heads = kv, cc.head_dim = d, cc.capacity = sinks + window, cc.ring = true, cc.sinks = sinks;
  KvCache cache(cc);
  const Tensor k = random_tensor({1, kv, T, d}, 1), v = random_tensor({1, kv, T, d}, 2);
  cache.append(k.view4(), v.view4());  // a chunk longer than the ring: the sinks and the last 5 stay
  const Tensor q = random_tensor({1, h, 2, d}, 3);
  const std::vector<int64_t> at{T - 1};  // rows at positions T − 1 and T (T sees keys ≤ T − 1 here)
  Tensor want({1, h, 2, d});
  for (int64_t head = 0; head < h; ++head)
    for (int64_t t = 0; t < 2; ++t) {
      const int64_t pos = T - 1 + t, g = head / (h / kv);
      std::vector<double> w;
      std::vector<int64_t> keys;
      for (int64_t p = 0; p < T; ++p)
        if (p <= pos && (p < sinks || p > pos - window)) {
          double dot = 0;
          for (int64_t x = 0; x < d; ++x) dot += double(q.at({0, head, t, x})) * k.at({0, g, p, x});
          w.push_back(dot / std::sqrt(double(d)));
          keys.push_back(p);
        }
      double mx = -1e300, sum = 0;
      for (double s : w) mx = std::max(mx, s);
      for (double& s : w) sum += (s = std::exp(s - mx));
      for (int64_t x = 0; x < d; ++x) {
        double acc = 0;
        for (size_t j = 0; j < keys.size(); ++j) acc += w[j] / sum * v.at({0, g, keys[j], x});
        want.at({0, head, t, x}) = static_cast<float>(acc);
      }
    }
  testing::for_each_decode_target([&] {
    CacheAttentionOptions o;
    o.window = window;
    o.splits = 2;
    Tensor one({1, h, 2, d});
    for (int threads : {1, 2, 3}) {
      o.threads = threads;
      Tensor got({1, h, 2, d});
      attend_cache(q.view4(), cache, at, o, got.view4());
      EXPECT_TRUE(all_close(got, want, 64 * kEps, 64 * kEps));
      if (threads == 1) one = got;
      EXPECT_TRUE(bitwise_equal(got, one));
    }
  });
}

TEST(SinkCache, BadConfigurations) {
  KvCacheConfig cc;
  cc.batch = 1, cc.kv_heads = 1, cc.head_dim = 4, cc.capacity = 4, cc.sinks = 1;
  EXPECT_NE(error_of([&] { KvCache c(cc); }).find("must be a ring"), std::string::npos);
  cc.ring = true, cc.sinks = 4;
  EXPECT_NE(error_of([&] { KvCache c(cc); }).find("capacity > sinks"), std::string::npos);
  cc.sinks = 1;
  KvCache cache(cc);
  MhaConfig c;
  c.embed_dim = 8, c.num_heads = 2, c.num_kv_heads = 1, c.layout = Layout::BatchFirst;
  const MultiheadAttention m(c, 1);
  IncrementalOptions o;
  o.window = 4;  // the ring holds 3 recent positions besides the sink
  const Tensor x = random_tensor({1, 1, 8}, 1);
  EXPECT_NE(error_of([&] { m.forward_incremental(x, x, x, cache, o); }).find("at most 3"), std::string::npos);
}

// ---- the module over a paged cache: MultiheadAttention::forward_incremental(…, PagedKvCache&, seqs) ----

struct ModuleCase {
  const char* name;
  MhaConfig config;
  CacheDtype dtype = CacheDtype::F32;
  int64_t window = 0;
};

std::vector<ModuleCase> module_cases() {
  MhaConfig base;
  base.embed_dim = 32, base.num_heads = 4, base.num_kv_heads = 2, base.layout = Layout::BatchFirst;
  base.rope = Rope::half_split();
  std::vector<ModuleCase> cases{{"gqa+rope", base}, {"bf16 cache", base, CacheDtype::BF16}, {"window 4", base}};
  cases.push_back({"int8 cache", base, CacheDtype::I8});
  cases[2].window = 4;
  MhaConfig edits = base;
  edits.alibi_slopes = alibi_slopes(4);
  edits.softcap = 5.0f;
  edits.attention_sinks = true;
  cases.push_back({"alibi+softcap+sinks", edits, CacheDtype::F32, 5});
  MhaConfig mha = base;  // plain multi-head, seq-first layout
  mha.num_kv_heads = 0, mha.layout = Layout::SeqFirst, mha.rope = Rope{};
  cases.push_back({"mha seq-first", mha});
  return cases;
}

/// rows [t0, t1) of every sequence of a batch-first (B, T, E) or seq-first (T, B, E) input.
Tensor token_rows(const Tensor& x, Layout layout, int64_t t0, int64_t t1) {
  const bool bf = layout == Layout::BatchFirst;
  const int64_t B = bf ? x.size(0) : x.size(1), E = x.size(2), n = t1 - t0;
  Tensor out(bf ? Shape{B, n, E} : Shape{n, B, E});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t e = 0; e < E; ++e)
        (bf ? out.at({b, t, e}) : out.at({t, b, e})) = bf ? x.at({b, t0 + t, e}) : x.at({t0 + t, b, e});
  return out;
}

// A prefill of 3 (sequence 1 padded to 2) then token by token: the paged overload equals the
// contiguous one bitwise after every step, on every target, for threads 1/2/3; block size 3 so
// sequences cross block edges, interleaved in the pool.
TEST(PagedKvCacheModule, EqualsContiguousCacheTokenByToken) {
  testing::for_each_decode_target([&] {
    for (const ModuleCase& mc : module_cases()) {
      SCOPED_TRACE(mc.name);
      MultiheadAttention m(mc.config, 5);
      if (mc.config.attention_sinks) m.params().sinks = random_tensor({4}, 6);
      const bool bf = mc.config.layout == Layout::BatchFirst;
      const int64_t B = 2, T = 12, E = 32;
      const Tensor x = random_tensor(bf ? Shape{B, T, E} : Shape{T, B, E}, 7);
      KvCacheConfig cc;
      cc.batch = B, cc.kv_heads = m.config().kv_heads(), cc.head_dim = 8, cc.capacity = T, cc.dtype = mc.dtype;
      KvCache flat(cc);
      PagedKvCacheConfig pc;
      pc.kv_heads = cc.kv_heads, pc.head_dim = 8, pc.block_size = 3, pc.num_blocks = 8, pc.dtype = mc.dtype;
      PagedKvCache paged(pc);
      const int64_t decoy = paged.add_sequence();  // ids need not be 0…B−1
      const std::vector<int64_t> ids{paged.add_sequence(), paged.add_sequence()};
      paged.free(decoy);
      IncrementalOptions o;
      o.window = mc.window;
      o.splits = 2;
      o.new_lengths = {3, 2};
      const Tensor pre = token_rows(x, mc.config.layout, 0, 3);
      ASSERT_TRUE(bitwise_equal(m.forward_incremental(pre, pre, pre, paged, ids, o).output,
                                m.forward_incremental(pre, pre, pre, flat, o).output));
      o.new_lengths.clear();
      for (int64_t t = 3; t < T - 1; ++t) {
        const Tensor in = token_rows(x, mc.config.layout, t, t + 1);
        o.threads = 1;
        const Tensor want = m.forward_incremental(in, in, in, flat, o).output;
        o.threads = 1 + static_cast<int>(t % 3);
        const Tensor got = m.forward_incremental(in, in, in, paged, ids, o).output;
        ASSERT_TRUE(bitwise_equal(got, want)) << "token " << t;
      }
      EXPECT_EQ(paged.length(ids[0]), T - 1);
      EXPECT_EQ(paged.length(ids[1]), T - 2);
      EXPECT_EQ(paged.k_at(ids[1], 1, 5, 2), flat.k_at(1, 1, 5, 2));
    }
  });
}

// A forked sequence decodes like a copy of its parent's contiguous cache, sharing the full blocks.
TEST(PagedKvCacheModule, ForkedSequenceDecodesLikeACopy) {
  MhaConfig c = module_cases()[0].config;
  const MultiheadAttention m(c, 5);
  KvCacheConfig cc;
  cc.batch = 1, cc.kv_heads = 2, cc.head_dim = 8, cc.capacity = 16;
  KvCache flat(cc);
  PagedKvCacheConfig pc;
  pc.kv_heads = 2, pc.head_dim = 8, pc.block_size = 4, pc.num_blocks = 8;
  PagedKvCache paged(pc);
  const int64_t parent = paged.add_sequence();
  const Tensor prompt = random_tensor({1, 6, 32}, 1);
  const std::vector<int64_t> p_ids{parent};
  m.forward_incremental(prompt, prompt, prompt, paged, p_ids);
  m.forward_incremental(prompt, prompt, prompt, flat);
  const int64_t free_before = paged.free_blocks();
  const int64_t child = paged.fork(parent);
  EXPECT_EQ(paged.free_blocks(), free_before);
  KvCache copy = flat.clone();
  const std::vector<int64_t> both{parent, child};
  for (int64_t t = 0; t < 4; ++t) {
    const Tensor a = random_tensor({1, 1, 32}, 10 + t), b = random_tensor({1, 1, 32}, 20 + t);
    Tensor ab({2, 1, 32});
    std::copy_n(a.data(), 32, ab.data());
    std::copy_n(b.data(), 32, ab.data() + 32);
    const Tensor got = m.forward_incremental(ab, ab, ab, paged, both).output;
    Tensor want({2, 1, 32});
    std::copy_n(m.forward_incremental(a, a, a, flat).output.data(), 32, want.data());
    std::copy_n(m.forward_incremental(b, b, b, copy).output.data(), 32, want.data() + 32);
    // Batch of 2 vs two batches of 1 may pick different split counts: equal within rounding.
    EXPECT_TRUE(all_close(got, want, 16 * kEps, 16 * kEps)) << "token " << t;
  }
  EXPECT_EQ(paged.block_table(parent)[0], paged.block_table(child)[0]);  // the full first block stays shared
  EXPECT_NE(paged.block_table(parent)[1], paged.block_table(child)[1]);  // the partial one was copied
}

TEST(PagedKvCacheModule, BadSequencesAndAFullPoolAreErrorsThatChangeNothing) {
  const MultiheadAttention m(module_cases()[0].config, 5);
  PagedKvCacheConfig pc;
  pc.kv_heads = 2, pc.head_dim = 8, pc.block_size = 4, pc.num_blocks = 3;
  PagedKvCache paged(pc);
  const int64_t a = paged.add_sequence(), b = paged.add_sequence();
  const Tensor x = random_tensor({2, 5, 32}, 1);
  const std::vector<int64_t> dup{a, a}, dead{a, 7}, one{a}, ok{a, b};
  EXPECT_NE(error_of([&] { m.forward_incremental(x, x, x, paged, dup); }).find("appears twice"), std::string::npos);
  EXPECT_NE(error_of([&] { m.forward_incremental(x, x, x, paged, dead); }).find("seqs[1] = 7"), std::string::npos);
  EXPECT_NE(error_of([&] { m.forward_incremental(x, x, x, paged, one); }).find("1 sequence ids for a batch of 2"),
            std::string::npos);
  // 2 × 5 tokens need 4 blocks of 4; the pool has 3.
  EXPECT_NE(error_of([&] { m.forward_incremental(x, x, x, paged, ok); }).find("need 4 more blocks"), std::string::npos);
  EXPECT_EQ(paged.length(a), 0);
  EXPECT_EQ(paged.length(b), 0);
  EXPECT_EQ(paged.free_blocks(), 3);
  // A parent and its fork both writing into their shared last block need one copy, not two.
  const Tensor six = random_tensor({1, 6, 32}, 2), two = random_tensor({2, 1, 32}, 3);
  const std::vector<int64_t> only_a{a};
  m.forward_incremental(six, six, six, paged, only_a);
  const std::vector<int64_t> family{a, paged.fork(a)};
  paged.free(b);
  EXPECT_EQ(paged.free_blocks(), 1);
  m.forward_incremental(two, two, two, paged, family);
  EXPECT_EQ(paged.free_blocks(), 0);
  EXPECT_EQ(paged.length(family[1]), 7);
  PagedKvCacheConfig wrong = pc;
  wrong.head_dim = 4;
  PagedKvCache small(wrong);
  const std::vector<int64_t> s0{small.add_sequence(), small.add_sequence()};
  EXPECT_NE(error_of([&] { m.forward_incremental(x, x, x, small, s0); }).find("paged cache is (kv_heads 2, d 4"),
            std::string::npos);
}

}  // namespace
}  // namespace mha
