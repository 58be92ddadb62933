// kernels/amx.h — Intel AMX (Advanced Matrix Extensions) tile micro-GEMMs for the fused kernel's
// bfloat16 products, and whether this CPU and OS let the process use them.
//
// AMX has eight tile registers of up to 16 rows × 64 bytes and one instruction, tdpbf16ps, that
// adds A·B to a float32 tile C (16 × 16) for A a tile of 16 rows × 32 bf16 and B one of 16 rows ×
// 16 bf16 pairs (the pairs are consecutive elements of the reduction dimension: the "VNNI"
// layout). On a Sapphire Rapids core that is 1024 multiply-adds a cycle, ~15× what the float32
// FMAs give and ~30× vdpbf16ps (measured: 3.5 TFLOP/s a core against 235 and 118 GFLOP/s), so
// with it the products cost little next to the softmax.
//
// The operands are the layouts the fused kernel's bf16 path already packs (kernels/
// fused_forward.cpp): bf16 pairs in 32-bit words. Shapes (words are bf16 pairs):
//   scores:     S (rows × 16·key_tiles floats, ld lds) = Q2 (rows × d2 words, ld ldq2) ·
//               Kt2 (d2 rows × 16·key_tiles words, ld ldk2): C[i][j] = Σ_c Q2[i][c] · Kt2[c][j].
//   accumulate: O (rows × 16·col_tiles floats, ld ldo) += P2 (rows × n2 words, ld ldp2) ·
//               V2 (n2 rows × 16·col_tiles words, ld ldv2), n2 key pairs.
// rows is a multiple of 16 and d2 of 16 (head dims that are multiples of 32). A ragged n2 needs
// `tail`, a thread's scratch of 16 × ldv2 words: the last pairs' V rows are copied there with zero
// rows after them, and P2's words from n2 to the next multiple of 16 are set to zero (P2 is the
// caller's scratch), so that nothing past n2 enters a product — not even 0 × a NaN.
// Tiles are the calling thread's state: call configure() before the products of a work item and
// release() after them. The arithmetic of a call depends on its operands only, not on the thread.
#pragma once

#include <cstdint>

namespace mha::kernels::amx {

/// The CPU has AMX-TILE and AMX-BF16, the OS saves tile state (XCR0), and the process was granted
/// the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, asked once). Unless MHA_AMX=0 is set in the
/// environment, which keeps every call on the vector instructions (for comparisons).
bool available();
/// available() and not switched off by set_allowed_for_test(false).
bool enabled();
/// Tests: run the bf16 kernels with (true, the default) or without AMX from now on.
void set_allowed_for_test(bool allowed);

/// Loads the tile configuration the products below use: all eight tiles 16 rows × 64 bytes.
void configure();
/// Returns the tiles to their initial state (smaller context switches).
void release();

void scores(const uint32_t* q2, int64_t ldq2, int64_t rows, int64_t d2, const uint32_t* kt2, int64_t ldk2,
            int64_t key_tiles, float* s, int64_t lds);
/// Four independent tile products (16·16·32 multiply-adds each), `iters` times, on zero tiles of
/// the calling thread: for measuring the machine's AMX peak (internal/machine_peak.h). Returns 0.
float peak_chains(int64_t iters);

void accumulate(uint32_t* p2, int64_t ldp2, int64_t rows, int64_t n2, const uint32_t* v2, int64_t ldv2,
                int64_t col_tiles, float* o, int64_t ldo, uint32_t* tail);

}  // namespace mha::kernels::amx
