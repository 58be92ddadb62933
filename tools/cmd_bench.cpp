// `mha bench`: times the module forward (or the attention core with --core) on random inputs and
// reports median time, GFLOP/s, peak RSS and the fraction of this machine's sgemm throughput,
// measured in the same run. The measurement itself lives in bench_util.h, shared with
// bench/bench_attention.cpp.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "bench_util.h"
#include "decode_bench.h"
#include "registry.h"

namespace mha::cli {

namespace {

struct BenchArgs {
  bench::BenchConfig config;
  std::string dtype = "f32";
  int repeat = 5;
  int64_t sgemm_size = 1536;
  bool core = false, json = false, backward = false, decode = false;
};

const char* yes_no(bool b) { return b ? "yes" : "no"; }

/// `--decode`: one new token per sequence against a cache of --seq positions (the decode benchmark).
void run_decode(const BenchArgs& a) {
  const bench::BenchConfig& c = a.config;
  if (a.core || a.backward) fail("bench: --decode cannot be combined with --core or --backward");
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
  run_decode_bench(d);
}

void run_bench(BenchArgs a) {
  bench::BenchConfig& c = a.config;
  if (a.dtype != "f32" && a.dtype != "bf16") fail("bench: --dtype must be f32 or bf16, got '", a.dtype, "'");
  if (a.decode) return run_decode(a);
  c.pass = a.backward ? bench::Pass::Backward : bench::Pass::Forward;
  c.dtype = a.dtype == "bf16" ? bench::DType::BF16 : bench::DType::F32;
  c.target = a.core ? bench::Target::Core : bench::Target::Module;
  bench::validate(c);
  if (a.repeat <= 0) fail("bench: --repeat must be ≥ 1, got ", a.repeat);
  if (a.sgemm_size <= 0) fail("bench: --sgemm-size must be ≥ 1, got ", a.sgemm_size);
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
    run = [&] { core->run(); };
  } else if (a.backward) {
    module_train = std::make_unique<bench::ModuleTrainCase>(c);
    dispatch = bench::ModuleCase(c).dispatch();
    run = [&] { module_train->run(); };
  } else {
    module = std::make_unique<bench::ModuleCase>(c);
    dispatch = module->dispatch();
    run = [&] { module->run(); };
  }
  const char* what = a.core ? (a.backward ? "attention core backward (sdpa_backward)" : "attention core (sdpa)")
                            : (a.backward ? "module forward + backward" : "module forward");
  std::fprintf(stderr,
               "bench: %s, B=%lld T=%lld S=%lld E=%lld h=%lld kv=%lld d=%lld causal=%s%s dtype=%s threads=%d, "
               "warm-up + %d runs\n",
               what, static_cast<long long>(c.batch), static_cast<long long>(c.seq), static_cast<long long>(c.t_k()),
               static_cast<long long>(c.embed_dim), static_cast<long long>(c.heads), static_cast<long long>(c.kv()),
               static_cast<long long>(c.head_dim()), yes_no(c.causal), bench::edits_str(c).c_str(), a.dtype.c_str(),
               threads, a.repeat);
  std::fprintf(stderr, "bench: sdpa dispatch: %s\n", dispatch.c_str());
  const auto progress = [&](int i, double ms) { std::fprintf(stderr, "bench: run %d/%d: %.3f ms\n", i, a.repeat, ms); };
  const std::vector<double> ms = bench::time_runs(run, a.repeat, progress);
  // Read the peak before the sgemm reference allocates its own matrices.
  const double peak_mb = bench::peak_rss_mib();
  core.reset();
  module.reset();
  core_backward.reset();
  module_train.reset();

  std::fprintf(stderr, "bench: sgemm reference %lld^3 on %d threads\n", static_cast<long long>(a.sgemm_size), threads);
  const double sgemm = bench::sgemm_gflops(a.sgemm_size, 5);
  const double med = bench::median(ms);
  const double flops = bench::total_flops(c);
  const double gflops = flops / (med * 1e6);
  const double expected_mb = bench::expected_tensor_bytes(c) / (1024.0 * 1024.0);

  if (a.json) {
    nlohmann::json j;
    j["target"] = a.core ? "core" : "module";
    j["pass"] = a.backward ? "backward" : "forward";
    j["batch"] = c.batch, j["seq"] = c.seq, j["kv_seq"] = c.t_k(), j["embed_dim"] = c.embed_dim;
    j["heads"] = c.heads, j["kv_heads"] = c.kv(), j["head_dim"] = c.head_dim();
    j["causal"] = c.causal, j["alibi"] = c.alibi, j["softcap"] = c.softcap, j["sinks"] = c.sinks;
    j["dtype"] = a.dtype, j["threads"] = threads, j["repeat"] = a.repeat;
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
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("%s: B=%lld T=%lld S=%lld E=%lld h=%lld kv=%lld d=%lld causal=%s%s dtype=%s threads=%d\n", what,
              static_cast<long long>(c.batch), static_cast<long long>(c.seq), static_cast<long long>(c.t_k()),
              static_cast<long long>(c.embed_dim), static_cast<long long>(c.heads), static_cast<long long>(c.kv()),
              static_cast<long long>(c.head_dim()), yes_no(c.causal), bench::edits_str(c).c_str(), a.dtype.c_str(),
              threads);
  std::printf("  dispatch          %s\n", dispatch.c_str());
  std::printf("  median            %.3f ms over %d runs\n", med, a.repeat);
  std::printf("  throughput        %.2f GFLOP/s (%.3g GFLOP per run)\n", gflops, flops * 1e-9);
  std::printf("  peak RSS          %.1f MiB (tensors it must hold: %.1f MiB)\n", peak_mb, expected_mb);
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
      "fraction of this machine's sgemm.");
  cmd->add_option("--batch,-B", c.batch, "batch size B (default 1)");
  cmd->add_option("--seq,-T", c.seq, "query length T")->required();
  cmd->add_option("--kv-seq,-S", c.kv_seq, "key/value length S (default T: self-attention)");
  cmd->add_option("--embed-dim,-E", c.embed_dim, "model width E")->required();
  cmd->add_option("--heads,-H", c.heads, "query heads h (must divide E)")->required();
  cmd->add_option("--kv-heads", c.kv_heads, "key/value heads (GQA; must divide h; default h)");
  cmd->add_flag("--causal", c.causal, "top-left causal mask (PyTorch's is_causal)");
  cmd->add_flag("--alibi", c.alibi, "ALiBi with the standard slopes for h heads");
  cmd->add_option("--softcap", c.softcap, "logit softcap C > 0: scores s -> C*tanh(s/C) (0 = off)");
  cmd->add_flag("--sinks", c.sinks, "one learned attention-sink logit per head (zeros)");
  cmd->add_option("--dtype", a->dtype, "f32 or bf16 (bf16: --core only, when the library has it)");
  cmd->add_option("--threads", c.threads, "threads for attention and BLAS (default: library default)");
  cmd->add_option("--repeat,-r", a->repeat, "timed runs after one warm-up (default 5)");
  cmd->add_option("--sgemm-size", a->sgemm_size, "n of the n×n×n sgemm reference (default 1536)");
  cmd->add_flag("--core", a->core, "time sdpa on (B, h, T, d) tensors instead of the module");
  cmd->add_flag("--backward", a->backward,
                "time the backward pass: with --core sdpa_backward alone (FLOPs 2.5x the forward core), else the "
                "module's training forward + backward");
  cmd->add_flag("--decode", a->decode,
                "time decoding one token per sequence against a KV cache of --seq positions (h, kv-heads, d = E/h); "
                "reports K/V GB/s next to a STREAM triad measured in the same run (mha bench-decode sweeps contexts)");
  cmd->add_flag("--json", a->json, "one JSON object on stdout");
  cmd->callback([a] { run_bench(*a); });
}

static const CommandRegistrar registered{50, add_bench_command};

}  // namespace mha::cli
