// kernels/entry_checks.h — what each kernel assumes of its params, asserted at its entry in
// debug builds (MHA_DASSERT: nothing in release builds). The public layer has validated and
// broadcast everything (kernels/attention.h); these catch a caller inside the library that
// did not.
#pragma once

#include <array>
#include <cstdint>

#include "kernels/attention.h"
#include "kernels/attention_backward.h"
#include "kernels/common.h"
#include "kernels/decode.h"

namespace mha::kernels {

template <class View>
int64_t numel(const View& v) {
  return v.shape[0] * v.shape[1] * v.shape[2] * v.shape[3];
}

/// Data present unless the view has no elements.
template <class View>
bool has_data(const View& v) {
  return numel(v) == 0 || v.data != nullptr;
}

template <class View>
bool shaped(const View& v, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
  return v.shape == std::array<int64_t, 4>{n0, n1, n2, n3};
}

/// What the forward and backward both read: q, k, v shapes (the bf16 entry passes its data
/// separately), masks at full extents, window and dropout.
inline void assert_sdpa_inputs(const SdpaParams& p) {
  const int64_t B = p.batch(), H = p.heads(), KV = p.kv_heads(), Tq = p.t_q(), Tk = p.t_k();
  MHA_DASSERT(KV > 0 ? H % KV == 0 : H == 0);  // query heads a multiple of K/V heads
  MHA_DASSERT(shaped(p.k, B, KV, Tk, p.d()) && shaped(p.v, B, KV, Tk, p.d_v()));
  const Masks& m = p.masks;  // broadcast to full extents by the public layer
  MHA_DASSERT(!m.allowed.view.defined() || shaped(m.allowed.view, B, H, Tq, Tk));
  MHA_DASSERT(!m.bias.view.defined() || shaped(m.bias.view, B, H, Tq, Tk));
  MHA_DASSERT(!m.key_padding.view.defined() || shaped(m.key_padding.view, B, 1, 1, Tk));
  MHA_DASSERT(!m.key_bias.view.defined() || shaped(m.key_bias.view, B, 1, 1, Tk));
  MHA_DASSERT(m.causal.window >= 0);
  MHA_DASSERT(!p.dropout.active() || (p.dropout.p > 0.0f && p.dropout.p < 1.0f));
}

/// The forward's params: the inputs, and the outputs it writes.
inline void assert_sdpa_params(const SdpaParams& p) {
  const int64_t B = p.batch(), H = p.heads(), Tq = p.t_q(), Tk = p.t_k();
  assert_sdpa_inputs(p);
  MHA_DASSERT(shaped(p.out, B, H, Tq, p.d_v()) && has_data(p.out));
  MHA_DASSERT(!p.lse.defined() || shaped(p.lse, B, H, Tq, 1));
  MHA_DASSERT(!p.weights.defined() || shaped(p.weights, B, H, Tq, Tk));
  MHA_DASSERT(!p.weights_avg.defined() || shaped(p.weights_avg, B, 1, Tq, Tk));
}

/// The fused backward reads and writes whole rows (GEMMs on strided rows).
inline void assert_sdpa_backward_params(const SdpaBackwardParams& p) {
  const SdpaParams& f = p.fwd;  // f.out, f.weights and f.lse are unused
  const int64_t B = f.batch(), H = f.heads(), KV = f.kv_heads(), Tq = f.t_q(), Tk = f.t_k();
  assert_sdpa_inputs(f);
  MHA_DASSERT(has_data(f.q) && has_data(f.k) && has_data(f.v));
  MHA_DASSERT(shaped(p.out, B, H, Tq, f.d_v()) && shaped(p.dout, B, H, Tq, f.d_v()));
  MHA_DASSERT(has_data(p.out) && has_data(p.dout));
  MHA_DASSERT(Tq == 0 || B * H == 0 || (shaped(p.lse, B, H, Tq, 1) && p.lse.defined()));
  MHA_DASSERT(shaped(p.dq, B, H, Tq, f.d()) && shaped(p.dk, B, KV, Tk, f.d()) && shaped(p.dv, B, KV, Tk, f.d_v()));
  MHA_DASSERT(has_data(p.dq) && has_data(p.dk) && has_data(p.dv));
  MHA_DASSERT(rows_are_contiguous(f.q) && rows_are_contiguous(f.k) && rows_are_contiguous(f.v));
  MHA_DASSERT(rows_are_contiguous(p.out) && rows_are_contiguous(p.dout));
  MHA_DASSERT(rows_are_contiguous(p.dq) && rows_are_contiguous(p.dk) && rows_are_contiguous(p.dv));
}

/// Decode reads the cache as contiguous rows of d (K) and d_v (V) per (batch, K/V head, slot).
inline void assert_decode_params(const DecodeParams& p) {
  const int64_t B = p.batch(), H = p.heads(), Tq = p.t_q();
  MHA_DASSERT(p.kv_heads > 0 ? H % p.kv_heads == 0 : H == 0);
  MHA_DASSERT(p.splits >= 1 && p.window >= 0 && p.capacity >= 0);
  MHA_DASSERT(has_data(p.q) && shaped(p.out, B, H, Tq, p.d_v) && has_data(p.out));
  MHA_DASSERT(!p.lse.defined() || shaped(p.lse, B, H, Tq, 1));
  MHA_DASSERT(B * Tq == 0 || (p.key_first && p.key_end && p.q_start));
  MHA_DASSERT(B * p.kv_heads * p.capacity == 0 || (p.k && p.v));
  MHA_DASSERT(p.dtype != DType::I8 || B * p.kv_heads * p.capacity == 0 || (p.k_scale && p.v_scale));
  MHA_DASSERT(p.k_channel_group == 0 || (p.dtype == DType::I8 && !p.ring && !p.block_table));
  MHA_DASSERT(!p.k_transposed || (p.k_channel_group == 0 && p.k_slots % 16 == 0 &&
                                  (p.block_table ? p.k_slots == p.block_size : p.k_slots >= p.capacity)));
}

}  // namespace mha::kernels
