// layers/incremental.cpp — MultiheadAttention::forward_incremental: attention with a KV cache.
//
// For T_new new tokens of sequence b, whose cache holds positions [first_b, L_b):
//   Q, K, V = projections of the new tokens;  RoPE at positions L_b + t
//   new part:    sdpa(Q, K_new, V_new), causal top-left among the new tokens (+ window)  → o₁, lse₁
//   cached part: attend_cache(Q, cache) at positions L_b + t (+ window), flash-decoding   → o₂, lse₂
//   (a sink ring whose sinks are among the new tokens: those keys leave the new part, padded out,
//   for a part of their own, causal without the window, merged the same way)
//   heads = (e^{lse₁−M} o₁ + e^{lse₂−M} o₂) / (e^{lse₁−M} + e^{lse₂−M}),  M = max(lse₁, lse₂)
//   append K_new, V_new to the cache;  output = heads · W_Oᵀ + b_O
// The two parts split the visible keys exactly, so the merge is exact softmax over all of them.
// Attending before appending means a ring of W positions serves a window of W for any chunk
// length, and a prefill into an empty cache is the full forward's own sdpa call (same kernel,
// same time) plus the copy into the cache. The cache is a contiguous KvCache or sequences of a
// PagedKvCache: one pipeline, the cache reached through CacheAccess.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <span>

#include "layers/cache_storage.h"
#include "layers/module_core.h"
#include "mha/module.h"
#include "mha/paged_kv_cache.h"

namespace mha {

namespace {

constexpr const char* kInc = "MultiheadAttention.forward_incremental";
// What the cache receives, named for the caller: (B, kv_heads, T_new, d) rows projected from
// key_new / value_new (with RoPE applied to the keys), a row per new token.
constexpr const char* kKeyRows = "the projection of key_new (batch, kv head, token, channel)";
constexpr const char* kValueRows = "the projection of value_new (batch, kv head, token, channel)";

/// What the pipeline below needs from a cache: the two overloads of forward_incremental differ
/// only here (a contiguous KvCache indexed by batch row, or sequences of a PagedKvCache).
class CacheAccess {
 public:
  virtual ~CacheAccess() = default;
  /// Throws unless the cache fits this module and a batch of B sequences (and `window`).
  virtual void check(const MhaConfig& c, int64_t B, int64_t window) const = 0;
  /// Throws, changing nothing, unless every sequence b can take counts[b] more positions at once
  /// (a paged pool is shared by all of them).
  virtual void check_room(std::span<const int64_t> counts) const = 0;
  virtual int64_t length(int64_t b) const = 0;
  virtual int64_t stored(int64_t b) const = 0;
  virtual int64_t sinks() const { return 0; }
  virtual void attend(View4<const float> q, std::span<const int64_t> start, const CacheAttentionOptions& o,
                      View4<float> out, View4<float> lse) const = 0;
  /// Appends the first counts[b] rows of k (B, kv, T, d) / v to sequence b.
  virtual void append(View4<const float> k, View4<const float> v, std::span<const int64_t> counts) = 0;
};

void check_cache_dims(const MhaConfig& c, int64_t kv_heads, int64_t head_dim, int64_t v_dim, const char* what) {
  if (kv_heads != c.kv_heads() || head_dim != c.head_dim() || v_dim != c.head_dim())
    fail(kInc, ": the ", what, " is (kv_heads ", kv_heads, ", d ", head_dim, ", d_v ", v_dim, "), expected (",
         c.kv_heads(), ", ", c.head_dim(), ", ", c.head_dim(), ") for this module");
}

class ContiguousAccess final : public CacheAccess {
 public:
  explicit ContiguousAccess(KvCache& cache) : cache_(cache) {}
  void check(const MhaConfig& c, int64_t B, int64_t window) const override {
    const KvCacheConfig& cc = cache_.config();
    if (cc.batch != B) fail(kInc, ": the cache holds ", cc.batch, " sequences, the input ", B);
    check_cache_dims(c, cc.kv_heads, cc.head_dim, cc.v_dim(), "cache");
    const int64_t recent = cache_.capacity() - cc.sinks;
    if (cache_.ring() && (window == 0 || window > recent))
      fail(kInc, ": a ring cache of ", cache_.capacity(), " positions (", cc.sinks,
           " of them sinks) serves a sliding window of at most ", recent, ", got window ", window, " (0 = unlimited)");
  }
  void check_room(std::span<const int64_t> counts) const override {
    for (size_t b = 0; b < counts.size(); ++b) {
      const auto i = static_cast<int64_t>(b);
      if (counts[b] > cache_.remaining(i))
        fail(kInc, ": sequence ", b, " holds ", cache_.length(i), " of ", cache_.capacity(), " positions; ", counts[b],
             " new tokens would exceed the cache's capacity");
    }
  }
  int64_t length(int64_t b) const override { return cache_.length(b); }
  int64_t stored(int64_t b) const override { return cache_.stored(b); }
  int64_t sinks() const override { return cache_.config().sinks; }
  void attend(View4<const float> q, std::span<const int64_t> start, const CacheAttentionOptions& o, View4<float> out,
              View4<float> lse) const override {
    attend_cache(q, cache_, start, o, out, lse);
  }
  void append(View4<const float> k, View4<const float> v, std::span<const int64_t> counts) override {
    // An int8 cache refuses non-finite values; checked here, so that the error names what the
    // caller passed (KvCache::append would name its own argument).
    for (size_t b = 0; b < counts.size(); ++b) {
      const int64_t n = counts[b], i = static_cast<int64_t>(b);
      detail::check_int8_finite(cache_.config().dtype, kInc, kKeyRows, k, i, n);
      detail::check_int8_finite(cache_.config().dtype, kInc, kValueRows, v, i, n);
    }
    cache_.append(k, v, counts);
  }

 private:
  KvCache& cache_;
};

class PagedAccess final : public CacheAccess {
 public:
  PagedAccess(PagedKvCache& cache, std::span<const int64_t> seqs) : cache_(cache), seqs_(seqs) {}
  void check(const MhaConfig& c, int64_t B, int64_t /*window*/) const override {
    if (static_cast<int64_t>(seqs_.size()) != B)
      fail(kInc, ": ", seqs_.size(), " sequence ids for a batch of ", B, " sequences");
    const PagedKvCacheConfig& pc = cache_.config();
    check_cache_dims(c, pc.kv_heads, pc.head_dim, pc.v_dim(), "paged cache");
    for (size_t b = 0; b < seqs_.size(); ++b) {
      if (!cache_.alive(seqs_[b]))
        fail(kInc, ": seqs[", b, "] = ", seqs_[b], " is not a live sequence of the paged cache");
      for (size_t a = 0; a < b; ++a)
        if (seqs_[a] == seqs_[b])
          fail(kInc, ": sequence ", seqs_[b], " appears twice in seqs (entries ", a, " and ", b, ")");
    }
  }
  void check_room(std::span<const int64_t> counts) const override {
    const int64_t bs = cache_.config().block_size;
    int64_t need = 0;
    std::map<int32_t, int64_t> writers;  // shared, partly filled last blocks: rows about to write into each
    for (size_t b = 0; b < counts.size(); ++b) {
      if (counts[b] == 0) continue;
      const std::span<const int32_t> table = cache_.block_table(seqs_[b]);
      const int64_t len = cache_.length(seqs_[b]);
      need += (len + counts[b] + bs - 1) / bs - static_cast<int64_t>(table.size());
      if (len % bs != 0 && cache_.refcount(table.back()) > 1) ++writers[table.back()];
    }
    // Copy-on-write: of k writers into a block r sequences hold, each copies it while it is still
    // shared, so min(k, r − 1) copies (the last holder, when all write, writes in place).
    for (const auto& [block, k] : writers) need += std::min(k, cache_.refcount(block) - 1);
    if (need > cache_.free_blocks())
      fail(kInc, ": the new tokens need ", need, " more blocks of ", bs, " positions, but the pool has ",
           cache_.free_blocks(), " of ", cache_.config().num_blocks, " free");
  }
  int64_t length(int64_t b) const override { return cache_.length(seqs_[static_cast<size_t>(b)]); }
  int64_t stored(int64_t b) const override { return length(b); }
  void attend(View4<const float> q, std::span<const int64_t> start, const CacheAttentionOptions& o, View4<float> out,
              View4<float> lse) const override {
    attend_paged_cache(q, cache_, seqs_, start, o, out, lse);
  }
  void append(View4<const float> k, View4<const float> v, std::span<const int64_t> counts) override {
    // An int8 pool refuses non-finite values: check every sequence's rows before appending any.
    for (size_t b = 0; b < seqs_.size(); ++b) {
      const int64_t n = counts[b], i = static_cast<int64_t>(b);
      detail::check_int8_finite(cache_.config().dtype, kInc, kKeyRows, k, i, n);
      detail::check_int8_finite(cache_.config().dtype, kInc, kValueRows, v, i, n);
    }
    for (size_t b = 0; b < seqs_.size(); ++b) {
      const auto rows = [&](View4<const float> x) {
        return View4<const float>{
            x.data + static_cast<int64_t>(b) * x.stride[0], {1, x.shape[1], counts[b], x.shape[3]}, x.stride};
      };
      cache_.append(seqs_[b], rows(k), rows(v));
    }
  }

 private:
  PagedKvCache& cache_;
  std::span<const int64_t> seqs_;
};

/// The incremental forward over any cache (the file comment's steps).
MhaOutput incremental(const MultiheadAttention& m, const Tensor& query_new, const Tensor& key_new,
                      const Tensor& value_new, CacheAccess& cache, const IncrementalOptions& options) {
  m.check_params();
  const MhaConfig& c = m.config();
  const MhaParameters& params = m.params();
  const int64_t d = c.head_dim(), H = c.num_heads;
  if (c.add_bias_kv || c.add_zero_attn)
    fail(kInc, ": add_bias_kv / add_zero_attn positions have no place in a KV cache; not supported");
  const detail::ModuleCall call =
      detail::check_inputs(kInc, c, query_new, key_new, value_new, detail::KvTokens::SameAsQuery);
  const int64_t B = call.batch(), T = call.t_q();
  if (options.window < 0) fail(kInc, ": window must be ≥ 0 (0 = unlimited), got ", options.window);
  cache.check(c, B, options.window);
  const int64_t sinks = cache.sinks();
  const std::vector<int64_t>& lens = options.new_lengths;
  if (!lens.empty() && static_cast<int64_t>(lens.size()) != B)
    fail(kInc, ": new_lengths has ", lens.size(), " entries, expected one per sequence (", B, ")");
  std::vector<int64_t> start(static_cast<size_t>(B)), counts(static_cast<size_t>(B));
  bool padded = false, any_cached = false;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens.empty() ? T : lens[static_cast<size_t>(b)];
    if (n < 0 || n > T) fail(kInc, ": new_lengths[", b, "] = ", n, " is outside [0, ", T, "]");
    counts[static_cast<size_t>(b)] = n;
    padded = padded || n < T;
    any_cached = any_cached || cache.stored(b) > 0;
    start[static_cast<size_t>(b)] = cache.length(b);
  }
  cache.check_room(counts);

  // ---- projections of the new tokens, rows in the input's layout ----
  detail::Projections proj =
      detail::project_inputs(c, params, query_new, key_new, value_new, call, m.workspace_pool().get(), options.threads);
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
  detail::set_score_options(c, params, sopt);
  sopt.backend = options.backend;
  sopt.threads = options.threads;
  // Sinks among the new tokens (keys u < ns_b = sinks − start_b of sequence b) stay visible past
  // the window (KvCache, 'attention sinks'). The window's part then runs over the other new keys,
  // the sinks padded out, and the sinks' part over keys [0, ns) with the causal rule alone; the two
  // split the visible keys exactly and merge by log-sum-exp below, like the cached part. (A
  // (B, 1, T, T) mask of the combined rule did this before: 1 GiB for a prefill of 32768 tokens.)
  std::vector<int64_t> sink_new(static_cast<size_t>(B), 0);
  int64_t ns = 0;
  for (int64_t b = 0; b < B; ++b) {
    sink_new[static_cast<size_t>(b)] =
        std::clamp<int64_t>(sinks - start[static_cast<size_t>(b)], 0, counts[static_cast<size_t>(b)]);
    ns = std::max(ns, sink_new[static_cast<size_t>(b)]);
  }
  const bool split_sinks = ns > 0 && T > 1;
  // Keys a part never reads, (B, width) rows, 1 = not read: in the window's part the padded new
  // tokens (docs/semantics.md, 'Padded keys are never read') and the sinks; in the sinks' part
  // every key past sequence b's own sinks.
  const auto unread = [&](int64_t width, bool sinks_part) {
    BoolTensor mask({B, width}, 0);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = counts[static_cast<size_t>(b)], ns_b = split_sinks ? sink_new[static_cast<size_t>(b)] : 0;
      for (int64_t u = 0; u < width; ++u) mask.at({b, u}) = sinks_part ? u >= ns_b : u >= n || u < ns_b;
    }
    return mask;
  };
  BoolTensor padding;
  if (padded || split_sinks) {
    padding = unread(T, false);
    sopt.masks.key_padding.view = {padding.data(), {B, 1, 1, T}, {T, 0, 0, 1}};
  }
  Tensor lse_new, out_cached, lse_cached;
  SdpaOutputs souts;
  souts.out = out;
  if (any_cached || split_sinks) {
    lse_new = Tensor({B, H, T});
    souts.lse = contiguous_view(lse_new.data(), B, H, T, 1);
  }
  sdpa(View4<const float>(Q), View4<const float>(K), View4<const float>(V), sopt, souts);

  // out, lse_new ← the log-sum-exp merge of (out, lse_new) with another part's (o2, l2) over the
  // same queries: exact softmax over both parts' keys.
  const auto merge = [&](const Tensor& o2, const Tensor& l2) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t) {
          float& l1 = lse_new.at({b, h, t});
          const float l = l2.at({b, h, t}), M = std::max(l1, l);
          float* o = out.row(b, h, t);
          if (M == -std::numeric_limits<float>::infinity()) {
            std::fill(o, o + d, 0.0f);
            continue;
          }
          const float w1 = std::exp(l1 - M), w2 = std::exp(l - M), inv = 1.0f / (w1 + w2);
          const float* p2 = o2.view4().row(b, h, t);
          for (int64_t x = 0; x < d; ++x) o[x] = (w1 * o[x] + w2 * p2[x]) * inv;
          l1 = M + std::log(w1 + w2);
        }
  };

  // ---- the sinks among the new tokens: keys [0, ns), causal (no window), merged ----
  if (split_sinks) {
    Tensor out_sinks({B, H, T, d}), lse_sinks({B, H, T});
    SdpaOptions sink_opt = sopt;
    sink_opt.masks.causal = Causal::top_left();
    sink_opt.sinks = {};  // the learned sink logits joined the window's part: counted once
    const BoolTensor sink_padding = unread(ns, true);
    sink_opt.masks.key_padding.view = {sink_padding.data(), {B, 1, 1, ns}, {ns, 0, 0, 1}};
    const auto first = [&](View4<float> x) {
      return View4<const float>{x.data, {B, x.shape[1], ns, x.shape[3]}, x.stride};
    };
    SdpaOutputs sink_outs;
    sink_outs.out = out_sinks.view4();
    sink_outs.lse = contiguous_view(lse_sinks.data(), B, H, T, 1);
    sdpa(View4<const float>(Q), first(K), first(V), sink_opt, sink_outs);
    merge(out_sinks, lse_sinks);
  }

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
    cache.attend(View4<const float>(Q), start, copt, out_cached.view4(),
                 contiguous_view(lse_cached.data(), B, H, T, 1));
    merge(out_cached, lse_cached);
  }
  if (padded)  // rows past a sequence's new tokens attend to nothing
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = counts[static_cast<size_t>(b)]; t < T; ++t)
          std::fill(out.row(b, h, t), out.row(b, h, t) + d, 0.0f);

  cache.append(View4<const float>(K), View4<const float>(V), counts);

  MhaOutput result;
  result.output =
      detail::project_output(c, params, heads.data(), query_new.shape(), call.q_rows.rows(), options.threads);
  return result;
}

}  // namespace

MhaOutput MultiheadAttention::forward_incremental(const Tensor& query_new, const Tensor& key_new,
                                                  const Tensor& value_new, KvCache& cache,
                                                  const IncrementalOptions& options) const {
  ContiguousAccess access(cache);
  return incremental(*this, query_new, key_new, value_new, access, options);
}

MhaOutput MultiheadAttention::forward_incremental(const Tensor& query_new, const Tensor& key_new,
                                                  const Tensor& value_new, PagedKvCache& cache,
                                                  std::span<const int64_t> seqs,
                                                  const IncrementalOptions& options) const {
  PagedAccess access(cache, seqs);
  return incremental(*this, query_new, key_new, value_new, access, options);
}

}  // namespace mha
