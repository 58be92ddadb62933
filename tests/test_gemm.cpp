// The one GEMM every projection runs on (kernels/gemm.h): right against a double-precision loop,
// and bitwise the same for any thread count (docs/semantics.md, 'Determinism').
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "kernels/gemm.h"

namespace {

using mha::kernels::linear;
using mha::kernels::linear_backward_input;
using mha::kernels::linear_backward_params;
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

// A layer's shapes: rows (the batch's tokens), in and out features; rows, in and out around the
// tile edges (256 rows, 512 columns), the weight gradient's chunks of k = rows (192), 0 and 1.
struct Layer {
  int64_t rows, in, out;
};
const Layer kLayers[] = {{0, 5, 3}, {4, 0, 3}, {1, 1, 1}, {7, 33, 17}, {193, 20, 24}, {257, 64, 513}, {385, 9, 40}};

/// The three products of one layer, with rows of every operand 3 floats longer than they are.
struct LayerProducts {
  std::vector<float> y, dx, dw, db;
};
LayerProducts layer_products(const Layer& s, const std::vector<float>& x, const std::vector<float>& w,
                             const std::vector<float>& bias, const std::vector<float>& dy, int threads) {
  LayerProducts r;
  r.y.assign(static_cast<size_t>(s.rows * (s.out + 3)), -7.0f);
  r.dx.assign(static_cast<size_t>(s.rows * (s.in + 3)), -7.0f);
  r.dw.assign(static_cast<size_t>(s.out * (s.in + 3)), -7.0f);
  r.db.assign(static_cast<size_t>(s.out), -7.0f);
  linear(x.data(), s.rows, s.in, s.in + 3, w.data(), s.out, s.in + 3, bias.data(), r.y.data(), s.out + 3, threads);
  linear_backward_input(dy.data(), s.rows, s.out, s.out + 3, w.data(), s.in, s.in + 3, r.dx.data(), s.in + 3, threads);
  linear_backward_params(dy.data(), s.rows, s.out, s.out + 3, x.data(), s.in, s.in + 3, r.dw.data(), s.in + 3,
                         r.db.data(), threads);
  return r;
}

// linear() (y = x·Wᵀ + b, the bias added to each tile of y), its input gradient (dx = dy·W) and
// parameter gradients (dW = dyᵀ·x over chunks of k, db summed in double with the rows in order):
// right against double-precision loops, the padding after each row untouched, and bitwise the
// same for 1 to 4 threads.
TEST(Gemm, LinearAndItsGradientsMatchDoublePrecisionOnAnyThreadCount) {
  for (const Layer& s : kLayers) {
    SCOPED_TRACE(::testing::Message() << "rows " << s.rows << ", in " << s.in << ", out " << s.out);
    const auto x = random_floats(s.rows * (s.in + 3), 11), w = random_floats(s.out * (s.in + 3), 12),
               bias = random_floats(s.out, 13), dy = random_floats(s.rows * (s.out + 3), 14);
    const LayerProducts got = layer_products(s, x, w, bias, dy, 2);
    const double tol = 1e-5 * (1.0 + static_cast<double>(std::max({s.rows, s.in, s.out})));
    for (int64_t i = 0; i < s.rows; ++i)
      for (int64_t o = 0; o < s.out; ++o) {
        double want = bias[o];
        for (int64_t c = 0; c < s.in; ++c) want += double(x[i * (s.in + 3) + c]) * w[o * (s.in + 3) + c];
        ASSERT_NEAR(got.y[i * (s.out + 3) + o], want, tol) << "y (" << i << ", " << o << ")";
      }
    for (int64_t i = 0; i < s.rows; ++i)
      for (int64_t c = 0; c < s.in; ++c) {
        double want = 0;
        for (int64_t o = 0; o < s.out; ++o) want += double(dy[i * (s.out + 3) + o]) * w[o * (s.in + 3) + c];
        ASSERT_NEAR(got.dx[i * (s.in + 3) + c], want, tol) << "dx (" << i << ", " << c << ")";
      }
    for (int64_t o = 0; o < s.out; ++o) {
      double sum = 0;
      for (int64_t i = 0; i < s.rows; ++i) sum += dy[i * (s.out + 3) + o];
      ASSERT_EQ(got.db[o], static_cast<float>(sum)) << "db " << o;  // the same terms in the same order
      for (int64_t c = 0; c < s.in; ++c) {
        double want = 0;
        for (int64_t i = 0; i < s.rows; ++i) want += double(dy[i * (s.out + 3) + o]) * x[i * (s.in + 3) + c];
        ASSERT_NEAR(got.dw[o * (s.in + 3) + c], want, tol) << "dW (" << o << ", " << c << ")";
      }
    }
    for (const auto& [buf, len] : {std::pair{&got.y, s.out}, std::pair{&got.dx, s.in}, std::pair{&got.dw, s.in}})
      for (size_t r = 0; r < buf->size() / static_cast<size_t>(len + 3); ++r)
        for (int64_t e = len; e < len + 3; ++e) ASSERT_EQ((*buf)[r * (len + 3) + e], -7.0f) << "padding";
    for (int threads : {1, 3, 4}) {
      const LayerProducts many = layer_products(s, x, w, bias, dy, threads);
      for (const auto& [a, b] : {std::pair{&many.y, &got.y}, std::pair{&many.dx, &got.dx}, std::pair{&many.dw, &got.dw},
                                 std::pair{&many.db, &got.db}})
        EXPECT_TRUE(a->empty() || std::memcmp(a->data(), b->data(), sizeof(float) * a->size()) == 0)
            << threads << " threads";
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
