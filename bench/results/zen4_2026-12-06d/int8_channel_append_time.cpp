// Time to append one token at a time (8 K/V heads x 128, K and V) to an int8 cache with
// per-channel key scales (groups of 32 positions), 1024 tokens; and the same for per-token scales.
// Build from the repository root after building mha: g++ -std=c++20 -O2 -Iinclude -o chan_append
// bench/results/zen4_2026-12-06d/int8_channel_append_time.cpp build/libmha.a build/libmha_internal.a -lhwy -fopenmp -ldnnl
#include <mha/kv_cache.h>
#include <mha/tensor.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  using namespace mha;
  const int64_t kv = 8, d = 128, T = 1024;
  Tensor k({1, kv, T, d});
  std::mt19937 g(1);
  std::normal_distribution<float> n;
  for (int64_t i = 0; i < k.numel(); ++i) k.data()[i] = n(g);
  for (const bool channel : {true, false}) {
    std::vector<double> us;
    for (int r = 0; r < 5; ++r) {
      KvCacheConfig c{.batch = 1, .kv_heads = kv, .head_dim = d, .capacity = T, .dtype = CacheDtype::I8};
      if (channel) c.int8_keys = Int8KeyScales::PerChannel, c.key_group = 32;
      KvCache cache(c);
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t t = 0; t < T; ++t) {
        const View4<const float> one{k.data() + t * d, {1, kv, 1, d}, {kv * T * d, T * d, d, 1}};
        cache.append(one, one);
      }
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / T);
    }
    std::sort(us.begin(), us.end());
    std::printf("int8 %s: one token (%lld K/V heads x %lld, K and V) a call: median %.2f us a token\n",
                channel ? "per-channel keys (groups of 32)" : "per-token scales", (long long)kv, (long long)d, us[2]);
  }
}
