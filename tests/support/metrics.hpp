// Error metrics shared by the tests. Every metric takes the value under test first and the
// reference second: rel_rms(got, ref). Non-finite values are never dropped: a NaN or Inf on
// either side makes the metric +inf (not NaN, which std::max and `e > tol` would silently pass).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace k3::test {

// fla's assert_close metric, the relative RMS error: ||got - ref||_2 / ||ref||_2 (equivalently
// rms(got - ref) / rms(ref)). Sizes that differ, or a NaN/Inf in either vector, give +inf; an
// all-zero reference gives 0 when got is all zero too, else +inf.
template <class G, class R>
double rel_rms(std::vector<G> const& got, std::vector<R> const& ref) {
  if (got.size() != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    double const g = static_cast<double>(got[i]), r = static_cast<double>(ref[i]);
    if (!std::isfinite(g) || !std::isfinite(r)) return INFINITY;
    num += (g - r) * (g - r);
    den += r * r;
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

// max |got - ref|; sizes that differ, or a NaN/Inf in either vector, give +inf.
inline double max_abs_diff(std::vector<double> const& got, std::vector<double> const& ref) {
  if (got.size() != ref.size()) return INFINITY;
  double m = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) return INFINITY;
    m = std::max(m, std::abs(got[i] - ref[i]));
  }
  return m;
}

// The max-norm relative error max|got - ref| / max|ref| (max|got - ref| for an all-zero
// reference); sizes that differ, or a NaN/Inf in either vector, give +inf.
template <class G, class R>
double rel_max(std::vector<G> const& got, std::vector<R> const& ref) {
  if (got.size() != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    double const g = static_cast<double>(got[i]), r = static_cast<double>(ref[i]);
    if (!std::isfinite(g) || !std::isfinite(r)) return INFINITY;
    num = std::max(num, std::abs(g - r));
    den = std::max(den, std::abs(r));
  }
  return den > 0 ? num / den : num;
}

// fla's assert_close: pass if the max abs diff is <= 1e-6, else if the relative RMS < ratio.
inline bool fla_close(std::vector<double> const& got, std::vector<double> const& ref, double ratio) {
  if (max_abs_diff(got, ref) <= 1e-6) return true;
  return rel_rms(got, ref) < ratio;
}

}  // namespace k3::test
