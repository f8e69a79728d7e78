// k3/moe/router.hpp — the MoE router of DeepSeek-V3 / Kimi K3 (sigmoid scores, additive
// selection bias, weights from the unbiased scores), reference implementation.
//
//   z_ij   = s_ij + b_j                     (selection only; FP32)
//   T_i    = argtop_k(z_i)                  (optionally group-limited, DeepSeek-V3)
//   p_ij   = scale * s_ij / sum_{r in T_i} s_ir     (0 when that sum is 0)
//   alpha_i = the (k+1)-th largest z_ij     (the Quantile-Balancing cut-off; never dispatched)
//
// Tie-breaking (deterministic, identical on every backend): experts are ranked by biased
// score descending and, on equal biased score, by expert index ascending. The same order is
// used for the output columns, so indices(i, 0) is the best expert of token i. Masked groups
// carry -inf and rank after every unmasked expert.
//
// Padding tokens (mask[i] == 0) get indices -1 and weights 0 (never dispatched), cut-off 0,
// and are excluded from the load counts and from every Quantile-Balancing statistic.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "k3/core/error.hpp"
#include "k3/core/math.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"

namespace k3::moe {

// What the [m, n] input holds: router probabilities in (0, 1) or the raw logits (the router
// applies a FP32 sigmoid). Histogram Quantile Balancing needs sigmoid scores; a bias learned
// on logits is not valid on scores, so never mix the two.
enum class score_kind { scores, logits };

struct router_options {
  index_t k = 16;              // experts per token (K3: 16 of 896)
  float routed_scale = 1.0f;   // K3 1.0, DeepSeek-V3 2.5, Kimi K2 2.827
  score_kind input = score_kind::scores;
  index_t n_groups = 1;        // DeepSeek-V3 group-limited routing: 8 groups ...
  index_t topk_groups = 1;     // ... of which 4 are kept. 1/1 = off (K3)
};

class qb_histogram;  // k3/moe/quantile_balancing.hpp

// What k3::moe::route reads and writes. scores (float) and bias are required inputs, mask
// optional ([m], nonzero = real token); indices and weights are required outputs, cutoff and
// load are filled when present. A present histogram (training only) gets the margins
// alpha_i - s_ij of the real tokens ADDED; build it with qb_histogram::for_bias(bias) so its
// bounds come from the bias used here. The views live in `Space`: host_space for the CPU
// backends (k3/moe.hpp takes only these), cuda_device_space for k3::cuda::stream_backend
// (k3/moe/cuda/route_backend.cuh); the histogram stays on the host either way.
template <class T, class Space = host_space>
struct route_args {
  const_view<T, 2, Space> scores;                 // [m, n]
  const_view<float, 1, Space> bias = {};          // [n]; absent only through quantile_balancer::route
  const_view<std::uint8_t, 1, Space> mask = {};   // [m]
  tensor_view<std::int32_t, 2, Space> indices;    // [m, k]
  tensor_view<float, 2, Space> weights;           // [m, k]
  tensor_view<float, 1, Space> cutoff = {};       // [m]  alpha_i, the (k+1)-th biased score
  tensor_view<std::int64_t, 1, Space> load = {};  // [n]  tokens per expert (padding excluded)
  qb_histogram* histogram = nullptr;
};

// The options' checks against n experts, as route() makes them. A caller that sizes buffers
// from opt.k (the outputs [m, k]) can make them first. Each message names the option and
// gives the allowed range and the value.
inline void check_router_options(router_options const& opt, index_t n) {
  using ::k3::detail::require;
  require(opt.k >= 1 && opt.k < n, error_kind::value, [&] {
    return "option 'k': must be in [1, n - 1] = [1, " + std::to_string(n - 1) + "] for n = " + std::to_string(n) +
           " experts (the cut-off is the (k+1)-th expert), got " + std::to_string(opt.k);
  });
  require(std::isfinite(opt.routed_scale), error_kind::value,
          [&] { return "option 'routed_scale': must be finite, got " + ::k3::detail::format_number(opt.routed_scale); });
  require(opt.n_groups >= 1 && n % opt.n_groups == 0, error_kind::value, [&] {
    return "option 'n_groups': must divide n = " + std::to_string(n) + ", got " + std::to_string(opt.n_groups);
  });
  require(opt.topk_groups >= 1 && opt.topk_groups <= opt.n_groups, error_kind::value, [&] {
    return "option 'topk_groups': must be in [1, option 'n_groups'] = [1, " + std::to_string(opt.n_groups) + "], got " +
           std::to_string(opt.topk_groups);
  });
  index_t const kept = opt.topk_groups * (n / opt.n_groups);
  require(opt.n_groups == 1 || opt.k <= kept, error_kind::value, [&] {
    return "option 'k': must be at most " + std::to_string(kept) + ", the experts group-limited routing keeps (option 'topk_groups' = " +
           std::to_string(opt.topk_groups) + " of option 'n_groups' = " + std::to_string(opt.n_groups) + " groups of " +
           std::to_string(n / opt.n_groups) + "), got " + std::to_string(opt.k);
  });
}

namespace detail {

// The outputs as the routing kernels take them (cutoff and load filled when non-empty).
struct route_outputs {
  tensor_view<std::int32_t, 2> indices;  // [m, k]
  tensor_view<float, 2> weights;         // [m, k]
  tensor_view<float, 1> cutoff{};        // [m]
  tensor_view<std::int64_t, 1> load{};   // [n]
};

// k3::moe::detail shadows k3::detail; re-export the shared validators.
using ::k3::detail::any_extent;
using ::k3::detail::check_inner_contiguous;
using ::k3::detail::check_no_overlap;
using ::k3::detail::check_shape;
using ::k3::detail::check_view;
using ::k3::detail::require;
using ::k3::detail::shape_of;

// Ranking order of (biased score, expert): higher score first, then lower index.
struct ranked {
  float z;
  std::int32_t j;
};
inline bool ranks_before(float za, std::int32_t ja, float zb, std::int32_t jb) noexcept {
  return za > zb || (za == zb && ja < jb);
}

inline float load_score(float x, score_kind kind) noexcept {
  return kind == score_kind::logits ? ::k3::detail::sigmoid(x) : x;
}

// The argument checks of route() on every backend: views of either space, `out` anything with
// indices, weights, cutoff and load (route_outputs, route_args). bias_values(n) checks the bias
// values where the caller can read them (the host; the CUDA backend reads them from the device
// after these checks).
template <class Scores, class Bias, class Outputs, class Mask, class BiasValues>
void validate_route_args(Scores const& scores, Bias const& bias, Outputs const& out, router_options const& opt, Mask const& mask,
                         BiasValues&& bias_values) {
  using ::k3::detail::check_shape;
  using ::k3::detail::require;
  ::k3::detail::check_view("scores", scores);
  index_t const m = scores.extent(0), n = scores.extent(1);
  require(m > 0, error_kind::shape, [&] { return "argument 'scores': zero tokens (shape " + ::k3::detail::shape_of(scores) + "); need m >= 1"; });
  require(n >= 2, error_kind::shape, [&] { return "argument 'scores': need at least 2 experts, got shape " + ::k3::detail::shape_of(scores); });
  ::k3::detail::check_inner_contiguous("scores", scores);
  check_router_options(opt, n);
  ::k3::detail::check_view("bias", bias);
  require(bias.extent(0) == n, error_kind::shape, [&] {
    return "argument 'bias': expected shape [" + std::to_string(n) + "] (one entry per expert), got " + ::k3::detail::shape_of(bias);
  });
  bias_values(n);
  ::k3::detail::check_view("indices", out.indices);
  check_shape("indices", out.indices, {m, opt.k});
  ::k3::detail::check_view("weights", out.weights);
  check_shape("weights", out.weights, {m, opt.k});
  if (!out.cutoff.empty()) {
    ::k3::detail::check_view("cutoff", out.cutoff);
    check_shape("cutoff", out.cutoff, {m});
  }
  if (!out.load.empty()) {
    ::k3::detail::check_view("load", out.load);
    check_shape("load", out.load, {n});
  }
  if (!mask.empty()) {
    ::k3::detail::check_view("mask", mask);
    check_shape("mask", mask, {m});
  }
  // No output broadcast (stride 0: one address for several tokens or experts, racing between
  // threads), over another, or over an input it would be read back as (scores, bias, mask).
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("indices", out.indices, "weights", out.weights,
                                                              "cutoff", out.cutoff, "load", out.load),
                                    ::k3::detail::named_views("scores", scores, "bias", bias, "mask", mask));
}

inline void validate_route(const_view<float, 2> scores, const_view<float, 1> bias, route_outputs const& out,
                           router_options const& opt, const_view<std::uint8_t, 1> mask) {
  validate_route_args(scores, bias, out, opt, mask, [&](index_t n) {
    for (index_t j = 0; j < n; ++j)
      ::k3::detail::require(std::isfinite(bias(j)), error_kind::value,
                            [&] { return "argument 'bias': non-finite value at expert " + std::to_string(j); });
  });
}

inline std::string qb_groups_message(index_t n_groups) {
  return "argument 'n_groups': quantile balancing does not cover group-limited routing (n_groups must be 1), got " +
         std::to_string(n_groups);
}

inline std::string nonfinite_message(index_t i, index_t j, score_kind kind) {
  return std::string("argument '") + (kind == score_kind::logits ? "logits" : "scores") + "': non-finite value at token " +
         std::to_string(i) + ", expert " + std::to_string(j);
}

// The reference per-token routine: fills z (n), returns the k+1 best in ranking order in
// `best` (k+1 entries). Used by the serial backend and as the fallback of faster ones.
inline void rank_token(float const* s, const_view<float, 1> bias, router_options const& opt, index_t n,
                       std::vector<ranked>& z, std::vector<ranked>& best) {
  z.resize(static_cast<std::size_t>(n));
  for (index_t j = 0; j < n; ++j) z[j] = {s[j] + bias(j), static_cast<std::int32_t>(j)};
  if (opt.n_groups > 1) {
    // DeepSeek-V3: a group's score is the sum of its two best biased scores; the experts of
    // every group outside the top `topk_groups` get -inf (a multiplicative 0 mask would leave
    // them competing with negative biased scores).
    index_t const gs = n / opt.n_groups;
    std::vector<ranked> gscore(static_cast<std::size_t>(opt.n_groups));
    for (index_t g = 0; g < opt.n_groups; ++g) {
      float a = -std::numeric_limits<float>::infinity(), b = a;
      for (index_t j = g * gs; j < (g + 1) * gs; ++j) {
        float v = z[j].z;
        if (v > a) {
          b = a;
          a = v;
        } else if (v > b) {
          b = v;
        }
      }
      gscore[g] = {gs >= 2 ? a + b : a, static_cast<std::int32_t>(g)};
    }
    auto cmp = [](ranked const& x, ranked const& y) { return ranks_before(x.z, x.j, y.z, y.j); };
    std::partial_sort(gscore.begin(), gscore.begin() + opt.topk_groups, gscore.end(), cmp);
    std::vector<char> keep(static_cast<std::size_t>(opt.n_groups), 0);
    for (index_t g = 0; g < opt.topk_groups; ++g) keep[gscore[g].j] = 1;
    for (index_t j = 0; j < n; ++j)
      if (!keep[j / gs]) z[j].z = -std::numeric_limits<float>::infinity();
  }
  auto cmp = [](ranked const& x, ranked const& y) { return ranks_before(x.z, x.j, y.z, y.j); };
  std::partial_sort(z.begin(), z.begin() + opt.k + 1, z.end(), cmp);
  best.assign(z.begin(), z.begin() + opt.k + 1);
}

// Writes indices / weights / cut-off of token i from its ranked k+1 best.
inline void emit_token(index_t i, float const* s, ranked const* best, router_options const& opt, route_outputs const& out) {
  float sum = 0.f;
  for (index_t r = 0; r < opt.k; ++r) sum += s[best[r].j];
  // Renormalised exactly (scale-invariant: tiny scores, e.g. sigmoid of logits below -30, still
  // give weights summing to the routed scale). Megatron's "+ 1e-20" guard shrank every weight
  // whenever the chosen scores summed below ~1e-13; only an all-zero choice needs a guard
  // (its weights are 0, as with Megatron's).
  float const denom = sum > 0.f ? sum : 1.f;
  for (index_t r = 0; r < opt.k; ++r) {
    out.indices(i, r) = best[r].j;
    out.weights(i, r) = s[best[r].j] / denom * opt.routed_scale;
  }
  if (!out.cutoff.empty()) out.cutoff(i) = best[opt.k].z;
}

inline void emit_padding(index_t i, router_options const& opt, route_outputs const& out) {
  for (index_t r = 0; r < opt.k; ++r) {
    out.indices(i, r) = -1;
    out.weights(i, r) = 0.f;
  }
  if (!out.cutoff.empty()) out.cutoff(i) = 0.f;
}

// The serial reference router over tokens [0, m) (k3::moe::route on cpu::serial). `mask`
// (optional, [m], nonzero = real token) marks padding.
inline void route_serial(const_view<float, 2> scores, const_view<float, 1> bias, route_outputs const& out,
                         router_options const& opt, const_view<std::uint8_t, 1> mask = {}) {
  detail::validate_route(scores, bias, out, opt, mask);
  index_t const m = scores.extent(0), n = scores.extent(1);
  std::vector<float> s(static_cast<std::size_t>(n));
  std::vector<detail::ranked> z, best;
  if (!out.load.empty())
    for (index_t j = 0; j < n; ++j) out.load(j) = 0;
  for (index_t i = 0; i < m; ++i) {
    for (index_t j = 0; j < n; ++j) {
      float x = scores(i, j);
      if (!std::isfinite(x)) throw k3::error(error_kind::value, detail::nonfinite_message(i, j, opt.input));
      s[j] = detail::load_score(x, opt.input);
    }
    if (!mask.empty() && mask(i) == 0) {
      detail::emit_padding(i, opt, out);
      continue;
    }
    detail::rank_token(s.data(), bias, opt, n, z, best);
    detail::emit_token(i, s.data(), best.data(), opt, out);
    if (!out.load.empty())
      for (index_t r = 0; r < opt.k; ++r) ++out.load(best[r].j);
  }
}

}  // namespace detail

}  // namespace k3::moe
