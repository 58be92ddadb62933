// Which 512-bit instructions share the dot products' pipes: 8 vpdpwssd alone and with shuffles, FMAs or
// vscalefps between them (Zen 4 figures in ab.txt §6).
// Build: g++ -O2 -mavx512f -mavx512bw -mavx512vnni -mavx512vbmi -o pipes pipe_sharing.cpp
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define DP(x) asm volatile("vpdpwssd %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define PW(x) asm volatile("vpermw %%zmm29, %%zmm28, %%zmm" #x ::: "xmm" #x)
#define SX(x) asm volatile("vpmovsxbw %%ymm27, %%zmm" #x ::: "xmm" #x)
#define UN(x) asm volatile("vpunpcklbw %%zmm27, %%zmm26, %%zmm" #x ::: "xmm" #x)
#define PB(x) asm volatile("vpermb %%zmm29, %%zmm28, %%zmm" #x ::: "xmm" #x)
#define FM(x) asm volatile("vfmadd231ps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define EX(x) asm volatile("vscalefps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define RD(x) asm volatile("vreduceps $0, %%zmm30, %%zmm" #x ::: "xmm" #x)
template <class F>
void timeit(const char* name, F f, long iters) {
  auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < iters; ++k) f();
  double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%-28s %.2f ns per iteration\n", name, ns / iters);
}
int main() {
  asm volatile(
      "vpxord %%zmm26,%%zmm26,%%zmm26; vpxord %%zmm27,%%zmm27,%%zmm27; vpxord %%zmm28,%%zmm28,%%zmm28; vpxord "
      "%%zmm29,%%zmm29,%%zmm29; vpxord %%zmm30,%%zmm30,%%zmm30; vpxord %%zmm31,%%zmm31,%%zmm31" ::
          : "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31");
  for (int r = 0; r < 2; ++r) {
    timeit(
        "8 dp",
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
    timeit(
        "8 dp + 2 vpermw",
        [] {
          DP(0);
          DP(1);
          PW(8);
          DP(2);
          DP(3);
          DP(4);
          DP(5);
          PW(9);
          DP(6);
          DP(7);
        },
        30000000);
    timeit(
        "8 dp + 2 vpmovsxbw",
        [] {
          DP(0);
          DP(1);
          SX(8);
          DP(2);
          DP(3);
          DP(4);
          DP(5);
          SX(9);
          DP(6);
          DP(7);
        },
        30000000);
    timeit(
        "8 dp + 2 sx + 2 permw",
        [] {
          DP(0);
          SX(10);
          DP(1);
          PW(8);
          DP(2);
          DP(3);
          SX(11);
          DP(4);
          DP(5);
          PW(9);
          DP(6);
          DP(7);
        },
        30000000);
    timeit(
        "8 dp + 4 unpack",
        [] {
          DP(0);
          UN(10);
          DP(1);
          UN(8);
          DP(2);
          DP(3);
          UN(11);
          DP(4);
          DP(5);
          UN(9);
          DP(6);
          DP(7);
        },
        30000000);
    timeit(
        "8 dp + 1 vpermb",
        [] {
          DP(0);
          DP(1);
          DP(2);
          DP(3);
          PB(8);
          DP(4);
          DP(5);
          DP(6);
          DP(7);
        },
        30000000);
    timeit(
        "8 dp + 4 fma",
        [] {
          DP(0);
          FM(10);
          DP(1);
          FM(8);
          DP(2);
          DP(3);
          FM(11);
          DP(4);
          DP(5);
          FM(9);
          DP(6);
          DP(7);
        },
        30000000);
    timeit(
        "8 dp + 4 scalef",
        [] {
          DP(0);
          EX(10);
          DP(1);
          EX(8);
          DP(2);
          DP(3);
          EX(11);
          DP(4);
          DP(5);
          EX(9);
          DP(6);
          DP(7);
        },
        30000000);
    timeit(
        "8 fma",
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
  }
}
