// kernels/quantize.cpp — float32 rows to int8 (kernels/quantize.h), per SIMD target.
//
// Appending to an int8 cache quantises every K/V row; one element at a time (a division each)
// that was ~2.6 ns an element on a Zen 4, more than a step of attention over the same rows.
#include "kernels/quantize.h"

#include <cmath>

#include "kernels/common.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/quantize.cpp"
// The fused kernels' targets (kernels/fused_forward.cpp), so that tests force the same ones.
#define HWY_DISABLED_TARGETS HWY_SSSE3
#define HWY_WANT_AVX3_DL
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::quantize::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The vector paths divide with hn::Div, which must be the IEEE division the scalar definition
// uses; on 32-bit Arm Highway 1.0.3 divides by a refined reciprocal instead, so there the rows
// take the scalar definition element by element.
constexpr bool kExactDivision = !HWY_ARCH_ARM_V7;

float quantize_int8_row(const float* in, int64_t n, int8_t* out, int64_t out_step) {
  MHA_DASSERT(n >= 0 && out_step >= 1 && (n == 0 || (in && out)));
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<int8_t, decltype(df)> d8;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  // The largest magnitude: a max is exact in any order (finite values).
  auto vmax = hn::Zero(df);
  int64_t x = 0;
  for (; x + L <= n; x += L) vmax = hn::Max(vmax, hn::Abs(hn::LoadU(df, in + x)));
  float absmax = hn::GetLane(hn::MaxOfLanes(df, vmax));
  for (; x < n; ++x) absmax = std::max(absmax, std::fabs(in[x]));
  const float scale = int8_scale(absmax);
  if (!kExactDivision || !(scale > 0.0f)) {
    for (x = 0; x < n; ++x) out[x * out_step] = int8_value(in[x], scale);
    return scale;
  }
  // int8_value's operations, lane by lane: the quotient (IEEE division, as the scalar one), the
  // clamp to ±127, the round to nearest even by 1.5 · 2²³, and an exact conversion.
  const auto vscale = hn::Set(df, scale), lo = hn::Set(df, -127.0f), hi = hn::Set(df, 127.0f);
  const auto round = hn::Set(df, 0x1.8p23f);
  HWY_ALIGN int8_t lanes[hn::MaxLanes(d8)];
  for (x = 0; x + L <= n; x += L) {
    const auto q = hn::Min(hn::Max(hn::Div(hn::LoadU(df, in + x), vscale), lo), hi);
    const auto v = hn::DemoteTo(d8, hn::ConvertTo(di, hn::Sub(hn::Add(q, round), round)));
    if (out_step == 1) {
      hn::StoreU(v, d8, out + x);
    } else {
      hn::Store(v, d8, lanes);
      for (int64_t i = 0; i < L; ++i) out[(x + i) * out_step] = lanes[i];
    }
  }
  for (; x < n; ++x) out[x * out_step] = int8_value(in[x], scale);
  return scale;
}

void quantize_int8_columns(const float* rows, int64_t n_rows, int64_t d, float* scale, int8_t* out) {
  MHA_DASSERT(n_rows >= 0 && d >= 0 && (d == 0 || (scale && (n_rows == 0 || (rows && out)))));
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<int8_t, decltype(df)> d8;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  const auto zero = hn::Zero(df), lo = hn::Set(df, -127.0f), hi = hn::Set(df, 127.0f);
  const auto round = hn::Set(df, 0x1.8p23f), div127 = hn::Set(df, 127.0f);
  int64_t x = 0;
  for (; kExactDivision && x + L <= d; x += L) {  // L channels at a time: their maxima, scales, then each row's values
    auto vmax = zero;
    for (int64_t i = 0; i < n_rows; ++i) vmax = hn::Max(vmax, hn::Abs(hn::LoadU(df, rows + i * d + x)));
    // int8_scale, lane by lane: the quotient, one ulp less where 127 times it overflows.
    const auto quotient = hn::Div(vmax, div127);
    const auto past_max = hn::Gt(hn::Mul(quotient, div127), hn::Set(df, std::numeric_limits<float>::max()));
    const auto vscale =
        hn::IfThenElse(past_max, hn::BitCast(df, hn::Sub(hn::BitCast(di, quotient), hn::Set(di, 1))), quotient);
    hn::StoreU(vscale, df, scale + x);
    const auto live = hn::Gt(vscale, zero);  // int8_value's 0 where the scale is 0
    for (int64_t i = 0; i < n_rows; ++i) {
      const auto q = hn::Min(hn::Max(hn::Div(hn::LoadU(df, rows + i * d + x), vscale), lo), hi);
      const auto r = hn::IfThenElseZero(live, hn::Sub(hn::Add(q, round), round));
      hn::StoreU(hn::DemoteTo(d8, hn::ConvertTo(di, r)), d8, out + i * d + x);
    }
  }
  for (; x < d; ++x) scale[x] = quantize_int8_scalar(rows + x, d, n_rows, out + x, d);  // a column
}

int64_t first_non_finite(const float* in, int64_t n) {
  MHA_DASSERT(n >= 0 && (n == 0 || in));
  const hn::ScalableTag<float> df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  int64_t x = 0;
  for (; x + L <= n; x += L)
    if (!hn::AllTrue(df, hn::IsFinite(hn::LoadU(df, in + x)))) break;
  for (; x < n; ++x)
    if (!std::isfinite(in[x])) return x;
  return -1;
}

int64_t dispatch_target() { return HWY_TARGET; }

}  // namespace mha::kernels::quantize::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::kernels {
namespace quantize {
HWY_EXPORT(quantize_int8_row);
HWY_EXPORT(quantize_int8_columns);
HWY_EXPORT(first_non_finite);
HWY_EXPORT(dispatch_target);
}  // namespace quantize

float quantize_int8_row(const float* in, int64_t n, int8_t* out, int64_t out_step) {
  return HWY_DYNAMIC_DISPATCH(quantize::quantize_int8_row)(in, n, out, out_step);
}
void quantize_int8_columns(const float* rows, int64_t n_rows, int64_t d, float* scale, int8_t* out) {
  HWY_DYNAMIC_DISPATCH(quantize::quantize_int8_columns)(rows, n_rows, d, scale, out);
}
int64_t first_non_finite(const float* in, int64_t n) { return HWY_DYNAMIC_DISPATCH(quantize::first_non_finite)(in, n); }
std::vector<int64_t> quantize_compiled_targets() { return target_bits(HWY_TARGETS); }
int64_t quantize_dispatch_target() { return HWY_DYNAMIC_DISPATCH(quantize::dispatch_target)(); }
}  // namespace mha::kernels
#endif  // HWY_ONCE
