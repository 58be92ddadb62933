// `mha bench` through the CLI: the JSON contract of --json and one-line errors for bad arguments.
// No timing is asserted: only that the numbers are there and make sense as numbers.
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>

#include "support/test_support.h"

namespace {

using mha::testing::run_command;

const std::string kCli = MHA_CLI_PATH;

int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n + (!s.empty() && s.back() != '\n');
}

/// `extra` defaults to a small sgemm reference and bandwidth stream to keep the test quick.
nlohmann::json bench_json(const std::string& args, const std::string& extra = " --sgemm-size 128 --bw-mib 8") {
  const auto r = run_command(kCli + " bench " + args + " --repeat 1 --json" + extra);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count_lines(r.out), 1) << "stdout must be one JSON object: " << r.out;
  return nlohmann::json::parse(r.out);
}

/// `mha bench-decode --json` on a small GQA cache (h=4, kv=2, d=16, 1 thread) with `args` added;
/// null (and a test failure) when it does not exit 0.
nlohmann::json decode_json(const std::string& args) {
  const auto r = run_command(kCli + " bench-decode --heads 4 --kv-heads 2 --head-dim 16 " + args +
                             " --repeat 2 --footprint-mib 1 --bw-mib 8 --threads 1 --json");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return r.exit_code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json();
}

void expect_measurement_keys(const nlohmann::json& j) {
  for (const char* key :
       {"median_ms", "gflops", "peak_rss_mb", "sgemm_gflops", "fraction_of_sgemm", "flops", "expected_tensor_mb"}) {
    ASSERT_TRUE(j.contains(key)) << key << " missing in " << j.dump();
    EXPECT_TRUE(j[key].is_number()) << key;
    EXPECT_GT(j[key].get<double>(), 0.0) << key;
  }
  EXPECT_NEAR(j["fraction_of_sgemm"].get<double>(), j["gflops"].get<double>() / j["sgemm_gflops"].get<double>(),
              1e-9 * j["fraction_of_sgemm"].get<double>());
  EXPECT_TRUE(j["dispatch"].is_string());
  // The same run's denominators: FMA peak on the dispatched SIMD target, read bandwidth, triad.
  for (const char* key : {"peak_f32_gflops", "peak_f32_gflops_before", "peak_f32_gflops_after", "peak_gflops",
                          "fraction_of_peak", "read_bw_gbs", "triad_gbs", "min_bytes", "fraction_of_read_bw",
                          "peak_f32_tile_gflops", "fraction_of_f32_tile_peak"}) {
    ASSERT_TRUE(j.contains(key)) << key << " missing in " << j.dump();
    EXPECT_GT(j[key].get<double>(), 0.0) << key;
  }
  EXPECT_GE(j["peak_bf16_dot_gflops"].get<double>(), 0.0);
  // (No comparison of the tile's and the chains' GFLOP/s: they are two timings, and a test running
  // beside this one on the other core once slowed the chains enough to fail `tile < 1.25 × chains`.)
  EXPECT_NEAR(j["fraction_of_f32_tile_peak"].get<double>(),
              j["gflops"].get<double>() / j["peak_f32_tile_gflops"].get<double>(),
              1e-9 * j["fraction_of_f32_tile_peak"].get<double>());
  EXPECT_NEAR(j["fraction_of_peak"].get<double>(), j["gflops"].get<double>() / j["peak_gflops"].get<double>(),
              1e-9 * j["fraction_of_peak"].get<double>());
  EXPECT_FALSE(j["simd_target"].get<std::string>().empty());
  EXPECT_GE(j["peak_bf16_amx_gflops"].get<double>(), 0.0);
  EXPECT_TRUE(j["peak_kind"] == "f32_fma" || j["peak_kind"] == "bf16_dot" || j["peak_kind"] == "bf16_amx")
      << j["peak_kind"];
  EXPECT_TRUE(j["products"] == "float32" || j["products"] == "vdpbf16ps" || j["products"] == "amx") << j["products"];
}

TEST(CliBench, CoreJsonHasTheKeysAndTheFlopCount) {
  // Exactly the documented smoke command, default sgemm reference included.
  const auto j = bench_json("--core --seq 64 --embed-dim 64 --heads 4", "");
  expect_measurement_keys(j);
  EXPECT_EQ(j["target"], "core");
  EXPECT_EQ(j["seq"], 64);
  EXPECT_EQ(j["kv_seq"], 64);
  EXPECT_EQ(j["heads"], 4);
  EXPECT_EQ(j["head_dim"], 16);
  EXPECT_EQ(j["causal"], false);
  // 4·B·h·T_q·T_k·d
  EXPECT_EQ(j["flops"].get<double>(), 4.0 * 1 * 4 * 64 * 64 * 16);
}

TEST(CliBench, CausalCoreCountsHalfTheFlops) {
  const auto j = bench_json("--core --causal --seq 64 --embed-dim 64 --heads 4 --threads 1");
  EXPECT_EQ(j["causal"], true);
  EXPECT_EQ(j["threads"], 1);
  EXPECT_EQ(j["flops"].get<double>(), 0.5 * 4.0 * 1 * 4 * 64 * 64 * 16);
}

// Each thread's busy time in the fused kernel per run, its balance (min / max) and its share of
// the median time: for the core forward only.
TEST(CliBench, CoreReportsEachThreadsBusyTime) {
  const auto j = bench_json("--core --causal --batch 4 --seq 300 --embed-dim 64 --heads 4 --threads 2");
  ASSERT_TRUE(j.contains("thread_busy_ms")) << j.dump();
  ASSERT_EQ(j["thread_busy_ms"].size(), 2u);
  for (const auto& ms : j["thread_busy_ms"]) EXPECT_GE(ms.get<double>(), 0.0);
  EXPECT_GT(j["thread_busy_ms"][0].get<double>() + j["thread_busy_ms"][1].get<double>(), 0.0);
  EXPECT_GE(j["busy_balance"].get<double>(), 0.0);
  EXPECT_LE(j["busy_balance"].get<double>(), 1.0);
  EXPECT_GT(j["busy_fraction"].get<double>(), 0.0);
  EXPECT_FALSE(bench_json("--seq 16 --embed-dim 32 --heads 4").contains("thread_busy_ms"));
}

TEST(CliBench, ModuleForwardCountsProjectionsToo) {
  const auto j = bench_json("--batch 2 --seq 16 --kv-seq 24 --embed-dim 32 --heads 4 --kv-heads 2");
  expect_measurement_keys(j);
  EXPECT_EQ(j["target"], "module");
  const double B = 2, T = 16, S = 24, E = 32, h = 4, d = 8, kv = 2;
  const double core = 4 * B * h * T * S * d;
  const double proj = 2 * B * T * E * E + 2 * 2 * B * S * E * kv * d + 2 * B * T * E * E;
  EXPECT_EQ(j["flops"].get<double>(), core + proj);
}

TEST(CliBench, ModuleForwardWithWeights) {
  for (const char* mode : {"per-head", "averaged"}) {
    const auto j = bench_json(std::string("--batch 2 --seq 40 --embed-dim 32 --heads 4 --need-weights ") + mode);
    expect_measurement_keys(j);
    EXPECT_EQ(j["need_weights"], mode);
    EXPECT_EQ(j["dispatch"], "fused: supported");
    // The weights count among the tensors the call must hold: (B, h, T, S) or (B, T, S) floats.
    const double without = bench_json("--batch 2 --seq 40 --embed-dim 32 --heads 4")["expected_tensor_mb"];
    const double weights = 4.0 * 2 * (std::string(mode) == "per-head" ? 4 : 1) * 40 * 40 / (1024.0 * 1024.0);
    EXPECT_NEAR(j["expected_tensor_mb"].get<double>() - without, weights, 1e-9);
  }
}

TEST(CliBench, CoreForwardWithWeights) {
  // The fused kernel writing weights: the same FLOPs as without, the weights among the tensors.
  const auto without = bench_json("--core --batch 2 --seq 40 --embed-dim 32 --heads 4");
  for (const char* mode : {"per-head", "averaged"}) {
    const auto j = bench_json(std::string("--core --batch 2 --seq 40 --embed-dim 32 --heads 4 --need-weights ") + mode);
    expect_measurement_keys(j);
    EXPECT_EQ(j["target"], "core");
    EXPECT_EQ(j["need_weights"], mode);
    EXPECT_EQ(j["dispatch"], "fused: supported");
    EXPECT_EQ(j["flops"].get<double>(), without["flops"].get<double>());
    const double weights = 4.0 * 2 * (std::string(mode) == "per-head" ? 4 : 1) * 40 * 40 / (1024.0 * 1024.0);
    EXPECT_NEAR(j["expected_tensor_mb"].get<double>() - without["expected_tensor_mb"].get<double>(), weights, 1e-9);
  }
}

TEST(CliBench, DecodeJsonHasTheBandwidthAndPeakFractions) {
  const auto j = decode_json("--contexts 64,100 --dtype f32");
  ASSERT_FALSE(j.is_null());
  for (const char* key : {"triad_gbs", "read_bw_gbs", "peak_f32_gflops"}) EXPECT_GT(j[key].get<double>(), 0.0) << key;
  EXPECT_FALSE(j["simd_target"].get<std::string>().empty());
  ASSERT_EQ(j["decode"].size(), 2u);
  for (const auto& d : j["decode"]) {
    EXPECT_NEAR(d["fraction_of_read_bw"].get<double>(), d["gbs"].get<double>() / j["read_bw_gbs"].get<double>(),
                1e-9 * d["fraction_of_read_bw"].get<double>());
    EXPECT_NEAR(d["fraction_of_peak"].get<double>(), d["gflops"].get<double>() / j["peak_f32_gflops"].get<double>(),
                1e-9 * d["fraction_of_peak"].get<double>());
  }
}

TEST(CliBench, DecodeInt8RowCountsItsScalesAndReportsItsError) {
  const auto j = decode_json("--contexts 100 --dtype f32,int8");
  ASSERT_FALSE(j.is_null());
  ASSERT_EQ(j["decode"].size(), 2u);
  const auto& f32 = j["decode"][0];
  const auto& q8 = j["decode"][1];
  EXPECT_EQ(q8["dtype"], "int8");
  // K and V: 100 positions × 2 heads, 16 bytes of int8 and a 4-byte scale per row (f32: 64 bytes).
  EXPECT_EQ(f32["kv_bytes_per_token"].get<double>(), 2.0 * 100 * 2 * 64);
  EXPECT_EQ(q8["kv_bytes_per_token"].get<double>(), 2.0 * 100 * 2 * (16 + 4));
  EXPECT_GT(q8["speedup_vs_f32"].get<double>(), 0.0);
  EXPECT_EQ(f32["max_abs_error_vs_f32"].get<double>(), 0.0);
  EXPECT_GT(q8["max_abs_error_vs_f32"].get<double>(), 0.0);
  EXPECT_LT(q8["max_abs_error_vs_f32"].get<double>(), 0.02);  // a few int8 steps of values in [−1, 1)
  EXPECT_LE(q8["mean_abs_error_vs_f32"].get<double>(), q8["max_abs_error_vs_f32"].get<double>());
  const auto bad = run_command(kCli + " bench-decode --dtype int4");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("int8"), std::string::npos) << bad.err;
}

TEST(CliBench, DecodeInt8ChannelRowCountsItsGroupScales) {
  const auto j = decode_json("--contexts 100 --dtype f32,int8-channel --key-group 25");
  ASSERT_FALSE(j.is_null());
  ASSERT_EQ(j["decode"].size(), 2u);
  const auto& kivi = j["decode"][1];
  EXPECT_EQ(kivi["dtype"], "int8-channel");
  // 100 positions × 2 heads: K 16 bytes a row plus 16 float scales per group of 25 rows; V 16 + 4.
  EXPECT_NEAR(kivi["kv_bytes_per_token"].get<double>(), 100 * 2 * (16 + 16.0 * 4 / 25) + 100 * 2 * (16 + 4), 1e-9);
  EXPECT_GT(kivi["max_abs_error_vs_f32"].get<double>(), 0.0);
  EXPECT_LT(kivi["max_abs_error_vs_f32"].get<double>(), 0.02);
  const auto bad = run_command(kCli + " bench-decode --dtype int8-channel --key-group 0");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("--key-group"), std::string::npos) << bad.err;
}

TEST(CliBench, DecodeTransposedKeysRowsNextToTheRowLayout) {
  const auto j = decode_json("--contexts 100 --dtype f32,f32-transposed,int8-transposed");
  ASSERT_FALSE(j.is_null());
  ASSERT_EQ(j["decode"].size(), 3u);
  const auto &rows = j["decode"][0], &lanes = j["decode"][1], &int8 = j["decode"][2];
  EXPECT_EQ(lanes["dtype"], "f32-transposed");
  EXPECT_EQ(int8["dtype"], "int8-transposed");
  // The same bytes to read as the row layout; the same values, so float rounding apart.
  EXPECT_EQ(lanes["kv_bytes_per_token"].get<double>(), rows["kv_bytes_per_token"].get<double>());
  EXPECT_LT(lanes["max_abs_error_vs_f32"].get<double>(), 1e-5);
  EXPECT_GT(int8["max_abs_error_vs_f32"].get<double>(), 0.0);
  EXPECT_LT(int8["max_abs_error_vs_f32"].get<double>(), 0.02);
  const auto bad = run_command(kCli + " bench-decode --dtype int8-channel-transposed");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("int8-transposed"), std::string::npos) << bad.err;
}

TEST(CliBench, Bf16CoreRunsOrSaysItIsUnavailable) {
  const auto r = run_command(kCli +
                             " bench --core --dtype bf16 --seq 32 --embed-dim 64 --heads 4 --repeat 1 "
                             "--sgemm-size 128 --json");
  if (r.exit_code == 0) {
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["dtype"], "bf16");
    expect_measurement_keys(j);
  } else {
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("bf16"), std::string::npos) << r.err;
  }
}

struct BadCase {
  const char* args;
  const char* mentions;
};

/// Each case: exit 1, one line on stderr that mentions what it should, nothing on stdout.
void expect_one_line_errors(const std::string& command, std::initializer_list<BadCase> cases) {
  for (const BadCase& c : cases) {
    const auto r = run_command(kCli + " " + command + " " + c.args);
    EXPECT_EQ(r.exit_code, 1) << c.args;
    EXPECT_EQ(count_lines(r.err), 1) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find(c.mentions), std::string::npos) << c.args << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << c.args << ": " << r.out;
  }
}

TEST(CliBench, BadArgumentsGiveExitOneAndOneLine) {
  expect_one_line_errors(
      "bench",
      {
          {"--seq 0 --embed-dim 64 --heads 4", "--seq"},
          {"--seq 8 --embed-dim 64 --heads 5", "--heads"},
          {"--seq 8 --embed-dim 64 --heads 4 --kv-heads 3", "--kv-heads"},
          {"--seq 8 --embed-dim -64 --heads 4", "--embed-dim"},
          {"--seq 8 --embed-dim 64 --heads 4 --batch 0", "--batch"},
          {"--seq 8 --embed-dim 64 --heads 4 --repeat 0", "--repeat"},
          {"--seq 8 --embed-dim 64 --heads 4 --threads -1", "--threads"},
          {"--seq 8 --embed-dim 64 --heads 4 --dtype f16", "--dtype"},
          {"--seq 8 --embed-dim 64 --heads 4 --dtype bf16", "bf16"},  // the module has no bf16 forward
          {"--seq 8 --embed-dim 64", "--heads"},
          {"--seq 8 --embed-dim 64 --heads 4 --bogus", "--bogus"},
          {"--seq 8 --embed-dim 64 --heads 4 --need-weights all", "--need-weights"},
          {"--seq 8 --embed-dim 64 --heads 4 --need-weights averaged --core --backward", "--need-weights"},
          {"--seq 8 --embed-dim 64 --heads 4 --bw-mib 0", "--bw-mib"},
          {"--seq 0 --embed-dim 64 --heads 4", "--seq must be ≥ 1, got 0"},  // not "is required": it was given
          {"--seq 8 --embed-dim 64 --heads 4 --kv-seq 0", "--kv-seq must be ≥ 1"},
          {"--seq 8 --embed-dim 64 --heads 4 --bw-mib 9223372036854775807", "1 TiB"},
          // Options a mode would silently ignore, timing something other than what was asked for.
          {"--seq 8 --embed-dim 64 --heads 4 --decode --alibi --softcap 5",
           "--alibi, --softcap do not apply with --decode"},
          {"--seq 8 --embed-dim 64 --heads 4 --decode --need-weights averaged", "--need-weights does not apply"},
          {"--seq 8 --embed-dim 64 --heads 4 --varlen --sinks", "--sinks does not apply with --varlen"},
          {"--seq 8 --embed-dim 64 --heads 4 --varlen -B 3", "--batch does not apply with --varlen"},
          {"--seq 8 --embed-dim 64 --heads 4 --varlen-seqs 3", "--varlen-seqs does not apply without --varlen"},
          {"--seq 8 --embed-dim 64 --heads 4 --core --footprint-mib 1",
           "--footprint-mib does not apply without --decode"},
          // --decode and --varlen ran before --parallel was looked at, which they silently dropped.
          {"--seq 8 --embed-dim 64 --heads 4 --parallel ring --decode", "--parallel cannot be combined with"},
          {"--seq 64 --embed-dim 64 --heads 4 --parallel ring --varlen --varlen-seqs 2",
           "--parallel cannot be combined with"},
          {"--seq 8 --embed-dim 64 --heads 4 --parallel heads --core", "--parallel cannot be combined with"},
      });
}

TEST(CliBenchDecode, BadArgumentsGiveExitOneAndOneLine) {
  expect_one_line_errors(
      "bench-decode --heads 4 --kv-heads 2 --head-dim 16",
      {
          {"--contexts 16 --prefill 8 --prefill-repeat 0", "--prefill-repeat"},  // was a median of nothing: NaN
          {"--contexts 16 --splits -1", "--splits"},
          {"--contexts 16 --footprint-mib 9223372036854775807", "1 TiB"},  // footprint · 2²⁰ overflowed
          {"--contexts 16 --bw-mib 1048577", "1 TiB"},
      });
}

// Edges that crashed or ran for minutes: a key group near 2⁶³ (an int64 overflow in the cache:
// SIGSEGV), split counts past the keys (a workspace per split: std::bad_alloc), and a tiny cache
// against the default 1 GiB footprint (a million caches, as many steps). Each now just runs.
TEST(CliBenchDecode, HugeKeyGroupsSplitsAndTinyCachesRun) {
  const nlohmann::json huge_group = decode_json("--contexts 40 --dtype int8-channel --key-group 9223372036854775807");
  EXPECT_EQ(huge_group["decode"].size(), 1u);
  const nlohmann::json many_splits = decode_json("--contexts 40 --dtype f32 --splits 2147483647");
  EXPECT_EQ(many_splits["decode"].size(), 1u);
  const auto r = run_command(kCli + " bench --seq 8 --embed-dim 16 --heads 2 --decode --repeat 1 --bw-mib 1 --json");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["decode"].size(), 1u);
}

}  // namespace
