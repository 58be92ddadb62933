// kernels/amx.cpp — AMX tile micro-GEMMs (see kernels/amx.h for shapes and layouts).
//
// The instructions are written as inline assembly rather than through the compilers' intrinsics:
// GCC's are macros over the same assembly, Clang's need every caller compiled for AMX, and the
// tile registers must be named by constants either way. Nothing here runs unless available()
// said yes, so the file needs no AMX compiler flags.
#include "kernels/amx.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define MHA_HAVE_AMX 1
#else
#define MHA_HAVE_AMX 0
#endif

namespace mha::kernels::amx {

namespace {

std::atomic<bool> allowed{true};

#if MHA_HAVE_AMX
bool detect() {
  const char* env = std::getenv("MHA_AMX");
  if (env && std::strcmp(env, "0") == 0) return false;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
  if (!tile || !bf16) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return false;  // OSXSAVE: xgetbv works
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3u) != 3u) return false;  // XTILECFG and XTILEDATA enabled by the OS
  // Linux hands the (8 KiB) tile data state to a process only when asked (since 5.16).
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Tile register numbers must be constants in the instruction text.
#define MHA_TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define MHA_TILE_LOAD(t, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define MHA_TILE_STORE(t, base, stride) \
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
// C += A·B, AT&T operand order: B, A, C.
#define MHA_TILE_DP(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kWordsPerRow = 16;  // 64 bytes of a tile row: 16 bf16 pairs or 16 floats

// One block of C tiles: RG row groups × CG column groups of 16, C tiles 0, 1 (row group 0) and 2,
// 3 (row group 1), A tiles 4, 5 and B tiles 6, 7. kLoadC: C starts from what lies at c (the
// accumulate form), else from zero. The reduction runs over `steps` words of A rows (16 a step);
// B for step k is at b_step(k) (ldb bytes between its rows).
template <int RG, int CG, bool kLoadC, class BStep>
inline void tile_block(const uint32_t* a, int64_t lda_bytes, int64_t steps, const BStep& b_step, int64_t ldb_bytes,
                       float* c, int64_t ldc) {
  const int64_t ldc_bytes = ldc * 4;
  float* c1 = c + 16 * ldc;  // row group 1
  if constexpr (kLoadC) {
    MHA_TILE_LOAD(0, c, ldc_bytes);
    if constexpr (CG > 1) MHA_TILE_LOAD(1, c + 16, ldc_bytes);
    if constexpr (RG > 1) MHA_TILE_LOAD(2, c1, ldc_bytes);
    if constexpr (RG > 1 && CG > 1) MHA_TILE_LOAD(3, c1 + 16, ldc_bytes);
  } else {
    MHA_TILE_ZERO(0);
    if constexpr (CG > 1) MHA_TILE_ZERO(1);
    if constexpr (RG > 1) MHA_TILE_ZERO(2);
    if constexpr (RG > 1 && CG > 1) MHA_TILE_ZERO(3);
  }
  const int64_t a_group = 16 * (lda_bytes / 4);  // words from one row group of A to the next
  for (int64_t k = 0; k < steps; ++k) {
    const uint32_t* ak = a + k * kWordsPerRow;
    const uint32_t* bk = b_step(k);
    MHA_TILE_LOAD(4, ak, lda_bytes);
    MHA_TILE_LOAD(6, bk, ldb_bytes);
    if constexpr (RG > 1) MHA_TILE_LOAD(5, ak + a_group, lda_bytes);
    if constexpr (CG > 1) MHA_TILE_LOAD(7, bk + 16, ldb_bytes);
    MHA_TILE_DP(0, 4, 6);
    if constexpr (CG > 1) MHA_TILE_DP(1, 4, 7);
    if constexpr (RG > 1) MHA_TILE_DP(2, 5, 6);
    if constexpr (RG > 1 && CG > 1) MHA_TILE_DP(3, 5, 7);
  }
  MHA_TILE_STORE(0, c, ldc_bytes);
  if constexpr (CG > 1) MHA_TILE_STORE(1, c + 16, ldc_bytes);
  if constexpr (RG > 1) MHA_TILE_STORE(2, c1, ldc_bytes);
  if constexpr (RG > 1 && CG > 1) MHA_TILE_STORE(3, c1 + 16, ldc_bytes);
}

// Every (row group pair, column group pair) of a rows × 16·col_tiles product.
template <bool kLoadC, class BStep>
void tile_product(const uint32_t* a, int64_t lda, int64_t rows, int64_t steps, const BStep& b_step, int64_t ldb,
                  int64_t col_tiles, float* c, int64_t ldc) {
  const int64_t groups = rows / 16;
  for (int64_t rg = 0; rg < groups; rg += 2) {
    const uint32_t* ar = a + rg * 16 * lda;
    float* cr = c + rg * 16 * ldc;
    const bool two_rows = rg + 1 < groups;
    for (int64_t cg = 0; cg < col_tiles; cg += 2) {
      const auto b_cols = [&](int64_t k) { return b_step(k) + cg * 16; };
      const bool two_cols = cg + 1 < col_tiles;
      float* cc = cr + cg * 16;
      if (two_rows && two_cols)
        tile_block<2, 2, kLoadC>(ar, lda * 4, steps, b_cols, ldb * 4, cc, ldc);
      else if (two_rows)
        tile_block<2, 1, kLoadC>(ar, lda * 4, steps, b_cols, ldb * 4, cc, ldc);
      else if (two_cols)
        tile_block<1, 2, kLoadC>(ar, lda * 4, steps, b_cols, ldb * 4, cc, ldc);
      else
        tile_block<1, 1, kLoadC>(ar, lda * 4, steps, b_cols, ldb * 4, cc, ldc);
    }
  }
}
#endif  // MHA_HAVE_AMX

}  // namespace

bool available() {
#if MHA_HAVE_AMX
  static const bool usable = detect();
  return usable;
#else
  return false;
#endif
}

bool enabled() { return allowed.load(std::memory_order_relaxed) && available(); }

void set_allowed_for_test(bool allow) { allowed.store(allow, std::memory_order_relaxed); }

#if MHA_HAVE_AMX
void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

void release() { __asm__ volatile("tilerelease" ::); }

void scores(const uint32_t* q2, int64_t ldq2, int64_t rows, int64_t d2, const uint32_t* kt2, int64_t ldk2,
            int64_t key_tiles, float* s, int64_t lds) {
  // Step k reduces over Q2's words [16k, 16k + 16): Kt2's rows of those pairs.
  const auto b_step = [&](int64_t k) { return kt2 + k * kWordsPerRow * ldk2; };
  tile_product<false>(q2, ldq2, rows, d2 / kWordsPerRow, b_step, ldk2, key_tiles, s, lds);
}

void accumulate(uint32_t* p2, int64_t ldp2, int64_t rows, int64_t n2, const uint32_t* v2, int64_t ldv2,
                int64_t col_tiles, float* o, int64_t ldo, uint32_t* tail) {
  const int64_t full = n2 / kWordsPerRow, ragged = n2 % kWordsPerRow, steps = full + (ragged ? 1 : 0);
  if (ragged) {
    // The last step's pairs: V2 rows [16·full, n2) then zero rows; P2's words past n2 zero.
    const int64_t cols = col_tiles * 16;
    for (int64_t r = 0; r < kWordsPerRow; ++r) {
      uint32_t* dst = tail + r * ldv2;
      if (r < ragged)
        std::memcpy(dst, v2 + (full * kWordsPerRow + r) * ldv2, sizeof(uint32_t) * static_cast<size_t>(cols));
      else
        std::memset(dst, 0, sizeof(uint32_t) * static_cast<size_t>(cols));
    }
    for (int64_t r = 0; r < rows; ++r)
      std::memset(p2 + r * ldp2 + n2, 0, sizeof(uint32_t) * static_cast<size_t>(kWordsPerRow - ragged));
  }
  const auto b_step = [&](int64_t k) { return k < full ? v2 + k * kWordsPerRow * ldv2 : tail; };
  tile_product<true>(p2, ldp2, rows, steps, b_step, ldv2, col_tiles, o, ldo);
}
float peak_chains(int64_t iters) {
  configure();
  MHA_TILE_ZERO(0);
  MHA_TILE_ZERO(1);
  MHA_TILE_ZERO(2);
  MHA_TILE_ZERO(3);
  MHA_TILE_ZERO(4);
  MHA_TILE_ZERO(5);
  MHA_TILE_ZERO(6);
  MHA_TILE_ZERO(7);
  for (int64_t i = 0; i < iters; ++i) {
    MHA_TILE_DP(0, 4, 6);
    MHA_TILE_DP(1, 4, 7);
    MHA_TILE_DP(2, 5, 6);
    MHA_TILE_DP(3, 5, 7);
  }
  release();
  return 0.0f;
}
#else
float peak_chains(int64_t) { return 0.0f; }
void configure() {}
void release() {}
void scores(const uint32_t*, int64_t, int64_t, int64_t, const uint32_t*, int64_t, int64_t, float*, int64_t) {}
void accumulate(uint32_t*, int64_t, int64_t, int64_t, const uint32_t*, int64_t, int64_t, float*, int64_t, uint32_t*) {}
#endif

}  // namespace mha::kernels::amx
