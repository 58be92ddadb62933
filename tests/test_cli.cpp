// The `mha` command line: the forward contract, params, demo, help, and one-line errors.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "mha/safetensors.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using mha::testing::run_command;

const std::string kCli = MHA_CLI_PATH;
const std::string kCase = std::string(MHA_SHARED_DIR) + "/conformance/cases/key_padding.safetensors";

int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

void expect_one_line_failure(const mha::testing::CommandResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

TEST(Cli, ForwardWritesOutputMatchingTheCase) {
  const std::string out = mha::testing::temp_dir() + "/out.safetensors";
  const auto r = run_command(kCli + " forward --weights " + kCase + " --inputs " + kCase + " --output " + out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto got = mha::io::SafetensorsFile::open(out);
  const auto want = mha::io::SafetensorsFile::open(kCase);
  EXPECT_EQ(got.names(), (std::vector<std::string>{"attn_weights", "output"}));
  EXPECT_TRUE(mha::testing::all_close(got.read_f32("output"), want.read_f32("expected.output"), 2e-5, 2e-4));
}

TEST(Cli, MalformedFilesFailWithOneLineAndNoOutput) {
  const std::string dir = mha::testing::temp_dir();
  const std::string out = dir + "/out.safetensors";
  // Truncated: the header promises more bytes than the file has.
  const std::string truncated = dir + "/truncated.safetensors";
  fs::copy_file(kCase, truncated);
  fs::resize_file(truncated, fs::file_size(truncated) / 2);
  expect_one_line_failure(
      run_command(kCli + " forward --weights " + truncated + " --inputs " + truncated + " --output " + out),
      "truncated.safetensors");
  EXPECT_FALSE(fs::exists(out));
  // Garbage: not even a header length.
  const std::string garbage = dir + "/garbage.safetensors";
  std::ofstream(garbage) << "abc";
  expect_one_line_failure(
      run_command(kCli + " forward --weights " + garbage + " --inputs " + garbage + " --output " + out), "mha:");
  EXPECT_FALSE(fs::exists(out));
  // Missing file.
  expect_one_line_failure(
      run_command(kCli + " forward --weights " + dir + "/nope.safetensors --inputs " + kCase + " --output " + out),
      "nope.safetensors");
  EXPECT_FALSE(fs::exists(out));
}

/// An integer mask would be added to the scores (its 1s raising the positions it meant to hide):
/// refused with one line naming the tensor and its dtype, as PyTorch refuses it.
TEST(Cli, IntegerMaskIsRefusedWithOneLine) {
  const std::string dir = mha::testing::temp_dir();
  const auto src = mha::io::SafetensorsFile::open(kCase);
  mha::io::SafetensorsWriter w;
  for (const auto& [k, v] : src.metadata()) w.set_metadata(k, v);
  for (const std::string& name : src.names()) {
    const auto& info = src.info(name);
    if (name != "key_padding_mask") {
      w.add_raw(name, info.dtype, info.shape, src.raw(name));
      continue;
    }
    ASSERT_TRUE(info.dtype == mha::io::DType::BOOL || info.dtype == mha::io::DType::U8);
    std::vector<int64_t> wide;  // the same 0/1 values as int64
    for (std::byte c : src.raw(name)) wide.push_back(c != std::byte{0} ? 1 : 0);
    w.add_raw(name, mha::io::DType::I64, info.shape, std::as_bytes(std::span<const int64_t>(wide)));
  }
  const std::string bad = dir + "/int_mask.safetensors";
  w.write(bad);
  const std::string out = dir + "/out.safetensors";
  const auto r = run_command(kCli + " forward --weights " + kCase + " --inputs " + bad + " --output " + out);
  expect_one_line_failure(r, "key_padding_mask");
  EXPECT_NE(r.err.find("I64"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out));
}

TEST(Cli, InconsistentConfigurationFailsWithOneLine) {
  const std::string dir = mha::testing::temp_dir();
  const auto src = mha::io::SafetensorsFile::open(kCase);
  mha::io::SafetensorsWriter w;
  for (const auto& [k, v] : src.metadata()) w.set_metadata(k, v);
  w.set_metadata("num_heads", "3");  // 16 is not divisible by 3
  for (const std::string& name : src.names()) {
    const auto& info = src.info(name);
    w.add_raw(name, info.dtype, info.shape, src.raw(name));
  }
  const std::string bad = dir + "/bad_heads.safetensors";
  w.write(bad);
  expect_one_line_failure(
      run_command(kCli + " forward --weights " + bad + " --inputs " + bad + " --output " + dir + "/o.safetensors"),
      "divisible");
  EXPECT_FALSE(fs::exists(dir + "/o.safetensors"));

  // Inputs with the wrong width.
  mha::io::SafetensorsWriter inputs;
  inputs.add("query", mha::Tensor({3, 5, 15}));
  inputs.add("key", mha::Tensor({3, 8, 16}));
  inputs.add("value", mha::Tensor({3, 8, 16}));
  const std::string in = dir + "/inputs.safetensors";
  inputs.write(in);
  expect_one_line_failure(
      run_command(kCli + " forward --weights " + kCase + " --inputs " + in + " --output " + dir + "/o.safetensors"),
      "(3, 5, 15)");
  EXPECT_FALSE(fs::exists(dir + "/o.safetensors"));
}

TEST(Cli, ParamsBertBase) {
  const auto r = run_command(kCli + " params --embed-dim 768 --heads 12");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("2,362,368"), std::string::npos) << r.out;
  const auto j = run_command(kCli + " params --embed-dim 4096 --heads 32 --kv-heads 8 --no-bias --json");
  ASSERT_EQ(j.exit_code, 0) << j.err;
  const auto parsed = nlohmann::json::parse(j.out);
  EXPECT_EQ(parsed["parameters"].get<int64_t>(), 2 * 4096 * 4096 + 2 * 4096 * 1024);
  EXPECT_EQ(parsed["kv_cache_bytes_per_token"]["f32"].get<int64_t>(), 2 * 8 * 128 * 4);
  EXPECT_EQ(parsed["kv_cache_bytes_per_token"]["int8"].get<int64_t>(), 2 * 8 * (128 + 4));
  EXPECT_DOUBLE_EQ(parsed["kv_cache_saving_vs_mha"].get<double>(), 4.0);
  expect_one_line_failure(run_command(kCli + " params --embed-dim 10 --heads 3"), "divisible");
  expect_one_line_failure(run_command(kCli + " params --embed-dim 10"), "heads");
  // 4.6e18 parameters: their bytes overflowed int64 (printed as 16 GiB, bf16 as a negative size).
  expect_one_line_failure(run_command(kCli + " params --embed-dim 1073741824 --heads 1"), "does not fit in 64 bits");
  const auto big = run_command(kCli + " params --embed-dim 536870912 --heads 1");
  EXPECT_NE(big.out.find("bytes: float32 4.00 EiB, bfloat16 2.00 EiB"), std::string::npos) << big.out;
}

TEST(Cli, DemoShowsTheWorkedExample) {
  const auto r = run_command(kCli + " demo");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[  0.71,   0.00,   0.71]"), std::string::npos);
  EXPECT_NE(r.out.find("[  0.00,   0.71,   0.71]"), std::string::npos);
  EXPECT_NE(r.out.find("[  0.71,   0.71,   1.41]"), std::string::npos);
  EXPECT_NE(r.out.find("row sums: 1.0000 1.0000 1.0000"), std::string::npos);
  EXPECT_NE(r.out.find("max |difference| = 0"), std::string::npos);
}

TEST(Cli, HelpEverywhereAndUnknownFlagsFail) {
  for (const char* sub : {"", "forward", "params", "demo"}) {
    const auto r = run_command(kCli + " " + sub + " --help");
    EXPECT_EQ(r.exit_code, 0) << sub;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << sub;
  }
  expect_one_line_failure(run_command(kCli + " params --embed-dim 8 --heads 2 --frobnicate"), "frobnicate");
  expect_one_line_failure(run_command(kCli), "mha:");
  // A misspelt command is named (CLI11 said only that a subcommand is required).
  expect_one_line_failure(run_command(kCli + " frobnicate --help"), "unknown command 'frobnicate'");
}

// An empty path where a file is written is refused before any work (analyze's --image '' drew
// nothing and exited 0).
TEST(Cli, EmptyOutputPathsAreRefused) {
  const std::string dir = mha::testing::temp_dir();
  expect_one_line_failure(run_command(kCli + " forward --weights " + kCase + " --inputs " + kCase + " --output ''"),
                          "--output: expected a path, got ''");
  expect_one_line_failure(run_command(kCli + " prune --weights " + kCase + " --heads 0 --output ''"),
                          "--output: expected a path, got ''");
  for (const char* opt : {"--image", "--svg"})
    expect_one_line_failure(
        run_command(kCli + " analyze --weights " + kCase + " --inputs " + kCase + " " + opt + " ''"),
        std::string(opt) + ": expected a path, got ''");
  EXPECT_TRUE(fs::is_empty(dir));
}

// --threads takes a whole number ≥ 0 on every subcommand that has it, and says so in a short line
// (the check it had printed its range as a double with a 300-digit bound).
TEST(Cli, ThreadsMustBeAWholeNumberAtLeastZero) {
  for (const char* sub : {"forward", "analyze", "prune"})
    for (const char* bad : {"abc", "-1", "1.5", "\"\"", "010"}) {
      SCOPED_TRACE(std::string(sub) + " --threads " + bad);
      const auto r = run_command(kCli + " " + sub + " --weights " + kCase + " --threads " + bad);
      expect_one_line_failure(r, "--threads: expected a whole number ≥ 0");
      EXPECT_LT(r.err.size(), 120u) << r.err;
    }
}

// 0 used to mean "the default" silently (--kv-heads 0 counted h heads); leaving the option out
// means that now, and 0, negatives and non-integers fail in one line. --embed-dim and --heads
// likewise ('' was read as 0, a number past int64 as INT64_MAX).
TEST(Cli, HeadAndWidthCountsMustBeWholeNumbersAtLeastOne) {
  const std::vector<std::string> commands = {kCli + " params -E 64 -H 4 --kv-heads ",
                                             kCli + " params -E 64 -H 4 --kdim ",
                                             kCli + " params -E 64 -H 4 --vdim ",
                                             kCli + " params -H 4 -E ",
                                             kCli + " params -E 64 -H ",
                                             kCli + " bench --core --seq 8 --heads 4 --embed-dim ",
                                             kCli + " bench --core --seq 8 --embed-dim 64 --heads 4 --kv-heads "};
  for (const std::string& cmd : commands)
    for (const char* bad : {"0", "-2", "1.5", "x"}) {
      SCOPED_TRACE(cmd + bad);
      const auto r = run_command(cmd + bad);
      expect_one_line_failure(r, ": expected a whole number ≥ 1, got '");
      EXPECT_LT(r.err.size(), 120u) << r.err;
    }
  const auto ok = run_command(kCli + " params -E 64 -H 4 --kv-heads 1 --kdim 32 --vdim 16 --json");
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  const auto j = nlohmann::json::parse(ok.out);
  EXPECT_EQ(j.at("num_kv_heads"), 1);
  EXPECT_EQ(j.at("kdim"), 32);
  EXPECT_EQ(j.at("vdim"), 16);
}

}  // namespace
