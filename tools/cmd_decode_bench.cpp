// `mha bench-decode`: time per decoded token against context length, and the K/V bytes read per
// token divided by that time, next to this machine's memory bandwidth (a read-only stream —
// fraction_of_read_bw, the denominator decode is bound by — and a STREAM triad) and its float32
// FMA peak on the dispatched SIMD target (fraction_of_peak), all measured in the same run; float32, bf16 and
// int8 caches; optionally prefill through the incremental path vs the full forward.
//
// Decoding one token reads every cached K and V row once: 2·B·kv·context·d elements (int8: and a
// 4-byte scale per row), the bytes counted in kv_bytes_per_token. Both the
// triad and the decode loop stream through a working set larger than the last-level cache
// (--footprint-mib, rotating over several caches), so both measure DRAM, not cache.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "decode_bench.h"
#include "mha/kv_cache.h"
#include "mha/module.h"
#include "registry.h"

namespace mha::cli {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

struct DecodeResult {
  std::string dtype;
  int64_t context = 0;
  double ms_best = 0, ms_median = 0, kv_bytes = 0, gbs = 0, gflops = 0;
  Tensor out;                        // the last step's output (B, h, 1, d)
  double max_err = 0, mean_err = 0;  // |out − the f32 cache's out| at this context
};

/// Fills max_err / mean_err of every row from the f32 row of the same context (same K, V and q).
void compare_to_f32(std::vector<DecodeResult>& results) {
  for (DecodeResult& r : results)
    for (const DecodeResult& f : results)
      if (f.dtype == "f32" && f.context == r.context && &f != &r) {
        double sum = 0;
        for (int64_t i = 0; i < r.out.numel(); ++i) {
          const double e = std::fabs(static_cast<double>(r.out.data()[i]) - f.out.data()[i]);
          r.max_err = std::max(r.max_err, e);
          sum += e;
        }
        r.mean_err = sum / static_cast<double>(std::max<int64_t>(1, r.out.numel()));
      }
}

constexpr const char* kTransposedSuffix = "-transposed";
constexpr int64_t kMaxCaches = 4096;           // caches one measurement rotates through, at most
constexpr int64_t kMaxMib = int64_t{1} << 20;  // --footprint-mib and --bw-mib: 1 TiB, far past any cache

/// Whether a --dtype name is one bench-decode takes: f32, bf16, int8, int8-channel (int8 with
/// per-channel key scales, KIVI), or f32, bf16 or int8 with -transposed (keys across SIMD lanes).
bool known_kind(const std::string& kind) {
  for (const char* k : {"f32", "bf16", "int8", "int8-channel", "f32-transposed", "bf16-transposed", "int8-transposed"})
    if (kind == k) return true;
  return false;
}

/// A --dtype name (known_kind) at one context length.
DecodeResult time_decode(const DecodeBenchArgs& a, const std::string& kind, int64_t context) {
  const int64_t B = a.batch, KV = a.kv_heads, d = a.head_dim;
  const bool transposed = kind.ends_with(kTransposedSuffix);
  const std::string base = transposed ? kind.substr(0, kind.size() - std::string(kTransposedSuffix).size()) : kind;
  const CacheDtype dtype = base == "bf16" ? CacheDtype::BF16 : base == "f32" ? CacheDtype::F32 : CacheDtype::I8;
  KvCacheConfig cc;
  cc.batch = B, cc.kv_heads = KV, cc.head_dim = d, cc.capacity = context, cc.dtype = dtype;
  if (base == "int8-channel") cc.int8_keys = Int8KeyScales::PerChannel, cc.key_group = a.key_group;
  if (transposed) cc.key_layout = KeyLayout::Transposed;
  // Bytes of one K or V row as stored, and so as read: the elements, plus the scale for int8 (per
  // channel: a key group's d scales shared by its key_group rows).
  const double row_bytes = dtype == CacheDtype::BF16 ? 2.0 * static_cast<double>(d)
                           : dtype == CacheDtype::I8 ? static_cast<double>(d) + 4.0
                                                     : 4.0 * static_cast<double>(d);
  const double k_row_bytes =
      cc.channel_keys() ? static_cast<double>(d) * (1.0 + 4.0 / static_cast<double>(std::min(a.key_group, context)))
                        : row_bytes;
  const double kv_bytes = static_cast<double>(B * KV * context) * (row_bytes + k_row_bytes);
  // Enough caches to stream footprint_mib, but at most kMaxCaches: tiny shapes would otherwise ask
  // for millions (1 KiB of K/V against 1 GiB: 1,048,576 caches and as many timed steps).
  const int64_t n_caches = std::clamp<int64_t>(
      static_cast<int64_t>(static_cast<double>(a.footprint_mib) * 1048576.0 / kv_bytes + 0.999), 1, kMaxCaches);
  std::vector<KvCache> caches;
  {
    const Tensor k = bench::random_tensor({B, KV, context, d}, 1), v = bench::random_tensor({B, KV, context, d}, 2);
    for (int64_t i = 0; i < n_caches; ++i) {
      caches.emplace_back(cc);
      caches.back().append(k.view4(), v.view4());
    }
  }
  const Tensor q = bench::random_tensor({B, a.heads, 1, d}, 3);
  Tensor out({B, a.heads, 1, d});
  CacheAttentionOptions o;
  o.splits = a.splits;
  o.threads = a.threads;
  int64_t next = 0;
  const auto ms = bench::time_runs(
      [&] {
        attend_cache(q.view4(), caches[static_cast<size_t>(next)], {}, o, out.view4());
        next = (next + 1) % n_caches;
      },
      std::max<int>(a.repeat, static_cast<int>(n_caches)));
  DecodeResult r;
  r.dtype = kind;
  r.context = context;
  r.ms_best = *std::min_element(ms.begin(), ms.end());
  r.ms_median = bench::median(ms);
  r.kv_bytes = kv_bytes;
  r.out = out;
  r.gbs = kv_bytes / (r.ms_best * 1e-3) / 1e9;
  // q·k and p·v for every cached position: 4·B·h·context·d FLOPs.
  r.gflops = 4.0 * static_cast<double>(B * a.heads * context * d) / (r.ms_best * 1e-3) / 1e9;
  return r;
}

struct PrefillResult {
  double full_ms = 0, incremental_ms = 0;
};

PrefillResult time_prefill(const DecodeBenchArgs& a) {
  MhaConfig c;
  c.embed_dim = a.heads * a.head_dim;
  c.num_heads = a.heads;
  c.num_kv_heads = a.kv_heads;
  c.layout = Layout::BatchFirst;
  const MultiheadAttention m(c, 1);
  const Tensor x = bench::random_tensor({a.batch, a.prefill, c.embed_dim}, 4);
  MhaForwardOptions fo;
  fo.causal = Causal::top_left();
  fo.threads = a.threads;
  KvCacheConfig cc;
  cc.batch = a.batch, cc.kv_heads = a.kv_heads, cc.head_dim = a.head_dim, cc.capacity = a.prefill;
  KvCache cache(cc);
  IncrementalOptions io;
  io.threads = a.threads;
  PrefillResult r;
  // Interleaved, so drift in the machine's load hits both paths alike.
  std::vector<double> full, inc;
  for (int i = 0; i <= a.prefill_repeat; ++i) {
    auto t0 = clock_type::now();
    const Tensor y1 = m.forward(x, x, x, fo).output;
    const double f = seconds_since(t0) * 1e3;
    cache.reset();
    t0 = clock_type::now();
    const Tensor y2 = m.forward_incremental(x, x, x, cache, io).output;
    const double g = seconds_since(t0) * 1e3;
    if (i > 0) full.push_back(f), inc.push_back(g);  // the first round warms up
  }
  r.full_ms = bench::median(full);
  r.incremental_ms = bench::median(inc);
  return r;
}

}  // namespace

void run_decode_bench(const DecodeBenchArgs& a) {
  if (a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads != 0 || a.head_dim <= 0 || a.batch <= 0)
    fail("bench-decode: need heads a multiple of kv-heads, head-dim ≥ 1 and batch ≥ 1; got heads ", a.heads,
         ", kv-heads ", a.kv_heads, ", head-dim ", a.head_dim, ", batch ", a.batch);
  if (a.repeat < 1 || a.threads < 1 || a.footprint_mib < 0 || a.prefill < 0 || a.bw_mib < 1 || a.prefill_repeat < 1 ||
      a.splits < 0)
    fail(
        "bench-decode: --repeat, --threads, --bw-mib and --prefill-repeat must be ≥ 1, --footprint-mib, --prefill "
        "and --splits ≥ 0; got ",
        a.repeat, ", ", a.threads, ", ", a.bw_mib, ", ", a.prefill_repeat, ", ", a.footprint_mib, ", ", a.prefill, ", ",
        a.splits);
  if (a.footprint_mib > kMaxMib || a.bw_mib > kMaxMib)
    fail("bench-decode: --footprint-mib and --bw-mib must be ≤ ", kMaxMib, " (1 TiB), got ", a.footprint_mib, " and ",
         a.bw_mib);
  for (int64_t ctx : a.contexts)
    if (ctx < 1) fail("bench-decode: context lengths must be ≥ 1, got ", ctx);
  for (const std::string& t : a.dtypes)
    if (!known_kind(t))
      fail(
          "bench-decode: --dtype takes f32, bf16, int8, int8-channel, f32-transposed, bf16-transposed and/or "
          "int8-transposed, got ",
          t);
  if (a.key_group < 1) fail("bench-decode: --key-group must be ≥ 1, got ", a.key_group);
  const int threads = bench::apply_threads(a.threads);

  // The triad streams max(footprint, 3 · 256 MiB) so it, too, comes from DRAM.
  const int64_t triad_n = std::max<int64_t>(a.footprint_mib * 1048576 / 24, int64_t{1} << 25);
  const double triad = internal::triad_gbs(triad_n, threads, 10);
  const double read_bw =
      internal::read_bandwidth_gbs(std::max<int64_t>(a.footprint_mib, a.bw_mib) * 1048576, threads, 10);
  const double peak = internal::f32_fma_peak_gflops(threads);
  const std::string target = internal::simd_target_name();

  std::vector<DecodeResult> results;
  for (const std::string& t : a.dtypes)
    for (int64_t ctx : a.contexts) results.push_back(time_decode(a, t, ctx));
  compare_to_f32(results);
  PrefillResult pre;
  if (a.prefill > 0) pre = time_prefill(a);

  // f32 time over `dtype`'s time at this context (0 when either was not run).
  auto speedup = [&](int64_t ctx, const std::string& dtype) {
    double f = 0, h = 0;
    for (const auto& r : results)
      if (r.context == ctx) {
        if (r.dtype == "f32") f = r.ms_best;
        if (r.dtype == dtype) h = r.ms_best;
      }
    return f > 0 && h > 0 ? f / h : 0.0;
  };
  if (a.json) {
    nlohmann::json j;
    j["config"] = {
        {"heads", a.heads},   {"kv_heads", a.kv_heads}, {"head_dim", a.head_dim}, {"batch", a.batch},
        {"threads", threads}, {"splits", a.splits},     {"repeat", a.repeat},     {"footprint_mib", a.footprint_mib}};
    j["triad_gbs"] = triad;
    j["read_bw_gbs"] = read_bw;
    j["peak_f32_gflops"] = peak;
    j["simd_target"] = target;
    for (const auto& r : results)
      j["decode"].push_back({{"dtype", r.dtype},
                             {"context", r.context},
                             {"ms_per_token_best", r.ms_best},
                             {"ms_per_token_median", r.ms_median},
                             {"kv_bytes_per_token", r.kv_bytes},
                             {"gbs", r.gbs},
                             {"fraction_of_triad", r.gbs / triad},
                             {"fraction_of_read_bw", r.gbs / read_bw},
                             {"gflops", r.gflops},
                             {"fraction_of_peak", r.gflops / peak},
                             {"bf16_speedup", speedup(r.context, "bf16")},
                             {"speedup_vs_f32", speedup(r.context, r.dtype)},
                             {"max_abs_error_vs_f32", r.max_err},
                             {"mean_abs_error_vs_f32", r.mean_err}});
    if (a.prefill > 0)
      j["prefill"] = {{"tokens", a.prefill},
                      {"full_forward_ms", pre.full_ms},
                      {"incremental_ms", pre.incremental_ms},
                      {"ratio", pre.incremental_ms / pre.full_ms}};
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("decode attention: h=%lld, kv_heads=%lld, d=%lld, batch %lld, %d threads, splits %s\n",
              static_cast<long long>(a.heads), static_cast<long long>(a.kv_heads), static_cast<long long>(a.head_dim),
              static_cast<long long>(a.batch), threads, a.splits > 0 ? std::to_string(a.splits).c_str() : "auto");
  std::printf("same run: read-only stream %.1f GB/s, STREAM triad %.1f GB/s, float32 FMA peak %.1f GFLOP/s (%s)\n\n",
              read_bw, triad, peak, target.c_str());
  std::printf("  %-16s %8s %12s %12s %12s %9s %9s %9s %9s\n", "cache", "context", "ms/token", "K/V MiB", "GB/s",
              "of read", "of triad", "of peak", "vs f32 ×");
  for (const auto& r : results) {
    char ratio[32] = "";
    const double x = speedup(r.context, r.dtype);
    if (r.dtype != "f32" && x > 0) std::snprintf(ratio, sizeof ratio, "%.2f", x);
    std::printf("  %-16s %8lld %12.3f %12.1f %12.1f %8.0f%% %8.0f%% %8.1f%% %9s\n", r.dtype.c_str(),
                static_cast<long long>(r.context), r.ms_best, r.kv_bytes / 1048576.0, r.gbs, 100.0 * r.gbs / read_bw,
                100.0 * r.gbs / triad, 100.0 * r.gflops / peak, ratio);
  }
  std::printf("\n(ms/token: best of %d; the caches rotate through %lld MiB so K/V come from memory)\n",
              std::max(a.repeat, 1), static_cast<long long>(a.footprint_mib));
  for (const auto& r : results)
    if (r.dtype != "f32" && r.max_err > 0)
      std::printf(
          "%s cache, context %lld: output vs the f32 cache's (K, V, q uniform in [-1, 1)): max |error| %.2g, "
          "mean %.2g\n",
          r.dtype.c_str(), static_cast<long long>(r.context), r.max_err, r.mean_err);
  if (a.prefill > 0)
    std::printf("\nprefill %lld tokens (E=%lld): full forward %.1f ms, incremental path %.1f ms (%.3f×)\n",
                static_cast<long long>(a.prefill), static_cast<long long>(a.heads * a.head_dim), pre.full_ms,
                pre.incremental_ms, pre.incremental_ms / pre.full_ms);
}

static void add_decode_bench_command(CLI::App& app) {
  auto a = std::make_shared<DecodeBenchArgs>();
  CLI::App* cmd = app.add_subcommand(
      "bench-decode",
      "Time per decoded token vs context length, K/V GB/s next to the read bandwidth and a STREAM triad, "
      "GFLOP/s next to the FMA peak, all measured in the same run (f32, bf16 and int8 caches).");
  cmd->add_option("--heads,-H", a->heads, "query heads h")->capture_default_str();
  cmd->add_option("--kv-heads", a->kv_heads, "key/value heads")->capture_default_str();
  cmd->add_option("--head-dim,-d", a->head_dim, "head dim d")->capture_default_str();
  cmd->add_option("--batch,-B", a->batch, "sequences decoded together")->capture_default_str();
  cmd->add_option("--contexts", a->contexts, "context lengths to time")->delimiter(',')->capture_default_str();
  cmd->add_option("--dtype", a->dtypes,
                  "cache dtypes: f32, bf16, int8, int8-channel (int8 with per-channel key scales, KIVI); f32, bf16 "
                  "or int8 with -transposed: keys across SIMD lanes (KeyLayout::Transposed)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--key-group", a->key_group, "int8-channel: positions per key group")->capture_default_str();
  cmd->add_option("--threads,-t", a->threads, "threads")->capture_default_str();
  cmd->add_option("--splits", a->splits, "split-K count (0 = auto, from the shapes)")->capture_default_str();
  cmd->add_option("--repeat", a->repeat, "timed decode steps per point (best is reported)")->capture_default_str();
  cmd->add_option("--footprint-mib", a->footprint_mib,
                  "MiB of K/V streamed per measurement, rotating over copies of the cache (beyond the LLC; at most "
                  "4096 copies)")
      ->capture_default_str();
  cmd->add_option("--bw-mib", a->bw_mib, "least MiB streamed by the read-bandwidth measurement")->capture_default_str();
  cmd->add_option("--prefill", a->prefill, "also time a prefill of this many tokens: incremental vs full forward")
      ->capture_default_str();
  cmd->add_option("--prefill-repeat", a->prefill_repeat, "prefill rounds (median)")->capture_default_str();
  cmd->add_flag("--json", a->json, "one JSON object on stdout");
  cmd->callback([a] { run_decode_bench(*a); });
}

static const CommandRegistrar registered{55, add_decode_bench_command};

}  // namespace mha::cli
