// layers/rope.cpp — the public rotary-embedding entry: validate once, then the kernel.
#include "mha/rope.h"

#include <cmath>

#include "kernels/decode.h"
#include "mha/masks.h"

namespace mha {

void Rope::validate(int64_t head_dim) const {
  if (!(theta > 0.0) || !std::isfinite(theta)) fail("Rope: theta must be finite and > 0, got ", theta);
  if (pairing != RopePairing::HalfSplit && pairing != RopePairing::Interleaved)
    fail("Rope: pairing ", static_cast<int>(pairing), " is not a RopePairing (HalfSplit or Interleaved)");
  const int64_t r = rotary_dims(head_dim);
  if (dims == 0 && head_dim % 2 != 0)
    fail("Rope: dims = 0 rotates the whole head, but the head dim ", head_dim,
         " is odd (dimensions rotate in pairs): give an even dims below it");
  if (dims < 0 || r % 2 != 0 || r > head_dim)
    fail("Rope: rotary dims must be even and ≤ the head dim ", head_dim, " (0 = all), got ", dims);
}

void apply_rope(View4<float> x, const Rope& rope, const int64_t* start, RopeDirection direction) {
  rope.validate(x.shape[3]);
  if (direction != RopeDirection::Rotate && direction != RopeDirection::Unrotate)
    fail("apply_rope: direction ", static_cast<int>(direction), " is not a RopeDirection (Rotate or Unrotate)");
  if (x.shape[0] * x.shape[1] * x.shape[2] * x.shape[3] == 0) return;
  if (!x.defined()) fail("apply_rope: x ", shape_str(x.shape_vec()), " has no data");
  // Positions stay within [0, 2^40], as everywhere else (Causal::kMaxPosition): start + t then
  // cannot overflow, and the angles keep their meaning.
  if (start)
    for (int64_t b = 0; b < x.shape[0]; ++b)
      if (start[b] < 0 || start[b] > Causal::kMaxPosition - x.shape[2])
        fail("apply_rope: start[", b, "] = ", start[b], " is outside [0, 2^40 − T] = [0, ",
             Causal::kMaxPosition - x.shape[2], "]");
  kernels::RopeParams p;
  p.x = x;
  p.start = start;
  p.theta = rope.theta;
  p.dims = rope.rotary_dims(x.shape[3]);
  p.pairing = rope.pairing;
  p.direction = direction;
  kernels::rope_inplace(p);
}

}  // namespace mha
