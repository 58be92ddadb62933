// kernels/masking.h — the causal / sliding-window rule, in one place for every kernel.
//
// Key j is visible to query i iff
//     j ≤ i + offset   and   (window == 0  or  j > i + offset − window)
// (mha/masks.h, Causal). Indices are rows of Q and K, or absolute positions with offset 0 when
// decoding against a cache. Kernels ask three questions of the rule: does query i see key j
// (per-element masking); which keys can some row of a query block see (the key loop's bounds);
// and is a (query block × key block) tile hidden, partly visible or wholly visible (skip it, mask
// it element by element, or use it with no per-element causal checks).
#pragma once

#include <algorithm>
#include <cstdint>

#include "mha/masks.h"

namespace mha::kernels {

/// How a tile of query rows × keys meets the rule.
enum class TileVis : uint8_t {
  None,     ///< no query of the tile sees any of its keys: skip it
  Partial,  ///< some pairs are hidden: mask element by element
  All,      ///< every query sees every key: no per-element causal checks
};

/// Keys [lo, hi); empty when hi == lo.
struct KeyRange {
  int64_t lo = 0, hi = 0;
};

struct CausalRule {
  bool on = false;     ///< false: every key is visible
  int64_t offset = 0;  ///< query i's last visible key is i + offset
  int64_t window = 0;  ///< > 0: only the last `window` keys up to that one; 0 = unlimited

  /// The rule of a causal mask for T_q queries against T_k keys.
  static CausalRule of(const Causal& c, int64_t t_q, int64_t t_k) {
    return {c.enabled(), c.offset_for(t_q, t_k), c.window};
  }
  /// Decoding: query and key are absolute positions, so the offset is 0.
  static CausalRule positions(int64_t window) { return {true, 0, window}; }

  /// Whether query i sees key j.
  bool sees(int64_t i, int64_t j) const { return !on || (j <= i + offset && (window == 0 || j > i + offset - window)); }

  /// The keys of [k_lo, k_hi) that some query of [i0, i1) (i1 > i0) sees:
  /// (i0 + offset − window, i1 − 1 + offset] ∩ [k_lo, k_hi). Every key of the result is seen by
  /// at least one of the queries, so a key loop over it skips nothing that matters. The result
  /// always lies within [k_lo, k_hi): an empty one where a window's lower edge is past k_hi
  /// (top-left, T_q > T_k + window) is [k_hi, k_hi), so callers may use its ends as indices.
  KeyRange visible_keys(int64_t i0, int64_t i1, int64_t k_lo, int64_t k_hi) const {
    int64_t lo = k_lo, hi = k_hi;
    if (on) {
      hi = std::min(hi, i1 + offset);
      if (window > 0) lo = std::min(k_hi, std::max(lo, i0 + offset - window + 1));
    }
    return {lo, std::max(lo, hi)};
  }

  /// Queries [i0, i1) × keys [j0, j1), both non-empty.
  TileVis tile(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    if (!on) return TileVis::All;
    const int64_t last_q = i1 - 1, last_k = j1 - 1;
    if (j0 > last_q + offset) return TileVis::None;                          // every key after every query's limit
    if (window > 0 && last_k <= i0 + offset - window) return TileVis::None;  // every key before every window
    const bool below = last_k <= i0 + offset;                                // the first query sees the last key
    const bool inside = window == 0 || j0 > last_q + offset - window;        // the last query sees the first key
    return below && inside ? TileVis::All : TileVis::Partial;
  }
};

}  // namespace mha::kernels
