// tools/load_inputs.cpp — see load_inputs.h.
#include "load_inputs.h"

#include <cstring>
#include <string>
#include <vector>

#include "mha/weights.h"

namespace mha::cli {

namespace {

/// A 1-D I32 or I64 tensor of sequence offsets (cu_seqlens_q / cu_seqlens_k).
std::vector<int64_t> read_offsets(const io::SafetensorsFile& f, const std::string& name) {
  const io::TensorInfo& info = f.info(name);
  if (info.shape.size() != 1 || (info.dtype != io::DType::I32 && info.dtype != io::DType::I64))
    fail(f.path(), ": '", name, "' must be a 1-D I32 or I64 tensor of B + 1 offsets, got ", io::dtype_name(info.dtype),
         " ", shape_str(info.shape));
  const std::span<const std::byte> raw = f.raw(name);
  std::vector<int64_t> out(static_cast<size_t>(info.shape[0]));
  for (size_t i = 0; i < out.size(); ++i) {
    if (info.dtype == io::DType::I32) {
      int32_t x;
      std::memcpy(&x, raw.data() + 4 * i, 4);
      out[i] = x;
    } else {
      std::memcpy(&out[i], raw.data() + 8 * i, 8);
    }
  }
  return out;
}

int64_t metadata_int(const std::map<std::string, std::string>& meta, const std::string& key) {
  auto it = meta.find(key);
  if (it == meta.end()) return 0;
  try {
    size_t used = 0;
    const long long v = std::stoll(it->second, &used);
    if (used == it->second.size() && v >= 0) return v;
  } catch (const std::exception&) {
  }
  fail("metadata '", key, "' must be a non-negative integer, got '", it->second, "'");
}

}  // namespace

bool metadata_flag(const io::SafetensorsFile& file, const std::string& key, bool fallback) {
  auto it = file.metadata().find(key);
  return it == file.metadata().end() ? fallback : io::metadata_bool(file.path(), key, it->second);
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

  // A mask is boolean (BOOL or U8: PyTorch's polarity, true = masked out) or floating point (added
  // to the scores). An integer mask would be added too, its 1s raising the scores of the positions
  // it meant to hide: refused, as PyTorch refuses it.
  const auto mask_is_bool = [&](const char* name) {
    const io::DType dt = inputs_file.info(name).dtype;
    if (dt == io::DType::BOOL || dt == io::DType::U8) return true;
    if (dt == io::DType::F16 || dt == io::DType::BF16 || dt == io::DType::F32 || dt == io::DType::F64) return false;
    fail(inputs_path, ": ", name, " must be BOOL, U8 or a float dtype (F16, BF16, F32, F64), got ", io::dtype_name(dt));
  };
  MhaForwardOptions& opt = in.options;
  if (inputs_file.contains("attn_mask"))
    opt.attn_mask = mask_is_bool("attn_mask") ? AttnMask::from_torch_bool(inputs_file.read_bool("attn_mask"))
                                              : AttnMask::add(inputs_file.read_f32("attn_mask"));
  if (inputs_file.contains("key_padding_mask")) {
    if (mask_is_bool("key_padding_mask"))
      opt.key_padding_mask.is_padding = inputs_file.read_bool("key_padding_mask");
    else
      opt.key_padding_mask.additive = inputs_file.read_f32("key_padding_mask");
  }
  // A packed batch of variable-length sequences: 2-D query/key/value (total, features) and the
  // offsets as tensors (cu_seqlens_k defaults to cu_seqlens_q: self-attention), the optional
  // maxima in the inputs file's metadata.
  if (inputs_file.contains("cu_seqlens_q") || inputs_file.contains("cu_seqlens_k")) {
    VarlenBatch seqs;
    seqs.cu_seqlens_q =
        read_offsets(inputs_file, inputs_file.contains("cu_seqlens_q") ? "cu_seqlens_q" : "cu_seqlens_k");
    seqs.cu_seqlens_k =
        read_offsets(inputs_file, inputs_file.contains("cu_seqlens_k") ? "cu_seqlens_k" : "cu_seqlens_q");
    seqs.max_seqlen_q = metadata_int(inputs_file.metadata(), "max_seqlen_q");
    seqs.max_seqlen_k = metadata_int(inputs_file.metadata(), "max_seqlen_k");
    opt.packed = std::move(seqs);
  }
  const auto& meta = weights.metadata();
  if (metadata_flag(weights, "is_causal", false)) opt.causal = Causal::top_left();
  // Per-sequence alignment for packed or cross-attention inputs: "top_left" (default) or "bottom_right".
  // A misspelt value is refused whether or not the file is causal (it was ignored without is_causal).
  if (auto it = meta.find("causal_align"); it != meta.end()) {
    if (it->second != "top_left" && it->second != "bottom_right")
      fail("metadata 'causal_align' must be top_left or bottom_right, got '", it->second, "'");
    if (it->second == "bottom_right" && opt.causal.enabled()) opt.causal = Causal::bottom_right();
  }
  in.need_weights = metadata_flag(weights, "need_weights", false);
  in.average = metadata_flag(weights, "average_attn_weights", true);
  opt.need_lse = metadata_flag(weights, "need_lse", false);
  return in;
}

}  // namespace mha::cli
