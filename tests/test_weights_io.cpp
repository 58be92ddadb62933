// The module's weights in safetensors files: both naming schemes round-trip bitwise, shapes and
// presence are checked against the configuration, and the shared PyTorch cases load into a module
// that reproduces PyTorch's output.
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "mha/safetensors.h"
#include "mha/weights.h"
#include "support/test_support.h"

namespace mha::io {
namespace {

using mha::testing::error_of;

#define EXPECT_ERROR_MENTIONS(stmt, ...)                                                          \
  do {                                                                                            \
    const std::string msg_ = error_of([&] { stmt; });                                             \
    for (const std::string& needle_ : std::initializer_list<std::string>{__VA_ARGS__})            \
      EXPECT_NE(msg_.find(needle_), std::string::npos) << "'" << needle_ << "' not in: " << msg_; \
  } while (0)

using mha::testing::named_parameters;

/// A module whose every parameter (biases included, which PyTorch initialises to zero) is random,
/// so that a value landing in the wrong place cannot go unnoticed.
MultiheadAttention random_module(const MhaConfig& config, uint64_t seed) {
  MultiheadAttention m(config, seed);
  MhaParameters& p = m.params();
  uint64_t s = seed * 100;
  for (Tensor* t : {&p.in_proj_weight, &p.q_proj_weight, &p.k_proj_weight, &p.v_proj_weight, &p.in_proj_bias, &p.bias_k,
                    &p.bias_v, &p.out_proj_weight, &p.out_proj_bias})
    if (t->defined()) *t = testing::random_tensor(t->shape(), ++s);
  return m;
}

void expect_same_params(const MultiheadAttention& got, const MultiheadAttention& want) {
  const auto a = named_parameters(got.params()), b = named_parameters(want.params());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(testing::bitwise_equal(*a[i].second, *b[i].second)) << a[i].first;
}

void expect_same_config(const MhaConfig& got, const MhaConfig& want) {
  EXPECT_EQ(got.embed_dim, want.embed_dim);
  EXPECT_EQ(got.num_heads, want.num_heads);
  EXPECT_EQ(got.kv_heads(), want.kv_heads());
  EXPECT_EQ(got.key_dim(), want.key_dim());
  EXPECT_EQ(got.value_dim(), want.value_dim());
  EXPECT_EQ(got.bias, want.bias);
  EXPECT_EQ(got.add_bias_kv, want.add_bias_kv);
  EXPECT_EQ(got.add_zero_attn, want.add_zero_attn);
  EXPECT_EQ(got.layout, want.layout);
  EXPECT_EQ(got.dropout, want.dropout);
  EXPECT_EQ(got.head_dim(), want.head_dim());
  EXPECT_EQ(got.rope.enabled, want.rope.enabled);
  if (want.rope.enabled) {
    EXPECT_EQ(got.rope.pairing, want.rope.pairing);
    EXPECT_EQ(got.rope.theta, want.rope.theta);
    EXPECT_EQ(got.rope.dims, want.rope.dims);
  }
}

struct NamedConfig {
  const char* name;
  MhaConfig config;
};

std::vector<NamedConfig> configs() {
  std::vector<NamedConfig> out;
  MhaConfig c;
  c.embed_dim = 8, c.num_heads = 2;
  out.push_back({"self", c});
  c.add_bias_kv = true, c.add_zero_attn = true, c.layout = Layout::BatchFirst, c.dropout = 0.125f;
  out.push_back({"bias_kv", c});
  c = MhaConfig{};
  c.embed_dim = 16, c.num_heads = 4, c.kdim = 10, c.vdim = 6;
  out.push_back({"cross", c});
  c = MhaConfig{};
  c.embed_dim = 32, c.num_heads = 8, c.num_kv_heads = 2, c.add_bias_kv = true;
  out.push_back({"gqa", c});
  c = MhaConfig{};
  c.embed_dim = 24, c.num_heads = 4, c.num_kv_heads = 1, c.kdim = 12, c.bias = false;
  out.push_back({"mqa_cross_nobias", c});
  c = MhaConfig{};
  c.embed_dim = 12, c.num_heads = 3, c.bias = false;
  out.push_back({"nobias", c});
  // h·d ≠ E (a pruned module) with RoPE: both must survive the trip through the metadata.
  c = MhaConfig{};
  c.embed_dim = 8, c.num_heads = 2, c.num_kv_heads = 1, c.head_dim_override = 6, c.rope = Rope::interleaved(5e5, 4);
  out.push_back({"pruned_rope", c});
  c = MhaConfig{};
  c.embed_dim = 16, c.num_heads = 4, c.rope = Rope::half_split(10000.5);
  out.push_back({"rope", c});
  return out;
}

std::string scheme_name(WeightNames n) { return n == WeightNames::PyTorch ? "PyTorch" : "HuggingFace"; }

// ---- round trips -------------------------------------------------------------------------------

TEST(WeightsIo, SaveAndLoadRoundTripBitwiseUnderBothNamingSchemes) {
  for (const auto& [label, config] : configs()) {
    for (WeightNames names : {WeightNames::PyTorch, WeightNames::HuggingFace}) {
      SCOPED_TRACE(std::string(label) + " / " + scheme_name(names));
      const MultiheadAttention m = random_module(config, 11);
      const std::string path = testing::temp_dir() + "/m.safetensors";
      save_module(path, m, names);

      const auto file = SafetensorsFile::open(path);
      EXPECT_EQ(detect_weight_names(file), names);
      EXPECT_EQ(file.metadata().at("format"), "mha-weights/1");
      const MultiheadAttention loaded = load_module(file);
      expect_same_config(loaded.config(), m.config());
      expect_same_params(loaded, m);
      EXPECT_NO_THROW(loaded.check_params());

      // load_weights into an existing module of the same configuration replaces every parameter.
      MultiheadAttention other(config, 99);
      load_weights(other, file);
      expect_same_params(other, m);
    }
  }
}

TEST(WeightsIo, PyTorchNamesAreTheStateDictNames) {
  MhaConfig c;
  c.embed_dim = 8, c.num_heads = 2, c.add_bias_kv = true;
  SafetensorsWriter w;
  add_weights(w, random_module(c, 1), WeightNames::PyTorch);
  const auto f = SafetensorsFile::from_bytes(w.to_bytes());
  EXPECT_EQ(f.names(), (std::vector<std::string>{"bias_k", "bias_v", "in_proj_bias", "in_proj_weight", "out_proj.bias",
                                                 "out_proj.weight"}));
  EXPECT_EQ(f.info("in_proj_weight").shape, (Shape{24, 8}));
  EXPECT_EQ(f.info("bias_k").shape, (Shape{1, 1, 8}));

  c.kdim = 5;
  SafetensorsWriter w2;
  add_weights(w2, random_module(c, 1), WeightNames::PyTorch);
  const auto g = SafetensorsFile::from_bytes(w2.to_bytes());
  EXPECT_FALSE(g.contains("in_proj_weight"));
  EXPECT_EQ(g.info("q_proj_weight").shape, (Shape{8, 8}));
  EXPECT_EQ(g.info("k_proj_weight").shape, (Shape{8, 5}));
  EXPECT_EQ(g.info("v_proj_weight").shape, (Shape{8, 8}));
}

TEST(WeightsIo, HuggingFaceNamesSplitThePackedProjectionForGqa) {
  MhaConfig c;
  c.embed_dim = 32, c.num_heads = 8, c.num_kv_heads = 2;  // d = 4: q 32 rows, k and v 8 rows each
  const MultiheadAttention m = random_module(c, 3);
  SafetensorsWriter w;
  add_weights(w, m, WeightNames::HuggingFace);
  const auto f = SafetensorsFile::from_bytes(w.to_bytes(), "gqa-hf");
  EXPECT_EQ(f.names(), (std::vector<std::string>{"k_proj.bias", "k_proj.weight", "o_proj.bias", "o_proj.weight",
                                                 "q_proj.bias", "q_proj.weight", "v_proj.bias", "v_proj.weight"}));
  EXPECT_EQ(f.metadata().at("num_kv_heads"), "2");
  EXPECT_EQ(f.info("q_proj.weight").shape, (Shape{32, 32}));
  EXPECT_EQ(f.info("k_proj.weight").shape, (Shape{8, 32}));
  EXPECT_EQ(f.info("v_proj.weight").shape, (Shape{8, 32}));
  EXPECT_EQ(f.info("k_proj.bias").shape, (Shape{8}));
  EXPECT_EQ(f.info("o_proj.weight").shape, (Shape{32, 32}));

  // k_proj.weight is rows [32, 40) of the packed weight, v_proj.bias entries [40, 48) of the bias.
  const Tensor k = f.read_f32("k_proj.weight");
  const Tensor vb = f.read_f32("v_proj.bias");
  for (int64_t r = 0; r < 8; ++r) {
    for (int64_t col = 0; col < 32; ++col) EXPECT_EQ(k.at({r, col}), m.params().in_proj_weight.at({32 + r, col}));
    EXPECT_EQ(vb.at({r}), m.params().in_proj_bias.at({40 + r}));
  }
  const MultiheadAttention loaded = load_module(f);
  expect_same_params(loaded, m);
}

TEST(WeightsIo, MetadataRoundTripsTheConfig) {
  for (const auto& [label, config] : configs()) {
    SCOPED_TRACE(label);
    expect_same_config(config_from_metadata(metadata_from_config(config), label), config);
  }
}

// ---- configuration errors ----------------------------------------------------------------------

TEST(WeightsIo, ConfigFromMetadataNamesTheKeyAndValue) {
  const std::map<std::string, std::string> good{{"embed_dim", "8"}, {"num_heads", "2"}};
  EXPECT_EQ(config_from_metadata(good, "f").embed_dim, 8);
  EXPECT_EQ(config_from_metadata(good, "f").layout, Layout::SeqFirst);
  EXPECT_TRUE(config_from_metadata(good, "f").bias);

  auto without = [&](const std::string& key) {
    auto m = good;
    m.erase(key);
    return m;
  };
  auto with = [&](const std::string& key, const std::string& value) {
    auto m = good;
    m[key] = value;
    return m;
  };
  EXPECT_ERROR_MENTIONS(config_from_metadata(without("embed_dim"), "w.st"), "w.st", "'embed_dim'");
  EXPECT_ERROR_MENTIONS(config_from_metadata(without("num_heads"), "w.st"), "w.st", "'num_heads'");
  EXPECT_ERROR_MENTIONS(config_from_metadata(with("num_heads", "two"), "w.st"), "'num_heads'", "'two'");
  EXPECT_ERROR_MENTIONS(config_from_metadata(with("embed_dim", "8.5"), "w.st"), "'embed_dim'", "'8.5'");
  EXPECT_ERROR_MENTIONS(config_from_metadata(with("embed_dim", ""), "w.st"), "'embed_dim'");
  EXPECT_ERROR_MENTIONS(config_from_metadata(with("kdim", "99999999999999999999"), "w.st"), "'kdim'");
  EXPECT_ERROR_MENTIONS(config_from_metadata(with("bias", "yes please"), "w.st"), "'bias'", "'yes please'");
  EXPECT_ERROR_MENTIONS(config_from_metadata(with("batch_first", "2"), "w.st"), "'batch_first'");
  EXPECT_ERROR_MENTIONS(config_from_metadata(with("dropout", "lots"), "w.st"), "'dropout'", "'lots'");
  // Values that parse but make no sense are rejected by MhaConfig::validate, naming the file.
  EXPECT_ERROR_MENTIONS(config_from_metadata(with("num_heads", "3"), "w.st"), "w.st", "3");
  EXPECT_ERROR_MENTIONS(config_from_metadata(with("num_kv_heads", "-1"), "w.st"), "w.st");
  EXPECT_ERROR_MENTIONS(config_from_metadata(with("dropout", "1.5"), "w.st"), "w.st");
  EXPECT_ERROR_MENTIONS(config_from_metadata(with("rope", "yarn"), "w.st"), "'rope'", "'yarn'");
  EXPECT_ERROR_MENTIONS(config_from_metadata(with("head_dim", "four"), "w.st"), "'head_dim'", "'four'");
  // 8 is not divisible by 3 heads, but with an explicit head dim it is a valid (pruned) module.
  auto pruned = with("num_heads", "3");
  pruned["head_dim"] = "2";
  EXPECT_EQ(config_from_metadata(pruned, "w.st").head_dim(), 2);

  const auto m = config_from_metadata(with("batch_first", "True"), "w.st");
  EXPECT_EQ(m.layout, Layout::BatchFirst);
}

// ---- bad files ---------------------------------------------------------------------------------

/// Everything in `file`, as float32 tensors by name, to be edited and written back.
std::map<std::string, Tensor> tensors_of(const SafetensorsFile& file) {
  std::map<std::string, Tensor> out;
  for (const auto& name : file.names()) out[name] = file.read_f32(name);
  return out;
}

SafetensorsFile rewrite(const std::map<std::string, std::string>& metadata, const std::map<std::string, Tensor>& ts) {
  SafetensorsWriter w;
  for (const auto& [k, v] : metadata) w.set_metadata(k, v);
  for (const auto& [name, t] : ts) w.add(name, t);
  return SafetensorsFile::from_bytes(w.to_bytes(), "edited.safetensors");
}

struct Saved {
  MhaConfig config;
  std::map<std::string, std::string> metadata;
  std::map<std::string, Tensor> tensors;
};

Saved saved(const MhaConfig& c, WeightNames names) {
  SafetensorsWriter w;
  add_weights(w, random_module(c, 5), names);
  const auto f = SafetensorsFile::from_bytes(w.to_bytes());
  return {c, f.metadata(), tensors_of(f)};
}

MhaConfig gqa_config() {
  MhaConfig c;
  c.embed_dim = 32, c.num_heads = 8, c.num_kv_heads = 2;
  return c;
}

TEST(WeightsIo, ShapeMismatchNamesTheTensorAndBothShapes) {
  {
    auto s = saved(gqa_config(), WeightNames::PyTorch);
    s.tensors["in_proj_weight"] = Tensor({96, 32});  // as if kv = h: wrong for GQA
    EXPECT_ERROR_MENTIONS(load_module(rewrite(s.metadata, s.tensors)), "edited.safetensors", "'in_proj_weight'",
                          "(96, 32)", "(48, 32)");
  }
  {
    auto s = saved(gqa_config(), WeightNames::HuggingFace);
    s.tensors["k_proj.weight"] = Tensor({32, 32});
    EXPECT_ERROR_MENTIONS(load_module(rewrite(s.metadata, s.tensors)), "'k_proj.weight'", "(32, 32)", "(8, 32)");
  }
  {
    auto s = saved(gqa_config(), WeightNames::HuggingFace);
    s.tensors["v_proj.bias"] = Tensor({1, 8});
    EXPECT_ERROR_MENTIONS(load_module(rewrite(s.metadata, s.tensors)), "'v_proj.bias'", "(1, 8)", "(8)");
  }
  {
    auto s = saved(gqa_config(), WeightNames::PyTorch);
    s.tensors["out_proj.weight"] = Tensor({32, 31});
    EXPECT_ERROR_MENTIONS(load_module(rewrite(s.metadata, s.tensors)), "'out_proj.weight'", "(32, 31)", "(32, 32)");
  }
}

TEST(WeightsIo, MissingTensorsAreNamed) {
  for (WeightNames names : {WeightNames::PyTorch, WeightNames::HuggingFace}) {
    MhaConfig c = gqa_config();
    c.add_bias_kv = true;
    const Saved base = saved(c, names);
    for (const auto& [name, t] : base.tensors) {
      SCOPED_TRACE(name);
      auto ts = base.tensors;
      ts.erase(name);
      if (ts.empty()) continue;
      const auto file = rewrite(base.metadata, ts);
      const std::string msg = error_of([&] { load_module(file); });
      // Removing the only tensor that identifies the scheme makes it undetectable; otherwise the
      // message names exactly what is missing.
      if (msg.find("neither") != std::string::npos) continue;
      EXPECT_NE(msg.find("missing tensor '" + name + "'"), std::string::npos) << msg;
    }
  }
}

TEST(WeightsIo, BiasPresenceMustMatchTheConfig) {
  MhaConfig with_bias = gqa_config();
  MhaConfig no_bias = gqa_config();
  no_bias.bias = false;
  for (WeightNames names : {WeightNames::PyTorch, WeightNames::HuggingFace}) {
    SCOPED_TRACE(scheme_name(names));
    // A file with biases but metadata saying bias=false.
    const Saved s = saved(with_bias, names);
    const auto file = rewrite(metadata_from_config(no_bias), s.tensors);
    const std::string bias_name = names == WeightNames::PyTorch ? "in_proj_bias" : "q_proj.bias";
    EXPECT_ERROR_MENTIONS(load_module(file), "'" + bias_name + "'", "bias=false");
    // And the other way: bias=true without the tensors.
    const Saved n = saved(no_bias, names);
    EXPECT_ERROR_MENTIONS(load_module(rewrite(metadata_from_config(with_bias), n.tensors)), "missing tensor",
                          bias_name);
  }
  // bias_k / bias_v without add_bias_kv.
  MhaConfig kv = gqa_config();
  kv.add_bias_kv = true;
  const Saved s = saved(kv, WeightNames::PyTorch);
  EXPECT_ERROR_MENTIONS(load_module(rewrite(metadata_from_config(gqa_config()), s.tensors)), "'bias_k'",
                        "add_bias_kv=false");
}

// The other scheme's parameter names are refused, not ignored: a PyTorch-named file holding
// q_proj.bias with bias=false loaded without those biases.
TEST(WeightsIo, TheOtherSchemesParametersAreRefused) {
  MhaConfig no_bias = gqa_config();
  no_bias.bias = false;
  const Saved torch = saved(no_bias, WeightNames::PyTorch);
  auto ts = torch.tensors;
  ts.emplace("q_proj.bias", Tensor({no_bias.num_heads * no_bias.head_dim()}));
  EXPECT_ERROR_MENTIONS(load_module(rewrite(torch.metadata, ts)), "'q_proj.bias' is present", "uses PyTorch's names");
  const Saved hf = saved(gqa_config(), WeightNames::HuggingFace);
  ts = hf.tensors;
  ts.emplace("in_proj_bias", Tensor({gqa_config().in_proj_rows()}));
  EXPECT_ERROR_MENTIONS(load_module(rewrite(hf.metadata, ts)), "'in_proj_bias' is present",
                        "uses Hugging Face's names");
}

// Metadata that would be silently unused, or whose message would mislead.
TEST(WeightsIo, MetadataThatWouldBeIgnoredOrMisnamedIsRefusedClearly) {
  const std::map<std::string, std::string> good{{"embed_dim", "8"}, {"num_heads", "2"}};
  for (const char* key : {"rope_theta", "rope_dims"}) {
    auto m = good;
    m[key] = "4";
    EXPECT_ERROR_MENTIONS(config_from_metadata(m, "w.st"), std::string("'") + key + "' is given but 'rope' is not");
    m["rope"] = "none";
    EXPECT_ERROR_MENTIONS(config_from_metadata(m, "w.st"), "'rope' is not");
    m["rope"] = "half_split";
    EXPECT_TRUE(config_from_metadata(m, "w.st").rope.enabled);
  }
  auto m = good;
  m["alibi_slopes"] = "1,2,3,4,5,6";  // the parse stops after h + 1: the count is the list's own
  EXPECT_ERROR_MENTIONS(config_from_metadata(m, "w.st"), "'alibi_slopes' has 6 entries, expected one per head (2)");
  for (const char* yes : {"true", "True", "1"}) EXPECT_TRUE(metadata_bool("w.st", "k", yes));
  for (const char* no : {"false", "False", "0"}) EXPECT_FALSE(metadata_bool("w.st", "k", no));
  EXPECT_ERROR_MENTIONS(metadata_bool("w.st", "is_causal", "yes"), "w.st", "'is_causal' = 'yes' is not true or false");
  // A Llama-style file without biases or a 'bias' key: the message says bias defaults to true.
  MhaConfig no_bias = gqa_config();
  no_bias.bias = false;
  const Saved s = saved(no_bias, WeightNames::HuggingFace);
  auto meta = s.metadata;
  meta.erase("bias");
  EXPECT_ERROR_MENTIONS(load_module(rewrite(meta, s.tensors)), "missing tensor 'q_proj.bias'",
                        "'bias' is absent and defaults to true");
}

TEST(WeightsIo, PackedAndSeparateProjectionsAreNotInterchangeableUnderPyTorchNames) {
  MhaConfig cross = gqa_config();
  cross.kdim = 16;
  const Saved s = saved(cross, WeightNames::PyTorch);  // q/k/v_proj_weight
  MhaConfig packed = gqa_config();
  EXPECT_ERROR_MENTIONS(load_module(rewrite(metadata_from_config(packed), s.tensors)), "'q_proj_weight'");
}

TEST(WeightsIo, FailedLoadLeavesTheModuleUnchanged) {
  const MhaConfig c = gqa_config();
  auto s = saved(c, WeightNames::HuggingFace);
  s.tensors["o_proj.weight"] = Tensor({1});
  MultiheadAttention m = random_module(c, 8);
  const MultiheadAttention before = m;
  EXPECT_THROW(load_weights(m, rewrite(s.metadata, s.tensors)), Error);
  expect_same_params(m, before);
}

// Equal shapes are not the same module: weights saved from 8 heads fit a module of 4 heads of the
// same width, and a module with RoPE or a softcap reads them as something else. A file that stores
// its configuration loads only into that configuration (but the layout and dropout, which say how
// the module is called); a file without one is checked by shapes alone, as before.
TEST(WeightsIo, LoadWeightsRefusesAModuleOfAnotherConfiguration) {
  const MhaConfig c = gqa_config();
  const auto s = saved(c, WeightNames::PyTorch);
  const SafetensorsFile file = rewrite(s.metadata, s.tensors);
  MhaConfig fewer_heads = c;
  fewer_heads.num_heads = 4;
  MhaConfig with_rope = c;
  with_rope.rope = Rope::half_split(10000.0);
  MhaConfig capped = c;
  capped.softcap = 30.0f;
  for (const auto& [other, needle] :
       std::vector<std::pair<MhaConfig, std::string>>{{fewer_heads, "num_heads = 8 where the module's has 4"},
                                                      {with_rope, "rope = none where the module's has half_split"},
                                                      {capped, "softcap = 0 where the module's has 30"}}) {
    MultiheadAttention m = random_module(other, 8);
    const MultiheadAttention before = m;
    EXPECT_ERROR_MENTIONS(load_weights(m, file), "edited.safetensors", needle);
    expect_same_params(m, before);
  }
  MhaConfig called_otherwise = c;
  called_otherwise.layout = Layout::BatchFirst, called_otherwise.dropout = 0.25f;
  MultiheadAttention m = random_module(called_otherwise, 8);
  load_weights(m, file);
  expect_same_params(m, load_module(file));
  std::map<std::string, std::string> no_config;  // tensors alone: shapes decide
  MultiheadAttention n = random_module(c, 9);
  load_weights(n, rewrite(no_config, s.tensors));
  expect_same_params(n, load_module(file));
  // A foreign file states a few fields: those are compared, as they resolve; the rest are not
  // (bias absent is no claim that there are biases). Another spelling of the same module loads.
  MhaConfig no_bias = c;
  no_bias.bias = false;
  auto nb = saved(no_bias, WeightNames::PyTorch);
  const std::map<std::string, std::string> sparse{
      {"embed_dim", "32"}, {"num_heads", "8"}, {"head_dim", "4"}, {"scale", "0.5"}};
  MultiheadAttention o = random_module(no_bias, 10);
  load_weights(o, rewrite(sparse, nb.tensors));
  std::map<std::string, std::string> other_scale = sparse;
  other_scale["scale"] = "0.25";
  EXPECT_ERROR_MENTIONS(load_weights(o, rewrite(other_scale, nb.tensors)),
                        "scale = 0.25 where the module's has 1/sqrt(head_dim)");
  // 1/√24 correctly rounded is an ulp from 1.0f / sqrtf(24): the same default scale. A softcap of
  // −0 is no softcap (a module saved with it reloads into itself). rope alone states no theta.
  MhaConfig d24;
  d24.embed_dim = 48, d24.num_heads = 2, d24.softcap = -0.0f;
  d24.rope = Rope::half_split(500000.0);
  const auto s24 = saved(d24, WeightNames::PyTorch);
  MultiheadAttention m24 = random_module(d24, 11);
  load_weights(m24, rewrite(s24.metadata, s24.tensors));
  const std::map<std::string, std::string> foreign24{
      {"embed_dim", "48"}, {"num_heads", "2"}, {"scale", "0.20412414523193154"}, {"rope", "half_split"}};
  load_weights(m24, rewrite(foreign24, s24.tensors));
}

// A file that states some fields but not embed_dim or num_heads was compared on nothing: one
// saying num_heads = 2 (a hand-written or foreign header) loaded into a module of 4 heads of the
// same width, whose projections have the same shapes. The module's width and head count now stand
// in for the ones the file leaves out, and every field it states is compared.
TEST(WeightsIo, FieldsStatedWithoutEmbedDimOrNumHeadsAreStillCompared) {
  MhaConfig two;
  two.embed_dim = 8, two.num_heads = 2;
  const auto s = saved(two, WeightNames::PyTorch);
  MhaConfig four = two;
  four.num_heads = 4;
  MultiheadAttention m4 = random_module(four, 8);
  const MultiheadAttention before = m4;
  EXPECT_ERROR_MENTIONS(load_weights(m4, rewrite({{"num_heads", "2"}}, s.tensors)), "edited.safetensors",
                        "num_heads = 2 where the module's has 4");
  expect_same_params(m4, before);
  EXPECT_ERROR_MENTIONS(load_weights(m4, rewrite({{"embed_dim", "8"}, {"rope", "half_split"}}, s.tensors)),
                        "rope = half_split where the module's has none");
  EXPECT_ERROR_MENTIONS(load_weights(m4, rewrite({{"num_kv_heads", "1"}}, s.tensors)),
                        "num_kv_heads = 1 where the module's has 4");
  // A stated field that does not fit the module's width names what was borrowed, not "embed_dim 8
  // is not divisible by num_heads 3" as if the file had said embed_dim = 8.
  EXPECT_ERROR_MENTIONS(load_weights(m4, rewrite({{"num_heads", "3"}}, s.tensors)),
                        "completed with the module's embed_dim = 8 (which the file does not state)",
                        "not divisible by num_heads 3");
  expect_same_params(m4, before);
  // What agrees loads: the stated head count into its own module, and a head count stated alone
  // into a module whose head_dim override the file does not repeat (8 is not a multiple of 3).
  MultiheadAttention m2 = random_module(two, 9);
  load_weights(m2, rewrite({{"num_heads", "2"}}, s.tensors));
  expect_same_params(m2, load_module(rewrite(s.metadata, s.tensors)));
  MhaConfig three = two;
  three.num_heads = 3, three.head_dim_override = 4;
  const auto s3 = saved(three, WeightNames::PyTorch);
  MultiheadAttention m3 = random_module(three, 10);
  load_weights(m3, rewrite({{"num_heads", "3"}}, s3.tensors));
  // Keys that describe no configuration field (the CLI's, layout, dropout) still compare nothing.
  load_weights(m4,
               rewrite({{"is_causal", "true"}, {"batch_first", "true"}}, saved(four, WeightNames::PyTorch).tensors));
}

TEST(WeightsIo, DetectsTheNamingSchemeOrSaysWhyNot) {
  SafetensorsWriter neither;
  neither.add("query", Tensor({2, 2}));
  const auto f = SafetensorsFile::from_bytes(neither.to_bytes(), "inputs.safetensors");
  EXPECT_ERROR_MENTIONS(detect_weight_names(f), "inputs.safetensors", "neither");

  SafetensorsWriter both;
  both.add("in_proj_weight", Tensor({2, 2}));
  both.add("q_proj.weight", Tensor({2, 2}));
  EXPECT_ERROR_MENTIONS(detect_weight_names(SafetensorsFile::from_bytes(both.to_bytes(), "both")), "both");
}

TEST(WeightsIo, NonFloatWeightsAreRejected) {
  auto s = saved(gqa_config(), WeightNames::PyTorch);
  SafetensorsWriter w;
  for (const auto& [k, v] : s.metadata) w.set_metadata(k, v);
  for (const auto& [name, t] : s.tensors)
    if (name != "out_proj.bias") w.add(name, t);
  w.add_raw("out_proj.bias", DType::I32, {32}, std::vector<std::byte>(128));
  EXPECT_ERROR_MENTIONS(load_module(SafetensorsFile::from_bytes(w.to_bytes())), "'out_proj.bias'", "I32");
}

TEST(WeightsIo, AcceptsLowerPrecisionWeights) {
  // BF16 weights load (widened exactly to float32).
  const MhaConfig c = gqa_config();
  const Saved s = saved(c, WeightNames::HuggingFace);
  SafetensorsWriter w;
  for (const auto& [k, v] : s.metadata) w.set_metadata(k, v);
  std::map<std::string, Tensor> rounded;
  for (const auto& [name, t] : s.tensors) {
    BF16Tensor b(t.shape());
    Tensor r(t.shape());
    for (int64_t i = 0; i < t.numel(); ++i) {
      b.data()[i] = to_bf16(t.data()[i]);
      r.data()[i] = to_float(b.data()[i]);
    }
    w.add(name, b);
    rounded[name] = r;
  }
  const MultiheadAttention m = load_module(SafetensorsFile::from_bytes(w.to_bytes()));
  const MultiheadAttention want = load_module(rewrite(s.metadata, rounded));
  expect_same_params(m, want);
}

// ---- the shared PyTorch cases ------------------------------------------------------------------

TEST(WeightsIo, SharedCasesLoadAndReproducePyTorch) {
  const std::filesystem::path dir = MHA_SHARED_DIR "/conformance/cases";
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " not present";
  int cases = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    SCOPED_TRACE(entry.path().filename().string());
    ++cases;
    const auto f = SafetensorsFile::open(entry.path().string());
    const MultiheadAttention m = load_module(f);
    EXPECT_NO_THROW(m.check_params());

    // The loaded weights are the file's, wherever they came from.
    const MhaParameters& p = m.params();
    if (f.contains("in_proj_weight")) {
      EXPECT_TRUE(testing::bitwise_equal(p.in_proj_weight, f.read_f32("in_proj_weight")));
    }
    if (f.contains("q_proj.weight") && m.config().packed_in_proj()) {
      const Tensor q = f.read_f32("q_proj.weight");
      EXPECT_EQ(p.in_proj_weight.size(0), m.config().in_proj_rows());
      EXPECT_TRUE(
          testing::bitwise_equal(Tensor(q.shape(), std::vector<float>(p.in_proj_weight.storage().begin(),
                                                                      p.in_proj_weight.storage().begin() + q.numel())),
                                 q));
    }

    // And the module built from them computes PyTorch's answer.
    MhaForwardOptions opt;
    if (f.metadata().at("is_causal") == "true") opt.causal = Causal::top_left();
    if (f.contains("attn_mask")) {
      if (f.info("attn_mask").dtype == DType::BOOL)
        opt.attn_mask = AttnMask::from_torch_bool(f.read_bool("attn_mask"));
      else
        opt.attn_mask = AttnMask::add(f.read_f32("attn_mask"));
    }
    if (f.contains("key_padding_mask")) {
      if (f.info("key_padding_mask").dtype == DType::BOOL)
        opt.key_padding_mask.is_padding = f.read_bool("key_padding_mask");
      else
        opt.key_padding_mask.additive = f.read_f32("key_padding_mask");
    }
    const MhaOutput out = m.forward(f.read_f32("query"), f.read_f32("key"), f.read_f32("value"), opt);
    EXPECT_TRUE(testing::all_close(out.output, f.read_f32("expected.output"), 2e-5, 2e-4));
  }
  EXPECT_GE(cases, 1);
}

TEST(WeightsIo, GqaCaseUsesHuggingFaceNames) {
  const std::string path = MHA_SHARED_DIR "/conformance/cases/gqa.safetensors";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " not present";
  const auto f = SafetensorsFile::open(path);
  EXPECT_EQ(detect_weight_names(f), WeightNames::HuggingFace);
  const MultiheadAttention m = load_module(f);
  EXPECT_EQ(m.config().kv_heads(), 2);
  // Saving it under PyTorch names and loading again gives the same parameters.
  const std::string out = testing::temp_dir() + "/gqa_torch.safetensors";
  save_module(out, m, WeightNames::PyTorch);
  const auto g = SafetensorsFile::open(out);
  EXPECT_EQ(detect_weight_names(g), WeightNames::PyTorch);
  expect_same_params(load_module(g), m);
}

}  // namespace
}  // namespace mha::io
