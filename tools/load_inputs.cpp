// tools/load_inputs.cpp — see load_inputs.h.
#include "load_inputs.h"

namespace mha::cli {

bool metadata_flag(const std::map<std::string, std::string>& meta, const std::string& key, bool fallback) {
  auto it = meta.find(key);
  if (it == meta.end()) return fallback;
  if (it->second == "true") return true;
  if (it->second == "false") return false;
  fail("metadata '", key, "' must be true or false, got '", it->second, "'");
}

LoadedInputs load_inputs(const io::SafetensorsFile& weights, const std::string& inputs_path) {
  // Inputs may be a different file from the weights (the same file in the conformance cases).
  const io::SafetensorsFile inputs_file = io::SafetensorsFile::open(inputs_path);
  for (const char* name : {"query", "key", "value"})
    if (!inputs_file.contains(name)) fail(inputs_path, ": input tensor '", name, "' is missing");
  LoadedInputs in;
  in.query = inputs_file.read_f32("query");
  in.key = inputs_file.read_f32("key");
  in.value = inputs_file.read_f32("value");

  MhaForwardOptions& opt = in.options;
  if (inputs_file.contains("attn_mask")) {
    const io::DType dt = inputs_file.info("attn_mask").dtype;
    opt.attn_mask = (dt == io::DType::BOOL || dt == io::DType::U8)
                        ? AttnMask::from_torch_bool(inputs_file.read_bool("attn_mask"))
                        : AttnMask::add(inputs_file.read_f32("attn_mask"));
  }
  if (inputs_file.contains("key_padding_mask")) {
    const io::DType dt = inputs_file.info("key_padding_mask").dtype;
    if (dt == io::DType::BOOL || dt == io::DType::U8)
      opt.key_padding_mask.is_padding = inputs_file.read_bool("key_padding_mask");
    else
      opt.key_padding_mask.additive = inputs_file.read_f32("key_padding_mask");
  }
  const auto& meta = weights.metadata();
  if (metadata_flag(meta, "is_causal", false)) opt.causal = Causal::top_left();
  in.need_weights = metadata_flag(meta, "need_weights", false);
  in.average = metadata_flag(meta, "average_attn_weights", true);
  opt.need_lse = metadata_flag(meta, "need_lse", false);
  return in;
}

}  // namespace mha::cli
