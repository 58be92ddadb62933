// kernels/fused_forward.cpp — the fused FlashAttention-style forward kernel (float32 and bfloat16
// inputs), SIMD through Google Highway with one dynamic dispatch per call.
//
// Shapes: Q (B, h, T_q, d), K (B, kv, T_k, d), V (B, kv, T_k, d_v), out (B, h, T_q, d_v),
// lse (B, h, T_q, 1); query head i reads K/V head i / group (group = h / kv).
//
// Blocking and memory traffic. The work items are (batch, kv-head, block of kBq = 128 queries),
// taken by whichever OpenMP thread is free (dynamic schedule), each (batch, kv-head)'s items
// together and, under a causal mask, its longest (last) query block first (item_at), so the
// threads end within one short item of each other. One item owns the Q rows of every query head
// of its group, and per head a running max m, running sum l and an output accumulator O
// (kBq × d_v, float32) in the thread's scratch. It walks the keys in blocks of kBk = 64. Each
// K/V block is packed — K transposed (d × kBk) so that S = Q·Kᵀ loads contiguous key vectors,
// V as contiguous rows (kBk × d_v) — and then used by all `group` query heads. With 2 query
// blocks or more, each thread keeps the blocks it packed for its last (batch, kv-head), up to
// 1 MiB, and its next items of that pair read them (keeps_packed_blocks; a pair's items are
// claimed together). Beyond that, from 1024 queries on (PrepackPlan) the whole call's K/V is
// packed once, before the items, into the shared workspace (the size of K and V: memory stays
// linear in T) and every item reads it; otherwise (and for packed batches) each item packs the
// blocks it uses into its own scratch.
// For each head: S (kBq × kBk, 32 KiB, stays in L1/L2) = scale·Q·Kᵀ + masks; online softmax
// (m' = max(m, rowmax S), P = exp(S − m'), l = l·e^{m−m'} + ΣP); O = e^{m−m'}·O + P·V. Both
// products are register-blocked micro-GEMMs (kMR rows × kNV vectors of accumulators). So K and V
// are streamed from memory T_q / kBq times per kv-head (not once per query head), Q and O once;
// nothing of size T_q × T_k exists. Causal masks limit each item to the keys that some row of
// the block can see (≈ half the blocks skipped), and within a block that straddles the diagonal
// or the window edge the rows go in runs of 16 (RowRun): rows that see none of its keys skip it,
// rows that see all of them take the unmasked softmax, and only the rest are masked, their
// products cut at the last key they see. Any block when a per-element mask is given is masked
// element by element with key_hidden(), the rule the reference uses. A packed variable-length
// batch (SdpaParams::varlen) has items (sequence, kv-head, query block) over the sequences' own
// rows, costed by the query rows times the keys they may see and taken longest first
// (run_varlen): work is Σ T_q·T_k over the sequences, never the padded B·max². Padded keys (and keys whose key_bias is
// −inf) are packed as zeros without reading K or V, and their scores are −inf. Score edits (kernels/score_edits.h) cost
// nothing when off: softcap and ALiBi take a second vector loop over S (a vector tanh; ALiBi's distances from an iota),
// and a sink enters only the final normalisation of each row (m, l and O rescaled once). Attention weights come from
// the same single pass over the keys: each block's probabilities are kept with the running max they were taken against
// (on the common path formed right in the rows that keep them) and normalised once when the item ends
// (finish_weights_one_pass). Only where the thread's scratch for that would
// exceed kOnePassWeightsMaxBytes (T_k·group > 32768) do weights take the older two passes, the scores computed twice.
//
// bfloat16: on AVX3_DL when the CPU has AVX512_BF16, Q·Kᵀ and P·V use vdpbf16ps (pairs of bf16
// multiplied and accumulated into float32 lanes), with P rounded to bf16 for P·V (the softmax
// itself, m, l and O stay float32; P's exponentials come from exp_before_bf16, within 3.0e-6 of
// exp, where the float32 path's exp_nonpositive is within float32's ε), in register tiles of 4
// rows × 4 vectors. Where the CPU also
// has AMX (Sapphire Rapids on) and d is a multiple of 32, the same packed pairs feed AMX tiles
// instead (kernels/amx.h; cx.amx): S leaves the tiles unscaled and one vector pass scales and
// masks it, O is rescaled where it lies and accumulated into by the tiles, rows go in whole tiles
// of 16. On Sapphire Rapids vdpbf16ps runs at a quarter of the float32 FMA's rate, so there the
// tiles made the bf16 core 4.3× faster (T = 4096, d = 64: 81 ms against 346; float32 244).
// Elsewhere bf16 inputs are widened to float32 when packed.
// On AVX-512 (float32 and bf16), blocks with no per-element mask, score edit, dropout or two-pass
// weights take softmax_rows16: the score tiles scale and mask S and keep each row's max while S
// is in registers (a run of rows cut by the causal rule then masks its hidden keys and takes its
// maxima again, cut_causal_rows), and the rest of the softmax reduces 16 rows' maxima and sums
// at a time (bf16: P written as bf16 pairs directly, unless one-pass weights need P as float32).
// The same arithmetic as softmax_block, bitwise.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/amx.h"
#include "kernels/attention.h"
#include "kernels/common.h"
#include "kernels/dropout_rng.h"
#include "kernels/entry_checks.h"
#include "kernels/fused_forward.h"
#include "kernels/masking.h"
#include "kernels/varlen.h"

#ifndef MHA_FUSED_FORWARD_ONCE
#define MHA_FUSED_FORWARD_ONCE
namespace mha::kernels::fused {

constexpr int64_t kBq = 128;       // query rows per work item
constexpr int64_t kBk = 64;        // keys per K/V block (a multiple of every target's tile width)
constexpr int64_t kMaxLanes = 16;  // widest vector of float (AVX-512)
constexpr int64_t kMaxMR = 8;      // most rows in a register tile, on any target
constexpr int64_t kRowsPad = kBq + kMaxMR;
constexpr int64_t kPrepackMinQueries = 8 * kBq;  // pack K/V once per call from 1024 queries on
// From 2 query blocks on, each thread keeps the K/V blocks it packed for its last (batch, kv-head)
// for the next item of the same pair, when they fit this many bytes (T_k ≤ 1984 at d = 64;
// keeps_packed_blocks); packing once per call is left for longer keys.
constexpr int64_t kKeptBlocksMaxBytes = int64_t{1} << 20;
constexpr int64_t kKeptBlocksMax = 64;          // one bit each in the thread's tag
constexpr int64_t kMaxPrefetchBytes = 32 * 64;  // per K/V row: a wider (strided) row is not worth it
// Float32 query rows between two prefetch steps (PrefetchDrip): one AVX-512 register tile. At
// B = 64, T = 128 a step every 6 rows took 14% off the core where one every 12 took 2%.
constexpr int64_t kDripRows = 6;
// Attention weights in one pass keep, per thread, one item's unnormalised weights for every head
// of its group: group × kBq × T_k floats, 1 MiB at T_k = 2048 for one head, so that the fix-up at
// the item's end finds them in L2/L3 and each output row is written once. (Fixing per-head
// weights up where they lie in p.weights instead cost ~40 ms more CPU time per module call of
// ~300 ms at T = 2048, h = 8, 1 thread: their 128 MiB written, then read and written again.)
// The bound keeps that scratch from growing without limit (at T_k = 1M it would be 512 MiB per
// thread) and caps it where it would no longer fit any cache: 16 MiB, i.e. T_k·group ≤ 32768.
// Beyond it every weights output takes the two-pass path, so that per-head, averaged and both
// keep giving the same bits (FusedWeights.PerHeadAveragedOrBothGiveTheSameBits).
constexpr int64_t kOnePassWeightsMaxBytes = int64_t{16} << 20;

/// One-pass weights (see kOnePassWeightsMaxBytes): the floats between rows of their scratch, T_k
/// rounded to an odd number of cache lines (kMaxLanes floats each); the floats of that scratch,
/// group × kBq rows; and whether the call takes that path. (Rows a power of two apart, 8 KiB at
/// T_k = 2048, would put a key block's 128 row segments in the same few cache sets of L1 and L2
/// and evict each other and the block's scores and V rows.)
inline int64_t one_pass_weights_ld(int64_t t_k) {
  const int64_t lines = (t_k + kMaxLanes - 1) / kMaxLanes;
  return (lines | 1) * kMaxLanes;
}
inline int64_t one_pass_weights_floats(const SdpaParams& p) { return p.group() * kBq * one_pass_weights_ld(p.t_k()); }
inline bool weights_one_pass(const SdpaParams& p) {
  if (!p.weights.defined() && !p.weights_avg.defined()) return false;
  const int64_t bound = p.weights_one_pass_max_bytes > 0 ? p.weights_one_pass_max_bytes : kOnePassWeightsMaxBytes;
  // The bound counts rows unpadded, so that it reads T_k·group ≤ 32768 whatever the padding.
  const int64_t floats = p.group() * kBq * round_up(p.t_k(), kMaxLanes);
  return floats * static_cast<int64_t>(sizeof(float)) <= bound;
}

/// Rows [r0, r1) of a query block that the causal rule (with its window) treats alike against one
/// key block: None, no key of the block is visible to them, so the block is skipped for them (m,
/// l and O stay as they are: what masking all of their scores gives, for finite V); All, every
/// key is, so they take the unmasked softmax; Partial, some are, all among the block's first nk
/// keys, so their products stop there. Under a causal mask the rows of a diagonal block split
/// this way instead of all taking the masked path over every key: at T = 128 half of the pairs
/// the products computed were hidden ones. Runs are whole groups of kRunRows rows (the 16-row
/// softmax's unit and a multiple of the bf16 tiles' 4 rows), the last one ending at the block's nq.
struct RowRun {
  int64_t r0 = 0, r1 = 0, nk = 0;
  TileVis vis = TileVis::All;
};
constexpr int64_t kRunRows = 16;
constexpr int64_t kMaxRuns = kBq / kRunRows;

/// The runs of rows [0, nq) of the query block at i0 against keys [j0, j0 + nk); returns their
/// count. None and All groups next to each other merge; each Partial group keeps its own nk.
inline int64_t row_runs(const CausalRule& causal, int64_t i0, int64_t nq, int64_t j0, int64_t nk, RowRun* runs) {
  int64_t n = 0;
  for (int64_t r0 = 0; r0 < nq; r0 += kRunRows) {
    const int64_t r1 = std::min(nq, r0 + kRunRows);
    const TileVis vis = causal.tile(i0 + r0, i0 + r1, j0, j0 + nk);
    if (n > 0 && vis != TileVis::Partial && runs[n - 1].vis == vis) {
      runs[n - 1].r1 = r1;
      continue;
    }
    const int64_t seen = vis == TileVis::Partial ? causal.visible_keys(i0 + r0, i0 + r1, j0, j0 + nk).hi - j0 : nk;
    runs[n++] = {r0, r1, seen, vis};
  }
  return n;
}

/// One packed K/V block (offsets in floats): K transposed (ldq × kBk), V (kBk rows of ldv) and
/// the key-only masks (kBk), as one thread's scratch holds them when an item packs for itself.
struct PackedBlockLayout {
  int64_t kt = 0, v = 0, kb = 0, stride = 0;
};
inline PackedBlockLayout packed_block_layout(int64_t ldq, int64_t ldv) {
  PackedBlockLayout B;
  ScratchCarver c;
  B.kt = c.take(ldq * kBk);
  B.v = c.take(kBk * ldv);
  B.kb = c.take(kBk);
  B.stride = c.total();
  return B;
}

/// Whether each thread keeps the K/V blocks it packed for its last (batch, kv-head): a call of 2
/// query blocks per pair or more whose key blocks fit kKeptBlocksMaxBytes. Items of a pair come
/// one after another (item_at), claimed together where the pairs are enough, so a thread's next
/// item is mostly of the same pair and reads the blocks it packed: at B = 64, T = 512 each block
/// had been packed by each of its 4 items. From 8 query blocks on it replaces packing once per
/// call (prepack_plan) where both apply: the same packing without writing the whole call's K and
/// V to memory and reading them back (core B = 8, T = 1024: 117 / 59 → 107 / 54 ms, causal 69 /
/// 34 → 56 / 30, 1 / 2 threads; B = 1, T = 1024 and the module level). Not for a packed batch
/// (its blocks start at each sequence's offset) nor for averaged weights (an item walks every
/// kv-head in turn).
inline bool keeps_packed_blocks(const SdpaParams& p, int64_t block_floats) {
  if (p.varlen.defined() || p.weights_avg.defined()) return false;
  const int64_t q_blocks = (p.t_q() + kBq - 1) / kBq, blocks = (p.t_k() + kBk - 1) / kBk;
  return q_blocks >= 2 && blocks > 0 && blocks <= kKeptBlocksMax &&
         blocks * block_floats * static_cast<int64_t>(sizeof(float)) <= kKeptBlocksMaxBytes;
}

/// Where one thread's scratch regions lie (offsets in floats, each region 64-byte aligned).
struct ScratchPlan {
  int64_t q = 0, kt = 0, v = 0, s = 0, p2 = 0, rmax = 0, o = 0, m = 0, l = 0, alpha = 0, kb = 0, l2 = 0, total = 0;
  int64_t ldq = 0;    // floats between Q rows (d rounded to even)
  int64_t ldv = 0;    // floats between packed V rows and O rows (d_v rounded to kMaxLanes)
  int64_t vtail = 0;  // AMX: the last key pairs' V rows, zero-padded to a whole tile (kernels/amx.h)
  // One-pass weights: wm, the running max each key block's weights were taken against (group ×
  // kRowsPad rows of wblocks); wp, the unnormalised weights (group × kBq rows, ldw apart); wscale,
  // one row's block scales at the fix-up.
  int64_t wm = 0, wp = 0, wblocks = 0, ldw = 0, wscale = 0;
  // keeps_packed_blocks: kept_blocks blocks of kept_layout from `kept` on, and at kept_tag two
  // int64: the (batch · kv + kv-head) they belong to (−1: none yet) and a bit per block packed.
  PackedBlockLayout kept_layout;
  int64_t kept = 0, kept_tag = 0, kept_blocks = 0;
};

inline ScratchPlan scratch_plan(const SdpaParams& p) {
  ScratchPlan L;
  const int64_t group = p.group();
  L.ldq = round_up(p.d(), 2);
  L.ldv = round_up(p.d_v(), kMaxLanes);
  ScratchCarver c;
  L.q = c.take(group * kRowsPad * L.ldq);
  L.kt = c.take(L.ldq * kBk);
  L.v = c.take(kBk * L.ldv);
  L.s = c.take(kRowsPad * kBk);
  L.p2 = c.take(kRowsPad * kBk / 2);
  L.rmax = c.take(kRowsPad * kMaxLanes);  // the bf16 path's rows' max vectors (score_block_dp)
  L.o = c.take(group * kRowsPad * L.ldv);
  L.m = c.take(group * kRowsPad);
  L.l = c.take(group * kRowsPad);
  L.alpha = c.take(kRowsPad);
  L.kb = c.take(kBk);
  L.vtail = c.take(16 * L.ldv);
  if (weights_one_pass(p)) {
    L.wblocks = (p.t_k() + kBk - 1) / kBk;
    L.wm = c.take(group * kRowsPad * L.wblocks);
    L.ldw = one_pass_weights_ld(p.t_k());
    L.wp = c.take(one_pass_weights_floats(p));
    L.wscale = c.take(round_up(L.wblocks, kMaxLanes));
  } else if (p.weights.defined() || p.weights_avg.defined()) {
    L.l2 = c.take(kRowsPad);  // the weights' second pass
  }
  L.kept_layout = packed_block_layout(L.ldq, L.ldv);
  if (keeps_packed_blocks(p, L.kept_layout.stride)) {
    L.kept_blocks = (p.t_k() + kBk - 1) / kBk;
    L.kept_tag = c.take(kAlignFloats);
    L.kept = c.take(L.kept_blocks * L.kept_layout.stride);
  }
  L.total = c.total();
  return L;
}

/// One work item of a packed variable-length batch: query block qb of K/V head g of sequence s,
/// with its cost (query rows × keys they may see) for longest-first scheduling.
struct VarlenItem {
  int64_t s, g, qb, cost;
};
static_assert(sizeof(VarlenItem) % sizeof(float) == 0);

/// Work items of a packed batch: one per (sequence, kv-head, block of kBq queries).
inline int64_t varlen_items(const SdpaParams& p) {
  if (!p.varlen.defined()) return 0;
  int64_t n = 0;
  for (int64_t s = 0; s < p.varlen.seqs; ++s) n += (p.varlen.cu_q[s + 1] - p.varlen.cu_q[s] + kBq - 1) / kBq;
  return n * p.kv_heads();
}

/// K/V packed once per call, before the work items (PrepackPlan::used): the transposed K block,
/// the V block and the key-only masks of every (batch, kv-head, key block), laid out exactly as
/// one thread's scratch holds them when an item packs for itself. Worth it when a K/V block
/// would otherwise be packed by many items: at T_q = 1024, 8 times per block (see prepack_plan
/// for where it stops paying). A packed batch keeps per-item
/// packing (its key blocks start at each sequence's own offset).
struct PrepackPlan {
  bool used = false;
  int64_t blocks = 0;        // key blocks per (batch, kv-head)
  PackedBlockLayout layout;  // one block's, as a thread's kept blocks have it

  int64_t total(const SdpaParams& p) const { return used ? p.batch() * p.kv_heads() * blocks * layout.stride : 0; }
};

inline PrepackPlan prepack_plan(const SdpaParams& p) {
  PrepackPlan P;
  // Packing per item costs a roughly fixed share of the products whatever T is (each item packs
  // the blocks it reads); packing once saves that share but writes a workspace the size of K and V,
  // whose fresh pages and DRAM traffic grow with B·T_k against products that grow with B·T_q·T_k.
  // Measured on 2 threads (Zen 5, quiet): once per call is ~5% faster at B=1, T=4096, but 8% slower
  // at B=8, T=1024 and 1.2–2× slower (and its threads unbalanced by page faults) at B=64, T=512,
  // so it started at 4096 queries. On an Intel Xeon (AVX-512, 2026-12-04, 3 interleaved rounds,
  // E=512, h=8, 1 / 2 threads) it pays from 1024 queries (8 items per key block): core B=1 T=2048
  // 67.4 / 33.9 → 60.7 / 32.1 ms, B=8 T=1024 142 / 70 → 134 / 69, B=32 T=1024 557 / 286 → 528 /
  // 275, B=8 T=2048 530 / 283 → 492 / 251; the module, whose K and V rows lie 3E apart in its
  // projection buffer, B=1 T=2048 127 / 64 → 95 / 50, B=8 T=1024 318 → 274 (1 thread). From 512
  // queries (4 items) it was 10% slower on causal B=64, T=512 and level elsewhere, so it stays off
  // there. Since 2026-12-05 a thread's kept blocks (keeps_packed_blocks) take its place where
  // they fit: what remains is T_k beyond them, e.g. B = 1, T = 2048 or 4096 at d = 64.
  const ScratchPlan L = scratch_plan(p);
  P.used = !p.varlen.defined() && p.t_q() >= kPrepackMinQueries && p.t_k() > 0 && L.kept_blocks == 0;
  if (!P.used) return P;
  P.blocks = (p.t_k() + kBk - 1) / kBk;
  P.layout = L.kept_layout;
  return P;
}

/// Work items of a call that is not a packed batch: one per (batch, kv-head — or batch entry alone,
/// where averaged weights are written —, block of kBq queries).
inline int64_t dense_items(const SdpaParams& p) {
  return p.batch() * (p.weights_avg.defined() ? 1 : p.kv_heads()) * ((p.t_q() + kBq - 1) / kBq);
}

/// K/V blocks packed once before the items (PrepackPlan::used), one per (batch, kv-head, key block).
inline int64_t prepacked_blocks(const SdpaParams& p, const PrepackPlan& prepack) {
  return prepack.used ? p.batch() * p.kv_heads() * prepack.blocks : 0;
}

/// The whole workspace: a packed batch's item list or the prepacked K/V, then one ScratchPlan
/// per thread.
inline WorkspacePlan workspace_plan(const SdpaParams& p) {
  const int64_t packed_items = varlen_items(p);
  const int64_t list = packed_items * static_cast<int64_t>(sizeof(VarlenItem) / sizeof(float));
  const PrepackPlan prepack = prepack_plan(p);
  // No more threads than pieces of work (items, or K/V blocks to pack): a thread with none would
  // only be woken (a team of 1024 for one item cost ~20 ms a call); results never depend on it.
  const int64_t items = p.varlen.defined() ? packed_items : dense_items(p);
  const int64_t work = std::max(items, prepacked_blocks(p, prepack));
  const int threads = static_cast<int>(std::clamp<int64_t>(work, 1, std::max(1, p.threads)));
  return {std::max(list, prepack.total(p)), scratch_plan(p).total, threads};
}

/// Adds the calling thread's time in a parallel region to busy_ms[thread] when busy_ms is set
/// (SdpaParams::thread_busy_ms); pause() and resume() leave out a barrier's wait. Two clock reads
/// per thread and call, none per item.
class BusyClock {
 public:
  explicit BusyClock(double* busy_ms) : busy_ms_(busy_ms) { resume(); }
  ~BusyClock() {
    pause();
    if (busy_ms_) busy_ms_[omp_get_thread_num()] += ms_;
  }
  BusyClock(const BusyClock&) = delete;
  BusyClock& operator=(const BusyClock&) = delete;
  void pause() {
    if (busy_ms_) ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
  }
  void resume() {
    if (busy_ms_) t0_ = std::chrono::steady_clock::now();
  }

 private:
  double* busy_ms_;
  double ms_ = 0;
  std::chrono::steady_clock::time_point t0_{};
};

/// Two bf16 values as one 32-bit word, `lo` in the low half (the first in memory).
inline uint32_t bf16_pair(bf16 lo, bf16 hi) { return uint32_t{lo.bits} | (uint32_t{hi.bits} << 16); }

inline bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

/// Everything a work item needs, computed once per call.
template <class T>
struct Ctx {
  const SdpaParams* p = nullptr;
  View4<const T> q, k, v;  // of the whole request, or of one packed sequence (kernels/varlen.h)
  View4<float> out, lse;
  int64_t t_q = 0, t_k = 0;
  ScratchPlan L;
  CausalRule causal;
  int64_t q_blocks = 0;
  float keep_scale = 1.0f;
  bool weights_two_pass = false;  // weights (per head and/or averaged) from two passes per item
  bool weights_one_pass = false;  // or from one pass and a fix-up (weights_one_pass(p))
  bool stream_weights = false;    // weights rows written with non-temporal stores (kStreamWeightsBytes)
  bool edit_scores = false;       // softcap or ALiBi: the scores take the edited path
  bool amx = false;               // bf16 products on AMX tiles (kernels/amx.h), rows in whole tiles of 16
  int64_t alibi_offset = 0;       // q_pos = row + this (kernels/attention.h, alibi_offset)
  PrepackPlan prepack;
  const float* prepacked = nullptr;  // the prepacked K/V blocks when prepack.used
};

}  // namespace mha::kernels::fused
#endif  // MHA_FUSED_FORWARD_ONCE

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/fused_forward.cpp"
// SSSE3 adds nothing over SSE4 here; the portable baseline (SCALAR in Highway 1.0.3) stays.
#define HWY_DISABLED_TARGETS HWY_SSSE3
// AVX3_DL (Ice Lake / Zen 4 class) is where the bf16 dot product lives.
#define HWY_WANT_AVX3_DL
// foreach_target.h must come first: it re-includes this file once per target.
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/exp-inl.h"
#include "hwy/contrib/math/math-inl.h"
// clang-format on

#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2
#include <immintrin.h>
#endif

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::fused {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kMR = 6;  // register tile: 6 rows × 4 vectors = 24 of the 32 registers
constexpr int kNV = 4;
#else
// AVX2 (and SSE4): 3 rows × 4 vectors = 12 accumulators. A step over d is 12 FMAs against 3
// broadcasts and 4 vector loads (GCC reads one of the four as an FMA's memory operand: 12 + 4 + 1
// registers would be 17), where 4 rows × 2 vectors was 8 FMAs against 4 broadcasts and 2 loads:
// half the broadcasts per FMA, and 12 independent sums instead of 8 (two FMA units of latency 4–5,
// as on Haswell to Zen 3, need 8–10 in flight). Each accumulator still sums over d (or over the
// keys) in order, so the bits are those of 4 × 2. Measured on a Zen 1 (T = 4096, E = 512, medians
// of 3–4 interleaved rounds): 1 thread d = 64 1,275 → 1,209 ms, d = 128 1,183 → 1,104 ms, causal
// 650 → 607 ms; 2 threads d = 64 746–793 → 695–725 ms, d = 128 696–730 → 649–691 ms. (6 × 2,
// also 12 accumulators but 6 broadcasts per 12 FMAs, was no faster than 4 × 2 there.)
constexpr int kMR = 3;
constexpr int kNV = 4;
#endif
static_assert(kMR <= kMaxMR);
static_assert(kDripRows % kMR == 0);  // chunks of whole tiles: the products' bits do not change
// AVX-512: one score tile (kNV vectors of 16) spans a block's kBk keys, and the common softmax
// runs 16 rows at a time (softmax_rows16). AVX2: the score tiles (kNV vectors of 8) take a row's
// max over the block's tiles in turn, and the common softmax runs 8 rows at a time
// (softmax_rows8). Either way the scores leave the tiles scaled and masked with their rows' max
// vectors (kFusedSoftmax), and the softmax needs one pass over S instead of two.
constexpr bool kHaveRows16 = HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL;
constexpr bool kHaveRows8 = HWY_TARGET == HWY_AVX2;
constexpr bool kFusedSoftmax = kHaveRows16 || kHaveRows8;
static_assert(!kHaveRows16 || kNV * kMaxLanes == kBk);
// The bf16 dot-product tiles: 4 rows × 4 vectors, so that a block of kBq = 128 rows needs no
// padding rows (6 would make it 132).
constexpr int kMRdp = HWY_TARGET == HWY_AVX3_DL ? 4 : kMR;
static_assert(kBq % kMRdp == 0 || kMRdp == kMR);

inline int64_t lanes() { return static_cast<int64_t>(hn::Lanes(DF())); }

/// Calls f(std::integral_constant<int, n>{}) for a run-time n in [1, kMax]; nothing for n = 0: a
/// tile's rows or vectors chosen at run time, its loops unrolled at compile time.
template <int kMax, class F>
HWY_INLINE void with_count(int64_t n, F&& f) {
  if constexpr (kMax > 0) {
    if (n == kMax) return f(std::integral_constant<int, kMax>{});
    with_count<kMax - 1>(n, f);
  }
}

using kernels::HWY_NAMESPACE::exp_before_bf16;
using kernels::HWY_NAMESPACE::exp_nonpositive;

// ---- S = Q·Kᵀ (float32) --------------------------------------------------------------------
// q: MR rows of d floats, ld ldq; kt: d rows of kBk keys; s: MR rows of kBk. With kScaled (the
// common softmax, softmax_rows16 / softmax_rows8), each score leaves as x = s·scale + kb (exactly
// −inf where kb is −inf, whatever Q holds: softmax_block's rule; kb is the tile's first key's) and
// the row's running max over the tile's vectors goes to rmax (kMaxLanes floats a row; with
// `first` false, folded into the max of the row's earlier tiles there): softmax_block's first
// pass, the same operations (so the same bits: a max is exact, whatever its order), while S is
// in registers.
template <int MR, int NV, bool kScaled, bool kHidden = true>
HWY_INLINE void score_tile(const float* HWY_RESTRICT q, int64_t ldq, const float* HWY_RESTRICT kt, int64_t d,
                           float* HWY_RESTRICT s, int64_t lds, float scale, const float* kb, float* rmax,
                           bool first = true) {
  const DF df;
  const int64_t N = lanes();
  VF acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = hn::Zero(df);
  for (int64_t c = 0; c < d; ++c) {
    VF kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = hn::LoadU(df, kt + c * kBk + v * N);
    for (int r = 0; r < MR; ++r) {
      const VF qv = hn::Set(df, q[r * ldq + c]);
      for (int v = 0; v < NV; ++v) acc[r][v] = hn::MulAdd(qv, kv[v], acc[r][v]);
    }
  }
  if constexpr (kScaled) {
    const VF vscale = hn::Set(df, scale), vneg_inf = hn::Set(df, kNegInf);
    VF kbv[NV];
    for (int v = 0; v < NV; ++v) kbv[v] = hn::LoadU(df, kb + v * N);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      VF vmax = first ? vneg_inf : hn::LoadU(df, rmax + r * kMaxLanes);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const VF scaled = hn::MulAdd(acc[r][v], vscale, kbv[v]);
        const VF x = kHidden ? hn::IfThenElse(hn::Eq(kbv[v], vneg_inf), kbv[v], scaled) : scaled;
        vmax = hn::Max(vmax, x);
        hn::StoreU(x, df, s + r * lds + v * N);
      }
      hn::StoreU(vmax, df, rmax + r * kMaxLanes);
    }
  } else {
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) hn::StoreU(acc[r][v], df, s + r * lds + v * N);
  }
}

// MR rows of S: tiles of kNV vectors, then the last `nvec % kNV` vectors.
template <int MR, bool kScaled, bool kHidden>
HWY_INLINE void score_rows(const float* q, int64_t ldq, int64_t d, const float* kt, int64_t nvec, float* s, int64_t lds,
                           float scale, const float* kb, float* rmax) {
  const int64_t N = lanes();
  int64_t v0 = 0;
  // (kb is null unless kScaled: no offset is formed from it then.)
  for (; v0 + kNV <= nvec; v0 += kNV)
    score_tile<MR, kNV, kScaled, kHidden>(q, ldq, kt + v0 * N, d, s + v0 * N, lds, scale, kScaled ? kb + v0 * N : kb,
                                          rmax, v0 == 0);
  with_count<kNV - 1>(nvec - v0, [&](auto nv) {
    score_tile<MR, nv, kScaled, kHidden>(q, ldq, kt + v0 * N, d, s + v0 * N, lds, scale, kScaled ? kb + v0 * N : kb,
                                         rmax, v0 == 0);
  });
}

// Rows are not padded to a multiple of kMR: the last rows % kMR form a smaller tile (at kBq = 128
// and kMR = 6, padding would compute 132 rows, 3% of the products for nothing). With rmax (only
// where kNV vectors span a block), scaled and with the rows' max vectors, as score_tile says.
template <bool kScaled, bool kHidden = true>
void score_block_t(const float* q, int64_t ldq, int64_t rows, int64_t d, const float* kt, int64_t nvec, float* s,
                   int64_t lds, float scale, const float* kb, float* rmax) {
  // Row r0's max vectors; null without kScaled (no offset is formed from a null pointer).
  const auto row_max = [&](int64_t r) { return kScaled ? rmax + r * kMaxLanes : rmax; };
  int64_t r0 = 0;
  for (; r0 + kMR <= rows; r0 += kMR)
    score_rows<kMR, kScaled, kHidden>(q + r0 * ldq, ldq, d, kt, nvec, s + r0 * lds, lds, scale, kb, row_max(r0));
  with_count<kMR - 1>(rows - r0, [&](auto mr) {
    score_rows<mr, kScaled, kHidden>(q + r0 * ldq, ldq, d, kt, nvec, s + r0 * lds, lds, scale, kb, row_max(r0));
  });
}

/// Whether a block's key terms kb (n floats) mark a key as never read (−inf). Scalar on purpose:
/// the same test as a Highway mask (Or of Eq, then AllFalse) made GCC 12's AVX3_DL build of
/// softmax_block give wrong softcap results, which ScoreEditsGolden caught; not understood yet.
inline bool has_hidden_keys(const float* kb, int64_t n) {
  bool any = false;
  for (int64_t j = 0; j < n; ++j) any |= kb[j] == kNegInf;
  return any;
}

/// S rows lds floats apart: kBk in the thread's scratch, or the one-pass weights' rows (run_group).
/// kb_hidden: whether kb holds a −inf in its nvec vectors (has_hidden_keys); without one, the
/// tiles skip the select that keeps such scores −inf (the same values: 3% of a B=64, T=256 call).
void score_block(const float* q, int64_t ldq, int64_t rows, int64_t d, const float* kt, int64_t nvec, float* s,
                 float scale = 0.0f, const float* kb = nullptr, float* rmax = nullptr, int64_t lds = kBk,
                 bool kb_hidden = true) {
  if constexpr (kFusedSoftmax) {
    if (rmax && kb_hidden) return score_block_t<true>(q, ldq, rows, d, kt, nvec, s, lds, scale, kb, rmax);
    if (rmax) return score_block_t<true, false>(q, ldq, rows, d, kt, nvec, s, lds, scale, kb, rmax);
  }
  score_block_t<false>(q, ldq, rows, d, kt, nvec, s, lds, scale, kb, rmax);
}

// ---- O = alpha·O + P·V (float32) -----------------------------------------------------------
// p: MR rows of probabilities, kLdp apart (0: ldp apart); vp: nk rows of ldv; o: MR rows of ldv.
// (The scratch's stride kBk is a constant: the MR rows' broadcasts then address P from one
// register, where a run-time stride takes a register per row in the inner loop: 2% at B = 64,
// T = 128 on one thread.)
template <int MR, int NV, int64_t kLdp>
HWY_INLINE void out_tile(const float* HWY_RESTRICT p, int64_t ldp_run, const float* HWY_RESTRICT alpha,
                         const float* HWY_RESTRICT vp, int64_t ldvp, int64_t ldv, int64_t nk, float* HWY_RESTRICT o) {
  const int64_t ldp = kLdp != 0 ? kLdp : ldp_run;
  const DF df;
  const int64_t N = lanes();
  VF acc[MR][NV];
  // Rows whose max did not move have alpha = 1 (most blocks of a long row): o·1 = o, so a tile of
  // such rows loads o as it is (x·1 is x, bit for bit, −0 and NaN included).
  bool rescale = false;
  for (int r = 0; r < MR; ++r) rescale |= alpha[r] != 1.0f;
  for (int r = 0; r < MR; ++r) {
    const VF a = hn::Set(df, alpha[r]);
    for (int v = 0; v < NV; ++v) {
      const VF x = hn::LoadU(df, o + r * ldv + v * N);
      acc[r][v] = rescale ? hn::Mul(x, a) : x;
    }
  }
  // nk ≥ 1 (a block has a key): a loop without a zero-trip path keeps acc in registers (with the
  // guard GCC 12 passes the accumulators through the stack where the two paths join).
  int64_t j = 0;
  do {
    VF vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = hn::LoadU(df, vp + j * ldvp + v * N);
    for (int r = 0; r < MR; ++r) {
      const VF pv = hn::Set(df, p[r * ldp + j]);
      for (int v = 0; v < NV; ++v) acc[r][v] = hn::MulAdd(pv, vv[v], acc[r][v]);
    }
  } while (++j < nk);
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) hn::StoreU(acc[r][v], df, o + r * ldv + v * N);
}

template <int MR, int64_t kLdp>
HWY_INLINE void out_rows(const float* p, int64_t ldp, const float* alpha, const float* vp, int64_t ldvp, int64_t ldv,
                         int64_t nk, int64_t nvec_o, float* o) {
  const int64_t N = lanes();
  int64_t v0 = 0;
  for (; v0 + kNV <= nvec_o; v0 += kNV) out_tile<MR, kNV, kLdp>(p, ldp, alpha, vp + v0 * N, ldvp, ldv, nk, o + v0 * N);
  with_count<kNV - 1>(nvec_o - v0,
                      [&](auto nv) { out_tile<MR, nv, kLdp>(p, ldp, alpha, vp + v0 * N, ldvp, ldv, nk, o + v0 * N); });
}

template <int64_t kLdp>
HWY_INLINE void out_block_ld(const float* p, int64_t ldp, const float* alpha, int64_t rows, const float* vp,
                             int64_t ldvp, int64_t ldv, int64_t nk, int64_t nvec_o, float* o) {
  int64_t r0 = 0;
  for (; r0 + kMR <= rows; r0 += kMR)
    out_rows<kMR, kLdp>(p + r0 * ldp, ldp, alpha + r0, vp, ldvp, ldv, nk, nvec_o, o + r0 * ldv);
  with_count<kMR - 1>(rows - r0, [&](auto mr) {
    out_rows<mr, kLdp>(p + r0 * ldp, ldp, alpha + r0, vp, ldvp, ldv, nk, nvec_o, o + r0 * ldv);
  });
}

/// V rows ldvp floats apart: the packed block's ldv, or the caller's V itself (run_group's
/// v_in_place); O rows ldv apart; P rows ldp apart (as score_block's lds).
void out_block(const float* p, const float* alpha, int64_t rows, const float* vp, int64_t ldvp, int64_t ldv, int64_t nk,
               int64_t nvec_o, float* o, int64_t ldp = kBk) {
  if (ldp == kBk)
    out_block_ld<kBk>(p, kBk, alpha, rows, vp, ldvp, ldv, nk, nvec_o, o);
  else
    out_block_ld<0>(p, ldp, alpha, rows, vp, ldvp, ldv, nk, nvec_o, o);
}

// ---- the bf16 dot-product path (AVX3_DL with AVX512_BF16 only) ------------------------------
// Operands are bf16 pairs in 32-bit words: q2 (rows × ⌈d/2⌉), kt2 (⌈d/2⌉ × kBk keys), p2 (rows ×
// kBk/2 key pairs), v2 (⌈nk/2⌉ key pairs × ldv). vdpbf16ps adds both products of a pair to a lane.
#if HWY_TARGET == HWY_AVX3_DL
// Every feature of the AVX3_DL target plus AVX512_BF16: these functions also call Highway ops,
// which clang inlines only into functions compiled with all of the target's features.
#define MHA_BF16_DOT __attribute__((target(HWY_TARGET_STR ",avx512bf16")))

/// Scores of kMRdp rows × NV vectors of keys. With `scaled` (the common softmax of
/// softmax_rows16), each score leaves as x = s·scale + kb (exactly −inf where kb is −inf), and
/// the row's running max over its vectors goes to rmax (16 floats a row): softmax_block's first
/// pass, the same operations in the same order (so the same bits), done while S is in registers.
template <int NV, bool kScaled>
MHA_BF16_DOT inline void score_tile_dp(const uint32_t* q2, int64_t ldq2, const uint32_t* kt2, int64_t d2, float* s,
                                       float scale, const float* kb, float* rmax) {
  __m512 acc[kMRdp][NV];
  for (int r = 0; r < kMRdp; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  // d2 ≥ 1 (sdpa refuses d = 0): as out_tile, no zero-trip path.
  int64_t c = 0;
  do {
    __m512i kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = _mm512_loadu_si512(kt2 + c * kBk + v * 16);
    for (int r = 0; r < kMRdp; ++r) {
      const __m512i qv = _mm512_set1_epi32(static_cast<int>(q2[r * ldq2 + c]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)qv, (__m512bh)kv[v]);
    }
  } while (++c < d2);
  if constexpr (kScaled) {
    const __m512 vscale = _mm512_set1_ps(scale), vneg_inf = _mm512_set1_ps(kNegInf);
    __m512 kbv[NV];
    __mmask16 hidden[NV];
    for (int v = 0; v < NV; ++v) {
      kbv[v] = _mm512_loadu_ps(kb + v * 16);
      hidden[v] = _mm512_cmp_ps_mask(kbv[v], vneg_inf, _CMP_EQ_OQ);
    }
    // Unrolled, so that acc stays in registers (a rolled r loop makes GCC index acc in memory).
#pragma GCC unroll 4
    for (int r = 0; r < kMRdp; ++r) {
      __m512 vmax = vneg_inf;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        // A key never read (kb = −inf) scores exactly −inf, whatever Q holds (see softmax_block).
        const __m512 x = _mm512_mask_blend_ps(hidden[v], _mm512_fmadd_ps(acc[r][v], vscale, kbv[v]), kbv[v]);
        vmax = _mm512_max_ps(vmax, x);
        _mm512_storeu_ps(s + r * kBk + v * 16, x);
      }
      _mm512_storeu_ps(rmax + r * 16, vmax);
    }
  } else {
    for (int r = 0; r < kMRdp; ++r)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + r * kBk + v * 16, acc[r][v]);
  }
}

/// S = Q·Kᵀ for rows (a multiple of kMRdp) × nvec vectors of keys; with rmax non-null, scaled and
/// with the rows' max vectors as score_tile_dp<…, true> says.
MHA_BF16_DOT HWY_NOINLINE void score_block_dp(const uint32_t* q2, int64_t ldq2, int64_t rows, int64_t d2,
                                              const uint32_t* kt2, int64_t nvec, float* s, float scale = 0.0f,
                                              const float* kb = nullptr, float* rmax = nullptr) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMRdp) {
    const uint32_t* qr = q2 + r0 * ldq2;
    float* sr = s + r0 * kBk;
    float* mr = rmax ? rmax + r0 * 16 : nullptr;
    const auto tile = [&](auto nv) {
      if (mr)
        score_tile_dp<decltype(nv)::value, true>(qr, ldq2, kt2, d2, sr, scale, kb, mr);
      else
        score_tile_dp<decltype(nv)::value, false>(qr, ldq2, kt2, d2, sr, scale, kb, mr);
    };
    with_count<4>(std::clamp<int64_t>(nvec, 1, 4), tile);
  }
}

template <int NV>
MHA_BF16_DOT inline void out_tile_dp(const uint32_t* p2, const float* alpha, const uint32_t* v2, int64_t ldv,
                                     int64_t n2, float* o) {
  __m512 acc[kMRdp][NV];
  for (int r = 0; r < kMRdp; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ldv + v * 16), a);
  }
  // n2 ≥ 1: as out_tile, no zero-trip path.
  int64_t j2 = 0;
  do {
    __m512i vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = _mm512_loadu_si512(v2 + j2 * ldv + v * 16);
    for (int r = 0; r < kMRdp; ++r) {
      const __m512i pv = _mm512_set1_epi32(static_cast<int>(p2[r * (kBk / 2) + j2]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)pv, (__m512bh)vv[v]);
    }
  } while (++j2 < n2);
  for (int r = 0; r < kMRdp; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + r * ldv + v * 16, acc[r][v]);
}

/// P (float32 probabilities, rows × kBk) rounded to bf16 (nearest even), consecutive keys paired:
/// word j2 of a row = (p[2·j2], p[2·j2+1]). The general softmax's output goes through here; the
/// fast one (softmax_rows16) writes the same words itself.
MHA_BF16_DOT HWY_NOINLINE void to_bf16_pairs(const float* s, int64_t rows, int64_t nk, uint32_t* p2) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < (nk + 31) / 32; ++c) {
      const __m512 lo = _mm512_loadu_ps(s + r * kBk + 32 * c), hi = _mm512_loadu_ps(s + r * kBk + 32 * c + 16);
      _mm512_storeu_si512(p2 + r * (kBk / 2) + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

MHA_BF16_DOT HWY_NOINLINE void out_block_dp(const uint32_t* p2, const float* alpha, int64_t rows, const uint32_t* v2,
                                            int64_t ldv, int64_t nk, int64_t nvec_o, float* o) {
  const int64_t n2 = (nk + 1) / 2;
  for (int64_t r0 = 0; r0 < rows; r0 += kMRdp) {
    int64_t v0 = 0;
    const uint32_t* pr = p2 + r0 * (kBk / 2);
    for (; v0 + 4 <= nvec_o; v0 += 4) out_tile_dp<4>(pr, alpha + r0, v2 + v0 * 16, ldv, n2, o + r0 * ldv + v0 * 16);
    switch (nvec_o - v0) {
      case 1:
        out_tile_dp<1>(pr, alpha + r0, v2 + v0 * 16, ldv, n2, o + r0 * ldv + v0 * 16);
        break;
      case 2:
        out_tile_dp<2>(pr, alpha + r0, v2 + v0 * 16, ldv, n2, o + r0 * ldv + v0 * 16);
        break;
      case 3:
        out_tile_dp<3>(pr, alpha + r0, v2 + v0 * 16, ldv, n2, o + r0 * ldv + v0 * 16);
        break;
      default:
        break;
    }
  }
}

// ---- the same products on AMX tiles (kernels/amx.h), where the CPU has them -----------------
// S comes out of the tiles unscaled; with rmax (softmax_rows16) one pass then scales and masks it
// and takes each row's max vector exactly as score_tile_dp<…, true> does from its registers.
MHA_BF16_DOT HWY_NOINLINE void score_block_amx(const uint32_t* q2, int64_t ldq2, int64_t rows, int64_t d2,
                                               const uint32_t* kt2, int64_t nvec, float* s, float scale = 0.0f,
                                               const float* kb = nullptr, float* rmax = nullptr) {
  amx::scores(q2, ldq2, rows, d2, kt2, kBk, nvec, s, kBk);
  if (!rmax) return;
  const __m512 vscale = _mm512_set1_ps(scale), vneg_inf = _mm512_set1_ps(kNegInf);
  __m512 kbv[4];
  __mmask16 hidden[4];
  for (int64_t v = 0; v < nvec; ++v) {
    kbv[v] = _mm512_loadu_ps(kb + v * 16);
    hidden[v] = _mm512_cmp_ps_mask(kbv[v], vneg_inf, _CMP_EQ_OQ);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * kBk;
    __m512 vmax = vneg_inf;
    for (int64_t v = 0; v < nvec; ++v) {
      const __m512 x =
          _mm512_mask_blend_ps(hidden[v], _mm512_fmadd_ps(_mm512_loadu_ps(row + v * 16), vscale, kbv[v]), kbv[v]);
      vmax = _mm512_max_ps(vmax, x);
      _mm512_storeu_ps(row + v * 16, x);
    }
    _mm512_storeu_ps(rmax + r * 16, vmax);
  }
}

/// O = alpha·O + P·V on AMX tiles: O's rows rescaled where they lie (alpha = 1 leaves a row as
/// it is, as the multiply would), then accumulated into by the tiles. p2's words past the block's
/// pairs are zeroed (amx::accumulate).
MHA_BF16_DOT HWY_NOINLINE void out_block_amx(uint32_t* p2, const float* alpha, int64_t rows, const uint32_t* v2,
                                             int64_t ldv, int64_t nk, int64_t nvec_o, float* o, uint32_t* tail) {
  for (int64_t r = 0; r < rows; ++r) {
    if (alpha[r] == 1.0f) continue;
    const __m512 a = _mm512_set1_ps(alpha[r]);
    float* row = o + r * ldv;
    for (int64_t v = 0; v < nvec_o; ++v)
      _mm512_storeu_ps(row + v * 16, _mm512_mul_ps(_mm512_loadu_ps(row + v * 16), a));
  }
  amx::accumulate(p2, kBk / 2, rows, (nk + 1) / 2, v2, ldv, nvec_o, o, ldv, tail);
}

constexpr bool kHaveDot = true;
#else
// Never called: the dot-product path is chosen on AVX3_DL only.
inline void score_block_dp(const uint32_t*, int64_t, int64_t, int64_t, const uint32_t*, int64_t, float*, float = 0.0f,
                           const float* = nullptr, float* = nullptr) {}
inline void to_bf16_pairs(const float*, int64_t, int64_t, uint32_t*) {}
inline void out_block_dp(const uint32_t*, const float*, int64_t, const uint32_t*, int64_t, int64_t, int64_t, float*) {}
inline void score_block_amx(const uint32_t*, int64_t, int64_t, int64_t, const uint32_t*, int64_t, float*, float = 0.0f,
                            const float* = nullptr, float* = nullptr) {}
inline void out_block_amx(uint32_t*, const float*, int64_t, const uint32_t*, int64_t, int64_t, int64_t, float*,
                          uint32_t*) {}
constexpr bool kHaveDot = false;
#endif

/// The online softmax's rescale factor for rows whose max moved from m_old to m_use (≥ m_old):
/// exp(m_old − m_use) with the kernels' own exp (1 where the max did not move; a NaN difference
/// stays NaN, as std::exp keeps it). Every softmax of the forward takes it from here, a vector of
/// rows at a time: a scalar std::exp per row and block was 2.4% of a B=64, T=256 call.
HWY_INLINE VF rescale_factor(VF m_old, VF m_use) {
  const DF df;
  const VF diff = hn::Sub(m_old, m_use);
  return hn::IfThenElse(hn::Eq(m_old, m_use), hn::Set(df, 1.0f),
                        hn::IfThenElse(hn::IsNaN(diff), diff, exp_nonpositive(df, diff)));
}

/// x·y rounded on its own, never contracted with the add that follows into an FMA (which rounds
/// once, differently): the online softmax's l·alpha, which every softmax rounds before adding the
/// block's sum. GCC contracts across statements as it sees fit (a change elsewhere in
/// softmax_block once made it fuse l·alpha + sum there, and the 8-row softmax's bits differed).
inline float rounded_product(float x, float y) {
  float p = x * y;
#if HWY_ARCH_X86
  asm("" : "+x"(p));
#else
  volatile float opaque = p;
  p = opaque;
#endif
  return p;
}

/// The online softmax's step for n rows whose block maxima are row_max: m becomes max(m, row max),
/// alpha the factor exp(m_old − m) for what was summed against m_old (1 where m did not move), and
/// m_use the value the block's scores are taken against (0 while a row has seen nothing: then
/// exp(−inf − 0) = 0, not NaN). softmax_block's arithmetic, shared by the row-batched softmaxes.
/// Returns the rows (bit r, n ≤ 32) whose max is now +inf: a visible +inf score makes its row NaN
/// (e^{+inf − +inf}, as in PyTorch), where exp_nonpositive's 0 for that NaN would leave l = 0 and
/// the zeros of a fully masked row.
inline uint32_t take_row_maxima(int64_t n, const float* row_max, float* m, float* alpha, float* m_use) {
  const DF df;
  const int64_t N = lanes();
  uint32_t inf_rows = 0;
  for (int64_t r0 = 0; r0 < n; r0 += N) {
    const auto live = hn::FirstN(df, static_cast<size_t>(n - r0));
    const VF m_old = hn::MaskedLoad(live, df, m + r0), row = hn::MaskedLoad(live, df, row_max + r0);
    const VF m_new = hn::IfThenElse(hn::Lt(m_old, row), row, m_old);  // std::max(m_old, row): NaN m_old stays
    const VF use = hn::IfThenElse(hn::Eq(m_new, hn::Set(df, kNegInf)), hn::Zero(df), m_new);
    hn::BlendedStore(use, live, df, m_use + r0);
    hn::BlendedStore(rescale_factor(m_old, use), live, df, alpha + r0);
    hn::BlendedStore(m_new, live, df, m + r0);
    uint8_t bits[8] = {};
    hn::StoreMaskBits(df, hn::And(live, hn::Eq(m_new, hn::Set(df, -kNegInf))), bits);
    uint32_t word;
    std::memcpy(&word, bits, sizeof(word));
    inf_rows |= word << r0;
  }
  return inf_rows;
}

// ---- the common online softmax, 16 rows at a time (AVX-512) --------------------------------
// Blocks with no score edit, per-element or partial causal mask, dropout or two-pass weights: the
// score tiles scaled and masked S and left each row's max vector in rmax (score_block(…, rmax),
// score_block_dp(…, rmax)); softmax_rows16 finishes softmax_block's arithmetic, bitwise, with the
// rows' maxima and sums reduced 16 rows at a time, and writes P as float32 in S or, for the bf16
// path, as bf16 pairs (to_bf16_pairs' layout) straight away.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#if HWY_TARGET == HWY_AVX3_DL
#define MHA_ROWS16 MHA_BF16_DOT  // for the bf16 pairs' conversion; the float32 variant uses none of it
#else
#define MHA_ROWS16
#endif

// Horizontal reductions of 16 row vectors at once: lane r of the result is what
// _mm512_reduce_{add,max}_ps (Highway's SumOfLanes / MaxOfLanes) gives for v[r], bitwise: the same
// tree (halves of 8, 4, 2, 1 lanes folded) with the same operand order at every level, so a NaN
// lane is kept or dropped exactly as there. 15 operations and 30 shuffles instead of 16 chains of
// 4 dependent steps each.
template <class Op>
MHA_ROWS16 inline __m512 reduce_rows16(const __m512* v, Op op) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // [v lo 8 | w lo 8] with [v hi 8 | w hi 8]
    a[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44));
  for (int i = 0; i < 4; ++i)  // four rows' upper 4 lanes with their lower 4
    b[i] = op(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88));
  for (int i = 0; i < 2; ++i)  // lanes 0, 1 of each 4 with lanes 2, 3
    c[i] = op(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 f = op(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  // Lane 4·(r mod 4) + r / 4 of f holds row r.
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}

/// s: rows × kBk scaled, masked scores (x = s·scale + kb); rmax: their rows' max vectors (16
/// floats a row). Updates m, l and alpha for the rows < nq as softmax_block<kBf16Exp> does, and
/// writes the probabilities: kPairs, as bf16 pairs into p2 (rows ≥ nq zero); else as float32
/// over s. kBf16Exp: the bf16 path's exp (exp_before_bf16), whose NaN reaches the row's sum.
template <bool kPairs, bool kBf16Exp>
MHA_ROWS16 HWY_NOINLINE void softmax_rows16(int64_t nq, int64_t rows, int64_t nk, float* s, const float* rmax, float* m,
                                            float* l, float* alpha, uint32_t* p2, int64_t lds) {
  const DF df;
  const int64_t nvec = (nk + 15) / 16;
  const auto vmax_op = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  const auto vadd_op = [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); };
  alignas(64) float row_max[16], m_use[16];
  __m512 red[16];
  for (int64_t r0 = 0; r0 < nq; r0 += 16) {
    const int64_t n = std::min<int64_t>(16, nq - r0);
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    for (int64_t r = 0; r < n; ++r) red[r] = _mm512_loadu_ps(rmax + (r0 + r) * 16);
    for (int64_t r = n; r < 16; ++r) red[r] = _mm512_set1_ps(kNegInf);
    _mm512_store_ps(row_max, reduce_rows16(red, vmax_op));
    // bit r: row r saw a NaN score (Max and exp_nonpositive may drop it) or a +inf one
    __mmask16 any_nan = static_cast<__mmask16>(take_row_maxima(n, row_max, m + r0, alpha + r0, m_use));
    for (int64_t r = n; r < 16; ++r) red[r] = _mm512_setzero_ps();  // (not all 16 first: a memset)
    for (int64_t r = 0; r < n; ++r) {
      float* row = s + (r0 + r) * lds;
      const VF vm = hn::Set(df, m_use[r]);
      // Lanes whose scores were all ordered so far: one masked compare a vector (a compare, a
      // move to a general register and an or per vector were 1.5% of a B=64, T=256 call). The
      // bf16 path's exp keeps a NaN, so its rows are flagged from their sums instead.
      __mmask16 ordered = 0xFFFF;
      __m512 vsum = _mm512_setzero_ps();
      const auto prob = [&](int64_t v) {
        const __m512 x = _mm512_loadu_ps(row + v * 16);
        __m512 e;
        if constexpr (kBf16Exp) {
          e = exp_before_bf16(df, VF{x}, vm).raw;
        } else {
          ordered = _mm512_mask_cmp_ps_mask(ordered, x, x, _CMP_ORD_Q);
          e = exp_nonpositive(df, hn::Sub(VF{x}, vm)).raw;
        }
        vsum = _mm512_add_ps(vsum, e);
        return e;
      };
      if constexpr (kPairs) {
#if HWY_TARGET == HWY_AVX3_DL
        for (int64_t v = 0; v < nvec; v += 2) {  // two vectors (the second zero past nk): 16 words
          const __m512 lo = prob(v), hi = v + 1 < nvec ? prob(v + 1) : _mm512_setzero_ps();
          _mm512_storeu_si512(p2 + (r0 + r) * (kBk / 2) + 8 * v, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
#endif
      } else {
        for (int64_t v = 0; v < nvec; ++v) _mm512_storeu_ps(row + v * 16, prob(v));
      }
      red[r] = vsum;
      if (ordered != 0xFFFF) any_nan = static_cast<__mmask16>(any_nan | (1u << r));
    }
    // l·alpha rounded before the sum is added, as softmax_block's scalar l·alpha + sum (no FMA).
    const __m512 la = _mm512_mul_round_ps(_mm512_maskz_loadu_ps(live, l + r0), _mm512_maskz_loadu_ps(live, alpha + r0),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 l_new = _mm512_add_ps(la, reduce_rows16(red, vadd_op));
    if constexpr (kBf16Exp) any_nan |= _mm512_cmp_ps_mask(l_new, l_new, _CMP_UNORD_Q);  // one NaN: l is NaN
    _mm512_mask_storeu_ps(l + r0, live, _mm512_mask_blend_ps(any_nan, l_new, _mm512_set1_ps(kNaN)));
  }
  // Padding rows of the register tiles: zero probabilities and no rescaling keep them inert.
  for (int64_t r = nq; r < rows; ++r) {
    if constexpr (kPairs)
      std::memset(p2 + r * (kBk / 2), 0, sizeof(uint32_t) * static_cast<size_t>(kBk / 2));
    else
      std::memset(s + r * lds, 0, sizeof(float) * static_cast<size_t>(kBk));
    alpha[r] = 0.0f;
  }
}
#else
template <bool kPairs, bool kBf16Exp>  // never called: the 16-row softmax is chosen on the AVX-512 targets only
inline void softmax_rows16(int64_t, int64_t, int64_t, float*, const float*, float*, float*, float*, uint32_t*,
                           int64_t) {}
#endif

// ---- the common online softmax, 8 rows at a time (AVX2) ------------------------------------
// softmax_rows16's work on 8-lane vectors: the score tiles left S scaled and masked and each row's
// max vector in rmax; the rows' maxima and sums are reduced 8 rows at a time, and P is written as
// float32 over S. The same bits as softmax_block on this target.
#if HWY_TARGET == HWY_AVX2
// Lane r of the result is Highway's SumOfLanes(v[r]) on AVX2, bitwise: that folds lane i with
// lane i + 4, then lanes (0, 2) and (1, 3) of what is left, then those two sums; the same pairs
// are added here (addition is commutative, bit for bit), for 8 rows at once: 21 operations where
// 8 rows' own reductions take 48. For a max, any order gives the same value.
template <class Op>
inline __m256 reduce_rows8(const __m256* v, Op op) {
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i)  // rows 2i, 2i + 1: lanes i + (i + 4) of each, in its half
    a[i] =
        op(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20), _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // lanes (0, 2) and (1, 3) of rows 4i..4i + 3
    b[i] = op(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  const __m256 f = op(_mm256_shuffle_ps(b[0], b[1], 0x88), _mm256_shuffle_ps(b[0], b[1], 0xDD));
  // f holds rows 0, 2, 4, 6, 1, 3, 5, 7.
  return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/// s: rows × kBk scaled, masked scores; rmax: their rows' max vectors (kMaxLanes floats a row, 8
/// used). Updates m, l and alpha for the rows < nq as softmax_block does and writes the
/// probabilities over s.
template <bool kPairs>
HWY_NOINLINE void softmax_rows8(int64_t nq, int64_t rows, int64_t nk, float* s, const float* rmax, float* m, float* l,
                                float* alpha, uint32_t*, int64_t lds) {
  static_assert(!kPairs, "no bf16 dot products on AVX2");
  const DF df;
  const int64_t nvec = (nk + 7) / 8;
  const auto vmax_op = [](__m256 a, __m256 b) { return _mm256_max_ps(a, b); };
  const auto vadd_op = [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); };
  alignas(32) float row_max[8], row_sum[8], m_use[8];
  __m256 red[8];
  for (int64_t r0 = 0; r0 < nq; r0 += 8) {
    const int64_t n = std::min<int64_t>(8, nq - r0);
    for (int64_t r = 0; r < n; ++r) red[r] = _mm256_loadu_ps(rmax + (r0 + r) * kMaxLanes);
    for (int64_t r = n; r < 8; ++r) red[r] = _mm256_set1_ps(kNegInf);
    _mm256_store_ps(row_max, reduce_rows8(red, vmax_op));
    // bit r: row r saw a NaN score (Max and exp_nonpositive may drop it) or a +inf one
    unsigned any_nan = take_row_maxima(n, row_max, m + r0, alpha + r0, m_use);
    for (int64_t r = n; r < 8; ++r) red[r] = _mm256_setzero_ps();
    for (int64_t r = 0; r < n; ++r) {
      float* row = s + (r0 + r) * lds;
      const VF vm = hn::Set(df, m_use[r]);
      __m256 nan = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
      for (int64_t v = 0; v < nvec; ++v) {
        const __m256 x = _mm256_loadu_ps(row + v * 8);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        const __m256 e = exp_nonpositive(df, hn::Sub(VF{x}, vm)).raw;
        vsum = _mm256_add_ps(vsum, e);
        _mm256_storeu_ps(row + v * 8, e);
      }
      red[r] = vsum;
      if (_mm256_movemask_ps(nan)) any_nan |= 1u << r;
    }
    _mm256_store_ps(row_sum, reduce_rows8(red, vadd_op));
    for (int64_t r = 0; r < n; ++r) {
      // l·alpha rounded before the sum is added, as in softmax_block.
      l[r0 + r] = any_nan >> r & 1u ? kNaN : rounded_product(l[r0 + r], alpha[r0 + r]) + row_sum[r];
    }
  }
  // Padding rows of the register tiles: zero probabilities and no rescaling keep them inert.
  for (int64_t r = nq; r < rows; ++r) {
    std::memset(s + r * lds, 0, sizeof(float) * static_cast<size_t>(kBk));
    alpha[r] = 0.0f;
  }
}
#else
template <bool kPairs>  // never called: the 8-row softmax is chosen on the AVX2 target only
inline void softmax_rows8(int64_t, int64_t, int64_t, float*, const float*, float*, float*, float*, uint32_t*, int64_t) {
}
#endif

/// The common online softmax on the target's rows (kFusedSoftmax): 16 at a time on AVX-512, 8 on
/// AVX2.
template <bool kPairs, bool kBf16Exp = kPairs>
inline void softmax_rows(int64_t nq, int64_t rows, int64_t nk, float* s, const float* rmax, float* m, float* l,
                         float* alpha, uint32_t* p2, int64_t lds = kBk) {
  if constexpr (kHaveRows16)
    softmax_rows16<kPairs, kBf16Exp>(nq, rows, nk, s, rmax, m, l, alpha, p2, lds);
  else if constexpr (kHaveRows8 && !kPairs && !kBf16Exp)
    softmax_rows8<kPairs>(nq, rows, nk, s, rmax, m, l, alpha, p2, lds);
}

/// Row i's scores (nk keys from j0, scaled) with the keys the causal rule hides from it set to
/// −inf; returns the row's max vector over what is left (softmax_block's causal pass).
HWY_INLINE VF cut_causal_row(const CausalRule& causal, int64_t i, int64_t j0, int64_t nk, float* row) {
  const DF df;
  const int64_t N = lanes(), nvec = (nk + N - 1) / N;
  const VF vneg_inf = hn::Set(df, kNegInf);
  const KeyRange seen = causal.visible_keys(i, i + 1, j0, j0 + nk);
  const VF vlo = hn::Set(df, static_cast<float>(seen.lo - j0)), vhi = hn::Set(df, static_cast<float>(seen.hi - j0));
  VF vmax = vneg_inf;
  for (int64_t v = 0; v < nvec; ++v) {
    const VF jj = hn::Iota(df, static_cast<float>(v * N));
    const VF x = hn::IfThenElse(hn::And(hn::Ge(jj, vlo), hn::Lt(jj, vhi)), hn::LoadU(df, row + v * N), vneg_inf);
    vmax = hn::Max(vmax, x);
    hn::StoreU(x, df, row + v * N);
  }
  return vmax;
}

/// A Partial run (RowRun) on the 16-row softmax: the score tiles scaled S (rows × kBk) and took
/// each row's max vector over all nk keys; here rows i0 + r (r < nq) are cut by the causal rule
/// and their max vectors (rmax, kMaxLanes floats a row) taken again: softmax_block's causal
/// pass, so softmax_rows16 then gives that path's bits.
inline void cut_causal_rows(const CausalRule& causal, int64_t i0, int64_t nq, int64_t j0, int64_t nk, float* s,
                            float* rmax, int64_t lds = kBk) {
  const DF df;
  for (int64_t r = 0; r < nq; ++r)
    hn::StoreU(cut_causal_row(causal, i0 + r, j0, nk, s + r * lds), df, rmax + r * kMaxLanes);
}

// ---- online softmax over one block of scores ------------------------------------------------
// Turns S (rows × kBk, raw dot products) into the unnormalised, dropout-masked probabilities and
// updates m, l and alpha (the factor O must be rescaled by) for the rows < nq.
/// kBf16Exp: the probabilities are rounded to bf16 next (the bf16 path): exp_before_bf16.
template <bool kBf16Exp, class T>
void softmax_block(const Ctx<T>& cx, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t rows, int64_t j0, int64_t nk,
                   bool elementwise, float* s, const float* kb, float* m, float* l, float* alpha,
                   bool apply_dropout = true) {
  const SdpaParams& p = *cx.p;
  const DF df;
  const int64_t N = lanes(), nvec = (nk + N - 1) / N;
  const VF vscale = hn::Set(df, p.scale);
  const VF vneg_inf = hn::Set(df, kNegInf);
  // Whether the block has a key that is never read (kb = −inf); most blocks have none, and their
  // rows skip the select below.
  const bool any_hidden = has_hidden_keys(kb, nvec * N);
  const bool per_element = p.masks.allowed.view.defined() || p.masks.bias.view.defined();
  for (int64_t r = 0; r < nq; ++r) {
    float* row = s + r * kBk;
    const int64_t i = i0 + r;
    VF vmax = vneg_inf;
    if (HWY_LIKELY(!cx.edit_scores && !any_hidden)) {
      for (int64_t v = 0; v < nvec; ++v) {
        const VF x = hn::MulAdd(hn::LoadU(df, row + v * N), vscale, hn::LoadU(df, kb + v * N));
        vmax = hn::Max(vmax, x);
        hn::StoreU(x, df, row + v * N);
      }
    } else if (!cx.edit_scores) {
      for (int64_t v = 0; v < nvec; ++v) {
        // A key never read (kb = −inf: padding, key_bias −inf, or past the block) scores exactly −inf,
        // even when Q holds NaN or ±inf (their product with its zero-packed K row would be NaN).
        const VF kbv = hn::LoadU(df, kb + v * N);
        const VF x = hn::IfThenElse(hn::Eq(kbv, vneg_inf), kbv, hn::MulAdd(hn::LoadU(df, row + v * N), vscale, kbv));
        vmax = hn::Max(vmax, x);
        hn::StoreU(x, df, row + v * N);
      }
    } else {
      // Score edits (kernels/score_edits.h): c·tanh(t/c) of the scaled product, then the key
      // bias and ALiBi's m·(k_pos − q_pos), the distance formed exactly in float lanes.
      const bool capped = p.edits.capped();
      const VF vcap = hn::Set(df, capped ? p.edits.softcap : 1.0f);
      const VF vslope = hn::Set(df, p.edits.alibi() ? p.edits.alibi_slopes[h] : 0.0f);
      const float dist0 = static_cast<float>(j0 - (i + cx.alibi_offset));
      for (int64_t v = 0; v < nvec; ++v) {
        const VF kbv = hn::LoadU(df, kb + v * N);
        VF t = hn::Mul(hn::LoadU(df, row + v * N), vscale);
        if (capped) t = hn::Mul(vcap, hn::Tanh(df, hn::Div(t, vcap)));
        t = hn::MulAdd(vslope, hn::Iota(df, dist0 + static_cast<float>(v * N)), hn::Add(t, kbv));
        const VF x = hn::IfThenElse(hn::Eq(kbv, vneg_inf), kbv, t);
        vmax = hn::Max(vmax, x);
        hn::StoreU(x, df, row + v * N);
      }
    }
    if (elementwise && !per_element) {
      // Only the causal rule cuts this block: row i sees its keys [lo, hi) (key_hidden's rule;
      // padded keys are −inf from packing already), the rest score −inf, a vector pass.
      vmax = cut_causal_row(cx.causal, i, j0, nk, row);
    } else if (elementwise) {
      const bool has_bias = p.masks.bias.view.defined();
      for (int64_t jj = 0; jj < nk; ++jj) {
        if (row[jj] == kNegInf) continue;  // padding, key_bias −inf or past the block: decided at packing
        if (key_hidden(p, b, h, i, j0 + jj, cx.causal.offset))
          row[jj] = kNegInf;
        else if (has_bias)
          row[jj] += p.masks.bias.view(b, h, i, j0 + jj);
      }
      vmax = hn::Set(df, kNegInf);
      for (int64_t v = 0; v < nvec; ++v) vmax = hn::Max(vmax, hn::LoadU(df, row + v * N));
    }
    const float m_old = m[r];
    const float m_new = std::max(m_old, hn::GetLane(hn::MaxOfLanes(df, vmax)));
    // With nothing visible yet, m stays −inf; subtracting 0 instead keeps exp(−inf − m) = 0, not NaN.
    const float m_use = m_new == kNegInf ? 0.0f : m_new;
    alpha[r] = hn::GetLane(rescale_factor(hn::Set(df, m_old), hn::Set(df, m_use)));
    const VF vm = hn::Set(df, m_use);
    VF vsum = hn::Zero(df);
    auto any_nan = hn::MaskFromVec(hn::Zero(df));  // Max and exp_nonpositive may drop a NaN score: note it here
    for (int64_t v = 0; v < nvec; ++v) {
      const VF x = hn::LoadU(df, row + v * N);
      VF e;
      if constexpr (kBf16Exp) {
        e = exp_before_bf16(df, x, vm);  // keeps a NaN: the sum shows it
      } else {
        any_nan = hn::Or(any_nan, hn::IsNaN(x));
        e = exp_nonpositive(df, hn::Sub(x, vm));
      }
      vsum = hn::Add(vsum, e);
      hn::StoreU(e, df, row + v * N);
    }
    l[r] = rounded_product(l[r], alpha[r]) + hn::GetLane(hn::SumOfLanes(df, vsum));
    // A visible NaN score makes the row NaN (docs/semantics.md, 'NaN is never hidden'): a NaN l
    // stays NaN through later blocks and turns out and lse into NaN; hidden scores are −inf here.
    // So does a visible +inf score (m_new = +inf: take_row_maxima says why).
    if (HWY_UNLIKELY(!hn::AllFalse(df, any_nan)) || m_new == -kNegInf || (kBf16Exp && std::isnan(l[r]))) l[r] = kNaN;
    m[r] = m_new;
    // Dropout acts on the normalised probabilities; l (the normaliser) keeps every term.
    if (apply_dropout && p.dropout.active())
      for (int64_t jj = 0; jj < nk; ++jj)
        if (row[jj] != 0.0f && !dropout_keep(p.dropout.seed, p.dropout.p, b, h, i, j0 + jj)) row[jj] = 0.0f;
  }
  // Padding rows of the register tiles: zero probabilities and no rescaling keep them inert.
  for (int64_t r = nq; r < rows; ++r) {
    std::memset(s + r * kBk, 0, sizeof(float) * static_cast<size_t>(kBk));
    alpha[r] = 0.0f;
  }
}

/// The sink z joins a row's softmax denominator: m' = max(m, z), l' = l·e^{m−m'} + e^{z−m'}, and
/// an output accumulated against m is rescaled by e^{m−m'}. A row that saw no key gets l' = 1
/// (output 0, lse = z); a NaN row stays NaN.
inline void add_sink(float z, float& m, float& l, float& rescale) {
  const float m_new = std::max(m, z);
  rescale = m == kNegInf ? 0.0f : std::exp(m - m_new);
  l = l * rescale + std::exp(z - m_new);
  m = std::isnan(l) ? m : m_new;
}

// ---- attention weights (second pass) -------------------------------------------------------
// s holds exp(score − m) after dropout for rows < nq; scaled by keep_scale / l it is the row of
// final probabilities: written to the per-head weights and/or added to the head-sum of the
// averaged weights (divided by h when the item ends).
//
// The weights outputs are written once and not read again by the kernel: B·h·T_q·T_k floats,
// 128 MiB per-head at T = 2048, h = 8. Ordinary stores first read every line they write (and at
// that size from memory); non-temporal stores write whole lines without the read. Per-head
// weights in one pass, T = 2048, 1 / 2 threads (Intel Xeon, AVX-512): 95 / 48 → 82 / 42 ms. Their
// lines go to memory rather than cache, where most of such an output would not fit anyway; a
// smaller output is written with ordinary stores and stays in cache for whoever reads it next.
constexpr int64_t kStreamWeightsBytes = int64_t{16} << 20;

/// Bytes of the call's weights outputs (per-head and averaged).
inline int64_t weights_bytes(const SdpaParams& p) {
  int64_t n = 0;
  for (const View4<float>* w : {&p.weights, &p.weights_avg})
    if (w->defined()) n += w->shape[0] * w->shape[1] * w->shape[2] * w->shape[3];
  return n * static_cast<int64_t>(sizeof(float));
}

/// dst[j] for j < n from vec(j) (a vector of lanes() values from j) and scalar(j); with `stream`,
/// the vector-aligned middle with non-temporal stores, which the item's end orders
/// (drain_streams), and the pieces before and after it one value at a time.
template <class VecAt, class ScalarAt>
inline void write_row_of(float* dst, int64_t n, bool stream, const VecAt& vec, const ScalarAt& scalar) {
  const DF df;
  const int64_t N = lanes();
  int64_t j = 0;
  if (stream) {
    const auto lead =
        static_cast<int64_t>((reinterpret_cast<uintptr_t>(dst) / sizeof(float)) % static_cast<uintptr_t>(N));
    for (const int64_t head = std::min(n, lead == 0 ? 0 : N - lead); j < head; ++j) dst[j] = scalar(j);
    for (; j + N <= n; j += N) hn::Stream(vec(j), df, dst + j);
  } else {
    for (; j + N <= n; j += N) hn::StoreU(vec(j), df, dst + j);
  }
  for (; j < n; ++j) dst[j] = scalar(j);
}

/// n floats from src (or n copies of `value` where src is null) into dst (write_row_of).
inline void write_row(float* dst, const float* src, float value, int64_t n, bool stream) {
  const DF df;
  if (src)
    write_row_of(
        dst, n, stream, [&](int64_t j) { return hn::LoadU(df, src + j); }, [&](int64_t j) { return src[j]; });
  else
    write_row_of(
        dst, n, stream, [&](int64_t) { return hn::Set(df, value); }, [&](int64_t) { return value; });
}

/// n floats src·f into dst (each product rounded once, as scale_in_place's; write_row_of).
inline void write_scaled_row(float* dst, const float* src, float f, int64_t n, bool stream) {
  const DF df;
  const VF vf = hn::Set(df, f);
  write_row_of(
      dst, n, stream, [&](int64_t j) { return hn::Mul(hn::LoadU(df, src + j), vf); },
      [&](int64_t j) { return src[j] * f; });
}

/// Makes the thread's non-temporal stores (write_row_of) visible before anything that follows,
/// such as the end of the call: they are weakly ordered.
inline void drain_streams() {
#if HWY_ARCH_X86
  __builtin_ia32_sfence();  // _mm_sfence, without its header on every target
#endif
}

/// Elements [j0, j1) of row (b, h, i) of a weights view set to `value`.
inline void fill_row(const View4<float>& w, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t j1, float value,
                     bool stream) {
  if (j1 <= j0) return;
  float* row = &w(b, h, i, 0);
  const int64_t ws = w.stride[3];
  if (ws == 1)
    write_row(row + j0, nullptr, value, j1 - j0, stream);
  else
    for (int64_t j = j0; j < j1; ++j) row[j * ws] = value;
}

template <class T>
void write_weights(const Ctx<T>& cx, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t j0, int64_t nk,
                   const float* l, float* s) {
  const SdpaParams& p = *cx.p;
  const DF df;
  const int64_t N = lanes(), nvec = (nk + N - 1) / N;
  for (int64_t r = 0; r < nq; ++r) {
    float* row = s + r * kBk;
    const float f = l[r] == 0.0f ? 0.0f : cx.keep_scale / l[r];
    const VF vf = hn::Set(df, f);
    for (int64_t v = 0; v < nvec; ++v) hn::StoreU(hn::Mul(hn::LoadU(df, row + v * N), vf), df, row + v * N);
    if (p.weights.defined()) {
      float* w = &p.weights(b, h, i0 + r, j0);
      const int64_t ws = p.weights.stride[3];
      if (ws == 1)
        write_row(w, row, 0.0f, nk, cx.stream_weights);
      else
        for (int64_t jj = 0; jj < nk; ++jj) w[jj * ws] = row[jj];
    }
    if (p.weights_avg.defined()) {
      float* a = &p.weights_avg(b, 0, i0 + r, j0);
      const int64_t as = p.weights_avg.stride[3];
      for (int64_t jj = 0; jj < nk; ++jj) a[jj * as] += row[jj];
    }
  }
}

/// The rest of query i's weights row for head h: zeros outside the keys the block visited; a NaN
/// row (l = NaN) is NaN throughout, as the reference's.
template <class T>
void finish_weights_row(const Ctx<T>& cx, int64_t b, int64_t h, int64_t i, KeyRange keys, float l) {
  const SdpaParams& p = *cx.p;
  const int64_t Tk = cx.t_k;
  if (std::isnan(l)) {
    if (p.weights.defined()) fill_row(p.weights, b, h, i, 0, Tk, kNaN, cx.stream_weights);
    if (p.weights_avg.defined()) fill_row(p.weights_avg, b, 0, i, 0, Tk, kNaN, cx.stream_weights);
    return;
  }
  if (p.weights.defined()) {
    fill_row(p.weights, b, h, i, 0, keys.lo, 0.0f, cx.stream_weights);
    fill_row(p.weights, b, h, i, keys.hi, Tk, 0.0f, cx.stream_weights);
  }
}

// ---- attention weights in one pass ---------------------------------------------------------
// The key loop runs the weights-free online softmax unchanged (so out and lse are that path's,
// bit for bit) and keeps each key block's P = exp(s − m_j), dropout applied, in the thread's
// scratch, with m_j, the row's running max after block j (what P was taken against). When the
// item ends, one fix-up scales block j's segment by exp(m_j − m)·keep_scale/l with the row's
// final m and l, the sink folded in as add_sink does, and writes the rows out: three products
// per block of weights become two.

/// Row r of head hh's weights while unnormalised, in the thread's scratch (T_k floats).
template <class T>
float* one_pass_row(const Ctx<T>& cx, float* ws, int64_t hh, int64_t r) {
  return ws + cx.L.wp + (hh * kBq + r) * cx.L.ldw;
}

/// Before the key loop: every block's m_j −inf, so a block a row never visits counts as one it
/// saw nothing in (its weights are zeros).
template <class T>
void start_weights_one_pass(const Ctx<T>& cx, float* ws) {
  float* wm = ws + cx.L.wm;
  std::fill(wm, wm + cx.p->group() * kRowsPad * cx.L.wblocks, kNegInf);
}

/// After block `block_at` ([j0, j0 + nk)) of head hh for the item's rows [r0, r0 + nq), which saw
/// its first nk_seen keys (a run of RowRun; the rest hidden from them: zeros): s and m are those
/// rows' P and running max; s null where P was formed in the kept rows already (run_group).
template <class T>
void keep_weights_block(const Ctx<T>& cx, float* ws, int64_t hh, int64_t r0, int64_t nq, int64_t j0, int64_t nk_seen,
                        int64_t nk, int64_t block_at, const float* s, const float* m) {
  float* wm = ws + cx.L.wm + (hh * kRowsPad + r0) * cx.L.wblocks + block_at;
  const DF df;
  const int64_t N = lanes();
  for (int64_t r = 0; r < nq; ++r) {
    wm[r * cx.L.wblocks] = m[r];
    float* w = one_pass_row(cx, ws, hh, r0 + r) + j0;
    int64_t j = s ? 0 : nk_seen;  // at most kBk floats: inline vectors, not a call per row
    if (s) {
      const float* sr = s + r * kBk;
      for (; j + N <= nk_seen; j += N) hn::StoreU(hn::LoadU(df, sr + j), df, w + j);
      for (; j < nk_seen; ++j) w[j] = sr[j];
    }
    for (; j < nk; ++j) w[j] = 0.0f;
  }
}

/// n floats times f, in place.
inline void scale_in_place(float* x, int64_t n, float f) {
  const DF df;
  const int64_t N = lanes();
  const VF vf = hn::Set(df, f);
  int64_t j = 0;
  for (; j + N <= n; j += N) hn::StoreU(hn::Mul(hn::LoadU(df, x + j), vf), df, x + j);
  for (; j < n; ++j) x[j] *= f;
}

/// v as it is, opaque to the optimiser: a product passed through it is rounded on its own and
/// never fused with the add that follows into an FMA (which rounds once, differently). On the
/// x86 SIMD targets, whose vectors live in registers; elsewhere average_in stores the product,
/// which does the same (a product with a second use is not contracted).
#if HWY_ARCH_X86 && HWY_TARGET != HWY_SCALAR && HWY_TARGET != HWY_EMU128
constexpr bool kRoundingBarrier = true;
template <class V>
HWY_INLINE V as_rounded(V v) {
  asm("" : "+v"(v.raw));
  return v;
}
#else
constexpr bool kRoundingBarrier = false;
template <class V>
HWY_INLINE V as_rounded(V v) {
  return v;
}
#endif

/// One head's share of n elements of an averaged weights row (`as` apart): w scaled by f (stored
/// back in place when `keep_scaled`: that head's weights, as per-head weights hold them; w is not
/// read when `zero`: the head's weights there are zeros), a = (first ? 0 : a) + w, then a / heads
/// when `last`: the operations of zeroing the row, adding every head's weights and dividing at the
/// end, in one pass per head instead of four. The product is rounded before the sum (as_rounded)
/// so that the average adds exactly the per-head weights. Without `keep_scaled` (averaged weights
/// alone) the scaled row is not stored: ~3% of an averaged-weights core call at T = 2048.
inline void average_in(float* a, int64_t as, float* w, int64_t n, float f, bool zero, bool first, bool last,
                       float heads, bool keep_scaled) {
  if (zero && !first && !last) return;
  int64_t j = 0;
  if (as == 1) {
    const DF df;
    const int64_t N = lanes();
    const VF vf = hn::Set(df, f), vh = hn::Set(df, heads), v0 = hn::Zero(df);
    for (; j + N <= n; j += N) {
      VF add = v0;
      if (!zero) {
        add = as_rounded(hn::Mul(hn::LoadU(df, w + j), vf));
        if (keep_scaled || !kRoundingBarrier) hn::StoreU(add, df, w + j);
      }
      const VF sum = first ? add : hn::Add(hn::LoadU(df, a + j), add);
      hn::StoreU(last ? hn::Div(sum, vh) : sum, df, a + j);
    }
  }
  for (; j < n; ++j) {
    float add = 0.0f;
    if (!zero) {
      add = w[j] * f;
#if HWY_ARCH_X86
      asm("" : "+x"(add));  // (as as_rounded: no FMA with the sum below)
      if (keep_scaled) w[j] = add;
#else
      w[j] = add;  // (the store keeps it from an FMA with the sum below)
#endif
    }
    const float sum = first ? add : a[j * as] + add;
    a[j * as] = last ? sum / heads : sum;
  }
}

/// scale[k] = exp(m[k] − m_row)·f for a row's n blocks (m[k] ≤ m_row: the max after block k, then
/// the final one), whole vectors at a time: scale has room for n rounded up to kMaxLanes. Blocks
/// the row never saw (m[k] = −inf) get 0; a row with f = 0 is zeros throughout (its caller reads
/// no scale of it).
inline void block_scales(const float* m, int64_t n, float m_row, float f, float* scale) {
  const DF df;
  const int64_t N = lanes();
  const VF vm = hn::Set(df, m_row), vf = hn::Set(df, f);
  std::copy(m, m + n, scale);  // then in place, the tail of the last vector −inf: scale 0
  std::fill(scale + n, scale + round_up(n, N), kNegInf);
  for (int64_t k = 0; k < n; k += N)
    hn::StoreU(hn::Mul(exp_nonpositive(df, hn::Sub(hn::LoadU(df, scale + k), vm)), vf), df, scale + k);
}

/// The item's end: each row of each head of group g normalised (block j's segment by
/// exp(m_j − m)·keep_scale/l) on its way to the per-head weights (scaled in the scratch, then
/// copied) and to the averaged ones (average_in: the first head of the item writes the row, the
/// others add in head order, the last divides by h), so per-head, averaged and both agree bitwise;
/// zeros outside the keys the item visited and NaN rows NaN (finish_weights_row, as on the
/// two-pass path). A row with l = 0 saw no key (m = −inf) and a block with m_j = −inf only −inf
/// scores: their weights are zeros, written rather than scaled (exp(−inf − m) is NaN at m = −inf).
template <class T>
void finish_weights_one_pass(const Ctx<T>& cx, float* ws, int64_t b, int64_t g, int64_t i0, int64_t nq,
                             const KeyRange& keys) {
  const SdpaParams& p = *cx.p;
  const int64_t group = p.group(), Tk = cx.t_k;
  const bool per_head = p.weights.defined(), averaged = p.weights_avg.defined();
  const float heads = static_cast<float>(p.heads());
  float* const scales = ws + cx.L.wscale;
  for (int64_t hh = 0; hh < group; ++hh) {
    const int64_t h = g * group + hh;
    const bool first = h == 0, last = h == p.heads() - 1;
    const float* m = ws + cx.L.m + hh * kRowsPad;
    const float* l = ws + cx.L.l + hh * kRowsPad;
    const float* wm = ws + cx.L.wm + hh * kRowsPad * cx.L.wblocks;
    for (int64_t r = 0; r < nq; ++r) {
      float mr = m[r], lr = l[r], rescale = 1.0f;
      if (p.edits.sinks) add_sink(p.edits.sinks[h], mr, lr, rescale);
      finish_weights_row(cx, b, h, i0 + r, keys, lr);
      if (std::isnan(lr)) continue;
      float* const a = averaged ? &p.weights_avg(b, 0, i0 + r, 0) : nullptr;
      const int64_t as = averaged ? p.weights_avg.stride[3] : 0;
      if (first && averaged) {  // zeros outside the visited keys: the first head writes them
        fill_row(p.weights_avg, b, 0, i0 + r, 0, keys.lo, 0.0f, cx.stream_weights);
        fill_row(p.weights_avg, b, 0, i0 + r, keys.hi, Tk, 0.0f, cx.stream_weights);
      }
      const float f = lr == 0.0f ? 0.0f : cx.keep_scale / lr;
      float* w = one_pass_row(cx, ws, hh, r);
      const float* const wm_row = wm + r * cx.L.wblocks;
      block_scales(wm_row, (keys.hi - keys.lo + kBk - 1) / kBk, mr, f, scales);
      float* const dst = per_head ? &p.weights(b, h, i0 + r, 0) : nullptr;
      const int64_t ds = per_head ? p.weights.stride[3] : 0;
      // Per-head weights alone, contiguous: each block scaled on its way out, in one pass.
      const bool direct = per_head && !averaged && ds == 1;
      for (int64_t j0 = keys.lo, k = 0; j0 < keys.hi; j0 += kBk, ++k) {
        const int64_t nk = std::min(kBk, keys.hi - j0);
        const bool zero = f == 0.0f || wm_row[k] == kNegInf;
        const float block_scale = scales[k];
        if (direct) {
          if (zero)
            write_row(dst + j0, nullptr, 0.0f, nk, cx.stream_weights);
          else
            write_scaled_row(dst + j0, w + j0, block_scale, nk, cx.stream_weights);
          continue;
        }
        // Scaled where it lies (for the per-head copy below) as it is added to the average.
        if (zero && per_head) std::fill(w + j0, w + j0 + nk, 0.0f);
        if (averaged)
          average_in(a + j0 * as, as, w + j0, nk, block_scale, zero, first, last, heads, per_head);
        else if (!zero)
          scale_in_place(w + j0, nk, block_scale);
      }
      if (per_head && !direct) {
        if (ds == 1)
          write_row(dst + keys.lo, w + keys.lo, 0.0f, keys.hi - keys.lo, cx.stream_weights);
        else
          for (int64_t j = keys.lo; j < keys.hi; ++j) dst[j * ds] = w[j];
      }
    }
  }
}

// ---- packing one K/V block ------------------------------------------------------------------
/// Four contiguous K rows (`row` apart, d floats each, starting at src) into four adjacent columns
/// of a transposed block (kt[c·kBk + t] = row t's element c): 4×4 tiles through 128-bit
/// interleaves, four loads and four stores per 16 values; the tail of d one value at a time.
HWY_INLINE void transpose4_rows(const float* src, int64_t row, int64_t d, float* kt) {
  int64_t c = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::Full128<float> d4;
  for (; c + 4 <= d; c += 4) {
    const auto r0 = hn::LoadU(d4, src + c), r1 = hn::LoadU(d4, src + row + c);
    const auto r2 = hn::LoadU(d4, src + 2 * row + c), r3 = hn::LoadU(d4, src + 3 * row + c);
    const auto t0 = hn::InterleaveLower(d4, r0, r1), t1 = hn::InterleaveLower(d4, r2, r3);  // columns c, c+1
    const auto t2 = hn::InterleaveUpper(d4, r0, r1), t3 = hn::InterleaveUpper(d4, r2, r3);  // columns c+2, c+3
    hn::StoreU(hn::ConcatLowerLower(d4, t1, t0), d4, kt + c * kBk);
    hn::StoreU(hn::ConcatUpperUpper(d4, t1, t0), d4, kt + (c + 1) * kBk);
    hn::StoreU(hn::ConcatLowerLower(d4, t3, t2), d4, kt + (c + 2) * kBk);
    hn::StoreU(hn::ConcatUpperUpper(d4, t3, t2), d4, kt + (c + 3) * kBk);
  }
#endif
  for (; c < d; ++c)
    for (int64_t t = 0; t < 4; ++t) kt[c * kBk + t] = src[t * row + c];
}

// Key block [j0, j0 + nk) of (batch b, kv-head g): the key-only masks into kb (−inf for padded keys,
// keys with key_bias −inf and lanes ≥ nk), K transposed into kt (d × kBk; bf16 pairs with kDot)
// and, with_v, V into vp (nk rows of ldv; pairs of rows with kDot). A key kb marks −inf is never
// read: its K column and V row are zeros.
template <class T, bool kDot>
void pack_kv_block(const Ctx<T>& cx, int64_t b, int64_t g, int64_t j0, int64_t nk, bool with_v, float* kt, float* vp,
                   float* kb) {
  const SdpaParams& p = *cx.p;
  const int64_t D = p.d(), Dv = p.d_v(), d2 = (D + 1) / 2, ldv = cx.L.ldv;
  const bool has_pad = p.masks.key_padding.view.defined(), has_kbias = p.masks.key_bias.view.defined();
  const int64_t ks = cx.k.stride[3], vs = cx.v.stride[3];
  auto* const kt2 = reinterpret_cast<uint32_t*>(kt);
  auto* const v2 = reinterpret_cast<uint32_t*>(vp);
  // Key-only masks first: a padded key (or one with key_bias −inf) is never read.
  for (int64_t jj = 0; jj < kBk; ++jj) {
    float add = kNegInf;
    if (jj < nk && !(has_pad && p.masks.key_padding.view(b, 0, 0, j0 + jj)))
      add = has_kbias ? p.masks.key_bias.view(b, 0, 0, j0 + jj) : 0.0f;
    kb[jj] = add;
  }
  if constexpr (kDot) {
    const int64_t n2 = (nk + 1) / 2;
    for (int64_t jj = 0; jj < kBk; ++jj) {
      const T* src = kb[jj] != kNegInf ? cx.k.row(b, g, j0 + jj) : nullptr;
      if (src && ks == 1 && D % 2 == 0) {  // contiguous pairs are already the words we need
        for (int64_t c = 0; c < d2; ++c) std::memcpy(kt2 + c * kBk + jj, src + 2 * c, sizeof(uint32_t));
        continue;
      }
      for (int64_t c = 0; c < d2; ++c)
        kt2[c * kBk + jj] =
            src ? bf16_pair(src[2 * c * ks], 2 * c + 1 < D ? src[(2 * c + 1) * ks] : bf16{}) : uint32_t{0};
    }
    for (int64_t j2 = 0; j2 < (with_v ? n2 : 0); ++j2) {
      const T* lo = kb[2 * j2] != kNegInf ? cx.v.row(b, g, j0 + 2 * j2) : nullptr;
      const T* hi = 2 * j2 + 1 < nk && kb[2 * j2 + 1] != kNegInf ? cx.v.row(b, g, j0 + 2 * j2 + 1) : nullptr;
      uint32_t* dst = v2 + j2 * ldv;
      if (lo && hi && vs == 1)  // the common case, in a loop the compiler vectorises
        for (int64_t c = 0; c < Dv; ++c) dst[c] = bf16_pair(lo[c], hi[c]);
      else
        for (int64_t c = 0; c < Dv; ++c) dst[c] = bf16_pair(lo ? lo[c * vs] : bf16{}, hi ? hi[c * vs] : bf16{});
      std::fill(dst + Dv, dst + ldv, uint32_t{0});
    }
  } else {
    for (int64_t jj = 0; jj < kBk; ++jj) {
      if constexpr (std::is_same_v<T, float>) {
        // Four live contiguous rows at a time in 4×4 tiles (the scalar loop below stores one value
        // at a time to a 256-byte stride; it was 8–11% of short causal calls).
        if (ks == 1 && jj % 4 == 0 && kb[jj] != kNegInf && kb[jj + 1] != kNegInf && kb[jj + 2] != kNegInf &&
            kb[jj + 3] != kNegInf) {
          transpose4_rows(cx.k.row(b, g, j0 + jj), cx.k.stride[2], D, kt + jj);
          jj += 3;
          continue;
        }
      }
      const bool live = kb[jj] != kNegInf;
      const T* src = live ? cx.k.row(b, g, j0 + jj) : nullptr;
      for (int64_t c = 0; c < D; ++c) kt[c * kBk + jj] = live ? to_f32(src[c * ks]) : 0.0f;
    }
    for (int64_t jj = 0; jj < (with_v ? nk : 0); ++jj) {
      float* dst = vp + jj * ldv;
      if (kb[jj] == kNegInf) {
        std::fill(dst, dst + ldv, 0.0f);
        continue;
      }
      const T* src = cx.v.row(b, g, j0 + jj);
      if (vs == 1)
        for (int64_t c = 0; c < Dv; ++c) dst[c] = to_f32(src[c]);
      else
        for (int64_t c = 0; c < Dv; ++c) dst[c] = to_f32(src[c * vs]);
      std::fill(dst + Dv, dst + ldv, 0.0f);
    }
  }
}

// ---- the next item's rows, asked for while this one computes ------------------------------
/// An item a thread has claimed but not started, in its context (a packed batch's items each have
/// their sequence's); none where cx is null.
template <class T>
struct Upcoming {
  const Ctx<T>* cx = nullptr;
  int64_t b = 0, g = 0, qb = 0;
};

/// Cache lines asked for a few at a time between the register tiles of the products: a queue of
/// row ranges and a cursor. Hundreds of prefetches at once fill the core's line-fill buffers and
/// the next instructions wait on them (perf at B = 64, T = 128: a fifth of the kernel's samples on
/// the prefetch bursts); a few per tile arrive while the tiles run.
/// The cursor walks spans of whole lines: a row's, or one head's rows at once where they follow
/// one another with no gap (the (B, h, T, d) layouts), so that asking for a line is the prefetch
/// and an add. Forming each line's address from (head, row, line) counters instead cost 7 cycles
/// a line: at B = 64, T = 128 (causal, 1 thread, in cache) 12% of the kernel's time.
template <int kLocality>
class PrefetchDrip {
 public:
  /// `rows` rows `row_stride` bytes apart, of `heads` heads `head_stride` bytes apart, the first
  /// `bytes` of each (at most kMaxPrefetchBytes).
  void add(const void* row0, int64_t row_stride, int64_t rows, int64_t head_stride, int64_t heads, int64_t bytes) {
    if (rows <= 0 || heads <= 0 || bytes <= 0) return;
    MHA_DASSERT(n_ < kMaxRanges);
    if (bytes == row_stride && bytes <= kMaxPrefetchBytes) {
      bytes *= rows;  // rows back to back: one span per head
      rows = 1;
    } else {
      bytes = std::min(bytes, kMaxPrefetchBytes);
    }
    ranges_[n_++] = {reinterpret_cast<uintptr_t>(row0), row_stride, rows, head_stride, heads, bytes};
    lines_ += heads * rows * ((bytes + 63) / 64 + 1);  // an upper bound: a row may straddle one more line
  }
  /// Lines still to ask for (an upper bound).
  int64_t lines() const { return lines_; }
  /// Asks for the next n lines.
  void step(int64_t n) {
    while (n > 0) {
      if (left_ == 0 && !next_span()) return;
      const int64_t k = std::min(n, left_);
      uintptr_t line = line_;
      for (int64_t i = 0; i < k; ++i, line += 64) {
        asm volatile("");  // (keeps the loop: see prefetch_bytes in kernels/common.h)
        __builtin_prefetch(reinterpret_cast<const char*>(line), 0, kLocality);
      }
      line_ = line;
      left_ -= k;
      n -= k;
      lines_ = std::max<int64_t>(0, lines_ - k);
    }
    if (left_ == 0 && cur_ == n_) clear();  // all asked for: the next add() starts a new queue
  }
  void finish() { step(lines_ + 1); }
  void clear() { n_ = cur_ = 0, head_ = row_ = left_ = lines_ = 0, line_ = 0; }

 private:
  /// Sets line_ and left_ to the lines of the next span (row row_ of head head_ of range cur_)
  /// and moves the counters past it; false, with the queue cleared, when none is left.
  bool next_span() {
    if (cur_ == n_) {
      clear();
      return false;
    }
    const Range& r = ranges_[cur_];
    const uintptr_t row = r.base + static_cast<uintptr_t>(head_ * r.head_stride + row_ * r.row_stride);
    line_ = row & ~uintptr_t{63};
    left_ = static_cast<int64_t>((row + static_cast<uintptr_t>(r.bytes) - 1 - line_) / 64) + 1;
    if (++row_ == r.rows) {
      row_ = 0;
      if (++head_ == r.heads) head_ = 0, ++cur_;
    }
    return true;
  }

  static constexpr int kMaxRanges = 4;
  struct Range {
    uintptr_t base;
    int64_t row_stride, rows, head_stride, heads, bytes;
  };
  Range ranges_[kMaxRanges];
  int n_ = 0, cur_ = 0;
  int64_t head_ = 0, row_ = 0, left_ = 0, lines_ = 0;
  uintptr_t line_ = 0;
};

/// Queues what item `u` reads from memory first: its Q rows (every head of the group), its output
/// rows (the stores then find their lines in cache) and the K and V rows of its first key block
/// (unless packed once per call). Into L2.
template <class T>
void queue_upcoming(const Upcoming<T>& u, PrefetchDrip<2>& drip) {
  if (!u.cx) return;
  const Ctx<T>& cx = *u.cx;
  const SdpaParams& p = *cx.p;
  const int64_t group = p.group(), i0 = u.qb * kBq, nq = std::min(kBq, cx.t_q - i0);
  const KeyRange keys = cx.causal.visible_keys(i0, i0 + nq, 0, cx.t_k);
  const int64_t nk = cx.prepacked ? 0 : std::min(kBk, keys.hi - keys.lo);
  const int64_t h0 = u.g * group;
  constexpr int64_t kT = sizeof(T), kF = sizeof(float);
  drip.add(cx.q.row(u.b, h0, i0), cx.q.stride[2] * kT, nq, cx.q.stride[1] * kT, group, p.d() * cx.q.stride[3] * kT);
  drip.add(cx.out.row(u.b, h0, i0), cx.out.stride[2] * kF, nq, cx.out.stride[1] * kF, group,
           p.d_v() * cx.out.stride[3] * kF);
  if (nk == 0) return;
  drip.add(cx.k.row(u.b, u.g, keys.lo), cx.k.stride[2] * kT, nk, 0, 1, p.d() * cx.k.stride[3] * kT);
  drip.add(cx.v.row(u.b, u.g, keys.lo), cx.v.stride[2] * kT, nk, 0, 1, p.d_v() * cx.v.stride[3] * kT);
}

/// Runs f(it, ahead) for items taken from `counter` until it passes n, each claimed one ahead of
/// the one in hand (ahead ≥ n: none), so that the next item's rows can be asked for while this
/// one computes (queue_upcoming); still first come, first served, each item by one thread.
template <class F>
void claim_one_ahead(std::atomic<int64_t>& counter, int64_t n, const F& f) {
  int64_t it = counter.fetch_add(1, std::memory_order_relaxed);
  while (it < n) {
    const int64_t ahead = counter.fetch_add(1, std::memory_order_relaxed);
    f(it, ahead);
    it = ahead;
  }
}

// ---- (batch b, kv-head g, query block qb) for every query head of the group ----------------
// Without weights: one pass over the keys with the online softmax. With weights in one pass
// (weights_one_pass), the same pass keeps each block's probabilities and the max they were taken
// against, and finish_weights_one_pass normalises them at the end. With weights in two passes
// (beyond kOnePassWeightsMaxBytes): a first pass finds each row's max m and sum l
// (no P·V, no dropout); a second recomputes the scores block by block, forms the final
// probabilities keep_scale·exp(s − m)/l (dropout applied), writes them as weights and
// accumulates P·V with no rescaling.
template <class T, bool kDot>
HWY_NOINLINE void run_group(const Ctx<T>& cx, int64_t b, int64_t g, int64_t qb, float* ws,
                            const Upcoming<T>& upcoming = {}) {
  const SdpaParams& p = *cx.p;
  const ScratchPlan& L = cx.L;
  const int64_t group = p.group(), Tq = cx.t_q, Tk = cx.t_k, D = p.d(), Dv = p.d_v();
  const int64_t i0 = qb * kBq, nq = std::min(kBq, Tq - i0);
  // The float32 tiles take any row count; the bf16 pair tiles work on whole tiles of kMRdp rows.
  const int64_t rows = kDot ? round_up(nq, cx.amx ? int64_t{16} : int64_t{kMRdp}) : nq;
  const int64_t N = lanes(), nvec_o = (Dv + N - 1) / N, d2 = (D + 1) / 2, ldq2 = L.ldq / 2;
  const int64_t ldv = L.ldv;
  const bool per_element_masks = p.masks.allowed.view.defined() || p.masks.bias.view.defined();
  float* const qp = ws + L.q;
  float* const kt = ws + L.kt;
  float* const vp = ws + L.v;
  float* const s = ws + L.s;
  float* const o = ws + L.o;
  float* const kb = ws + L.kb;
  auto* const q2 = reinterpret_cast<uint32_t*>(qp);
  auto* const p2 = reinterpret_cast<uint32_t*>(ws + L.p2);

  // float32 Q with contiguous rows is read where it lies (ldq_use apart; the float32 tiles need
  // no padding rows); else Q of every head of the group is copied, rows ≥ nq zero. For a short
  // item the copy was a sixth of the time outside the products.
  constexpr bool kF32 = std::is_same_v<T, float> && !kDot;
  const bool q_in_place = kF32 && cx.q.stride[3] == 1;
  const int64_t ldq_use = q_in_place ? cx.q.stride[2] : L.ldq;
  const auto q_head = [&](int64_t hh) -> const float* {
    if constexpr (kF32) {
      if (q_in_place) return cx.q.row(b, g * group + hh, i0);
    }
    return qp + hh * kRowsPad * L.ldq;
  };
  for (int64_t hh = 0; hh < group; ++hh) {
    const int64_t h = g * group + hh;
    float* qh = qp + hh * kRowsPad * L.ldq;
    for (int64_t r = 0; r < (q_in_place ? 0 : rows); ++r) {
      if (r >= nq) {  // padding rows of the register tiles, in whichever layout is in use
        if constexpr (kDot)
          std::memset(q2 + (hh * kRowsPad + r) * ldq2, 0, sizeof(uint32_t) * static_cast<size_t>(ldq2));
        else
          std::memset(qh + r * L.ldq, 0, sizeof(float) * static_cast<size_t>(L.ldq));
        continue;
      }
      const T* src = cx.q.row(b, h, i0 + r);
      const int64_t qs = cx.q.stride[3];
      if constexpr (kDot) {
        uint32_t* dst = q2 + hh * kRowsPad * ldq2 + r * ldq2;
        for (int64_t c = 0; c < d2; ++c)
          dst[c] = bf16_pair(src[2 * c * qs], 2 * c + 1 < D ? src[(2 * c + 1) * qs] : bf16{});
      } else if (qs == 1) {  // the common case, in a loop the compiler vectorises
        for (int64_t c = 0; c < D; ++c) qh[r * L.ldq + c] = to_f32(src[c]);
      } else {
        for (int64_t c = 0; c < D; ++c) qh[r * L.ldq + c] = to_f32(src[c * qs]);
      }
    }
    std::fill(ws + L.m + hh * kRowsPad, ws + L.m + (hh + 1) * kRowsPad, kNegInf);
    std::fill(ws + L.l + hh * kRowsPad, ws + L.l + (hh + 1) * kRowsPad, 0.0f);
    std::fill(o + hh * kRowsPad * ldv, o + (hh * kRowsPad + rows) * ldv, 0.0f);
  }

  // Only the keys some row of this block may see.
  const KeyRange keys = cx.causal.visible_keys(i0, i0 + nq, 0, Tk);
  const int64_t j_begin = keys.lo, j_end = keys.hi;
  const int64_t ks = cx.k.stride[3], vs = cx.v.stride[3];
  // Key block [j0, j0 + nk) ready for the products: from the prepacked blocks when the call
  // packed them (a block this item uses in full, else one whose tail lanes the item must not see:
  // its masks are copied with those lanes −inf), else packed into this thread's scratch.
  const float *kt_use = kt, *vp_use = vp, *kb_use = kb;
  // float32 V is read where it lies when its rows are contiguous, whole vectors wide and back to
  // back (a (B, kv, T, d_v) tensor), and no key is hidden by padding or key_bias (those rows must
  // read as zeros, and could hold anything); else packed with K (ldv apart, zero where hidden).
  // Rows further apart, as in a module's (N, 3·E) projection buffer (6 KiB at E = 512), fall into
  // a few sets of L1 and are fetched again for every tile: where a thread keeps its packed blocks
  // for several items (keeps_packed_blocks) they are packed too (module B=16, T=512: 181 / 93 ms
  // in place, 166 / 86 packed, 1 / 2 threads). An item that packs for itself alone reads them in
  // place (module B=64, T=128: 2-5% slower on 2 threads with each item copying its V).
  const bool v_in_place = kF32 && vs == 1 && Dv % N == 0 && (L.kept_blocks == 0 || cx.v.stride[2] == Dv) &&
                          !p.masks.key_padding.view.defined() && !p.masks.key_bias.view.defined();
  int64_t ldvp = ldv;
  // Lines for later, asked for a few at a time between the tiles of the products (PrefetchDrip):
  // the next key block's K and V rows, and the next item's rows. The float32 products run in
  // chunks of kDripRows query rows, a step after each; the bf16 ones a step after each product.
  // Under a call's prepacked K/V, or when this thread has kept every one of at least 16 blocks
  // the item reads, only the next item's Q and output rows remain, a trickle per key block: each
  // product runs whole (its chunks' calls cost ~5% at T = 4096; over fewer blocks the trickle
  // would come in bursts: 3–5% slower at B = 64, T = 256).
  bool all_kept = L.kept_blocks > 0 && j_begin % kBk == 0 && j_end - j_begin >= 16 * kBk;
  if (all_kept) {
    const auto* const tag = reinterpret_cast<const int64_t*>(ws + L.kept_tag);
    const int64_t first = j_begin / kBk, last = (j_end - 1) / kBk;
    const uint64_t span = (last - first == 63 ? ~uint64_t{0} : (uint64_t{1} << (last - first + 1)) - 1) << first;
    all_kept = tag[0] == b * p.kv_heads() + g && (static_cast<uint64_t>(tag[1]) & span) == span;
  }
  const int64_t chunk_rows = kF32 && !cx.prepacked && !all_kept ? kDripRows : kRowsPad;
  // The block's rows in runs by causal visibility (RowRun). With weights in two passes, every
  // row takes the whole block (the second pass writes each row's probabilities over it); blocks
  // that straddle the causal diagonal or the window's lower edge are masked per element there.
  // One-pass weights take the runs as the weights-free path does (keep_weights_block zeroes
  // what a run does not see; a row skipped by a block keeps m_j = −inf there: zeros).
  const auto block_runs = [&](int64_t j0, int64_t nk, RowRun* runs) -> int64_t {
    if (!cx.weights_two_pass) return row_runs(cx.causal, i0, nq, j0, nk, runs);
    runs[0] = {0, nq, nk, cx.causal.tile(i0, i0 + nq, j0, j0 + nk) == TileVis::All ? TileVis::All : TileVis::Partial};
    return 1;
  };
  // The drip's steps a key block gives: one after each product (score and P·V) of each chunk of
  // each run of rows that sees the block (as the loop below takes them), for every head of the
  // group. Counted exactly, so that what is asked for spreads over the steps there are: a causal
  // item at T = 128 skips a fifth of the chunks a whole-rows count assumed, and those lines came
  // in one burst at the item's end.
  const auto block_steps = [&](int64_t j0) {
    RowRun runs[kMaxRuns];
    const int64_t n_runs = block_runs(j0, std::min(kBk, j_end - j0), runs);
    int64_t steps = 0;
    for (int64_t ri = 0; ri < n_runs; ++ri) {
      if (runs[ri].vis == TileVis::None) continue;
      const int64_t rows_run = (runs[ri].r1 == nq ? rows : runs[ri].r1) - runs[ri].r0;
      steps += kDot ? 1 : (rows_run + chunk_rows - 1) / chunk_rows;
    }
    return group * 2 * steps;
  };
  PrefetchDrip<3> next_block;
  PrefetchDrip<2> next_item;
  queue_upcoming(upcoming, next_item);
  int64_t item_steps = 0;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kBk) item_steps += block_steps(j0);
  item_steps = std::max<int64_t>(1, item_steps);
  const int64_t item_step = (next_item.lines() + item_steps - 1) / item_steps;
  int64_t block_step = 0;
  const auto drip = [&] {
    next_block.step(block_step);
    next_item.step(item_step);
  };
  // A packed block of layout K in use: its K, V and masks; a block whose first nk keys alone this
  // item may see gets its masks copied with the other lanes −inf.
  const auto use_packed = [&](const float* block, const PackedBlockLayout& K, int64_t nk, int64_t width) {
    kt_use = block + K.kt;
    vp_use = block + K.v;
    kb_use = block + K.kb;
    if (nk < width) {
      std::copy(kb_use, kb_use + nk, kb);
      std::fill(kb + nk, kb + kBk, kNegInf);
      kb_use = kb;
    }
  };
  const auto use_v_in_place = [&](int64_t j0) {
    if constexpr (kF32) {
      if (v_in_place) vp_use = cx.v.row(b, g, j0), ldvp = cx.v.stride[2];
    }
  };
  // Asks for the next K/V block (unless `needed` is false: kept already), a few lines between the
  // tiles of this block's products: packing reads it from L3 or memory. (A prefetch reads no
  // value; padded rows stay unread. V read in place next to kept blocks lies in back-to-back rows,
  // which the hardware streams by itself.)
  const auto ask_next_block = [&](int64_t j0, bool with_v, bool needed) {
    next_block.finish();  // what the last block's tiles left (a run that skipped tiles)
    if (needed && j0 + kBk < j_end) {
      constexpr int64_t kT = sizeof(T);
      const int64_t n_next = std::min(kBk, j_end - j0 - kBk);
      next_block.add(cx.k.row(b, g, j0 + kBk), cx.k.stride[2] * kT, n_next, 0, 1, D * ks * kT);
      if (with_v)
        next_block.add(cx.v.row(b, g, j0 + kBk), cx.v.stride[2] * kT, n_next, 0, 1, Dv * vs * kT);
      else
        next_block.finish();  // the first of two weights passes: no tiles to spread them over
    }
    const int64_t steps = std::max<int64_t>(1, block_steps(j0));
    block_step = (next_block.lines() + steps - 1) / steps;
  };
  const auto pack_block = [&](int64_t j0, int64_t nk, bool with_v) {
    ldvp = ldv;
    const int64_t width = std::min(kBk, Tk - j0);
    // bf16 pairs: an odd nk short of the packed width would pair the last key with one no row may
    // see (its V row would enter a product), so that block is packed here.
    const bool whole_block = j0 % kBk == 0 && (!kDot || nk == width || nk % 2 == 0);
    if (L.kept_blocks > 0 && whole_block) {
      // This thread's kept blocks (keeps_packed_blocks): packed by the first item of the pair
      // that needs them, whole (as prepacked ones), V only where it is not read in place.
      auto* const tag = reinterpret_cast<int64_t*>(ws + L.kept_tag);
      const int64_t pair = b * p.kv_heads() + g, slot = j0 / kBk;
      if (tag[0] != pair) tag[0] = pair, tag[1] = 0;
      const auto have = [&](int64_t at) { return at < L.kept_blocks && ((static_cast<uint64_t>(tag[1]) >> at) & 1u); };
      const PackedBlockLayout& K = L.kept_layout;
      float* const block = ws + L.kept + slot * K.stride;
      if (!have(slot)) {
        pack_kv_block<T, kDot>(cx, b, g, j0, width, !v_in_place, block + K.kt, block + K.v, block + K.kb);
        tag[1] = static_cast<int64_t>(static_cast<uint64_t>(tag[1]) | (uint64_t{1} << slot));
      }
      use_packed(block, K, nk, width);
      use_v_in_place(j0);
      ask_next_block(j0, with_v, !have(slot + 1));
      return;
    }
    if (cx.prepacked && whole_block) {
      const PackedBlockLayout& K = cx.prepack.layout;
      use_packed(cx.prepacked + ((b * p.kv_heads() + g) * cx.prepack.blocks + j0 / kBk) * K.stride, K, nk, width);
      return;
    }
    pack_kv_block<T, kDot>(cx, b, g, j0, nk, with_v && !v_in_place, kt, vp, kb);
    kt_use = kt;
    vp_use = vp;
    kb_use = kb;
    use_v_in_place(j0);
    ask_next_block(j0, with_v, true);
  };

  if (cx.amx) amx::configure();  // this thread's tiles, for the products of this item
  if (cx.weights_one_pass) start_weights_one_pass(cx, ws);
  // With weights in two passes, the first: each row's max m and sum l over every key block.
  if (cx.weights_two_pass) {
    for (int64_t j0 = j_begin; j0 < j_end; j0 += kBk) {
      const int64_t nk = std::min(kBk, j_end - j0), nvec = (nk + N - 1) / N;
      pack_block(j0, nk, false);
      const bool partial = cx.causal.tile(i0, i0 + nq, j0, j0 + nk) != TileVis::All;
      for (int64_t hh = 0; hh < group; ++hh) {
        const int64_t h = g * group + hh;
        if constexpr (kDot)
          (cx.amx ? score_block_amx : score_block_dp)(q2 + hh * kRowsPad * ldq2, ldq2, rows, d2,
                                                      reinterpret_cast<const uint32_t*>(kt_use), nvec, s, 0.0f, nullptr,
                                                      nullptr);
        else
          score_block(q_head(hh), ldq_use, rows, D, kt_use, nvec, s);
        softmax_block<kDot>(cx, b, h, i0, nq, rows, j0, nk, partial || per_element_masks, s, kb_use,
                            ws + L.m + hh * kRowsPad, ws + L.l + hh * kRowsPad, ws + L.alpha, /*apply_dropout=*/false);
      }
    }
  }
  // With weights in two passes and sinks, the sink joins m and l now, so that the second pass
  // writes the final probabilities and accumulates P·V with them.
  if (cx.weights_two_pass && p.edits.sinks) {
    for (int64_t hh = 0; hh < group; ++hh) {
      float* m = ws + L.m + hh * kRowsPad;
      float* l = ws + L.l + hh * kRowsPad;
      float rescale = 1.0f;
      for (int64_t r = 0; r < nq; ++r) add_sink(p.edits.sinks[g * group + hh], m[r], l[r], rescale);
    }
  }
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kBk) {
    const int64_t nk = std::min(kBk, j_end - j0);
    pack_block(j0, nk, true);
    const int64_t block_at = (j0 - j_begin) / kBk;
    RowRun runs[kMaxRuns];
    const int64_t n_runs = block_runs(j0, nk, runs);
    for (int64_t hh = 0; hh < group; ++hh) {
      const int64_t h = g * group + hh;
      for (int64_t ri = 0; ri < n_runs; ++ri) {
        const RowRun& run = runs[ri];
        if (run.vis == TileVis::None) continue;
        const bool partial = run.vis == TileVis::Partial;
        const int64_t r0 = run.r0, nq_run = run.r1 - r0;
        // Padding rows of the bf16 tiles belong to the last run.
        const int64_t rows_run = (run.r1 == nq ? rows : run.r1) - r0;
        // A per-element mask is applied to the block's keys [0, nk) only, so its rows keep them all.
        const int64_t nk_run = per_element_masks ? nk : run.nk, nvec = (nk_run + N - 1) / N;
        float* const oh = o + (hh * kRowsPad + r0) * ldv;
        float* const m = ws + L.m + hh * kRowsPad + r0;
        float* const l = ws + L.l + hh * kRowsPad + r0;
        float* const alpha = ws + L.alpha + r0;
        uint32_t* const p2r = p2 + r0 * (kBk / 2);
        const uint32_t* const q2r = q2 + (hh * kRowsPad + r0) * ldq2;
        // The common case on AVX-512 scales, masks and takes the rows' maxima as it scores, and
        // finishes the softmax 16 rows at a time (softmax_rows16).
        // A run cut by the causal rule alone takes it too, its hidden keys masked after scoring
        // (cut_causal_rows).
        const bool rows16 =
            kFusedSoftmax && !cx.weights_two_pass && !cx.edit_scores && !per_element_masks && !p.dropout.active();
        float* const rmax = rows16 ? ws + L.rmax + r0 * kMaxLanes : nullptr;
        // One-pass weights on that path (float32): the scores go straight into the rows the
        // weights are kept in (ldw apart), and P stays there for the products, instead of being
        // copied there after the softmax (keep_weights_block). Only where the block's whole
        // vectors end within the row.
        const bool p_in_weights = kF32 && rows16 && cx.weights_one_pass && j0 + round_up(nk, kMaxLanes) <= L.ldw;
        const int64_t lds = p_in_weights ? L.ldw : kBk;
        float* const sr = p_in_weights ? one_pass_row(cx, ws, hh, r0) + j0 : s + r0 * kBk;
        if constexpr (kDot) {
          (cx.amx ? score_block_amx : score_block_dp)(
              q2r, ldq2, rows_run, d2, reinterpret_cast<const uint32_t*>(kt_use), nvec, sr, p.scale, kb_use, rmax);
          drip();
        } else {
          const bool kb_hidden = !rmax || has_hidden_keys(kb_use, nvec * N);
          for (int64_t c0 = 0; c0 < rows_run; c0 += chunk_rows) {
            score_block(q_head(hh) + (r0 + c0) * ldq_use, ldq_use, std::min(chunk_rows, rows_run - c0), D, kt_use, nvec,
                        sr + c0 * lds, p.scale, kb_use, rmax ? rmax + c0 * kMaxLanes : nullptr, lds, kb_hidden);
            drip();
          }
        }
        if (rows16 && partial) cut_causal_rows(cx.causal, i0 + r0, nq_run, j0, nk_run, sr, rmax, lds);
        if (cx.weights_two_pass) {
          // m is final: the block's max cannot exceed it, so alpha = 1 and exp(s − m) ≤ 1.
          std::fill(ws + L.l2, ws + L.l2 + kRowsPad, 0.0f);
          softmax_block<kDot>(cx, b, h, i0, nq, rows, j0, nk, partial || per_element_masks, s, kb_use, m, ws + L.l2,
                              alpha);
          write_weights(cx, b, h, i0, nq, j0, nk, l, s);
          if constexpr (kDot) to_bf16_pairs(s, rows, nk, p2);
        } else if (rows16 && !(kDot && cx.weights_one_pass)) {
          softmax_rows<kDot>(nq_run, rows_run, nk_run, sr, rmax, m, l, alpha, p2r, lds);
        } else if (rows16) {
          // One-pass weights keep P as float32; its bf16 pairs are then the words that
          // softmax_rows16<true> writes.
          softmax_rows<false, kDot>(nq_run, rows_run, nk_run, sr, rmax, m, l, alpha, p2r);
          to_bf16_pairs(sr, rows_run, nk_run, p2r);
        } else {
          softmax_block<kDot>(cx, b, h, i0 + r0, nq_run, rows_run, j0, nk_run, partial || per_element_masks, sr, kb_use,
                              m, l, alpha);
          if constexpr (kDot) to_bf16_pairs(sr, rows_run, nk_run, p2r);
        }
        if (cx.weights_one_pass)
          keep_weights_block(cx, ws, hh, r0, nq_run, j0, nk_run, nk, block_at, p_in_weights ? nullptr : sr, m);
        if constexpr (kDot) {
          if (cx.amx)
            out_block_amx(p2r, alpha, rows_run, reinterpret_cast<const uint32_t*>(vp_use), ldv, nk_run, nvec_o, oh,
                          reinterpret_cast<uint32_t*>(ws + L.vtail));
          else
            out_block_dp(p2r, alpha, rows_run, reinterpret_cast<const uint32_t*>(vp_use), ldv, nk_run, nvec_o, oh);
          drip();
        } else
          for (int64_t c0 = 0; c0 < rows_run; c0 += chunk_rows) {
            // A run cut by the causal rule takes P·V in pieces of kDripRows rows, each stopping
            // at the last key its own rows see: what it leaves out are products with zeros of P
            // (at B = 64, T = 128 a fourteenth of the P·V products; in cache the call 2.6%
            // faster). Pieces, not chunks: a chunk is the whole run where the thread kept or the
            // call prepacked the blocks, which depends on the scheduling, and which rows a NaN in
            // a hidden key's V row reaches must not.
            const int64_t c1 = std::min(rows_run, c0 + chunk_rows);
            for (int64_t a = c0; a < c1; a += partial ? kDripRows : c1 - c0) {
              const int64_t e = partial ? std::min(c1, a + kDripRows) : c1;
              const int64_t nk_piece =
                  partial ? std::clamp<int64_t>(
                                cx.causal.visible_keys(i0 + r0 + a, i0 + r0 + e, j0, j0 + nk_run).hi - j0, 1, nk_run)
                          : nk_run;
              out_block(sr + a * lds, alpha + a, e - a, vp_use, ldvp, ldv, nk_piece, nvec_o, oh + a * ldv, lds);
            }
            drip();
          }
      }
    }
  }

  if (cx.amx) amx::release();
  next_item.finish();  // what tiles skipped under a causal mask left

  // Normalise and write out; a row that saw no key gives zeros and lse = −inf; a row that saw a
  // NaN score has l = NaN, so out and lse are NaN.
  for (int64_t hh = 0; hh < group; ++hh) {
    const int64_t h = g * group + hh;
    const float* oh = o + hh * kRowsPad * ldv;
    const float* m = ws + L.m + hh * kRowsPad;
    const float* l = ws + L.l + hh * kRowsPad;
    for (int64_t r = 0; r < nq; ++r) {
      float* dst = cx.out.row(b, h, i0 + r);
      const int64_t os = cx.out.stride[3];
      if (cx.weights_two_pass) {  // P was normalised in the second pass, by an l that holds the sink already
        const bool empty_row = l[r] == 0.0f;
        finish_weights_row(cx, b, h, i0 + r, keys, l[r]);
        const float fill = std::isnan(l[r]) ? kNaN : 0.0f;
        for (int64_t c = 0; c < Dv; ++c) dst[c * os] = empty_row || fill != 0.0f ? fill : oh[r * ldv + c];
        if (cx.lse.defined()) cx.lse(b, h, i0 + r, 0) = empty_row ? kNegInf : m[r] + std::log(l[r]);
        continue;
      }
      float mr = m[r], lr = l[r], rescale = 1.0f;
      if (p.edits.sinks) add_sink(p.edits.sinks[h], mr, lr, rescale);
      const bool empty_row = lr == 0.0f;
      const float inv = empty_row ? 0.0f : cx.keep_scale * rescale / lr;
      if (os == 1)  // the common case, in a loop the compiler vectorises
        for (int64_t c = 0; c < Dv; ++c) dst[c] = empty_row ? 0.0f : oh[r * ldv + c] * inv;
      else
        for (int64_t c = 0; c < Dv; ++c) dst[c * os] = empty_row ? 0.0f : oh[r * ldv + c] * inv;
      if (cx.lse.defined()) cx.lse(b, h, i0 + r, 0) = empty_row ? kNegInf : mr + std::log(lr);
    }
  }
  if (cx.weights_one_pass) finish_weights_one_pass(cx, ws, b, g, i0, nq, keys);
  if (cx.stream_weights) drain_streams();
}

// ---- one work item ---------------------------------------------------------------------------
// (batch, kv-head, query block); with averaged weights (batch, query block) and every kv-head in
// turn, so that one item owns each averaged row: zeroed, summed over heads in order, divided by h.
template <class T, bool kDot>
void run_item(const Ctx<T>& cx, int64_t item, float* ws, int64_t next_item = -1) {
  const SdpaParams& p = *cx.p;
  const int64_t KV = p.kv_heads(), qb = item % cx.q_blocks;
  if (!p.weights_avg.defined()) {
    Upcoming<T> next;
    if (next_item >= 0)
      next = {&cx, next_item / (cx.q_blocks * KV), (next_item / cx.q_blocks) % KV, next_item % cx.q_blocks};
    run_group<T, kDot>(cx, item / (cx.q_blocks * KV), (item / cx.q_blocks) % KV, qb, ws, next);
    return;
  }
  const int64_t b = item / cx.q_blocks, i0 = qb * kBq, nq = std::min(kBq, cx.t_q - i0), Tk = cx.t_k;
  const View4<float>& avg = p.weights_avg;
  // One-pass weights: the groups' fix-ups write, add and divide the rows themselves (average_in).
  // (Ordinary stores: the heads' sums read these lines next; streamed, they would go to memory.)
  if (!cx.weights_one_pass)
    for (int64_t r = 0; r < nq; ++r) fill_row(avg, b, 0, i0 + r, 0, Tk, 0.0f, /*stream=*/false);
  for (int64_t g = 0; g < KV; ++g) run_group<T, kDot>(cx, b, g, qb, ws);
  if (cx.weights_one_pass) return;
  const float heads = static_cast<float>(p.heads());
  const int64_t as = avg.stride[3];
  for (int64_t r = 0; r < nq && Tk > 0; ++r) {
    float* row = &avg(b, 0, i0 + r, 0);
    for (int64_t j = 0; j < Tk; ++j) row[j * as] /= heads;
  }
}

/// Item `at` of the order threads take them in: the items of each (batch, kv-head) together (they
/// read the same K/V), and under a causal mask their query blocks last first, since a later block
/// sees more keys. Taken by whichever thread is free, the work thus comes longest first and ends
/// on short items, so the threads finish within one short item of each other (a round-robin deal
/// gave every odd block to thread 1: a third more work than thread 0 at T = 512).
template <class T>
int64_t item_at(const Ctx<T>& cx, int64_t at) {
  if (!cx.p->masks.causal.enabled()) return at;
  const int64_t qb = at % cx.q_blocks;
  return at - qb + (cx.q_blocks - 1 - qb);
}

/// Calls f(std::bool_constant<kDot>{}) for the kernels this call uses: the bf16 dot-product ones
/// when `dot` (bf16 inputs on a CPU with vdpbf16ps), else the float32 ones.
template <class T, class F>
void with_dot(bool dot, const F& f) {
  constexpr bool kMayDot = kHaveDot && std::is_same_v<T, bf16>;
  if (dot)
    f(std::bool_constant<kMayDot>{});
  else
    f(std::false_type{});
}

/// The context of packed sequence s: its rows of Q, K, V, out and lse (kernels/varlen.h) and
/// the causal rule aligned to its own lengths.
template <class T>
Ctx<T> sequence_ctx(const Ctx<T>& whole, int64_t s) {
  const SdpaParams& p = *whole.p;
  const int64_t q0 = p.varlen.cu_q[s], k0 = p.varlen.cu_k[s];
  Ctx<T> cx = whole;
  cx.t_q = p.varlen.cu_q[s + 1] - q0;
  cx.t_k = p.varlen.cu_k[s + 1] - k0;
  cx.q = rows_of(whole.q, q0, cx.t_q);
  cx.k = rows_of(whole.k, k0, cx.t_k);
  cx.v = rows_of(whole.v, k0, cx.t_k);
  cx.out = rows_of(whole.out, q0, cx.t_q);
  cx.lse = rows_of(whole.lse, q0, cx.t_q);
  cx.causal = CausalRule::of(p.masks.causal, cx.t_q, cx.t_k);
  cx.q_blocks = (cx.t_q + kBq - 1) / kBq;
  // ALiBi's query positions follow the causal alignment of this sequence's own lengths.
  cx.alibi_offset = p.masks.causal.enabled() ? p.masks.causal.offset_for(cx.t_q, cx.t_k) : cx.t_k - cx.t_q;
  return cx;
}

/// A packed batch: items (sequence, kv-head, query block) over every sequence, costed by the
/// query rows times the keys they may see, and taken longest first by whichever thread is free
/// (dynamic schedule). Sequences of 16 and 4096 tokens thus share the threads evenly, no
/// padding is touched, and since every output row belongs to exactly one item, which thread
/// runs it cannot change any result.
template <class T>
void run_varlen(const Ctx<T>& whole, float* workspace, bool dot) {
  const SdpaParams& p = *whole.p;
  const int64_t KV = p.kv_heads();
  const WorkspacePlan plan = workspace_plan(p);
  auto* const items = reinterpret_cast<VarlenItem*>(plan.shared_part(workspace));  // 32 bytes per item
  int64_t n = 0;
  for (int64_t s = 0; s < p.varlen.seqs; ++s) {
    const int64_t tq = p.varlen.cu_q[s + 1] - p.varlen.cu_q[s], tk = p.varlen.cu_k[s + 1] - p.varlen.cu_k[s];
    const CausalRule rule = CausalRule::of(p.masks.causal, tq, tk);
    for (int64_t qb = 0; qb * kBq < tq; ++qb) {
      const int64_t i0 = qb * kBq, nq = std::min(kBq, tq - i0);
      const KeyRange keys = rule.visible_keys(i0, i0 + nq, 0, tk);
      const int64_t cost = nq * (keys.hi - keys.lo) + nq;  // + nq: a row that sees nothing still writes
      for (int64_t g = 0; g < KV; ++g) items[n++] = {s, g, qb, cost};
    }
  }
  MHA_DASSERT(n == varlen_items(p));
  if (n == 0) return;
  std::sort(items, items + n, [](const VarlenItem& a, const VarlenItem& b) {  // a total order: no ties
    if (a.cost != b.cost) return a.cost > b.cost;
    return a.s != b.s ? a.s < b.s : a.qb != b.qb ? a.qb < b.qb : a.g < b.g;
  });
  // Claimed one ahead, as run() does; the next item's rows are its own sequence's.
  std::atomic<int64_t> next_item{0};
#pragma omp parallel num_threads(plan.threads)
  {
    BusyClock busy(p.thread_busy_ms);
    float* ws = plan.thread_part(workspace, omp_get_thread_num());
    claim_one_ahead(next_item, n, [&](int64_t it, int64_t ahead) {
      const Ctx<T> cx = sequence_ctx(whole, items[it].s);
      Ctx<T> cx_ahead;
      Upcoming<T> upcoming;
      if (ahead < n) {
        cx_ahead = sequence_ctx(whole, items[ahead].s);
        upcoming = {&cx_ahead, 0, items[ahead].g, items[ahead].qb};
      }
      with_dot<T>(
          dot, [&](auto kDot) { run_group<T, decltype(kDot)::value>(cx, 0, items[it].g, items[it].qb, ws, upcoming); });
    });
  }
}

template <class T>
void run(const SdpaParams& p, View4<const T> q, View4<const T> k, View4<const T> v, float* workspace) {
  Ctx<T> cx;
  cx.p = &p;
  cx.q = q;
  cx.k = k;
  cx.v = v;
  cx.out = p.out;
  cx.lse = p.lse;
  cx.t_q = p.t_q();
  cx.t_k = p.t_k();
  cx.L = scratch_plan(p);
  cx.causal = CausalRule::of(p.masks.causal, p.t_q(), p.t_k());
  cx.q_blocks = (p.t_q() + kBq - 1) / kBq;
  cx.keep_scale = p.dropout.active() ? 1.0f / (1.0f - p.dropout.p) : 1.0f;
  cx.weights_one_pass = weights_one_pass(p);
  cx.weights_two_pass = !cx.weights_one_pass && (p.weights.defined() || p.weights_avg.defined());
  cx.stream_weights =
      weights_bytes(p) >= (p.weights_stream_min_bytes > 0 ? p.weights_stream_min_bytes : kStreamWeightsBytes);
  cx.edit_scores = p.edits.capped() || p.edits.alibi();
  cx.alibi_offset = alibi_offset(p);
  constexpr bool kMayDot = kHaveDot && std::is_same_v<T, bf16>;
  const bool dot = kMayDot && cpu_has_bf16_dot();
  // AMX tiles reduce over 32 dims a step: head dims that are multiples of 32 (the common 32, 64,
  // 128, ...); others keep vdpbf16ps.
  cx.amx = dot && p.d() % 32 == 0 && amx::enabled();
  if (p.varlen.defined()) return run_varlen(cx, workspace, dot);  // no weights with a packed batch
  const int64_t items = dense_items(p);
  if (items == 0) return;
  const WorkspacePlan plan = workspace_plan(p);
  const int threads = plan.threads;
  cx.prepack = prepack_plan(p);
  float* const packed = cx.prepack.used ? plan.shared_part(workspace) : nullptr;
  cx.prepacked = packed;
  const int64_t KV = p.kv_heads(), blocks = cx.prepack.blocks, Tk = cx.t_k;
  const int64_t packs = prepacked_blocks(p, cx.prepack);
  // One parallel region: the K/V blocks packed once (static: equal blocks), a barrier, then the
  // items, longest first within each (batch, kv-head) and taken by whichever thread is free
  // (item_at). Every output row belongs to exactly one item, whose arithmetic does not depend
  // on the thread or the order, so the thread count cannot change any result.
  // A unit per (batch, kv-head) where blocks are kept and the pairs are enough to balance the
  // threads (at most one unit apart at the end: a few percent of the call from 4 per thread).
  const int64_t unit = cx.L.kept_blocks > 0 && items / cx.q_blocks >= 4 * threads ? cx.q_blocks : 1;
  std::atomic<int64_t> next_item{0};
#pragma omp parallel num_threads(threads)
  {
    BusyClock busy(p.thread_busy_ms);
    float* ws = plan.thread_part(workspace, omp_get_thread_num());
    if (cx.L.kept_blocks > 0) reinterpret_cast<int64_t*>(ws + cx.L.kept_tag)[0] = -1;  // none kept yet
    if (packs > 0) {
#pragma omp for schedule(static) nowait
      for (int64_t at = 0; at < packs; ++at) {
        const int64_t j0 = (at % blocks) * kBk, b = at / (KV * blocks), g = (at / blocks) % KV;
        const PackedBlockLayout& K = cx.prepack.layout;
        float* block = packed + at * K.stride;
        with_dot<T>(dot, [&](auto kDot) {
          pack_kv_block<T, decltype(kDot)::value>(cx, b, g, j0, std::min(kBk, Tk - j0), true, block + K.kt, block + K.v,
                                                  block + K.kb);
        });
      }
      busy.pause();
#pragma omp barrier
      busy.resume();
    }
    // Claimed in units of `unit` consecutive items: with kept blocks, every query block of a
    // (batch, kv-head) at once, so that one thread packs each of its K/V blocks once (claimed one
    // by one, two threads took turns on a pair's items and each packed every block).
    claim_one_ahead(next_item, items / unit, [&](int64_t u, int64_t u_ahead) {
      for (int64_t at = 0; at < unit; ++at) {
        const int64_t it = u * unit + at, ahead = at + 1 < unit ? it + 1 : u_ahead * unit;
        with_dot<T>(dot, [&](auto kDot) {
          run_item<T, decltype(kDot)::value>(cx, item_at(cx, it), ws, ahead < items ? item_at(cx, ahead) : -1);
        });
      }
    });
  }
}

void fused_f32(const SdpaParams& p, float* workspace) {
  run<float>(p, p.q.as<float>(), p.k.as<float>(), p.v.as<float>(), workspace);
}
void fused_bf16(const SdpaParams& p, float* workspace) {
  run<bf16>(p, p.q.as<bf16>(), p.k.as<bf16>(), p.v.as<bf16>(), workspace);
}
int64_t dispatch_target() { return HWY_TARGET; }
bool bf16_dot() { return kHaveDot && cpu_has_bf16_dot(); }
void exp_before_bf16_of(const float* x, float m, float* out, int64_t n) {
  const DF df;
  const int64_t N = lanes();
  const VF vm = hn::Set(df, m);
  alignas(64) float lanes_in[kMaxLanes], lanes_out[kMaxLanes];
  for (int64_t i = 0; i < n; i += N) {
    const int64_t k = std::min(N, n - i);
    std::fill(lanes_in, lanes_in + N, 0.0f);
    std::copy(x + i, x + i + k, lanes_in);
    hn::Store(exp_before_bf16(df, hn::Load(df, lanes_in), vm), df, lanes_out);
    std::copy(lanes_out, lanes_out + k, out + i);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace mha::kernels::fused
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::kernels {
namespace fused {
HWY_EXPORT(fused_f32);
HWY_EXPORT(fused_bf16);
HWY_EXPORT(dispatch_target);
HWY_EXPORT(bf16_dot);
HWY_EXPORT(exp_before_bf16_of);
}  // namespace fused

bool fused_supports(const SdpaParams&, std::string*) { return true; }

size_t fused_workspace_floats(const SdpaParams& p) { return fused::workspace_plan(p).floats(); }

void sdpa_fused(const SdpaParams& p, float* workspace) {
  assert_sdpa_params(p);
  MHA_DASSERT(has_data(p.q) && has_data(p.k) && has_data(p.v) && has_data(p.weights) && has_data(p.weights_avg));
  MHA_DASSERT(workspace != nullptr);
  if (p.dtype == DType::BF16)
    HWY_DYNAMIC_DISPATCH(fused::fused_bf16)(p, workspace);
  else
    HWY_DYNAMIC_DISPATCH(fused::fused_f32)(p, workspace);
}

std::vector<int64_t> fused_compiled_targets() { return target_bits(HWY_TARGETS); }
int64_t fused_dispatch_target() { return HWY_DYNAMIC_DISPATCH(fused::dispatch_target)(); }
bool fused_bf16_uses_dot_instructions() { return HWY_DYNAMIC_DISPATCH(fused::bf16_dot)(); }
const char* fused_bf16_products(int64_t d) {
  if (!fused_bf16_uses_dot_instructions()) return "float32";
  return d % 32 == 0 && amx::enabled() ? "amx" : "vdpbf16ps";
}
bool fused_weights_one_pass(const SdpaParams& p) { return fused::weights_one_pass(p); }
void fused_exp_before_bf16(const float* x, float m, float* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(fused::exp_before_bf16_of)(x, m, out, n);
}

}  // namespace mha::kernels
#endif  // HWY_ONCE
