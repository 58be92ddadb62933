// kernels/gemm.cpp — linear layers and their gradients over oneDNN's sgemm (see gemm.h for why).
#include "kernels/gemm.h"

#include <algorithm>

#include <omp.h>

#include <oneapi/dnnl/dnnl.h>

#include "mha/error.h"
#include "mha/threads.h"

namespace mha::kernels {

namespace {

// C is cut into tiles whose sizes depend on the shape alone, never on the thread count, and each
// tile is one single-threaded oneDNN call over the whole of k: every element of C is then summed
// in the same order whatever the number of threads (docs/semantics.md, 'Determinism'). oneDNN's
// own threading does not promise that: on an AVX2-only Zen it divides some shapes' work
// differently between 2 threads than on 1 (a 300×64×64 product differs in its last bits), which
// broke Module.BitwiseIdenticalForAnyThreadCount on that CPU. Tiles of at most kTileM × kTileN
// keep each call large enough that oneDNN's packing of A and B costs a few percent of its FMAs.
constexpr int64_t kTileM = 256;
constexpr int64_t kTileN = 512;
// Products with A transposed (the weight gradients dW = dYᵀ·X, whose k is the batch's rows) run as
// a fixed sequence of calls over k chunks of at most kChunkK, each adding onto the tile (beta = 1
// after the first). On one long-k call, oneDNN's sgemm runs these at 100–130 GFLOP/s when A's
// rows are ≥ 3 KiB apart (a module's (N, 3·E) projection gradient), against 140–175 in chunks of
// 128–192 (single-threaded, k = 4096, Intel Xeon with AVX-512; the other layouts gain nothing).
// The chunks depend on k alone, so the bits still do not depend on the thread count.
constexpr int64_t kChunkK = 192;

/// n split into ⌈n / most⌉ near-equal parts, each a multiple of `align` (the last takes the rest).
int64_t part_size(int64_t n, int64_t most, int64_t align) {
  const int64_t parts = (n + most - 1) / most;
  const int64_t size = (n + parts - 1) / parts;
  return std::min(n, (size + align - 1) / align * align);
}

/// sgemm() below, and when `bias` is given (n floats), C's rows then have it added, tile by tile:
/// linear()'s bias, added by the thread that computed the tile while the tile is still in L2 (256 ×
/// 512 floats, 512 KiB). Seeding C with the bias for the GEMM to add onto (beta = 1) cost a pass
/// that had to read every line of C from memory before the GEMM wrote it: 4.7% of a B=64, T=128
/// module call's samples, against well under 1% for the add from L2.
void tiled_sgemm(Trans trans_a, Trans trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc, int threads,
                 const float* bias) {
  if (m == 0 || n == 0) return;
  // An empty sum (a layer with no inputs, a batch with no rows): C = beta·C (+ bias), which oneDNN
  // refuses for the zero leading dimensions that come with it. No bias adds nothing (not +0, which
  // would turn a −0 into +0), and beta = 0 with a bias gives the bias itself.
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float& x = c[i * ldc + j];
        x = beta == 0.0f ? 0.0f : beta * x;
        if (bias) x = beta == 0.0f ? bias[j] : x + bias[j];
      }
    return;
  }
  const char ta = trans_a == Trans::Yes ? 'T' : 'N', tb = trans_b == Trans::Yes ? 'T' : 'N';
  const int64_t tm = part_size(m, kTileM, 8), tn = part_size(n, kTileN, 16);
  const int64_t tiles_m = (m + tm - 1) / tm, tiles_n = (n + tn - 1) / tn, tiles = tiles_m * tiles_n;
  const int64_t tk = ta == 'T' ? part_size(k, kChunkK, 16) : k;
  // op(A) rows i0.. over terms k0.. start at a + i0·lda + k0 (A as stored, 'N') or a + k0·lda + i0
  // (Aᵀ stored, 'T'); op(B) columns j0.. over terms k0.. at b + k0·ldb + j0 ('N') or b + j0·ldb + k0 ('T').
  const auto tile = [&](int64_t t) {
    const int64_t i0 = t / tiles_n * tm, j0 = t % tiles_n * tn;
    const int64_t mt = std::min(tm, m - i0), nt = std::min(tn, n - j0);
    dnnl_status_t done = dnnl_success;
    for (int64_t k0 = 0; k0 < k && done == dnnl_success; k0 += tk)
      done = dnnl_sgemm(ta, tb, mt, nt, std::min(tk, k - k0), alpha, a + (ta == 'N' ? i0 * lda + k0 : k0 * lda + i0),
                        lda, b + (tb == 'N' ? k0 * ldb + j0 : j0 * ldb + k0), ldb, k0 == 0 ? beta : 1.0f,
                        c + i0 * ldc + j0, ldc);
    if (bias && done == dnnl_success)
      for (int64_t i = i0; i < i0 + mt; ++i) {
        float* row = c + i * ldc;
        for (int64_t j = j0; j < j0 + nt; ++j) row[j] += bias[j];
      }
    return done;
  };
  const int want = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(resolve_threads(threads), tiles)));
  dnnl_status_t status = dnnl_success;
  if (want == 1 || omp_in_parallel()) {
    // oneDNN runs single-threaded inside a parallel region; outside one, tell it to.
    const int before = omp_get_max_threads();
    if (before != 1) omp_set_num_threads(1);
    for (int64_t t = 0; t < tiles && status == dnnl_success; ++t) status = tile(t);
    if (before != 1) omp_set_num_threads(before);
  } else {
#pragma omp parallel num_threads(want)
    {
      // One oneDNN thread per tile, said explicitly: oneDNN sizes its threads from
      // omp_get_max_threads() unless omp_in_parallel(), and a team the runtime shrank to one
      // thread (OMP_DYNAMIC=true, OMP_THREAD_LIMIT=1) is an inactive region, where it planned for
      // more threads than it then got and left parts of C unwritten (NaN and inf in a module's
      // output). This sets the calling thread's own copy of the setting, gone with the region.
      omp_set_num_threads(1);
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < tiles; ++t) {
        const dnnl_status_t s = tile(t);
        if (s != dnnl_success) {
#pragma omp critical(mha_sgemm_status)
          status = s;
        }
      }
    }
  }
  if (status != dnnl_success)
    fail("sgemm: oneDNN failed (status ", static_cast<int>(status), ") for m=", m, " n=", n, " k=", k);
}

}  // namespace

void sgemm(Trans trans_a, Trans trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc, int threads) {
  tiled_sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, threads, nullptr);
}

void linear(const float* x, int64_t rows, int64_t in, int64_t ldx, const float* w, int64_t out, int64_t ldw,
            const float* bias, float* y, int64_t ldy, int threads) {
  if (rows == 0 || out == 0) return;
  // The bias added to each tile of y right after its product, while the tile is in L2.
  tiled_sgemm(Trans::No, Trans::Yes, rows, out, in, 1.0f, x, ldx, w, ldw, 0.0f, y, ldy, threads, bias);
}

void linear_backward_input(const float* dy, int64_t rows, int64_t out, int64_t lddy, const float* w, int64_t in,
                           int64_t ldw, float* dx, int64_t lddx, int threads) {
  sgemm(Trans::No, Trans::No, rows, in, out, 1.0f, dy, lddy, w, ldw, 0.0f, dx, lddx, threads);
}

void linear_backward_params(const float* dy, int64_t rows, int64_t out, int64_t lddy, const float* x, int64_t in,
                            int64_t ldx, float* dw, int64_t lddw, float* db, int threads) {
  if (db) {
    // Column sums in double, rows in order: a chunk of columns at a time with the rows outermost,
    // so each row's chunk is read contiguously (a column at a time strode across every row's
    // cache line: ~3% of a training step at T=4096). Each column adds the same terms in the same
    // order as a column-by-column loop, so the bits are the same, whichever thread sums the chunk
    // and however many columns one instruction adds. (One thread, one column at a time, took
    // 4–5 ms of a module's training step at T=4096, E=512: 0.5–1%.)
    constexpr int64_t kChunk = 64;
    const int64_t chunks = (out + kChunk - 1) / kChunk;
    const int team = static_cast<int>(std::min<int64_t>(omp_in_parallel() ? 1 : resolve_threads(threads), chunks));
#pragma omp parallel for schedule(static) num_threads(team)
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const int64_t c0 = chunk * kChunk, nc = std::min(kChunk, out - c0);
      double sum[kChunk] = {};
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = dy + r * lddy + c0;
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) sum[c] += row[c];
      }
      for (int64_t c = 0; c < nc; ++c) db[c0 + c] = static_cast<float>(sum[c]);
    }
  }
  sgemm(Trans::Yes, Trans::No, out, in, rows, 1.0f, dy, lddy, x, ldx, 0.0f, dw, lddw, threads);
}

}  // namespace mha::kernels
