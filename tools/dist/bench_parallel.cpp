// `mpirun -np P mha bench --parallel ring|ulysses|heads|pingpong …`: times the distributed schemes of
// mha/dist.h on random inputs. Every rank runs the same command; rank 0 prints.
//
// What it reports (per scheme, medians over --repeat runs after one warm-up; a run's time is the
// slowest rank's):
//   time, GFLOP/s per rank (the single-process FLOP count / P / time), bytes sent per rank;
//   local_ms: the same local kernels on the same block shapes with no communication at all;
//   comm_ms: the communication alone (ring: the P − 1 block exchanges; others: time − local);
//   comm_hidden_fraction (ring): (local + comm − time) / comm, clamped to [0, 1];
//   busy_ms per rank (ring): time inside the kernels, and busy_balance = min / max of those;
//   wait_ms / wall_ms per rank (ring): blocked in MPI_Wait*, and the call's own wall time (last run);
//   local_busy_ms per rank (ring): the no-communication run's time inside the kernels.
// `pingpong` sends messages of 8 B … 64 MiB between ranks 0 and 1 and reports half the round trip.
#include "dist/bench_parallel.h"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mha/dist.h"
#include "mha/error.h"
#include "mha/module.h"
#include "registry.h"

namespace mha::cli {

namespace {

struct MpiSession {
  bool owned = false;
  MpiSession() {
    int init = 0;
    MPI_Initialized(&init);
    if (!init) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      owned = true;
    }
  }
  ~MpiSession() {
    if (owned) MPI_Finalize();
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
};

/// `fn()` once untimed, then `repeat` times; each time the slowest rank's, in ms.
template <class Fn>
std::vector<double> time_collective(MPI_Comm comm, int repeat, Fn&& fn) {
  fn();
  std::vector<double> ms;
  for (int i = 0; i < repeat; ++i) {
    MPI_Barrier(comm);
    const double t0 = MPI_Wtime();
    fn();
    double t = (MPI_Wtime() - t0) * 1e3, tmax = 0;
    MPI_Allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, comm);
    ms.push_back(tmax);
  }
  return ms;
}

std::vector<double> gather_to_all(MPI_Comm comm, double x) {
  int P = 1;
  MPI_Comm_size(comm, &P);
  std::vector<double> all(static_cast<size_t>(P));
  MPI_Allgather(&x, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, comm);
  return all;
}

void pingpong(MPI_Comm comm, const ParallelBenchArgs& a, int me, int P) {
  if (P < 2) fail("bench: --parallel pingpong needs at least 2 ranks (mpirun -np 2)");
  nlohmann::json rows = nlohmann::json::array();
  std::vector<char> buf(size_t{64} << 20);
  for (int64_t bytes = 8; bytes <= (int64_t{64} << 20); bytes *= 8) {
    const int iters = bytes <= (1 << 16) ? 2000 : bytes <= (1 << 22) ? 100 : 10;
    std::vector<double> us;
    for (int rep = 0; rep < std::max(a.repeat, 1); ++rep) {
      MPI_Barrier(comm);
      const double t0 = MPI_Wtime();
      for (int i = 0; i < iters; ++i) {
        if (me == 0) {
          MPI_Send(buf.data(), static_cast<int>(bytes), MPI_CHAR, 1, 1, comm);
          MPI_Recv(buf.data(), static_cast<int>(bytes), MPI_CHAR, 1, 1, comm, MPI_STATUS_IGNORE);
        } else if (me == 1) {
          MPI_Recv(buf.data(), static_cast<int>(bytes), MPI_CHAR, 0, 1, comm, MPI_STATUS_IGNORE);
          MPI_Send(buf.data(), static_cast<int>(bytes), MPI_CHAR, 0, 1, comm);
        }
      }
      us.push_back((MPI_Wtime() - t0) / (2.0 * iters) * 1e6);
    }
    const double one_way = bench::median(us);
    rows.push_back(
        {{"bytes", bytes}, {"one_way_us", one_way}, {"gbytes_per_s", static_cast<double>(bytes) / (one_way * 1e3)}});
  }
  if (me != 0) return;
  if (a.json) {
    std::printf("%s\n", nlohmann::json{{"scheme", "pingpong"}, {"ranks", P}, {"rows", rows}}.dump().c_str());
    return;
  }
  std::printf("MPI ping-pong between ranks 0 and 1 (one way = half the round trip, median of %d)\n", a.repeat);
  for (const auto& r : rows)
    std::printf("  %10lld B  %10.2f us  %8.3f GB/s\n", static_cast<long long>(r["bytes"].get<int64_t>()),
                r["one_way_us"].get<double>(), r["gbytes_per_s"].get<double>());
}

}  // namespace

void run_parallel_bench_mpi(const ParallelBenchArgs& args);

void run_parallel_bench(const ParallelBenchArgs& args) {
  MpiSession session;
  try {
    run_parallel_bench_mpi(args);
  } catch (const std::exception& e) {
    // Print here, before MPI_Finalize: finalising synchronises the ranks, so every rank has printed
    // its line before any exits (mpirun ends the job when the first rank exits with status 1).
    std::string msg = e.what();
    for (char& ch : msg)
      if (ch == '\n') ch = ' ';
    std::fprintf(stderr, "mha: %s\n", msg.c_str());
    std::fflush(stderr);
    throw AlreadyReported{};
  }
}

void run_parallel_bench_mpi(const ParallelBenchArgs& args) {
  ParallelBenchArgs a = args;
  bench::BenchConfig& c = a.config;
  const std::string& s = a.scheme;
  if (s != "ring" && s != "ulysses" && s != "heads" && s != "pingpong")
    fail("bench: --parallel must be ring, ulysses, heads or pingpong, got '", s, "'");
  if (a.repeat <= 0) fail("bench: --repeat must be ≥ 1, got ", a.repeat);
  if (a.backward && s != "ring") fail("bench: --backward with --parallel is implemented for ring only");
  if (s != "pingpong") bench::validate(c);
  if (s != "pingpong" && c.kv_seq > 0 && c.kv_seq != c.seq) fail("bench: --parallel runs self-attention (no --kv-seq)");
  MPI_Comm comm = MPI_COMM_WORLD;
  int me = 0, P = 1;
  MPI_Comm_rank(comm, &me);
  MPI_Comm_size(comm, &P);
  if (s == "pingpong") return pingpong(comm, a, me, P);
  const int threads = bench::apply_threads(c.threads);
  const int64_t B = c.batch, T = c.seq, h = c.heads, kv = c.kv(), d = c.head_dim();
  const dist::SeqLayout layout = c.causal && s == "ring" ? dist::SeqLayout::Zigzag : dist::SeqLayout::Contiguous;
  const Causal causal = c.causal ? Causal::top_left() : Causal::none();
  if (me == 0)
    std::fprintf(stderr,
                 "bench: --parallel %s on %d ranks, B=%lld T=%lld E=%lld h=%lld kv=%lld d=%lld causal=%s%s, "
                 "%d threads per rank, warm-up + %d runs\n",
                 s.c_str(), P, static_cast<long long>(B), static_cast<long long>(T),
                 static_cast<long long>(c.embed_dim), static_cast<long long>(h), static_cast<long long>(kv),
                 static_cast<long long>(d), c.causal ? "yes" : "no", a.backward ? " backward" : "", threads, a.repeat);

  std::vector<double> ms, local_ms;
  double comm_ms = 0, busy = 0, bytes = 0, wait = 0, wall = 0, local_busy = 0;
  c.pass = a.backward ? bench::Pass::Backward : bench::Pass::Forward;
  c.target = s == "heads" ? bench::Target::Module : bench::Target::Core;
  if (s == "ring" || s == "ulysses") {
    const int64_t tl = dist::local_length(T, P, me, layout);
    const Tensor q = bench::random_tensor({B, h, tl, d}, 11 + static_cast<uint64_t>(me));
    const Tensor k = bench::random_tensor({B, kv, tl, d}, 101 + static_cast<uint64_t>(me));
    const Tensor v = bench::random_tensor({B, kv, tl, d}, 1001 + static_cast<uint64_t>(me));
    const BoolTensor none;
    if (s == "ring") {
      dist::RingOptions o;
      o.causal = causal;
      o.layout = layout;
      o.threads = threads;
      dist::RingStats st;
      o.stats = &st;
      dist::RingResult fwd;
      Tensor dout;
      if (a.backward) {
        fwd = dist::ring_attention(comm, q, k, v, none, T, T, o);
        dout = bench::random_tensor(fwd.out.shape(), 7 + static_cast<uint64_t>(me));
      }
      const auto run = [&] {
        if (a.backward)
          dist::ring_attention_backward(comm, q, k, v, fwd.out, dout, fwd.lse, none, T, T, o);
        else
          dist::ring_attention(comm, q, k, v, none, T, T, o);
      };
      ms = time_collective(comm, a.repeat, run);
      busy = st.compute_seconds * 1e3;
      wait = st.wait_seconds * 1e3;
      wall = st.seconds * 1e3;
      bytes = static_cast<double>(st.bytes_sent);
      dist::RingOptions lo = o;
      lo.skip_communication = true;
      dist::RingStats lst;
      lo.stats = &lst;
      o.stats = nullptr;
      const auto run_local = [&] {
        if (a.backward)
          dist::ring_attention_backward(comm, q, k, v, fwd.out, dout, fwd.lse, none, T, T, lo);
        else
          dist::ring_attention(comm, q, k, v, none, T, T, lo);
      };
      local_ms = time_collective(comm, a.repeat, run_local);
      local_busy = lst.compute_seconds * 1e3;
      // The communication alone: the same P − 1 K/V exchanges (and, backward, P accumulator hops).
      int64_t max_rows = 0;
      for (int r = 0; r < P; ++r) max_rows = std::max(max_rows, dist::local_length(T, P, r, layout));
      std::vector<float> sk(static_cast<size_t>(2 * B * kv * max_rows * d)), rk(sk.size());
      const int hops = a.backward ? 2 * P - 1 : P - 1;
      const auto run_comm = [&] {
        for (int i = 0; i < hops; ++i)
          MPI_Sendrecv(sk.data(), static_cast<int>(sk.size()), MPI_FLOAT, (me + 1) % P, 5, rk.data(),
                       static_cast<int>(rk.size()), MPI_FLOAT, (me + P - 1) % P, 5, comm, MPI_STATUS_IGNORE);
      };
      if (P > 1) comm_ms = bench::median(time_collective(comm, a.repeat, run_comm));
    } else {
      dist::UlyssesOptions o;
      o.causal = causal;
      o.threads = threads;
      ms = time_collective(comm, a.repeat, [&] { dist::ulysses_attention(comm, q, k, v, none, T, T, o); });
      // The same kernel on this rank's h/P heads of the whole sequence, with no all-to-all.
      const Tensor qh = bench::random_tensor({B, h / P, T, d}, 3), kh = bench::random_tensor({B, kv / P, T, d}, 4),
                   vh = bench::random_tensor({B, kv / P, T, d}, 5);
      SdpaOptions so;
      so.masks.causal = causal;
      so.threads = threads;
      local_ms = time_collective(comm, a.repeat, [&] { sdpa(qh, kh, vh, so); });
      // Sent per rank: (P − 1)/P of q, k, v going out and of the output coming back.
      bytes = 4.0 * static_cast<double>(P - 1) / P * static_cast<double>(q.numel() + k.numel() + v.numel() + q.numel());
      comm_ms = std::max(0.0, bench::median(ms) - bench::median(local_ms));
    }
  } else {  // heads
    MhaConfig mc;
    mc.embed_dim = c.embed_dim;
    mc.num_heads = h;
    mc.num_kv_heads = kv;
    mc.layout = Layout::BatchFirst;
    const MultiheadAttention full(mc, 1);
    const dist::TensorParallelAttention tp(comm, full);
    const Tensor x = bench::random_tensor({B, T, c.embed_dim}, 9);
    MhaForwardOptions fo;
    fo.causal = causal;
    fo.threads = threads;
    ms = time_collective(comm, a.repeat, [&] { tp.forward(x, x, x, fo); });
    local_ms = time_collective(comm, a.repeat, [&] { tp.shard().forward(x, x, x, fo); });
    bytes = 4.0 * 2.0 * static_cast<double>(P - 1) / P * static_cast<double>(B * T * c.embed_dim);  // ring allreduce
    comm_ms = std::max(0.0, bench::median(ms) - bench::median(local_ms));
  }
  const std::vector<double> busy_all = gather_to_all(comm, busy), bytes_all = gather_to_all(comm, bytes),
                            wait_all = gather_to_all(comm, wait), wall_all = gather_to_all(comm, wall),
                            local_busy_all = gather_to_all(comm, local_busy);
  if (me != 0) return;
  const double med = bench::median(ms), local = bench::median(local_ms);
  const double flops = bench::total_flops(c);
  const double gflops_per_rank = flops / P / (med * 1e6);
  double hidden = -1;
  if (s == "ring" && P > 1 && comm_ms > 0) hidden = std::clamp((local + comm_ms - med) / comm_ms, 0.0, 1.0);
  double bmin = *std::min_element(busy_all.begin(), busy_all.end()),
         bmax = *std::max_element(busy_all.begin(), busy_all.end());
  if (a.json) {
    nlohmann::json j;
    j["scheme"] = s, j["ranks"] = P, j["threads_per_rank"] = threads, j["pass"] = a.backward ? "backward" : "forward";
    j["batch"] = B, j["seq"] = T, j["embed_dim"] = c.embed_dim, j["heads"] = h, j["kv_heads"] = kv, j["head_dim"] = d;
    j["causal"] = c.causal, j["layout"] = layout == dist::SeqLayout::Zigzag ? "zigzag" : "contiguous";
    j["times_ms"] = ms, j["median_ms"] = med, j["flops"] = flops, j["gflops_per_rank"] = gflops_per_rank;
    j["gflops_total"] = gflops_per_rank * P;
    j["bytes_sent_per_rank"] = bytes_all;
    j["local_ms"] = local, j["comm_ms"] = comm_ms;
    j["comm_hidden_fraction"] = hidden >= 0 ? nlohmann::json(hidden) : nlohmann::json(nullptr);
    if (s == "ring") {
      j["busy_ms_per_rank"] = busy_all;
      j["busy_balance"] = bmax > 0 ? bmin / bmax : 1.0;
      j["wait_ms_per_rank"] = wait_all, j["wall_ms_per_rank"] = wall_all;
      j["local_busy_ms_per_rank"] = local_busy_all;
    }
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("%s attention on %d ranks (%d threads each): B=%lld T=%lld E=%lld h=%lld kv=%lld causal=%s %s\n",
              s.c_str(), P, threads, static_cast<long long>(B), static_cast<long long>(T),
              static_cast<long long>(c.embed_dim), static_cast<long long>(h), static_cast<long long>(kv),
              c.causal ? "yes" : "no", a.backward ? "backward" : "forward");
  std::printf("  median            %.3f ms over %d runs\n", med, a.repeat);
  std::printf("  throughput        %.2f GFLOP/s per rank, %.2f in all\n", gflops_per_rank, gflops_per_rank * P);
  std::printf("  bytes sent        %.3g per rank (rank 0)\n", bytes_all[0]);
  if (s == "ring")
    std::printf("  local kernels     %.3f ms alone; communication %.3f ms alone\n", local, comm_ms);
  else
    std::printf("  local kernels     %.3f ms alone; communication %.3f ms (time − local: not overlapped)\n", local,
                comm_ms);
  if (hidden >= 0) std::printf("  comm hidden       %.3f\n", hidden);
  if (s == "ring") {
    std::printf("  busy per rank    ");
    for (double b : busy_all) std::printf(" %.1f ms", b);
    std::printf("  (min/max %.3f)\n", bmax > 0 ? bmin / bmax : 1.0);
  }
}

}  // namespace mha::cli
