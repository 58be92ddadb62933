// layers/scratch_pool.h — working buffers that a module's forward calls reuse. Internal.
//
// Every forward needs a few large buffers that it fully overwrites before reading: the projected
// Q/K/V rows and the attention heads. Allocating (and zero-filling) them afresh each call costs more
// than the arithmetic for batches of short sequences: tens of MiB of memset, and the kernel's
// page-fault path for every fresh page. A module keeps them in a ScratchPool instead: a call
// checks buffers out (a Lease) and hands them back when it ends; the next call of the same or a
// smaller size reuses them. Concurrent calls on one module each check out their own buffers
// (under a mutex), so they never share one. Buffers are never zero-filled: only what a call
// writes in full before reading may live in one.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace mha::detail {

class ScratchPool : public std::enable_shared_from_this<ScratchPool> {
 public:
  /// Sole use of a buffer of at least the floats asked for, contents unspecified; back to its pool
  /// (if any) when the lease ends.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept = default;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { give_back(); }

    float* data() const { return buf_.get(); }
    size_t capacity() const { return floats_; }

   private:
    friend class ScratchPool;
    void give_back();
    std::shared_ptr<ScratchPool> pool_;
    std::unique_ptr<float[]> buf_;
    size_t floats_ = 0;
  };

  static std::shared_ptr<ScratchPool> make() { return std::shared_ptr<ScratchPool>(new ScratchPool()); }

  /// A buffer of ≥ `floats` floats: the smallest free one that fits, else a fresh allocation
  /// (not zero-filled). Throws mha::Error when memory runs out.
  Lease take(size_t floats);
  /// A fresh buffer that belongs to no pool (freed when the lease ends).
  static Lease fresh(size_t floats);

  /// Frees every buffer not checked out now.
  void release();
  /// Buffers kept free now, and their floats (for tests and diagnostics).
  size_t free_buffers() const;
  size_t free_floats() const;

 private:
  ScratchPool() = default;
  void put(std::unique_ptr<float[]> buf, size_t floats);

  static constexpr size_t kMaxFree = 8;  // several concurrent calls × two buffers each
  mutable std::mutex mu_;
  std::vector<std::pair<size_t, std::unique_ptr<float[]>>> free_;
};

}  // namespace mha::detail
