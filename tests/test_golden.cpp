// PyTorch goldens through the library (the CLI runs the same cases in conformance_golden):
// tests/golden/forward (module cases, shared conformance format) and tests/golden/sdpa.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "mha/module.h"
#include "mha/safetensors.h"
#include "mha/sdpa.h"
#include "mha/weights.h"
#include "support/test_support.h"

namespace {

using mha::Tensor;
using mha::testing::to_bf16_tensor;
using mha::testing::widened;
namespace fs = std::filesystem;

// The shared checker's tolerance: PyTorch float32 vs our float32, both within a few ulps of exact.
constexpr double kAtol = 2e-5, kRtol = 2e-4;

std::vector<std::string> case_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

bool flag(const std::map<std::string, std::string>& meta, const std::string& key, bool fallback) {
  auto it = meta.find(key);
  return it == meta.end() ? fallback : it->second == "true";
}

class ForwardGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(ForwardGolden, MatchesPyTorch) {
  const auto file = mha::io::SafetensorsFile::open(GetParam());
  const auto& meta = file.metadata();
  mha::MultiheadAttention module = mha::io::load_module(file);
  mha::MhaForwardOptions opt;
  if (file.contains("attn_mask")) {
    opt.attn_mask = file.info("attn_mask").dtype == mha::io::DType::BOOL
                        ? mha::AttnMask::from_torch_bool(file.read_bool("attn_mask"))
                        : mha::AttnMask::add(file.read_f32("attn_mask"));
  }
  if (file.contains("key_padding_mask")) {
    if (file.info("key_padding_mask").dtype == mha::io::DType::BOOL)
      opt.key_padding_mask.is_padding = file.read_bool("key_padding_mask");
    else
      opt.key_padding_mask.additive = file.read_f32("key_padding_mask");
  }
  if (flag(meta, "is_causal", false)) opt.causal = mha::Causal::top_left();
  const bool need_weights = flag(meta, "need_weights", false);
  opt.need_weights = !need_weights                              ? mha::NeedWeights::None
                     : flag(meta, "average_attn_weights", true) ? mha::NeedWeights::Averaged
                                                                : mha::NeedWeights::PerHead;
  const Tensor q = file.read_f32("query"), k = file.read_f32("key"), v = file.read_f32("value");
  for (mha::Backend backend : {mha::Backend::Reference, mha::Backend::Auto}) {
    opt.backend = backend;
    const mha::MhaOutput out = module.forward(q, k, v, opt);
    EXPECT_TRUE(mha::testing::all_close(out.output, file.read_f32("expected.output"), kAtol, kRtol));
    if (need_weights)
      EXPECT_TRUE(mha::testing::all_close(out.attn_weights, file.read_f32("expected.attn_weights"), kAtol, kRtol));
    else
      EXPECT_FALSE(out.attn_weights.defined());
  }
}

std::string case_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = fs::path(info.param).stem().string();
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return name;
}

INSTANTIATE_TEST_SUITE_P(Cases, ForwardGolden, ::testing::ValuesIn(case_files(MHA_GOLDEN_DIR "/forward")), case_name);
INSTANTIATE_TEST_SUITE_P(Shared, ForwardGolden, ::testing::ValuesIn(case_files(MHA_SHARED_DIR "/conformance/cases")),
                         case_name);

class SdpaGolden : public ::testing::TestWithParam<std::string> {};

/// One SDPA golden: inputs, masks (owned here, so the views in opt stay valid) and options.
struct SdpaCase {
  mha::io::SafetensorsFile file;
  Tensor q, k, v, bias;
  mha::BoolTensor allowed;
  mha::SdpaOptions opt;

  explicit SdpaCase(const std::string& path) : file(mha::io::SafetensorsFile::open(path)) {
    const auto& meta = file.metadata();
    q = file.read_f32("q"), k = file.read_f32("k"), v = file.read_f32("v");
    if (file.contains("allowed")) {
      allowed = file.read_bool("allowed");
      opt.masks.allowed.view = allowed.view4();
    }
    if (file.contains("bias")) {
      bias = file.read_f32("bias");
      opt.masks.bias.view = bias.view4();
    }
    const std::string causal = meta.count("causal") ? meta.at("causal") : "none";
    if (causal == "top_left") opt.masks.causal = mha::Causal::top_left();
    if (causal == "bottom_right") opt.masks.causal = mha::Causal::bottom_right();
    if (meta.count("scale")) opt.scale = std::stof(meta.at("scale"));
  }
  SdpaCase(const SdpaCase&) = delete;
  SdpaCase& operator=(const SdpaCase&) = delete;
  float scale() const { return opt.scale ? *opt.scale : 1.0f / std::sqrt(static_cast<float>(q.shape()[3])); }
};

TEST_P(SdpaGolden, MatchesPyTorch) {
  SdpaCase c(GetParam());
  const Tensor want_lse = c.file.read_f32("expected.lse");
  for (mha::Backend backend : {mha::Backend::Reference, mha::Backend::Auto}) {
    c.opt.backend = backend;
    const mha::SdpaResult r = mha::sdpa(c.q, c.k, c.v, c.opt, mha::Want::WeightsAndLse);
    EXPECT_TRUE(mha::testing::all_close(r.out, c.file.read_f32("expected.out"), kAtol, kRtol));
    EXPECT_TRUE(mha::testing::all_close(r.weights, c.file.read_f32("expected.weights"), kAtol, kRtol));
    EXPECT_TRUE(mha::testing::all_close(r.lse, want_lse, kAtol, kRtol));
  }
}

/// max |a − b| over the entries where both are finite (equal infinities, −inf lse of a fully masked
/// row, are checked by all_close).
double max_error(const Tensor& a, const Tensor& b) {
  double e = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::isfinite(a.data()[i]) && std::isfinite(b.data()[i]))
      e = std::max(e, std::abs(static_cast<double>(a.data()[i]) - b.data()[i]));
  return e;
}
/// max over (b, h, i, j) of scale·Σ_c |q_ic|·|k_jc| (K/V head h / group): what bounds a score.
double max_abs_score(const Tensor& q, const Tensor& k, float scale) {
  const int64_t B = q.shape()[0], H = q.shape()[1], Tq = q.shape()[2], D = q.shape()[3], KV = k.shape()[1],
                Tk = k.shape()[2];
  double worst = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Tq; ++i)
        for (int64_t j = 0; j < Tk; ++j) {
          double sum = 0;
          for (int64_t c = 0; c < D; ++c)
            sum += std::abs(static_cast<double>(q.at({b, h, i, c})) * k.at({b, h / (H / KV), j, c}));
          worst = std::max(worst, scale * sum);
        }
  return worst;
}

// bf16 inputs on the PyTorch goldens (docs/semantics.md, "bfloat16"). bf16 keeps 8 significant
// bits: rounding to nearest moves a value by at most u = 2⁻⁹ of itself. The fused kernel's own
// error (against the reference on the same, widened, inputs) comes from rounding P to bf16 for
// P·V: out = Σ p_j(1 + δ_j) v_j / Σ p_j with |δ_j| ≤ u moves by at most u·max|v|; m, l and lse stay
// float32. Against PyTorch's float32 answer, the rounding of the inputs adds: V by u·max|v|, and
// each score by at most δ = (2u + u²)·max scale·Σ|q||k|, so each probability by a factor within
// e^{±2δ}, out by (e^{2δ} − 1)·max|v| and lse by δ. Each bound gets the float32 tolerance on top.
TEST_P(SdpaGolden, Bf16WithinItsPrecision) {
  SdpaCase c(GetParam());
  const double u = std::ldexp(1.0, -9);
  const mha::BF16Tensor qb = to_bf16_tensor(c.q), kb = to_bf16_tensor(c.k), vb = to_bf16_tensor(c.v);
  Tensor out({c.q.shape()[0], c.q.shape()[1], c.q.shape()[2], c.v.shape()[3]});
  Tensor lse4({c.q.shape()[0], c.q.shape()[1], c.q.shape()[2], 1});
  Tensor lse(c.file.read_f32("expected.lse").shape());  // (B, h, T_q), as the owning form returns it
  c.opt.backend = mha::Backend::Reference;
  const mha::SdpaResult same_inputs = mha::sdpa(widened(qb), widened(kb), widened(vb), c.opt, mha::Want::Lse);
  const Tensor want_out = c.file.read_f32("expected.out"), want_lse = c.file.read_f32("expected.lse");
  const double vmax = mha::testing::max_abs(c.v), delta = (2 * u + u * u) * max_abs_score(c.q, c.k, c.scale());
  const double kernel_bound = u * vmax + kAtol, torch_bound = (2 * u + std::expm1(2 * delta)) * vmax + kAtol;
  // Every SIMD target: the dot-product, AMX (where present) and widened-FMA paths all keep the bounds.
  c.opt.backend = mha::Backend::Fused;
  mha::testing::for_each_fused_target([&] {
    mha::sdpa(qb.view4(), kb.view4(), vb.view4(), c.opt, {out.view4(), {}, lse4.view4()});
    std::copy(lse4.data(), lse4.data() + lse4.numel(), lse.data());
    EXPECT_TRUE(mha::testing::all_close(out, same_inputs.out, kernel_bound, 0));
    EXPECT_TRUE(mha::testing::all_close(lse, same_inputs.lse, kAtol, kRtol));
    EXPECT_TRUE(mha::testing::all_close(out, want_out, torch_bound, 0));
    EXPECT_TRUE(mha::testing::all_close(lse, want_lse, delta + kAtol, kRtol));
  });
  // The figures of the target this CPU dispatches to.
  mha::sdpa(qb.view4(), kb.view4(), vb.view4(), c.opt, {out.view4(), {}, lse4.view4()});
  std::copy(lse4.data(), lse4.data() + lse4.numel(), lse.data());
  std::printf("%-40s kernel %.2e of %.2e; vs PyTorch f32: out %.2e of %.2e, lse %.2e of %.2e\n",
              fs::path(GetParam()).stem().c_str(), max_error(out, same_inputs.out), kernel_bound,
              max_error(out, want_out), torch_bound, max_error(lse, want_lse), delta + kAtol);
}

INSTANTIATE_TEST_SUITE_P(Cases, SdpaGolden, ::testing::ValuesIn(case_files(MHA_GOLDEN_DIR "/sdpa")), case_name);

TEST(GoldenData, EnoughCasesAreCommitted) {
  EXPECT_GE(case_files(MHA_GOLDEN_DIR "/forward").size(), 40u);
  EXPECT_GE(case_files(MHA_GOLDEN_DIR "/sdpa").size(), 10u);
}

}  // namespace
