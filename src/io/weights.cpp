// The multi-head module's parameters in safetensors files, under PyTorch's or Hugging Face's names.
//
// Internally the module keeps PyTorch's layout (MhaParameters). Hugging Face checkpoints split the
// input projection into q/k/v linears and call the output projection o_proj; this file is the one
// place that maps between the two, so the module never needs to know which naming a file used.
#include "mha/weights.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <optional>
#include <sstream>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "layers/sdpa_prepare.h"

namespace mha::io {

bool metadata_bool(const std::string& who, const std::string& key, const std::string& value) {
  // "True"/"False" too: that is what Python's str(bool) writes into metadata.
  if (value == "true" || value == "True" || value == "1") return true;
  if (value == "false" || value == "False" || value == "0") return false;
  fail(who, ": metadata '", key, "' = '", value, "' is not true or false");
}

namespace {

// ---- metadata parsing --------------------------------------------------------------------------

const std::string* find_key(const std::map<std::string, std::string>& metadata, const std::string& key) {
  const auto it = metadata.find(key);
  return it == metadata.end() ? nullptr : &it->second;
}

/// An integer or floating-point metadata value; the whole string must be the number.
template <class T>
T parse_number(const std::string& label, const std::string& key, const std::string& value) {
  T out = 0;
  const char* first = value.data();
  const char* last = first + value.size();
  const auto [ptr, ec] = std::from_chars(first, last, out);
  if (ec != std::errc() || ptr != last || value.empty())
    fail("config_from_metadata: ", label, ": metadata '", key, "' = '", value, "' is not ",
         std::is_integral_v<T> ? "an integer" : "a number");
  return out;
}

int64_t parse_int(const std::string& label, const std::string& key, const std::string& value) {
  return parse_number<int64_t>(label, key, value);
}

bool parse_bool(const std::string& label, const std::string& key, const std::string& value) {
  return metadata_bool("config_from_metadata: " + label, key, value);
}

/// The shortest decimal form that reads back as exactly `v`.
template <class T>
std::string shortest(T v) {
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, ec == std::errc() ? end : buf);
}

/// The metadata's name of a RoPE pairing (config_from_metadata reads it back).
const char* pairing_name(RopePairing pairing) {
  return pairing == RopePairing::Interleaved ? "interleaved" : "half_split";
}

// ---- tensor names ------------------------------------------------------------------------------

struct Names {
  // PyTorch state_dict names.
  static constexpr const char* in_proj_weight = "in_proj_weight";
  static constexpr const char* q_proj_weight = "q_proj_weight";
  static constexpr const char* k_proj_weight = "k_proj_weight";
  static constexpr const char* v_proj_weight = "v_proj_weight";
  static constexpr const char* in_proj_bias = "in_proj_bias";
  static constexpr const char* out_proj_weight = "out_proj.weight";
  static constexpr const char* out_proj_bias = "out_proj.bias";
  // Shared by both schemes: Hugging Face has no equivalent of PyTorch's add_bias_kv.
  static constexpr const char* bias_k = "bias_k";
  static constexpr const char* bias_v = "bias_v";
  static constexpr const char* sinks = "sinks";  // learned attention sinks, gpt-oss's name
  // Hugging Face names.
  static constexpr const char* hf_q_weight = "q_proj.weight";
  static constexpr const char* hf_k_weight = "k_proj.weight";
  static constexpr const char* hf_v_weight = "v_proj.weight";
  static constexpr const char* hf_o_weight = "o_proj.weight";
  static constexpr const char* hf_q_bias = "q_proj.bias";
  static constexpr const char* hf_k_bias = "k_proj.bias";
  static constexpr const char* hf_v_bias = "v_proj.bias";
  static constexpr const char* hf_o_bias = "o_proj.bias";
};

std::string config_str(const MhaConfig& c) {
  std::ostringstream os;
  os << "embed_dim=" << c.embed_dim << ", num_heads=" << c.num_heads << ", num_kv_heads=" << c.kv_heads()
     << ", kdim=" << c.key_dim() << ", vdim=" << c.value_dim();
  return os.str();
}

/// Reads the tensors of one file for one configuration, with messages that name both.
class Reader {
 public:
  Reader(const SafetensorsFile& file, const MhaConfig& config) : file_(file), config_(config) {}

  Tensor get(const char* name, const Shape& expected) const {
    if (!file_.contains(name)) {
      // A bias the configuration expects because metadata 'bias' is absent: say it defaults to true.
      const bool default_bias = std::string_view(name).ends_with("bias") && std::string_view(name) != Names::bias_k &&
                                std::string_view(name) != Names::bias_v && !file_.metadata().contains("bias");
      fail("load_weights: ", file_.path(), ": missing tensor '", name, "' ", shape_str(expected), " (",
           config_str(config_), ")",
           default_bias ? "; metadata 'bias' is absent and defaults to true: add bias=false for a file without biases"
                        : "");
    }
    const TensorInfo& info = file_.info(name);
    if (info.dtype != DType::F32 && info.dtype != DType::F16 && info.dtype != DType::BF16 && info.dtype != DType::F64)
      fail("load_weights: ", file_.path(), ": tensor '", name, "' is ", dtype_name(info.dtype),
           "; weights must be F32, F16, BF16 or F64");
    if (info.shape != expected)
      fail("load_weights: ", file_.path(), ": tensor '", name, "' has shape ", shape_str(info.shape), ", expected ",
           shape_str(expected), " (", config_str(config_), ")");
    return file_.read_f32(name);
  }

  /// A tensor the configuration does not use must not be there: silently ignoring it would load a
  /// checkpoint into a module that computes something else (e.g. without its biases).
  void reject(const char* name, const char* why) const {
    if (file_.contains(name))
      fail("load_weights: ", file_.path(), ": tensor '", name, "' is present but ", why, " (", config_str(config_),
           ")");
  }

 private:
  const SafetensorsFile& file_;
  const MhaConfig& config_;
};

/// Rows [row0, row0 + rows) of a 2-D (or 1-D) tensor.
Tensor slice_rows(const Tensor& t, int64_t row0, int64_t rows) {
  const int64_t width = t.dim() == 2 ? t.size(1) : 1;
  Shape shape = t.shape();
  shape[0] = rows;
  const auto begin = t.storage().begin() + row0 * width;
  return Tensor(std::move(shape), TensorStorage<float>(begin, begin + rows * width));
}

/// Stacks tensors along the first dimension (equal trailing dims are the caller's to ensure).
Tensor concat_rows(std::initializer_list<const Tensor*> parts) {
  Shape shape = (*parts.begin())->shape();
  shape[0] = 0;
  TensorStorage<float> values;
  for (const Tensor* p : parts) {
    shape[0] += p->size(0);
    values.insert(values.end(), p->storage().begin(), p->storage().end());
  }
  return Tensor(std::move(shape), std::move(values));
}

}  // namespace

// ---- configuration <-> metadata ----------------------------------------------------------------

MhaConfig config_from_metadata(const std::map<std::string, std::string>& metadata, const std::string& label) {
  MhaConfig c;
  for (const char* key : {"embed_dim", "num_heads"})
    if (!find_key(metadata, key)) fail("config_from_metadata: ", label, ": metadata has no '", key, "'");
  c.embed_dim = parse_int(label, "embed_dim", *find_key(metadata, "embed_dim"));
  c.num_heads = parse_int(label, "num_heads", *find_key(metadata, "num_heads"));
  if (const auto* v = find_key(metadata, "num_kv_heads")) c.num_kv_heads = parse_int(label, "num_kv_heads", *v);
  if (const auto* v = find_key(metadata, "kdim")) c.kdim = parse_int(label, "kdim", *v);
  if (const auto* v = find_key(metadata, "vdim")) c.vdim = parse_int(label, "vdim", *v);
  if (const auto* v = find_key(metadata, "bias")) c.bias = parse_bool(label, "bias", *v);
  if (const auto* v = find_key(metadata, "add_bias_kv")) c.add_bias_kv = parse_bool(label, "add_bias_kv", *v);
  if (const auto* v = find_key(metadata, "add_zero_attn")) c.add_zero_attn = parse_bool(label, "add_zero_attn", *v);
  if (const auto* v = find_key(metadata, "batch_first"))
    c.layout = parse_bool(label, "batch_first", *v) ? Layout::BatchFirst : Layout::SeqFirst;
  if (const auto* v = find_key(metadata, "dropout")) c.dropout = parse_number<float>(label, "dropout", *v);
  if (const auto* v = find_key(metadata, "head_dim")) c.head_dim_override = parse_int(label, "head_dim", *v);
  // RoPE changes what the weights compute, so a file that had it must bring it back.
  if (const auto* v = find_key(metadata, "rope")) {
    if (*v == "half_split")
      c.rope = Rope::half_split();
    else if (*v == "interleaved")
      c.rope = Rope::interleaved();
    else if (*v != "none")
      fail("config_from_metadata: ", label, ": metadata 'rope' = '", *v,
           "' is not one of none, half_split, interleaved");
  }
  // Without a rope key (or with rope=none) these would set nothing that is used: a Llama file
  // written by hand with rope_theta but no rope would load, and compute, without RoPE.
  for (const char* key : {"rope_theta", "rope_dims"})
    if (find_key(metadata, key) && !c.rope.enabled)
      fail("config_from_metadata: ", label, ": metadata '", key,
           "' is given but 'rope' is not (add rope=half_split or rope=interleaved)");
  if (const auto* v = find_key(metadata, "rope_theta")) c.rope.theta = parse_number<double>(label, "rope_theta", *v);
  if (const auto* v = find_key(metadata, "rope_dims")) c.rope.dims = parse_int(label, "rope_dims", *v);
  if (const auto* v = find_key(metadata, "scale")) c.scale = parse_number<float>(label, "scale", *v);
  if (const auto* v = find_key(metadata, "softcap")) c.softcap = parse_number<float>(label, "softcap", *v);
  if (const auto* v = find_key(metadata, "attention_sinks"))
    c.attention_sinks = parse_bool(label, "attention_sinks", *v);
  if (const auto* v = find_key(metadata, "alibi_slopes")) {  // comma-separated, one per head
    // Counted first, so that a list of the wrong length is named with its own length (the parse
    // below stops after num_heads + 1 entries: the allocation stays bounded by the config).
    const int64_t entries = std::count(v->begin(), v->end(), ',') + 1;
    if (c.num_heads > 0 && entries != c.num_heads)
      fail("config_from_metadata: ", label, ": metadata 'alibi_slopes' has ", entries,
           " entries, expected one per head (", c.num_heads, ")");
    size_t at = 0;
    while (at <= v->size() && c.alibi_slopes.size() <= static_cast<size_t>(std::max<int64_t>(c.num_heads, 0))) {
      const size_t comma = std::min(v->find(',', at), v->size());
      c.alibi_slopes.push_back(parse_number<float>(label, "alibi_slopes", v->substr(at, comma - at)));
      at = comma + 1;
    }
  }
  try {
    c.validate();
  } catch (const Error& e) {
    fail("config_from_metadata: ", label, ": ", e.what());
  }
  return c;
}

std::map<std::string, std::string> metadata_from_config(const MhaConfig& config) {
  const auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  std::map<std::string, std::string> m{
      {"format", "mha-weights/1"},
      {"embed_dim", std::to_string(config.embed_dim)},
      {"num_heads", std::to_string(config.num_heads)},
      {"kdim", std::to_string(config.key_dim())},
      {"vdim", std::to_string(config.value_dim())},
      {"bias", b(config.bias)},
      {"add_bias_kv", b(config.add_bias_kv)},
      {"add_zero_attn", b(config.add_zero_attn)},
      {"batch_first", b(config.layout == Layout::BatchFirst)},
  };
  // Written only when they differ from the default, as in the conformance cases.
  if (config.kv_heads() != config.num_heads) m["num_kv_heads"] = std::to_string(config.kv_heads());
  if (config.dropout != 0.0f) m["dropout"] = shortest(config.dropout);
  if (config.head_dim_override > 0) m["head_dim"] = std::to_string(config.head_dim());
  if (config.scale) m["scale"] = shortest(*config.scale);
  if (config.softcap != 0.0f) m["softcap"] = shortest(config.softcap);
  if (config.attention_sinks) m["attention_sinks"] = "true";
  if (!config.alibi_slopes.empty()) {
    std::string s;
    for (float x : config.alibi_slopes) {
      if (!s.empty()) s += ',';
      s += shortest(x);
    }
    m["alibi_slopes"] = s;
  }
  if (config.rope.enabled) {
    m["rope"] = pairing_name(config.rope.pairing);
    m["rope_theta"] = shortest(config.rope.theta);
    if (config.rope.dims > 0) m["rope_dims"] = std::to_string(config.rope.dims);
  }
  return m;
}

// ---- loading -----------------------------------------------------------------------------------

WeightNames detect_weight_names(const SafetensorsFile& file) {
  const bool torch = file.contains(Names::in_proj_weight) || file.contains(Names::q_proj_weight) ||
                     file.contains(Names::out_proj_weight);
  const bool hf = file.contains(Names::hf_q_weight) || file.contains(Names::hf_o_weight);
  if (torch && hf)
    fail("detect_weight_names: ", file.path(),
         ": has both PyTorch (in_proj_weight / q_proj_weight / out_proj.weight) and Hugging Face "
         "(q_proj.weight / o_proj.weight) projection weights");
  if (torch) return WeightNames::PyTorch;
  if (hf) return WeightNames::HuggingFace;
  fail("detect_weight_names: ", file.path(),
       ": has neither PyTorch (in_proj_weight / q_proj_weight / out_proj.weight) nor Hugging Face "
       "(q_proj.weight / o_proj.weight) projection weights");
}

namespace {

/// Reads every parameter `c` needs from `file`. Each tensor's name, dtype and shape are checked
/// against the file's header before it is read, so what this allocates is bounded by the file's
/// own size (times 4 / element size): a hostile header cannot make it allocate more.
MhaParameters read_parameters(const MhaConfig& c, const SafetensorsFile& file) {
  const int64_t E = c.embed_dim, d = c.head_dim(), h = c.num_heads, kv = c.kv_heads();
  const Reader r(file, c);
  const WeightNames names = detect_weight_names(file);

  // Everything is read into a fresh set first, so a failure leaves the module as it was.
  MhaParameters p;
  // The other naming scheme's parameters are never read: refused, not ignored (a PyTorch-named file
  // with q_proj.bias and bias=false would load without those biases).
  if (names == WeightNames::PyTorch) {
    for (const char* n : {Names::hf_q_weight, Names::hf_k_weight, Names::hf_v_weight, Names::hf_o_weight,
                          Names::hf_q_bias, Names::hf_k_bias, Names::hf_v_bias, Names::hf_o_bias})
      r.reject(n, "the file uses PyTorch's names (in_proj_weight / out_proj.weight), not Hugging Face's");
  } else {
    for (const char* n : {Names::in_proj_weight, Names::q_proj_weight, Names::k_proj_weight, Names::v_proj_weight,
                          Names::in_proj_bias, Names::out_proj_weight, Names::out_proj_bias})
      r.reject(n, "the file uses Hugging Face's names (q_proj.weight / o_proj.weight), not PyTorch's");
  }
  if (names == WeightNames::PyTorch) {
    if (c.packed_in_proj()) {
      for (const char* n : {Names::q_proj_weight, Names::k_proj_weight, Names::v_proj_weight})
        r.reject(n, "kdim = vdim = embed_dim, so the projections are packed in in_proj_weight");
      p.in_proj_weight = r.get(Names::in_proj_weight, {c.in_proj_rows(), E});
    } else {
      r.reject(Names::in_proj_weight, "kdim or vdim differ from embed_dim, so q/k/v_proj_weight are expected");
      p.q_proj_weight = r.get(Names::q_proj_weight, {h * d, E});
      p.k_proj_weight = r.get(Names::k_proj_weight, {kv * d, c.key_dim()});
      p.v_proj_weight = r.get(Names::v_proj_weight, {kv * d, c.value_dim()});
    }
    if (c.bias) {
      p.in_proj_bias = r.get(Names::in_proj_bias, {c.in_proj_rows()});
      p.out_proj_bias = r.get(Names::out_proj_bias, {E});
    } else {
      for (const char* n : {Names::in_proj_bias, Names::out_proj_bias}) r.reject(n, "the configuration has bias=false");
    }
    p.out_proj_weight = r.get(Names::out_proj_weight, {E, h * d});
  } else {
    Tensor q = r.get(Names::hf_q_weight, {h * d, E});
    Tensor k = r.get(Names::hf_k_weight, {kv * d, c.key_dim()});
    Tensor v = r.get(Names::hf_v_weight, {kv * d, c.value_dim()});
    if (c.packed_in_proj()) {
      p.in_proj_weight = concat_rows({&q, &k, &v});
    } else {
      p.q_proj_weight = std::move(q);
      p.k_proj_weight = std::move(k);
      p.v_proj_weight = std::move(v);
    }
    if (c.bias) {
      const Tensor qb = r.get(Names::hf_q_bias, {h * d});
      const Tensor kb = r.get(Names::hf_k_bias, {kv * d});
      const Tensor vb = r.get(Names::hf_v_bias, {kv * d});
      p.in_proj_bias = concat_rows({&qb, &kb, &vb});
      p.out_proj_bias = r.get(Names::hf_o_bias, {E});
    } else {
      for (const char* n : {Names::hf_q_bias, Names::hf_k_bias, Names::hf_v_bias, Names::hf_o_bias})
        r.reject(n, "the configuration has bias=false");
    }
    p.out_proj_weight = r.get(Names::hf_o_weight, {E, h * d});
  }
  if (c.add_bias_kv) {
    p.bias_k = r.get(Names::bias_k, {1, 1, kv * d});
    p.bias_v = r.get(Names::bias_v, {1, 1, kv * d});
  } else {
    for (const char* n : {Names::bias_k, Names::bias_v}) r.reject(n, "the configuration has add_bias_kv=false");
  }
  if (c.attention_sinks)
    p.sinks = r.get(Names::sinks, {h});
  else
    r.reject(Names::sinks, "the configuration has attention_sinks=false");
  return p;
}

/// What a configuration computes, field by field, every default resolved (the head dim, K/V
/// heads, widths, the softmax scale, RoPE's rotated dims): two spellings of one module (scale=0.5
/// where 1/√d is 0.5, head_dim equal to E/h) give the same values. In the order a mismatch is best
/// reported in (the head count before the head dim it implies).
std::vector<std::pair<std::string, std::string>> effective_fields(const MhaConfig& c) {
  const auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  const auto number = [](float x) { return shortest(x == 0.0f ? 0.0f : x); };  // −0 is 0 (validate takes both)
  const int64_t d = c.head_dim();
  std::string slopes = "none";
  for (size_t i = 0; i < c.alibi_slopes.size(); ++i) slopes = (i ? slopes + "," : "") + number(c.alibi_slopes[i]);
  // 1/√d as the module resolves it (1.0f / sqrtf(d)) and correctly rounded differ by an ulp for
  // some d (24, 96, 112): either, stated or not, is the default scale.
  const float rounded = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const bool default_scale = !c.scale || *c.scale == mha::detail::resolve_scale(std::nullopt, d) || *c.scale == rounded;
  return {{"embed_dim", std::to_string(c.embed_dim)},
          {"num_heads", std::to_string(c.num_heads)},
          {"num_kv_heads", std::to_string(c.kv_heads())},
          {"head_dim", std::to_string(d)},
          {"kdim", std::to_string(c.key_dim())},
          {"vdim", std::to_string(c.value_dim())},
          {"bias", b(c.bias)},
          {"add_bias_kv", b(c.add_bias_kv)},
          {"add_zero_attn", b(c.add_zero_attn)},
          {"scale", default_scale ? std::string("1/sqrt(head_dim)") : number(*c.scale)},
          {"softcap", number(c.softcap)},
          {"attention_sinks", b(c.attention_sinks)},
          {"alibi_slopes", slopes},
          {"rope", c.rope.enabled ? pairing_name(c.rope.pairing) : "none"},
          {"rope_theta", c.rope.enabled ? shortest(c.rope.theta) : "-"},
          {"rope_dims", c.rope.enabled ? std::to_string(c.rope.dims > 0 ? c.rope.dims : d) : "-"}};
}

}  // namespace

void load_weights(MultiheadAttention& module, const SafetensorsFile& file) {
  // A file that states its configuration must have been saved from a module that computes what
  // this one does: equal shapes are not enough (8 × 8 projections fit 2 heads of 4 and 4 heads of
  // 2; RoPE, ALiBi, a softcap or sinks change the scores without changing a shape). Each field the
  // file states is compared, as it resolves (every field of mha's own files, which state the whole
  // configuration); a field a foreign file leaves out is not. The layout and dropout say how a
  // module is called, not what its weights mean, and may differ.
  const auto& meta = file.metadata();
  const auto mine = effective_fields(module.config());
  const bool states_any = std::any_of(mine.begin(), mine.end(), [&](const auto& f) { return meta.contains(f.first); });
  if (states_any) {
    // embed_dim and num_heads (and a head_dim override) resolve the other fields. A file that
    // leaves them out is no claim about them: the module's stand in, and what the file does state
    // is still compared (a file stating num_heads = 2 alone loaded into 4 heads of the same width).
    std::map<std::string, std::string> resolved = meta;
    const MhaConfig& mc = module.config();
    std::string borrowed;  // the module's fields standing in for the file's, for the message below
    const auto stand_in = [&](const char* key, int64_t value) {
      if (resolved.emplace(key, std::to_string(value)).second)
        borrowed += std::string(borrowed.empty() ? "" : ", ") + key + " = " + std::to_string(value);
    };
    stand_in("embed_dim", mc.embed_dim);
    stand_in("num_heads", mc.num_heads);
    if (mc.head_dim_override > 0) stand_in("head_dim", mc.head_dim());
    MhaConfig file_config;
    try {
      file_config = config_from_metadata(resolved, file.path());
    } catch (const Error& e) {
      if (borrowed.empty()) throw;
      // Its message would name the module's values as if the file had stated them.
      fail("load_weights: ", file.path(), ": the file's configuration, completed with the module's ", borrowed,
           " (which the file does not state), does not describe a module: ", e.what());
    }
    const auto theirs = effective_fields(file_config);
    const bool whole = meta.contains("format") && meta.at("format") == "mha-weights/1";
    for (size_t i = 0; i < theirs.size(); ++i) {
      const auto& [key, value] = theirs[i];
      const bool stated = whole || meta.contains(key);
      if (stated && mine[i].second != value)
        fail("load_weights: ", file.path(), ": the file's configuration has ", key, " = ", value,
             " where the module's has ", mine[i].second, " (load_module builds the module the file describes)");
    }
  }
  module.params() = read_parameters(module.config(), file);
}

MultiheadAttention load_module(const SafetensorsFile& file) {
  // The file's tensors first, then the module: building the module from the metadata alone would
  // allocate (and initialise) whatever sizes the metadata claims before anything checks them.
  const MhaConfig config = config_from_metadata(file.metadata(), file.path());
  return MultiheadAttention(config, read_parameters(config, file));
}

// ---- saving ------------------------------------------------------------------------------------

namespace {
/// A WeightNames cast from an integer must name one of its values; fn is the function the caller
/// called (save_module's refusal said "add_weights", a function it never called).
void check_weight_names(const char* fn, WeightNames names) {
  if (names != WeightNames::PyTorch && names != WeightNames::HuggingFace)
    fail(fn, ": names ", static_cast<int>(names), " is not a WeightNames (PyTorch or HuggingFace)");
}
}  // namespace

void add_weights(SafetensorsWriter& writer, const MultiheadAttention& module, WeightNames names) {
  check_weight_names("add_weights", names);
  module.check_params();
  const MhaConfig& c = module.config();
  const MhaParameters& p = module.params();
  for (const auto& [key, value] : metadata_from_config(c)) writer.set_metadata(key, value);

  if (names == WeightNames::PyTorch) {
    if (c.packed_in_proj()) {
      writer.add(Names::in_proj_weight, p.in_proj_weight);
    } else {
      writer.add(Names::q_proj_weight, p.q_proj_weight);
      writer.add(Names::k_proj_weight, p.k_proj_weight);
      writer.add(Names::v_proj_weight, p.v_proj_weight);
    }
    if (c.bias) {
      writer.add(Names::in_proj_bias, p.in_proj_bias);
      writer.add(Names::out_proj_bias, p.out_proj_bias);
    }
    writer.add(Names::out_proj_weight, p.out_proj_weight);
  } else {
    const int64_t q_rows = c.num_heads * c.head_dim(), kv_rows = c.kv_heads() * c.head_dim();
    if (c.packed_in_proj()) {
      writer.add(Names::hf_q_weight, slice_rows(p.in_proj_weight, 0, q_rows));
      writer.add(Names::hf_k_weight, slice_rows(p.in_proj_weight, q_rows, kv_rows));
      writer.add(Names::hf_v_weight, slice_rows(p.in_proj_weight, q_rows + kv_rows, kv_rows));
    } else {
      writer.add(Names::hf_q_weight, p.q_proj_weight);
      writer.add(Names::hf_k_weight, p.k_proj_weight);
      writer.add(Names::hf_v_weight, p.v_proj_weight);
    }
    if (c.bias) {
      writer.add(Names::hf_q_bias, slice_rows(p.in_proj_bias, 0, q_rows));
      writer.add(Names::hf_k_bias, slice_rows(p.in_proj_bias, q_rows, kv_rows));
      writer.add(Names::hf_v_bias, slice_rows(p.in_proj_bias, q_rows + kv_rows, kv_rows));
      writer.add(Names::hf_o_bias, p.out_proj_bias);
    }
    writer.add(Names::hf_o_weight, p.out_proj_weight);
  }
  if (c.add_bias_kv) {
    writer.add(Names::bias_k, p.bias_k);
    writer.add(Names::bias_v, p.bias_v);
  }
  if (c.attention_sinks) writer.add(Names::sinks, p.sinks);
}

void save_module(const std::string& path, const MultiheadAttention& module, WeightNames names) {
  check_weight_names("save_module", names);
  SafetensorsWriter writer;
  add_weights(writer, module, names);
  writer.write(path);
}

}  // namespace mha::io
