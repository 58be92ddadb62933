// Autoregressive decoding with a KV cache: prefill a prompt, then generate token by token.
//
// Each step feeds only the new token; the module projects it, applies rotary embeddings at its
// absolute position, attends to everything in the cache, and appends its key and value. The
// result equals running the full causal forward over the whole sequence again, row for row.
#include <cmath>
#include <cstdio>
#include <cstring>

#include "mha/kv_cache.h"
#include "mha/module.h"

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      const bool help = std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0;
      std::fprintf(help ? stdout : stderr, "usage: %s [--quick]\n", argv[0]);
      return help ? 0 : 2;
    }
  }
  const int64_t prompt_len = quick ? 8 : 64, new_tokens = quick ? 4 : 32;

  // A Llama-style layer: 8 query heads sharing 2 key/value heads, rotary positions.
  mha::MhaConfig config;
  config.embed_dim = 64;
  config.num_heads = 8;
  config.num_kv_heads = 2;
  config.layout = mha::Layout::BatchFirst;  // (B, T, E)
  config.rope = mha::Rope::half_split();
  const mha::MultiheadAttention layer(config, /*init_seed=*/1);

  // One cache per layer: (batch, kv_heads, capacity, head_dim), allocated once.
  mha::KvCacheConfig cache_config;
  cache_config.batch = 1;
  cache_config.kv_heads = config.kv_heads();
  cache_config.head_dim = config.head_dim();
  cache_config.capacity = prompt_len + new_tokens;
  cache_config.dtype = mha::CacheDtype::BF16;            // half the bytes to read per step
  cache_config.key_layout = mha::KeyLayout::Transposed;  // keys across SIMD lanes: faster steps
  mha::KvCache cache(cache_config);

  // Prefill: the whole prompt in one call (self-attention: query = key = value).
  mha::Tensor prompt({1, prompt_len, config.embed_dim});
  for (int64_t i = 0; i < prompt.numel(); ++i) prompt.data()[i] = std::sin(0.1f * static_cast<float>(i));
  mha::Tensor out = layer.forward_incremental(prompt, prompt, prompt, cache).output;
  std::printf("prefill: %lld tokens, cache holds %lld\n", static_cast<long long>(prompt_len),
              static_cast<long long>(cache.length(0)));

  // Decode: one token per step. A real model would feed the next token's embedding here;
  // this example feeds the layer's last output back in.
  mha::Tensor token({1, 1, config.embed_dim});
  for (int64_t step = 0; step < new_tokens; ++step) {
    std::memcpy(token.data(), out.data() + (out.size(1) - 1) * config.embed_dim, sizeof(float) * config.embed_dim);
    out = layer.forward_incremental(token, token, token, cache).output;
  }
  std::printf("decoded %lld tokens, cache holds %lld of %lld positions, out[0] = %.5f\n",
              static_cast<long long>(new_tokens), static_cast<long long>(cache.length(0)),
              static_cast<long long>(cache.capacity()), static_cast<double>(out.data()[0]));
  return std::isfinite(out.data()[0]) ? 0 : 1;
}
