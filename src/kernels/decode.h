// kernels/decode.h — attention of a few queries against a long KV cache (flash-decoding), and
// rotary embeddings. Kernels take validated params; they neither allocate nor do I/O.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/common.h"
#include "kernels/score_edits.h"
#include "mha/rope.h"
#include "mha/tensor.h"

namespace mha::kernels {

// ---- rotary embeddings ---------------------------------------------------------------------
struct RopeParams {
  View4<float> x;                  // (B, heads, T, d), rotated in place
  const int64_t* start = nullptr;  // (B) absolute position of row 0, or null for 0
  double theta = 10000.0;
  int64_t dims = 0;  // even, ≤ d
  RopePairing pairing = RopePairing::HalfSplit;
  RopeDirection direction = RopeDirection::Rotate;  // Unrotate: by −angle (sin negated)
};
void rope_inplace(const RopeParams& p);

// ---- decode attention over a cache ---------------------------------------------------------
struct DecodeParams {
  View4<const float> q;     // (B, h, T_q, d)
  const void* k = nullptr;  // (B, kv, capacity, d) contiguous, float, bf16 or int8 by dtype
  const void* v = nullptr;  // (B, kv, capacity, d_v)
  DType dtype = DType::F32;
  // int8 only: one scale per row of k / v (same row index, (B, kv, capacity) or the pool's
  // (blocks, kv, block_size)); element = int8 value · its row's scale.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  // int8 keys with per-channel scales (KIVI), when > 0: k_scale is (B, kv, ceil(capacity / G), d)
  // with G = k_channel_group, one scale per channel of each group of G consecutive slots; key
  // element = int8 value · its group's scale of its channel. Contiguous, non-ring caches only.
  int64_t k_channel_group = 0;
  // Transposed keys (KeyLayout::Transposed; no per-channel scales): k is (B, kv, k_slots / 16,
  // d, 16), slot s of a head in lane s mod 16 of its tile, k_slots = capacity rounded up to whole
  // tiles; paged, the pool is (blocks, kv, block_size / 16, d, 16) and k_slots = block_size.
  // k_scale stays one per row, indexed as in the row layout.
  bool k_transposed = false;
  int64_t k_slots = 0;
  int64_t kv_heads = 0, capacity = 0, d_v = 0;
  bool ring = false;  // position p lives in slot p mod capacity (else slot p); with sinks, p < sinks in
                      // slot p and later ones in slot sinks + (p − sinks) mod (capacity − sinks)
  // Paged (vLLM's PagedAttention), when block_table is set: k and v are pools (blocks, kv,
  // block_size, d | d_v), and position p of sequence b lives in row p mod block_size of block
  // block_table[b · table_stride + p / block_size]. ring and capacity are then unused.
  const int32_t* block_table = nullptr;
  int64_t table_stride = 0, block_size = 0;
  const int64_t* key_first = nullptr;  // (B) first position held
  const int64_t* key_end = nullptr;    // (B) one past the last position held
  const int64_t* q_start = nullptr;    // (B) absolute position of query row 0
  int64_t window = 0;                  // 0 = unlimited
  // StreamingLLM attention sinks: positions [0, sinks) are held (besides [key_first, key_end),
  // which then starts at or after `sinks`) and visible to every later query whatever the window.
  int64_t sinks = 0;
  float scale = 1.0f;
  ScoreEdits edits;  // softcap, ALiBi (by absolute positions), sinks (kernels/score_edits.h)
  int splits = 1;    // ≥ 1, independent of threads
  int threads = 1;
  View4<float> out;  // (B, h, T_q, d_v)
  View4<float> lse;  // (B, h, T_q, 1), optional

  int64_t batch() const { return q.shape[0]; }
  int64_t heads() const { return q.shape[1]; }
  int64_t t_q() const { return q.shape[2]; }
  int64_t d() const { return q.shape[3]; }
  int64_t group() const { return heads() / kv_heads; }
};
/// The SIMD targets the decode kernel was compiled for (Highway bits; its HWY_TARGETS, which
/// the tests' own translation units may not share) and the one a call dispatches to now.
std::vector<int64_t> decode_compiled_targets();
int64_t decode_dispatch_target();

size_t decode_workspace_floats(const DecodeParams& p);
/// A split count for sequences holding at most longest_held positions: splits (at least 1), capped
/// at one block of keys per split. The further splits would be empty, so the cap changes no bit of
/// the result; it keeps a huge count from sizing a huge workspace.
int cap_decode_splits(int splits, int64_t longest_held);
void decode_attention(const DecodeParams& p, float* workspace);

}  // namespace mha::kernels
