// tools/bench_util.h — what `mha bench` and bench/bench_attention.cpp share: the cases they time,
// the FLOP convention, peak memory and the machine's sgemm throughput measured in the same run.
//
// FLOP convention (issue 3): the attention core is 4·B·h·T_q·T_k·d (QKᵀ and PV, one multiply-add
// = 2 FLOPs each), counted as half when causal; each projection GEMM is 2·rows·in·out. Softmax,
// bias and mask work are not counted, so GFLOP/s compare like for like with PyTorch and sgemm.
#pragma once

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "gemm_reference.h"
#include "machine_peak.h"
#include "mha/module.h"
#include "mha/random.h"
#include "mha/sdpa.h"
#include "mha/tensor.h"
#include "mha/training.h"

namespace mha::bench {

enum class DType : uint8_t { F32, BF16 };
enum class Target : uint8_t { Module, Core };
/// Forward: the forward alone. Backward: the core's backward alone (from a saved forward), or the
/// module's training forward + backward together.
enum class Pass : uint8_t { Forward, Backward };

struct BenchConfig {
  int64_t batch = 1, seq = 0, kv_seq = 0, embed_dim = 0, heads = 0, kv_heads = 0;
  bool causal = false;
  DType dtype = DType::F32;
  Target target = Target::Module;
  Pass pass = Pass::Forward;
  NeedWeights need_weights = NeedWeights::None;  ///< forward only (module or core)
  int threads = 0;                               ///< 0 = library default
  bool alibi = false;                            ///< --alibi: the standard slopes for h heads
  float softcap = 0.0f;                          ///< --softcap C
  bool sinks = false;                            ///< --sinks: one (zero) sink logit per head

  int64_t t_k() const { return kv_seq > 0 ? kv_seq : seq; }
  int64_t kv() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t head_dim() const { return embed_dim / heads; }
  /// Self-attention (query, key and value one tensor, one packed QKV GEMM) unless --kv-seq differs.
  bool self_attention() const { return t_k() == seq; }
};

/// One-line errors for sizes a benchmark cannot run (mha::Error, as the CLI expects).
inline void validate(const BenchConfig& c) {
  if (c.batch <= 0) fail("bench: --batch must be ≥ 1, got ", c.batch);
  if (c.seq <= 0) fail("bench: --seq must be ≥ 1, got ", c.seq);
  if (c.kv_seq < 0) fail("bench: --kv-seq must be ≥ 1, got ", c.kv_seq);
  if (c.embed_dim <= 0) fail("bench: --embed-dim must be ≥ 1, got ", c.embed_dim);
  if (c.heads <= 0) fail("bench: --heads must be ≥ 1, got ", c.heads);
  if (c.kv_heads < 0) fail("bench: --kv-heads must be ≥ 1, got ", c.kv_heads);
  if (c.embed_dim % c.heads != 0) fail("bench: --heads ", c.heads, " must divide --embed-dim ", c.embed_dim);
  if (c.heads % c.kv() != 0) fail("bench: --kv-heads ", c.kv(), " must divide --heads ", c.heads);
  if (c.threads < 0) fail("bench: --threads must be ≥ 1, got ", c.threads);
  if (!std::isfinite(c.softcap) || c.softcap < 0.0f) fail("bench: --softcap must be a finite C > 0, got ", c.softcap);
}

/// 4·B·h·T_q·T_k·d, halved when causal.
inline double core_flops(const BenchConfig& c) {
  const double f = 4.0 * static_cast<double>(c.batch) * static_cast<double>(c.heads) * static_cast<double>(c.seq) *
                   static_cast<double>(c.t_k()) * static_cast<double>(c.head_dim());
  return c.causal ? 0.5 * f : f;
}

/// Q, K, V and output projections: 2·rows·in·out each.
inline double projection_flops(const BenchConfig& c) {
  const double E = static_cast<double>(c.embed_dim), kvd = static_cast<double>(c.kv() * c.head_dim());
  const double nq = static_cast<double>(c.batch * c.seq), nk = static_cast<double>(c.batch * c.t_k());
  return 2.0 * nq * E * E      // Q
         + 2.0 * nk * E * kvd  // K
         + 2.0 * nk * E * kvd  // V
         + 2.0 * nq * E * E;   // output
}

/// Backward counts the usual convention: 2.5× the forward core (five T_q×T_k×d products) and 2×
/// each projection GEMM (input and weight gradients).
inline double total_flops(const BenchConfig& c) {
  if (c.pass == Pass::Backward)
    return c.target == Target::Core ? 2.5 * core_flops(c)
                                    : 3.5 * core_flops(c) + 3.0 * projection_flops(c);  // forward + backward
  return c.target == Target::Core ? core_flops(c) : core_flops(c) + projection_flops(c);
}

/// Bytes of the tensors a forward must hold: for the module the inputs, projected Q/K/V, the
/// attention output, the output and the weights; for the core Q, K, V, the output and the weights.
/// Anything beyond this (plus the process's fixed footprint) is scratch, and must not grow like T².
inline double expected_tensor_bytes(const BenchConfig& c) {
  const double E = static_cast<double>(c.embed_dim), d = static_cast<double>(c.head_dim());
  const double h = static_cast<double>(c.heads), kv = static_cast<double>(c.kv());
  const double nq = static_cast<double>(c.batch * c.seq), nk = static_cast<double>(c.batch * c.t_k());
  const double elem = c.dtype == DType::BF16 ? 2.0 : 4.0;
  const double t_k = static_cast<double>(c.t_k());
  const double attn = c.need_weights == NeedWeights::PerHead    ? nq * h * t_k
                      : c.need_weights == NeedWeights::Averaged ? nq * t_k
                                                                : 0.0;
  if (c.target == Target::Core) return elem * (2.0 * nq * h * d + 2.0 * nk * kv * d) + 4.0 * (nq * h * d + attn);
  const double inputs = c.self_attention() ? nq * E : nq * E + 2.0 * nk * E;
  const double projected = nq * h * d + 2.0 * nk * kv * d;
  const double weights = (h + 2.0 * kv) * d * E + E * h * d + (h + 2.0 * kv) * d + E;
  return 4.0 * (inputs + projected + nq * h * d + nq * E + weights + attn);
}

/// Peak resident set size of this process so far, in MiB (Linux reports ru_maxrss in KiB).
inline double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

/// Uniform values in [−1, 1) from a fixed seed (splitmix64): the same inputs on every run.
inline void fill_uniform(std::span<float> values, uint64_t seed) {
  SplitMix64 rng = SplitMix64::seeded(seed);
  for (float& x : values) x = static_cast<float>(static_cast<double>(rng.next() >> 40) * 0x1.0p-23 - 1.0);
}

inline Tensor random_tensor(Shape shape, uint64_t seed) {
  Tensor t(std::move(shape));
  fill_uniform(t.values(), seed);
  return t;
}

/// --alibi / --softcap / --sinks as SdpaOptions; the slopes and sinks live in `store`.
struct EditStore {
  std::vector<float> slopes, sinks;
};
inline void apply_edits(const BenchConfig& c, EditStore& store, SdpaOptions& opt) {
  if (c.alibi) store.slopes = alibi_slopes(c.heads);
  if (c.sinks) store.sinks.assign(static_cast<size_t>(c.heads), 0.0f);
  opt.alibi.slopes = store.slopes;
  opt.softcap = c.softcap;
  opt.sinks.logits = store.sinks;
}
/// The edits in words, for the report line ("" when none).
inline std::string edits_str(const BenchConfig& c) {
  std::string s;
  if (c.alibi) s += " alibi";
  if (c.softcap > 0) s += " softcap=" + std::to_string(c.softcap);
  if (c.sinks) s += " sinks";
  return s;
}

/// The attention core alone: sdpa on contiguous (B, h, T_q, d) and (B, kv, T_k, d) tensors.
class CoreCase {
 public:
  explicit CoreCase(const BenchConfig& c) : c_(c) {
    out_ = Tensor({c.batch, c.heads, c.seq, c.head_dim()});
    // Weights outputs, like out, kept across runs (a caller that asks for weights every call
    // would keep them too): the kernel's time, not fresh pages'.
    if (c.need_weights != NeedWeights::None) weights_ = Tensor({c.batch, weight_heads(), c.seq, c.t_k()});
    const int64_t d = c.head_dim();
    const Tensor q = random_tensor({c.batch, c.heads, c.seq, d}, 1);
    const Tensor k = random_tensor({c.batch, c.kv(), c.t_k(), d}, 2);
    const Tensor v = random_tensor({c.batch, c.kv(), c.t_k(), d}, 3);
    if (c.dtype == DType::BF16) {
      q16_ = to_bf16_tensor(q), k16_ = to_bf16_tensor(k), v16_ = to_bf16_tensor(v);
    } else {
      q_ = q, k_ = k, v_ = v;
    }
    opt_.masks.causal = c.causal ? Causal::top_left() : Causal::none();
    opt_.threads = c.threads;
    opt_.thread_stats = &stats_;
    apply_edits(c, edits_, opt_);
  }

  /// Each thread's busy time in the fused kernel, summed over the calls since reset_stats().
  const SdpaThreadStats& stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

  void run() {
    SdpaOutputs outs = outputs(out_.view4(), weights_.defined() ? weights_.view4() : View4<float>{});
    if (c_.dtype == DType::BF16)
      mha::sdpa(q16_.view4(), k16_.view4(), v16_.view4(), opt_, outs);
    else
      mha::sdpa(q_.view4(), k_.view4(), v_.view4(), opt_, outs);
  }

  /// Which kernel Auto picks for this request, and why (sdpa_dispatch_reason; float32 shapes).
  std::string dispatch() const {
    float dummy = 0.0f;  // make_params reads shapes and strides only
    const int64_t d = c_.head_dim();
    const View4<const float> q = contiguous_view<const float>(&dummy, c_.batch, c_.heads, c_.seq, d);
    const View4<const float> kv = contiguous_view<const float>(&dummy, c_.batch, c_.kv(), c_.t_k(), d);
    const View4<float> w = c_.need_weights == NeedWeights::None
                               ? View4<float>{}
                               : contiguous_view<float>(&dummy, c_.batch, weight_heads(), c_.seq, c_.t_k());
    return sdpa_dispatch_reason(q, kv, kv, opt_,
                                outputs(contiguous_view<float>(&dummy, c_.batch, c_.heads, c_.seq, d), w));
  }

 private:
  /// Heads of the weights output: h per head, 1 averaged.
  int64_t weight_heads() const { return c_.need_weights == NeedWeights::PerHead ? c_.heads : 1; }
  /// out, and the weights view as per-head or averaged weights, as --need-weights asks.
  SdpaOutputs outputs(View4<float> out, View4<float> weights) const {
    SdpaOutputs outs;
    outs.out = out;
    if (c_.need_weights == NeedWeights::PerHead) outs.weights = weights;
    if (c_.need_weights == NeedWeights::Averaged) outs.averaged_weights = weights;
    return outs;
  }
  static BF16Tensor to_bf16_tensor(const Tensor& t) {
    BF16Tensor r(t.shape());
    for (int64_t i = 0; i < t.numel(); ++i) r.data()[i] = to_bf16(t.data()[i]);
    return r;
  }
  BenchConfig c_;
  Tensor q_, k_, v_, out_, weights_;
  BF16Tensor q16_, k16_, v16_;
  EditStore edits_;
  SdpaThreadStats stats_;
  SdpaOptions opt_;  // points at stats_: a CoreCase stays where it was built (held by unique_ptr)
};

/// The whole module forward: MultiheadAttention::forward, batch-first, eval, need_weights as asked
/// (none by default).
class ModuleCase {
 public:
  explicit ModuleCase(const BenchConfig& c) : c_(c), module_(make_config(c), /*init_seed=*/7) {
    if (c.dtype == DType::BF16)
      fail("bench: --dtype bf16 is not available for the module forward yet (only with --core)");
    query_ = random_tensor({c.batch, c.seq, c.embed_dim}, 4);
    if (!c.self_attention()) {
      key_ = random_tensor({c.batch, c.t_k(), c.embed_dim}, 5);
      value_ = random_tensor({c.batch, c.t_k(), c.embed_dim}, 6);
    }
    opt_.causal = c.causal ? Causal::top_left() : Causal::none();
    opt_.need_weights = c.need_weights;
    opt_.threads = c.threads;
  }

  void run() {
    // Self-attention passes one tensor three times: the module then does one packed QKV GEMM.
    const Tensor& key = c_.self_attention() ? query_ : key_;
    const Tensor& value = c_.self_attention() ? query_ : value_;
    const MhaOutput out = module_.forward(query_, key, value, opt_);
    checksum_ += out.output.numel() > 0 ? out.output.data()[0] : 0.0f;
  }

  /// The dispatch for the (B, h, T, d) head views the module hands to sdpa.
  std::string dispatch() const {
    float dummy = 0.0f;  // make_params reads shapes and strides only
    const int64_t E = c_.embed_dim, d = c_.head_dim(), ld = c_.self_attention() ? (c_.heads + 2 * c_.kv()) * d : E;
    const View4<const float> q{&dummy, {c_.batch, c_.heads, c_.seq, d}, {c_.seq * ld, d, ld, 1}};
    const int64_t ldk = c_.self_attention() ? ld : c_.kv() * d;
    const View4<const float> kv{&dummy, {c_.batch, c_.kv(), c_.t_k(), d}, {c_.t_k() * ldk, d, ldk, 1}};
    SdpaOptions sopt;
    sopt.masks.causal = opt_.causal;
    sopt.threads = c_.threads;
    EditStore store;
    apply_edits(c_, store, sopt);
    SdpaOutputs outs;
    outs.out = View4<float>{&dummy, {c_.batch, c_.heads, c_.seq, d}, {c_.seq * E, d, E, 1}};
    if (c_.need_weights == NeedWeights::PerHead)
      outs.weights = contiguous_view<float>(&dummy, c_.batch, c_.heads, c_.seq, c_.t_k());
    if (c_.need_weights == NeedWeights::Averaged)
      outs.averaged_weights = contiguous_view<float>(&dummy, c_.batch, 1, c_.seq, c_.t_k());
    return sdpa_dispatch_reason(q, kv, kv, sopt, outs);
  }

 public:
  static MhaConfig make_config(const BenchConfig& c) {
    MhaConfig m;
    m.embed_dim = c.embed_dim;
    m.num_heads = c.heads;
    m.num_kv_heads = c.kv_heads;
    m.layout = Layout::BatchFirst;
    if (c.alibi) m.alibi_slopes = alibi_slopes(c.heads);
    m.softcap = c.softcap;
    m.attention_sinks = c.sinks;
    return m;
  }

 private:
  BenchConfig c_;
  MultiheadAttention module_;
  Tensor query_, key_, value_;
  MhaForwardOptions opt_;
  float checksum_ = 0.0f;  // keeps the result observable
};

/// The attention core's backward, from a forward run once at construction (out and lse saved).
class CoreBackwardCase {
 public:
  explicit CoreBackwardCase(const BenchConfig& c) : c_(c) {
    if (c.dtype == DType::BF16) fail("bench: --backward runs in float32 only (there is no bf16 backward)");
    const int64_t d = c.head_dim();
    q_ = random_tensor({c.batch, c.heads, c.seq, d}, 1);
    k_ = random_tensor({c.batch, c.kv(), c.t_k(), d}, 2);
    v_ = random_tensor({c.batch, c.kv(), c.t_k(), d}, 3);
    d_out_ = random_tensor({c.batch, c.heads, c.seq, d}, 4);
    opt_.masks.causal = c.causal ? Causal::top_left() : Causal::none();
    opt_.threads = c.threads;
    apply_edits(c, edits_, opt_);
    SdpaResult fwd = sdpa(q_, k_, v_, opt_, Want::Lse);
    out_ = std::move(fwd.out);
    lse_ = fwd.lse.reshaped({c.batch, c.heads, c.seq, 1});
    dq_ = Tensor(q_.shape()), dk_ = Tensor(k_.shape()), dv_ = Tensor(v_.shape());
  }
  // Into gradient tensors kept across runs, as CoreCase keeps its output and as a training loop
  // (or PyTorch's caching allocator) keeps its buffers: fresh ones per call were up to 15% of the
  // time in the kernel's page faults (B=64, T=512: 192 MiB of gradients a call).
  void run() {
    sdpa_backward(q_.view4(), k_.view4(), v_.view4(), out_.view4(), d_out_.view4(), lse_.view4(), opt_,
                  {dq_.view4(), dk_.view4(), dv_.view4()});
  }
  std::string dispatch() const { return sdpa_backward_dispatch_reason(q_.view4(), k_.view4(), v_.view4(), opt_); }

 private:
  BenchConfig c_;
  Tensor q_, k_, v_, out_, d_out_, lse_, dq_, dk_, dv_;
  EditStore edits_;
  SdpaOptions opt_;
};

/// The module's training step: forward_train + backward (gradients for inputs and parameters).
class ModuleTrainCase {
 public:
  explicit ModuleTrainCase(const BenchConfig& c) : c_(c), module_(ModuleCase::make_config(c), /*init_seed=*/7) {
    if (c.dtype == DType::BF16) fail("bench: --backward runs in float32 only (there is no bf16 backward)");
    query_ = random_tensor({c.batch, c.seq, c.embed_dim}, 4);
    key_ = c.self_attention() ? query_ : random_tensor({c.batch, c.t_k(), c.embed_dim}, 5);
    value_ = c.self_attention() ? query_ : random_tensor({c.batch, c.t_k(), c.embed_dim}, 6);
    d_output_ = random_tensor({c.batch, c.seq, c.embed_dim}, 8);
    opt_.causal = c.causal ? Causal::top_left() : Causal::none();
    opt_.threads = c.threads;
  }
  void run() {
    const Tensor& key = c_.self_attention() ? query_ : key_;
    const Tensor& value = c_.self_attention() ? query_ : value_;
    MhaTrainOutput fwd = forward_train(module_, query_, key, value, opt_);
    const MhaGradients grads = backward(module_, fwd.context, d_output_);
    checksum_ += grads.query.numel() > 0 ? grads.query.data()[0] : 0.0f;
  }

 private:
  BenchConfig c_;
  MultiheadAttention module_;
  Tensor query_, key_, value_, d_output_;
  MhaForwardOptions opt_;
  float checksum_ = 0.0f;
};

/// Sets the library's thread count (kernels and GEMMs); returns the count in effect.
inline int apply_threads(int threads) {
  set_num_threads(threads);
  return num_threads();
}

/// Times `fn` `repeat` times after one untimed warm-up; returns each time in milliseconds.
/// `progress(i, ms)` is called after each timed run (i from 1).
inline std::vector<double> time_runs(const std::function<void()>& fn, int repeat,
                                     const std::function<void(int, double)>& progress = {}) {
  using clock = std::chrono::steady_clock;
  fn();  // warm-up: first-touch of buffers, BLAS thread start-up
  std::vector<double> ms;
  for (int i = 1; i <= repeat; ++i) {
    const auto t0 = clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
    if (progress) progress(i, ms.back());
  }
  return ms;
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// sgemm throughput of this machine through the library's GEMM (kernels::linear, reached through
/// internal/gemm_reference.h; y = x·Wᵀ, the projections' layout) for n×n×n, median of `repeat`
/// runs, with the BLAS threads already set. Measured after the case so its buffers do not count
/// in the case's peak RSS.
inline double sgemm_gflops(int64_t n, int repeat) {
  std::vector<float> a(static_cast<size_t>(n * n)), b(a.size()), y(a.size());
  fill_uniform(a, 11);
  fill_uniform(b, 12);
  const auto ms = time_runs([&] { internal::square_linear(a.data(), b.data(), y.data(), n); }, repeat);
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / (median(ms) * 1e6);
}

/// This machine's arithmetic peak and memory bandwidth, measured in the same process as the case
/// (internal/machine_peak.h): the FMA peaks on the SIMD target the kernels dispatch to, on
/// `threads` threads; the read-only bandwidth and the STREAM triad over `bytes` beyond the cache.
struct MachinePeak {
  std::string simd_target;
  double f32_gflops = 0, bf16_dot_gflops = 0;  ///< bf16: 0 without a bf16 dot-product instruction
  double f32_tile_gflops = 0;                  ///< the kernels' register tile fed from L1
  double amx_bf16_gflops = 0;                  ///< 0 without AMX tiles (kernels/amx.h)
  double read_gbs = 0, triad_gbs = 0;
};

inline MachinePeak measure_machine(int threads, int64_t bytes) {
  MachinePeak m;
  m.simd_target = internal::simd_target_name();
  m.f32_gflops = internal::f32_fma_peak_gflops(threads);
  m.f32_tile_gflops = internal::f32_tile_peak_gflops(threads);
  m.bf16_dot_gflops = internal::bf16_dot_peak_gflops(threads);
  m.amx_bf16_gflops = internal::amx_bf16_peak_gflops(threads);
  m.read_gbs = internal::read_bandwidth_gbs(bytes, threads);
  m.triad_gbs = internal::triad_gbs(std::max<int64_t>(bytes / 24, 1024), threads);
  return m;
}

}  // namespace mha::bench
