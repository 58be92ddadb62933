// Links mha::dist from the installed package; needs no MPI_Init (sequence_segments is local).
#include <cstdio>

#include <mha/dist.h>

int main() {
  const auto segs = mha::dist::sequence_segments(10, 2, 1, mha::dist::SeqLayout::Zigzag);
  if (segs.size() != 2 || segs[0].start != 3 || segs[1].start != 6) return 1;
  std::printf("dist consumer ok: %zu segments\n", segs.size());
  return 0;
}
