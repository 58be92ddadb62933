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

void linear_backward_input(const float* dy, int64_t rows, int64_t out, int64_t lddy, const float* w, int64_t in,
                           int64_t ldw, float* dx, int64_t lddx) {
  if (rows == 0 || in == 0) return;
  if (out == 0) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < in; ++c) dx[r * lddx + c] = 0.0f;
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(rows), static_cast<blasint>(in),
              static_cast<blasint>(out), 1.0f, dy, static_cast<blasint>(lddy), w, static_cast<blasint>(ldw), 0.0f, dx,
              static_cast<blasint>(lddx));
}

void linear_backward_params(const float* dy, int64_t rows, int64_t out, int64_t lddy, const float* x, int64_t in,
                            int64_t ldx, float* dw, int64_t lddw, float* db) {
  if (db)
    for (int64_t c = 0; c < out; ++c) {
      double sum = 0.0;
      for (int64_t r = 0; r < rows; ++r) sum += dy[r * lddy + c];
      db[c] = static_cast<float>(sum);
    }
  if (out == 0 || in == 0) return;
  if (rows == 0) {
    for (int64_t o = 0; o < out; ++o)
      for (int64_t c = 0; c < in; ++c) dw[o * lddw + c] = 0.0f;
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<blasint>(out), static_cast<blasint>(in),
              static_cast<blasint>(rows), 1.0f, dy, static_cast<blasint>(lddy), x, static_cast<blasint>(ldx), 0.0f, dw,
              static_cast<blasint>(lddw));
}

void set_blas_threads(int threads) {
  if (threads > 0) openblas_set_num_threads(threads);
}

}  // namespace mha::kernels
