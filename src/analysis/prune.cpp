// analysis/prune.cpp — head pruning and ablation importance (mha/prune.h).
#include "mha/prune.h"

#include <cmath>
#include <numeric>
#include <sstream>

namespace mha {

namespace {

std::string list_str(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << ']';
  return os.str();
}

/// pruned[i] = true for each head in `heads`, after checking range and repeats.
std::vector<bool> pruned_mask(const char* fn, const MhaConfig& c, const std::vector<int64_t>& heads) {
  std::vector<bool> pruned(static_cast<size_t>(c.num_heads), false);
  for (int64_t head : heads) {
    if (head < 0 || head >= c.num_heads)
      fail(fn, ": head ", head, " in heads ", list_str(heads), " is out of range [0, ", c.num_heads, ")");
    if (pruned[static_cast<size_t>(head)]) fail(fn, ": head ", head, " appears twice in heads ", list_str(heads));
    pruned[static_cast<size_t>(head)] = true;
  }
  return pruned;
}

/// Appends rows [block·d, (block+1)·d) of a row-major (·, cols) matrix for each block, in order.
void gather_blocks(const float* src, int64_t cols, int64_t d, const std::vector<int64_t>& blocks,
                   TensorStorage<float>& dst) {
  for (int64_t block : blocks) {
    const float* begin = src + block * d * cols;
    dst.insert(dst.end(), begin, begin + d * cols);
  }
}

Tensor gathered(const Tensor& src, int64_t d, const std::vector<int64_t>& blocks, const Shape& shape) {
  TensorStorage<float> out;
  gather_blocks(src.data(), src.numel() / src.size(0), d, blocks, out);
  return Tensor(shape, std::move(out));
}

}  // namespace

MultiheadAttention prune_heads(const MultiheadAttention& module, const std::vector<int64_t>& heads,
                               const PruneOptions& options) {
  constexpr const char* kFn = "prune_heads";
  if (options.uneven_groups != UnevenGroups::Refuse && options.uneven_groups != UnevenGroups::DuplicateKV)
    fail(kFn, ": uneven_groups ", static_cast<int>(options.uneven_groups),
         " is not an UnevenGroups (Refuse or DuplicateKV)");
  module.check_params();
  const MhaConfig& c = module.config();
  const MhaParameters& p = module.params();
  const int64_t E = c.embed_dim, d = c.head_dim(), H = c.num_heads, KV = c.kv_heads(), r = H / KV;
  const std::vector<bool> pruned = pruned_mask(kFn, c, heads);
  if (static_cast<int64_t>(heads.size()) == H)
    fail(kFn, ": cannot prune every head (heads ", list_str(heads), " of num_heads ", H,
         "): the module would have no heads left");

  // Surviving query heads per K/V group.
  std::vector<std::vector<int64_t>> kept(static_cast<size_t>(KV));
  for (int64_t i = 0; i < H; ++i)
    if (!pruned[static_cast<size_t>(i)]) kept[static_cast<size_t>(i / r)].push_back(i);
  int64_t per_copy = 0;  // query heads per K/V head in the result: gcd of the surviving counts
  bool uneven = false;
  for (const auto& group : kept) {
    if (group.empty()) continue;
    const auto n = static_cast<int64_t>(group.size());
    if (per_copy != 0 && n != per_copy) uneven = true;
    per_copy = std::gcd(per_copy, n);
  }
  if (uneven && options.uneven_groups == UnevenGroups::Refuse) {
    std::ostringstream os;
    for (int64_t g = 0; g < KV; ++g) {
      const auto& group = kept[static_cast<size_t>(g)];
      os << (g ? "; " : "") << "group " << g << " (heads " << g * r << ".." << (g + 1) * r - 1 << ") keeps "
         << group.size() << ' ' << list_str(group);
    }
    fail(kFn, ": pruning heads ", list_str(heads), " of a grouped-query module (num_heads ", H, ", num_kv_heads ", KV,
         ") leaves K/V groups with different numbers of query heads: ", os.str(),
         ". Prune whole groups or the same number of heads from each, or duplicate the shared K/V heads "
         "(UnevenGroups::DuplicateKV; mha prune --duplicate-kv; Python duplicate_kv=True)");
  }

  // The result's query heads (kept, in order) and K/V heads (source group of each copy).
  std::vector<int64_t> q_heads, kv_heads;
  for (int64_t g = 0; g < KV; ++g) {
    const auto& group = kept[static_cast<size_t>(g)];
    q_heads.insert(q_heads.end(), group.begin(), group.end());
    for (size_t n = 0; n < group.size() / static_cast<size_t>(std::max<int64_t>(per_copy, 1)); ++n)
      kv_heads.push_back(g);
  }
  const auto H2 = static_cast<int64_t>(q_heads.size()), KV2 = static_cast<int64_t>(kv_heads.size());

  MhaConfig c2 = c;
  c2.num_heads = H2;
  c2.num_kv_heads = KV2 == H2 ? 0 : KV2;
  c2.head_dim_override = d;
  // Per-head score edits follow their heads: ALiBi slopes and sink logits of the kept heads.
  if (!c.alibi_slopes.empty()) {
    c2.alibi_slopes.clear();
    for (int64_t h : q_heads) c2.alibi_slopes.push_back(c.alibi_slopes[static_cast<size_t>(h)]);
  }
  MultiheadAttention result(c2);
  MhaParameters& q = result.params();

  if (c.packed_in_proj()) {
    // in_proj_weight rows: [Q heads 0..H) [K heads 0..KV) [V heads 0..KV), d rows each.
    std::vector<int64_t> blocks = q_heads;
    for (int64_t g : kv_heads) blocks.push_back(H + g);
    for (int64_t g : kv_heads) blocks.push_back(H + KV + g);
    q.in_proj_weight = gathered(p.in_proj_weight, d, blocks, {(H2 + 2 * KV2) * d, E});
  } else {
    q.q_proj_weight = gathered(p.q_proj_weight, d, q_heads, {H2 * d, E});
    q.k_proj_weight = gathered(p.k_proj_weight, d, kv_heads, {KV2 * d, c.key_dim()});
    q.v_proj_weight = gathered(p.v_proj_weight, d, kv_heads, {KV2 * d, c.value_dim()});
  }
  if (c.bias) {
    std::vector<int64_t> blocks = q_heads;
    for (int64_t g : kv_heads) blocks.push_back(H + g);
    for (int64_t g : kv_heads) blocks.push_back(H + KV + g);
    q.in_proj_bias = gathered(p.in_proj_bias.reshaped({p.in_proj_bias.numel(), 1}), d, blocks, {(H2 + 2 * KV2) * d});
    q.out_proj_bias = p.out_proj_bias;
  }
  if (c.attention_sinks)
    for (int64_t n = 0; n < H2; ++n) q.sinks.data()[n] = p.sinks.data()[q_heads[static_cast<size_t>(n)]];
  if (c.add_bias_kv) {
    q.bias_k = gathered(p.bias_k.reshaped({KV * d, 1}), d, kv_heads, {1, 1, KV2 * d});
    q.bias_v = gathered(p.bias_v.reshaped({KV * d, 1}), d, kv_heads, {1, 1, KV2 * d});
  }
  // W_O (E, H·d): keep the kept heads' column blocks, row by row.
  q.out_proj_weight = Tensor({E, H2 * d});
  for (int64_t row = 0; row < E; ++row)
    for (int64_t n = 0; n < H2; ++n) {
      const float* src = p.out_proj_weight.data() + row * H * d + q_heads[static_cast<size_t>(n)] * d;
      std::copy(src, src + d, q.out_proj_weight.data() + row * H2 * d + n * d);
    }
  result.check_params();
  return result;
}

MultiheadAttention ablate_heads(const MultiheadAttention& module, const std::vector<int64_t>& heads) {
  module.check_params();
  const MhaConfig& c = module.config();
  const std::vector<bool> pruned = pruned_mask("ablate_heads", c, heads);
  MultiheadAttention result = module;
  const int64_t E = c.embed_dim, d = c.head_dim(), H = c.num_heads;
  float* wo = result.params().out_proj_weight.data();
  for (int64_t row = 0; row < E; ++row)
    for (int64_t h = 0; h < H; ++h)
      if (pruned[static_cast<size_t>(h)]) std::fill(wo + row * H * d + h * d, wo + row * H * d + (h + 1) * d, 0.0f);
  return result;
}

std::vector<double> head_importance(const MultiheadAttention& module, const Tensor& query, const Tensor& key,
                                    const Tensor& value, const MhaForwardOptions& options) {
  MhaForwardOptions opt = options;
  opt.need_weights = NeedWeights::None;
  const Tensor y = module.forward(query, key, value, opt).output;
  double norm = 0;
  for (float x : y.values()) norm += static_cast<double>(x) * x;
  norm = std::sqrt(norm);
  std::vector<double> importance;
  for (int64_t h = 0; h < module.config().num_heads; ++h) {
    const Tensor ya = ablate_heads(module, {h}).forward(query, key, value, opt).output;
    double diff = 0;
    for (int64_t n = 0; n < y.numel(); ++n) {
      const double e = static_cast<double>(y.data()[n]) - ya.data()[n];
      diff += e * e;
    }
    diff = std::sqrt(diff);
    importance.push_back(norm > 0 ? diff / norm : diff);
  }
  return importance;
}

}  // namespace mha
