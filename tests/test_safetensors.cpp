// safetensors: round trips for every dtype, the shared conformance files, and every kind of
// malformed input the reader promises to reject with a message naming what is wrong.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "mha/safetensors.h"
#include "support/test_support.h"

namespace mha::io {
namespace {

std::vector<std::byte> to_byte_vector(const void* p, size_t n) {
  std::vector<std::byte> out(n);
  if (n) std::memcpy(out.data(), p, n);
  return out;
}

template <class T>
std::vector<std::byte> bytes_of(const std::vector<T>& values) {
  return to_byte_vector(values.data(), values.size() * sizeof(T));
}

/// A file image from a header text and `data_bytes` bytes of data (each byte = its index).
std::vector<std::byte> image(const std::string& header, size_t data_bytes, uint64_t claimed_length = UINT64_MAX) {
  const uint64_t n = claimed_length == UINT64_MAX ? header.size() : claimed_length;
  std::vector<std::byte> out = to_byte_vector(&n, 8);
  for (char c : header) out.push_back(static_cast<std::byte>(c));
  for (size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<std::byte>(i));
  return out;
}

/// Expects from_bytes to throw mha::Error whose message names the file and contains every needle.
void expect_rejected(const std::vector<std::byte>& bytes, std::initializer_list<std::string> needles) {
  try {
    SafetensorsFile::from_bytes(bytes, "bad.safetensors");
    ADD_FAILURE() << "accepted a malformed image; expected an error mentioning " << *needles.begin();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("bad.safetensors"), std::string::npos) << msg;
    for (const std::string& needle : needles) EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  }
}

void expect_header_rejected(const std::string& header, size_t data_bytes, std::initializer_list<std::string> needles) {
  SCOPED_TRACE(header);
  expect_rejected(image(header, data_bytes), needles);
}

using mha::testing::error_of;

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// ---- round trips ------------------------------------------------------------------------------

struct DtypeCase {
  DType dtype;
  std::vector<std::byte> bytes;
  std::vector<float> as_float;
};

std::vector<DtypeCase> every_dtype() {
  std::vector<DtypeCase> cases;
  cases.push_back({DType::BOOL, bytes_of(std::vector<uint8_t>{0, 1, 1, 0}), {0, 1, 1, 0}});
  cases.push_back({DType::U8, bytes_of(std::vector<uint8_t>{0, 7, 200, 255}), {0, 7, 200, 255}});
  cases.push_back({DType::I8, bytes_of(std::vector<int8_t>{-128, -1, 0, 127}), {-128, -1, 0, 127}});
  cases.push_back({DType::I16, bytes_of(std::vector<int16_t>{-32768, -3, 5, 32767}), {-32768, -3, 5, 32767}});
  cases.push_back({DType::U16, bytes_of(std::vector<uint16_t>{0, 1, 40000, 65535}), {0, 1, 40000, 65535}});
  cases.push_back({DType::I32, bytes_of(std::vector<int32_t>{-100000, -1, 0, 1 << 24}), {-100000, -1, 0, 1 << 24}});
  cases.push_back({DType::U32, bytes_of(std::vector<uint32_t>{0, 3, 1u << 31, 16}), {0, 3, 2147483648.0f, 16}});
  cases.push_back({DType::I64, bytes_of(std::vector<int64_t>{-(1ll << 40), -2, 0, 9}), {-1099511627776.0f, -2, 0, 9}});
  cases.push_back(
      {DType::U64, bytes_of(std::vector<uint64_t>{0, 1ull << 63, 5, 6}), {0, 9223372036854775808.0f, 5, 6}});
  // F16: zero, one, -2 and the largest finite value (subnormals etc. are tested below).
  cases.push_back({DType::F16, bytes_of(std::vector<uint16_t>{0x0000, 0x3c00, 0xc000, 0x7bff}), {0, 1, -2, 65504}});
  cases.push_back({DType::BF16,
                   bytes_of(std::vector<uint16_t>{to_bf16(1.5f).bits, to_bf16(-0.25f).bits, to_bf16(3.0e38f).bits,
                                                  to_bf16(0.0f).bits}),
                   {1.5f, -0.25f, to_float(to_bf16(3.0e38f)), 0}});
  cases.push_back(
      {DType::F32, bytes_of(std::vector<float>{1.25f, -7.5f, 1e-40f, 3.0e38f}), {1.25f, -7.5f, 1e-40f, 3.0e38f}});
  cases.push_back({DType::F64,
                   bytes_of(std::vector<double>{0.5, -1.0 / 3.0, 1e-3, 12345.0}),
                   {0.5f, static_cast<float>(-1.0 / 3.0), static_cast<float>(1e-3), 12345.0f}});
  return cases;
}

TEST(Safetensors, RoundTripsEveryDtypeThroughAFile) {
  const auto cases = every_dtype();
  ASSERT_EQ(cases.size(), 13u);
  SafetensorsWriter w;
  for (const auto& c : cases) w.add_raw(std::string("t_") + dtype_name(c.dtype), c.dtype, {2, 2}, c.bytes);
  const std::string path = testing::temp_dir() + "/all.safetensors";
  w.write(path);

  const auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.names().size(), cases.size());
  for (const auto& c : cases) {
    const std::string name = std::string("t_") + dtype_name(c.dtype);
    SCOPED_TRACE(name);
    ASSERT_TRUE(f.contains(name));
    const TensorInfo& info = f.info(name);
    EXPECT_EQ(info.name, name);
    EXPECT_EQ(info.dtype, c.dtype);
    EXPECT_EQ(info.shape, (Shape{2, 2}));
    EXPECT_EQ(info.end - info.begin, c.bytes.size());
    // Every tensor starts aligned to its element size, even though the data has no gaps.
    EXPECT_EQ(info.begin % dtype_size(c.dtype), 0u);
    const auto raw = f.raw(name);
    EXPECT_EQ(std::vector<std::byte>(raw.begin(), raw.end()), c.bytes);
    const Tensor t = f.read_f32(name);
    EXPECT_EQ(t.shape(), (Shape{2, 2}));
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(float_bits(t.data()[i]), float_bits(c.as_float[i])) << "element " << i;
  }
  // The same image through from_bytes gives the same answers.
  const auto g = SafetensorsFile::from_bytes(w.to_bytes(), "copy");
  EXPECT_EQ(g.names(), f.names());
  EXPECT_TRUE(testing::bitwise_equal(g.read_f32("t_F16"), f.read_f32("t_F16")));
}

TEST(Safetensors, DtypeNamesAndSizes) {
  EXPECT_STREQ(dtype_name(DType::BF16), "BF16");
  EXPECT_STREQ(dtype_name(DType::BOOL), "BOOL");
  EXPECT_EQ(dtype_size(DType::BOOL), 1u);
  EXPECT_EQ(dtype_size(DType::F16), 2u);
  EXPECT_EQ(dtype_size(DType::U32), 4u);
  EXPECT_EQ(dtype_size(DType::F64), 8u);
}

TEST(Safetensors, F16ConversionHandlesSubnormalsInfinitiesAndNaN) {
  const std::vector<uint16_t> bits{0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x0400,
                                   0x3555, 0x7c00, 0xfc00, 0x7e00, 0xfe01};
  SafetensorsWriter w;
  w.add_raw("h", DType::F16, {static_cast<int64_t>(bits.size())}, bytes_of(bits));
  const Tensor t = SafetensorsFile::from_bytes(w.to_bytes()).read_f32("h");
  const float* v = t.data();
  EXPECT_EQ(float_bits(v[0]), 0u);
  EXPECT_EQ(float_bits(v[1]), 0x80000000u);  // −0 keeps its sign
  EXPECT_EQ(v[2], std::ldexp(1.0f, -24));    // smallest subnormal
  EXPECT_EQ(v[3], -std::ldexp(1.0f, -24));
  EXPECT_EQ(v[4], std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(v[5], std::ldexp(1.0f, -14));     // smallest normal
  EXPECT_EQ(v[6], 0x1.554p-2f);               // 0.333251953125
  EXPECT_EQ(v[7], std::numeric_limits<float>::infinity());
  EXPECT_EQ(v[8], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(v[9]));
  EXPECT_TRUE(std::isnan(v[10]));
}

TEST(Safetensors, TypedAddsAndBoolReads) {
  SafetensorsWriter w;
  const Tensor f = testing::random_tensor({3, 5}, 1);
  BF16Tensor b({2, 3});
  for (int64_t i = 0; i < b.numel(); ++i) b.data()[i] = to_bf16(static_cast<float>(i) - 2.5f);
  BoolTensor mask({2, 2}, std::vector<uint8_t>{0, 5, 1, 0});  // nonzero is written as 1
  w.add("f", f);
  w.add("b", b);
  w.add_bool("mask", mask);
  w.add_raw("u8", DType::U8, {3}, bytes_of(std::vector<uint8_t>{0, 9, 255}));
  w.add("scalar", Tensor(Shape{}, std::vector<float>{42.0f}));
  w.add("empty", Tensor(Shape{0, 4}));

  const auto file = SafetensorsFile::from_bytes(w.to_bytes());
  EXPECT_TRUE(testing::bitwise_equal(file.read_f32("f"), f));
  EXPECT_EQ(file.info("b").dtype, DType::BF16);
  const Tensor bf = file.read_f32("b");
  for (int64_t i = 0; i < b.numel(); ++i) EXPECT_EQ(bf.data()[i], static_cast<float>(i) - 2.5f);
  EXPECT_EQ(file.info("mask").dtype, DType::BOOL);
  EXPECT_EQ(file.read_bool("mask").storage(), (mha::TensorStorage<uint8_t>{0, 1, 1, 0}));
  EXPECT_EQ(file.read_bool("u8").storage(), (mha::TensorStorage<uint8_t>{0, 1, 1}));
  EXPECT_EQ(file.read_f32("scalar").shape(), Shape{});
  EXPECT_EQ(file.read_f32("scalar").data()[0], 42.0f);
  EXPECT_EQ(file.read_f32("empty").shape(), (Shape{0, 4}));
  EXPECT_EQ(file.read_f32("empty").numel(), 0);

  const std::string bool_err = error_of([&] { file.read_bool("f"); });
  EXPECT_NE(bool_err.find("'f'"), std::string::npos) << bool_err;
  EXPECT_NE(bool_err.find("F32"), std::string::npos) << bool_err;
  const std::string missing = error_of([&] { file.info("nope"); });
  EXPECT_NE(missing.find("'nope'"), std::string::npos) << missing;
  EXPECT_THROW(file.read_f32("nope"), Error);
  EXPECT_THROW(file.raw("nope"), Error);
  EXPECT_FALSE(file.contains("nope"));
}

TEST(Safetensors, MetadataRoundTripsAndComesFirstInTheHeader) {
  SafetensorsWriter w;
  w.set_metadata("format", "mha-weights/1");
  w.set_metadata("note", "ünïcödé and \"quotes\"");
  // Upper-case names sort before '_' in byte order; __metadata__ must still lead the header.
  w.add("A", Tensor({1}, 1.0f));
  w.add("z", Tensor({2}, 2.0f));
  const auto bytes = w.to_bytes();

  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u) << "the data section must start 8-byte aligned";
  const std::string header(reinterpret_cast<const char*>(bytes.data() + 8), n);
  EXPECT_EQ(header.rfind("{\"__metadata__\":", 0), 0u) << header;
  EXPECT_LT(header.find("\"A\""), header.find("\"z\"")) << header;
  EXPECT_EQ(bytes.size(), 8 + n + 12) << "no gaps in the data section";

  const auto f = SafetensorsFile::from_bytes(bytes);
  EXPECT_EQ(f.metadata().size(), 2u);
  EXPECT_EQ(f.metadata().at("format"), "mha-weights/1");
  EXPECT_EQ(f.metadata().at("note"), "ünïcödé and \"quotes\"");
  EXPECT_EQ(f.names(), (std::vector<std::string>{"A", "z"}));

  // Without metadata there is no __metadata__ key at all.
  SafetensorsWriter plain;
  plain.add("x", Tensor({1}));
  const auto g = SafetensorsFile::from_bytes(plain.to_bytes());
  EXPECT_TRUE(g.metadata().empty());
}

TEST(Safetensors, WriterRejectsBadAdds) {
  SafetensorsWriter w;
  w.add("x", Tensor({2}));
  EXPECT_NE(error_of([&] { w.add("x", Tensor({2})); }).find("'x'"), std::string::npos);
  EXPECT_THROW(w.add("__metadata__", Tensor({1})), Error);
  const std::string e = error_of([&] { w.add_raw("r", DType::F32, {2, 3}, std::vector<std::byte>(20)); });
  EXPECT_NE(e.find("'r'"), std::string::npos) << e;
  EXPECT_NE(e.find("24"), std::string::npos) << e;
  EXPECT_NE(e.find("20"), std::string::npos) << e;
  EXPECT_THROW(w.add_raw("neg", DType::U8, {-1}, {}), Error);
}

TEST(Safetensors, WriteReplacesAtomicallyAndNamesThePathOnFailure) {
  const std::string dir = testing::temp_dir();
  const std::string path = dir + "/w.safetensors";
  SafetensorsWriter first;
  first.add("a", Tensor({1}, 1.0f));
  first.write(path);
  SafetensorsWriter second;
  second.add("b", Tensor({1}, 2.0f));
  second.write(path);  // overwrites
  EXPECT_EQ(SafetensorsFile::open(path).names(), std::vector<std::string>{"b"});

  const std::string bad = dir + "/no/such/dir/out.safetensors";
  const std::string e = error_of([&] { second.write(bad); });
  EXPECT_NE(e.find(bad), std::string::npos) << e;
  // Nothing but the one good file is left behind (no temporaries).
  size_t entries = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++entries;
  EXPECT_EQ(entries, 1u);
}

// The temporary name is predictable (pid and a counter): a symbolic link planted there was written
// through (and a file there truncated). It is created new now (O_EXCL | O_NOFOLLOW), taking the
// next name when one is taken; the link's target is left alone and the result is a regular file.
TEST(Safetensors, WriteNeverFollowsALinkAtItsTemporaryName) {
  const std::string dir = testing::temp_dir();
  const std::string victim = dir + "/victim.txt";
  std::ofstream(victim) << "keep me";
  for (int i = 0; i < 16; ++i)
    std::filesystem::create_symlink(victim,
                                    dir + "/.mha-" + std::to_string(::getpid()) + "-" + std::to_string(i) + ".tmp");
  SafetensorsWriter w;
  w.add("a", Tensor({2}, 3.0f));
  const std::string path = dir + "/out.safetensors";
  w.write(path);
  EXPECT_FALSE(std::filesystem::is_symlink(path));
  EXPECT_EQ(SafetensorsFile::open(path).read_f32("a").storage(), (mha::TensorStorage<float>{3.0f, 3.0f}));
  std::ifstream in(victim);
  const std::string kept((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(kept, "keep me");
  // A file it replaces keeps its permissions.
  std::filesystem::permissions(path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  w.write(path);
  EXPECT_EQ(std::filesystem::status(path).permissions(),
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
}

// Paths the OS would read differently, or could not name with a suffix added, and a progress
// callback that throws: each fails or succeeds cleanly, leaving no temporary behind.
TEST(Safetensors, NulPathsLongNamesAndThrowingProgress) {
  const std::string dir = testing::temp_dir();
  SafetensorsWriter w;
  w.add("a", Tensor({3}, 1.0f));
  const std::string nul = dir + "/a" + std::string(1, '\0') + "b.safetensors";
  EXPECT_NE(error_of([&] { w.write(nul); }).find("NUL byte"), std::string::npos);
  EXPECT_NE(error_of([&] { SafetensorsFile::open(nul); }).find("NUL byte"), std::string::npos);
  const std::string longest = dir + "/" + std::string(255 - 12, 'x') + ".safetensors";  // a 255-byte name
  w.write(longest);  // its temporary had the name plus ".tmp.<pid>": "File name too long"
  EXPECT_EQ(SafetensorsFile::open(longest).names(), std::vector<std::string>{"a"});
  EXPECT_THROW(w.write(dir + "/p.safetensors", [](uint64_t, uint64_t) { throw std::runtime_error("stop"); }),
               std::runtime_error);
  size_t entries = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++entries;
  EXPECT_EQ(entries, 1u);  // the long-named file alone
}

TEST(Safetensors, OpenNamesAMissingOrEmptyFile) {
  const std::string dir = testing::temp_dir();
  const std::string missing = dir + "/missing.safetensors";
  const std::string e = error_of([&] { SafetensorsFile::open(missing); });
  EXPECT_NE(e.find(missing), std::string::npos) << e;

  const std::string empty = dir + "/empty.safetensors";
  std::ofstream(empty).close();
  const std::string e2 = error_of([&] { SafetensorsFile::open(empty); });
  EXPECT_NE(e2.find(empty), std::string::npos) << e2;
  EXPECT_NE(e2.find("0 bytes"), std::string::npos) << e2;

  EXPECT_THROW(SafetensorsFile::open(dir), Error);  // a directory

  // A FIFO with no writer: refused at once (a blocking open waited for a writer for ever).
  const std::string fifo = dir + "/pipe.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string e3 = error_of([&] { SafetensorsFile::open(fifo); });
  EXPECT_NE(e3.find("not a regular file"), std::string::npos) << e3;
}

TEST(Safetensors, MovesKeepTheMappingAlive) {
  SafetensorsWriter w;
  const Tensor t = testing::random_tensor({4, 4}, 7);
  w.add("t", t);
  const std::string path = testing::temp_dir() + "/m.safetensors";
  w.write(path);
  auto a = SafetensorsFile::open(path);
  SafetensorsFile b(std::move(a));
  EXPECT_TRUE(testing::bitwise_equal(b.read_f32("t"), t));
  auto c = SafetensorsFile::from_bytes(w.to_bytes());
  c = std::move(b);  // unmaps c's old image, takes b's mapping
  EXPECT_TRUE(testing::bitwise_equal(c.read_f32("t"), t));
  EXPECT_EQ(c.path(), path);
}

// ---- the shared conformance cases ----------------------------------------------------------------

TEST(Safetensors, ReadsEverySharedConformanceCase) {
  const std::filesystem::path dir = MHA_SHARED_DIR "/conformance/cases";
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " not present";
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    SCOPED_TRACE(entry.path().string());
    ++files;
    const auto f = SafetensorsFile::open(entry.path().string());
    EXPECT_EQ(f.metadata().at("format"), "mha-case/1");
    EXPECT_TRUE(f.contains("query"));
    EXPECT_TRUE(f.contains("expected.output"));
    for (const std::string& name : f.names()) {
      const TensorInfo& info = f.info(name);
      if (info.dtype == DType::BOOL) {
        EXPECT_EQ(f.read_bool(name).shape(), info.shape);
      } else {
        const Tensor t = f.read_f32(name);
        EXPECT_EQ(t.shape(), info.shape);
        for (float x : t.values()) ASSERT_TRUE(std::isfinite(x) || name.find("mask") != std::string::npos) << name;
      }
    }
    // Re-encoding what we read gives the same tensors back.
    SafetensorsWriter w;
    for (const auto& [k, v] : f.metadata()) w.set_metadata(k, v);
    for (const std::string& name : f.names()) w.add_raw(name, f.info(name).dtype, f.info(name).shape, f.raw(name));
    const auto g = SafetensorsFile::from_bytes(w.to_bytes());
    EXPECT_EQ(g.metadata(), f.metadata());
    for (const std::string& name : f.names()) {
      const auto a = f.raw(name), b = g.raw(name);
      EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end())) << name;
    }
  }
  EXPECT_GE(files, 1);
}

TEST(Safetensors, ReadsAKnownValueFromACase) {
  const std::string path = MHA_SHARED_DIR "/conformance/cases/self_basic.safetensors";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " not present";
  const auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f.info("in_proj_weight").shape, (Shape{24, 8}));
  EXPECT_EQ(f.info("query").shape, (Shape{2, 5, 8}));
  EXPECT_EQ(f.metadata().at("embed_dim"), "8");
}

// ---- malformed input ---------------------------------------------------------------------------

const std::string kGoodEntry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

TEST(SafetensorsMalformed, TruncatedFiles) {
  expect_rejected(std::vector<std::byte>(3), {"3 bytes", "8-byte header length"});
  expect_rejected({}, {"0 bytes"});
  // A valid image cut inside the header.
  auto bytes = image("{" + kGoodEntry + "}", 8);
  bytes.resize(20);
  expect_rejected(bytes, {"header length", "past the end"});
  // Cut inside the data: the tensor's range now runs past the data section.
  bytes = image("{" + kGoodEntry + "}", 8);
  bytes.pop_back();
  expect_rejected(bytes, {"tensor 'a'", "[0, 8]", "7 bytes"});
}

TEST(SafetensorsMalformed, HeaderLengthPastEndOrHuge) {
  expect_rejected(image("{}", 0, 1000), {"header length 1000", "past the end"});
  expect_rejected(image("{}", 0, 1ull << 63), {"9223372036854775808"});
  expect_rejected(image("{}", 0, UINT64_MAX - 1), {"18446744073709551614"});
}

TEST(SafetensorsMalformed, HeaderLengthOverTheLimit) {
  // A 100 MiB + 8 byte header of spaces, really present: rejected for its size, not parsed.
  const uint64_t n = (100ull << 20) + 8;
  std::vector<std::byte> bytes(8 + n, std::byte{' '});
  std::memcpy(bytes.data(), &n, 8);
  expect_rejected(bytes, {std::to_string(n), "limit"});
}

TEST(SafetensorsMalformed, InvalidJson) {
  expect_header_rejected(R"({"a":{"dtype":"F32",)", 0, {"not valid JSON"});
  expect_header_rejected("", 0, {"not valid JSON"});
  expect_header_rejected("{\"\xff\xfe\":1}", 0, {"not valid JSON"});  // invalid UTF-8
  expect_header_rejected("{} trailing", 0, {"not valid JSON"});
  // The JSON error quotes the header where it stopped: bytes that are not printable ASCII come
  // out as \xNN, so the message is text (a raw 0xFF reached the terminal, and Python raised an
  // empty ValueError for it).
  expect_header_rejected("{\"\xff\xfe\":1}", 0, {"\\xff"});
  const std::string msg = error_of([] { (void)SafetensorsFile::from_bytes(image("{\"\xff\x01\":1}", 0), "bad"); });
  for (const char ch : msg) {
    const auto b = static_cast<unsigned char>(ch);
    EXPECT_TRUE(b >= 0x20 && b < 0x7F) << msg;  // this message is all ASCII
  }
}

TEST(SafetensorsMalformed, NonObjectJson) {
  expect_header_rejected("[1, 2]", 0, {"array", "expected an object"});
  expect_header_rejected("\"hello\"", 0, {"string"});
  expect_header_rejected(R"({"a": 5})", 0, {"tensor 'a'", "number"});
}

TEST(SafetensorsMalformed, MissingFields) {
  expect_header_rejected(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8, {"tensor 'a'", "'dtype'"});
  expect_header_rejected(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8, {"tensor 'a'", "'shape'"});
  expect_header_rejected(R"({"a":{"dtype":"F32","shape":[2]}})", 8, {"tensor 'a'", "'data_offsets'"});
}

TEST(SafetensorsMalformed, UnknownDtype) {
  expect_header_rejected(R"({"w":{"dtype":"F8","shape":[2],"data_offsets":[0,2]}})", 2, {"tensor 'w'", "'F8'"});
  expect_header_rejected(R"({"w":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", 8, {"tensor 'w'", "'f32'"});
  expect_header_rejected(R"({"w":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", 8, {"tensor 'w'", "dtype"});
}

TEST(SafetensorsMalformed, BadShapes) {
  expect_header_rejected(R"({"s":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", 0, {"tensor 's'", "[-1]"});
  expect_header_rejected(R"({"s":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4, {"tensor 's'", "1.5"});
  expect_header_rejected(R"({"s":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", 8, {"tensor 's'", "\"2\""});
  expect_header_rejected(R"({"s":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", 8, {"tensor 's'", "shape"});
  expect_header_rejected(R"({"s":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8]}})", 8,
                         {"tensor 's'", "9223372036854775808"});
}

TEST(SafetensorsMalformed, ShapeDoesNotMatchTheByteRange) {
  expect_header_rejected(R"({"query":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 24,
                         {"tensor 'query' F32 shape (2, 3) needs 24 bytes but data_offsets span 20"});
  expect_header_rejected(R"({"m":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", 8,
                         {"tensor 'm'", "needs 6 bytes", "span 8"});
}

TEST(SafetensorsMalformed, OffsetsPastTheEnd) {
  expect_header_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 12,
                         {"tensor 'a'", "[8, 16]", "12 bytes"});
}

TEST(SafetensorsMalformed, BadOffsets) {
  expect_header_rejected(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[8,4]}})", 8,
                         {"tensor 'a'", "[8, 4]", "begin after end"});
  expect_header_rejected(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4,8]}})", 8, {"tensor 'a'", "[0,4,8]"});
  expect_header_rejected(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[-4,0]}})", 8, {"tensor 'a'", "[-4,0]"});
  expect_header_rejected(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":{"b":0}}})", 8, {"tensor 'a'"});
}

TEST(SafetensorsMalformed, OverlappingRanges) {
  expect_header_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                         12, {"tensor 'b'", "overlap tensor 'a'", "[4, 12]", "[0, 8]"});
  // Hidden behind an empty tensor in between: still caught.
  expect_header_rejected(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                         R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                         R"("c":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                         16, {"tensor 'c'", "overlap tensor 'a'"});
  // The same range twice.
  expect_header_rejected(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                         R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                         4, {"overlap"});
}

TEST(SafetensorsMalformed, EmptyTensorsAndGapsAreFine) {
  const auto f = SafetensorsFile::from_bytes(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                                   R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]},)"
                                                   R"("c":{"dtype":"U8","shape":[2],"data_offsets":[10,12]}})",
                                                   12));
  EXPECT_EQ(f.names().size(), 3u);
  EXPECT_EQ(f.read_f32("c").storage(), (mha::TensorStorage<float>{10, 11}));
}

TEST(SafetensorsMalformed, ShapeProductOverflows) {
  expect_header_rejected(R"({"big":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,0]}})", 0,
                         {"tensor 'big'", "(1099511627776, 1099511627776)", "overflow"});
  // The product fits but times the element size it does not.
  expect_header_rejected(R"({"big":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}})", 0,
                         {"tensor 'big'", "overflow"});
  // With a zero extent the product really is zero, however large the other extents.
  EXPECT_NO_THROW(
      SafetensorsFile::from_bytes(image(R"({"z":{"dtype":"F32","shape":[0,1099511627776],"data_offsets":[0,0]}})", 0)));
}

// A header of nested brackets within the size limit took ~130 times its size in memory before it
// failed; a NUL byte ended nlohmann's reading, so what followed it (a tensor, invalid UTF-8) was
// never checked. Both are refused as the header is read, but a run of NULs that ends the header.
TEST(SafetensorsMalformed, DeepNestingAndNulBytesInTheHeader) {
  expect_header_rejected("{\"x\":" + std::string(100, '[') + std::string(100, ']') + "}", 0,
                         {"nests deeper than 32 levels"});
  expect_header_rejected(R"({"__metadata__":{"x":"1"}})" + std::string(1, '\0') +
                             R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                         4, {"NUL byte at offset 26 with more after it"});
  expect_header_rejected(R"({"__metadata__":{"x":"1"}})" + std::string(3, '\0') + " ", 0, {"NUL byte at offset 26"});
  // A real header's depth (object, entry, shape) is fine, and so is a header padded with NULs to
  // its end (some writers pad so where the format says spaces).
  const std::string real = R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  EXPECT_NO_THROW(SafetensorsFile::from_bytes(image(real, 4)));
  EXPECT_EQ(SafetensorsFile::from_bytes(image(real + std::string(6, '\0'), 4)).names(), std::vector<std::string>{"a"});
}

// Zero bytes whatever the order of the extents ([2^63 − 1, 0] overflowed before it reached the 0).
TEST(SafetensorsMalformed, AZeroExtentAnywhereIsZeroBytes) {
  const auto f = SafetensorsFile::from_bytes(
      image(R"({"z":{"dtype":"F32","shape":[9223372036854775807,0],"data_offsets":[0,0]}})", 0));
  EXPECT_EQ(f.info("z").shape, (Shape{9223372036854775807, 0}));
  SafetensorsWriter w;
  EXPECT_NO_THROW(w.add_raw("h", DType::F32, {9223372036854775807, 0}, {}));
}

// An F64 weight past float32's range loaded as ±inf (and the C++ conversion is undefined there):
// it is refused, naming the tensor and element; float32's largest value still converts.
TEST(Safetensors, F64BeyondFloatRangeIsRefused) {
  SafetensorsWriter w;
  const double ok[3] = {3.4028234663852886e38, -1e-300, std::numeric_limits<double>::infinity()};
  const double bad[2] = {1.0, 3.5e38};
  w.add_raw("ok", DType::F64, {3}, std::as_bytes(std::span(ok)));
  w.add_raw("bad", DType::F64, {2}, std::as_bytes(std::span(bad)));
  const auto f = SafetensorsFile::from_bytes(w.to_bytes(), "f64");
  const Tensor t = f.read_f32("ok");
  EXPECT_EQ(t.data()[0], std::numeric_limits<float>::max());
  EXPECT_EQ(t.data()[2], std::numeric_limits<float>::infinity());  // an infinity stays one
  const std::string e = error_of([&] { (void)f.read_f32("bad"); });
  EXPECT_NE(e.find("tensor 'bad' element 1"), std::string::npos) << e;
  EXPECT_NE(e.find("beyond float32's range"), std::string::npos) << e;
}

TEST(SafetensorsMalformed, BadMetadata) {
  expect_header_rejected(R"({"__metadata__":[1,2]})", 0, {"'__metadata__'", "array"});
  expect_header_rejected(R"({"__metadata__":{"epoch":3}})", 0, {"'__metadata__'", "'epoch'", "number"});
  expect_header_rejected(R"({"__metadata__":{"x":{"y":"z"}}})", 0, {"'x'", "object"});
  expect_header_rejected(R"({"__metadata__":"v1"})", 0, {"'__metadata__'", "string"});
}

TEST(SafetensorsMalformed, DuplicateKeys) {
  expect_header_rejected("{" + kGoodEntry + "," + kGoodEntry + "}", 8, {"'a'", "twice"});
  expect_header_rejected(R"({"a":{"dtype":"F32","dtype":"U8","shape":[2],"data_offsets":[0,8]}})", 8,
                         {"'dtype'", "twice", "'a'"});
  expect_header_rejected(R"({"__metadata__":{"k":"1","k":"2"}})", 0, {"'k'", "twice", "'__metadata__'"});
}

}  // namespace
}  // namespace mha::io
