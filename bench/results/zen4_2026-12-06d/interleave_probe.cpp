// A bf16 score tile (4 rows x 4 vectors, 32 pairs of channels: 512 vdpbf16ps) alone and with the
// 16 exps of a softmax tile interleaved (ab.txt §4). Build: g++ -O3 -march=cooperlake -mtune=znver3 -o fz fz.cpp
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdint>
alignas(64) uint32_t kt[64 * 64];
alignas(64) uint32_t q[4 * 64];
alignas(64) float S[8][64];
alignas(64) uint32_t P2[8][32];
alignas(64) float acc_out[16][16];
static inline __m512 exp4(__m512 x, __m512 m, __mmask16* ord) {
  const __m512 xm = _mm512_sub_ps(x, m);
  const __m512 t = _mm512_mul_ps(xm, _mm512_set1_ps(1.44269504088896341f));
  const __mmask16 vis = _mm512_cmp_ps_mask(xm, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(0.0095701f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05591786f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024745f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69312181f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999926f));
  return _mm512_maskz_scalef_ps(vis, p, _mm512_sub_ps(t, f));
}
template <int MODE>
__attribute__((noinline)) void tile(int d2, float* vs_out) {
  __m512 acc[4][4];
  for (int r = 0; r < 4; ++r) for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  __m512 vsum = _mm512_setzero_ps();
  int k = 0;
  for (int c = 0; c < d2; ++c) {
    __m512i kv[4];
    for (int v = 0; v < 4; ++v) kv[v] = _mm512_loadu_si512(kt + c * 64 + v * 16);
    for (int r = 0; r < 4; ++r) {
      const __m512i qv = _mm512_set1_epi32((int)q[r * 64 + c]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)qv, (__m512bh)kv[v]);
    }
    if (MODE == 1 && (c & 3) == 3 && k < 8) {
      const int r = k / 2, v = 2 * (k % 2);
      const __m512 m = _mm512_set1_ps(S[4 + r][63]);
      const __m512 lo = exp4(_mm512_load_ps(&S[r][v * 16]), m, nullptr);
      const __m512 hi = exp4(_mm512_load_ps(&S[r][v * 16 + 16]), m, nullptr);
      vsum = _mm512_add_ps(vsum, _mm512_add_ps(lo, hi));
      _mm512_store_si512(&P2[r][8 * v], (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      ++k;
    }
    if (MODE == 2 && (c & 1) == 1 && k < 16) {
      const int r = k / 4, v = k % 4;
      const __m512 m = _mm512_set1_ps(S[4 + r][63]);
      const __m512 lo = exp4(_mm512_load_ps(&S[r][v * 16]), m, nullptr);
      vsum = _mm512_add_ps(vsum, lo);
      _mm512_store_ps(&S[4+r][v * 16], lo);
      ++k;
    }
  }
  for (int r = 0; r < 4; ++r) for (int v = 0; v < 4; ++v) _mm512_store_ps(acc_out[r * 4 + v], acc[r][v]);
  _mm512_storeu_ps(vs_out, vsum);
}
template <int MODE>
void run(const char* name) {
  alignas(64) float vs[16];
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    const long n = 2000000;
    for (long i = 0; i < n; ++i) tile<MODE>(32, vs);
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n;
    std::printf("%s: %.2f ns per tile = %.1f cycles at 3.66 GHz (512 dp)\n", name, ns, ns * 3.66);
  }
}
int main() {
  for (int i = 0; i < 64 * 64; ++i) kt[i] = 0x3f803f80u;
  for (int i = 0; i < 4 * 64; ++i) q[i] = 0x3c003c00u;
  for (int r = 0; r < 8; ++r) for (int c = 0; c < 64; ++c) S[r][c] = -0.01f * c;
  run<0>("dp only      ");
  run<1>("dp + 16 exps (pairs every 4)");
  run<2>("dp + 16 exps (one every 2)");
}
