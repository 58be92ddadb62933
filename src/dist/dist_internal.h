// What the schemes of src/dist share beyond the public header.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mha/dist.h"
#include "mha/masks.h"
#include "mha/tensor.h"

namespace mha::dist {

int comm_size(MPI_Comm comm);
int comm_rank(MPI_Comm comm);
/// n as MPI's int count; mha::Error naming `what` when it does not fit.
int mpi_count(int64_t n, const char* what);

/// Empty when `layout` is Contiguous or Zigzag, else the message (checked before any rank cuts a
/// sequence with it: sequence_segments throws on that rank alone).
std::string layout_error(const char* fn, SeqLayout layout);

/// Empty when `causal` (for global lengths seq_q, seq_k ≥ 0) is in range for every rank's inner
/// sdpa, else the message: a window in [0, 2⁴⁰], and an offset whose blocks' local offsets
/// q0 − k0 + offset (|q0 − k0| < max(seq_q, seq_k)) stay within sdpa's ±2⁴⁰. Checked before
/// any exchange and shared with check_collectively, so that no rank throws alone from inside
/// the ring while the others wait on it.
std::string causal_range_error(const char* fn, const Causal& causal, int64_t seq_q, int64_t seq_k);

/// What of `causal` must agree between ranks, as check_same_everywhere's values: the alignment,
/// the offset where Align::Offset uses it (top_left's and bottom_right's raw field is unused and
/// may differ) and the window.
std::vector<int64_t> causal_signature(const Causal& causal);

/// A float's bits for check_same_everywhere (−1 for none): ranks must agree to the bit.
int64_t float_bits(std::optional<float> x);

/// Rows [first, first + count) of a (B, H, T, D) view along axis 2.
template <class T>
View4<T> rows_of(View4<T> v, int64_t first, int64_t count) {
  v.data += first * v.stride[2];
  v.shape[2] = count;
  return v;
}

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace mha::dist
