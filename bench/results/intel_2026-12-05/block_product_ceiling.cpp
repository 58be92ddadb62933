// Stand-alone copy of the fused backward's micro-GEMM (6 rows x 4 vectors, AVX-512) in the kernel's
// structure (run-time strides, remainder rows in a smaller tile), timing whole block products from
// L1 against an FMA-chain peak: the record behind the README's paragraph on it (2026-12-05).
// Build: g++ -O3 -march=skylake-avx512 -std=c++20 [-DUNROLL_ALL] block_product_ceiling.cpp
// Run: ./a.out M K TRANS (64 64 0, 64 64 1, 128 64 0).
#include <hwy/highway.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>
namespace hn = hwy::HWY_NAMESPACE;
// -DUNROLL_ALL: every loop over the tile unrolled by pragma. Without it GCC 12 passes the
// accumulators through the stack around the loop over k, as it did in the kernel itself until the
// kernel's tile took the unrolled form (the commit after 376a3ed).
#ifdef UNROLL_ALL
#define MHA_UNROLL(n) _Pragma("GCC unroll 8")
#else
#define MHA_UNROLL(n)
#endif
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
struct Operands {
  const float* a;
  int64_t sai, sar;
  const float* b;
  int64_t ldb;
  float* c;
  int64_t ldc;
};

template <int MR, int NV>
HWY_INLINE void gemm_tile(const Operands& o, int64_t k, float alpha, bool accumulate) {
  const DF df;
  const int64_t N = hn::Lanes(df);
  VF acc[MR][NV];
  MHA_UNROLL(8)
  for (int i = 0; i < MR; ++i) MHA_UNROLL(4) for (int v = 0; v < NV; ++v) acc[i][v] = hn::Zero(df);
  for (int64_t r = 0; r < k; ++r) {
    VF bv[NV];
    MHA_UNROLL(4) for (int v = 0; v < NV; ++v) bv[v] = hn::LoadU(df, o.b + r * o.ldb + v * N);
    MHA_UNROLL(8)
    for (int i = 0; i < MR; ++i) {
      const VF av = hn::Set(df, o.a[i * o.sai + r * o.sar]);
      MHA_UNROLL(4) for (int v = 0; v < NV; ++v) acc[i][v] = hn::MulAdd(av, bv[v], acc[i][v]);
    }
  }
  const VF al = hn::Set(df, alpha);
  MHA_UNROLL(8)
  for (int i = 0; i < MR; ++i) MHA_UNROLL(4) for (int v = 0; v < NV; ++v) {
      float* ci = o.c + i * o.ldc + v * N;
      hn::StoreU(accumulate ? hn::MulAdd(al, acc[i][v], hn::LoadU(df, ci)) : hn::Mul(al, acc[i][v]), df, ci);
    }
}
/// The last rows (< MR) of a product: a tile of that many rows, chosen at run time.
template <int MR>
HWY_INLINE void rest(const Operands& o, int64_t rows, int64_t k, bool acc) {
  if constexpr (MR > 0) {
    if (rows == MR) return gemm_tile<MR, 4>(o, k, 1.0f, acc);
    rest<MR - 1>(o, rows, k, acc);
  }
}
template <int MR>
HWY_NOINLINE void rows(const Operands& o, int64_t m, int64_t k, bool acc) {
  const auto at = [&](int64_t i0) {
    Operands t = o;
    t.a += i0 * o.sai;
    t.c += i0 * o.ldc;
    return t;
  };
  int64_t i0 = 0;
  for (; i0 + MR <= m; i0 += MR) gemm_tile<MR, 4>(at(i0), k, 1.0f, acc);
  rest<MR - 1>(at(i0), m - i0, k, acc);
}
HWY_NOINLINE void chains(int64_t iters, float* out) {
  const DF df;
  VF a[12];
  for (int i = 0; i < 12; ++i) a[i] = hn::Set(df, 1.0f + i * 1e-7f);
  const VF x = hn::Set(df, 0.9999999f), y = hn::Set(df, 1e-8f);
  for (int64_t t = 0; t < iters; ++t)
    for (int i = 0; i < 12; ++i) a[i] = hn::MulAdd(a[i], x, y);
  VF s = a[0];
  for (int i = 1; i < 12; ++i) s = hn::Add(s, a[i]);
  hn::StoreU(s, df, out);
}
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  const int64_t m = argc > 1 ? atoi(argv[1]) : 64, k = argc > 2 ? atoi(argv[2]) : 64;
  const int trans = argc > 3 ? atoi(argv[3]) : 0;
  std::vector<float> A(256 * 256, 0.001f), B(256 * 64, 0.002f), C(256 * 64, 0.f);
  float sink[16];
  double peak = 0;
  for (int r = 0; r < 5; ++r) {
    double t = now();
    chains(2000000, sink);
    t = now() - t;
    peak = std::max(peak, 2000000.0 * 12 * 16 * 2 / t / 1e9);
  }
  Operands o{A.data(), trans ? 1 : k, trans ? m : 1, B.data(), 64, C.data(), 64};
  using RowsFn = void (*)(const Operands&, int64_t, int64_t, bool);
  const std::pair<int, RowsFn> tiles[] = {{6, rows<6>}, {4, rows<4>}, {5, rows<5>}, {7, rows<7>}};
  for (const auto& [mr, run_rows] : tiles) {
    double best = 0;
    for (int r = 0; r < 7; ++r) {
      const int64_t reps = 20000;
      double t = now();
      for (int64_t i = 0; i < reps; ++i) {
        run_rows(o, m, k, true);
      }
      t = now() - t;
      best = std::max(best, reps * 2.0 * m * 64 * k / t / 1e9);
    }
    printf("m=%ld k=%ld trans=%d MR=%d: %.1f GF/s = %.3f of chain peak %.1f\n", m, k, trans, mr, best, best / peak,
           peak);
  }
  return (int)sink[0] & 0;
}
