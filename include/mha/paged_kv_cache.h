// mha/paged_kv_cache.h — a paged KV cache (vLLM's PagedAttention) and attention through it.
//
// K and V live in a pool of fixed-size blocks, (blocks, kv_heads, block_size, d) each, allocated
// once. A sequence is a block table — the pool blocks that hold its positions 0…block_size−1,
// block_size…2·block_size−1, … — and a length; it grows a block at a time from the free list, so
// nothing is reserved per sequence and nothing is ever reallocated or moved. Blocks are
// reference-counted: fork() makes a new sequence whose table shares every block of its parent
// (beam search, parallel sampling: no K/V is copied), and a write into a block that another
// sequence also holds first copies that one block (copy-on-write), so the sharers never see it.
// Only a shared, partly filled last block can be written into this way; full shared blocks are
// never written again. free() returns a sequence's blocks (those no longer shared) to the pool.
//
// attend_paged_cache() is attend_cache() (mha/kv_cache.h) read through the block tables: the same
// decode kernel, the same causal / window rule on absolute positions, and bitwise the same
// result as a contiguous cache holding the same values, for the same split count.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "mha/kv_cache.h"
#include "mha/tensor.h"

namespace mha {

struct PagedKvCacheConfig {
  int64_t kv_heads = 0;     ///< K/V heads (num_kv_heads of the module)
  int64_t head_dim = 0;     ///< d of K
  int64_t value_dim = 0;    ///< d of V; 0 = head_dim
  int64_t block_size = 16;  ///< positions per block
  int64_t num_blocks = 0;   ///< blocks in the pool (its whole capacity, shared by every sequence)
  CacheDtype dtype = CacheDtype::F32;
  /// Rows (default) or Transposed: each block's keys in tiles of kKeyTile positions, keys across
  /// SIMD lanes (mha/kv_cache.h); block_size must then be a multiple of kKeyTile.
  KeyLayout key_layout = KeyLayout::Rows;

  int64_t v_dim() const { return value_dim > 0 ? value_dim : head_dim; }
  bool transposed_keys() const { return key_layout == KeyLayout::Transposed; }
};

class PagedKvCache {
 public:
  /// Allocates the pool; throws mha::Error on bad sizes.
  explicit PagedKvCache(const PagedKvCacheConfig& config);
  PagedKvCache(const PagedKvCache&) = delete;
  PagedKvCache& operator=(const PagedKvCache&) = delete;
  /// Moves leave the source an empty pool (no blocks, no sequences): a sequence added to it takes
  /// no tokens, and attending it is an mha::Error.
  PagedKvCache(PagedKvCache&& other) noexcept;
  PagedKvCache& operator=(PagedKvCache&& other) noexcept;

  const PagedKvCacheConfig& config() const { return config_; }

  /// A new empty sequence; returns its id (ids of freed sequences are reused).
  int64_t add_sequence();
  /// A new sequence holding the same positions as `seq`, sharing its blocks (no K/V copied).
  int64_t fork(int64_t seq);
  /// Releases `seq`: each of its blocks loses a reference and returns to the pool at zero.
  void free(int64_t seq);

  /// Appends k (1, kv, T, d) / v (1, kv, T, d_v) to sequence `seq` at positions length … length+T−1,
  /// taking blocks from the pool as needed (and copying a shared last block before writing into
  /// it). Fails with mha::Error, changing nothing, when the pool has too few free blocks.
  void append(int64_t seq, View4<const float> k, View4<const float> v);

  int64_t length(int64_t seq) const;
  /// The pool blocks holding sequence `seq`'s positions, in order.
  std::span<const int32_t> block_table(int64_t seq) const;
  bool alive(int64_t seq) const;
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  /// How many live sequences hold block `block`.
  int64_t refcount(int64_t block) const;

  /// Raw pools (blocks, kv_heads, block_size, d) row-major (transposed keys: K is (blocks,
  /// kv_heads, block_size / kKeyTile, d, kKeyTile)); float*, bf16* or int8_t* by dtype.
  const void* k_data() const;
  const void* v_data() const;
  /// int8 only (else null): the scale of each pool row, (blocks, kv_heads, block_size).
  const float* k_scales() const;
  const float* v_scales() const;
  /// K/V of sequence `seq`, head g, position p (< length), feature x, as float (tests and tools).
  float k_at(int64_t seq, int64_t g, int64_t p, int64_t x) const;
  float v_at(int64_t seq, int64_t g, int64_t p, int64_t x) const;

 private:
  struct Sequence {
    std::vector<int32_t> blocks;
    int64_t length = 0;
    bool alive = false;
  };
  const Sequence& sequence(int64_t seq, const char* who) const;
  int32_t take_block();
  void copy_block(int32_t from, int32_t to);
  int64_t row_index(int32_t block, int64_t g, int64_t row) const;

  PagedKvCacheConfig config_;
  detail::CachePlane k_, v_;
  std::vector<int32_t> refs_;  // per block
  std::vector<int32_t> free_;  // free blocks, taken from the back
  std::vector<Sequence> seqs_;
};

/// Causal attention of q (B, h, T_q, d) against sequences `seqs` (B ids) of a paged cache: row t
/// of batch b is at absolute position q_start[b] + t (empty q_start = length: right after the
/// cache) and sees key p when p ≤ its position (and p > position − window). out (B, h, T_q, d_v),
/// lse (B, h, T_q, 1) optional. Equal to attend_cache on a contiguous cache of the same values.
void attend_paged_cache(View4<const float> q, const PagedKvCache& cache, std::span<const int64_t> seqs,
                        std::span<const int64_t> q_start, const CacheAttentionOptions& options, View4<float> out,
                        View4<float> lse = {});

/// The same through explicit block tables, vLLM's form: block_tables (B × table_width, row b the
/// blocks of sequence b), lengths (B). Every entry a sequence's length reaches must name a block
/// of the pool, else mha::Error (never an out-of-bounds read).
void attend_paged_blocks(View4<const float> q, const PagedKvCache& cache, std::span<const int32_t> block_tables,
                         int64_t table_width, std::span<const int64_t> lengths, std::span<const int64_t> q_start,
                         const CacheAttentionOptions& options, View4<float> out, View4<float> lse = {});

}  // namespace mha
