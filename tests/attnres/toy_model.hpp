// A toy stack for driver tests: sublayer l is y = tanh(RMSNorm0(x) W_l^T) on [T, d] rows, where
// RMSNorm0 is a parameter-free RMSNorm with eps = 0 (scale invariant, like every PreNorm).
#pragma once
#include <cmath>
#include <vector>

#include "attnres/reference.hpp"
#include "k3/attnres.hpp"

namespace toy {

using k3::index_t;

struct model {
  index_t L, d;
  std::vector<std::vector<double>> W;  // [L][d*d]
  model(index_t L_, index_t d_, std::uint64_t seed) : L(L_), d(d_) {
    attnres_ref::rng r(seed);
    for (index_t l = 0; l < L; ++l) W.push_back(r.normals<double>(std::size_t(d * d), 0.8 / std::sqrt(double(d))));
  }
  // y = f_l(x) for T rows (x, y in double)
  void forward(index_t l, std::vector<double> const& x, std::vector<double>& y, index_t T) const {
    y.assign(std::size_t(T * d), 0);
    for (index_t t = 0; t < T; ++t) {
      double ss = 0;
      for (index_t k = 0; k < d; ++k) ss += x[t * d + k] * x[t * d + k];
      double rr = 1 / std::sqrt(ss / double(d));
      for (index_t i = 0; i < d; ++i) {
        double a = 0;
        for (index_t k = 0; k < d; ++k) a += W[l][i * d + k] * x[t * d + k] * rr;
        y[t * d + i] = std::tanh(a);
      }
    }
  }
  // dx from dy (recomputes the forward)
  void backward(index_t l, std::vector<double> const& x, std::vector<double> const& dy, std::vector<double>& dx, index_t T) const {
    std::vector<double> y;
    forward(l, x, y, T);
    dx.assign(std::size_t(T * d), 0);
    for (index_t t = 0; t < T; ++t) {
      double ss = 0;
      for (index_t k = 0; k < d; ++k) ss += x[t * d + k] * x[t * d + k];
      double rr = 1 / std::sqrt(ss / double(d));
      std::vector<double> dn(std::size_t(d), 0);  // grad w.r.t. n = x * rr
      for (index_t i = 0; i < d; ++i) {
        double da = dy[t * d + i] * (1 - y[t * d + i] * y[t * d + i]);
        for (index_t k = 0; k < d; ++k) dn[k] += da * W[l][i * d + k];
      }
      // n = x * rr, rr = (mean x^2)^-1/2: dx = rr dn - rr^3 (dn . x) x / d
      double dot = 0;
      for (index_t k = 0; k < d; ++k) dot += dn[k] * x[t * d + k];
      for (index_t k = 0; k < d; ++k) dx[t * d + k] = rr * dn[k] - rr * rr * rr * dot * x[t * d + k] / double(d);
    }
  }
};

template <class S>
std::vector<S> to(std::vector<double> const& v) {
  std::vector<S> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = S(v[i]);
  return o;
}
template <class S>
std::vector<double> from(S const* p, std::size_t n) {
  std::vector<double> o(n);
  for (std::size_t i = 0; i < n; ++i) o[i] = double(p[i]);
  return o;
}

// Runs the toy stack through a driver; records every site's input (L + 1 of them, the last
// is the output mix).
template <class S, class B>
std::vector<std::vector<double>> run_forward(k3::attnres::block_attn_res<S, B>& ar, model const& m, std::vector<double> const& emb,
                                              index_t T) {
  std::vector<std::vector<double>> inputs;
  auto e = to<S>(emb);
  ar.begin(k3::host_view(e.data(), T, m.d));
  std::vector<S> x(std::size_t(T * m.d)), ys;
  std::vector<double> y;
  for (index_t l = 0; l <= m.L; ++l) {
    if (l == m.L) ar.output(k3::host_view(x.data(), T, m.d));
    else ar.input(k3::host_view(x.data(), T, m.d));
    inputs.push_back(from(x.data(), x.size()));
    if (l == m.L) break;
    m.forward(l, inputs.back(), y, T);
    ys = to<S>(y);
    ar.add(k3::host_view(ys.data(), T, m.d));
  }
  return inputs;
}

}  // namespace toy
