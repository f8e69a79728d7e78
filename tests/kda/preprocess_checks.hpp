// Shared helpers for the KDA pre-processing tests: seeded normal samples, conversions between
// float64 references and a storage type, a mixed abs/rel closeness check that reports the worst
// element, and central finite differences against an analytic gradient.
#pragma once
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "k3/core/numeric/bfloat16.hpp"

namespace k3::test {

inline std::vector<double> randn(std::size_t n, std::uint64_t seed, double scale = 1.0, double shift = 0.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<double> v(n);
  for (auto& x : v) x = shift + scale * d(rng);
  return v;
}

template <class S>
std::vector<S> cast(std::vector<double> const& v) {
  std::vector<S> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = k3::store_as<S>(v[i]);
  return out;
}

template <class S>
std::vector<double> widen(std::vector<S> const& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = k3::load_as<double>(v[i]);
  return out;
}

// max_i |got_i - ref_i| / (atol + rtol |ref_i|) <= 1
inline void check_close(std::vector<double> const& got, std::vector<double> const& ref, double rtol, double atol,
                        char const* what) {
  REQUIRE(got.size() == ref.size());
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    double const e = std::fabs(got[i] - ref[i]) / (atol + rtol * std::fabs(ref[i]));
    if (!(e <= worst)) {  // NaN counts as the worst
      worst = e;
      at = i;
    }
  }
  INFO(what << ": worst at " << at << " got " << (got.empty() ? 0.0 : got[at]) << " ref "
            << (ref.empty() ? 0.0 : ref[at]));
  CHECK(worst <= 1.0);
}

// Central differences of loss() with respect to every entry of p, against grad.
template <class Loss>
void check_fd(std::vector<double>& p, std::vector<double> const& grad, Loss&& loss, char const* what,
              double h = 1e-6, double tol = 2e-7) {
  REQUIRE(p.size() == grad.size());
  double worst = 0;
  std::size_t at = 0;
  double fd_at = 0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    double const keep = p[i];
    p[i] = keep + h;
    double const lp = loss();
    p[i] = keep - h;
    double const lm = loss();
    p[i] = keep;
    double const fd = (lp - lm) / (2 * h);
    double const e = std::fabs(fd - grad[i]) / (1.0 + std::fabs(grad[i]));
    if (!(e <= worst)) {
      worst = e;
      at = i;
      fd_at = fd;
    }
  }
  INFO(what << ": worst at " << at << " fd " << fd_at << " analytic " << (grad.empty() ? 0.0 : grad[at]));
  CHECK(worst <= tol);
}

}  // namespace k3::test
