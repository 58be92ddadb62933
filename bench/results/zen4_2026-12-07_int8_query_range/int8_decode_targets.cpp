// int8 decode time per forced SIMD target (AVX2, SSE4, AVX3_DL): h=32, kv=8, d=128, 1 thread; rows
// and keys across lanes; context 8192 from memory (18 caches rotating through ~300 MiB) and 512 in
// cache; best of 60 / 400 steps. Built against a build tree's library with the old or the new
// decode kernel's object linked ahead of it (summary.txt here):
//   g++ -std=c++20 -O2 -fopenmp -Iinclude -c THIS -o prog.o
//   g++ -fopenmp prog.o decode_{old,new}.o build/libmha.a -lhwy -ldnnl -o bench_{old,new}
// Not part of the build.
#include <hwy/targets.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include "mha/kv_cache.h"
#include "mha/tensor.h"
using namespace mha;
int main(int argc, char** argv) {
  const char* label = argc > 1 ? argv[1] : "?";
  const int64_t kv = 8, h = 32, d = 128;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (const int64_t T : {int64_t{8192}, int64_t{512}}) {
    Tensor k({1, kv, T, d}), v({1, kv, T, d}), q({1, h, 1, d}), out({1, h, 1, d});
    for (Tensor* t : {&k, &v, &q})
      for (int64_t i = 0; i < t->numel(); ++i) t->data()[i] = u(rng);
    for (const KeyLayout layout : {KeyLayout::Rows, KeyLayout::Transposed}) {
      const int n = T == 8192 ? 18 : 1;
      std::vector<KvCache> caches;
      for (int i = 0; i < n; ++i) {
        KvCacheConfig c{.batch = 1, .kv_heads = kv, .head_dim = d, .capacity = T, .dtype = CacheDtype::I8};
        c.key_layout = layout;
        caches.emplace_back(c);
        caches.back().append(k.view4(), v.view4());
      }
      for (uint32_t target : {uint32_t{HWY_AVX2}, uint32_t{HWY_SSE4}, uint32_t{HWY_AVX3_DL}}) {
        hwy::SetSupportedTargetsForTest(target);
        CacheAttentionOptions o;
        o.threads = 1;
        double best = 1e9;
        const std::vector<int64_t> at{T};
        const int reps = T == 8192 ? 60 : 400;
        for (int rep = 0; rep < reps; ++rep) {
          const auto t0 = std::chrono::steady_clock::now();
          attend_cache(q.view4(), caches[rep % n], at, o, out.view4());
          best =
              std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        std::printf("%s T=%lld %s %s %.4f ms\n", label, static_cast<long long>(T),
                    layout == KeyLayout::Rows ? "rows" : "lanes", hwy::TargetName(target), best);
      }
      hwy::SetSupportedTargetsForTest(0);
    }
  }
}
