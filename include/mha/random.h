// mha/random.h — the small deterministic generator behind parameter initialisation, test inputs,
// benchmark inputs and the examples.
//
// splitmix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014;
// constants from Vigna's reference code): a 64-bit state advanced by the golden-ratio increment
// and hashed by two xor-shift-multiply rounds. Fast, tiny, and the same stream on every machine,
// which is what reproducible weights and inputs need. Not for cryptography. (Dropout uses a
// counter-based Philox instead, so that its decisions do not depend on order.)
#pragma once

#include <cmath>
#include <cstdint>

namespace mha {

class SplitMix64 {
 public:
  static constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;  ///< the state increment, ⌊2⁶⁴/φ⌋ (odd)

  /// Starts from a raw state; the first value is the hash of state + kGamma.
  constexpr explicit SplitMix64(uint64_t state) : state_(state) {}

  /// The seeding MultiheadAttention uses for its initial parameters (and the tools for their
  /// inputs): state = seed · kGamma + 0x2545F4914F6CDD1D, so nearby seeds give unrelated streams.
  static constexpr SplitMix64 seeded(uint64_t seed) { return SplitMix64(seed * kGamma + 0x2545F4914F6CDD1Dull); }

  /// The next 64 random bits.
  constexpr uint64_t next() {
    state_ += kGamma;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  /// Uniform in [0, 1), from the top 53 bits.
  constexpr double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

  /// Standard normal by Box–Muller (one value per two uniforms; u1 is taken in (0, 1]).
  double normal() {
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

  uint64_t state() const { return state_; }

 private:
  uint64_t state_;
};

}  // namespace mha
