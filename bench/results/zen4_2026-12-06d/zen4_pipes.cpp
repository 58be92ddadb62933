// Which 512-bit instructions share pipes on this Zen 4 (bench/results/zen4_2026-12-06d/ab.txt §2):
// nanoseconds per group of instructions, each writing its own register from zeroed inputs (no
// dependences but within a group's repeats). A group that costs no more than its FMAs or dot
// products alone runs on other pipes.
// Build: g++ -O2 -mavx512f -mavx512dq -mavx512bw -mavx512bf16 -o zen4_pipes zen4_pipes.cpp
#include <chrono>
#include <cstdio>
#define FM(x) asm volatile("vfmadd231ps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define MUL(x) asm volatile("vmulps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define ADD(x) asm volatile("vaddps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define MAX(x) asm volatile("vmaxps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define CMP(x) asm volatile("vcmpps $1, %%zmm30, %%zmm31, %%k" #x ::: )
#define PCMP(x) asm volatile("vpcmpud $2, %%zmm30, %%zmm31, %%k" #x ::: )
#define RED(x) asm volatile("vreduceps $0, %%zmm30, %%zmm" #x ::: "xmm" #x)
#define SF(x) asm volatile("vscalefps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define CVT(x) asm volatile("vcvtne2ps2bf16 %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define PADD(x) asm volatile("vpaddd %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define SLL(x) asm volatile("vpslld $23, %%zmm30, %%zmm" #x ::: "xmm" #x)
#define SHF(x) asm volatile("vshuff32x4 $0x44, %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
#define BF(x) asm volatile("vdpbf16ps %%zmm30, %%zmm31, %%zmm" #x ::: "xmm" #x)
template <class Body>
void probe(const char* name, Body body, long iters = 20000000) {
  const auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < iters; ++k) body();
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%-36s %.2f ns per group\n", name, ns / static_cast<double>(iters));
}
int main() {
  asm volatile("vpxord %%zmm30, %%zmm30, %%zmm30; vpxord %%zmm31, %%zmm31, %%zmm31" ::: "xmm30", "xmm31");
  for (int round = 0; round < 2; ++round) {
    std::printf("round %d\n", round);
    // clang-format off
    probe("8 fma", [] { FM(0); FM(1); FM(2); FM(3); FM(4); FM(5); FM(6); FM(7); });
    probe("8 fma + 4 mul", [] { FM(0); MUL(10); FM(1); FM(2); MUL(11); FM(3); FM(4); MUL(12); FM(5); FM(6); MUL(13); FM(7); });
    probe("8 fma + 4 cmp (to a mask)", [] { FM(0); CMP(2); FM(1); FM(2); CMP(3); FM(3); FM(4); CMP(4); FM(5); FM(6); CMP(5); FM(7); });
    probe("8 fma + 4 vpcmpud (to a mask)", [] { FM(0); PCMP(2); FM(1); FM(2); PCMP(3); FM(3); FM(4); PCMP(4); FM(5); FM(6); PCMP(5); FM(7); });
    probe("8 fma + 4 add", [] { FM(0); ADD(10); FM(1); FM(2); ADD(11); FM(3); FM(4); ADD(12); FM(5); FM(6); ADD(13); FM(7); });
    probe("8 fma + 4 reduceps", [] { FM(0); RED(10); FM(1); FM(2); RED(11); FM(3); FM(4); RED(12); FM(5); FM(6); RED(13); FM(7); });
    probe("8 fma + 4 scalefps", [] { FM(0); SF(10); FM(1); FM(2); SF(11); FM(3); FM(4); SF(12); FM(5); FM(6); SF(13); FM(7); });
    probe("8 fma + 4 cvtne2ps2bf16", [] { FM(0); CVT(10); FM(1); FM(2); CVT(11); FM(3); FM(4); CVT(12); FM(5); FM(6); CVT(13); FM(7); });
    probe("8 fma + 4 shuff32x4", [] { FM(0); SHF(10); FM(1); FM(2); SHF(11); FM(3); FM(4); SHF(12); FM(5); FM(6); SHF(13); FM(7); });
    probe("8 add", [] { ADD(0); ADD(1); ADD(2); ADD(3); ADD(4); ADD(5); ADD(6); ADD(7); });
    probe("8 max", [] { MAX(0); MAX(1); MAX(2); MAX(3); MAX(4); MAX(5); MAX(6); MAX(7); });
    probe("8 add + 4 vpaddd", [] { ADD(0); PADD(10); ADD(1); ADD(2); PADD(11); ADD(3); ADD(4); PADD(12); ADD(5); ADD(6); PADD(13); ADD(7); });
    probe("8 add + 4 vpslld", [] { ADD(0); SLL(10); ADD(1); ADD(2); SLL(11); ADD(3); ADD(4); SLL(12); ADD(5); ADD(6); SLL(13); ADD(7); });
    probe("8 reduceps", [] { RED(0); RED(1); RED(2); RED(3); RED(4); RED(5); RED(6); RED(7); });
    probe("8 scalefps", [] { SF(0); SF(1); SF(2); SF(3); SF(4); SF(5); SF(6); SF(7); });
    probe("4 reduceps + 4 scalefps", [] { RED(0); SF(1); RED(2); SF(3); RED(4); SF(5); RED(6); SF(7); });
    probe("4 reduceps + 4 scalefps + 8 add", [] { RED(0); ADD(10); SF(1); ADD(11); RED(2); ADD(12); SF(3); ADD(13); RED(4); ADD(14); SF(5); ADD(15); RED(6); ADD(16); SF(7); ADD(17); });
    probe("8 cvtne2ps2bf16", [] { CVT(0); CVT(1); CVT(2); CVT(3); CVT(4); CVT(5); CVT(6); CVT(7); });
    probe("8 cvtne2ps2bf16 + 8 add", [] { CVT(0); ADD(10); CVT(1); ADD(11); CVT(2); ADD(12); CVT(3); ADD(13); CVT(4); ADD(14); CVT(5); ADD(15); CVT(6); ADD(16); CVT(7); ADD(17); });
    probe("16 vdpbf16ps", [] { BF(0); BF(1); BF(2); BF(3); BF(4); BF(5); BF(6); BF(7); BF(8); BF(9); BF(10); BF(11); BF(12); BF(13); BF(14); BF(15); });
    probe("16 vdpbf16ps + 8 add", [] { BF(0); ADD(16); BF(1); BF(2); ADD(17); BF(3); BF(4); ADD(18); BF(5); BF(6); ADD(19); BF(7); BF(8); ADD(20); BF(9); BF(10); ADD(21); BF(11); BF(12); ADD(22); BF(13); BF(14); ADD(23); BF(15); });
    probe("16 vdpbf16ps + 4 scalefps", [] { BF(0); SF(16); BF(1); BF(2); BF(3); BF(4); SF(17); BF(5); BF(6); BF(7); BF(8); SF(18); BF(9); BF(10); BF(11); BF(12); SF(19); BF(13); BF(14); BF(15); });
    probe("16 vdpbf16ps + 4 reduceps", [] { BF(0); RED(16); BF(1); BF(2); BF(3); BF(4); RED(17); BF(5); BF(6); BF(7); BF(8); RED(18); BF(9); BF(10); BF(11); BF(12); RED(19); BF(13); BF(14); BF(15); });
    probe("16 vdpbf16ps + 4 cvtne2ps2bf16", [] { BF(0); CVT(16); BF(1); BF(2); BF(3); BF(4); CVT(17); BF(5); BF(6); BF(7); BF(8); CVT(18); BF(9); BF(10); BF(11); BF(12); CVT(19); BF(13); BF(14); BF(15); });
    probe("16 vdpbf16ps + 4 fma", [] { BF(0); FM(16); BF(1); BF(2); BF(3); BF(4); FM(17); BF(5); BF(6); BF(7); BF(8); FM(18); BF(9); BF(10); BF(11); BF(12); FM(19); BF(13); BF(14); BF(15); });
    // clang-format on
  }
}
