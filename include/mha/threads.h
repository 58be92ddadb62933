// mha/threads.h — the library-wide thread count.
//
// Every parallel part of mha (the attention kernels, the GEMMs, decoding) takes a per-call
// `threads` option; 0 there means the library default set here.
#pragma once

namespace mha {

/// The most threads any call uses, whatever is asked: a request for a million threads sized a
/// million workspaces (std::bad_alloc); results never depend on the count.
constexpr int kMaxThreads = 1024;

/// Library-wide default thread count (0 = from the environment, below).
void set_num_threads(int threads);
/// The default in force: the value set above; else OMP_NUM_THREADS's first value where it is a
/// positive whole number (read once, as OpenMP reads it); else the CPUs this process may run on
/// (its affinity mask: taskset, a cgroup cpuset, an MPI binding); at least 1.
int num_threads();
/// A per-call request resolved: `requested` when > 0, else num_threads(); at most kMaxThreads.
/// Throws mha::Error for a negative request.
int resolve_threads(int requested);

}  // namespace mha
