// analysis/metrics.cpp — per-head metrics and classes from attention weights (mha/analysis.h).
#include <cmath>
#include <string>
#include <vector>

#include "mha/analysis.h"
#include "mha/masks.h"

namespace mha {

const char* head_class_name(HeadClass cls) {
  switch (cls) {
    case HeadClass::AttentionSink:
      return "attention_sink";
    case HeadClass::PrevToken:
      return "prev_token";
    case HeadClass::SelfAttend:
      return "self_attend";
    case HeadClass::Focused:
      return "focused";
    case HeadClass::Broad:
      return "broad";
    case HeadClass::Empty:
      return "empty";
  }
  return "unknown";
}

HeadClass classify(const HeadMetrics& m, const HeadThresholds& t) {
  if (m.rows == 0) return HeadClass::Empty;
  if (m.sink > t.sink) return HeadClass::AttentionSink;
  if (m.prev_token > t.prev_token) return HeadClass::PrevToken;
  if (m.self > t.self_attend) return HeadClass::SelfAttend;
  if (m.entropy < t.focused_entropy) return HeadClass::Focused;
  return HeadClass::Broad;
}

std::vector<HeadMetrics> head_metrics(const Tensor& weights, const MetricsOptions& options) {
  constexpr const char* kFn = "head_metrics";
  if (weights.dim() != 3 && weights.dim() != 4)
    fail(kFn, ": weights must be (B, h, T_q, T_k) or (h, T_q, T_k), got ", shape_str(weights.shape()));
  const View4<const float> w = weights.view4();
  const int64_t B = w.shape[0], H = w.shape[1], Tq = w.shape[2], Tk = w.shape[3];
  if (Tk < 1 && Tq > 0) fail(kFn, ": weights ", shape_str(weights.shape()), " have no key positions (T_k = 0)");
  for (int64_t n = 0; n < weights.numel(); ++n) {
    const float x = weights.data()[n];
    if (!(x >= 0.0f) || !std::isfinite(x))
      fail(kFn, ": weights ", shape_str(weights.shape()), " must be finite and non-negative, got ", x,
           " at flat index ", n);
  }
  const int64_t positions = options.key_positions.value_or(Tk);
  if (positions < 0 || positions > Tk)
    fail(kFn, ": key_positions ", positions, " is out of range [0, ", Tk, "] for weights ", shape_str(weights.shape()));
  const int64_t offset = options.query_offset.value_or(positions - Tq);
  // Query i's own key is i + offset: bounded as sdpa bounds a causal offset, so that it and the
  // key before it are formed without overflow (any offset past ±2⁴⁰ puts both outside every row).
  constexpr int64_t kMaxOffset = Causal::kMaxPosition;
  if (offset < -kMaxOffset || offset > kMaxOffset)
    fail(kFn, ": query_offset ", offset, " is out of range [", -kMaxOffset, ", ", kMaxOffset, "]");

  // Padding masks: (B, positions) and (B, T_q), PyTorch's polarity; (positions) and (T_q) too for
  // one sequence's (h, T_q, T_k) weights, as PyTorch takes an unbatched key_padding_mask.
  const auto check_padding = [&](const BoolTensor& m, const char* name, int64_t width) {
    if (!m.defined()) return;
    const bool batched = m.dim() == 2 && m.size(0) == B && m.size(1) == width;
    const bool unbatched = m.dim() == 1 && weights.dim() == 3 && m.size(0) == width;
    if (!batched && !unbatched)
      fail(kFn, ": ", name, " ", shape_str(m.shape()), " must be (B, ", width, ") = (", B, ", ", width, ")",
           weights.dim() == 3 ? " or (" + std::to_string(width) + ")" : std::string(), " for weights ",
           shape_str(weights.shape()));
  };
  check_padding(options.key_padding, "key_padding", positions);
  check_padding(options.query_padding, "query_padding", Tq);
  const auto key_padded = [&](int64_t b, int64_t j) {
    return options.key_padding.defined() && options.key_padding.data()[b * positions + j] != 0;
  };
  // Each sequence's sink: its first key that is not padding (none: −1, no sink mass); without a
  // key padding mask key 0, when key_positions leaves one.
  std::vector<int64_t> sink_key(static_cast<size_t>(B), -1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < positions; ++j)
      if (!key_padded(b, j)) {
        sink_key[static_cast<size_t>(b)] = j;
        break;
      }

  std::vector<HeadMetrics> result(static_cast<size_t>(H));
  for (int64_t h = 0; h < H; ++h) {
    HeadMetrics& m = result[static_cast<size_t>(h)];
    m.head = h;
    // Sums in double, in a fixed order: the metrics do not depend on anything but the weights.
    double entropy = 0, sink = 0, prev = 0, self = 0, focus = 0;
    int64_t rows = 0, prev_rows = 0, self_rows = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < Tq; ++i) {
        const float* row = w.row(b, h, i);
        double ent = 0, top = 0;
        bool sees_a_position = false;  // some weight on one of the first `positions` keys
        for (int64_t j = 0; j < Tk; ++j) {
          const double x = row[j];
          if (x > 0) {
            ent -= x * std::log(x);
            sees_a_position = sees_a_position || j < positions;
          }
          top = std::max(top, x);
        }
        // Excluded from every mean: fully masked rows, and rows left only the appended bias_k /
        // zero-attention keys, which would read as focus 1, entropy 0 (mha/analysis.h).
        if (!sees_a_position) continue;
        if (options.query_padding.defined() && options.query_padding.data()[b * Tq + i] != 0) continue;
        ++rows;
        entropy += ent;
        const int64_t first = sink_key[static_cast<size_t>(b)];
        if (first >= 0) sink += row[first];
        focus += top;
        const int64_t own = i + offset;
        if (own >= 0 && own < positions) self += row[own], ++self_rows;
        if (own - 1 >= 0 && own - 1 < positions) prev += row[own - 1], ++prev_rows;
      }
    m.rows = rows;
    const auto mean = [](double total, int64_t count) { return count > 0 ? total / static_cast<double>(count) : 0.0; };
    m.entropy = mean(entropy, rows);
    m.sink = mean(sink, rows);
    m.focus = mean(focus, rows);
    m.prev_token = mean(prev, prev_rows);
    m.self = mean(self, self_rows);
    m.cls = classify(m, options.thresholds);
  }
  return result;
}

}  // namespace mha
