// Whether 4 independent sums hide the latency of vpdpwssd, vfmadd231ps and vdpbf16ps (ab.txt §6).
// Build: g++ -O2 -mavx512f -mavx512bw -mavx512vnni -mavx512bf16 -o chains chain_latency.cpp
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define DP(x) asm volatile("vpdpwssd %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define FM(x) asm volatile("vfmadd231ps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define BF(x) asm volatile("vdpbf16ps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
template <class F>
double timeit(F f, long iters) {
  auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < iters; ++k) f();
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / iters;
}
int main() {
  asm volatile("vpxord %%zmm30,%%zmm30,%%zmm30; vpxord %%zmm31,%%zmm31,%%zmm31" ::: "xmm30", "xmm31");
  for (int r = 0; r < 3; ++r) {
    double d4 = timeit(
        [] {
          DP(0);
          DP(1);
          DP(2);
          DP(3);
          DP(0);
          DP(1);
          DP(2);
          DP(3);
        },
        30000000);
    double d8 = timeit(
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
        30000000);
    double f4 = timeit(
        [] {
          FM(0);
          FM(1);
          FM(2);
          FM(3);
          FM(0);
          FM(1);
          FM(2);
          FM(3);
        },
        30000000);
    double f8 = timeit(
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
        30000000);
    double b4 = timeit(
        [] {
          BF(0);
          BF(1);
          BF(2);
          BF(3);
          BF(0);
          BF(1);
          BF(2);
          BF(3);
        },
        30000000);
    double b8 = timeit(
        [] {
          BF(0);
          BF(1);
          BF(2);
          BF(3);
          BF(4);
          BF(5);
          BF(6);
          BF(7);
        },
        30000000);
    std::printf(
        "ns per 8 ops: vpdpwssd 4 chains %.2f, 8 chains %.2f | vfmadd 4 chains %.2f, 8 chains %.2f | vdpbf16ps 4 "
        "chains %.2f, 8 chains %.2f\n",
        d4, d8, f4, f8, b4, b8);
  }
}
