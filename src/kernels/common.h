// kernels/common.h — small helpers every kernel shares: −inf, rounding, debug assertions,
// carving scratch out of the caller's workspace, and prefetching.
//
// (The vectorised exp is per SIMD target, so it lives in kernels/exp-inl.h.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

#include "mha/tensor.h"

namespace mha::kernels {

/// Element type of the inputs a kernel reads (Q, K, V or a KV cache).
enum class DType : uint8_t { F32, BF16, I8 };  // I8: KV caches only (decode)

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kNegInfDouble = -std::numeric_limits<double>::infinity();
/// Where the float32 kernels' exp (exp_nonpositive) gives 0: below −87, where e^x nears float32's
/// smallest normal number. The fused forward takes it of s − m (m the running max of the key's
/// block) before dividing by the sum, the backwards of s − lse; the double-precision references
/// cut there too (the forward against the row's best key), so that a subnormal probability times
/// inf or NaN in its V row does not make inf on one path and NaN on another (docs/semantics.md,
/// 'NaN': the running max leaves edge cases).
constexpr double kMinLogProbability = -87.0;

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/// An input element as float32, for kernels templated on float or bf16 inputs.
inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return to_float(x); }
inline float to_f32(int8_t x) { return static_cast<float>(x); }

// ---- debug assertions at kernel entry ------------------------------------------------------
// The public layer validates; kernels only assert (in builds without NDEBUG), as gemma.cpp's
// HWY_DASSERT does. A failure names the kernel's file and line and the condition, then aborts.
#ifndef NDEBUG
#define MHA_DASSERT(cond)                                                                 \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "%s:%d: MHA_DASSERT(%s) failed\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)
#else  // the condition is named (so nothing it uses is "unused") but never evaluated
#define MHA_DASSERT(cond) static_cast<void>(sizeof(!(cond)))
#endif

/// Whether a view's rows are what a kernel reading whole rows assumes: unit inner stride and a
/// row stride of at least the row length (or a single row). Extents of zero pass.
template <class View>
bool rows_are_contiguous(const View& v) {
  return v.shape[3] == 0 || (v.stride[3] == 1 && (v.shape[2] <= 1 || v.stride[2] >= v.shape[3]));
}

// ---- scratch carved from the caller's workspace --------------------------------------------
// Kernels never allocate: the caller passes one float buffer of *_workspace_floats() floats.
// Each kernel describes its buffer once, as a WorkspacePlan (a part for the whole call, then one
// part per thread) built with ScratchCarver, and both its *_workspace_floats() and the kernel
// itself read that plan, so the size asked for and the regions used cannot drift apart.

constexpr int64_t kAlignFloats = 16;  // 64 bytes: every region starts on its own cache line

/// Hands out consecutive regions of a buffer, as offsets in floats, each one 64-byte aligned
/// (given an aligned start).
class ScratchCarver {
 public:
  /// Reserves `floats` floats; returns where they start.
  int64_t take(int64_t floats) {
    const int64_t at = used_;
    used_ += round_up(floats, kAlignFloats);
    return at;
  }
  int64_t total() const { return used_; }

 private:
  int64_t used_ = 0;
};

/// The caller's workspace pointer rounded up to the next 64-byte boundary.
inline float* align64(float* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<float*>((addr + 63) & ~uintptr_t{63});
}

/// A kernel's workspace: `shared` floats for the whole call, then `threads` parts of
/// `per_thread` floats, all 64-byte aligned, after up to 63 bytes spent aligning the start.
struct WorkspacePlan {
  int64_t shared = 0, per_thread = 0;
  int threads = 1;

  size_t floats() const {
    return static_cast<size_t>(round_up(shared, kAlignFloats) + threads * round_up(per_thread, kAlignFloats) +
                               kAlignFloats);
  }
  float* shared_part(float* workspace) const { return align64(workspace); }
  float* thread_part(float* workspace, int thread) const {
    return align64(workspace) + round_up(shared, kAlignFloats) + thread * round_up(per_thread, kAlignFloats);
  }
};

// ---- SIMD targets ----------------------------------------------------------------------------

/// The single-target bits of a Highway target mask (HWY_TARGETS of a kernel's file), for tests.
inline std::vector<int64_t> target_bits(int64_t targets) {
  std::vector<int64_t> out;
  for (int64_t t = targets; t != 0; t &= t - 1) out.push_back(t & ~(t - 1));
  return out;
}

// ---- prefetching -----------------------------------------------------------------------------

/// Asks for the cache lines of bytes [offset, offset + bytes) from `base`, four lines a step (a
/// few lines past the end may come along; for rows of one K/V head they are the next row's).
/// kLocality: 3 into L1, 2 into L2. The address is formed as an integer, since it may lie past
/// the end of base's buffer; a prefetch reads no value and never faults. The empty asm statement
/// (no instruction) keeps the loop: without it GCC 12 deleted whole loops of these prefetches
/// (the decode kernel's former far prefetches, the fused forward's next-item ones: no prefetch of them
/// was left in the binary), as loops with no effect.
template <int kLocality = 3>
inline void prefetch_bytes(const void* base, int64_t offset, int64_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(offset);
  const uintptr_t end = start + static_cast<uintptr_t>(bytes);
  for (uintptr_t a = start & ~uintptr_t{63}; a < end; a += 256) {
    asm volatile("");
    const char* c = reinterpret_cast<const char*>(a);
    __builtin_prefetch(c, 0, kLocality);
    __builtin_prefetch(c + 64, 0, kLocality);
    __builtin_prefetch(c + 128, 0, kLocality);
    __builtin_prefetch(c + 192, 0, kLocality);
  }
}

}  // namespace mha::kernels
