// Independent float64 (long double accumulation) reference for AttnRes mixing, written from
// the spec's formulas without sharing code with the library, plus test utilities.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace attnres_ref {

using vec = std::vector<double>;

// One token: sources V[j][k] (m x d).
struct token_result {
  vec r, c, alpha, h;
};

inline token_result forward(std::vector<vec> const& V, vec const& w, vec const& g, double eps) {
  std::size_t m = V.size(), d = w.size();
  token_result o;
  o.r.resize(m);
  o.c.resize(m);
  o.alpha.resize(m);
  o.h.assign(d, 0.0);
  std::vector<long double> s(m);
  for (std::size_t j = 0; j < m; ++j) {
    long double ss = 0, c = 0;
    for (std::size_t k = 0; k < d; ++k) {
      ss += (long double)V[j][k] * V[j][k];
      c += (long double)g[k] * w[k] * V[j][k];
    }
    long double r = 1.0L / std::sqrt(ss / d + eps);
    o.r[j] = double(r);
    o.c[j] = double(c);
    s[j] = r * c;
  }
  long double mx = *std::max_element(s.begin(), s.end()), z = 0;
  for (std::size_t j = 0; j < m; ++j) z += std::exp(s[j] - mx);
  for (std::size_t j = 0; j < m; ++j) o.alpha[j] = double(std::exp(s[j] - mx) / z);
  for (std::size_t k = 0; k < d; ++k) {
    long double acc = 0;
    for (std::size_t j = 0; j < m; ++j) acc += (long double)std::exp(s[j] - mx) / z * V[j][k];
    o.h[k] = double(acc);
  }
  return o;
}

// Gradients for one token; du accumulated by the caller (dw = du*g, dg = du*w).
inline void backward(std::vector<vec> const& V, vec const& w, vec const& g, double eps, vec const& dh, std::vector<vec>& dV,
                     std::vector<long double>& du) {
  token_result f = forward(V, w, g, eps);
  std::size_t m = V.size(), d = w.size();
  long double dhh = 0;
  std::vector<long double> a(m);
  for (std::size_t j = 0; j < m; ++j) {
    long double x = 0;
    for (std::size_t k = 0; k < d; ++k) x += (long double)dh[k] * V[j][k];
    a[j] = x;
    dhh += f.alpha[j] * x;
  }
  dV.assign(m, vec(d));
  for (std::size_t j = 0; j < m; ++j) {
    long double ds = f.alpha[j] * (a[j] - dhh), r = f.r[j];
    for (std::size_t k = 0; k < d; ++k) {
      long double u = (long double)g[k] * w[k];
      dV[j][k] = double(f.alpha[j] * dh[k] + ds * (r * u - f.c[j] * r * r * r * V[j][k] / d));
      du[k] += ds * r * V[j][k];
    }
  }
}

inline double rel_err(std::vector<double> const& x, std::vector<double> const& ref) {
  // A NaN where the other side has none is an infinite error (std::max would drop it).
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) && std::isnan(ref[i])) continue;
    double const e = std::abs(x[i] - ref[i]);
    if (!(e <= num)) num = std::isnan(e) ? INFINITY : e;
    den = std::max(den, std::abs(ref[i]));
  }
  return den == 0 ? num : num / den;
}

struct rng {
  std::mt19937_64 g;
  explicit rng(std::uint64_t seed) : g(seed) {}
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(g); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(g); }
  template <class T>
  std::vector<T> normals(std::size_t n, double scale = 1.0) {
    std::vector<T> v(n);
    for (auto& x : v) x = T(scale * normal());
    return v;
  }
};

}  // namespace attnres_ref
