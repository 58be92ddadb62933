// kernels/dropout_rng.h — the counter-based generator behind dropout (docs/semantics.md, 'Dropout').
//
// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): the
// counter is (batch, head, query, key) and the key is the 64-bit seed, so the decision for one
// attention weight never depends on tiling, thread count or which pass (forward or backward)
// asks for it.
#pragma once

#include <cstdint>

namespace mha::kernels {

inline uint32_t philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
}

/// The first 32-bit word of Philox-4x32-10 at counter (c0, c1, c2, c3) under the 64-bit key.
inline uint32_t philox4x32_10(uint64_t key, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = philox_mulhilo(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = philox_mulhilo(0xCD9E8D57u, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

/// Uniform in [0, 1) with 24 random bits, for the weight (batch, head, query, key).
inline float dropout_uniform(uint64_t seed, int64_t batch, int64_t head, int64_t query, int64_t key) {
  const uint32_t bits = philox4x32_10(seed, static_cast<uint32_t>(batch), static_cast<uint32_t>(head),
                                      static_cast<uint32_t>(query), static_cast<uint32_t>(key));
  return static_cast<float>(bits >> 8) * 0x1.0p-24f;
}

/// Whether dropout with probability p keeps that weight.
inline bool dropout_keep(uint64_t seed, float p, int64_t batch, int64_t head, int64_t query, int64_t key) {
  return dropout_uniform(seed, batch, head, query, key) >= p;
}

}  // namespace mha::kernels
