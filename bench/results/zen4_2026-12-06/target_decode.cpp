// Built against a build tree's library: g++ -std=c++20 -O2 -fopenmp -Iinclude THIS build/libmha.a -lhwy -ldnnl
// (bench/results/zen4_2026-12-06/ab.txt §6). Not part of the build.
// Decode time per SIMD target: h=32, kv=8, d=128, context 8192, int8 and f32 caches, 1 thread.
#include <hwy/targets.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
#include "mha/kv_cache.h"
#include "mha/tensor.h"
using namespace mha;
int main() {
  const int64_t kv = 8, h = 32, d = 128, T = 8192;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  Tensor k({1, kv, T, d}), v({1, kv, T, d}), q({1, h, 1, d}), out({1, h, 1, d});
  for (Tensor* t : {&k, &v, &q})
    for (int64_t i = 0; i < t->numel(); ++i) t->data()[i] = u(rng);
  for (CacheDtype dt : {CacheDtype::F32, CacheDtype::I8}) {
    // several caches so that K/V come from memory (rotate through ~300 MiB)
    const int n = dt == CacheDtype::F32 ? 5 : 18;
    std::vector<KvCache> caches;
    for (int i = 0; i < n; ++i) {
      KvCacheConfig c{.batch = 1, .kv_heads = kv, .head_dim = d, .capacity = T, .dtype = dt};
      caches.emplace_back(c);
      caches.back().append(k.view4(), v.view4());
    }
    for (uint32_t target : hwy::SupportedAndGeneratedTargets()) {
      hwy::SetSupportedTargetsForTest(target);
      CacheAttentionOptions o;
      o.threads = 1;
      double best = 1e9;
      const std::vector<int64_t> at{T};
      for (int rep = 0; rep < 40; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        attend_cache(q.view4(), caches[rep % n], at, o, out.view4());
        best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::printf("%s %s %.3f ms\n", dt == CacheDtype::F32 ? "f32" : "int8", hwy::TargetName(target), best);
    }
    hwy::SetSupportedTargetsForTest(0);
  }
}
