#include "kernels/gemm.h"

#include <cblas.h>

namespace mha::kernels {

void linear(const float* x, int64_t rows, int64_t in, int64_t ldx, const float* w, int64_t out, int64_t ldw,
            const float* bias, float* y, int64_t ldy) {
  if (rows == 0 || out == 0) return;
  float beta = 0.0f;
  if (bias) {
    // Seed y with the bias so the GEMM adds onto it (one pass over y instead of two).
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < out; ++c) y[r * ldy + c] = bias[c];
    beta = 1.0f;
  }
  if (in == 0) {
    if (!bias)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < out; ++c) y[r * ldy + c] = 0.0f;
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(rows), static_cast<blasint>(out),
              static_cast<blasint>(in), 1.0f, x, static_cast<blasint>(ldx), w, static_cast<blasint>(ldw), beta, y,
              static_cast<blasint>(ldy));
}

void set_blas_threads(int threads) {
  if (threads > 0) openblas_set_num_threads(threads);
}

}  // namespace mha::kernels
