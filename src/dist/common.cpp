// Shards of a sequence, gathering them back, and the collective argument checks every scheme uses.
#include <algorithm>
#include <cstring>
#include <limits>

#include "dist/dist_internal.h"
#include "mha/dist.h"
#include "mha/error.h"

namespace mha::dist {

std::vector<Segment> sequence_segments(int64_t seq_len, int ranks, int rank, SeqLayout layout) {
  if (ranks < 1 || rank < 0 || rank >= ranks) fail("sequence_segments: rank ", rank, " of ", ranks, " is not a rank");
  if (seq_len < 0) fail("sequence_segments: negative sequence length ", seq_len);
  if (const std::string err = layout_error("sequence_segments", layout); !err.empty()) fail(err);
  const int64_t chunks = layout == SeqLayout::Zigzag ? 2 * int64_t{ranks} : ranks;
  const auto chunk = [&](int64_t c) {
    const int64_t base = seq_len / chunks, extra = seq_len % chunks;
    const int64_t start = c * base + std::min(c, extra);
    return Segment{start, base + (c < extra ? 1 : 0)};
  };
  if (layout == SeqLayout::Zigzag) return {chunk(rank), chunk(chunks - 1 - rank)};
  return {chunk(rank)};
}

int64_t local_length(int64_t seq_len, int ranks, int rank, SeqLayout layout) {
  int64_t n = 0;
  for (const Segment& s : sequence_segments(seq_len, ranks, rank, layout)) n += s.length;
  return n;
}

Tensor take_sequence(const Tensor& x, int ranks, int rank, SeqLayout layout) {
  if (x.dim() != 4) fail("take_sequence: x must be (B, H, T, D), got ", shape_str(x.shape()));
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  const auto segs = sequence_segments(T, ranks, rank, layout);
  Tensor out({B, H, local_length(T, ranks, rank, layout), D});
  float* dst = out.data();
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (const Segment& s : segs) {
      std::copy_n(x.data() + (bh * T + s.start) * D, s.length * D, dst);
      dst += s.length * D;
    }
  return out;
}

BoolTensor take_sequence(const BoolTensor& padding, int ranks, int rank, SeqLayout layout) {
  if (padding.dim() != 2) fail("take_sequence: key padding must be (B, T), got ", shape_str(padding.shape()));
  const int64_t B = padding.size(0), T = padding.size(1);
  const auto segs = sequence_segments(T, ranks, rank, layout);
  BoolTensor out({B, local_length(T, ranks, rank, layout)});
  uint8_t* dst = out.data();
  for (int64_t b = 0; b < B; ++b)
    for (const Segment& s : segs) {
      std::copy_n(padding.data() + b * T + s.start, s.length, dst);
      dst += s.length;
    }
  return out;
}

int comm_size(MPI_Comm comm) {
  int p = 0;
  MPI_Comm_size(comm, &p);
  return p;
}
int comm_rank(MPI_Comm comm) {
  int r = 0;
  MPI_Comm_rank(comm, &r);
  return r;
}

std::string layout_error(const char* fn, SeqLayout layout) {
  if (layout == SeqLayout::Contiguous || layout == SeqLayout::Zigzag) return {};
  return std::string(fn) + ": layout " + std::to_string(static_cast<unsigned>(layout)) +
         " is not a SeqLayout (Contiguous or Zigzag)";
}

std::string causal_range_error(const char* fn, const Causal& causal, int64_t seq_q, int64_t seq_k) {
  constexpr int64_t kMax = Causal::kMaxPosition;  // sdpa's own bound on an offset and a window
  const std::string f = fn;
  // sdpa's rule: the ring hands its kernels an offset of its own, never this alignment, so an
  // alignment outside the enum was read as top-left where sdpa refuses it.
  if (causal.align != Causal::Align::None && causal.align != Causal::Align::TopLeft &&
      causal.align != Causal::Align::BottomRight && causal.align != Causal::Align::Offset)
    return f + ": causal alignment " + std::to_string(static_cast<unsigned>(causal.align)) + " is not a Causal::Align";
  if (causal.window < 0) return f + ": causal window must be ≥ 0, got " + std::to_string(causal.window);
  if (causal.window > kMax)
    return f + ": sliding window " + std::to_string(causal.window) + " is out of range [0, " + std::to_string(kMax) +
           "] (0 = unlimited)";
  if (!causal.enabled()) {
    if (causal.window > 0)  // sdpa's rule: a window is measured from a causal diagonal
      return f + ": a sliding window of " + std::to_string(causal.window) +
             " needs a causal alignment (Causal::bottom_right() etc.)";
    return {};
  }
  const int64_t offset = causal.offset_for(seq_q, seq_k), reach = std::max(seq_q, seq_k);
  if (reach > kMax || offset < reach - kMax || offset > kMax - reach)
    return f + ": causal offset " + std::to_string(offset) + " is out of range for seq_q " + std::to_string(seq_q) +
           ", seq_k " + std::to_string(seq_k) + ": |offset| + max(seq_q, seq_k) must be ≤ " + std::to_string(kMax);
  return {};
}

std::vector<int64_t> causal_signature(const Causal& causal) {
  return {static_cast<int64_t>(causal.align), causal.align == Causal::Align::Offset ? causal.offset : 0, causal.window};
}

int64_t float_bits(std::optional<float> x) {
  if (!x) return -1;
  uint32_t u = 0;
  std::memcpy(&u, &*x, sizeof u);
  return u;
}

int mpi_count(int64_t n, const char* what) {
  if (n < 0 || n > std::numeric_limits<int>::max())
    fail(what, ": a message of ", n, " elements does not fit MPI's int count; use more ranks or smaller blocks");
  return static_cast<int>(n);
}

Tensor gather_sequence(MPI_Comm comm, const Tensor& local, int64_t seq_len, SeqLayout layout) {
  const int P = comm_size(comm), me = comm_rank(comm);
  std::string err;
  // Every local check sets err, none throws: a rank that threw alone would leave the others
  // waiting in check_collectively's reduction.
  if (local.dim() != 4)
    err = "gather_sequence: local must be (B, H, T_local, D), got " + shape_str(local.shape());
  else if (seq_len < 0)
    err = "gather_sequence: seq_len must be >= 0, got " + std::to_string(seq_len);
  else if (std::string bad = layout_error("gather_sequence", layout); !bad.empty())
    err = bad;
  else if (const int64_t held = local_length(seq_len, P, me, layout); local.size(2) != held)
    err = "gather_sequence: local has " + std::to_string(local.size(2)) + " rows, this rank holds " +
          std::to_string(held) + " of " + std::to_string(seq_len);
  check_collectively(comm, err);
  const int64_t B = local.size(0), H = local.size(1), D = local.size(3);
  // The layout too: ranks that cut the sequence differently would gather other rows (or counts
  // that disagree, which MPI aborts on).
  check_same_everywhere(comm, {B, H, D, seq_len, static_cast<int64_t>(layout)}, "gather_sequence (B, H, D, T, layout)");
  std::vector<int> counts(static_cast<size_t>(P)), displs(static_cast<size_t>(P));
  int64_t total = 0;
  for (int r = 0; r < P; ++r) {
    counts[static_cast<size_t>(r)] = mpi_count(B * H * local_length(seq_len, P, r, layout) * D, "gather_sequence");
    displs[static_cast<size_t>(r)] = mpi_count(total, "gather_sequence");
    total += counts[static_cast<size_t>(r)];
  }
  std::vector<float> all(static_cast<size_t>(total));
  MPI_Allgatherv(local.data(), counts[static_cast<size_t>(me)], MPI_FLOAT, all.data(), counts.data(), displs.data(),
                 MPI_FLOAT, comm);
  Tensor out({B, H, seq_len, D});
  for (int r = 0; r < P; ++r) {
    const auto segs = sequence_segments(seq_len, P, r, layout);
    const int64_t Lr = local_length(seq_len, P, r, layout);
    const float* src = all.data() + displs[static_cast<size_t>(r)];
    for (int64_t bh = 0; bh < B * H; ++bh) {
      int64_t row = 0;
      for (const Segment& s : segs) {
        std::copy_n(src + (bh * Lr + row) * D, s.length * D, out.data() + (bh * seq_len + s.start) * D);
        row += s.length;
      }
    }
  }
  return out;
}

void check_collectively(MPI_Comm comm, const std::string& local_error) {
  const int P = comm_size(comm), me = comm_rank(comm);
  int mine = local_error.empty() ? P : me, first = P;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == P) return;
  std::string msg = me == first ? local_error : std::string();
  int len = static_cast<int>(msg.size());
  MPI_Bcast(&len, 1, MPI_INT, first, comm);
  msg.resize(static_cast<size_t>(len));
  MPI_Bcast(msg.data(), len, MPI_CHAR, first, comm);
  throw Error("rank " + std::to_string(first) + " of " + std::to_string(P) + ": " + msg);
}

void check_same_everywhere(MPI_Comm comm, const std::vector<int64_t>& values, const std::string& what) {
  const int P = comm_size(comm);
  // The count first, so that ranks passing different numbers of values cannot deadlock the gather.
  const int64_t n = static_cast<int64_t>(values.size());
  int64_t lo = n, hi = n;
  MPI_Allreduce(&n, &lo, 1, MPI_INT64_T, MPI_MIN, comm);
  MPI_Allreduce(&n, &hi, 1, MPI_INT64_T, MPI_MAX, comm);
  if (lo != hi) check_collectively(comm, what + ": ranks pass different numbers of values");
  std::vector<int64_t> all(static_cast<size_t>(n * P));
  MPI_Allgather(values.data(), static_cast<int>(n), MPI_INT64_T, all.data(), static_cast<int>(n), MPI_INT64_T, comm);
  std::string err;
  for (int r = 1; r < P && err.empty(); ++r)
    if (!std::equal(all.begin(), all.begin() + n, all.begin() + r * n)) {
      std::vector<int64_t> a(all.begin(), all.begin() + n), b(all.begin() + r * n, all.begin() + (r + 1) * n);
      err = what + " differ across ranks: rank 0 has " + shape_str(a) + ", rank " + std::to_string(r) + " has " +
            shape_str(b);
    }
  // Every rank computed the same verdict from the same gathered data; throw it collectively.
  if (!err.empty()) throw Error(err);
}

}  // namespace mha::dist
