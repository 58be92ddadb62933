// kernels/varlen.h — one sequence of a packed variable-length batch as an ordinary (B = 1) request.
//
// A packed (total, heads, d) array is viewed as (1, heads, total, d) with strides (·, d, heads·d, 1);
// sequence s is rows [cu[s], cu[s+1]) of it: the same view with its data pointer moved cu[s] rows
// on and T = cu[s+1] − cu[s]. Nothing is copied, and every kernel that handles one sequence handles
// a packed batch by handing it these slices (the reference kernels and the fused backward do; the
// fused forward builds its work items over every sequence at once to balance the threads).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/attention.h"
#include "kernels/attention_backward.h"

namespace mha::kernels {

/// Rows [start, start + len) of a (1, heads, total, ·) view.
template <class T>
View4<T> rows_of(View4<T> v, int64_t start, int64_t len) {
  if (v.data != nullptr) v.data += start * v.stride[2];
  v.shape[2] = len;
  return v;
}

inline InputView rows_of(InputView v, int64_t start, int64_t len, int64_t elem_bytes) {
  if (v.data != nullptr) v.data = static_cast<const char*>(v.data) + start * v.stride[2] * elem_bytes;
  v.shape[2] = len;
  return v;
}

inline int64_t elem_bytes(DType t) { return t == DType::BF16 ? 2 : 4; }

/// Sequence s of a packed request, as a request of its own (B = 1, no varlen).
inline SdpaParams sequence_params(const SdpaParams& p, int64_t s) {
  SdpaParams r = p;
  r.varlen = {};
  const int64_t q0 = p.varlen.cu_q[s], nq = p.varlen.cu_q[s + 1] - q0;
  const int64_t k0 = p.varlen.cu_k[s], nk = p.varlen.cu_k[s + 1] - k0;
  const int64_t eb = elem_bytes(p.dtype);
  r.q = rows_of(p.q, q0, nq, eb);
  r.k = rows_of(p.k, k0, nk, eb);
  r.v = rows_of(p.v, k0, nk, eb);
  r.out = rows_of(p.out, q0, nq);
  r.lse = rows_of(p.lse, q0, nq);
  return r;
}

inline SdpaBackwardParams sequence_params(const SdpaBackwardParams& p, int64_t s) {
  SdpaBackwardParams r = p;
  r.fwd = sequence_params(p.fwd, s);
  const int64_t q0 = p.fwd.varlen.cu_q[s], nq = p.fwd.varlen.cu_q[s + 1] - q0;
  const int64_t k0 = p.fwd.varlen.cu_k[s], nk = p.fwd.varlen.cu_k[s + 1] - k0;
  r.out = rows_of(p.out, q0, nq);
  r.dout = rows_of(p.dout, q0, nq);
  r.lse = rows_of(p.lse, q0, nq);
  r.dq = rows_of(p.dq, q0, nq);
  r.dk = rows_of(p.dk, k0, nk);
  r.dv = rows_of(p.dv, k0, nk);
  return r;
}

/// The sink gradient of a packed batch, over every row in row order (double sums; any thread count
/// gives the same bits): ∂L/∂z_h = −Σ_i e^{z_h − lse_i}·D_i, D_i = dout_i·out_i (the forward's
/// output row; a packed batch has no dropout). The per-sequence kernels, run with dsinks = null,
/// leave it to this, since each would write its own sequence's sum over the whole (h) array.
inline void packed_sinks_gradient(const SdpaBackwardParams& p) {
  const SdpaParams& f = p.fwd;
  for (int64_t h = 0; h < f.heads(); ++h) {
    double acc = 0.0;
    // Sequence by sequence, so that a row's keys are its own sequence's (row_saw_no_key): rows in order.
    for (int64_t s = 0; s < f.varlen.seqs; ++s) {
      const SdpaBackwardParams r = sequence_params(p, s);
      for (int64_t i = 0; i < r.fwd.t_q(); ++i) {
        // A row that saw no key adds nothing, also where its d out holds a NaN (0 · NaN).
        if (row_saw_no_key(r, 0, h, i)) continue;
        double dot = 0.0;
        for (int64_t c = 0; c < f.d_v(); ++c) dot += static_cast<double>(r.dout(0, h, i, c)) * r.out(0, h, i, c);
        acc -= std::exp(static_cast<double>(f.edits.sinks[h]) - r.lse(0, h, i, 0)) * dot;
      }
    }
    p.dsinks[h] = static_cast<float>(acc);
  }
}

/// Runs `one` on every sequence of a packed backward request, then the sink gradient over all.
template <class Fn>
void for_each_sequence_backward(const SdpaBackwardParams& p, const Fn& one) {
  for (int64_t s = 0; s < p.fwd.varlen.seqs; ++s) {
    SdpaBackwardParams r = sequence_params(p, s);
    r.dsinks = nullptr;
    one(r);
  }
  if (p.fwd.edits.sinks && p.dsinks) packed_sinks_gradient(p);
}

}  // namespace mha::kernels
