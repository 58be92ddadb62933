// The 512-bit dot products' throughput on this CPU (ab.txt §1 and §6): nanoseconds per group of 8
// instructions, (a) with 4, 8 or 12 independent sums (does 4 hide the latency?), (b) 8 vpdpwssd with
// other instructions between them (which ones share the dot products' pipes?).
// Build: g++ -O2 -mavx512f -mavx512bw -mavx512vnni -mavx512vbmi -mavx512bf16 -o probes pipe_probes.cpp
#include <chrono>
#include <cstdio>

// One instruction writing zmm<x> from the zeroed zmm26-31 (no memory, no dependence but on zmm<x>).
#define DP(x) asm volatile("vpdpwssd %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define DB(x) asm volatile("vpdpbusd %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define BF(x) asm volatile("vdpbf16ps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define FM(x) asm volatile("vfmadd231ps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define PW(x) asm volatile("vpermw %%zmm29, %%zmm28, %%zmm" #x ::: "xmm" #x)
#define PB(x) asm volatile("vpermb %%zmm29, %%zmm28, %%zmm" #x ::: "xmm" #x)
#define SX(x) asm volatile("vpmovsxbw %%ymm27, %%zmm" #x ::: "xmm" #x)
#define UN(x) asm volatile("vpunpcklbw %%zmm27, %%zmm26, %%zmm" #x ::: "xmm" #x)
#define SF(x) asm volatile("vscalefps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)

/// Runs body (a group of instructions) `iters` times; prints the nanoseconds per group of 8
/// counted instructions (`counted` of them in body).
template <class Body>
void probe(const char* name, int counted, Body body, long iters = 30000000) {
  const auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < iters; ++k) body();
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%-34s %.2f ns per 8\n", name, ns / static_cast<double>(iters) * 8.0 / counted);
}

int main() {
  asm volatile(
      "vpxord %%zmm26, %%zmm26, %%zmm26; vpxord %%zmm27, %%zmm27, %%zmm27; vpxord %%zmm28, %%zmm28, %%zmm28\n"
      "vpxord %%zmm29, %%zmm29, %%zmm29; vpxord %%zmm30, %%zmm30, %%zmm30; vpxord %%zmm31, %%zmm31, %%zmm31" ::
          : "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31");
  for (int round = 0; round < 2; ++round) {
    // clang-format off
    std::printf("(a) independent sums\n");
    probe("vpdpwssd, 4 sums", 8, [] { DP(0); DP(1); DP(2); DP(3); DP(0); DP(1); DP(2); DP(3); });
    probe("vpdpwssd, 8 sums", 8, [] { DP(0); DP(1); DP(2); DP(3); DP(4); DP(5); DP(6); DP(7); });
    probe("vpdpwssd, 12 sums", 12, [] { DP(0); DP(1); DP(2); DP(3); DP(4); DP(5); DP(6); DP(7); DP(8); DP(9); DP(10); DP(11); });
    probe("vpdpbusd, 8 sums", 8, [] { DB(0); DB(1); DB(2); DB(3); DB(4); DB(5); DB(6); DB(7); });
    probe("vfmadd231ps, 4 sums", 8, [] { FM(0); FM(1); FM(2); FM(3); FM(0); FM(1); FM(2); FM(3); });
    probe("vfmadd231ps, 8 sums", 8, [] { FM(0); FM(1); FM(2); FM(3); FM(4); FM(5); FM(6); FM(7); });
    probe("vdpbf16ps, 4 sums", 8, [] { BF(0); BF(1); BF(2); BF(3); BF(0); BF(1); BF(2); BF(3); });
    probe("vdpbf16ps, 8 sums", 8, [] { BF(0); BF(1); BF(2); BF(3); BF(4); BF(5); BF(6); BF(7); });
    std::printf("(b) 8 vpdpwssd with others between them\n");
    probe("alone", 8, [] { DP(0); DP(1); DP(2); DP(3); DP(4); DP(5); DP(6); DP(7); });
    probe("+ 2 vpermw", 8, [] { DP(0); DP(1); PW(8); DP(2); DP(3); DP(4); DP(5); PW(9); DP(6); DP(7); });
    probe("+ 2 vpmovsxbw", 8, [] { DP(0); DP(1); SX(8); DP(2); DP(3); DP(4); DP(5); SX(9); DP(6); DP(7); });
    probe("+ 2 vpmovsxbw + 2 vpermw", 8, [] { DP(0); SX(10); DP(1); PW(8); DP(2); DP(3); SX(11); DP(4); DP(5); PW(9); DP(6); DP(7); });
    probe("+ 4 vpunpcklbw", 8, [] { DP(0); UN(10); DP(1); UN(8); DP(2); DP(3); UN(11); DP(4); DP(5); UN(9); DP(6); DP(7); });
    probe("+ 1 vpermb", 8, [] { DP(0); DP(1); DP(2); DP(3); PB(8); DP(4); DP(5); DP(6); DP(7); });
    probe("+ 4 vscalefps", 8, [] { DP(0); SF(10); DP(1); SF(8); DP(2); DP(3); SF(11); DP(4); DP(5); SF(9); DP(6); DP(7); });
    probe("+ 4 vfmadd231ps", 8, [] { DP(0); FM(10); DP(1); FM(8); DP(2); DP(3); FM(11); DP(4); DP(5); FM(9); DP(6); DP(7); });
    // clang-format on
  }
}
