// tools/decode_bench.h — the decode benchmark, shared by `mha bench --decode` and `mha bench-decode`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mha::cli {

/// Time per decoded token against context length, K/V bytes read per second, and, measured in the
/// same run, the machine's read-only bandwidth, STREAM triad and float32 FMA peak.
struct DecodeBenchArgs {
  int64_t heads = 32, kv_heads = 8, head_dim = 128, batch = 1;
  std::vector<int64_t> contexts{512, 1024, 2048, 4096, 8192};
  std::vector<std::string> dtypes{"f32", "bf16", "int8"};  // and int8-channel (per-channel key scales)
  int64_t key_group = 32;                                  // int8-channel: positions per key group
  int threads = 2, repeat = 20, splits = 0;
  int64_t footprint_mib = 1024;  // bytes streamed per measurement, beyond the last-level cache
  int64_t bw_mib = 256;          // at least this much streamed by the read-bandwidth measurement
  int64_t prefill = 0;           // tokens; 0 = skip the prefill comparison
  int prefill_repeat = 3;
  bool json = false;
};

void run_decode_bench(const DecodeBenchArgs& args);

}  // namespace mha::cli
