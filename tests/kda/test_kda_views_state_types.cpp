// Checks of the KDA C++ API against this file's own reference, written from
// shared/spec/kda.md section 1.1 (not from the library): a token-by-token recurrence templated
// on the scalar, run in double for values and in std::complex<double> for gradients (complex
// step, support/complex_step.hpp: d/dx f = Im f(x + i h e) / h, exact to rounding).
// Probed: state type different from the storage type (float/bfloat16 inputs with a double
// state, double inputs with a float state), every backend (serial, simd, threads 1..5), both
// modes, padded views with permuted dimensions for every input and output, packed sequences of
// length 0..chunk+1 with h0/dht/dh0, the default scale with K odd, and decode steps after a
// prefill with grouped value heads in double.
#include <doctest/doctest.h>

#include <array>
#include <complex>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "k3/kda.hpp"
#include "k3/kda/preprocess.hpp"
#include "support/complex_step.hpp"
#include "support/metrics.hpp"
#include "support/strided.hpp"

namespace {

using namespace k3;
using k3::test::rel_rms;
using k3::test::strided;
using cd = std::complex<double>;

struct shape {
  index_t B = 1, T = 1, H = 1, HV = 1, K = 1, V = 1;
  std::vector<std::int64_t> cu;  // packed when non-empty (B = 1)
  index_t N() const { return cu.empty() ? B : index_t(cu.size()) - 1; }
};

// Row-major dense arrays in the public layouts.
template <class Z>
struct problem_data {
  shape s;
  double scale = 0;
  std::vector<Z> q, k, v, g, beta, h0;
};

// The reference: S' = Diag(e^g) S; u = beta (v - S'^T k); S = S' + k u^T; o = S^T (scale q).
template <class Z>
void reference(problem_data<Z> const& d, std::vector<Z>& o, std::vector<Z>& ht) {
  auto const& s = d.s;
  index_t const G = s.HV / s.H;
  o.assign(std::size_t(s.B * s.T * s.HV * s.V), Z(0));
  ht.assign(std::size_t(s.N() * s.HV * s.K * s.V), Z(0));
  for (index_t n = 0; n < s.N(); ++n) {
    index_t const b = s.cu.empty() ? n : 0, t0 = s.cu.empty() ? 0 : s.cu[std::size_t(n)], t1 = s.cu.empty() ? s.T : s.cu[std::size_t(n) + 1];
    for (index_t hv = 0; hv < s.HV; ++hv) {
      index_t const h = hv / G;
      std::vector<Z> S(std::size_t(s.K * s.V), Z(0)), u(std::size_t(s.V));
      if (!d.h0.empty())
        for (index_t i = 0; i < s.K * s.V; ++i) S[std::size_t(i)] = d.h0[std::size_t((n * s.HV + hv) * s.K * s.V + i)];
      for (index_t t = t0; t < t1; ++t) {
        index_t const qk = ((b * s.T + t) * s.H + h) * s.K, vv = ((b * s.T + t) * s.HV + hv) * s.V, gg = ((b * s.T + t) * s.HV + hv) * s.K;
        Z const beta = d.beta[std::size_t((b * s.T + t) * s.HV + hv)];
        for (index_t i = 0; i < s.K; ++i) {
          Z const e = std::exp(d.g[std::size_t(gg + i)]);
          for (index_t j = 0; j < s.V; ++j) S[std::size_t(i * s.V + j)] *= e;
        }
        for (index_t j = 0; j < s.V; ++j) {
          Z p = 0;
          for (index_t i = 0; i < s.K; ++i) p += S[std::size_t(i * s.V + j)] * d.k[std::size_t(qk + i)];
          u[std::size_t(j)] = beta * (d.v[std::size_t(vv + j)] - p);
        }
        for (index_t i = 0; i < s.K; ++i)
          for (index_t j = 0; j < s.V; ++j) S[std::size_t(i * s.V + j)] += d.k[std::size_t(qk + i)] * u[std::size_t(j)];
        for (index_t j = 0; j < s.V; ++j) {
          Z a = 0;
          for (index_t i = 0; i < s.K; ++i) a += S[std::size_t(i * s.V + j)] * d.q[std::size_t(qk + i)];
          o[std::size_t(vv + j)] = d.scale * a;
        }
      }
      for (index_t i = 0; i < s.K * s.V; ++i) ht[std::size_t((n * s.HV + hv) * s.K * s.V + i)] = S[std::size_t(i)];
    }
  }
}

struct grads {
  std::vector<double> dq, dk, dv, dg, dbeta, dh0;
};

// Gradients of L = sum(o * do) + sum(ht * dht), element by element by the complex step.
grads reference_grads(problem_data<double> const& d, std::vector<double> const& d_o, std::vector<double> const& dht) {
  problem_data<cd> z{d.s, d.scale, {}, {}, {}, {}, {}, {}};
  auto up = [](std::vector<double> const& x) { return std::vector<cd>(x.begin(), x.end()); };
  z.q = up(d.q), z.k = up(d.k), z.v = up(d.v), z.g = up(d.g), z.beta = up(d.beta), z.h0 = up(d.h0);
  auto loss = [&] {
    std::vector<cd> o, ht;
    reference(z, o, ht);
    cd l = 0;
    for (std::size_t i = 0; i < o.size(); ++i) l += o[i] * d_o[i];
    for (std::size_t i = 0; i < ht.size() && !dht.empty(); ++i) l += ht[i] * dht[i];
    return l;
  };
  auto grad = [&](std::vector<cd>& x) { return k3::test::complex_step_gradient(x, loss); };
  return {grad(z.q), grad(z.k), grad(z.v), grad(z.g), grad(z.beta), grad(z.h0)};
}

problem_data<double> random_problem(shape const& s, std::uint64_t seed, bool with_h0 = true, std::optional<double> scale = {}) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0, 1);
  std::uniform_real_distribution<double> ud(0, 1);
  problem_data<double> d{s, scale ? *scale : 1 / std::sqrt(double(s.K)), {}, {}, {}, {}, {}, {}};
  auto fill = [&](std::vector<double>& x, index_t n, double sd) {
    x.resize(std::size_t(n));
    for (auto& e : x) e = sd * nd(rng);
  };
  index_t const BT = s.B * s.T;
  fill(d.q, BT * s.H * s.K, 1 / std::sqrt(double(s.K)));
  fill(d.k, BT * s.H * s.K, 1 / std::sqrt(double(s.K)));
  fill(d.v, BT * s.HV * s.V, 1);
  d.g.resize(std::size_t(BT * s.HV * s.K));
  for (auto& e : d.g) e = ud(rng) < 0.05 ? -30 * ud(rng) : -0.3 * ud(rng);
  d.beta.resize(std::size_t(BT * s.HV));
  for (auto& e : d.beta) e = 1.2 * ud(rng);
  if (with_h0) fill(d.h0, s.N() * s.HV * s.K * s.V, 0.5);
  return d;
}

template <class T>
std::vector<double> rounded(std::vector<double> const& x) {
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = load_as<double>(store_as<T>(x[i]));
  return r;
}

struct tol {
  double o, ht, grad, dh0;
};

// Runs forward and backward with In storage and S state on padded, permuted views of every
// tensor; compares with the reference on the In-rounded inputs.
// The problem as a run with In storage and S state sees it, with do/dht and the reference.
struct prepared {
  problem_data<double> d;
  std::vector<double> d_o, dht, o_ref, ht_ref;
  grads gr;
};
template <class In, class S>
prepared prepare(problem_data<double> d, std::uint64_t seed, bool with_grads = true) {
  auto const& s = d.s;
  d.q = rounded<In>(d.q), d.k = rounded<In>(d.k), d.v = rounded<In>(d.v), d.g = rounded<In>(d.g), d.beta = rounded<In>(d.beta);
  d.h0 = rounded<S>(d.h0);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0, 1);
  std::vector<double> d_o(std::size_t(s.B * s.T * s.HV * s.V)), dht(std::size_t(s.N() * s.HV * s.K * s.V));
  for (auto& e : d_o) e = nd(rng);
  for (auto& e : dht) e = nd(rng);
  d_o = rounded<In>(d_o);
  dht = rounded<S>(dht);
  prepared p{d, d_o, dht, {}, {}, {}};
  reference(d, p.o_ref, p.ht_ref);
  if (with_grads) p.gr = reference_grads(d, d_o, dht);
  return p;
}

template <class In, class S, class Backend>
void run_case(Backend const& be, kda::algorithm mode, prepared const& pp, tol const& tl, bool with_saved) {
  auto const& d = pp.d;
  auto const& s = d.s;
  auto const& d_o = pp.d_o;
  auto const& dht = pp.dht;
  auto const& o_ref = pp.o_ref;
  auto const& ht_ref = pp.ht_ref;
  auto const& gr = pp.gr;
  In const nan_in = store_as<In>(std::numeric_limits<double>::quiet_NaN());
  S const nan_s = std::numeric_limits<S>::quiet_NaN();
  using A4 = std::array<index_t, 4>;
  std::array<std::size_t, 3> const tb{1, 0, 2}, hb{2, 1, 0}, id{0, 1, 2};
  strided<In, 4> q(A4{s.B, s.T, s.H, s.K}, tb, 3, nan_in), k(A4{s.B, s.T, s.H, s.K}, hb, 1, nan_in), v(A4{s.B, s.T, s.HV, s.V}, tb, 2, nan_in),
      g(A4{s.B, s.T, s.HV, s.K}, hb, 5, nan_in), dov(A4{s.B, s.T, s.HV, s.V}, hb, 1, nan_in);
  strided<In, 3> beta(std::array<index_t, 3>{s.B, s.T, s.HV}, std::array<std::size_t, 2>{1, 0}, 2, nan_in);
  strided<S, 4> h0(A4{s.N(), s.HV, s.K, s.V}, std::array<std::size_t, 3>{1, 0, 2}, 2, nan_s), dhtv(A4{s.N(), s.HV, s.K, s.V}, id, 3, nan_s);
  q.set(d.q), k.set(d.k), v.set(d.v), g.set(d.g), beta.set(d.beta), h0.set(d.h0), dov.set(d_o), dhtv.set(dht);
  In const sent = store_as<In>(-3.0);
  S const sents = S(-3);
  strided<In, 4> o(A4{s.B, s.T, s.HV, s.V}, hb, 2, sent);
  strided<S, 4> ht(A4{s.N(), s.HV, s.K, s.V}, std::array<std::size_t, 3>{2, 1, 0}, 1, sents);
  kda::options opt;
  opt.mode = mode;
  if (!s.cu.empty()) opt.cu_seqlens = s.cu;
  if (!s.cu.empty()) opt.scale = d.scale;  // else the default K^-1/2 (K odd here), as d.scale
  kda::forward_args<In, S> fa;
  fa.q = q.view, fa.k = k.view, fa.v = v.view, fa.g = g.view, fa.beta = beta.view, fa.o = o.view, fa.h0 = h0.view, fa.ht = ht.view;
  std::vector<S> saved;
  if (with_saved) {
    auto const sh = kda::saved_shape(fa, opt);
    saved.assign(std::size_t(sh[0] * sh[1] * sh[2]), nan_s);
    fa.saved = host_view(saved.data(), sh[0], sh[1], sh[2]);
  }
  kda::forward(be, fa, opt);
  CHECK(rel_rms(o.get(), o_ref) <= tl.o);
  CHECK(rel_rms(ht.get(), ht_ref) <= tl.ht);
  CHECK(o.padding_is(sent));
  CHECK(ht.padding_is(sents));

  strided<In, 4> dq(A4{s.B, s.T, s.H, s.K}, tb, 1, sent), dk(A4{s.B, s.T, s.H, s.K}, hb, 4, sent), dv(A4{s.B, s.T, s.HV, s.V}, tb, 1, sent),
      dg(A4{s.B, s.T, s.HV, s.K}, hb, 2, sent);
  strided<In, 3> dbeta(std::array<index_t, 3>{s.B, s.T, s.HV}, std::array<std::size_t, 2>{1, 0}, 3, sent);
  strided<S, 4> dh0(A4{s.N(), s.HV, s.K, s.V}, std::array<std::size_t, 3>{1, 2, 0}, 2, sents);
  kda::backward_args<In, S> ba;
  ba.q = q.view, ba.k = k.view, ba.v = v.view, ba.g = g.view, ba.beta = beta.view, ba.h0 = h0.view, ba.d_o = dov.view, ba.dht = dhtv.view;
  ba.dq = dq.view, ba.dk = dk.view, ba.dv = dv.view, ba.dg = dg.view, ba.dbeta = dbeta.view, ba.dh0 = dh0.view;
  if (with_saved) ba.saved = host_view(static_cast<S const*>(saved.data()), fa.saved.extent(0), fa.saved.extent(1), fa.saved.extent(2));
  kda::backward(be, ba, opt);
  CHECK(rel_rms(dq.get(), gr.dq) <= tl.grad);
  CHECK(rel_rms(dk.get(), gr.dk) <= tl.grad);
  CHECK(rel_rms(dv.get(), gr.dv) <= tl.grad);
  CHECK(rel_rms(dg.get(), gr.dg) <= tl.grad);
  CHECK(rel_rms(dbeta.get(), gr.dbeta) <= tl.grad);
  CHECK(rel_rms(dh0.get(), gr.dh0) <= tl.dh0);
  for (auto* x : {&dq, &dk, &dv, &dg}) CHECK(x->padding_is(sent));
  CHECK(dbeta.padding_is(sent));
  CHECK(dh0.padding_is(sents));
}

template <class In, class S>
void every_backend(problem_data<double> const& d0, tol const& tl, std::uint64_t seed) {
  prepared const d = prepare<In, S>(d0, seed);
  for (auto mode : {kda::algorithm::chunk, kda::algorithm::recurrent}) {
    CAPTURE(int(mode));
    bool const sv = mode == kda::algorithm::chunk;
    {
      INFO("serial");
      run_case<In, S>(cpu::serial{}, mode, d, tl, false);
    }
    {
      INFO("simd");
      run_case<In, S>(cpu::simd<>{}, mode, d, tl, sv);
    }
    for (unsigned th = 1; th <= 5; th += 2) {
      INFO("threads " << th);
      run_case<In, S>(cpu::threads<>(th), mode, d, tl, sv);
    }
  }
}

std::vector<shape> shapes() {
  return {
      shape{.B = 2, .T = 67, .H = 1, .HV = 2, .K = 5, .V = 3},
      shape{.B = 1, .T = 1, .H = 2, .HV = 2, .K = 3, .V = 4},
      shape{.B = 1, .T = 135, .H = 1, .HV = 3, .K = 7, .V = 2, .cu = {0, 0, 1, 2, 66, 130, 130, 135}},
      shape{.B = 1, .T = 65, .H = 2, .HV = 4, .K = 9, .V = 5, .cu = {0, 65}},
  };
}

}  // namespace

TEST_CASE("kda: double storage and state at 1e-12 on padded permuted views, every backend and mode") {
  std::uint64_t seed = 100;
  for (auto const& s : shapes()) {
    CAPTURE(s.T);
    CAPTURE(s.K);
    every_backend<double, double>(random_problem(s, seed), tol{1e-12, 1e-12, 1e-11, 1e-11}, seed);
    ++seed;
  }
}

TEST_CASE("kda: float and bfloat16 storage with a double state") {
  std::uint64_t seed = 200;
  for (auto const& s : shapes()) {
    CAPTURE(s.T);
    CAPTURE(s.K);
    // Values rounded to the storage type on output only: the state (double) keeps 1e-12.
    every_backend<float, double>(random_problem(s, seed), tol{1e-6, 1e-12, 1e-6, 1e-11}, seed);
    ++seed;
    every_backend<bfloat16, double>(random_problem(s, seed), tol{8e-3, 1e-12, 8e-3, 1e-11}, seed);
    ++seed;
  }
}

TEST_CASE("kda: double storage with a float state") {
  std::uint64_t seed = 300;
  for (auto const& s : shapes()) {
    CAPTURE(s.T);
    CAPTURE(s.K);
    every_backend<double, float>(random_problem(s, seed), tol{2e-5, 2e-5, 5e-5, 5e-5}, seed);
    ++seed;
  }
}

namespace {
// A prefill of `T0` tokens (chunked forward into pool slots), then decode steps one token at a
// time for the rest, with grouped value heads, against the reference of the whole sequence.
template <class In, class S, class Backend>
void prefill_then_decode(Backend const& be, double tol_o, double tol_state, std::uint64_t seed) {
  shape const s{.B = 3, .T = 70, .H = 2, .HV = 6, .K = 5, .V = 7};
  index_t const T0 = 66, P = 5;
  auto d = random_problem(s, seed);
  d.q = rounded<In>(d.q), d.k = rounded<In>(d.k), d.v = rounded<In>(d.v), d.g = rounded<In>(d.g), d.beta = rounded<In>(d.beta);
  d.h0 = rounded<S>(d.h0);
  std::vector<double> o_ref, ht_ref;
  reference(d, o_ref, ht_ref);
  // Pool with padded rows, sequence n in slot slots[n]; slots 1 and 3 are never touched.
  std::vector<std::int64_t> const slots = {4, 0, 2};
  S const sent = S(-3);
  strided<S, 4> pool(std::array<index_t, 4>{P, s.HV, s.K, s.V}, std::array<std::size_t, 3>{1, 0, 2}, 3, sent);
  auto at = [](auto const& v, std::array<index_t, 4> e, index_t b, index_t t, index_t h, index_t i) {
    return v[std::size_t(((b * e[1] + t) * e[2] + h) * e[3] + i)];
  };
  // Prefill: tokens [0, T0) of every sequence, final states straight into the pool slots.
  {
    std::vector<In> q, k, v, g, beta;
    for (index_t b = 0; b < s.B; ++b)
      for (index_t t = 0; t < T0; ++t) {
        for (index_t h = 0; h < s.H; ++h)
          for (index_t i = 0; i < s.K; ++i) {
            q.push_back(store_as<In>(at(d.q, {s.B, s.T, s.H, s.K}, b, t, h, i)));
            k.push_back(store_as<In>(at(d.k, {s.B, s.T, s.H, s.K}, b, t, h, i)));
          }
        for (index_t h = 0; h < s.HV; ++h) {
          for (index_t i = 0; i < s.V; ++i) v.push_back(store_as<In>(at(d.v, {s.B, s.T, s.HV, s.V}, b, t, h, i)));
          for (index_t i = 0; i < s.K; ++i) g.push_back(store_as<In>(at(d.g, {s.B, s.T, s.HV, s.K}, b, t, h, i)));
          beta.push_back(store_as<In>(d.beta[std::size_t((b * s.T + t) * s.HV + h)]));
        }
      }
    std::vector<S> h0(d.h0.size());
    for (std::size_t i = 0; i < h0.size(); ++i) h0[i] = S(d.h0[i]);
    std::vector<In> o(std::size_t(s.B * T0 * s.HV * s.V));
    for (index_t b = 0; b < s.B; ++b) {
      kda::forward_args<In, S> fa;
      fa.q = host_view(static_cast<In const*>(q.data()), s.B, T0, s.H, s.K).sub(0, b, 1);
      fa.k = host_view(static_cast<In const*>(k.data()), s.B, T0, s.H, s.K).sub(0, b, 1);
      fa.v = host_view(static_cast<In const*>(v.data()), s.B, T0, s.HV, s.V).sub(0, b, 1);
      fa.g = host_view(static_cast<In const*>(g.data()), s.B, T0, s.HV, s.K).sub(0, b, 1);
      fa.beta = host_view(static_cast<In const*>(beta.data()), s.B, T0, s.HV).sub(0, b, 1);
      fa.o = host_view(o.data(), s.B, T0, s.HV, s.V).sub(0, b, 1);
      fa.h0 = host_view(static_cast<S const*>(h0.data()), s.B, s.HV, s.K, s.V).sub(0, b, 1);
      fa.ht = pool.view.sub(0, slots[std::size_t(b)], 1);
      kda::forward(be, fa, kda::options{});
    }
    std::vector<double> o_pre, o_ref_pre;
    for (index_t b = 0; b < s.B; ++b)
      for (index_t t = 0; t < T0; ++t)
        for (index_t h = 0; h < s.HV; ++h)
          for (index_t i = 0; i < s.V; ++i) {
            o_pre.push_back(load_as<double>(o[std::size_t(((b * T0 + t) * s.HV + h) * s.V + i)]));
            o_ref_pre.push_back(at(o_ref, {s.B, s.T, s.HV, s.V}, b, t, h, i));
          }
    CHECK(rel_rms(o_pre, o_ref_pre) <= tol_o);
  }
  for (index_t t = T0; t < s.T; ++t) {
    std::vector<In> q, k, v, g, beta, o(std::size_t(s.B * s.HV * s.V));
    for (index_t b = 0; b < s.B; ++b) {
      for (index_t h = 0; h < s.H; ++h)
        for (index_t i = 0; i < s.K; ++i) {
          q.push_back(store_as<In>(at(d.q, {s.B, s.T, s.H, s.K}, b, t, h, i)));
          k.push_back(store_as<In>(at(d.k, {s.B, s.T, s.H, s.K}, b, t, h, i)));
        }
      for (index_t h = 0; h < s.HV; ++h) {
        for (index_t i = 0; i < s.V; ++i) v.push_back(store_as<In>(at(d.v, {s.B, s.T, s.HV, s.V}, b, t, h, i)));
        for (index_t i = 0; i < s.K; ++i) g.push_back(store_as<In>(at(d.g, {s.B, s.T, s.HV, s.K}, b, t, h, i)));
        beta.push_back(store_as<In>(d.beta[std::size_t((b * s.T + t) * s.HV + h)]));
      }
    }
    kda::decode_args<In, S> da;
    da.q = host_view(static_cast<In const*>(q.data()), s.B, s.H, s.K);
    da.k = host_view(static_cast<In const*>(k.data()), s.B, s.H, s.K);
    da.v = host_view(static_cast<In const*>(v.data()), s.B, s.HV, s.V);
    da.g = host_view(static_cast<In const*>(g.data()), s.B, s.HV, s.K);
    da.beta = host_view(static_cast<In const*>(beta.data()), s.B, s.HV);
    da.o = host_view(o.data(), s.B, s.HV, s.V);
    da.state_pool = pool.view;
    da.slots64 = host_view(slots.data(), s.B);
    kda::decode(be, da, kda::options{});
    std::vector<double> got, want;
    for (index_t b = 0; b < s.B; ++b)
      for (index_t h = 0; h < s.HV; ++h)
        for (index_t i = 0; i < s.V; ++i) {
          got.push_back(load_as<double>(o[std::size_t((b * s.HV + h) * s.V + i)]));
          want.push_back(at(o_ref, {s.B, s.T, s.HV, s.V}, b, t, h, i));
        }
    CHECK(rel_rms(got, want) <= tol_o);
  }
  std::vector<double> got;
  for (index_t b = 0; b < s.B; ++b)
    for (index_t h = 0; h < s.HV; ++h)
      for (index_t i = 0; i < s.K; ++i)
        for (index_t j = 0; j < s.V; ++j) got.push_back(double(pool.at({slots[std::size_t(b)], h, i, j})));
  CHECK(rel_rms(got, ht_ref) <= tol_state);
  for (index_t slot : {1, 3})
    for (index_t h = 0; h < s.HV; ++h)
      for (index_t i = 0; i < s.K; ++i)
        for (index_t j = 0; j < s.V; ++j) CHECK(pool.at({slot, h, i, j}) == sent);
  CHECK(pool.padding_is(sent));
}

template <class In, class S>
void decode_every_backend(double tol_o, double tol_state, std::uint64_t seed) {
  {
    INFO("serial");
    prefill_then_decode<In, S>(cpu::serial{}, tol_o, tol_state, seed);
  }
  {
    INFO("simd");
    prefill_then_decode<In, S>(cpu::simd<>{}, tol_o, tol_state, seed);
  }
  for (unsigned th : {1u, 2u, 4u}) {
    INFO("threads " << th);
    prefill_then_decode<In, S>(cpu::threads<>(th), tol_o, tol_state, seed);
  }
}
}  // namespace

TEST_CASE("kda: decode after a chunked prefill, grouped value heads, padded pool, every backend and type") {
  decode_every_backend<double, double>(1e-12, 1e-12, 401);
  decode_every_backend<float, double>(1e-6, 1e-12, 402);
  decode_every_backend<bfloat16, double>(8e-3, 1e-12, 403);
  decode_every_backend<double, float>(2e-5, 2e-5, 404);
  decode_every_backend<float, float>(2e-5, 2e-5, 405);
}

namespace {
// Forward on one backend with `saved`, backward on another reading it; optional tensors
// (h0, ht, dht, dh0) present or absent in every combination.
template <class In, class S, class Fb, class Bb>
void saved_across(Fb const& fb, Bb const& bb, problem_data<double> d, bool h0, bool ht, bool dht, bool dh0, std::optional<double> lb,
                  double tol_v, double tol_g) {
  auto const& s = d.s;
  // Without h0 the reference starts from zeros (and dh0 is still its gradient).
  if (!h0) std::fill(d.h0.begin(), d.h0.end(), 0.0);
  // The references, once per problem, types and (h0, dht) presence.
  struct entry {
    std::vector<double> key;
    prepared pp;
    grads gr;
  };
  static std::vector<entry> cache;
  std::vector<double> key = {double(sizeof(In)), double(sizeof(S)), double(h0), double(dht), d.g.front(), d.v.back(), double(d.g.size())};
  entry const* hit = nullptr;
  for (auto const& e : cache)
    if (e.key == key) hit = &e;
  if (!hit) {
    prepared pp = prepare<In, S>(d, 9, false);
    std::vector<double> dht_used = dht ? pp.dht : std::vector<double>(pp.dht.size(), 0.0);
    grads gr = reference_grads(pp.d, pp.d_o, dht_used);
    cache.push_back({key, std::move(pp), std::move(gr)});
    hit = &cache.back();
  }
  prepared const& pp = hit->pp;
  auto const& p = pp.d;
  auto const& o_ref = pp.o_ref;
  auto const& ht_ref = pp.ht_ref;
  grads const& gr = hit->gr;
  auto cast = [](std::vector<double> const& x, auto z) {
    std::vector<decltype(z)> r(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) r[i] = store_as<decltype(z)>(x[i]);
    return r;
  };
  auto q = cast(p.q, In{}), k = cast(p.k, In{}), v = cast(p.v, In{}), g = cast(p.g, In{}), beta = cast(p.beta, In{}), d_o = cast(pp.d_o, In{});
  auto h0v = cast(p.h0, S{}), dhtv = cast(pp.dht, S{});
  std::vector<In> o(d_o.size());
  std::vector<S> htv(pp.dht.size(), S(-3)), dh0v(pp.dht.size(), S(-3));
  auto c4 = [](auto const& x, index_t a, index_t b, index_t c, index_t e) { return host_view(x.data(), a, b, c, e); };
  kda::options opt;
  if (!s.cu.empty()) opt.cu_seqlens = s.cu;
  opt.gate_lower_bound = lb;
  kda::forward_args<In, S> fa;
  fa.q = c4(q, s.B, s.T, s.H, s.K), fa.k = c4(k, s.B, s.T, s.H, s.K), fa.v = c4(v, s.B, s.T, s.HV, s.V), fa.g = c4(g, s.B, s.T, s.HV, s.K);
  fa.beta = host_view(static_cast<In const*>(beta.data()), s.B, s.T, s.HV);
  fa.o = host_view(o.data(), s.B, s.T, s.HV, s.V);
  if (h0) fa.h0 = c4(static_cast<std::vector<S> const&>(h0v), s.N(), s.HV, s.K, s.V);
  if (ht) fa.ht = host_view(htv.data(), s.N(), s.HV, s.K, s.V);
  auto const sh = kda::saved_shape(fa, opt);
  std::vector<S> saved(std::size_t(sh[0] * sh[1] * sh[2]), std::numeric_limits<S>::quiet_NaN());
  fa.saved = host_view(saved.data(), sh[0], sh[1], sh[2]);
  kda::forward(fb, fa, opt);
  std::vector<double> od(o.size());
  for (std::size_t i = 0; i < o.size(); ++i) od[i] = load_as<double>(o[i]);
  CHECK(rel_rms(od, o_ref) <= tol_v);
  if (ht) CHECK(rel_rms(std::vector<double>(htv.begin(), htv.end()), ht_ref) <= tol_v);
  std::vector<In> dq(q.size()), dk(k.size()), dv(v.size()), dg(g.size()), db(beta.size());
  kda::backward_args<In, S> ba;
  ba.q = fa.q, ba.k = fa.k, ba.v = fa.v, ba.g = fa.g, ba.beta = fa.beta, ba.h0 = fa.h0;
  ba.d_o = c4(static_cast<std::vector<In> const&>(d_o), s.B, s.T, s.HV, s.V);
  if (dht) ba.dht = c4(static_cast<std::vector<S> const&>(dhtv), s.N(), s.HV, s.K, s.V);
  ba.dq = host_view(dq.data(), s.B, s.T, s.H, s.K), ba.dk = host_view(dk.data(), s.B, s.T, s.H, s.K);
  ba.dv = host_view(dv.data(), s.B, s.T, s.HV, s.V), ba.dg = host_view(dg.data(), s.B, s.T, s.HV, s.K);
  ba.dbeta = host_view(db.data(), s.B, s.T, s.HV);
  if (dh0) ba.dh0 = host_view(dh0v.data(), s.N(), s.HV, s.K, s.V);
  ba.saved = host_view(static_cast<S const*>(saved.data()), sh[0], sh[1], sh[2]);
  kda::backward(bb, ba, opt);
  auto dd = [](std::vector<In> const& x) {
    std::vector<double> r(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) r[i] = load_as<double>(x[i]);
    return r;
  };
  CHECK(rel_rms(dd(dq), gr.dq) <= tol_g);
  CHECK(rel_rms(dd(dk), gr.dk) <= tol_g);
  CHECK(rel_rms(dd(dv), gr.dv) <= tol_g);
  CHECK(rel_rms(dd(dg), gr.dg) <= tol_g);
  CHECK(rel_rms(dd(db), gr.dbeta) <= tol_g);
  // Without h0 the gradient is still that of the (zero) initial state.
  if (dh0) CHECK(rel_rms(std::vector<double>(dh0v.begin(), dh0v.end()), gr.dh0) <= tol_g);
}

problem_data<double> bounded_problem(shape const& s, std::uint64_t seed) {
  auto d = random_problem(s, seed);
  std::mt19937_64 rng(seed + 1);
  std::uniform_real_distribution<double> ud(0, 1);
  for (auto& e : d.g) e = ud(rng) < 0.3 ? -5.0 : -5.0 * ud(rng);
  return d;
}
}  // namespace

TEST_CASE("kda: saved states from one backend read by another, h0/ht/dht/dh0 absent in any combination") {
  shape const s{.B = 1, .T = 100, .H = 1, .HV = 2, .K = 6, .V = 5, .cu = {0, 3, 3, 70, 100}};
  auto const d = random_problem(s, 501);
  for (int mask = 0; mask < 16; ++mask) {
    bool const h0 = mask & 1, ht = mask & 2, dht = mask & 4, dh0 = mask & 8;
    CAPTURE(mask);
    saved_across<double, double>(cpu::serial{}, cpu::threads<>(3), d, h0, ht, dht, dh0, {}, 1e-12, 1e-11);
    saved_across<double, double>(cpu::threads<>(2), cpu::serial{}, d, h0, ht, dht, dh0, {}, 1e-12, 1e-11);
    saved_across<float, float>(cpu::simd<>{}, cpu::serial{}, d, h0, ht, dht, dh0, {}, 2e-5, 5e-5);
    saved_across<float, float>(cpu::serial{}, cpu::simd<>{}, d, h0, ht, dht, dh0, {}, 2e-5, 5e-5);
  }
}

TEST_CASE("kda: gate_lower_bound -5 (dense diagonal tiles) in double at 1e-12, g exactly -5 on 30% of entries") {
  for (auto const& s : {shape{.B = 2, .T = 80, .H = 1, .HV = 2, .K = 7, .V = 3}, shape{.B = 1, .T = 47, .H = 2, .HV = 2, .K = 16, .V = 9, .cu = {0, 17, 17, 47}}}) {
    auto const d = bounded_problem(s, 601);
    double const lb = -5.0;
    for (bool h0 : {true, false}) {
      saved_across<double, double>(cpu::serial{}, cpu::serial{}, d, h0, true, true, true, lb, 1e-12, 1e-11);
      saved_across<double, double>(cpu::simd<>{}, cpu::threads<>(4), d, h0, true, true, true, lb, 1e-12, 1e-11);
      saved_across<float, double>(cpu::threads<>(3), cpu::simd<>{}, d, h0, true, true, true, lb, 1e-6, 1e-6);
    }
  }
}

TEST_CASE("kda: the lower-bounded gate stored as bfloat16 (lb rounded to -4.3125 for lb = -4.3) meets its own bound") {
  // Regression: kda::gate_lower_bound writes lb * sigmoid(z) = lb for large z; in
  // bfloat16 -4.3 is stored as -4.3125, and forward/backward with gate_lower_bound = -4.3 then
  // rejected the library's own gate ("value -4.3125 ... is below ... -4.3"). A value one
  // bfloat16 step lower is still refused.
  index_t const B = 1, T = 70, H = 1, HV = 2, K = 5, V = 3;
  for (double lb : {-4.3, -0.1, -5.0, -1.0 / 3}) {
    CAPTURE(lb);
    std::vector<float> x(std::size_t(B * T * HV * K));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = i % 3 == 0 ? 40.f : float(i % 7) - 3.f;
    std::vector<bfloat16> g(x.size()), q(std::size_t(B * T * H * K), bfloat16(0.25f)), v(std::size_t(B * T * HV * V), bfloat16(1.f)),
        beta(std::size_t(B * T * HV), bfloat16(0.5f)), o(v.size()), d_o(v.size(), bfloat16(1.f)), dq(q.size()), dk(q.size()), dv(v.size()),
        dg(g.size()), db(beta.size());
    // x in bfloat16 (its values are exact there), as the args hold x and g in one storage type.
    std::vector<bfloat16> xb(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) xb[i] = store_as<bfloat16>(x[i]);
    kda::gate_lower_bound(cpu::serial{}, kda::gate_args<bfloat16>{.x = host_view(static_cast<bfloat16 const*>(xb.data()), B, T, HV, K), .g = host_view(g.data(), B, T, HV, K)},
                          {.lower_bound = lb});
    CHECK(double(float(g[0])) == load_as<double>(store_as<bfloat16>(lb)));
    kda::forward_args<bfloat16> fa;
    fa.q = host_view(static_cast<bfloat16 const*>(q.data()), B, T, H, K), fa.k = fa.q;
    fa.v = host_view(static_cast<bfloat16 const*>(v.data()), B, T, HV, V);
    fa.g = host_view(static_cast<bfloat16 const*>(g.data()), B, T, HV, K);
    fa.beta = host_view(static_cast<bfloat16 const*>(beta.data()), B, T, HV);
    fa.o = host_view(o.data(), B, T, HV, V);
    kda::backward_args<bfloat16> ba;
    ba.q = fa.q, ba.k = fa.k, ba.v = fa.v, ba.g = fa.g, ba.beta = fa.beta;
    ba.d_o = host_view(static_cast<bfloat16 const*>(d_o.data()), B, T, HV, V);
    ba.dq = host_view(dq.data(), B, T, H, K), ba.dk = host_view(dk.data(), B, T, H, K), ba.dv = host_view(dv.data(), B, T, HV, V);
    ba.dg = host_view(dg.data(), B, T, HV, K), ba.dbeta = host_view(db.data(), B, T, HV);
    kda::options opt;
    opt.gate_lower_bound = lb;
    for (auto mode : {kda::algorithm::chunk, kda::algorithm::recurrent}) {
      opt.mode = mode;
      CHECK_NOTHROW(kda::forward(cpu::serial{}, fa, opt));
      CHECK_NOTHROW(kda::forward(cpu::simd<>{}, fa, opt));
      CHECK_NOTHROW(kda::forward(cpu::threads<>(3), fa, opt));
      CHECK_NOTHROW(kda::backward(cpu::serial{}, ba, opt));
      CHECK_NOTHROW(kda::backward(cpu::threads<>(2), ba, opt));
    }
    // One bfloat16 step below the stored bound: refused by every backend.
    bfloat16 const below = bfloat16::from_bits(static_cast<std::uint16_t>(store_as<bfloat16>(lb).bits + 1));
    REQUIRE(double(float(below)) < std::min(lb, load_as<double>(store_as<bfloat16>(lb))));
    g[37] = below;
    for (auto mode : {kda::algorithm::chunk, kda::algorithm::recurrent}) {
      opt.mode = mode;
      CHECK_THROWS_AS(kda::forward(cpu::serial{}, fa, opt), k3::error);
      CHECK_THROWS_AS(kda::forward(cpu::simd<>{}, fa, opt), k3::error);
      CHECK_THROWS_AS(kda::forward(cpu::threads<>(3), fa, opt), k3::error);
      CHECK_THROWS_AS(kda::backward(cpu::threads<>(2), ba, opt), k3::error);
    }
  }
}

namespace {
// Forward only, V a multiple of the SIMD width (the vectorised recurrent form and the decode
// column blocks run only then; the shapes above take their scalar fallbacks).
template <class In, class S, class Backend>
void wide_forward(Backend const& be, kda::algorithm mode, prepared const& pp, double tol_o, double tol_ht) {
  auto const& s = pp.d.s;
  using A4 = std::array<index_t, 4>;
  In const nan_in = store_as<In>(std::numeric_limits<double>::quiet_NaN());
  strided<In, 4> q(A4{s.B, s.T, s.H, s.K}, {1, 0, 2}, 3, nan_in), k(A4{s.B, s.T, s.H, s.K}, {2, 1, 0}, 1, nan_in),
      v(A4{s.B, s.T, s.HV, s.V}, {1, 0, 2}, 8, nan_in), g(A4{s.B, s.T, s.HV, s.K}, {2, 1, 0}, 5, nan_in);
  strided<In, 3> beta(std::array<index_t, 3>{s.B, s.T, s.HV}, std::array<std::size_t, 2>{1, 0}, 2, nan_in);
  strided<S, 4> h0(A4{s.N(), s.HV, s.K, s.V}, {1, 0, 2}, 16, std::numeric_limits<S>::quiet_NaN());
  q.set(pp.d.q), k.set(pp.d.k), v.set(pp.d.v), g.set(pp.d.g), beta.set(pp.d.beta), h0.set(pp.d.h0);
  strided<In, 4> o(A4{s.B, s.T, s.HV, s.V}, {2, 1, 0}, 16, store_as<In>(-3.0));
  strided<S, 4> ht(A4{s.N(), s.HV, s.K, s.V}, {2, 1, 0}, 8, S(-3));
  kda::options opt;
  opt.mode = mode;
  if (!s.cu.empty()) opt.cu_seqlens = s.cu;
  kda::forward_args<In, S> fa;
  fa.q = q.view, fa.k = k.view, fa.v = v.view, fa.g = g.view, fa.beta = beta.view, fa.o = o.view, fa.h0 = h0.view, fa.ht = ht.view;
  kda::forward(be, fa, opt);
  CHECK(rel_rms(o.get(), pp.o_ref) <= tol_o);
  CHECK(rel_rms(ht.get(), pp.ht_ref) <= tol_ht);
  CHECK(o.padding_is(store_as<In>(-3.0)));
  CHECK(ht.padding_is(S(-3)));
}

template <class In, class S>
void wide_every_backend(problem_data<double> const& d, double tol_o, double tol_ht) {
  prepared const pp = prepare<In, S>(d, 3, false);
  for (auto mode : {kda::algorithm::recurrent, kda::algorithm::chunk}) {
    CAPTURE(int(mode));
    wide_forward<In, S>(cpu::serial{}, mode, pp, tol_o, tol_ht);
    wide_forward<In, S>(cpu::simd<>{}, mode, pp, tol_o, tol_ht);
    wide_forward<In, S>(cpu::threads<>(2), mode, pp, tol_o, tol_ht);
    wide_forward<In, S>(cpu::threads<>(5), mode, pp, tol_o, tol_ht);
  }
}
}  // namespace

TEST_CASE("kda: V a multiple of the SIMD width (vectorised recurrent form), every type, strong decays and resets") {
  std::uint64_t seed = 800;
  for (auto const& s : {shape{.B = 2, .T = 70, .H = 1, .HV = 2, .K = 5, .V = 16}, shape{.B = 1, .T = 90, .H = 2, .HV = 4, .K = 17, .V = 32, .cu = {0, 1, 1, 40, 90}},
                        shape{.B = 1, .T = 33, .H = 1, .HV = 1, .K = 3, .V = 64}}) {
    CAPTURE(s.V);
    auto d = random_problem(s, ++seed);
    // A large state and per-step decays down to e^-60 (the rescaled-state path), some exact resets.
    for (auto& e : d.h0) e *= 1e3;
    for (std::size_t i = 0; i < d.g.size(); i += 11) d.g[i] = -60.0 * double(i % 3);
    for (std::size_t i = 5; i < d.g.size(); i += 97) d.g[i] = -std::numeric_limits<double>::infinity();
    wide_every_backend<double, double>(d, 1e-12, 1e-12);
    wide_every_backend<float, double>(d, 1e-6, 1e-12);
    wide_every_backend<bfloat16, double>(d, 8e-3, 1e-12);
    wide_every_backend<double, float>(d, 2e-5, 2e-5);
    wide_every_backend<float, float>(d, 2e-5, 2e-5);
  }
}

TEST_CASE("kda: decode with V a multiple of the SIMD width (column blocks), every backend and type") {
  for (index_t V : {16, 40, 136}) {
    CAPTURE(V);
    shape const s{.B = 6, .T = 3, .H = 1, .HV = 2, .K = 7, .V = V};
    auto const d = random_problem(s, 900 + std::uint64_t(V));
    auto one = [&](auto in_tag, auto s_tag, double tol_o, double tol_s) {
      using In = decltype(in_tag);
      using S = decltype(s_tag);
      prepared const pp = prepare<In, S>(d, 5, false);
      auto run = [&](auto const& be) {
        // Pool: 8 slots with padded rows, sequences in slots 7, 0, 3, 5, 1, 6.
        std::vector<std::int32_t> const slots = {7, 0, 3, 5, 1, 6};
        strided<S, 4> pool(std::array<index_t, 4>{8, s.HV, s.K, s.V}, std::array<std::size_t, 3>{0, 1, 2}, 8, S(-3));
        for (index_t n = 0; n < s.B; ++n)
          for (index_t h = 0; h < s.HV; ++h)
            for (index_t i = 0; i < s.K * s.V; ++i)
              pool.at({slots[std::size_t(n)], h, i / s.V, i % s.V}) = S(pp.d.h0[std::size_t((n * s.HV + h) * s.K * s.V + i)]);
        for (index_t t = 0; t < s.T; ++t) {
          auto rows = [&](std::vector<double> const& x, index_t heads, index_t w) {
            std::vector<In> r;
            for (index_t n = 0; n < s.B; ++n)
              for (index_t i = 0; i < heads * w; ++i) r.push_back(store_as<In>(x[std::size_t((n * s.T + t) * heads * w + i)]));
            return r;
          };
          auto q = rows(pp.d.q, s.H, s.K), k = rows(pp.d.k, s.H, s.K), v = rows(pp.d.v, s.HV, s.V), g = rows(pp.d.g, s.HV, s.K),
               beta = rows(pp.d.beta, s.HV, 1);
          std::vector<In> o(v.size());
          kda::decode_args<In, S> da;
          da.q = host_view(static_cast<In const*>(q.data()), s.B, s.H, s.K), da.k = host_view(static_cast<In const*>(k.data()), s.B, s.H, s.K);
          da.v = host_view(static_cast<In const*>(v.data()), s.B, s.HV, s.V), da.g = host_view(static_cast<In const*>(g.data()), s.B, s.HV, s.K);
          da.beta = host_view(static_cast<In const*>(beta.data()), s.B, s.HV), da.o = host_view(o.data(), s.B, s.HV, s.V);
          da.state_pool = pool.view;
          da.slots32 = host_view(slots.data(), s.B);
          kda::decode(be, da, kda::options{});
          std::vector<double> got, want;
          for (index_t n = 0; n < s.B; ++n)
            for (index_t i = 0; i < s.HV * s.V; ++i) {
              got.push_back(load_as<double>(o[std::size_t(n * s.HV * s.V + i)]));
              want.push_back(pp.o_ref[std::size_t((n * s.T + t) * s.HV * s.V + i)]);
            }
          CHECK(rel_rms(got, want) <= tol_o);
        }
        std::vector<double> st;
        for (index_t n = 0; n < s.B; ++n)
          for (index_t h = 0; h < s.HV; ++h)
            for (index_t i = 0; i < s.K * s.V; ++i) st.push_back(double(pool.at({slots[std::size_t(n)], h, i / s.V, i % s.V})));
        CHECK(rel_rms(st, pp.ht_ref) <= tol_s);
        for (index_t slot : {2, 4})
          for (index_t h = 0; h < s.HV; ++h) CHECK(pool.at({slot, h, 0, 0}) == S(-3));
        CHECK(pool.padding_is(S(-3)));
      };
      run(cpu::serial{});
      run(cpu::simd<>{});
      run(cpu::threads<>(3));
    };
    one(double{}, double{}, 1e-12, 1e-12);
    one(float{}, double{}, 1e-6, 1e-12);
    one(bfloat16{}, double{}, 8e-3, 1e-12);
    one(float{}, float{}, 2e-5, 2e-5);
  }
}
