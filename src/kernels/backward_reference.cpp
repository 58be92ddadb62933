// kernels/backward_reference.cpp — the readable oracle for the SDPA backward pass.
//
// Shapes: Q (B, h, T_q, d), K (B, kv, T_k, d), V (B, kv, T_k, d_v), dO (B, h, T_q, d_v);
// dQ like Q, dK like K, dV like V. Workspace (doubles): T_k probabilities, T_k dp, and one
// K/V-head's dK (T_k, d) and dV (T_k, d_v) accumulators, T_k softcap factors, T_k hidden flags
// and h sink gradients.
//
// One K/V head at a time: its dK/dV accumulate in double over every query row of every query head
// of its group (docs/semantics.md, 'Grouped-query attention'), then are rounded once. Each row's
// softmax is recomputed from scratch in double exactly as kernels/reference.cpp forms it, so this
// path needs neither out nor lse and stays independent of the kernel it checks. Steps cite the
// forward lines (reference.cpp) they differentiate.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/attention_backward.h"
#include "kernels/common.h"
#include "kernels/dropout_rng.h"
#include "kernels/entry_checks.h"
#include "kernels/varlen.h"

namespace mha::kernels {

namespace {
/// Forward step 1 for key j of row (b, h, i), K/V head g, in double: t = scale·q·k, s = c·tanh(t/c)
/// with a softcap (then *cap_grad = ds/dt = 1 − tanh²(t/c)), + the additive terms `add`, + ALiBi;
/// rounded to float as the forward's scores are (one past float's range is ±inf there).
double reference_score(const SdpaParams& f, int64_t b, int64_t h, int64_t g, int64_t i, int64_t j, double add,
                       int64_t alibi_off, double* cap_grad) {
  const View4<const float> q = f.q.as<float>(), k = f.k.as<float>();  // float32 only
  double dot = 0.0;
  for (int64_t c = 0; c < f.d(); ++c) dot += static_cast<double>(q(b, h, i, c)) * k(b, g, j, c);
  double t = static_cast<double>(f.scale) * dot;
  if (f.edits.capped()) {
    const double u = std::tanh(t / static_cast<double>(f.edits.softcap));
    t = static_cast<double>(f.edits.softcap) * u;
    *cap_grad = 1.0 - u * u;
  }
  double s = t + add;
  if (f.edits.alibi()) s += static_cast<double>(f.edits.alibi_slopes[h]) * static_cast<double>(j - (i + alibi_off));
  return static_cast<float>(s);
}
}  // namespace

bool row_saw_no_key(const SdpaBackwardParams& p, int64_t b, int64_t h, int64_t i) {
  const SdpaParams& f = p.fwd;
  const float lse = p.lse(b, h, i, 0);
  if (lse == -std::numeric_limits<float>::infinity()) return true;
  if (!f.edits.sinks || lse != f.edits.sinks[h]) return false;
  for (int64_t c = 0; c < f.d_v(); ++c)
    if (p.out(b, h, i, c) != 0.0f) return false;
  // The scores as the reference forms them (score edits included): any that is not −inf was seen.
  const int64_t g = h / f.group(), causal_offset = f.masks.causal.offset_for(f.t_q(), f.t_k());
  const int64_t alibi_off = alibi_offset(f);
  double unused_cap_grad = 0.0;
  for (int64_t j = 0; j < f.t_k(); ++j) {
    if (key_hidden(f, b, h, i, j, causal_offset)) continue;
    // A −inf additive term hides the key whatever the product (a NaN or +inf product would have
    // made the row's lse NaN, which is not the sink's): no product needed, so rows padded with
    // −inf terms cost T_k tests, not T_k·d multiply-adds.
    const double add = additive_terms(f, b, h, i, j);
    if (add == kNegInfDouble) continue;
    if (reference_score(f, b, h, g, i, j, add, alibi_off, &unused_cap_grad) != kNegInfDouble) return false;
  }
  return true;
}

size_t reference_backward_workspace_doubles(const SdpaBackwardParams& p) {
  const SdpaParams& f = p.fwd;
  return static_cast<size_t>(f.t_k() * (4 + f.d() + f.d_v()) + f.heads());
}

void sdpa_backward_reference(const SdpaBackwardParams& p, double* workspace) {
  const SdpaParams& f = p.fwd;
  assert_sdpa_inputs(f);
  MHA_DASSERT(has_data(f.q) && has_data(f.k) && has_data(f.v) && has_data(p.dout));
  MHA_DASSERT(has_data(p.dq) && has_data(p.dk) && has_data(p.dv));
  if (f.varlen.defined()) {  // a packed batch: each sequence on its own (kernels/varlen.h)
    for_each_sequence_backward(p, [&](const SdpaBackwardParams& r) { sdpa_backward_reference(r, workspace); });
    return;
  }
  const View4<const float> q = f.q.as<float>(), k = f.k.as<float>(), v = f.v.as<float>();  // float32 only
  const int64_t B = f.batch(), KV = f.kv_heads(), Tq = f.t_q(), Tk = f.t_k(), D = f.d(), Dv = f.d_v();
  const int64_t group = f.group();
  const int64_t causal_offset = f.masks.causal.offset_for(Tq, Tk);
  const double keep_scale = f.dropout.active() ? 1.0 / (1.0 - static_cast<double>(f.dropout.p)) : 1.0;
  double* prob = workspace;             // (T_k): p_j of the current row, before dropout
  double* dprob = prob + Tk;            // (T_k): dp_j = ∂L/∂p_j
  double* dk_acc = dprob + Tk;          // (T_k, d)
  double* dv_acc = dk_acc + Tk * D;     // (T_k, d_v)
  double* cap_grad = dv_acc + Tk * Dv;  // (T_k): 1 − tanh²(t_j / c) with softcap
  double* hidden = cap_grad + Tk;       // (T_k): 1 where the current row cannot see the key
  double* dsink_acc = hidden + Tk;      // (h): d(sink logit), summed over batches and rows
  const int64_t alibi_off = alibi_offset(f);
  for (int64_t h = 0; h < f.heads(); ++h) dsink_acc[h] = 0.0;

  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < KV; ++g) {
      for (int64_t x = 0; x < Tk * D; ++x) dk_acc[x] = 0.0;
      for (int64_t x = 0; x < Tk * Dv; ++x) dv_acc[x] = 0.0;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i = 0; i < Tq; ++i) {
          // Recompute forward step 1 (scores: scale · q·k + additive terms, hidden keys −inf)
          // and step 3 (softmax with the maximum subtracted), in double.
          double row_max = kNegInfDouble;
          bool row_nan = false;
          for (int64_t j = 0; j < Tk; ++j) {
            prob[j] = kNegInfDouble;
            hidden[j] = key_hidden(f, b, h, i, j, causal_offset) ? 1.0 : 0.0;
            if (hidden[j] != 0.0) continue;
            // Score edits as in the forward; rounded to float (−inf: a key the row does not see,
            // so a row of them saw nothing).
            prob[j] = reference_score(f, b, h, g, i, j, additive_terms(f, b, h, i, j), alibi_off, &cap_grad[j]);
            row_max = std::max(row_max, prob[j]);
            row_nan = row_nan || std::isnan(prob[j]);
          }
          // A visible NaN made the forward row NaN: a NaN maximum makes every visible p_j NaN, so
          // it reaches dQ and the dK/dV rows of the visible keys, as differentiating the forward would.
          if (row_nan) row_max = std::numeric_limits<double>::quiet_NaN();
          // Forward step 2: a row with no visible key gave out = 0, a constant: its gradient is 0.
          if (row_max == kNegInfDouble) {
            for (int64_t c = 0; c < D; ++c) p.dq(b, h, i, c) = 0.0f;
            continue;
          }
          // A sink z joins the denominator: p_j = exp(s_j) / (exp(z) + Σ_k exp(s_k)).
          const double sink = f.edits.sinks ? static_cast<double>(f.edits.sinks[h]) : kNegInfDouble;
          row_max = std::max(row_max, sink);
          double sum = f.edits.sinks ? std::exp(sink - row_max) : 0.0;
          for (int64_t j = 0; j < Tk; ++j)
            if (prob[j] != kNegInfDouble) sum += std::exp(prob[j] - row_max);
          // A probability below e^−87 is exactly 0, as the float32 kernels' exp gives it (and then
          // dS_j = 0, whatever dp_j holds): so a NaN in such a key's V row reaches dK on no path.
          const double log_sum = std::log(sum);
          for (int64_t j = 0; j < Tk; ++j) {
            if (prob[j] == kNegInfDouble) {  // hidden (or a −inf score): 0, also in a NaN row
              prob[j] = 0.0;
              continue;
            }
            const double x = prob[j] - row_max - log_sum;  // log p_j
            prob[j] = x < kMinLogProbability ? 0.0 : std::exp(x);
          }

          // Forward step 4: out_i = Σ_j p̃_j v_j with p̃_j = p_j · keep_ij · keep_scale. So
          //   dv_j += p̃_j · do_i      and      dp_j = keep_ij · keep_scale · (do_i · v_j).
          // Hidden keys are skipped: their V rows are never read, as in the forward. A key the row
          // sees is read even where p̃_j = 0 (dropped, an underflow, a −inf score), as the forward
          // reads it: a NaN in its V row or in d out reaches the gradients as 0 · NaN would.
          double row_dot = 0.0;  // D_i = Σ_j p_j dp_j
          for (int64_t j = 0; j < Tk; ++j) {
            dprob[j] = 0.0;
            if (hidden[j] != 0.0) continue;
            double factor = keep_scale;
            if (f.dropout.active() && !dropout_keep(f.dropout.seed, f.dropout.p, b, h, i, j)) factor = 0.0;
            double dot = 0.0;
            for (int64_t c = 0; c < Dv; ++c) {
              const double d_o = p.dout(b, h, i, c);
              dot += d_o * v(b, g, j, c);
              dv_acc[j * Dv + c] += prob[j] * factor * d_o;
            }
            dprob[j] = factor * dot;
            row_dot += prob[j] * dprob[j];
          }
          // Softmax (step 3): p_j = exp(s_j) / Σ_k exp(s_k)  ⇒  ds_j = p_j (dp_j − Σ_k p_k dp_k).
          // The sink has no value (dp_sink = 0): dz = p_sink (0 − Σ_k p_k dp_k).
          if (f.edits.sinks && p.dsinks) dsink_acc[h] -= std::exp(sink - row_max) / sum * row_dot;
          // Softcap: s = c·tanh(t/c)  ⇒  dt_j = ds_j (1 − tanh²(t_j/c)).
          const auto dt = [&](int64_t j) {
            const double ds = prob[j] * (dprob[j] - row_dot);
            return f.edits.capped() ? ds * cap_grad[j] : ds;
          };
          // Step 1: t_j = scale · q_i·k_j  ⇒  dq_i = scale Σ_j dt_j k_j,  dk_j += scale dt_j q_i,
          // over every key the row sees; where p_j = 0, dt_j is exactly 0 (whatever dp_j holds),
          // so an infinite K row that scored −inf makes dq_i NaN as 0 · inf does in the fused
          // kernel and in PyTorch.
          for (int64_t c = 0; c < D; ++c) {
            double acc = 0.0;
            for (int64_t j = 0; j < Tk; ++j)
              if (hidden[j] == 0.0) acc += (prob[j] == 0.0 ? 0.0 : dt(j)) * k(b, g, j, c);
            p.dq(b, h, i, c) = static_cast<float>(static_cast<double>(f.scale) * acc);
          }
          for (int64_t j = 0; j < Tk; ++j) {
            if (hidden[j] != 0.0) continue;
            const double ds = static_cast<double>(f.scale) * (prob[j] == 0.0 ? 0.0 : dt(j));
            for (int64_t c = 0; c < D; ++c) dk_acc[j * D + c] += ds * q(b, h, i, c);
          }
        }
      }
      for (int64_t j = 0; j < Tk; ++j) {
        for (int64_t c = 0; c < D; ++c) p.dk(b, g, j, c) = static_cast<float>(dk_acc[j * D + c]);
        for (int64_t c = 0; c < Dv; ++c) p.dv(b, g, j, c) = static_cast<float>(dv_acc[j * Dv + c]);
      }
    }
  }
  if (p.dsinks)
    for (int64_t h = 0; h < f.heads(); ++h) p.dsinks[h] = static_cast<float>(dsink_acc[h]);
}

}  // namespace mha::kernels
