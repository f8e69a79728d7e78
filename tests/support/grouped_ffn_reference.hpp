// The routed experts of a MoE layer written out in float64, slot by slot (no grouping, no
// GEMM), for the grouped_ffn tests of every backend; random problems with the awkward cases
// (experts no slot reaches, slots with id -1, slots with weight 0); conversions to storage
// types and the per-tensor comparison the tests share.
#pragma once
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "k3/core/numeric/bfloat16.hpp"

namespace k3::test {

struct grouped_ffn_problem {
  std::int64_t T = 0, k = 0, n = 0, l = 0, f = 0;
  double beta_gate = 4.0, beta_up = 25.0;
  std::vector<double> z, p, w_gate, w_up, w_down, du;  // [T,l] [T,k] [n,f,l] [n,f,l] [n,l,f] [T,l]
  std::vector<std::int64_t> idx;                        // [T,k]
};

struct grouped_ffn_result {
  std::vector<double> u, h_gate, h_up;                      // forward
  std::vector<double> dz, dp, dw_gate, dw_up, dw_down;      // backward of <du, u>
};

// Each token picks k distinct experts among the first `used` (so experts >= used get no slot);
// every `hole`-th slot gets id -1 and every `zero`-th weight is 0 (0: none).
inline grouped_ffn_problem random_grouped_ffn(std::int64_t T, std::int64_t k, std::int64_t n, std::int64_t l, std::int64_t f, unsigned seed,
                                              std::int64_t used = -1, std::int64_t hole = 0, std::int64_t zero = 0) {
  grouped_ffn_problem q;
  q.T = T;
  q.k = k;
  q.n = n;
  q.l = l;
  q.f = f;
  if (used < 0) used = n;
  std::mt19937_64 r(seed);
  std::normal_distribution<double> nd;
  auto fill = [&](std::vector<double>& v, std::size_t size, double scale) {
    v.resize(size);
    for (auto& x : v) x = scale * nd(r);
  };
  fill(q.z, static_cast<std::size_t>(T * l), 1.0);
  fill(q.du, static_cast<std::size_t>(T * l), 1.0);
  // Scales that put the gate's and the up projection's pre-activations across both soft-caps.
  fill(q.w_gate, static_cast<std::size_t>(n * f * l), 3.0 / std::sqrt(static_cast<double>(l ? l : 1)));
  fill(q.w_up, static_cast<std::size_t>(n * f * l), 2.0 / std::sqrt(static_cast<double>(l ? l : 1)));
  fill(q.w_down, static_cast<std::size_t>(n * l * f), 1.0 / std::sqrt(static_cast<double>(f ? f : 1)));
  q.idx.resize(static_cast<std::size_t>(T * k));
  q.p.resize(q.idx.size());
  std::uniform_real_distribution<double> ud(0.05, 1.0);
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<std::int64_t> ids(static_cast<std::size_t>(used));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), r);
    for (std::int64_t j = 0; j < k; ++j) {
      std::size_t const s = static_cast<std::size_t>(t * k + j);
      q.idx[s] = ids[static_cast<std::size_t>(j % used)];
      q.p[s] = ud(r);
      if (hole && static_cast<std::int64_t>(s) % hole == hole - 1) q.idx[s] = -1;
      if (zero && static_cast<std::int64_t>(s) % zero == 0) q.p[s] = 0.0;
    }
  }
  return q;
}

inline double ref_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

inline grouped_ffn_result grouped_ffn_reference(grouped_ffn_problem const& q) {
  auto const T = q.T, k = q.k, l = q.l, f = q.f;
  double const bg = q.beta_gate, bu = q.beta_up;
  grouped_ffn_result r;
  r.u.assign(static_cast<std::size_t>(T * l), 0.0);
  r.h_gate.assign(static_cast<std::size_t>(T * k * f), 0.0);
  r.h_up = r.h_gate;
  r.dz.assign(r.u.size(), 0.0);
  r.dp.assign(static_cast<std::size_t>(T * k), 0.0);
  r.dw_gate.assign(q.w_gate.size(), 0.0);
  r.dw_up.assign(q.w_up.size(), 0.0);
  r.dw_down.assign(q.w_down.size(), 0.0);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      std::int64_t const e = q.idx[static_cast<std::size_t>(t * k + j)];
      if (e < 0) continue;
      double const p = q.p[static_cast<std::size_t>(t * k + j)];
      std::vector<double> a(static_cast<std::size_t>(f)), dag(static_cast<std::size_t>(f)), dau(static_cast<std::size_t>(f));
      for (std::int64_t c = 0; c < f; ++c) {
        double g = 0, u = 0;
        for (std::int64_t i = 0; i < l; ++i) {
          g += q.z[static_cast<std::size_t>(t * l + i)] * q.w_gate[static_cast<std::size_t>((e * f + c) * l + i)];
          u += q.z[static_cast<std::size_t>(t * l + i)] * q.w_up[static_cast<std::size_t>((e * f + c) * l + i)];
        }
        r.h_gate[static_cast<std::size_t>((t * k + j) * f + c)] = g;
        r.h_up[static_cast<std::size_t>((t * k + j) * f + c)] = u;
        double const tg = std::tanh(g / bg), tu = std::tanh(u / bu), sg = ref_sigmoid(g);
        a[static_cast<std::size_t>(c)] = bg * tg * sg * bu * tu;
        dag[static_cast<std::size_t>(c)] = bu * tu * ((1 - tg * tg) * sg + bg * tg * sg * (1 - sg));
        dau[static_cast<std::size_t>(c)] = bg * tg * sg * (1 - tu * tu);
      }
      // u_t += p · a w_downᵀ; the loss <du, u> gives dp = <du_t, a w_downᵀ>.
      double dp = 0;
      std::vector<double> da(static_cast<std::size_t>(f), 0.0);
      for (std::int64_t i = 0; i < l; ++i) {
        double y = 0;
        for (std::int64_t c = 0; c < f; ++c) y += a[static_cast<std::size_t>(c)] * q.w_down[static_cast<std::size_t>((e * l + i) * f + c)];
        double const dui = q.du[static_cast<std::size_t>(t * l + i)];
        r.u[static_cast<std::size_t>(t * l + i)] += p * y;
        dp += dui * y;
        for (std::int64_t c = 0; c < f; ++c) {
          da[static_cast<std::size_t>(c)] += p * dui * q.w_down[static_cast<std::size_t>((e * l + i) * f + c)];
          r.dw_down[static_cast<std::size_t>((e * l + i) * f + c)] += p * dui * a[static_cast<std::size_t>(c)];
        }
      }
      r.dp[static_cast<std::size_t>(t * k + j)] = dp;
      for (std::int64_t c = 0; c < f; ++c) {
        double const dg = da[static_cast<std::size_t>(c)] * dag[static_cast<std::size_t>(c)];
        double const dup = da[static_cast<std::size_t>(c)] * dau[static_cast<std::size_t>(c)];
        for (std::int64_t i = 0; i < l; ++i) {
          std::size_t const w = static_cast<std::size_t>((e * f + c) * l + i);
          r.dz[static_cast<std::size_t>(t * l + i)] += dg * q.w_gate[w] + dup * q.w_up[w];
          r.dw_gate[w] += dg * q.z[static_cast<std::size_t>(t * l + i)];
          r.dw_up[w] += dup * q.z[static_cast<std::size_t>(t * l + i)];
        }
      }
    }
  return r;
}

// The loss the reference's backward differentiates: <du, u(q)>.
inline double grouped_ffn_loss(grouped_ffn_problem const& q) {
  auto const r = grouped_ffn_reference(q);
  double s = 0;
  for (std::size_t i = 0; i < r.u.size(); ++i) s += q.du[i] * r.u[i];
  return s;
}

template <class T>
std::vector<T> stored(std::vector<double> const& v) {
  std::vector<T> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = k3::store_as<T>(v[i]);
  return o;
}
template <class T>
std::vector<double> widened(std::vector<T> const& v) {
  std::vector<double> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = k3::load_as<double>(v[i]);
  return o;
}

// The problem as T holds it (the reference then runs on exactly those values).
template <class T>
grouped_ffn_problem rounded(grouped_ffn_problem q) {
  for (std::vector<double>* v : {&q.z, &q.p, &q.w_gate, &q.w_up, &q.w_down, &q.du}) *v = widened(stored<T>(*v));
  return q;
}

// Every tensor of got against ref by `metric`, under its tolerance (forward, backward).
template <class M>
void check_against(grouped_ffn_result const& got, grouped_ffn_result const& ref, M metric, double tol_fwd, double tol_bwd) {
  CHECK_LE(metric(got.u, ref.u), tol_fwd);
  CHECK_LE(metric(got.h_gate, ref.h_gate), tol_fwd);
  CHECK_LE(metric(got.h_up, ref.h_up), tol_fwd);
  CHECK_LE(metric(got.dz, ref.dz), tol_bwd);
  CHECK_LE(metric(got.dp, ref.dp), tol_bwd);
  CHECK_LE(metric(got.dw_gate, ref.dw_gate), tol_bwd);
  CHECK_LE(metric(got.dw_up, ref.dw_up), tol_bwd);
  CHECK_LE(metric(got.dw_down, ref.dw_down), tol_bwd);
}

// With z[bad] holding a NaN: u and dz are NaN in token `bad` only, and the weight gradients of
// exactly the experts `bad` was routed to.
inline void check_nan_confined(grouped_ffn_problem const& q, std::int64_t bad, grouped_ffn_result const& r) {
  for (std::int64_t t = 0; t < q.T; ++t)
    for (std::int64_t i = 0; i < q.l; ++i) {
      CHECK(std::isnan(r.u[static_cast<std::size_t>(t * q.l + i)]) == (t == bad));
      CHECK(std::isnan(r.dz[static_cast<std::size_t>(t * q.l + i)]) == (t == bad));
    }
  for (std::int64_t e = 0; e < q.n; ++e) {
    bool reached = false;
    for (std::int64_t j = 0; j < q.k; ++j) reached |= q.idx[static_cast<std::size_t>(bad * q.k + j)] == e;
    CHECK(std::isnan(r.dw_gate[static_cast<std::size_t>(e * q.f * q.l)]) == reached);
    CHECK(std::isnan(r.dw_down[static_cast<std::size_t>(e * q.l * q.f)]) == reached);
  }
}
}  // namespace k3::test
