// kernels/exp-inl.h — the vectorised exps of the softmax kernels, compiled per SIMD target:
// exp_nonpositive (float32-accurate, every softmax) and exp_before_bf16 (for probabilities rounded
// to bf16 next: the bf16 dot-product path).
//
// Include after hwy/highway.h in a file compiled with foreach_target.h (Highway's -inl.h
// convention: the guard flips with HWY_TARGET_TOGGLE, so every target gets its own copy). Kernels
// name them kernels::HWY_NAMESPACE::exp_nonpositive and so on (or bring them in with
// using-declarations).
#if defined(MHA_KERNELS_EXP_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_EXP_INL_H_
#undef MHA_KERNELS_EXP_INL_H_
#else
#define MHA_KERNELS_EXP_INL_H_
#endif

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

/// 1.5·2²³: added to a float t with |t| < 2²², the sum is the nearest integer to t plus this.
constexpr float kRoundMagic = 12582912.0f;

/// log2(e), as the float both exps multiply by.
constexpr float kLog2e = 1.44269504088896341f;

/// 2^f for |f| ≤ ½: the degree-6 Taylor polynomial of e^(f·ln 2), Horner's rule.
template <class DF, class VF = hn::Vec<DF>>
HWY_INLINE VF poly_exp2(DF df, VF f) {
  VF p = hn::Set(df, 1.5403530393381606e-4f);
  p = hn::MulAdd(p, f, hn::Set(df, 1.3333558146428443e-3f));
  p = hn::MulAdd(p, f, hn::Set(df, 9.6181291076284772e-3f));
  p = hn::MulAdd(p, f, hn::Set(df, 5.5504108664821580e-2f));
  p = hn::MulAdd(p, f, hn::Set(df, 0.24022650695910071f));
  p = hn::MulAdd(p, f, hn::Set(df, 0.69314718055994531f));
  return hn::MulAdd(p, f, hn::Set(df, 1.0f));
}

/// exp(x) for the arguments a softmax forms, x = s − max ≤ 0 (or s − lse, which rounding can
/// push a few ulp above 0; anything up to 88 is fine). Exactly 0 below −87 and for −inf (masked
/// scores), so no caller needs a mask of its own. 2^t = 2^n · 2^f with t = x·log2(e), n = round(t),
/// |f| ≤ ½, and 2^f by its degree-6 Taylor polynomial (truncation error (ln 2 / 2)⁷ / 7! ≈ 1.2e-8,
/// under float32's ε). Cheaper than hwy's general Exp, and in the fused forward it runs once per
/// score.
template <class DF, class VF = hn::Vec<DF>>
HWY_INLINE VF exp_nonpositive(DF df, VF x) {
  const hn::RebindToSigned<DF> di;
  const VF t0 = hn::Mul(x, hn::Set(df, kLog2e));
  const auto visible = hn::Ge(x, hn::Set(df, -87.0f));
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if constexpr (hn::MaxLanes(DF()) == 16) {
    // vreduceps gives f = t − round(t) exactly in one instruction (vrndscaleps is two on Intel
    // cores), and t − f is round(t) exactly: the n and f of the general path below. vscalefps then
    // forms p·2ⁿ in one instruction instead of building 2ⁿ's bits (convert, add, shift, multiply):
    // n is an integer, so both round the same exact product once. The same bits. vscalefps takes
    // any n, and every x < −87 (t < −125.5, −inf and NaN too) is zeroed at the end, so t needs
    // no clamp here. (±inf gives f = 0, NaN gives NaN: both zeroed.)
    const VF f{_mm512_reduce_ps(t0.raw, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
    const VF n = hn::Sub(t0, f);
    return hn::IfThenElseZero(visible, VF{_mm512_scalef_ps(poly_exp2(df, f).raw, n.raw)});
  }
  const VF t = hn::Max(t0, hn::Set(df, -126.0f));
  const VF n = hn::Round(t);
#else
  const VF t = hn::Max(t0, hn::Set(df, -126.0f));
  // t + 1.5·2²³ rounds t to an integer (to nearest, ties to even, as Round does: t is within
  // [−126, 128), far inside the 2²² this needs), and that integer sits in the sum's low bits:
  // 2ⁿ's exponent bits come from them below, with no float-to-int conversion (which Highway's
  // ConvertTo follows with an overflow fix-up on AVX2). n, f and 2ⁿ are the same numbers as
  // Round's, so the result keeps its bits.
  const VF n_magic = hn::Add(t, hn::Set(df, kRoundMagic));
  const VF n = hn::Sub(n_magic, hn::Set(df, kRoundMagic));
#endif
  const VF f = hn::Sub(t, n);
  const VF p = poly_exp2(df, f);
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  const auto scale_bits = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));
#else
  // The sum's bits are those of 1.5·2²³ (0x4B400000) plus n: take that away and add the bias.
  const auto scale_bits = hn::ShiftLeft<23>(hn::Add(hn::BitCast(di, n_magic), hn::Set(di, 127 - 0x4B400000)));
#endif
  return hn::IfThenElseZero(visible, hn::Mul(p, hn::BitCast(df, scale_bits)));
}

/// 2^f for 0 ≤ f < 1: a degree-4 polynomial with p(0) = 1 exactly (so 2ⁿ and e⁰ come out exact:
/// a row of equal scores keeps probabilities of exactly 1) and float32 coefficients fitted for the
/// smallest largest relative error over [0, 1), 3.0e-6 (scripts/fit_exp2.py).
template <class DF, class VF = hn::Vec<DF>>
HWY_INLINE VF poly_exp2_unit(DF df, VF f) {
  VF p = hn::Set(df, 0.013426629826426506f);
  p = hn::MulAdd(p, f, hn::Set(df, 0.05224256217479706f));
  p = hn::MulAdd(p, f, hn::Set(df, 0.24128016829490662f));
  p = hn::MulAdd(p, f, hn::Set(df, 0.6930448412895203f));
  return hn::MulAdd(p, f, hn::Set(df, 1.0f));
}

/// exp(x − m) for the probabilities of the bf16 path, which rounds them to bf16 next (8
/// significant bits: a relative change of up to u = 2⁻⁹ ≈ 2e-3). t = (x − m)·log2(e), 2^t =
/// 2^⌊t⌋ · 2^f with f = t − ⌊t⌋ in [0, 1) and 2^f by poly_exp2_unit: within 3.0e-6 of 2^t at the
/// same t (what forming t adds, up to about 1e-5 of exp(x − m) near x − m = −87, exp_nonpositive
/// shares), 650 times under u, and exactly 1 at x = m (the row's max), as exp_nonpositive. Four
/// fewer operations a vector than exp_nonpositive (its degree-6 polynomial on [−½, ½], 2ⁿ formed
/// apart, and the compare that notes a NaN): at T = 4096, d = 64 the bf16 core 3.5% faster on a
/// Zen 4.
/// Exactly 0 for t < −126 (x − m below about −87.3, so no subnormal is ever formed) and for −inf;
/// NaN stays NaN, so a NaN score reaches its row's sum (callers flag NaN rows from the sum).
template <class DF, class VF = hn::Vec<DF>>
HWY_INLINE VF exp_before_bf16(DF df, VF x, VF m) {
  const VF t = hn::Mul(hn::Sub(x, m), hn::Set(df, kLog2e));
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if constexpr (hn::MaxLanes(DF()) == 16) {
    // vreduceps with rounding down gives f = t − ⌊t⌋ (rounded down where it needs more bits than
    // t has below 1: at most an ulp of f, 4e-8 of the result), and vscalefps multiplies by 2^⌊t⌋
    // itself (it floors its exponent operand), exactly for normal results: n is never formed.
    // "Not less than" is true for NaN: NaN passes to the result.
    const __mmask16 kept = _mm512_cmp_ps_mask(t.raw, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    const VF f{_mm512_reduce_ps(t.raw, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)};
    return VF{_mm512_maskz_scalef_ps(kept, poly_exp2_unit(df, f).raw, t.raw)};
  }
#endif
  // Portable operations (never run by a kernel, which takes this exp on AVX3_DL only; tested to the
  // same bound): n = ⌊t⌋ in [−126, 127] wherever the result is kept, f = t − n rounded to
  // nearest, 2ⁿ from its exponent bits (p·2ⁿ is exact, as vscalefps's; t = +inf, which no softmax
  // forms, gives NaN here where vscalefps gives +inf).
  const hn::RebindToSigned<DF> di;
  const auto kept = hn::Not(hn::Lt(t, hn::Set(df, -126.0f)));
  const VF n = hn::Floor(hn::Max(t, hn::Set(df, -126.0f)));
  const VF p = poly_exp2_unit(df, hn::Sub(t, n));
  const auto scale_bits = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));
  return hn::IfThenElseZero(kept, hn::Mul(p, hn::BitCast(df, scale_bits)));
}

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_EXP_INL_H_
