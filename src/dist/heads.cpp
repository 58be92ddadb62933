// Tensor-parallel heads for the module: each rank keeps h/P query heads and their kv/P K/V heads
// (prune_heads removes the others exactly: rows of W_Q, W_K, W_V and of the input bias, columns of
// W_O), computes its heads' contribution to the output projection, and one MPI_Allreduce sums them.
// Rank 0 alone keeps out_proj.bias, so the sum adds it once.
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "dist/dist_internal.h"
#include "mha/dist.h"
#include "mha/error.h"
#include "mha/prune.h"

namespace mha::dist {

namespace {

MultiheadAttention make_shard(MPI_Comm comm, const MultiheadAttention& full, int64_t* first_head) {
  const int P = comm_size(comm), me = comm_rank(comm);
  const MhaConfig& c = full.config();
  std::string err;
  if (c.kv_heads() % P != 0)
    err = "TensorParallelAttention: " + std::to_string(P) + " ranks must divide the K/V head count " +
          std::to_string(c.kv_heads()) + " (num_heads " + std::to_string(c.num_heads) + ")";
  check_collectively(comm, err);
  // Every field that changes the numbers, to the bit: RoPE's θ, rotated width and pairing as well
  // as whether it is on, and each ALiBi slope in its head's place (a sum of their bits let ranks
  // with the slopes of two heads swapped pass, and each rank's heads took other slopes).
  int64_t theta_bits = 0;
  static_assert(sizeof theta_bits == sizeof c.rope.theta);
  std::memcpy(&theta_bits, &c.rope.theta, sizeof theta_bits);
  std::vector<int64_t> signature = {c.embed_dim,
                                    c.num_heads,
                                    c.kv_heads(),
                                    c.head_dim(),
                                    c.key_dim(),
                                    c.value_dim(),
                                    c.bias ? 1 : 0,
                                    c.add_bias_kv ? 1 : 0,
                                    c.add_zero_attn ? 1 : 0,
                                    static_cast<int64_t>(c.layout),
                                    c.rope.enabled ? 1 : 0,
                                    c.rope.enabled ? theta_bits : 0,
                                    c.rope.enabled ? c.rope.rotary_dims(c.head_dim()) : 0,
                                    c.rope.enabled ? static_cast<int64_t>(c.rope.pairing) : 0,
                                    float_bits(c.scale),
                                    float_bits(c.softcap),
                                    float_bits(c.dropout),
                                    c.attention_sinks ? 1 : 0,
                                    static_cast<int64_t>(c.alibi_slopes.size())};
  check_same_everywhere(comm, signature,
                        "TensorParallelAttention: module configuration (E, h, kv, d, kdim, vdim, bias, bias_kv, "
                        "zero_attn, layout, rope and its theta, dims and pairing, scale, softcap, dropout, sinks, "
                        "number of ALiBi slopes)");
  // The slopes apart, now that their count agrees (so both ranks' values are shown).
  std::vector<int64_t> slopes;
  for (const float s : c.alibi_slopes) slopes.push_back(float_bits(s));
  check_same_everywhere(comm, slopes, "TensorParallelAttention: ALiBi slopes (bits, by head)");
  const int64_t per = c.num_heads / P;
  *first_head = me * per;
  std::vector<int64_t> drop;
  for (int64_t i = 0; i < c.num_heads; ++i)
    if (i < *first_head || i >= *first_head + per) drop.push_back(i);
  // The parameters are this rank's alone: one whose shapes do not fit the (agreed) configuration
  // made prune_heads throw there only, and the other ranks, constructed, waited for it in their
  // first forward() for ever. Checked here and shared, so every rank throws.
  std::optional<MultiheadAttention> shard;
  err.clear();
  try {
    full.check_params();
    shard.emplace(drop.empty() ? full : prune_heads(full, drop));
  } catch (const Error& e) {
    err = std::string("TensorParallelAttention: ") + e.what();
  }
  check_collectively(comm, err);
  if (me != 0 && shard->params().out_proj_bias.defined())
    std::fill(shard->params().out_proj_bias.values().begin(), shard->params().out_proj_bias.values().end(), 0.0f);
  return std::move(*shard);
}

/// Every rank's (B, h/P, T_q) log-sum-exp ((h/P, T_q) unbatched), rank r's heads being r·h/P on,
/// as the whole (B, h, T_q): what the single-process module returns.
Tensor gather_heads(MPI_Comm comm, const Tensor& local) {
  const int P = comm_size(comm);
  const bool batched = local.dim() == 3;
  const int64_t B = batched ? local.size(0) : 1, Hp = local.size(batched ? 1 : 0), T = local.size(batched ? 2 : 1);
  const int64_t n = local.numel();
  Tensor all({P * n});
  MPI_Allgather(local.data(), mpi_count(n, "TensorParallelAttention::forward: lse"), MPI_FLOAT, all.data(),
                static_cast<int>(n), MPI_FLOAT, comm);
  Tensor out(batched ? Shape{B, P * Hp, T} : Shape{P * Hp, T});
  for (int64_t r = 0; r < P; ++r)
    for (int64_t b = 0; b < B; ++b)
      std::copy_n(all.data() + r * n + b * Hp * T, Hp * T, out.data() + (b * P * Hp + r * Hp) * T);
  return out;
}

}  // namespace

TensorParallelAttention::TensorParallelAttention(MPI_Comm comm, const MultiheadAttention& full)
    : comm_(comm), shard_(make_shard(comm, full, &first_head_)) {}

MhaOutput TensorParallelAttention::forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                           const MhaForwardOptions& options) const {
  std::string err;
  if (options.need_weights != NeedWeights::None)
    err = "TensorParallelAttention::forward: attention weights are not supported (need_weights must be None)";
  else if (options.mode == Mode::Training && shard_.config().dropout > 0.0f)
    err =
        "TensorParallelAttention::forward: dropout in training mode is not supported (its per-head keys would "
        "change with the shard)";
  else if (options.attn_mask.present() && (options.attn_mask.allowed.defined() ? options.attn_mask.allowed.dim()
                                                                               : options.attn_mask.additive.dim()) == 3)
    err =
        "TensorParallelAttention::forward: per-head (B·h, T_q, T_k) attention masks are not supported; pass a "
        "(T_q, T_k) mask";
  check_collectively(comm_, err);
  std::vector<int64_t> shapes;
  for (const Tensor* t : {&query, &key, &value}) {
    shapes.push_back(t->dim());
    for (int64_t i = 0; i < 4; ++i) shapes.push_back(i < t->dim() ? t->size(i) : -1);
  }
  check_same_everywhere(comm_, shapes, "TensorParallelAttention::forward: input shapes (query, key, value)");
  // Every rank computes its heads' share of one attention: the options that shape it must agree
  // (a rank alone with a causal mask summed into the others' output gave neither answer).
  const auto mask_signature = [](const Tensor& a, const BoolTensor& b, std::vector<int64_t>* out) {
    out->push_back(a.defined() ? 1 : b.defined() ? 2 : 0);
    const int64_t rank = a.defined() ? a.dim() : b.defined() ? b.dim() : 0;
    out->push_back(rank);
    for (int64_t i = 0; i < 4; ++i)  // a fixed count (masks have at most 3 dims): a count that differs is its own error
      out->push_back(i >= rank ? -1 : a.defined() ? a.size(i) : b.size(i));
  };
  std::vector<int64_t> same;
  mask_signature(options.attn_mask.additive, options.attn_mask.allowed, &same);
  mask_signature(options.key_padding_mask.additive, options.key_padding_mask.is_padding, &same);
  for (const int64_t x : causal_signature(options.causal)) same.push_back(x);
  for (const int64_t x :
       {int64_t{options.need_lse ? 1 : 0}, static_cast<int64_t>(options.mode), int64_t{options.packed ? 1 : 0}})
    same.push_back(x);
  check_same_everywhere(comm_, same,
                        "TensorParallelAttention::forward: options (attn_mask, key_padding_mask, causal, offset, "
                        "window, need_lse, mode, packed)");
  // A packed batch's offsets place every sequence, as B and T do a padded one's: ranks whose
  // offsets differ each attended within other sequences, and the sum was neither answer (the
  // packed flag alone was compared). Their counts and bounds first, then the offsets themselves
  // (equal in number by then), so that a mismatch shows both ranks' lists.
  if (options.packed) {
    const VarlenBatch& vb = *options.packed;
    const std::vector<int64_t>& q_offsets = vb.cu_seqlens_q.values();
    const std::vector<int64_t>& k_offsets = vb.cu_seqlens_k.values();
    check_same_everywhere(comm_,
                          {static_cast<int64_t>(q_offsets.size()), static_cast<int64_t>(k_offsets.size()),
                           vb.max_seqlen_q, vb.max_seqlen_k},
                          "TensorParallelAttention::forward: packed batch (number of cu_seqlens_q and cu_seqlens_k "
                          "offsets, max_seqlen_q, max_seqlen_k)");
    check_same_everywhere(comm_, q_offsets, "TensorParallelAttention::forward: packed batch's cu_seqlens_q");
    check_same_everywhere(comm_, k_offsets, "TensorParallelAttention::forward: packed batch's cu_seqlens_k");
  }
  MhaOutput out;
  err.clear();
  try {
    out = shard_.forward(query, key, value, options);
  } catch (const Error& e) {
    err = e.what();
  }
  check_collectively(comm_, err);
  MPI_Allreduce(MPI_IN_PLACE, out.output.data(), mpi_count(out.output.numel(), "TensorParallelAttention::forward"),
                MPI_FLOAT, MPI_SUM, comm_);
  if (options.need_lse) out.lse = gather_heads(comm_, out.lse);
  return out;
}

}  // namespace mha::dist
