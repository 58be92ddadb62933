// The README's tour of the C++ API, compiled and run by the test suite.
#include <cstdio>
#include <filesystem>
#include <string>

#include <mha/module.h>
#include <mha/safetensors.h>
#include <mha/sdpa.h>
#include <mha/weights.h>

int main() {
  // 1. Scaled dot-product attention on (B, h, T, d) tensors, causal, with weights and log-sum-exp.
  mha::Tensor q({1, 2, 4, 8}, 0.1f), k({1, 2, 4, 8}, 0.2f), v({1, 2, 4, 8}, 1.0f);
  mha::SdpaOptions sdpa_options;
  sdpa_options.masks.causal = mha::Causal::top_left();  // query i sees keys 0..i
  mha::SdpaResult att = mha::sdpa(q, k, v, sdpa_options, mha::Want::WeightsAndLse);
  std::printf("sdpa: out %s, weights %s, row 0 = [%.2f %.2f]\n", mha::shape_str(att.out.shape()).c_str(),
              mha::shape_str(att.weights.shape()).c_str(), att.weights.at({0, 0, 0, 0}), att.weights.at({0, 0, 0, 1}));

  // 2. The module: torch.nn.MultiheadAttention's options, plus grouped-query attention.
  mha::MhaConfig config;
  config.embed_dim = 64;
  config.num_heads = 8;
  config.num_kv_heads = 2;  // 4 query heads share each K/V head
  config.layout = mha::Layout::BatchFirst;
  mha::MultiheadAttention attention(config, /*init_seed=*/1);

  mha::Tensor x({2, 10, 64}, 0.5f);     // (B, T, E)
  mha::BoolTensor padding({2, 10}, 0);  // true = padding, never read
  padding.at({1, 9}) = 1;
  mha::MhaForwardOptions options;
  options.key_padding_mask.is_padding = padding;
  options.causal = mha::Causal::top_left();
  options.need_weights = mha::NeedWeights::PerHead;
  mha::MhaOutput y = attention.forward(x, x, x, options);
  std::printf("module: output %s, weights %s, %lld parameters\n", mha::shape_str(y.output.shape()).c_str(),
              mha::shape_str(y.attn_weights.shape()).c_str(), static_cast<long long>(attention.parameter_count()));

  // 3. Weights in safetensors, under PyTorch or Hugging Face names.
  const std::string path = std::filesystem::temp_directory_path() / "mha_tour_weights.safetensors";
  mha::io::save_module(path, attention, mha::io::WeightNames::HuggingFace);
  mha::MultiheadAttention loaded = mha::io::load_module(mha::io::SafetensorsFile::open(path));
  std::printf("reloaded from %s: %lld parameters\n", path.c_str(), static_cast<long long>(loaded.parameter_count()));
  std::filesystem::remove(path);

  // 4. Bad input is an exception that names the argument and the shapes.
  try {
    attention.forward(mha::Tensor({2, 10, 63}), x, x);
  } catch (const mha::Error& e) {
    std::printf("error: %s\n", e.what());
  }
  return 0;
}
