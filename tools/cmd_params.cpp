// `mha params`: parameter count, bytes per dtype and KV-cache bytes per token for a configuration.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mha/module.h"
#include "registry.h"

namespace mha::cli {

namespace {

struct ParamsArgs {
  int64_t embed_dim = 0, heads = 0, kv_heads = 0, kdim = 0, vdim = 0;
  bool no_bias = false, add_bias_kv = false, json = false;
};

std::string with_commas(int64_t n) {
  std::string s = std::to_string(n), out;
  int count = 0;
  for (auto it = s.rbegin(); it != s.rend(); ++it) {
    if (count && count % 3 == 0 && *it != '-') out.insert(out.begin(), ',');
    out.insert(out.begin(), *it);
    ++count;
  }
  return out;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 6) bytes /= 1024.0, ++u;
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

void run_params(const ParamsArgs& a) {
  MhaConfig c;
  c.embed_dim = a.embed_dim;
  c.num_heads = a.heads;
  c.num_kv_heads = a.kv_heads;
  c.kdim = a.kdim;
  c.vdim = a.vdim;
  c.bias = !a.no_bias;
  c.add_bias_kv = a.add_bias_kv;
  c.validate();
  const int64_t E = c.embed_dim, d = c.head_dim(), h = c.num_heads, kv = c.kv_heads();
  struct Part {
    std::string name, shape;
    int64_t count;
  };
  std::vector<Part> parts = {
      {"W_Q (q_proj)", shape_str({h * d, E}), h * d * E},
      {"W_K (k_proj)", shape_str({kv * d, c.key_dim()}), kv * d * c.key_dim()},
      {"W_V (v_proj)", shape_str({kv * d, c.value_dim()}), kv * d * c.value_dim()},
      {"W_O (out_proj)", shape_str({E, h * d}), E * h * d},
  };
  if (c.bias) {
    parts.push_back({"in_proj_bias", shape_str({c.in_proj_rows()}), c.in_proj_rows()});
    parts.push_back({"out_proj.bias", shape_str({E}), E});
  }
  if (c.add_bias_kv) {
    parts.push_back({"bias_k", shape_str({1, 1, kv * d}), kv * d});
    parts.push_back({"bias_v", shape_str({1, 1, kv * d}), kv * d});
  }
  const int64_t total = parameter_count(c);
  // Checked: a configuration validate() accepts can hold more float32 bytes than int64 counts
  // (E = 2^30, h = 1: 4.6e18 parameters), which printed as 16 GiB and a negative bf16 size.
  const std::string what = "params: the bytes of " + with_commas(total) + " parameters";
  const int64_t f32_bytes = checked_mul(total, 4, what), half_bytes = checked_mul(total, 2, what);
  const int64_t kv_per_token_elems = 2 * kv * d;          // one K row and one V row per KV head
  const int64_t mha_per_token_elems = 2 * h * d;          // what full multi-head attention would cache
  const int64_t int8_per_token_bytes = 2 * kv * (d + 4);  // a byte per element, a float scale per row
  if (a.json) {
    nlohmann::json j;
    j["embed_dim"] = E, j["num_heads"] = h, j["num_kv_heads"] = kv, j["head_dim"] = d;
    j["kdim"] = c.key_dim(), j["vdim"] = c.value_dim(), j["bias"] = c.bias;
    j["parameters"] = total;
    j["bytes"] = {{"f32", f32_bytes}, {"bf16", half_bytes}, {"f16", half_bytes}};
    for (const Part& p : parts) j["breakdown"].push_back({{"name", p.name}, {"shape", p.shape}, {"count", p.count}});
    j["kv_cache_bytes_per_token"] = {
        {"f32", kv_per_token_elems * 4}, {"bf16", kv_per_token_elems * 2}, {"int8", int8_per_token_bytes}};
    j["kv_cache_saving_vs_mha"] = static_cast<double>(mha_per_token_elems) / static_cast<double>(kv_per_token_elems);
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf(
      "Multi-head attention: embed_dim E=%lld, heads h=%lld, kv_heads=%lld, head dim d=%lld, kdim=%lld, "
      "vdim=%lld%s\n\n",
      static_cast<long long>(E), static_cast<long long>(h), static_cast<long long>(kv), static_cast<long long>(d),
      static_cast<long long>(c.key_dim()), static_cast<long long>(c.value_dim()),
      c.bias ? ", with biases" : ", no biases");
  std::printf("  %-16s %-14s %14s\n", "parameter", "shape", "count");
  for (const Part& p : parts)
    std::printf("  %-16s %-14s %14s\n", p.name.c_str(), p.shape.c_str(), with_commas(p.count).c_str());
  std::printf("  %-16s %-14s %14s\n\n", "total", "", with_commas(total).c_str());
  std::printf("  bytes: float32 %s, bfloat16 %s, float16 %s\n", human_bytes(static_cast<double>(f32_bytes)).c_str(),
              human_bytes(static_cast<double>(half_bytes)).c_str(),
              human_bytes(static_cast<double>(half_bytes)).c_str());
  std::printf("  KV cache per token (per layer): float32 %s, bfloat16 %s, int8 %s",
              human_bytes(static_cast<double>(kv_per_token_elems * 4)).c_str(),
              human_bytes(static_cast<double>(kv_per_token_elems * 2)).c_str(),
              human_bytes(static_cast<double>(int8_per_token_bytes)).c_str());
  if (kv != h)
    std::printf("  (%gx less than %lld full heads)", static_cast<double>(h) / static_cast<double>(kv),
                static_cast<long long>(h));
  std::printf("\n");
}

}  // namespace

static void add_params_command(CLI::App& app) {
  auto a = std::make_shared<ParamsArgs>();
  CLI::App* cmd = app.add_subcommand(
      "params", "Parameter count and bytes per dtype, by projection, and the KV-cache bytes per token.");
  cmd->add_option("--embed-dim,-E", a->embed_dim, "model width E")->required()->check(whole_number_at_least(1));
  cmd->add_option("--heads,-H", a->heads, "query heads h (must divide E)")->required()->check(whole_number_at_least(1));
  cmd->add_option("--kv-heads", a->kv_heads, "key/value heads (GQA; 1 = MQA; default h)")
      ->check(whole_number_at_least(1));
  cmd->add_option("--kdim", a->kdim, "feature size of the key input (default E)")->check(whole_number_at_least(1));
  cmd->add_option("--vdim", a->vdim, "feature size of the value input (default E)")->check(whole_number_at_least(1));
  cmd->add_flag("--no-bias", a->no_bias, "no in_proj / out_proj biases");
  cmd->add_flag("--add-bias-kv", a->add_bias_kv, "count bias_k and bias_v");
  cmd->add_flag("--json", a->json, "one JSON object on stdout");
  cmd->callback([a] { run_params(*a); });
}

static const CommandRegistrar registered{30, add_params_command};

}  // namespace mha::cli
