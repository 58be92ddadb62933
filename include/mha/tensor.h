// mha/tensor.h — owners and views.
//
// A Tensor owns contiguous row-major storage and knows its shape. A View4 is a non-owning,
// strided window over four dimensions (batch, head, row, column) — what the kernels take.
// Copies between the two are explicit; a view never outlives the storage it points into.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "mha/error.h"

namespace mha {

using Shape = std::vector<int64_t>;

/// Tensors of at least 4 MiB take their storage from a process-wide cache of freed blocks, so
/// that a call repeated with the same shapes (a module's output, its attention weights: 128 MiB
/// per head set at T = 2048, h = 8) reuses memory whose pages are already mapped instead of
/// having the kernel map and zero fresh pages on first touch (a fifth of such a call's time on a
/// virtual machine). A block is reused for a request of exactly its size; the cache keeps the most
/// recently freed blocks up to a limit in bytes and frees the oldest beyond it. The limit is
/// 256 MiB, or MHA_TENSOR_CACHE_MIB mebibytes when that is set when the cache is first used
/// (0 turns the cache off); builds under AddressSanitizer start with it off, so that a read after
/// free is still caught. The attention kernels' workspaces of that size (sdpa's packed K/V, the
/// backward's dense copies of Q and dO) come from the same cache. Thread-safe.
/// Bytes held in freed blocks now.
size_t cached_tensor_bytes() noexcept;
/// Frees every cached block; returns the bytes freed.
size_t release_cached_tensors() noexcept;
/// The cache's limit in bytes (0: off).
size_t tensor_cache_limit() noexcept;
/// Sets the limit, freeing the oldest cached blocks beyond it.
void set_tensor_cache_limit(size_t bytes) noexcept;

namespace detail {
/// Large buffers are worth backing with transparent huge pages: on Linux with THP in "madvise"
/// mode, a fresh 128 MiB buffer otherwise takes 32768 page faults on first touch (about a second
/// on a loaded virtual machine, against tens of milliseconds with 2 MiB pages). Tensor storage of
/// this size and more also goes through the cache of freed blocks (tensor_cache_limit).
inline constexpr size_t kHugePageAdviceBytes = size_t{4} << 20;
/// A block of `bytes` (≥ kHugePageAdviceBytes): a cached one of that size, else a new one aligned to
/// 2 MiB (whole huge pages). Throws std::bad_alloc.
void* allocate_block(size_t bytes);
/// Gives back a block from allocate_block of that size: cached, or freed.
void free_block(void* p, size_t bytes) noexcept;

/// std::allocator, except that elements a vector adds without a value (resize(n)) are left
/// default-initialised, which for float, bf16 and uint8 means not written: a tensor whose every
/// element a kernel writes first (Tensor::uninitialized) then skips a pass that zero-fills it.
/// Elements given a value (assign(n, v), copies) are constructed as with std::allocator. Storage
/// of kHugePageAdviceBytes and more comes from the cache of freed blocks (allocate_block).
template <class T>
struct NoFillAllocator : std::allocator<T> {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = NoFillAllocator<U>;
  };
  NoFillAllocator() noexcept = default;
  template <class U>
  NoFillAllocator(const NoFillAllocator<U>&) noexcept {}
  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_array_new_length();
    if (n * sizeof(T) >= kHugePageAdviceBytes) return static_cast<T*>(allocate_block(n * sizeof(T)));
    return std::allocator<T>::allocate(n);
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n * sizeof(T) >= kHugePageAdviceBytes)
      free_block(p, n * sizeof(T));
    else
      std::allocator<T>::deallocate(p, n);
  }
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
}  // namespace detail

/// A tensor's storage: a std::vector whose resize(n) does not fill (detail::NoFillAllocator).
template <class T>
using TensorStorage = std::vector<T, detail::NoFillAllocator<T>>;

namespace detail {
/// Asks the kernel for huge pages over the 2 MiB-aligned interior of [p, p + bytes) before it is
/// first touched (madvise MADV_HUGEPAGE). Advice only: does nothing where unsupported or refused.
void advise_huge_pages(const void* p, size_t bytes) noexcept;
}  // namespace detail

/// bfloat16 storage: the top 16 bits of an IEEE float32.
struct bf16 {
  uint16_t bits = 0;
};

/// Round-to-nearest-even float32 → bfloat16 (NaN stays NaN).
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

inline float to_float(bf16 b) {
  uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// The element count of `shape`. Shapes come from files and callers, so this is checked: a
/// negative extent, or extents whose non-zero product leaves int64, throws mha::Error naming the
/// shape. Requiring the product of the non-zero extents to fit (not just the total, which a zero
/// extent makes 0) keeps every stride computed from such a shape in range too.
inline int64_t shape_numel(const Shape& shape) {
  int64_t nonzero = 1;
  bool empty = false;
  for (int64_t s : shape) {
    if (s < 0) fail("shape ", shape_str(shape), " has a negative extent");
    if (s == 0) {
      empty = true;
      continue;
    }
    if (__builtin_mul_overflow(nonzero, s, &nonzero))
      fail("shape ", shape_str(shape), " has more elements than fit in 64 bits");
  }
  return empty ? 0 : nonzero;
}

/// Non-owning strided view over four dimensions. Strides are in elements and may be 0
/// (broadcast along that dimension) or larger than the extent (a window into a bigger tensor).
template <class T>
struct View4 {
  T* data = nullptr;
  std::array<int64_t, 4> shape{0, 0, 0, 0};
  std::array<int64_t, 4> stride{0, 0, 0, 0};

  /// Whether the view points at data (an absent optional output or mask has none).
  bool defined() const { return data != nullptr; }
  T& operator()(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
    return data[i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3]];
  }
  T* row(int64_t i0, int64_t i1, int64_t i2) const { return data + i0 * stride[0] + i1 * stride[1] + i2 * stride[2]; }
  Shape shape_vec() const { return {shape[0], shape[1], shape[2], shape[3]}; }
  /// A const view of the same window.
  operator View4<const T>() const { return {data, shape, stride}; }
};

/// "(n0, n1, n2, n3)": a view's extents, for error messages.
template <class T>
std::string shape_str(const View4<T>& v) {
  return shape_str(v.shape_vec());
}

/// A contiguous row-major view of `shape` starting at `data`.
template <class T>
View4<T> contiguous_view(T* data, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
  return {data, {n0, n1, n2, n3}, {n1 * n2 * n3, n2 * n3, n3, 1}};
}

/// Owning, contiguous, row-major tensor of any rank (float, bf16 or uint8 elements).
template <class T>
class BasicTensor {
 public:
  BasicTensor() = default;
  /// `shape` with every element `fill` (zeros by default).
  explicit BasicTensor(Shape shape, T fill = T{}) : shape_(std::move(shape)) { allocate(&fill); }
  /// `shape` with the given values, row-major (copied).
  BasicTensor(Shape shape, const std::vector<T>& values)
      : BasicTensor(std::move(shape), TensorStorage<T>(values.begin(), values.end())) {}
  BasicTensor(Shape shape, std::initializer_list<T> values)
      : BasicTensor(std::move(shape), TensorStorage<T>(values.begin(), values.end())) {}
  /// `shape` over the given storage (moved, not copied).
  BasicTensor(Shape shape, TensorStorage<T> values) : shape_(std::move(shape)), data_(std::move(values)) {
    if (static_cast<int64_t>(data_.size()) != shape_numel(shape_))
      fail("Tensor: ", data_.size(), " values do not fill shape ", shape_str(shape_));
  }
  /// `shape` with its elements not written: for outputs that are overwritten in full before anything
  /// reads them, which then cost no pass that fills them. Reading an element first is undefined.
  [[nodiscard]] static BasicTensor uninitialized(Shape shape) {
    BasicTensor t;
    t.shape_ = std::move(shape);
    t.allocate(nullptr);
    return t;
  }

  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  /// The extent of `axis` (negative counts from the end, as in PyTorch); mha::Error outside [−dim, dim).
  int64_t size(int64_t axis) const {
    if (axis < -dim() || axis >= dim())
      fail("Tensor::size: axis ", axis, " of a rank-", dim(), " tensor ", shape_str(shape_));
    return shape_[static_cast<size_t>(axis < 0 ? axis + dim() : axis)];
  }
  int64_t numel() const { return static_cast<int64_t>(data_.size()); }
  bool defined() const { return !shape_.empty() || !data_.empty(); }

  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  std::span<T> values() { return data_; }
  std::span<const T> values() const { return data_; }
  TensorStorage<T>& storage() { return data_; }
  const TensorStorage<T>& storage() const { return data_; }

  /// Element access by full index: one index per axis (else mha::Error: a missing index silently
  /// flattened the rest, an extra one read past the shape); each index's range is the caller's
  /// responsibility, as for std::vector's [].
  T& at(std::initializer_list<int64_t> index) { return data_[offset(index)]; }
  const T& at(std::initializer_list<int64_t> index) const { return data_[offset(index)]; }

  /// A copy of the values under a new shape with the same element count. The storage is copied,
  /// not shared: writes to the result do not show in this tensor (O(numel) time and memory).
  [[nodiscard]] BasicTensor reshaped(Shape shape) const {
    if (shape_numel(shape) != numel())
      fail("Tensor::reshaped: cannot reshape ", shape_str(shape_), " to ", shape_str(shape));
    return BasicTensor(std::move(shape), data_);
  }

  /// A 4-D view; tensors of lower rank are padded with leading 1s.
  View4<T> view4() { return make_view4<T>(data_.data()); }
  View4<const T> view4() const { return make_view4<const T>(data_.data()); }

 private:
  /// shape_'s elements, each *fill, or left unwritten where fill is null.
  void allocate(const T* fill) {
    for (int64_t s : shape_)
      if (s < 0) fail("Tensor: negative extent in shape ", shape_str(shape_));
    const int64_t n = shape_numel(shape_);
    const int64_t bytes = checked_mul(n, static_cast<int64_t>(sizeof(T)), "Tensor " + shape_str(shape_));
    try {
      if (static_cast<size_t>(bytes) >= detail::kHugePageAdviceBytes) {
        data_.reserve(static_cast<size_t>(n));  // allocate, advise, then touch
        detail::advise_huge_pages(data_.data(), static_cast<size_t>(bytes));
      }
      if (fill)
        data_.assign(static_cast<size_t>(n), *fill);
      else
        data_.resize(static_cast<size_t>(n));
    } catch (const std::bad_alloc&) {
      fail("Tensor: cannot allocate ", shape_str(shape_), ": ", bytes_str(static_cast<double>(bytes)), " (", bytes,
           " bytes)");
    } catch (const std::length_error&) {
      fail("Tensor: cannot allocate ", shape_str(shape_), ": ", bytes_str(static_cast<double>(bytes)), " (", bytes,
           " bytes)");
    }
  }
  size_t offset(std::initializer_list<int64_t> index) const {
    if (static_cast<int64_t>(index.size()) != dim())
      fail("Tensor::at: ", index.size(), " indices for a rank-", dim(), " tensor ", shape_str(shape_));
    size_t off = 0, axis = 0;
    for (int64_t i : index) off = off * static_cast<size_t>(shape_[axis++]) + static_cast<size_t>(i);
    return off;
  }
  template <class U>
  View4<U> make_view4(U* p) const {
    if (dim() > 4) fail("Tensor::view4: rank ", dim(), " tensor ", shape_str(shape_), " has more than 4 dims");
    std::array<int64_t, 4> s{1, 1, 1, 1};
    for (int64_t i = 0; i < dim(); ++i) s[static_cast<size_t>(4 - dim() + i)] = shape_[static_cast<size_t>(i)];
    return contiguous_view<U>(p, s[0], s[1], s[2], s[3]);
  }

  Shape shape_;
  TensorStorage<T> data_;
};

using Tensor = BasicTensor<float>;        ///< float32
using BF16Tensor = BasicTensor<bf16>;     ///< bfloat16 storage
using BoolTensor = BasicTensor<uint8_t>;  ///< booleans as bytes (0 / 1)

}  // namespace mha
