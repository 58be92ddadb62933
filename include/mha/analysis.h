// mha/analysis.h — what attention heads do, measured from their weights.
//
// Input: attention weights (B, h, T_q, T_k), or (h, T_q, T_k) for one sequence, as returned by
// MultiheadAttention::forward with NeedWeights::PerHead. For each head, over every row (b, i) that
// sees a key position (below):
//   entropy     mean of −Σ_j w[i,j]·ln w[i,j]          (nats; 0·ln 0 = 0; uniform over n keys = ln n)
//   sink        mean of w[i, 0]                         (mass on the first key)
//   prev_token  mean of w[i, p(i) − 1]                  (mass on the previous position)
//   self        mean of w[i, p(i)]                      (mass on the query's own position)
//   focus       mean of max_j w[i, j]
// where p(i) = i + offset is the key index at the query's own position. Of the T_k columns, the
// first n = MetricsOptions::key_positions (default: all) are sequence positions; columns after
// them have none (the bias_k and zero-attention keys MultiheadAttention appends: their mass
// counts in the entropy and focus, never as a query's own or previous token). The default offset
// is bottom-right alignment, n − T_q (0 for self-attention; the last query is the last key, as in
// KV-cache decoding); MetricsOptions::query_offset sets it explicitly (a top-left causal mask's
// offset is 0). A row whose p(i) − 1 (or p(i)) lies outside [0, n) does not enter the prev_token
// (self) mean; a head where no row qualifies reports 0 there (e.g. T = 1 has no previous token).
// A row sees a key position when it has weight on one of the first n columns. Rows that see none
// are excluded from every mean: fully masked rows (all zeros: docs/semantics.md, 'Fully masked
// rows'), and rows whose only visible keys are the appended bias_k / zero-attention ones — every
// real key hidden by attn_mask, key_padding_mask or the causal rule, which never hide those
// columns — whose weight, all on those columns, would read as focus 1 and entropy 0 and say
// nothing of the head. The weights decide, as they do for fully masked rows: a hidden key's weight
// is exactly 0, and so is the weight of a key a float mask pushes down by ~1e30 (Hugging Face's
// finfo.min padding) or of a visible key that scores too far below the row's best for float32
// (about 87 below in mha's weights): a row whose every real key is that far below an appended key
// is left out too, its weights being those of a masked row. key_positions = 0 leaves no row.
// Padding, when given (MetricsOptions, PyTorch's polarity: true = padding): rows of padded queries
// are excluded from every mean like fully masked rows (their outputs are discarded anyway), and
// the sink is each sequence's first key that is not padding (with left padding, key 0 is padding
// and carries no weight). A padded previous or own position carries no weight, and counts as such.
//
// Classes, first match wins, in the lesson's order (what Clark et al. 2019 look for):
//   attention_sink  sink > 0.4
//   prev_token      prev_token > 0.3
//   self_attend     self > 0.4
//   focused         entropy < 0.5 nats
//   broad           otherwise
//   empty           the head has no row that sees a key position (nothing to measure)
// The comparisons are strict; the thresholds are configurable (HeadThresholds).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mha/tensor.h"

namespace mha {

enum class HeadClass : uint8_t { AttentionSink, PrevToken, SelfAttend, Focused, Broad, Empty };

/// "attention_sink", "prev_token", "self_attend", "focused", "broad", "empty".
const char* head_class_name(HeadClass cls);

struct HeadThresholds {
  double sink = 0.4;             ///< attention_sink when sink mass > this
  double prev_token = 0.3;       ///< prev_token when previous-position mass > this
  double self_attend = 0.4;      ///< self_attend when diagonal mass > this
  double focused_entropy = 0.5;  ///< focused when mean entropy (nats) < this
};

struct MetricsOptions {
  HeadThresholds thresholds;
  /// p(i) = i + query_offset is query i's own key position; unset = key_positions − T_q
  /// (bottom-right).
  std::optional<int64_t> query_offset;
  /// How many leading key columns are sequence positions, in [0, T_k]; unset = T_k. Pass T_k − 1
  /// (− 2) for weights of a module with add_bias_kv (and add_zero_attn), whose extra columns come
  /// last (rows with weight on those columns only are then not measured).
  std::optional<int64_t> key_positions;
  /// (B, key_positions), nonzero = padding (PyTorch's key_padding_mask polarity); undefined = none.
  /// The sink of sequence b is its first key that is not padding.
  BoolTensor key_padding;
  /// (B, T_q), nonzero = padding: those rows are not measured; undefined = none. For
  /// self-attention this is the key padding mask itself.
  BoolTensor query_padding;
};

struct HeadMetrics {
  int64_t head = 0;
  int64_t rows = 0;         ///< rows measured (all batches): those that see a key position
  double entropy = 0.0;     ///< nats
  double sink = 0.0;        ///< mean weight on key 0
  double prev_token = 0.0;  ///< mean weight on key p(i) − 1
  double self = 0.0;        ///< mean weight on key p(i)
  double focus = 0.0;       ///< mean of each row's maximum
  HeadClass cls = HeadClass::Empty;
};

/// The class of a head from its metrics (Empty when rows == 0), in the order documented above.
HeadClass classify(const HeadMetrics& metrics, const HeadThresholds& thresholds = {});

/// One entry per head. Throws mha::Error unless `weights` is 3-D or 4-D with non-negative,
/// finite entries (and T_k ≥ 1).
std::vector<HeadMetrics> head_metrics(const Tensor& weights, const MetricsOptions& options = {});

}  // namespace mha
