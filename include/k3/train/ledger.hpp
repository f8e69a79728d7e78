// k3/train/ledger.hpp — the per-GPU memory ledger of a K3-like training step (K3 §5.2.2, the
// memory article among the sources): weights, gradients, optimizer state, activations and
// communication buffers, for a model config under the parallelism sliders, once with every
// memory technique off ("naive") and once with the chosen toggles on ("k3").
//
//   k3::train::ledger_of(model_config{}, parallel_config{}, toggles::all()) -> ledger
//
// Every formula is in docs/training_memory.md with the article's statement it reproduces; the
// figures are right in order of magnitude, not in digits (the article says the same of its own).
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "k3/core/error.hpp"

namespace k3::train {

// K3's shapes (config.json) by default; any K3-like model fits the same fields.
struct model_config {
  std::int64_t d = 7168;               // hidden size
  std::int64_t kda_layers = 69;        // KDA attention layers
  std::int64_t mla_layers = 24;        // gated MLA attention layers
  std::int64_t moe_layers = 92;        // MoE FFN layers (every layer but the first)
  std::int64_t dense_layers = 1;       // dense FFN layers (the first)
  std::int64_t experts = 896;          // routed experts per MoE layer
  std::int64_t top_k = 16;             // experts per token
  std::int64_t latent = 3584;          // Stable LatentMoE latent width l (the experts' input and output)
  std::int64_t expert_ffn = 3072;      // expert intermediate size f
  std::int64_t shared_experts = 2;     // per MoE layer, on the full width d
  std::int64_t shared_ffn = 3072;      // shared expert intermediate size
  std::int64_t vocab = 163840;
  std::int64_t dense_ffn = 33792;      // intermediate size of the dense first layer
  // KDA: heads x head_dim = 96 x 128 = 12288 for q, k, v, the output gate and o (five d x 12288
  // matrices), the low-rank decay gate d -> 128 -> 12288 and beta d -> heads.
  std::int64_t kda_heads = 96, kda_head_dim = 128, kda_gate_rank = 128;
  // MLA: q through a rank-1536 bottleneck to heads x 192, kv through 512 (+64 rope) to heads x 256,
  // an output gate d x heads*128 and o heads*128 x d.
  std::int64_t mla_heads = 96, mla_q_rank = 1536, mla_kv_rank = 512, mla_rope_dim = 64, mla_qk_dim = 192, mla_kv_dim = 256,
               mla_v_dim = 128;
  // Values saved for the backward per token (the article's per-layer counts). The MoE layer's
  // count includes the top_k dispatched input copies and the top_k expert outputs (latent each).
  std::int64_t kda_saved_values = 70000, mla_saved_values = 75000, moe_saved_values = 245000;
  // The block representatives of Block AttnRes (9 x d per token) are a small extra the article
  // names separately; they are not in its 29M values per token and not counted here.
};

struct parallel_config {
  std::int64_t pp = 8;        // P, pipeline stages
  std::int64_t vpp = 4;       // V, virtual stages per rank (1: plain 1F1B)
  std::int64_t ep = 32;       // R, expert parallel size
  std::int64_t dp = 8;        // N, weight replicas (ZeRO shards by it)
  std::int64_t tokens = 8192; // S, tokens per micro-batch
};

// The article's memory techniques, in its order; each one removes or changes one row.
enum class technique : int { fp8_activations, offload, moe_backward_rewrite, pp_balance, zero2_cpu_grads, p2p_muon, moonep_buffers };
inline constexpr std::array<std::string_view, 7> technique_names = {"fp8_activations", "offload",        "moe_backward_rewrite", "pp_balance",
                                                                    "zero2_cpu_grads", "p2p_muon", "moonep_buffers"};

struct toggles {
  std::array<bool, 7> on{};
  bool operator[](technique t) const noexcept { return on[static_cast<std::size_t>(t)]; }
  static toggles all() noexcept {
    toggles t;
    t.on.fill(true);
    return t;
  }
  static toggles none() noexcept { return {}; }
  // "all", "none" or a comma-separated list of technique names.
  static toggles parse(std::string const& spec) {
    if (spec == "all") return all();
    if (spec == "none") return none();
    toggles t;
    std::size_t pos = 0;
    while (pos <= spec.size()) {
      std::size_t const end = std::min(spec.find(',', pos), spec.size());
      std::string_view const name(spec.data() + pos, end - pos);
      auto it = std::find(technique_names.begin(), technique_names.end(), name);
      if (it == technique_names.end()) {
        std::string known;
        for (auto n : technique_names) known += (known.empty() ? "" : ", ") + std::string(n);
        throw k3::error(error_kind::value, "toggles: unknown technique '" + std::string(name) + "' (expected all, none or a comma-separated list of: " + known + ")");
      }
      t.on[static_cast<std::size_t>(it - technique_names.begin())] = true;
      pos = end + 1;
    }
    return t;
  }
};

struct parameter_counts {
  double routed_experts = 0, kda = 0, mla = 0, moe_non_expert = 0, embedding = 0, dense_ffn = 0, non_expert = 0, total = 0;
};

struct activation_counts {
  double kda_layer = 0, mla_layer = 0, moe_layer = 0, model = 0;  // values saved per token
};

// Bytes on one GPU, by row.
struct gpu_bytes {
  double weights = 0, grads = 0, optimizer = 0, activations = 0, comm = 0;
  double total() const noexcept { return weights + grads + optimizer + activations + comm; }
};

struct ledger {
  parameter_counts params;
  activation_counts activation_values_per_token;
  gpu_bytes naive, k3;                   // the busiest pipeline rank (rank 0)
  std::vector<gpu_bytes> naive_by_rank;  // every pipeline rank
  std::vector<gpu_bytes> k3_by_rank;
  toggles on;
};

inline parameter_counts parameters_of(model_config const& m) {
  auto const D = static_cast<double>(m.d);
  parameter_counts p;
  p.routed_experts = double(m.moe_layers) * double(m.experts) * 3.0 * double(m.latent) * double(m.expert_ffn);
  double const hk = double(m.kda_heads) * double(m.kda_head_dim);
  p.kda = double(m.kda_layers) * (5.0 * D * hk + D * double(m.kda_gate_rank) + double(m.kda_gate_rank) * hk + D * double(m.kda_heads));
  double const h = double(m.mla_heads);
  p.mla = double(m.mla_layers) * (D * double(m.mla_q_rank) + double(m.mla_q_rank) * h * double(m.mla_qk_dim) +
                                  D * double(m.mla_kv_rank + m.mla_rope_dim) + double(m.mla_kv_rank) * h * double(m.mla_kv_dim) +
                                  2.0 * D * h * double(m.mla_v_dim));
  p.moe_non_expert = double(m.moe_layers) * (2.0 * D * double(m.latent) + double(m.experts) * D +
                                             double(m.shared_experts) * 3.0 * D * double(m.shared_ffn));
  p.embedding = 2.0 * double(m.vocab) * D;
  p.dense_ffn = double(m.dense_layers) * 3.0 * D * double(m.dense_ffn);
  p.non_expert = p.kda + p.mla + p.moe_non_expert + p.embedding + p.dense_ffn;
  p.total = p.non_expert + p.routed_experts;
  return p;
}

// Micro-batches in flight on pipeline rank r, in units of one stage's activations: P − r under
// 1F1B; with V virtual stages, the interleaved schedule's warm-up ((V − 1)·P + 2(P − 1 − r))
// plus the one in progress, each a chunk of 1/V of the stage's layers.
inline double in_flight(parallel_config const& p, std::int64_t r) noexcept {
  if (p.vpp <= 1) return static_cast<double>(p.pp - r);
  return static_cast<double>((p.vpp - 1) * p.pp + 2 * (p.pp - 1 - r) + 1) / static_cast<double>(p.vpp);
}

inline void check_configs(model_config const& m, parallel_config const& p) {
  auto pos = [](char const* name, std::int64_t v) {
    ::k3::detail::require(v >= 1, error_kind::value, [&] { return std::string("argument '") + name + "': expected >= 1, got " + std::to_string(v); });
  };
  pos("pp", p.pp);
  pos("vpp", p.vpp);
  pos("ep", p.ep);
  pos("dp", p.dp);
  pos("tokens", p.tokens);
  pos("d", m.d);
  pos("experts", m.experts);
  pos("top_k", m.top_k);
  ::k3::detail::require(m.top_k <= m.experts, error_kind::value, "argument 'top_k': more experts per token than experts");
  ::k3::detail::require(m.moe_saved_values >= 2 * m.top_k * m.latent, error_kind::value, [&] {
    return "argument 'moe_saved_values': " + std::to_string(m.moe_saved_values) + " cannot hold the 2 x top_k x latent = " +
           std::to_string(2 * m.top_k * m.latent) + " dispatched copies and expert outputs it includes";
  });
  for (std::int64_t v : {m.kda_layers, m.mla_layers, m.moe_layers, m.dense_layers, m.kda_saved_values, m.mla_saved_values})
    ::k3::detail::require(v >= 0, error_kind::value, "model_config: layer and value counts must be >= 0");
}

// One pipeline rank's bytes under the given toggles.
inline gpu_bytes gpu_bytes_of(model_config const& m, parallel_config const& p, toggles const& t, std::int64_t rank) {
  parameter_counts const c = parameters_of(m);
  double const P = double(p.pp), R = double(p.ep), N = double(p.dp), S = double(p.tokens), V = double(p.vpp);
  double const non_expert_here = c.non_expert / P, experts_here = c.routed_experts / (P * R), params_here = non_expert_here + experts_here;
  gpu_bytes g;
  // BF16 weights; MoonEP's fixed buffers keep room for twice the expert weights.
  g.weights = 2.0 * non_expert_here + 2.0 * experts_here * (t[technique::moonep_buffers] ? 2.0 : 1.0);
  // FP32 gradients, unsharded; Pipeline ZeRO-2 with CPU shards keeps two VPP-chunk buffers.
  g.grads = t[technique::zero2_cpu_grads] ? 2.0 * 4.0 * params_here / V : 4.0 * params_here;
  // Muon: FP32 master weights and momentum, ZeRO-1 sharded over the N replicas.
  g.optimizer = 8.0 * params_here / N;
  // Activations: values per token of one stage's layers, times S, times what is in flight.
  double const moe_values = double(m.moe_saved_values) - (t[technique::moe_backward_rewrite] ? 2.0 * double(m.top_k * m.latent) : 0.0);
  double const bytes_per_value = t[technique::fp8_activations] ? 1.0 + 4.0 / 128.0 : 2.0;  // E4M3 + an FP32 scale per 1x128
  if (t[technique::offload]) {
    // Only the current and the prefetched layer stay: the largest attention + FFN layer, twice.
    double const attention = double(std::max(m.kda_layers > 0 ? m.kda_saved_values : 0, m.mla_layers > 0 ? m.mla_saved_values : 0));
    g.activations = 2.0 * (attention + (m.moe_layers > 0 ? moe_values : 0.0)) * S * bytes_per_value;
  } else {
    double const stage = (double(m.kda_layers) * double(m.kda_saved_values) + double(m.mla_layers) * double(m.mla_saved_values) +
                          double(m.moe_layers) * moe_values) / P;
    double flight = in_flight(p, rank);
    if (t[technique::pp_balance]) {
      double sum = 0;
      for (std::int64_t r = 0; r < p.pp; ++r) sum += in_flight(p, r);
      flight = sum / P;
    }
    g.activations = stage * S * bytes_per_value * flight;
  }
  // Communication: MoonEP's all-to-all buffers (S·top_k token slots of the latent width, BF16,
  // dispatch and combine) and, without P2P Muon, the full-parameter gather buffer (BF16 weights).
  g.comm = 2.0 * S * double(m.top_k) * double(m.latent) * 2.0 + (t[technique::p2p_muon] ? 0.0 : 2.0 * params_here);
  return g;
}

inline ledger ledger_of(model_config const& m = {}, parallel_config const& p = {}, toggles const& t = toggles::all()) {
  check_configs(m, p);
  ledger l;
  l.params = parameters_of(m);
  l.activation_values_per_token = {double(m.kda_saved_values), double(m.mla_saved_values), double(m.moe_saved_values),
                                   double(m.kda_layers) * double(m.kda_saved_values) + double(m.mla_layers) * double(m.mla_saved_values) +
                                       double(m.moe_layers) * double(m.moe_saved_values)};
  l.on = t;
  for (std::int64_t r = 0; r < p.pp; ++r) {
    l.naive_by_rank.push_back(gpu_bytes_of(m, p, toggles::none(), r));
    l.k3_by_rank.push_back(gpu_bytes_of(m, p, t, r));
  }
  l.naive = l.naive_by_rank.front();
  l.k3 = l.k3_by_rank.front();
  return l;
}

}  // namespace k3::train
