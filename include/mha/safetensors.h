// mha/safetensors.h — reading and writing safetensors files: the file format only.
//
// Format: 8-byte little-endian header length N, N bytes of UTF-8 JSON mapping each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the end of the header),
// an optional "__metadata__" object of string → string, then the raw little-endian data.
// Files are memory-mapped and validated completely when opened: header length and JSON, known
// dtypes, shape × dtype size = byte range (no integer overflow), ranges inside the file and not
// overlapping. Any violation throws mha::Error naming the file and the tensor.
// The multi-head module's parameters in such files (names, metadata) are mha/weights.h's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

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

  /// Converts F32, F16, BF16, F64 (and integer/bool types) to float32; a finite F64 value past
  /// float32's range is an error naming the tensor and element, not ±inf.
  Tensor read_f32(const std::string& name) const;
  /// BOOL or U8 → bytes 0/1 (any nonzero becomes 1).
  BoolTensor read_bool(const std::string& name) const;

 private:
  struct Impl;
  explicit SafetensorsFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Collects tensors and writes them in one go. write() goes to a temporary file beside the
/// target and renames it, so a failure never leaves a partial output file. It streams the header
/// and then each tensor's bytes to the file: no image of the whole file is built in memory.
class SafetensorsWriter {
 public:
  /// Called while writing with (bytes written, total bytes), about every 1% of a large file.
  using Progress = std::function<void(uint64_t done, uint64_t total)>;

  void set_metadata(const std::string& key, const std::string& value);
  void add(const std::string& name, const Tensor& t);           ///< F32 (copied)
  void add(const std::string& name, const BF16Tensor& t);       ///< BF16 (copied)
  void add_bool(const std::string& name, const BoolTensor& t);  ///< BOOL (copied)
  void add_raw(const std::string& name, DType dtype, const Shape& shape, std::span<const std::byte> bytes);
  /// F32 without a copy: `t` must stay alive and unchanged until write() / to_bytes() return.
  /// For large outputs, which would otherwise be held twice.
  void add_ref(const std::string& name, const Tensor& t);
  void write(const std::string& path, const Progress& progress = {}) const;
  std::vector<std::byte> to_bytes() const;

 private:
  struct Entry {
    DType dtype;
    Shape shape;
    std::vector<std::byte> owned;     ///< the copied bytes (add, add_raw)
    std::span<const std::byte> view;  ///< the caller's bytes (add_ref), when owned is empty
    std::span<const std::byte> bytes() const { return owned.empty() ? view : std::span<const std::byte>(owned); }
  };
  struct Layout {
    std::string header;  ///< padded JSON text
    std::vector<const std::pair<const std::string, Entry>*> order;
    uint64_t data_size = 0;
  };
  Layout layout() const;
  void add_entry(const std::string& name, DType dtype, const Shape& shape, std::span<const std::byte> bytes, bool copy);
  std::map<std::string, std::string> metadata_;
  std::map<std::string, Entry> tensors_;
};

}  // namespace mha::io
