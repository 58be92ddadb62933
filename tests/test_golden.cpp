// PyTorch goldens through the library (the CLI runs the same cases in conformance_golden):
// tests/golden/forward (module cases, shared conformance format) and tests/golden/sdpa.
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

INSTANTIATE_TEST_SUITE_P(Cases, ForwardGolden, ::testing::ValuesIn(case_files(MHA_GOLDEN_DIR "/forward")),
                         case_name);
INSTANTIATE_TEST_SUITE_P(Shared, ForwardGolden, ::testing::ValuesIn(case_files(MHA_SHARED_DIR "/conformance/cases")),
                         case_name);

class SdpaGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(SdpaGolden, MatchesPyTorch) {
  const auto file = mha::io::SafetensorsFile::open(GetParam());
  const auto& meta = file.metadata();
  const Tensor q = file.read_f32("q"), k = file.read_f32("k"), v = file.read_f32("v");
  mha::SdpaOptions opt;
  mha::BoolTensor allowed;
  Tensor bias;
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
  const Tensor want_lse = file.read_f32("expected.lse");
  for (mha::Backend backend : {mha::Backend::Reference, mha::Backend::Auto}) {
    opt.backend = backend;
    const mha::SdpaResult r = mha::sdpa(q, k, v, opt, mha::Want::WeightsAndLse);
    EXPECT_TRUE(mha::testing::all_close(r.out, file.read_f32("expected.out"), kAtol, kRtol));
    EXPECT_TRUE(mha::testing::all_close(r.weights, file.read_f32("expected.weights"), kAtol, kRtol));
    EXPECT_TRUE(mha::testing::all_close(r.lse, want_lse, kAtol, kRtol));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, SdpaGolden, ::testing::ValuesIn(case_files(MHA_GOLDEN_DIR "/sdpa")), case_name);

TEST(GoldenData, EnoughCasesAreCommitted) {
  EXPECT_GE(case_files(MHA_GOLDEN_DIR "/forward").size(), 40u);
  EXPECT_GE(case_files(MHA_GOLDEN_DIR "/sdpa").size(), 10u);
}

}  // namespace
