// `mha bench`: times the module forward (or the attention core with --core) on random inputs and
// reports median time, GFLOP/s, peak RSS and, measured in the same run, the fraction of this
// machine's FMA peak on the dispatched SIMD target (fraction_of_peak), of its read-only memory
// bandwidth for the bytes the call must touch at least once (fraction_of_read_bw), and of its sgemm
// throughput (a secondary reference). The measurement itself lives in bench_util.h, shared with
// bench/bench_attention.cpp.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "bench_util.h"
#include "decode_bench.h"
#include "mha/random.h"
#include "mha/sdpa.h"
#include "registry.h"
#ifdef MHA_HAVE_DIST
#include "dist/bench_parallel.h"
#endif

namespace mha::cli {

namespace {

struct BenchArgs {
  bench::BenchConfig config;
  std::string dtype = "f32";
  std::string need_weights = "none";
  int repeat = 5;
  int64_t sgemm_size = 1536;
  int64_t bw_mib = 256;
  bool core = false, json = false, backward = false, decode = false, varlen = false;
  std::string parallel;  ///< --parallel ring|ulysses|heads|pingpong (under mpirun)
  int64_t varlen_seqs = 64, varlen_min = 16;
  uint64_t varlen_seed = 1;
  int64_t footprint_mib = 1024;    ///< --decode: MiB of K/V streamed per measurement
  std::vector<std::string> given;  ///< the options given on the command line (their long names)
  bool has(const std::string& name) const { return std::find(given.begin(), given.end(), name) != given.end(); }
};

/// Fails naming the options in `names` that were given though they do not apply `when` (e.g. "with
/// --decode"): silently ignoring them would time something other than what was asked for.
void refuse_unused(const BenchArgs& a, const char* when, std::initializer_list<const char*> names) {
  std::string unused;
  int count = 0;
  for (const char* n : names)
    if (a.has(n)) unused += (count++ ? ", " : "") + std::string(n);
  if (count > 0) fail("bench: ", unused, count > 1 ? " do" : " does", " not apply ", when);
}

/// A required size option: given and ≥ 1 (0 is also what an absent one holds).
void require_size(const BenchArgs& a, const char* name, int64_t value) {
  if (!a.has(name)) fail("bench: ", name, " is required");
  if (value < 1) fail("bench: ", name, " must be ≥ 1, got ", value);
}

const char* yes_no(bool b) { return b ? "yes" : "no"; }

/// `--decode`: one new token per sequence against a cache of --seq positions (the decode benchmark).
void run_decode(const BenchArgs& a) {
  const bench::BenchConfig& c = a.config;
  if (a.core || a.backward) fail("bench: --decode cannot be combined with --core or --backward");
  refuse_unused(a, "with --decode",
                {"--kv-seq", "--causal", "--alibi", "--softcap", "--sinks", "--need-weights", "--sgemm-size"});
  bench::validate(c);
  DecodeBenchArgs d;
  d.heads = c.heads;
  d.kv_heads = c.kv();
  d.head_dim = c.head_dim();
  d.batch = c.batch;
  d.contexts = {c.seq};
  d.dtypes = {a.dtype};
  d.threads = c.threads > 0 ? c.threads : num_threads();
  d.repeat = a.repeat;
  d.json = a.json;
  d.bw_mib = a.bw_mib;
  d.footprint_mib = a.footprint_mib;
  run_decode_bench(d);
}

/// Milliseconds of each of `repeat` runs of fn (no warm-up: the buffers are already touched).
std::vector<double> time_each(const std::function<void()>& fn, int repeat, const char* what) {
  std::vector<double> ms;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    std::fprintf(stderr, "bench: %s run %d/%d: %.1f ms\n", what, i + 1, repeat, ms.back());
  }
  return ms;
}

/// Each thread's busy time in the fused kernel per run, and how even it is (min / max).
struct ThreadBusy {
  std::vector<double> ms;
  double balance = 1.0;
  double mean() const {
    return ms.empty() ? 0.0 : std::accumulate(ms.begin(), ms.end(), 0.0) / static_cast<double>(ms.size());
  }
};

ThreadBusy thread_busy(const SdpaThreadStats& s) {
  ThreadBusy b;
  for (double ms : s.busy_ms) b.ms.push_back(ms / static_cast<double>(std::max<int64_t>(1, s.calls)));
  const auto [lo, hi] = std::minmax_element(b.ms.begin(), b.ms.end());
  if (!b.ms.empty() && *hi > 0) b.balance = *lo / *hi;
  return b;
}

/// `--varlen`: attention core (f32, fused) on --varlen-seqs sequences with lengths drawn uniformly
/// from [--varlen-min, --seq] (fixed seed), packed (sdpa_varlen, no padding) against the same batch
/// padded to --seq (sdpa on (B, h, T, d) with the padding as a key-padding mask; padded query rows
/// are computed and thrown away, as a padded batch does). GFLOP/s count the useful work only.
void run_varlen(const BenchArgs& a) {
  bench::BenchConfig c = a.config;
  if (a.core || a.backward || a.decode || a.dtype != "f32")
    fail("bench: --varlen times the f32 attention core alone; drop --core, --backward, --decode and --dtype");
  bench::validate(c);
  if (a.repeat <= 0) fail("bench: --repeat must be ≥ 1, got ", a.repeat);
  if (a.varlen_seqs <= 0 || a.varlen_min <= 0 || a.varlen_min > c.seq)
    fail("bench: --varlen-seqs must be ≥ 1 and --varlen-min in [1, --seq]; got ", a.varlen_seqs, " and ", a.varlen_min);
  const int threads = bench::apply_threads(c.threads);
  const int64_t B = a.varlen_seqs, T = c.seq, H = c.heads, KV = c.kv(), D = c.head_dim();
  SplitMix64 rng(a.varlen_seed);
  std::vector<int64_t> lens(static_cast<size_t>(B)), cu{0};
  double useful = 0;  // 4·T_q·T_k·d per head (halved when causal), the module's counting
  for (int64_t& n : lens) {
    n = a.varlen_min + static_cast<int64_t>(rng.uniform() * static_cast<double>(T - a.varlen_min + 1));
    cu.push_back(cu.back() + n);
    useful += 4.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(D * H) * (c.causal ? 0.5 : 1);
  }
  const int64_t total = cu.back();
  std::fprintf(stderr,
               "bench: varlen, %lld sequences of %lld…%lld tokens (%lld in all, padded %lld), h=%lld kv=%lld "
               "d=%lld causal=%s threads=%d, %d run(s) each\n",
               static_cast<long long>(B), static_cast<long long>(a.varlen_min), static_cast<long long>(T),
               static_cast<long long>(total), static_cast<long long>(B * T), static_cast<long long>(H),
               static_cast<long long>(KV), static_cast<long long>(D), yes_no(c.causal), threads, a.repeat);
  SdpaOptions opt;
  opt.masks.causal = c.causal ? Causal::top_left() : Causal::none();
  opt.backend = Backend::Fused;
  opt.threads = threads;
  const auto fill = [&](Tensor& t) {
    for (float& x : t.values()) x = static_cast<float>(2.0 * rng.uniform() - 1.0);
  };
  double packed_ms = 0, padded_ms = 0;
  {
    Tensor q({total, H, D}), k({total, KV, D}), v({total, KV, D}), out({total, H, D});
    fill(q), fill(k), fill(v);
    VarlenBatch seqs;
    seqs.cu_seqlens_q = cu;
    seqs.cu_seqlens_k = cu;
    const auto run = [&] {
      sdpa_varlen(packed_view<const float>(q.data(), total, H, D), packed_view<const float>(k.data(), total, KV, D),
                  packed_view<const float>(v.data(), total, KV, D), seqs, opt,
                  {packed_view(out.data(), total, H, D), {}, {}});
    };
    packed_ms = bench::median(time_each(run, a.repeat, "packed"));
  }
  {
    Tensor q({B, H, T, D}), k({B, KV, T, D}), v({B, KV, T, D}), out({B, H, T, D});
    fill(q), fill(k), fill(v);
    BoolTensor pad({B, T}, 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = lens[static_cast<size_t>(b)]; t < T; ++t) pad.at({b, t}) = 1;
    SdpaOptions popt = opt;
    popt.masks.key_padding.view = {pad.data(), {B, 1, 1, T}, {T, 0, 0, 1}};
    const auto run = [&] { sdpa(q.view4(), k.view4(), v.view4(), popt, {out.view4(), {}, {}}); };
    padded_ms = bench::median(time_each(run, a.repeat, "padded"));
  }
  const double packed_gf = useful / (packed_ms * 1e6), padded_gf = useful / (padded_ms * 1e6);
  // What the padded batch computes: every query row against every key block (padded keys are
  // skipped when packed into a block, but their blocks are still walked), B·T² per head.
  const double padded_work = 4.0 * static_cast<double>(B) * static_cast<double>(T) * static_cast<double>(T) *
                             static_cast<double>(D * H) * (c.causal ? 0.5 : 1);
  if (a.json) {
    nlohmann::json j;
    j["target"] = "varlen";
    j["sequences"] = B, j["min_len"] = a.varlen_min, j["max_len"] = T, j["total_tokens"] = total;
    j["heads"] = H, j["kv_heads"] = KV, j["head_dim"] = D, j["causal"] = c.causal, j["threads"] = threads;
    j["repeat"] = a.repeat, j["seed"] = a.varlen_seed;
    j["packed_ms"] = packed_ms, j["padded_ms"] = padded_ms, j["useful_flops"] = useful;
    j["packed_gflops"] = packed_gf, j["padded_gflops"] = padded_gf, j["speedup"] = padded_ms / packed_ms;
    j["padded_work_ratio"] = padded_work / useful;
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf(
      "varlen attention core: %lld sequences, lengths %lld…%lld (seed %llu), %lld tokens (padded: %lld), "
      "h=%lld kv=%lld d=%lld causal=%s threads=%d\n",
      static_cast<long long>(B), static_cast<long long>(a.varlen_min), static_cast<long long>(T),
      static_cast<unsigned long long>(a.varlen_seed), static_cast<long long>(total), static_cast<long long>(B * T),
      static_cast<long long>(H), static_cast<long long>(KV), static_cast<long long>(D), yes_no(c.causal), threads);
  std::printf("  packed (sdpa_varlen)    %.1f ms, %.1f GFLOP/s of useful work\n", packed_ms, packed_gf);
  std::printf("  padded to %lld (sdpa)  %.1f ms, %.1f GFLOP/s of useful work\n", static_cast<long long>(T), padded_ms,
              padded_gf);
  std::printf("  packed / padded         %.2fx faster (the padded batch holds %.2fx the useful work)\n",
              padded_ms / packed_ms, padded_work / useful);
}

void run_bench(BenchArgs a) {
  bench::BenchConfig& c = a.config;
  if (a.dtype != "f32" && a.dtype != "bf16") fail("bench: --dtype must be f32 or bf16, got '", a.dtype, "'");
  if (a.parallel != "pingpong") {
    require_size(a, "--seq", c.seq);
    require_size(a, "--embed-dim", c.embed_dim);
    require_size(a, "--heads", c.heads);
  }
  if (a.has("--kv-seq") && c.kv_seq < 1) fail("bench: --kv-seq must be ≥ 1, got ", c.kv_seq);
  if (a.bw_mib > (int64_t{1} << 20) || a.footprint_mib > (int64_t{1} << 20))
    fail("bench: --bw-mib and --footprint-mib must be ≤ 1048576 (1 TiB), got ", a.bw_mib, " and ", a.footprint_mib);
  if (!a.varlen) refuse_unused(a, "without --varlen", {"--varlen-seqs", "--varlen-min", "--varlen-seed"});
  if (!a.decode) refuse_unused(a, "without --decode", {"--footprint-mib"});
  // (--batch too: --varlen-seqs says how many sequences there are)
  if (a.varlen)
    refuse_unused(a, "with --varlen", {"--batch", "--kv-seq", "--alibi", "--softcap", "--sinks", "--need-weights"});
  // Before the --varlen and --decode runs: they returned first, so `--parallel ring --decode` timed
  // one process's decoding on every rank and reported it as if --parallel had been honoured.
  if (!a.parallel.empty() && (a.core || a.decode || a.varlen || a.dtype != "f32"))
    fail("bench: --parallel cannot be combined with --core, --decode, --varlen or --dtype bf16");
  if (a.varlen) return run_varlen(a);
  if (a.decode) return run_decode(a);
  if (!a.parallel.empty()) {
#ifdef MHA_HAVE_DIST
    ParallelBenchArgs p;
    p.config = c;
    p.scheme = a.parallel;
    p.backward = a.backward;
    p.json = a.json;
    p.repeat = a.repeat;
    return run_parallel_bench(p);
#else
    fail("bench: --parallel needs mha built with MPI (cmake -DMHA_WITH_MPI=ON; Debian's libopenmpi-dev)");
#endif
  }
  c.pass = a.backward ? bench::Pass::Backward : bench::Pass::Forward;
  c.dtype = a.dtype == "bf16" ? bench::DType::BF16 : bench::DType::F32;
  c.target = a.core ? bench::Target::Core : bench::Target::Module;
  if (a.need_weights == "per-head")
    c.need_weights = NeedWeights::PerHead;
  else if (a.need_weights == "averaged")
    c.need_weights = NeedWeights::Averaged;
  else if (a.need_weights != "none")
    fail("bench: --need-weights must be none, per-head or averaged, got '", a.need_weights, "'");
  if (c.need_weights != NeedWeights::None && a.backward)
    fail("bench: --need-weights is for the forward (module or --core), not with --backward");
  bench::validate(c);
  if (a.repeat <= 0) fail("bench: --repeat must be ≥ 1, got ", a.repeat);
  if (a.sgemm_size <= 0) fail("bench: --sgemm-size must be ≥ 1, got ", a.sgemm_size);
  if (a.bw_mib <= 0) fail("bench: --bw-mib must be ≥ 1, got ", a.bw_mib);
  const int threads = bench::apply_threads(c.threads);
  c.threads = threads;

  // Build the case first: it rejects what it cannot run (bf16 without the overload) in one line.
  std::unique_ptr<bench::CoreCase> core;
  std::unique_ptr<bench::ModuleCase> module;
  std::unique_ptr<bench::CoreBackwardCase> core_backward;
  std::unique_ptr<bench::ModuleTrainCase> module_train;
  std::string dispatch;
  std::function<void()> run;
  if (a.core && a.backward) {
    core_backward = std::make_unique<bench::CoreBackwardCase>(c);
    dispatch = core_backward->dispatch();
    run = [&] { core_backward->run(); };
  } else if (a.core) {
    core = std::make_unique<bench::CoreCase>(c);
    dispatch = core->dispatch();
    run = [&, calls = 0]() mutable {
      if (calls++ == 1) core->reset_stats();  // the busy times count the timed runs, not the warm-up
      core->run();
    };
  } else if (a.backward) {
    module_train = std::make_unique<bench::ModuleTrainCase>(c);
    dispatch = bench::ModuleCase(c).dispatch();
    run = [&] { module_train->run(); };
  } else {
    module = std::make_unique<bench::ModuleCase>(c);
    dispatch = module->dispatch();
    run = [&] { module->run(); };
  }
  const std::string what =
      std::string(a.core       ? (a.backward ? "attention core backward (sdpa_backward)" : "attention core (sdpa)")
                  : a.backward ? "module forward + backward"
                               : "module forward") +
      (c.need_weights == NeedWeights::PerHead    ? " with per-head weights"
       : c.need_weights == NeedWeights::Averaged ? " with averaged weights"
                                                 : "");
  std::fprintf(stderr,
               "bench: %s, B=%lld T=%lld S=%lld E=%lld h=%lld kv=%lld d=%lld causal=%s%s dtype=%s threads=%d, "
               "warm-up + %d runs\n",
               what.c_str(), static_cast<long long>(c.batch), static_cast<long long>(c.seq),
               static_cast<long long>(c.t_k()), static_cast<long long>(c.embed_dim), static_cast<long long>(c.heads),
               static_cast<long long>(c.kv()), static_cast<long long>(c.head_dim()), yes_no(c.causal),
               bench::edits_str(c).c_str(), a.dtype.c_str(), threads, a.repeat);
  std::fprintf(stderr, "bench: sdpa dispatch: %s\n", dispatch.c_str());
  // The FMA peak before and after the timed runs: a neighbour's load that changes the machine
  // in between shows as a drop (peak_ratio_after_before well below 1: discard the run).
  const double peak_before = internal::f32_fma_peak_gflops(threads);
  const auto progress = [&](int i, double ms) { std::fprintf(stderr, "bench: run %d/%d: %.3f ms\n", i, a.repeat, ms); };
  const std::vector<double> ms = bench::time_runs(run, a.repeat, progress);
  // Read the peak RSS before the machine measurements and the sgemm reference allocate their own.
  const double peak_mb = bench::peak_rss_mib();
  const ThreadBusy busy = core ? thread_busy(core->stats()) : ThreadBusy{};
  core.reset();
  module.reset();
  core_backward.reset();
  module_train.reset();

  std::fprintf(stderr, "bench: FMA peak, read bandwidth and triad (%lld MiB) on %d threads\n",
               static_cast<long long>(a.bw_mib), threads);
  const bench::MachinePeak machine = bench::measure_machine(threads, a.bw_mib * 1048576);
  std::fprintf(stderr, "bench: sgemm reference %lld^3 on %d threads\n", static_cast<long long>(a.sgemm_size), threads);
  const double sgemm = bench::sgemm_gflops(a.sgemm_size, 5);
  const double med = bench::median(ms);
  const double flops = bench::total_flops(c);
  const double gflops = flops / (med * 1e6);
  const double expected_mb = bench::expected_tensor_bytes(c) / (1024.0 * 1024.0);
  // The denominator: the peak of what the bf16 core multiplies on — AMX tiles, or bf16 pairs with
  // vdpbf16ps — else the float32 FMA peak; the better of the two float32 measurements.
  const std::string products = c.dtype == bench::DType::BF16 ? internal::bf16_products(c.head_dim()) : "float32";
  const bool bf16_amx = products == "amx" && machine.amx_bf16_gflops > 0;
  const bool bf16_dot = !bf16_amx && products == "vdpbf16ps" && machine.bf16_dot_gflops > 0;
  const double f32_peak = std::max(peak_before, machine.f32_gflops);
  const double peak = bf16_amx ? machine.amx_bf16_gflops : bf16_dot ? machine.bf16_dot_gflops : f32_peak;
  const char* peak_kind = bf16_amx ? "bf16_amx" : bf16_dot ? "bf16_dot" : "f32_fma";
  const double peak_ratio = peak_before > 0 ? machine.f32_gflops / peak_before : 1.0;
  // Bytes the call must touch at least once (inputs, outputs, weights, intermediates): a lower
  // bound on its memory traffic, so the fraction of the read bandwidth is a lower bound too.
  const double min_gbs = bench::expected_tensor_bytes(c) / (med * 1e-3) / 1e9;

  if (a.json) {
    nlohmann::json j;
    j["target"] = a.core ? "core" : "module";
    j["pass"] = a.backward ? "backward" : "forward";
    j["batch"] = c.batch, j["seq"] = c.seq, j["kv_seq"] = c.t_k(), j["embed_dim"] = c.embed_dim;
    j["heads"] = c.heads, j["kv_heads"] = c.kv(), j["head_dim"] = c.head_dim();
    j["causal"] = c.causal, j["alibi"] = c.alibi, j["softcap"] = c.softcap, j["sinks"] = c.sinks;
    j["dtype"] = a.dtype, j["threads"] = threads, j["repeat"] = a.repeat;
    j["need_weights"] = a.need_weights;
    j["dispatch"] = dispatch;
    j["times_ms"] = ms;
    j["median_ms"] = med;
    j["flops"] = flops;
    j["gflops"] = gflops;
    j["peak_rss_mb"] = peak_mb;
    j["expected_tensor_mb"] = expected_mb;
    j["sgemm_size"] = a.sgemm_size;
    j["sgemm_gflops"] = sgemm;
    j["fraction_of_sgemm"] = gflops / sgemm;
    j["simd_target"] = machine.simd_target;
    j["peak_f32_gflops"] = f32_peak;
    j["peak_f32_gflops_before"] = peak_before;
    j["peak_f32_gflops_after"] = machine.f32_gflops;
    j["peak_ratio_after_before"] = peak_ratio;
    j["peak_bf16_dot_gflops"] = machine.bf16_dot_gflops;
    j["peak_bf16_amx_gflops"] = machine.amx_bf16_gflops;
    j["products"] = products;
    j["peak_gflops"] = peak;
    j["peak_kind"] = peak_kind;
    j["fraction_of_f32_peak"] = gflops / f32_peak;
    j["peak_f32_tile_gflops"] = machine.f32_tile_gflops;
    j["fraction_of_f32_tile_peak"] = gflops / machine.f32_tile_gflops;
    j["fraction_of_peak"] = gflops / peak;
    j["read_bw_gbs"] = machine.read_gbs;
    j["triad_gbs"] = machine.triad_gbs;
    j["min_bytes"] = bench::expected_tensor_bytes(c);
    j["min_bytes_gbs"] = min_gbs;
    j["fraction_of_read_bw"] = min_gbs / machine.read_gbs;
    if (!busy.ms.empty()) {  // --core forward: each thread's time in the kernel's work items
      j["thread_busy_ms"] = busy.ms;
      j["busy_balance"] = busy.balance;
      j["busy_fraction"] = busy.mean() / med;
    }
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("%s: B=%lld T=%lld S=%lld E=%lld h=%lld kv=%lld d=%lld causal=%s%s dtype=%s threads=%d\n", what.c_str(),
              static_cast<long long>(c.batch), static_cast<long long>(c.seq), static_cast<long long>(c.t_k()),
              static_cast<long long>(c.embed_dim), static_cast<long long>(c.heads), static_cast<long long>(c.kv()),
              static_cast<long long>(c.head_dim()), yes_no(c.causal), bench::edits_str(c).c_str(), a.dtype.c_str(),
              threads);
  std::printf("  dispatch          %s\n", dispatch.c_str());
  std::printf("  median            %.3f ms over %d runs\n", med, a.repeat);
  std::printf("  throughput        %.2f GFLOP/s (%.3g GFLOP per run)\n", gflops, flops * 1e-9);
  std::printf("  peak RSS          %.1f MiB (tensors it must hold: %.1f MiB)\n", peak_mb, expected_mb);
  std::printf("  FMA peak          %.1f GFLOP/s %s on %s, %d threads; fraction of peak %.3f%s\n", peak,
              bf16_amx   ? "bf16 AMX tiles"
              : bf16_dot ? "bf16 dot product"
                         : "float32",
              machine.simd_target.c_str(), threads, gflops / peak,
              peak_ratio < 0.9 ? " (the peak fell during the run: machine busy, discard)" : "");
  std::printf(
      "  L1-fed FMA tile   %.1f GFLOP/s float32 (the kernels' register tile, operands from L1); fraction %.3f\n",
      machine.f32_tile_gflops, gflops / machine.f32_tile_gflops);
  std::printf(
      "  memory            read %.1f GB/s, triad %.1f GB/s; the %.1f MiB it must touch at %.1f GB/s: "
      "fraction of read bandwidth %.3f\n",
      machine.read_gbs, machine.triad_gbs, expected_mb, min_gbs, min_gbs / machine.read_gbs);
  if (!busy.ms.empty()) {
    std::string list;
    for (double t : busy.ms) {
      char one[32];
      std::snprintf(one, sizeof one, "%s%.3f", list.empty() ? "" : ", ", t);
      list += one;
    }
    std::printf("  threads busy      %s ms per run; balance (min/max) %.3f, %.0f%% of the median time\n", list.c_str(),
                busy.balance, 100.0 * busy.mean() / med);
  }
  std::printf("  sgemm (%lld^3)   %.2f GFLOP/s on %d threads; fraction %.3f\n", static_cast<long long>(a.sgemm_size),
              sgemm, threads, gflops / sgemm);
}

}  // namespace

static void add_bench_command(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  bench::BenchConfig& c = a->config;
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Time the module forward (or the attention core) on random inputs: median, GFLOP/s, peak memory, "
      "fractions of this machine's FMA peak, read bandwidth and sgemm, measured in the same run.");
  cmd->add_option("--batch,-B", c.batch, "batch size B (default 1)");
  cmd->add_option("--seq,-T", c.seq, "query length T (required)");
  cmd->add_option("--kv-seq,-S", c.kv_seq, "key/value length S (default T: self-attention)");
  cmd->add_option("--embed-dim,-E", c.embed_dim, "model width E (required)")->check(whole_number_at_least(1));
  cmd->add_option("--heads,-H", c.heads, "query heads h (must divide E) (required)")->check(whole_number_at_least(1));
  cmd->add_option("--kv-heads", c.kv_heads, "key/value heads (GQA; must divide h; default h)")
      ->check(whole_number_at_least(1));
  cmd->add_flag("--causal", c.causal, "top-left causal mask (PyTorch's is_causal)");
  cmd->add_flag("--alibi", c.alibi, "ALiBi with the standard slopes for h heads");
  cmd->add_option("--softcap", c.softcap, "logit softcap C > 0: scores s -> C*tanh(s/C) (0 = off)");
  cmd->add_flag("--sinks", c.sinks, "one learned attention-sink logit per head (zeros)");
  cmd->add_option("--dtype", a->dtype, "f32 or bf16 (bf16: --core only, when the library has it)");
  cmd->add_option("--threads", c.threads, "threads for attention and BLAS (default: library default)");
  cmd->add_option("--repeat,-r", a->repeat, "timed runs after one warm-up (default 5)");
  cmd->add_option("--sgemm-size", a->sgemm_size, "n of the n×n×n sgemm reference (default 1536)");
  cmd->add_option("--need-weights", a->need_weights,
                  "forward (module or --core) also returning attention weights: none (default), per-head or averaged");
  cmd->add_option("--bw-mib", a->bw_mib, "MiB streamed by the read-bandwidth and triad measurements (default 256)");
  cmd->add_flag("--core", a->core, "time sdpa on (B, h, T, d) tensors instead of the module");
  cmd->add_flag("--backward", a->backward,
                "time the backward pass: with --core sdpa_backward alone (FLOPs 2.5x the forward core), else the "
                "module's training forward + backward");
  cmd->add_flag("--decode", a->decode,
                "time decoding one token per sequence against a KV cache of --seq positions (h, kv-heads, d = E/h); "
                "reports K/V GB/s next to a STREAM triad measured in the same run (mha bench-decode sweeps contexts)");
  cmd->add_flag("--varlen", a->varlen,
                "packed variable-length batch: the attention core on --varlen-seqs sequences with lengths drawn from "
                "[--varlen-min, --seq], packed (sdpa_varlen) vs padded to --seq (sdpa + key padding); use -r 1");
  cmd->add_option("--varlen-seqs", a->varlen_seqs, "sequences in the --varlen batch (default 64)");
  cmd->add_option("--varlen-min", a->varlen_min, "shortest --varlen sequence (default 16)");
  cmd->add_option("--varlen-seed", a->varlen_seed, "seed of the --varlen lengths and data (default 1)")
      ->check(unsigned_whole_number());
  cmd->add_option("--footprint-mib", a->footprint_mib,
                  "with --decode: MiB of K/V streamed per measurement, rotating over copies of the cache (default "
                  "1024; at most 4096 copies)");
  cmd->add_flag("--json", a->json, "one JSON object on stdout");
  cmd->add_option("--parallel", a->parallel,
                  "under mpirun: ring (context parallel; zigzag when --causal), ulysses (all-to-all), heads "
                  "(tensor-parallel module) or pingpong (MPI latency and bandwidth between ranks 0 and 1)");
  cmd->callback([a, cmd] {
    for (const CLI::Option* o : cmd->get_options())
      if (o->count() > 0 && !o->get_lnames().empty()) a->given.push_back("--" + o->get_lnames().front());
    run_bench(*a);
  });
}

static const CommandRegistrar registered{50, add_bench_command};

}  // namespace mha::cli
