// mha/weights.h — the multi-head module's parameters in safetensors files.
//
// The module keeps PyTorch's layout (MhaParameters). A file may name the same tensors the PyTorch
// way (one packed in_proj_weight, or q/k/v_proj_weight) or the Hugging Face way (q_proj, k_proj,
// v_proj, o_proj); loading detects which and checks every shape against the configuration stored
// in the file's metadata. The file format itself is mha/safetensors.h's.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "mha/module.h"
#include "mha/safetensors.h"

namespace mha::io {

enum class WeightNames : uint8_t {
  PyTorch,      ///< in_proj_weight or q/k/v_proj_weight, in_proj_bias, bias_k, bias_v, out_proj.weight/bias
  HuggingFace,  ///< q_proj.weight, k_proj.weight, v_proj.weight, o_proj.weight (+ .bias)
};

/// The configuration stored in a file's metadata (keys as in shared/conformance/README.md:
/// embed_dim, num_heads, num_kv_heads, kdim, vdim, bias, add_bias_kv, add_zero_attn, batch_first;
/// and mha's own: head_dim, dropout, scale, softcap, alibi_slopes, attention_sinks, rope
/// (none, half_split or interleaved), rope_theta, rope_dims).
MhaConfig config_from_metadata(const std::map<std::string, std::string>& metadata, const std::string& label);
std::map<std::string, std::string> metadata_from_config(const MhaConfig& config);
/// A boolean metadata value: true / True / 1 or false / False / 0 (Python's str(bool) writes the
/// capitalised ones); anything else throws, naming `who` and the key.
bool metadata_bool(const std::string& who, const std::string& key, const std::string& value);

/// Which naming scheme a file uses (throws if it has neither set of projection weights).
WeightNames detect_weight_names(const SafetensorsFile& file);

/// Loads every parameter of `module` from `file` (either naming scheme, auto-detected), checking
/// each shape against the module's configuration, and each configuration field the file's
/// metadata states (mha's own files state them all) against the module's, as they resolve, all
/// but batch_first and dropout: a file of 2 heads must not load into a module of 4 of the same
/// width, nor one without RoPE into a module with it.
void load_weights(MultiheadAttention& module, const SafetensorsFile& file);

/// Config from the metadata, then the weights.
MultiheadAttention load_module(const SafetensorsFile& file);

/// Adds the module's parameters (and its config as metadata) to `writer` under `names`.
void add_weights(SafetensorsWriter& writer, const MultiheadAttention& module, WeightNames names);
void save_module(const std::string& path, const MultiheadAttention& module, WeightNames names);

}  // namespace mha::io
