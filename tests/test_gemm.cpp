// The one GEMM every projection runs on (kernels/gemm.h): right against a double-precision loop,
// and bitwise the same for any thread count (docs/semantics.md, 'Determinism').
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/gemm.h"

namespace {

using mha::kernels::sgemm;
using mha::kernels::Trans;

struct Case {
  int64_t m, n, k;
};

std::vector<float> random_floats(int64_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = dist(gen);
  return x;
}

// C = alpha·op(A)·op(B) + beta·C for one case and transposition, with `threads` threads.
std::vector<float> run(Trans ta, Trans tb, const Case& s, float alpha, float beta, const std::vector<float>& a,
                       const std::vector<float>& b, const std::vector<float>& c0, int threads) {
  const int64_t lda = ta == Trans::No ? s.k : s.m, ldb = tb == Trans::No ? s.n : s.k;
  std::vector<float> c = c0;
  sgemm(ta, tb, s.m, s.n, s.k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), s.n, threads);
  return c;
}

// Shapes around the tile edges (256 rows, 512 columns of C), odd sizes, 0 and 1, the shapes whose
// bits oneDNN's own threading changed with the thread count on an AVX2 Zen, and k around the
// edges of the chunks that products with A transposed are summed in (192 terms at most).
const Case kCases[] = {{300, 64, 64},   {300, 64, 192}, {150, 64, 64},  {300, 192, 64}, {1, 1, 1}, {1, 1536, 64},
                       {257, 513, 7},   {513, 97, 33},  {7, 5, 0},      {0, 5, 3},      {5, 0, 3}, {33, 1, 300},
                       {512, 1024, 16}, {20, 24, 193},  {260, 40, 385}, {9, 530, 1000}};

TEST(Gemm, MatchesDoublePrecisionForEveryTransposition) {
  for (const Case& s : kCases)
    for (Trans ta : {Trans::No, Trans::Yes})
      for (Trans tb : {Trans::No, Trans::Yes}) {
        const auto a = random_floats(s.m * s.k, 1), b = random_floats(s.k * s.n, 2), c0 = random_floats(s.m * s.n, 3);
        const float alpha = 0.75f, beta = s.k == 0 ? 0.5f : 1.0f;
        const auto c = run(ta, tb, s, alpha, beta, a, b, c0, 2);
        for (int64_t i = 0; i < s.m; ++i)
          for (int64_t j = 0; j < s.n; ++j) {
            double want = beta * c0[i * s.n + j];
            for (int64_t p = 0; p < s.k; ++p) {
              const double av = ta == Trans::No ? a[i * s.k + p] : a[p * s.m + i];
              const double bv = tb == Trans::No ? b[p * s.n + j] : b[j * s.k + p];
              want += alpha * av * bv;
            }
            ASSERT_NEAR(c[i * s.n + j], want, 1e-5 * (1.0 + static_cast<double>(s.k)))
                << s.m << "x" << s.n << "x" << s.k << " at (" << i << ", " << j << ")";
          }
      }
}

// beta = 0 overwrites C without reading it (BLAS's rule), also when k is summed in chunks: C full
// of NaN gives the product alone.
TEST(Gemm, BetaZeroNeverReadsC) {
  for (const Case& s : kCases)
    for (Trans ta : {Trans::No, Trans::Yes}) {
      const auto a = random_floats(s.m * s.k, 7), b = random_floats(s.k * s.n, 8);
      const std::vector<float> zeros(static_cast<size_t>(s.m * s.n), 0.0f),
          nans(zeros.size(), std::numeric_limits<float>::quiet_NaN());
      const auto from_zeros = run(ta, Trans::No, s, 1.0f, 0.0f, a, b, zeros, 2);
      const auto from_nans = run(ta, Trans::No, s, 1.0f, 0.0f, a, b, nans, 2);
      EXPECT_TRUE(from_zeros.empty() ||
                  std::memcmp(from_zeros.data(), from_nans.data(), sizeof(float) * from_zeros.size()) == 0)
          << s.m << "x" << s.n << "x" << s.k;
    }
}

TEST(Gemm, BitwiseIdenticalForAnyThreadCount) {
  for (const Case& s : kCases)
    for (Trans ta : {Trans::No, Trans::Yes})
      for (Trans tb : {Trans::No, Trans::Yes}) {
        const auto a = random_floats(s.m * s.k, 4), b = random_floats(s.k * s.n, 5), c0 = random_floats(s.m * s.n, 6);
        const auto one = run(ta, tb, s, 1.0f, 1.0f, a, b, c0, 1);
        for (int threads : {2, 3, 4}) {
          const auto many = run(ta, tb, s, 1.0f, 1.0f, a, b, c0, threads);
          // (an empty C has no data pointer to compare: memcmp must not be given it)
          EXPECT_TRUE(one.empty() || std::memcmp(one.data(), many.data(), sizeof(float) * one.size()) == 0)
              << s.m << "x" << s.n << "x" << s.k << " with " << threads << " threads";
        }
      }
}

// When OpenMP gives a team fewer threads than asked (OMP_DYNAMIC=true, OMP_THREAD_LIMIT=1, no
// active levels), oneDNN inside a tile planned for threads it did not get and left parts of C
// unwritten: NaN and inf in a module's projections. The same bits as with full teams, now.
TEST(Gemm, SameBitsWhenOpenMPGivesFewerThreadsThanAsked) {
  const Case s{600, 1100, 96};  // several tiles of C: the threaded path
  const auto a = random_floats(s.m * s.k, 7), b = random_floats(s.k * s.n, 8), c0 = random_floats(s.m * s.n, 9);
  const auto want = run(Trans::No, Trans::Yes, s, 1.0f, 0.0f, a, b, c0, 2);
  const int levels = omp_get_max_active_levels();
  const bool dynamic = omp_get_dynamic();
  const int max_threads = omp_get_max_threads();
  omp_set_num_threads(2);        // what oneDNN would plan for (with OMP_NUM_THREADS=1 it plans one: no bug to see)
  omp_set_max_active_levels(0);  // every region inactive: teams of one, as a shrunk team
  const auto inactive = run(Trans::No, Trans::Yes, s, 1.0f, 0.0f, a, b, c0, 2);
  omp_set_max_active_levels(levels);
  omp_set_dynamic(1);  // the runtime may shrink teams (it does on a loaded machine)
  const auto shrinkable = run(Trans::No, Trans::Yes, s, 1.0f, 0.0f, a, b, c0, 2);
  omp_set_dynamic(dynamic);
  omp_set_num_threads(max_threads);
  EXPECT_EQ(std::memcmp(inactive.data(), want.data(), sizeof(float) * want.size()), 0);
  EXPECT_EQ(std::memcmp(shrinkable.data(), want.data(), sizeof(float) * want.size()), 0);
}

}  // namespace
