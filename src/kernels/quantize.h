// kernels/quantize.h — rows of float32 to int8 for the KV caches: symmetric, one scale a row.
//
// Shapes: one row of n floats in, n int8 out (out_step apart: 1 for rows, kKeyTile for keys across
// SIMD lanes) and its scale. The scalar definition (int8_scale, int8_value) is the oracle; the
// vector kernel gives its bits on every SIMD target.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace mha::kernels {

/// The int8 scale of a row whose largest magnitude is `absmax` (0 for a row of zeros, or one so
/// small that absmax / 127 underflows: it then reads back as zeros, within absmax).
/// (Near FLT_MAX, 127 · (absmax / 127) can round past it, and a finite value would read back as
/// +inf: there the scale is the float below, and every value reads back finite, within scale / 2.)
inline float int8_scale(float absmax) {
  const float scale = absmax / 127.0f;
  return 127.0f * scale <= std::numeric_limits<float>::max() ? scale : std::nextafter(scale, 0.0f);
}

/// x in steps of `scale`, rounded to nearest (ties to even) and clamped to ±127; 0 when scale is 0.
inline int8_t int8_value(float x, float scale) {
  if (!(scale > 0.0f)) return 0;
  // Round to nearest, ties to even, as std::nearbyint does in the default rounding mode: adding
  // and subtracting 1.5 · 2²³ leaves no fraction bits for |q| < 2²² (clamping first gives the
  // same step). Inline, where std::nearbyint is a libm call on a build without SSE4.1.
  constexpr float kRound = 0x1.8p23f;
  const float q = std::clamp(x / scale, -127.0f, 127.0f);
  return static_cast<int8_t>((q + kRound) - kRound);  // IEEE arithmetic: never folded (no -ffast-math)
}

/// The scalar definition for a whole row: in[x · in_step] for x < n quantised with one scale
/// (returned), out[x · out_step] = int8_value(in[x · in_step], scale). The oracle of the kernels
/// below, and what they and the caches use where no SIMD path applies (strided rows, tails).
inline float quantize_int8_scalar(const float* in, int64_t in_step, int64_t n, int8_t* out, int64_t out_step) {
  float absmax = 0.0f;
  for (int64_t x = 0; x < n; ++x) absmax = std::max(absmax, std::fabs(in[x * in_step]));
  const float scale = int8_scale(absmax);
  for (int64_t x = 0; x < n; ++x) out[x * out_step] = int8_value(in[x * in_step], scale);
  return scale;
}

/// Quantises one row of n finite floats: scale = int8_scale(max |in[x]|) (returned), out[x ·
/// out_step] = int8_value(in[x], scale) for x < n — bitwise what the scalar functions give, a
/// SIMD vector of elements at a time (the division included: no reciprocal). Finite values only
/// (the caches check them first).
float quantize_int8_row(const float* in, int64_t n, int8_t* out, int64_t out_step);

/// Quantises n_rows rows of d finite floats (contiguous) column by column, as per-channel key scales
/// do: scale[x] = int8_scale(max over the rows of |rows[i·d + x]|), out[i·d + x] =
/// int8_value(rows[i·d + x], scale[x]) — bitwise the scalar functions' results.
void quantize_int8_columns(const float* rows, int64_t n_rows, int64_t d, float* scale, int8_t* out);

/// The index of the first of in[0 … n) that is ±inf or NaN (no int8 scale can represent it), or −1.
int64_t first_non_finite(const float* in, int64_t n);

/// For tests: the SIMD targets this kernel was compiled for, and the one dispatch picks now.
std::vector<int64_t> quantize_compiled_targets();
int64_t quantize_dispatch_target();

}  // namespace mha::kernels
