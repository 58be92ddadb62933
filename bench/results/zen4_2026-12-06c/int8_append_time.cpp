// Time to append 4096 tokens x 8 K/V heads x 128 to a fresh int8 cache (ab.txt §4). Build from the
// repository root after building mha: g++ -std=c++20 -O2 -Iinclude -o app
// bench/results/zen4_2026-12-06c/int8_append_time.cpp build/libmha.a build/libmha_internal.a -lhwy -fopenmp
#include <mha/kv_cache.h>
#include <mha/tensor.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
int main() {
  using namespace mha;
  const int64_t kv = 8, d = 128, T = 4096;
  Tensor k({1, kv, T, d});
  std::mt19937 g(1);
  std::normal_distribution<float> n;
  for (int64_t i = 0; i < k.numel(); ++i) k.data()[i] = n(g);
  for (auto layout : {KeyLayout::Rows, KeyLayout::Transposed}) {
    std::vector<double> ms;
    for (int r = 0; r < 7; ++r) {
      KvCache c(KvCacheConfig{
          .batch = 1, .kv_heads = kv, .head_dim = d, .capacity = T, .dtype = CacheDtype::I8, .key_layout = layout});
      auto t0 = std::chrono::steady_clock::now();
      c.append(k.view4(), k.view4());
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    std::printf("int8 append, %s keys: %lld tokens x %lld kv heads x %lld (K and V): median %.2f ms\n",
                layout == KeyLayout::Rows ? "row" : "transposed", (long long)T, (long long)kv, (long long)d, ms[3]);
  }
}
