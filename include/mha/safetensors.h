// mha/safetensors.h — reading and writing safetensors files, and the module's weights in them.
//
// Format: 8-byte little-endian header length N, N bytes of UTF-8 JSON mapping each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the end of the header),
// an optional "__metadata__" object of string → string, then the raw little-endian data.
// Files are memory-mapped and validated completely when opened: header length and JSON, known
// dtypes, shape × dtype size = byte range (no integer overflow), ranges inside the file and not
// overlapping. Any violation throws mha::Error naming the file and the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mha/module.h"
#include "mha/tensor.h"

namespace mha::io {

enum class DType : uint8_t { BOOL, U8, I8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64 };

const char* dtype_name(DType dtype);  ///< "F32", "BF16", …
size_t dtype_size(DType dtype);       ///< bytes per element

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  uint64_t begin = 0;  ///< byte offsets relative to the start of the data section
  uint64_t end = 0;
};

/// A validated, memory-mapped safetensors file (read-only).
class SafetensorsFile {
 public:
  /// Maps and validates `path`; throws mha::Error on any malformation.
  static SafetensorsFile open(const std::string& path);
  /// Validates an in-memory image (the same checks); the bytes are copied.
  static SafetensorsFile from_bytes(std::span<const std::byte> bytes, const std::string& label = "<memory>");

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const;
  const std::map<std::string, std::string>& metadata() const;
  std::vector<std::string> names() const;  ///< sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;  ///< throws if absent
  std::span<const std::byte> raw(const std::string& name) const;

  /// Converts F32, F16, BF16, F64 (and integer/bool types) to float32.
  Tensor read_f32(const std::string& name) const;
  /// BOOL or U8 → bytes 0/1 (any nonzero becomes 1).
  BoolTensor read_bool(const std::string& name) const;

 private:
  struct Impl;
  explicit SafetensorsFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Collects tensors and writes them in one go. write() goes to a temporary file beside the
/// target and renames it, so a failure never leaves a partial output file.
class SafetensorsWriter {
 public:
  void set_metadata(const std::string& key, const std::string& value);
  void add(const std::string& name, const Tensor& t);           ///< F32
  void add(const std::string& name, const BF16Tensor& t);       ///< BF16
  void add_bool(const std::string& name, const BoolTensor& t);  ///< BOOL
  void add_raw(const std::string& name, DType dtype, const Shape& shape, std::span<const std::byte> bytes);
  void write(const std::string& path) const;
  std::vector<std::byte> to_bytes() const;

 private:
  struct Entry {
    DType dtype;
    Shape shape;
    std::vector<std::byte> bytes;
  };
  std::map<std::string, std::string> metadata_;
  std::map<std::string, Entry> tensors_;
};

// ---- The module's weights ------------------------------------------------------------------

enum class WeightNames : uint8_t {
  PyTorch,      ///< in_proj_weight or q/k/v_proj_weight, in_proj_bias, bias_k, bias_v, out_proj.weight/bias
  HuggingFace,  ///< q_proj.weight, k_proj.weight, v_proj.weight, o_proj.weight (+ .bias)
};

/// The configuration stored in a file's metadata (keys as in shared/conformance/README.md:
/// embed_dim, num_heads, num_kv_heads, kdim, vdim, bias, add_bias_kv, add_zero_attn, batch_first).
MhaConfig config_from_metadata(const std::map<std::string, std::string>& metadata, const std::string& label);
std::map<std::string, std::string> metadata_from_config(const MhaConfig& config);

/// Which naming scheme a file uses (throws if it has neither set of projection weights).
WeightNames detect_weight_names(const SafetensorsFile& file);

/// Loads every parameter of `module` from `file` (either naming scheme, auto-detected), checking
/// each shape against the module's configuration.
void load_weights(MultiheadAttention& module, const SafetensorsFile& file);

/// Config from the metadata, then the weights.
MultiheadAttention load_module(const SafetensorsFile& file);

/// Adds the module's parameters (and its config as metadata) to `writer` under `names`.
void add_weights(SafetensorsWriter& writer, const MultiheadAttention& module, WeightNames names);
void save_module(const std::string& path, const MultiheadAttention& module, WeightNames names);

}  // namespace mha::io
