// layers/cache_storage.h — sizing the K and V storage of a KV cache (contiguous KvCache or paged
// PagedKvCache): (n0, n1, n2, d) elements each, float32 or bfloat16 by the cache's dtype.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mha/error.h"
#include "mha/kv_cache.h"
#include "mha/tensor.h"

namespace mha::detail {

/// Resizes K to (n0, n1, n2, head_dim) and V to (n0, n1, n2, v_dim) elements in the vectors of
/// `dtype` (the others stay empty). Sizes come from the caller or a file's metadata: every
/// product is checked, bytes included, and an overflow fails naming `what` (e.g. "KvCache:
/// (batch, kv_heads, capacity, d)") and the shape.
inline void size_cache_storage(const std::string& what, int64_t n0, int64_t n1, int64_t n2, int64_t head_dim,
                               int64_t v_dim, CacheDtype dtype, std::vector<float>& k32, std::vector<float>& v32,
                               std::vector<bf16>& k16, std::vector<bf16>& v16) {
  const auto numel = [&](int64_t dim) {
    const std::string where = what + " = " + shape_str({n0, n1, n2, dim});
    const int64_t n = checked_mul(checked_mul(checked_mul(n0, n1, where), n2, where), dim, where);
    (void)checked_mul(n, 4, where);
    return static_cast<size_t>(n);
  };
  const size_t nk = numel(head_dim), nv = numel(v_dim);
  if (dtype == CacheDtype::BF16) {
    k16.resize(nk);
    v16.resize(nv);
  } else {
    k32.resize(nk);
    v32.resize(nv);
  }
}

}  // namespace mha::detail
