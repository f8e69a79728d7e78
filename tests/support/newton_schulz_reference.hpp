// The float64 reference for Muon's NS5 (spec moe_routing.md C.3): the formula written out in
// plain loops, independent of Eigen and of every k3 backend.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

namespace k3::test {

// NS5 of g [rows, cols] (row-major) in float64, eps 1e-7, coefficients (3.4445, -4.7750, 2.0315).
inline std::vector<double> ns5_direct(std::vector<double> const& g, std::int64_t rows, std::int64_t cols, int steps) {
  bool const tr = rows > cols;
  std::int64_t const m = tr ? cols : rows, n = tr ? rows : cols;
  std::vector<double> x(static_cast<std::size_t>(m * n));
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) x[tr ? j * n + i : i * n + j] = g[i * cols + j];
  double sq = 0;
  for (double v : x) sq += v * v;
  double const d = std::sqrt(sq) + 1e-7;
  for (double& v : x) v /= d;
  std::vector<double> a(static_cast<std::size_t>(m * m)), b(a.size()), y(x.size());
  for (int s = 0; s < steps; ++s) {
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < m; ++j) {
        double acc = 0;
        for (std::int64_t k = 0; k < n; ++k) acc += x[i * n + k] * x[j * n + k];
        a[i * m + j] = acc;
      }
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < m; ++j) {
        double acc = 0;
        for (std::int64_t k = 0; k < m; ++k) acc += a[i * m + k] * a[k * m + j];
        b[i * m + j] = -4.7750 * a[i * m + j] + 2.0315 * acc;
      }
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (std::int64_t k = 0; k < m; ++k) acc += b[i * m + k] * x[k * n + j];
        y[i * n + j] = 3.4445 * x[i * n + j] + acc;
      }
    x.swap(y);
  }
  std::vector<double> o(g.size());
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) o[i * cols + j] = x[tr ? j * n + i : i * n + j];
  return o;
}

}  // namespace k3::test
