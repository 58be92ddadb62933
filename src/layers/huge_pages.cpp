// layers/huge_pages.cpp — transparent-huge-page advice for large buffers (mha/tensor.h).
#include <cstdint>

#include "mha/tensor.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace mha::detail {

void advise_huge_pages(const void* p, size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  // Failure (THP disabled, an old kernel) leaves ordinary pages: the advice is an optimisation.
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace mha::detail
