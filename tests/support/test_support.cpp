#include "support/test_support.h"

#include <hwy/targets.h>

#include "kernels/amx.h"
#include "kernels/backward_fused.h"
#include "kernels/decode.h"
#include "kernels/fused_forward.h"

#include <sys/wait.h>
#include <unistd.h>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>
#include <vector>

#include "mha/random.h"

namespace mha::testing {

Tensor random_tensor(const Shape& shape, uint64_t seed, float lo, float hi) {
  Tensor t(shape);
  SplitMix64 rng(seed * SplitMix64::kGamma + 0x1234567ull);  // the tests' own seeding
  for (float& x : t.values()) x = static_cast<float>(lo + (hi - lo) * rng.uniform());
  return t;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (float x : t.values())
    if (std::isfinite(x)) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

BF16Tensor to_bf16_tensor(const Tensor& t) {
  BF16Tensor b(t.shape());
  for (int64_t i = 0; i < t.numel(); ++i) b.data()[i] = to_bf16(t.data()[i]);
  return b;
}

Tensor widened(const BF16Tensor& b) {
  Tensor t(b.shape());
  for (int64_t i = 0; i < b.numel(); ++i) t.data()[i] = to_float(b.data()[i]);
  return t;
}

constexpr double kF32Eps = 0x1.0p-23;

double f32_out_tol(double max_v, int64_t keys, double score_bound, double slack) {
  return slack * kF32Eps * max_v * (4.0 * std::sqrt(static_cast<double>(keys)) + 4.0 * score_bound + 16.0);
}

double f32_lse_tol(int64_t keys, double score_bound, double slack) {
  return slack * kF32Eps * (8.0 * score_bound + 4.0 * std::log(static_cast<double>(keys) + 1.0) + 16.0);
}

::testing::AssertionResult all_close(const Tensor& got, const Tensor& want, double atol, double rtol) {
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure() << "shape " << shape_str(got.shape()) << " != " << shape_str(want.shape());
  double worst = 0;
  int64_t worst_at = -1;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.data()[i], w = want.data()[i];
    if (std::isnan(g) != std::isnan(w) || (std::isinf(w) && g != w))
      return ::testing::AssertionFailure() << "element " << i << ": got " << g << ", want " << w;
    if (std::isnan(w) || std::isinf(w)) continue;
    const double ratio = std::fabs(g - w) / (atol + rtol * std::fabs(w));
    if (ratio > worst) worst = ratio, worst_at = i;
  }
  if (worst > 1.0)
    return ::testing::AssertionFailure() << "element " << worst_at << ": got " << got.data()[worst_at] << ", want "
                                         << want.data()[worst_at] << " (" << worst << "x the tolerance atol=" << atol
                                         << " rtol=" << rtol << ")";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult bitwise_equal(const Tensor& got, const Tensor& want) {
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure() << "shape " << shape_str(got.shape()) << " != " << shape_str(want.shape());
  for (int64_t i = 0; i < got.numel(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, got.data() + i, 4);
    std::memcpy(&b, want.data() + i, 4);
    if (a != b)
      return ::testing::AssertionFailure() << "element " << i << ": " << got.data()[i] << " vs " << want.data()[i];
  }
  return ::testing::AssertionSuccess();
}

std::vector<std::pair<std::string, const Tensor*>> named_parameters(const MhaParameters& p) {
  return {{"in_proj_weight", &p.in_proj_weight},
          {"q_proj_weight", &p.q_proj_weight},
          {"k_proj_weight", &p.k_proj_weight},
          {"v_proj_weight", &p.v_proj_weight},
          {"in_proj_bias", &p.in_proj_bias},
          {"bias_k", &p.bias_k},
          {"bias_v", &p.bias_v},
          {"sinks", &p.sinks},
          {"out_proj.weight", &p.out_proj_weight},
          {"out_proj.bias", &p.out_proj_bias}};
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no mha::Error thrown";
  return {};
}

static std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

namespace {
/// The directories temp_dir() made in this process. They go when the test binary exits, unless a
/// test failed: then they stay, named on stderr, for a look at what the test wrote.
struct TempDirs {
  std::vector<std::filesystem::path> made;
  TempDirs() = default;
  TempDirs(const TempDirs&) = delete;
  TempDirs& operator=(const TempDirs&) = delete;
  ~TempDirs() {
    const bool failed = ::testing::UnitTest::GetInstance()->Failed();
    for (const auto& dir : made) {
      if (failed) {
        std::fprintf(stderr, "kept for a look after the failure: %s\n", dir.c_str());
        continue;
      }
      std::error_code ignored;  // a directory that is gone already is fine
      std::filesystem::remove_all(dir, ignored);
    }
  }
};
}  // namespace

std::string temp_dir() {
  static TempDirs dirs;
  static int counter = 0;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "global";
  for (char& c : name)
    if (c == '/') c = '_';
  auto dir = std::filesystem::temp_directory_path() /
             ("mha_test_" + std::to_string(::getpid()) + "_" + name + "_" + std::to_string(counter++));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  dirs.made.push_back(dir);
  return dir.string();
}

CommandResult run_command(const std::string& command_line) {
  const std::string dir = temp_dir();
  const std::string out = dir + "/stdout", err = dir + "/stderr";
  const std::string full = command_line + " >" + out + " 2>" + err + " </dev/null";
  const int status = std::system(full.c_str());
  CommandResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  r.out = slurp(out);
  r.err = slurp(err);
  std::filesystem::remove_all(dir);
  return r;
}

namespace {
/// Runs body once per target of `compiled` that this CPU supports, with dispatch forced to it and
/// `dispatched()` checked against it.
void for_each_target(const std::vector<int64_t>& compiled, int64_t (*dispatched)(), const std::function<void()>& body) {
  hwy::SetSupportedTargetsForTest(0);
  const int64_t supported = hwy::SupportedTargets();
  int ran = 0;
  for (int64_t target : compiled) {
    if (!(supported & target)) continue;
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(std::string("target ") + hwy::TargetName(target));
    ASSERT_EQ(dispatched(), target);
    ++ran;
    body();
    if (::testing::Test::HasFatalFailure()) break;
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GE(ran, 1);
}
}  // namespace

void for_each_fused_target(const std::function<void()>& body) {
  // Where the CPU has AMX, the AVX3_DL target's bf16 products run on its tiles; run that target
  // again with the tiles switched off, so that the vdpbf16ps kernels are tested here too.
  for_each_target(kernels::fused_compiled_targets(), kernels::fused_dispatch_target, [&] {
    body();
    if (kernels::fused_dispatch_target() != HWY_AVX3_DL || !kernels::amx::available() ||
        ::testing::Test::HasFatalFailure())
      return;
    SCOPED_TRACE("AMX switched off");
    kernels::amx::set_allowed_for_test(false);
    body();
    kernels::amx::set_allowed_for_test(true);
  });
}

void for_each_fused_backward_target(const std::function<void()>& body) {
  for_each_target(kernels::fused_backward_compiled_targets(), kernels::fused_backward_dispatch_target, body);
}

void for_each_decode_target(const std::function<void()>& body) {
  for_each_target(kernels::decode_compiled_targets(), kernels::decode_dispatch_target, body);
}

}  // namespace mha::testing
