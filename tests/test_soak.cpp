// Soak (issue 16): thousands of random-shape calls and a long decode with resets must not grow the
// resident set. RSS is sampled from /proc/self/statm after a warm-up (allocator pools, OpenMP
// threads and oneDNN's kernel caches settle there) and at intervals after it; the bound is that
// it grows by at most kRssBoundBytes over the rest of the run. A leak of even one small tensor per
// call (≥ 1 KiB × thousands of calls) would cross it. About 15 s of CPU in Release.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <random>

#include "mha/kv_cache.h"
#include "mha/module.h"
#include "support/test_support.h"

namespace mha {
namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;  // quarantines grow the RSS by design; fewer calls, no bound
#else
constexpr bool kSanitized = false;
#endif

constexpr int64_t kRssBoundBytes = int64_t{16} << 20;

int64_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<int64_t>(::sysconf(_SC_PAGE_SIZE));
}

TEST(Soak, RandomShapeCallsKeepRssFlat) {
  const int calls = kSanitized ? 300 : 2500, warmup = calls / 10;
  std::mt19937_64 rng(16);
  const auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  // A few modules (the configs differ in heads, GQA, bias, extras), reused across calls.
  std::vector<MultiheadAttention> modules;
  for (int i = 0; i < 4; ++i) {
    MhaConfig c;
    c.num_heads = int64_t{1} << i;
    c.embed_dim = c.num_heads * 8;
    c.num_kv_heads = i == 3 ? 2 : 0;
    c.bias = i != 1;
    c.add_zero_attn = i == 2;
    modules.emplace_back(c, static_cast<uint64_t>(i));
  }
  int64_t base = 0, peak = 0;
  for (int call = 0; call < calls; ++call) {
    if (call == warmup) base = rss_bytes();
    const MultiheadAttention& m = modules[static_cast<size_t>(pick(0, 3))];
    const int64_t E = m.config().embed_dim, B = pick(1, 3), Tq = pick(1, 40), Tk = pick(1, 40);
    const Tensor q = testing::random_tensor({Tq, B, E}, static_cast<uint64_t>(call));
    const Tensor kv = testing::random_tensor({Tk, B, E}, static_cast<uint64_t>(call) + 1);
    MhaForwardOptions o;
    o.need_weights = static_cast<NeedWeights>(pick(0, 2));
    if (pick(0, 3) == 0) o.causal = Causal::bottom_right();
    const MhaOutput out = m.forward(q, kv, kv, o);
    ASSERT_EQ(out.output.shape(), q.shape());
    if (call > warmup && call % 100 == 0) peak = std::max(peak, rss_bytes());
  }
  peak = std::max(peak, rss_bytes());
  std::fprintf(stderr, "soak: %d calls, RSS after warm-up %.1f MiB, peak after %.1f MiB\n", calls,
               static_cast<double>(base) / 1048576.0, static_cast<double>(peak) / 1048576.0);
  if (!kSanitized) {
    EXPECT_LE(peak - base, kRssBoundBytes) << "RSS grew over random-shape calls";
  }
}

TEST(Soak, LongDecodeWithResetsKeepsRssFlat) {
  const int steps = kSanitized ? 400 : 2500, warmup = steps / 10;
  MhaConfig c;
  c.embed_dim = 64, c.num_heads = 8, c.num_kv_heads = 2, c.layout = Layout::BatchFirst;
  const MultiheadAttention m(c, 5);
  const int64_t B = 2, capacity = 256;
  KvCache cache(KvCacheConfig{.batch = B, .kv_heads = 2, .head_dim = 8, .capacity = capacity});
  int64_t base = 0, peak = 0, resets = 0;
  for (int s = 0; s < steps; ++s) {
    if (s == warmup) base = rss_bytes();
    // Reset one sequence or all before the cache fills, as a server recycling slots would.
    if (cache.remaining(0) == 0 || cache.remaining(1) == 0) {
      if (s % 2 == 0) {
        cache.reset();
      } else {
        for (int64_t b = 0; b < B; ++b)
          if (cache.remaining(b) == 0) cache.reset(b);
      }
      ++resets;
    }
    const Tensor x = testing::random_tensor({B, 1, 64}, static_cast<uint64_t>(s));
    (void)m.forward_incremental(x, x, x, cache);
    if (s > warmup && s % 100 == 0) peak = std::max(peak, rss_bytes());
  }
  peak = std::max(peak, rss_bytes());
  std::fprintf(stderr, "soak: %d decode steps, %ld resets, RSS after warm-up %.1f MiB, peak after %.1f MiB\n", steps,
               static_cast<long>(resets), static_cast<double>(base) / 1048576.0, static_cast<double>(peak) / 1048576.0);
  EXPECT_GT(resets, 0);
  if (!kSanitized) {
    EXPECT_LE(peak - base, kRssBoundBytes) << "RSS grew over a long decode";
  }
}

}  // namespace
}  // namespace mha
