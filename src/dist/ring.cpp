// Ring attention (context parallelism) and its backward pass.
//
// P ranks each hold their rows of Q, K and V (one segment, or two with SeqLayout::Zigzag). In step s
// (0 ≤ s < P) rank r holds the K/V block of rank r − s: it posts the receive of the next block from
// r − 1 and the send of the current one to r + 1, runs the fused kernel on every (query segment, key
// segment) pair that the causal mask does not hide entirely — with the causal offset those segments'
// global positions give — and merges each partial output into its rows by log-sum-exp:
//   m = max(l₁, l₂), w_i = exp(l_i − m), o = (w₁·o₁ + w₂·o₂) / (w₁ + w₂), l = m + log(w₁ + w₂),
// the merge the split-K decode kernel uses, done in double. The merge order is the step order, so a
// fixed P gives bitwise-identical results run to run.
//
// Backward: each rank keeps dQ for its rows; the dK/dV accumulators of a block travel the ring with
// it. The fused backward kernel, given the global lse and out (so the probabilities it recomputes
// are the global ones, and D = rowsum(dO·O) is the global one), gives each pair's exact share of dQ,
// dK and dV. A rank adds its share of a block's dK/dV to the accumulator the previous rank passes
// on (received while it computes) and sends the sum on; after P steps every block's accumulator
// is back at its owner.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "dist/dist_internal.h"
#include "mha/dist.h"
#include "mha/error.h"
#include "mha/sdpa.h"
#include "mha/training.h"

namespace mha::dist {

namespace {

constexpr int kTagK = 7101, kTagV = 7102, kTagPad = 7103, kTagDk = 7104, kTagDv = 7105;

struct Dims {
  int64_t B = 0, h = 0, kv = 0, d = 0, dv = 0, tq = 0, tk = 0;  // tq, tk: local rows
};

/// Local checks (one rank's arguments); the verdict is then shared with check_collectively.
std::string check_local(const char* fn, const Tensor& q, const Tensor& k, const Tensor& v, const BoolTensor& pad,
                        int64_t seq_q, int64_t seq_k, int P, int me, SeqLayout layout, const Causal& causal,
                        const std::optional<float>& scale, int threads) {
  const std::string f = fn;
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    return f + ": q, k, v must be 4-D (B, h, T_local, d); got " + shape_str(q.shape()) + ", " + shape_str(k.shape()) +
           ", " + shape_str(v.shape());
  if (seq_q < 0 || seq_k < 0)
    return f + ": negative global length seq_q " + std::to_string(seq_q) + " / seq_k " + std::to_string(seq_k);
  if (std::string err = layout_error(fn, layout); !err.empty()) return err;
  const int64_t want_q = local_length(seq_q, P, me, layout), want_k = local_length(seq_k, P, me, layout);
  if (q.size(2) != want_q)
    return f + ": q " + shape_str(q.shape()) + " has " + std::to_string(q.size(2)) + " rows; this rank holds " +
           std::to_string(want_q) + " of seq_q " + std::to_string(seq_q);
  if (k.size(2) != want_k || v.size(2) != want_k)
    return f + ": k " + shape_str(k.shape()) + " / v " + shape_str(v.shape()) + " must have " + std::to_string(want_k) +
           " rows (this rank's share of seq_k " + std::to_string(seq_k) + ")";
  if (k.size(0) != q.size(0) || v.size(0) != q.size(0) || v.size(1) != k.size(1) || k.size(3) != q.size(3))
    return f + ": shapes do not match: q " + shape_str(q.shape()) + ", k " + shape_str(k.shape()) + ", v " +
           shape_str(v.shape());
  if (q.size(3) < 1 || v.size(3) < 1)  // sdpa's rule, checked before the exchange: see causal_range_error
    return f + ": head dims d and d_v must be ≥ 1; got q " + shape_str(q.shape()) + ", v " + shape_str(v.shape());
  if (k.size(1) <= 0 || q.size(1) % k.size(1) != 0)
    return f + ": k/v heads " + std::to_string(k.size(1)) + " must divide q heads " + std::to_string(q.size(1));
  if (pad.defined() && (pad.dim() != 2 || pad.size(0) != q.size(0) || pad.size(1) != want_k))
    return f + ": key_padding must be (B, T_k_local) = " + shape_str({q.size(0), want_k}) + ", got " +
           shape_str(pad.shape());
  if (scale && !(std::isfinite(*scale))) return f + ": scale must be finite";
  if (std::string err = causal_range_error(fn, causal, seq_q, seq_k); !err.empty()) return err;
  if (threads < 0) return f + ": threads must be ≥ 0, got " + std::to_string(threads);
  return {};
}

/// The most rows any rank holds of a sequence of seq_k (the largest block the ring passes round).
int64_t largest_share(int64_t seq_k, int P, SeqLayout layout) {
  int64_t rows = 0;
  for (int r = 0; r < P; ++r) rows = std::max(rows, local_length(seq_k, P, r, layout));
  return rows;
}

Dims validate(const char* fn, MPI_Comm comm, const Tensor& q, const Tensor& k, const Tensor& v, const BoolTensor& pad,
              int64_t seq_q, int64_t seq_k, SeqLayout layout, const Causal& causal, const std::optional<float>& scale,
              int threads, int64_t extra) {
  const int P = comm_size(comm), me = comm_rank(comm);
  check_collectively(comm, check_local(fn, q, k, v, pad, seq_q, seq_k, P, me, layout, causal, scale, threads));
  Dims d{q.size(0), q.size(1), k.size(1), q.size(3), v.size(3), q.size(2), k.size(2)};
  std::vector<int64_t> same{d.B, d.h, d.kv, d.d, d.dv, seq_q, seq_k, static_cast<int64_t>(layout)};
  for (const int64_t x : causal_signature(causal)) same.push_back(x);
  for (const int64_t x : {int64_t{pad.defined() ? 1 : 0}, float_bits(scale), extra}) same.push_back(x);
  check_same_everywhere(
      comm, same,
      std::string(fn) + ": (B, h, kv, d, d_v, seq_q, seq_k, layout, causal, offset, window, padding, scale, mode)");
  // The largest block any step sends (K, V, the backward's accumulators, the padding) must fit
  // MPI's int count. Every rank computes this from the same global shapes, so every rank throws
  // here, before any exchange, rather than one rank alone in the middle of the ring (a hang).
  const int64_t max_rows = largest_share(seq_k, P, layout);
  const int64_t largest =
      std::max(checked_mul(checked_mul(d.B, d.kv, fn), checked_mul(max_rows, std::max(d.d, d.dv), fn), fn),
               checked_mul(d.B, max_rows, fn));
  if (largest > std::numeric_limits<int>::max())
    fail(fn, ": a K/V block of ", largest, " elements (B ", d.B, " × kv ", d.kv, " × ", max_rows, " rows × d ",
         std::max(d.d, d.dv), ") does not fit MPI's int count; use more ranks or smaller blocks");
  return d;
}

/// A K/V block (and its padding) as a step sees it: contiguous (B, kv, L, ·) for its length L; this
/// rank's own tensors in step 0, a receive buffer afterwards. has_pad is the same on every rank
/// (checked collectively); the pointers may be null where a block has no rows.
struct BlockRef {
  const float* k = nullptr;
  const float* v = nullptr;
  const uint8_t* pad = nullptr;
  bool has_pad = false;
};

/// A receive buffer for one block. A Tensor, so that it is backed by huge pages: the receive writes
/// it through the kernel's cross-process copy, which pays every 4 KiB page fault of a fresh buffer
/// (a 32 MiB block took ~0.4 s of page faults on a loaded virtual machine, against ~0.06 s).
struct BlockBuf {
  Tensor k, v;
  BoolTensor pad;
  void allocate(const Dims& d, int64_t max_rows, bool with_pad) {
    k = Tensor({d.B * d.kv * max_rows * d.d});
    v = Tensor({d.B * d.kv * max_rows * d.dv});
    if (with_pad) pad = BoolTensor({d.B * max_rows});
  }
  BlockRef ref() const { return {k.data(), v.data(), pad.data(), pad.defined()}; }
};

/// How a (query segment, key segment) pair relates under the causal mask (global positions).
enum class Visibility { Hidden, Full, Partial };

Visibility classify(const Causal& c, int64_t G, const Segment& qs, const Segment& ks, Causal* local) {
  if (qs.length == 0 || ks.length == 0) return Visibility::Hidden;
  if (!c.enabled()) {
    *local = Causal::none();
    return Visibility::Full;
  }
  const int64_t q0 = qs.start, q1 = qs.start + qs.length - 1, k0 = ks.start, k1 = ks.start + ks.length - 1;
  const int64_t W = c.window;
  // Query q sees key p when p ≤ q + G and, with a window, p > q + G − W.
  if (k0 > q1 + G) return Visibility::Hidden;
  if (W > 0 && k1 <= q0 + G - W) return Visibility::Hidden;
  if (k1 <= q0 + G && (W == 0 || k0 > q1 + G - W)) {
    *local = Causal::none();
    return Visibility::Full;
  }
  *local = Causal::with_offset(q0 - k0 + G).with_window(W);
  return Visibility::Partial;
}

/// Calls fn(qs, q_row, ks, k_row, local) for every (query segment, key segment) pair of this rank's
/// rows and a block's that the causal mask does not hide entirely, in a fixed order; q_row and k_row
/// are the segments' first local rows, local the causal rule of the pair (none when fully visible).
template <class Fn>
void for_each_visible_pair(const std::vector<Segment>& q_segs, const std::vector<Segment>& k_segs, const Causal& causal,
                           int64_t G, RingStats* stats, Fn&& fn) {
  int64_t q_row = 0;
  for (const Segment& qs : q_segs) {
    int64_t k_row = 0;
    for (const Segment& ks : k_segs) {
      Causal local;
      if (classify(causal, G, qs, ks, &local) != Visibility::Hidden) {
        fn(qs, q_row, ks, k_row, local);
        if (stats) ++stats->blocks_computed;
      } else if (qs.length > 0 && ks.length > 0 && stats) {
        ++stats->blocks_skipped;
      }
      k_row += ks.length;
    }
    q_row += qs.length;
  }
}

/// The key padding of rows [k_row, k_row + n) of a block of `rows` rows (none when it has none).
KeyPadding block_padding(const BlockRef& blk, int64_t B, int64_t k_row, int64_t n, int64_t rows) {
  KeyPadding kp;
  if (blk.has_pad) kp.view = View4<const uint8_t>{blk.pad + k_row, {B, 1, 1, n}, {rows, 0, 0, 1}};
  return kp;
}

/// Merges (o, l) — contiguous (B, h, n, dv) and (B, h, n) — into rows [row0, row0 + n) of the
/// accumulators out (B, h, T, dv) and lse (B, h, T).
void merge_into(Tensor& out, Tensor& lse, int64_t row0, const float* o, const float* l, int64_t n) {
  const int64_t BH = out.size(0) * out.size(1), T = out.size(2), dv = out.size(3);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t i = 0; i < n; ++i) {
      float* acc = out.data() + (bh * T + row0 + i) * dv;
      float& acc_l = lse.data()[bh * T + row0 + i];
      const float* part = o + (bh * n + i) * dv;
      const float part_l = l[bh * n + i];
      if (std::isnan(acc_l) || std::isnan(part_l)) {
        acc_l = std::numeric_limits<float>::quiet_NaN();
        std::fill_n(acc, dv, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      if (part_l == kNegInf) continue;  // nothing visible in this block
      if (acc_l == kNegInf) {
        acc_l = part_l;
        std::copy_n(part, dv, acc);
        continue;
      }
      const double m = std::max(acc_l, part_l);
      const double w1 = std::exp(static_cast<double>(acc_l) - m), w2 = std::exp(static_cast<double>(part_l) - m);
      const double inv = 1.0 / (w1 + w2);
      for (int64_t j = 0; j < dv; ++j) acc[j] = static_cast<float>((w1 * acc[j] + w2 * part[j]) * inv);
      acc_l = static_cast<float>(m + std::log(w1 + w2));
    }
}

struct Requests {
  std::vector<MPI_Request> r;
  void wait(RingStats* stats) {
    if (r.empty()) return;
    const double t0 = now_seconds();
    MPI_Waitall(static_cast<int>(r.size()), r.data(), MPI_STATUSES_IGNORE);
    if (stats) stats->wait_seconds += now_seconds() - t0;
    r.clear();
  }
};

/// Posts the exchange of K/V blocks: `send` (this rank's current block, `send_rows` rows) to the next
/// rank, `recv` (the block of `recv_rows` rows) from the previous one.
void post_block_exchange(MPI_Comm comm, const Dims& d, const BlockRef& send, int64_t send_rows, BlockBuf& recv,
                         int64_t recv_rows, Requests& reqs, RingStats* stats) {
  const int P = comm_size(comm), me = comm_rank(comm);
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  const size_t n = send.has_pad ? 6 : 4;
  reqs.r.resize(reqs.r.size() + n);
  MPI_Request* r = reqs.r.data() + reqs.r.size() - n;
  const int nk_in = mpi_count(d.B * d.kv * recv_rows * d.d, "ring_attention"),
            nv_in = mpi_count(d.B * d.kv * recv_rows * d.dv, "ring_attention");
  const int nk_out = mpi_count(d.B * d.kv * send_rows * d.d, "ring_attention"),
            nv_out = mpi_count(d.B * d.kv * send_rows * d.dv, "ring_attention");
  MPI_Irecv(recv.k.data(), nk_in, MPI_FLOAT, prev, kTagK, comm, r++);
  MPI_Irecv(recv.v.data(), nv_in, MPI_FLOAT, prev, kTagV, comm, r++);
  MPI_Isend(send.k, nk_out, MPI_FLOAT, next, kTagK, comm, r++);
  MPI_Isend(send.v, nv_out, MPI_FLOAT, next, kTagV, comm, r++);
  int64_t bytes = 4 * (int64_t{nk_out} + nv_out);
  if (send.has_pad) {
    const int np_in = mpi_count(d.B * recv_rows, "ring_attention"),
              np_out = mpi_count(d.B * send_rows, "ring_attention");
    MPI_Irecv(recv.pad.data(), np_in, MPI_UNSIGNED_CHAR, prev, kTagPad, comm, r++);
    MPI_Isend(send.pad, np_out, MPI_UNSIGNED_CHAR, next, kTagPad, comm, r++);
    bytes += np_out;
  }
  if (stats) stats->bytes_sent += bytes;
}

/// The ring's shared skeleton: the local block first (read in place), then P − 1 blocks from the
/// ring, each handed to `visit(block, src_rank, rows, step)` while the next one is in flight. Step s
/// receives into buffer s mod 2 while it sends the block it holds (its own, or the buffer of step
/// s − 1), so two buffers suffice, and one with two ranks.
template <class Visit>
void run_ring(MPI_Comm comm, const Dims& d, const Tensor& k, const Tensor& v, const BoolTensor& pad, int64_t seq_k,
              SeqLayout layout, bool skip_comm, RingStats* stats, Visit&& visit) {
  const int P = comm_size(comm), me = comm_rank(comm);
  const int64_t max_rows = largest_share(seq_k, P, layout);
  BlockBuf bufs[2];
  if (!skip_comm) {
    for (int i = 0; i < std::min(P - 1, 2); ++i) bufs[i].allocate(d, max_rows, pad.defined());
  } else if (P > 1) {
    // No exchange: steps 1 … P − 1 read this rank's own block again, but in the shapes of the
    // blocks they stand for (their source ranks' row counts, up to max_rows): from a copy in a
    // buffer that large, zero past the copy, so that no step reads outside it.
    bufs[0].allocate(d, max_rows, pad.defined());
    std::copy(k.data(), k.data() + k.numel(), bufs[0].k.data());
    std::copy(v.data(), v.data() + v.numel(), bufs[0].v.data());
    if (pad.defined()) std::copy(pad.data(), pad.data() + pad.numel(), bufs[0].pad.data());
  }
  BlockRef cur{k.data(), v.data(), pad.data(), pad.defined()};
  for (int s = 0; s < P; ++s) {
    const int src = (me - s + P) % P;
    const int64_t rows = local_length(seq_k, P, src, layout);
    if (skip_comm && s == 1) cur = bufs[0].ref();
    Requests reqs;
    const bool exchange = s + 1 < P && !skip_comm;
    if (exchange) {
      const int next_src = (me - s - 1 + 2 * P) % P;
      post_block_exchange(comm, d, cur, rows, bufs[s % 2], local_length(seq_k, P, next_src, layout), reqs, stats);
    }
    visit(cur, src, rows, s);
    reqs.wait(stats);
    if (exchange) cur = bufs[s % 2].ref();
  }
}

}  // namespace

RingResult ring_attention(MPI_Comm comm, const Tensor& q, const Tensor& k, const Tensor& v,
                          const BoolTensor& key_padding, int64_t seq_q, int64_t seq_k, const RingOptions& options) {
  const double t_start = now_seconds();
  RingStats* stats = options.stats;
  if (stats) *stats = {};
  const Dims d = validate("ring_attention", comm, q, k, v, key_padding, seq_q, seq_k, options.layout, options.causal,
                          options.scale, options.threads, options.skip_communication ? 1 : 0);
  const int P = comm_size(comm), me = comm_rank(comm);
  const auto q_segs = sequence_segments(seq_q, P, me, options.layout);
  const int64_t G = options.causal.enabled() ? options.causal.offset_for(seq_q, seq_k) : 0;

  RingResult res;
  res.out = Tensor({d.B, d.h, d.tq, d.dv});
  res.lse = Tensor({d.B, d.h, d.tq}, -std::numeric_limits<float>::infinity());
  int64_t max_q = 0;
  for (const Segment& s : q_segs) max_q = std::max(max_q, s.length);
  // Scratch as Tensors (huge pages when large): see BlockBuf.
  Tensor part_o({d.B * d.h * max_q * d.dv}), part_l({d.B * d.h * max_q});

  SdpaOptions so;
  so.scale = options.scale;
  so.threads = options.threads;
  const View4<const float> qv = q.view4();
  run_ring(comm, d, k, v, key_padding, seq_k, options.layout, options.skip_communication, stats,
           [&](const BlockRef& blk, int src, int64_t rows, int) {
             const double t0 = now_seconds();
             const View4<const float> kb = contiguous_view<const float>(blk.k, d.B, d.kv, rows, d.d);
             const View4<const float> vb = contiguous_view<const float>(blk.v, d.B, d.kv, rows, d.dv);
             for_each_visible_pair(
                 q_segs, sequence_segments(seq_k, P, src, options.layout), options.causal, G, stats,
                 [&](const Segment& qs, int64_t q_row, const Segment& ks, int64_t k_row, const Causal& local) {
                   so.masks.causal = local;
                   so.masks.key_padding = block_padding(blk, d.B, k_row, ks.length, rows);
                   SdpaOutputs outs;
                   outs.out = contiguous_view(part_o.data(), d.B, d.h, qs.length, d.dv);
                   outs.lse = contiguous_view(part_l.data(), d.B, d.h, qs.length, int64_t{1});
                   sdpa(rows_of(qv, q_row, qs.length), rows_of(kb, k_row, ks.length), rows_of(vb, k_row, ks.length), so,
                        outs);
                   merge_into(res.out, res.lse, q_row, part_o.data(), part_l.data(), qs.length);
                 });
             if (stats) stats->compute_seconds += now_seconds() - t0;
           });
  if (stats) stats->seconds = now_seconds() - t_start;
  return res;
}

RingGrads ring_attention_backward(MPI_Comm comm, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& d_out, const Tensor& lse, const BoolTensor& key_padding, int64_t seq_q,
                                  int64_t seq_k, const RingOptions& options) {
  const double t_start = now_seconds();
  RingStats* stats = options.stats;
  if (stats) *stats = {};
  // The forward's results must match q's rows on this rank.
  std::string err;
  if (q.dim() == 4 && v.dim() == 4) {
    const Shape want_out{q.size(0), q.size(1), q.size(2), v.size(3)};
    if (out.shape() != want_out || d_out.shape() != want_out)
      err = "ring_attention_backward: out " + shape_str(out.shape()) + " and d_out " + shape_str(d_out.shape()) +
            " must be " + shape_str(want_out);
    else if (lse.shape() != Shape{q.size(0), q.size(1), q.size(2)})
      err = "ring_attention_backward: lse " + shape_str(lse.shape()) + " must be " +
            shape_str({q.size(0), q.size(1), q.size(2)}) + " (B, h, T_q_local)";
  }
  check_collectively(comm, err);
  const Dims d = validate("ring_attention_backward", comm, q, k, v, key_padding, seq_q, seq_k, options.layout,
                          options.causal, options.scale, options.threads, options.skip_communication ? 3 : 2);
  const int P = comm_size(comm), me = comm_rank(comm);
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  const auto q_segs = sequence_segments(seq_q, P, me, options.layout);
  const int64_t G = options.causal.enabled() ? options.causal.offset_for(seq_q, seq_k) : 0;
  int64_t max_q = 0, max_k = 0;
  for (const Segment& s : q_segs) max_q = std::max(max_q, s.length);
  for (int r = 0; r < P; ++r)
    for (const Segment& s : sequence_segments(seq_k, P, r, options.layout)) max_k = std::max(max_k, s.length);
  int64_t max_rows = 0;
  for (int r = 0; r < P; ++r) max_rows = std::max(max_rows, local_length(seq_k, P, r, options.layout));

  RingGrads g;
  g.dq = Tensor(q.shape());
  // Scratch as Tensors (huge pages when large): see BlockBuf.
  Tensor dq_t({d.B * d.h * max_q * d.d}), dk_t({d.B * d.kv * max_k * d.d}), dv_t({d.B * d.kv * max_k * d.dv});
  // This rank's share of the current block's dK/dV, the accumulator arriving from the previous rank
  // and the one leaving for the next.
  const int64_t nk = d.B * d.kv * max_rows * d.d, nv = d.B * d.kv * max_rows * d.dv;
  Tensor part_k({nk}), part_v({nv}), in_k({nk}), in_v({nv}), acc_k({nk}), acc_v({nv});
  Requests acc_send, acc_recv;
  const bool comm_on = !options.skip_communication && P > 1;
  const auto post_acc_recv = [&](int64_t rows) {
    acc_recv.r.resize(2);
    MPI_Irecv(in_k.data(), mpi_count(d.B * d.kv * rows * d.d, "ring_attention_backward"), MPI_FLOAT, prev, kTagDk, comm,
              &acc_recv.r[0]);
    MPI_Irecv(in_v.data(), mpi_count(d.B * d.kv * rows * d.dv, "ring_attention_backward"), MPI_FLOAT, prev, kTagDv,
              comm, &acc_recv.r[1]);
  };

  SdpaOptions so;
  so.scale = options.scale;
  so.threads = options.threads;
  so.backend = Backend::Fused;   // the reference backward recomputes its own lse: it must see the global one
  so.lse_over_more_keys = true;  // a block's keys are some of the row's: no renormalising over them
  const View4<const float> qv = q.view4(), ov = out.view4(), dov = d_out.view4();
  const View4<const float> lv = contiguous_view<const float>(lse.data(), d.B, d.h, d.tq, int64_t{1});
  run_ring(comm, d, k, v, key_padding, seq_k, options.layout, options.skip_communication, stats,
           [&](const BlockRef& blk, int src, int64_t rows, int s) {
             if (comm_on && s > 0) post_acc_recv(rows);  // the accumulator of this block, from prev
             const double t0 = now_seconds();
             const View4<const float> kb = contiguous_view<const float>(blk.k, d.B, d.kv, rows, d.d);
             const View4<const float> vb = contiguous_view<const float>(blk.v, d.B, d.kv, rows, d.dv);
             std::fill_n(part_k.data(), d.B * d.kv * rows * d.d, 0.0f);
             std::fill_n(part_v.data(), d.B * d.kv * rows * d.dv, 0.0f);
             for_each_visible_pair(
                 q_segs, sequence_segments(seq_k, P, src, options.layout), options.causal, G, stats,
                 [&](const Segment& qs, int64_t q_row, const Segment& ks, int64_t k_row, const Causal& local) {
                   so.masks.causal = local;
                   so.masks.key_padding = block_padding(blk, d.B, k_row, ks.length, rows);
                   SdpaGrads gr;
                   gr.dq = contiguous_view(dq_t.data(), d.B, d.h, qs.length, d.d);
                   gr.dk = contiguous_view(dk_t.data(), d.B, d.kv, ks.length, d.d);
                   gr.dv = contiguous_view(dv_t.data(), d.B, d.kv, ks.length, d.dv);
                   sdpa_backward(rows_of(qv, q_row, qs.length), rows_of(kb, k_row, ks.length),
                                 rows_of(vb, k_row, ks.length), rows_of(ov, q_row, qs.length),
                                 rows_of(dov, q_row, qs.length), rows_of(lv, q_row, qs.length), so, gr);
                   // dQ rows of this query segment, dK/dV rows of this key segment of the block.
                   for (int64_t bh = 0; bh < d.B * d.h; ++bh)
                     for (int64_t i = 0; i < qs.length * d.d; ++i)
                       g.dq.data()[(bh * d.tq + q_row) * d.d + i] += dq_t.data()[bh * qs.length * d.d + i];
                   for (int64_t bh = 0; bh < d.B * d.kv; ++bh) {
                     for (int64_t i = 0; i < ks.length * d.d; ++i)
                       part_k.data()[(bh * rows + k_row) * d.d + i] += dk_t.data()[bh * ks.length * d.d + i];
                     for (int64_t i = 0; i < ks.length * d.dv; ++i)
                       part_v.data()[(bh * rows + k_row) * d.dv + i] += dv_t.data()[bh * ks.length * d.dv + i];
                   }
                 });
             if (stats) stats->compute_seconds += now_seconds() - t0;
             const int64_t n_k = d.B * d.kv * rows * d.d, n_v = d.B * d.kv * rows * d.dv;
             if (!comm_on) {
               // One rank (or the benchmark's no-communication run): this block's gradient is its share.
               if (s == 0) {
                 std::copy_n(part_k.data(), n_k, acc_k.data());
                 std::copy_n(part_v.data(), n_v, acc_v.data());
               }
               return;
             }
             acc_send.wait(stats);  // the previous accumulator has left: acc may be overwritten
             if (s > 0) {
               acc_recv.wait(stats);
               for (int64_t i = 0; i < n_k; ++i) acc_k.data()[i] = in_k.data()[i] + part_k.data()[i];
               for (int64_t i = 0; i < n_v; ++i) acc_v.data()[i] = in_v.data()[i] + part_v.data()[i];
             } else {
               std::copy_n(part_k.data(), n_k, acc_k.data());
               std::copy_n(part_v.data(), n_v, acc_v.data());
             }
             acc_send.r.resize(2);
             MPI_Isend(acc_k.data(), mpi_count(n_k, "ring_attention_backward"), MPI_FLOAT, next, kTagDk, comm,
                       &acc_send.r[0]);
             MPI_Isend(acc_v.data(), mpi_count(n_v, "ring_attention_backward"), MPI_FLOAT, next, kTagDv, comm,
                       &acc_send.r[1]);
             if (stats) stats->bytes_sent += 4 * (n_k + n_v);
           });
  g.dk = Tensor(k.shape());
  g.dv = Tensor(v.shape());
  if (comm_on) {
    // The last hop: this rank's own block, with every rank's share.
    post_acc_recv(d.tk);
    acc_recv.wait(stats);
    acc_send.wait(stats);
    std::copy_n(in_k.data(), g.dk.numel(), g.dk.data());
    std::copy_n(in_v.data(), g.dv.numel(), g.dv.data());
  } else {
    std::copy_n(acc_k.data(), g.dk.numel(), g.dk.data());
    std::copy_n(acc_v.data(), g.dv.numel(), g.dv.data());
  }
  if (stats) stats->seconds = now_seconds() - t_start;
  return g;
}

}  // namespace mha::dist
