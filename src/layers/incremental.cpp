// layers/incremental.cpp — MultiheadAttention::forward_incremental: attention with a KV cache.
//
// For T_new new tokens of sequence b, whose cache holds positions [first_b, L_b):
//   Q, K, V = projections of the new tokens;  RoPE at positions L_b + t
//   new part:    sdpa(Q, K_new, V_new), causal top-left among the new tokens (+ window)  → o₁, lse₁
//   cached part: attend_cache(Q, cache) at positions L_b + t (+ window), flash-decoding   → o₂, lse₂
//   heads = (e^{lse₁−M} o₁ + e^{lse₂−M} o₂) / (e^{lse₁−M} + e^{lse₂−M}),  M = max(lse₁, lse₂)
//   append K_new, V_new to the cache;  output = heads · W_Oᵀ + b_O
// The two parts split the visible keys exactly, so the merge is exact softmax over all of them.
// Attending before appending means a ring of W positions serves a window of W for any chunk
// length, and a prefill into an empty cache is the full forward's own sdpa call (same kernel,
// same time) plus the copy into the cache.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/gemm.h"
#include "mha/module.h"

namespace mha {

namespace {

constexpr const char* kInc = "MultiheadAttention.forward_incremental";

/// Where row (b, t) of a (…, features) input sits: row index b·per_batch + t·per_step.
struct TokenRows {
  int64_t batch = 1, steps = 0, per_batch = 0, per_step = 0;

  TokenRows(const Tensor& x, Layout layout) {
    if (x.dim() == 2) {
      steps = x.size(0), per_step = 1;
    } else if (layout == Layout::BatchFirst) {
      batch = x.size(0), steps = x.size(1), per_batch = x.size(1), per_step = 1;
    } else {
      batch = x.size(1), steps = x.size(0), per_batch = 1, per_step = x.size(1);
    }
  }
  /// (batch, heads, steps, d) over `heads` blocks of d columns of a (rows, ld) buffer.
  View4<float> heads(float* buffer, int64_t ld, int64_t n_heads, int64_t d) const {
    return {buffer, {batch, n_heads, steps, d}, {per_batch * ld, d, per_step * ld, 1}};
  }
};

}  // namespace

MhaOutput MultiheadAttention::forward_incremental(const Tensor& query_new, const Tensor& key_new,
                                                  const Tensor& value_new, KvCache& cache,
                                                  const IncrementalOptions& options) const {
  check_params();
  const MhaConfig& c = config_;
  const int64_t E = c.embed_dim, d = c.head_dim(), H = c.num_heads, KV = c.kv_heads();
  if (c.add_bias_kv || c.add_zero_attn)
    fail(kInc, ": add_bias_kv / add_zero_attn positions have no place in a KV cache; not supported");
  if (query_new.dim() != 2 && query_new.dim() != 3)
    fail(kInc, ": query_new must be 3-D (batched) or 2-D (T, E), got ", shape_str(query_new.shape()));
  if (key_new.dim() != query_new.dim() || value_new.dim() != query_new.dim())
    fail(kInc, ": query_new ", shape_str(query_new.shape()), ", key_new ", shape_str(key_new.shape()),
         " and value_new ", shape_str(value_new.shape()), " must have the same rank");
  const TokenRows qr(query_new, c.layout), kr(key_new, c.layout), vr(value_new, c.layout);
  if (query_new.size(-1) != E || key_new.size(-1) != c.key_dim() || value_new.size(-1) != c.value_dim())
    fail(kInc, ": features of query_new ", shape_str(query_new.shape()), ", key_new ", shape_str(key_new.shape()),
         ", value_new ", shape_str(value_new.shape()), " must be E = ", E, ", kdim = ", c.key_dim(),
         ", vdim = ", c.value_dim());
  if (kr.batch != qr.batch || vr.batch != qr.batch || kr.steps != qr.steps || vr.steps != qr.steps)
    fail(kInc, ": query_new ", shape_str(query_new.shape()), ", key_new ", shape_str(key_new.shape()),
         " and value_new ", shape_str(value_new.shape()), " must hold the same batch and number of new tokens");
  const int64_t B = qr.batch, T = qr.steps, N = B * T;
  const KvCacheConfig& cc = cache.config();
  if (cc.batch != B || cc.kv_heads != KV || cc.head_dim != d || cc.v_dim() != d)
    fail(kInc, ": the cache is (batch ", cc.batch, ", kv_heads ", cc.kv_heads, ", d ", cc.head_dim, ", d_v ",
         cc.v_dim(), "), expected (", B, ", ", KV, ", ", d, ", ", d, ") for this module and input");
  if (options.window < 0) fail(kInc, ": window must be ≥ 0 (0 = unlimited), got ", options.window);
  if (cache.ring() && (options.window == 0 || options.window > cache.capacity()))
    fail(kInc, ": a ring cache of ", cache.capacity(), " positions serves a sliding window of at most ",
         cache.capacity(), ", got window ", options.window, " (0 = unlimited)");
  const std::vector<int64_t>& lens = options.new_lengths;
  if (!lens.empty() && static_cast<int64_t>(lens.size()) != B)
    fail(kInc, ": new_lengths has ", lens.size(), " entries, expected one per sequence (", B, ")");
  std::vector<int64_t> start(static_cast<size_t>(B));
  bool padded = false, any_cached = false;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens.empty() ? T : lens[static_cast<size_t>(b)];
    if (n < 0 || n > T) fail(kInc, ": new_lengths[", b, "] = ", n, " is outside [0, ", T, "]");
    if (n > cache.remaining(b))
      fail(kInc, ": sequence ", b, " holds ", cache.length(b), " of ", cache.capacity(), " positions; ", n,
           " new tokens would exceed the cache's capacity");
    padded = padded || n < T;
    any_cached = any_cached || cache.stored(b) > 0;
    start[static_cast<size_t>(b)] = cache.length(b);
  }

  // ---- projections of the new tokens: Q (N, h·d), K and V (N, kv·d), rows in the input's layout ----
  const bool packed = c.packed_in_proj();
  const float* in_bias = c.bias ? params_.in_proj_bias.data() : nullptr;
  std::vector<float> proj(static_cast<size_t>(N * (H + 2 * KV) * d));
  float* q_out = proj.data();
  float* k_out = q_out + N * H * d;
  float* v_out = k_out + N * KV * d;
  const float* w_in = params_.in_proj_weight.data();
  kernels::linear(query_new.data(), N, E, E, packed ? w_in : params_.q_proj_weight.data(), H * d, E, in_bias, q_out,
                  H * d);
  kernels::linear(key_new.data(), N, c.key_dim(), c.key_dim(), packed ? w_in + H * d * E : params_.k_proj_weight.data(),
                  KV * d, c.key_dim(), in_bias ? in_bias + H * d : nullptr, k_out, KV * d);
  kernels::linear(value_new.data(), N, c.value_dim(), c.value_dim(),
                  packed ? w_in + (H + KV) * d * E : params_.v_proj_weight.data(), KV * d, c.value_dim(),
                  in_bias ? in_bias + (H + KV) * d : nullptr, v_out, KV * d);
  const View4<float> Q = qr.heads(q_out, H * d, H, d), K = qr.heads(k_out, KV * d, KV, d),
                     V = qr.heads(v_out, KV * d, KV, d);
  if (c.rope.enabled) {
    apply_rope(Q, c.rope, start.data());
    apply_rope(K, c.rope, start.data());
  }

  // ---- the new tokens among themselves ----
  std::vector<float> heads(static_cast<size_t>(N * H * d), 0.0f);
  const View4<float> out = qr.heads(heads.data(), H * d, H, d);
  SdpaOptions sopt;
  sopt.masks.causal = Causal::top_left().with_window(options.window);
  sopt.backend = options.backend;
  sopt.threads = options.threads;
  BoolTensor padding;
  if (padded) {  // padded new tokens are never read (docs/semantics.md, 'Padded keys are never read')
    padding = BoolTensor({B, T}, 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = lens[static_cast<size_t>(b)]; t < T; ++t) padding.at({b, t}) = 1;
    sopt.masks.key_padding.view = {padding.data(), {B, 1, 1, T}, {T, 0, 0, 1}};
  }
  Tensor lse_new, out_cached, lse_cached;
  SdpaOutputs souts;
  souts.out = out;
  if (any_cached) {
    lse_new = Tensor({B, H, T});
    souts.lse = contiguous_view(lse_new.data(), B, H, T, 1);
  }
  sdpa(View4<const float>(Q), View4<const float>(K), View4<const float>(V), sopt, souts);

  // ---- the cached positions, merged by log-sum-exp ----
  if (any_cached) {
    out_cached = Tensor({B, H, T, d});
    lse_cached = Tensor({B, H, T});
    CacheAttentionOptions copt;
    copt.window = options.window;
    copt.splits = options.splits;
    copt.threads = options.threads;
    attend_cache(View4<const float>(Q), cache, start, copt, out_cached.view4(),
                 contiguous_view(lse_cached.data(), B, H, T, 1));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const float l1 = lse_new.at({b, h, t}), l2 = lse_cached.at({b, h, t});
          const float M = std::max(l1, l2);
          float* o = out.row(b, h, t);
          if (M == -std::numeric_limits<float>::infinity()) {
            std::fill(o, o + d, 0.0f);
            continue;
          }
          const float w1 = std::exp(l1 - M), w2 = std::exp(l2 - M), inv = 1.0f / (w1 + w2);
          const float* o2 = out_cached.view4().row(b, h, t);
          for (int64_t x = 0; x < d; ++x) o[x] = (w1 * o[x] + w2 * o2[x]) * inv;
        }
  }
  if (padded)  // rows past a sequence's new tokens attend to nothing
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = lens[static_cast<size_t>(b)]; t < T; ++t)
          std::fill(out.row(b, h, t), out.row(b, h, t) + d, 0.0f);

  cache.append(View4<const float>(K), View4<const float>(V), lens);

  MhaOutput result;
  result.output = Tensor(query_new.shape());
  kernels::linear(heads.data(), N, H * d, H * d, params_.out_proj_weight.data(), E, H * d,
                  c.bias ? params_.out_proj_bias.data() : nullptr, result.output.data(), E);
  return result;
}

}  // namespace mha
