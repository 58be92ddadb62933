// bench/gemm_compare.cpp — sgemm GFLOP/s of OpenBLAS, BLIS and oneDNN on this machine for the
// projection shapes of the module: y (M, N) = x (M, K) · Wᵀ with W (N, K), row-major, K = 512,
// M = B·T ∈ {256, 4096, 16384}, N ∈ {512 (Q or output), 1536 (packed QKV)}, on 1 and 2 threads.
//
// OpenBLAS and BLIS both export cblas_sgemm, so linking both would silently measure one of them
// twice. Each is loaded with dlopen(RTLD_LOCAL | RTLD_DEEPBIND) and its own cblas_sgemm is looked
// up in it; oneDNN is linked (dnnl_sgemm is its own name). The libraries' calls are interleaved
// round by round so that load from other processes spreads over all three alike.
//
//   gemm_compare [--quick] [--threads 1,2]
#include <dlfcn.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

// CBLAS's enum values (the same in every implementation).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
using CblasSgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                            int);

struct Library {
  std::string name;
  std::function<void(int)> set_threads;
  std::function<void(int64_t m, int64_t n, int64_t k, const float* x, const float* w, float* y)> gemm;
};

void* open_or_die(const char* path) {
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (!h) {
    std::fprintf(stderr, "gemm_compare: cannot load %s: %s\n", path, dlerror());
    std::exit(1);
  }
  return h;
}

template <class Fn>
Fn symbol_or_die(void* handle, const char* lib, const char* name) {
  void* p = dlsym(handle, name);
  if (!p) {
    std::fprintf(stderr, "gemm_compare: %s has no %s\n", lib, name);
    std::exit(1);
  }
  return reinterpret_cast<Fn>(p);
}

Library cblas_library(const char* name, const char* path, const char* set_threads_symbol, bool threads_are_64bit) {
  void* h = open_or_die(path);
  auto sgemm = symbol_or_die<CblasSgemm>(h, name, "cblas_sgemm");
  Library lib;
  lib.name = name;
  if (threads_are_64bit) {  // BLIS: bli_thread_set_num_threads(dim_t)
    auto set = symbol_or_die<void (*)(int64_t)>(h, name, set_threads_symbol);
    lib.set_threads = [set](int n) { set(n); };
  } else {  // OpenBLAS: openblas_set_num_threads(int)
    auto set = symbol_or_die<void (*)(int)>(h, name, set_threads_symbol);
    lib.set_threads = [set](int n) { set(n); };
  }
  lib.gemm = [sgemm](int64_t m, int64_t n, int64_t k, const float* x, const float* w, float* y) {
    sgemm(kRowMajor, kNoTrans, kTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, x,
          static_cast<int>(k), w, static_cast<int>(k), 0.0f, y, static_cast<int>(n));
  };
  return lib;
}

Library onednn_library() {
  Library lib;
  lib.name = "oneDNN";
  lib.set_threads = [](int n) { omp_set_num_threads(n); };  // Debian's oneDNN uses the OpenMP runtime
  lib.gemm = [](int64_t m, int64_t n, int64_t k, const float* x, const float* w, float* y) {
    if (dnnl_sgemm('N', 'T', m, n, k, 1.0f, x, k, w, k, 0.0f, y, n) != dnnl_success) {
      std::fprintf(stderr, "gemm_compare: dnnl_sgemm failed\n");
      std::exit(1);
    }
  };
  return lib;
}

double seconds_of(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::vector<int> thread_counts{1, 2};
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      thread_counts.clear();
      for (const char* p = argv[++i]; *p;) {
        thread_counts.push_back(std::atoi(p));
        while (*p && *p != ',') ++p;
        if (*p == ',') ++p;
      }
    } else {
      std::fprintf(stderr, "usage: gemm_compare [--quick] [--threads 1,2]\n");
      return 1;
    }
  }
  std::vector<Library> libs{cblas_library("OpenBLAS", MHA_OPENBLAS_PATH, "openblas_set_num_threads", false),
                            cblas_library("BLIS", MHA_BLIS_PATH, "bli_thread_set_num_threads", true), onednn_library()};
  if (void* blis = dlopen(MHA_BLIS_PATH, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND)) {
    // BLIS picks its kernels by CPU at start-up; a CPU it does not know gets the generic ones.
    auto query = reinterpret_cast<int (*)()>(dlsym(blis, "bli_arch_query_id"));
    auto name = reinterpret_cast<const char* (*)(int)>(dlsym(blis, "bli_arch_string"));
    if (query && name) std::printf("BLIS kernel configuration: %s\n", name(query()));
  }
  const std::vector<int64_t> ms = quick ? std::vector<int64_t>{256, 4096} : std::vector<int64_t>{256, 4096, 16384};
  const std::vector<int64_t> ns{512, 1536};
  const int64_t k = 512;
  const double budget_s = quick ? 0.3 : 1.0;  // per library and shape

  std::printf("sgemm y(M,N) = x(M,K)·Wᵀ, K=%lld, row-major; GFLOP/s median (best) of interleaved runs\n",
              static_cast<long long>(k));
  std::printf("%7s %6s %4s | %17s | %17s | %17s | %s\n", "M", "N", "thr", libs[0].name.c_str(), libs[1].name.c_str(),
              libs[2].name.c_str(), "winner (median)");
  for (int threads : thread_counts) {
    for (const Library& lib : libs) lib.set_threads(threads);
    for (int64_t m : ms)
      for (int64_t n : ns) {
        std::vector<float> x(static_cast<size_t>(m * k)), w(static_cast<size_t>(n * k)), y(static_cast<size_t>(m * n));
        for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 13) * 0.01f - 0.06f;
        for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 7) * 0.02f - 0.06f;
        const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
        // Warm-up (thread pools, oneDNN's JIT, first touch of y), checking that every library
        // computes the same product as the first: a fast wrong answer must not win.
        double slowest = 0;
        std::vector<float> y0;
        for (const Library& lib : libs) {
          std::fill(y.begin(), y.end(), -1.0f);
          slowest = std::max(slowest, seconds_of([&] { lib.gemm(m, n, k, x.data(), w.data(), y.data()); }));
          if (y0.empty()) y0 = y;
          float worst = 0;
          for (size_t i = 0; i < y.size(); ++i) worst = std::max(worst, std::abs(y[i] - y0[i]));
          if (worst > 1e-3f) {
            std::fprintf(stderr, "gemm_compare: %s differs from %s by %g\n", lib.name.c_str(), libs[0].name.c_str(),
                         static_cast<double>(worst));
            return 1;
          }
        }
        const int rounds = std::clamp(static_cast<int>(budget_s / slowest), 3, 25);
        std::vector<std::vector<double>> gflops(libs.size());
        for (int r = 0; r < rounds; ++r)
          for (size_t l = 0; l < libs.size(); ++l)
            gflops[l].push_back(flops / seconds_of([&] { libs[l].gemm(m, n, k, x.data(), w.data(), y.data()); }) *
                                1e-9);
        std::printf("%7lld %6lld %4d", static_cast<long long>(m), static_cast<long long>(n), threads);
        size_t best_lib = 0;
        for (size_t l = 0; l < libs.size(); ++l) {
          const double med = median(gflops[l]), best = *std::max_element(gflops[l].begin(), gflops[l].end());
          std::printf(" | %7.1f (%7.1f)", med, best);
          if (med > median(gflops[best_lib])) best_lib = l;
        }
        std::printf(" | %s\n", libs[best_lib].name.c_str());
        std::fflush(stdout);
      }
  }
  return 0;
}
