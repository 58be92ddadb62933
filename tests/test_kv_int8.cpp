// The int8 KV cache (CacheDtype::I8): per-row symmetric quantisation (scale = max|x| / 127, round
// to nearest), what it stores and reads back, its bytes, clones, and the non-finite values it
// refuses. Attention over it is tested with the other caches (test_decode.cpp, test_paged_cache.cpp)
// and against PyTorch (Int8CacheGolden below).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <hwy/targets.h>

#include "kernels/decode.h"
#include "kernels/fused_forward.h"
#include "kernels/quantize.h"
#include "mha/kv_cache.h"
#include "mha/module.h"
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

/// The SIMD quantiser (kernels/quantize.h) against its scalar definition, bitwise: the scale and
/// every byte, for rows of every length around the vector widths, written contiguously and 16
/// apart (keys across lanes), on every SIMD target.
TEST(Int8Quantize, RowsMatchTheScalarDefinitionOnEveryTarget) {
  std::mt19937 gen(11);
  std::normal_distribution<float> normal;
  testing::for_each_fused_target([&] {
    ASSERT_EQ(kernels::quantize_dispatch_target(), kernels::fused_dispatch_target());
    for (const int64_t n : {0, 1, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 127, 128, 129, 256}) {
      for (int pattern = 0; pattern < 9; ++pattern) {
        std::vector<float> row(static_cast<size_t>(n));
        // 1e-40: a denormal scale; 1e-44 (pattern 7): nonzero values whose scale underflows to 0.
        const float magnitude = pattern == 1   ? 1e-3f
                                : pattern == 2 ? 1e4f
                                : pattern == 3 ? 1e-40f
                                : pattern == 7 ? 1e-44f
                                               : 1.0f;
        for (auto& x : row) x = normal(gen) * magnitude;
        if (pattern == 4 && n > 0) {  // a max of 127, so scale 1: halves are ties
          for (int64_t x = 0; x < n; ++x) row[static_cast<size_t>(x)] = static_cast<float>(x % 254 - 127) + 0.5f;
          row[0] = 127.0f;
        }
        if (pattern == 5) std::fill(row.begin(), row.end(), 0.0f);
        if (pattern == 6) std::fill(row.begin(), row.end(), -0.0f);
        if (pattern == 8 && n > 0) row[static_cast<size_t>(n / 2)] = -std::numeric_limits<float>::max();
        float absmax = 0.0f;
        for (const float x : row) absmax = std::max(absmax, std::fabs(x));
        const float want_scale = kernels::int8_scale(absmax);
        for (const int64_t step : {1, 16}) {
          SCOPED_TRACE("n " + std::to_string(n) + ", pattern " + std::to_string(pattern) + ", step " +
                       std::to_string(step));
          std::vector<int8_t> got(static_cast<size_t>(std::max<int64_t>(1, n * step)), int8_t{99});
          const float scale = kernels::quantize_int8_row(row.data(), n, got.data(), step);
          EXPECT_EQ(std::memcmp(&scale, &want_scale, sizeof(float)), 0) << scale << " vs " << want_scale;
          for (int64_t x = 0; x < n * step; ++x) {
            const int8_t want = x % step == 0 ? kernels::int8_value(row[static_cast<size_t>(x / step)], want_scale)
                                              : int8_t{99};  // untouched between a row's elements
            ASSERT_EQ(got[static_cast<size_t>(x)], want) << "byte " << x;
          }
        }
      }
    }
  });
}

/// The per-channel quantiser (kernels::quantize_int8_columns) against the scalar definition,
/// bitwise: each column's scale and every byte, with columns of zeros (scale 0), ties (a column
/// whose max is 127) and row and column counts around the vector widths, on every SIMD target.
TEST(Int8Quantize, ColumnsMatchTheScalarDefinitionOnEveryTarget) {
  std::mt19937 gen(12);
  std::normal_distribution<float> normal;
  testing::for_each_fused_target([&] {
    ASSERT_EQ(kernels::quantize_dispatch_target(), kernels::fused_dispatch_target());
    for (const int64_t rows : {1, 2, 5, 32, 33})
      for (const int64_t d : {1, 7, 16, 17, 40, 128, 131}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + ", d " + std::to_string(d));
        std::vector<float> in(static_cast<size_t>(rows * d));
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t x = 0; x < d; ++x) {
            float& v = in[static_cast<size_t>(i * d + x)];
            // Columns of small, huge, denormal-scale (1e-40) and underflowing-scale (1e-44) values.
            const float magnitudes[] = {1.0f, 1e-3f, 1e4f, 1e-40f, 1e-44f};
            v = normal(gen) * magnitudes[x % 5];
            if (x % 7 == 3) v = i % 2 ? 0.0f : -0.0f;                                   // a column of zeros
            if (x % 7 == 4) v = i == 0 ? 127.0f : static_cast<float>(i % 200) - 99.5f;  // ties at scale 1
            if (x % 7 == 5 && i == rows / 2) v = std::numeric_limits<float>::max();     // a scale one ulp down
          }
        std::vector<float> scale(static_cast<size_t>(d), -1.0f);
        std::vector<int8_t> got(static_cast<size_t>(rows * d), int8_t{99});
        kernels::quantize_int8_columns(in.data(), rows, d, scale.data(), got.data());
        for (int64_t x = 0; x < d; ++x) {
          float absmax = 0.0f;
          for (int64_t i = 0; i < rows; ++i) absmax = std::max(absmax, std::fabs(in[static_cast<size_t>(i * d + x)]));
          const float want_scale = kernels::int8_scale(absmax);
          ASSERT_EQ(std::memcmp(&scale[static_cast<size_t>(x)], &want_scale, sizeof(float)), 0) << "column " << x;
          for (int64_t i = 0; i < rows; ++i)
            ASSERT_EQ(got[static_cast<size_t>(i * d + x)],
                      kernels::int8_value(in[static_cast<size_t>(i * d + x)], want_scale))
                << "row " << i << ", column " << x;
        }
      }
  });
}

/// The SIMD finiteness check (kernels::first_non_finite) names the first ±inf or NaN, wherever it
/// lies (a full vector or the tail), on every SIMD target.
TEST(Int8Quantize, FirstNonFiniteOnEveryTarget) {
  const float kInf = std::numeric_limits<float>::infinity(), kNaN = std::numeric_limits<float>::quiet_NaN();
  testing::for_each_fused_target([&] {
    ASSERT_EQ(kernels::quantize_dispatch_target(), kernels::fused_dispatch_target());
    for (const int64_t n : {0, 1, 5, 16, 17, 40, 128, 131}) {
      std::vector<float> row(static_cast<size_t>(n), 1.0f);
      EXPECT_EQ(kernels::first_non_finite(row.data(), n), -1) << n;
      for (const float bad : {kInf, -kInf, kNaN, std::numeric_limits<float>::max() * 2.0f})
        for (int64_t at = 0; at < n; at += std::max<int64_t>(1, n / 5)) {
          std::vector<float> r = row;
          r[static_cast<size_t>(at)] = bad;
          if (at + 3 < n) r[static_cast<size_t>(at + 3)] = kNaN;  // a later one is not the first
          EXPECT_EQ(kernels::first_non_finite(r.data(), n), at) << "n " << n << ", at " << at << ", " << bad;
        }
    }
  });
}

/// An append from a view whose elements are not contiguous (the scalar path) stores the same
/// bytes and scales as from a contiguous copy (the SIMD path).
TEST(Int8Cache, StridedAndContiguousAppendsStoreTheSame) {
  const int64_t kv = 2, T = 3, d = 37;
  const Tensor k = random_tensor({1, kv, T, d}, 5, -2.0f, 2.0f);
  std::vector<float> spread(static_cast<size_t>(2 * k.numel()), std::numeric_limits<float>::quiet_NaN());
  for (int64_t i = 0; i < k.numel(); ++i) spread[static_cast<size_t>(2 * i)] = k.data()[i];
  const View4<const float> strided{spread.data(), {1, kv, T, d}, {2 * kv * T * d, 2 * T * d, 2 * d, 2}};
  for (const KeyLayout layout : {KeyLayout::Rows, KeyLayout::Transposed}) {
    KvCacheConfig c = int8_config(1, kv, d, 4);
    c.key_layout = layout;
    KvCache a(c), b(c);
    a.append(k.view4(), k.view4());
    b.append(strided, strided);
    for (int64_t g = 0; g < kv; ++g)
      for (int64_t t = 0; t < T; ++t) {
        EXPECT_EQ(a.k_scales()[g * 4 + t], b.k_scales()[g * 4 + t]);
        for (int64_t x = 0; x < d; ++x) {
          EXPECT_EQ(a.k_at(0, g, t, x), b.k_at(0, g, t, x));
          EXPECT_EQ(a.v_at(0, g, t, x), b.v_at(0, g, t, x));
        }
      }
  }
}

TEST(Int8Cache, HalfStepsRoundToEven) {
  // A row whose max is 127 has scale 1: its halves are ties, rounded to the even step (as
  // std::nearbyint and torch.round do), both signs, at the ends of the range too.
  const std::vector<float> row = {127.0f, 2.5f, -2.5f, 3.5f, -3.5f, 0.5f, -0.5f, 1.5f, 126.5f, -126.5f, 0.25f, -0.75f};
  const std::vector<float> want = {127.0f, 2.0f, -2.0f, 4.0f, -4.0f, 0.0f, 0.0f, 2.0f, 126.0f, -126.0f, 0.0f, -1.0f};
  const int64_t d = static_cast<int64_t>(row.size());
  KvCache cache(int8_config(1, 1, d, 2));
  Tensor k({1, 1, 1, d});
  for (int64_t x = 0; x < d; ++x) k.at({0, 0, 0, x}) = row[static_cast<size_t>(x)];
  cache.append(k.view4(), k.view4());
  EXPECT_EQ(cache.k_scales()[0], 1.0f);
  for (int64_t x = 0; x < d; ++x) {
    EXPECT_EQ(cache.k_at(0, 0, 0, x), want[static_cast<size_t>(x)]) << "element " << x;
    EXPECT_EQ(cache.v_at(0, 0, 0, x), want[static_cast<size_t>(x)]) << "element " << x;
  }
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

// 127 · (FLT_MAX / 127) rounds past FLT_MAX: the scale is the float below, so such a row reads
// back finite and within half a step (it read back as ±inf, and the output with it).
TEST(Int8Cache, RowsReachingTheLargestFloatReadBackFinite) {
  const float big = std::numeric_limits<float>::max();
  ASSERT_FALSE(std::isfinite(127.0f * (big / 127.0f)));
  const float scale = kernels::int8_scale(big);
  EXPECT_EQ(scale, std::nextafter(big / 127.0f, 0.0f));
  EXPECT_EQ(kernels::int8_scale(std::nextafter(big, 0.0f) / 2), std::nextafter(big, 0.0f) / 2 / 127.0f);
  for (const Int8KeyScales keys : {Int8KeyScales::PerToken, Int8KeyScales::PerChannel}) {
    KvCacheConfig c = int8_config(1, 1, 4, 4);
    c.int8_keys = keys, c.key_group = 1;
    KvCache cache(c);
    Tensor k({1, 1, 1, 4}), v({1, 1, 1, 4});
    const float row[] = {big, -big, 1.0f, -3e37f};
    for (int64_t x = 0; x < 4; ++x) k.at({0, 0, 0, x}) = v.at({0, 0, 0, x}) = row[x];
    cache.append(k.view4(), v.view4());
    for (int64_t x = 0; x < 4; ++x) {
      EXPECT_TRUE(std::isfinite(cache.k_at(0, 0, 0, x))) << x;
      EXPECT_LE(std::fabs(cache.k_at(0, 0, 0, x) - row[x]), scale / 2 * (1 + 1e-6)) << x;
      EXPECT_LE(std::fabs(cache.v_at(0, 0, 0, x) - row[x]), scale / 2 * (1 + 1e-6)) << x;
    }
    Tensor q({1, 1, 1, 4}, 0.0f), out({1, 1, 1, 4});
    attend_cache(q.view4(), cache, {}, {}, out.view4());  // one key: the output is its V row
    for (int64_t x = 0; x < 4; ++x) EXPECT_EQ(out.at({0, 0, 0, x}), cache.v_at(0, 0, 0, x)) << x;
  }
}

// Tiny values: the decode kernel's int16 steps of a row (queries; probabilities times V's scales)
// were 32767 / max, +inf below max ≈ 1e-34, and the output was off by a third of |V|. The int8
// cache now stays as close to the float32 one, relative to the values' size, as at ordinary sizes.
TEST(Int8Cache, TinyValuesDecodeAsCloseAsOrdinaryOnes) {
  const int64_t kv = 2, h = 4, T = 200, d = 32;
  for (const float v_size : {1.0f, 3e-30f, 3.5e-33f, 3e-35f})
    for (const float q_size : {1.0f, 1e-34f}) {
      SCOPED_TRACE("|V| " + std::to_string(v_size) + ", |q| " + std::to_string(q_size));
      KvCache f32(int8_config(1, kv, d, T));
      KvCacheConfig c = f32.config();
      c.dtype = CacheDtype::F32;
      f32 = KvCache(c);
      KvCache i8(int8_config(1, kv, d, T));
      Tensor k = random_tensor({1, kv, T, d}, 21, -1.0f, 1.0f), v = random_tensor({1, kv, T, d}, 22, -1.0f, 1.0f);
      for (float& x : v.values()) x *= v_size;
      for (float& x : k.values()) x /= q_size;  // scores of ordinary size
      f32.append(k.view4(), v.view4());
      i8.append(k.view4(), v.view4());
      Tensor q = random_tensor({1, h, 1, d}, 23, -1.0f, 1.0f);
      for (float& x : q.values()) x *= q_size;
      Tensor a({1, h, 1, d}), b({1, h, 1, d});
      attend_cache(q.view4(), f32, {}, {}, a.view4());
      attend_cache(q.view4(), i8, {}, {}, b.view4());
      testing::for_each_decode_target([&] {
        Tensor t({1, h, 1, d});
        attend_cache(q.view4(), i8, {}, {}, t.view4());
        for (int64_t i = 0; i < t.numel(); ++i)
          ASSERT_LE(std::fabs(t.values()[i] - a.values()[i]), 0.05f * v_size) << i;  // the cache's 2⁻⁸ per row
      });
      float worst = 0.0f;
      for (int64_t i = 0; i < a.numel(); ++i) worst = std::max(worst, std::fabs(b.values()[i] - a.values()[i]));
      EXPECT_LE(worst, 0.05f * v_size);
    }
}

/// (1, kv, T, d) of n · 2^exponent, n whole in [−127, 127], with n = ±127 at element 0 of every row
/// and at every element of the rows at positions p % 32 == 0: each row's max|x| / 127, and each
/// 32-position group's per channel, is 2^exponent, so an int8 cache holds these values exactly.
Tensor int8_exact_values(int64_t kv, int64_t T, int64_t d, uint32_t seed, int exponent) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> steps(-127, 127);
  Tensor x({1, kv, T, d});
  for (int64_t g = 0; g < kv; ++g)
    for (int64_t p = 0; p < T; ++p)
      for (int64_t e = 0; e < d; ++e) {
        const int n = e == 0 || p % 32 == 0 ? ((p + e) % 2 == 0 ? 127 : -127) : steps(gen);
        x.at({0, g, p, e}) = std::ldexp(static_cast<float>(n), exponent);
      }
  return x;
}

/// Whether every element of t is finite.
bool all_finite(const Tensor& t) {
  return std::all_of(t.values().begin(), t.values().end(), [](float x) { return std::isfinite(x); });
}

/// Attention of q (1, h, 1, d) over a float32 cache holding k and v (1, kv, T, d): the answer the
/// int8 caches of the same (int8-exact) values are held to.
Tensor float32_cache_attention(const Tensor& q, const Tensor& k, const Tensor& v) {
  KvCacheConfig config = int8_config(1, k.shape()[1], k.shape()[3], k.shape()[2]);
  config.dtype = CacheDtype::F32;
  KvCache f32(config);
  f32.append(k.view4(), v.view4());
  Tensor out(q.shape());
  attend_cache(q.view4(), f32, {}, {}, out.view4());
  return out;
}

// Query rows of extreme magnitude. Where int8 rows are widened to float (AVX2, SSE4 and below),
// q · k_int8 was summed in float before the key's scale applied, up to 127 · d times the
// dequantised products: queries near 1e37 gave inf scores and NaN rows where the float32 cache and
// the AVX-512 integer products stay finite. The caches here hold exactly the float32 cache's
// values (int8_exact_values), so every layout, paged or not, with per-token or per-channel key
// scales, must give the float32 cache's output to the integer products' 16-bit rounding of q and
// p (AVX-512) or float rounding (elsewhere), on every target, the same bits for any thread count.
TEST(Int8Cache, QueriesOfExtremeMagnitudeDecodeAsTheFloat32CacheDoes) {
  constexpr int64_t kv = 2, h = 4, T = 300, d = 64;
  struct Case {
    const char* what;
    int q_exponent, k_exponent;
  };
  const Case cases[] = {
      {"q near 2^124, keys below 1: scores near 1e37, one key takes all", 124, -7},
      {"q near 2^124, keys near 2^-123: scores of ordinary size", 124, -130},
      {"q near 2^-120, keys below 1: scores near 0, uniform", -120, -7},
      {"q near 2^-100, keys near 2^97: scores of ordinary size", -100, 90},
  };
  const Tensor v = int8_exact_values(kv, T, d, 32, -7);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const Tensor k = int8_exact_values(kv, T, d, 31, c.k_exponent);
    Tensor q = random_tensor({1, h, 1, d}, 33);
    for (float& x : q.values()) x = std::ldexp(x, c.q_exponent);
    const Tensor want = float32_cache_attention(q, k, v);
    ASSERT_TRUE(all_finite(want));

    // The int8 caches: rows and keys across lanes, contiguous and paged (blocks of 16), and
    // per-channel key scales (contiguous rows only).
    std::vector<std::pair<std::string, std::function<void(const CacheAttentionOptions&, Tensor&)>>> variants;
    std::vector<KvCache> contiguous;
    std::vector<PagedKvCache> paged;
    std::vector<int64_t> paged_seqs;
    for (const KeyLayout layout : {KeyLayout::Rows, KeyLayout::Transposed})
      for (const Int8KeyScales keys : {Int8KeyScales::PerToken, Int8KeyScales::PerChannel}) {
        if (layout == KeyLayout::Transposed && keys == Int8KeyScales::PerChannel) continue;  // refused
        KvCacheConfig i8 = int8_config(1, kv, d, T);
        i8.key_layout = layout, i8.int8_keys = keys;
        contiguous.emplace_back(i8);
        contiguous.back().append(k.view4(), v.view4());
      }
    for (const KeyLayout layout : {KeyLayout::Rows, KeyLayout::Transposed}) {
      PagedKvCacheConfig pc;
      pc.kv_heads = kv, pc.head_dim = d, pc.block_size = 16, pc.num_blocks = (T + 15) / 16;
      pc.dtype = CacheDtype::I8, pc.key_layout = layout;
      paged.emplace_back(pc);
      paged_seqs.push_back(paged.back().add_sequence());
      paged.back().append(paged_seqs.back(), k.view4(), v.view4());
    }
    const char* const contiguous_names[] = {"rows", "rows, per-channel keys", "keys across lanes"};
    for (size_t i = 0; i < contiguous.size(); ++i)
      variants.emplace_back(contiguous_names[i], [&, i](const CacheAttentionOptions& o, Tensor& out) {
        attend_cache(q.view4(), contiguous[i], {}, o, out.view4());
      });
    const char* const paged_names[] = {"paged rows", "paged keys across lanes"};
    for (size_t i = 0; i < paged.size(); ++i)
      variants.emplace_back(paged_names[i], [&, i](const CacheAttentionOptions& o, Tensor& out) {
        attend_paged_cache(q.view4(), paged[i], std::span(paged_seqs).subspan(i, 1), {}, o, out.view4());
      });

    testing::for_each_decode_target([&] {
      for (const auto& [name, attend] : variants) {
        SCOPED_TRACE(name);
        CacheAttentionOptions o;
        o.splits = 3;
        Tensor one({1, h, 1, d}), two({1, h, 1, d});
        o.threads = 1;
        attend(o, one);
        o.threads = 2;
        attend(o, two);
        EXPECT_TRUE(bitwise_equal(two, one));
        // AVX-512 rounds q and p to 16 bits (up to 6e-6 here); elsewhere float rounding (below 1e-6).
        EXPECT_TRUE(testing::all_close(one, want, 1e-4, 1e-4));
      }
    });
  }
}

// A query channel near 2^107 (after the scale) that meets only zero keys, the other channels small
// against keys near 2^105: the scores (~2^98) are finite, but the query's step (a power of two on
// the widened targets, max|q| / 32767 on the integer ones) times a key scale of 2^98 is not. The
// scores take step and scale in the order that cannot overflow, so no row turns NaN on any target;
// where int8 rows are widened the output is the float32 cache's (on AVX-512 the 16-bit rounding of
// q, whose step is 2⁻¹⁶ of the huge channel, leaves the small channels nothing: finite, not close).
TEST(Int8Cache, AHugeQueryChannelAgainstLargeKeyScalesStaysFinite) {
  constexpr int64_t kv = 1, h = 2, T = 40, d = 16;
  Tensor k = int8_exact_values(kv, T, d, 41, 98);  // channel 0 at ±127 steps: scale 2^98 exactly
  for (int64_t p = 0; p < T; ++p) k.at({0, 0, p, 1}) = 0.0f;
  const Tensor v = int8_exact_values(kv, T, d, 42, -7);
  Tensor q = random_tensor({1, h, 1, d}, 43);
  for (float& x : q.values()) x = std::ldexp(x, -7);
  for (int64_t head = 0; head < h; ++head) q.at({0, head, 0, 1}) = std::ldexp(1.0f, 110);
  const Tensor want = float32_cache_attention(q, k, v);
  ASSERT_TRUE(all_finite(want));
  for (const KeyLayout layout : {KeyLayout::Rows, KeyLayout::Transposed}) {
    KvCacheConfig i8 = int8_config(1, kv, d, T);
    i8.key_layout = layout;
    KvCache cache(i8);
    cache.append(k.view4(), v.view4());
    testing::for_each_decode_target([&] {
      SCOPED_TRACE(layout == KeyLayout::Rows ? "rows" : "keys across lanes");
      Tensor got({1, h, 1, d});
      attend_cache(q.view4(), cache, {}, {}, got.view4());
      EXPECT_TRUE(all_finite(got));
      const int64_t target = kernels::decode_dispatch_target();
      if (target != HWY_AVX3 && target != HWY_AVX3_DL) {
        EXPECT_TRUE(testing::all_close(got, want, 1e-4, 1e-4));
      }
    });
  }
}

// A query row holding ±inf (and no NaN) scores each key ±inf or NaN, as q · k does in float: on
// the targets that widen int8 keys, on the float32 cache and in sdpa. The AVX-512 integer products
// have no int16 steps for such a row and made every score NaN, so a row whose every score is −inf
// gave a NaN row there (zeros and lse −inf everywhere else: docs/semantics.md, 'Fully masked
// rows'), and under a softcap, which turns −inf into −c, NaN where the others give the mean of V.
// Now every int8 layout, contiguous and paged, gives the float32 cache's answer on every target.
TEST(Int8Cache, AnInfiniteQueryRowScoresAsTheFloat32CacheDoes) {
  constexpr int64_t kv = 1, h = 4, T = 40, d = 16;
  const float inf = std::numeric_limits<float>::infinity();
  Tensor k = int8_exact_values(kv, T, d, 51, -7);
  for (int64_t p = 0; p < T; ++p) k.at({0, 0, p, 0}) = std::ldexp(-127.0f, -7);  // channel 0 < 0
  const Tensor v = int8_exact_values(kv, T, d, 52, -7);
  Tensor k_zero = k;  // key 0's channel 0 is 0 (its other channels keep ±127 steps: still exact)
  k_zero.at({0, 0, 0, 0}) = 0.0f;
  Tensor q = random_tensor({1, h, 1, d}, 53);
  q.at({0, 0, 0, 0}) = inf;   // scores −inf: fully masked
  q.at({0, 1, 0, 0}) = -inf;  // scores +inf: NaN
  q.at({0, 2, 0, 3}) = inf;   // channel 3's keys have both signs: ±inf scores, +inf among them: NaN
  // head 3: an ordinary row in the same tile (int16 query steps, as any other: within 1e-4 here)
  const std::vector<float> sinks{0.5f, -1.0f, 0.25f, 2.0f};
  for (const Tensor* keys : {&k, &k_zero})
    for (int edit = 0; edit < 3; ++edit) {
      SCOPED_TRACE(std::string(keys == &k ? "keys' channel 0 negative" : "key 0's channel 0 zero") +
                   (edit == 1   ? ", softcap 3"
                    : edit == 2 ? ", sinks"
                                : ""));
      CacheAttentionOptions o;
      if (edit == 1) o.softcap = 3.0f;
      if (edit == 2) o.sinks.logits = sinks;
      KvCacheConfig f32_config = int8_config(1, kv, d, T);
      f32_config.dtype = CacheDtype::F32;
      KvCache f32(f32_config);
      f32.append(keys->view4(), v.view4());
      std::vector<KvCache> contiguous;
      std::vector<PagedKvCache> paged;
      std::vector<int64_t> seqs;
      for (const KeyLayout layout : {KeyLayout::Rows, KeyLayout::Transposed}) {
        KvCacheConfig i8 = int8_config(1, kv, d, T);
        i8.key_layout = layout;
        contiguous.emplace_back(i8);
        contiguous.back().append(keys->view4(), v.view4());
        PagedKvCacheConfig pc;
        pc.kv_heads = kv, pc.head_dim = d, pc.block_size = 16, pc.num_blocks = (T + 15) / 16;
        pc.dtype = CacheDtype::I8, pc.key_layout = layout;
        paged.emplace_back(pc);
        seqs.push_back(paged.back().add_sequence());
        paged.back().append(seqs.back(), keys->view4(), v.view4());
      }
      testing::for_each_decode_target([&] {
        Tensor want({1, h, 1, d}), want_lse({1, h, 1, 1});
        attend_cache(q.view4(), f32, {}, o, want.view4(), want_lse.view4());
        // The float32 cache's answer, head by head (a softcap makes ±inf scores ±c: finite rows;
        // key 0's zero makes head 0's score NaN there, and so its row).
        const bool masked = keys == &k && edit != 1;
        for (int64_t x = 0; x < d; ++x) {
          if (masked) {
            EXPECT_EQ(want.at({0, 0, 0, x}), 0.0f);
          }
          if (keys == &k_zero) {
            EXPECT_TRUE(std::isnan(want.at({0, 0, 0, x})));
          }
          if (edit != 1) {
            EXPECT_TRUE(std::isnan(want.at({0, 1, 0, x})) && std::isnan(want.at({0, 2, 0, x})));
          }
          EXPECT_TRUE(std::isfinite(want.at({0, 3, 0, x})));
        }
        if (masked) {
          EXPECT_EQ(want_lse.at({0, 0, 0, 0}), edit == 2 ? sinks[0] : -inf);
        }
        for (size_t i = 0; i < 4; ++i) {
          SCOPED_TRACE(i < 2 ? (i == 0 ? "rows" : "keys across lanes")
                             : (i == 2 ? "paged rows" : "paged across lanes"));
          Tensor got({1, h, 1, d}), got_lse({1, h, 1, 1});
          if (i < 2)
            attend_cache(q.view4(), contiguous[i], {}, o, got.view4(), got_lse.view4());
          else
            attend_paged_cache(q.view4(), paged[i - 2], std::span(seqs).subspan(i - 2, 1), {}, o, got.view4(),
                               got_lse.view4());
          for (int64_t head = 0; head < 4; ++head) {
            for (int64_t x = 0; x < d; ++x) {
              const float g = got.at({0, head, 0, x}), w = want.at({0, head, 0, x});
              EXPECT_TRUE(std::isnan(w) ? std::isnan(g) : std::fabs(g - w) <= 1e-4f)
                  << "head " << head << " channel " << x << ": " << g << ", float32 cache " << w;
            }
            const float gl = got_lse.at({0, head, 0, 0}), wl = want_lse.at({0, head, 0, 0});
            EXPECT_TRUE(std::isnan(wl) ? std::isnan(gl) : std::fabs(gl - wl) <= 1e-4f || gl == wl)
                << "head " << head << ": lse " << gl << ", float32 cache " << wl;
          }
        }
      });
    }
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

  // Through the module, the error names what the caller passed: the projection of key_new or
  // value_new (it named KvCache::append's own argument, "key").
  MhaConfig mc;
  mc.embed_dim = 8, mc.num_heads = 2, mc.layout = Layout::BatchFirst;
  const MultiheadAttention m(mc, 1);
  KvCache module_cache(int8_config(1, 2, 4, 4));
  Tensor x = random_tensor({1, 1, 8}, 4), bad = x;
  bad.at({0, 0, 5}) = nan;
  EXPECT_NE(error_of([&] {
              m.forward_incremental(x, x, bad, module_cache);
            }).find("forward_incremental: an int8 cache takes finite values only, but the projection of value_new"),
            std::string::npos);
  EXPECT_NE(error_of([&] { m.forward_incremental(x, bad, x, module_cache); }).find("the projection of key_new"),
            std::string::npos);
  EXPECT_EQ(module_cache.length(0), 0);

  // A float32 cache keeps a NaN (it shows in the output: docs/semantics.md).
  KvCacheConfig f32 = int8_config(2, 2, 4, 8);
  f32.dtype = CacheDtype::F32;
  KvCache plain(f32);
  EXPECT_NO_THROW(plain.append(k.view4(), v.view4()));
}

// ---- per-channel key scales (KIVI) -----------------------------------------------------------

KvCacheConfig channel_config(int64_t batch, int64_t kv, int64_t d, int64_t capacity, int64_t group) {
  KvCacheConfig c = int8_config(batch, kv, d, capacity);
  c.int8_keys = Int8KeyScales::PerChannel, c.key_group = group;
  return c;
}

/// Positions [t0, t1) of x (B, kv, T, d).
Tensor slice_tokens(const Tensor& x, int64_t t0, int64_t t1) {
  Tensor out({x.size(0), x.size(1), t1 - t0, x.size(3)});
  for (int64_t b = 0; b < x.size(0); ++b)
    for (int64_t g = 0; g < x.size(1); ++g)
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t e = 0; e < x.size(3); ++e) out.at({b, g, t - t0, e}) = x.at({b, g, t, e});
  return out;
}

/// What a per-channel cache must hold for key element (b, g, p, x) after positions [0, len) of
/// `k` were appended: the group's channel scale over its appended positions, and the element
/// rounded to it (the same float32 division and rounding as a per-token row).
float channel_key(const Tensor& k, int64_t b, int64_t g, int64_t p, int64_t x, int64_t group, int64_t len) {
  const int64_t g0 = p / group * group, g1 = std::min(len, g0 + group);
  float absmax = 0;
  for (int64_t i = g0; i < g1; ++i) absmax = std::max(absmax, std::fabs(k.at({b, g, i, x})));
  const float scale = absmax / 127.0f;
  return scale > 0 ? std::nearbyint(k.at({b, g, p, x}) / scale) * scale : 0.0f;
}

TEST(Int8ChannelKeys, EachGroupHasOneScalePerChannel) {
  // Groups of 4 over 11 positions, appended 3, then 1 by 1, then 5: open groups are quantised again
  // from their float rows as they grow, so every step holds exactly the formula over what was
  // appended so far, and the result does not depend on how the appends were cut.
  const int64_t B = 2, kv = 2, T = 11, d = 5, G = 4, cap = 12;
  Tensor k = random_tensor({B, kv, T, d}, 21, -3.0f, 3.0f), v = random_tensor({B, kv, T, d}, 22);
  for (int64_t t = 0; t < T; ++t) k.at({0, 1, t, 2}) = 40.0f * k.at({0, 1, t, 2});  // an outlier channel
  for (int64_t t = 4; t < 8; ++t) k.at({1, 0, t, 3}) = 0.0f;                        // a group's channel of zeros
  KvCache stepwise(channel_config(B, kv, d, cap, G)), whole(channel_config(B, kv, d, cap, G));
  whole.append(k.view4(), v.view4());
  int64_t len = 0;
  for (int64_t n : {3, 1, 1, 1, 5}) {
    const Tensor ks = slice_tokens(k, len, len + n), vs = slice_tokens(v, len, len + n);
    stepwise.append(ks.view4(), vs.view4());
    len += n;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < kv; ++g)
        for (int64_t p = 0; p < len; ++p)
          for (int64_t x = 0; x < d; ++x)
            ASSERT_EQ(stepwise.k_at(b, g, p, x), channel_key(k, b, g, p, x, G, len))
                << "after " << len << ": " << b << " " << g << " " << p << " " << x;
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < kv; ++g)
      for (int64_t p = 0; p < T; ++p)
        for (int64_t x = 0; x < d; ++x) {
          EXPECT_EQ(whole.k_at(b, g, p, x), stepwise.k_at(b, g, p, x));
          EXPECT_EQ(whole.v_at(b, g, p, x), stepwise.v_at(b, g, p, x));  // values: per row, as before
        }
  // The scales, (B, kv, groups, d): group 1 of (1, 0) has a channel of zeros.
  EXPECT_EQ(whole.config().key_groups(), 3);
  EXPECT_EQ(whole.k_scales()[((1 * kv + 0) * 3 + 1) * d + 3], 0.0f);
  for (int64_t t = 4; t < 8; ++t) EXPECT_EQ(whole.k_at(1, 0, t, 3), 0.0f);
  // Bytes: int8 K and V, a scale per V row, d scales per key group, and each head's open group in float.
  EXPECT_EQ(whole.bytes(),
            static_cast<size_t>(2 * B * kv * cap * d + 4 * B * kv * cap + 4 * B * kv * 3 * d + 4 * B * kv * G * d));
  // The outlier channel costs precision only in its own channel: the other channels of (0, 1) are
  // within half of their own step, far finer than the outlier's.
  for (int64_t t = 0; t < T; ++t) {
    float absmax = 0;
    for (int64_t i = t / G * G; i < std::min(T, t / G * G + G); ++i)
      absmax = std::max(absmax, std::fabs(k.at({0, 1, i, 0})));
    EXPECT_LE(std::fabs(whole.k_at(0, 1, t, 0) - k.at({0, 1, t, 0})), absmax / 254 * (1 + 1e-6));
  }
}

TEST(Int8ChannelKeys, OutlierChannelsCostLessThanWithRowScales) {
  // Keys whose channel 0 is 50× the others (the outlier channels KIVI describes): with one scale per
  // row the other channels are rounded to steps of the outlier; per channel they keep their own.
  const int64_t T = 64, d = 16;
  Tensor k = random_tensor({1, 1, T, d}, 31), v = random_tensor({1, 1, T, d}, 32);
  for (int64_t t = 0; t < T; ++t) k.at({0, 0, t, 0}) = 50.0f * k.at({0, 0, t, 0});
  KvCache rows(int8_config(1, 1, d, T)), channels(channel_config(1, 1, d, T, 32));
  rows.append(k.view4(), v.view4());
  channels.append(k.view4(), v.view4());
  double row_err = 0, channel_err = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t x = 1; x < d; ++x) {
      row_err = std::max(row_err, static_cast<double>(std::fabs(rows.k_at(0, 0, t, x) - k.at({0, 0, t, x}))));
      channel_err =
          std::max(channel_err, static_cast<double>(std::fabs(channels.k_at(0, 0, t, x) - k.at({0, 0, t, x}))));
    }
  EXPECT_LT(channel_err * 10, row_err) << "per channel " << channel_err << ", per row " << row_err;
}

TEST(Int8ChannelKeys, CloneResetAndRefusals) {
  const int64_t d = 6;
  KvCache cache(channel_config(2, 1, d, 10, 4));
  const Tensor k = random_tensor({2, 1, 6, d}, 41), v = random_tensor({2, 1, 6, d}, 42);
  cache.append(k.view4(), v.view4());
  KvCache copy = cache.clone();  // the open group's float rows too
  const Tensor k2 = random_tensor({2, 1, 1, d}, 43, -5.0f, 5.0f);
  copy.append(k2.view4(), k2.view4());
  cache.append(k2.view4(), k2.view4());
  for (int64_t p = 0; p < 7; ++p)
    for (int64_t x = 0; x < d; ++x) EXPECT_EQ(copy.k_at(1, 0, p, x), cache.k_at(1, 0, p, x));
  // Reset: the next group starts afresh, whatever the old rows held.
  cache.reset(0);
  const Tensor k3 = random_tensor({1, 1, 2, d}, 44);
  cache.append_sequence(0, k3.view4(), k3.view4());
  for (int64_t p = 0; p < 2; ++p)
    for (int64_t x = 0; x < d; ++x) {
      float absmax = std::max(std::fabs(k3.at({0, 0, 0, x})), std::fabs(k3.at({0, 0, 1, x})));
      EXPECT_EQ(cache.k_at(0, 0, p, x), std::nearbyint(k3.at({0, 0, p, x}) / (absmax / 127.0f)) * (absmax / 127.0f));
    }
  // Non-finite keys are refused as with row scales.
  Tensor bad = random_tensor({1, 1, 1, d}, 45);
  bad.at({0, 0, 0, 2}) = std::numeric_limits<float>::infinity();
  EXPECT_NE(error_of([&] { cache.append_sequence(0, bad.view4(), bad.view4()); }).find("finite"), std::string::npos);
  EXPECT_EQ(cache.length(0), 2);
  // Only an int8, non-ring cache takes per-channel key scales, with groups of ≥ 1 position.
  KvCacheConfig f32 = channel_config(1, 1, d, 8, 4);
  f32.dtype = CacheDtype::F32;
  EXPECT_NE(error_of([&] { KvCache{f32}; }).find("per-channel key scales need an int8, non-ring cache"),
            std::string::npos);
  KvCacheConfig ring = channel_config(1, 1, d, 8, 4);
  ring.ring = true;
  EXPECT_NE(error_of([&] { KvCache{ring}; }).find("a ring"), std::string::npos);
  EXPECT_NE(error_of([&] { KvCache{channel_config(1, 1, d, 8, 0)}; }).find("key_group 0"), std::string::npos);
  // A key_group near 2⁶³ is one group (capacity + key_group − 1 overflowed: no scales, and the
  // first append wrote past them).
  for (const int64_t huge : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() - 5}) {
    KvCache one(channel_config(1, 1, d, 8, huge)), same(channel_config(1, 1, d, 8, 9));
    EXPECT_EQ(one.config().key_groups(), 1);
    const Tensor keys = random_tensor({1, 1, 8, d}, 31), values = random_tensor({1, 1, 8, d}, 32);
    one.append(keys.view4(), values.view4());
    same.append(keys.view4(), values.view4());
    const Tensor query = random_tensor({1, 2, 1, d}, 33);
    Tensor a({1, 2, 1, d}), b({1, 2, 1, d});
    attend_cache(query.view4(), one, {}, {}, a.view4());
    attend_cache(query.view4(), same, {}, {}, b.view4());
    EXPECT_TRUE(bitwise_equal(a, b));
  }
  // Transposed keys keep per-token scales only.
  KvCacheConfig transposed = channel_config(1, 1, d, 8, 4);
  transposed.key_layout = KeyLayout::Transposed;
  EXPECT_NE(error_of([&] { KvCache{transposed}; }).find("transposed keys"), std::string::npos);
}

// ---- PyTorch golden (tests/golden/generate_int8_cache.py) ------------------------------------

/// The cache, holding the case's k and v, stores k_dequant / v_dequant bit for bit (the same
/// float32 division and round-half-to-even as torch), and decoding q after the whole cache gives
/// `out` at 1, 2 and 3 threads.
void expect_cache_matches_golden(const io::SafetensorsFile& f, const KvCache& cache) {
  const Tensor q = f.read_f32("q"), k_deq = f.read_f32("k_dequant"), v_deq = f.read_f32("v_dequant");
  const Tensor want = f.read_f32("out");
  const int64_t B = k_deq.size(0), kv = k_deq.size(1), T = k_deq.size(2), d = k_deq.size(3);
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
    // Attention over |v| ≤ 1 and a few dozen keys against PyTorch's float64. The decode kernel
    // rounds queries and probabilities to 16 bits for its integer products (docs/semantics.md,
    // 'KV caches in int8'): errors up to ~6e-5 here, where a wrong scale or quantisation step
    // (2⁻⁸ of a row) would show as 1e-3 or more.
    EXPECT_TRUE(testing::all_close(out, want, 1e-4, 1e-4));
  }
}

io::SafetensorsFile int8_golden(const std::string& name) {
  return io::SafetensorsFile::open(std::string(MHA_GOLDEN_DIR) + "/int8_cache/" + name + ".safetensors");
}

TEST(Int8CacheGolden, QuantisationAndDecodeMatchPyTorch) {
  const io::SafetensorsFile f = int8_golden("decode_gqa");
  const Tensor k = f.read_f32("k"), v = f.read_f32("v");
  KvCache cache(int8_config(k.size(0), k.size(1), k.size(3), k.size(2)));
  cache.append(k.view4(), v.view4());
  expect_cache_matches_golden(f, cache);
}

TEST(Int8CacheGolden, PerChannelKeysMatchPyTorch) {
  // Keys per channel of each group of 8 positions (27 positions: the last group is partial), an
  // outlier channel and a group's channel of zeros; values per row.
  const io::SafetensorsFile f = int8_golden("decode_gqa_channel");
  const Tensor k = f.read_f32("k"), v = f.read_f32("v");
  const int64_t T = k.size(2);
  KvCache cache(channel_config(k.size(0), k.size(1), k.size(3), T, std::stoll(f.metadata().at("key_group"))));
  // In two appends that split a group: the open group is quantised again when the rest arrives.
  cache.append(slice_tokens(k, 0, 11).view4(), slice_tokens(v, 0, 11).view4());
  cache.append(slice_tokens(k, 11, T).view4(), slice_tokens(v, 11, T).view4());
  expect_cache_matches_golden(f, cache);
}

}  // namespace
}  // namespace mha
