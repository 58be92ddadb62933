// internal/machine_peak.h — this machine's arithmetic peak and memory bandwidth, measured in the
// same process as a benchmark, so `mha bench` and `mha bench-decode` can report what fraction of
// the hardware a kernel reached (issue 15: honest denominators).
//
// The FMA peaks run on the SIMD target the attention kernels dispatch to (the same Highway
// dynamic dispatch, the same compiled target list), on every thread given, each thread running
// independent multiply-add chains (more chains than FMA latency × FMA ports, so the units never
// wait on a result), for 20 ms per round (calibrated on one thread); the best of 5 rounds counts.
#pragma once

#include <cstdint>
#include <string>

namespace mha::internal {

/// The Highway target the kernels dispatch to now, by name ("AVX3_ZEN4", "AVX3_DL", "AVX2", …).
std::string simd_target_name();

/// float32 FMA peak in GFLOP/s (one FMA = 2 FLOPs per lane) on `threads` threads.
double f32_fma_peak_gflops(int threads, double ms_per_round = 20.0, int rounds = 5);

/// float32 FMA rate in GFLOP/s of the attention kernels' register tile fed from L1: each step
/// loads 4 vectors and broadcasts one float per tile row for its 4 × rows FMAs, as their
/// micro-GEMMs do. The attainable ceiling of such a loop, below f32_fma_peak_gflops where loads
/// and broadcasts compete with the FMAs for issue (0.78–0.87 of it, median 0.85, on an Intel Xeon
/// with two 512-bit FMA ports, 2026-12-04): a second denominator, for how far a kernel is from
/// its own loop.
double f32_tile_peak_gflops(int threads, double ms_per_round = 20.0, int rounds = 5);

/// Whether the dispatched target multiplies bf16 pairs into float32 (vdpbf16ps), as the fused
/// forward does for bf16 inputs.
bool has_bf16_dot();

/// bf16 dot-product peak in GFLOP/s (vdpbf16ps: 2 products and 2 additions per lane) on
/// `threads` threads; 0 when has_bf16_dot() is false (bf16 is then widened to float32 and the
/// float32 peak applies).
double bf16_dot_peak_gflops(int threads, double ms_per_round = 20.0, int rounds = 5);

/// AMX bf16 tile peak in GFLOP/s (tdpbf16ps: 16·16·32 multiply-adds, 2 FLOPs each) on `threads`
/// threads; 0 where the CPU or OS gives no AMX (kernels/amx.h), whose products the fused bf16
/// forward then runs on where it has them.
double amx_bf16_peak_gflops(int threads, double ms_per_round = 20.0, int rounds = 5);

/// What the fused bf16 forward multiplies on for head dim d (kernels/fused_forward.h): "amx",
/// "vdpbf16ps" or "float32"; its peak is then amx_bf16_peak_gflops, bf16_dot_peak_gflops or
/// f32_fma_peak_gflops.
std::string bf16_products(int64_t head_dim);

/// Read-only memory bandwidth in GB/s: `threads` threads summing `bytes` of float32 (first-touched
/// by the threads that read them), best of `rounds`. Choose `bytes` well beyond the last-level cache.
double read_bandwidth_gbs(int64_t bytes, int threads, int rounds = 5);

/// STREAM triad a[i] = b[i] + s·c[i] over three arrays of `n` doubles, best of `rounds`; bytes
/// counted as STREAM does (3 · 8 · n, no write-allocate).
double triad_gbs(int64_t n, int threads, int rounds = 5);

}  // namespace mha::internal
