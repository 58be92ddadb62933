// internal/machine_peak.cpp — see machine_peak.h.
//
// Compiled for the same Highway targets as the fused attention kernels (kernels/fused_forward.cpp:
// SSSE3 disabled, AVX3_DL wanted), so HWY_DYNAMIC_DISPATCH picks the same target for both.
#include "machine_peak.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "kernels/amx.h"
#include "kernels/fused_forward.h"
#include "mha/error.h"

#ifndef MHA_MACHINE_PEAK_ONCE
#define MHA_MACHINE_PEAK_ONCE
namespace mha::internal::peak {
constexpr int kChains = 12;  // independent FMA chains: > 4-cycle latency × 2 FMA ports, with slack
// The L1-fed tile (tile_chains): a panel of kTileDepth steps, each kTileVecs vectors of B and one
// float of A per tile row, small enough for L1 on every target (16 KiB of B on AVX-512).
constexpr int kTileDepth = 64;
constexpr int kTileVecs = 4;
}  // namespace mha::internal::peak
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "machine_peak.cpp"
#define HWY_DISABLED_TARGETS HWY_SSSE3
#define HWY_WANT_AVX3_DL
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
// clang-format on

#if HWY_TARGET == HWY_AVX3_DL
#include <immintrin.h>
#endif

HWY_BEFORE_NAMESPACE();
namespace mha::internal::peak {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

int64_t f32_lanes() { return static_cast<int64_t>(hn::Lanes(DF())); }

/// kChains independent chains acc = acc·m + a, `iters` steps each; returns their sum (so the work
/// is observable). The values settle near a/(1 − m) = 1: no overflow, no denormals.
float fma_chains(int64_t iters) {
  const DF df;
  VF acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = hn::Set(df, 0.001f * static_cast<float>(i));
  const VF m = hn::Set(df, 0.999f), a = hn::Set(df, 0.001f);
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < kChains; ++i) acc[i] = hn::MulAdd(acc[i], m, a);
  VF sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = hn::Add(sum, acc[i]);
  return hn::GetLane(hn::SumOfLanes(df, sum));
}

/// Rows of the L1-fed tile: the attention kernels' register tile (kernels/fused_forward.cpp, kMR
/// rows × 4 vectors): 6 rows where there are 32 vector registers, 3 where there are 16.
constexpr int tile_rows() { return HWY_LANES(float) >= 16 ? 6 : 3; }
int64_t tile_flops_per_step() { return int64_t{2} * tile_rows() * kTileVecs * kTileDepth * f32_lanes(); }

/// What the kernels' micro-GEMMs do per step, at full speed: a register tile of tile_rows() ×
/// kTileVecs accumulators, each depth step loading kTileVecs vectors of B and broadcasting one
/// float of A per row from L1, `iters` passes over a kTileDepth-deep panel. The ceiling of any
/// FMA loop whose operands come from L1 (loads and broadcasts share the core with the FMAs);
/// values stay near 1e-6·steps: no overflow, no denormals.
float tile_chains(int64_t iters) {
  const DF df;
  constexpr int R = tile_rows();
  const int64_t N = f32_lanes();
  HWY_ALIGN float b[kTileDepth * kTileVecs * (HWY_MAX_BYTES / sizeof(float))];
  HWY_ALIGN float a[R * kTileDepth];
  std::fill(b, b + kTileDepth * kTileVecs * N, 1e-3f);
  std::fill(a, a + R * kTileDepth, 1e-3f);
  VF acc[R * kTileVecs];
  for (auto& v : acc) v = hn::Zero(df);
  for (int64_t n = 0; n < iters; ++n) {
    for (int k = 0; k < kTileDepth; ++k) {
      VF bv[kTileVecs];
      for (int v = 0; v < kTileVecs; ++v) bv[v] = hn::Load(df, b + (k * kTileVecs + v) * N);
      for (int r = 0; r < R; ++r) {
        const VF av = hn::Set(df, a[r * kTileDepth + k]);
        for (int v = 0; v < kTileVecs; ++v) acc[r * kTileVecs + v] = hn::MulAdd(av, bv[v], acc[r * kTileVecs + v]);
      }
    }
    // The panel may change between passes (as a kernel's next block does): no load is hoisted.
    asm volatile("" ::: "memory");
  }
  VF sum = acc[0];
  for (int i = 1; i < R * kTileVecs; ++i) sum = hn::Add(sum, acc[i]);
  return hn::GetLane(hn::SumOfLanes(df, sum));
}

/// Σ p[0 … n) with eight vector accumulators (loads never wait on an addition).
float sum_floats(const float* p, int64_t n) {
  const DF df;
  const int64_t N = f32_lanes();
  VF acc[8];
  for (auto& v : acc) v = hn::Zero(df);
  int64_t i = 0;
  for (; i + 8 * N <= n; i += 8 * N)
    for (int k = 0; k < 8; ++k) acc[k] = hn::Add(acc[k], hn::LoadU(df, p + i + k * N));
  VF sum = acc[0];
  for (int k = 1; k < 8; ++k) sum = hn::Add(sum, acc[k]);
  float s = hn::GetLane(hn::SumOfLanes(df, sum));
  for (; i < n; ++i) s += p[i];
  return s;
}

#if HWY_TARGET == HWY_AVX3_DL
#define MHA_BF16_DOT __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,fma,avx2")))
/// kChains chains of vdpbf16ps (16 lanes × 2 bf16 products each), `iters` steps each.
MHA_BF16_DOT float dot_chains(int64_t iters) {
  __m512 acc[kChains];
  for (auto& v : acc) v = _mm512_setzero_ps();
  // bf16 2^-10 in both halves of every word: each step adds 2·2^-20 to a lane.
  const __m512i x = _mm512_set1_epi32(static_cast<int>(0x3A803A80u));
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)x, (__m512bh)x);
  __m512 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
  return _mm512_reduce_add_ps(sum);
}
bool bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
#else
float dot_chains(int64_t) { return 0.0f; }
bool bf16_dot() { return false; }
#endif

int64_t target() { return HWY_TARGET; }

}  // namespace HWY_NAMESPACE
}  // namespace mha::internal::peak
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::internal {
namespace peak {
HWY_EXPORT(f32_lanes);
HWY_EXPORT(fma_chains);
HWY_EXPORT(tile_chains);
HWY_EXPORT(tile_flops_per_step);
HWY_EXPORT(sum_floats);
HWY_EXPORT(dot_chains);
HWY_EXPORT(bf16_dot);
HWY_EXPORT(target);

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// Runs chain(iters) on every thread at once; calibrates iters to about `ms` per round; returns
/// the best rate in steps per second per thread-summed chain set.
template <class Chain>
double best_steps_per_second(Chain chain, int threads, double ms, int rounds) {
  threads = std::max(1, threads);
  volatile float sink = 0.0f;
  const auto timed = [&](int64_t iters) {
    std::vector<float> out(static_cast<size_t>(threads));
    const auto t0 = clock_type::now();
#pragma omp parallel num_threads(threads)
    out[static_cast<size_t>(omp_get_thread_num())] = chain(iters);
    const double s = seconds_since(t0);
    for (float x : out) sink = sink + x;
    return s;
  };
  // Calibrate on the calling thread alone (a parallel region's wake-up, milliseconds on a loaded
  // machine, must not enter it): double the steps until one run takes a quarter of `ms`, then
  // scale to `ms`. The rounds below then run on every thread.
  int64_t iters = 1 << 10;
  const auto alone = [&](int64_t n) {
    const auto t0 = clock_type::now();
    sink = sink + chain(n);
    return seconds_since(t0);
  };
  double s = alone(iters);
  while (s < 0.25e-3 * ms && iters < (int64_t{1} << 40)) s = alone(iters *= 2);
  for (int r = 0; r < 2; ++r) s = std::min(s, alone(iters));  // a preempted run must not shrink the rounds
  iters = std::max(iters, static_cast<int64_t>(static_cast<double>(iters) * (ms * 1e-3) / s));
  timed(iters / 8 + 1);  // wake the thread team
  double best = 1e30;
  for (int r = 0; r < std::max(1, rounds); ++r) best = std::min(best, timed(iters));
  return static_cast<double>(iters) * threads / best;
}

}  // namespace peak

std::string simd_target_name() { return hwy::TargetName(HWY_DYNAMIC_DISPATCH(peak::target)()); }

double f32_fma_peak_gflops(int threads, double ms_per_round, int rounds) {
  const auto chain = [](int64_t iters) { return HWY_DYNAMIC_DISPATCH(peak::fma_chains)(iters); };
  const double steps = peak::best_steps_per_second(chain, threads, ms_per_round, rounds);
  const double flops_per_step = 2.0 * peak::kChains * static_cast<double>(HWY_DYNAMIC_DISPATCH(peak::f32_lanes)());
  return steps * flops_per_step / 1e9;
}

double f32_tile_peak_gflops(int threads, double ms_per_round, int rounds) {
  const auto chain = [](int64_t iters) { return HWY_DYNAMIC_DISPATCH(peak::tile_chains)(iters); };
  const double steps = peak::best_steps_per_second(chain, threads, ms_per_round, rounds);
  return steps * static_cast<double>(HWY_DYNAMIC_DISPATCH(peak::tile_flops_per_step)()) / 1e9;
}

bool has_bf16_dot() { return HWY_DYNAMIC_DISPATCH(peak::bf16_dot)(); }

double bf16_dot_peak_gflops(int threads, double ms_per_round, int rounds) {
  if (!has_bf16_dot()) return 0.0;
  const auto chain = [](int64_t iters) { return HWY_DYNAMIC_DISPATCH(peak::dot_chains)(iters); };
  const double steps = peak::best_steps_per_second(chain, threads, ms_per_round, rounds);
  return steps * 4.0 * 16.0 * peak::kChains / 1e9;  // 16 lanes × (2 products + 2 additions)
}

double amx_bf16_peak_gflops(int threads, double ms_per_round, int rounds) {
  if (!kernels::amx::available()) return 0.0;
  const auto chain = [](int64_t iters) { return kernels::amx::peak_chains(iters); };
  const double steps = peak::best_steps_per_second(chain, threads, ms_per_round, rounds);
  return steps * 4.0 * 16.0 * 16.0 * 32.0 * 2.0 / 1e9;
}

std::string bf16_products(int64_t head_dim) { return kernels::fused_bf16_products(head_dim); }

double read_bandwidth_gbs(int64_t bytes, int threads, int rounds) {
  threads = std::max(1, threads);
  const int64_t n = std::max<int64_t>(bytes / 4, 1024);
  std::unique_ptr<float[]> a(new float[static_cast<size_t>(n)]);
  const int64_t per = (n + threads - 1) / threads;
#pragma omp parallel num_threads(threads)
  {  // first touch by the thread that reads the part
    const int64_t lo = std::min(n, per * omp_get_thread_num()), hi = std::min(n, lo + per);
    std::fill(a.get() + lo, a.get() + hi, 1.0f);
  }
  double best = 1e30;
  std::vector<float> sums(static_cast<size_t>(threads));
  for (int r = 0; r < std::max(1, rounds); ++r) {
    const auto t0 = peak::clock_type::now();
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      const int64_t lo = std::min(n, per * t), hi = std::min(n, lo + per);
      sums[static_cast<size_t>(t)] = HWY_DYNAMIC_DISPATCH(peak::sum_floats)(a.get() + lo, hi - lo);
    }
    best = std::min(best, peak::seconds_since(t0));
  }
  double total = 0.0;
  for (float s : sums) total += s;
  if (total <= 0.0) fail("read bandwidth: check sum failed");
  return 4.0 * static_cast<double>(n) / best / 1e9;
}

double triad_gbs(int64_t n, int threads, int rounds) {
  threads = std::max(1, threads);
  std::unique_ptr<double[]> a(new double[static_cast<size_t>(n)]), b(new double[static_cast<size_t>(n)]),
      c(new double[static_cast<size_t>(n)]);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) a[i] = 0.0, b[i] = 1.0, c[i] = 2.0;
  double best = 1e30;
  for (int r = 0; r < std::max(1, rounds); ++r) {
    const auto t0 = peak::clock_type::now();
    const double s = 3.0;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
    best = std::min(best, peak::seconds_since(t0));
  }
  if (a[n / 2] != 7.0) fail("triad: check failed");
  return 3.0 * 8.0 * static_cast<double>(n) / best / 1e9;
}

}  // namespace mha::internal
#endif  // HWY_ONCE
