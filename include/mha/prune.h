// mha/prune.h — removing attention heads, and measuring what each head contributes.
//
// prune_heads returns a smaller module whose output equals the original's with the pruned heads'
// contributions zeroed (their columns of W_O set to 0), for every input and mask that does not
// depend on the head index. It removes the pruned heads' rows of W_Q (and of the Q part of
// in_proj_bias) and their columns of W_O. The head dim d stays; since h'·d ≠ E afterwards, the
// result sets MhaConfig::head_dim_override = d.
//
// Grouped-query attention (kv < h, groups of r = h / kv consecutive query heads share a K/V head):
// a group's K/V rows (and bias_k / bias_v entries) are removed when all of its query heads are
// pruned, and kept otherwise. The result needs every surviving group to keep the same number of
// query heads (contiguous equal groups: docs/semantics.md, 'Grouped-query attention'). When they would differ:
//   UnevenGroups::Refuse       (default) throws mha::Error naming each group and its surviving heads;
//   UnevenGroups::DuplicateKV  stays exact by splitting each surviving group into copies of its K/V
//                              head, g = gcd of the surviving counts query heads per copy. The KV
//                              cache then holds duplicates (it may even grow), so this is opt-in.
// Pruning every head, a head index out of [0, h), or a repeated index is refused with mha::Error.
// Per-head attention masks ((B·h, T_q, T_k) attn_mask) must be sliced by the caller to the kept heads.
#pragma once

#include <cstdint>
#include <vector>

#include "mha/module.h"

namespace mha {

enum class UnevenGroups : uint8_t { Refuse, DuplicateKV };

struct PruneOptions {
  UnevenGroups uneven_groups = UnevenGroups::Refuse;
};

/// A new module without `heads` (original head indices, any order). The kept heads keep their order.
[[nodiscard]] MultiheadAttention prune_heads(const MultiheadAttention& module, const std::vector<int64_t>& heads,
                                             const PruneOptions& options = {});

/// The same module with `heads`' columns of W_O set to zero: what prune_heads must equal. Same
/// validation of `heads` as prune_heads (an empty list and every head are allowed here).
[[nodiscard]] MultiheadAttention ablate_heads(const MultiheadAttention& module, const std::vector<int64_t>& heads);

/// Importance of each head by ablation: ‖y − y₋ᵢ‖₂ / ‖y‖₂, where y is the module's output on
/// these inputs and y₋ᵢ the output with head i's contribution zeroed (ablate_heads). When ‖y‖₂ = 0
/// the absolute change ‖y − y₋ᵢ‖₂ is returned. need_weights in `options` is ignored.
std::vector<double> head_importance(const MultiheadAttention& module, const Tensor& query, const Tensor& key,
                                    const Tensor& value, const MhaForwardOptions& options = {});

}  // namespace mha
