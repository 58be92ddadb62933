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
/// The default in force: the value set above; else OpenMP's default for a team started by the
/// calling thread (omp_get_max_threads(): OMP_NUM_THREADS where set, else the CPUs of the
/// process's affinity mask when OpenMP loaded — taskset, a cgroup cpuset, an MPI binding — or
/// what omp_set_num_threads last set, as torch.set_num_threads does); at least 1.
int num_threads();
/// A per-call request resolved: `requested` when > 0, else num_threads(); at most kMaxThreads.
/// Throws mha::Error for a negative request.
int resolve_threads(int requested);

}  // namespace mha
