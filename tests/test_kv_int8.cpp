// The int8 KV cache (CacheDtype::I8): per-row symmetric quantisation (scale = max|x| / 127, round
// to nearest), what it stores and reads back, its bytes, clones, and the non-finite values it
// refuses. Attention over it is tested with the other caches (test_decode.cpp, test_paged_cache.cpp)
// and against PyTorch (Int8CacheGolden below).
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "mha/kv_cache.h"
#include "mha/paged_kv_cache.h"
#include "mha/safetensors.h"
#include "support/test_support.h"

namespace mha {
namespace {

using testing::bitwise_equal;
using testing::error_of;
using testing::random_tensor;

KvCacheConfig int8_config(int64_t batch, int64_t kv, int64_t d, int64_t capacity) {
  KvCacheConfig c;
  c.batch = batch, c.kv_heads = kv, c.head_dim = d, c.capacity = capacity, c.dtype = CacheDtype::I8;
  return c;
}

TEST(Int8Cache, RowsReadBackWithinHalfAStep) {
  const int64_t kv = 2, T = 5, d = 19;
  KvCache cache(int8_config(1, kv, d, 8));
  Tensor k = random_tensor({1, kv, T, d}, 1, -3.0f, 3.0f), v = random_tensor({1, kv, T, d}, 2);
  for (int64_t x = 0; x < d; ++x) k.at({0, 1, 2, x}) = 0.0f;  // a row of zeros: scale 0
  k.at({0, 0, 3, 4}) = 5.0f;                                  // a row whose max is exact: 127
  cache.append(k.view4(), v.view4());
  for (int64_t g = 0; g < kv; ++g)
    for (int64_t t = 0; t < T; ++t) {
      float absmax = 0;
      for (int64_t x = 0; x < d; ++x) absmax = std::max(absmax, std::fabs(k.at({0, g, t, x})));
      const float scale = cache.k_scales()[g * 8 + t];
      EXPECT_EQ(scale, absmax / 127.0f);
      for (int64_t x = 0; x < d; ++x) {
        const float want = k.at({0, g, t, x});
        const float stored = scale > 0 ? std::nearbyint(want / scale) * scale : 0.0f;
        EXPECT_EQ(cache.k_at(0, g, t, x), stored) << g << " " << t << " " << x;
        EXPECT_LE(std::fabs(cache.k_at(0, g, t, x) - want), scale / 2 * (1 + 1e-6));
        EXPECT_LE(std::fabs(cache.v_at(0, g, t, x) - v.at({0, g, t, x})), cache.v_scales()[g * 8 + t] / 2 * (1 + 1e-6));
      }
    }
  for (int64_t x = 0; x < d; ++x) EXPECT_EQ(cache.k_at(0, 1, 2, x), 0.0f);
  EXPECT_EQ(cache.k_at(0, 0, 3, 4), 5.0f);
  // One byte per element plus a float scale per row, for K and for V.
  EXPECT_EQ(cache.bytes(), static_cast<size_t>(2 * kv * 8 * (d + 4)));
}

TEST(Int8Cache, ScalesUnderflowToZerosNotToInfinity) {
  KvCache cache(int8_config(1, 1, 3, 2));
  const float tiny = std::numeric_limits<float>::denorm_min();
  Tensor k({1, 1, 1, 3}, tiny), v({1, 1, 1, 3}, -tiny);
  cache.append(k.view4(), v.view4());
  EXPECT_EQ(cache.k_scales()[0], 0.0f);
  for (int64_t x = 0; x < 3; ++x) EXPECT_EQ(cache.k_at(0, 0, 0, x), 0.0f);
  Tensor q({1, 1, 1, 3}, 1.0f), out({1, 1, 1, 3});
  attend_cache(q.view4(), cache, {}, {}, out.view4());
  for (float x : out.values()) EXPECT_EQ(x, 0.0f);
}

TEST(Int8Cache, CloneIsADeepCopy) {
  KvCache cache(int8_config(2, 2, 8, 6));
  const Tensor k = random_tensor({2, 2, 4, 8}, 3), v = random_tensor({2, 2, 4, 8}, 4);
  cache.append(k.view4(), v.view4());
  KvCache copy = cache.clone();
  const Tensor q = random_tensor({2, 4, 1, 8}, 5);
  Tensor a({2, 4, 1, 8}), b({2, 4, 1, 8});
  attend_cache(q.view4(), cache, {}, {}, a.view4());
  attend_cache(q.view4(), copy, {}, {}, b.view4());
  EXPECT_TRUE(bitwise_equal(b, a));
  const Tensor k2 = random_tensor({2, 2, 1, 8}, 6);
  copy.append(k2.view4(), k2.view4());  // the original keeps its rows
  EXPECT_EQ(cache.length(0), 4);
  EXPECT_EQ(copy.length(0), 5);
  EXPECT_EQ(cache.k_at(1, 1, 3, 7), copy.k_at(1, 1, 3, 7));
}

// No scale represents NaN or ±inf: appending one fails, names the tensor, shape and place, and
// changes nothing. Padding rows past counts[b] are not stored, so they may hold anything.
TEST(Int8Cache, NonFiniteValuesAreErrorsThatChangeNothing) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  KvCache cache(int8_config(2, 2, 4, 8));
  Tensor k = random_tensor({2, 2, 3, 4}, 1), v = random_tensor({2, 2, 3, 4}, 2);
  k.at({1, 1, 2, 3}) = nan;
  const std::string msg = error_of([&] { cache.append(k.view4(), v.view4()); });
  EXPECT_NE(msg.find("KvCache::append: an int8 cache takes finite values only, but key (2, 2, 3, 4) holds nan at "
                     "(1, 1, 2, 3)"),
            std::string::npos)
      << msg;
  EXPECT_EQ(cache.length(0), 0);
  EXPECT_EQ(cache.length(1), 0);
  const std::vector<int64_t> counts{3, 2};  // sequence 1's row 2 is padding
  cache.append(k.view4(), v.view4(), counts);
  EXPECT_EQ(cache.length(1), 2);
  v.at({0, 0, 0, 0}) = -inf;
  EXPECT_NE(error_of([&] { cache.append(k.view4(), v.view4(), counts); }).find("value"), std::string::npos);
  EXPECT_EQ(cache.length(0), 3);

  Tensor one = random_tensor({1, 2, 1, 4}, 3);
  one.at({0, 0, 0, 1}) = inf;
  EXPECT_NE(error_of([&] { cache.append_sequence(0, one.view4(), one.view4()); }).find("append_sequence"),
            std::string::npos);
  EXPECT_EQ(cache.length(0), 3);

  PagedKvCacheConfig pc;
  pc.kv_heads = 2, pc.head_dim = 4, pc.block_size = 2, pc.num_blocks = 4, pc.dtype = CacheDtype::I8;
  PagedKvCache paged(pc);
  const int64_t s = paged.add_sequence();
  EXPECT_NE(error_of([&] { paged.append(s, one.view4(), one.view4()); }).find("PagedKvCache::append"),
            std::string::npos);
  EXPECT_EQ(paged.length(s), 0);
  EXPECT_EQ(paged.free_blocks(), 4);

  // A float32 cache keeps a NaN (it shows in the output: docs/semantics.md).
  KvCacheConfig f32 = int8_config(2, 2, 4, 8);
  f32.dtype = CacheDtype::F32;
  KvCache plain(f32);
  EXPECT_NO_THROW(plain.append(k.view4(), v.view4()));
}

// ---- PyTorch golden (tests/golden/generate_int8_cache.py) ------------------------------------

TEST(Int8CacheGolden, QuantisationAndDecodeMatchPyTorch) {
  const io::SafetensorsFile f =
      io::SafetensorsFile::open(std::string(MHA_GOLDEN_DIR) + "/int8_cache/decode_gqa.safetensors");
  const Tensor q = f.read_f32("q"), k = f.read_f32("k"), v = f.read_f32("v");
  const Tensor k_deq = f.read_f32("k_dequant"), v_deq = f.read_f32("v_dequant"), want = f.read_f32("out");
  const int64_t B = k.size(0), kv = k.size(1), T = k.size(2), d = k.size(3);
  KvCache cache(int8_config(B, kv, d, T));
  cache.append(k.view4(), v.view4());
  // The same float32 division and round-half-to-even as torch: the same bits.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < kv; ++g)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t x = 0; x < d; ++x) {
          ASSERT_EQ(cache.k_at(b, g, t, x), k_deq.at({b, g, t, x})) << b << " " << g << " " << t << " " << x;
          ASSERT_EQ(cache.v_at(b, g, t, x), v_deq.at({b, g, t, x}));
        }
  Tensor out(want.shape());
  const std::vector<int64_t> at(static_cast<size_t>(B), T);  // queries after the whole cache
  for (int threads : {1, 2, 3}) {
    CacheAttentionOptions o;
    o.threads = threads;
    attend_cache(q.view4(), cache, at, o, out.view4());
    // float32 attention over |v| ≤ 1 and a few hundred keys against PyTorch's float64.
    EXPECT_TRUE(testing::all_close(out, want, 1e-5, 1e-5));
  }
}

}  // namespace
}  // namespace mha
