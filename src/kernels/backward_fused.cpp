// kernels/backward_fused.cpp — the fused FlashAttention-2 style backward pass of SDPA.
//
// Shapes: Q (B, h, T_q, d), K (B, kv, T_k, d), V (B, kv, T_k, d_v), O and dO (B, h, T_q, d_v),
// lse (B, h, T_q, 1); dQ like Q, dK like K, dV like V. Query head i reads K/V head i / group.
//
// Blocking and memory traffic. The scores are recomputed block by block — kBr queries × kBc keys —
// from Q, K and the forward's lse, so nothing of size T_q × T_k exists: per block
//   S  = scale · Q_i K_jᵀ (+ masks)          P  = exp(S − lse)        (forward step "scores, softmax")
//   dP̃ = dO_i V_jᵀ                           dP = dP̃ ∘ keep/(1 − p)   (forward step "dropout")
//   dS = P ∘ (dP − D),  D = rowsum(dO ∘ O)                          (softmax backward)
//   dV_j += P̃ᵀ dO_i    dK_j += scale · dSᵀ Q_i    dQ_i += scale · dS K_j
// The five products are register-tiled Highway micro-GEMMs (block_gemm: kMR rows × 4 vectors of
// accumulators, one call per product, no library call overhead or packing of its own); each key
// block's K and V are transposed once into scratch (for S = Q·Kᵀ and dP̃ = dO·Vᵀ) and reused by
// every query block and head of the group. The elementwise steps are Highway vectors too, all
// dispatched once per call. Block sizes are chosen for L2: a block's operands — kBr rows of Q
// and dO, kBc rows of K and V and their transposes, three kBr × kBc score buffers and the kBc-row
// dK/dV accumulators — come to about 180 KiB at d = 64 and 250 KiB at d = 128, so all five
// products of a block run from L2 (1 MiB per core on the Zen 4 this project targets).
//
// Ownership and determinism. A key block's dK/dV rows are a sum over every query head of the
// group (GQA) of that head's share, each share summed over the query blocks in order, and the
// shares added in head order; dQ is accumulated in key-block order for each query block. Three
// ways to split the work (Scheme): when B·kv offers enough parallelism, one item per (batch,
// kv-head) walks its key blocks in order and adds into dQ directly (5 products); else, with GQA,
// one item per (batch, query head) does the same for its head and keeps its shares, summed per
// key block afterwards; else items are (batch, kv-head, key block) for dK/dV, and a second pass
// over (batch, head, query block) recomputes P and dS to accumulate dQ (7 products). All three
// perform the same floating-point operations in the same order per output element, so results are
// bitwise identical for any thread count.
//
// A row whose |lse| is 64 or more (scores that all sit near −1e9 under a finite mask, or share a
// large offset) first gets its sum over the keys recomputed (refine_lse), so that its P sums to 1
// as the forward's did: float32 lse = m + log l rounds log l away there.
//
// Masks: causal blocks that no (query, key) pair can see are skipped; blocks that straddle the
// diagonal or the window edge run their products in groups of 16 rows and keys, each over only
// the pairs it can see (run_block), and are masked with a vector cut per row; any block when a
// per-element mask exists is masked with key_hidden(), the rule every kernel shares. Padded keys
// (and keys whose key_bias is −inf) are never read: a block with such keys copies its K/V rows
// with zeros in their place, and their dK/dV rows come out 0. Rows whose lse is −inf (fully masked) get P = 0, hence
// zero gradient; rows whose lse is NaN (a visible NaN in the forward) get P = NaN on their visible keys, so the NaN
// reaches dQ, dK and dV as it would by differentiating the forward (docs/semantics.md, 'NaN').
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/attention_backward.h"
#include "kernels/backward_fused.h"
#include "kernels/common.h"
#include "kernels/dropout_rng.h"
#include "kernels/entry_checks.h"
#include "kernels/masking.h"
#include "kernels/varlen.h"

#ifndef MHA_BACKWARD_FUSED_ONCE
#define MHA_BACKWARD_FUSED_ONCE
namespace mha::kernels::bwd {

constexpr int64_t kBc = 64;       // keys per block (also the scores' row stride)
constexpr int64_t kCutRows = 16;  // rows (and keys) per group of a block cut by the causal diagonal

/// |lse| from which a row's probabilities are renormalised before use (refine_lse). P = exp(S −
/// lse) with the forward's float32 lse is off by a factor exp(±ulp(lse)/2) for the whole row: up to
/// 3.8e-6 below 64, as much as S's own rounding there; but a row whose scores all sit near −1e9 (a
/// whole row under a finite −1e9 or finfo.min mask) or carry a large common offset has lse within an
/// ulp of its max, log Σ lost: its P summed to T_k instead of 1 (dV 4× too large at T_k = 4).
constexpr float kLseRefine = 64.0f;

/// Query rows per block: 64, fewer for wide heads so that kBr·kBc·max(d, d_v) ≤ 2¹⁸ (each product
/// at most 2¹⁸ multiply-adds): the Q and dO rows of a block shrink as d grows, keeping its
/// operands within L2 (see the top of this file).
inline int64_t block_rows(const SdpaParams& f) {
  const int64_t widest = std::max<int64_t>(1, std::max(f.d(), f.d_v()));
  return std::clamp<int64_t>(262144 / (kBc * widest), 1, 64);
}

/// One thread's scratch (offsets in floats, each region 64-byte aligned).
constexpr int64_t kMaxLanes = 16;  // widest vector of float (AVX-512): padded rows are a multiple

/// One thread's scratch (offsets in floats, each region 64-byte aligned). ldk / ldv: the padded
/// row length of d / d_v floats (a multiple of every target's vector), used by the transposed
/// and padded copies of the block's operands and by the dK/dV accumulators.
struct Scratch {
  int64_t s = 0, p = 0, pt = 0, cap = 0, k = 0, v = 0, kt = 0, vt = 0, kp = 0, qp = 0, dop = 0, dk = 0, dv = 0,
          dk_head = 0, dv_head = 0, total = 0;
  int64_t ldk = 0, ldv = 0;
};

inline Scratch scratch_for(const SdpaParams& f) {
  Scratch L;
  ScratchCarver c;
  const int64_t br = block_rows(f);
  L.ldk = round_up(f.d(), kMaxLanes);
  L.ldv = round_up(f.d_v(), kMaxLanes);
  L.s = c.take(br * kBc);                           // scores, then dS
  L.p = c.take(br * kBc);                           // P (before dropout)
  L.pt = c.take(br * kBc);                          // P̃ (after dropout) and dP
  L.cap = c.take(f.edits.capped() ? br * kBc : 0);  // softcap: 1 − tanh²(t / c) per score
  L.k = c.take(kBc * f.d());                        // K/V rows with zeros for padded keys
  L.v = c.take(kBc * f.d_v());
  L.kt = c.take(f.d() * kBc);  // Kᵀ and Vᵀ of the key block (d × kBc, zero past the block's keys)
  L.vt = c.take(f.d_v() * kBc);
  L.kp = c.take(kBc * L.ldk);  // K, Q and dO rows padded to whole vectors (when d is not a multiple)
  L.qp = c.take(br * L.ldk);
  L.dop = c.take(br * L.ldv);
  L.dk = c.take(kBc * L.ldk);
  L.dv = c.take(kBc * L.ldv);
  L.dk_head = c.take(f.group() > 1 ? kBc * L.ldk : 0);  // one query head's share of dK/dV (GQA)
  L.dv_head = c.take(f.group() > 1 ? kBc * L.ldv : 0);
  L.total = c.total();
  return L;
}

/// Whether Q and dO are copied once per call into dense rows (Shared): when the rows of either
/// lie further apart than their length, as inside a module's (N, 3·E) projection buffer or its
/// (N, E) head gradients. Copied block by block instead (whole_vectors), each query block's rows
/// were copied again for every key block: T / 64 copies of Q and dO, 3% of a module's training
/// step at T = 4096 on a Zen 1.
inline bool dense_rows(const SdpaBackwardParams& p) {
  return p.fwd.q.stride[2] != p.fwd.q.shape[3] || p.dout.stride[2] != p.dout.shape[3];
}

/// Whether dQ is accumulated in dense rows of the workspace (Shared) and copied out at the end:
/// when its rows lie further apart than their length (a module's (N, E) head gradients). A key
/// block's item walks every query block of the head, whose dQ rows (1 MiB at T = 4096, d = 64)
/// do not stay in L2; rows 2 KiB apart defeat the hardware's prefetcher, and asking for them
/// ahead (a query block's 256 lines in five bursts) stalled the core on full line-fill buffers.
/// Dense rows stream by themselves: a module's training step at T = 4096 (Intel Xeon, 1 / 2
/// threads) 933 / 497 → 875 / 458 ms, for an 8 MiB zero-fill and copy.
inline bool dense_dq(const SdpaBackwardParams& p) { return p.dq.stride[2] != p.dq.shape[3]; }

/// Which of the call's rows the workspace holds dense copies of.
struct DenseCopies {
  bool q_dout = false, dq = false;
};
inline DenseCopies dense_copies(const SdpaBackwardParams& p) { return {dense_rows(p), dense_dq(p)}; }

/// How the work is split between threads (every scheme gives the same bits: see the top of the file).
/// - PerKvHead: an item per (batch, kv-head) walks its key blocks in order, dQ added directly
///   (5 products per block); when B·kv offers enough items.
/// - PerHead (GQA and MQA): an item per (batch, query head) does the same for its head alone and
///   keeps the head's share of dK/dV; the shares are then summed over each group in head order.
///   Without it, B=1 with kv = 1 or 2 on 2 threads took TwoPass at 0.42–0.47 of the FMA peak
///   (against 0.72 for kv = h).
/// - TwoPass: items (batch, kv-head, key block) for dK/dV, then (batch, head, query block) for
///   dQ, which recompute P and dS (7 products per block).
enum class Scheme { PerKvHead, PerHead, TwoPass };
inline Scheme scheme_for(const SdpaParams& f) {
  const int64_t threads = std::max(1, f.threads);
  if (threads == 1 || f.batch() * f.kv_heads() >= 2 * threads) return Scheme::PerKvHead;
  if (f.group() > 1 && f.batch() * f.heads() >= 2 * threads) return Scheme::PerHead;
  return Scheme::TwoPass;
}

/// Where the shared part of the workspace lies (offsets in floats): D = rowsum(dO ∘ O) for every
/// (batch, head, query); with dense_rows, Q and dO of every (batch, head, query) in rows of
/// ldk / ldv floats, zero past d / d_v (the layout whole_vectors gives a block's rows); with
/// Scheme::PerHead, each (batch, query head)'s share of dK and dV, (B, h, T_k) rows of ldk / ldv;
/// with dense_dq, dQ of every (batch, head, query) in rows of ldk floats.
struct Shared {
  int64_t rowdot = 0, empty = 0, lse_lo = 0, lse_sum = 0, q = 0, dout = 0, dk_heads = 0, dv_heads = 0, dq = 0,
          total = 0;
};
inline Shared shared_for(const SdpaParams& f, DenseCopies dense) {
  Shared S;
  ScratchCarver c;
  const int64_t rows = f.batch() * f.heads() * f.t_q(), ldk = round_up(f.d(), kMaxLanes),
                ldv = round_up(f.d_v(), kMaxLanes);
  const int64_t key_rows = scheme_for(f) == Scheme::PerHead ? f.batch() * f.heads() * f.t_k() : 0;
  S.rowdot = c.take(rows);
  S.empty = c.take(rows);
  S.lse_lo = c.take(rows);
  S.lse_sum = c.take(rows);
  S.q = c.take(dense.q_dout ? rows * ldk : 0);
  S.dout = c.take(dense.q_dout ? rows * ldv : 0);
  S.dk_heads = c.take(key_rows * ldk);
  S.dv_heads = c.take(key_rows * ldv);
  S.dq = c.take(dense.dq ? rows * ldk : 0);
  S.total = c.total();
  return S;
}

/// Row i of (batch b, head h) in a (B, h, rows) array: the layout of every region of Shared.
inline int64_t head_row(const SdpaParams& f, int64_t b, int64_t h, int64_t rows, int64_t i) {
  return (b * f.heads() + h) * rows + i;
}

/// The whole workspace: the Shared part, then one Scratch per thread.
inline WorkspacePlan workspace_plan(const SdpaParams& f, DenseCopies dense) {
  return {shared_for(f, dense).total, scratch_for(f).total, std::max(1, f.threads)};
}

/// Everything a work item needs, computed once per call.
struct Ctx {
  const SdpaBackwardParams* p = nullptr;
  Scratch L;
  int64_t br = 64, n_qblocks = 0, n_kblocks = 0;
  CausalRule causal;
  bool element_masks = false;  // allowed / bias / key_bias: every block is masked element by element
  bool edit_scores = false;    // softcap or ALiBi: every score is edited (kernels/score_edits.h)
  int64_t alibi_offset = 0;
  float keep_scale = 1.0f;
  const float* rowdot = nullptr;  // D = rowsum(dO ∘ O), (B, h, T_q) contiguous
  const float* empty = nullptr;   // 1 where the row saw no key (row_saw_no_key), else 0; (B, h, T_q)
  const float* lse_lo = nullptr;  // refine_lse's correction of each row's lse (0 for most), (B, h, T_q)
  bool any_empty = false;         // whether any row of the call saw no key (most calls: none)
  // With dense_rows: Q and dO as (B, h, T_q) rows of L.ldk / L.ldv floats; else null.
  const float* dense_q = nullptr;
  const float* dense_dout = nullptr;
  // With dense_dq: dQ accumulated as (B, h, T_q) rows of L.ldk floats, copied out at the end; else null.
  float* dense_dq = nullptr;
  // Scheme::PerHead: each (batch, query head)'s share of dK and dV, (B, h, T_k) rows of L.ldk / L.ldv.
  float* dk_heads = nullptr;
  float* dv_heads = nullptr;
};

/// Q and dO into the dense rows of Shared (dense_rows), zero past d / d_v.
inline void copy_dense_rows(const SdpaBackwardParams& p, int64_t ldk, int64_t ldv, float* q, float* dout, int threads) {
  const SdpaParams& f = p.fwd;
  const int64_t B = f.batch(), H = f.heads(), Tq = f.t_q(), D = f.d(), Dv = f.d_v();
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t i = 0; i < Tq; ++i) {
      const float* qi = f.q.as<float>().row(b, h, i);
      const float* gi = p.dout.row(b, h, i);
      float* qd = q + (bh * Tq + i) * ldk;
      float* gd = dout + (bh * Tq + i) * ldv;
      std::copy(qi, qi + D, qd);
      std::fill(qd + D, qd + ldk, 0.0f);
      std::copy(gi, gi + Dv, gd);
      std::fill(gd + Dv, gd + ldv, 0.0f);
    }
  }
}

/// D_i = dO_i · O_i: the softmax backward's row term (Σ_j p_j dp_j equals it, dropout included).
/// NaN where dO_i holds ±inf: then every dp_j is ±inf or NaN and the reference's Σ_j p_j dp_j is
/// NaN or ±inf, so that every dS_ij = p_j(dp_j − D_i) of the row is NaN there; dO_i · O_i is
/// ±inf of one sign instead, which left dS (and dK, d sinks) ±inf for the keys of the other sign.
inline void row_dots(const SdpaBackwardParams& p, float* out, int threads) {
  const SdpaParams& f = p.fwd;
  const int64_t B = f.batch(), H = f.heads(), Tq = f.t_q(), Dv = f.d_v();
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t i = 0; i < Tq; ++i) {
      const float* o = p.out.row(b, h, i);
      const float* g = p.dout.row(b, h, i);
      double acc = 0.0, non_finite = 0.0;  // non_finite: 0, or NaN once g holds ±inf or NaN (0 · inf)
      for (int64_t c = 0; c < Dv; ++c) {
        acc += static_cast<double>(o[c]) * g[c];
        non_finite += 0.0 * g[c];
      }
      out[bh * Tq + i] = static_cast<float>(acc + non_finite);
    }
  }
}

/// out[(b·H + h)·T_q + i] = 1 where row (b, h, i) saw no key (row_saw_no_key), else 0; returns
/// whether any did.
inline bool empty_rows(const SdpaBackwardParams& p, float* out, int threads) {
  const SdpaParams& f = p.fwd;
  const int64_t H = f.heads(), Tq = f.t_q(), rows = f.batch() * H * Tq;
  int64_t count = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : count)
  for (int64_t r = 0; r < rows; ++r) {
    const bool none = row_saw_no_key(p, r / Tq / H, r / Tq % H, r % Tq);
    out[r] = none ? 1.0f : 0.0f;
    count += none ? 1 : 0;
  }
  return count > 0;
}

/// True when block [j0, j1) of batch b contains a key that is never read: padded, or with
/// key_bias −inf (key_dropped()).
inline bool has_padding(const SdpaParams& f, int64_t b, int64_t j0, int64_t j1) {
  if (!f.masks.key_padding.view.defined() && !f.masks.key_bias.view.defined()) return false;
  for (int64_t j = j0; j < j1; ++j)
    if (key_dropped(f.masks, b, j)) return true;
  return false;
}

/// Copies K/V rows [j0, j1) of head g into contiguous scratch with zeros for padded keys, whose
/// rows are never read (docs/semantics.md, 'Padded keys are never read').
inline void copy_unpadded(const SdpaParams& f, int64_t b, int64_t g, int64_t j0, int64_t j1, float* k, float* v) {
  const int64_t D = f.d(), Dv = f.d_v();
  for (int64_t j = j0; j < j1; ++j) {
    const bool pad = key_dropped(f.masks, b, j);
    float* kr = k + (j - j0) * D;
    float* vr = v + (j - j0) * Dv;
    if (pad) {
      std::fill(kr, kr + D, 0.0f);
      std::fill(vr, vr + Dv, 0.0f);
    } else {
      std::memcpy(kr, f.k.as<float>().row(b, g, j), static_cast<size_t>(D) * sizeof(float));
      std::memcpy(vr, f.v.as<float>().row(b, g, j), static_cast<size_t>(Dv) * sizeof(float));
    }
  }
}

}  // namespace mha::kernels::bwd
#endif  // MHA_BACKWARD_FUSED_ONCE

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/backward_fused.cpp"
#define HWY_DISABLED_TARGETS HWY_SSSE3
// foreach_target.h must come first: it re-includes this file once per target.
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/exp-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::bwd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using kernels::HWY_NAMESPACE::exp_nonpositive;

/// Softmax recomputed from the saved lse: P[r, :] = exp(S[r, :] − lse_r), with the forward's exp
/// (exp((S − lse_r) − lo_r) for a row refine_lse corrected, lo_r ≠ 0); 0 where S = −inf (and below
/// −87), and the whole row 0 when lse_r = −inf (fully masked).
HWY_INLINE void probabilities(const float* HWY_RESTRICT s, const float* lse, const float* lo, int64_t rows,
                              int64_t cols, float* HWY_RESTRICT prob) {
  const hn::ScalableTag<float> df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  for (int64_t r = 0; r < rows; ++r) {
    const float* sr = s + r * kBc;
    float* pr = prob + r * kBc;
    if (lse[r] == kNegInf) {
      std::fill(pr, pr + cols, 0.0f);
      continue;
    }
    if (std::isnan(lse[r])) {  // the forward saw a visible NaN: so does every visible P of the row
      for (int64_t c = 0; c < cols; ++c) pr[c] = sr[c] == kNegInf ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const auto m = hn::Set(df, lse[r]);
    if (lo[r] != 0.0f) {
      const auto lo_r = hn::Set(df, lo[r]);
      for (int64_t c = 0; c < cols; c += N)
        hn::StoreU(exp_nonpositive(df, hn::Sub(hn::Sub(hn::LoadU(df, sr + c), m), lo_r)), df, pr + c);
      continue;
    }
    for (int64_t c = 0; c < cols; c += N)
      hn::StoreU(exp_nonpositive(df, hn::Sub(hn::LoadU(df, sr + c), m)), df, pr + c);
  }
}

/// dS = P ∘ (dP − D_r), selected to 0 where P = 0 (masked keys, whose dP is never needed); a NaN P
/// (ordered compares are false for it) is kept.
HWY_INLINE void score_grads(const float* HWY_RESTRICT prob, const float* HWY_RESTRICT dp, const float* rowdot,
                            int64_t rows, int64_t cols, float* HWY_RESTRICT ds) {
  const hn::ScalableTag<float> df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto zero = hn::Zero(df);
  for (int64_t r = 0; r < rows; ++r) {
    const auto d = hn::Set(df, rowdot[r]);
    for (int64_t c = 0; c < cols; c += N) {
      const auto pv = hn::LoadU(df, prob + r * kBc + c);
      const auto g = hn::Mul(pv, hn::Sub(hn::LoadU(df, dp + r * kBc + c), d));
      hn::StoreU(hn::IfThenZeroElse(hn::Eq(pv, zero), g), df, ds + r * kBc + c);
    }
  }
}

// ---- the block products: register-tiled micro-GEMMs ------------------------------------------
// C (m × n) = alpha · A·B, or C += alpha · A·B, with A(i, r) = a[i·sai + r·sar] (so Aᵀ costs
// nothing) and B rows of whole vectors (ldb floats apart, readable up to n rounded up to a vector:
// the operands are padded copies or rows whose length is a multiple of the vector). Each element
// is Σ_r in order in a register, then added to C once: the same operations whatever the thread.
#if HWY_TARGET <= HWY_AVX3
constexpr int kMR = 6;  // 6 rows × 4 vectors = 24 accumulators of the 32 registers
#else
constexpr int kMR = 3;  // 3 rows × 4 vectors, within 16 registers
#endif
constexpr int kNV = 4;

struct Operands {
  const float* a;
  int64_t sai, sar;
  const float* b;
  int64_t ldb;
  float* c;
  int64_t ldc;
};

// Every loop over the tile's rows and vectors is unrolled: indexed by constants, the MR·NV
// accumulators stay in registers from the first product to the store (GCC 12 otherwise keeps the
// array on the stack around the loop over k). For the same reason the epilogue is straight-line:
// whether to add into C is a template parameter, and only the last vector of a row can be partial.
template <int MR, int NV, bool kAccumulate>
HWY_INLINE void gemm_tile(const Operands& o, int64_t k, float alpha, int64_t cols) {
  const hn::ScalableTag<float> df;
  using V = hn::Vec<decltype(df)>;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  V acc[MR][NV];
  HWY_UNROLL(8)
  for (int i = 0; i < MR; ++i) {
    HWY_UNROLL(4)
    for (int v = 0; v < NV; ++v) acc[i][v] = hn::Zero(df);
  }
  for (int64_t r = 0; r < k; ++r) {
    V bv[NV];
    HWY_UNROLL(4)
    for (int v = 0; v < NV; ++v) bv[v] = hn::LoadU(df, o.b + r * o.ldb + v * N);
    HWY_UNROLL(8)
    for (int i = 0; i < MR; ++i) {
      const V av = hn::Set(df, o.a[i * o.sai + r * o.sar]);
      HWY_UNROLL(4)
      for (int v = 0; v < NV; ++v) acc[i][v] = hn::MulAdd(av, bv[v], acc[i][v]);
    }
  }
  const V al = hn::Set(df, alpha);
  const auto scaled = [&](const V a, float* c) {
    return kAccumulate ? hn::MulAdd(al, a, hn::LoadU(df, c)) : hn::Mul(al, a);
  };
  const int64_t last_valid = cols - (NV - 1) * N;  // 1..N floats of each row's last vector
  HWY_UNROLL(8)
  for (int i = 0; i < MR; ++i) {
    float* ci = o.c + i * o.ldc;
    HWY_UNROLL(4)
    for (int v = 0; v + 1 < NV; ++v) hn::StoreU(scaled(acc[i][v], ci + v * N), df, ci + v * N);
    float* cl = ci + (NV - 1) * N;
    if (last_valid == N) {
      hn::StoreU(scaled(acc[i][NV - 1], cl), df, cl);
    } else {  // a partial vector: through a vector-sized buffer, so nothing past the row is touched
      HWY_ALIGN float tmp[kMaxLanes] = {};
      if constexpr (kAccumulate) std::copy(cl, cl + last_valid, tmp);
      hn::Store(scaled(acc[i][NV - 1], tmp), df, tmp);
      std::copy(tmp, tmp + last_valid, cl);
    }
  }
}

/// One tile of `rows` < kMR rows (the last rows of a product): MR chosen at run time.
template <int MR, int NV, bool kAccumulate>
HWY_INLINE void gemm_rest(int64_t rows, const Operands& o, int64_t k, float alpha, int64_t cols) {
  if constexpr (MR > 0) {
    if (rows == MR) return gemm_tile<MR, NV, kAccumulate>(o, k, alpha, cols);
    gemm_rest<MR - 1, NV, kAccumulate>(rows, o, k, alpha, cols);
  }
}

template <int NV, bool kAccumulate>
HWY_INLINE void gemm_rows(const Operands& o, int64_t m, int64_t k, float alpha, int64_t cols) {
  const auto at = [&](int64_t i) {
    Operands t = o;
    t.a += i * o.sai, t.c += i * o.ldc;
    return t;
  };
  int64_t i0 = 0;
  for (; i0 + kMR <= m; i0 += kMR) gemm_tile<kMR, NV, kAccumulate>(at(i0), k, alpha, cols);
  gemm_rest<kMR - 1, NV, kAccumulate>(m - i0, at(i0), k, alpha, cols);
}

/// A column strip of NV ≤ kNV vectors: NV chosen at run time.
template <int NV, bool kAccumulate>
HWY_INLINE void gemm_strip(int64_t nv, const Operands& o, int64_t m, int64_t k, float alpha, int64_t cols) {
  if constexpr (NV > 0) {
    if (nv == NV) return gemm_rows<NV, kAccumulate>(o, m, k, alpha, cols);
    gemm_strip<NV - 1, kAccumulate>(nv, o, m, k, alpha, cols);
  }
}

/// C (m × n) (+)= alpha · A·B over the operands above; k terms per element.
HWY_NOINLINE void block_gemm(const Operands& o, int64_t m, int64_t n, int64_t k, float alpha, bool accumulate) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(hn::ScalableTag<float>()));
  for (int64_t j0 = 0; j0 < n; j0 += kNV * N) {
    Operands t = o;
    t.b += j0, t.c += j0;
    const int64_t cols = std::min(kNV * N, n - j0);
    const int64_t nv = (cols + N - 1) / N;
    if (accumulate)
      gemm_strip<kNV, true>(nv, t, m, k, alpha, cols);
    else
      gemm_strip<kNV, false>(nv, t, m, k, alpha, cols);
  }
}

/// rows × width floats (ld apart) as dense operand rows: the rows themselves when they are dense
/// (ld = width) and whole vectors, else a copy padded with zeros to ldp (a multiple of every
/// vector). Rows a few KiB apart (Q, dO or K inside a module's (N, 3·E) projection buffer, or a
/// (B, T, h, d) layout) fall into a handful of cache sets, so a block's products, which read each
/// row again for every strip of columns, would miss L1 on every pass: copied once per block, they
/// cost a copy of br·d floats against five products of br·kBc·d multiply-adds.
HWY_INLINE const float* whole_vectors(const float* src, int64_t ld, int64_t rows, int64_t width, float* pad,
                                      int64_t ldp, int64_t* ld_out) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(hn::ScalableTag<float>()));
  if (width % N == 0 && (ld == width || rows <= 1)) {
    *ld_out = ld;
    return src;
  }
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(src + r * ld, src + r * ld + width, pad + r * ldp);
    std::fill(pad + r * ldp + width, pad + (r + 1) * ldp, 0.0f);
  }
  *ld_out = ldp;
  return pad;
}

/// One (query block, key block) of head h: recompute P, form dS, and update whichever of
/// dK/dV (accumulators, contiguous kBc rows) and dQ the caller asks for.
struct BlockJob {
  int64_t b, h, g, i0, i1, j0, j1;
  const float* k;  // K rows of the block (strided view rows or the unpadded copy)
  int64_t ldk;
  const float* v;
  int64_t ldv;
  bool padded;
  const float* kt;  // Kᵀ and Vᵀ of the block (d × kBc), and K as rows of whole vectors
  const float* vt;
  const float* kb;
  int64_t ldkb;
};

/// Rows and keys of a block in groups. A block that straddles the causal diagonal is computed in
/// groups of kCutRows: each group of query rows against only the keys some row of it sees (S,
/// dP̃, dQ), each group of keys over only the query rows from the first that sees one of them on
/// (dV, dK). The terms left out are exact zeros (P = dS = 0 for hidden pairs), so the sums are
/// those of the whole block: only the sign of an all-zero sum could differ. A diagonal block thus
/// costs about 5/8 of a whole one (4 groups of 64: 1, 2, 3, 4 quarters of the keys).
struct BlockGroups {
  BlockGroups(const Ctx& c, const BlockJob& j, TileVis block_vis)
      : cx(c),
        job(j),
        vis(block_vis),
        nr(j.i1 - j.i0),
        nc(j.j1 - j.j0),
        cut(block_vis == TileVis::Partial && c.causal.on),
        size(cut ? kCutRows : std::max<int64_t>(nr, nc)) {}
  /// Keys [0, n) of the block hold all that rows [r0, r1) see.
  int64_t keys_seen(int64_t r0, int64_t r1) const {
    return cut ? cx.causal.visible_keys(job.i0 + r0, job.i0 + r1, job.j0, job.j1).hi - job.j0 : nc;
  }
  /// No row before it sees key c0 or a later one.
  int64_t first_row(int64_t c0) const {
    return cut ? std::clamp(job.j0 + c0 - cx.causal.offset - job.i0, int64_t{0}, nr) : int64_t{0};
  }
  const Ctx& cx;
  const BlockJob& job;
  TileVis vis;
  int64_t nr, nc;
  bool cut;
  int64_t size;  // rows (and keys) per group
  int64_t lanes = static_cast<int64_t>(hn::Lanes(hn::ScalableTag<float>()));
};

/// The block's scores as the forward formed them, into s (nr rows of kBc, −inf past the keys a
/// row group computes and for hidden keys, which are never exp'd): S = scale · Q Kᵀ + additive
/// terms, with the score edits (softcap, whose factor 1 − tanh²(t/c) goes into cap for its
/// backward, and ALiBi). q: the block's Q rows, ldq apart. run_block's first step, and what
/// refine_lse reads the rows' sums from.
HWY_INLINE void block_scores(const Ctx& cx, const BlockJob& job, const BlockGroups& groups, const float* q, int64_t ldq,
                             float* s, float* cap) {
  const SdpaParams& f = cx.p->fwd;
  const TileVis vis = groups.vis;
  const int64_t nr = groups.nr, nc = groups.nc, N = groups.lanes, group = groups.size, D = f.d();
  const int64_t cols = round_up(nc, N);
  for (int64_t r0 = 0; r0 < nr; r0 += group) {
    const int64_t r1 = std::min(nr, r0 + group), n = std::min(cols, round_up(groups.keys_seen(r0, r1), N));
    block_gemm({q + r0 * ldq, ldq, 1, job.kt, kBc, s + r0 * kBc, kBc}, r1 - r0, n, D, f.scale, false);
    for (int64_t r = r0; r < r1; ++r) std::fill(s + r * kBc + std::min(n, nc), s + r * kBc + cols, kNegInf);
  }
  const bool masked = vis == TileVis::Partial || cx.element_masks || job.padded;
  if (vis == TileVis::Partial && !cx.element_masks && !job.padded && !cx.edit_scores) {
    // Only the causal rule (and its window) cuts this block: row i sees keys [lo, hi), key_hidden's
    // rule, and with no bias its scores need no additive term. Two fills per row instead of a
    // key_hidden test per score, which made a diagonal block cost about as much as two whole ones.
    for (int64_t r = 0; r < nr; ++r) {
      const KeyRange seen = cx.causal.visible_keys(job.i0 + r, job.i0 + r + 1, job.j0, job.j1);
      std::fill(s + r * kBc, s + r * kBc + (seen.lo - job.j0), kNegInf);
      std::fill(s + r * kBc + (seen.hi - job.j0), s + r * kBc + nc, kNegInf);
    }
  } else if (masked && !cx.edit_scores)
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t i = job.i0 + r, j = job.j0 + c;
        float& x = s[r * kBc + c];
        x = key_hidden(f, job.b, job.h, i, j, cx.causal.offset) ? kNegInf : x + additive_terms(f, job.b, job.h, i, j);
      }
  // Score edits, as the forward forms them: s = c·tanh(t/c) + additive terms + ALiBi, keeping
  // ds/dt = 1 − tanh²(t/c) for the softcap's backward below (0 for hidden keys).
  if (cx.edit_scores) {
    const float c_cap = f.edits.softcap;
    const float slope = f.edits.alibi() ? f.edits.alibi_slopes[job.h] : 0.0f;
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t i = job.i0 + r, j = job.j0 + c;
        float& x = s[r * kBc + c];
        if (masked && key_hidden(f, job.b, job.h, i, j, cx.causal.offset)) {
          x = kNegInf;
          if (f.edits.capped()) cap[r * kBc + c] = 0.0f;
          continue;
        }
        if (f.edits.capped()) {
          const float u = std::tanh(x / c_cap);
          cap[r * kBc + c] = 1.0f - u * u;
          x = c_cap * u;
        }
        if (masked) x += additive_terms(f, job.b, job.h, i, j);
        if (f.edits.alibi()) x += alibi_bias(slope, i + cx.alibi_offset, j);
      }
  }
}

HWY_NOINLINE void run_block(const Ctx& cx, const BlockJob& job, TileVis vis, float* ws, float* dk_acc, float* dv_acc,
                            bool want_dq) {
  const SdpaBackwardParams& p = *cx.p;
  const SdpaParams& f = p.fwd;
  const int64_t nr = job.i1 - job.i0, nc = job.j1 - job.j0, D = f.d(), Dv = f.d_v();
  const int64_t cols = round_up(nc, static_cast<int64_t>(hn::Lanes(hn::ScalableTag<float>())));
  float* s = ws + cx.L.s;
  float* prob = ws + cx.L.p;
  float* pt = ws + cx.L.pt;
  // Q and dO rows of the block, dense (the call's copy, dense_rows, or whole_vectors): the A
  // operands of S and dP̃, the B operands of dK and dV.
  int64_t ldq = cx.L.ldk, lddo = cx.L.ldv;
  const int64_t row0 = head_row(f, job.b, job.h, f.t_q(), job.i0);  // in rowdot and the dense rows
  const float* q = cx.dense_q ? cx.dense_q + row0 * ldq
                              : whole_vectors(f.q.as<float>().row(job.b, job.h, job.i0), f.q.stride[2], nr, D,
                                              ws + cx.L.qp, cx.L.ldk, &ldq);
  const float* dout = cx.dense_dout ? cx.dense_dout + row0 * lddo
                                    : whole_vectors(p.dout.row(job.b, job.h, job.i0), p.dout.stride[2], nr, Dv,
                                                    ws + cx.L.dop, cx.L.ldv, &lddo);
  // dQ rows of the block: the call's dense rows (dense_dq) or the output's.
  const int64_t lddq = cx.dense_dq ? cx.L.ldk : p.dq.stride[2];
  float* const dq = cx.dense_dq ? cx.dense_dq + row0 * lddq : p.dq.row(job.b, job.h, job.i0);
  float lse[64], lse_lo[64];
  bool empty[64];  // rows that saw no key (row_saw_no_key); read only where the call has such rows
  bool any_empty = false;
  for (int64_t r = 0; r < nr; ++r) {
    lse[r] = p.lse(job.b, job.h, job.i0 + r, 0);
    lse_lo[r] = cx.lse_lo[row0 + r];
    empty[r] = cx.any_empty && cx.empty[row0 + r] != 0.0f;
    any_empty |= empty[r];
  }
  // Such a row's dS is 0, but its Q and dO rows still enter the dK and dV products, where 0 · NaN
  // or 0 · inf would be NaN (and with a sink its P may be a few ulp above 0): the gradient of a
  // row that saw no key must be 0 and reach no key (docs/semantics.md, 'Fully masked rows'). So
  // its rows are zeros in the block's copies.
  // Zeros over the first `width` floats of each such row of x (rows ld apart).
  const auto clear_empty_rows = [&](float* x, int64_t ld, int64_t width) {
    if (any_empty)
      for (int64_t r = 0; r < nr; ++r)
        if (empty[r]) std::fill(x + r * ld, x + r * ld + width, 0.0f);
  };
  if (any_empty) {
    const auto zero_empty_rows = [&](const float* src, int64_t ld, int64_t width, float* pad, int64_t ldp) {
      for (int64_t r = 0; r < nr; ++r) {
        if (empty[r])
          std::fill(pad + r * ldp, pad + r * ldp + width, 0.0f);
        else if (src != pad)  // (whole_vectors may have made this copy already)
          std::copy(src + r * ld, src + r * ld + width, pad + r * ldp);
        std::fill(pad + r * ldp + width, pad + (r + 1) * ldp, 0.0f);
      }
    };
    zero_empty_rows(q, ldq, D, ws + cx.L.qp, cx.L.ldk);
    zero_empty_rows(dout, lddo, Dv, ws + cx.L.dop, cx.L.ldv);
    q = ws + cx.L.qp, ldq = cx.L.ldk;
    dout = ws + cx.L.dop, lddo = cx.L.ldv;
  }
  const BlockGroups groups(cx, job, vis);
  const int64_t N = groups.lanes, group = groups.size;
  const auto keys_seen = [&](int64_t r0, int64_t r1) { return groups.keys_seen(r0, r1); };
  const auto first_row = [&](int64_t c0) { return groups.first_row(c0); };
  // Forward "scores" (block_scores; with a softcap its factor into cap), and forward "out = P̃ V":
  // dP̃ = dO Vᵀ (into pt); its columns left out are 0.
  float* cap = ws + cx.L.cap;
  block_scores(cx, job, groups, q, ldq, s, cap);
  for (int64_t r0 = 0; r0 < nr; r0 += group) {
    const int64_t r1 = std::min(nr, r0 + group), n = std::min(cols, round_up(keys_seen(r0, r1), N));
    block_gemm({dout + r0 * lddo, lddo, 1, job.vt, kBc, pt + r0 * kBc, kBc}, r1 - r0, n, Dv, 1.0f, false);
    for (int64_t r = r0; r < r1; ++r) std::fill(pt + r * kBc + n, pt + r * kBc + cols, 0.0f);
  }
  // Forward "softmax": P = exp(S − lse). A row that saw no key has P = 0 (with a sink its lse is
  // finite, and its zeroed Q scored 0 above, not −inf).
  probabilities(s, lse, lse_lo, nr, cols, prob);
  clear_empty_rows(prob, kBc, kBc);
  // Dropout's keep/(1 − p) on both P̃ and dP.
  const float* p_used = prob;  // P̃
  if (f.dropout.active()) {
    // P̃ goes into s (free until dS is formed); dP stays in pt.
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t c = 0; c < nc; ++c) {
        const bool keep = dropout_keep(f.dropout.seed, f.dropout.p, job.b, job.h, job.i0 + r, job.j0 + c);
        const float k = keep ? cx.keep_scale : 0.0f;
        s[r * kBc + c] = prob[r * kBc + c] * k;
        pt[r * kBc + c] *= k;
      }
    p_used = s;
  }
  // dV_j += P̃ᵀ dO_i.
  if (dv_acc) {
    for (int64_t c0 = 0; c0 < nc; c0 += group) {
      const int64_t r_lo = first_row(c0);
      if (r_lo < nr)
        block_gemm({p_used + r_lo * kBc + c0, 1, kBc, dout + r_lo * lddo, lddo, dv_acc + c0 * cx.L.ldv, cx.L.ldv},
                   std::min(nc - c0, group), Dv, nr - r_lo, 1.0f, true);
    }
  }
  // Softmax backward: dS = P ∘ (dP − D) (into s: P̃ has been used).
  score_grads(prob, pt, cx.rowdot + row0, nr, cols, s);
  // Softcap: s = c·tanh(t/c)  ⇒  dT = dS ∘ (1 − tanh²(t/c)), the gradient the products need.
  if (f.edits.capped())
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t c = 0; c < nc; ++c) s[r * kBc + c] *= cap[r * kBc + c];
  // A row that saw no key: dS = 0, also where its zeroed Q met an infinite K row (0 · inf in S
  // made the softcap factor NaN).
  clear_empty_rows(s, kBc, kBc);
  // Forward "S = scale · Q Kᵀ": dK_j += scale · dSᵀ Q_i, dQ_i += scale · dS K_j.
  if (dk_acc) {
    for (int64_t c0 = 0; c0 < nc; c0 += group) {
      const int64_t r_lo = first_row(c0);
      if (r_lo < nr)
        block_gemm({s + r_lo * kBc + c0, 1, kBc, q + r_lo * ldq, ldq, dk_acc + c0 * cx.L.ldk, cx.L.ldk},
                   std::min(nc - c0, group), D, nr - r_lo, f.scale, true);
    }
  }
  if (want_dq) {
    for (int64_t r0 = 0; r0 < nr; r0 += group) {
      const int64_t r1 = std::min(nr, r0 + group), k = keys_seen(r0, r1);
      if (k > 0)
        block_gemm({s + r0 * kBc, kBc, 1, job.kb, job.ldkb, dq + r0 * lddq, lddq}, r1 - r0, D, k, f.scale, true);
    }
    // dS = 0 times an infinite K row is NaN: a row that saw no key keeps dQ = 0.
    clear_empty_rows(dq, lddq, D);
  }
}

/// xt (width × kBc) = xᵀ for rows × width floats x (ld apart), zero past the block's rows.
HWY_INLINE void transpose_block(const float* x, int64_t ld, int64_t rows, int64_t width, float* xt) {
  for (int64_t c = 0; c < width; ++c) {
    float* t = xt + c * kBc;
    for (int64_t j = 0; j < rows; ++j) t[j] = x[j * ld + c];
    std::fill(t + rows, t + kBc, 0.0f);
  }
}

/// The K/V rows of key block [j0, j1): the view's rows, or an unpadded copy in scratch; their
/// transposes and K as whole-vector rows for the products.
HWY_INLINE BlockJob key_block(const Ctx& cx, int64_t b, int64_t g, int64_t j0, int64_t j1, float* ws,
                              bool with_v = true) {
  const SdpaParams& f = cx.p->fwd;
  BlockJob job{b,
               0,
               g,
               0,
               0,
               j0,
               j1,
               f.k.as<float>().row(b, g, j0),
               f.k.stride[2],
               f.v.as<float>().row(b, g, j0),
               f.v.stride[2],
               false,
               ws + cx.L.kt,
               ws + cx.L.vt,
               nullptr,
               0};
  if (has_padding(f, b, j0, j1)) {
    copy_unpadded(f, b, g, j0, j1, ws + cx.L.k, ws + cx.L.v);
    job.k = ws + cx.L.k, job.ldk = f.d();
    job.v = ws + cx.L.v, job.ldv = f.d_v();
    job.padded = true;
  }
  transpose_block(job.k, job.ldk, j1 - j0, f.d(), ws + cx.L.kt);
  if (with_v) transpose_block(job.v, job.ldv, j1 - j0, f.d_v(), ws + cx.L.vt);
  job.kb = whole_vectors(job.k, job.ldk, j1 - j0, f.d(), ws + cx.L.kp, cx.L.ldk, &job.ldkb);
  return job;
}

/// Head h against the key block of `job` (ready: key_block) over every query block in order: its
/// dK/dV contributions added into dk/dv (kBc rows of ldk / ldv floats), with want_dq also its dQ.
HWY_INLINE void head_against_block(const Ctx& cx, BlockJob& job, int64_t h, float* ws, float* dk, float* dv,
                                   bool want_dq) {
  const int64_t Tq = cx.p->fwd.t_q();
  for (int64_t i0 = 0; i0 < Tq; i0 += cx.br) {
    const int64_t i1 = std::min(Tq, i0 + cx.br);
    const TileVis vis = cx.causal.tile(i0, i1, job.j0, job.j1);
    if (vis == TileVis::None) continue;
    job.h = h, job.i0 = i0, job.i1 = i1;
    run_block(cx, job, vis, ws, dk, dv, want_dq);
  }
}

/// sum[i] += part[i], i < n: one query head's share of dK or dV into its group's sum. Every
/// scheme adds the shares with this, in head order, so they give the same bits.
HWY_INLINE void add_share(float* HWY_RESTRICT sum, const float* HWY_RESTRICT part, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sum[i] += part[i];
}

/// dK/dV rows [j0, j1) of (b, g) from their sums (kBc rows of ldk / ldv): a key that is never read
/// has gradient 0 even where a NaN query meets its zero dS (0·NaN in the dK product): it takes
/// part in no product of the forward.
HWY_INLINE void store_key_grads(const Ctx& cx, int64_t b, int64_t g, int64_t j0, int64_t j1, bool padded, float* dk_sum,
                                float* dv_sum) {
  const SdpaBackwardParams& p = *cx.p;
  const SdpaParams& f = p.fwd;
  const int64_t D = f.d(), Dv = f.d_v(), ldk = cx.L.ldk, ldv = cx.L.ldv;
  if (padded)
    for (int64_t j = j0; j < j1; ++j)
      if (key_dropped(f.masks, b, j)) {
        std::fill(dk_sum + (j - j0) * ldk, dk_sum + (j - j0) * ldk + D, 0.0f);
        std::fill(dv_sum + (j - j0) * ldv, dv_sum + (j - j0) * ldv + Dv, 0.0f);
      }
  for (int64_t j = j0; j < j1; ++j) {
    std::memcpy(p.dk.row(b, g, j), dk_sum + (j - j0) * ldk, static_cast<size_t>(D) * sizeof(float));
    std::memcpy(p.dv.row(b, g, j), dv_sum + (j - j0) * ldv, static_cast<size_t>(Dv) * sizeof(float));
  }
}

/// dK/dV of key block kb of (b, g), over every query head of the group and every query block;
/// with want_dq also the dQ contributions of this key block. With GQA each head's share is
/// formed on its own and then added to the group's sum (add_share), as Scheme::PerHead does.
HWY_NOINLINE void key_block_item(const Ctx& cx, int64_t b, int64_t g, int64_t kb, float* ws, bool want_dq) {
  const SdpaParams& f = cx.p->fwd;
  const int64_t Tk = f.t_k(), group = f.group();
  const int64_t j0 = kb * kBc, j1 = std::min(Tk, j0 + kBc);
  const int64_t ldk = cx.L.ldk, ldv = cx.L.ldv, nk = (j1 - j0) * ldk, nv = (j1 - j0) * ldv;
  float* dk_sum = ws + cx.L.dk;
  float* dv_sum = ws + cx.L.dv;
  float* dk_head = group > 1 ? ws + cx.L.dk_head : dk_sum;
  float* dv_head = group > 1 ? ws + cx.L.dv_head : dv_sum;
  std::fill(dk_sum, dk_sum + nk, 0.0f);
  std::fill(dv_sum, dv_sum + nv, 0.0f);
  BlockJob job = key_block(cx, b, g, j0, j1, ws);
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    if (group > 1) {
      std::fill(dk_head, dk_head + nk, 0.0f);
      std::fill(dv_head, dv_head + nv, 0.0f);
    }
    head_against_block(cx, job, h, ws, dk_head, dv_head, want_dq);
    if (group > 1) {
      add_share(dk_sum, dk_head, nk);
      add_share(dv_sum, dv_head, nv);
    }
  }
  store_key_grads(cx, b, g, j0, j1, job.padded, dk_sum, dv_sum);
}

/// Scheme::PerHead: head h of batch b over every key block in order, dQ added directly, its share
/// of each key block's dK/dV kept in cx.dk_heads / dv_heads for sum_head_shares.
HWY_NOINLINE void head_item(const Ctx& cx, int64_t b, int64_t h, float* ws) {
  const SdpaParams& f = cx.p->fwd;
  const int64_t Tk = f.t_k(), g = h / f.group(), ldk = cx.L.ldk, ldv = cx.L.ldv;
  for (int64_t kb = 0; kb < cx.n_kblocks; ++kb) {
    const int64_t j0 = kb * kBc, j1 = std::min(Tk, j0 + kBc);
    float* dk = cx.dk_heads + head_row(f, b, h, Tk, j0) * ldk;
    float* dv = cx.dv_heads + head_row(f, b, h, Tk, j0) * ldv;
    std::fill(dk, dk + (j1 - j0) * ldk, 0.0f);
    std::fill(dv, dv + (j1 - j0) * ldv, 0.0f);
    BlockJob job = key_block(cx, b, g, j0, j1, ws);
    head_against_block(cx, job, h, ws, dk, dv, true);
  }
}

/// Scheme::PerHead, after every head_item: dK/dV of key block kb of (b, g), the group's shares
/// added in head order.
HWY_NOINLINE void sum_head_shares(const Ctx& cx, int64_t b, int64_t g, int64_t kb, float* ws) {
  const SdpaParams& f = cx.p->fwd;
  const int64_t Tk = f.t_k(), group = f.group(), ldk = cx.L.ldk, ldv = cx.L.ldv;
  const int64_t j0 = kb * kBc, j1 = std::min(Tk, j0 + kBc), nk = (j1 - j0) * ldk, nv = (j1 - j0) * ldv;
  float* dk_sum = ws + cx.L.dk;
  float* dv_sum = ws + cx.L.dv;
  std::fill(dk_sum, dk_sum + nk, 0.0f);
  std::fill(dv_sum, dv_sum + nv, 0.0f);
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    add_share(dk_sum, cx.dk_heads + head_row(f, b, h, Tk, j0) * ldk, nk);
    add_share(dv_sum, cx.dv_heads + head_row(f, b, h, Tk, j0) * ldv, nv);
  }
  store_key_grads(cx, b, g, j0, j1, has_padding(f, b, j0, j1), dk_sum, dv_sum);
}

/// dQ of query block qb of (b, h), walking the key blocks in order (the second-pass scheme).
HWY_NOINLINE void query_block_item(const Ctx& cx, int64_t b, int64_t h, int64_t qb, float* ws) {
  const SdpaParams& f = cx.p->fwd;
  const int64_t Tq = f.t_q(), Tk = f.t_k(), g = h / f.group();
  const int64_t i0 = qb * cx.br, i1 = std::min(Tq, i0 + cx.br);
  for (int64_t kb = 0; kb < cx.n_kblocks; ++kb) {
    const int64_t j0 = kb * kBc, j1 = std::min(Tk, j0 + kBc);
    const TileVis vis = cx.causal.tile(i0, i1, j0, j1);
    if (vis == TileVis::None) continue;
    BlockJob job = key_block(cx, b, g, j0, j1, ws);
    job.h = h, job.i0 = i0, job.i1 = i1;
    run_block(cx, job, vis, ws, nullptr, nullptr, true);
  }
}

/// Whether row (b, h, i)'s probabilities are renormalised (kLseRefine): a finite lse that large,
/// in a row that saw a key, and an lse over this call's keys (not lse_over_more_keys: ring
/// attention's blocks, whose probabilities over one block must not sum to 1).
HWY_INLINE bool needs_refining(const Ctx& cx, int64_t b, int64_t h, int64_t i) {
  if (cx.p->lse_over_more_keys) return false;
  const SdpaParams& f = cx.p->fwd;
  const float lse = cx.p->lse(b, h, i, 0);
  return std::isfinite(lse) && std::fabs(lse) >= kLseRefine &&
         !(cx.any_empty && cx.empty[head_row(f, b, h, f.t_q(), i)] != 0.0f);
}

/// refine_lse's work for head h of batch b: m and l its rows' (T_q) running max and sum, then c in m
/// (0 for rows not refined). ws: the thread's scratch. A function of its own, not the body of the
/// parallel loop: clang outlines an OpenMP body without the function's SIMD target attributes,
/// and its vectors then fail to compile (clang 14: "Do not know how to split the result").
HWY_NOINLINE void refine_head(const Ctx& cx, int64_t b, int64_t h, float* m, float* l, float* ws) {
  const SdpaParams& f = cx.p->fwd;
  const int64_t Tq = f.t_q(), Tk = f.t_k(), D = f.d(), g = h / f.group();
  const hn::ScalableTag<float> df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  constexpr float kNoMax = -std::numeric_limits<float>::infinity();
  bool any = false;
  for (int64_t i = 0; i < Tq && !any; ++i) any = needs_refining(cx, b, h, i);
  if (!any) return;  // m (lo) stays 0 for the head: −inf there gave NaN gradients
  for (int64_t i = 0; i < Tq; ++i) m[i] = kNoMax, l[i] = 0.0f;
  float* s = ws + cx.L.s;
  for (int64_t kb = 0; kb < cx.n_kblocks; ++kb) {
    const int64_t j0 = kb * kBc, j1 = std::min(Tk, j0 + kBc), cols = round_up(j1 - j0, N);
    bool packed = false;
    BlockJob job{};
    for (int64_t i0 = 0; i0 < Tq; i0 += cx.br) {
      const int64_t i1 = std::min(Tq, i0 + cx.br), nr = i1 - i0;
      const TileVis vis = cx.causal.tile(i0, i1, j0, j1);
      bool rows = false;
      for (int64_t r = 0; r < nr && !rows; ++r) rows = needs_refining(cx, b, h, i0 + r);
      if (vis == TileVis::None || !rows) continue;
      if (!packed) job = key_block(cx, b, g, j0, j1, ws, false), packed = true;
      job.h = h, job.i0 = i0, job.i1 = i1;
      int64_t ldq = cx.L.ldk;
      const float* q =
          cx.dense_q ? cx.dense_q + head_row(f, b, h, Tq, i0) * ldq
                     : whole_vectors(f.q.as<float>().row(b, h, i0), f.q.stride[2], nr, D, ws + cx.L.qp, cx.L.ldk, &ldq);
      block_scores(cx, job, BlockGroups(cx, job, vis), q, ldq, s, ws + cx.L.cap);
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t i = i0 + r;
        if (!needs_refining(cx, b, h, i)) continue;
        const auto vl = hn::Set(df, cx.p->lse(b, h, i, 0));
        auto vmax = hn::Set(df, kNoMax);
        for (int64_t c = 0; c < cols; c += N) vmax = hn::Max(vmax, hn::Sub(hn::LoadU(df, s + r * kBc + c), vl));
        const float block_max = hn::GetLane(hn::MaxOfLanes(df, vmax));
        if (block_max == kNoMax) continue;  // no key of the block seen
        const float m_new = std::max(m[i], block_max);
        const auto vm = hn::Set(df, m_new);
        auto vsum = hn::Zero(df);
        for (int64_t c = 0; c < cols; c += N)
          vsum = hn::Add(vsum, exp_nonpositive(df, hn::Sub(hn::Sub(hn::LoadU(df, s + r * kBc + c), vl), vm)));
        l[i] = l[i] * std::exp(m[i] - m_new) + hn::GetLane(hn::SumOfLanes(df, vsum));
        m[i] = m_new;
      }
    }
  }
  for (int64_t i = 0; i < Tq; ++i) {
    if (!needs_refining(cx, b, h, i)) {
      m[i] = 0.0f;
      continue;
    }
    double mi = m[i], li = l[i];
    if (f.edits.sinks) {  // the sink's share of the denominator: exp(z_h − lse)
      const double z = static_cast<double>(f.edits.sinks[h]) - cx.p->lse(b, h, i, 0);
      const double m_new = std::max(mi, z);
      li = li * std::exp(mi - m_new) + std::exp(z - m_new);
      mi = m_new;
    }
    m[i] = li > 0.0 && std::isfinite(mi) ? static_cast<float>(mi + std::log(li)) : 0.0f;
  }
}

/// lo (B, h, T_q): 0, but for the rows needs_refining picks, c = log(Σ_j exp(S_j − lse) + exp(z_h −
/// lse)) over the scores as block_scores forms them (and the sink, if any): the row's P = exp((S −
/// lse) − c) then sums to 1 as the forward's did. S − lse is exact near lse (Sterbenz), c is small
/// and formed from those differences, so the log Σ that lse's last bit lost comes back. An extra
/// pass of the score product over the query blocks that hold such rows, an item per (batch, head)
/// walking its key blocks in order (each K block packed once), the rows' running max in lo and
/// sum in `sum` until the end (none in most calls: scores of a trained model stay far below 64);
/// the same arithmetic for any thread count. With every row flagged (T = 2048, h = 8, d = 64,
/// scores of ±100, 2 threads, Zen 4) it added a quarter of the backward's time (122 → 152–166 ms),
/// and half under a per-element mask, whose scalar pass it repeats.
HWY_NOINLINE void refine_lse(const Ctx& cx, float* lo, float* sum, const WorkspacePlan& plan, float* workspace) {
  const SdpaParams& f = cx.p->fwd;
  const int64_t B = f.batch(), H = f.heads(), Tq = f.t_q();
  const int threads = plan.threads;
  std::fill(lo, lo + B * H * Tq, 0.0f);
  int64_t flagged = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : flagged)
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < Tq; ++i) flagged += needs_refining(cx, bh / H, bh % H, i) ? 1 : 0;
  if (flagged == 0) return;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t bh = 0; bh < B * H; ++bh)
    refine_head(cx, bh / H, bh % H, lo + bh * Tq, sum + bh * Tq, plan.thread_part(workspace, omp_get_thread_num()));
}

void backward_f32(const SdpaBackwardParams& p, float* workspace) {
  const SdpaParams& f = p.fwd;
  const int64_t B = f.batch(), H = f.heads(), KV = f.kv_heads(), Tq = f.t_q(), Tk = f.t_k(), D = f.d();
  const DenseCopies dense = dense_copies(p);
  const WorkspacePlan plan = workspace_plan(f, dense);
  const int threads = plan.threads;
  Ctx cx;
  cx.p = &p;
  cx.L = scratch_for(f);
  cx.br = block_rows(f);
  cx.n_qblocks = (Tq + cx.br - 1) / cx.br;
  cx.n_kblocks = (Tk + kBc - 1) / kBc;
  cx.causal = CausalRule::of(f.masks.causal, Tq, Tk);
  cx.element_masks = f.masks.allowed.view.defined() || f.masks.bias.view.defined() || f.masks.key_bias.view.defined();
  cx.keep_scale = f.dropout.active() ? 1.0f / (1.0f - f.dropout.p) : 1.0f;
  cx.edit_scores = f.edits.capped() || f.edits.alibi();
  cx.alibi_offset = alibi_offset(f);
  const Shared shared = shared_for(f, dense);
  float* rowdot = plan.shared_part(workspace) + shared.rowdot;
  cx.rowdot = rowdot;
  row_dots(p, rowdot, threads);
  float* empty = plan.shared_part(workspace) + shared.empty;
  cx.empty = empty;
  cx.any_empty = empty_rows(p, empty, threads);
  float* lse_lo = plan.shared_part(workspace) + shared.lse_lo;
  cx.lse_lo = lse_lo;
  if (dense.q_dout) {
    float* q = plan.shared_part(workspace) + shared.q;
    float* dout = plan.shared_part(workspace) + shared.dout;
    copy_dense_rows(p, cx.L.ldk, cx.L.ldv, q, dout, threads);
    cx.dense_q = q;
    cx.dense_dout = dout;
  }
  refine_lse(cx, lse_lo, plan.shared_part(workspace) + shared.lse_sum, plan, workspace);
  // The sink z_h: dz_h = −Σ_{b,i} exp(z_h − lse_i) · D_i, summed in a fixed order (any thread
  // count gives the same bits); a NaN row gives NaN. A row that saw no key (lse = z_h, out = 0: a
  // constant) adds nothing, as in the reference, also where its dO holds a NaN (0 · NaN).
  if (f.edits.sinks && p.dsinks)
    for (int64_t h = 0; h < H; ++h) {
      double acc = 0.0;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Tq; ++i) {
          if (empty[(b * H + h) * Tq + i] != 0.0f) continue;
          const int64_t row = (b * H + h) * Tq + i;
          const double pz = std::exp(static_cast<double>(f.edits.sinks[h]) - p.lse(b, h, i, 0) - cx.lse_lo[row]);
          acc -= pz * rowdot[(b * H + h) * Tq + i];
        }
      p.dsinks[h] = static_cast<float>(acc);
    }

  // dQ accumulates over key blocks: start from 0 (fully masked rows stay 0).
  if (dense.dq) {
    cx.dense_dq = plan.shared_part(workspace) + shared.dq;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t bh = 0; bh < B * H; ++bh)
      std::fill(cx.dense_dq + bh * Tq * cx.L.ldk, cx.dense_dq + (bh + 1) * Tq * cx.L.ldk, 0.0f);
  } else {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t i = 0; i < Tq; ++i) std::fill(p.dq.row(bh / H, bh % H, i), p.dq.row(bh / H, bh % H, i) + D, 0.0f);
  }

  const Scheme scheme = scheme_for(f);
  if (scheme == Scheme::PerKvHead) {
    // One item per (batch, kv-head): key blocks in order, dQ added directly (5 products).
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < B * KV; ++item) {
      float* ws = plan.thread_part(workspace, omp_get_thread_num());
      for (int64_t kb = 0; kb < cx.n_kblocks; ++kb) key_block_item(cx, item / KV, item % KV, kb, ws, true);
    }
  } else if (scheme == Scheme::PerHead) {
    // One item per (batch, query head), then dK/dV per (batch, kv-head, key block) from the shares.
    cx.dk_heads = plan.shared_part(workspace) + shared.dk_heads;
    cx.dv_heads = plan.shared_part(workspace) + shared.dv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < B * H; ++item)
      head_item(cx, item / H, item % H, plan.thread_part(workspace, omp_get_thread_num()));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t item = 0; item < B * KV * cx.n_kblocks; ++item) {
      const int64_t bg = item / cx.n_kblocks;
      sum_head_shares(cx, bg / KV, bg % KV, item % cx.n_kblocks, plan.thread_part(workspace, omp_get_thread_num()));
    }
  } else {
    // Items (batch, kv-head, key block) for dK/dV, then (batch, head, query block) for dQ.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < B * KV * cx.n_kblocks; ++item) {
      float* ws = plan.thread_part(workspace, omp_get_thread_num());
      const int64_t bg = item / cx.n_kblocks;
      key_block_item(cx, bg / KV, bg % KV, item % cx.n_kblocks, ws, false);
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < B * H * cx.n_qblocks; ++item) {
      float* ws = plan.thread_part(workspace, omp_get_thread_num());
      const int64_t bh = item / cx.n_qblocks;
      query_block_item(cx, bh / H, bh % H, item % cx.n_qblocks, ws);
    }
  }
  if (dense.dq) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t i = 0; i < Tq; ++i) {
        const float* row = cx.dense_dq + (bh * Tq + i) * cx.L.ldk;
        std::copy(row, row + D, p.dq.row(bh / H, bh % H, i));
      }
  }
}

int64_t dispatch_target() { return HWY_TARGET; }

}  // namespace HWY_NAMESPACE
}  // namespace mha::kernels::bwd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::kernels {
namespace bwd {
HWY_EXPORT(backward_f32);
HWY_EXPORT(dispatch_target);
}  // namespace bwd

bool fused_backward_supports(const SdpaBackwardParams& p, std::string* why) {
  auto no = [why](const char* reason) {
    if (why) *why = reason;
    return false;
  };
  const SdpaParams& f = p.fwd;
  // BLAS takes rows with unit inner stride and a row stride of at least the row length (an empty
  // view has no rows: its strides do not matter).
  auto rows_ok = [](const auto& v) {
    return (v.stride[3] == 1 && v.stride[2] >= v.shape[3]) || v.shape[0] * v.shape[1] * v.shape[2] * v.shape[3] == 0;
  };
  if (!rows_ok(f.q) || !rows_ok(f.k) || !rows_ok(f.v) || !rows_ok(p.dout) || !rows_ok(p.out))
    return no("fused backward needs unit inner stride and row stride ≥ row length for q, k, v, out and d_out");
  if (!rows_ok(p.dq) || !rows_ok(p.dk) || !rows_ok(p.dv))
    return no("fused backward needs unit inner stride and row stride ≥ row length for dq, dk and dv");
  if (!p.lse.defined() && f.batch() * f.heads() * f.t_q() > 0) return no("fused backward needs the forward's lse");
  if (why) *why = "supported";
  return true;
}

size_t fused_backward_workspace_floats(const SdpaBackwardParams& p) {
  return bwd::workspace_plan(p.fwd, bwd::dense_copies(p)).floats();
}

void sdpa_backward_fused(const SdpaBackwardParams& p, float* workspace) {
  assert_sdpa_backward_params(p);
  MHA_DASSERT(workspace != nullptr);
  if (p.fwd.varlen.defined()) {
    // A packed batch: one sequence after another, each with every thread (its items are its own
    // key blocks). The whole request's workspace covers any one sequence's: each sequence has the
    // request's B = 1, heads, d, d_v, strides and threads (so the same dense_rows and Scheme),
    // its shared part grows with T_q and T_k only, and the per-thread scratch does not depend on
    // them.
    const auto fn = HWY_DYNAMIC_DISPATCH(bwd::backward_f32);
    for_each_sequence_backward(p, [&](const SdpaBackwardParams& r) { fn(r, workspace); });
    return;
  }
  HWY_DYNAMIC_DISPATCH(bwd::backward_f32)(p, workspace);
}

std::vector<int64_t> fused_backward_compiled_targets() { return target_bits(HWY_TARGETS); }
int64_t fused_backward_dispatch_target() { return HWY_DYNAMIC_DISPATCH(bwd::dispatch_target)(); }

}  // namespace mha::kernels
#endif  // HWY_ONCE
