// layers/view_overlap.h — whether views share memory. Outputs must not overlap the inputs they are
// computed from, each other, or themselves: the kernels read inputs in blocks after writing some
// outputs, so an overlap gave wrong numbers that differed between the reference and fused paths
// and between thread counts. Internal; the public entries check with these and refuse, naming
// both views.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <utility>

#include "mha/error.h"
#include "mha/tensor.h"

namespace mha::detail {

/// Signed 128-bit integers (a GCC / Clang extension, marked as one so -Wpedantic stays quiet).
__extension__ typedef __int128 Wide;

/// The bytes [lo, hi) a view's elements lie in (lo == hi: none), from its corners. 128-bit
/// arithmetic: any shape and strides a caller passes give the right span, never an overflow.
struct ByteSpan {
  Wide lo = 0, hi = 0;
  bool empty() const { return lo >= hi; }
};

template <class T>
ByteSpan byte_span(const View4<T>& v) {
  if (!v.defined()) return {};
  Wide lo = 0, hi = 0;  // in elements, from v.data
  for (size_t a = 0; a < 4; ++a) {
    if (v.shape[a] <= 0) return {};
    const Wide reach = static_cast<Wide>(v.stride[a]) * (v.shape[a] - 1);
    (reach < 0 ? lo : hi) += reach;
  }
  const auto base = static_cast<Wide>(reinterpret_cast<uintptr_t>(v.data));
  return {base + lo * static_cast<Wide>(sizeof(T)), base + (hi + 1) * static_cast<Wide>(sizeof(T))};
}

/// The bytes of a contiguous run of values (ALiBi slopes, sink logits, a gradient span).
template <class T>
ByteSpan byte_span(std::span<T> values) {
  if (values.empty()) return {};
  const auto at = static_cast<Wide>(reinterpret_cast<uintptr_t>(values.data()));
  return {at, at + static_cast<Wide>(values.size_bytes())};
}

inline bool overlap(const ByteSpan& a, const ByteSpan& b) {
  return !a.empty() && !b.empty() && a.lo < b.hi && b.lo < a.hi;
}

/// Whether two index tuples of `v` may name one element. Sufficient for disjointness: with the
/// dimensions of extent > 1 in order of |stride|, each stride passes the reach of those inside it
/// (every dense, padded or permuted layout does); a stride of 0 or rows closer than their width fail.
template <class T>
bool self_overlapping(const View4<T>& v) {
  for (size_t a = 0; a < 4; ++a)
    if (v.shape[a] <= 0) return false;  // no elements
  std::array<std::pair<Wide, int64_t>, 4> dims{};
  size_t n = 0;
  for (size_t a = 0; a < 4; ++a)
    if (v.shape[a] > 1) dims[n++] = {v.stride[a] < 0 ? -static_cast<Wide>(v.stride[a]) : v.stride[a], v.shape[a]};
  for (size_t i = 1; i < n; ++i)  // insertion sort of at most 4 (std::sort here trips GCC 12's -Warray-bounds)
    for (size_t j = i; j > 0 && dims[j].first < dims[j - 1].first; --j) std::swap(dims[j], dims[j - 1]);
  Wide reach = 1;  // elements the inner dimensions span, corner to corner, plus one
  for (size_t i = 0; i < n; ++i) {
    if (dims[i].first < reach) return true;
    reach += dims[i].first * (dims[i].second - 1);
  }
  return false;
}

struct NamedSpan {
  const char* name;
  ByteSpan span;
};

/// Fails, naming both, when an output overlaps an input or another output; `outputs_apart`
/// false leaves the outputs' overlaps with each other unchecked (gradients that share one packed
/// buffer, interleaved, lie in each other's span without sharing an element).
inline void check_disjoint(const char* fn, std::initializer_list<NamedSpan> outputs,
                           std::initializer_list<NamedSpan> inputs, bool outputs_apart = true) {
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    for (const NamedSpan& i : inputs)
      if (overlap(o->span, i.span))
        fail(fn, ": ", o->name, " shares memory with ", i.name, "; outputs must not overlap the inputs");
    if (outputs_apart)
      for (auto p = outputs.begin(); p != o; ++p)
        if (overlap(o->span, p->span))
          fail(fn, ": ", o->name, " shares memory with ", p->name, "; outputs must not overlap");
  }
}

/// Fails when an output view's own elements share memory (a stride of 0, rows closer than their width).
template <class T>
void check_output_layout(const char* fn, const char* name, const View4<T>& v) {
  if (v.defined() && self_overlapping(v))
    fail(fn, ": ", name, " ", shape_str(v), " with strides (", v.stride[0], ", ", v.stride[1], ", ", v.stride[2], ", ",
         v.stride[3], ") names some elements twice; an output needs one place per element");
}

}  // namespace mha::detail
