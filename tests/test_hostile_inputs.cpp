// Hostile sizes (issue 16, items 5, 6, 7 and 9): every reproduction fails fast with an mha::Error
// that names the argument and the shape, without allocating what the input claims.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "layers/module_core.h"
#include "mha/kv_cache.h"
#include "mha/module.h"
#include "mha/paged_kv_cache.h"
#include "mha/prune.h"
#include "mha/rope.h"
#include "mha/safetensors.h"
#include "mha/sdpa.h"
#include "mha/training.h"
#include "mha/weights.h"
#include "support/test_support.h"

namespace mha {
namespace {

using mha::testing::error_of;
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

#define EXPECT_MENTIONS(msg, needle) EXPECT_NE((msg).find(needle), std::string::npos) << (msg)

/// Peak resident set of this process so far, in bytes.
int64_t peak_rss() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

/// A weights file with only metadata (embed_dim, num_heads and `extra`) and `tensors`.
io::SafetensorsFile weights_file(const std::string& embed_dim, const std::string& num_heads,
                                 const std::map<std::string, std::string>& extra = {},
                                 const std::vector<std::pair<std::string, Shape>>& tensors = {}) {
  io::SafetensorsWriter w;
  w.set_metadata("embed_dim", embed_dim);
  w.set_metadata("num_heads", num_heads);
  for (const auto& [k, v] : extra) w.set_metadata(k, v);
  for (const auto& [name, shape] : tensors) w.add(name, Tensor(shape));
  const auto bytes = w.to_bytes();
  return io::SafetensorsFile::from_bytes(bytes, "hostile.safetensors");
}

// ---- item 6: load_module validates against the file before allocating ---------------------------

TEST(HostileWeights, HugeEmbedDimWithoutTensorsFailsFastAndSmall) {
  const int64_t rss0 = peak_rss();
  const auto t0 = std::chrono::steady_clock::now();
  // Used to zero-fill and initialise 6.3 GB for 34 s before noticing the file has no weights.
  const auto file = weights_file("20000", "1");
  const std::string msg = error_of([&] { (void)io::load_module(file); });
  EXPECT_MENTIONS(msg, "neither PyTorch");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  EXPECT_LT(peak_rss() - rss0, int64_t{64} << 20) << "bytes allocated for a file of a few hundred bytes";
}

TEST(HostileWeights, HugeEmbedDimWithAWrongSizedTensorNamesTheShape) {
  const int64_t rss0 = peak_rss();
  const auto file = weights_file("20000", "1", {}, {{"in_proj_weight", {1}}});
  const std::string msg = error_of([&] { (void)io::load_module(file); });
  EXPECT_MENTIONS(msg, "in_proj_weight");
  EXPECT_MENTIONS(msg, "(60000, 20000)");
  EXPECT_LT(peak_rss() - rss0, int64_t{64} << 20);
}

TEST(HostileWeights, EmbedDimTwoToTheFortyIsAnErrorNotBadAlloc) {
  const auto file = weights_file("1099511627776", "1");
  const std::string msg = error_of([&] { (void)io::load_module(file); });
  EXPECT_MENTIONS(msg, "hostile.safetensors");
  EXPECT_MENTIONS(msg, "does not fit in 64 bits");
}

TEST(HostileWeights, ValidFileStillLoadsBitwise) {
  MhaConfig c;
  c.embed_dim = 8, c.num_heads = 2, c.add_bias_kv = true;
  MultiheadAttention m(c, 3);
  io::SafetensorsWriter w;
  io::add_weights(w, m, io::WeightNames::HuggingFace);
  const auto bytes = w.to_bytes();
  const auto loaded = io::load_module(io::SafetensorsFile::from_bytes(bytes));
  EXPECT_EQ(loaded.params().in_proj_weight.storage(), m.params().in_proj_weight.storage());
  EXPECT_EQ(loaded.params().bias_v.storage(), m.params().bias_v.storage());
}

// ---- item 7: sizes from untrusted input are checked ---------------------------------------------

TEST(HostileSizes, ShapeNumelChecksOverflowEvenNextToAZeroExtent) {
  EXPECT_EQ(shape_numel({3, 0, 5}), 0);
  EXPECT_EQ(shape_numel({}), 1);
  const std::string msg = error_of([] { (void)shape_numel({kMax, 2, 0}); });
  EXPECT_MENTIONS(msg, "(9223372036854775807, 2, 0)");
  EXPECT_MENTIONS(msg, "64 bits");
  EXPECT_MENTIONS(error_of([] { (void)shape_numel({2, -1}); }), "negative");
  EXPECT_MENTIONS(error_of([] { BoolTensor t({kMax, 2, 0}); }), "(9223372036854775807, 2, 0)");
  EXPECT_MENTIONS(error_of([] { Tensor t({int64_t{1} << 62}); }), "(4611686018427387904)");
}

TEST(HostileSizes, CheckedMulAndAdd) {
  EXPECT_EQ(checked_mul(3, 4, "x"), 12);
  EXPECT_MENTIONS(error_of([] { (void)checked_mul(kMax, 2, "thing (a, b)"); }), "thing (a, b)");
  EXPECT_MENTIONS(error_of([] { (void)checked_add(kMax, 1, "sum"); }), "sum");
  EXPECT_MENTIONS(error_of([] { (void)checked_mul(-1, 2, "neg"); }), "negative");
}

TEST(HostileSizes, SafetensorsRejectsAnElementCountThatOverflowsBehindAZero) {
  // [2^63 − 1, 2, 0] BOOL: 0 bytes, so the byte check passed, and reading it overflowed.
  io::SafetensorsWriter w;
  w.add_raw("query", io::DType::BOOL, {kMax, 2, 0}, {});
  const auto bytes = w.to_bytes();
  const std::string msg = error_of([&] { (void)io::SafetensorsFile::from_bytes(bytes, "zero.safetensors"); });
  EXPECT_MENTIONS(msg, "zero.safetensors");
  EXPECT_MENTIONS(msg, "query");
  EXPECT_MENTIONS(msg, "(9223372036854775807, 2, 0)");
}

TEST(HostileSizes, ConfigDimensionsNearInt64MaxAreErrors) {
  for (const char* key : {"kdim", "vdim", "head_dim"}) {
    const auto file = weights_file("8", "2", {{key, "9223372036854775807"}});
    const std::string load = error_of([&] { (void)io::load_module(file); });
    EXPECT_MENTIONS(load, "64 bits");
  }
  MhaConfig c;
  c.embed_dim = 8, c.num_heads = 2, c.kdim = kMax;
  EXPECT_MENTIONS(error_of([&] { c.validate(); }), "kdim=9223372036854775807");
  EXPECT_MENTIONS(error_of([&] { (void)parameter_count(c); }), "64 bits");
  c.kdim = 0, c.head_dim_override = kMax / 2;
  EXPECT_MENTIONS(error_of([&] { MultiheadAttention m(c); }), "64 bits");
}

TEST(HostileSizes, KvCacheSizesAreChecked) {
  KvCacheConfig k;
  k.batch = kMax / 2, k.kv_heads = 4, k.head_dim = 8, k.capacity = 16;
  EXPECT_MENTIONS(error_of([&] { KvCache c(k); }), "KvCache");
  // Transposed keys round capacity up to whole tiles: near the top of int64 that is refused, and
  // a capacity whose rounded K no longer fits is caught by the size checks.
  k.batch = 1, k.key_layout = KeyLayout::Transposed;
  for (int64_t capacity : {kMax, kMax - 10}) {
    k.capacity = capacity;
    EXPECT_MENTIONS(error_of([&] { KvCache c(k); }), "whole tiles");
  }
  k.capacity = kMax / 64;
  EXPECT_MENTIONS(error_of([&] { KvCache c(k); }), "KvCache");
}

TEST(HostileSizes, CliForwardOnAnOverflowingInputFailsWithOneLine) {
  const std::string dir = testing::temp_dir();
  MhaConfig c;
  c.embed_dim = 4, c.num_heads = 2;
  io::save_module(dir + "/w.safetensors", MultiheadAttention(c), io::WeightNames::PyTorch);
  io::SafetensorsWriter in;
  in.add_raw("query", io::DType::BOOL, {kMax, 2, 0}, {});
  in.add_raw("key", io::DType::BOOL, {kMax, 2, 0}, {});
  in.add_raw("value", io::DType::BOOL, {kMax, 2, 0}, {});
  in.write(dir + "/in.safetensors");
  const auto r =
      testing::run_command(std::string(MHA_CLI_PATH) + " forward --weights " + dir + "/w.safetensors --inputs " + dir +
                           "/in.safetensors --output " + dir + "/out.safetensors");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_MENTIONS(r.err, "9223372036854775807");
}

// ---- item 5: KvCache element access checks every index ------------------------------------------

TEST(HostileIndices, KvCacheElementAccessChecksHeadAndFeature) {
  KvCacheConfig k;
  k.batch = 2, k.kv_heads = 2, k.head_dim = 3, k.value_dim = 5, k.capacity = 4;
  KvCache cache(k);
  const Tensor kk = testing::random_tensor({2, 2, 1, 3}, 1), vv = testing::random_tensor({2, 2, 1, 5}, 2);
  cache.append(View4<const float>(kk.view4()), View4<const float>(vv.view4()));
  EXPECT_EQ(cache.k_at(1, 1, 0, 2), kk.at({1, 1, 0, 2}));
  EXPECT_EQ(cache.v_at(1, 1, 0, 4), vv.at({1, 1, 0, 4}));
  EXPECT_MENTIONS(error_of([&] { (void)cache.k_at(0, 2, 0, 0); }), "head 2");
  EXPECT_MENTIONS(error_of([&] { (void)cache.k_at(0, -1, 0, 0); }), "head -1");
  EXPECT_MENTIONS(error_of([&] { (void)cache.k_at(0, 0, 0, 3); }), "feature 3");
  EXPECT_MENTIONS(error_of([&] { (void)cache.v_at(0, 0, 0, 5); }), "feature 5");
  EXPECT_MENTIONS(error_of([&] { (void)cache.v_at(0, 0, 0, -1); }), "feature -1");
  EXPECT_MENTIONS(error_of([&] { (void)cache.v_at(2, 0, 0, 0); }), "sequence 2");
  EXPECT_MENTIONS(error_of([&] { (void)cache.k_at(0, 0, 1, 0); }), "position 1");
}

// Causal offsets and windows bound the positions i + offset − window the masks form: outside
// ±2⁴⁰ they are errors, INT64_MIN included (whose absolute value an llabs check once took, and
// passed), forward and backward. (The MPI schemes check their own: tests/dist/test_dist.cpp.)
TEST(HostileIndices, CausalOffsetAndWindowOutsideTwoToTheFortyAreErrors) {
  const Tensor q = testing::random_tensor({1, 1, 2, 4}, 1);
  const View4<const float> v(q.view4());
  const auto call = [&](Causal causal) {
    SdpaOptions o;
    o.masks.causal = causal;
    (void)sdpa(q, q, q, o);
  };
  const int64_t edge = int64_t{1} << 40, kMin = std::numeric_limits<int64_t>::min();
  for (const int64_t offset : {kMin, kMin + 1, -edge - 1, edge + 1, kMax}) {
    SCOPED_TRACE(offset);
    const std::string msg = error_of([&] { call(Causal::with_offset(offset).with_window(3)); });
    EXPECT_MENTIONS(msg,
                    "causal offset " + std::to_string(offset) + " is out of range [-1099511627776, 1099511627776]");
  }
  for (const int64_t window : {edge + 1, kMax}) {
    SCOPED_TRACE(window);
    const std::string msg = error_of([&] { call(Causal::with_offset(-edge).with_window(window)); });
    EXPECT_MENTIONS(msg, "sliding window " + std::to_string(window) + " is out of range [0, 1099511627776]");
  }
  // The edges themselves are valid (the first hides every key; the second lets query i see the
  // keys after it, within the window).
  EXPECT_NO_THROW(call(Causal::with_offset(-edge).with_window(edge)));
  EXPECT_NO_THROW(call(Causal::with_offset(edge).with_window(edge)));
  // The backward checks the same way.
  SdpaOptions o;
  o.masks.causal = Causal::with_offset(kMin);
  Tensor out({1, 1, 2, 4}), lse({1, 1, 2, 1}), dq({1, 1, 2, 4}), dk({1, 1, 2, 4}), dv({1, 1, 2, 4});
  const View4<const float> cout(out.view4()), clse(lse.view4());
  EXPECT_MENTIONS(error_of([&] {
                    sdpa_backward(v, v, v, cout, v, clse, o, {dq.view4(), dk.view4(), dv.view4(), {}});
                  }),
                  "is out of range");
}

// Enums cast from integers: an alignment past Offset counted as causal with a rule no kernel
// knows, a backend past Fused as Auto. Both are errors naming the value, forward and backward.
TEST(HostileIndices, EnumValuesOutOfRangeAreErrors) {
  const Tensor q = testing::random_tensor({1, 1, 2, 4}, 1);
  const View4<const float> v(q.view4());
  SdpaOptions o;
  o.masks.causal.align = static_cast<Causal::Align>(99);
  EXPECT_MENTIONS(error_of([&] { (void)sdpa(q, q, q, o); }), "causal alignment 99 is not a Causal::Align");
  Tensor out({1, 1, 2, 4}), lse({1, 1, 2, 1}), dq({1, 1, 2, 4}), dk({1, 1, 2, 4}), dv({1, 1, 2, 4});
  const View4<const float> cout(out.view4()), clse(lse.view4());
  EXPECT_MENTIONS(error_of([&] {
                    sdpa_backward(v, v, v, cout, v, clse, o, {dq.view4(), dk.view4(), dv.view4(), {}});
                  }),
                  "is not a Causal::Align");
  o = {};
  o.backend = static_cast<Backend>(7);
  EXPECT_MENTIONS(error_of([&] { (void)sdpa(q, q, q, o); }), "backend 7 is not a Backend");
  EXPECT_MENTIONS(error_of([&] {
                    sdpa_backward(v, v, v, cout, v, clse, o, {dq.view4(), dk.view4(), dv.view4(), {}});
                  }),
                  "backend 7 is not a Backend");
}

// The caches' enums, cast from integers, were taken as the nearest valid value: a CacheDtype of 5
// stored and read float32, a KeyLayout of 5 rows, an Int8KeyScales of 5 per-token scales. Each is an
// error naming the setting and its value, on the contiguous and the paged cache.
TEST(HostileIndices, CacheEnumValuesOutOfRangeAreErrors) {
  KvCacheConfig c;
  c.kv_heads = 1;
  c.head_dim = 4;
  c.capacity = 8;
  KvCacheConfig bad = c;
  bad.dtype = static_cast<CacheDtype>(5);
  EXPECT_MENTIONS(error_of([&] { KvCache cache(bad); }), "KvCache: dtype 5 is not a CacheDtype");
  bad = c;
  bad.key_layout = static_cast<KeyLayout>(5);
  EXPECT_MENTIONS(error_of([&] { KvCache cache(bad); }), "KvCache: key_layout 5 is not a KeyLayout");
  bad = c;
  bad.dtype = CacheDtype::I8;
  bad.int8_keys = static_cast<Int8KeyScales>(5);
  EXPECT_MENTIONS(error_of([&] { KvCache cache(bad); }), "KvCache: int8_keys 5 is not an Int8KeyScales");
  EXPECT_NO_THROW(KvCache{c});

  PagedKvCacheConfig p;
  p.kv_heads = 1;
  p.head_dim = 4;
  p.num_blocks = 2;
  PagedKvCacheConfig pbad = p;
  pbad.dtype = static_cast<CacheDtype>(5);
  EXPECT_MENTIONS(error_of([&] { PagedKvCache cache(pbad); }), "PagedKvCache: dtype 5 is not a CacheDtype");
  pbad = p;
  pbad.key_layout = static_cast<KeyLayout>(5);
  EXPECT_MENTIONS(error_of([&] { PagedKvCache cache(pbad); }), "PagedKvCache: key_layout 5 is not a KeyLayout");
  EXPECT_NO_THROW(PagedKvCache{p});
}

// The module's enums, cast from integers, were taken without an error: a Mode past Training ran
// as Eval (no dropout), a NeedWeights past Averaged returned no weights, a Layout past BatchFirst
// read the inputs as SeqFirst and a RopePairing past Interleaved rotated as HalfSplit. Each is an
// error naming the setting and its value.
TEST(HostileIndices, ModuleEnumValuesOutOfRangeAreErrors) {
  MhaConfig c;
  c.embed_dim = 8;
  c.num_heads = 2;
  const MultiheadAttention m(c, 1);
  const Tensor x = testing::random_tensor({3, 2, 8}, 1);
  MhaForwardOptions o;
  o.mode = static_cast<Mode>(7);
  EXPECT_MENTIONS(error_of([&] { (void)m.forward(x, x, x, o); }), "options.mode 7 is not a Mode");
  EXPECT_MENTIONS(error_of([&] { (void)forward_train(m, x, x, x, o); }), "options.mode 7 is not a Mode");
  o = {};
  o.need_weights = static_cast<NeedWeights>(9);
  EXPECT_MENTIONS(error_of([&] { (void)m.forward(x, x, x, o); }), "options.need_weights 9 is not a NeedWeights");
  // forward_train refuses weights before it runs the pass: a NeedWeights of 9 was refused there as
  // a request for weights ("attention weights are not returned in training"), not named.
  EXPECT_MENTIONS(error_of([&] { (void)forward_train(m, x, x, x, o); }),
                  "forward_train: options.need_weights 9 is not a NeedWeights");
  MhaConfig bad = c;
  bad.layout = static_cast<Layout>(5);
  EXPECT_MENTIONS(error_of([&] { MultiheadAttention module(bad, 1); }), "MhaConfig: layout 5 is not a Layout");
  bad = c;
  bad.rope = Rope::half_split();
  bad.rope.pairing = static_cast<RopePairing>(7);
  EXPECT_MENTIONS(error_of([&] { MultiheadAttention module(bad, 1); }), "Rope: pairing 7 is not a RopePairing");
  EXPECT_NO_THROW((void)m.forward(x, x, x));

  // The same for what sdpa's owning forms return, apply_rope's direction, prune_heads' rule for
  // uneven groups and the names weights are saved under.
  const Tensor q = testing::random_tensor({1, 2, 3, 4}, 2);
  EXPECT_MENTIONS(error_of([&] { (void)sdpa(q, q, q, {}, static_cast<Want>(7)); }), "sdpa: want 7 is not a Want");
  const Tensor packed = testing::random_tensor({3, 2, 4}, 3);
  EXPECT_MENTIONS(error_of([&] {
                    (void)sdpa_varlen(packed, packed, packed, VarlenBatch{{0, 3}, {0, 3}}, {}, static_cast<Want>(7));
                  }),
                  "want 7 is not a Want");
  Tensor r = q;
  EXPECT_MENTIONS(error_of([&] { apply_rope(r.view4(), Rope::half_split(), nullptr, static_cast<RopeDirection>(5)); }),
                  "apply_rope: direction 5 is not a RopeDirection");
  PruneOptions po;
  po.uneven_groups = static_cast<UnevenGroups>(5);
  EXPECT_MENTIONS(error_of([&] { (void)prune_heads(m, {0}, po); }), "uneven_groups 5 is not an UnevenGroups");
  const std::string dir = testing::temp_dir();
  // Named by the function the caller called (save_module's said "add_weights"), and no file written.
  EXPECT_MENTIONS(error_of([&] { io::save_module(dir + "/w.safetensors", m, static_cast<io::WeightNames>(9)); }),
                  "save_module: names 9 is not a WeightNames");
  EXPECT_FALSE(std::filesystem::exists(dir + "/w.safetensors"));
  io::SafetensorsWriter writer;
  EXPECT_MENTIONS(error_of([&] { io::add_weights(writer, m, static_cast<io::WeightNames>(9)); }),
                  "add_weights: names 9 is not a WeightNames");
}

TEST(HostileConfig, RopeOverAnOddHeadDimNamesTheHeadDim) {
  MhaConfig c;
  c.embed_dim = 15, c.num_heads = 1, c.rope = Rope::half_split();
  const std::string msg = error_of([&] { MultiheadAttention m(c); });
  EXPECT_MENTIONS(msg, "the head dim 15 is odd");
  c.rope.dims = 3;
  EXPECT_MENTIONS(error_of([&] { MultiheadAttention m(c); }), "got 3");
}

TEST(HostileConfig, RopeStartsOutsideThePositionRangeAreRefused) {
  Tensor x({2, 1, 3, 4}, 1.0f);
  const Tensor before = x;
  for (const int64_t bad : {int64_t{-1}, Causal::kMaxPosition - 2, std::numeric_limits<int64_t>::max()}) {
    const int64_t start[] = {0, bad};  // start + t overflowed at INT64_MAX
    EXPECT_MENTIONS(error_of([&] { apply_rope(x.view4(), Rope::half_split(), start); }),
                    "apply_rope: start[1] = " + std::to_string(bad) + " is outside [0, 2^40 − T]");
  }
  EXPECT_TRUE(mha::testing::bitwise_equal(x, before));  // refused before anything rotates
  const int64_t edge[] = {0, Causal::kMaxPosition - 3};
  apply_rope(x.view4(), Rope::half_split(), edge);
}

// ---- item 11: outputs that share memory with inputs, each other or themselves are refused ----------
// Written over what they are computed from, they gave wrong numbers, different on each path and
// thread count (out over k or v, lse over out, weights over out, dk over k, dq over d_out).

TEST(HostileViews, SdpaOutputsOverlappingInputsOrEachOtherAreRefused) {
  const int64_t B = 1, H = 2, T = 40, d = 16;
  Tensor qkv({3, B, H, T, d}), spare({B, H, T, d + 1});
  const int64_t n = B * H * T * d;
  const View4<float> q = contiguous_view(qkv.data(), B, H, T, d), k = contiguous_view(qkv.data() + n, B, H, T, d),
                     v = contiguous_view(qkv.data() + 2 * n, B, H, T, d);
  const auto run = [&](View4<float> out, View4<float> lse = {}, View4<float> weights = {}) {
    sdpa(q, k, v, {}, {out, weights, lse});
  };
  const auto call = [&](View4<float> out, View4<float> lse = {}, View4<float> weights = {}) {
    return error_of([&] { run(out, lse, weights); });
  };
  EXPECT_MENTIONS(call(k), "sdpa: output shares memory with key");
  EXPECT_MENTIONS(call(contiguous_view(qkv.data() + 2 * n - 3, B, H, T, d)), "output shares memory with key");
  EXPECT_MENTIONS(call(contiguous_view(qkv.data() + d, B, H, T, d)), "output shares memory with query");
  const View4<float> out = contiguous_view(spare.data(), B, H, T, d);
  EXPECT_MENTIONS(call(out, {spare.data(), {B, H, T, 1}, {H * T * d, T * d, d, 1}}), "lse shares memory with output");
  Tensor w({B, H, T, T});
  EXPECT_MENTIONS(call(out, {}, {spare.data() + 5, {B, H, T, T}, {H * T * T, T * T, T, 1}}),
                  "weights shares memory with output");
  // An output that names an element twice (rows closer than their width, a stride of 0).
  EXPECT_MENTIONS(call({spare.data(), {B, H, T, d}, {H * T * d, T * d, 1, 1}}), "names some elements twice");
  EXPECT_MENTIONS(call({spare.data(), {B, H, T, d}, {0, 0, d, 1}}), "names some elements twice");
  // Apart (separate buffers, or out in part of the rows of a wider one), it runs.
  EXPECT_NO_THROW(run(out, {}, w.view4()));
  Tensor wide({B, H, T, 2 * d});
  const View4<float> left{wide.data(), {B, H, T, d}, {H * T * 2 * d, T * 2 * d, 2 * d, 1}};
  EXPECT_NO_THROW(run(left));
}

TEST(HostileViews, SdpaBackwardGradientsOverTheirInputsAreRefused) {
  const int64_t B = 1, H = 2, T = 20, d = 8;
  const Tensor q = mha::testing::random_tensor({B, H, T, d}, 1), k = mha::testing::random_tensor({B, H, T, d}, 2),
               v = mha::testing::random_tensor({B, H, T, d}, 3);
  const SdpaResult fwd = sdpa(q, k, v, {}, Want::Lse);
  Tensor d_out = mha::testing::random_tensor({B, H, T, d}, 4), dq({B, H, T, d}), dk({B, H, T, d}), dv({B, H, T, d});
  const View4<const float> lse = contiguous_view(fwd.lse.data(), B, H, T, 1);
  const auto run = [&](View4<float> gq, View4<float> gk, View4<float> gv) {
    sdpa_backward(q.view4(), k.view4(), v.view4(), fwd.out.view4(), d_out.view4(), lse, {}, {gq, gk, gv});
  };
  const auto call = [&](View4<float> gq, View4<float> gk, View4<float> gv) {
    return error_of([&] { run(gq, gk, gv); });
  };
  EXPECT_MENTIONS(call(dq.view4(), {const_cast<float*>(k.data()), k.view4().shape, k.view4().stride}, dv.view4()),
                  "sdpa_backward: dk shares memory with k");
  EXPECT_MENTIONS(call(d_out.view4(), dk.view4(), dv.view4()), "dq shares memory with d_out");
  EXPECT_MENTIONS(call(dq.view4(), dk.view4(), {dv.data(), dv.view4().shape, {H * T * d, 0, d, 1}}),
                  "dv (1, 2, 20, 8) with strides (320, 0, 8, 1) names some elements twice");
  // One buffer holding dq, dk and dv interleaved row by row (the module's packed layout) is fine.
  Tensor packed({B, T, 3, H, d});
  const auto part = [&](int64_t i) {
    return View4<float>{packed.data() + i * H * d, {B, H, T, d}, {T * 3 * H * d, d, 3 * H * d, 1}};
  };
  EXPECT_NO_THROW(run(part(0), part(1), part(2)));
  EXPECT_MENTIONS(call(part(0), part(0), part(2)), "dk and dq start at the same element");
}

TEST(HostileViews, AttendCacheLseOverOutIsRefusedQueryOverOutRuns) {
  KvCache cache(KvCacheConfig{.batch = 1, .kv_heads = 1, .head_dim = 4, .capacity = 8});
  const Tensor kv = mha::testing::random_tensor({1, 1, 5, 4}, 5);
  cache.append(kv.view4(), kv.view4());
  Tensor q = mha::testing::random_tensor({1, 2, 1, 4}, 6), out({1, 2, 1, 4});
  EXPECT_MENTIONS(error_of([&] {
                    attend_cache(q.view4(), cache, {}, {}, out.view4(), {out.data() + 1, {1, 2, 1, 1}, {8, 4, 4, 1}});
                  }),
                  "attend_cache: lse shares memory with out");
  attend_cache(q.view4(), cache, {}, {}, out.view4());
  attend_cache(q.view4(), cache, {}, {}, q.view4());  // in place: each item copies its query rows first
  EXPECT_TRUE(mha::testing::bitwise_equal(q, out));
}

// A negative thread count meant "the default" in C++ while Python refused it; zero K/V heads said
// "0 query heads must be a multiple of the 0 key/value heads" (they are refused, naming why: the
// kernels group query heads over them), zero query heads over one K/V head is an empty call.
TEST(HostileViews, NegativeThreadsAreRefusedAndZeroHeadsAreNamed) {
  const Tensor q = mha::testing::random_tensor({1, 2, 3, 4}, 1);
  SdpaOptions opt;
  opt.threads = -1;
  EXPECT_MENTIONS(error_of([&] { sdpa(q, q, q, opt); }), "threads must be ≥ 0 (0 = the library default), got -1");
  const Tensor none({1, 0, 3, 4}), one_head({1, 1, 3, 4});
  EXPECT_MENTIONS(error_of([&] { sdpa(none, none, none, {}, Want::Weights); }), "key and value need at least one head");
  const Tensor lse({1, 0, 3});
  EXPECT_MENTIONS(error_of([&] { sdpa_backward(none, none, none, none, none, lse); }), "at least one head");
  const SdpaResult empty = sdpa(none, one_head, one_head, {}, Want::WeightsAndLse);
  EXPECT_EQ(empty.out.shape(), (Shape{1, 0, 3, 4}));
  EXPECT_EQ(empty.weights.shape(), (Shape{1, 0, 3, 3}));
  const SdpaGradTensors g = sdpa_backward(none, one_head, one_head, empty.out, empty.out, empty.lse);
  EXPECT_EQ(g.dq.shape(), (Shape{1, 0, 3, 4}));
  for (float x : g.dk.values()) EXPECT_EQ(x, 0.0f);  // no query reads them
  KvCache cache(KvCacheConfig{.batch = 1, .kv_heads = 1, .head_dim = 4, .capacity = 4});
  Tensor empty_out({1, 0, 1, 4});
  attend_cache(Tensor({1, 0, 1, 4}).view4(), cache, {}, {}, empty_out.view4());
}

// ---- item 9: outputs too large are refused up front ---------------------------------------------

TEST(HostileOutputs, AttentionWeightsTooLargeNameShapeAndBytes) {
  const double need = 8.0 * 200000.0 * 200000.0 * 4.0;
  if (static_cast<double>(detail::physical_memory_bytes()) > need) GTEST_SKIP() << "machine holds 1.16 TiB";
  MhaConfig c;
  c.embed_dim = 8, c.num_heads = 8;
  const MultiheadAttention m(c);
  const Tensor x({200000, 1, 8});
  MhaForwardOptions o;
  o.need_weights = NeedWeights::PerHead;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = error_of([&] { (void)m.forward(x, x, x, o); });
  EXPECT_MENTIONS(msg, "attention weights (1, 8, 200000, 200000) need 1.16 TiB");
  EXPECT_MENTIONS(msg, "MultiheadAttention.forward");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  // Averaged weights are checked too (formed in place, with no per-head intermediate), and without
  // weights the same call is small.
  o.need_weights = NeedWeights::Averaged;
  EXPECT_MENTIONS(error_of([&] { (void)m.forward(x, x, x, o); }),
                  "averaged attention weights (1, 200000, 200000) need");
}

TEST(HostileOutputs, WriterStreamsReferencedTensorsWithProgress) {
  const Tensor big = testing::random_tensor({1000, 300}, 7);
  io::SafetensorsWriter w;
  w.add_ref("big", big);
  w.add("small", Tensor({2}, 1.0f));
  const std::string path = testing::temp_dir() + "/streamed.safetensors";
  uint64_t last = 0, calls = 0, total = 0;
  w.write(path, [&](uint64_t done, uint64_t all) {
    EXPECT_GE(done, last);
    last = done, total = all, ++calls;
  });
  EXPECT_EQ(last, total);
  EXPECT_GE(calls, 1u);
  EXPECT_EQ(std::filesystem::file_size(path), total);
  const auto f = io::SafetensorsFile::open(path);
  EXPECT_EQ(f.read_f32("big").storage(), big.storage());
  EXPECT_EQ(w.to_bytes().size(), total);
}

}  // namespace
}  // namespace mha
