// `mha bench --parallel ring|ulysses|heads` under mpirun (built when MHA_WITH_MPI).
#pragma once

#include <string>

#include "bench_util.h"

namespace mha::cli {

struct ParallelBenchArgs {
  bench::BenchConfig config;
  std::string scheme;  ///< ring, ulysses, heads or pingpong
  bool backward = false;
  bool json = false;
  int repeat = 5;
};

/// Initialises MPI when needed (and finalises what it initialised), runs the scheme on every rank
/// of MPI_COMM_WORLD and prints from rank 0.
void run_parallel_bench(const ParallelBenchArgs& args);

}  // namespace mha::cli
