// Edge values on every path (issue 16, items 1–4 and 8): a key masked by a −inf key bias is never
// read, like padding (docs/semantics.md, 'Padded keys are never read'); a visible NaN makes its
// row NaN and is never turned into a fully masked row ('NaN is never hidden'); keys hidden only
// from some queries may be read by the fused kernels, and what that means is pinned down here;
// views without data are errors, not crashes; empty inputs give empty outputs ('Empty inputs').
// Every kernel path: the reference and fused forward (float32 and bf16, every SIMD target), the
// reference with weights, both backward kernels, decoding against a cache, and the module
// (need_weights None / PerHead / Averaged, forward_train + backward, forward_incremental).
#include <hwy/targets.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kernels/fused_forward.h"
#include "mha/kv_cache.h"
#include "mha/module.h"
#include "mha/sdpa.h"
#include "mha/training.h"
#include "support/test_support.h"

namespace mha {
namespace {

using testing::all_close;
using testing::for_each_fused_target;
using testing::random_tensor;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

BF16Tensor to_bf16_tensor(const Tensor& t) {
  BF16Tensor b(t.shape());
  for (int64_t i = 0; i < t.numel(); ++i) b.data()[i] = to_bf16(t.data()[i]);
  return b;
}

/// One SDPA request with its inputs and masks (owned here so the views in opt stay valid).
struct Case {
  int64_t B = 1, H = 1, KV = 1, Tq = 4, Tk = 4, D = 4, Dv = 4;
  Tensor q, k, v, key_bias, bias;
  BoolTensor key_padding, allowed;
  SdpaOptions opt;

  Case(int64_t b, int64_t h, int64_t tq, int64_t tk, int64_t d, uint64_t seed) : B(b), H(h), KV(h), Tq(tq), Tk(tk) {
    D = Dv = d;
    q = random_tensor({B, H, Tq, D}, seed);
    k = random_tensor({B, KV, Tk, D}, seed + 1);
    v = random_tensor({B, KV, Tk, Dv}, seed + 2);
  }
  void poison_key(int64_t b, int64_t j, bool in_k, bool in_v) {
    for (int64_t g = 0; g < KV; ++g) {
      if (in_k)
        for (int64_t c = 0; c < D; ++c) k.at({b, g, j, c}) = kNaN;
      if (in_v)
        for (int64_t c = 0; c < Dv; ++c) v.at({b, g, j, c}) = kNaN;
    }
  }
  void set_key_bias(const std::vector<float>& per_key) {  // same for every batch
    key_bias = Tensor({B, 1, 1, Tk});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < Tk; ++j) key_bias.at({b, 0, 0, j}) = per_key[static_cast<size_t>(j)];
    opt.masks.key_bias.view = key_bias.view4();
  }
  void set_allowed(const std::function<bool(int64_t, int64_t)>& sees) {
    allowed = BoolTensor({1, 1, Tq, Tk});
    for (int64_t i = 0; i < Tq; ++i)
      for (int64_t j = 0; j < Tk; ++j) allowed.at({0, 0, i, j}) = sees(i, j) ? 1 : 0;
    opt.masks.allowed.view = allowed.view4();
  }
};

struct Fwd {
  Tensor out, lse, weights;
};

enum class Path { Reference, ReferenceWithWeights, Fused, Bf16Reference, Bf16Fused };

const char* path_name(Path p) {
  switch (p) {
    case Path::Reference:
      return "reference";
    case Path::ReferenceWithWeights:
      return "reference with weights";
    case Path::Fused:
      return "fused";
    case Path::Bf16Reference:
      return "bf16 reference";
    default:
      return "bf16 fused";
  }
}

Fwd forward(const Case& c, Path path, int threads = 2) {
  Fwd r{Tensor({c.B, c.H, c.Tq, c.Dv}), Tensor({c.B, c.H, c.Tq, 1}), Tensor({c.B, c.H, c.Tq, c.Tk})};
  SdpaOptions opt = c.opt;
  opt.threads = threads;
  opt.backend = path == Path::Fused || path == Path::Bf16Fused ? Backend::Fused : Backend::Reference;
  SdpaOutputs outs{r.out.view4(), {}, r.lse.view4()};
  if (path == Path::ReferenceWithWeights) outs.weights = r.weights.view4();
  if (path == Path::Bf16Reference || path == Path::Bf16Fused) {
    const BF16Tensor qb = to_bf16_tensor(c.q), kb = to_bf16_tensor(c.k), vb = to_bf16_tensor(c.v);
    sdpa(qb.view4(), kb.view4(), vb.view4(), opt, outs);
  } else {
    sdpa(c.q.view4(), c.k.view4(), c.v.view4(), opt, outs);
  }
  return r;
}

/// Every forward path, the fused ones on every SIMD target.
void for_each_forward(const Case& c, const std::function<void(const Fwd&, Path)>& check) {
  for (Path p : {Path::Reference, Path::ReferenceWithWeights, Path::Bf16Reference}) {
    SCOPED_TRACE(path_name(p));
    check(forward(c, p), p);
  }
  for_each_fused_target([&] {
    for (Path p : {Path::Fused, Path::Bf16Fused}) {
      SCOPED_TRACE(path_name(p));
      check(forward(c, p), p);
    }
  });
}

/// The backward of c on `backend`, d out random (seed 99) and then edited by `edit_d_out`.
SdpaGradTensors backward(const Case& c, Backend backend, const std::function<void(Tensor&)>& edit_d_out = {}) {
  const Fwd f = forward(c, Path::Reference);
  Tensor d_out = random_tensor(f.out.shape(), 99);
  if (edit_d_out) edit_d_out(d_out);
  SdpaGradTensors g{Tensor(c.q.shape()), Tensor(c.k.shape()), Tensor(c.v.shape())};
  SdpaOptions opt = c.opt;
  opt.backend = backend;
  sdpa_backward(c.q.view4(), c.k.view4(), c.v.view4(), f.out.view4(), d_out.view4(), f.lse.view4(), opt,
                {g.dq.view4(), g.dk.view4(), g.dv.view4()});
  return g;
}

/// Row (b, h, i) of a (B, h, T, n) tensor: how many entries are NaN.
int64_t nan_count(const Tensor& t, int64_t b, int64_t h, int64_t i) {
  int64_t n = 0;
  for (int64_t c = 0; c < t.size(3); ++c) n += std::isnan(t.at({b, h, i, c})) ? 1 : 0;
  return n;
}
bool row_nan(const Tensor& t, int64_t b, int64_t h, int64_t i) { return nan_count(t, b, h, i) == t.size(3); }
bool row_finite(const Tensor& t, int64_t b, int64_t h, int64_t i) {
  for (int64_t c = 0; c < t.size(3); ++c)
    if (!std::isfinite(t.at({b, h, i, c}))) return false;
  return true;
}
bool all_finite(const Tensor& t) {
  for (float x : t.values())
    if (!std::isfinite(x)) return false;
  return true;
}

// ---- 1. a −inf key bias is padding -------------------------------------------------------------

/// Key 1 (and, for longer rows, every 7th key) has key_bias −inf and NaN in its K and V rows: no
/// path may read them, so every output is finite and equals the same request with the keys padded.
/// (Before: the fused forward gave 1.0 and lse 1.349 at T = 4, the reference NaN.)
TEST(KeyBiasMinusInf, IsNeverReadOnAnyPath) {
  for (int64_t T : {4, 150}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    Case c(2, 2, T, T, 8, 7);
    std::vector<float> kb(static_cast<size_t>(T));
    Case padded = c;
    padded.key_padding = BoolTensor({c.B, 1, 1, T});
    for (int64_t j = 0; j < T; ++j) {
      const bool masked = j == 1 || j % 7 == 3;
      kb[static_cast<size_t>(j)] = masked ? -kInf : 0.25f * static_cast<float>(j % 3);
      for (int64_t b = 0; b < c.B; ++b) padded.key_padding.at({b, 0, 0, j}) = masked ? 1 : 0;
      if (masked) c.poison_key(0, j, true, true), c.poison_key(1, j, true, true);
    }
    c.set_key_bias(kb);
    for (float& x : kb) x = std::isinf(x) ? 0.0f : x;
    padded.set_key_bias(kb);
    padded.opt.masks.key_padding.view = padded.key_padding.view4();
    const Fwd want = forward(padded, Path::Reference);
    ASSERT_TRUE(all_finite(want.out));
    for_each_forward(c, [&](const Fwd& got, Path p) {
      EXPECT_TRUE(all_finite(got.out));
      EXPECT_TRUE(all_finite(got.lse));
      const bool bf16 = p == Path::Bf16Fused || p == Path::Bf16Reference;
      if (!bf16) {
        EXPECT_TRUE(all_close(got.out, want.out, 1e-5, 1e-5));
        EXPECT_TRUE(all_close(got.lse, want.lse, 1e-5, 1e-5));
      }
      if (p == Path::ReferenceWithWeights) {
        for (int64_t i = 0; i < T; ++i) EXPECT_EQ(got.weights.at({0, 0, i, 1}), 0.0f);
      }
    });
    for (Backend be : {Backend::Reference, Backend::Fused}) {
      SCOPED_TRACE(be == Backend::Fused ? "fused backward" : "reference backward");
      const SdpaGradTensors g = backward(c, be);
      EXPECT_TRUE(all_finite(g.dq) && all_finite(g.dk) && all_finite(g.dv));
      for (int64_t x = 0; x < c.D; ++x) EXPECT_EQ(g.dk.at({0, 0, 1, x}), 0.0f);
      for (int64_t x = 0; x < c.Dv; ++x) EXPECT_EQ(g.dv.at({1, 1, 1, x}), 0.0f);
    }
  }
}

MultiheadAttention small_module(uint64_t seed = 3) {
  MhaConfig cfg;
  cfg.embed_dim = 8;
  cfg.num_heads = 2;
  return MultiheadAttention(cfg, seed);
}

/// Module level: PyTorch's float key_padding_mask with −inf on a key whose key/value input row is
/// NaN. Before: need_weights = Averaged gave 16/16 NaN, backward's d_query and d_in_proj_weight NaN.
/// The weight gradient of the K and V projections is Σ dKᵀ·x_key; the masked key's dK row is 0 but
/// its input row is NaN, and 0·NaN is NaN there exactly as in PyTorch — so only the query's side
/// (d query, W_Q's rows of d in_proj_weight, out_proj) is required finite.
TEST(KeyBiasMinusInf, ModuleEveryNeedWeightsAndBackward) {
  const MultiheadAttention m = small_module();
  const int64_t T = 4, B = 1, E = 8;
  const Tensor x = random_tensor({T, B, E}, 5);
  Tensor kv = random_tensor({T, B, E}, 6);
  for (int64_t e = 0; e < E; ++e) kv.at({1, 0, e}) = kNaN;
  MhaForwardOptions o;
  o.key_padding_mask.additive = Tensor({B, T}, 0.0f);
  o.key_padding_mask.additive.at({0, 1}) = -kInf;
  for (NeedWeights nw : {NeedWeights::None, NeedWeights::PerHead, NeedWeights::Averaged}) {
    o.need_weights = nw;
    const MhaOutput y = m.forward(x, kv, kv, o);
    EXPECT_TRUE(all_finite(y.output)) << static_cast<int>(nw);
    if (nw != NeedWeights::None) {
      EXPECT_TRUE(all_finite(y.attn_weights)) << static_cast<int>(nw);
    }
  }
  o.need_weights = NeedWeights::None;
  for (Backend be : {Backend::Reference, Backend::Fused}) {
    o.backend = be;
    const MhaTrainOutput t = forward_train(m, x, kv, kv, o);
    EXPECT_TRUE(all_finite(t.output));
    const MhaGradients g = backward(m, t.context, random_tensor(t.output.shape(), 8));
    EXPECT_TRUE(all_finite(g.query));
    EXPECT_TRUE(all_finite(g.params.out_proj_weight));
    for (int64_t r = 0; r < E; ++r)
      for (int64_t c = 0; c < E; ++c) EXPECT_TRUE(std::isfinite(g.params.in_proj_weight.at({r, c})));
  }
}

// ---- 2. a visible NaN makes its row NaN on every path ------------------------------------------

/// Key 2's K row is NaN and visible to rows 0 and 2; an allowed mask hides it from row 1. Rows 0 and
/// 2 are NaN (out and lse) on every path, row 1 finite. (Before: the fused path gave rows (1, 0, 1).)
TEST(NaN, VisibleKeyMakesTheRowNaNOnEveryPath) {
  Case c(1, 1, 3, 3, 4, 11);
  c.poison_key(0, 2, true, false);
  c.set_allowed([](int64_t i, int64_t j) { return !(i == 1 && j == 2); });
  for_each_forward(c, [&](const Fwd& f, Path p) {
    EXPECT_TRUE(row_nan(f.out, 0, 0, 0) && row_nan(f.out, 0, 0, 2));
    EXPECT_TRUE(std::isnan(f.lse.at({0, 0, 0, 0})) && std::isnan(f.lse.at({0, 0, 2, 0})));
    EXPECT_TRUE(row_finite(f.out, 0, 0, 1));
    EXPECT_TRUE(std::isfinite(f.lse.at({0, 0, 1, 0})));
    if (p == Path::ReferenceWithWeights) {
      EXPECT_TRUE(row_nan(f.weights, 0, 0, 0) && row_finite(f.weights, 0, 0, 1));
    }
  });
  // No mask: every row sees key 2, so every row is NaN (PyTorch's answer).
  c.opt.masks.allowed = {};
  for_each_forward(c, [&](const Fwd& f, Path) {
    for (int64_t i = 0; i < 3; ++i) EXPECT_TRUE(row_nan(f.out, 0, 0, i) && std::isnan(f.lse.at({0, 0, i, 0})));
  });
}

/// A NaN query row is NaN, not a fully masked row (which gives zeros and lse −inf); a NaN query
/// whose keys are all padded is fully masked. Long rows cross the fused kernel's blocks.
TEST(NaN, QueryRowIsNaNNotFullyMasked) {
  for (int64_t T : {3, 200}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    Case c(2, 1, T, T, 4, 13);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t x = 0; x < c.D; ++x) c.q.at({b, 0, 1, x}) = kNaN;
    c.key_padding = BoolTensor({2, 1, 1, T}, 0);
    for (int64_t j = 0; j < T; ++j) c.key_padding.at({1, 0, 0, j}) = 1;  // batch 1: every key padded
    c.opt.masks.key_padding.view = c.key_padding.view4();
    for_each_forward(c, [&](const Fwd& f, Path) {
      EXPECT_TRUE(row_nan(f.out, 0, 0, 1));
      EXPECT_TRUE(std::isnan(f.lse.at({0, 0, 1, 0})));
      EXPECT_TRUE(row_finite(f.out, 0, 0, 0) && row_finite(f.out, 0, 0, 2));
      for (int64_t x = 0; x < c.Dv; ++x) EXPECT_EQ(f.out.at({1, 0, 1, x}), 0.0f);
      EXPECT_EQ(f.lse.at({1, 0, 1, 0}), -kInf);
    });
    for (Backend be : {Backend::Reference, Backend::Fused}) {
      SCOPED_TRACE(be == Backend::Fused ? "fused backward" : "reference backward");
      const SdpaGradTensors g = backward(c, be);
      EXPECT_TRUE(row_nan(g.dq, 0, 0, 1));
      EXPECT_TRUE(row_finite(g.dq, 0, 0, 0) && row_finite(g.dq, 0, 0, 2));
      for (int64_t x = 0; x < c.D; ++x) EXPECT_EQ(g.dq.at({1, 0, 1, x}), 0.0f);
      for (int64_t j = 0; j < T; ++j)  // batch 1's keys are all padded: never read, gradient 0
        for (int64_t x = 0; x < c.D; ++x) EXPECT_EQ(g.dk.at({1, 0, j, x}), 0.0f);
    }
  }
}

/// A NaN in an additive mask at a visible position makes that row NaN; under an allowed mask
/// that hides the position it is not visible and changes nothing.
TEST(NaN, AdditiveMaskValue) {
  Case c(1, 1, 3, 5, 4, 17);
  c.bias = Tensor({1, 1, 3, 5}, 0.0f);
  c.bias.at({0, 0, 0, 4}) = kNaN;
  c.bias.at({0, 0, 2, 4}) = kNaN;
  c.opt.masks.bias.view = c.bias.view4();
  c.set_allowed([](int64_t i, int64_t j) { return !(i == 2 && j == 4); });
  for_each_forward(c, [&](const Fwd& f, Path) {
    EXPECT_TRUE(row_nan(f.out, 0, 0, 0));
    EXPECT_TRUE(row_finite(f.out, 0, 0, 1) && row_finite(f.out, 0, 0, 2));
  });
}

/// A −inf entry of an additive mask is a term added to the score, not a mask: NaN + (−inf) is NaN,
/// so a NaN K row behind it makes the row NaN (as PyTorch's float masks do), where AllowedMask,
/// KeyPadding or a −inf key bias hide the key. A NaN query whose every key has −inf in the additive
/// mask is a NaN row; with every key padded it is a fully masked one. The same on every path.
TEST(NaN, MinusInfAdditiveEntryIsATermNotAMask) {
  Case c(1, 1, 3, 4, 4, 61);
  c.poison_key(0, 2, true, false);
  c.bias = Tensor({1, 1, 3, 4}, 0.0f);
  c.bias.at({0, 0, 0, 2}) = -kInf;  // row 0: a term; row 1: AllowedMask hides the key; row 2 sees it
  c.opt.masks.bias.view = c.bias.view4();
  c.set_allowed([](int64_t i, int64_t j) { return !(i == 1 && j == 2); });
  for_each_forward(c, [&](const Fwd& f, Path p) {
    EXPECT_TRUE(row_nan(f.out, 0, 0, 0) && row_nan(f.out, 0, 0, 2));
    EXPECT_TRUE(std::isnan(f.lse.at({0, 0, 0, 0})));
    EXPECT_TRUE(row_finite(f.out, 0, 0, 1));
    if (p == Path::ReferenceWithWeights) {
      EXPECT_TRUE(row_nan(f.weights, 0, 0, 0) && row_finite(f.weights, 0, 0, 1));
    }
  });
  for (Backend be : {Backend::Reference, Backend::Fused}) {
    SCOPED_TRACE(be == Backend::Fused ? "fused backward" : "reference backward");
    const SdpaGradTensors g = backward(c, be);
    EXPECT_TRUE(row_nan(g.dq, 0, 0, 0));
    if (be == Backend::Reference) {  // the fused backward may read the hidden key for row 1 ('Padded keys')
      EXPECT_TRUE(row_finite(g.dq, 0, 0, 1));
    }
  }

  Case nan_query(1, 1, 2, 5, 4, 62);
  for (int64_t x = 0; x < nan_query.D; ++x) nan_query.q.at({0, 0, 0, x}) = kNaN;
  nan_query.bias = Tensor({1, 1, 2, 5}, 0.0f);
  for (int64_t j = 0; j < 5; ++j) nan_query.bias.at({0, 0, 0, j}) = -kInf;
  nan_query.opt.masks.bias.view = nan_query.bias.view4();
  for_each_forward(nan_query, [&](const Fwd& f, Path) {
    EXPECT_TRUE(row_nan(f.out, 0, 0, 0));
    EXPECT_TRUE(std::isnan(f.lse.at({0, 0, 0, 0})));
    EXPECT_TRUE(row_finite(f.out, 0, 0, 1));
  });
  nan_query.opt.masks.bias = {};
  nan_query.key_padding = BoolTensor({1, 1, 1, 5}, 1);
  nan_query.opt.masks.key_padding.view = nan_query.key_padding.view4();
  for_each_forward(nan_query, [&](const Fwd& f, Path) {
    for (int64_t x = 0; x < nan_query.Dv; ++x) EXPECT_EQ(f.out.at({0, 0, 0, x}), 0.0f);
    EXPECT_EQ(f.lse.at({0, 0, 0, 0}), -kInf);
  });
}

/// A +inf score that a query sees makes its row NaN (softmax takes e^{+inf − +inf}, as in
/// PyTorch), not the zeros of a fully masked row: from a +inf key bias (key 150 of 200, under a
/// causal mask, so rows before it stay finite and the rows that see it meet it in a later block),
/// and from a +inf query entry against keys whose entry is positive (every score of that row +inf).
TEST(Infinity, VisiblePlusInfScoreMakesTheRowNaNOnEveryPath) {
  Case c(1, 1, 200, 200, 4, 29);
  std::vector<float> bias(200, 0.0f);
  bias[150] = kInf;
  c.set_key_bias(bias);
  c.opt.masks.causal = Causal::top_left();
  for_each_forward(c, [&](const Fwd& f, Path) {
    for (int64_t i : {0, 1, 100, 149}) EXPECT_TRUE(row_finite(f.out, 0, 0, i)) << i;
    for (int64_t i : {150, 151, 199}) {
      EXPECT_TRUE(row_nan(f.out, 0, 0, i)) << i;
      EXPECT_TRUE(std::isnan(f.lse.at({0, 0, i, 0}))) << i;
    }
  });
  Case d(1, 1, 3, 70, 4, 31);
  for (int64_t j = 0; j < d.Tk; ++j) d.k.at({0, 0, j, 0}) = 0.5f + std::abs(d.k.at({0, 0, j, 0}));
  d.q.at({0, 0, 1, 0}) = kInf;
  for_each_forward(d, [&](const Fwd& f, Path p) {
    EXPECT_TRUE(row_nan(f.out, 0, 0, 1) && std::isnan(f.lse.at({0, 0, 1, 0})));
    EXPECT_TRUE(row_finite(f.out, 0, 0, 0) && row_finite(f.out, 0, 0, 2));
    if (p == Path::ReferenceWithWeights) {
      EXPECT_TRUE(row_nan(f.weights, 0, 0, 1) && row_finite(f.weights, 0, 0, 0));
    }
  });
  // As a visible NaN: the row's gradient is NaN for its query and for the keys it sees.
  for (Backend be : {Backend::Reference, Backend::Fused}) {
    SCOPED_TRACE(be == Backend::Fused ? "fused backward" : "reference backward");
    const SdpaGradTensors g = backward(d, be);
    EXPECT_TRUE(row_nan(g.dq, 0, 0, 1));
    EXPECT_TRUE(row_finite(g.dq, 0, 0, 0) && row_finite(g.dq, 0, 0, 2));
    for (int64_t j : {0, 35, 69}) EXPECT_TRUE(row_nan(g.dk, 0, 0, j) && row_nan(g.dv, 0, 0, j)) << j;
  }
  // A +inf additive mask entry at one visible position: that row alone.
  Case e(1, 1, 3, 70, 4, 33);
  e.bias = Tensor({1, 1, 3, 70}, 0.0f);
  e.bias.at({0, 0, 2, 40}) = kInf;
  e.opt.masks.bias.view = e.bias.view4();
  for_each_forward(e, [&](const Fwd& f, Path p) {
    EXPECT_TRUE(row_nan(f.out, 0, 0, 2) && std::isnan(f.lse.at({0, 0, 2, 0})));
    EXPECT_TRUE(row_finite(f.out, 0, 0, 0) && row_finite(f.out, 0, 0, 1));
    if (p == Path::ReferenceWithWeights) {
      EXPECT_TRUE(row_nan(f.weights, 0, 0, 2));
    }
  });
}

/// Weights as each backend writes them: per head and averaged, over every column.
struct BothWeights {
  Tensor per_head, averaged, out;
};
BothWeights weights_of(const Tensor& q, const Tensor& k, const Tensor& v, SdpaOptions o, Backend be) {
  o.backend = be;
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Tk = k.size(2);
  BothWeights w{Tensor({B, H, Tq, Tk}, 777.0f), Tensor({B, 1, Tq, Tk}, 777.0f), Tensor({B, H, Tq, v.size(3)}, 777.0f)};
  SdpaOutputs so;
  so.out = w.out.view4(), so.weights = w.per_head.view4(), so.averaged_weights = w.averaged.view4();
  sdpa(View4<const float>(q.view4()), View4<const float>(k.view4()), View4<const float>(v.view4()), o, so);
  return w;
}

/// A row whose max is +inf is NaN in every weight column, hidden ones included, on both backends
/// (the reference wrote 0 for its hidden and −inf columns, and its head average of such a row
/// could stay finite); with no heads at all the averaged weights are zeros on both (the reference
/// gave 0 / 0, the fused kernel left them unwritten).
TEST(Infinity, PlusInfRowIsNaNInEveryWeightColumnOnBothBackends) {
  Tensor q({1, 2, 2, 2}, 0.5f), k({1, 2, 2, 2}, 0.25f), v({1, 2, 2, 2}, 1.0f);
  k.at({0, 0, 0, 0}) = kInf;  // head 0: key 0 scores +inf for both queries
  SdpaOptions o;
  o.masks.causal = Causal::top_left();  // query 0 sees key 0 only: key 1 is hidden from it
  for (Backend be : {Backend::Reference, Backend::Fused}) {
    SCOPED_TRACE(be == Backend::Fused ? "fused" : "reference");
    const BothWeights w = weights_of(q, k, v, o, be);
    for (int64_t i = 0; i < 2; ++i) {
      EXPECT_TRUE(row_nan(w.per_head, 0, 0, i)) << i;
      EXPECT_TRUE(row_nan(w.averaged, 0, 0, i)) << i;
      EXPECT_TRUE(row_finite(w.per_head, 0, 1, i)) << i;  // head 1 is untouched
    }
  }
  const Tensor q0({1, 0, 2, 4}), k0({1, 1, 3, 4}, 1.0f), v0({1, 1, 3, 4}, 1.0f);
  SdpaOptions none;
  for (Backend be : {Backend::Reference, Backend::Fused}) {
    none.backend = be;
    Tensor averaged({1, 1, 2, 3}, 777.0f), out({1, 0, 2, 4});
    SdpaOutputs so;
    so.out = out.view4(), so.averaged_weights = averaged.view4();
    sdpa(View4<const float>(q0.view4()), View4<const float>(k0.view4()), View4<const float>(v0.view4()), none, so);
    for (const float x : averaged.values()) EXPECT_EQ(x, 0.0f) << (be == Backend::Fused ? "fused" : "reference");
  }
}

/// A probability below e^−87 is 0 on the reference forward too, as the float32 exp gives it: with
/// +inf in that key's V row both backends give NaN (0 · inf). The reference kept the subnormal
/// (e^−95 · inf = inf) where the fused kernel gave NaN. PyTorch, which keeps subnormals, gives inf.
TEST(Infinity, SubnormalProbabilityTimesInfiniteValueIsTheSameOnBothBackends) {
  Tensor q({1, 1, 1, 1}, 1.0f), k({1, 1, 2, 1}), v({1, 1, 2, 1});
  k.at({0, 0, 0, 0}) = 0.0f, k.at({0, 0, 1, 0}) = -95.0f;
  v.at({0, 0, 0, 0}) = 1.0f, v.at({0, 0, 1, 0}) = kInf;
  SdpaOptions o;
  o.scale = 1.0f;
  for (Backend be : {Backend::Reference, Backend::Fused}) {
    SCOPED_TRACE(be == Backend::Fused ? "fused" : "reference");
    const BothWeights w = weights_of(q, k, v, o, be);
    EXPECT_TRUE(std::isnan(w.out.at({0, 0, 0, 0})));
    EXPECT_EQ(w.per_head.at({0, 0, 0, 1}), 0.0f);
    EXPECT_EQ(w.per_head.at({0, 0, 0, 0}), 1.0f);
  }
  k.at({0, 0, 1, 0}) = -80.0f;  // e^−80 is a normal float: kept, and inf there is inf on both
  for (Backend be : {Backend::Reference, Backend::Fused})
    EXPECT_EQ(weights_of(q, k, v, o, be).out.at({0, 0, 0, 0}), kInf) << (be == Backend::Fused ? "fused" : "reference");
  // The cut is on the score's distance to the best key, before the division by the sum: with three
  // keys at 0, a key at −86.5 has probability e^−86.5 / 3, below e^−87, and is kept on both (as in
  // PyTorch: inf); a cut on the normalised probability dropped it on the reference alone.
  Tensor k4({1, 1, 4, 1}, 0.0f), v4({1, 1, 4, 1}, 1.0f);
  k4.at({0, 0, 3, 0}) = -86.5f;
  v4.at({0, 0, 3, 0}) = kInf;
  for (Backend be : {Backend::Reference, Backend::Fused}) {
    SCOPED_TRACE(be == Backend::Fused ? "fused" : "reference");
    const BothWeights w = weights_of(q, k4, v4, o, be);
    EXPECT_EQ(w.out.at({0, 0, 0, 0}), kInf);
    EXPECT_GT(w.per_head.at({0, 0, 0, 3}), 0.0f);
  }
}

/// ±inf in a row of d out: every dp_j = dO·v_j of the row is ±inf or NaN, so the reference's
/// Σ_j p_j dp_j, and with it every dS of the row, is NaN (as in torch's autograd). The fused
/// backward forms that sum as dO·O, a +inf of one sign, and gave dS (so dK and d sinks) ±inf for
/// the keys whose V entry had the other sign until 2026-12-07; it now gives the same NaNs.
TEST(Infinity, InfiniteOutputGradientGivesTheSameNaNsOnBothBackwards) {
  Tensor q({1, 1, 2, 2}, {0.3f, -0.2f, 0.5f, 0.1f}),
      k({1, 1, 4, 2}, {0.2f, 0.4f, -0.3f, 0.1f, 0.6f, -0.5f, 0.1f, 0.2f});
  Tensor v({1, 1, 4, 2}, {1.0f, 0.3f, -1.0f, 0.2f, 2.0f, -0.4f, -0.5f, 0.7f});
  for (const float bad : {kInf, -kInf}) {
    Tensor dout({1, 1, 2, 2}, {bad, 0.5f, 0.2f, -0.1f});
    const std::vector<float> sink{0.25f};
    for (const bool with_sink : {false, true}) {
      SdpaOptions o;
      if (with_sink) o.sinks.logits = sink;
      const SdpaResult f = sdpa(q, k, v, o, Want::Lse);
      for (const int threads : {1, 2}) {
        o.threads = threads;
        for (Backend be : {Backend::Reference, Backend::Fused}) {
          SCOPED_TRACE(::testing::Message() << (be == Backend::Fused ? "fused" : "reference") << " d out " << bad
                                            << (with_sink ? " with a sink" : "") << ", threads " << threads);
          o.backend = be;
          const SdpaGradTensors g = sdpa_backward(q, k, v, f.out, dout, f.lse, o);
          for (const float x : g.dk.values()) EXPECT_TRUE(std::isnan(x)) << x;
          for (int64_t c = 0; c < 2; ++c) {
            EXPECT_TRUE(std::isnan(g.dq.at({0, 0, 0, c})));
            EXPECT_FALSE(std::isnan(g.dq.at({0, 0, 1, c})));  // the other row's gradient stays finite
          }
          if (with_sink) {
            EXPECT_TRUE(std::isnan(g.dsinks.data()[0]));
          }
        }
      }
    }
  }
}

/// A key the row sees is read even where its probability is 0: an underflow (key 1's score is
/// 400 below key 0's) or a dropped key. 0 · NaN in its V row is NaN, on the reference paths as on
/// the fused ones and in PyTorch; before 2026-12-07 the reference skipped such V rows and gave a
/// finite row. The backward passes agree too: NaN reaches dQ of the rows that read the key.
TEST(NaN, ValueOfAVisibleKeyWithProbabilityZeroIsStillRead) {
  Case c(1, 1, 2, 3, 1, 37);
  c.q.at({0, 0, 0, 0}) = c.q.at({0, 0, 1, 0}) = 1.0f;
  c.k.at({0, 0, 0, 0}) = 200.0f;
  c.k.at({0, 0, 1, 0}) = -200.0f;
  c.k.at({0, 0, 2, 0}) = 110.0f;  // p = e^−90: a float32 subnormal, below the kernels' e^−87
  c.v.at({0, 0, 1, 0}) = c.v.at({0, 0, 2, 0}) = kNaN;
  for_each_forward(c, [&](const Fwd& f, Path) {
    EXPECT_TRUE(row_nan(f.out, 0, 0, 0) && row_nan(f.out, 0, 0, 1));
    EXPECT_TRUE(std::isfinite(f.lse.at({0, 0, 0, 0})));  // the scores are finite: only out meets the NaN
  });
  for (Backend be : {Backend::Reference, Backend::Fused}) {
    SCOPED_TRACE(be == Backend::Fused ? "fused backward" : "reference backward");
    const SdpaGradTensors g = backward(c, be);
    EXPECT_TRUE(std::isnan(g.dq.at({0, 0, 0, 0})));
    // Their probabilities (e^−400, e^−90) are 0 on every path (below e^−87, where the float32
    // exp gives 0), so their dS is 0 and their dK takes no NaN: a double would keep them.
    EXPECT_EQ(g.dk.at({0, 0, 1, 0}), 0.0f);
    EXPECT_EQ(g.dk.at({0, 0, 2, 0}), 0.0f);
  }

  // Dropout: which keys are dropped depends on the seed only; poison the V row of one that is.
  Case d(1, 1, 1, 8, 4, 41);
  d.opt.dropout = {0.5f, 3};
  int64_t dropped = -1;
  const Fwd w = forward(d, Path::ReferenceWithWeights);  // the weights after dropout
  for (int64_t j = 0; j < 8 && dropped < 0; ++j)
    if (w.weights.at({0, 0, 0, j}) == 0.0f) dropped = j;
  ASSERT_GE(dropped, 0);
  for (int64_t x = 0; x < d.Dv; ++x) d.v.at({0, 0, dropped, x}) = kNaN;
  for_each_forward(d, [&](const Fwd& f, Path) { EXPECT_TRUE(row_nan(f.out, 0, 0, 0)); });
  for (Backend be : {Backend::Reference, Backend::Fused}) {
    SCOPED_TRACE(be == Backend::Fused ? "fused backward" : "reference backward");
    const SdpaGradTensors g = backward(d, be);
    EXPECT_TRUE(row_nan(g.dq, 0, 0, 0));
  }
}

/// A query whose visible scores are all −inf (here −inf in Q against keys whose entry is
/// positive) sees no score: a fully masked row on every path, forward (zeros, lse −inf) and
/// backward (dQ 0, and nothing reaches dK or dV). And a fully masked query row holding NaN gives
/// no NaN to the keys hidden from it either (before 2026-12-07 the fused backward's dK product
/// took 0 · NaN there). Rows of 70 keys cross a key block.
TEST(Infinity, RowWhoseVisibleScoresAreAllMinusInfIsFullyMasked) {
  Case c(1, 1, 3, 70, 4, 43);
  for (int64_t j = 0; j < c.Tk; ++j) c.k.at({0, 0, j, 0}) = 0.5f + std::abs(c.k.at({0, 0, j, 0}));
  c.q.at({0, 0, 1, 0}) = -kInf;
  for_each_forward(c, [&](const Fwd& f, Path) {
    for (int64_t x = 0; x < c.Dv; ++x) EXPECT_EQ(f.out.at({0, 0, 1, x}), 0.0f);
    EXPECT_EQ(f.lse.at({0, 0, 1, 0}), -kInf);
    EXPECT_TRUE(row_finite(f.out, 0, 0, 0) && row_finite(f.out, 0, 0, 2));
  });
  // With a sink the row's lse is the sink logit, not −inf; 1 to 3 threads take each of the fused
  // backward's three schemes (one item per kv-head, per head with GQA, two passes).
  const std::vector<float> sinks = {0.5f, -1.0f};
  for (bool with_sinks : {false, true})
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE(std::string(with_sinks ? "sinks, " : "") + std::to_string(threads) + " threads");
      c.opt.threads = threads;
      c.opt.sinks.logits = with_sinks ? std::span<const float>(sinks.data(), 1) : std::span<const float>();
      // Row 1's d out holds NaN and ±inf: its gradient reaches nothing, so each backend gives the
      // same bits as with that row zero.
      const auto poison_row_1 = [](Tensor& d_out) {
        for (int64_t x = 0; x < d_out.size(3); ++x)
          d_out.at({0, 0, 1, x}) = x % 3 == 0 ? kNaN : (x % 3 == 1 ? kInf : -kInf);
      };
      const auto zero_row_1 = [](Tensor& d_out) {
        for (int64_t x = 0; x < d_out.size(3); ++x) d_out.at({0, 0, 1, x}) = 0.0f;
      };
      const SdpaGradTensors ref = backward(c, Backend::Reference, poison_row_1),
                            fused = backward(c, Backend::Fused, poison_row_1);
      for (const SdpaGradTensors* g : {&ref, &fused}) {
        for (int64_t x = 0; x < c.D; ++x) EXPECT_EQ(g->dq.at({0, 0, 1, x}), 0.0f);
        EXPECT_TRUE(all_finite(g->dq) && all_finite(g->dk) && all_finite(g->dv));
      }
      for (Backend be : {Backend::Reference, Backend::Fused}) {
        SCOPED_TRACE(be == Backend::Fused ? "fused backward" : "reference backward");
        const SdpaGradTensors& got = be == Backend::Fused ? fused : ref;
        const SdpaGradTensors want = backward(c, be, zero_row_1);
        EXPECT_TRUE(testing::bitwise_equal(got.dk, want.dk));
        EXPECT_TRUE(testing::bitwise_equal(got.dv, want.dv));
      }
      EXPECT_TRUE(all_close(fused.dk, ref.dk, 1e-4, 1e-4));
      EXPECT_TRUE(all_close(fused.dv, ref.dv, 1e-4, 1e-4));

      // A NaN query row hidden by a mask, in a GQA layout (2 query heads on one K/V head, query
      // head 1's row 1 poisoned), so that the per-head scheme runs too.
      Case m(2, 2, 3, 70, 4, 47);
      m.KV = 1;
      m.k = random_tensor({2, 1, 70, 4}, 48);
      m.v = random_tensor({2, 1, 70, 4}, 49);
      for (int64_t x = 0; x < m.D; ++x) m.q.at({1, 1, 1, x}) = kNaN;
      m.set_allowed([](int64_t i, int64_t) { return i != 1; });
      m.opt.threads = threads;
      m.opt.sinks.logits = with_sinks ? std::span<const float>(sinks) : std::span<const float>();
      for (Backend be : {Backend::Reference, Backend::Fused}) {
        SCOPED_TRACE(be == Backend::Fused ? "fused backward" : "reference backward");
        const SdpaGradTensors g = backward(m, be);
        for (int64_t x = 0; x < m.D; ++x) EXPECT_EQ(g.dq.at({1, 1, 1, x}), 0.0f);
        EXPECT_TRUE(all_finite(g.dq) && all_finite(g.dk) && all_finite(g.dv));
      }
    }

  // −inf additive terms on every key row 1 sees: the same fully masked row, d out's NaN row too.
  Case a(1, 1, 3, 70, 4, 53);
  a.bias = Tensor({1, 1, 3, 70}, 0.0f);
  for (int64_t j = 0; j < 70; ++j) a.bias.at({0, 0, 1, j}) = -kInf;
  a.opt.masks.bias.view = a.bias.view4();
  for_each_forward(a, [&](const Fwd& f, Path) {
    for (int64_t x = 0; x < a.Dv; ++x) EXPECT_EQ(f.out.at({0, 0, 1, x}), 0.0f);
    EXPECT_EQ(f.lse.at({0, 0, 1, 0}), -kInf);
  });
  for (Backend be : {Backend::Reference, Backend::Fused}) {
    SCOPED_TRACE(be == Backend::Fused ? "fused backward" : "reference backward");
    const SdpaGradTensors g = backward(a, be, [](Tensor& d_out) {
      for (int64_t x = 0; x < d_out.size(3); ++x) d_out.at({0, 0, 1, x}) = kNaN;
    });
    for (int64_t x = 0; x < a.D; ++x) EXPECT_EQ(g.dq.at({0, 0, 1, x}), 0.0f);
    EXPECT_TRUE(all_finite(g.dq) && all_finite(g.dk) && all_finite(g.dv));
  }
}

/// The same with a softcap: the empty row's zeroed query against an infinite K row scores 0 · inf
/// (NaN) in the backward's recomputation, whose softcap factor must not reach dK. Other rows see
/// that key (a capped ±inf score: its factor 0), so their dQ meets 0 · inf as in PyTorch.
TEST(Infinity, FullyMaskedRowUnderASoftcapGivesNoGradient) {
  Case c(1, 1, 3, 70, 4, 59);
  c.opt.softcap = 5.0f;
  c.bias = Tensor({1, 1, 3, 70}, 0.0f);
  for (int64_t j = 0; j < 70; ++j) c.bias.at({0, 0, 1, j}) = -kInf;
  c.opt.masks.bias.view = c.bias.view4();
  c.k.at({0, 0, 40, 0}) = kInf;
  for (const std::vector<float>& sinks : {std::vector<float>{}, std::vector<float>{0.5f}}) {
    SCOPED_TRACE(sinks.empty() ? "no sink" : "sink");
    c.opt.sinks.logits = sinks;
    const SdpaGradTensors ref = backward(c, Backend::Reference), fused = backward(c, Backend::Fused);
    for (const SdpaGradTensors* g : {&ref, &fused}) {
      for (int64_t x = 0; x < c.D; ++x) EXPECT_EQ(g->dq.at({0, 0, 1, x}), 0.0f);
      EXPECT_TRUE(all_finite(g->dk) && all_finite(g->dv));
    }
    EXPECT_TRUE(all_close(fused.dk, ref.dk, 1e-4, 1e-4));
  }
}

/// A row that sees a key whose weight vanishes beside a sink (e^−200) has the output 0 and the lse
/// of an empty row, yet it saw a key: its NaN d out reaches dV and d sinks on both backends, as
/// differentiating the forward would (0 · NaN), instead of being taken for a fully masked row.
TEST(NaN, RowWhoseKeysWeightVanishesBesideASinkIsNotFullyMasked) {
  const Tensor q({1, 1, 1, 2}, 0.0f), k({1, 1, 1, 2}, 0.0f), v({1, 1, 1, 2}, 1.0f);
  const std::vector<float> sinks{200.0f};
  SdpaOptions opt;
  opt.sinks.logits = sinks;
  opt.backend = Backend::Reference;
  const SdpaResult f = sdpa(q, k, v, opt, Want::Lse);
  ASSERT_EQ(f.lse.at({0, 0, 0}), 200.0f);
  ASSERT_EQ(f.out.at({0, 0, 0, 0}), 0.0f);
  const Tensor d_out({1, 1, 1, 2}, kNaN);
  for (Backend be : {Backend::Reference, Backend::Fused}) {
    SCOPED_TRACE(be == Backend::Fused ? "fused backward" : "reference backward");
    opt.backend = be;
    const SdpaGradTensors g = sdpa_backward(q, k, v, f.out, d_out, f.lse, opt);
    EXPECT_TRUE(std::isnan(g.dv.at({0, 0, 0, 0})));
    EXPECT_TRUE(std::isnan(g.dsinks.at({0})));
  }
}

/// A score past float's range (1e20 · −1e20) is −inf on the float paths: the row saw nothing, and
/// the backwards agree (the reference's double once kept −1e40 and gave the row a gradient).
TEST(Infinity, ScorePastFloatRangeIsAFullyMaskedRowOnEveryPath) {
  const Tensor q({1, 1, 1, 1}, 1e20f), k({1, 1, 1, 1}, -1e20f), v({1, 1, 1, 1}, 1.0f), d_out({1, 1, 1, 1}, 1.0f);
  SdpaOptions opt;
  opt.scale = 1.0f;
  for (Backend fwd : {Backend::Reference, Backend::Fused}) {
    opt.backend = fwd;
    const SdpaResult f = sdpa(q, k, v, opt, Want::Lse);
    EXPECT_EQ(f.out.at({0, 0, 0, 0}), 0.0f);
    EXPECT_EQ(f.lse.at({0, 0, 0}), -kInf);
    for (Backend be : {Backend::Reference, Backend::Fused}) {
      SCOPED_TRACE(be == Backend::Fused ? "fused backward" : "reference backward");
      opt.backend = be;
      const SdpaGradTensors g = sdpa_backward(q, k, v, f.out, d_out, f.lse, opt);
      EXPECT_EQ(g.dq.at({0, 0, 0, 0}), 0.0f);
      EXPECT_EQ(g.dk.at({0, 0, 0, 0}), 0.0f);
      EXPECT_EQ(g.dv.at({0, 0, 0, 0}), 0.0f);
    }
  }
}

/// A cache of one K/V head (d = 4) holding k and v, (1, 1, 40, 4) each.
KvCache cache_of(const Tensor& k, const Tensor& v) {
  KvCacheConfig cc;
  cc.kv_heads = 1, cc.head_dim = 4, cc.capacity = 64;
  KvCache cache(cc);
  cache.append(k.view4(), v.view4());
  return cache;
}

/// Queries q (1, 1, 40, 4), query i at position i, against the cache: out, then lse.
std::pair<Tensor, Tensor> decode_40(const Tensor& q, const KvCache& cache, int splits, int64_t window = 0) {
  CacheAttentionOptions o;
  o.splits = splits;
  o.window = window;
  Tensor out({1, 1, 40, 4}), lse({1, 1, 40, 1});
  attend_cache(q.view4(), cache, std::vector<int64_t>{0}, o, out.view4(), lse.view4());
  return {out, lse};
}

/// Decoding: NaN in the cached K row at position 2 reaches exactly the queries that see it, with
/// one split and with several (the log-sum-exp merge must keep it).
TEST(NaN, DecodeAgainstACache) {
  Tensor k = random_tensor({1, 1, 40, 4}, 21), v = random_tensor({1, 1, 40, 4}, 22);
  for (int64_t x = 0; x < 4; ++x) k.at({0, 0, 2, x}) = kNaN;
  const KvCache cache = cache_of(k, v);
  Tensor q = random_tensor({1, 1, 40, 4}, 23);
  for (int64_t x = 0; x < 4; ++x) q.at({0, 0, 1, x}) = kNaN;  // position 1: a NaN query
  for (int splits : {1, 3}) {
    SCOPED_TRACE("splits " + std::to_string(splits));
    const auto [out, lse] = decode_40(q, cache, splits);
    EXPECT_TRUE(row_finite(out, 0, 0, 0));
    for (int64_t i = 1; i < 40; ++i) EXPECT_TRUE(row_nan(out, 0, 0, i) && std::isnan(lse.at({0, 0, i, 0}))) << i;
    // A window that has left position 2 behind: those rows are finite again.
    const auto [windowed, windowed_lse] = decode_40(q, cache, splits, 4);
    for (int64_t i = 6; i < 40; ++i) EXPECT_TRUE(row_finite(windowed, 0, 0, i)) << i;
  }
}

/// Decoding: a cached key whose score is +inf (K entry +inf, query entries positive) makes every
/// query that sees it NaN, as a NaN key does.
TEST(Infinity, DecodePlusInfScoreMakesTheRowNaN) {
  Tensor k = random_tensor({1, 1, 40, 4}, 41), v = random_tensor({1, 1, 40, 4}, 42);
  k.at({0, 0, 5, 0}) = kInf;
  const KvCache cache = cache_of(k, v);
  Tensor q = random_tensor({1, 1, 40, 4}, 43);
  for (int64_t i = 0; i < 40; ++i) q.at({0, 0, i, 0}) = 0.25f + std::abs(q.at({0, 0, i, 0}));
  for (int splits : {1, 3}) {
    SCOPED_TRACE("splits " + std::to_string(splits));
    const auto [out, lse] = decode_40(q, cache, splits);
    for (int64_t i = 0; i < 5; ++i) EXPECT_TRUE(row_finite(out, 0, 0, i)) << i;
    for (int64_t i = 5; i < 40; ++i) EXPECT_TRUE(row_nan(out, 0, 0, i) && std::isnan(lse.at({0, 0, i, 0}))) << i;
  }
}

// ---- 3. keys hidden from some queries only ------------------------------------------------------

/// What is promised for a key hidden per position (here by an allowed mask and by causality) whose
/// V row holds NaN: rows that see it are NaN on every path; the reference paths (forward, with
/// weights, backward) never read it for the rows that do not, which stay finite; the fused kernels
/// may read it inside a tile, so such a row is either exactly what the reference gives or NaN —
/// nothing else (docs/semantics.md, 'Padded keys are never read'). The fused kernels do read it
/// here; the check of that is informational, not a promise.
TEST(HiddenPerPosition, ReferenceNeverReadsTheFusedKernelsMay) {
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "allowed mask");
    Case c(1, 1, 8, 8, 4, 31);
    c.poison_key(0, 5, false, true);
    if (causal)
      c.opt.masks.causal = Causal::top_left();
    else
      c.set_allowed([](int64_t i, int64_t j) { return j != 5 || i >= 5; });
    const Fwd ref = forward(c, Path::Reference);
    for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(row_nan(ref.out, 0, 0, i), i >= 5) << i;
    const Fwd refw = forward(c, Path::ReferenceWithWeights);
    for (int64_t i = 0; i < 5; ++i) EXPECT_TRUE(row_finite(refw.out, 0, 0, i) && row_finite(refw.weights, 0, 0, i));
    const SdpaGradTensors g = backward(c, Backend::Reference);
    for (int64_t i = 0; i < 5; ++i) EXPECT_TRUE(row_finite(g.dq, 0, 0, i)) << i;
    for_each_fused_target([&] {
      const Fwd f = forward(c, Path::Fused);
      for (int64_t i = 0; i < 8; ++i) {
        if (i >= 5) {
          EXPECT_TRUE(row_nan(f.out, 0, 0, i)) << i;
          continue;
        }
        const bool nan_row = row_nan(f.out, 0, 0, i);
        if (!nan_row) {
          for (int64_t x = 0; x < c.Dv; ++x) EXPECT_NEAR(f.out.at({0, 0, i, x}), ref.out.at({0, 0, i, x}), 1e-5);
        }
        EXPECT_TRUE(nan_row || row_finite(f.out, 0, 0, i)) << i;
        EXPECT_TRUE(std::isfinite(f.lse.at({0, 0, i, 0}))) << i;  // lse never depends on V
      }
    });
  }
}

// ---- 4. views with a shape but no data ----------------------------------------------------------

TEST(NoData, KeyOrValueWithoutDataIsAnError) {
  Case c(1, 1, 3, 3, 4, 41);
  Tensor out({1, 1, 3, 4}), lse({1, 1, 3, 1});
  View4<const float> k = c.k.view4(), v = c.v.view4();
  View4<const float> k0 = k, v0 = v;
  k0.data = nullptr, v0.data = nullptr;
  EXPECT_THROW(sdpa(c.q.view4(), k0, v, {}, {out.view4(), {}, lse.view4()}), Error);
  EXPECT_THROW(sdpa(c.q.view4(), k, v0, {}, {out.view4(), {}, lse.view4()}), Error);
  EXPECT_NE(testing::error_of([&] {
              sdpa(c.q.view4(), k0, v, {}, {out.view4(), {}, {}});
            }).find("key"),
            std::string::npos);
  SdpaGradTensors g{Tensor(c.q.shape()), Tensor(c.k.shape()), Tensor(c.v.shape())};
  const SdpaGrads gv{g.dq.view4(), g.dk.view4(), g.dv.view4()};
  EXPECT_THROW(sdpa_backward(c.q.view4(), k0, v, out.view4(), out.view4(), lse.view4(), {}, gv), Error);
  EXPECT_THROW(sdpa_backward(c.q.view4(), k, v0, out.view4(), out.view4(), lse.view4(), {}, gv), Error);
}

// ---- 8. empty inputs ----------------------------------------------------------------------------

struct EmptyShape {
  int64_t B, H, Tq, Tk;
};

/// T = 0, T_k = 0, B = 0: empty outputs of the right shape; with T_q > 0 and T_k = 0 every row is
/// fully masked (zeros, lse −inf, weights of width 0); gradients of the right shape, zero.
TEST(Empty, SdpaEveryPath) {
  for (const EmptyShape s : {EmptyShape{2, 2, 0, 0}, EmptyShape{0, 2, 3, 3}, EmptyShape{2, 2, 3, 0},
                             EmptyShape{2, 2, 0, 3}, EmptyShape{1, 2, 70, 0}}) {
    SCOPED_TRACE("B " + std::to_string(s.B) + " T_q " + std::to_string(s.Tq) + " T_k " + std::to_string(s.Tk));
    Case c(s.B, s.H, s.Tq, s.Tk, 4, 51);
    for (bool causal : {false, true}) {
      c.opt.masks.causal = causal ? Causal::bottom_right() : Causal{};
      for_each_forward(c, [&](const Fwd& f, Path) {
        for (float x : f.out.values()) EXPECT_EQ(x, 0.0f);
        for (float x : f.lse.values()) EXPECT_EQ(x, -kInf);
      });
      for (Backend be : {Backend::Reference, Backend::Fused}) {
        const SdpaGradTensors g = backward(c, be);
        EXPECT_EQ(g.dq.shape(), c.q.shape());
        for (float x : g.dq.values()) EXPECT_EQ(x, 0.0f);
        EXPECT_EQ(g.dk.shape(), c.k.shape());
      }
    }
    const SdpaResult r = sdpa(c.q, c.k, c.v, {}, Want::Weights);
    EXPECT_EQ(r.weights.shape(), (Shape{s.B, s.H, s.Tq, s.Tk}));
  }
}

/// The module with T = 0 (queries, keys or both) and B = 0: every need_weights, training forward
/// and backward, and incremental decoding with no new token.
TEST(Empty, ModuleEveryPath) {
  const MultiheadAttention m = small_module();
  const int64_t E = 8;
  struct S {
    int64_t B, Tq, Tk;
  };
  for (const S s : {S{2, 0, 0}, S{2, 3, 0}, S{2, 0, 3}, S{0, 3, 3}}) {
    SCOPED_TRACE("B " + std::to_string(s.B) + " T_q " + std::to_string(s.Tq) + " T_k " + std::to_string(s.Tk));
    const Tensor q = random_tensor({s.Tq, s.B, E}, 61), kv = random_tensor({s.Tk, s.B, E}, 62);
    for (NeedWeights nw : {NeedWeights::None, NeedWeights::PerHead, NeedWeights::Averaged}) {
      MhaForwardOptions o;
      o.need_weights = nw;
      const MhaOutput y = m.forward(q, kv, kv, o);
      EXPECT_EQ(y.output.shape(), (Shape{s.Tq, s.B, E}));
      // No key: attention gives zeros, the output is out_proj's bias (zero at initialisation).
      for (float x : y.output.values()) EXPECT_EQ(x, 0.0f);
      if (nw == NeedWeights::PerHead) {
        EXPECT_EQ(y.attn_weights.shape(), (Shape{s.B, 2, s.Tq, s.Tk}));
      } else if (nw == NeedWeights::Averaged) {
        EXPECT_EQ(y.attn_weights.shape(), (Shape{s.B, s.Tq, s.Tk}));
      }
    }
    for (Backend be : {Backend::Reference, Backend::Fused}) {
      MhaForwardOptions o;
      o.backend = be;
      const MhaTrainOutput t = forward_train(m, q, kv, kv, o);
      EXPECT_EQ(t.output.shape(), (Shape{s.Tq, s.B, E}));
      const MhaGradients g = backward(m, t.context, Tensor(t.output.shape(), 1.0f));
      EXPECT_EQ(g.query.shape(), q.shape());
      EXPECT_EQ(g.key.shape(), kv.shape());
      EXPECT_TRUE(all_finite(g.params.in_proj_weight) && all_finite(g.params.out_proj_weight));
    }
  }
  // T_k = 0 with the module's extra positions: they are then the only keys, and the weights have
  // width 1 (zero_attn) or 2 (bias_kv and zero_attn).
  for (const bool bias_kv : {false, true}) {
    MhaConfig cfg = m.config();
    cfg.add_zero_attn = true;
    cfg.add_bias_kv = bias_kv;
    const MultiheadAttention mx(cfg, 4);
    const Tensor q = random_tensor({3, 2, E}, 64), kv({0, 2, E});
    MhaForwardOptions o;
    o.need_weights = NeedWeights::PerHead;
    const MhaOutput y = mx.forward(q, kv, kv, o);
    EXPECT_EQ(y.output.shape(), (Shape{3, 2, E}));
    EXPECT_TRUE(all_finite(y.output));
    EXPECT_EQ(y.attn_weights.shape(), (Shape{2, 2, 3, bias_kv ? 2 : 1}));
    const MhaTrainOutput t = forward_train(mx, q, kv, kv, {});
    const MhaGradients g = backward(mx, t.context, Tensor(t.output.shape(), 1.0f));
    EXPECT_EQ(g.key.shape(), kv.shape());
    EXPECT_TRUE(all_finite(g.query));
  }
  // Incremental: no new token, then a step after it.
  KvCacheConfig cc;
  cc.batch = 2, cc.kv_heads = 2, cc.head_dim = 4, cc.capacity = 8;
  KvCache cache(cc);
  const Tensor none({0, 2, E});
  const MhaOutput y0 = m.forward_incremental(none, none, none, cache);
  EXPECT_EQ(y0.output.shape(), (Shape{0, 2, E}));
  EXPECT_EQ(cache.length(0), 0);
  const Tensor one = random_tensor({1, 2, E}, 63);
  EXPECT_TRUE(all_finite(m.forward_incremental(one, one, one, cache).output));
  EXPECT_EQ(cache.length(1), 1);
}

}  // namespace
}  // namespace mha
