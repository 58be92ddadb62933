// kernels/decode.cpp — flash-decoding: a few query rows against a long KV cache.
//
// Shapes: Q (B, h, T_q, d); cache K (B, kv, capacity, d), V (B, kv, capacity, d_v), float32,
// bf16 or int8 (with one scale per row), position p in slot p (or p mod capacity in a ring);
// out (B, h, T_q, d_v); lse (B, h, T_q, 1). Paged: K (blocks, kv, block_size, d), V (blocks, kv,
// block_size, d_v) pools and a block table per sequence; position p in row p mod block_size of
// block table[p / block_size]. Only the address of a key's row changes: the kernel already
// gathers a block's rows through per-key pointers.
//
// Blocking and memory traffic. Decoding is bound by reading the cache, not by arithmetic (one
// multiply-add per cached element per query row). So a work item is (batch b, K/V head g, tile of
// query rows, split s): the G = h/kv query heads of group g and up to a few queries each form the
// item's rows, and every K row and V row of the split's positions is read once, contiguously, for
// all of them (GQA's whole point). Keys go in blocks of 128: scores for every row, a block max, one
// vector exp per row, then V accumulated with the probabilities. Each split keeps its own running
// (max m, sum l, unnormalised output) in the workspace; afterwards the splits are merged exactly:
//   M = max_s m_s,  L = Σ_s e^{m_s − M} l_s,  out = Σ_s e^{m_s − M} acc_s / L,  lse = M + log L,
// in split order. The split count is a parameter, never the thread count, and every item is
// computed by one thread start to finish, so results are bitwise the same for any thread count.
// Cost, measured on the 2-core Zen machine (h=32, kv=8, d=128): per core a step takes about the
// arithmetic time with K/V in cache (≈ 31 ns per key and K/V head for f32, 24 for bf16) plus the
// time to stream the rows from memory; prefetching (below) narrows that sum by asking for rows
// while the arithmetic runs (on AVX2 the score loop asks for the block's V rows and, for float32,
// the P·V loop for the next block's K rows).
// Items are handed out dynamically: which thread takes an item cannot change its result, and a
// thread that the OS preempts (a shared machine) no longer holds back a fixed half of the work.
//
// int8, on AVX-512 targets: both products in integers (the int8 section below; other targets
// widen the rows to float, as bf16 is, with each query row divided by a power of two that keeps
// the float sums of q · k_int8 in range: divide_by_power_of_two_step). The query rows are rounded
// to int16 once per item and a block's probabilities (times their value rows' scales) once per
// block, the int8 rows widened to int16 only, and pairs of int16 products summed exactly in int32
// lanes (pmaddwd, vpdpwssd with AVX512-VNNI). The scales apply outside the loops over d: a key's
// score is scale_k · step_q · (q16 · k_int8), and the softmax sum l uses the unscaled
// probabilities. That is the attention over the dequantised cache (value · scale) up to the
// 16-bit rounding of q and p (docs/semantics.md). Keys with per-channel scales (KIVI) fold their
// group's scales into the query instead and keep float32 scores: a key's score is (q ⊙
// scale_group) · k_int8, one elementwise product of the query rows per run of a block's keys that
// share a group (those products are the dequantised ones: no wider range than float32's).
//
// Transposed keys (KeyLayout::Transposed, DecodeParams::k_transposed): K in tiles of 16 slots,
// each channel's 16 values together, so a block's scores accumulate 16 keys in the lanes of one
// vector per query row (score_block_transposed) and the row layout's transpose-add tree over
// each 16 dot products (sum_each: ~3 shuffles and adds per score at d = 128 against 8 FMAs) goes
// away. V keeps its rows. Measured on a Zen 4 (1 thread, context 8192): f32 4.4–4.8 → 3.6–4.5
// ms, bf16 2.5–2.6 → 2.0–2.2, int8 2.0–2.2 → 1.7–1.8.
//
// SIMD: Google Highway, compiled for each x86 target and dispatched once per call.

// foreach_target.h must come first, and exp-inl.h after highway.h: keep this order.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/decode.cpp"
// The same targets as the fused kernels and the same-run peak (machine_peak.cpp): without
// AVX3_DL here, a Zen 4 or later decoded on AVX3 while bench-decode named AVX3_DL.
#define HWY_DISABLED_TARGETS HWY_SSSE3
#define HWY_WANT_AVX3_DL
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include "kernels/exp-inl.h"
#include "hwy/contrib/math/math-inl.h"
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/common.h"
#include "kernels/decode.h"
#include "kernels/entry_checks.h"
#include "kernels/masking.h"

#ifndef MHA_DECODE_SHARED_ONCE
#define MHA_DECODE_SHARED_ONCE
namespace mha::kernels::decode_detail {

#ifndef MHA_DECODE_BLOCK
#define MHA_DECODE_BLOCK 128  // 32 and 64 were 8–15% slower from memory (h=32, kv=8, d=128, 8192 keys), 256 no faster
#endif
constexpr int64_t kBlock = MHA_DECODE_BLOCK;  // keys per block (a multiple of every target's float lanes)
constexpr int64_t kRowsPerTile = 16;          // query rows per work item (G heads × a few queries)
constexpr int64_t kKeyTile = 16;              // transposed keys: slots per tile (mha::kKeyTile, mha/kv_cache.h)
// Prefetching, two kinds (h=32, kv=8, d=128, 8192 keys from memory):
// - near: inside the score and P·V loops, the K or V row kNearRows keys ahead into L1, so the
//   loads of the arithmetic hit L1 instead of waiting on L2 (4 to 32 rows were within noise);
// - the other loop's rows: each loop asks for the rows the *other* loop reads next into L2, so
//   that memory streams while the arithmetic runs (kNextKeysDuringValues below, with the
//   measurements).
constexpr int64_t kNearRows = 16;

/// How the work is cut; a function of the shapes and the split count only.
struct Plan {
  int64_t group, tq_tile, q_tiles, rows_max, items, splits;
};
inline Plan make_plan(const DecodeParams& p) {
  Plan pl;
  pl.group = p.group();
  pl.tq_tile = std::max<int64_t>(1, std::min<int64_t>(p.t_q(), kRowsPerTile / pl.group));
  pl.q_tiles = p.t_q() == 0 ? 0 : (p.t_q() + pl.tq_tile - 1) / pl.tq_tile;
  pl.rows_max = pl.group * pl.tq_tile;
  // With attention sinks, part 0 of every tile is the sink positions; the splits follow.
  pl.splits = std::max(1, p.splits) + (p.sinks > 0 ? 1 : 0);
  pl.items = p.batch() * p.kv_heads * pl.q_tiles * pl.splits;
  return pl;
}
/// Floats one item keeps: m and l per row, then the row outputs.
inline int64_t partial_floats(const Plan& pl, int64_t d_v) { return pl.rows_max * (d_v + 2); }
/// Floats of per-thread scratch: scaled query rows, one block of scores per row, a correction per row
/// (per-channel int8 keys: and the query rows times a key group's scales; transposed keys: and
/// one tile's scores per row; int8: and the int16 query rows and probabilities with their steps).
inline int64_t scratch_floats(const DecodeParams& p, const Plan& pl) {
  const int64_t extra = p.k_channel_group > 0 ? p.d() : p.k_transposed ? kKeyTile : 0;  // qg, or a tile's scores
  const int64_t int8 = p.dtype == DType::I8 ? (p.d() + 1) / 2 + 1 + kBlock / 2 + 1 : 0;
  return pl.rows_max * (p.d() + kBlock + 1 + extra + int8);
}
/// The whole workspace: every item's partial result, then one scratch per thread.
inline WorkspacePlan workspace_plan(const DecodeParams& p, const Plan& pl) {
  // No more threads than items: a thread with none would only be woken (a team of 1024 for one
  // item cost ~20 ms a call); results never depend on the count.
  const int threads = static_cast<int>(std::clamp<int64_t>(pl.items, 1, std::max(1, p.threads)));
  return {pl.items * partial_floats(pl, p.d_v), scratch_floats(p, pl), threads};
}

/// One work item's coordinates.
struct Item {
  int64_t b, g, t0, tq, lo, hi;  // query rows t0 … t0+tq−1; positions [lo, hi)
  bool sink = false;             // the attention sinks' part: no window applies
};
inline Item item_at(const DecodeParams& p, const Plan& pl, int64_t index) {
  Item it;
  const int64_t s = index % pl.splits;
  int64_t rest = index / pl.splits;
  const int64_t qt = rest % pl.q_tiles;
  rest /= pl.q_tiles;
  it.g = rest % p.kv_heads;
  it.b = rest / p.kv_heads;
  it.t0 = qt * pl.tq_tile;
  it.tq = std::min(pl.tq_tile, p.t_q() - it.t0);
  const int64_t end = p.key_end[it.b], first = std::min(end, std::max(p.key_first[it.b], p.sinks));
  const int64_t q_lo = p.q_start[it.b] + it.t0;
  const int64_t sink_parts = p.sinks > 0 ? 1 : 0;
  if (s < sink_parts) {  // the sinks: seen by every later query, whatever the window
    it.sink = true;
    const KeyRange seen = CausalRule::positions(0).visible_keys(q_lo, q_lo + it.tq, 0, std::min(p.sinks, end));
    it.lo = seen.lo, it.hi = seen.hi;
    return it;
  }
  // Split s of the held positions, in whole blocks, from the sequence's own range only.
  const int64_t n = end - first, parts = pl.splits - sink_parts;
  const int64_t chunk = ((n + parts - 1) / parts + kBlock - 1) / kBlock * kBlock;
  it.lo = std::min(end, first + (s - sink_parts) * chunk);
  it.hi = std::min(end, it.lo + chunk);
  // Positions no row of this tile can see are skipped (causal and window).
  const KeyRange seen = CausalRule::positions(p.window).visible_keys(q_lo, q_lo + it.tq, it.lo, it.hi);
  it.lo = seen.lo, it.hi = seen.hi;
  return it;
}

}  // namespace mha::kernels::decode_detail
#endif

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using namespace decode_detail;

using DF = hn::ScalableTag<float>;

// Each loop asks for the rows the *other* loop will read next, so that memory streams while the
// arithmetic runs. Without it a block's P·V started by pulling its V rows from memory in a burst
// (the near prefetches of its first column pass run far ahead of 8 FMAs a key), with nothing to
// compute meanwhile: a step took about the arithmetic time plus the streaming time. Now:
// - the score loop asks for the block's V rows into L2 (a T1 hint), next to its K rows;
// - for float32 the P·V loop asks for the next block's K rows into L2, spread over its column
//   passes: each pass the lines under its columns (one line per key at d = 128 with ≥ 4 query
//   rows), each line once (a whole row per key in the first pass was slower than nothing).
//   bf16 rows, widened before their FMAs, ask for them too on the AVX-512 targets only. On a
//   Zen 4 (2026-12-06; h=32, kv=8, d=128, context 8192, 3 interleaved rounds, medians) that took
//   bf16 from 2.23 to 1.90 ms a token on 1 thread (0.69 → 0.78 of the same-run read bandwidth)
//   and 1.26 → 1.13 on 2, keys across lanes 2.15 → 1.81 and 1.31 → 1.08, with K/V in cache
//   level (100 µs a step either way): the requests overlap the stream with the arithmetic. On
//   AVX2 it was level, on SSE4 and below, bound by the arithmetic, 9–11% slower (the same CPU,
//   each target forced). An Intel Xeon (AVX3_DL, 2 threads) had measured the opposite on the
//   kernel as it was then, before the score tiles' cheaper transpose-add: bf16 1.52 → 1.58 ms,
//   int8 0.99 → 1.09 when int8 was widened too. int8, whose products now run in integers, asks
//   again (kAskNextKeys in decode_item_of).
// Measured on a Zen 1 (AVX2; h=32, kv=8, d=128, context 8192 from memory, medians of 3
// interleaved rounds of the best of 20 steps, a neighbour loading the machine; the fraction is of
// the same-run read bandwidth): 1 thread float32 9.75 → 7.47 ms (0.56 → 0.76), keys across lanes
// 9.01 → 6.73 (0.61 → 0.84), bf16 6.58 → 5.98, bf16 keys across lanes 6.70 → 5.78; 2 threads
// float32 5.68 → 4.46 (0.57 → 0.73), keys across lanes 5.24 → 3.95 (0.60 → 0.84), bf16 3.82 →
// 3.28; int8 2–5% (bench/results/decode_zen1_phase_prefetch_2026-12-03.jsonl).
// The AVX-512 targets used instead "far" requests (the rows of the next block into L2, spread
// over the same loops; chosen on a Zen 4 against one burst of the next block into L1) until an
// Intel Xeon (AVX3_DL, 2026-12-05, 3 interleaved rounds, medians of the fraction of the same-run
// read bandwidth) measured these to be better on every cache: 2 threads f32 0.76 → 0.78, f32
// keys across lanes 0.77 → 0.82, bf16 0.65 → 0.78, bf16 keys across lanes 0.75 → 0.85, int8 0.51
// → 0.60; 1 thread f32 0.82 → 0.85, keys across lanes 0.81 → 0.86, bf16 keys across lanes 0.80
// → 0.93 (bench/results/intel_2026-12-05/decode_prefetch.txt).
template <class T>
constexpr bool kNextKeysDuringValues = std::is_same_v<T, float> || (std::is_same_v<T, bf16> && HWY_TARGET <= HWY_AVX3);

/// Rows to ask for into L2 (a T1 hint) alongside a loop over a block's keys: with key j, `bytes`
/// of rows[j] (null: none). The score loops ask for the block's V rows (the transposed scores, once
/// per run of keys in one tile: the run's rows, contiguous, `bytes` each); the P·V loop for the
/// next block's K rows, spread over its column passes (each pass only the lines under its columns).
template <class T>
struct FarRows {
  const T* const* rows = nullptr;
  int64_t bytes = 0;
};

HWY_INLINE hn::Vec<DF> load_row(DF df, const float* p) { return hn::LoadU(df, p); }
HWY_INLINE hn::Vec<DF> load_row(DF df, const bf16* p) {
  // bf16 is the top half of a float32: widen its bits and shift.
  static_assert(sizeof(bf16) == sizeof(uint16_t));
  const hn::Rebind<uint16_t, DF> d16;
  const hn::Rebind<uint32_t, DF> d32;
  return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(d32, hn::LoadU(d16, reinterpret_cast<const uint16_t*>(p)))));
}

HWY_INLINE hn::Vec<DF> load_row(DF df, const int8_t* p) {
  const hn::Rebind<int8_t, DF> d8;
  const hn::Rebind<int32_t, DF> d32;
  return hn::ConvertTo(df, hn::PromoteTo(d32, hn::LoadU(d8, p)));
}

// Register tiles. The score tile is kTileRows query rows × kTileKeys keys: its kTileRows·kTileKeys
// = L dot products accumulate in L vectors (vertical FMAs over d, each K chunk loaded once for all
// rows) and are then reduced together by a transpose-add tree into one vector, instead of one
// horizontal reduction per (row, key). The P·V tile is kTileRows rows × kTileKeys chunks of d_v,
// so each V chunk is loaded (and widened, for bf16) once for all rows. Tiles use about half of
// the vector registers on every target (16 on AVX-512, 8 on AVX2, 4 on SSE4).
constexpr int kLanes = static_cast<int>(HWY_LANES(float));
constexpr int kTileRows = kLanes >= 4 ? 4 : 1;
constexpr int kTileKeys = kLanes / kTileRows;
static_assert(kTileRows * kTileKeys == kLanes, "a score tile's dot products fill exactly one vector per lane");

/// v[i] for i < n = L: returns the vector whose lane i is the sum of v[i]'s lanes (v is clobbered).
/// D: float32, or int32 (the int8 path's exact sums).
template <class D>
HWY_INLINE hn::Vec<D> sum_each(D df, hn::Vec<D>* v) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  // 16 lanes: the first two levels with interleaves inside 16-byte blocks (32-bit, then 64-bit
  // lanes), the last two with block shuffles, so that only 9 of the 45 operations cross blocks
  // (ConcatEven / ConcatOdd: 30 two-source permutes). Afterwards block m of u[i] holds the sums
  // over block m of v[4i … 4i+3], and two rounds of block shuffles add the blocks up in order.
  static_assert(kLanes == 16);
  const hn::Repartition<uint64_t, D> d64;
  const hn::RebindToSigned<D> di;
  hn::Vec<D> t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = hn::Add(hn::InterleaveLower(df, v[2 * i], v[2 * i + 1]), hn::InterleaveUpper(df, v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const auto a = hn::BitCast(d64, t[2 * i]), b = hn::BitCast(d64, t[2 * i + 1]);
    u[i] = hn::Add(hn::BitCast(df, hn::InterleaveLower(d64, a, b)), hn::BitCast(df, hn::InterleaveUpper(d64, a, b)));
  }
  const auto block_sums = [&](hn::Vec<D> a, hn::Vec<D> b) {  // blocks (a0+a1, a2+a3, b0+b1, b2+b3)
    const __m512i x = hn::BitCast(di, a).raw, y = hn::BitCast(di, b).raw;
    const auto even = hn::BitCast(df, hn::Vec<decltype(di)>{_mm512_shuffle_i32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0))});
    const auto odd = hn::BitCast(df, hn::Vec<decltype(di)>{_mm512_shuffle_i32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1))});
    return hn::Add(even, odd);
  };
  return block_sums(block_sums(u[0], u[1]), block_sums(u[2], u[3]));
#elif HWY_TARGET != HWY_SCALAR  // one lane: nothing to reduce
  // Each level halves the vector count: lane groups of the inputs, pairwise summed, stay in order.
  for (int n = kLanes; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i)
      v[i] = hn::Add(hn::ConcatEven(df, v[2 * i + 1], v[2 * i]), hn::ConcatOdd(df, v[2 * i + 1], v[2 * i]));
#else
  (void)df;
#endif
  return v[0];
}

/// Bytes of a cache row of n elements (rows of one K/V head are contiguous, so the row kNearRows
/// ahead starts kNearRows · bytes on; it may lie past the cache's end, which a prefetch allows).
template <class T>
constexpr int64_t row_bytes(int64_t n) {
  return n * static_cast<int64_t>(sizeof(T));
}

/// Asks for the lines of bytes [0, bytes) from p (none when bytes ≤ 0), one request a line
/// (prefetch_bytes asks four lines a step: for a 128-byte int8 row, each line twice).
template <int kLocality>
HWY_INLINE void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, kLocality);
}

/// Scores of rows [r0, r0 + NR) against keys [j0, j0 + NK) of the block: sc[r][j] = q_r · k_j
/// (q pre-scaled). With NR·NK = L the sums are reduced as one tile.
template <int NR, int NK, class T>
HWY_INLINE void score_tile(const float* qs, int64_t d, const T* const* keys, FarRows<T> far, int64_t j0, int64_t r0,
                           float* sc) {
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  const int64_t dv = d / L * L;
  hn::Vec<DF> acc[NR * NK];
  for (int i = 0; i < NR * NK; ++i) acc[i] = hn::Zero(df);
  if (r0 == 0)  // the first row tile passes over the keys first
    for (int k = 0; k < NK; ++k) {
      prefetch_bytes<3>(keys[j0 + k], kNearRows * row_bytes<T>(d), row_bytes<T>(d));
      if (far.rows && far.rows[j0 + k]) prefetch_bytes<2>(far.rows[j0 + k], 0, far.bytes);
    }
  for (int64_t c = 0; c < dv; c += L) {
    hn::Vec<DF> kv[NK];
    for (int k = 0; k < NK; ++k) kv[k] = load_row(df, keys[j0 + k] + c);
    for (int r = 0; r < NR; ++r) {
      const auto qv = hn::LoadU(df, qs + (r0 + r) * d + c);
      for (int k = 0; k < NK; ++k) acc[r * NK + k] = hn::MulAdd(qv, kv[k], acc[r * NK + k]);
    }
  }
  float s[NR * NK];
  if constexpr (NR * NK == kLanes) {
    hn::StoreU(sum_each(df, acc), df, s);
  } else {
    for (int i = 0; i < NR * NK; ++i) s[i] = hn::GetLane(hn::SumOfLanes(df, acc[i]));
  }
  if (dv == d) {  // no tail: each row's NK scores are one copy
    for (int r = 0; r < NR; ++r) std::memcpy(sc + (r0 + r) * kBlock + j0, s + r * NK, sizeof(float) * NK);
    return;
  }
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < NK; ++k) {
      float x = s[r * NK + k];
      for (int64_t c = dv; c < d; ++c) x += qs[(r0 + r) * d + c] * to_f32(keys[j0 + k][c]);
      sc[(r0 + r) * kBlock + j0 + k] = x;
    }
}

/// Scores of rows [r0, r0 + NR) against the block's `nb` keys, asking for `far` along with them.
template <int NR, class T>
HWY_INLINE void score_rows(const float* qs, int64_t d, const T* const* keys, FarRows<T> far, int64_t nb, int64_t r0,
                           float* sc) {
  constexpr int NK = kLanes / NR;
  int64_t j = 0;
  for (; j + NK <= nb; j += NK) score_tile<NR, NK>(qs, d, keys, far, j, r0, sc);
  for (; j < nb; ++j) score_tile<NR, 1>(qs, d, keys, far, j, r0, sc);
}

/// acc_r = acc_r · corr_r + Σ_j P[r][j] · v_j for rows [r0, r0 + NR), columns [c0, c0 + NC·L).
template <int NR, int NC, class T>
HWY_INLINE void accumulate_tile(const float* P, const float* corr, const T* const* vals, FarRows<T> far, int64_t nb,
                                int64_t d_v, int64_t r0, int64_t c0, float* acc) {
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  hn::Vec<DF> a[NR * NC];
  for (int r = 0; r < NR; ++r) {
    const auto cv = hn::Set(df, corr[r0 + r]);
    for (int i = 0; i < NC; ++i) a[r * NC + i] = hn::Mul(hn::LoadU(df, acc + (r0 + r) * d_v + c0 + i * L), cv);
  }
  // This pass asks for the lines at bytes [b0, b1) of each far row, those under its
  // columns (the last pass to the row's end, for a far row longer than d_v): each line once over
  // the passes, counted from the row's start (a row that does not start a line may miss its last).
  const int64_t b0 = (row_bytes<T>(c0) + 63) / 64 * 64;
  const int64_t b1 = c0 + NC * L >= d_v / L * L ? far.bytes : std::min(far.bytes, row_bytes<T>(c0 + NC * L));
  for (int64_t j = 0; j < nb; ++j) {
    if (r0 == 0 && c0 == 0)  // the first tile to pass over V
      prefetch_bytes<3>(vals[j], kNearRows * row_bytes<T>(d_v), row_bytes<T>(d_v));
    if (far.rows && r0 == 0 && far.rows[j]) prefetch_lines<2>(reinterpret_cast<const char*>(far.rows[j]) + b0, b1 - b0);
    hn::Vec<DF> vv[NC];
    for (int i = 0; i < NC; ++i) vv[i] = load_row(df, vals[j] + c0 + i * L);
    for (int r = 0; r < NR; ++r) {
      const auto pv = hn::Set(df, P[(r0 + r) * kBlock + j]);
      for (int i = 0; i < NC; ++i) a[r * NC + i] = hn::MulAdd(pv, vv[i], a[r * NC + i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NC; ++i) hn::StoreU(a[r * NC + i], df, acc + (r0 + r) * d_v + c0 + i * L);
}

/// The P·V update of rows [r0, r0 + NR) over all of d_v, asking for `far` along with the keys.
template <int NR, class T>
HWY_INLINE void accumulate_rows(const float* P, const float* corr, const T* const* vals, FarRows<T> far, int64_t nb,
                                int64_t d_v, int64_t r0, float* acc) {
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  constexpr int NC = kLanes / NR >= 4 ? 4 : kLanes / NR;
  const int64_t dvv = d_v / L * L;
  int64_t c = 0;
  for (; c + NC * L <= dvv; c += NC * L) accumulate_tile<NR, NC>(P, corr, vals, far, nb, d_v, r0, c, acc);
  for (; c < dvv; c += L) accumulate_tile<NR, 1>(P, corr, vals, far, nb, d_v, r0, c, acc);
  for (c = dvv; c < d_v; ++c)
    for (int r = 0; r < NR; ++r) {
      float x = acc[(r0 + r) * d_v + c] * corr[r0 + r];
      for (int64_t j = 0; j < nb; ++j) x += P[(r0 + r) * kBlock + j] * to_f32(vals[j][c]);
      acc[(r0 + r) * d_v + c] = x;
    }
}

// ---- int8 caches: integer products ----------------------------------------------------------
// Widening an int8 row to float32 before its FMAs made int8 decoding bound by arithmetic (about
// 0.6–0.7 of the FMA peak at a quarter of float32's bytes). Instead both products run on integers
// with exact int32 sums: the query rows (already times the softmax scale) are rounded once per
// item to int16 steps of max|q| / qmax, a row's probabilities (times their value rows' scales)
// once per block to int16 steps of their block max / 32767, and the int8 rows are widened to
// int16 only. A multiply-add of int16 pairs (pmaddwd; vpdpwssd with AVX512-VNNI) then does two
// products and their sum per 32-bit lane, where float32 did one. The int32 sums are converted to
// float once per dot product (scores) or per block (P·V) and take the steps as scales. Each
// rounding is at most half a step: 2⁻¹⁶ of the row's (block's) largest element, against 2⁻⁸ for
// the cache's own rounding (docs/semantics.md, 'KV caches in int8').
// Bounds: |k|, |v| ≤ 128, so a score's sum stays below 2³¹ with qmax = min(32767, (2³¹ − 1) /
// (128 d)), and a block's P·V sums below 128 · 32767 · 128 · 2 < 2³¹ for blocks up to 256 keys.
static_assert(kBlock % 2 == 0 && kBlock <= 256, "int8 P·V: key pairs, and int32 sums of a block in range");

#undef MHA_INT8_DOT  // defined once per target (this file is compiled once per target)
#if HWY_TARGET == HWY_AVX3_DL
// AVX3_DL's target string lacks AVX512-VNNI in Highway 1.0.3 (every CPU it dispatches to has it):
// the functions of the int8 path carry it, so that vpdpwssd inlines into them.
#define MHA_INT8_DOT __attribute__((target(HWY_TARGET_STR ",avx512vnni")))
#else
#define MHA_INT8_DOT
#endif

// Which targets take the integer products: the AVX-512 ones, where they were measured faster (Zen
// 4, context 8192, 1 thread, bench/results/zen4_2026-12-06/ab.txt §6: AVX3_DL 1.98–2.31 →
// 1.47–1.53 ms, AVX3 (pmaddwd) 2.01–2.07 → 1.57–1.67). On AVX2 they were 7% slower (2.33–2.40 →
// 2.50–2.57 ms: pmaddwd plus an add per 16 products against an FMA per 8, and the rounding of q and
// p, for a widening saved) and on SSE4 level; there int8 rows stay widened to float32, so the
// 16-bit rounding of q and p happens on AVX3 and AVX3_DL only, and the integer kernels are
// compiled for those targets only (elsewhere they are declared, for the call sites' discarded
// branches, and never defined). They passed the decode tests on every target at fc464f8–acd08c2,
// when dot_pairs also had pmaddwd for AVX2 / SSE4 and a portable pair sum for the others: another
// target is those few lines once a measurement on its CPU says so.
#undef MHA_INT8_PRODUCTS  // per target, as MHA_INT8_DOT
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define MHA_INT8_PRODUCTS 1
constexpr bool kIntProducts = true;
#else
#define MHA_INT8_PRODUCTS 0
constexpr bool kIntProducts = false;
#endif

/// The largest int16 step count of a query element for head dim d (so a score's int32 sum of d
/// products with |k| ≤ 128 cannot overflow).
inline int32_t query_steps(int64_t d) {
  return static_cast<int32_t>(std::min<int64_t>(32767, (int64_t{2147483647} / 128) / std::max<int64_t>(d, 1)));
}

/// max|in[x]| for x < n, and whether every in[x] is finite (if not, the max means nothing).
struct AbsMax {
  float value;
  bool finite;
};
HWY_INLINE AbsMax abs_max(const float* in, int64_t n) {
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  const int64_t nv = n / L * L;
  auto vmax = hn::Zero(df);
  auto bad = hn::MaskFromVec(hn::Zero(df));
  for (int64_t x = 0; x < nv; x += L) {
    const auto v = hn::LoadU(df, in + x);
    vmax = hn::Max(vmax, hn::Abs(v));
    bad = hn::Or(bad, hn::Not(hn::IsFinite(v)));
  }
  AbsMax m{hn::GetLane(hn::MaxOfLanes(df, vmax)), hn::AllFalse(df, bad)};
  for (int64_t x = nv; x < n; ++x) {
    m.finite = m.finite && std::isfinite(in[x]);
    m.value = std::max(m.value, std::fabs(in[x]));
  }
  return m;
}

/// out[x] = round(in[x] / s) for x < n, with s = max|in| / steps (returned). A row of zeros gives
/// s = 0 and zeros; a row holding a NaN or ±inf gives s = NaN and zeros, so every product it takes
/// part in is NaN (as the float32 products would be).
HWY_INLINE float quantize_int16(const float* in, int64_t n, int32_t steps, int16_t* out) {
  const DF df;
  const hn::Rebind<int16_t, DF> dh;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  const int64_t nv = n / L * L;
  const auto [amax, finite] = abs_max(in, n);
  if (!finite || amax == 0.0f) {
    std::fill(out, out + n, int16_t{0});
    return finite ? 0.0f : kNaN;
  }
  const float inv = static_cast<float>(steps) / amax;
  if (HWY_UNLIKELY(!(inv <= std::numeric_limits<float>::max()))) {
    // amax below steps / FLT_MAX (≈ 1e-34; e.g. probabilities times a tiny V scale): steps / amax
    // overflows. The row times 2⁶⁴ first (exact: every |in| < 1e-34), then steps / (amax · 2⁶⁴).
    const float inv_up = static_cast<float>(steps) / (amax * 0x1p64f);
    for (int64_t x = 0; x < n; ++x) out[x] = static_cast<int16_t>(std::nearbyint(in[x] * 0x1p64f * inv_up));
    return amax / static_cast<float>(steps);
  }
  const auto vinv = hn::Set(df, inv);
  for (int64_t x = 0; x < nv; x += L)  // |in · inv| ≤ steps (to rounding): no saturation
    hn::StoreU(hn::DemoteTo(dh, hn::NearestInt(hn::Mul(hn::LoadU(df, in + x), vinv))), dh, out + x);
  for (int64_t x = nv; x < n; ++x) out[x] = static_cast<int16_t>(std::nearbyint(in[x] * inv));
  return amax / static_cast<float>(steps);
}

/// Divides in[0, n) by the smallest power of two s (returned) that leaves max|in / s| < 2⁶⁴: s = 1
/// for rows below 2⁶⁴ and for rows holding a NaN or ±inf (which give NaN as before), else 2 … 2⁶⁴.
/// For the targets that widen int8 keys to float: there q · k_int8 is summed in float before the
/// key's scale applies, up to 127 · d times the dequantised products, so a query row near 1e37
/// overflowed to inf where the float32 cache and the integer products (which divide by their own
/// step) stayed finite; below 2⁶⁴ · 127 · d the sums cannot. A power of two divides exactly (only
/// elements below 2⁻¹⁹⁰ of the row's max turn subnormal), and (scale_k · (q / s · k_int8)) · s (the
/// order decode_item_of multiplies in) rounds as scale_k · (q · k_int8) did: scores that were
/// finite keep their bits (but where a product or a scale is subnormal).
HWY_INLINE float divide_by_power_of_two_step(float* in, int64_t n) {
  constexpr int kRangeExponent = 64;
  const auto [amax, finite] = abs_max(in, n);
  int exponent = 0;  // amax = f · 2^exponent, f in [0.5, 1)
  if (!finite || std::frexp(amax, &exponent) == 0.0f || exponent <= kRangeExponent) return 1.0f;
  const int e = exponent - kRangeExponent;  // 1 … 64: 2^e and 2^−e are normal floats
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  const float inverse = std::ldexp(1.0f, -e);
  const auto vinverse = hn::Set(df, inverse);
  int64_t x = 0;
  for (; x + L <= n; x += L) hn::StoreU(hn::Mul(hn::LoadU(df, in + x), vinverse), df, in + x);
  for (; x < n; ++x) in[x] *= inverse;
  return std::ldexp(1.0f, e);
}

#if MHA_INT8_PRODUCTS
using DI = hn::RebindToSigned<DF>;        // int32 sums, one per float lane
using DW = hn::Repartition<int16_t, DI>;  // int16 pairs, one pair per int32 lane
using DB = hn::Rebind<int8_t, DW>;        // int8 rows, as many as DW's lanes
using DQ = hn::Rebind<int8_t, DI>;        // int8 rows, as many as DI's lanes

/// acc + a_even · b_even + a_odd · b_odd in each 32-bit lane (exact while the sums stay in range).
MHA_INT8_DOT HWY_INLINE hn::Vec<DI> dot_pairs(hn::Vec<DI> acc, hn::Vec<DW> a, hn::Vec<DW> b) {
#if HWY_TARGET == HWY_AVX3_DL
  // As an asm statement: GCC 12 gave the intrinsic's accumulator a second register in loops and
  // copied it there and back every iteration.
  __m512i sum = acc.raw;
  asm("vpdpwssd %2, %1, %0" : "+v"(sum) : "v"(a.raw), "v"(b.raw));
  return hn::Vec<DI>{sum};
#else
  hn::Vec<DI> unused = hn::Zero(DI());  // AVX3: pmaddwd sums each pair into its own lane
  return hn::ReorderWidenMulAccumulate(DI(), a, b, acc, unused);
#endif
}

/// The int16 pairs (a[x], b[x]) in lanes x < L, from L int8 each of a and b.
MHA_INT8_DOT HWY_INLINE hn::Vec<DW> int16_pairs(const int8_t* a, const int8_t* b) {
  const DI di;
  const DW dw;
  const DQ dq;
  const auto even = hn::PromoteTo(di, hn::LoadU(dq, a));
  const auto odd = hn::ShiftLeft<16>(hn::PromoteTo(di, hn::LoadU(dq, b)));
  return hn::OddEven(hn::BitCast(dw, odd), hn::BitCast(dw, even));
}

/// int16_pairs(ab, ab + 16): the pairs of two adjacent runs of 16 int8 (a transposed tile's
/// channels c and c + 1), by one widening of both runs and one word permute that interleaves
/// them, where int16_pairs takes two widenings, a shift and a blend (Zen 4, int8 keys across
/// lanes, 1 thread: a step in cache 64.5 → 63.2 µs, from memory at context 8192 1.25 → 1.23 ms).
MHA_INT8_DOT HWY_INLINE hn::Vec<DW> int16_pairs_adjacent(const int8_t* ab) {
  static_assert(kLanes == 16, "the integer products' targets are the AVX-512 ones");
  alignas(64) static constexpr uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                           21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                           11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i words = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab)));
  return hn::Vec<DW>{_mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), words)};
}

/// L int8 zeros, the partner of an odd d's last channel.
alignas(64) constexpr int8_t kZeroInt8[64] = {};

/// Integer scores of rows [r0, r0 + NR) against keys [j0, j0 + NK) of the block: sc[r][j] =
/// Σ_x q16[r][x] · k_j[x], exact, as float. With NR·NK = L the sums are reduced as one tile.
template <int NR, int NK>
MHA_INT8_DOT HWY_INLINE void score_tile_int8(const int16_t* q16, int64_t d, const int8_t* const* keys,
                                             FarRows<int8_t> far, int64_t j0, int64_t r0, float* sc) {
  // Exactly the lines of each row (prefetch_bytes' four lines a step asked for each line of a
  // 128-byte row twice, and with the next keys asked for in P·V that cost 1.56 → 2.04 ms).
  if (r0 == 0)  // the first row tile passes over the keys first
    for (int k = 0; k < NK; ++k) {
      prefetch_lines<3>(keys[j0 + k] + kNearRows * d, d);
      if (far.rows && far.rows[j0 + k]) prefetch_lines<2>(far.rows[j0 + k], far.bytes);
    }
  int32_t s[NR * NK];
  const DI di;
  const DW dw;
  const DB db;
  const int64_t W = static_cast<int64_t>(hn::Lanes(dw));
  const int64_t dv = d / W * W;
  hn::Vec<DI> acc[NR * NK];
  for (int i = 0; i < NR * NK; ++i) acc[i] = hn::Zero(di);
  for (int64_t c = 0; c < dv; c += W) {
    hn::Vec<DW> kv[NK];
    for (int k = 0; k < NK; ++k) kv[k] = hn::PromoteTo(dw, hn::LoadU(db, keys[j0 + k] + c));
    for (int r = 0; r < NR; ++r) {
      const auto qv = hn::LoadU(dw, q16 + (r0 + r) * d + c);
      for (int k = 0; k < NK; ++k) acc[r * NK + k] = dot_pairs(acc[r * NK + k], qv, kv[k]);
    }
  }
  if constexpr (NR * NK == kLanes) {
    const auto sums = sum_each(di, acc);
    if (dv == d) {  // no tail: each row's NK scores are one copy
      float f[NR * NK];
      hn::StoreU(hn::ConvertTo(DF(), sums), DF(), f);
      for (int r = 0; r < NR; ++r) std::memcpy(sc + (r0 + r) * kBlock + j0, f + r * NK, sizeof(float) * NK);
      return;
    }
    hn::StoreU(sums, di, s);
  } else {
    for (int i = 0; i < NR * NK; ++i) s[i] = hn::GetLane(hn::SumOfLanes(di, acc[i]));
  }
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < NK; ++k) {
      int32_t x = s[r * NK + k];
      for (int64_t c = dv; c < d; ++c) x += int32_t{q16[(r0 + r) * d + c]} * keys[j0 + k][c];
      sc[(r0 + r) * kBlock + j0 + k] = static_cast<float>(x);
    }
}

/// Integer scores of rows [r0, r0 + NR) against the block's nb keys.
template <int NR>
MHA_INT8_DOT HWY_INLINE void score_rows_int8(const int16_t* q16, int64_t d, const int8_t* const* keys,
                                             FarRows<int8_t> far, int64_t nb, int64_t r0, float* sc) {
  constexpr int NK = kLanes / NR;
  int64_t j = 0;
  for (; j + NK <= nb; j += NK) score_tile_int8<NR, NK>(q16, d, keys, far, j, r0, sc);
  for (; j < nb; ++j) score_tile_int8<NR, 1>(q16, d, keys, far, j, r0, sc);
}

/// Integer scores of every row (rows × d int16 queries) against the block's nb keys.
MHA_INT8_DOT HWY_NOINLINE void score_block_int8(const int16_t* q16, int64_t rows, int64_t d, const int8_t* const* keys,
                                                FarRows<int8_t> far, int64_t nb, float* sc) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) score_rows_int8<kTileRows>(q16, d, keys, far, nb, r, sc);
  for (; r < rows; ++r) score_rows_int8<1>(q16, d, keys, far, nb, r, sc);
}

/// acc_r = acc_r · corr_r + sp_r · Σ_j p16[r][j] · v_j for rows [r0, r0 + NR), columns [c0, c0 +
/// NC·L): keys in pairs (np even; p16 is 0 past the block's keys, whose rows are valid to read).
template <int NR, int NC>
MHA_INT8_DOT HWY_INLINE void accumulate_tile_int8(const int16_t* p16, const float* sp, const float* corr,
                                                  const int8_t* const* vals, FarRows<int8_t> far, int64_t np,
                                                  int64_t d_v, int64_t r0, int64_t c0, float* acc) {
  const DF df;
  const DI di;
  const DW dw;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  hn::Vec<DI> a[NR * NC];
  for (int i = 0; i < NR * NC; ++i) a[i] = hn::Zero(di);
  // As accumulate_tile: this pass asks for the lines of the far rows under its columns.
  const int64_t b0 = (c0 + 63) / 64 * 64;
  const int64_t b1 = c0 + NC * L >= d_v / L * L ? far.bytes : std::min(far.bytes, c0 + NC * L);
  for (int64_t j = 0; j < np; j += 2) {
    if (r0 == 0 && c0 == 0) {  // the first tile to pass over V
      prefetch_bytes<3>(vals[j], kNearRows * d_v, d_v);
      prefetch_bytes<3>(vals[j + 1], kNearRows * d_v, d_v);
    }
    if (far.rows && r0 == 0)
      for (int64_t k = j; k < j + 2; ++k)
        if (far.rows[k]) prefetch_lines<2>(far.rows[k] + b0, b1 - b0);
    hn::Vec<DW> vv[NC];  // columns of keys j and j + 1 as pairs (v_j[x], v_{j+1}[x]), one per lane
    if constexpr (NC % 2 == 0) {
      // Two vectors of columns at once: the rows' bytes interleaved, then widened (half the
      // operations of int16_pairs). Within 16-byte blocks, so with 2 blocks (AVX-512) vv[i]
      // holds columns 0–7 and 16–23 of the 32, vv[i + 1] 8–15 and 24–31 (put back below).
      const DB db;
      for (int i = 0; i < NC; i += 2) {
        const auto even = hn::LoadU(db, vals[j] + c0 + i * L), odd = hn::LoadU(db, vals[j + 1] + c0 + i * L);
        vv[i] = hn::PromoteTo(dw, hn::InterleaveLower(db, even, odd));
        vv[i + 1] = hn::PromoteTo(dw, hn::InterleaveUpper(db, even, odd));
      }
    } else {
      for (int i = 0; i < NC; ++i) vv[i] = int16_pairs(vals[j] + c0 + i * L, vals[j + 1] + c0 + i * L);
    }
    for (int r = 0; r < NR; ++r) {
      int32_t pair;  // (p16[r][j], p16[r][j + 1]), the first in the low half
      std::memcpy(&pair, p16 + (r0 + r) * kBlock + j, sizeof(pair));
      const auto pv = hn::BitCast(dw, hn::Set(di, pair));
      for (int i = 0; i < NC; ++i) a[r * NC + i] = dot_pairs(a[r * NC + i], pv, vv[i]);
    }
  }
  if constexpr (NC % 2 == 0 && hn::MaxLanes(DB()) > 16)  // the interleaves' column order, put back
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < NC; i += 2) {
        const auto lo = a[r * NC + i], hi = a[r * NC + i + 1];
        a[r * NC + i] = hn::ConcatLowerLower(di, hi, lo);
        a[r * NC + i + 1] = hn::ConcatUpperUpper(di, hi, lo);
      }
  for (int r = 0; r < NR; ++r) {
    const auto cv = hn::Set(df, corr[r0 + r]), sv = hn::Set(df, sp[r0 + r]);
    for (int i = 0; i < NC; ++i) {
      float* out = acc + (r0 + r) * d_v + c0 + i * L;
      hn::StoreU(hn::MulAdd(hn::ConvertTo(df, a[r * NC + i]), sv, hn::Mul(hn::LoadU(df, out), cv)), df, out);
    }
  }
}

/// The integer P·V update of rows [r0, r0 + NR) over the vector columns [0, dvv) of d_v.
template <int NR>
MHA_INT8_DOT HWY_INLINE void accumulate_rows_int8(const int16_t* p16, const float* sp, const float* corr,
                                                  const int8_t* const* vals, FarRows<int8_t> far, int64_t np,
                                                  int64_t d_v, int64_t dvv, int64_t r0, float* acc) {
  constexpr int64_t L = kLanes;
  constexpr int NC = kLanes / NR >= 4 ? 4 : kLanes / NR;
  int64_t c = 0;
  for (; c + NC * L <= dvv; c += NC * L) accumulate_tile_int8<NR, NC>(p16, sp, corr, vals, far, np, d_v, r0, c, acc);
  for (; c < dvv; c += L) accumulate_tile_int8<NR, 1>(p16, sp, corr, vals, far, np, d_v, r0, c, acc);
}

/// The integer P·V update of every row over all of d_v (np keys, even), asking for `far` along
/// with the keys (far.rows has np entries).
MHA_INT8_DOT HWY_NOINLINE void accumulate_block_int8(const int16_t* p16, const float* sp, const float* corr,
                                                     const int8_t* const* vals, FarRows<int8_t> far, int64_t rows,
                                                     int64_t np, int64_t d_v, float* acc) {
  const int64_t dvv = d_v / kLanes * kLanes;
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    accumulate_rows_int8<kTileRows>(p16, sp, corr, vals, far, np, d_v, dvv, r, acc);
  for (; r < rows; ++r) accumulate_rows_int8<1>(p16, sp, corr, vals, far, np, d_v, dvv, r, acc);
  for (int64_t c = dvv; c < d_v; ++c)
    for (r = 0; r < rows; ++r) {
      int32_t x = 0;
      for (int64_t j = 0; j < np; ++j) x += int32_t{p16[r * kBlock + j]} * vals[j][c];
      acc[r * d_v + c] = acc[r * d_v + c] * corr[r] + static_cast<float>(x) * sp[r];
    }
}
#else  // declared for decode_item_of's branches that kIntProducts discards here; never defined
void score_block_int8(const int16_t* q16, int64_t rows, int64_t d, const int8_t* const* keys, FarRows<int8_t> far,
                      int64_t nb, float* sc);
void accumulate_block_int8(const int16_t* p16, const float* sp, const float* corr, const int8_t* const* vals,
                           FarRows<int8_t> far, int64_t rows, int64_t np, int64_t d_v, float* acc);
#endif

// Transposed keys (DecodeParams::k_transposed): a tile of kKeyTile slots is (d, kKeyTile), each
// channel's kKeyTile values together. The scores of NR rows against a tile's keys accumulate in
// the lanes of kTileVecs vectors per row, one multiply-add per channel and row with the row's
// query element broadcast: no horizontal sums (the row layout's transpose-add tree per 16 dot
// products). Shapes: qs (rows, d), tile (d, kKeyTile), out (NR, ld_out).
constexpr int kTileVecs = kLanes >= kKeyTile ? 1 : static_cast<int>(kKeyTile) / kLanes;
constexpr int kTileRowsT = kTileVecs >= 4 ? 2 : 4;  // rows per transposed score tile: ≤ 8 accumulators on AVX2/SSE4

/// out[r][0 … kKeyTile) = q_{r0+r} · key of lane i of `tile`, r < NR. With `ahead`, asks a few
/// lines per channel step for the next tile in memory into L1 (the row layout's kNearRows ahead;
/// past the last tile a prefetch only, never a read) and for the first far_bytes of `far` (if
/// set) into L2, at the same pace (so at most the tile's own size).
template <int NR, class T>
HWY_INLINE void score_tile_transposed(const float* qs, int64_t d, const T* tile, bool ahead, const T* far,
                                      int64_t far_bytes, int64_t r0, float* out, int64_t ld_out) {
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  constexpr int64_t kColBytes = kKeyTile * static_cast<int64_t>(sizeof(T)), kPrefetchEvery = 256 / kColBytes;
  hn::Vec<DF> acc[NR * kTileVecs];
  for (int i = 0; i < NR * kTileVecs; ++i) acc[i] = hn::Zero(df);
  for (int64_t c = 0; c < d; ++c) {
    const T* col = tile + c * kKeyTile;
    if (ahead && c % kPrefetchEvery == 0) {               // 256 bytes (4 lines) every few channels
      prefetch_bytes<3>(tile, (d + c) * kColBytes, 256);  // the next tile starts d columns on
      if (far && c * kColBytes < far_bytes) prefetch_bytes<2>(far, c * kColBytes, 256);
    }
    hn::Vec<DF> kv[kTileVecs];
    for (int i = 0; i < kTileVecs; ++i) kv[i] = load_row(df, col + i * L);
    for (int r = 0; r < NR; ++r) {
      const auto qv = hn::Set(df, qs[(r0 + r) * d + c]);
      for (int i = 0; i < kTileVecs; ++i) acc[r * kTileVecs + i] = hn::MulAdd(qv, kv[i], acc[r * kTileVecs + i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < kTileVecs; ++i) hn::StoreU(acc[r * kTileVecs + i], df, out + r * ld_out + i * L);
}

/// The integer scores of score_tile_transposed for int8 tiles: out[r][i] = Σ_x q16[r0 + r][x] ·
/// tile[x][i], exact, as float. Channels go in pairs, (tile[x][i], tile[x + 1][i]) as the int16
/// pair of lane i, each multiplied with the row's (q16[x], q16[x + 1]) broadcast. Compiled for the
/// AVX-512 targets only (kIntProducts), where a tile's 16 keys fill one vector.
#if MHA_INT8_PRODUCTS
template <int NR>
MHA_INT8_DOT HWY_INLINE void score_tile_transposed_int8(const int16_t* q16, int64_t d, const int8_t* tile, bool ahead,
                                                        const int8_t* far, int64_t far_bytes, int64_t r0, float* out,
                                                        int64_t ld_out) {
  static_assert(kTileVecs == 1);
  constexpr int64_t kPrefetchEvery = 256 / kKeyTile;  // channels: 256 bytes of the tile
  const DF df;
  const DI di;
  const DW dw;
  hn::Vec<DI> acc[NR];  // lanes: the tile's keys
  for (auto& v : acc) v = hn::Zero(di);
  for (int64_t c = 0; c < d; c += 2) {
    const int8_t* col = tile + c * kKeyTile;
    if (ahead && c % kPrefetchEvery == 0) {
      prefetch_bytes<3>(tile, (d + c) * kKeyTile, 256);  // the next tile starts d columns on
      if (far && c * kKeyTile < far_bytes) prefetch_bytes<2>(far, c * kKeyTile, 256);
    }
    const bool pair = c + 1 < d;  // an odd d's last channel pairs with zeros
    const hn::Vec<DW> kv = pair ? int16_pairs_adjacent(col) : int16_pairs(col, kZeroInt8);  // c + 1 follows c
    for (int r = 0; r < NR; ++r) {
      const int16_t* q = q16 + (r0 + r) * d + c;
      int32_t qq = q[0] & 0xFFFF;  // (q[c], q[c + 1]), the first in the low half: one 32-bit load
      if (HWY_LIKELY(pair)) std::memcpy(&qq, q, sizeof(qq));
      acc[r] = dot_pairs(acc[r], hn::BitCast(dw, hn::Set(di, qq)), kv);
    }
  }
  for (int r = 0; r < NR; ++r) hn::StoreU(hn::ConvertTo(df, acc[r]), df, out + r * ld_out);
}

/// score_tile_transposed_int8 over two whole tiles at once (out0 and out1, kBlock apart a row):
/// each broadcast query pair serves both tiles, and the 2·NR accumulators are twice as many
/// independent vpdpwssd chains, where one tile's NR = 4 left the loop bound by their latency
/// (Zen 4, 1 thread: one tile's scores ran at about two thirds of one vpdpwssd a cycle; a step of
/// h=32, kv=8, d=128 over 512 keys in cache 63.6–64.2 → 60.4–61.1 µs). With `ahead`, asks for the
/// two tiles after tile1 and for each tile's `far` rows (far_bytes each) at one tile's pace.
/// Its own function rather than a tile-count parameter of score_tile_transposed_int8: the
/// generic form's loops compiled (GCC 12) to the same instructions but ran 2–6% slower here.
template <int NR>
MHA_INT8_DOT HWY_INLINE void score_tile_pair_transposed_int8(const int16_t* q16, int64_t d, const int8_t* tile0,
                                                             const int8_t* tile1, bool ahead, const int8_t* far0,
                                                             const int8_t* far1, int64_t far_bytes, int64_t r0,
                                                             float* out0, float* out1) {
  static_assert(kTileVecs == 1);
  constexpr int64_t kPrefetchEvery = 256 / kKeyTile;
  const DF df;
  const DI di;
  const DW dw;
  hn::Vec<DI> acc0[NR], acc1[NR];
  for (int r = 0; r < NR; ++r) acc0[r] = acc1[r] = hn::Zero(di);
  for (int64_t c = 0; c < d; c += 2) {
    if (ahead && c % kPrefetchEvery == 0) {
      prefetch_bytes<3>(tile1, (d + c) * kKeyTile, 256);
      prefetch_bytes<3>(tile1, (2 * d + c) * kKeyTile, 256);
      if (c * kKeyTile < far_bytes) {
        if (far0) prefetch_bytes<2>(far0, c * kKeyTile, 256);
        if (far1) prefetch_bytes<2>(far1, c * kKeyTile, 256);
      }
    }
    const bool pair = c + 1 < d;
    const hn::Vec<DW> kv0 =
        pair ? int16_pairs_adjacent(tile0 + c * kKeyTile) : int16_pairs(tile0 + c * kKeyTile, kZeroInt8);
    const hn::Vec<DW> kv1 =
        pair ? int16_pairs_adjacent(tile1 + c * kKeyTile) : int16_pairs(tile1 + c * kKeyTile, kZeroInt8);
    for (int r = 0; r < NR; ++r) {
      const int16_t* q = q16 + (r0 + r) * d + c;
      int32_t qq = q[0] & 0xFFFF;
      if (HWY_LIKELY(pair)) std::memcpy(&qq, q, sizeof(qq));
      const hn::Vec<DW> qv = hn::BitCast(dw, hn::Set(di, qq));
      acc0[r] = dot_pairs(acc0[r], qv, kv0);
      acc1[r] = dot_pairs(acc1[r], qv, kv1);
    }
  }
  for (int r = 0; r < NR; ++r) {
    hn::StoreU(hn::ConvertTo(df, acc0[r]), df, out0 + r * kBlock);
    hn::StoreU(hn::ConvertTo(df, acc1[r]), df, out1 + r * kBlock);
  }
}
#else  // declared for score_block_transposed's branch that kIntProducts discards here; never defined
template <int NR>
void score_tile_transposed_int8(const int16_t* q16, int64_t d, const int8_t* tile, bool ahead, const int8_t* far,
                                int64_t far_bytes, int64_t r0, float* out, int64_t ld_out);
template <int NR>
void score_tile_pair_transposed_int8(const int16_t* q16, int64_t d, const int8_t* tile0, const int8_t* tile1,
                                     bool ahead, const int8_t* far0, const int8_t* far1, int64_t far_bytes, int64_t r0,
                                     float* out0, float* out1);
#endif

/// Whether keys [j, j + kKeyTile) of a block of nb are one whole tile, lanes 0 … kKeyTile − 1 in order.
template <class T>
inline bool whole_tile_at(const T* const* tile, const int32_t* lane, int64_t j, int64_t nb) {
  if (j + kKeyTile > nb) return false;
  for (int64_t i = 0; i < kKeyTile; ++i)
    if (tile[j + i] != tile[j] || lane[j + i] != i) return false;
  return true;
}

/// Scores of every row against the block's nb keys in transposed tiles: key j lies in lane
/// lane[j] of the tile at tile[j]; `far` is asked for along with them (far.rows[j] for the run
/// that starts at key j: the run's rows, far.bytes each).
/// Runs of keys in consecutive lanes of one tile take one tile score each; a whole tile lands in
/// sc directly, a part through `tmp` (rows × kKeyTile).
/// int8 tiles take the rows' int16 queries q16 (rows × d) instead of qs (integer scores).
template <class T>
MHA_INT8_DOT HWY_NOINLINE void score_block_transposed(const float* qs, const int16_t* q16, int64_t rows, int64_t d,
                                                      const T* const* tile, const int32_t* lane, FarRows<T> far,
                                                      int64_t nb, float* tmp, float* sc) {
  for (int64_t j = 0; j < nb;) {
    const int64_t lane0 = lane[j];
    int64_t n = 1;
    while (j + n < nb && tile[j + n] == tile[j] && lane[j + n] == lane0 + n) ++n;
    const T* far_tile = far.rows ? far.rows[j] : nullptr;
    const int64_t far_bytes = n * far.bytes;
    const bool whole = lane0 == 0 && n == kKeyTile;
    float* out = whole ? sc + j : tmp;
    const int64_t ld = whole ? kBlock : kKeyTile;
    int64_t r = 0;
    if constexpr (std::is_same_v<T, int8_t> && kIntProducts) {
      // Two whole tiles in a row: scored together (score_tile_pair_transposed_int8).
      if (whole && whole_tile_at(tile, lane, j + kKeyTile, nb)) {
        const T* far_next = far.rows ? far.rows[j + kKeyTile] : nullptr;
        for (; r + kTileRowsT <= rows; r += kTileRowsT)
          score_tile_pair_transposed_int8<kTileRowsT>(q16, d, tile[j], tile[j + kKeyTile], r == 0, far_tile, far_next,
                                                      far_bytes, r, sc + j + r * kBlock,
                                                      sc + j + kKeyTile + r * kBlock);
        for (; r < rows; ++r)
          score_tile_pair_transposed_int8<1>(q16, d, tile[j], tile[j + kKeyTile], r == 0, far_tile, far_next, far_bytes,
                                             r, sc + j + r * kBlock, sc + j + kKeyTile + r * kBlock);
        j += 2 * kKeyTile;
        continue;
      }
      for (; r + kTileRowsT <= rows; r += kTileRowsT)
        score_tile_transposed_int8<kTileRowsT>(q16, d, tile[j], r == 0, far_tile, far_bytes, r, out + r * ld, ld);
      for (; r < rows; ++r)
        score_tile_transposed_int8<1>(q16, d, tile[j], r == 0, far_tile, far_bytes, r, out + r * ld, ld);
    } else {
      for (; r + kTileRowsT <= rows; r += kTileRowsT)
        score_tile_transposed<kTileRowsT>(qs, d, tile[j], r == 0, far_tile, far_bytes, r, out + r * ld, ld);
      for (; r < rows; ++r) score_tile_transposed<1>(qs, d, tile[j], r == 0, far_tile, far_bytes, r, out + r * ld, ld);
    }
    if (!whole)
      for (int64_t rr = 0; rr < rows; ++rr)
        std::copy(tmp + rr * kKeyTile + lane0, tmp + rr * kKeyTile + lane0 + n, sc + rr * kBlock + j);
    j += n;
  }
}

/// Scores of the block's nb int8 keys (positions p0 …) with per-channel scales: per run of keys in
/// one group, qg = the query rows qs (rows × d) times the group's scales (group_scales + group · d),
/// then the score tiles over that run. Its own function: inlined into decode_item_of, GCC kept
/// the score tiles' accumulators in memory (the per-channel step ran 50% slower than per-token).
HWY_NOINLINE void score_block_channels(const float* qs, float* qg, int64_t rows, int64_t d, const int8_t* const* keys,
                                       FarRows<int8_t> far, int64_t nb, int64_t p0, int64_t key_group,
                                       const float* group_scales, float* sc) {
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  for (int64_t j0 = 0; j0 < nb;) {
    const int64_t group = (p0 + j0) / key_group, n = std::min(nb, (group + 1) * key_group - p0) - j0;
    const float* scale = group_scales + group * d;
    for (int64_t rr = 0; rr < rows; ++rr) {
      const float* qr = qs + rr * d;
      float* gr = qg + rr * d;
      int64_t x = 0;
      for (; x + L <= d; x += L) hn::StoreU(hn::Mul(hn::LoadU(df, qr + x), hn::LoadU(df, scale + x)), df, gr + x);
      for (; x < d; ++x) gr[x] = qr[x] * scale[x];
    }
    int64_t r = 0;
    const FarRows<int8_t> run_far{far.rows ? far.rows + j0 : nullptr, far.bytes};
    for (; r + kTileRows <= rows; r += kTileRows) score_rows<kTileRows>(qg, d, keys + j0, run_far, n, r, sc + j0);
    for (; r < rows; ++r) score_rows<1>(qg, d, keys + j0, run_far, n, r, sc + j0);
    j0 += n;
  }
}

/// One work item over a cache of T; kChannelKeys: int8 keys with per-channel scales (a variant of
/// its own, so the other dtypes' loops are compiled exactly as without it).
template <class T, bool kChannelKeys = false, bool kTransposed = false>
void decode_item_of(const DecodeParams& p, int64_t index, float* partial, float* scratch) {
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  const Plan pl = make_plan(p);
  const Item it = item_at(p, pl, index);
  const int64_t d = p.d(), d_v = p.d_v, G = pl.group, rows = G * it.tq;
  float* m = partial;
  float* l = m + pl.rows_max;
  float* acc = l + pl.rows_max;
  float* qs = scratch;                      // (rows, d): query rows times the scale
  float* sc = qs + pl.rows_max * d;         // (rows, kBlock): scores, then probabilities
  float* corr = sc + pl.rows_max * kBlock;  // (rows): e^{m_old − m_new} of the current block
  float* qg = corr + pl.rows_max;           // per-channel int8 keys: (rows, d) qs ⊙ group scales
  float* tile_tmp = corr + pl.rows_max;     // transposed keys: (rows, kKeyTile), a tile's scores
  // int8: (rows, d) int16 query rows and their steps, (rows, kBlock) int16 probabilities and steps
  float* const int8_part = corr + pl.rows_max * (1 + (kChannelKeys ? d : kTransposed ? kKeyTile : 0));
  int16_t* const q16 = reinterpret_cast<int16_t*>(int8_part);
  float* const q_step = int8_part + pl.rows_max * ((d + 1) / 2);
  int16_t* const p16 = reinterpret_cast<int16_t*>(q_step + pl.rows_max);
  float* const p_step = q_step + pl.rows_max * (1 + kBlock / 2);
  const int64_t q_first = p.q_start[it.b] + it.t0;  // position of the tile's first query
  const int64_t q_last = q_first + it.tq - 1;
  const CausalRule causal = CausalRule::positions(it.sink ? 0 : p.window);
  // Row r = hh·tq + t: query head g·G + hh, query t0 + t.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t hh = r / it.tq, t = r % it.tq;
    const float* q = p.q.row(it.b, it.g * G + hh, it.t0 + t);
    for (int64_t x = 0; x < d; ++x) qs[r * d + x] = p.scale * q[x * p.q.stride[3]];
    m[r] = kNegInf;
    l[r] = 0.0f;
  }
  std::fill(acc, acc + rows * d_v, 0.0f);
  constexpr bool kScaled = std::is_same_v<T, int8_t>;
  // int8 with one scale per key: integer scores. Per-channel key scales keep float32 ones (q ⊙ the
  // group's scales changes every few keys: rounding it each time cost more than the integer
  // products gave).
  constexpr bool kIntScores = kScaled && !kChannelKeys && kIntProducts;
  constexpr bool kIntValues = kScaled && kIntProducts;  // integer P·V
  // int8 with one scale per key: score = step_q · scale_k · (q / step_q · k_int8) (in the order
  // the block loop below gives), the step per query row: the int16 rounding's (integer scores),
  // else a power of two that keeps the float sums of q · k_int8 in range
  // (divide_by_power_of_two_step).
  // A row holding ±inf but no NaN has no int16 steps; its scores are formed in float in the block
  // loop, as the targets that widen int8 keys form them, with a step of 1. (Such rows are found
  // again there from qs, rather than listed here: a kernel does not allocate.)
  const auto infinite_row = [&](int64_t r) {
    const float* q = qs + r * d;
    return std::none_of(q, q + d, [](float x) { return std::isnan(x); }) &&
           std::any_of(q, q + d, [](float x) { return std::isinf(x); });
  };
  bool any_infinite_row = false;
  if constexpr (kIntScores) {
    for (int64_t r = 0; r < rows; ++r) {
      q_step[r] = quantize_int16(qs + r * d, d, query_steps(d), q16 + r * d);
      if (HWY_UNLIKELY(std::isnan(q_step[r])) && infinite_row(r)) {
        q_step[r] = 1.0f;
        any_infinite_row = true;
      }
    }
  } else if constexpr (kScaled && !kChannelKeys) {
    for (int64_t r = 0; r < rows; ++r) q_step[r] = divide_by_power_of_two_step(qs + r * d, d);
  }

  const T* const kpool = static_cast<const T*>(p.k);
  const T* const vpool = static_cast<const T*>(p.v);
  // Paged: this sequence's block table.
  const int32_t* const table = p.block_table ? p.block_table + it.b * p.table_stride : nullptr;
  // Position pos lives in slot `slot` of plane head `head` (a (sequence, K/V head), or a paged
  // block's K/V head), `rows_per_head` rows a head: row head · rows_per_head + slot.
  struct Place {
    int64_t head, slot;
  };
  const int64_t rows_per_head = table ? p.block_size : p.capacity;
  const auto place_of = [&](int64_t pos) -> Place {
    if (table) return {table[pos / p.block_size] * p.kv_heads + it.g, pos % p.block_size};
    // A ring (with sinks: the slots after them) holds the latest positions.
    const int64_t slot = !p.ring || pos < p.sinks ? pos : p.sinks + (pos - p.sinks) % (p.capacity - p.sinks);
    return {it.b * p.kv_heads + it.g, slot};
  };
  const auto row_at = [&](Place at) { return at.head * rows_per_head + at.slot; };
  static_assert(!kTransposed || !kChannelKeys);
  // Transposed keys: the tile holding a place (k_slots slots a head, or a paged block's
  // block_size), and its lane there.
  const auto key_tile = [&](Place at, int32_t* lane) -> const T* {
    *lane = static_cast<int32_t>(at.slot % kKeyTile);
    return kpool + (at.head * p.k_slots + at.slot - at.slot % kKeyTile) * d;
  };
  // A key's row, or with transposed keys the row-sized part of its tile (what next_keys asks for).
  const auto key_row = [&](Place at) -> const T* {
    if constexpr (kTransposed) {
      int32_t lane = 0;
      const T* tile = key_tile(at, &lane);
      return tile + lane * d;
    } else {
      return kpool + row_at(at) * d;
    }
  };
  // A contiguous cache that is no ring holds position p in slot p of the sequence's own head: its
  // blocks skip place_of's placement per key (with the cache in L2, context 512: int8 keys across
  // lanes 75 → 65 µs a step, rows 72 → 69).
  const bool linear = !table && !p.ring;
  const int64_t linear_head = it.b * p.kv_heads + it.g;
  const T* ktile[kTransposed ? kBlock : 1];
  int32_t klane[kTransposed ? kBlock : 1];
  const T* keys[kBlock];
  const T* vals[kBlock];
  // The next block's K rows (null past the item's end), for the P·V loop (kNextKeysDuringValues).
  // Transposed keys: the key's row-sized part of its tile.
  const T* next_keys[kBlock];
  // What the score and P·V loops ask for into L2: the block's V rows, the next block's K rows.
  const FarRows<T> score_far{vals, row_bytes<T>(d_v)};
  FarRows<T> value_far;
  // int8 asks too where its products are integers, except with per-channel keys. Zen 4, 1 / 2
  // threads, context 8192: transposed keys 1.41 → 1.34 ms, 0.78 → 0.75; rows, with their score
  // loop's exact lines, 1.38 → 1.35 ms, 0.83 → 0.79 over 8 interleaved rounds; per-channel keys
  // level (1.58 / 0.92 ms either way, exact lines in their float score loop too).
  constexpr bool kAskNextKeys =
      kNextKeysDuringValues<T> || (std::is_same_v<T, int8_t> && !kChannelKeys && kIntProducts);
  if constexpr (kAskNextKeys) value_far = {next_keys, row_bytes<T>(d)};
  static_assert(!kChannelKeys || kScaled);
  const int64_t key_group = kChannelKeys ? p.k_channel_group : 0;  // per-channel key scales: positions per group
  // Groups per head, rounded up without forming capacity + key_group − 1 (KvCacheConfig::key_groups).
  const int64_t groups = kChannelKeys ? p.capacity / key_group + (p.capacity % key_group != 0) : 0;
  const float* const group_scales = kChannelKeys ? p.k_scale + (it.b * p.kv_heads + it.g) * groups * d : nullptr;
  // int8: the block's row scales (per-channel keys need none for K: their scales are in qg)
  float kscale[kScaled && !kChannelKeys ? kBlock : 1], vscale[kScaled ? kBlock : 1];
  const auto neg_inf = hn::Set(df, kNegInf);
  const bool edit_scores = p.edits.capped() || p.edits.alibi();
  // int8: the scales of the block from p_next, asked for into L2 a block ahead. Nothing else asked
  // for them: each block's first reads of its row scales (and of per-channel key groups' scales)
  // went to memory while its products waited (Zen 4, 1 thread, context 8192 from memory, medians
  // of 10 interleaved rounds: keys across lanes 1.265 → 1.231 ms a token, rows 1.318 → 1.292).
  const auto ask_scales_of_block = [&](int64_t p_next) {
    if constexpr (kScaled) {
      if (p_next >= it.hi) return;
      const int64_t n = std::min(kBlock, it.hi - p_next);
      constexpr int64_t kF = sizeof(float), kLineFloats = 64 / kF;
      if constexpr (kChannelKeys) {
        const int64_t g0 = p_next / key_group, g1 = (p_next + n - 1) / key_group;
        prefetch_bytes<2>(group_scales + g0 * d, 0, (g1 - g0 + 1) * d * kF);
      }
      if (linear) {
        const int64_t row0 = row_at({linear_head, p_next});
        if constexpr (!kChannelKeys) prefetch_bytes<2>(p.k_scale + row0, 0, n * kF);
        prefetch_bytes<2>(p.v_scale + row0, 0, n * kF);
        return;
      }
      // Paged or a ring: a line's worth of keys at a time, the lines of its first and last key's
      // scales (rows run on within a page or up to the wrap; pages of fewer keys than a line of
      // scales holds leave the lines of the pages between to the demand reads).
      for (int64_t j = 0; j < n; j += kLineFloats)
        for (const int64_t pos : {p_next + j, p_next + std::min(j + kLineFloats, n) - 1}) {
          const int64_t row = row_at(place_of(pos));
          asm volatile("");  // (keeps the loop: see prefetch_bytes in kernels/common.h)
          if constexpr (!kChannelKeys) __builtin_prefetch(p.k_scale + row, 0, 2);
          __builtin_prefetch(p.v_scale + row, 0, 2);
        }
    }
  };
  for (int64_t p0 = it.lo; p0 < it.hi; p0 += kBlock) {
    const int64_t nb = std::min(kBlock, it.hi - p0);
    ask_scales_of_block(p0 + kBlock);
    if (linear) {  // the block's rows are consecutive
      const int64_t row0 = row_at({linear_head, p0});
      for (int64_t j = 0; j < nb; ++j) {
        if constexpr (kTransposed)
          ktile[j] = key_tile({linear_head, p0 + j}, &klane[j]);
        else
          keys[j] = kpool + (row0 + j) * d;
        vals[j] = vpool + (row0 + j) * d_v;
      }
      if constexpr (kScaled) {
        if constexpr (!kChannelKeys) std::copy(p.k_scale + row0, p.k_scale + row0 + nb, kscale);
        std::copy(p.v_scale + row0, p.v_scale + row0 + nb, vscale);
      }
    } else {
      for (int64_t j = 0; j < nb; ++j) {
        const Place at = place_of(p0 + j);
        const int64_t row = row_at(at);
        if constexpr (kTransposed)
          ktile[j] = key_tile(at, &klane[j]);
        else
          keys[j] = kpool + row * d;
        vals[j] = vpool + row * d_v;
        if constexpr (kScaled) {
          if constexpr (!kChannelKeys) kscale[j] = p.k_scale[row];
          vscale[j] = p.v_scale[row];
        }
      }
    }
    if constexpr (kScaled) {
      if constexpr (!kChannelKeys) std::fill(kscale + nb, kscale + kBlock, 0.0f);
      std::fill(vscale + nb, vscale + kBlock, 0.0f);
      if (nb % 2 != 0) vals[nb] = vals[nb - 1];  // integer P·V takes keys in pairs: a row to read, times 0
    }
    if constexpr (kAskNextKeys) {  // the next block's rows, asked for in the P·V loop
      const int64_t pf = p0 + kBlock;
      if (linear)
        for (int64_t j = 0; j < nb; ++j) next_keys[j] = pf + j < it.hi ? key_row({linear_head, pf + j}) : nullptr;
      else
        for (int64_t j = 0; j < nb; ++j) next_keys[j] = pf + j < it.hi ? key_row(place_of(pf + j)) : nullptr;
      if (nb % 2 != 0) next_keys[nb] = nullptr;  // int8's P·V takes keys in pairs
    }
    int64_t r = 0;
    if constexpr (kChannelKeys) {
      score_block_channels(qs, qg, rows, d, keys, score_far, nb, p0, key_group, group_scales, sc);
    } else if constexpr (kIntScores && !kTransposed) {
      score_block_int8(q16, rows, d, keys, score_far, nb, sc);
    } else if constexpr (kTransposed) {
      score_block_transposed(qs, q16, rows, d, ktile, klane, score_far, nb, tile_tmp, sc);
    } else {
      for (; r + kTileRows <= rows; r += kTileRows) score_rows<kTileRows>(qs, d, keys, score_far, nb, r, sc);
      for (; r < rows; ++r) score_rows<1>(qs, d, keys, score_far, nb, r, sc);
    }
    if constexpr (kIntScores) {
      // A query row holding ±inf (no NaN): q · k_int8 summed in float is, key by key, ±inf (the
      // sign of its infinite terms; finite channels cannot change an infinite sum) or NaN (an
      // infinite term times 0, or terms of both signs): what the widened targets, the float32
      // cache and sdpa give, so a row whose every visible score is −inf is fully masked here too
      // (it was NaN: docs/semantics.md, 'Fully masked rows'). The key's scale follows below.
      for (int64_t rr = 0; HWY_UNLIKELY(any_infinite_row) && rr < rows; ++rr) {
        if (!infinite_row(rr)) continue;
        const float* q = qs + rr * d;
        for (int64_t j = 0; j < nb; ++j) {
          float sum = 0.0f;
          for (int64_t x = 0; x < d; ++x) {
            if (!std::isinf(q[x])) continue;
            int8_t kx;
            if constexpr (kTransposed)
              kx = ktile[j][x * kKeyTile + klane[j]];
            else
              kx = keys[j][x];
            sum += q[x] * static_cast<float>(kx);
          }
          sc[rr * kBlock + j] = sum;
        }
      }
    }
    // Causal / window masks, only where the block is not visible to every row.
    const bool all_visible = causal.tile(q_first, q_last + 1, p0, p0 + nb) == TileVis::All;
    for (int64_t rr = 0; rr < rows; ++rr) {
      float* s = sc + rr * kBlock;
      const int64_t qpos = q_first + rr % it.tq;
      // int8: score = step_q · scale_k · (q / step_q · k_int8), multiplied in the order that
      // cannot overflow where the score does not: a step below 1 (every ordinary query row of the
      // integer products) times the key's scale first, as always; a step of 1 or more (a row that
      // the widened products divided by a power of two, or integer steps of a row beyond 32767)
      // last, after the scale (the product and the sum are then at most the score). A power of
      // two multiplies exactly: the widened path's finite scores keep their bits.
      // Lanes past nb are −inf below.
      if constexpr (kScaled && !kChannelKeys) {
        const auto step = hn::Set(df, q_step[rr]);
        if (q_step[rr] < 1.0f) {
          for (int64_t j = 0; j < nb; j += L)
            hn::StoreU(hn::Mul(hn::LoadU(df, s + j), hn::Mul(step, hn::LoadU(df, kscale + j))), df, s + j);
        } else {
          for (int64_t j = 0; j < nb; j += L)
            hn::StoreU(hn::Mul(hn::Mul(hn::LoadU(df, s + j), hn::LoadU(df, kscale + j)), step), df, s + j);
        }
      }
      if (edit_scores) {
        // Score edits (kernels/score_edits.h): c·tanh(t/c), then ALiBi's m·(k_pos − q_pos) by
        // absolute positions; hidden keys become −inf below.
        // Lanes past nb hold stale scores; they are edited too (Tanh is defined on every float)
        // and overwritten with −inf below.
        const auto vslope = hn::Set(df, p.edits.alibi() ? p.edits.alibi_slopes[it.g * G + rr / it.tq] : 0.0f);
        const auto vcap = hn::Set(df, p.edits.capped() ? p.edits.softcap : 1.0f);
        const float dist0 = static_cast<float>(p0 - qpos);
        for (int64_t j = 0; j < nb; j += L) {
          auto x = hn::LoadU(df, s + j);
          if (p.edits.capped()) x = hn::Mul(vcap, hn::Tanh(df, hn::Div(x, vcap)));
          hn::StoreU(hn::MulAdd(vslope, hn::Iota(df, dist0 + static_cast<float>(j)), x), df, s + j);
        }
      }
      if (!all_visible)
        for (int64_t j = 0; j < nb; ++j) {
          if (!causal.sees(qpos, p0 + j)) s[j] = kNegInf;
        }
      for (int64_t j = nb; j < kBlock; ++j) s[j] = kNegInf;
      auto vmax = neg_inf;
      auto any_nan = hn::MaskFromVec(hn::Zero(df));  // Max may drop a NaN score: note it here
      for (int64_t j = 0; j < kBlock; j += L) {
        const auto x = hn::LoadU(df, s + j);
        vmax = hn::Max(vmax, x);
        any_nan = hn::Or(any_nan, hn::IsNaN(x));
      }
      const float bmax = hn::GetLane(hn::MaxOfLanes(df, vmax));
      float m_new = std::max(m[rr], bmax);
      // A visible NaN score makes the row NaN (docs/semantics.md, 'NaN is never hidden'): l = NaN
      // stays NaN through later blocks and the merge; a finite m keeps the split from looking empty.
      // So does a visible +inf score (e^{+inf − +inf}, as in PyTorch).
      const bool saw_nan = HWY_UNLIKELY(!hn::AllFalse(df, any_nan)) || m_new == -kNegInf;
      if (saw_nan && m_new == kNegInf) m_new = 0.0f;
      if (m_new == kNegInf) {  // nothing visible yet: probabilities 0, state unchanged
        corr[rr] = 1.0f;
        std::fill(s, s + kBlock, 0.0f);
        if constexpr (kIntValues) std::fill(p16 + rr * kBlock, p16 + (rr + 1) * kBlock, int16_t{0}), p_step[rr] = 0.0f;
        continue;
      }
      corr[rr] = m[rr] == kNegInf ? 0.0f : std::exp(m[rr] - m_new);
      const auto mv = hn::Set(df, m_new);
      auto sum = hn::Zero(df);
      for (int64_t j = 0; j < kBlock; j += L) {
        const auto x = hn::LoadU(df, s + j);
        const auto e = exp_nonpositive(df, hn::Sub(x, mv));  // 0 for masked (−inf) scores
        if constexpr (kScaled)
          hn::StoreU(hn::Mul(e, hn::LoadU(df, vscale + j)), df, s + j);  // P · scale_v; l sums P alone
        else
          hn::StoreU(e, df, s + j);
        sum = hn::Add(sum, e);
      }
      l[rr] = saw_nan ? kNaN : l[rr] * corr[rr] + hn::GetLane(hn::SumOfLanes(df, sum));
      m[rr] = m_new;
      if constexpr (kIntValues)  // P · scale_v in int16 steps of the row's block max (NaN: all NaN)
        p_step[rr] = quantize_int16(s, kBlock, 32767, p16 + rr * kBlock);
    }
    if constexpr (kIntValues) {
      accumulate_block_int8(p16, p_step, corr, vals, value_far, rows, nb + nb % 2, d_v, acc);
    } else {
      r = 0;
      for (; r + kTileRows <= rows; r += kTileRows)
        accumulate_rows<kTileRows>(sc, corr, vals, value_far, nb, d_v, r, acc);
      for (; r < rows; ++r) accumulate_rows<1>(sc, corr, vals, value_far, nb, d_v, r, acc);
    }
  }
}

void decode_item(const DecodeParams& p, int64_t index, float* partial, float* scratch) {
  if (p.k_transposed) {
    if (p.dtype == DType::BF16)
      decode_item_of<bf16, false, true>(p, index, partial, scratch);
    else if (p.dtype == DType::I8)
      decode_item_of<int8_t, false, true>(p, index, partial, scratch);
    else
      decode_item_of<float, false, true>(p, index, partial, scratch);
  } else if (p.dtype == DType::BF16) {
    decode_item_of<bf16>(p, index, partial, scratch);
  } else if (p.dtype == DType::I8) {
    p.k_channel_group > 0 ? decode_item_of<int8_t, true>(p, index, partial, scratch)
                          : decode_item_of<int8_t>(p, index, partial, scratch);
  } else {
    decode_item_of<float>(p, index, partial, scratch);
  }
}

/// The target this copy was compiled for (decode_dispatch_target: which one a call takes).
int64_t decode_target() { return HWY_TARGET; }

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>

namespace mha::kernels {

HWY_EXPORT(decode_item);
HWY_EXPORT(decode_target);

using namespace decode_detail;

std::vector<int64_t> decode_compiled_targets() { return target_bits(HWY_TARGETS); }
int64_t decode_dispatch_target() { return HWY_DYNAMIC_DISPATCH(decode_target)(); }

size_t decode_workspace_floats(const DecodeParams& p) { return workspace_plan(p, make_plan(p)).floats(); }

int cap_decode_splits(int splits, int64_t longest_held) {
  // Splits are cut in whole blocks of kBlock positions (item_at), so past one block each the rest
  // are empty, and the merge skips empty ones: the cap changes no bit.
  return static_cast<int>(
      std::min<int64_t>(std::max(1, splits), std::max<int64_t>(1, (longest_held + kBlock - 1) / kBlock)));
}

void decode_attention(const DecodeParams& p, float* workspace) {
  assert_decode_params(p);
  const Plan pl = make_plan(p);
  if (pl.items == 0) return;
  MHA_DASSERT(workspace != nullptr);
  const WorkspacePlan wp = workspace_plan(p, pl);
  const int64_t part = partial_floats(pl, p.d_v);
  float* partials = wp.shared_part(workspace);
  auto* const item_fn = HWY_DYNAMIC_DISPATCH(decode_item);  // dispatched once per call

#pragma omp parallel num_threads(wp.threads)
  {
    float* mine = wp.thread_part(workspace, omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < pl.items; ++i) item_fn(p, i, partials + i * part, mine);

      // Merge the splits of each (b, g, query tile), in split order.
#pragma omp for schedule(dynamic, 1)
    for (int64_t tile = 0; tile < pl.items / pl.splits; ++tile) {
      const Item it = item_at(p, pl, tile * pl.splits);
      const float* first = partials + tile * pl.splits * part;
      for (int64_t r = 0; r < pl.group * it.tq; ++r) {
        const int64_t head = it.g * pl.group + r / it.tq, query = it.t0 + r % it.tq;
        float M = kNegInf;
        for (int64_t s = 0; s < pl.splits; ++s) M = std::max(M, first[s * part + r]);
        // A sink z joins the merge as one more term with l = 1 and no value.
        const float sink = p.edits.sinks ? p.edits.sinks[head] : kNegInf;
        M = std::max(M, sink);
        float* out = p.out.row(it.b, head, query);
        const int64_t os = p.out.stride[3];
        if (M == kNegInf) {  // no visible key: zeros, lse −inf (docs/semantics.md, 'Fully masked rows')
          for (int64_t x = 0; x < p.d_v; ++x) out[x * os] = 0.0f;
          if (p.lse.defined()) p.lse(it.b, head, query, 0) = kNegInf;
          continue;
        }
        double Lsum = p.edits.sinks ? static_cast<double>(std::exp(sink - M)) : 0.0;
        for (int64_t x = 0; x < p.d_v; ++x) out[x * os] = 0.0f;
        for (int64_t s = 0; s < pl.splits; ++s) {
          const float* ps = first + s * part;
          if (ps[r] == kNegInf) continue;
          const float w = std::exp(ps[r] - M);
          Lsum += static_cast<double>(w) * ps[pl.rows_max + r];
          const float* acc = ps + 2 * pl.rows_max + r * p.d_v;
          for (int64_t x = 0; x < p.d_v; ++x) out[x * os] += w * acc[x];
        }
        const float inv = static_cast<float>(1.0 / Lsum);
        for (int64_t x = 0; x < p.d_v; ++x) out[x * os] *= inv;
        if (p.lse.defined()) p.lse(it.b, head, query, 0) = M + static_cast<float>(std::log(Lsum));
      }
    }
  }
}

}  // namespace mha::kernels
#endif
