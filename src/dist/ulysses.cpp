// Ulysses: sequence shards → head shards (one MPI_Alltoallv per tensor), the fused kernel on h/P
// heads of the whole sequence, and one all-to-all back. The causal mask and the key padding are then
// the single-process ones (global positions), so the result is the single-process kernel's on those
// heads, exactly.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "dist/dist_internal.h"
#include "mha/dist.h"
#include "mha/error.h"
#include "mha/sdpa.h"

namespace mha::dist {

namespace {

/// x (B, H, T_local, D), this rank's contiguous rows → (B, H/P, T, D), this rank's heads.
Tensor sequence_to_heads(MPI_Comm comm, const Tensor& x, int64_t T) {
  const int P = comm_size(comm), me = comm_rank(comm);
  const int64_t B = x.size(0), H = x.size(1), Tl = x.size(2), D = x.size(3), Hp = H / P;
  std::vector<float> send(static_cast<size_t>(x.numel()));
  std::vector<int> scount(static_cast<size_t>(P)), sdisp(static_cast<size_t>(P)), rcount(static_cast<size_t>(P)),
      rdisp(static_cast<size_t>(P));
  int64_t pos = 0, rpos = 0;
  for (int j = 0; j < P; ++j) {
    sdisp[static_cast<size_t>(j)] = mpi_count(pos, "ulysses_attention");
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hh = j * Hp; hh < (j + 1) * Hp; ++hh) {
        std::copy_n(x.data() + ((b * H + hh) * Tl) * D, Tl * D, send.data() + pos);
        pos += Tl * D;
      }
    scount[static_cast<size_t>(j)] = mpi_count(pos - sdisp[static_cast<size_t>(j)], "ulysses_attention");
    const int64_t n = B * Hp * local_length(T, P, j, SeqLayout::Contiguous) * D;
    rcount[static_cast<size_t>(j)] = mpi_count(n, "ulysses_attention");
    rdisp[static_cast<size_t>(j)] = mpi_count(rpos, "ulysses_attention");
    rpos += n;
  }
  std::vector<float> recv(static_cast<size_t>(rpos));
  MPI_Alltoallv(send.data(), scount.data(), sdisp.data(), MPI_FLOAT, recv.data(), rcount.data(), rdisp.data(),
                MPI_FLOAT, comm);
  Tensor out({B, Hp, T, D});
  for (int j = 0; j < P; ++j) {
    const Segment s = sequence_segments(T, P, j, SeqLayout::Contiguous)[0];
    const float* src = recv.data() + rdisp[static_cast<size_t>(j)];
    for (int64_t bh = 0; bh < B * Hp; ++bh)
      std::copy_n(src + bh * s.length * D, s.length * D, out.data() + (bh * T + s.start) * D);
  }
  (void)me;
  return out;
}

/// y (B, H/P, T, D), this rank's heads → (B, H, T_local, D), this rank's rows.
Tensor heads_to_sequence(MPI_Comm comm, const Tensor& y, int64_t H) {
  const int P = comm_size(comm), me = comm_rank(comm);
  const int64_t B = y.size(0), Hp = y.size(1), T = y.size(2), D = y.size(3);
  const int64_t Tl = local_length(T, P, me, SeqLayout::Contiguous);
  std::vector<int> scount(static_cast<size_t>(P)), sdisp(static_cast<size_t>(P)), rcount(static_cast<size_t>(P)),
      rdisp(static_cast<size_t>(P));
  std::vector<float> send(static_cast<size_t>(y.numel()));
  int64_t pos = 0;
  for (int j = 0; j < P; ++j) {
    const Segment s = sequence_segments(T, P, j, SeqLayout::Contiguous)[0];
    sdisp[static_cast<size_t>(j)] = mpi_count(pos, "ulysses_attention");
    for (int64_t bh = 0; bh < B * Hp; ++bh) {
      std::copy_n(y.data() + (bh * T + s.start) * D, s.length * D, send.data() + pos);
      pos += s.length * D;
    }
    scount[static_cast<size_t>(j)] = mpi_count(pos - sdisp[static_cast<size_t>(j)], "ulysses_attention");
    rcount[static_cast<size_t>(j)] = mpi_count(B * Hp * Tl * D, "ulysses_attention");
    rdisp[static_cast<size_t>(j)] = mpi_count(int64_t{j} * B * Hp * Tl * D, "ulysses_attention");
  }
  std::vector<float> recv(static_cast<size_t>(B * H * Tl * D));
  MPI_Alltoallv(send.data(), scount.data(), sdisp.data(), MPI_FLOAT, recv.data(), rcount.data(), rdisp.data(),
                MPI_FLOAT, comm);
  Tensor out({B, H, Tl, D});
  for (int j = 0; j < P; ++j)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hh = 0; hh < Hp; ++hh)
        std::copy_n(recv.data() + rdisp[static_cast<size_t>(j)] + (b * Hp + hh) * Tl * D, Tl * D,
                    out.data() + ((b * H + j * Hp + hh) * Tl) * D);
  return out;
}

}  // namespace

RingResult ulysses_attention(MPI_Comm comm, const Tensor& q, const Tensor& k, const Tensor& v,
                             const BoolTensor& key_padding, int64_t seq_q, int64_t seq_k,
                             const UlyssesOptions& options) {
  const int P = comm_size(comm), me = comm_rank(comm);
  std::string err;
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    err = "ulysses_attention: q, k, v must be 4-D (B, h, T_local, d); got " + shape_str(q.shape()) + ", " +
          shape_str(k.shape()) + ", " + shape_str(v.shape());
  else if (seq_q < 0 || seq_k < 0)
    err = "ulysses_attention: negative global length";
  else if (k.size(1) <= 0 || q.size(1) % k.size(1) != 0)
    err = "ulysses_attention: k/v heads " + std::to_string(k.size(1)) + " must divide q heads " +
          std::to_string(q.size(1));
  else if (q.size(3) < 1 || v.size(3) < 1)
    err = "ulysses_attention: head dims d and d_v must be ≥ 1; got q " + shape_str(q.shape()) + ", v " +
          shape_str(v.shape());
  else if (options.scale && !std::isfinite(*options.scale))
    err = "ulysses_attention: scale must be finite";
  else if (options.threads < 0)
    err = "ulysses_attention: threads must be ≥ 0, got " + std::to_string(options.threads);
  else if (k.size(1) % P != 0)
    err = "ulysses_attention: " + std::to_string(P) + " ranks must divide the K/V head count " +
          std::to_string(k.size(1)) + " (each rank takes kv/P K/V heads and their query heads)";
  else if (q.size(2) != local_length(seq_q, P, me, SeqLayout::Contiguous) ||
           k.size(2) != local_length(seq_k, P, me, SeqLayout::Contiguous) || v.size(2) != k.size(2))
    err = "ulysses_attention: q " + shape_str(q.shape()) + ", k " + shape_str(k.shape()) + ", v " +
          shape_str(v.shape()) + " do not hold this rank's contiguous rows of seq_q " + std::to_string(seq_q) +
          " / seq_k " + std::to_string(seq_k);
  else if (k.size(0) != q.size(0) || v.size(0) != q.size(0) || v.size(1) != k.size(1) || k.size(3) != q.size(3) ||
           q.size(1) % k.size(1) != 0)
    err = "ulysses_attention: shapes do not match: q " + shape_str(q.shape()) + ", k " + shape_str(k.shape()) + ", v " +
          shape_str(v.shape());
  else if (key_padding.defined() &&
           (key_padding.dim() != 2 || key_padding.size(0) != q.size(0) || key_padding.size(1) != k.size(2)))
    err = "ulysses_attention: key_padding must be (B, T_k_local) = " + shape_str({q.size(0), k.size(2)}) + ", got " +
          shape_str(key_padding.shape());
  else
    err = causal_range_error("ulysses_attention", options.causal, seq_q, seq_k);
  check_collectively(comm, err);
  std::vector<int64_t> same{q.size(0), q.size(1), k.size(1), q.size(3), v.size(3), seq_q, seq_k};
  for (const int64_t x : causal_signature(options.causal)) same.push_back(x);
  for (const int64_t x : {int64_t{key_padding.defined() ? 1 : 0}, float_bits(options.scale)}) same.push_back(x);
  check_same_everywhere(comm, same,
                        "ulysses_attention: (B, h, kv, d, d_v, seq_q, seq_k, causal, offset, window, padding, scale)");

  const Tensor qh = sequence_to_heads(comm, q, seq_q), kh = sequence_to_heads(comm, k, seq_k),
               vh = sequence_to_heads(comm, v, seq_k);
  SdpaOptions so;
  so.scale = options.scale;
  so.masks.causal = options.causal;
  so.threads = options.threads;
  BoolTensor pad_full;
  if (key_padding.defined()) {
    // The whole (B, T_k) mask on every rank: the local rows as (B, 1, T_k_local, 1) through the same gather.
    Tensor local({key_padding.size(0), 1, key_padding.size(1), 1});
    for (int64_t i = 0; i < key_padding.numel(); ++i) local.data()[i] = key_padding.data()[i] ? 1.0f : 0.0f;
    const Tensor full = gather_sequence(comm, local, seq_k, SeqLayout::Contiguous);
    pad_full = BoolTensor({q.size(0), seq_k});
    for (int64_t i = 0; i < full.numel(); ++i) pad_full.data()[i] = full.data()[i] != 0.0f ? 1 : 0;
    so.masks.key_padding.view = View4<const uint8_t>{pad_full.data(), {q.size(0), 1, 1, seq_k}, {seq_k, 0, 0, 1}};
  }
  Tensor out_h({qh.size(0), qh.size(1), seq_q, v.size(3)}), lse_h({qh.size(0), qh.size(1), seq_q, 1});
  SdpaOutputs outs;
  outs.out = out_h.view4();
  outs.lse = lse_h.view4();
  sdpa(qh.view4(), kh.view4(), vh.view4(), so, outs);
  RingResult res;
  res.out = heads_to_sequence(comm, out_h, q.size(1));
  Tensor lse = heads_to_sequence(comm, lse_h, q.size(1));
  res.lse = lse.reshaped({q.size(0), q.size(1), q.size(2)});
  return res;
}

}  // namespace mha::dist
