// layers/threads.cpp — the library-wide default thread count (mha/threads.h).
#include "mha/threads.h"

#include <algorithm>
#include <atomic>
#include <thread>

#include "mha/error.h"

namespace mha {

namespace {
std::atomic<int> g_default_threads{0};
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
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(std::min<unsigned>(hw, kMaxThreads)) : 1;
}

}  // namespace mha
