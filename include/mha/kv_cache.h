// mha/kv_cache.h — a key/value cache for autoregressive decoding, and attention over it.
//
// One KvCache serves one attention layer: K and V are preallocated as (batch, kv_heads, capacity,
// d) in float32, bfloat16 or int8 and filled by append(); nothing is reallocated per step.
//
// int8 (CacheDtype::I8): every row of K and of V — one token of one K/V head — is stored as int8
// values and one float scale, symmetric: scale = max|x| / 127, value = round-to-nearest(x / scale)
// (a row of zeros has scale 0). A row reads back as value · scale, within scale / 2 of what was
// appended (for normal scales; docs/semantics.md has the edges near 0 and FLT_MAX). The decode
// kernel reads the int8 rows and their scales directly (a quarter of the float32 bytes, plus 4 per
// row).
//
// int8 keys with per-channel scales (Int8KeyScales::PerChannel, KIVI: Liu et al. 2024): keys are
// scaled per channel instead, one scale per channel x of each group of `key_group` consecutive
// positions: scale[group][x] = max over the group's positions of |k[p][x]| / 127. Key channels
// with outliers (common in trained models) then cost precision only in their own channel. The
// positions of a group that is not yet full are kept in float32 as well (at most key_group rows per
// sequence and K/V head), and the whole group is quantised again on every append that reaches it,
// from those float rows, so a key's int8 value is final once its group is full. Values keep one
// scale per row. Contiguous, non-ring caches only (a ring would overwrite a group one slot at a time).
// Appending a non-finite key or value to an int8 cache fails with
// mha::Error naming it, changing nothing: no scale could represent it (a float cache keeps the
// NaN, which then shows in the output, docs/semantics.md). Every sequence
// of the batch has its own length (the absolute position of its next token), so a batch of prompts
// of different lengths decodes together.
//
// Transposed keys (KeyLayout::Transposed, keys across SIMD lanes; gemma.cpp keeps its K this way):
// K is stored in tiles of kKeyTile = 16 consecutive slots, each tile (d, 16): the 16 slots' values
// of channel 0, then of channel 1, and so on. A score then is 16 keys' dot products accumulated
// in the lanes of one vector, one multiply-add per channel and query row, with no horizontal sum
// per key at the end (which the row layout needs: on a Zen 4 those sums were ~13% of an int8
// decode step). The same values as the row layout hold, so attention gives the same result up to
// float rounding (the sums run in another order). V keeps its rows (P·V reads them whole). Any
// dtype with per-token scales, ring or not; not with per-channel key scales. k_data() is then
// (batch, kv_heads, key_slots() / 16, d, 16).
//
// Ring mode (sliding-window attention): the cache holds the last `capacity` positions of each
// sequence; position p lives in slot p mod capacity. Lengths stay absolute, so rotary embeddings
// and causal / window masks use true positions however long the sequence grows.
//
// Ring mode with attention sinks (StreamingLLM, Xiao et al. 2023): `sinks` > 0 keeps positions
// 0 … sinks − 1 for good in slots 0 … sinks − 1, and the ring of the other capacity − sinks slots
// holds the most recent positions. Attention sees the sinks from every query, whatever the window,
// plus the window of recent positions. Positions are NOT re-indexed within the cache (the paper
// does that, caching keys before rotation): keys are rotated once, at their original absolute
// positions, as everywhere else in mha, so a sink cache gives exactly the attention of the full
// sequence under the mask "key p visible to query q iff p ≤ q and (p < sinks or p > q − window)".
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "mha/masks.h"
#include "mha/tensor.h"

namespace mha {

enum class CacheDtype : uint8_t { F32, BF16, I8 };

/// How an int8 cache scales its keys (values always have one scale per row).
enum class Int8KeyScales : uint8_t {
  PerToken,    ///< one scale per key row (token, K/V head)
  PerChannel,  ///< KIVI: one scale per channel of each group of KvCacheConfig::key_group positions
};

/// How a contiguous cache lays out K (V is always rows of d_v).
enum class KeyLayout : uint8_t {
  Rows,        ///< (batch, kv_heads, capacity, d): each position's d values together
  Transposed,  ///< tiles of kKeyTile positions, each tile (d, kKeyTile): keys across SIMD lanes
};
/// Positions per tile of the transposed key layout (AVX-512's float lanes).
inline constexpr int64_t kKeyTile = 16;

/// "f32", "bf16" or "int8".
const char* cache_dtype_name(CacheDtype dtype);

namespace detail {
/// K or V storage of a cache: elements of its dtype, and for int8 one scale per row. Internal
/// (layers/cache_storage.h).
struct CachePlane {
  std::vector<float> f32;
  std::vector<bf16> b16;
  std::vector<int8_t> i8;
  std::vector<float> scale;   // int8 only: one per row (token, K/V head), or per-channel key scales
  std::vector<float> recent;  // per-channel keys only: the float rows of each (sequence, head)'s open group
};
}  // namespace detail

struct KvCacheConfig {
  int64_t batch = 1;
  int64_t kv_heads = 0;   ///< K/V heads (num_kv_heads of the module)
  int64_t head_dim = 0;   ///< d of K
  int64_t value_dim = 0;  ///< d of V; 0 = head_dim
  int64_t capacity = 0;   ///< positions held per sequence (ring mode: the window it can serve)
  CacheDtype dtype = CacheDtype::F32;
  bool ring = false;  ///< keep the last `capacity` positions instead of failing when full
  int64_t sinks = 0;  ///< ring only: positions [0, sinks) are never evicted (StreamingLLM); < capacity
  /// int8 only: per-token (default) or per-channel key scales (KIVI; contiguous, non-ring caches).
  Int8KeyScales int8_keys = Int8KeyScales::PerToken;
  int64_t key_group = 32;  ///< per-channel key scales: positions per group (KIVI's G), ≥ 1
  /// Rows (default) or Transposed (keys across SIMD lanes; not with per-channel key scales).
  KeyLayout key_layout = KeyLayout::Rows;

  int64_t v_dim() const { return value_dim > 0 ? value_dim : head_dim; }
  bool channel_keys() const { return dtype == CacheDtype::I8 && int8_keys == Int8KeyScales::PerChannel; }
  /// Per-channel key scales: groups of key_group positions per (sequence, K/V head).
  /// (Rounded up without forming capacity + key_group − 1, which overflows for a key_group near
  /// 2⁶³; 0 where key_group < 1, which the cache refuses.)
  int64_t key_groups() const {
    return channel_keys() && key_group > 0 ? capacity / key_group + (capacity % key_group != 0) : 0;
  }
  bool transposed_keys() const { return key_layout == KeyLayout::Transposed; }
  /// Key slots stored per (sequence, K/V head): capacity, rounded up to whole tiles when transposed.
  int64_t key_slots() const { return transposed_keys() ? (capacity + kKeyTile - 1) / kKeyTile * kKeyTile : capacity; }
};

class KvCache {
 public:
  /// An empty cache (batch 0, no storage): config(), batch() (0), bytes() (0), clone() and reset()
  /// work; appending, attending and every per-sequence query are an mha::Error.
  KvCache() noexcept { config_.batch = 0; }
  /// Allocates (batch, kv_heads, capacity, d) for K and for V; throws mha::Error on bad sizes.
  explicit KvCache(const KvCacheConfig& config);

  // Copies are explicit (clone()); moves are cheap and leave the source empty, as KvCache() is
  // (a defaulted move kept its sizes over no storage, and its next use read past the end).
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  KvCache(KvCache&& other) noexcept;
  KvCache& operator=(KvCache&& other) noexcept;
  /// A deep copy (e.g. to branch a shared prompt into several continuations).
  [[nodiscard]] KvCache clone() const;

  const KvCacheConfig& config() const { return config_; }
  int64_t batch() const { return config_.batch; }
  int64_t capacity() const { return config_.capacity; }
  bool ring() const { return config_.ring; }
  CacheDtype dtype() const { return config_.dtype; }
  size_t bytes() const;  ///< K and V storage

  /// Absolute length of sequence b: positions 0 … length − 1 were appended; the next is `length`.
  int64_t length(int64_t b) const;
  /// First position still held (0 unless a ring has wrapped); with sinks, the first held position
  /// after them (positions [0, sinks) are held too).
  int64_t first(int64_t b) const;
  /// Positions held: length − first, plus the sinks once a ring with sinks has evicted any.
  int64_t stored(int64_t b) const;
  /// Whether position p of sequence b is held.
  bool holds(int64_t b, int64_t p) const;
  /// Positions sequence b can still take before append fails (ring: unlimited → INT64_MAX).
  int64_t remaining(int64_t b) const;

  /// Appends `counts[b]` rows of k (B, kv, T, d) / v (B, kv, T, d_v) to each sequence b (rows
  /// 0 … counts[b] − 1; empty counts = all T). Fails with mha::Error, changing nothing, when a
  /// non-ring sequence would exceed its capacity or a shape does not match.
  void append(View4<const float> k, View4<const float> v, std::span<const int64_t> counts = {});
  /// Appends k (kv, T, d) / v (kv, T, d_v), as (1, kv, T, ·) views, to sequence b only.
  void append_sequence(int64_t b, View4<const float> k, View4<const float> v);

  void reset();           ///< every sequence back to length 0 (storage kept)
  void reset(int64_t b);  ///< one sequence back to length 0

  /// Slot of absolute position p (ring: p mod capacity; with sinks, sinks + (p − sinks) mod
  /// (capacity − sinks) for p ≥ sinks).
  int64_t slot(int64_t p) const {
    if (!config_.ring) return p;
    const int64_t s = config_.sinks;
    return p < s ? p : s + (p - s) % (config_.capacity - s);
  }
  /// Raw storage, (batch, kv_heads, capacity, d) row-major (transposed keys: k_data() is
  /// (batch, kv_heads, key_slots() / kKeyTile, d, kKeyTile)); float*, bf16* or int8_t* by dtype().
  const void* k_data() const;
  const void* v_data() const;
  /// int8 only (else null): the scale of each row, (batch, kv_heads, capacity); with per-channel
  /// key scales, k_scales() is (batch, kv_heads, key_groups(), head_dim) instead.
  const float* k_scales() const;
  const float* v_scales() const;
  /// Reads K/V of sequence b, head g, position p (must be held) as float (for tests and tools).
  float k_at(int64_t b, int64_t g, int64_t p, int64_t x) const;
  float v_at(int64_t b, int64_t g, int64_t p, int64_t x) const;

 private:
  void check_has_storage(const char* who) const;  ///< not empty (default-constructed or moved from)
  void check_batch_index(int64_t b, const char* who) const;
  /// b, g and x in range for K (dim = head_dim) or V (dim = v_dim), p held by sequence b.
  void check_element_index(int64_t b, int64_t g, int64_t p, int64_t x, int64_t dim, const char* who) const;
  void store_sequence(View4<const float> k, View4<const float> v, int64_t b_src, int64_t b, int64_t n);
  void store_rows(detail::CachePlane& dst, View4<const float> src, int64_t b_src, int64_t b, int64_t count, int64_t dim,
                  bool transposed);
  void store_channel_keys(View4<const float> src, int64_t b_src, int64_t b, int64_t count);

  KvCacheConfig config_;
  std::vector<int64_t> lengths_;
  detail::CachePlane k_, v_;
};

/// Options for attention over a cache.
struct CacheAttentionOptions {
  std::optional<float> scale;  ///< default 1/√d
  int64_t window = 0;          ///< sliding window W: key p visible when q − W < p ≤ q; 0 = unlimited
  /// Split-K: the held positions of each sequence are cut into this many contiguous parts whose
  /// (max, sum, partial output) are merged exactly by log-sum-exp. 0 = chosen from the shapes
  /// alone. The result depends on the split count but never on the thread count (counts above one
  /// split per 128 held positions give the result of that count: the further parts would be empty).
  int splits = 0;
  int threads = 0;         ///< 0 = mha::num_threads()
  Alibi alibi{};           ///< ALiBi slopes per query head, by absolute positions (mha/masks.h)
  float softcap = 0.0f;    ///< c > 0: s → c·tanh(s/c); 0 = off
  AttentionSinks sinks{};  ///< sink logit per query head (the returned lse includes it)
};

/// Causal attention of q (B, h, T_q, d) against everything `cache` holds: row t of batch b is at
/// absolute position q_start[b] + t (empty q_start = cache.length(b): the tokens right after the
/// cache) and sees key p when p ≤ its position (and p > position − window). Query head i reads
/// K/V head i / (h / kv). out (B, h, T_q, d_v); lse (B, h, T_q, 1) optional. A row that sees no
/// key gives zeros and lse = −inf.
void attend_cache(View4<const float> q, const KvCache& cache, std::span<const int64_t> q_start,
                  const CacheAttentionOptions& options, View4<float> out, View4<float> lse = {});

/// The split count attend_cache uses when options.splits = 0, for these shapes.
int auto_cache_splits(int64_t batch, int64_t kv_heads, int64_t q_rows_per_group, int64_t keys);

}  // namespace mha
