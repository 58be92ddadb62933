#include <cstdio>

#include <mha/module.h>

int main() {
  mha::MhaConfig config;
  config.embed_dim = 8;
  config.num_heads = 2;
  config.layout = mha::Layout::BatchFirst;
  mha::MultiheadAttention attention(config, 1);
  mha::Tensor x({1, 3, 8}, 0.5f);
  mha::MhaOutput y = attention.forward(x, x, x);
  if (y.output.shape() != mha::Shape{1, 3, 8}) return 1;
  std::printf("consumer ok: %lld parameters\n", static_cast<long long>(attention.parameter_count()));
  return 0;
}
