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

#include "layers/module_core.h"
#include "mha/module.h"

namespace mha {

namespace {

constexpr const char* kInc = "MultiheadAttention.forward_incremental";

}  // namespace

MhaOutput MultiheadAttention::forward_incremental(const Tensor& query_new, const Tensor& key_new,
                                                  const Tensor& value_new, KvCache& cache,
                                                  const IncrementalOptions& options) const {
  check_params();
  const MhaConfig& c = config_;
  const int64_t d = c.head_dim(), H = c.num_heads, KV = c.kv_heads();
  if (c.add_bias_kv || c.add_zero_attn)
    fail(kInc, ": add_bias_kv / add_zero_attn positions have no place in a KV cache; not supported");
  const detail::ModuleCall call =
      detail::check_inputs(kInc, c, query_new, key_new, value_new, detail::KvTokens::SameAsQuery);
  const int64_t B = call.batch(), T = call.t_q();
  const KvCacheConfig& cc = cache.config();
  if (cc.batch != B || cc.kv_heads != KV || cc.head_dim != d || cc.v_dim() != d)
    fail(kInc, ": the cache is (batch ", cc.batch, ", kv_heads ", cc.kv_heads, ", d ", cc.head_dim, ", d_v ",
         cc.v_dim(), "), expected (", B, ", ", KV, ", ", d, ", ", d, ") for this module and input");
  if (options.window < 0) fail(kInc, ": window must be ≥ 0 (0 = unlimited), got ", options.window);
  const int64_t sinks = cc.sinks, recent = cache.capacity() - sinks;
  if (cache.ring() && (options.window == 0 || options.window > recent))
    fail(kInc, ": a ring cache of ", cache.capacity(), " positions (", sinks,
         " of them sinks) serves a sliding window of at most ", recent, ", got window ", options.window,
         " (0 = unlimited)");
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

  // ---- projections of the new tokens, rows in the input's layout ----
  detail::Projections proj =
      detail::project_inputs(c, params_, query_new, key_new, value_new, call, scratch_.pool.get());
  const View4<float> Q = proj.q, K = proj.k, V = proj.v;
  if (c.rope.enabled) {
    apply_rope(Q, c.rope, start.data());
    apply_rope(K, c.rope, start.data());
  }

  // ---- the new tokens among themselves ----
  std::vector<float> heads(static_cast<size_t>(call.q_rows.rows() * H * d), 0.0f);
  const View4<float> out = call.q_rows.heads(heads.data(), H * d, 0, H, d);
  SdpaOptions sopt;
  sopt.masks.causal = Causal::top_left().with_window(options.window);
  // Scale, ALiBi (relative distance: top-left among the new tokens, absolute positions over the
  // cache) and softcap on both parts; the sinks join the new part only, so that the merge below
  // counts each sink once.
  detail::set_score_options(c, params_, sopt);
  sopt.backend = options.backend;
  sopt.threads = options.threads;
  BoolTensor padding, sink_allowed;
  bool sink_mask = false;  // a new token that is an attention sink and lies outside a later one's window
  for (int64_t b = 0; b < B; ++b)
    sink_mask = sink_mask || (sinks > 0 && start[static_cast<size_t>(b)] < sinks && T > 1);
  if (sink_mask) {
    // Sinks among the new tokens stay visible past the window: (B, 1, T, T), the causal and
    // window rule with that exception (KvCache, 'attention sinks').
    sink_allowed = BoolTensor({B, 1, T, T}, 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t u = 0; u <= t; ++u)
          sink_allowed.at({b, 0, t, u}) = start[static_cast<size_t>(b)] + u < sinks || u > t - options.window;
    sopt.masks.allowed.view = sink_allowed.view4();
    sopt.masks.causal = Causal::top_left();
  }
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
    copt.scale = c.scale;
    copt.alibi = sopt.alibi;
    copt.softcap = c.softcap;
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
  result.output = detail::project_output(c, params_, heads.data(), query_new.shape(), call.q_rows.rows());
  return result;
}

}  // namespace mha
