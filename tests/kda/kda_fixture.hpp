// Random KDA problems for the tests: generated in double, stored in any storage type, run
// through any backend and algorithm, results returned in double.
#pragma once
#include <array>
#include <cmath>
#include <limits>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "k3/kda.hpp"
#include "support/metrics.hpp"

namespace k3::test {

// resets: 3% of the (token, head, channel) log decays are hard resets; token_resets: a
// fraction reset_fraction of the (token, value head) rows reset on every channel (a document
// boundary inside packed data).
enum class gate_kind { logsigmoid, resets, lower_bound, token_resets };

struct kda_case {
  index_t B = 1, T = 16, H = 1, HV = 1, K = 16, V = 16;
  std::vector<std::int64_t> cu;  // empty: not packed (else B must be 1)
  bool h0 = true, dht = true;
  gate_kind gate = gate_kind::logsigmoid;
  double lb = -5;
  double reset = -1000;  // the log decay of a hard reset (gate_kind::resets): -1000, -1e8, -inf
  double reset_fraction = 0.1;  // gate_kind::token_resets
  std::uint64_t seed = 1;
  index_t N() const { return cu.empty() ? B : index_t(cu.size()) - 1; }
};

struct kda_data64 {
  kda_case c;
  std::vector<double> q, k, v, g, beta, h0, d_o, dht;
};

inline kda_data64 make_data(kda_case const& c) {
  kda_data64 d;
  d.c = c;
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  auto normed = [&](std::vector<double>& x, index_t rows, index_t dim) {
    x.resize(std::size_t(rows * dim));
    for (index_t r = 0; r < rows; ++r) {
      double s = 0;
      for (index_t i = 0; i < dim; ++i) s += (x[std::size_t(r * dim + i)] = nd(rng)) * x[std::size_t(r * dim + i)];
      s = std::sqrt(s + 1e-6);
      for (index_t i = 0; i < dim; ++i) x[std::size_t(r * dim + i)] /= s;
    }
  };
  index_t const BT = c.B * c.T;
  normed(d.q, BT * c.H, c.K);
  normed(d.k, BT * c.H, c.K);
  d.v.resize(std::size_t(BT * c.HV * c.V));
  for (auto& x : d.v) x = nd(rng);
  d.g.resize(std::size_t(BT * c.HV * c.K));
  bool row_reset = false;
  for (std::size_t i = 0; i < d.g.size(); ++i) {
    double& x = d.g[i];
    if (c.gate == gate_kind::token_resets && i % std::size_t(c.K) == 0) row_reset = ud(rng) < c.reset_fraction;
    double z = nd(rng);
    switch (c.gate) {
      case gate_kind::logsigmoid: x = -std::log1p(std::exp(-z)) / 4; break;
      case gate_kind::resets: x = ud(rng) < 0.03 ? c.reset : -std::log1p(std::exp(-z)) / 4; break;
      case gate_kind::lower_bound: x = ud(rng) < 0.1 ? c.lb : c.lb / (1 + std::exp(-z)); break;
      case gate_kind::token_resets: x = row_reset ? c.reset : -std::log1p(std::exp(-z)) / 4; break;
    }
  }
  d.beta.resize(std::size_t(BT * c.HV));
  for (auto& x : d.beta) x = 1 / (1 + std::exp(-nd(rng)));
  index_t const ns = c.N() * c.HV * c.K * c.V;
  if (c.h0) {
    d.h0.resize(std::size_t(ns));
    for (auto& x : d.h0) x = 0.5 * nd(rng);
  }
  d.d_o.resize(std::size_t(BT * c.HV * c.V));
  for (auto& x : d.d_o) x = nd(rng);
  if (c.dht) {
    d.dht.resize(std::size_t(ns));
    for (auto& x : d.dht) x = nd(rng);
  }
  return d;
}

template <class T>
std::vector<T> cast_to(std::vector<double> const& x) {
  std::vector<T> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = store_as<T>(x[i]);
  return r;
}
template <class T>
std::vector<double> to_double(std::vector<T> const& x) {
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = load_as<double>(x[i]);
  return r;
}
// Round-trip through a storage type: the inputs a lower-precision run actually sees.
template <class T>
kda_data64 rounded(kda_data64 d) {
  for (auto* x : {&d.q, &d.k, &d.v, &d.g, &d.beta, &d.d_o}) *x = to_double(cast_to<T>(*x));
  return d;
}

struct fwd_result {
  std::vector<double> o, ht;
};
struct bwd_result {
  std::vector<double> dq, dk, dv, dg, dbeta, dh0;
};

template <class In, class S = k3::accumulation_t<In>>
struct typed_data {
  kda_case c;
  std::vector<In> q, k, v, g, beta, d_o;
  std::vector<S> h0, dht;
  std::vector<std::int64_t> cu;
  explicit typed_data(kda_data64 const& d)
      : c(d.c), q(cast_to<In>(d.q)), k(cast_to<In>(d.k)), v(cast_to<In>(d.v)), g(cast_to<In>(d.g)), beta(cast_to<In>(d.beta)),
        d_o(cast_to<In>(d.d_o)), h0(cast_to<S>(d.h0)), dht(cast_to<S>(d.dht)), cu(d.c.cu) {}
  tensor_view<In const, 4> qv() const { return host_view(q.data(), c.B, c.T, c.H, c.K); }
  tensor_view<In const, 4> kv() const { return host_view(k.data(), c.B, c.T, c.H, c.K); }
  tensor_view<In const, 4> vv() const { return host_view(v.data(), c.B, c.T, c.HV, c.V); }
  tensor_view<In const, 4> gv() const { return host_view(g.data(), c.B, c.T, c.HV, c.K); }
  tensor_view<In const, 3> bv() const { return host_view(beta.data(), c.B, c.T, c.HV); }
  tensor_view<In const, 4> dov() const { return host_view(d_o.data(), c.B, c.T, c.HV, c.V); }
  tensor_view<S const, 4> h0v() const {
    return h0.empty() ? tensor_view<S const, 4>{} : host_view(h0.data(), c.N(), c.HV, c.K, c.V);
  }
  tensor_view<S const, 4> dhtv() const {
    return dht.empty() ? tensor_view<S const, 4>{} : host_view(dht.data(), c.N(), c.HV, c.K, c.V);
  }
  kda::options opts(kda::algorithm m) const {
    kda::options o;
    o.mode = m;
    if (c.gate == gate_kind::lower_bound) o.gate_lower_bound = c.lb;
    if (!cu.empty()) o.cu_seqlens = cu;
    return o;
  }
};

// The forward's saved states (forward_args::saved) and their shape.
template <class S>
struct saved_states {
  std::vector<S> data;
  std::array<index_t, 3> shape{};
  tensor_view<S, 3> view() { return host_view(data.data(), shape[0], shape[1], shape[2]); }
  tensor_view<S const, 3> view() const { return host_view(data.data(), shape[0], shape[1], shape[2]); }
};

// With `saved`, the chunked forward also fills it (sized here from kda::saved_shape).
template <class In, class S = k3::accumulation_t<In>, class Backend = cpu::serial>
fwd_result run_forward(typed_data<In, S> const& d, kda::algorithm m, Backend const& be = {}, saved_states<S>* saved = nullptr) {
  auto const& c = d.c;
  std::vector<In> o(std::size_t(c.B * c.T * c.HV * c.V));
  std::vector<S> ht(std::size_t(c.N() * c.HV * c.K * c.V), S(-7));
  kda::forward_args<In, S> a{.q = d.qv(), .k = d.kv(), .v = d.vv(), .g = d.gv(), .beta = d.bv(),
                             .o = host_view(o.data(), c.B, c.T, c.HV, c.V), .h0 = d.h0v(),
                             .ht = host_view(ht.data(), c.N(), c.HV, c.K, c.V)};
  if (saved) {
    saved->shape = kda::saved_shape(a, d.opts(m));
    // poison: every entry the backward reads must be written by the forward
    saved->data.assign(std::size_t(saved->shape[0] * saved->shape[1] * saved->shape[2]), std::numeric_limits<S>::quiet_NaN());
    a.saved = saved->view();
  }
  kda::forward(be, a, d.opts(m));
  return {to_double(o), to_double(ht)};
}

template <class In, class S = k3::accumulation_t<In>, class Backend = cpu::serial>
bwd_result run_backward(typed_data<In, S> const& d, kda::algorithm m, Backend const& be = {}, saved_states<S> const* saved = nullptr) {
  auto const& c = d.c;
  std::vector<In> dq(d.q.size(), store_as<In>(-7.0)), dk(d.k.size(), store_as<In>(-7.0)), dv(d.v.size(), store_as<In>(-7.0)), dg(d.g.size(), store_as<In>(-7.0)),
      db(d.beta.size(), store_as<In>(-7.0));
  std::vector<S> dh0(std::size_t(c.N() * c.HV * c.K * c.V), S(-7));
  kda::backward_args<In, S> a{.q = d.qv(), .k = d.kv(), .v = d.vv(), .g = d.gv(), .beta = d.bv(), .h0 = d.h0v(),
                              .d_o = d.dov(), .dht = d.dhtv(),
                              .dq = host_view(dq.data(), c.B, c.T, c.H, c.K), .dk = host_view(dk.data(), c.B, c.T, c.H, c.K),
                              .dv = host_view(dv.data(), c.B, c.T, c.HV, c.V), .dg = host_view(dg.data(), c.B, c.T, c.HV, c.K),
                              .dbeta = host_view(db.data(), c.B, c.T, c.HV),
                              .dh0 = host_view(dh0.data(), c.N(), c.HV, c.K, c.V)};
  if (saved) a.saved = saved->view();
  kda::backward(be, a, d.opts(m));
  return {to_double(dq), to_double(dk), to_double(dv), to_double(dg), to_double(db), to_double(dh0)};
}

}  // namespace k3::test
