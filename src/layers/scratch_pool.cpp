// layers/scratch_pool.cpp — see scratch_pool.h.
#include "layers/scratch_pool.h"

#include <algorithm>
#include <new>

#include "mha/error.h"
#include "mha/module.h"
#include "mha/tensor.h"

namespace mha::detail {

namespace {

std::unique_ptr<float[]> allocate(size_t floats) {
  try {
    auto buf = std::make_unique_for_overwrite<float[]>(std::max<size_t>(floats, 1));
    if (floats * sizeof(float) >= kHugePageAdviceBytes) advise_huge_pages(buf.get(), floats * sizeof(float));
    return buf;
  } catch (const std::bad_alloc&) {
    fail("MultiheadAttention: cannot allocate ", bytes_str(4.0 * static_cast<double>(floats)), " of working memory");
  }
}

}  // namespace

ScratchPool::Lease& ScratchPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    give_back();
    pool_ = std::move(other.pool_);
    buf_ = std::move(other.buf_);
    floats_ = std::exchange(other.floats_, 0);
  }
  return *this;
}

void ScratchPool::Lease::give_back() {
  if (pool_ && buf_) pool_->put(std::move(buf_), floats_);
  pool_.reset();
  buf_.reset();
  floats_ = 0;
}

ScratchPool::Lease ScratchPool::take(size_t floats) {
  Lease lease;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->first >= floats && (best == free_.end() || it->first < best->first)) best = it;
    if (best != free_.end()) {
      lease.floats_ = best->first;
      lease.buf_ = std::move(best->second);
      free_.erase(best);
    }
  }
  if (!lease.buf_) {
    lease.buf_ = allocate(floats);
    lease.floats_ = floats;
  }
  lease.pool_ = shared_from_this();
  return lease;
}

ScratchPool::Lease ScratchPool::fresh(size_t floats) {
  Lease lease;
  lease.buf_ = allocate(floats);
  lease.floats_ = floats;
  return lease;
}

void ScratchPool::put(std::unique_ptr<float[]> buf, size_t floats) {
  std::unique_ptr<float[]> dropped;  // freed outside the lock
  const std::lock_guard<std::mutex> lock(mu_);
  free_.emplace_back(floats, std::move(buf));
  if (free_.size() > kMaxFree) {  // keep the largest: they serve every smaller request too
    const auto smallest =
        std::min_element(free_.begin(), free_.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    dropped = std::move(smallest->second);
    free_.erase(smallest);
  }
}

void ScratchPool::release() {
  std::vector<std::pair<size_t, std::unique_ptr<float[]>>> dropped;
  const std::lock_guard<std::mutex> lock(mu_);
  dropped.swap(free_);
}

size_t ScratchPool::free_buffers() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

size_t ScratchPool::free_floats() const {
  const std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& f : free_) n += f.first;
  return n;
}

ModuleScratch::ModuleScratch() : pool(ScratchPool::make()) {}
ModuleScratch::ModuleScratch(const ModuleScratch&) : ModuleScratch() {}
ModuleScratch::ModuleScratch(ModuleScratch&& other) noexcept : pool(other.pool) {}
ModuleScratch& ModuleScratch::operator=(const ModuleScratch&) { return *this; }
ModuleScratch& ModuleScratch::operator=(ModuleScratch&& other) noexcept {
  pool = other.pool;
  return *this;
}
ModuleScratch::~ModuleScratch() = default;

}  // namespace mha::detail
