// bench/bench_attention.cpp — Google Benchmark for the attention core (sdpa) and the whole module
// forward over a few sequence lengths, B=1, E=512, h=8 (d=64), float32, reporting GFLOP/s, peak
// RSS and the fraction of this machine's sgemm measured at start-up in the same process.
// The cases and the FLOP convention are tools/bench_util.h's, the same as `mha bench`'s.
//
//   bench_attention [--threads=N] [--benchmark_filter=Core] [other Google Benchmark flags]
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_util.h"

namespace {

using mha::bench::BenchConfig;

int g_threads = 2;          // the targets are for 2 threads
double g_sgemm_gflops = 0;  // measured once in main, before any benchmark

BenchConfig config_for(int64_t t, bool causal, mha::bench::Target target) {
  BenchConfig c;
  c.batch = 1, c.seq = t, c.embed_dim = 512, c.heads = 8;
  c.causal = causal;
  c.target = target;
  c.threads = g_threads;
  return c;
}

/// Times the loop itself too, so that the fraction of sgemm is computed from the same runs.
template <class Case>
void run_case(benchmark::State& state, const BenchConfig& c) {
  Case bench_case(c);
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    bench_case.run();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double flops = mha::bench::total_flops(c);
  const double gflops = flops * static_cast<double>(state.iterations()) / (seconds * 1e9);
  state.counters["GFLOP/s"] = benchmark::Counter(gflops);
  state.counters["peak_rss_mb"] = benchmark::Counter(mha::bench::peak_rss_mib());
  state.counters["sgemm_GFLOP/s"] = benchmark::Counter(g_sgemm_gflops);
  state.counters["fraction_of_sgemm"] = benchmark::Counter(g_sgemm_gflops > 0 ? gflops / g_sgemm_gflops : 0.0);
  state.SetLabel(bench_case.dispatch());
}

void BM_Core(benchmark::State& state) {
  run_case<mha::bench::CoreCase>(state, config_for(state.range(0), state.range(1) != 0, mha::bench::Target::Core));
}
void BM_Module(benchmark::State& state) {
  run_case<mha::bench::ModuleCase>(state, config_for(state.range(0), state.range(1) != 0, mha::bench::Target::Module));
}

// T from 128 to 2048: the reference path (until the fused kernel lands) takes seconds beyond.
BENCHMARK(BM_Core)
    ->ArgsProduct({{128, 512, 2048}, {0, 1}})
    ->ArgNames({"T", "causal"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Module)
    ->ArgsProduct({{128, 512, 2048}, {0, 1}})
    ->ArgNames({"T", "causal"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  // Our one flag, --threads=N, is taken out before Google Benchmark sees the rest.
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--threads=", 10) == 0)
      g_threads = std::atoi(argv[i] + 10);
    else
      args.push_back(argv[i]);
  }
  if (g_threads <= 0) {
    std::fprintf(stderr, "bench_attention: --threads must be ≥ 1\n");
    return 1;
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  mha::bench::apply_threads(g_threads);
  g_sgemm_gflops = mha::bench::sgemm_gflops(1536, 5);
  std::fprintf(stderr, "sgemm 1536^3 on %d threads: %.1f GFLOP/s\n", g_threads, g_sgemm_gflops);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
