// Throughput of the 512-bit dot-product and FMA instructions with N independent sums (Zen 4
// figures in ab.txt §1). Build: g++ -O2 -mavx512f -mavx512vnni -o dp dot_product_throughput.cpp
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define DP(x) asm volatile("vpdpwssd %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define DB(x) asm volatile("vpdpbusd %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define FM(x) asm volatile("vfmadd231ps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
template <class F>
void timeit(const char* name, int per, F f, long iters) {
  auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < iters; ++k) f();
  double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%-12s %.3f ns per op = %.2f cycles at 3.66 GHz\n", name, ns / (iters * per), ns / (iters * per) * 3.66);
}
int main() {
  asm volatile("vpxord %%zmm30,%%zmm30,%%zmm30; vpxord %%zmm31,%%zmm31,%%zmm31" ::: "xmm30", "xmm31");
  for (int r = 0; r < 2; ++r) {
    timeit(
        "dpwssd x4", 4,
        [] {
          DP(0);
          DP(1);
          DP(2);
          DP(3);
        },
        50000000);
    timeit(
        "dpwssd x6", 6,
        [] {
          DP(0);
          DP(1);
          DP(2);
          DP(3);
          DP(4);
          DP(5);
        },
        50000000);
    timeit(
        "dpwssd x8", 8,
        [] {
          DP(0);
          DP(1);
          DP(2);
          DP(3);
          DP(4);
          DP(5);
          DP(6);
          DP(7);
        },
        50000000);
    timeit(
        "dpwssd x12", 12,
        [] {
          DP(0);
          DP(1);
          DP(2);
          DP(3);
          DP(4);
          DP(5);
          DP(6);
          DP(7);
          DP(8);
          DP(9);
          DP(10);
          DP(11);
        },
        30000000);
    timeit(
        "dpbusd x8", 8,
        [] {
          DB(0);
          DB(1);
          DB(2);
          DB(3);
          DB(4);
          DB(5);
          DB(6);
          DB(7);
        },
        50000000);
    timeit(
        "fma x4", 4,
        [] {
          FM(0);
          FM(1);
          FM(2);
          FM(3);
        },
        50000000);
    timeit(
        "fma x8", 8,
        [] {
          FM(0);
          FM(1);
          FM(2);
          FM(3);
          FM(4);
          FM(5);
          FM(6);
          FM(7);
        },
        50000000);
  }
}
