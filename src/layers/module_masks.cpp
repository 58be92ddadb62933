#include "layers/module_masks.h"

#include <array>

#include "kernels/masking.h"

namespace mha::detail {

namespace {

/// Copies a (planes, T_q, T_k) mask into (planes, T_q, S), the extra columns keeping `fill`.
template <class T>
BasicTensor<T> widen(const BasicTensor<T>& m, int64_t planes, int64_t tq, int64_t tk, int64_t s, T fill) {
  BasicTensor<T> out({planes, tq, s}, fill);
  for (int64_t pl = 0; pl < planes; ++pl)
    for (int64_t i = 0; i < tq; ++i)
      for (int64_t j = 0; j < tk; ++j) out.at({pl, i, j}) = m.data()[(pl * tq + i) * tk + j];
  return out;
}

}  // namespace

void widen_module_masks(const MhaForwardOptions& options, int64_t B, int64_t H, int64_t Tq, int64_t Tk, int64_t extra,
                        bool own, ModuleMasks& owned, SdpaOptions& sopt) {
  const int64_t S = Tk + extra;
  sopt.masks.causal = options.causal;
  const AttnMask& am = options.attn_mask;
  const bool mask3 = am.present() && (am.allowed.defined() ? am.allowed.dim() : am.additive.dim()) == 3;
  const int64_t planes = mask3 ? B * H : 1;
  const std::array<int64_t, 4> mshape{mask3 ? B : 1, mask3 ? H : 1, Tq, S};
  const std::array<int64_t, 4> mstride{mask3 ? H * Tq * S : 0, mask3 ? Tq * S : 0, S, 1};
  const bool causal_on_real_keys = extra > 0 && options.causal.enabled();
  if (am.allowed.defined() && !extra && !own) {  // read where the caller keeps it
    sopt.masks.allowed.view = {am.allowed.data(), mshape, mstride};
  } else if (am.allowed.defined() || causal_on_real_keys) {
    const int64_t aplanes = am.allowed.defined() ? planes : 1;
    if (am.allowed.defined())
      owned.allowed = extra ? widen<uint8_t>(am.allowed, aplanes, Tq, Tk, S, 1) : am.allowed;
    else
      owned.allowed = BoolTensor({1, Tq, S}, 1);
    if (causal_on_real_keys) {
      const kernels::CausalRule rule = kernels::CausalRule::of(options.causal, Tq, Tk);
      for (int64_t pl = 0; pl < aplanes; ++pl)
        for (int64_t i = 0; i < Tq; ++i)
          for (int64_t j = 0; j < Tk; ++j)
            if (!rule.sees(i, j)) owned.allowed.at({pl, i, j}) = 0;
      sopt.masks.causal = Causal::none();
    }
    const bool p3 = aplanes > 1;
    sopt.masks.allowed.view = {
        owned.allowed.data(), {p3 ? B : 1, p3 ? H : 1, Tq, S}, {p3 ? H * Tq * S : 0, p3 ? Tq * S : 0, S, 1}};
  }
  if (am.additive.defined() && !extra && !own) {
    sopt.masks.bias.view = {am.additive.data(), mshape, mstride};
  } else if (am.additive.defined()) {
    owned.additive = extra ? widen<float>(am.additive, planes, Tq, Tk, S, 0.0f) : am.additive;
    sopt.masks.bias.view = {owned.additive.data(), mshape, mstride};
  }
  const KeyPaddingMask& kpm = options.key_padding_mask;
  if (kpm.is_padding.defined()) {
    owned.key_padding = widen<uint8_t>(kpm.is_padding, 1, B, Tk, S, 0);
    for (uint8_t& x : owned.key_padding.values()) x = x ? 1 : 0;
    sopt.masks.key_padding.view = {owned.key_padding.data(), {B, 1, 1, S}, {S, 0, 0, 1}};
  } else if (kpm.additive.defined()) {
    owned.key_bias = widen<float>(kpm.additive, 1, B, Tk, S, 0.0f);
    sopt.masks.key_bias.view = {owned.key_bias.data(), {B, 1, 1, S}, {S, 0, 0, 1}};
  }
}

}  // namespace mha::detail
