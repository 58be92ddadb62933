// kernels/rope.cpp — rotary position embeddings, in place.
//
// Shapes: x (B, heads, T, d), strided; start (B) absolute position of row 0 per batch, or null.
// For each (b, t) the dims/2 angles are formed once in double and applied to every head, so the
// sin/cos cost is T·dims/2 per call, not T·heads·dims/2.
#include <cmath>

#include "kernels/decode.h"

namespace mha::kernels {

void rope_inplace(const RopeParams& p) {
  const View4<float>& x = p.x;
  const int64_t B = x.shape[0], H = x.shape[1], T = x.shape[2];
  const int64_t half = p.dims / 2;
  // Pair i of the rotation: features (a(i), b(i)).
  const bool interleaved = p.pairing == RopePairing::Interleaved;
  // Unrotate is rotation by −angle: cos is even, sin odd, so only sin changes sign (exactly).
  const float sin_sign = p.direction == RopeDirection::Unrotate ? -1.0f : 1.0f;
  const int64_t a_step = interleaved ? 2 : 1, b_off = interleaved ? 1 : half;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t pos0 = p.start ? p.start[b] : 0;
    for (int64_t t = 0; t < T; ++t) {
      const double pos = static_cast<double>(pos0 + t);
      for (int64_t i = 0; i < half; ++i) {
        // θ^(−2i/dims), as Hugging Face forms inv_freq, but in double.
        const double inv_freq = std::pow(p.theta, -static_cast<double>(2 * i) / static_cast<double>(p.dims));
        const double angle = pos * inv_freq;
        const float c = static_cast<float>(std::cos(angle)), s = sin_sign * static_cast<float>(std::sin(angle));
        const int64_t ia = i * a_step * x.stride[3], ib = (i * a_step + b_off) * x.stride[3];
        for (int64_t h = 0; h < H; ++h) {
          float* row = x.row(b, h, t);
          const float xa = row[ia], xb = row[ib];
          row[ia] = xa * c - xb * s;
          row[ib] = xb * c + xa * s;
        }
      }
    }
  }
}

}  // namespace mha::kernels
