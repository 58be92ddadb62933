// safetensors reading (memory-mapped, validated once on open) and writing (atomic rename).
//
// Everything a file claims is checked before any tensor is handed out, so the accessors below can
// index the data section without further bounds checks: a malformed or hostile file is an
// mha::Error at open time, never an out-of-bounds read later.
#include "mha/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "io/paths.h"

namespace mha::io {

// Element bytes are copied straight from the file; safetensors data is little-endian.
static_assert(std::endian::native == std::endian::little, "mha::io assumes a little-endian host");

namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // a real header is kilobytes; this bounds a hostile one

/// `s` with every byte outside printable ASCII written as \xNN. nlohmann's parse errors quote the
/// header where they stopped, which in a hostile file need not be text: raw, such bytes reached
/// the terminal, and Python raised an empty ValueError for a message that was not UTF-8.
std::string printable(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char ch : s) {
    const auto b = static_cast<unsigned char>(ch);
    if (b >= 0x20 && b < 0x7F) {
      out += ch;
    } else {
      constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[b >> 4];
      out += kHex[b & 15];
    }
  }
  return out;
}

struct DTypeEntry {
  DType dtype;
  const char* name;
  size_t size;
};
constexpr DTypeEntry kDTypes[] = {
    {DType::BOOL, "BOOL", 1}, {DType::U8, "U8", 1},   {DType::I8, "I8", 1},     {DType::I16, "I16", 2},
    {DType::U16, "U16", 2},   {DType::I32, "I32", 4}, {DType::U32, "U32", 4},   {DType::I64, "I64", 8},
    {DType::U64, "U64", 8},   {DType::F16, "F16", 2}, {DType::BF16, "BF16", 2}, {DType::F32, "F32", 4},
    {DType::F64, "F64", 8},
};

std::optional<DType> parse_dtype(const std::string& s) {
  for (const auto& e : kDTypes)
    if (s == e.name) return e.dtype;
  return std::nullopt;
}

std::string errno_str() { return std::strerror(errno); }

uint64_t read_le64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

/// Byte count of `shape` elements of `dtype`, or nullopt on overflow of 64 bits.
std::optional<uint64_t> checked_nbytes(const Shape& shape, DType dtype) {
  // Any zero extent makes 0 bytes, whatever the others (2^63 − 1 × 0 overflowed before the 0).
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  uint64_t n = dtype_size(dtype);
  for (int64_t s : shape)
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(s), &n)) return std::nullopt;
  return n;
}

/// Parses a JSON number that must be a non-negative integer fitting int64 (shape extents, offsets).
/// nlohmann keeps non-negative integers as number_unsigned, negative ones as number_integer and
/// anything with a fraction, exponent or beyond 2^64 as number_float.
std::optional<uint64_t> as_index(const json& v) {
  if (!v.is_number_unsigned()) return std::nullopt;
  const auto u = v.get<uint64_t>();
  if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return u;
}

/// nlohmann::json silently keeps the last of two equal keys; safetensors must reject them (two
/// definitions of one tensor would make the file mean different things to different readers).
/// A parser callback sees every key with the object it belongs to, so duplicates are caught here.
class DuplicateKeyFinder {
 public:
  /// A real header nests 3 levels (the object, a tensor's entry, its shape); each level costs this
  /// finder a frame and nlohmann a node, so a header of nested brackets within the size limit took
  /// ~130 times its size in memory before failing. Deeper than this is refused as it is read.
  static constexpr int kMaxDepth = 32;
  struct TooDeep {};

  bool operator()(int depth, json::parse_event_t event, json& parsed) {
    if (depth > kMaxDepth) throw TooDeep{};
    switch (event) {
      case json::parse_event_t::object_start:
        frames_.push_back(Frame{true, {}, last_key(), {}});
        break;
      case json::parse_event_t::array_start:
        frames_.push_back(Frame{false, {}, last_key(), {}});
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!frames_.empty()) frames_.pop_back();
        break;
      case json::parse_event_t::key:
        if (!frames_.empty() && frames_.back().is_object) {
          auto key = parsed.get<std::string>();
          if (!frames_.back().keys.insert(key).second && !duplicate_) duplicate_ = {key, frames_.back().owner};
          frames_.back().last = std::move(key);
        }
        break;
      case json::parse_event_t::value:
        break;
    }
    return true;
  }
  /// (the repeated key, the key of the object holding it; empty at top level)
  const std::optional<std::pair<std::string, std::string>>& duplicate() const { return duplicate_; }

 private:
  struct Frame {
    bool is_object;
    std::set<std::string> keys;
    std::string owner;
    std::string last;
  };
  std::string last_key() const { return frames_.empty() ? std::string() : frames_.back().last; }
  std::vector<Frame> frames_;
  std::optional<std::pair<std::string, std::string>> duplicate_;
};

float f16_to_float(uint16_t h) {
  const bool negative = (h & 0x8000u) != 0;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Zero and subnormals: mantissa · 2^-24 is exact in float32.
    const float mag = std::ldexp(static_cast<float>(mantissa), -24);
    return negative ? -mag : mag;
  }
  uint32_t bits = negative ? 0x80000000u : 0u;
  if (exponent == 0x1f)
    bits |= 0x7f800000u | (mantissa << 13);  // inf, or NaN keeping its payload
  else
    bits |= ((exponent + (127 - 15)) << 23) | (mantissa << 13);  // rebias 15 → 127
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <class T>
void convert(const std::byte* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(T));
    dst[i] = static_cast<float>(v);
  }
}

}  // namespace

const char* dtype_name(DType dtype) {
  for (const auto& e : kDTypes)
    if (e.dtype == dtype) return e.name;
  return "?";
}

size_t dtype_size(DType dtype) {
  for (const auto& e : kDTypes)
    if (e.dtype == dtype) return e.size;
  return 0;
}

// ---- SafetensorsFile ---------------------------------------------------------------------------

struct SafetensorsFile::Impl {
  std::string path;
  void* map = nullptr;  // the mmap'd file (open), or null
  size_t map_len = 0;
  std::vector<std::byte> owned;     // the copied image (from_bytes)
  const std::byte* data = nullptr;  // start of the data section
  uint64_t data_size = 0;
  std::map<std::string, std::string> metadata;
  std::map<std::string, TensorInfo> tensors;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (map) ::munmap(map, map_len);
  }

  /// Validates the image [base, base + size) and fills metadata/tensors/data.
  void parse(const std::byte* base, uint64_t size);
  const TensorInfo& find(const std::string& name, const char* caller) const;
};

void SafetensorsFile::Impl::parse(const std::byte* base, uint64_t size) {
  const std::string where = "safetensors: " + path + ": ";
  if (size < 8) fail(where, "file is ", size, " bytes, shorter than the 8-byte header length");
  const uint64_t n = read_le64(base);
  if (n > size - 8)
    fail(where, "header length ", n, " runs past the end of the file (", size - 8, " bytes follow the length)");
  if (n > kMaxHeaderBytes) fail(where, "header length ", n, " exceeds the limit of ", kMaxHeaderBytes, " bytes");

  const char* text = reinterpret_cast<const char*>(base + 8);
  // nlohmann stops reading at a NUL byte as at the end of its input, so what followed one (a
  // tensor's entry, invalid UTF-8) went unread and unchecked; JSON holds none (strings escape it).
  // Some writers pad the header with NULs where the format says spaces: a run of NULs to the end
  // of the header is taken as padding, a NUL with anything after it is refused.
  uint64_t json_bytes = n;
  if (const void* nul = std::memchr(text, 0, n)) {
    json_bytes = static_cast<uint64_t>(static_cast<const char*>(nul) - text);
    for (uint64_t i = json_bytes; i < n; ++i)
      if (text[i] != 0)
        fail(where, "header (", n, " bytes) holds a NUL byte at offset ", json_bytes,
             " with more after it: not JSON (pad a header with spaces)");
  }
  DuplicateKeyFinder dups;
  json header;
  try {
    // nlohmann rejects invalid UTF-8 inside strings and any non-JSON byte outside them.
    header = json::parse(text, text + json_bytes, std::ref(dups));
  } catch (const json::exception& e) {
    fail(where, "header (", n, " bytes) is not valid JSON: ", printable(e.what()));
  } catch (const DuplicateKeyFinder::TooDeep&) {
    fail(where, "header (", n, " bytes) nests deeper than ", DuplicateKeyFinder::kMaxDepth, " levels");
  }
  if (dups.duplicate()) {
    const auto& [key, owner] = *dups.duplicate();
    if (owner.empty()) fail(where, "tensor name '", key, "' appears twice in the header");
    fail(where, "key '", key, "' appears twice in '", owner, "'");
  }
  if (!header.is_object()) fail(where, "header is a JSON ", header.type_name(), ", expected an object");

  data = base + 8 + n;
  data_size = size - 8 - n;

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(where, "'__metadata__' is a JSON ", entry.type_name(), ", expected an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string())
          fail(where, "'__metadata__' value for '", key, "' is a JSON ", value.type_name(), ", expected a string");
        metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string tensor = "tensor '" + name + "'";
    if (!entry.is_object()) fail(where, tensor, " is a JSON ", entry.type_name(), ", expected an object");
    for (const char* field : {"dtype", "shape", "data_offsets"})
      if (!entry.contains(field)) fail(where, tensor, " has no '", field, "'");

    TensorInfo info;
    info.name = name;
    const json& dtype = entry["dtype"];
    if (!dtype.is_string()) fail(where, tensor, " dtype is a JSON ", dtype.type_name(), ", expected a string");
    const auto parsed = parse_dtype(dtype.get<std::string>());
    if (!parsed)
      fail(where, tensor, " has unknown dtype '", dtype.get<std::string>(),
           "' (known: BOOL U8 I8 I16 U16 I32 U32 I64 U64 F16 BF16 F32 F64)");
    info.dtype = *parsed;

    const json& shape = entry["shape"];
    if (!shape.is_array()) fail(where, tensor, " shape is a JSON ", shape.type_name(), ", expected an array");
    for (size_t i = 0; i < shape.size(); ++i) {
      const auto extent = as_index(shape[i]);
      if (!extent) fail(where, tensor, " shape ", shape.dump(), ": extent ", i, " is not a non-negative integer");
      info.shape.push_back(static_cast<int64_t>(*extent));
    }

    const json& offsets = entry["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2)
      fail(where, tensor, " data_offsets ", offsets.dump(), " is not a [begin, end] pair");
    const auto begin = as_index(offsets[0]), end = as_index(offsets[1]);
    if (!begin || !end) fail(where, tensor, " data_offsets ", offsets.dump(), " are not non-negative integers");
    if (*begin > *end) fail(where, tensor, " data_offsets [", *begin, ", ", *end, "] begin after end");
    info.begin = *begin;
    info.end = *end;

    const std::string desc = tensor + " " + dtype_name(info.dtype) + " shape " + shape_str(info.shape);
    // The element count must fit even where a zero extent makes the byte size 0: readers build
    // tensors (and strides) of this shape, e.g. [2^63 - 1, 2, 0].
    try {
      (void)shape_numel(info.shape);
    } catch (const Error&) {
      fail(where, desc, " has an element count that overflows 64 bits");
    }
    const auto nbytes = checked_nbytes(info.shape, info.dtype);
    if (!nbytes || *nbytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(where, desc, " has a byte size that overflows 64 bits");
    if (*nbytes != info.end - info.begin)
      fail(where, desc, " needs ", *nbytes, " bytes but data_offsets span ", info.end - info.begin);
    if (info.end > data_size)
      fail(where, tensor, " data_offsets [", info.begin, ", ", info.end, "] run past the data section (", data_size,
           " bytes)");
    tensors.emplace(name, std::move(info));
  }

  // Overlapping ranges would make two tensors alias the same bytes; sort by start and sweep.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& [name, info] : tensors) by_offset.push_back(&info);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  // A range that starts before the furthest end so far shares bytes with an earlier tensor (an
  // empty range shares none, wherever it sits).
  const TensorInfo* furthest = nullptr;
  for (const TensorInfo* cur : by_offset) {
    if (cur->begin == cur->end) continue;
    if (furthest && cur->begin < furthest->end)
      fail(where, "tensor '", cur->name, "' data_offsets [", cur->begin, ", ", cur->end, "] overlap tensor '",
           furthest->name, "' [", furthest->begin, ", ", furthest->end, "]");
    if (!furthest || cur->end > furthest->end) furthest = cur;
  }
}

const TensorInfo& SafetensorsFile::Impl::find(const std::string& name, const char* caller) const {
  const auto it = tensors.find(name);
  if (it == tensors.end()) {
    std::string have;
    size_t listed = 0;
    for (const auto& [n, info] : tensors) {
      if (listed++ == 12) {
        have += ", …";
        break;
      }
      have += (have.empty() ? "" : ", ") + n;
    }
    fail("safetensors: ", path, ": ", caller, ": no tensor named '", name,
         "' (the file has: ", have.empty() ? "none" : have, ")");
  }
  return it->second;
}

SafetensorsFile::SafetensorsFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  detail::check_path("safetensors", path);  // "a\0b" would open "a" (Python passes such strings on)
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  // O_NONBLOCK: a FIFO (or a device) opens at once and is refused below, where a blocking open
  // waited for a writer for ever; regular files and their mapping are unaffected.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail("safetensors: ", path, ": cannot open: ", errno_str());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string err = errno_str();
    ::close(fd);
    fail("safetensors: ", path, ": cannot stat: ", err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("safetensors: ", path, ": not a regular file");
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  // mmap of length 0 is an error; a file that short fails validation anyway.
  if (size >= 8) {
    void* p = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const std::string err = errno_str();
      ::close(fd);
      fail("safetensors: ", path, ": cannot map ", size, " bytes: ", err);
    }
    impl->map = p;
    impl->map_len = static_cast<size_t>(size);
  }
  ::close(fd);  // the mapping stays valid without the descriptor
  impl->parse(static_cast<const std::byte*>(impl->map), size);
  return SafetensorsFile(std::move(impl));
}

SafetensorsFile SafetensorsFile::from_bytes(std::span<const std::byte> bytes, const std::string& label) {
  auto impl = std::make_unique<Impl>();
  impl->path = label;
  impl->owned.assign(bytes.begin(), bytes.end());
  impl->parse(impl->owned.data(), impl->owned.size());
  return SafetensorsFile(std::move(impl));
}

const std::string& SafetensorsFile::path() const { return impl_->path; }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return impl_->metadata; }

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(impl_->tensors.size());
  for (const auto& [name, info] : impl_->tensors) out.push_back(name);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const { return impl_->tensors.count(name) != 0; }

const TensorInfo& SafetensorsFile::info(const std::string& name) const { return impl_->find(name, "info"); }

std::span<const std::byte> SafetensorsFile::raw(const std::string& name) const {
  const TensorInfo& t = impl_->find(name, "raw");
  return {impl_->data + t.begin, static_cast<size_t>(t.end - t.begin)};
}

Tensor SafetensorsFile::read_f32(const std::string& name) const {
  const TensorInfo& t = impl_->find(name, "read_f32");
  Tensor out(t.shape);
  const std::byte* src = impl_->data + t.begin;
  float* dst = out.data();
  const auto n = static_cast<size_t>(out.numel());
  if (n == 0) return out;  // an empty tensor has no storage to copy into
  switch (t.dtype) {
    case DType::F32:
      std::memcpy(dst, src, n * 4);
      break;
    case DType::F64:
      for (size_t i = 0; i < n; ++i) {
        double v;
        std::memcpy(&v, src + 8 * i, 8);
        // Past float32's largest value plus half its last step the float is ±inf (and the C++
        // conversion undefined): a finite weight must not load as an infinite one.
        if (std::fabs(v) >= 0x1.ffffffp+127 && std::isfinite(v))
          fail("read_f32: ", impl_->path, ": tensor '", name, "' element ", i, " = ", v, " is beyond float32's range");
        dst[i] = static_cast<float>(v);
      }
      break;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) {
        bf16 b;
        std::memcpy(&b.bits, src + 2 * i, 2);
        dst[i] = to_float(b);
      }
      break;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = f16_to_float(h);
      }
      break;
    case DType::BOOL:
      for (size_t i = 0; i < n; ++i) dst[i] = src[i] != std::byte{0} ? 1.0f : 0.0f;
      break;
    case DType::U8:
      convert<uint8_t>(src, dst, n);
      break;
    case DType::I8:
      convert<int8_t>(src, dst, n);
      break;
    case DType::I16:
      convert<int16_t>(src, dst, n);
      break;
    case DType::U16:
      convert<uint16_t>(src, dst, n);
      break;
    case DType::I32:
      convert<int32_t>(src, dst, n);
      break;
    case DType::U32:
      convert<uint32_t>(src, dst, n);
      break;
    case DType::I64:
      convert<int64_t>(src, dst, n);
      break;
    case DType::U64:
      convert<uint64_t>(src, dst, n);
      break;
  }
  return out;
}

BoolTensor SafetensorsFile::read_bool(const std::string& name) const {
  const TensorInfo& t = impl_->find(name, "read_bool");
  if (t.dtype != DType::BOOL && t.dtype != DType::U8)
    fail("safetensors: ", impl_->path, ": read_bool: tensor '", name, "' is ", dtype_name(t.dtype),
         ", expected BOOL or U8");
  BoolTensor out(t.shape);
  const std::byte* src = impl_->data + t.begin;
  for (size_t i = 0; i < out.storage().size(); ++i) out.data()[i] = src[i] != std::byte{0} ? 1 : 0;
  return out;
}

// ---- SafetensorsWriter -------------------------------------------------------------------------

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

void SafetensorsWriter::add(const std::string& name, const Tensor& t) {
  add_raw(name, DType::F32, t.shape(), std::as_bytes(t.values()));
}

void SafetensorsWriter::add(const std::string& name, const BF16Tensor& t) {
  add_raw(name, DType::BF16, t.shape(), std::as_bytes(t.values()));
}

void SafetensorsWriter::add_bool(const std::string& name, const BoolTensor& t) {
  // Normalise to 0/1: safetensors BOOL bytes other than 0 and 1 are not valid booleans elsewhere.
  std::vector<std::byte> bytes(t.storage().size());
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = t.storage()[i] ? std::byte{1} : std::byte{0};
  add_raw(name, DType::BOOL, t.shape(), bytes);
}

void SafetensorsWriter::add_raw(const std::string& name, DType dtype, const Shape& shape,
                                std::span<const std::byte> bytes) {
  add_entry(name, dtype, shape, bytes, true);
}

void SafetensorsWriter::add_ref(const std::string& name, const Tensor& t) {
  add_entry(name, DType::F32, t.shape(), std::as_bytes(t.values()), false);
}

void SafetensorsWriter::add_entry(const std::string& name, DType dtype, const Shape& shape,
                                  std::span<const std::byte> bytes, bool copy) {
  if (name == "__metadata__") fail("SafetensorsWriter::add: '__metadata__' is reserved and cannot name a tensor");
  if (tensors_.count(name)) fail("SafetensorsWriter::add: tensor '", name, "' was already added");
  if (dtype_size(dtype) == 0) fail("SafetensorsWriter::add: tensor '", name, "' has an invalid dtype");
  for (int64_t s : shape)
    if (s < 0) fail("SafetensorsWriter::add: tensor '", name, "' has a negative extent in shape ", shape_str(shape));
  const auto nbytes = checked_nbytes(shape, dtype);
  if (!nbytes || *nbytes != bytes.size())
    fail("SafetensorsWriter::add: tensor '", name, "' ", dtype_name(dtype), " shape ", shape_str(shape), " needs ",
         nbytes ? std::to_string(*nbytes) : std::string("more than 2^64"), " bytes but ", bytes.size(), " were given");
  Entry e{dtype, shape, {}, {}};
  if (copy)
    e.owned.assign(bytes.begin(), bytes.end());
  else
    e.view = bytes;
  tensors_.emplace(name, std::move(e));
}

SafetensorsWriter::Layout SafetensorsWriter::layout() const {
  // The data section is gap-free, as the reference safetensors reader requires. Laying tensors out
  // by element size, largest first, keeps every tensor aligned to its element size once the
  // header is padded so that the data section starts on an 8-byte boundary.
  Layout out;
  for (const auto& item : tensors_) out.order.push_back(&item);
  std::stable_sort(out.order.begin(), out.order.end(), [](const auto* a, const auto* b) {
    return dtype_size(a->second.dtype) > dtype_size(b->second.dtype);
  });
  std::map<std::string, std::pair<uint64_t, uint64_t>> offsets;
  for (const auto* item : out.order) {
    const uint64_t n = item->second.bytes().size();
    offsets[item->first] = {out.data_size, out.data_size + n};
    out.data_size += n;
  }

  // ordered_json keeps insertion order: __metadata__ first, then the names sorted.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    auto& meta = header["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata_) meta[key] = value;
  }
  for (const auto& [name, entry] : tensors_) {
    const auto& [begin, end] = offsets.at(name);
    nlohmann::ordered_json info = nlohmann::ordered_json::object();
    info["dtype"] = dtype_name(entry.dtype);
    info["shape"] = entry.shape;
    info["data_offsets"] = nlohmann::ordered_json::array({begin, end});
    header[name] = std::move(info);
  }
  try {
    out.header = header.dump();
  } catch (const nlohmann::json::exception& e) {
    fail("SafetensorsWriter: a tensor name or metadata string is not valid UTF-8: ", e.what());
  }
  out.header.append((8 - out.header.size() % 8) % 8, ' ');
  return out;
}

std::vector<std::byte> SafetensorsWriter::to_bytes() const {
  const Layout l = layout();
  std::vector<std::byte> out(8 + l.header.size() + l.data_size);
  const uint64_t n = l.header.size();
  std::memcpy(out.data(), &n, 8);
  std::memcpy(out.data() + 8, l.header.data(), l.header.size());
  std::byte* data = out.data() + 8 + l.header.size();
  for (const auto* item : l.order) {
    const auto bytes = item->second.bytes();
    if (!bytes.empty()) std::memcpy(data, bytes.data(), bytes.size());
    data += bytes.size();
  }
  return out;
}

void SafetensorsWriter::write(const std::string& path, const Progress& progress) const {
  const Layout l = layout();
  detail::check_path("SafetensorsWriter::write", path);
  // Write beside the target and rename: readers see either the old file or the complete new one.
  std::string tmp;
  const int fd = detail::create_temp_beside("SafetensorsWriter::write", path, tmp);
  const auto give_up = [&](const char* what) {
    const std::string err = errno_str();
    ::close(fd);
    ::unlink(tmp.c_str());
    fail("SafetensorsWriter::write: ", path, ": ", what, " ", tmp, " failed: ", err);
  };
  const uint64_t total = 8 + l.header.size() + l.data_size;
  uint64_t written = 0, reported = 0;
  // Pieces go out in chunks of at most 64 MiB so that progress can be reported as they do.
  const auto put = [&](const std::byte* p, size_t n) {
    constexpr size_t kChunk = size_t{64} << 20;
    while (n > 0) {
      const ssize_t w = ::write(fd, p, std::min(n, kChunk));
      if (w < 0) {
        if (errno == EINTR) continue;
        give_up("writing");
      }
      p += w, n -= static_cast<size_t>(w), written += static_cast<uint64_t>(w);
      if (progress && (written - reported >= total / 100 || written == total)) {
        reported = written;
        try {
          progress(written, total);
        } catch (...) {  // a callback that throws stops the write: no descriptor or temporary file left
          ::close(fd);
          ::unlink(tmp.c_str());
          throw;
        }
      }
    }
  };
  const uint64_t n = l.header.size();
  std::byte length[8];
  std::memcpy(length, &n, 8);
  put(length, 8);
  put(reinterpret_cast<const std::byte*>(l.header.data()), l.header.size());
  for (const auto* item : l.order) {
    const auto bytes = item->second.bytes();
    put(bytes.data(), bytes.size());
  }
  if (::fsync(fd) != 0) give_up("syncing");
  if (::close(fd) != 0) {
    const std::string err = errno_str();
    ::unlink(tmp.c_str());
    fail("SafetensorsWriter::write: ", path, ": closing ", tmp, " failed: ", err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = errno_str();
    ::unlink(tmp.c_str());
    fail("SafetensorsWriter::write: ", path, ": cannot rename ", tmp, " into place: ", err);
  }
}

}  // namespace mha::io
