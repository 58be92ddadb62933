// layers/threads.cpp — the library-wide default thread count (mha/threads.h).
#include "mha/threads.h"

#include <omp.h>

#include <algorithm>
#include <atomic>

#include "mha/error.h"

namespace mha {

namespace {
std::atomic<int> g_default_threads{0};

/// OpenMP's own default for a team started here: OMP_NUM_THREADS as libgomp parsed it when it
/// loaded, else the CPUs of the process's affinity mask as it was then (taskset, a cgroup cpuset,
/// an MPI launcher's binding). Asked of OpenMP rather than read again: with OMP_PROC_BIND or
/// OMP_PLACES set, libgomp pins the initial thread to one CPU when it loads, so the calling
/// thread's own mask says 1 while the process has them all.
int openmp_default_threads() { return std::clamp(omp_get_max_threads(), 1, kMaxThreads); }
}  // namespace

void set_num_threads(int threads) {
  if (threads < 0) fail("set_num_threads: threads must be ≥ 0, got ", threads);
  g_default_threads.store(threads);
}

int num_threads() { return resolve_threads(0); }

int resolve_threads(int requested) {
  // A negative count is a mistake, not "the default" (Python refuses it too): one rule everywhere.
  if (requested < 0) fail("threads must be ≥ 0 (0 = the library default), got ", requested);
  if (requested > 0) return std::min(requested, kMaxThreads);
  const int global = g_default_threads.load();
  if (global > 0) return std::min(global, kMaxThreads);
  // Unset: what the environment asks for (a process pinned to one CPU, or told OMP_NUM_THREADS=1
  // by a launcher running many such processes, must not start a thread per CPU of the machine).
  return openmp_default_threads();
}

}  // namespace mha
