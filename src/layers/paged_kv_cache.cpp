// layers/paged_kv_cache.cpp — the paged KV cache (mha/paged_kv_cache.h): a pool of blocks,
// reference-counted block tables with copy-on-write, and attention through them (the decode
// kernel with a block table, kernels/decode.h).
#include "mha/paged_kv_cache.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "kernels/decode.h"
#include "layers/cache_storage.h"
#include "layers/sdpa_prepare.h"
#include "layers/view_overlap.h"
#include "mha/threads.h"

namespace mha {

namespace {

constexpr const char* kPaged = "PagedKvCache";

}  // namespace

PagedKvCache::PagedKvCache(const PagedKvCacheConfig& config) : config_(config) {
  const PagedKvCacheConfig& c = config_;
  if (c.kv_heads <= 0 || c.head_dim <= 0 || c.value_dim < 0 || c.block_size <= 0 || c.num_blocks <= 0)
    fail(kPaged, ": kv_heads, head_dim, block_size and num_blocks must be ≥ 1 (value_dim ≥ 0), got kv_heads ",
         c.kv_heads, ", head_dim ", c.head_dim, ", value_dim ", c.value_dim, ", block_size ", c.block_size,
         ", num_blocks ", c.num_blocks);
  detail::check_cache_enums(kPaged, c.dtype, c.key_layout);
  if (c.transposed_keys() && c.block_size % kKeyTile != 0)
    fail(kPaged, ": transposed keys (KeyLayout::Transposed) need a block_size that is a multiple of ", kKeyTile,
         ", got ", c.block_size);
  if (c.num_blocks > std::numeric_limits<int32_t>::max())
    fail(kPaged, ": num_blocks ", c.num_blocks, " does not fit the int32 block table entries");
  detail::size_cache_storage(std::string(kPaged) + ": pool (blocks, kv_heads, block_size, d)", c.num_blocks, c.kv_heads,
                             c.block_size, c.head_dim, c.v_dim(), c.dtype, k_, v_);
  refs_.assign(static_cast<size_t>(c.num_blocks), 0);
  free_.resize(static_cast<size_t>(c.num_blocks));
  // Taken from the back: block 0 first.
  for (int64_t i = 0; i < c.num_blocks; ++i) free_[static_cast<size_t>(i)] = static_cast<int32_t>(c.num_blocks - 1 - i);
}

PagedKvCache::PagedKvCache(PagedKvCache&& other) noexcept { *this = std::move(other); }

PagedKvCache& PagedKvCache::operator=(PagedKvCache&& other) noexcept {
  if (this != &other) {
    config_ = std::exchange(other.config_, PagedKvCacheConfig{});
    k_ = std::exchange(other.k_, {});
    v_ = std::exchange(other.v_, {});
    refs_ = std::exchange(other.refs_, {});
    free_ = std::exchange(other.free_, {});
    seqs_ = std::exchange(other.seqs_, {});
  }
  return *this;
}

const PagedKvCache::Sequence& PagedKvCache::sequence(int64_t seq, const char* who) const {
  if (seq < 0 || seq >= static_cast<int64_t>(seqs_.size()) || !seqs_[static_cast<size_t>(seq)].alive)
    fail(kPaged, "::", who, ": sequence ", seq, " does not exist (freed or never added)");
  return seqs_[static_cast<size_t>(seq)];
}

bool PagedKvCache::alive(int64_t seq) const {
  return seq >= 0 && seq < static_cast<int64_t>(seqs_.size()) && seqs_[static_cast<size_t>(seq)].alive;
}

int64_t PagedKvCache::add_sequence() {
  for (size_t i = 0; i < seqs_.size(); ++i)
    if (!seqs_[i].alive) {
      seqs_[i] = Sequence{{}, 0, true};
      return static_cast<int64_t>(i);
    }
  seqs_.push_back(Sequence{{}, 0, true});
  return static_cast<int64_t>(seqs_.size()) - 1;
}

int64_t PagedKvCache::fork(int64_t seq) {
  sequence(seq, "fork");
  const int64_t child = add_sequence();  // may grow seqs_: index afresh below
  Sequence& c = seqs_[static_cast<size_t>(child)];
  c = seqs_[static_cast<size_t>(seq)];
  for (int32_t b : c.blocks) ++refs_[static_cast<size_t>(b)];
  return child;
}

void PagedKvCache::free(int64_t seq) {
  sequence(seq, "free");
  Sequence& s = seqs_[static_cast<size_t>(seq)];
  for (int32_t b : s.blocks)
    if (--refs_[static_cast<size_t>(b)] == 0) free_.push_back(b);
  s = Sequence{};
}

int64_t PagedKvCache::length(int64_t seq) const { return sequence(seq, "length").length; }

std::span<const int32_t> PagedKvCache::block_table(int64_t seq) const { return sequence(seq, "block_table").blocks; }

int64_t PagedKvCache::refcount(int64_t block) const {
  if (block < 0 || block >= config_.num_blocks)
    fail(kPaged, "::refcount: block ", block, " is outside the pool [0, ", config_.num_blocks, ")");
  return refs_[static_cast<size_t>(block)];
}

int32_t PagedKvCache::take_block() {
  const int32_t b = free_.back();
  free_.pop_back();
  refs_[static_cast<size_t>(b)] = 1;
  return b;
}

int64_t PagedKvCache::row_index(int32_t block, int64_t g, int64_t row) const {
  return (block * config_.kv_heads + g) * config_.block_size + row;
}

void PagedKvCache::copy_block(int32_t from, int32_t to) {
  const int64_t rows = config_.kv_heads * config_.block_size;
  detail::plane_copy_rows(k_, row_index(from, 0, 0), row_index(to, 0, 0), rows, config_.head_dim);
  detail::plane_copy_rows(v_, row_index(from, 0, 0), row_index(to, 0, 0), rows, config_.v_dim());
}

void PagedKvCache::append(int64_t seq, View4<const float> k, View4<const float> v) {
  sequence(seq, "append");
  detail::check_extents("PagedKvCache::append", "key", k);
  detail::check_extents("PagedKvCache::append", "value", v);
  const PagedKvCacheConfig& c = config_;
  const int64_t T = k.shape[2];
  const Shape want_k{1, c.kv_heads, T, c.head_dim}, want_v{1, c.kv_heads, T, c.v_dim()};
  if (k.shape_vec() != want_k || v.shape_vec() != want_v)
    fail(kPaged, "::append: key ", shape_str(k), " and value ", shape_str(v), " must be ", shape_str(want_k), " and ",
         shape_str(want_v), " (1, kv_heads, T, d)");
  if (T > 0 && (!k.defined() || !v.defined())) fail(kPaged, "::append: key or value has no data");
  detail::check_int8_finite(c.dtype, "PagedKvCache::append", "key", k, 0, T);
  detail::check_int8_finite(c.dtype, "PagedKvCache::append", "value", v, 0, T);
  Sequence& s = seqs_[static_cast<size_t>(seq)];
  const int64_t bs = c.block_size, len = s.length;
  const int64_t have = static_cast<int64_t>(s.blocks.size());
  const int64_t need = (len + T + bs - 1) / bs;
  // A shared last block with room left is copied before it is written (copy-on-write).
  const bool cow = T > 0 && len % bs != 0 && refs_[static_cast<size_t>(s.blocks.back())] > 1;
  const int64_t new_blocks = need - have + (cow ? 1 : 0);
  if (new_blocks > free_blocks())
    fail(kPaged, "::append: sequence ", seq, " needs ", new_blocks, " more blocks of ", bs, " positions for ", T,
         " new tokens, but the pool has ", free_blocks(), " of ", c.num_blocks, " free");
  if (cow) {
    const int32_t old = s.blocks.back(), fresh = take_block();
    copy_block(old, fresh);
    --refs_[static_cast<size_t>(old)];
    s.blocks.back() = fresh;
  }
  for (int64_t i = have; i < need; ++i) s.blocks.push_back(take_block());
  const auto store = [&](detail::CachePlane& pool, View4<const float> src, int64_t dim, bool transposed) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t pos = len + t;
      const int32_t block = s.blocks[static_cast<size_t>(pos / bs)];
      for (int64_t g = 0; g < c.kv_heads; ++g)
        detail::plane_put_row(pool, c.dtype, row_index(block, g, pos % bs),
                              detail::slot_place(transposed, block * c.kv_heads + g, bs, bs, dim, pos % bs), dim,
                              src.row(0, g, t), src.stride[3]);
    }
  };
  store(k_, k, c.head_dim, c.transposed_keys());
  store(v_, v, c.v_dim(), false);
  s.length += T;
}

const void* PagedKvCache::k_data() const { return detail::plane_data(k_, config_.dtype); }
const void* PagedKvCache::v_data() const { return detail::plane_data(v_, config_.dtype); }
const float* PagedKvCache::k_scales() const { return detail::plane_scales(k_, config_.dtype); }
const float* PagedKvCache::v_scales() const { return detail::plane_scales(v_, config_.dtype); }

float PagedKvCache::k_at(int64_t seq, int64_t g, int64_t p, int64_t x) const {
  const Sequence& s = sequence(seq, "k_at");
  if (g < 0 || g >= config_.kv_heads || p < 0 || p >= s.length || x < 0 || x >= config_.head_dim)
    fail(kPaged, "::k_at: (head ", g, ", position ", p, ", feature ", x, ") is outside (", config_.kv_heads, ", ",
         s.length, ", ", config_.head_dim, ")");
  const int32_t block = s.blocks[static_cast<size_t>(p / config_.block_size)];
  const int64_t bs = config_.block_size;
  return detail::plane_at(
      k_, config_.dtype, row_index(block, g, p % bs),
      detail::slot_place(config_.transposed_keys(), block * config_.kv_heads + g, bs, bs, config_.head_dim, p % bs), x);
}

float PagedKvCache::v_at(int64_t seq, int64_t g, int64_t p, int64_t x) const {
  const Sequence& s = sequence(seq, "v_at");
  if (g < 0 || g >= config_.kv_heads || p < 0 || p >= s.length || x < 0 || x >= config_.v_dim())
    fail(kPaged, "::v_at: (head ", g, ", position ", p, ", feature ", x, ") is outside (", config_.kv_heads, ", ",
         s.length, ", ", config_.v_dim(), ")");
  return detail::plane_at(v_, config_.dtype,
                          row_index(s.blocks[static_cast<size_t>(p / config_.block_size)], g, p % config_.block_size),
                          config_.v_dim(), x);
}

namespace {

/// attend_paged_blocks' work, its errors named after `fn`: the function the caller called (an
/// attend_paged_cache call said 'attend_paged_blocks: …' for its own bad window or slopes).
void attend_paged(const char* fn, View4<const float> q, const PagedKvCache& cache,
                  std::span<const int32_t> block_tables, int64_t table_width, std::span<const int64_t> lengths,
                  std::span<const int64_t> q_start, const CacheAttentionOptions& options, View4<float> out,
                  View4<float> lse) {
  const PagedKvCacheConfig& c = cache.config();
  if (c.num_blocks == 0) fail(fn, ": the cache is empty (moved from): no storage");
  detail::check_extents(fn, "query", q);
  const int64_t B = q.shape[0], H = q.shape[1], Tq = q.shape[2], d = q.shape[3];
  if (d != c.head_dim || H < 0 || H % c.kv_heads != 0)
    fail(fn, ": query ", shape_str(q), " must be (B, h, T_q, ", c.head_dim, ") with h a multiple of the cache's ",
         c.kv_heads, " kv_heads");
  const Shape want_out{B, H, Tq, c.v_dim()};
  if (out.shape_vec() != want_out) fail(fn, ": out has shape ", shape_str(out), ", expected ", shape_str(want_out));
  if (lse.defined() && lse.shape_vec() != Shape{B, H, Tq, 1})
    fail(fn, ": lse has shape ", shape_str(lse), ", expected ", shape_str({B, H, Tq, 1}));
  detail::check_output_layout(fn, "out", out);
  detail::check_output_layout(fn, "lse", lse);
  detail::check_disjoint(fn, {{"out", detail::byte_span(out)}, {"lse", detail::byte_span(lse)}},
                         {{"ALiBi slopes", detail::byte_span(options.alibi.slopes)},
                          {"sink logits", detail::byte_span(options.sinks.logits)}});
  if (static_cast<int64_t>(lengths.size()) != B)
    fail(fn, ": lengths has ", lengths.size(), " entries, expected one per sequence (", B, ")");
  if (!q_start.empty() && static_cast<int64_t>(q_start.size()) != B)
    fail(fn, ": q_start has ", q_start.size(), " entries, expected one per sequence (", B, ")");
  if (table_width < 0) fail(fn, ": table_width must be ≥ 0, got ", table_width);
  // Products formed checked: B × table_width past int64 wrapped to a small count that matched.
  const int64_t table_positions =
      checked_mul(table_width, c.block_size, std::string(fn) + ": table_width × block_size");
  if (static_cast<int64_t>(block_tables.size()) != checked_mul(B, table_width, std::string(fn) + ": B × table_width"))
    fail(fn, ": block_tables has ", block_tables.size(), " entries, expected B × table_width = ", B, " × ",
         table_width);
  detail::check_window(fn, options.window);
  if (options.splits < 0) fail(fn, ": splits must be ≥ 0 (0 = auto), got ", options.splits);
  if (options.scale && !std::isfinite(*options.scale)) fail(fn, ": scale must be finite, got ", *options.scale);
  const kernels::ScoreEdits edits = detail::check_score_edits(fn, H, options.alibi, options.softcap, options.sinks);
  std::vector<int64_t> first(static_cast<size_t>(B), 0), end(static_cast<size_t>(B)), start(static_cast<size_t>(B));
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    const size_t i = static_cast<size_t>(b);
    const int64_t len = lengths[i];
    if (len < 0 || len > table_positions)
      fail(fn, ": lengths[", b, "] = ", len, " is outside [0, ", table_positions, "] (table_width ", table_width,
           " × block_size ", c.block_size, ")");
    for (int64_t j = 0; j < (len + c.block_size - 1) / c.block_size; ++j) {
      const int32_t blk = block_tables[static_cast<size_t>(b * table_width + j)];
      if (blk < 0 || blk >= c.num_blocks)
        fail(fn, ": block_tables[", b, "][", j, "] = ", blk, " points outside the pool of ", c.num_blocks, " blocks");
    }
    end[i] = len;
    start[i] = q_start.empty() ? len : q_start[i];
    detail::check_q_start(fn, b, start[i], Tq);
    longest = std::max(longest, len);
  }
  if (B * H * Tq == 0) return;
  if (!q.defined() || !out.defined()) fail(fn, ": query or output has no data");
  kernels::DecodeParams p;
  p.q = q;
  p.k = cache.k_data();
  p.v = cache.v_data();
  p.dtype = detail::kernel_dtype(c.dtype);
  p.k_scale = cache.k_scales();
  p.v_scale = cache.v_scales();
  p.k_transposed = c.transposed_keys();
  p.k_slots = c.block_size;  // transposed keys: tiles per (block, head)
  p.kv_heads = c.kv_heads;
  p.capacity = table_positions;
  p.d_v = c.v_dim();
  p.block_table = block_tables.data();
  p.table_stride = table_width;
  p.block_size = c.block_size;
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

}  // namespace

void attend_paged_blocks(View4<const float> q, const PagedKvCache& cache, std::span<const int32_t> block_tables,
                         int64_t table_width, std::span<const int64_t> lengths, std::span<const int64_t> q_start,
                         const CacheAttentionOptions& options, View4<float> out, View4<float> lse) {
  attend_paged("attend_paged_blocks", q, cache, block_tables, table_width, lengths, q_start, options, out, lse);
}

void attend_paged_cache(View4<const float> q, const PagedKvCache& cache, std::span<const int64_t> seqs,
                        std::span<const int64_t> q_start, const CacheAttentionOptions& options, View4<float> out,
                        View4<float> lse) {
  const int64_t B = q.shape[0];
  if (static_cast<int64_t>(seqs.size()) != B)
    fail("attend_paged_cache: ", seqs.size(), " sequence ids for a query batch of ", B);
  int64_t width = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t id = seqs[static_cast<size_t>(b)];
    if (!cache.alive(id))
      fail("attend_paged_cache: seqs[", b, "] = ", id, " is not a live sequence of the paged cache");
    width = std::max<int64_t>(width, static_cast<int64_t>(cache.block_table(id).size()));
  }
  std::vector<int32_t> tables(static_cast<size_t>(B * width), 0);
  std::vector<int64_t> lengths(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const std::span<const int32_t> t = cache.block_table(seqs[static_cast<size_t>(b)]);
    std::copy(t.begin(), t.end(), tables.begin() + b * width);
    lengths[static_cast<size_t>(b)] = cache.length(seqs[static_cast<size_t>(b)]);
  }
  attend_paged("attend_paged_cache", q, cache, tables, width, lengths, q_start, options, out, lse);
}

}  // namespace mha
