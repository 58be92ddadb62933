// kernels/reference.cpp — the readable oracle for scaled dot-product attention.
//
// Shapes: Q (B, h, T_q, d), K/V (B, kv, T_k, d | d_v), out (B, h, T_q, d_v), weights
// (B, h, T_q, T_k), lse (B, h, T_q, 1). One query row at a time, in the order docs/semantics.md
// gives ('Scores and the order of operations'): scale, add the additive terms, mask, softmax
// (max subtracted), dropout, weighted sum.
// Dot products and sums accumulate in double so this stays the most accurate path we have.
#include <algorithm>
#include <cmath>

#include "kernels/attention.h"
#include "kernels/common.h"
#include "kernels/dropout_rng.h"
#include "kernels/entry_checks.h"
#include "kernels/varlen.h"

namespace mha::kernels {

size_t reference_workspace_floats(const SdpaParams& p) { return 2 * static_cast<size_t>(p.t_k()); }

namespace {

/// Q/K/V elements of type T (float or bf16), each widened exactly as it is read.
template <class T>
void reference_rows(const SdpaParams& p, View4<const T> q, View4<const T> k, View4<const T> v, float* workspace) {
  const int64_t B = p.batch(), H = p.heads(), Tq = p.t_q(), Tk = p.t_k(), D = p.d(), Dv = p.d_v();
  const int64_t group = p.group();
  const int64_t causal_offset = p.masks.causal.offset_for(Tq, Tk);
  const int64_t alibi_off = alibi_offset(p);
  float* scores = workspace;    // (T_k): one row of scores, then of probabilities
  float* hidden = scores + Tk;  // (T_k): 1 where the row cannot see the key (key_hidden), else 0

  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;  // its K/V head (docs/semantics.md, 'Grouped-query attention')
      for (int64_t i = 0; i < Tq; ++i) {
        const T* q_row = q.row(b, h, i);
        // 1. Scores: scale · q·k + additive terms; hidden keys get −inf and are never read.
        double row_max = kNegInfDouble;
        bool row_nan = false;  // a visible NaN score (from Q, K or an additive term)
        for (int64_t j = 0; j < Tk; ++j) {
          hidden[j] = key_hidden(p, b, h, i, j, causal_offset) ? 1.0f : 0.0f;
          if (hidden[j] != 0.0f) {
            scores[j] = kNegInf;
            continue;
          }
          const T* k_row = k.row(b, g, j);
          double dot = 0.0;
          for (int64_t c = 0; c < D; ++c)
            dot += static_cast<double>(to_f32(q_row[c * q.stride[3]])) * to_f32(k_row[c * k.stride[3]]);
          // Score edits (kernels/score_edits.h): softcap the scaled product, then add the biases.
          double s = static_cast<double>(p.scale) * dot;
          if (p.edits.capped()) s = softcap_score(s, static_cast<double>(p.edits.softcap));
          s += additive_terms(p, b, h, i, j);
          if (p.edits.alibi())
            s += static_cast<double>(p.edits.alibi_slopes[h]) * static_cast<double>(j - (i + alibi_off));
          scores[j] = static_cast<float>(s);
          if (scores[j] > row_max) row_max = scores[j];
          // NaN, or +inf (a +inf max makes every visible exp(s − max) NaN: inf − inf).
          row_nan = row_nan || std::isnan(scores[j]) || scores[j] == -kNegInf;
        }
        float* out_row = p.out.row(b, h, i);
        // A visible NaN or +inf score makes the whole row NaN — out, lse and the weights of every
        // column, hidden ones included — as PyTorch's softmax does (docs/semantics.md, 'NaN').
        if (row_nan) {
          for (int64_t c = 0; c < Dv; ++c) out_row[c * p.out.stride[3]] = kNaN;
          if (p.weights.defined())
            for (int64_t j = 0; j < Tk; ++j) p.weights(b, h, i, j) = kNaN;
          if (p.lse.defined()) p.lse(b, h, i, 0) = kNaN;
          continue;
        }
        // 2. A row with no visible key gives zeros and lse = −inf (docs/semantics.md, 'Fully masked
        // rows'); with a sink, the sink takes all the mass: zeros and lse = the sink logit.
        const double sink = p.edits.sinks ? static_cast<double>(p.edits.sinks[h]) : kNegInfDouble;
        if (row_max == kNegInfDouble) {
          for (int64_t c = 0; c < Dv; ++c) out_row[c * p.out.stride[3]] = 0.0f;
          if (p.weights.defined())
            for (int64_t j = 0; j < Tk; ++j) p.weights(b, h, i, j) = 0.0f;
          if (p.lse.defined()) p.lse(b, h, i, 0) = static_cast<float>(sink);
          continue;
        }
        // 3. Softmax with the maximum subtracted; a sink joins the denominator only.
        const double key_max = row_max;
        row_max = std::max(row_max, sink);
        double sum = p.edits.sinks ? std::exp(sink - row_max) : 0.0;
        for (int64_t j = 0; j < Tk; ++j) {
          if (scores[j] == kNegInf) continue;
          sum += std::exp(static_cast<double>(scores[j]) - row_max);
        }
        const double log_sum = std::log(sum);
        if (p.lse.defined()) p.lse(b, h, i, 0) = static_cast<float>(row_max + log_sum);
        // 4. Probabilities, dropout (kept ones scaled by 1/(1 − p)), and the weighted sum of V.
        const double keep_scale = p.dropout.active() ? 1.0 / (1.0 - static_cast<double>(p.dropout.p)) : 1.0;
        for (int64_t j = 0; j < Tk; ++j) {
          double prob = 0.0;
          // A key scoring more than 87 below the row's best key has probability 0, as the fused
          // kernels' float32 exp(s − m) gives it before dividing by the sum (kMinLogProbability).
          if (scores[j] != kNegInf && static_cast<double>(scores[j]) - key_max >= kMinLogProbability) {
            prob = std::exp(static_cast<double>(scores[j]) - row_max) / sum;
            if (p.dropout.active())
              prob = dropout_keep(p.dropout.seed, p.dropout.p, b, h, i, j) ? prob * keep_scale : 0.0;
          }
          scores[j] = static_cast<float>(prob);
          if (p.weights.defined()) p.weights(b, h, i, j) = scores[j];
        }
        for (int64_t c = 0; c < Dv; ++c) {
          double acc = 0.0;
          for (int64_t j = 0; j < Tk; ++j) {
            // A hidden key's V row is never read. A key the row sees is, even where its
            // probability is 0 (dropped, an underflow, a −inf score): 0 · NaN is NaN, as in the
            // fused kernels and PyTorch (docs/semantics.md, 'NaN').
            if (hidden[j] != 0.0f) continue;
            acc += static_cast<double>(scores[j]) * to_f32(v(b, g, j, c));
          }
          out_row[c * p.out.stride[3]] = static_cast<float>(acc);
        }
      }
    }
  }
}

}  // namespace

void sdpa_reference(const SdpaParams& p, float* workspace) {
  assert_sdpa_params(p);
  MHA_DASSERT(has_data(p.q) && has_data(p.k) && has_data(p.v) && has_data(p.weights));
  MHA_DASSERT(workspace != nullptr || p.t_k() == 0);
  if (p.varlen.defined()) {  // a packed batch: each sequence on its own (kernels/varlen.h)
    for (int64_t s = 0; s < p.varlen.seqs; ++s) sdpa_reference(sequence_params(p, s), workspace);
    return;
  }
  if (p.dtype == DType::BF16)
    reference_rows<bf16>(p, p.q.as<bf16>(), p.k.as<bf16>(), p.v.as<bf16>(), workspace);
  else
    reference_rows<float>(p, p.q.as<float>(), p.k.as<float>(), p.v.as<float>(), workspace);
}

}  // namespace mha::kernels
