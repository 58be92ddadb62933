// `mha analyze` and `mha prune` through the command line: the table, JSON, pictures, pruned files.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "mha/analysis.h"
#include "mha/image.h"
#include "mha/prune.h"
#include "mha/safetensors.h"
#include "mha/weights.h"
#include "support/test_support.h"

namespace {

using mha::testing::run_command;

const std::string kCli = MHA_CLI_PATH;
const std::string kGolden = std::string(MHA_GOLDEN_DIR) + "/forward/";

constexpr int64_t kT = 8, kE = 16, kD = 8;

/// Two heads with known jobs on one-hot inputs x_t = e_t: head 0 puts its weight on key 0 (a
/// sink: constant query from the bias, only key 0 has a key vector), head 1 on the previous token
/// (query e_t, key of position j is e_{j+1}). Causal, so row 0 of head 1 sees only key 0.
struct Files {
  std::string weights, inputs;
};

/// q0, tq: the query input is rows [q0, q0 + tq) of the one-hot sequence (keys and values all kT
/// of it); align: the metadata's causal_align, if any.
Files write_known_heads(const std::string& dir, int64_t q0 = 0, int64_t tq = kT, const std::string& align = "",
                        bool causal = true) {
  mha::MhaConfig c;
  c.embed_dim = kE, c.num_heads = 2, c.layout = mha::Layout::BatchFirst;
  mha::MultiheadAttention m(c, 1);
  mha::MhaParameters& p = m.params();
  const float big = 30.0f;  // score gap 30/√8 ≈ 10.6: the winning key gets > 0.999
  std::fill(p.in_proj_weight.values().begin(), p.in_proj_weight.values().end(), 0.0f);
  const int64_t K0 = 2 * kD, V0 = 4 * kD;   // row offsets of the K and V blocks in in_proj_weight
  p.in_proj_bias.at({0}) = big;             // head 0: q = big·e'_0 for every query
  p.in_proj_weight.at({K0 + 0, 0}) = 1.0f;  // head 0: only key 0 has k = e'_0
  for (int64_t t = 0; t < kT; ++t) {
    p.in_proj_weight.at({kD + t, t}) = big;                            // head 1: q_t = big·e'_t
    if (t + 1 < kT) p.in_proj_weight.at({K0 + kD + t + 1, t}) = 1.0f;  // head 1: k_t = e'_{t+1}
    for (int64_t h = 0; h < 2; ++h) p.in_proj_weight.at({V0 + h * kD + t, t}) = 1.0f;
  }
  Files f{dir + "/known.safetensors", dir + "/known_inputs.safetensors"};
  mha::io::SafetensorsWriter w;
  mha::io::add_weights(w, m, mha::io::WeightNames::PyTorch);
  w.set_metadata("is_causal", causal ? "true" : "false");
  if (!align.empty()) w.set_metadata("causal_align", align);
  w.write(f.weights);
  mha::Tensor x({2, kT, kE}), q({2, tq, kE});
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < kT; ++t) x.at({b, t, t}) = 1.0f;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < tq; ++t) q.at({b, t, q0 + t}) = 1.0f;
  mha::io::SafetensorsWriter in;
  in.add("query", q);
  for (const char* name : {"key", "value"}) in.add(name, x);
  in.write(f.inputs);
  return f;
}

void expect_one_line_failure(const mha::testing::CommandResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

TEST(CliAnalyze, TableNamesEachHeadsClass) {
  const Files f = write_known_heads(mha::testing::temp_dir());
  const auto r = run_command(kCli + " analyze --weights " + f.weights + " --inputs " + f.inputs);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("   0  attention_sink"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("   1  prev_token"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("entropy"), std::string::npos);
  EXPECT_NE(r.out.find("sink > 0.4"), std::string::npos);
}

TEST(CliAnalyze, JsonMatchesTheLibrary) {
  const Files f = write_known_heads(mha::testing::temp_dir());
  const auto r = run_command(kCli + " analyze --json --importance --weights " + f.weights + " --inputs " + f.inputs);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["num_heads"], 2);
  EXPECT_EQ(j["t_q"], kT);
  EXPECT_EQ(j["heads"][0]["class"], "attention_sink");
  EXPECT_EQ(j["heads"][1]["class"], "prev_token");
  EXPECT_GT(j["heads"][0]["sink"].get<double>(), 0.999);
  EXPECT_GT(j["heads"][1]["prev_token"].get<double>(), 0.999);
  EXPECT_EQ(j["heads"][1]["rows"], 2 * kT);
  EXPECT_GT(j["heads"][1]["importance"].get<double>(), 0.0);
  // The same numbers as head_metrics on the module's own weights (JSON keeps doubles exactly).
  const auto wf = mha::io::SafetensorsFile::open(f.weights);
  const auto in = mha::io::SafetensorsFile::open(f.inputs);
  mha::MhaForwardOptions opt;
  opt.causal = mha::Causal::top_left();
  opt.need_weights = mha::NeedWeights::PerHead;
  const mha::Tensor x = in.read_f32("query");
  const auto m = mha::head_metrics(mha::io::load_module(wf).forward(x, x, x, opt).attn_weights);
  for (size_t h = 0; h < 2; ++h) {
    EXPECT_EQ(j["heads"][h]["entropy"].get<double>(), m[h].entropy);
    EXPECT_EQ(j["heads"][h]["self"].get<double>(), m[h].self);
    EXPECT_EQ(j["heads"][h]["focus"].get<double>(), m[h].focus);
  }
}

// Cross-attention (T_q = 4 queries, T_k = 8 keys): a query's own key is where the causal mask
// puts it. Top-left (the metadata's is_causal), query t = e_t sits at key t and head 1 looks at key
// t − 1; bottom-right (causal_align), query t = e_{t+4} sits at key t + 4 and looks at t + 3.
// Either way head 1 puts its weight on the previous token; measured at bottom-right's offset under
// a top-left mask, its previous keys were hidden ones and it read 0. `--causal` leaves a causal mask the
// metadata names as it is.
TEST(CliAnalyze, OwnKeyFollowsTheCausalAlignment) {
  constexpr int64_t kTq = 4;
  for (const std::string align : {"", "bottom_right"}) {
    SCOPED_TRACE(align.empty() ? "top-left" : align);
    const Files f = write_known_heads(mha::testing::temp_dir(), align.empty() ? 0 : kT - kTq, kTq, align);
    std::string first;
    for (const char* flag : {"", " --causal"}) {
      const auto r = run_command(kCli + " analyze --json" + flag + " --weights " + f.weights + " --inputs " + f.inputs);
      ASSERT_EQ(r.exit_code, 0) << r.err;
      const auto j = nlohmann::json::parse(r.out);
      EXPECT_EQ(j["query_offset"], align.empty() ? 0 : kT - kTq);
      EXPECT_GT(j["heads"][1]["prev_token"].get<double>(), 0.99);
      EXPECT_LT(j["heads"][1]["self"].get<double>(), 0.3);  // top-left's query 0 sees only key 0: 1/4
      if (first.empty())
        first = r.out;
      else
        EXPECT_EQ(r.out, first);
    }
  }
  // A file that is not causal but says causal_align=bottom_right: --causal aligns its mask so.
  const Files f = write_known_heads(mha::testing::temp_dir(), kT - kTq, kTq, "bottom_right", false);
  const auto r = run_command(kCli + " analyze --json --causal --weights " + f.weights + " --inputs " + f.inputs);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["query_offset"], kT - kTq);
  EXPECT_GT(j["heads"][1]["prev_token"].get<double>(), 0.99);
}

// --tokens alone labels the queries at the key positions the metrics use: the first T_q under a
// top-left causal mask (they were labelled as the last T_q, contradicting the picture's mask), the
// last T_q at bottom-right. The JSON lists the labels as drawn.
TEST(CliAnalyze, QueryLabelsFollowTheCausalAlignment) {
  constexpr int64_t kTq = 3;
  for (const std::string align : {"", "bottom_right"}) {
    SCOPED_TRACE(align.empty() ? "top-left" : align);
    const std::string dir = mha::testing::temp_dir();
    const Files f = write_known_heads(dir, align.empty() ? 0 : kT - kTq, kTq, align);
    const auto r = run_command(kCli + " analyze --json --weights " + f.weights + " --inputs " + f.inputs + " --svg " +
                               dir + "/q.svg --tokens \"a b c d e f g h\"");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    const std::vector<std::string> want =
        align.empty() ? std::vector<std::string>{"a", "b", "c"} : std::vector<std::string>{"f", "g", "h"};
    EXPECT_EQ(j["image"]["query_labels"].get<std::vector<std::string>>(), want);
    EXPECT_EQ(j["image"]["key_labels"].size(), static_cast<size_t>(kT));
  }
}

// Under a top-left causal mask with more queries than keys (T_q = 4, T_k = 2), query i ≥ T_k
// reaches past the real keys: the appended bias_k column must not count as its own or previous
// token (a head attending only to bias_k was classed prev_token).
TEST(CliAnalyze, AppendedBiasKeyIsNoPosition) {
  constexpr int64_t kE4 = 4, kTq = 4, kTk = 2;
  mha::MhaConfig c;
  c.embed_dim = kE4, c.num_heads = 1, c.add_bias_kv = true, c.layout = mha::Layout::BatchFirst;
  mha::MultiheadAttention m(c, 1);
  mha::MhaParameters& p = m.params();
  std::fill(p.in_proj_weight.values().begin(), p.in_proj_weight.values().end(), 0.0f);
  std::fill(p.bias_k.values().begin(), p.bias_k.values().end(), 0.0f);
  p.in_proj_bias.at({0}) = 30.0f;  // q = 30·e_0 for every query; real keys are 0
  p.bias_k.at({0, 0, 0}) = 1.0f;   // bias_k = e_0: score 15 against 0
  const std::string dir = mha::testing::temp_dir();
  const std::string weights = dir + "/bk.safetensors", inputs = dir + "/bk_inputs.safetensors";
  mha::io::SafetensorsWriter w;
  mha::io::add_weights(w, m, mha::io::WeightNames::PyTorch);
  w.set_metadata("is_causal", "true");
  w.write(weights);
  mha::io::SafetensorsWriter in;
  in.add("query", mha::Tensor({1, kTq, kE4}, 1.0f));
  in.add("key", mha::Tensor({1, kTk, kE4}, 1.0f));
  in.add("value", mha::Tensor({1, kTk, kE4}, 1.0f));
  in.write(inputs);
  const auto r = run_command(kCli + " analyze --json --weights " + weights + " --inputs " + inputs);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["t_k"], kTk);
  EXPECT_EQ(j["query_offset"], 0);
  EXPECT_EQ(j["heads"][0]["rows"], kTq);  // every query sees key 0
  EXPECT_LT(j["heads"][0]["self"].get<double>(), 1e-4);
  EXPECT_LT(j["heads"][0]["prev_token"].get<double>(), 1e-4);
  EXPECT_GT(j["heads"][0]["focus"].get<double>(), 0.99);
  EXPECT_NE(j["heads"][0]["class"], "prev_token");
  // Bottom-right, queries 0 and 1 see no real key, only bias_k: those rows are not measured.
  w.set_metadata("causal_align", "bottom_right");
  w.write(weights);
  const auto br = run_command(kCli + " analyze --json --weights " + weights + " --inputs " + inputs);
  ASSERT_EQ(br.exit_code, 0) << br.err;
  const auto jb = nlohmann::json::parse(br.out);
  EXPECT_EQ(jb["query_offset"], kTk - kTq);
  EXPECT_EQ(jb["heads"][0]["rows"], kTq - (kTq - kTk));
}

// A key padding mask on self-attention inputs: padded query rows are not measured (they were
// counted: their outputs are discarded, their weights are no head's behaviour), and the JSON says
// so. Cross-attention inputs keep every query row.
TEST(CliAnalyze, PaddedQueryRowsOfSelfAttentionAreNotMeasured) {
  const std::string dir = mha::testing::temp_dir();
  for (const bool self : {true, false})
    for (const bool as_float : {false, true}) {  // float: Hugging Face's finfo(float32).min
      SCOPED_TRACE(std::string(self ? "self-attention" : "cross-attention") + (as_float ? ", float mask" : ""));
      const Files f = write_known_heads(dir, 0, self ? kT : kT - 1);
      mha::io::SafetensorsFile in = mha::io::SafetensorsFile::open(f.inputs);
      mha::io::SafetensorsWriter w;
      for (const char* name : {"query", "key", "value"}) w.add(name, in.read_f32(name));
      mha::BoolTensor padding({2, kT});
      padding.data()[kT + kT - 1] = padding.data()[kT + kT - 2] = 1;  // batch 1: the last two keys
      mha::Tensor additive({2, kT}, 0.0f);
      additive.data()[kT + kT - 1] = additive.data()[kT + kT - 2] = std::numeric_limits<float>::lowest();
      if (as_float)
        w.add("key_padding_mask", additive);
      else
        w.add_bool("key_padding_mask", padding);
      const std::string inputs = dir + "/padded.safetensors";
      w.write(inputs);
      const auto r = run_command(kCli + " analyze --json --weights " + f.weights + " --inputs " + inputs);
      ASSERT_EQ(r.exit_code, 0) << r.err;
      const auto j = nlohmann::json::parse(r.out);
      EXPECT_EQ(j["key_padding"], true);
      EXPECT_EQ(j["padded_query_rows_excluded"], self);
      EXPECT_EQ(j["heads"][0]["rows"], self ? 2 * kT - 2 : 2 * (kT - 1));
      EXPECT_GT(j["heads"][0]["sink"].get<double>(), 0.99);  // key 0 is real in both sequences
    }
}

// --heads takes a comma list, several arguments, or the option again: the same pruned file.
TEST(CliPrune, HeadsAsACommaListArgumentsOrRepeatedOptions) {
  const std::string dir = mha::testing::temp_dir();
  const std::string c = kGolden + "bias_kv_zero_attn_seq_first.safetensors";
  std::string first;
  for (const char* heads : {"0,2", "0 2", "0 --heads 2", "2,0,"}) {
    SCOPED_TRACE(heads);
    const std::string out = dir + "/p.safetensors";
    const auto r = run_command(kCli + " prune --weights " + c + " --heads " + heads + " --output " + out);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::ifstream in(out, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (first.empty())
      first = bytes;
    else
      EXPECT_EQ(bytes, first);
  }
}

// A packed batch gives no attention weights: refused in one line that says what to give instead
// (the help said "inputs as for mha forward", which takes them).
TEST(CliAnalyze, PackedInputsAreRefusedWithWhatToGiveInstead) {
  const std::string dir = mha::testing::temp_dir();
  const Files f = write_known_heads(dir);
  mha::io::SafetensorsWriter in;
  const mha::Tensor x = mha::testing::random_tensor({kT, kE}, 3);
  for (const char* name : {"query", "key", "value"}) in.add(name, x);
  const std::vector<int32_t> cu = {0, 3, static_cast<int32_t>(kT)};
  in.add_raw("cu_seqlens_q", mha::io::DType::I32, {3}, std::as_bytes(std::span<const int32_t>(cu)));
  in.write(dir + "/packed.safetensors");
  expect_one_line_failure(
      run_command(kCli + " analyze --weights " + f.weights + " --inputs " + dir + "/packed.safetensors"),
      "analyze: a packed batch (cu_seqlens) returns no attention weights");
}

// POSIX paths are bytes: a weights path that is not UTF-8 is reported with U+FFFD in the JSON
// instead of failing the whole report (the JSON library refuses to write invalid UTF-8).
TEST(CliAnalyze, JsonTakesAPathThatIsNotUtf8) {
  const std::string dir = mha::testing::temp_dir();
  const Files f = write_known_heads(dir);
  const std::string odd = dir + "/\xff_w.safetensors";
  std::filesystem::copy_file(f.weights, odd);
  const auto r = run_command(kCli + " analyze --json --weights '" + odd + "' --inputs " + f.inputs);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_NE(j["weights"].get<std::string>().find("\xef\xbf\xbd_w.safetensors"), std::string::npos);
}

// The picture's options without a picture (an out-of-range --batch, labels of the wrong count:
// exit 0, ignored) and a misspelt causal_align in a file that is not causal (ignored) are errors.
TEST(CliAnalyze, OptionsThatWouldBeIgnoredAreRefused) {
  const Files f = write_known_heads(mha::testing::temp_dir());
  const std::string base = kCli + " analyze --weights " + f.weights + " --inputs " + f.inputs;
  for (const char* opt : {" --batch 2", " --tokens 'a b'", " --query-tokens 'a'"})
    expect_one_line_failure(run_command(base + opt), "give --image or --svg");
  const Files g = write_known_heads(mha::testing::temp_dir(), 0, kT, "center", false);
  expect_one_line_failure(run_command(kCli + " analyze --weights " + g.weights + " --inputs " + g.inputs),
                          "metadata 'causal_align' must be top_left or bottom_right, got 'center'");
}

TEST(CliAnalyze, ImageShowsTheSinkColumnAndTheMaskedTriangle) {
  const std::string dir = mha::testing::temp_dir();
  const Files f = write_known_heads(dir);
  const std::string png = dir + "/heads.png", svg = dir + "/heads.svg";
  const auto r = run_command(kCli + " analyze --json --weights " + f.weights + " --inputs " + f.inputs + " --image " +
                             png + " --svg " + svg + " --batch 1 --tokens \"a b c d e f g h\"");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  const mha::Image img = mha::read_png(png);
  EXPECT_GT(img.width, 2 * kT * 8);
  mha::HeatmapPlacement L;
  L.cell = j["image"]["cell_pixels"].get<int64_t>();
  L.panel_x = j["image"]["panel_x"].get<std::vector<int64_t>>();
  L.panel_y = j["image"]["panel_y"].get<std::vector<int64_t>>();
  ASSERT_EQ(L.panel_x.size(), 2u);
  // Weights > 0.999 land within a step of the hot end of the scale; exact zeros are blank.
  const auto near_hot = [](mha::Rgb c) {
    const mha::Rgb hot = mha::heat_color(1.0);
    return std::abs(c.r - hot.r) <= 2 && std::abs(c.g - hot.g) <= 2 && std::abs(c.b - hot.b) <= 2;
  };
  for (int64_t i = 0; i < kT; ++i) {
    EXPECT_TRUE(near_hot(img.pixel(L.center_x(0, 0), L.center_y(0, i)))) << "sink column, row " << i;
    if (i > 0) {
      EXPECT_TRUE(near_hot(img.pixel(L.center_x(1, i - 1), L.center_y(1, i)))) << "previous token, row " << i;
    }
  }
  EXPECT_EQ(img.pixel(L.center_x(0, kT - 1), L.center_y(0, 0)), mha::masked_color()) << "causally masked";
  EXPECT_TRUE(std::filesystem::file_size(svg) > 1000);

  expect_one_line_failure(run_command(kCli + " analyze --weights " + f.weights + " --inputs " + f.inputs + " --image " +
                                      png + " --tokens \"too few\""),
                          "--tokens has 2 words");
  expect_one_line_failure(run_command(kCli + " analyze --weights " + f.weights + " --inputs " + f.inputs + " --image " +
                                      png + " --batch 2"),
                          "--batch 2 is out of range");
}

TEST(CliAnalyze, WorksOnGoldenCasesWithMasksAndExtraKeys) {
  for (const char* name : {"bias_kv_zero_attn_seq_first", "gqa_causal_kpm_per_head_seq_first", "unbatched_self"}) {
    const std::string c = kGolden + name + ".safetensors";
    const std::string png = mha::testing::temp_dir() + "/g.png";
    const auto r = run_command(kCli + " analyze --weights " + c + " --inputs " + c + " --image " + png);
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.err;
    EXPECT_NO_THROW(mha::read_png(png)) << name;
  }
}

TEST(CliPrune, WritesAPrunedModuleEqualToAblation) {
  const std::string dir = mha::testing::temp_dir();
  const std::string c = kGolden + "gqa_h8_kv2_causal_per_head.safetensors", out = dir + "/pruned.safetensors";
  // Head 1 alone would leave K/V groups of 3 and 4: refused, naming the groups.
  expect_one_line_failure(run_command(kCli + " prune --weights " + c + " --heads 1 --output " + out), "group 0");
  EXPECT_FALSE(std::filesystem::exists(out));
  const auto r = run_command(kCli + " prune --weights " + c + " --heads 1,5 --output " + out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("pruned 2 of 8 heads: 6 heads"), std::string::npos) << r.out;
  const auto original = mha::io::load_module(mha::io::SafetensorsFile::open(c));
  const auto pruned = mha::io::load_module(mha::io::SafetensorsFile::open(out));
  EXPECT_EQ(pruned.config().num_heads, 6);
  EXPECT_EQ(pruned.config().kv_heads(), 2);
  const auto in = mha::io::SafetensorsFile::open(c);
  const mha::Tensor q = in.read_f32("query"), k = in.read_f32("key"), v = in.read_f32("value");
  const double tol = 64 * std::numeric_limits<float>::epsilon();
  EXPECT_TRUE(mha::testing::all_close(pruned.forward(q, k, v).output,
                                      mha::ablate_heads(original, {1, 5}).forward(q, k, v).output, tol, tol));
  // The pruned file analyses like any other.
  const auto a = run_command(kCli + " analyze --weights " + out + " --inputs " + c);
  EXPECT_EQ(a.exit_code, 0) << a.err;
  EXPECT_NE(a.out.find("6 heads"), std::string::npos) << a.out;
  // The input's run settings come along (the file was causal with per-head weights: without them
  // `mha forward` ran the pruned model non-causal and wrote no weights).
  const auto& before = in.metadata();
  const auto out_file = mha::io::SafetensorsFile::open(out);
  const auto& after = out_file.metadata();
  for (const char* key : {"is_causal", "need_weights", "average_attn_weights"}) {
    ASSERT_TRUE(before.contains(key)) << key;
    ASSERT_TRUE(after.contains(key)) << key;
    EXPECT_EQ(after.at(key), before.at(key)) << key;
  }
  mha::MhaForwardOptions causal;
  causal.causal = mha::Causal::top_left();
  const std::string y = dir + "/y.safetensors";
  ASSERT_EQ(run_command(kCli + " forward --weights " + out + " --inputs " + c + " --output " + y).exit_code, 0);
  const auto got = mha::io::SafetensorsFile::open(y);
  EXPECT_TRUE(mha::testing::all_close(got.read_f32("output"), pruned.forward(q, k, v, causal).output, tol, tol));
  EXPECT_TRUE(got.contains("attn_weights"));
}

TEST(CliPrune, ImportanceAndErrors) {
  const std::string dir = mha::testing::temp_dir();
  const Files f = write_known_heads(dir);
  const std::string out = dir + "/p.safetensors";
  const auto r = run_command(kCli + " prune --weights " + f.weights + " --heads 0 --output " + out +
                             " --importance --inputs " + f.inputs);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("head  0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("head  1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("output change from pruning"), std::string::npos) << r.out;
  expect_one_line_failure(run_command(kCli + " prune --weights " + f.weights + " --heads 0,1 --output " + out),
                          "cannot prune every head");
  expect_one_line_failure(run_command(kCli + " prune --weights " + f.weights + " --heads 0,0 --output " + out),
                          "appears twice");
  expect_one_line_failure(run_command(kCli + " prune --weights " + f.weights + " --heads 7 --output " + out),
                          "out of range");
  expect_one_line_failure(
      run_command(kCli + " prune --weights " + f.weights + " --heads 0 --output " + out + " --importance"),
      "--importance needs --inputs");
  // An empty list is an error (CLI11 once read --heads "" as head 0 and removed it); empty items
  // between commas are skipped, anything else must be a whole integer.
  std::filesystem::remove(out);
  const std::pair<const char*, const char*> bad_heads[] = {
      {"\"\"", "--heads lists no head index"},
      {",", "--heads lists no head index"},  // (CLI11's list took the next option: '--output is required')
      {"1,x", "--heads item 'x' is not a head index"},
      {"1.0", "'1.0'"}};
  for (const auto& [heads, needle] : bad_heads)
    expect_one_line_failure(
        run_command(kCli + " prune --weights " + f.weights + " --heads " + heads + " --output " + out), needle);
  EXPECT_FALSE(std::filesystem::exists(out));
  // A file that cannot be written: one line on stderr, and nothing on stdout (the importance and
  // output-change lines wait for the file).
  const auto unwritable = run_command(kCli + " prune --weights " + f.weights + " --heads 0 --output " + dir +
                                      "/no/such/dir/p.safetensors --importance --inputs " + f.inputs);
  EXPECT_EQ(unwritable.exit_code, 1);
  EXPECT_EQ(std::count(unwritable.err.begin(), unwritable.err.end(), '\n'), 1) << unwritable.err;
  EXPECT_EQ(unwritable.out, "");
}

/// stderr without the list LeakSanitizer appends at exit when suppressions were used (in the
/// sanitizer build, a process that loaded fontconfig to draw text has some: tests/lsan.supp).
std::string without_leak_summary(const std::string& err) {
  const size_t at = err.find("-----------------------------------------------------\nSuppressions used:");
  return at == std::string::npos ? err : err.substr(0, at);
}

// A picture that cannot be written fails the command before the report reaches stdout: a script
// never reads a whole table or JSON object from a call that exits 1.
TEST(CliAnalyze, UnwritablePictureFailsBeforeAnyOutput) {
  const std::string dir = mha::testing::temp_dir();
  const Files f = write_known_heads(dir);
  for (const char* flag : {" --image ", " --svg "})
    for (const char* json : {"", " --json"}) {
      SCOPED_TRACE(std::string(flag) + json);
      const auto r = run_command(kCli + " analyze --weights " + f.weights + " --inputs " + f.inputs + json + flag +
                                 dir + "/no/such/dir/x.png");
      const std::string err = without_leak_summary(r.err);
      EXPECT_EQ(r.exit_code, 1);
      EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << r.err;
      EXPECT_EQ(r.out, "");
    }
  // An existing directory as the picture (or prune's output) is named as such, not as a failed
  // rename of a temporary file beside it.
  for (const char* flag : {" --image ", " --svg "}) {
    SCOPED_TRACE(flag);
    expect_one_line_failure(
        run_command(kCli + " analyze --weights " + f.weights + " --inputs " + f.inputs + flag + dir),
        "is a directory: give a file name");
  }
  expect_one_line_failure(run_command(kCli + " prune --weights " + f.weights + " --heads 1 --output " + dir),
                          "is a directory: give a file name");
}

}  // namespace
