// libFuzzer target for the safetensors reader and the weight loader (issue 16): any byte string
// must either open and read cleanly or throw mha::Error. Every other outcome is a finding: a
// sanitizer report, a crash, another exception type (std::terminate), a timeout, or memory beyond
// libFuzzer's -rss_limit_mb (allocation driven by a header instead of the file's size).
// Built by -DMHA_FUZZ=ON with clang (fuzz/CMakeLists.txt); run by scripts/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <span>

#include "mha/error.h"
#include "mha/safetensors.h"
#include "mha/weights.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  try {
    const io::SafetensorsFile file =
        io::SafetensorsFile::from_bytes(std::as_bytes(std::span<const uint8_t>(data, size)), "fuzz");
    // The reader: every tensor the header declares, as floats and (where allowed) as booleans.
    for (const std::string& name : file.names()) {
      const io::TensorInfo& info = file.info(name);
      (void)file.raw(name);
      (void)file.read_f32(name);
      if (info.dtype == io::DType::BOOL || info.dtype == io::DType::U8) (void)file.read_bool(name);
    }
    // The weight loader: metadata → configuration → parameters → module.
    const MultiheadAttention module = io::load_module(file);
    (void)module.parameter_count();
    // And back: what loaded must save.
    io::SafetensorsWriter writer;
    io::add_weights(writer, module, io::detect_weight_names(file));
    (void)writer.to_bytes();
  } catch (const Error&) {
    // The contract for bad input.
  }
  return 0;
}
