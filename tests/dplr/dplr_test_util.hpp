// Shared helpers for the DPLR tests: random problems with owned buffers, views, comparisons.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "k3/dplr.hpp"

namespace dplr_test {

using k3::index_t;

template <class T>
struct problem {
  using S = k3::dplr::state_t<T>;
  index_t B = 1, T_ = 1, H = 1, K = 1, V = 1, N = 1;
  std::vector<T> q, k, v, a, b, gk;
  std::vector<S> h0;
  std::vector<std::int64_t> cu;
  bool with_h0 = false;

  k3::const_view<T, 4> kv(std::vector<T> const& x, index_t D) const { return k3::host_view(x.data(), B, T_, H, D); }
  // The inputs (h0 when with_h0) as forward args; outputs unset.
  k3::dplr::forward_args<T> inputs() const {
    k3::dplr::forward_args<T> in{kv(q, K), kv(k, K), kv(v, V), kv(a, K), kv(b, K), kv(gk, K)};
    if (with_h0) in.h0 = k3::host_view(h0.data(), N, H, K, V);
    return in;
  }
  k3::dplr::options options(index_t chunk = 64) const {
    k3::dplr::options o;
    o.chunk_size = chunk;
    if (!cu.empty()) o.cu_seqlens = k3::host_view(cu.data(), static_cast<index_t>(cu.size()));
    return o;
  }
  index_t nk() const { return B * T_ * H * K; }
  index_t nv() const { return B * T_ * H * V; }
  index_t ns() const { return N * H * K * V; }
};

// resets: g = -1000 at 3% of (token, channel); huge_resets -1e8; infinite_resets -inf.
enum class gate { normal, zero, resets, strong, huge_resets, infinite_resets };

// a: unit vectors; b = -lambda a with lambda in (0, 1] (stable, RWKV-7 style) unless
// generic_ab, then independent small vectors.
template <class T>
problem<T> make(std::mt19937_64& rng, index_t B, index_t Tn, index_t H, index_t K, index_t V, std::vector<std::int64_t> cu = {},
                bool with_h0 = true, gate g = gate::normal, bool generic_ab = false) {
  problem<T> p;
  p.B = B;
  p.T_ = Tn;
  p.H = H;
  p.K = K;
  p.V = V;
  p.cu = std::move(cu);
  p.N = p.cu.empty() ? B : static_cast<index_t>(p.cu.size()) - 1;
  p.with_h0 = with_h0;
  std::normal_distribution<double> n01(0.0, 1.0);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  auto fill = [&](std::vector<T>& x, index_t n, double s) {
    x.resize(static_cast<std::size_t>(n));
    for (auto& e : x) e = static_cast<T>(s * n01(rng));
  };
  double ks = 1.0 / std::sqrt(double(std::max<index_t>(K, 1)));
  fill(p.q, p.nk(), 1.0);
  fill(p.k, p.nk(), ks);
  fill(p.v, p.nv(), 1.0);
  fill(p.a, p.nk(), 1.0);
  p.b.resize(p.a.size());
  p.gk.resize(p.a.size());
  for (index_t r = 0; r < B * Tn * H; ++r) {
    T* ar = p.a.data() + r * K;
    T* br = p.b.data() + r * K;
    double nrm = 0;
    for (index_t d = 0; d < K; ++d) nrm += double(ar[d]) * ar[d];
    nrm = std::sqrt(nrm) + 1e-12;
    double lam = 0.2 + 0.8 * u01(rng);
    for (index_t d = 0; d < K; ++d) {
      if (generic_ab) {
        ar[d] = static_cast<T>(0.5 * ks * n01(rng));
        br[d] = static_cast<T>(0.5 * ks * n01(rng));
      } else {
        ar[d] = static_cast<T>(ar[d] / nrm);
        br[d] = static_cast<T>(-lam * ar[d]);
      }
      double x = n01(rng);
      double ls = -std::log1p(std::exp(-x));  // log sigmoid
      double gv = 0;
      switch (g) {
        case gate::normal: gv = ls / 4; break;
        case gate::zero: gv = 0; break;
        case gate::strong: gv = ls * 2; break;
        case gate::resets: gv = u01(rng) < 0.03 ? -1000.0 : ls / 4; break;
        case gate::huge_resets: gv = u01(rng) < 0.03 ? -1e8 : ls / 4; break;
        case gate::infinite_resets: gv = u01(rng) < 0.03 ? -std::numeric_limits<double>::infinity() : ls / 4; break;
      }
      p.gk[r * K + d] = static_cast<T>(gv);
    }
  }
  p.h0.resize(static_cast<std::size_t>(p.ns()));
  for (auto& e : p.h0) e = static_cast<typename problem<T>::S>(0.5 * n01(rng));
  return p;
}

template <class T>
std::vector<T> randn(std::mt19937_64& rng, index_t n, double s = 1.0) {
  std::normal_distribution<double> n01(0.0, 1.0);
  std::vector<T> x(static_cast<std::size_t>(n));
  for (auto& e : x) e = static_cast<T>(s * n01(rng));
  return x;
}

// max |x - y| / max(1, max |y|); a NaN or Inf difference is an infinite error (std::max would
// drop a NaN).
template <class A, class B>
double rel_err(std::vector<A> const& x, std::vector<B> const& y) {
  if (x.size() != y.size()) return INFINITY;
  double m = 1, e = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    m = std::max(m, std::abs(double(y[i])));
    double const d = std::abs(double(x[i]) - double(y[i]));
    if (!(d <= e)) e = std::isfinite(d) ? d : INFINITY;
  }
  return e / m;
}

template <class T>
struct fwd_result {
  std::vector<T> o;
  std::vector<k3::dplr::state_t<T>> ht;
};

template <class T>
struct bwd_result {
  std::vector<T> dq, dk, dv, da, db, dgk;
  std::vector<k3::dplr::state_t<T>> dh0;
};

// The inputs of forward args (h0 included) as backward args, gradients unset.
template <class T>
k3::dplr::backward_args<T> backward_of(k3::dplr::forward_args<T> const& a) {
  return {a.q, a.k, a.v, a.a, a.b, a.gk, a.h0};
}
// The span inputs of forward args (h0 dropped) with the map outputs.
template <class T, class M>
k3::dplr::maps_args<T> maps_of(k3::dplr::forward_args<T> const& a, M const& m, M const& n) {
  return {a.q, a.k, a.v, a.a, a.b, a.gk, m, n};
}
template <class T, class D, class M>
k3::dplr::transposed_maps_args<T> transposed_maps_of(k3::dplr::forward_args<T> const& a, D const& d_o, M const& mt, M const& g) {
  return {a.q, a.k, a.v, a.a, a.b, a.gk, d_o, mt, g};
}
// Forward or backward args with a communicator: the context-parallel calls.
template <class C, class T>
k3::dplr::cp_forward_args<T, C> on(C const& comm, k3::dplr::forward_args<T> const& a) {
  return {&comm, a.q, a.k, a.v, a.a, a.b, a.gk, a.h0, a.o, a.ht};
}
template <class C, class T>
k3::dplr::cp_backward_args<T, C> on(C const& comm, k3::dplr::backward_args<T> const& a) {
  return {&comm, a.q, a.k, a.v, a.a, a.b, a.gk, a.h0, a.d_o, a.dht, a.dq, a.dk, a.dv, a.da, a.db, a.dgk, a.dh0};
}

template <class T, class F>
fwd_result<T> run_fwd(problem<T> const& p, F&& f) {
  fwd_result<T> r;
  r.o.assign(static_cast<std::size_t>(p.nv()), T(0));
  r.ht.assign(static_cast<std::size_t>(p.ns()), 0);
  auto a = p.inputs();
  a.o = k3::host_view(r.o.data(), p.B, p.T_, p.H, p.V);
  a.ht = k3::host_view(r.ht.data(), p.N, p.H, p.K, p.V);
  f(a);
  return r;
}

template <class T, class F>
bwd_result<T> run_bwd(problem<T> const& p, std::vector<T> const& dO, std::vector<k3::dplr::state_t<T>> const& dht, F&& f) {
  bwd_result<T> r;
  for (auto* x : {&r.dq, &r.dk, &r.da, &r.db, &r.dgk}) x->assign(static_cast<std::size_t>(p.nk()), T(0));
  r.dv.assign(static_cast<std::size_t>(p.nv()), T(0));
  r.dh0.assign(static_cast<std::size_t>(p.ns()), 0);
  auto g = backward_of(p.inputs());
  g.d_o = k3::host_view(dO.data(), p.B, p.T_, p.H, p.V);
  if (!dht.empty()) g.dht = k3::host_view(dht.data(), p.N, p.H, p.K, p.V);
  auto v4 = [&](std::vector<T>& x, index_t D) { return k3::host_view(x.data(), p.B, p.T_, p.H, D); };
  g.dq = v4(r.dq, p.K), g.dk = v4(r.dk, p.K), g.dv = v4(r.dv, p.V), g.da = v4(r.da, p.K), g.db = v4(r.db, p.K), g.dgk = v4(r.dgk, p.K);
  g.dh0 = k3::host_view(r.dh0.data(), p.N, p.H, p.K, p.V);
  f(g);
  return r;
}

template <class T>
double max_err(fwd_result<T> const& x, fwd_result<T> const& y) {
  return std::max(rel_err(x.o, y.o), rel_err(x.ht, y.ht));
}
template <class T>
double max_err(bwd_result<T> const& x, bwd_result<T> const& y) {
  double e = 0;
  e = std::max(e, rel_err(x.dq, y.dq));
  e = std::max(e, rel_err(x.dk, y.dk));
  e = std::max(e, rel_err(x.dv, y.dv));
  e = std::max(e, rel_err(x.da, y.da));
  e = std::max(e, rel_err(x.db, y.db));
  e = std::max(e, rel_err(x.dgk, y.dgk));
  e = std::max(e, rel_err(x.dh0, y.dh0));
  return e;
}

inline k3::dplr::options recurrent(k3::dplr::options o) {
  o.mode = k3::dplr::algorithm::recurrent;
  return o;
}
inline auto recurrent_fwd(k3::dplr::options o) {
  return [o](auto const& a) { k3::dplr::forward(k3::cpu::serial{}, a, recurrent(o)); };
}
inline auto recurrent_bwd(k3::dplr::options o) {
  return [o](auto const& a) { k3::dplr::backward(k3::cpu::serial{}, a, recurrent(o)); };
}
template <class Bk>
auto chunked_fwd(Bk bk, k3::dplr::options o) {
  return [bk, o](auto const& a) { k3::dplr::forward(bk, a, o); };
}
template <class Bk>
auto chunked_bwd(Bk bk, k3::dplr::options o) {
  return [bk, o](auto const& a) { k3::dplr::backward(bk, a, o); };
}

}  // namespace dplr_test
