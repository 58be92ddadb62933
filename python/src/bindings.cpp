// python/src/bindings.cpp — the compiled half of the `mha` Python package (mha._core).
//
// Thin: every function takes numpy arrays the Python half (python/mha/*.py) has already checked for
// dtype and rank, wraps them as strided View4s without copying where it can, releases the GIL,
// and calls the public C++ API (include/mha/). mha::Error becomes ValueError with the library's
// message; the Python half raises TypeError for wrong types before anything gets here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <vector>

#include "mha/analysis.h"
#include "mha/error.h"
#include "mha/image.h"
#include "mha/kv_cache.h"
#include "mha/module.h"
#include "mha/paged_kv_cache.h"
#include "mha/prune.h"
#include "mha/safetensors.h"
#include "mha/sdpa.h"
#include "mha/threads.h"
#include "mha/training.h"
#include "mha/weights.h"

namespace py = pybind11;

namespace {

// ---- numpy <-> views and tensors ------------------------------------------------------------------

/// A strided 4-D view over a numpy array's buffer (no copy). The Python half guarantees 4 dims,
/// the dtype and non-negative strides that are whole elements; this re-checks and names `what`.
template <class T>
mha::View4<T> view_of(const py::array& a, const char* what) {
  if (a.ndim() != 4) mha::fail(what, ": expected a 4-D array, got ", a.ndim(), " dimensions");
  if (a.itemsize() != static_cast<py::ssize_t>(sizeof(T))) mha::fail(what, ": unexpected element size");
  mha::View4<T> v;
  v.data = static_cast<T*>(const_cast<void*>(a.data()));
  for (size_t i = 0; i < 4; ++i) {
    const int64_t bytes = static_cast<int64_t>(a.strides(static_cast<py::ssize_t>(i)));
    if (bytes < 0 || bytes % static_cast<int64_t>(sizeof(T)) != 0)
      mha::fail(what, ": strides must be non-negative whole elements");
    v.shape[i] = static_cast<int64_t>(a.shape(static_cast<py::ssize_t>(i)));
    v.stride[i] = bytes / static_cast<int64_t>(sizeof(T));
  }
  return v;
}

template <class T>
mha::View4<const T> opt_view(const std::optional<py::array>& a, const char* what) {
  if (!a) return {};
  return view_of<const T>(*a, what);
}

/// A C-contiguous float32 copy of a numpy array as an owning Tensor (the module's API owns its inputs).
mha::Tensor tensor_from(const py::array_t<float, py::array::c_style | py::array::forcecast>& a) {
  mha::Shape shape(a.shape(), a.shape() + a.ndim());
  mha::TensorStorage<float> values(a.data(), a.data() + a.size());
  return mha::Tensor(std::move(shape), std::move(values));
}

/// An owning BoolTensor of 0 / 1 from a bool or uint8 numpy array (nonzero = true), read in place
/// whatever its strides (transposed, sliced, broadcast, reversed): the one copy that the module's
/// owning masks need. With `negate`, true becomes 0 and false 1 in that same pass, so that PyTorch's
/// "True = masked out" turns into mha's "allowed" without numpy's logical_not first making a mask-sized
/// copy of its own (and the conversion to contiguous uint8 a second).
mha::BoolTensor bool_tensor_from(const py::array& a, const char* what, bool negate = false) {
  if (a.itemsize() != 1 || (a.dtype().kind() != 'b' && a.dtype().kind() != 'u'))
    mha::fail(what, ": expected a bool or uint8 array, got dtype ", std::string(py::str(a.dtype())));
  const auto rank = static_cast<size_t>(a.ndim());
  mha::BoolTensor t = mha::BoolTensor::uninitialized(mha::Shape(a.shape(), a.shape() + rank));
  if (t.numel() == 0) return t;
  const auto* base = static_cast<const uint8_t*>(a.data());
  const int64_t cols = rank ? a.shape(rank - 1) : 1, col_stride = rank ? a.strides(rank - 1) : 0;
  // An odometer over the axes before the last: `row` is the byte offset of the current row.
  std::vector<int64_t> index(rank ? rank - 1 : 0, 0);
  int64_t row = 0;
  uint8_t* out = t.data();
  for (int64_t r = 0, rows = t.numel() / cols; r < rows; ++r, out += cols) {
    const uint8_t* src = base + row;
    if (col_stride == 1)  // the common case, kept apart so that it vectorises
      for (int64_t j = 0; j < cols; ++j) out[j] = static_cast<uint8_t>((src[j] != 0) != negate);
    else
      for (int64_t j = 0; j < cols; ++j) out[j] = static_cast<uint8_t>((src[j * col_stride] != 0) != negate);
    for (size_t axis = index.size(); axis-- > 0;) {
      row += a.strides(static_cast<py::ssize_t>(axis));
      if (++index[axis] < a.shape(static_cast<py::ssize_t>(axis))) break;
      row -= a.strides(static_cast<py::ssize_t>(axis)) * a.shape(static_cast<py::ssize_t>(axis));
      index[axis] = 0;
    }
  }
  return t;
}

/// A numpy array that owns a copy of the tensor (empty tensor → None).
py::object array_from(const mha::Tensor& t) {
  if (!t.defined()) return py::none();
  py::array_t<float> out(std::vector<py::ssize_t>(t.shape().begin(), t.shape().end()));
  if (t.numel()) std::memcpy(out.mutable_data(), t.data(), static_cast<size_t>(t.numel()) * sizeof(float));
  return out;
}

/// Moves a tensor's storage into a numpy array without copying (the capsule owns the vector).
py::object array_take(mha::Tensor&& t) {
  if (!t.defined()) return py::none();
  auto* storage = new mha::TensorStorage<float>(std::move(t.storage()));
  py::capsule owner(storage, [](void* p) { delete static_cast<mha::TensorStorage<float>*>(p); });
  return py::array_t<float>(std::vector<py::ssize_t>(t.shape().begin(), t.shape().end()), storage->data(), owner);
}

// ---- sdpa -------------------------------------------------------------------------------------

mha::Causal make_causal(const std::string& align, int64_t offset, int64_t window) {
  mha::Causal c;
  if (align == "none")
    c = mha::Causal::none();
  else if (align == "top_left")
    c = mha::Causal::top_left();
  else if (align == "bottom_right")
    c = mha::Causal::bottom_right();
  else if (align == "offset")
    c = mha::Causal::with_offset(offset);
  else
    mha::fail("causal: unknown alignment '", align, "'");
  return c.with_window(window);
}

struct SdpaArgs {
  std::optional<float> scale;
  std::optional<py::array> allowed, bias, key_padding, key_bias;
  std::string causal = "none";
  int64_t causal_offset = 0, window = 0;
  float dropout_p = 0.0f;
  uint64_t seed = 0;
  int threads = 0;
  std::vector<float> alibi_slopes, sinks;  // empty = off
  float softcap = 0.0f;
};

mha::SdpaOptions make_options(const SdpaArgs& a) {
  mha::SdpaOptions opt;
  opt.scale = a.scale;
  opt.masks.allowed.view = opt_view<uint8_t>(a.allowed, "sdpa: allowed");
  opt.masks.bias.view = opt_view<float>(a.bias, "sdpa: bias");
  opt.masks.key_padding.view = opt_view<uint8_t>(a.key_padding, "sdpa: key_padding_mask");
  opt.masks.key_bias.view = opt_view<float>(a.key_bias, "sdpa: key_padding_mask");
  opt.masks.causal = make_causal(a.causal, a.causal_offset, a.window);
  opt.dropout = {a.dropout_p, a.seed};
  opt.threads = a.threads;
  opt.alibi.slopes = a.alibi_slopes;  // views into `a`, which outlives the call
  opt.softcap = a.softcap;
  opt.sinks.logits = a.sinks;
  return opt;
}

/// Output (B, h, T_q, d_v), optional weights (B, h, T_q, T_k) and lse (B, h, T_q): numpy arrays
/// allocated here and written in place by the kernels.
py::tuple py_sdpa(const py::array& q, const py::array& k, const py::array& v, const SdpaArgs& args, bool want_weights,
                  bool want_lse, bool bf16_inputs) {
  const mha::SdpaOptions opt = make_options(args);
  const int64_t B = q.shape(0), h = q.shape(1), Tq = q.shape(2), Tk = k.ndim() == 4 ? k.shape(2) : 0,
                dv = v.ndim() == 4 ? v.shape(3) : 0;
  py::array_t<float> out({B, h, Tq, dv});
  py::object weights = py::none(), lse = py::none();
  mha::SdpaOutputs outs;
  outs.out = view_of<float>(out, "out");
  if (want_weights) {
    py::array_t<float> w({B, h, Tq, Tk});
    outs.weights = view_of<float>(w, "weights");
    weights = w;
  }
  if (want_lse) {
    py::array_t<float> l({B, h, Tq, int64_t{1}});
    outs.lse = view_of<float>(l, "lse");
    lse = l.attr("reshape")(py::make_tuple(B, h, Tq));
  }
  if (bf16_inputs) {
    const auto qv = view_of<const mha::bf16>(q, "sdpa: q"), kv = view_of<const mha::bf16>(k, "sdpa: k"),
               vv = view_of<const mha::bf16>(v, "sdpa: v");
    py::gil_scoped_release release;
    mha::sdpa(qv, kv, vv, opt, outs);
  } else {
    const auto qv = view_of<const float>(q, "sdpa: q"), kv = view_of<const float>(k, "sdpa: k"),
               vv = view_of<const float>(v, "sdpa: v");
    py::gil_scoped_release release;
    mha::sdpa(qv, kv, vv, opt, outs);
  }
  return py::make_tuple(out, weights, lse);
}

py::tuple py_sdpa_backward(const py::array& q, const py::array& k, const py::array& v, const py::array& out,
                           const py::array& d_out, const py::array& lse, const SdpaArgs& args) {
  const mha::SdpaOptions opt = make_options(args);
  const auto qv = view_of<const float>(q, "sdpa_backward: q"), kv = view_of<const float>(k, "sdpa_backward: k"),
             vv = view_of<const float>(v, "sdpa_backward: v");
  const auto ov = view_of<const float>(out, "sdpa_backward: out"),
             gv = view_of<const float>(d_out, "sdpa_backward: d_out"),
             lv = view_of<const float>(lse, "sdpa_backward: lse");
  py::array_t<float> dq({qv.shape[0], qv.shape[1], qv.shape[2], qv.shape[3]});
  py::array_t<float> dk({kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[3]});
  py::array_t<float> dv({vv.shape[0], vv.shape[1], vv.shape[2], vv.shape[3]});
  py::array_t<float> dsinks(static_cast<py::ssize_t>(args.sinks.size()));
  const mha::SdpaGrads grads{view_of<float>(dq, "dq"),
                             view_of<float>(dk, "dk"),
                             view_of<float>(dv, "dv"),
                             {dsinks.mutable_data(), args.sinks.size()}};
  {
    py::gil_scoped_release release;
    mha::sdpa_backward(qv, kv, vv, ov, gv, lv, opt, grads);
  }
  if (!args.sinks.empty()) return py::make_tuple(dq, dk, dv, dsinks);
  return py::make_tuple(dq, dk, dv);
}

// ---- packed variable-length sequences ---------------------------------------------------------

/// q/k/v as (1, heads, total, d) strided views of (total, heads, d) arrays (the Python side
/// transposes without copying); out (total, h, d_v) and lse (total, h) allocated here.
py::tuple py_sdpa_varlen(const py::array& q, const py::array& k, const py::array& v,
                         const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& cu_q,
                         const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& cu_k, int64_t max_q,
                         int64_t max_k, const SdpaArgs& args, bool want_lse, bool bf16_inputs) {
  const mha::SdpaOptions opt = make_options(args);
  mha::VarlenBatch seqs;
  seqs.cu_seqlens_q = std::vector<int64_t>(cu_q.data(), cu_q.data() + cu_q.size());
  seqs.cu_seqlens_k = std::vector<int64_t>(cu_k.data(), cu_k.data() + cu_k.size());
  seqs.max_seqlen_q = max_q, seqs.max_seqlen_k = max_k;
  const int64_t total = q.shape(2), h = q.shape(1), dv = v.shape(3);
  py::array_t<float> out({total, h, dv});
  py::object lse = py::none();
  mha::SdpaOutputs outs;
  outs.out = mha::packed_view(out.mutable_data(), total, h, dv);
  if (want_lse) {
    py::array_t<float> l({total, h});
    outs.lse = mha::packed_view(l.mutable_data(), total, h, int64_t{1});
    lse = l;
  }
  if (bf16_inputs) {
    const auto qv = view_of<const mha::bf16>(q, "sdpa_varlen: q"), kv = view_of<const mha::bf16>(k, "sdpa_varlen: k"),
               vv = view_of<const mha::bf16>(v, "sdpa_varlen: v");
    py::gil_scoped_release release;
    mha::sdpa_varlen(qv, kv, vv, seqs, opt, outs);
  } else {
    const auto qv = view_of<const float>(q, "sdpa_varlen: q"), kv = view_of<const float>(k, "sdpa_varlen: k"),
               vv = view_of<const float>(v, "sdpa_varlen: v");
    py::gil_scoped_release release;
    mha::sdpa_varlen(qv, kv, vv, seqs, opt, outs);
  }
  return py::make_tuple(out, lse);
}

// ---- the module ---------------------------------------------------------------------------------

// ---- Python threads sharing one KV cache ------------------------------------------------------
// The GIL is released while a cache computes, so without a lock two Python threads appending to one
// cache would race past its capacity check (a heap overrun), and a read could meet a half-done
// write. Every method of the bound caches, and every call that reads or fills one, holds the cache's
// lock: shared to read it, exclusive to change it. The GIL is always released first (and taken
// back after the lock is dropped), so a thread waiting for the lock never holds the GIL its holder
// needs. The locks are a fixed set chosen by address: two caches may share one (then their writers
// wait for each other, results unchanged); no call takes two.
std::shared_mutex& lock_of(const void* cache) {
  static std::array<std::shared_mutex, 61> locks;
  return locks[reinterpret_cast<std::uintptr_t>(cache) % locks.size()];
}

/// f() under `cache`'s shared lock, without the GIL (f must not touch Python objects).
template <class Cache, class F>
auto reading(const Cache& cache, F&& f) {
  py::gil_scoped_release release;
  std::shared_lock lock(lock_of(&cache));
  return f();
}

/// f() under `cache`'s exclusive lock, without the GIL (f must not touch Python objects).
template <class Cache, class F>
auto writing(const Cache& cache, F&& f) {
  py::gil_scoped_release release;
  std::unique_lock lock(lock_of(&cache));
  return f();
}

using F32In = py::array_t<float, py::array::c_style | py::array::forcecast>;

/// Attention of q (B, h, T_q, d) over a KV cache by `attend(q, options, out, lse)`, without the GIL:
/// (out (B, h, T_q, d_v), lse (B, h, T_q)).
template <class Cache, class Attend>
py::tuple attend_over_cache(const F32In& q, const Cache& cache, const char* what, int64_t d_v,
                            const mha::CacheAttentionOptions& options, Attend attend) {
  const mha::View4<const float> qv = view_of<const float>(q, what);
  const int64_t B = qv.shape[0], H = qv.shape[1], T = qv.shape[2];
  py::array_t<float> out({B, H, T, d_v}), lse({B, H, T});
  const mha::View4<float> out_view = view_of<float>(out, "out");
  const mha::View4<float> lse_view = mha::contiguous_view(lse.mutable_data(), B, H, T, int64_t{1});
  reading(cache, [&] { attend(qv, options, out_view, lse_view); });
  return py::make_tuple(out, lse);
}

/// attend_cache's options; ALiBi slopes and sink logits borrow `slopes` and `sinks` (empty = off),
/// which the caller keeps alive for the call. The library checks every value.
mha::CacheAttentionOptions cache_options(std::optional<float> scale, int64_t window, int splits, int threads,
                                         const std::vector<float>& slopes, float softcap,
                                         const std::vector<float>& sinks) {
  mha::CacheAttentionOptions o{scale, window, splits, threads};
  o.alibi.slopes = slopes;
  o.softcap = softcap;
  o.sinks.logits = sinks;
  return o;
}

/// Parameter tensors by PyTorch name.
mha::Tensor* param_slot(mha::MhaParameters& p, const std::string& name) {
  if (name == "in_proj_weight") return &p.in_proj_weight;
  if (name == "q_proj_weight") return &p.q_proj_weight;
  if (name == "k_proj_weight") return &p.k_proj_weight;
  if (name == "v_proj_weight") return &p.v_proj_weight;
  if (name == "in_proj_bias") return &p.in_proj_bias;
  if (name == "bias_k") return &p.bias_k;
  if (name == "bias_v") return &p.bias_v;
  if (name == "sinks") return &p.sinks;
  if (name == "out_proj.weight") return &p.out_proj_weight;
  if (name == "out_proj.bias") return &p.out_proj_bias;
  mha::fail("unknown parameter name '", name, "'");
}

const mha::Tensor* param_slot(const mha::MhaParameters& p, const std::string& name) {
  return param_slot(const_cast<mha::MhaParameters&>(p), name);  // the same lookup; nothing is written
}

const std::vector<std::string> kParamNames = {"in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                                              "in_proj_bias",   "bias_k",        "bias_v",        "out_proj.weight",
                                              "out_proj.bias",  "sinks"};

/// The forward options, from the Python half's already-converted masks (mha polarity).
struct ForwardArgs {
  /// attn_mask in PyTorch's polarity (nonzero = may NOT attend) and key_padding_mask (nonzero =
  /// padding): bool or uint8 arrays of any strides, copied once, into the options (bool_tensor_from).
  std::optional<py::array> attn_masked_out;
  std::optional<F32In> attn_additive;
  std::optional<py::array> key_padding;
  std::optional<F32In> key_bias;
  bool is_causal = false;
  std::string need_weights = "none";  // none | per_head | averaged
  bool training = false;
  uint64_t seed = 0;
  int threads = 0;
  bool need_lse = false;
  std::optional<std::vector<int64_t>> cu_seqlens_q, cu_seqlens_k;  // a packed batch (both or neither)
};

mha::MhaForwardOptions forward_options(const ForwardArgs& a) {
  mha::MhaForwardOptions o;
  if (a.attn_masked_out)
    o.attn_mask = mha::AttnMask::allow(bool_tensor_from(*a.attn_masked_out, "attn_mask", /*negate=*/true));
  if (a.attn_additive) o.attn_mask = mha::AttnMask::add(tensor_from(*a.attn_additive));
  if (a.key_padding) o.key_padding_mask.is_padding = bool_tensor_from(*a.key_padding, "key_padding_mask");
  if (a.key_bias) o.key_padding_mask.additive = tensor_from(*a.key_bias);
  if (a.is_causal) o.causal = mha::Causal::top_left();
  if (a.need_weights == "per_head")
    o.need_weights = mha::NeedWeights::PerHead;
  else if (a.need_weights == "averaged")
    o.need_weights = mha::NeedWeights::Averaged;
  o.mode = a.training ? mha::Mode::Training : mha::Mode::Eval;
  o.dropout_seed = a.seed;
  o.threads = a.threads;
  o.need_lse = a.need_lse;
  if (a.cu_seqlens_q) {
    mha::VarlenBatch packed;
    packed.cu_seqlens_q = *a.cu_seqlens_q;
    packed.cu_seqlens_k = a.cu_seqlens_k ? *a.cu_seqlens_k : *a.cu_seqlens_q;
    o.packed = std::move(packed);
  }
  return o;
}

mha::CacheDtype cache_dtype(const char* what, const std::string& dtype) {
  if (dtype == "bf16") return mha::CacheDtype::BF16;
  if (dtype == "int8") return mha::CacheDtype::I8;
  if (dtype != "f32") mha::fail(what, ": dtype must be 'f32', 'bf16' or 'int8', got '", dtype, "'");
  return mha::CacheDtype::F32;
}

mha::KeyLayout key_layout_of(const char* what, const std::string& layout) {
  if (layout == "transposed") return mha::KeyLayout::Transposed;
  if (layout != "rows") mha::fail(what, ": key_layout must be 'rows' or 'transposed', got '", layout, "'");
  return mha::KeyLayout::Rows;
}

/// Runs one of the module's incremental forwards on copies of q/k/v with the GIL released, holding
/// the lock of the cache it appends to.
template <class Cache, class Call>
py::object incremental_call(Cache& cache, const py::array_t<float, py::array::c_style | py::array::forcecast>& q,
                            const py::array_t<float, py::array::c_style | py::array::forcecast>& k,
                            const py::array_t<float, py::array::c_style | py::array::forcecast>& v,
                            std::vector<int64_t> new_lengths, int64_t window, int threads, const Call& call) {
  const mha::Tensor qt = tensor_from(q), kt = tensor_from(k), vt = tensor_from(v);
  mha::IncrementalOptions opt;
  opt.new_lengths = std::move(new_lengths);
  opt.window = window;
  opt.threads = threads;
  mha::MhaOutput r = writing(cache, [&] { return call(qt, kt, vt, opt); });
  return array_take(std::move(r.output));
}

/// The module's three inputs as owning tensors. When Python passed the same object more than once
/// (self-attention), one tensor serves them all, so the module sees the same Tensor and projects
/// Q, K and V with one packed GEMM, as a C++ caller passing one tensor thrice gets.
struct ModuleInputs {
  mha::Tensor q, k, v;
  bool k_is_q = false, v_is_q = false, v_is_k = false;
  const mha::Tensor& key() const { return k_is_q ? q : k; }
  const mha::Tensor& value() const { return v_is_q ? q : (v_is_k ? key() : v); }
};

void fill_inputs(ModuleInputs& in, const py::object& q, const py::object& k, const py::object& v) {
  in.q = tensor_from(py::cast<F32In>(q));
  in.k_is_q = k.is(q);
  in.v_is_q = v.is(q);
  in.v_is_k = v.is(k);
  if (!in.k_is_q) in.k = tensor_from(py::cast<F32In>(k));
  if (!in.v_is_q && !in.v_is_k) in.v = tensor_from(py::cast<F32In>(v));
}

/// What forward_train saved, with the inputs it references (MhaContext points at them).
struct TrainContext {
  ModuleInputs inputs;
  mha::MhaContext ctx;
};

py::dict config_dict(const mha::MhaConfig& c) {
  py::dict d;
  d["embed_dim"] = c.embed_dim;
  d["num_heads"] = c.num_heads;
  d["num_kv_heads"] = c.kv_heads();
  d["kdim"] = c.key_dim();
  d["vdim"] = c.value_dim();
  d["bias"] = c.bias;
  d["add_bias_kv"] = c.add_bias_kv;
  d["add_zero_attn"] = c.add_zero_attn;
  d["dropout"] = c.dropout;
  d["batch_first"] = c.layout == mha::Layout::BatchFirst;
  d["head_dim"] = c.head_dim();
  d["scale"] = c.scale ? py::cast(*c.scale) : py::none();
  d["alibi_slopes"] = c.alibi_slopes.empty() ? py::none() : py::cast(c.alibi_slopes);
  d["softcap"] = c.softcap;
  d["attention_sinks"] = c.attention_sinks;
  if (c.rope.enabled) {
    py::dict r;
    r["theta"] = c.rope.theta;
    r["dims"] = c.rope.dims;
    r["pairing"] = c.rope.pairing == mha::RopePairing::HalfSplit ? "half_split" : "interleaved";
    d["rope"] = r;
  } else {
    d["rope"] = py::none();
  }
  return d;
}

mha::MhaConfig make_config(int64_t embed_dim, int64_t num_heads, int64_t num_kv_heads, int64_t kdim, int64_t vdim,
                           bool bias, bool add_bias_kv, bool add_zero_attn, float dropout, bool batch_first, bool rope,
                           double rope_theta, int64_t rope_dims, const std::string& rope_pairing, int64_t head_dim) {
  mha::MhaConfig c;
  c.embed_dim = embed_dim;
  c.num_heads = num_heads;
  c.num_kv_heads = num_kv_heads;
  c.kdim = kdim;
  c.vdim = vdim;
  c.bias = bias;
  c.add_bias_kv = add_bias_kv;
  c.add_zero_attn = add_zero_attn;
  c.dropout = dropout;
  c.layout = batch_first ? mha::Layout::BatchFirst : mha::Layout::SeqFirst;
  if (rope) {
    if (rope_pairing == "half_split")
      c.rope = mha::Rope::half_split(rope_theta, rope_dims);
    else if (rope_pairing == "interleaved")
      c.rope = mha::Rope::interleaved(rope_theta, rope_dims);
    else
      mha::fail("rope: pairing must be 'half_split' or 'interleaved', got '", rope_pairing, "'");
  }
  c.head_dim_override = head_dim;
  return c;
}

py::list metrics_list(const std::vector<mha::HeadMetrics>& metrics) {
  py::list out;
  for (const auto& m : metrics) {
    py::dict d;
    d["head"] = m.head;
    d["rows"] = m.rows;
    d["entropy"] = m.entropy;
    d["sink"] = m.sink;
    d["prev_token"] = m.prev_token;
    d["self"] = m.self;
    d["focus"] = m.focus;
    d["class"] = mha::head_class_name(m.cls);
    out.append(d);
  }
  return out;
}

/// The numpy format of a safetensors integer dtype (little-endian, as the format stores them), or
/// null for the others.
const char* integer_format(mha::io::DType dtype) {
  using mha::io::DType;
  switch (dtype) {
    case DType::U8:
      return "<u1";
    case DType::I8:
      return "<i1";
    case DType::I16:
      return "<i2";
    case DType::U16:
      return "<u2";
    case DType::I32:
      return "<i4";
    case DType::U32:
      return "<u4";
    case DType::I64:
      return "<i8";
    case DType::U64:
      return "<u8";
    default:
      return nullptr;
  }
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "mha's compiled core; use the `mha` package instead of this module.";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const mha::Error& e) {
      // A message may quote bytes of a hostile input that are not UTF-8 (a safetensors header's
      // JSON error shows where it stopped): PyErr_SetString would then raise an empty ValueError.
      // Such bytes come out as \xNN escapes instead.
      const std::string msg = e.what();
      PyObject* text = PyUnicode_DecodeUTF8(msg.data(), static_cast<Py_ssize_t>(msg.size()), "backslashreplace");
      if (!text) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "mha error (its message could not be decoded)");
        return;
      }
      PyErr_SetObject(PyExc_ValueError, text);
      Py_DECREF(text);
    }
  });

  py::class_<SdpaArgs>(m, "SdpaArgs")
      .def(py::init<>())
      .def_readwrite("scale", &SdpaArgs::scale)
      .def_readwrite("allowed", &SdpaArgs::allowed)
      .def_readwrite("bias", &SdpaArgs::bias)
      .def_readwrite("key_padding", &SdpaArgs::key_padding)
      .def_readwrite("key_bias", &SdpaArgs::key_bias)
      .def_readwrite("causal", &SdpaArgs::causal)
      .def_readwrite("causal_offset", &SdpaArgs::causal_offset)
      .def_readwrite("window", &SdpaArgs::window)
      .def_readwrite("dropout_p", &SdpaArgs::dropout_p)
      .def_readwrite("seed", &SdpaArgs::seed)
      .def_readwrite("threads", &SdpaArgs::threads)
      .def_readwrite("alibi_slopes", &SdpaArgs::alibi_slopes)
      .def_readwrite("sinks", &SdpaArgs::sinks)
      .def_readwrite("softcap", &SdpaArgs::softcap);
  m.def("alibi_slopes", &mha::alibi_slopes);
  m.def("sdpa", &py_sdpa);
  m.def("sdpa_backward", &py_sdpa_backward);
  m.def("sdpa_varlen", &py_sdpa_varlen);

  m.def("to_bf16_bits", [](const F32In& a) {
    py::array_t<uint16_t> out(std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()));
    const float* src = a.data();
    uint16_t* dst = out.mutable_data();
    for (py::ssize_t i = 0; i < a.size(); ++i) dst[i] = mha::to_bf16(src[i]).bits;
    return out;
  });
  m.def("set_num_threads", &mha::set_num_threads);
  m.def("num_threads", &mha::num_threads);
  m.def("cached_tensor_bytes", &mha::cached_tensor_bytes,
        "Bytes held in freed tensor blocks of 4 MiB and more, kept for reuse by calls of the same shapes.");
  m.def("release_cached_tensors", &mha::release_cached_tensors, "Frees every cached tensor block; returns the bytes.");
  m.def("tensor_cache_limit", &mha::tensor_cache_limit, "The cache's limit in bytes (0: off).");
  m.def("set_tensor_cache_limit", &mha::set_tensor_cache_limit, py::arg("bytes"),
        "Sets the cache's limit in bytes, freeing the oldest blocks beyond it (0 turns it off).");

  py::class_<ForwardArgs>(m, "ForwardArgs")
      .def(py::init<>())
      .def_readwrite("attn_masked_out", &ForwardArgs::attn_masked_out)
      .def_readwrite("attn_additive", &ForwardArgs::attn_additive)
      .def_readwrite("key_padding", &ForwardArgs::key_padding)
      .def_readwrite("key_bias", &ForwardArgs::key_bias)
      .def_readwrite("is_causal", &ForwardArgs::is_causal)
      .def_readwrite("need_weights", &ForwardArgs::need_weights)
      .def_readwrite("training", &ForwardArgs::training)
      .def_readwrite("seed", &ForwardArgs::seed)
      .def_readwrite("threads", &ForwardArgs::threads)
      .def_readwrite("need_lse", &ForwardArgs::need_lse)
      .def_readwrite("cu_seqlens_q", &ForwardArgs::cu_seqlens_q)
      .def_readwrite("cu_seqlens_k", &ForwardArgs::cu_seqlens_k);

  py::class_<TrainContext>(m, "TrainContext");

  py::class_<mha::KvCache>(m, "KvCache")
      .def(py::init([](int64_t batch, int64_t kv_heads, int64_t head_dim, int64_t value_dim, int64_t capacity,
                       const std::string& dtype, bool ring, int64_t sinks, const std::string& int8_keys,
                       int64_t key_group, const std::string& key_layout) {
        mha::KvCacheConfig c;
        c.batch = batch;
        c.kv_heads = kv_heads;
        c.head_dim = head_dim;
        c.value_dim = value_dim;
        c.capacity = capacity;
        c.dtype = cache_dtype("KvCache", dtype);
        c.ring = ring;
        c.sinks = sinks;
        if (int8_keys == "per-channel")
          c.int8_keys = mha::Int8KeyScales::PerChannel;
        else if (int8_keys != "per-token")
          mha::fail("KvCache: int8_keys must be 'per-token' or 'per-channel', got '", int8_keys, "'");
        c.key_group = key_group;
        c.key_layout = key_layout_of("KvCache", key_layout);
        return mha::KvCache(c);
      }))
      .def("length", [](const mha::KvCache& self, int64_t b) { return reading(self, [&] { return self.length(b); }); })
      .def("stored", [](const mha::KvCache& self, int64_t b) { return reading(self, [&] { return self.stored(b); }); })
      .def("remaining",
           [](const mha::KvCache& self, int64_t b) { return reading(self, [&] { return self.remaining(b); }); })
      .def_property_readonly("batch", &mha::KvCache::batch)  // the configuration: never changes
      .def_property_readonly("capacity", &mha::KvCache::capacity)
      .def_property_readonly("ring", &mha::KvCache::ring)
      .def_property_readonly("nbytes", &mha::KvCache::bytes)
      .def("reset", [](mha::KvCache& self) { writing(self, [&] { self.reset(); }); })
      .def("reset_sequence", [](mha::KvCache& self, int64_t b) { writing(self, [&] { self.reset(b); }); })
      .def("clone", [](const mha::KvCache& self) { return reading(self, [&] { return self.clone(); }); })
      // k (B, kv, T, d), v (B, kv, T, d_v) float32; counts: rows of each sequence (empty = all T).
      .def("append",
           [](mha::KvCache& self, const F32In& k, const F32In& v, const std::vector<int64_t>& counts) {
             const auto kv = view_of<const float>(k, "KvCache.append: k"),
                        vv = view_of<const float>(v, "KvCache.append: v");
             writing(self, [&] { self.append(kv, vv, counts); });
           })
      .def("k_at", [](const mha::KvCache& self, int64_t b, int64_t g, int64_t p,
                      int64_t x) { return reading(self, [&] { return self.k_at(b, g, p, x); }); })
      .def("v_at", [](const mha::KvCache& self, int64_t b, int64_t g, int64_t p, int64_t x) {
        return reading(self, [&] { return self.v_at(b, g, p, x); });
      });

  py::class_<mha::PagedKvCache>(m, "PagedKvCache")
      .def(py::init([](int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t value_dim,
                       const std::string& dtype, const std::string& key_layout) {
        mha::PagedKvCacheConfig c;
        c.kv_heads = kv_heads;
        c.head_dim = head_dim;
        c.block_size = block_size;
        c.num_blocks = num_blocks;
        c.value_dim = value_dim;
        c.dtype = cache_dtype("PagedKvCache", dtype);
        c.key_layout = key_layout_of("PagedKvCache", key_layout);
        return std::make_unique<mha::PagedKvCache>(c);
      }))
      .def("add_sequence", [](mha::PagedKvCache& self) { return writing(self, [&] { return self.add_sequence(); }); })
      .def("fork", [](mha::PagedKvCache& self, int64_t seq) { return writing(self, [&] { return self.fork(seq); }); })
      .def("free", [](mha::PagedKvCache& self, int64_t seq) { writing(self, [&] { self.free(seq); }); })
      .def("length",
           [](const mha::PagedKvCache& self, int64_t seq) { return reading(self, [&] { return self.length(seq); }); })
      .def("alive",
           [](const mha::PagedKvCache& self, int64_t seq) { return reading(self, [&] { return self.alive(seq); }); })
      .def("block_table",
           [](const mha::PagedKvCache& self, int64_t seq) {
             return reading(self, [&] {
               const std::span<const int32_t> t = self.block_table(seq);
               return std::vector<int32_t>(t.begin(), t.end());
             });
           })
      .def("free_blocks",
           [](const mha::PagedKvCache& self) { return reading(self, [&] { return self.free_blocks(); }); })
      .def("refcount", [](const mha::PagedKvCache& self,
                          int64_t block) { return reading(self, [&] { return self.refcount(block); }); })
      .def("k_at", [](const mha::PagedKvCache& self, int64_t seq, int64_t g, int64_t p,
                      int64_t x) { return reading(self, [&] { return self.k_at(seq, g, p, x); }); })
      .def("v_at", [](const mha::PagedKvCache& self, int64_t seq, int64_t g, int64_t p,
                      int64_t x) { return reading(self, [&] { return self.v_at(seq, g, p, x); }); })
      // k (1, kv, T, d), v (1, kv, T, d_v) float32, at positions length … length + T − 1 of seq.
      .def("append",
           [](mha::PagedKvCache& self, int64_t seq, const F32In& k, const F32In& v) {
             const auto kv = view_of<const float>(k, "PagedKvCache.append: k"),
                        vv = view_of<const float>(v, "PagedKvCache.append: v");
             writing(self, [&] { self.append(seq, kv, vv); });
           })
      .def_property_readonly("block_size", [](const mha::PagedKvCache& self) { return self.config().block_size; })
      .def_property_readonly("num_blocks", [](const mha::PagedKvCache& self) { return self.config().num_blocks; });

  // attend_cache / attend_paged_cache: q (B, h, T_q, d) float32 → (out (B, h, T_q, d_v), lse (B, h, T_q)).
  // The score edits come last: ALiBi slopes and sink logits (empty = off) and the softcap.
  m.def("attend_cache", [](const F32In& q, const mha::KvCache& cache, const std::vector<int64_t>& q_start,
                           std::optional<float> scale, int64_t window, int splits, int threads,
                           const std::vector<float>& slopes, float softcap, const std::vector<float>& sinks) {
    return attend_over_cache(
        q, cache, "attend_cache: q", cache.config().v_dim(),
        cache_options(scale, window, splits, threads, slopes, softcap, sinks),
        [&](auto qv, const auto& o, auto out, auto lse) { mha::attend_cache(qv, cache, q_start, o, out, lse); });
  });
  m.def("attend_paged_cache",
        [](const F32In& q, const mha::PagedKvCache& cache, const std::vector<int64_t>& seqs,
           const std::vector<int64_t>& q_start, std::optional<float> scale, int64_t window, int splits, int threads,
           const std::vector<float>& slopes, float softcap, const std::vector<float>& sinks) {
          return attend_over_cache(q, cache, "attend_paged_cache: q", cache.config().v_dim(),
                                   cache_options(scale, window, splits, threads, slopes, softcap, sinks),
                                   [&](auto qv, const auto& o, auto out, auto lse) {
                                     mha::attend_paged_cache(qv, cache, seqs, q_start, o, out, lse);
                                   });
        });

  py::class_<mha::MultiheadAttention>(m, "Module")
      .def(py::init([](int64_t embed_dim, int64_t num_heads, int64_t num_kv_heads, int64_t kdim, int64_t vdim,
                       bool bias, bool add_bias_kv, bool add_zero_attn, float dropout, bool batch_first, bool rope,
                       double rope_theta, int64_t rope_dims, const std::string& rope_pairing, int64_t head_dim,
                       uint64_t seed) {
        return mha::MultiheadAttention(
            make_config(embed_dim, num_heads, num_kv_heads, kdim, vdim, bias, add_bias_kv, add_zero_attn, dropout,
                        batch_first, rope, rope_theta, rope_dims, rope_pairing, head_dim),
            seed);
      }))
      .def("config", [](const mha::MultiheadAttention& self) { return config_dict(self.config()); })
      // Pickling, and so copy.copy / copy.deepcopy: the whole configuration and the parameters (the
      // kept working buffers are not part of the module's value). A version tag first, so that a
      // later layout can still read this one or refuse it by name.
      .def(py::pickle(
          [](const mha::MultiheadAttention& self) {
            const mha::MhaConfig& c = self.config();
            py::dict params;
            for (const auto& n : kParamNames)
              if (const mha::Tensor* t = param_slot(self.params(), n); t->defined())
                params[py::str(n)] = array_from(*t);
            const py::tuple config = py::make_tuple(
                c.embed_dim, c.num_heads, c.num_kv_heads, c.kdim, c.vdim, c.bias, c.add_bias_kv, c.add_zero_attn,
                c.dropout, c.layout == mha::Layout::BatchFirst, c.rope.enabled, c.rope.theta, c.rope.dims,
                c.rope.pairing == mha::RopePairing::HalfSplit ? "half_split" : "interleaved", c.head_dim_override,
                c.scale ? py::cast(*c.scale) : py::none(), c.alibi_slopes, c.softcap, c.attention_sinks);
            return py::make_tuple(1, config, params);
          },
          [](const py::tuple& state) {
            if (state.size() != 3 || py::cast<int>(state[0]) != 1)
              mha::fail("Module: cannot unpickle this state (written by another version of mha?)");
            const auto c_in = py::cast<py::tuple>(state[1]);
            if (c_in.size() != 19) mha::fail("Module: cannot unpickle a configuration of ", c_in.size(), " fields");
            mha::MhaConfig c =
                make_config(py::cast<int64_t>(c_in[0]), py::cast<int64_t>(c_in[1]), py::cast<int64_t>(c_in[2]),
                            py::cast<int64_t>(c_in[3]), py::cast<int64_t>(c_in[4]), py::cast<bool>(c_in[5]),
                            py::cast<bool>(c_in[6]), py::cast<bool>(c_in[7]), py::cast<float>(c_in[8]),
                            py::cast<bool>(c_in[9]), py::cast<bool>(c_in[10]), py::cast<double>(c_in[11]),
                            py::cast<int64_t>(c_in[12]), py::cast<std::string>(c_in[13]), py::cast<int64_t>(c_in[14]));
            if (!c_in[15].is_none()) c.scale = py::cast<float>(c_in[15]);
            c.alibi_slopes = py::cast<std::vector<float>>(c_in[16]);
            c.softcap = py::cast<float>(c_in[17]);
            c.attention_sinks = py::cast<bool>(c_in[18]);
            mha::MhaParameters p;
            for (const auto& [name, value] : py::cast<py::dict>(state[2])) {
              const std::string n = py::cast<std::string>(name);
              *param_slot(p, n) = tensor_from(py::cast<F32In>(value));
            }
            return mha::MultiheadAttention(c, std::move(p));  // validates the config and the shapes
          }))
      // The same module with scale / ALiBi / softcap / sinks set (sinks start at 0 when added).
      .def("with_score_options",
           [](const mha::MultiheadAttention& self, std::vector<float> slopes, float softcap, bool sinks,
              std::optional<float> scale) {
             mha::MhaConfig c = self.config();
             c.alibi_slopes = std::move(slopes);
             c.softcap = softcap;
             c.attention_sinks = sinks;
             c.scale = scale;
             mha::MhaParameters p = self.params();
             if (!sinks) p.sinks = mha::Tensor();
             if (sinks && p.sinks.numel() != c.num_heads) p.sinks = mha::Tensor({c.num_heads});
             return mha::MultiheadAttention(c, std::move(p));
           })
      // The same configuration with these parameters (every one the configuration has, by name): a
      // new module, `self` untouched, that shares self's workspace. mha.torch's forward binds its
      // torch parameters so, per call, instead of set() on a shared module, which a forward running
      // on another thread reads; the shared workspace lets each call reuse the buffers the last
      // one gave back (a module of its own started with none: ~130 MiB of fresh pages a training
      // step at B = 64, T = 128, E = 512).
      .def("with_params",
           [](const mha::MultiheadAttention& self, const py::dict& values) {
             mha::MhaParameters p;
             for (const auto& [name, value] : values) {
               const std::string n = py::cast<std::string>(name);
               *param_slot(p, n) = tensor_from(py::cast<F32In>(value));
             }
             return self.with_params(std::move(p));  // checks every shape
           })
      .def("parameter_count", &mha::MultiheadAttention::parameter_count)
      .def("release_workspace", &mha::MultiheadAttention::release_workspace)
      .def("workspace_bytes", &mha::MultiheadAttention::workspace_bytes)
      .def("param_names",
           [](mha::MultiheadAttention& self) {
             std::vector<std::string> names;
             for (const auto& n : kParamNames)
               if (param_slot(self.params(), n)->defined()) names.push_back(n);
             return names;
           })
      .def("get", [](mha::MultiheadAttention& self,
                     const std::string& name) { return array_from(*param_slot(self.params(), name)); })
      .def("set",
           [](mha::MultiheadAttention& self, const std::string& name, const F32In& value) {
             mha::Tensor* slot = param_slot(self.params(), name);
             mha::Tensor t = tensor_from(value);
             if (!slot->defined())
               mha::fail("load_state_dict: this module's configuration has no parameter '", name, "'");
             if (t.shape() != slot->shape())
               mha::fail("load_state_dict: '", name, "' has shape ", mha::shape_str(t.shape()), ", expected ",
                         mha::shape_str(slot->shape()));
             *slot = std::move(t);
           })
      .def("forward",
           [](const mha::MultiheadAttention& self, const py::object& q, const py::object& k, const py::object& v,
              const ForwardArgs& args) {
             ModuleInputs in;
             fill_inputs(in, q, k, v);
             const mha::MhaForwardOptions opt = forward_options(args);
             mha::MhaOutput r;
             {
               py::gil_scoped_release release;
               r = self.forward(in.q, in.key(), in.value(), opt);
             }
             return py::make_tuple(array_take(std::move(r.output)), array_take(std::move(r.attn_weights)),
                                   array_take(std::move(r.lse)));
           })
      .def("forward_incremental",
           [](const mha::MultiheadAttention& self, const F32In& q, const F32In& k, const F32In& v, mha::KvCache& cache,
              std::vector<int64_t> new_lengths, int64_t window, int threads) {
             return incremental_call(
                 cache, q, k, v, std::move(new_lengths), window, threads,
                 [&](const mha::Tensor& qt, const mha::Tensor& kt, const mha::Tensor& vt,
                     const mha::IncrementalOptions& o) { return self.forward_incremental(qt, kt, vt, cache, o); });
           })
      .def("forward_incremental_paged",
           [](const mha::MultiheadAttention& self, const F32In& q, const F32In& k, const F32In& v,
              mha::PagedKvCache& cache, const std::vector<int64_t>& seqs, std::vector<int64_t> new_lengths,
              int64_t window, int threads) {
             return incremental_call(cache, q, k, v, std::move(new_lengths), window, threads,
                                     [&](const mha::Tensor& qt, const mha::Tensor& kt, const mha::Tensor& vt,
                                         const mha::IncrementalOptions& o) {
                                       return self.forward_incremental(qt, kt, vt, cache, seqs, o);
                                     });
           })
      .def("forward_train",
           [](const mha::MultiheadAttention& self, const py::object& q, const py::object& k, const py::object& v,
              const ForwardArgs& args) {
             auto tc = std::make_unique<TrainContext>();
             fill_inputs(tc->inputs, q, k, v);
             const mha::MhaForwardOptions opt = forward_options(args);
             mha::MhaTrainOutput r;
             {
               py::gil_scoped_release release;
               r = mha::forward_train(self, tc->inputs.q, tc->inputs.key(), tc->inputs.value(), opt);
             }
             tc->ctx = std::move(r.context);
             return py::make_tuple(array_take(std::move(r.output)), std::move(tc));
           })
      .def("backward",
           [](const mha::MultiheadAttention& self, const TrainContext& tc, const F32In& d_output) {
             const mha::Tensor g = tensor_from(d_output);
             mha::MhaGradients r;
             {
               py::gil_scoped_release release;
               r = mha::backward(self, tc.ctx, g);
             }
             py::dict d;
             d["query"] = array_take(std::move(r.query));
             d["key"] = array_take(std::move(r.key));
             d["value"] = array_take(std::move(r.value));
             for (const auto& n : kParamNames) {
               mha::Tensor* t = param_slot(r.params, n);
               if (t->defined()) d[py::str(n)] = array_take(std::move(*t));
             }
             return d;
           })
      .def("save",
           [](const mha::MultiheadAttention& self, const std::string& path, const std::string& names) {
             mha::io::WeightNames w = mha::io::WeightNames::PyTorch;
             if (names == "huggingface")
               w = mha::io::WeightNames::HuggingFace;
             else if (names != "pytorch")
               mha::fail("save: names must be 'pytorch' or 'huggingface', got '", names, "'");
             mha::io::save_module(path, self, w);
           })
      .def("prune",
           [](const mha::MultiheadAttention& self, const std::vector<int64_t>& heads, bool duplicate_kv) {
             mha::PruneOptions o;
             o.uneven_groups = duplicate_kv ? mha::UnevenGroups::DuplicateKV : mha::UnevenGroups::Refuse;
             return mha::prune_heads(self, heads, o);
           })
      .def("head_importance", [](const mha::MultiheadAttention& self, const F32In& q, const F32In& k, const F32In& v,
                                 const ForwardArgs& args) {
        return mha::head_importance(self, tensor_from(q), tensor_from(k), tensor_from(v), forward_options(args));
      });

  // For bench/python_overhead.py: the baseline of the Python call's overhead. Times the same C++
  // call `mha bench` times (self-attention module forward, no weights, eval) on this process's
  // module and input, so both sides run interleaved in one process under the same machine load.
  // Returns each call's milliseconds; the input is copied into a Tensor once, outside the timing.
  m.def("_time_cpp_forward", [](const mha::MultiheadAttention& self, const F32In& x, int repeat, int threads) {
    const mha::Tensor t = tensor_from(x);
    mha::MhaForwardOptions opt;
    opt.threads = threads;
    std::vector<double> ms;
    py::gil_scoped_release release;
    for (int i = 0; i < repeat; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      const mha::MhaOutput r = self.forward(t, t, t, opt);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    return ms;
  });

  m.def("load_module",
        [](const std::string& path) { return mha::io::load_module(mha::io::SafetensorsFile::open(path)); });
  m.def("load_weights", [](mha::MultiheadAttention& self, const std::string& path) {
    mha::io::load_weights(self, mha::io::SafetensorsFile::open(path));
  });
  m.def("read_safetensors", [](const std::string& path) {
    const auto f = mha::io::SafetensorsFile::open(path);
    py::dict tensors;
    for (const auto& name : f.names()) {
      const auto& info = f.info(name);
      // numpy refuses shapes the file format allows (more dimensions than its NPY_MAXDIMS: 32 in
      // numpy 1, 64 in numpy 2; extents whose product overflows before a zero one empties them),
      // with a ValueError that named neither the file nor the tensor. numpy's own verdict, whichever
      // numpy is loaded, is re-raised with both named. (Such a tensor holds no more elements than
      // the file has bytes, so reading it first allocates nothing large.)
      try {
        if (info.dtype == mha::io::DType::BOOL) {
          const mha::BoolTensor b = f.read_bool(name);
          py::array_t<bool> a(std::vector<py::ssize_t>(b.shape().begin(), b.shape().end()));
          for (int64_t i = 0; i < b.numel(); ++i) a.mutable_data()[i] = b.data()[i] != 0;
          tensors[py::str(name)] = a;
        } else if (const char* format = integer_format(info.dtype)) {
          // Integers keep their type (cu_seqlens, token ids): as float32 they lost every value past
          // 2^24 and could not be passed back where the API takes integer offsets.
          const std::span<const std::byte> bytes = f.raw(name);
          py::array a(py::dtype(format), std::vector<py::ssize_t>(info.shape.begin(), info.shape.end()));
          if (!bytes.empty()) std::memcpy(a.mutable_data(), bytes.data(), bytes.size());
          tensors[py::str(name)] = a;
        } else {
          tensors[py::str(name)] = array_take(f.read_f32(name));
        }
      } catch (py::error_already_set& e) {
        if (!e.matches(PyExc_ValueError)) throw;
        throw py::value_error("read_safetensors: " + path + ": tensor '" + name + "' " +
                              mha::io::dtype_name(info.dtype) + " shape " + mha::shape_str(info.shape) +
                              " is not one numpy can hold: " + py::str(e.value()).cast<std::string>());
      }
    }
    return py::make_tuple(tensors, f.metadata());
  });
  m.def("analyze", [](const F32In& weights, std::optional<int64_t> query_offset, std::optional<int64_t> key_positions,
                      std::optional<py::array> key_padding, std::optional<py::array> query_padding) {
    mha::MetricsOptions o;
    o.query_offset = query_offset;
    o.key_positions = key_positions;
    if (key_padding) o.key_padding = bool_tensor_from(*key_padding, "key_padding_mask");
    if (query_padding) o.query_padding = bool_tensor_from(*query_padding, "query_padding_mask");
    return metrics_list(mha::head_metrics(tensor_from(weights), o));
  });
  m.def("write_heatmap_png",
        [](const std::string& path, const F32In& weights) { mha::write_heatmap_png(path, tensor_from(weights)); });
}
