// layers/score_edits.cpp — ALiBi's standard slopes and the one check of the score edits (ALiBi,
// softcap, sinks) that every attention entry point shares (layers/sdpa_prepare.h).
#include <cmath>
#include <cstdint>
#include <vector>

#include "layers/sdpa_prepare.h"
#include "mha/error.h"
#include "mha/masks.h"

namespace mha {

namespace {

/// 2^(−8(i+1)/n) for i < n, n a power of two: the geometric sequence starting at 2^(−8/n).
std::vector<double> power_of_two_slopes(int64_t n) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    out[static_cast<size_t>(i)] = std::exp2(-8.0 * static_cast<double>(i + 1) / static_cast<double>(n));
  return out;
}

}  // namespace

std::vector<float> alibi_slopes(int64_t heads) {
  if (heads < 0) fail("alibi_slopes: heads must be ≥ 0, got ", heads);
  if (heads > (int64_t{1} << 24)) fail("alibi_slopes: heads = ", heads, " is out of range");
  if (heads == 0) return {};
  int64_t n = 1;
  while (n * 2 <= heads) n *= 2;  // the largest power of two ≤ heads
  std::vector<double> slopes = power_of_two_slopes(n);
  if (n < heads) {  // the rest: every other slope of the 2n schedule (BLOOM, Press et al.)
    const std::vector<double> twice = power_of_two_slopes(2 * n);
    for (int64_t i = 0; static_cast<int64_t>(slopes.size()) < heads; i += 2)
      slopes.push_back(twice[static_cast<size_t>(i)]);
  }
  return {slopes.begin(), slopes.end()};
}

namespace detail {

kernels::ScoreEdits check_score_edits(const char* fn, int64_t heads, const Alibi& alibi, float softcap,
                                      const AttentionSinks& sinks) {
  kernels::ScoreEdits e;
  if (alibi.enabled()) {
    if (static_cast<int64_t>(alibi.slopes.size()) != heads)
      fail(fn, ": alibi slopes has ", alibi.slopes.size(), " entries, expected one per query head (", heads, ")");
    for (size_t i = 0; i < alibi.slopes.size(); ++i)
      if (!std::isfinite(alibi.slopes[i])) fail(fn, ": alibi slope ", i, " is not finite (", alibi.slopes[i], ")");
    e.alibi_slopes = alibi.slopes.data();
  }
  if (!std::isfinite(softcap) || softcap < 0.0f)
    fail(fn, ": softcap must be a finite c > 0 (or 0 = off), got ", softcap);
  e.softcap = softcap;
  if (sinks.enabled()) {
    if (static_cast<int64_t>(sinks.logits.size()) != heads)
      fail(fn, ": sinks has ", sinks.logits.size(), " entries, expected one per query head (", heads, ")");
    for (size_t i = 0; i < sinks.logits.size(); ++i)
      if (!std::isfinite(sinks.logits[i])) fail(fn, ": sink logit ", i, " is not finite (", sinks.logits[i], ")");
    e.sinks = sinks.logits.data();
  }
  return e;
}

}  // namespace detail
}  // namespace mha
