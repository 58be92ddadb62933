// Helpers shared by the tests: deterministic random tensors, tolerance checks, running the CLI.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "mha/module.h"
#include "mha/tensor.h"

namespace mha::testing {

/// Uniform values in [lo, hi) from a fixed seed (splitmix64), reproducible on every machine.
Tensor random_tensor(const Shape& shape, uint64_t seed, float lo = -1.0f, float hi = 1.0f);

/// Checks |got − want| ≤ atol + rtol·|want| elementwise, and equal shapes; reports the worst.
::testing::AssertionResult all_close(const Tensor& got, const Tensor& want, double atol, double rtol);

/// The largest |x| over the finite values of t (0 for none).
double max_abs(const Tensor& t);

/// t rounded to bfloat16 (nearest even), and a bf16 tensor's values widened back to float32.
BF16Tensor to_bf16_tensor(const Tensor& t);
Tensor widened(const BF16Tensor& b);

/// float32 tolerances of the fused kernels against the double reference, from the problem's
/// bounds: a softmax over `keys` keys (count a sink as one more) with scores |s| ≤ score_bound,
/// values |v| ≤ max_v. `slack` scales the whole bound (2 where score edits add roundings).
///   out: ε·max_v·(4√keys + 4·score_bound + 16)     lse: ε·(8·score_bound + 4·log(keys + 1) + 16)
double f32_out_tol(double max_v, int64_t keys, double score_bound, double slack = 1.0);
double f32_lse_tol(int64_t keys, double score_bound, double slack = 1.0);

/// Bitwise equality of shapes and values.
::testing::AssertionResult bitwise_equal(const Tensor& got, const Tensor& want);

/// Every parameter tensor of the module, in a fixed order, under its PyTorch name (unused ones
/// are empty tensors).
std::vector<std::pair<std::string, const Tensor*>> named_parameters(const MhaParameters& p);

/// Runs f and returns the message of the mha::Error it throws (a test failure when it throws none).
std::string error_of(const std::function<void()>& f);

struct CommandResult {
  int exit_code = -1;
  std::string out;  ///< stdout
  std::string err;  ///< stderr
};
/// Runs a shell command line, capturing stdout and stderr.
CommandResult run_command(const std::string& command_line);

/// A fresh empty directory under the system's temp directory, its name unique per process and
/// test. Removed when the test binary exits, unless a test failed (then kept and named on stderr).
std::string temp_dir();

/// Runs `body` once per compiled SIMD target of the fused forward kernel that this CPU supports,
/// with dispatch forced to it (and checked), then restores the normal dispatch.
void for_each_fused_target(const std::function<void()>& body);
/// The same for the fused backward kernel's targets.
void for_each_fused_backward_target(const std::function<void()>& body);
/// The same for the decode kernel's targets (kernels::decode_compiled_targets: a test file's own
/// hwy::SupportedAndGeneratedTargets lacks AVX3_DL, which the kernels are built for).
void for_each_decode_target(const std::function<void()>& body);

}  // namespace mha::testing
