// Shared helpers for the MoE tests: deterministic random scores, owning route buffers.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "k3/moe.hpp"

namespace moe_test {

using k3::index_t;

// sigmoid(N(0, 1) + pref_j) with pref a linear ramp -skew/2..skew/2 over the experts:
// strongly unbalanced under plain top-k.
inline std::vector<float> skewed_scores(index_t m, index_t n, double skew, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<float> s(static_cast<std::size_t>(m * n));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) {
      double pref = n > 1 ? skew * (double(j) / double(n - 1) - 0.5) : 0.0;
      s[i * n + j] = static_cast<float>(1.0 / (1.0 + std::exp(-(nd(g) + pref))));
    }
  return s;
}

inline std::vector<float> uniform(index_t count, double lo, double hi, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<float> v(static_cast<std::size_t>(count));
  for (auto& x : v) x = static_cast<float>(u(g));
  return v;
}

struct routed {
  index_t m, k, n;
  std::vector<std::int32_t> idx;
  std::vector<float> w, cut;
  std::vector<std::int64_t> load;
  routed(index_t m_, index_t k_, index_t n_)
      : m(m_), k(k_), n(n_), idx(static_cast<std::size_t>(m * k)), w(static_cast<std::size_t>(m * k)), cut(static_cast<std::size_t>(m)),
        load(static_cast<std::size_t>(n)) {}
  // The routing call's args with these buffers as every output.
  k3::moe::route_args<float> args(k3::const_view<float, 2> scores, k3::const_view<float, 1> bias = {},
                                  k3::const_view<std::uint8_t, 1> mask = {}, k3::moe::qb_histogram* histogram = nullptr) {
    return {.scores = scores,
            .bias = bias,
            .mask = mask,
            .indices = k3::host_view(idx.data(), m, k),
            .weights = k3::host_view(w.data(), m, k),
            .cutoff = k3::host_view(cut.data(), m),
            .load = k3::host_view(load.data(), n),
            .histogram = histogram};
  }
};

// EPLB's plan for `load` on the serial backend.
inline k3::moe::eplb_plan eplb_plan_of(k3::const_view<double, 2> load, k3::moe::eplb_options const& opt) {
  k3::moe::eplb_plan plan;
  k3::moe::eplb(k3::cpu::serial{}, k3::moe::eplb_args<double>{.load = load, .placement = &plan}, opt);
  return plan;
}

inline k3::const_view<float, 2> cview(std::vector<float> const& v, index_t m, index_t n) { return {v.data(), {m, n}}; }
inline k3::const_view<float, 1> cview(std::vector<float> const& v) { return {v.data(), {static_cast<index_t>(v.size())}}; }
inline k3::tensor_view<float, 1> mview(std::vector<float>& v) { return {v.data(), {static_cast<index_t>(v.size())}}; }

// max |load_j - q| / q over experts, q = m k / n
inline double max_violation(std::vector<std::int64_t> const& load, index_t m, index_t k) {
  double q = double(m) * double(k) / double(load.size()), v = 0;
  for (auto l : load) v = std::max(v, std::fabs(double(l) - q) / q);
  return v;
}

}  // namespace moe_test
