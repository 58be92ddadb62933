// layers/threads.cpp — the library-wide default thread count (mha/threads.h).
#include "mha/threads.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

#include "mha/error.h"

namespace mha {

namespace {
std::atomic<int> g_default_threads{0};

/// OMP_NUM_THREADS's first value when it is a positive whole number ("4" or "4,2" for nested
/// levels), read once as OpenMP itself reads it; else 0.
int omp_num_threads_variable() {
  static const int value = [] {
    const char* s = std::getenv("OMP_NUM_THREADS");
    if (s == nullptr) return 0;
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(s, &end, 10);
    if (end == s || errno != 0 || v <= 0 || (*end != '\0' && *end != ',')) return 0;
    return static_cast<int>(std::min<long>(v, kMaxThreads));
  }();
  return value;
}

/// The CPUs this process may run on: its affinity mask (taskset, a cgroup's cpuset, an MPI
/// launcher's binding), else the hardware concurrency; at least 1. Read on every call: the mask
/// can change while the process runs.
int available_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return std::min(n, kMaxThreads);
  }
#endif
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(std::min<unsigned>(hw, kMaxThreads)) : 1;
}
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
  const int from_env = omp_num_threads_variable();
  return from_env > 0 ? from_env : available_cpus();
}

}  // namespace mha
