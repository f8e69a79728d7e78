// Shared helpers for the KDA tests: fla's relative-RMS metric and a random problem generator.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace k3::test {

// fla's assert_close metric: rms(ref - x) / rms(ref). Non-finite values give +inf.
inline double rel_rms(std::vector<double> const& ref, std::vector<double> const& x) {
  if (ref.size() != x.size()) return INFINITY;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(ref[i]) || !std::isfinite(x[i])) return INFINITY;
    num += (ref[i] - x[i]) * (ref[i] - x[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

inline double max_abs_diff(std::vector<double> const& a, std::vector<double> const& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// fla's assert_close: pass if the max abs diff is <= 1e-6, else rel RMS < ratio.
inline bool fla_close(std::vector<double> const& ref, std::vector<double> const& x, double ratio) {
  if (ref.size() == x.size() && max_abs_diff(ref, x) <= 1e-6) return true;
  return rel_rms(ref, x) < ratio;
}

}  // namespace k3::test
