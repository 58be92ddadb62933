// tools/load_inputs.h — the module and its inputs from safetensors files, shared by the commands
// that run a forward (`mha forward`, `mha analyze`, `mha prune --importance`).
#pragma once

#include <map>
#include <string>

#include "mha/module.h"
#include "mha/safetensors.h"

namespace mha::cli {

/// A boolean metadata value of `file` (io::metadata_bool's spellings), or `fallback` when the key is
/// absent; anything else throws, naming the file and the key.
bool metadata_flag(const io::SafetensorsFile& file, const std::string& key, bool fallback);

/// The metadata keys that say how to run a forward (is_causal, causal_align, need_weights,
/// average_attn_weights, need_lse), beside the module's configuration: `mha prune` carries them over.
inline constexpr const char* kRunSettingKeys[] = {"is_causal", "causal_align", "need_weights", "average_attn_weights",
                                                  "need_lse"};

struct LoadedInputs {
  Tensor query, key, value;
  /// attn_mask and key_padding_mask from the inputs file (BOOL: true = may NOT attend, PyTorch's
  /// convention; F32: added), and Causal::top_left() when the weights' metadata says is_causal.
  MhaForwardOptions options;
  bool need_weights = false;  ///< the weights' metadata need_weights
  bool average = true;        ///< the weights' metadata average_attn_weights
};

/// Reads query, key, value and the optional masks from `inputs_path` (which may be the weights
/// file itself, as in the conformance cases); flags from the weights file's metadata.
LoadedInputs load_inputs(const io::SafetensorsFile& weights, const std::string& inputs_path);

}  // namespace mha::cli
