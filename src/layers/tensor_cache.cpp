// layers/tensor_cache.cpp — the cache of freed tensor blocks (mha/tensor.h, tensor_cache_limit).
#include <cstdlib>
#include <deque>
#include <mutex>
#include <new>

#include "mha/tensor.h"

#if defined(__SANITIZE_ADDRESS__)
#define MHA_TENSOR_CACHE_OFF_BY_DEFAULT 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MHA_TENSOR_CACHE_OFF_BY_DEFAULT 1
#endif
#endif

namespace mha {

namespace {

constexpr size_t kBlockAlign = size_t{2} << 20;  // whole huge pages (advise_huge_pages)

size_t default_limit() {
#ifdef MHA_TENSOR_CACHE_OFF_BY_DEFAULT
  return 0;
#else
  if (const char* mib = std::getenv("MHA_TENSOR_CACHE_MIB")) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(mib, &end, 10);
    if (end != mib && *end == '\0' && v <= (SIZE_MAX >> 20)) return static_cast<size_t>(v) << 20;
  }
  return size_t{256} << 20;
#endif
}

struct Block {
  void* p;
  size_t bytes;
};

/// Freed blocks, most recent first, and their bytes; every access under `mutex`.
struct Cache {
  std::mutex mutex;
  std::deque<Block> blocks;
  size_t bytes = 0;
  size_t limit = default_limit();

  /// Frees the oldest blocks until at most `keep` bytes stay; returns the bytes freed.
  size_t trim(size_t keep) noexcept {
    size_t freed = 0;
    while (bytes > keep && !blocks.empty()) {
      std::free(blocks.back().p);
      freed += blocks.back().bytes;
      bytes -= blocks.back().bytes;
      blocks.pop_back();
    }
    return freed;
  }
};

Cache& cache() {
  static Cache* const c = new Cache;  // never destroyed: tensors may be freed during static destruction
  return *c;
}

}  // namespace

size_t cached_tensor_bytes() noexcept {
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mutex);
  return c.bytes;
}

size_t release_cached_tensors() noexcept {
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mutex);
  return c.trim(0);
}

size_t tensor_cache_limit() noexcept {
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mutex);
  return c.limit;
}

void set_tensor_cache_limit(size_t bytes) noexcept {
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mutex);
  c.limit = bytes;
  c.trim(bytes);
}

namespace detail {

void* allocate_block(size_t bytes) {
  Cache& c = cache();
  {
    const std::lock_guard<std::mutex> lock(c.mutex);
    for (auto it = c.blocks.begin(); it != c.blocks.end(); ++it)
      if (it->bytes == bytes) {
        void* p = it->p;
        c.bytes -= bytes;
        c.blocks.erase(it);
        return p;
      }
  }
  if (bytes > SIZE_MAX - kBlockAlign) throw std::bad_alloc();
  const size_t rounded = (bytes + kBlockAlign - 1) / kBlockAlign * kBlockAlign;
  void* p = std::aligned_alloc(kBlockAlign, rounded);
  if (!p && release_cached_tensors() > 0) p = std::aligned_alloc(kBlockAlign, rounded);  // the cache's memory first
  if (!p) throw std::bad_alloc();
  return p;
}

void free_block(void* p, size_t bytes) noexcept {
  if (!p) return;
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mutex);
  if (bytes > c.limit) {
    std::free(p);
    return;
  }
  try {
    c.blocks.push_front({p, bytes});
  } catch (...) {  // no room to note it: free it
    std::free(p);
    return;
  }
  c.bytes += bytes;
  c.trim(c.limit);
}

}  // namespace detail

}  // namespace mha
