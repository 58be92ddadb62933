// mha/dist.h — attention sharded over MPI ranks (target mha::dist; the core library stays MPI-free).
//
// Three schemes, each over a communicator the caller passes in (never MPI_COMM_WORLD behind its back):
//
//   ring_attention     context parallelism: Q, K, V split along the sequence; K/V blocks travel round
//                      the ring (MPI_Isend/Irecv of the next block overlapped with the fused kernel on
//                      the current one) and partial outputs are merged exactly by log-sum-exp. Blocks a
//                      causal mask hides entirely are skipped. With SeqLayout::Zigzag each rank holds
//                      chunks r and 2P−1−r of 2P, so every rank does the same causal work.
//   ring_attention_backward   dQ stays local; dK/dV accumulators travel the ring with their K/V block,
//                      using the global log-sum-exp the forward returned.
//   ulysses_attention  sequence shards → head shards (MPI_Alltoallv of Q, K and V, and an
//                      Allgatherv of the key padding), sdpa on h/P heads of the whole sequence, and
//                      all-to-alls of the output and lse back. P must divide the K/V head count.
//   TensorParallelAttention   the module with h/P query heads and kv/P K/V heads per rank (rows of
//                      W_Q, W_K, W_V, columns of W_O) and one MPI_Allreduce that sums the output.
//
// Every rank must call a function with the same global shapes and options (collective calls). The
// arguments are checked collectively: when one rank's arguments are bad, or the ranks disagree, every
// rank throws mha::Error with the same message (naming the rank and the argument) — never a hang.
// Results equal the single-process sdpa() within the fused kernel's tolerance (the merge by
// log-sum-exp reassociates sums), and are bitwise identical run to run and for any thread count per
// rank, for a fixed P (P changes where the sums are split).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mha/masks.h"
#include "mha/module.h"
#include "mha/tensor.h"

namespace mha::dist {

// ---- which positions of a sequence a rank holds -------------------------------------------------

/// Contiguous: rank r holds chunk r of P. Zigzag: the sequence is cut into 2P chunks and rank r holds
/// chunks r and 2P−1−r (load balance under a causal mask). Chunks differ in length by at most one
/// (the first T mod n chunks are one longer), so T need not be divisible by P.
enum class SeqLayout : uint8_t { Contiguous, Zigzag };

struct Segment {
  int64_t start = 0;   ///< global position of the first row
  int64_t length = 0;  ///< rows (may be 0 when T < chunks)
};

/// The positions of a length-T sequence that `rank` of `ranks` holds, in the order they are stored
/// locally (concatenated).
std::vector<Segment> sequence_segments(int64_t seq_len, int ranks, int rank, SeqLayout layout);
/// Σ lengths of sequence_segments(...).
int64_t local_length(int64_t seq_len, int ranks, int rank, SeqLayout layout);

/// This rank's rows of x (B, H, T, D) along axis 2: (B, H, T_local, D).
Tensor take_sequence(const Tensor& x, int ranks, int rank, SeqLayout layout);
/// This rank's columns of a key padding mask (B, T): (B, T_local).
BoolTensor take_sequence(const BoolTensor& padding, int ranks, int rank, SeqLayout layout);
/// The inverse of take_sequence across the communicator: every rank gets the full (B, H, T, D).
Tensor gather_sequence(MPI_Comm comm, const Tensor& local, int64_t seq_len, SeqLayout layout);

// ---- collective argument checks -----------------------------------------------------------------

/// Every rank calls this with its own verdict (empty = fine). When any rank has an error, every rank
/// throws mha::Error with the message of the lowest failing rank ("rank r: …").
void check_collectively(MPI_Comm comm, const std::string& local_error);
/// Throws (collectively) unless every rank passes the same values; `what` names them in the message.
void check_same_everywhere(MPI_Comm comm, const std::vector<int64_t>& values, const std::string& what);

// ---- ring attention (context parallelism) -------------------------------------------------------

/// What one call did on this rank (for benchmarks).
struct RingStats {
  double seconds = 0;          ///< wall time of the call
  double compute_seconds = 0;  ///< inside the local kernels and the merge
  double wait_seconds = 0;     ///< blocked in MPI_Wait* (communication not hidden)
  int64_t bytes_sent = 0;
  int64_t blocks_computed = 0;  ///< (query segment, key segment) pairs run through the kernel
  int64_t blocks_skipped = 0;   ///< pairs a causal mask hides entirely
};

struct RingOptions {
  std::optional<float> scale;  ///< default 1/√d
  /// Causal over global positions: Causal::top_left(), bottom_right() (T_q ≠ T_k), with_offset(n),
  /// each optionally with a sliding window.
  Causal causal;
  /// How Q and K/V are sharded (both use the same layout). Zigzag balances causal work.
  SeqLayout layout = SeqLayout::Contiguous;
  int threads = 0;             ///< per rank; 0 = library default
  RingStats* stats = nullptr;  ///< filled when set
  /// Benchmark knob: run the same local kernels on the same block shapes without any communication
  /// (the blocks keep this rank's data), to measure how much of the communication is hidden.
  /// The result is meaningless; never set it outside a benchmark.
  bool skip_communication = false;
};

struct RingResult {
  Tensor out;  ///< (B, h, T_q_local, d_v)
  Tensor lse;  ///< (B, h, T_q_local): log-sum-exp of each global score row (−inf when fully masked)
};

/// q (B, h, T_q_local, d), k (B, kv, T_k_local, d), v (B, kv, T_k_local, d_v): this rank's rows as
/// take_sequence(…, options.layout) gives them for global lengths seq_q, seq_k. key_padding: this
/// rank's (B, T_k_local) columns of a (B, T_k) mask (nonzero = padding, never read), or empty.
RingResult ring_attention(MPI_Comm comm, const Tensor& q, const Tensor& k, const Tensor& v,
                          const BoolTensor& key_padding, int64_t seq_q, int64_t seq_k, const RingOptions& options = {});

struct RingGrads {
  Tensor dq, dk, dv;  ///< this rank's rows, shaped like q, k, v
};
/// Gradients of ring_attention: out and lse are what it returned, d_out = ∂loss/∂out (local rows).
RingGrads ring_attention_backward(MPI_Comm comm, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& d_out, const Tensor& lse, const BoolTensor& key_padding, int64_t seq_q,
                                  int64_t seq_k, const RingOptions& options = {});

// ---- Ulysses (sequence ↔ head all-to-all) -------------------------------------------------------

struct UlyssesOptions {
  std::optional<float> scale;
  Causal causal;
  int threads = 0;
};
/// Same arguments as ring_attention with SeqLayout::Contiguous shards. The communicator's size
/// must divide the K/V head count (and so h).
RingResult ulysses_attention(MPI_Comm comm, const Tensor& q, const Tensor& k, const Tensor& v,
                             const BoolTensor& key_padding, int64_t seq_q, int64_t seq_k,
                             const UlyssesOptions& options = {});

// ---- tensor-parallel heads for the module -------------------------------------------------------

/// Rank r keeps query heads [r·h/P, (r+1)·h/P) and their K/V heads (kv/P of them): its rows of W_Q,
/// W_K, W_V and of the input bias, its columns of W_O; rank 0 alone keeps out_proj.bias. forward()
/// sums the ranks' partial outputs with one MPI_Allreduce, so every rank returns the full output
/// (and with need_lse every head's lse, gathered). P must divide the K/V head count. Not
/// supported: attention weights, dropout in training mode and per-head (B·h, T_q, T_k) attention
/// masks (each is refused with mha::Error on every rank).
class TensorParallelAttention {
 public:
  /// Collective: every rank passes the same full module (e.g. loaded from one checkpoint).
  TensorParallelAttention(MPI_Comm comm, const MultiheadAttention& full);
  /// Collective: same arguments as MultiheadAttention::forward, the same on every rank (shapes,
  /// masks' kinds and shapes, causal alignment and window, need_lse, mode and a packed batch's
  /// offsets are checked: a rank that differs makes every rank throw; the masks' values are the
  /// caller's to keep equal).
  MhaOutput forward(const Tensor& query, const Tensor& key, const Tensor& value,
                    const MhaForwardOptions& options = {}) const;
  const MultiheadAttention& shard() const { return shard_; }
  int64_t first_head() const { return first_head_; }

 private:
  MPI_Comm comm_;
  MultiheadAttention shard_;
  int64_t first_head_ = 0;
};

}  // namespace mha::dist
