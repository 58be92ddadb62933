// layers/cache_storage.h — the K and V storage of a KV cache (contiguous KvCache or paged
// PagedKvCache): (n0, n1, n2, d) elements each, float32, bfloat16 or int8 (with one float scale
// per row) by the cache's dtype. Both caches address storage by row — one token of one K/V head —
// and element row · dim + x; these helpers are the only code that knows the element types.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/common.h"
#include "kernels/quantize.h"
#include "mha/error.h"
#include "mha/kv_cache.h"
#include "mha/masks.h"
#include "mha/tensor.h"

namespace mha::detail {

/// A cache configuration's enums, cast from integers by a caller, must name one of their values:
/// CacheDtype 5 was stored and read as float32, KeyLayout 5 as rows and Int8KeyScales 5 as
/// per-token scales, with no error (docs/semantics.md, 'Bad input is an error'; sdpa refuses an
/// out-of-range Backend or Causal::Align the same way).
inline void check_cache_enums(const char* who, CacheDtype dtype, KeyLayout layout,
                              Int8KeyScales int8_keys = Int8KeyScales::PerToken) {
  if (dtype != CacheDtype::F32 && dtype != CacheDtype::BF16 && dtype != CacheDtype::I8)
    fail(who, ": dtype ", static_cast<int>(dtype), " is not a CacheDtype (F32, BF16 or I8)");
  if (layout != KeyLayout::Rows && layout != KeyLayout::Transposed)
    fail(who, ": key_layout ", static_cast<int>(layout), " is not a KeyLayout (Rows or Transposed)");
  if (int8_keys != Int8KeyScales::PerToken && int8_keys != Int8KeyScales::PerChannel)
    fail(who, ": int8_keys ", static_cast<int>(int8_keys), " is not an Int8KeyScales (PerToken or PerChannel)");
}

/// Sizes K to (n0, n1, n2, head_dim) and V to (n0, n1, n2, v_dim) elements of `dtype` (int8: and
/// one scale per row). Sizes come from the caller or a file's metadata: every product is checked,
/// bytes included, and an overflow fails naming `what` (e.g. "KvCache: (batch, kv_heads,
/// capacity, d)") and the shape.
///
/// k_slots > n2 (transposed keys: n2 rounded up to whole tiles): K holds that many slots of
/// elements per (n0, n1), its int8 scales still one per row of n2.
inline void size_cache_storage(const std::string& what, int64_t n0, int64_t n1, int64_t n2, int64_t head_dim,
                               int64_t v_dim, CacheDtype dtype, CachePlane& k, CachePlane& v, int64_t k_slots = 0) {
  const auto size = [&](CachePlane& plane, int64_t dim, int64_t slots) {
    const std::string where = what + " = " + shape_str({n0, n1, slots, dim});
    const int64_t rows = checked_mul(checked_mul(n0, n1, where), n2, where);
    const int64_t n = checked_mul(checked_mul(checked_mul(n0, n1, where), slots, where), dim, where);
    (void)checked_mul(n, 4, where);
    if (dtype == CacheDtype::BF16) {
      plane.b16.resize(static_cast<size_t>(n));
    } else if (dtype == CacheDtype::I8) {
      plane.i8.resize(static_cast<size_t>(n));
      plane.scale.resize(static_cast<size_t>(rows));
    } else {
      plane.f32.resize(static_cast<size_t>(n));
    }
  };
  size(k, head_dim, std::max(n2, k_slots));
  size(v, v_dim, n2);
}

/// No negative extent in `view` (a negative T slipped past the shape checks, which compare with
/// the view's own T: a cache's length went negative and its next append wrote before its storage).
template <class T>
inline void check_extents(const char* fn, const char* name, const View4<T>& view) {
  for (const int64_t n : view.shape)
    if (n < 0) fail(fn, ": ", name, " has a negative extent: ", shape_str(view));
}

/// A decode window: 0 (unlimited) up to Causal::kMaxPosition, as sdpa takes it.
inline void check_window(const char* fn, int64_t window) {
  if (window < 0 || window > Causal::kMaxPosition)
    fail(fn, ": window must be in [0, 2^40] (0 = unlimited), got ", window);
}

/// A query row's first position q_start (its T_q rows at q_start … q_start + T_q − 1) within
/// [0, Causal::kMaxPosition − T_q], as sdpa bounds its causal offset: the decode kernel forms
/// q_start + T_q and position − window, which near INT64_MAX overflowed and hid every key.
inline void check_q_start(const char* fn, int64_t b, int64_t start, int64_t tq) {
  const int64_t most = Causal::kMaxPosition - tq;
  if (start < 0 || start > most)
    fail(fn, ": q_start[", b, "] = ", start, " is outside [0, 2^40 − T_q] = [0, ", most, "]");
}

/// The element type the decode kernel reads.
inline kernels::DType kernel_dtype(CacheDtype dtype) {
  if (dtype == CacheDtype::BF16) return kernels::DType::BF16;
  if (dtype == CacheDtype::I8) return kernels::DType::I8;
  return kernels::DType::F32;
}

inline size_t plane_bytes(const CachePlane& p) {
  return (p.f32.size() + p.scale.size() + p.recent.size()) * sizeof(float) + p.b16.size() * sizeof(bf16) + p.i8.size();
}

inline const void* plane_data(const CachePlane& p, CacheDtype dtype) {
  if (dtype == CacheDtype::BF16) return p.b16.data();
  if (dtype == CacheDtype::I8) return p.i8.data();
  return p.f32.data();
}

inline const float* plane_scales(const CachePlane& p, CacheDtype dtype) {
  return dtype == CacheDtype::I8 ? p.scale.data() : nullptr;
}

/// Where element x of a row lies: `at` + x · `step` (rows: at = row · dim, step 1). Transposed
/// keys (KeyLayout::Transposed) put slot s of a head in lane s mod kKeyTile of its tile.
struct ElementPlace {
  int64_t at = 0, step = 1;
};
inline ElementPlace row_place(int64_t row, int64_t dim) { return {row * dim, 1}; }
/// Slot `slot` of plane head `head` (b · kv_heads + g, or a paged block's block · kv_heads + g):
/// in rows, row head · rows + slot; transposed (KeyLayout::Transposed, K only), lane slot mod
/// kKeyTile of its tile among `slots` slots a head (rows rounded up to whole tiles).
inline ElementPlace slot_place(bool transposed, int64_t head, int64_t rows, int64_t slots, int64_t dim, int64_t slot) {
  if (!transposed) return row_place(head * rows + slot, dim);
  return {(head * slots + slot / kKeyTile * kKeyTile) * dim + slot % kKeyTile, kKeyTile};
}

/// Element x of the row with scale index `row` whose elements lie at `place`, as float (int8:
/// value · scale).
inline float plane_at(const CachePlane& p, CacheDtype dtype, int64_t row, ElementPlace place, int64_t x) {
  const size_t i = static_cast<size_t>(place.at + x * place.step);
  if (dtype == CacheDtype::BF16) return to_float(p.b16[i]);
  if (dtype == CacheDtype::I8) return static_cast<float>(p.i8[i]) * p.scale[static_cast<size_t>(row)];
  return p.f32[i];
}
/// Element x of row `row` (dim elements a row), as float (int8: value · scale).
inline float plane_at(const CachePlane& p, CacheDtype dtype, int64_t row, int64_t dim, int64_t x) {
  return plane_at(p, dtype, row, row_place(row, dim), x);
}

using kernels::int8_scale;
using kernels::int8_value;

/// Writes the row with scale index `row`, its elements at `place`, from in[x · stride], x < dim,
/// converting to the plane's dtype (int8: symmetric, scale = max|x| / 127, round to nearest).
/// Values must be finite for int8 (check_int8_finite).
inline void plane_put_row(CachePlane& p, CacheDtype dtype, int64_t row, ElementPlace place, int64_t dim,
                          const float* in, int64_t stride) {
  const auto at = [&](int64_t x) { return static_cast<size_t>(place.at + x * place.step); };
  if (dtype == CacheDtype::BF16) {
    for (int64_t x = 0; x < dim; ++x) p.b16[at(x)] = to_bf16(in[x * stride]);
  } else if (dtype == CacheDtype::I8) {
    // A contiguous row (every append from a contiguous tensor) takes the SIMD kernel.
    int8_t* const out = p.i8.data() + place.at;
    p.scale[static_cast<size_t>(row)] = stride == 1 ? kernels::quantize_int8_row(in, dim, out, place.step)
                                                    : kernels::quantize_int8_scalar(in, stride, dim, out, place.step);
  } else {
    for (int64_t x = 0; x < dim; ++x) p.f32[at(x)] = in[x * stride];
  }
}
/// Writes row `row` (dim elements a row) from in[x · stride].
inline void plane_put_row(CachePlane& p, CacheDtype dtype, int64_t row, int64_t dim, const float* in, int64_t stride) {
  plane_put_row(p, dtype, row, row_place(row, dim), dim, in, stride);
}

/// Copies rows [from, from + n) to [to, to + n) (dim elements a row; int8: with their scales).
inline void plane_copy_rows(CachePlane& p, int64_t from, int64_t to, int64_t n, int64_t dim) {
  const auto copy = [&](auto& v, int64_t width) {
    if (v.empty()) return;
    std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(from * width), static_cast<size_t>(n * width),
                v.begin() + static_cast<std::ptrdiff_t>(to * width));
  };
  copy(p.f32, dim);
  copy(p.b16, dim);
  copy(p.i8, dim);
  copy(p.scale, 1);
}

/// For an int8 cache: fails, naming `who`, `name` and the position, when rows t < count of batch
/// row b of src hold a non-finite value (no scale could represent it). Call before changing anything.
inline void check_int8_finite(CacheDtype dtype, const char* who, const char* name, View4<const float> src, int64_t b,
                              int64_t count) {
  if (dtype != CacheDtype::I8) return;
  for (int64_t g = 0; g < src.shape[1]; ++g)
    for (int64_t t = 0; t < count; ++t) {
      const float* in = src.row(b, g, t);
      const int64_t n = src.shape[3], stride = src.stride[3];
      if (stride == 1 && kernels::first_non_finite(in, n) < 0) continue;  // a SIMD vector at a time
      for (int64_t x = 0; x < n; ++x)
        if (!std::isfinite(in[x * stride]))
          fail(who, ": an int8 cache takes finite values only, but ", name, " ", shape_str(src), " holds ",
               in[x * stride], " at (", b, ", ", g, ", ", t, ", ", x, ")");
    }
}

}  // namespace mha::detail
