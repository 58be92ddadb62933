// layers/kv_cache.cpp — the KV cache (storage, append, reset, clone) and attention over it.
#include "mha/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "kernels/decode.h"
#include "kernels/quantize.h"
#include "layers/cache_storage.h"
#include "layers/sdpa_prepare.h"
#include "layers/view_overlap.h"
#include "mha/threads.h"

namespace mha {

static_assert(kKeyTile == 16, "the decode kernel's transposed tiles (kernels/decode.cpp) are 16 slots wide");

const char* cache_dtype_name(CacheDtype dtype) {
  return dtype == CacheDtype::BF16 ? "bf16" : dtype == CacheDtype::I8 ? "int8" : "f32";
}

KvCache::KvCache(const KvCacheConfig& config) : config_(config) {
  const KvCacheConfig& c = config_;
  if (c.batch <= 0 || c.kv_heads <= 0 || c.head_dim <= 0 || c.value_dim < 0 || c.capacity <= 0)
    fail("KvCache: batch, kv_heads, head_dim and capacity must be ≥ 1 (value_dim ≥ 0), got batch ", c.batch,
         ", kv_heads ", c.kv_heads, ", head_dim ", c.head_dim, ", value_dim ", c.value_dim, ", capacity ", c.capacity);
  detail::check_cache_enums("KvCache", c.dtype, c.key_layout, c.int8_keys);
  if (c.transposed_keys() && c.int8_keys == Int8KeyScales::PerChannel)
    fail("KvCache: transposed keys (KeyLayout::Transposed) take per-token int8 scales, not per-channel ones");
  if (c.transposed_keys() && c.capacity > std::numeric_limits<int64_t>::max() - kKeyTile)
    fail("KvCache: capacity ", c.capacity, " cannot be rounded up to whole tiles of ", kKeyTile, " positions");
  detail::size_cache_storage("KvCache: (batch, kv_heads, capacity, d)", c.batch, c.kv_heads, c.capacity, c.head_dim,
                             c.v_dim(), c.dtype, k_, v_, c.key_slots());
  if (c.sinks < 0 || (c.sinks > 0 && (!c.ring || c.sinks >= c.capacity)))
    fail("KvCache: sinks must be ≥ 0, and with sinks the cache must be a ring with capacity > sinks; got sinks ",
         c.sinks, ", capacity ", c.capacity, c.ring ? ", ring" : ", not a ring");
  if (c.int8_keys == Int8KeyScales::PerChannel) {
    if (c.dtype != CacheDtype::I8 || c.ring || c.key_group < 1)
      fail("KvCache: per-channel key scales need an int8, non-ring cache and key_group ≥ 1; got dtype ",
           cache_dtype_name(c.dtype), c.ring ? ", a ring" : "", ", key_group ", c.key_group);
    // One scale per channel of each group, and the float rows of each head's open group.
    const std::string where = "KvCache: per-channel key scales (batch, kv_heads, groups, d) = " +
                              shape_str({c.batch, c.kv_heads, c.key_groups(), c.head_dim});
    const int64_t heads = checked_mul(c.batch, c.kv_heads, where);
    // A fresh vector, not assign(): that would keep the per-row scales' larger buffer when d < key_group.
    k_.scale = std::vector<float>(
        static_cast<size_t>(checked_mul(checked_mul(heads, c.key_groups(), where), c.head_dim, where)), 0.0f);
    k_.recent.assign(static_cast<size_t>(heads * std::min(c.key_group, c.capacity) * c.head_dim), 0.0f);
  }
  lengths_.assign(static_cast<size_t>(c.batch), 0);
}

KvCache::KvCache(KvCache&& other) noexcept { *this = std::move(other); }

KvCache& KvCache::operator=(KvCache&& other) noexcept {
  if (this != &other) {
    config_ = std::exchange(other.config_, KvCacheConfig{});
    other.config_.batch = 0;
    lengths_ = std::exchange(other.lengths_, {});
    k_ = std::exchange(other.k_, {});
    v_ = std::exchange(other.v_, {});
  }
  return *this;
}

KvCache KvCache::clone() const {
  KvCache copy;
  copy.config_ = config_;
  copy.lengths_ = lengths_;
  copy.k_ = k_;
  copy.v_ = v_;
  return copy;
}

size_t KvCache::bytes() const { return detail::plane_bytes(k_) + detail::plane_bytes(v_); }

void KvCache::check_has_storage(const char* who) const {
  if (lengths_.empty()) fail("KvCache::", who, ": the cache is empty (default-constructed or moved from): no storage");
}

void KvCache::check_batch_index(int64_t b, const char* who) const {
  check_has_storage(who);
  if (b < 0 || b >= config_.batch)
    fail("KvCache::", who, ": sequence ", b, " is out of range [0, ", config_.batch, ")");
}

int64_t KvCache::length(int64_t b) const {
  check_batch_index(b, "length");
  return lengths_[static_cast<size_t>(b)];
}
int64_t KvCache::first(int64_t b) const {
  check_batch_index(b, "first");
  const int64_t len = lengths_[static_cast<size_t>(b)];
  if (!config_.ring) return 0;
  if (len <= config_.capacity) return 0;
  return len - (config_.capacity - config_.sinks);  // ≥ sinks once anything was evicted
}
int64_t KvCache::stored(int64_t b) const {
  check_batch_index(b, "stored");
  const int64_t len = lengths_[static_cast<size_t>(b)];
  return len - first(b) + (first(b) > 0 ? config_.sinks : 0);
}
bool KvCache::holds(int64_t b, int64_t p) const {
  return p >= 0 && p < length(b) && (p >= first(b) || p < config_.sinks);
}
int64_t KvCache::remaining(int64_t b) const {
  check_batch_index(b, "remaining");
  return config_.ring ? std::numeric_limits<int64_t>::max() : config_.capacity - length(b);
}

const void* KvCache::k_data() const { return detail::plane_data(k_, config_.dtype); }
const void* KvCache::v_data() const { return detail::plane_data(v_, config_.dtype); }
const float* KvCache::k_scales() const { return detail::plane_scales(k_, config_.dtype); }
const float* KvCache::v_scales() const { return detail::plane_scales(v_, config_.dtype); }

void KvCache::check_element_index(int64_t b, int64_t g, int64_t p, int64_t x, int64_t dim, const char* who) const {
  check_batch_index(b, who);
  if (g < 0 || g >= config_.kv_heads)
    fail("KvCache::", who, ": head ", g, " is out of range [0, ", config_.kv_heads, ")");
  if (x < 0 || x >= dim) fail("KvCache::", who, ": feature ", x, " is out of range [0, ", dim, ")");
  if (!holds(b, p))
    fail("KvCache::", who, ": position ", p, " is not held by sequence ", b, " (it holds [", first(b), ", ", length(b),
         "))");
}

float KvCache::k_at(int64_t b, int64_t g, int64_t p, int64_t x) const {
  check_element_index(b, g, p, x, config_.head_dim, "k_at");
  if (config_.channel_keys()) {
    const int64_t head = b * config_.kv_heads + g, d = config_.head_dim;
    const float scale = k_.scale[static_cast<size_t>((head * config_.key_groups() + p / config_.key_group) * d + x)];
    return static_cast<float>(k_.i8[static_cast<size_t>((head * config_.capacity + p) * d + x)]) * scale;
  }
  const int64_t head = b * config_.kv_heads + g, s = slot(p);
  return detail::plane_at(
      k_, config_.dtype, head * config_.capacity + s,
      detail::slot_place(config_.transposed_keys(), head, config_.capacity, config_.key_slots(), config_.head_dim, s),
      x);
}
float KvCache::v_at(int64_t b, int64_t g, int64_t p, int64_t x) const {
  check_element_index(b, g, p, x, config_.v_dim(), "v_at");
  return detail::plane_at(v_, config_.dtype, (b * config_.kv_heads + g) * config_.capacity + slot(p), config_.v_dim(),
                          x);
}

void KvCache::store_rows(detail::CachePlane& dst, View4<const float> src, int64_t b_src, int64_t b, int64_t count,
                         int64_t dim, bool transposed) {
  const int64_t len = lengths_[static_cast<size_t>(b)];
  // A ring keeps only the last `capacity` of the new rows (with sinks: the sinks, and the last
  // capacity − sinks of the others).
  const int64_t recent = config_.capacity - config_.sinks;
  const int64_t keep_from = config_.ring ? std::max<int64_t>(0, count - recent) : 0;
  for (int64_t g = 0; g < config_.kv_heads; ++g) {
    const int64_t head = b * config_.kv_heads + g;
    for (int64_t t = 0; t < count; ++t) {
      if (t < keep_from && len + t >= config_.sinks) continue;
      const int64_t s = slot(len + t);
      detail::plane_put_row(dst, config_.dtype, head * config_.capacity + s,
                            detail::slot_place(transposed, head, config_.capacity, config_.key_slots(), dim, s), dim,
                            src.row(b_src, g, t), src.stride[3]);
    }
  }
}

void KvCache::store_channel_keys(View4<const float> src, int64_t b_src, int64_t b, int64_t count) {
  // Positions len … len + count − 1 go to their group's float rows (recent, row p mod G); every
  // group the append reaches is then quantised again from all its rows so far: a full group
  // once and for good, the open one (the last) until it fills.
  const KvCacheConfig& c = config_;
  const int64_t len = lengths_[static_cast<size_t>(b)], d = c.head_dim, G = c.key_group;
  const int64_t recent_rows = std::min(G, c.capacity);
  for (int64_t g = 0; g < c.kv_heads; ++g) {
    const int64_t head = b * c.kv_heads + g;
    float* recent = k_.recent.data() + head * recent_rows * d;
    for (int64_t t = 0; t < count; ++t) {
      const int64_t pos = len + t;
      const float* in = src.row(b_src, g, t);
      float* row = recent + (pos % G) * d;
      for (int64_t x = 0; x < d; ++x) row[x] = in[x * src.stride[3]];
      if (pos % G != G - 1 && t != count - 1) continue;
      const int64_t group = pos / G, rows = pos % G + 1;
      float* scale = k_.scale.data() + (head * c.key_groups() + group) * d;
      int8_t* out = k_.i8.data() + (head * c.capacity + group * G) * d;
      kernels::quantize_int8_columns(recent, rows, d, scale, out);
    }
  }
}

void KvCache::store_sequence(View4<const float> k, View4<const float> v, int64_t b_src, int64_t b, int64_t n) {
  if (config_.channel_keys())
    store_channel_keys(k, b_src, b, n);
  else
    store_rows(k_, k, b_src, b, n, config_.head_dim, config_.transposed_keys());
  store_rows(v_, v, b_src, b, n, config_.v_dim(), false);
  lengths_[static_cast<size_t>(b)] += n;
}

void KvCache::append(View4<const float> k, View4<const float> v, std::span<const int64_t> counts) {
  const KvCacheConfig& c = config_;
  check_has_storage("append");
  detail::check_extents("KvCache::append", "key", k);
  detail::check_extents("KvCache::append", "value", v);
  const Shape want_k{c.batch, c.kv_heads, k.shape[2], c.head_dim}, want_v{c.batch, c.kv_heads, k.shape[2], c.v_dim()};
  if (k.shape_vec() != want_k || v.shape_vec() != want_v)
    fail("KvCache::append: key ", shape_str(k), " and value ", shape_str(v), " must be ", shape_str(want_k), " and ",
         shape_str(want_v), " (batch, kv_heads, T, d)");
  const int64_t T = k.shape[2];
  if (!counts.empty() && static_cast<int64_t>(counts.size()) != c.batch)
    fail("KvCache::append: counts has ", counts.size(), " entries, expected one per sequence (", c.batch, ")");
  // Check everything before changing anything.
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t n = counts.empty() ? T : counts[static_cast<size_t>(b)];
    if (n < 0 || n > T) fail("KvCache::append: counts[", b, "] = ", n, " is outside [0, ", T, "]");
    if (n > remaining(b))
      fail("KvCache::append: sequence ", b, " holds ", length(b), " of ", c.capacity, " positions; appending ", n,
           " would exceed the capacity (make the cache larger, or a ring for sliding-window attention)");
  }
  if (T > 0 && (!k.defined() || !v.defined())) fail("KvCache::append: key or value has no data");
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t n = counts.empty() ? T : counts[static_cast<size_t>(b)];
    detail::check_int8_finite(c.dtype, "KvCache::append", "key", k, b, n);
    detail::check_int8_finite(c.dtype, "KvCache::append", "value", v, b, n);
  }
  for (int64_t b = 0; b < c.batch; ++b) {
    store_sequence(k, v, b, b, counts.empty() ? T : counts[static_cast<size_t>(b)]);
  }
}

void KvCache::append_sequence(int64_t b, View4<const float> k, View4<const float> v) {
  check_batch_index(b, "append_sequence");
  detail::check_extents("KvCache::append_sequence", "key", k);
  detail::check_extents("KvCache::append_sequence", "value", v);
  const KvCacheConfig& c = config_;
  const Shape want_k{1, c.kv_heads, k.shape[2], c.head_dim}, want_v{1, c.kv_heads, k.shape[2], c.v_dim()};
  if (k.shape_vec() != want_k || v.shape_vec() != want_v)
    fail("KvCache::append_sequence: key ", shape_str(k), " and value ", shape_str(v), " must be ", shape_str(want_k),
         " and ", shape_str(want_v), " (1, kv_heads, T, d)");
  const int64_t n = k.shape[2];
  if (n > remaining(b))
    fail("KvCache::append_sequence: sequence ", b, " holds ", length(b), " of ", c.capacity, " positions; appending ",
         n, " would exceed the capacity");
  if (n > 0 && (!k.defined() || !v.defined())) fail("KvCache::append_sequence: key or value has no data");
  detail::check_int8_finite(c.dtype, "KvCache::append_sequence", "key", k, 0, n);
  detail::check_int8_finite(c.dtype, "KvCache::append_sequence", "value", v, 0, n);
  store_sequence(k, v, 0, b, n);
}

void KvCache::reset() { std::fill(lengths_.begin(), lengths_.end(), 0); }  // empty: nothing to reset
void KvCache::reset(int64_t b) {
  check_batch_index(b, "reset");
  lengths_[static_cast<size_t>(b)] = 0;
}

int auto_cache_splits(int64_t batch, int64_t kv_heads, int64_t q_rows_per_group, int64_t keys) {
  // Enough independent items to keep many cores busy (≥ 64), but no split shorter than 256
  // positions, where the merge would start to cost more than it saves. Thread count is not an input.
  const int64_t units = std::max<int64_t>(1, batch * kv_heads * std::max<int64_t>(1, q_rows_per_group / 16));
  const int64_t by_work = (64 + units - 1) / units;
  const int64_t by_length = std::max<int64_t>(1, keys / 256);
  return static_cast<int>(std::clamp<int64_t>(std::min(by_work, by_length), 1, 64));
}

void attend_cache(View4<const float> q, const KvCache& cache, std::span<const int64_t> q_start,
                  const CacheAttentionOptions& options, View4<float> out, View4<float> lse) {
  const KvCacheConfig& c = cache.config();
  if (c.capacity == 0) fail("attend_cache: the cache is empty (default-constructed or moved from): no storage");
  detail::check_extents("attend_cache", "query", q);
  const int64_t B = q.shape[0], H = q.shape[1], Tq = q.shape[2], d = q.shape[3];
  if (B != c.batch || d != c.head_dim || H < 0 || H % c.kv_heads != 0)
    fail("attend_cache: query ", shape_str(q), " must be (", c.batch, ", h, T_q, ", c.head_dim,
         ") with h a multiple of the cache's ", c.kv_heads, " kv_heads");
  const Shape want_out{B, H, Tq, c.v_dim()};
  if (out.shape_vec() != want_out)
    fail("attend_cache: out has shape ", shape_str(out), ", expected ", shape_str(want_out));
  if (lse.defined() && lse.shape_vec() != Shape{B, H, Tq, 1})
    fail("attend_cache: lse has shape ", shape_str(lse), ", expected ", shape_str({B, H, Tq, 1}));
  // lse over out gave wrong outputs; q may overlap out (each work item copies its query rows first).
  detail::check_output_layout("attend_cache", "out", out);
  detail::check_output_layout("attend_cache", "lse", lse);
  detail::check_disjoint("attend_cache", {{"out", detail::byte_span(out)}, {"lse", detail::byte_span(lse)}},
                         {{"ALiBi slopes", detail::byte_span(options.alibi.slopes)},
                          {"sink logits", detail::byte_span(options.sinks.logits)}});
  if (!q_start.empty() && static_cast<int64_t>(q_start.size()) != B)
    fail("attend_cache: q_start has ", q_start.size(), " entries, expected one per sequence (", B, ")");
  detail::check_window("attend_cache", options.window);
  if (options.splits < 0) fail("attend_cache: splits must be ≥ 0 (0 = auto), got ", options.splits);
  if (options.scale && !std::isfinite(*options.scale)) fail("attend_cache: scale must be finite, got ", *options.scale);
  const kernels::ScoreEdits edits =
      detail::check_score_edits("attend_cache", H, options.alibi, options.softcap, options.sinks);
  if (B * H * Tq == 0) return;
  if (!q.defined() || !out.defined()) fail("attend_cache: query or output has no data");

  std::vector<int64_t> first(static_cast<size_t>(B)), end(static_cast<size_t>(B)), start(static_cast<size_t>(B));
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    const size_t i = static_cast<size_t>(b);
    first[i] = cache.first(b);
    end[i] = cache.length(b);
    start[i] = q_start.empty() ? end[i] : q_start[i];
    detail::check_q_start("attend_cache", b, start[i], Tq);
    longest = std::max(longest, end[i] - first[i]);
  }
  kernels::DecodeParams p;
  p.q = q;
  p.k = cache.k_data();
  p.v = cache.v_data();
  p.dtype = detail::kernel_dtype(c.dtype);
  p.k_scale = cache.k_scales();
  p.v_scale = cache.v_scales();
  p.k_channel_group = c.channel_keys() ? c.key_group : 0;
  p.k_transposed = c.transposed_keys();
  p.k_slots = c.key_slots();
  p.kv_heads = c.kv_heads;
  p.capacity = c.capacity;
  p.d_v = c.v_dim();
  p.ring = c.ring;
  p.sinks = c.sinks;
  p.key_first = first.data();
  p.key_end = end.data();
  p.q_start = start.data();
  p.window = options.window;
  p.scale = detail::resolve_scale(options.scale, d);
  p.edits = edits;
  p.splits = kernels::cap_decode_splits(
      options.splits > 0 ? options.splits : auto_cache_splits(B, c.kv_heads, (H / c.kv_heads) * Tq, longest), longest);
  p.threads = resolve_threads(options.threads);
  p.out = out;
  p.lse = lse;
  std::vector<float> workspace(kernels::decode_workspace_floats(p));
  kernels::decode_attention(p, workspace.data());
}

}  // namespace mha
