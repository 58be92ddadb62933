// Packed variable-length sequences (sdpa_varlen, sdpa_backward_varlen): against PyTorch goldens
// written as a loop over sequences, against the per-sequence sdpa on every path (the reference
// bitwise, the fused kernels bitwise on the same target), fused vs reference on every SIMD target
// for float32 and bfloat16, threads 1/2/3 bitwise, and bad offsets.
#include <hwy/targets.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/backward_fused.h"
#include "mha/safetensors.h"
#include "mha/sdpa.h"
#include "mha/training.h"
#include "mha/weights.h"
#include "support/test_support.h"

namespace mha {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::error_of;
using testing::f32_out_tol;
using testing::for_each_fused_target;
using testing::max_abs;
using testing::random_tensor;

constexpr double kEps = std::numeric_limits<float>::epsilon();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<int64_t> offsets(const std::vector<int64_t>& lens) {
  std::vector<int64_t> cu{0};
  for (int64_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}

/// A packed batch: lengths per sequence, heads, dims, causal rule, and its tensors.
struct Packed {
  std::vector<int64_t> lens_q, lens_k;
  int64_t H = 2, KV = 1, D = 8, Dv = 8;
  Causal causal;
  Tensor q, k, v, dout;
  VarlenBatch seqs;
  // Score edits (off unless set): ALiBi slopes, softcap, sink logits, one per query head.
  std::vector<float> slopes, sinks;
  float softcap = 0.0f;

  Packed(std::vector<int64_t> lq, std::vector<int64_t> lk, int64_t h, int64_t kv, int64_t d, int64_t dv, Causal c,
         uint64_t seed)
      : lens_q(std::move(lq)), lens_k(std::move(lk)), H(h), KV(kv), D(d), Dv(dv), causal(c) {
    seqs.cu_seqlens_q = offsets(lens_q);
    seqs.cu_seqlens_k = offsets(lens_k);
    const int64_t nq = seqs.cu_seqlens_q.values().back(), nk = seqs.cu_seqlens_k.values().back();
    q = random_tensor({nq, H, D}, seed);
    k = random_tensor({nk, KV, D}, seed + 1);
    v = random_tensor({nk, KV, Dv}, seed + 2, -2.0f, 2.0f);
    dout = random_tensor({nq, H, Dv}, seed + 3);
  }
  int64_t seq_count() const { return static_cast<int64_t>(lens_q.size()); }
  int64_t longest_k() const {
    int64_t m = 1;
    for (int64_t n : lens_k) m = std::max(m, n);
    return m;
  }
  SdpaOptions options(Backend backend, int threads) const {
    SdpaOptions o;
    o.masks.causal = causal;
    o.backend = backend;
    o.threads = threads;
    o.alibi.slopes = slopes;
    o.softcap = softcap;
    if (!sinks.empty()) o.sinks.logits = sinks;
    return o;
  }
  /// out and lse of the whole packed batch.
  SdpaResult forward(Backend backend, int threads = 2) const {
    return sdpa_varlen(q, k, v, seqs, options(backend, threads), Want::Lse);
  }
  /// out and lse of the packed batch on its inputs rounded to bf16.
  SdpaResult forward_bf16(Backend backend, int threads = 2) const {
    BF16Tensor qb(q.shape()), kb(k.shape()), vb(v.shape());
    for (int64_t i = 0; i < q.numel(); ++i) qb.data()[i] = to_bf16(q.data()[i]);
    for (int64_t i = 0; i < k.numel(); ++i) kb.data()[i] = to_bf16(k.data()[i]);
    for (int64_t i = 0; i < v.numel(); ++i) vb.data()[i] = to_bf16(v.data()[i]);
    const int64_t nq = q.size(0), nk = k.size(0);
    SdpaResult r{Tensor({nq, H, Dv}), {}, Tensor({nq, H})};
    SdpaOutputs o;
    o.out = packed_view(r.out.data(), nq, H, Dv);
    o.lse = packed_view(r.lse.data(), nq, H, int64_t{1});
    sdpa_varlen(packed_view<const bf16>(qb.data(), nq, H, D), packed_view<const bf16>(kb.data(), nk, KV, D),
                packed_view<const bf16>(vb.data(), nk, KV, Dv), seqs, options(backend, threads), o);
    return r;
  }
  SdpaGradTensors backward(Backend backend, int threads = 2) const {
    const SdpaResult f = forward(Backend::Fused, threads);
    return sdpa_backward_varlen(q, k, v, f.out, dout, f.lse, seqs, options(backend, threads));
  }
  /// float32 tolerance of out (as tests/test_fused_forward.cpp derives it).
  double out_tol() const {
    const double bound = static_cast<double>(D) / std::sqrt(static_cast<double>(D)) * max_abs(q) * max_abs(k);
    return f32_out_tol(max_abs(v), longest_k(), bound);
  }
};

/// Rows [r0, r0 + n) of a packed (total, heads, d) tensor as (1, heads, n, d).
Tensor sequence_of(const Tensor& packed, int64_t r0, int64_t n) {
  const int64_t heads = packed.size(1), d = packed.size(2);
  Tensor t({1, heads, n, d});
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < d; ++c) t.at({0, h, i, c}) = packed.at({r0 + i, h, c});
  return t;
}

/// Whether `part` (1, heads, n, d) equals rows [r0, r0 + n) of `packed` bitwise.
::testing::AssertionResult rows_equal(const Tensor& packed, int64_t r0, const Tensor& part) {
  return bitwise_equal(sequence_of(packed, r0, part.size(2)), part);
}

/// A lse (total, heads) as (total, heads, 1).
Tensor as3(const Tensor& lse) { return lse.reshaped({lse.size(0), lse.size(1), 1}); }

std::vector<Packed> sweep() {
  std::vector<Packed> cases;
  uint64_t seed = 100;
  const std::vector<Causal> rules = {Causal::none(), Causal::top_left(), Causal::bottom_right(),
                                     Causal::bottom_right().with_window(5), Causal::with_offset(-2)};
  for (const Causal& c : rules) {
    // Self-attention lengths around the kernel's 128-query and 64-key blocks, 0 and 1 included.
    cases.emplace_back(std::vector<int64_t>{0, 1, 7, 129, 64, 0, 3}, std::vector<int64_t>{0, 1, 7, 129, 64, 0, 3}, 4, 2,
                       16, 16, c, seed += 10);
    // Cross lengths (T_q ≠ T_k per sequence), MQA, odd head dims.
    cases.emplace_back(std::vector<int64_t>{5, 0, 130, 1}, std::vector<int64_t>{9, 4, 65, 0}, 3, 1, 9, 7, c,
                       seed += 10);
  }
  return cases;
}

// ---- PyTorch goldens: a loop over sequences in plain PyTorch -------------------------------------

std::string golden(const std::string& name) { return std::string(MHA_GOLDEN_DIR) + "/varlen/" + name + ".safetensors"; }

std::vector<int64_t> read_offsets(const io::SafetensorsFile& f, const char* name) {
  std::vector<int64_t> cu;
  const Tensor values = f.read_f32(name);
  for (float x : values.values()) cu.push_back(static_cast<int64_t>(x));
  return cu;
}

TEST(VarlenGolden, ForwardAndGradientsMatchPyTorch) {
  for (const char* name : {"gqa_bottom_right", "self_top_left_window", "cross_none"}) {
    SCOPED_TRACE(name);
    const io::SafetensorsFile f = io::SafetensorsFile::open(golden(name));
    const Tensor q = f.read_f32("q"), k = f.read_f32("k"), v = f.read_f32("v"), dout = f.read_f32("d_out");
    VarlenBatch seqs;
    seqs.cu_seqlens_q = read_offsets(f, "cu_q");
    seqs.cu_seqlens_k = read_offsets(f, "cu_k");
    SdpaOptions opt;
    const std::string causal = f.metadata().at("causal");
    const int64_t window = std::stoll(f.metadata().at("window"));
    if (causal == "top_left") opt.masks.causal = Causal::top_left().with_window(window);
    if (causal == "bottom_right") opt.masks.causal = Causal::bottom_right().with_window(window);
    const double tol = 16 * kEps;  // |q|, |k|, |v| ≤ 1, d ≤ 8, a few keys: a few ε
    for (Backend backend : {Backend::Reference, Backend::Fused}) {
      opt.backend = backend;
      const SdpaResult r = sdpa_varlen(q, k, v, seqs, opt, Want::Lse);
      EXPECT_TRUE(all_close(r.out, f.read_f32("out"), tol, tol));
      EXPECT_TRUE(all_close(r.lse, f.read_f32("lse"), tol, tol));
      const SdpaGradTensors g = sdpa_backward_varlen(q, k, v, r.out, dout, r.lse, seqs, opt);
      EXPECT_TRUE(all_close(g.dq, f.read_f32("dq"), 4 * tol, 4 * tol));
      EXPECT_TRUE(all_close(g.dk, f.read_f32("dk"), 4 * tol, 4 * tol));
      EXPECT_TRUE(all_close(g.dv, f.read_f32("dv"), 4 * tol, 4 * tol));
    }
  }
}

// ---- every path equals the same path run on each sequence alone ---------------------------------

/// Checks that `backend`'s forward and backward of the packed batch equal the same path run on each
/// sequence alone, bitwise; with sinks, that the packed sink gradient is the sum of the sequences'.
void expect_packed_equals_each_sequence(const Packed& c, Backend backend) {
  SCOPED_TRACE(backend == Backend::Fused ? "fused" : "reference");
  const SdpaResult packed = c.forward(backend);
  const SdpaGradTensors grads = c.backward(backend);
  const std::vector<int64_t>&cq = c.seqs.cu_seqlens_q.values(), &ck = c.seqs.cu_seqlens_k.values();
  std::vector<double> dsinks(c.sinks.size(), 0.0);
  for (int64_t s = 0; s < c.seq_count(); ++s) {
    SCOPED_TRACE("sequence " + std::to_string(s));
    const size_t u = static_cast<size_t>(s);
    const Tensor q = sequence_of(c.q, cq[u], c.lens_q[u]), k = sequence_of(c.k, ck[u], c.lens_k[u]),
                 v = sequence_of(c.v, ck[u], c.lens_k[u]), dout = sequence_of(c.dout, cq[u], c.lens_q[u]);
    const SdpaResult one = sdpa(q, k, v, c.options(backend, 2), Want::Lse);
    EXPECT_TRUE(rows_equal(packed.out, cq[u], one.out));
    EXPECT_TRUE(rows_equal(as3(packed.lse), cq[u], one.lse.reshaped({1, c.H, c.lens_q[u], 1})));
    // The backward from the fused forward's out and lse, as c.backward() does.
    const SdpaResult f = sdpa(q, k, v, c.options(Backend::Fused, 2), Want::Lse);
    const SdpaGradTensors g = sdpa_backward(q, k, v, f.out, dout, f.lse, c.options(backend, 2));
    EXPECT_TRUE(rows_equal(grads.dq, cq[u], g.dq));
    EXPECT_TRUE(rows_equal(grads.dk, ck[u], g.dk));
    EXPECT_TRUE(rows_equal(grads.dv, ck[u], g.dv));
    for (size_t h = 0; h < dsinks.size(); ++h) dsinks[h] += g.dsinks.data()[h];
  }
  ASSERT_EQ(grads.dsinks.numel(), static_cast<int64_t>(c.sinks.size()));
  for (size_t h = 0; h < dsinks.size(); ++h)  // sums in another order: within rounding
    EXPECT_NEAR(grads.dsinks.data()[h], dsinks[h], 1e-4 * (1.0 + std::fabs(dsinks[h]))) << "head " << h;
}

/// A sequence with no keys (its rows see nothing: out 0, lse the sink logit) and NaN in its rows of
/// d out adds nothing to the packed sink gradient, on both backends, as one sequence alone gives:
/// the packed sum skipped only rows whose d out · out was 0, and NaN · 0 is not.
TEST(Varlen, SequenceWithoutKeysAddsNothingToTheSinkGradient) {
  Packed c({2, 3}, {0, 4}, 2, 1, 8, 8, Causal{}, 61);
  c.sinks = {0.25f, -0.5f};
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t x = 0; x < c.Dv; ++x) c.dout.at({i, h, x}) = kNaN;
  for (Backend backend : {Backend::Reference, Backend::Fused}) {
    SCOPED_TRACE(backend == Backend::Fused ? "fused" : "reference");
    const SdpaGradTensors g = c.backward(backend);
    for (int64_t h = 0; h < c.H; ++h) EXPECT_TRUE(std::isfinite(g.dsinks.at({h}))) << "head " << h;
    expect_packed_equals_each_sequence(c, backend);
  }
}

TEST(Varlen, EachPathEqualsPerSequenceSdpaBitwise) {
  for (const Packed& c : sweep())
    for (Backend backend : {Backend::Reference, Backend::Fused}) expect_packed_equals_each_sequence(c, backend);
}

// Score edits with a packed batch: ALiBi (positions aligned per sequence by its own lengths),
// softcap and sinks, on every fused target, equal to the same path run on each sequence alone
// (bitwise; the sink gradient, a sum over every sequence's rows, within rounding).
TEST(Varlen, ScoreEditsEqualPerSequenceSdpaOnEveryTarget) {
  std::vector<Packed> cases;
  uint64_t seed = 700;
  for (const Causal& rule : {Causal::none(), Causal::top_left(), Causal::bottom_right().with_window(5)})
    for (int edits = 0; edits < 4; ++edits) {  // ALiBi, softcap, sinks, all three
      const std::vector<int64_t> lens_q{0, 1, 7, 129, 3};
      // Cross lengths with all three: ALiBi and the causal rule aligned by each sequence's lengths.
      const std::vector<int64_t> lens_k = edits == 3 ? std::vector<int64_t>{2, 5, 0, 130, 9} : lens_q;
      Packed c(lens_q, lens_k, 4, 2, 16, 16, rule, seed += 10);
      if (edits == 0 || edits == 3) c.slopes = alibi_slopes(4);
      if (edits == 1 || edits == 3) c.softcap = 1.5f;
      if (edits == 2 || edits == 3) c.sinks = {0.5f, -1.0f, 2.0f, 0.0f};
      cases.push_back(c);
    }
  for (const Packed& c : cases)
    for_each_fused_target([&] {
      for (Backend backend : {Backend::Reference, Backend::Fused}) expect_packed_equals_each_sequence(c, backend);
    });
}

// ---- fused vs reference, every SIMD target, float32 and bfloat16; threads bitwise ----------------

TEST(Varlen, FusedMatchesReferenceOnEveryTarget) {
  for (const Packed& c : sweep()) {
    const SdpaResult want = c.forward(Backend::Reference);
    for_each_fused_target([&] {
      const SdpaResult got = c.forward(Backend::Fused);
      EXPECT_TRUE(all_close(got.out, want.out, c.out_tol(), 0));
      EXPECT_TRUE(all_close(got.lse, want.lse, 64 * kEps, 4 * kEps));
    });
  }
}

TEST(Varlen, Bf16FusedMatchesBf16ReferenceOnEveryTarget) {
  for (const Packed& c : sweep()) {
    const SdpaResult want = c.forward_bf16(Backend::Reference);
    // The fused bf16 path may round P to bf16 for P·V (2^-9 relative per weight).
    const double tol = c.out_tol() + 0x1.0p-8 * max_abs(c.v);
    for_each_fused_target([&] {
      const SdpaResult got = c.forward_bf16(Backend::Fused);
      EXPECT_TRUE(all_close(got.out, want.out, tol, 0));
      EXPECT_TRUE(all_close(got.lse, want.lse, 64 * kEps, 4 * kEps));
    });
  }
}

TEST(Varlen, BackwardFusedMatchesReferenceOnEveryTarget) {
  for (const Packed& c : sweep()) {
    const SdpaGradTensors want = c.backward(Backend::Reference);
    hwy::SetSupportedTargetsForTest(0);
    const int64_t supported = hwy::SupportedTargets();
    for (int64_t target : kernels::fused_backward_compiled_targets()) {
      if (!(supported & target)) continue;
      hwy::SetSupportedTargetsForTest(target);
      SCOPED_TRACE(hwy::TargetName(target));
      const SdpaGradTensors got = c.backward(Backend::Fused);
      // Sums over up to T keys (dq) or T·group queries (dk, dv) of O(1) terms.
      const double tol = 64 * kEps * static_cast<double>(c.longest_k() + 130 * c.H);
      EXPECT_TRUE(all_close(got.dq, want.dq, tol, 0));
      EXPECT_TRUE(all_close(got.dk, want.dk, tol, 0));
      EXPECT_TRUE(all_close(got.dv, want.dv, tol, 0));
    }
    hwy::SetSupportedTargetsForTest(0);
  }
}

TEST(Varlen, ThreadCountDoesNotChangeAnyBit) {
  for (const Packed& c : sweep()) {
    const SdpaResult one = c.forward(Backend::Fused, 1), one_bf16 = c.forward_bf16(Backend::Fused, 1);
    const SdpaGradTensors g1 = c.backward(Backend::Fused, 1);
    for (int threads : {2, 3}) {
      const SdpaResult r = c.forward(Backend::Fused, threads);
      EXPECT_TRUE(bitwise_equal(r.out, one.out));
      EXPECT_TRUE(bitwise_equal(r.lse, one.lse));
      const SdpaResult r16 = c.forward_bf16(Backend::Fused, threads);
      EXPECT_TRUE(bitwise_equal(r16.out, one_bf16.out)) << "bf16";
      EXPECT_TRUE(bitwise_equal(r16.lse, one_bf16.lse)) << "bf16";
      const SdpaGradTensors g = c.backward(Backend::Fused, threads);
      EXPECT_TRUE(bitwise_equal(g.dq, g1.dq));
      EXPECT_TRUE(bitwise_equal(g.dk, g1.dk));
      EXPECT_TRUE(bitwise_equal(g.dv, g1.dv));
    }
  }
}

// sdpa_varlen(const Tensor&…) hands the kernels out and lse unfilled: each element is written,
// whatever the buffers held (rows of empty sequences and rows that see no key included).
TEST(Varlen, EveryOutputElementIsWrittenWhateverTheBuffersHeld) {
  for (const Packed& c : sweep())
    for (Backend backend : {Backend::Reference, Backend::Fused}) {
      const int64_t nq = c.q.size(0);
      const auto run_into = [&](float fill) {
        SdpaResult r{Tensor({nq, c.H, c.Dv}, fill), {}, Tensor({nq, c.H}, fill)};
        sdpa_varlen(packed_view<const float>(c.q.data(), nq, c.H, c.D),
                    packed_view<const float>(c.k.data(), c.k.size(0), c.KV, c.D),
                    packed_view<const float>(c.v.data(), c.v.size(0), c.KV, c.Dv), c.seqs, c.options(backend, 2),
                    {packed_view(r.out.data(), nq, c.H, c.Dv), {}, packed_view(r.lse.data(), nq, c.H, int64_t{1})});
        return r;
      };
      const SdpaResult clean = run_into(0.0f), dirty = run_into(std::numeric_limits<float>::quiet_NaN());
      EXPECT_TRUE(bitwise_equal(dirty.out, clean.out)) << (backend == Backend::Fused ? "fused" : "reference");
      EXPECT_TRUE(bitwise_equal(dirty.lse, clean.lse)) << (backend == Backend::Fused ? "fused" : "reference");
    }
}

// Lengths of very different sizes (the load-balancing case) give the same bits as each alone.
TEST(Varlen, UnevenLengthsBalancedAndExact) {
  const Packed c({700, 3, 1, 250, 17}, {700, 3, 1, 250, 17}, 2, 1, 16, 16, Causal::top_left(), 7);
  const SdpaResult r1 = c.forward(Backend::Fused, 1), r3 = c.forward(Backend::Fused, 3);
  EXPECT_TRUE(bitwise_equal(r1.out, r3.out));
  const SdpaResult want = c.forward(Backend::Reference);
  EXPECT_TRUE(all_close(r3.out, want.out, c.out_tol(), 0));
}

TEST(Varlen, EmptyBatchAndInt32Offsets) {
  VarlenBatch none;
  none.cu_seqlens_q = {0};
  none.cu_seqlens_k = {0};
  const SdpaResult r = sdpa_varlen(Tensor({0, 2, 4}), Tensor({0, 1, 4}), Tensor({0, 1, 4}), none, {}, Want::Lse);
  EXPECT_EQ(r.out.shape(), (Shape{0, 2, 4}));
  const Packed c({2, 3}, {2, 3}, 2, 2, 4, 4, Causal::top_left(), 3);
  const std::vector<int32_t> cu32{0, 2, 5};
  VarlenBatch seqs32;
  seqs32.cu_seqlens_q = cu32;
  seqs32.cu_seqlens_k = cu32;
  seqs32.max_seqlen_q = seqs32.max_seqlen_k = 3;
  EXPECT_TRUE(bitwise_equal(sdpa_varlen(c.q, c.k, c.v, seqs32, c.options(Backend::Auto, 1)).out,
                            c.forward(Backend::Auto, 1).out));
}

TEST(Varlen, BadArgumentsAreClearErrors) {
  const Packed c({2, 3}, {2, 3}, 2, 2, 4, 4, Causal::none(), 3);
  auto err = [&](std::vector<int64_t> cq, std::vector<int64_t> ck, int64_t max_q = 0) {
    VarlenBatch s;
    s.cu_seqlens_q = cq;
    s.cu_seqlens_k = ck;
    s.max_seqlen_q = max_q;
    return error_of([&] { sdpa_varlen(c.q, c.k, c.v, s); });
  };
  EXPECT_NE(err({0, 3, 2, 5}, {0, 2, 3, 5}).find("must not decrease"), std::string::npos);
  EXPECT_NE(err({0, 2, 4}, {0, 2, 5}).find("must equal the total rows, 5"), std::string::npos);
  EXPECT_NE(err({1, 2, 5}, {0, 2, 5}).find("cu_seqlens_q[0] = 1"), std::string::npos);
  EXPECT_NE(err({0, 2, 5}, {0, 5}).find("both need B + 1"), std::string::npos);
  EXPECT_NE(err({}, {0, 5}).find("is empty"), std::string::npos);
  EXPECT_NE(err({0, 2, 5}, {0, 2, 5}, 2).find("more than the given maximum 2"), std::string::npos);
  VarlenBatch ok;
  ok.cu_seqlens_q = {0, 2, 5};
  ok.cu_seqlens_k = {0, 2, 5};
  EXPECT_NE(error_of([&] { sdpa_varlen(c.q, c.k, c.v, ok, {}, Want::Weights); }).find("weights"), std::string::npos);
  SdpaOptions drop;
  drop.dropout.p = 0.1f;
  EXPECT_NE(error_of([&] { sdpa_varlen(c.q, c.k, c.v, ok, drop); }).find("dropout"), std::string::npos);
  BoolTensor pad({1, 5}, 0);
  SdpaOptions masked;
  masked.masks.key_padding.view = {pad.data(), {1, 1, 1, 5}, {5, 0, 0, 1}};
  EXPECT_NE(error_of([&] { sdpa_varlen(c.q, c.k, c.v, ok, masked); }).find("only a causal mask"), std::string::npos);
  EXPECT_NE(error_of([&] { sdpa_varlen(Tensor({5, 2, 4, 1}), c.k, c.v, ok); }).find("3-D"), std::string::npos);
}

// ---- the module on packed input ------------------------------------------------------------------

/// Rows [r0, r0 + n) of a 2-D (rows, E) tensor.
Tensor rows2(const Tensor& t, int64_t r0, int64_t n) {
  const int64_t E = t.size(1);
  Tensor out({n, E});
  for (int64_t i = 0; i < n * E; ++i) out.data()[i] = t.data()[r0 * E + i];
  return out;
}

void module_packed_equals_each_sequence(const MultiheadAttention& m) {
  const std::vector<int64_t> lens{5, 0, 1, 140, 9};
  const std::vector<int64_t> cu = offsets(lens);
  const Tensor x = random_tensor({cu.back(), 24}, 1), dy = random_tensor({cu.back(), 24}, 2);
  MhaForwardOptions o;
  o.causal = Causal::top_left();
  o.packed = VarlenBatch{cu, cu, 0, 0};
  const Tensor y = m.forward(x, x, x, o).output;
  MhaTrainOutput tr = forward_train(m, x, x, x, o);
  EXPECT_TRUE(bitwise_equal(tr.output, y));
  const MhaGradients g = backward(m, tr.context, dy);

  MhaForwardOptions alone;
  alone.causal = Causal::top_left();
  Tensor w_grad(g.params.in_proj_weight.shape(), 0.0f);
  Tensor sink_grad = m.params().sinks.defined() ? Tensor(m.params().sinks.shape(), 0.0f) : Tensor();
  const double tol = 512 * kEps;
  for (size_t s = 0; s < lens.size(); ++s) {
    if (lens[s] == 0) continue;
    SCOPED_TRACE("sequence " + std::to_string(s));
    const Tensor xs = rows2(x, cu[s], lens[s]);
    EXPECT_TRUE(all_close(rows2(y, cu[s], lens[s]), m.forward(xs, xs, xs, alone).output, tol, tol));
    MhaTrainOutput ts = forward_train(m, xs, xs, xs, alone);
    const MhaGradients gs = backward(m, ts.context, rows2(dy, cu[s], lens[s]));
    EXPECT_TRUE(all_close(rows2(g.query, cu[s], lens[s]), gs.query, tol, tol));
    for (int64_t i = 0; i < w_grad.numel(); ++i) w_grad.data()[i] += gs.params.in_proj_weight.data()[i];
    for (int64_t i = 0; sink_grad.defined() && i < sink_grad.numel(); ++i)
      sink_grad.data()[i] += gs.params.sinks.data()[i];
  }
  EXPECT_TRUE(all_close(g.params.in_proj_weight, w_grad, 4 * tol, 4 * tol));
  if (sink_grad.defined()) {
    EXPECT_TRUE(all_close(g.params.sinks, sink_grad, 4 * tol, 4 * tol));
  }

  // What a packed module call refuses.
  MhaForwardOptions bad = o;
  bad.need_weights = NeedWeights::PerHead;
  EXPECT_NE(error_of([&] { m.forward(x, x, x, bad); }).find("weights"), std::string::npos);
  bad = o;
  bad.packed->cu_seqlens_q = std::vector<int64_t>{0, 5, 3};
  EXPECT_NE(error_of([&] { m.forward(x, x, x, bad); }).find("must not decrease"), std::string::npos);
  EXPECT_NE(
      error_of([&] {
        m.forward(x.reshaped({1, cu.back(), 24}), x.reshaped({1, cu.back(), 24}), x.reshaped({1, cu.back(), 24}), o);
      }).find("2-D inputs"),
      std::string::npos);
}

TEST(VarlenModule, ForwardAndBackwardEqualEachSequenceAlone) {
  MhaConfig c;
  c.embed_dim = 24, c.num_heads = 4, c.num_kv_heads = 2;
  c.rope = Rope::half_split();  // positions restart at 0 in each sequence
  MhaConfig edited = c;         // score edits with a packed batch: ALiBi aligned per sequence, softcap, sinks
  edited.alibi_slopes = alibi_slopes(4);
  edited.softcap = 2.0f;
  edited.attention_sinks = true;
  for (const MhaConfig& config : {c, edited}) {
    SCOPED_TRACE(config.attention_sinks ? "alibi+softcap+sinks" : "no edits");
    MultiheadAttention m(config, 5);
    if (config.attention_sinks) m.params().sinks = random_tensor({4}, 3);
    module_packed_equals_each_sequence(m);
  }
}

// ---- `mha forward` on a packed batch -------------------------------------------------------------

TEST(VarlenCli, ForwardReadsOffsetsAndMatchesTheLibrary) {
  MhaConfig c;
  c.embed_dim = 16, c.num_heads = 2;
  const MultiheadAttention m(c, 4);
  const std::string dir = testing::temp_dir();
  io::save_module(dir + "/w.safetensors", m, io::WeightNames::PyTorch);
  const std::vector<int32_t> cu{0, 3, 3, 8};
  const Tensor x = random_tensor({8, 16}, 6);
  io::SafetensorsWriter w;
  w.add("query", x), w.add("key", x), w.add("value", x);
  w.add_raw("cu_seqlens_q", io::DType::I32, {4}, std::as_bytes(std::span<const int32_t>(cu)));
  w.set_metadata("max_seqlen_q", "5");
  w.write(dir + "/in.safetensors");
  const testing::CommandResult r =
      testing::run_command(std::string(MHA_CLI_PATH) + " forward --weights " + dir + "/w.safetensors --inputs " + dir +
                           "/in.safetensors --output " + dir + "/out.safetensors");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  MhaForwardOptions o;
  o.packed = VarlenBatch{cu, cu, 5, 0};
  EXPECT_TRUE(bitwise_equal(io::SafetensorsFile::open(dir + "/out.safetensors").read_f32("output"),
                            m.forward(x, x, x, o).output));
  // A bad offset is one line and exit status 1.
  io::SafetensorsWriter bad;
  bad.add("query", x), bad.add("key", x), bad.add("value", x);
  const std::vector<int64_t> wrong{0, 3, 7};
  bad.add_raw("cu_seqlens_q", io::DType::I64, {3}, std::as_bytes(std::span<const int64_t>(wrong)));
  bad.write(dir + "/bad.safetensors");
  const testing::CommandResult e =
      testing::run_command(std::string(MHA_CLI_PATH) + " forward --weights " + dir + "/w.safetensors --inputs " + dir +
                           "/bad.safetensors --output " + dir + "/o2.safetensors");
  EXPECT_EQ(e.exit_code, 1);
  EXPECT_NE(e.err.find("must equal the total rows, 8"), std::string::npos) << e.err;
}

}  // namespace
}  // namespace mha
