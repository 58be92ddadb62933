// Distributed attention (mha/dist.h) under mpirun: ctest runs this program with P = 1, 2, 3 and 4
// ranks (tests/CMakeLists.txt). Every rank builds the same full inputs, keeps its shard, runs the
// scheme, gathers the result and compares it with the single-process library on the full inputs.
#include <mpi.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "mha/dist.h"
#include "mha/error.h"
#include "mha/module.h"
#include "mha/sdpa.h"
#include "mha/training.h"
#include "support/test_support.h"

namespace mha {
namespace {

using dist::SeqLayout;

int rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int ranks() {
  int p = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}

/// The fused kernel's float32 tolerance (the forward goldens'): atol + rtol·|want|, atol scaled by
/// the largest |want| (gradients can be large).
::testing::AssertionResult close(const Tensor& got, const Tensor& want, double atol = 2e-5, double rtol = 2e-4) {
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure() << "shape " << shape_str(got.shape()) << " vs " << shape_str(want.shape());
  double biggest = 1.0;
  for (float w : want.values())
    if (std::isfinite(w)) biggest = std::max(biggest, static_cast<double>(std::fabs(w)));
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.data()[i], w = want.data()[i];
    if (std::isinf(w) && g == w) continue;
    if (!(std::fabs(g - w) <= atol * biggest + rtol * std::fabs(w)))
      return ::testing::AssertionFailure()
             << "element " << i << ": got " << g << ", want " << w << " (rank " << rank() << " of " << ranks() << ")";
  }
  return ::testing::AssertionSuccess();
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  return a.numel() == 0 || std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<size_t>(a.numel())) == 0;
}

/// (B, h, T) lse as (B, h, T, 1) for gather_sequence.
Tensor as4(const Tensor& lse) { return lse.reshaped({lse.size(0), lse.size(1), lse.size(2), 1}); }

struct Case {
  int64_t B = 2, h = 4, kv = 2, d = 8, dv = 8, tq = 37, tk = 37;
  Causal causal;
  bool padding = false;
  bool last_rank_all_padding = false;  ///< the keys the last rank holds are all padding
  SeqLayout layout = SeqLayout::Contiguous;
  float qk_scale = 1.0f;  ///< Q and K times this: scores grow as its square (12: |lse| ≥ 64 in most rows)
};

struct Inputs {
  Tensor q, k, v;
  BoolTensor pad;  // (B, T_k) or empty
};

Inputs make_inputs(const Case& c, uint64_t seed) {
  Inputs in{mha::testing::random_tensor({c.B, c.h, c.tq, c.d}, seed),
            mha::testing::random_tensor({c.B, c.kv, c.tk, c.d}, seed + 1),
            mha::testing::random_tensor({c.B, c.kv, c.tk, c.dv}, seed + 2),
            {}};
  if (c.qk_scale != 1.0f) {
    for (float& x : in.q.values()) x *= c.qk_scale;
    for (float& x : in.k.values()) x *= c.qk_scale;
  }
  if (c.padding) {
    in.pad = BoolTensor({c.B, c.tk}, 0);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t t = 0; t < c.tk; ++t) in.pad.at({b, t}) = ((t * 7 + b * 3) % 5 == 0) ? 1 : 0;
    if (c.last_rank_all_padding)
      for (const dist::Segment& s : dist::sequence_segments(c.tk, ranks(), ranks() - 1, c.layout))
        for (int64_t b = 0; b < c.B; ++b)
          for (int64_t t = s.start; t < s.start + s.length; ++t) in.pad.at({b, t}) = 1;
  }
  return in;
}

SdpaOptions single_options(const Case& c, const Inputs& in) {
  SdpaOptions o;
  o.masks.causal = c.causal;
  if (in.pad.defined())
    o.masks.key_padding.view = View4<const uint8_t>{in.pad.data(), {c.B, 1, 1, c.tk}, {c.tk, 0, 0, 1}};
  return o;
}

dist::RingResult run_ring(const Case& c, const Inputs& in) {
  const int P = ranks(), me = rank();
  dist::RingOptions o;
  o.causal = c.causal;
  o.layout = c.layout;
  o.threads = 1;
  const BoolTensor pad = in.pad.defined() ? dist::take_sequence(in.pad, P, me, c.layout) : BoolTensor();
  return dist::ring_attention(MPI_COMM_WORLD, dist::take_sequence(in.q, P, me, c.layout),
                              dist::take_sequence(in.k, P, me, c.layout), dist::take_sequence(in.v, P, me, c.layout),
                              pad, c.tq, c.tk, o);
}

void check_ring_forward(const Case& c) {
  const Inputs in = make_inputs(c, 42);
  const SdpaResult want = sdpa(in.q, in.k, in.v, single_options(c, in), Want::Lse);
  const dist::RingResult got = run_ring(c, in);
  const Tensor out = dist::gather_sequence(MPI_COMM_WORLD, got.out, c.tq, c.layout);
  const Tensor lse = dist::gather_sequence(MPI_COMM_WORLD, as4(got.lse), c.tq, c.layout);
  EXPECT_TRUE(close(out, want.out));
  EXPECT_TRUE(close(lse.reshaped(want.lse.shape()), want.lse));
  // Run to run: bitwise identical for this P.
  const dist::RingResult again = run_ring(c, in);
  EXPECT_TRUE(bitwise_equal(again.out, got.out));
  EXPECT_TRUE(bitwise_equal(again.lse, got.lse));
}

TEST(Ring, ForwardNonCausalContiguousAndZigzag) {
  Case c;
  check_ring_forward(c);
  c.layout = SeqLayout::Zigzag;
  check_ring_forward(c);
}

TEST(Ring, ForwardCausalTopLeft) {
  for (SeqLayout layout : {SeqLayout::Contiguous, SeqLayout::Zigzag}) {
    Case c;
    c.causal = Causal::top_left();
    c.layout = layout;
    check_ring_forward(c);
  }
}

TEST(Ring, ForwardCausalBottomRightCross) {
  for (SeqLayout layout : {SeqLayout::Contiguous, SeqLayout::Zigzag}) {
    Case c;
    c.tq = 23, c.tk = 41;
    c.causal = Causal::bottom_right();
    c.layout = layout;
    check_ring_forward(c);
    c.causal = Causal::top_left();  // T_q < T_k: the last keys are hidden from every query
    check_ring_forward(c);
  }
}

TEST(Ring, ForwardSlidingWindowAndOffset) {
  Case c;
  c.layout = SeqLayout::Zigzag;
  c.causal = Causal::top_left().with_window(5);
  check_ring_forward(c);
  c.causal = Causal::with_offset(-3);  // the first three queries see nothing: zero rows, lse −inf
  check_ring_forward(c);
}

TEST(Ring, ForwardKeyPaddingAndARankOfPaddingOnly) {
  Case c;
  c.padding = true;
  check_ring_forward(c);
  c.causal = Causal::top_left();
  c.layout = SeqLayout::Zigzag;
  c.last_rank_all_padding = true;
  check_ring_forward(c);
}

TEST(Ring, ForwardMultiQueryAndDifferentValueWidth) {
  Case c;
  c.h = 3, c.kv = 1, c.dv = 5, c.B = 1, c.tq = c.tk = 19;
  c.causal = Causal::top_left();
  c.layout = SeqLayout::Zigzag;
  check_ring_forward(c);
}

TEST(Ring, ForwardTinySequencesLeaveRanksEmpty) {
  Case c;
  c.tq = c.tk = 3;  // with P = 4 and zigzag, some chunks are empty
  c.causal = Causal::top_left();
  c.layout = SeqLayout::Zigzag;
  check_ring_forward(c);
  c.layout = SeqLayout::Contiguous;
  check_ring_forward(c);
  // With key padding, every rank must exchange padding even when its own shard is empty.
  c.padding = true;
  check_ring_forward(c);
  c.layout = SeqLayout::Zigzag;
  check_ring_forward(c);
}

void check_ring_backward(const Case& c) {
  const int P = ranks(), me = rank();
  const Inputs in = make_inputs(c, 7);
  SdpaOptions so = single_options(c, in);
  const SdpaResult fwd = sdpa(in.q, in.k, in.v, so, Want::Lse);
  const Tensor d_out = mha::testing::random_tensor(fwd.out.shape(), 99);
  so.backend = Backend::Fused;
  const SdpaGradTensors want = sdpa_backward(in.q, in.k, in.v, fwd.out, d_out, fwd.lse, so);

  dist::RingOptions o;
  o.causal = c.causal;
  o.layout = c.layout;
  o.threads = 1;
  const BoolTensor pad = in.pad.defined() ? dist::take_sequence(in.pad, P, me, c.layout) : BoolTensor();
  const Tensor q = dist::take_sequence(in.q, P, me, c.layout), k = dist::take_sequence(in.k, P, me, c.layout),
               v = dist::take_sequence(in.v, P, me, c.layout), dol = dist::take_sequence(d_out, P, me, c.layout);
  const dist::RingResult r = dist::ring_attention(MPI_COMM_WORLD, q, k, v, pad, c.tq, c.tk, o);
  const dist::RingGrads g =
      dist::ring_attention_backward(MPI_COMM_WORLD, q, k, v, r.out, dol, r.lse, pad, c.tq, c.tk, o);
  EXPECT_TRUE(close(dist::gather_sequence(MPI_COMM_WORLD, g.dq, c.tq, c.layout), want.dq));
  EXPECT_TRUE(close(dist::gather_sequence(MPI_COMM_WORLD, g.dk, c.tk, c.layout), want.dk));
  EXPECT_TRUE(close(dist::gather_sequence(MPI_COMM_WORLD, g.dv, c.tk, c.layout), want.dv));
  const dist::RingGrads again =
      dist::ring_attention_backward(MPI_COMM_WORLD, q, k, v, r.out, dol, r.lse, pad, c.tq, c.tk, o);
  EXPECT_TRUE(bitwise_equal(again.dq, g.dq));
  EXPECT_TRUE(bitwise_equal(again.dk, g.dk));
  EXPECT_TRUE(bitwise_equal(again.dv, g.dv));
}

TEST(RingBackward, NonCausal) { check_ring_backward(Case{}); }

TEST(RingBackward, CausalZigzagGqaPadding) {
  Case c;
  c.causal = Causal::top_left();
  c.layout = SeqLayout::Zigzag;
  c.padding = true;
  c.last_rank_all_padding = true;
  check_ring_backward(c);
}

// Scores of ±100: rows whose |lse| ≥ 64, which the fused backward renormalises over a call's keys
// when its lse is theirs. A ring block is some of the row's keys with the whole row's lse
// (SdpaOptions::lse_over_more_keys): renormalised over the block, each block's P summed to 1.
TEST(RingBackward, LargeScoresUseTheWholeRowsLse) {
  Case c;
  c.qk_scale = 12.0f;
  c.causal = Causal::top_left();
  check_ring_backward(c);
}

TEST(RingBackward, CausalBottomRightCross) {
  Case c;
  c.tq = 23, c.tk = 41, c.dv = 6;
  c.causal = Causal::bottom_right();
  c.layout = SeqLayout::Zigzag;
  check_ring_backward(c);
}

// ---- Ulysses --------------------------------------------------------------------------------------

dist::RingResult run_ulysses(const Case& c, const Inputs& in) {
  const int P = ranks(), me = rank();
  dist::UlyssesOptions o;
  o.causal = c.causal;
  o.threads = 1;
  const BoolTensor pad = in.pad.defined() ? dist::take_sequence(in.pad, P, me, SeqLayout::Contiguous) : BoolTensor();
  return dist::ulysses_attention(MPI_COMM_WORLD, dist::take_sequence(in.q, P, me, SeqLayout::Contiguous),
                                 dist::take_sequence(in.k, P, me, SeqLayout::Contiguous),
                                 dist::take_sequence(in.v, P, me, SeqLayout::Contiguous), pad, c.tq, c.tk, o);
}

void check_ulysses(const Case& c) {
  const Inputs in = make_inputs(c, 5);
  const SdpaResult want = sdpa(in.q, in.k, in.v, single_options(c, in), Want::Lse);
  const dist::RingResult got = run_ulysses(c, in);
  EXPECT_TRUE(close(dist::gather_sequence(MPI_COMM_WORLD, got.out, c.tq, SeqLayout::Contiguous), want.out));
  const Tensor lse = dist::gather_sequence(MPI_COMM_WORLD, as4(got.lse), c.tq, SeqLayout::Contiguous);
  EXPECT_TRUE(close(lse.reshaped(want.lse.shape()), want.lse));
  const dist::RingResult again = run_ulysses(c, in);
  EXPECT_TRUE(bitwise_equal(again.out, got.out));
}

TEST(Ulysses, MatchesSingleProcess) {
  Case c;
  c.h = 24, c.kv = 12, c.d = 4, c.dv = 3;  // 12 K/V heads: P = 1, 2, 3, 4 all divide
  check_ulysses(c);
  c.causal = Causal::top_left();
  c.padding = true;
  c.last_rank_all_padding = true;
  check_ulysses(c);
  c.tq = 23, c.tk = 41;
  c.causal = Causal::bottom_right();
  check_ulysses(c);
}

TEST(Ulysses, RefusesHeadCountsNotDivisibleByRanks) {
  Case c;
  c.h = 10, c.kv = 5;
  const Inputs in = make_inputs(c, 5);
  if (ranks() == 1 || ranks() == 5) GTEST_SKIP() << "P divides 5";
  const std::string err = mha::testing::error_of([&] { run_ulysses(c, in); });
  EXPECT_NE(err.find("must divide the K/V head count 5"), std::string::npos) << err;
}

// ---- tensor-parallel heads ------------------------------------------------------------------------

TEST(Heads, MatchesSingleProcessModule) {
  for (int64_t h : {12, 24}) {
    MhaConfig cfg;
    cfg.embed_dim = 48;
    cfg.num_heads = h;
    cfg.num_kv_heads = 12;
    cfg.layout = Layout::BatchFirst;
    cfg.add_bias_kv = h == 12;
    const MultiheadAttention full(cfg, 3);
    // PyTorch initialises the biases to zero; give them values so that the bias paths count.
    MultiheadAttention biased = full;
    Tensor& in_bias = biased.params().in_proj_bias;
    for (int64_t i = 0; i < in_bias.numel(); ++i) in_bias.data()[i] = 0.01f * static_cast<float>(i % 7);
    for (float& x : biased.params().out_proj_bias.values()) x = 0.5f;
    const dist::TensorParallelAttention tp(MPI_COMM_WORLD, biased);
    const Tensor x = mha::testing::random_tensor({2, 13, 48}, 8);
    MhaForwardOptions fo;
    fo.causal = Causal::top_left();
    fo.key_padding_mask.is_padding = BoolTensor({2, 13}, 0);
    fo.key_padding_mask.is_padding.at({1, 12}) = 1;
    const MhaOutput want = biased.forward(x, x, x, fo);
    const MhaOutput got = tp.forward(x, x, x, fo);
    EXPECT_TRUE(close(got.output, want.output));
    EXPECT_TRUE(bitwise_equal(tp.forward(x, x, x, fo).output, got.output));
  }
}

TEST(Heads, RefusesWhatItCannotShard) {
  MhaConfig cfg;
  cfg.embed_dim = 20;
  cfg.num_heads = 5;
  const MultiheadAttention m(cfg, 1);
  if (ranks() > 1) {
    const std::string err = mha::testing::error_of([&] { dist::TensorParallelAttention(MPI_COMM_WORLD, m); });
    EXPECT_NE(err.find("must divide the K/V head count 5"), std::string::npos) << err;
  }
  cfg.num_heads = 4;
  cfg.embed_dim = 24;
  cfg.num_kv_heads = 0;
  if (ranks() == 3) return;  // 3 ∤ 4
  const dist::TensorParallelAttention tp(MPI_COMM_WORLD, MultiheadAttention(cfg, 1));
  MhaForwardOptions fo;
  fo.need_weights = NeedWeights::PerHead;
  const Tensor x = mha::testing::random_tensor({5, 1, 24}, 1);
  const std::string err = mha::testing::error_of([&] { tp.forward(x, x, x, fo); });
  EXPECT_NE(err.find("attention weights are not supported"), std::string::npos) << err;
  // One rank with a different input shape: every rank throws, nobody hangs in the Allreduce.
  const Tensor y = mha::testing::random_tensor({rank() == ranks() - 1 ? 6 : 5, 1, 24}, 1);
  if (ranks() > 1) {
    const std::string e2 = mha::testing::error_of([&] { tp.forward(y, y, y); });
    EXPECT_NE(e2.find("differ across ranks"), std::string::npos) << e2;
  }
}

/// The configuration is checked collectively, but each rank's parameters were checked by
/// prune_heads on that rank alone: a module whose W_O did not fit its configuration on one rank
/// threw there, and the other ranks, constructed, waited for it in their first forward() for
/// ever. Now every rank throws, naming the rank and the parameter.
TEST(Heads, ParametersThatDoNotFitOnOneRankFailOnEveryRank) {
  MhaConfig cfg;
  cfg.embed_dim = 48;
  cfg.num_heads = 12;
  cfg.layout = Layout::BatchFirst;
  MultiheadAttention m(cfg, 3);
  const int last = ranks() - 1;
  if (rank() == last) m.params().out_proj_weight = Tensor({3});
  const std::string err = mha::testing::error_of([&] { dist::TensorParallelAttention(MPI_COMM_WORLD, m); });
  EXPECT_NE(err.find("rank " + std::to_string(last) + " of " + std::to_string(ranks())), std::string::npos) << err;
  EXPECT_NE(err.find("out_proj.weight"), std::string::npos) << err;
}

/// A packed batch whose offsets differ on one rank: each rank attended within its own sequences
/// and the summed output was neither answer, silently (only whether the batch was packed was
/// compared). Now an error on every rank; equal offsets still match the single-process module.
TEST(Heads, PackedOffsetsThatDifferOnOneRankFailOnEveryRank) {
  MhaConfig cfg;
  cfg.embed_dim = 48;
  cfg.num_heads = 12;
  cfg.layout = Layout::BatchFirst;
  const MultiheadAttention full(cfg, 3);
  const dist::TensorParallelAttention tp(MPI_COMM_WORLD, full);
  const Tensor x = mha::testing::random_tensor({7, 48}, 8);
  MhaForwardOptions fo;
  VarlenBatch seqs;
  seqs.cu_seqlens_q = seqs.cu_seqlens_k = std::vector<int64_t>{0, 3, 7};
  fo.packed = seqs;
  EXPECT_TRUE(close(tp.forward(x, x, x, fo).output, full.forward(x, x, x, fo).output));
  if (ranks() == 1) return;
  if (rank() == ranks() - 1) seqs.cu_seqlens_q = seqs.cu_seqlens_k = std::vector<int64_t>{0, 4, 7};
  fo.packed = seqs;
  std::string err = mha::testing::error_of([&] { tp.forward(x, x, x, fo); });
  EXPECT_NE(err.find("packed batch"), std::string::npos) << err;
  EXPECT_NE(err.find("differ across ranks"), std::string::npos) << err;
  if (rank() == ranks() - 1) seqs.cu_seqlens_q = seqs.cu_seqlens_k = std::vector<int64_t>{0, 7};
  fo.packed = seqs;
  err = mha::testing::error_of([&] { tp.forward(x, x, x, fo); });
  EXPECT_NE(err.find("differ across ranks"), std::string::npos) << err;
}

/// The configuration check compared only whether RoPE was on and the sum of the ALiBi slopes' bits:
/// ranks with another θ, pairing or rotated width, or two heads' slopes swapped, passed, and the
/// summed output was neither rank's module's. Each now fails on every rank.
TEST(Heads, RefusesRanksWhoseRopeOrSlopesDiffer) {
  if (ranks() == 1 || 12 % ranks() != 0) GTEST_SKIP() << "needs two or more ranks dividing 12 heads";
  const bool last = rank() == ranks() - 1;
  const auto refused = [](const MhaConfig& cfg) {
    const std::string err =
        mha::testing::error_of([&] { dist::TensorParallelAttention(MPI_COMM_WORLD, MultiheadAttention(cfg, 3)); });
    EXPECT_NE(err.find("differ across ranks"), std::string::npos) << err;
  };
  MhaConfig base;
  base.embed_dim = 48;
  base.num_heads = 12;
  base.rope = Rope::half_split(10000.0);
  MhaConfig c = base;
  if (last) c.rope.theta = 500.0;
  refused(c);
  c = base;
  if (last) c.rope = Rope::interleaved(10000.0);
  refused(c);
  c = base;
  if (last) c.rope.dims = 2;
  refused(c);
  c = base;
  c.rope = Rope{};
  c.alibi_slopes = alibi_slopes(12);
  if (last) std::swap(c.alibi_slopes[10], c.alibi_slopes[11]);
  refused(c);
  // The same configurations on every rank still shard.
  c = base;
  c.alibi_slopes = alibi_slopes(12);
  EXPECT_NO_THROW(dist::TensorParallelAttention(MPI_COMM_WORLD, MultiheadAttention(c, 3)));
}

/// skip_communication ran each step on this rank's own buffers but in the source rank's row count:
/// with uneven shards (T not a multiple of P, or zigzag chunks) it read past them. It now reads a
/// copy as large as the largest block; the call completes, its output shaped as the real one's.
TEST(Ring, SkipCommunicationStaysWithinItsBlocksOnUnevenShards) {
  for (const SeqLayout layout : {SeqLayout::Contiguous, SeqLayout::Zigzag})
    for (const int64_t T : {3, 7, 13}) {
      Case c;
      c.tq = c.tk = T;
      c.layout = layout;
      c.padding = true;
      const Inputs in = make_inputs(c, 11);
      const int P = ranks(), me = rank();
      dist::RingOptions o;
      o.layout = layout;
      o.threads = 1;
      o.skip_communication = true;
      const BoolTensor pad = dist::take_sequence(in.pad, P, me, layout);
      const Tensor q = dist::take_sequence(in.q, P, me, layout), k = dist::take_sequence(in.k, P, me, layout),
                   v = dist::take_sequence(in.v, P, me, layout);
      const dist::RingResult r = dist::ring_attention(MPI_COMM_WORLD, q, k, v, pad, T, T, o);
      EXPECT_EQ(r.out.size(2), q.size(2));
      const Tensor d_out = mha::testing::random_tensor(r.out.shape(), 5);
      const dist::RingGrads g =
          dist::ring_attention_backward(MPI_COMM_WORLD, q, k, v, r.out, d_out, r.lse, pad, T, T, o);
      EXPECT_EQ(g.dk.shape(), k.shape());
    }
}

// ---- bad use: an error on every rank, never a hang ------------------------------------------------

TEST(BadUse, MismatchedGlobalShapesAcrossRanks) {
  if (ranks() == 1) GTEST_SKIP() << "needs two ranks";
  Case c;
  const Inputs in = make_inputs(c, 1);
  const int P = ranks(), me = rank();
  dist::RingOptions o;
  // The last rank believes in a different number of heads: its shard is (B, 2, …) rather than (B, 4, …).
  const Tensor q = dist::take_sequence(in.q, P, me, o.layout);
  const Tensor q_bad =
      me == P - 1 ? dist::take_sequence(mha::testing::random_tensor({c.B, 2, c.tq, c.d}, 3), P, me, o.layout) : q;
  const Tensor k = dist::take_sequence(in.k, P, me, o.layout), v = dist::take_sequence(in.v, P, me, o.layout);
  std::string err =
      mha::testing::error_of([&] { dist::ring_attention(MPI_COMM_WORLD, q_bad, k, v, {}, c.tq, c.tk, o); });
  EXPECT_NE(err.find("differ across ranks"), std::string::npos) << err;
  // A rank whose shard has the wrong number of rows: every rank reports that rank's message.
  const Tensor q_short = me == P - 1 ? mha::testing::random_tensor({c.B, c.h, q.size(2) + 1, c.d}, 3) : q;
  err = mha::testing::error_of([&] { dist::ring_attention(MPI_COMM_WORLD, q_short, k, v, {}, c.tq, c.tk, o); });
  EXPECT_NE(err.find("rank " + std::to_string(P - 1) + " of " + std::to_string(P) + ": ring_attention: q"),
            std::string::npos)
      << err;
  err = mha::testing::error_of([&] { dist::ulysses_attention(MPI_COMM_WORLD, q_short, k, v, {}, c.tq, c.tk); });
  EXPECT_NE(err.find("rank "), std::string::npos) << err;
}

// gather_sequence with arguments that disagree: a layout on the last rank only (each rank's rows cut
// for the layout it names) gave other rows with no error, or counts MPI aborted on; a negative
// length on one rank threw there alone and left the others waiting. Both are errors everywhere.
TEST(BadUse, GatherSequenceArgumentsThatDisagree) {
  if (ranks() == 1) GTEST_SKIP() << "needs two ranks";
  const int P = ranks(), me = rank();
  for (int64_t T : {8, 7}) {
    const Tensor x = mha::testing::random_tensor({1, 2, T, 3}, 5);
    const SeqLayout mine = me == P - 1 ? SeqLayout::Zigzag : SeqLayout::Contiguous;
    const Tensor local = dist::take_sequence(x, P, me, mine);
    const std::string err = mha::testing::error_of([&] { dist::gather_sequence(MPI_COMM_WORLD, local, T, mine); });
    EXPECT_NE(err.find("differ across ranks"), std::string::npos) << "T = " << T << ": " << err;
  }
  const Tensor x = mha::testing::random_tensor({1, 2, 8, 3}, 6);
  const Tensor local = dist::take_sequence(x, P, me, SeqLayout::Contiguous);
  const int64_t T = me == P - 1 ? -1 : 8;
  const std::string err =
      mha::testing::error_of([&] { dist::gather_sequence(MPI_COMM_WORLD, local, T, SeqLayout::Contiguous); });
  EXPECT_NE(err.find("seq_len must be >= 0, got -1"), std::string::npos) << err;
}

// Causal offsets and windows out of range are refused on every rank before any exchange: an inner
// sdpa that threw on one rank alone (a local block's offset q0 − k0 + offset past sdpa's ±2⁴⁰, or
// a window past 2⁴⁰) would leave the others waiting in the ring.
TEST(BadUse, CausalOffsetOrWindowOutOfRangeFailsOnEveryRank) {
  Case c;
  const Inputs in = make_inputs(c, 1);
  const int P = ranks(), me = rank();
  dist::RingOptions o;
  const Tensor q = dist::take_sequence(in.q, P, me, o.layout), k = dist::take_sequence(in.k, P, me, o.layout),
               v = dist::take_sequence(in.v, P, me, o.layout);
  const int64_t edge = int64_t{1} << 40;
  for (const Causal causal : {Causal::with_offset(std::numeric_limits<int64_t>::min()),
                              Causal::with_offset(edge),  // |offset| + max(seq_q, seq_k) > 2^40
                              Causal::with_offset(-edge + c.tk - 1), Causal::top_left().with_window(edge + 1)}) {
    SCOPED_TRACE(causal.offset);
    o.causal = causal;
    std::string err = mha::testing::error_of([&] { dist::ring_attention(MPI_COMM_WORLD, q, k, v, {}, c.tq, c.tk, o); });
    EXPECT_NE(err.find("out of range"), std::string::npos) << err;
    dist::UlyssesOptions u;
    u.causal = causal;
    err = mha::testing::error_of([&] { dist::ulysses_attention(MPI_COMM_WORLD, q, k, v, {}, c.tq, c.tk, u); });
    if (c.kv % P == 0) {
      EXPECT_NE(err.find("out of range"), std::string::npos) << err;
    }
  }
  // At the edge it runs: every key hidden from every query (lse −inf).
  o.causal = Causal::with_offset(-edge + c.tk);
  const dist::RingResult r = dist::ring_attention(MPI_COMM_WORLD, q, k, v, {}, c.tq, c.tk, o);
  for (const float x : r.lse.values()) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
}

// Found by a randomized sweep of the schemes (2026-12-07): each was a hang, a crash or a silent
// answer where the single-process library refuses. Now an error on every rank, before any exchange.
TEST(BadUse, WhatSdpaRefusesFailsOnEveryRankBeforeTheExchange) {
  const int P = ranks(), me = rank();
  // Head dim 0 with T = 2: on 3 or 4 ranks some rank holds no rows and never called the inner sdpa,
  // which threw on the others with the exchange posted (a hang, forward and backward).
  for (const bool zero_value_dim : {false, true}) {
    Case c;
    c.tq = c.tk = 2;
    (zero_value_dim ? c.dv : c.d) = 0;
    const Inputs in = make_inputs(c, 3);
    dist::RingOptions o;
    const Tensor q = dist::take_sequence(in.q, P, me, o.layout), k = dist::take_sequence(in.k, P, me, o.layout),
                 v = dist::take_sequence(in.v, P, me, o.layout);
    std::string err = mha::testing::error_of([&] { dist::ring_attention(MPI_COMM_WORLD, q, k, v, {}, 2, 2, o); });
    EXPECT_NE(err.find("head dims d and d_v must be ≥ 1"), std::string::npos) << err;
    const Tensor out({q.size(0), q.size(1), q.size(2), v.size(3)}), lse({q.size(0), q.size(1), q.size(2)});
    err = mha::testing::error_of(
        [&] { dist::ring_attention_backward(MPI_COMM_WORLD, q, k, v, out, out, lse, {}, 2, 2, o); });
    EXPECT_NE(err.find("head dims d and d_v must be ≥ 1"), std::string::npos) << err;
  }
  Case c;
  const Inputs in = make_inputs(c, 1);
  const Tensor q = dist::take_sequence(in.q, P, me, SeqLayout::Contiguous),
               k = dist::take_sequence(in.k, P, me, SeqLayout::Contiguous),
               v = dist::take_sequence(in.v, P, me, SeqLayout::Contiguous);
  // Ulysses with no K/V heads divided by zero (SIGFPE on every rank).
  const Tensor k0({c.B, 0, k.size(2), c.d}), v0({c.B, 0, k.size(2), c.dv});
  std::string err = mha::testing::error_of([&] { dist::ulysses_attention(MPI_COMM_WORLD, q, k0, v0, {}, c.tq, c.tk); });
  EXPECT_NE(err.find("k/v heads 0 must divide q heads 4"), std::string::npos) << err;
  // A sliding window without a causal alignment: the ring computed plain attention (sdpa refuses).
  dist::RingOptions o;
  o.causal = Causal::none().with_window(3);
  err = mha::testing::error_of([&] { dist::ring_attention(MPI_COMM_WORLD, q, k, v, {}, c.tq, c.tk, o); });
  EXPECT_NE(err.find("a sliding window of 3 needs a causal alignment"), std::string::npos) << err;
  // top_left's offset field is unused: ranks that leave different values there still agree.
  o.causal = Causal::top_left();
  o.causal.offset = me;
  const Tensor ring_out = dist::ring_attention(MPI_COMM_WORLD, q, k, v, {}, c.tq, c.tk, o).out;
  o.causal.offset = 0;
  EXPECT_TRUE(bitwise_equal(ring_out, dist::ring_attention(MPI_COMM_WORLD, q, k, v, {}, c.tq, c.tk, o).out));
}

// Enum values outside their enums: the ring hands its kernels offsets of its own, so a causal
// alignment that sdpa (and Ulysses, through it) refuses was read as top-left, silently; a layout
// that is neither Contiguous nor Zigzag was read as Contiguous. Both are errors on every rank,
// also when one rank alone passes the layout (its rows are cut before the collective checks).
TEST(BadUse, AlignmentsAndLayoutsOutsideTheirEnumsFailOnEveryRank) {
  const int P = ranks(), me = rank();
  Case c;
  const Inputs in = make_inputs(c, 4);
  const Tensor q = dist::take_sequence(in.q, P, me, SeqLayout::Contiguous),
               k = dist::take_sequence(in.k, P, me, SeqLayout::Contiguous),
               v = dist::take_sequence(in.v, P, me, SeqLayout::Contiguous);
  dist::RingOptions o;
  o.causal.align = static_cast<Causal::Align>(9);
  std::string err = mha::testing::error_of([&] { dist::ring_attention(MPI_COMM_WORLD, q, k, v, {}, c.tq, c.tk, o); });
  EXPECT_NE(err.find("causal alignment 9 is not a Causal::Align"), std::string::npos) << err;
  const Tensor out({q.size(0), q.size(1), q.size(2), v.size(3)}), lse({q.size(0), q.size(1), q.size(2)});
  err = mha::testing::error_of(
      [&] { dist::ring_attention_backward(MPI_COMM_WORLD, q, k, v, out, out, lse, {}, c.tq, c.tk, o); });
  EXPECT_NE(err.find("causal alignment 9 is not a Causal::Align"), std::string::npos) << err;
  dist::UlyssesOptions u;
  u.causal = o.causal;
  if (c.kv % P == 0) {
    err = mha::testing::error_of([&] { dist::ulysses_attention(MPI_COMM_WORLD, q, k, v, {}, c.tq, c.tk, u); });
    EXPECT_NE(err.find("causal alignment 9 is not a Causal::Align"), std::string::npos) << err;
  }
  const auto bad = static_cast<SeqLayout>(7);
  const std::string want = "rank " + std::to_string(P - 1) + " of " + std::to_string(P);
  o = {};
  if (me == P - 1) o.layout = bad;
  err = mha::testing::error_of([&] { dist::ring_attention(MPI_COMM_WORLD, q, k, v, {}, c.tq, c.tk, o); });
  EXPECT_NE(err.find(want + ": ring_attention: layout 7 is not a SeqLayout"), std::string::npos) << err;
  err = mha::testing::error_of(
      [&] { dist::gather_sequence(MPI_COMM_WORLD, q, c.tq, me == P - 1 ? bad : SeqLayout::Contiguous); });
  EXPECT_NE(err.find(want + ": gather_sequence: layout 7 is not a SeqLayout"), std::string::npos) << err;
  EXPECT_NE(mha::testing::error_of([&] { dist::take_sequence(in.q, P, me, bad); }).find("is not a SeqLayout"),
            std::string::npos);
}

// Each rank computes its heads' share of one attention: options that differ between ranks (one rank
// alone causal gave neither the causal nor the plain answer, silently) are an error on every rank,
// and need_lse returns every head's lse, as the single-process module does (it returned the rank's
// own h/P heads).
TEST(Heads, OptionsAgreeAcrossRanksAndLseCoversEveryHead) {
  MhaConfig cfg;
  cfg.embed_dim = 48;
  cfg.num_heads = 12;
  cfg.num_kv_heads = 12;
  cfg.layout = Layout::BatchFirst;
  if (12 % ranks() != 0) GTEST_SKIP() << "the ranks must divide 12 heads";
  const MultiheadAttention full(cfg, 3);
  const dist::TensorParallelAttention tp(MPI_COMM_WORLD, full);
  const Tensor x = mha::testing::random_tensor({2, 7, 48}, 8);
  MhaForwardOptions fo;
  fo.causal = Causal::top_left();
  fo.need_lse = true;
  const MhaOutput want = full.forward(x, x, x, fo);
  const MhaOutput got = tp.forward(x, x, x, fo);
  EXPECT_TRUE(close(got.output, want.output));
  EXPECT_TRUE(close(got.lse, want.lse));
  const Tensor x1 = mha::testing::random_tensor({7, 48}, 9);  // unbatched: lse (h, T_q)
  EXPECT_TRUE(close(tp.forward(x1, x1, x1, fo).lse, full.forward(x1, x1, x1, fo).lse));
  if (ranks() == 1) return;
  MhaForwardOptions lone = fo;
  if (rank() == ranks() - 1) lone.causal = Causal::none();
  std::string err = mha::testing::error_of([&] { tp.forward(x, x, x, lone); });
  EXPECT_NE(err.find("TensorParallelAttention::forward: options"), std::string::npos) << err;
  lone = fo;
  if (rank() == 0) lone.key_padding_mask.is_padding = BoolTensor({2, 7}, 0);
  err = mha::testing::error_of([&] { tp.forward(x, x, x, lone); });
  EXPECT_NE(err.find("differ across ranks"), std::string::npos) << err;
  MhaConfig other = cfg;
  if (rank() == 0) other.softcap = 30.0f;
  err = mha::testing::error_of([&] { dist::TensorParallelAttention(MPI_COMM_WORLD, MultiheadAttention(other, 3)); });
  EXPECT_NE(err.find("softcap"), std::string::npos) << err;
}

}  // namespace
}  // namespace mha

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  // Rank 0 lists every test; the others print only failures (read when the printer is chosen, in
  // InitGoogleTest, so set before it).
  if (me != 0) ::testing::GTEST_FLAG(brief) = true;
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  MPI_Finalize();
  return rc;
}
