// Checks of the DPLR C++ API against this file's own reference, written from
// shared/spec/kda.md section 4.1: S_t = Diag(e^gk_t) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,
// o_t = S_t^T (scale q_t), a token loop templated on the scalar (double for values,
// std::complex<double> for complex-step gradients).
// Probed: general a and b (not the KDA special case), every backend and long-sequence mode,
// chunk sizes that are not powers of two, all intra-chunk forms, padded permuted views for every
// input and output; segment maps of arbitrary splits (empty segments, splits inside a chunk)
// composed and applied = one pass, the transposed maps likewise for the state gradient, maps of
// packed sequences, KDA maps with grouped value heads, the context-parallel entry points.
#include <doctest/doctest.h>

#include <complex>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "k3/comm/communicator.hpp"
#include "k3/dplr.hpp"
#include "support/complex_step.hpp"
#include "support/metrics.hpp"
#include "support/strided.hpp"

namespace {

using namespace k3;
using k3::test::rel_rms;
using k3::test::strided;
using cd = std::complex<double>;
using A4 = std::array<index_t, 4>;

struct shape {
  index_t B = 1, T = 1, H = 1, K = 1, V = 1;
  std::vector<std::int64_t> cu;
  index_t N() const { return cu.empty() ? B : index_t(cu.size()) - 1; }
};

template <class Z>
struct data {
  shape s;
  double scale = 1;
  std::vector<Z> q, k, v, a, b, gk, h0;
};

template <class Z>
void reference(data<Z> const& d, std::vector<Z>& o, std::vector<Z>& ht) {
  auto const& s = d.s;
  o.assign(std::size_t(s.B * s.T * s.H * s.V), Z(0));
  ht.assign(std::size_t(s.N() * s.H * s.K * s.V), Z(0));
  for (index_t n = 0; n < s.N(); ++n) {
    index_t const bb = s.cu.empty() ? n : 0, t0 = s.cu.empty() ? 0 : s.cu[std::size_t(n)], t1 = s.cu.empty() ? s.T : s.cu[std::size_t(n) + 1];
    for (index_t h = 0; h < s.H; ++h) {
      std::vector<Z> S(std::size_t(s.K * s.V), Z(0)), aS(std::size_t(s.V));
      if (!d.h0.empty())
        for (index_t i = 0; i < s.K * s.V; ++i) S[std::size_t(i)] = d.h0[std::size_t((n * s.H + h) * s.K * s.V + i)];
      for (index_t t = t0; t < t1; ++t) {
        index_t const rk = ((bb * s.T + t) * s.H + h) * s.K, rv = ((bb * s.T + t) * s.H + h) * s.V;
        for (index_t j = 0; j < s.V; ++j) {
          Z x = 0;
          for (index_t i = 0; i < s.K; ++i) x += d.a[std::size_t(rk + i)] * S[std::size_t(i * s.V + j)];
          aS[std::size_t(j)] = x;
        }
        for (index_t i = 0; i < s.K; ++i) {
          Z const e = std::exp(d.gk[std::size_t(rk + i)]);
          for (index_t j = 0; j < s.V; ++j)
            S[std::size_t(i * s.V + j)] = e * S[std::size_t(i * s.V + j)] + d.b[std::size_t(rk + i)] * aS[std::size_t(j)] +
                                          d.k[std::size_t(rk + i)] * d.v[std::size_t(rv + j)];
        }
        for (index_t j = 0; j < s.V; ++j) {
          Z x = 0;
          for (index_t i = 0; i < s.K; ++i) x += S[std::size_t(i * s.V + j)] * d.q[std::size_t(rk + i)];
          o[std::size_t(rv + j)] = d.scale * x;
        }
      }
      for (index_t i = 0; i < s.K * s.V; ++i) ht[std::size_t((n * s.H + h) * s.K * s.V + i)] = S[std::size_t(i)];
    }
  }
}

struct grads {
  std::vector<double> dq, dk, dv, da, db, dgk, dh0;
};

grads reference_grads(data<double> const& d, std::vector<double> const& d_o, std::vector<double> const& dht) {
  data<cd> z{d.s, d.scale, {}, {}, {}, {}, {}, {}, {}};
  auto up = [](std::vector<double> const& x) { return std::vector<cd>(x.begin(), x.end()); };
  z.q = up(d.q), z.k = up(d.k), z.v = up(d.v), z.a = up(d.a), z.b = up(d.b), z.gk = up(d.gk), z.h0 = up(d.h0);
  auto loss = [&] {
    std::vector<cd> o, ht;
    reference(z, o, ht);
    cd l = 0;
    for (std::size_t i = 0; i < o.size(); ++i) l += o[i] * d_o[i];
    for (std::size_t i = 0; i < ht.size(); ++i) l += ht[i] * dht[i];
    return l;
  };
  auto grad = [&](std::vector<cd>& x) { return k3::test::complex_step_gradient(x, loss); };
  return {grad(z.q), grad(z.k), grad(z.v), grad(z.a), grad(z.b), grad(z.gk), grad(z.h0)};
}

// Stable general DPLR: |b a^T| small, a and b independent (not the KDA tie).
data<double> random_dplr(shape const& s, std::uint64_t seed, bool resets = true) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0, 1);
  std::uniform_real_distribution<double> ud(0, 1);
  data<double> d{s, 1 / std::sqrt(double(s.K)), {}, {}, {}, {}, {}, {}, {}};
  index_t const nk = s.B * s.T * s.H * s.K, nv = s.B * s.T * s.H * s.V;
  auto fill = [&](std::vector<double>& x, index_t n, double sd) {
    x.resize(std::size_t(n));
    for (auto& e : x) e = sd * nd(rng);
  };
  double const r = 1 / std::sqrt(double(s.K));
  fill(d.q, nk, r), fill(d.k, nk, r), fill(d.v, nv, 1), fill(d.a, nk, 0.6 * r), fill(d.b, nk, 0.6 * r);
  d.gk.resize(std::size_t(nk));
  // Mostly decays, some strong (resets), some growth (gk > 0: the API takes any log decay).
  for (auto& e : d.gk) {
    double const u = ud(rng);
    e = resets && u < 0.04 ? -40 * ud(rng) : u < 0.12 ? 0.3 * ud(rng) : -0.4 * ud(rng);
  }
  fill(d.h0, s.N() * s.H * s.K * s.V, 0.5);
  return d;
}

struct views {
  strided<double, 4> q, k, v, a, b, gk, h0;
  explicit views(data<double> const& d)
      : q(A4{d.s.B, d.s.T, d.s.H, d.s.K}, {1, 0, 2}, 3, NAN),
        k(A4{d.s.B, d.s.T, d.s.H, d.s.K}, {2, 1, 0}, 1, NAN),
        v(A4{d.s.B, d.s.T, d.s.H, d.s.V}, {1, 2, 0}, 2, NAN),
        a(A4{d.s.B, d.s.T, d.s.H, d.s.K}, {0, 2, 1}, 4, NAN),
        b(A4{d.s.B, d.s.T, d.s.H, d.s.K}, {2, 0, 1}, 1, NAN),
        gk(A4{d.s.B, d.s.T, d.s.H, d.s.K}, {1, 0, 2}, 2, NAN),
        h0(A4{d.s.N(), d.s.H, d.s.K, d.s.V}, {1, 0, 2}, 2, NAN) {
    q.set(d.q), k.set(d.k), v.set(d.v), a.set(d.a), b.set(d.b), gk.set(d.gk), h0.set(d.h0);
  }
  dplr::forward_args<double> in() const { return {q.view, k.view, v.view, a.view, b.view, gk.view, h0.view}; }
};

dplr::options options_for(shape const& s, index_t chunk) {
  dplr::options o;
  o.chunk_size = chunk;
  if (!s.cu.empty()) o.cu_seqlens = const_view<std::int64_t, 1>(s.cu.data(), {index_t(s.cu.size())});
  return o;
}

// Forward and backward of `run` (chunked on a backend, or recurrent) on padded permuted views,
// against the reference.
template <class Fwd, class Bwd>
void check_all(data<double> const& d, dplr::options const& opt, Fwd&& fwd, Bwd&& bwd, grads const& gr, std::vector<double> const& d_o,
               std::vector<double> const& dht) {
  auto const& s = d.s;
  std::vector<double> o_ref, ht_ref;
  reference(d, o_ref, ht_ref);
  views x(d);
  strided<double, 4> o(A4{s.B, s.T, s.H, s.V}, {2, 1, 0}, 2, -3), ht(A4{s.N(), s.H, s.K, s.V}, {2, 1, 0}, 1, -3);
  auto fa = x.in();
  fa.o = o.view;
  fa.ht = ht.view;
  fwd(fa, opt);
  CHECK(rel_rms(o.get(), o_ref) <= 1e-12);
  CHECK(rel_rms(ht.get(), ht_ref) <= 1e-12);
  CHECK(o.padding_is(-3));
  CHECK(ht.padding_is(-3));
  strided<double, 4> dov(A4{s.B, s.T, s.H, s.V}, {1, 0, 2}, 1, NAN), dhtv(A4{s.N(), s.H, s.K, s.V}, {0, 2, 1}, 2, NAN);
  dov.set(d_o), dhtv.set(dht);
  strided<double, 4> dq(A4{s.B, s.T, s.H, s.K}, {1, 0, 2}, 1, -3), dk(A4{s.B, s.T, s.H, s.K}, {2, 1, 0}, 2, -3),
      dv(A4{s.B, s.T, s.H, s.V}, {1, 0, 2}, 3, -3), da(A4{s.B, s.T, s.H, s.K}, {2, 0, 1}, 1, -3), db(A4{s.B, s.T, s.H, s.K}, {0, 2, 1}, 1, -3),
      dgk(A4{s.B, s.T, s.H, s.K}, {1, 2, 0}, 2, -3), dh0(A4{s.N(), s.H, s.K, s.V}, {1, 2, 0}, 1, -3);
  auto const in = x.in();
  bwd(dplr::backward_args<double>{in.q, in.k, in.v, in.a, in.b, in.gk, in.h0, dov.view, dhtv.view, dq.view, dk.view, dv.view, da.view, db.view,
                                  dgk.view, dh0.view},
      opt);
  CHECK(rel_rms(dq.get(), gr.dq) <= 1e-11);
  CHECK(rel_rms(dk.get(), gr.dk) <= 1e-11);
  CHECK(rel_rms(dv.get(), gr.dv) <= 1e-11);
  CHECK(rel_rms(da.get(), gr.da) <= 1e-11);
  CHECK(rel_rms(db.get(), gr.db) <= 1e-11);
  CHECK(rel_rms(dgk.get(), gr.dgk) <= 1e-11);
  CHECK(rel_rms(dh0.get(), gr.dh0) <= 1e-11);
  for (auto* g : {&dq, &dk, &dv, &da, &db, &dgk, &dh0}) CHECK(g->padding_is(-3));
}

std::vector<shape> shapes() {
  return {shape{.B = 2, .T = 41, .H = 2, .K = 5, .V = 3}, shape{.B = 1, .T = 1, .H = 1, .K = 3, .V = 4},
          shape{.B = 1, .T = 58, .H = 2, .K = 4, .V = 3, .cu = {0, 0, 1, 18, 18, 37, 58}}, shape{.B = 1, .T = 53, .H = 1, .K = 6, .V = 5}};
}

}  // namespace

TEST_CASE("dplr: chunked and recurrent forms at 1e-12 on padded views, general a and b, every backend, mode and chunk") {
  std::uint64_t seed = 700;
  for (auto const& s : shapes()) {
    auto const d = random_dplr(s, ++seed);
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> nd(0, 1);
    std::vector<double> d_o(std::size_t(s.B * s.T * s.H * s.V)), dht(std::size_t(s.N() * s.H * s.K * s.V));
    for (auto& e : d_o) e = nd(rng);
    for (auto& e : dht) e = nd(rng);
    grads const gr = reference_grads(d, d_o, dht);
    CAPTURE(s.T);
    CAPTURE(s.K);
    {
      INFO("recurrent");
      auto rec = options_for(s, 64);
      rec.mode = dplr::algorithm::recurrent;
      check_all(
          d, rec, [](auto const& a, auto const& o) { dplr::forward(cpu::serial{}, a, o); },
          [](auto const& a, auto const& o) { dplr::backward(cpu::serial{}, a, o); }, gr, d_o, dht);
    }
    for (index_t chunk : {1, 3, 16, 17, 40, 100}) {
      for (auto intra : {dplr::intra_form::automatic, dplr::intra_form::factored, dplr::intra_form::pairwise}) {
        for (auto ls : {dplr::sequence_split::value_split, dplr::sequence_split::segment_maps}) {
          auto opt = options_for(s, chunk);
          opt.intra = intra;
          opt.long_sequence = ls;
          CAPTURE(chunk);
          CAPTURE(int(intra));
          CAPTURE(int(ls));
          auto run = [&](auto const& be) {
            check_all(
                d, opt, [&](auto const& a, auto const& o) { dplr::forward(be, a, o); }, [&](auto const& a, auto const& o) { dplr::backward(be, a, o); },
                gr, d_o, dht);
          };
          if (ls == dplr::sequence_split::value_split && intra == dplr::intra_form::automatic) {
            run(cpu::serial{});
            run(cpu::simd<>{});
          }
          for (unsigned th : {2u, 3u, 5u}) {
            CAPTURE(th);
            run(cpu::threads<>(th));
          }
        }
      }
    }
  }
}

namespace {
// Maps of tokens [t0, t1) of every sequence of a non-packed problem.
struct span_maps {
  std::vector<double> M, N;
};
template <class Bk>
span_maps maps_of(data<double> const& d, index_t t0, index_t t1, index_t chunk, Bk const& bk, std::vector<double> const* d_o = nullptr) {
  auto const& s = d.s;
  views x(d);
  auto in = x.in();
  auto sub = [&](const_view<double, 4> v) { return v.sub(1, t0, t1 - t0); };
  strided<double, 4> M(A4{s.N(), s.H, s.K, s.K}, {1, 0, 2}, 2, -3), N(A4{s.N(), s.H, s.K, s.V}, {2, 0, 1}, 1, -3);
  dplr::options opt;
  opt.chunk_size = chunk;
  if (d_o) {
    strided<double, 4> dov(A4{s.B, s.T, s.H, s.V}, {2, 1, 0}, 1, NAN);
    dov.set(*d_o);
    dplr::segment_maps_transposed(bk,
                                  dplr::transposed_maps_args<double>{sub(in.q), sub(in.k), sub(in.v), sub(in.a), sub(in.b), sub(in.gk),
                                                                     const_view<double, 4>(dov.view).sub(1, t0, t1 - t0), M.view, N.view},
                                  opt);
  } else {
    dplr::segment_maps(bk, dplr::maps_args<double>{sub(in.q), sub(in.k), sub(in.v), sub(in.a), sub(in.b), sub(in.gk), M.view, N.view}, opt);
  }
  CHECK(M.padding_is(-3));
  CHECK(N.padding_is(-3));
  return {M.get(), N.get()};
}

const_view<double, 4> cv(std::vector<double> const& x, index_t n, index_t h, index_t r, index_t c) { return host_view(x.data(), n, h, r, c); }
tensor_view<double, 4> mv(std::vector<double>& x, index_t n, index_t h, index_t r, index_t c) { return host_view(x.data(), n, h, r, c); }
}  // namespace

TEST_CASE("dplr: segment maps of any split compose and apply to the one-pass state and state gradient") {
  // Four (sequence, head) pairs, and one (the threads backend then splits each span's map
  // over its threads: the single-sequence pipeline).
  for (shape const& s : {shape{.B = 2, .T = 37, .H = 2, .K = 4, .V = 3}, shape{.B = 1, .T = 37, .H = 1, .K = 3, .V = 5}}) {
  auto const d = random_dplr(s, 77);
  std::vector<double> o_ref, ht_ref;
  reference(d, o_ref, ht_ref);
  std::mt19937_64 rng(78);
  std::normal_distribution<double> nd(0, 1);
  std::vector<double> d_o(std::size_t(s.B * s.T * s.H * s.V)), dht(std::size_t(s.N() * s.H * s.K * s.V));
  for (auto& e : d_o) e = nd(rng);
  for (auto& e : dht) e = nd(rng);
  grads const gr = reference_grads(d, d_o, dht);
  index_t const NH = s.N() * s.H;
  for (auto const& cuts : std::vector<std::vector<index_t>>{{0, 37}, {0, 0, 37}, {0, 5, 5, 16, 17, 30, 37, 37}, {0, 1, 36, 37}, {0, 20, 37}}) {
    for (index_t chunk : {1, 6, 16, 64}) {
      CAPTURE(chunk);
      CAPTURE(cuts.size());
      auto run = [&](auto const& bk) {
        // Forward: compose (M, N) of the segments left to right, then apply to h0.
        std::vector<double> M(std::size_t(NH * s.K * s.K), 0), N(std::size_t(NH * s.K * s.V), 0);
        for (index_t i = 0; i < NH; ++i)
          for (index_t j = 0; j < s.K; ++j) M[std::size_t((i * s.K + j) * s.K + j)] = 1;
        for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
          auto seg = maps_of(d, cuts[c], cuts[c + 1], chunk, bk);
          std::vector<double> M2(M.size()), N2(N.size());
          dplr::compose_maps(bk, dplr::compose_args<double>{cv(seg.M, s.N(), s.H, s.K, s.K), cv(seg.N, s.N(), s.H, s.K, s.V), cv(M, s.N(), s.H, s.K, s.K),
                                                            cv(N, s.N(), s.H, s.K, s.V), mv(M2, s.N(), s.H, s.K, s.K), mv(N2, s.N(), s.H, s.K, s.V)});
          M.swap(M2), N.swap(N2);
        }
        std::vector<double> ht(N.size());
        dplr::apply_map(bk, dplr::apply_args<double>{cv(M, s.N(), s.H, s.K, s.K), cv(N, s.N(), s.H, s.K, s.V), cv(d.h0, s.N(), s.H, s.K, s.V),
                                                     mv(ht, s.N(), s.H, s.K, s.V)});
        CHECK(rel_rms(ht, ht_ref) <= 1e-12);
        // In place over N.
        dplr::apply_map(bk, dplr::apply_args<double>{cv(M, s.N(), s.H, s.K, s.K), cv(N, s.N(), s.H, s.K, s.V), cv(d.h0, s.N(), s.H, s.K, s.V),
                                                     mv(N, s.N(), s.H, s.K, s.V)});
        CHECK(rel_rms(N, ht_ref) <= 1e-12);
        // Backward: dS_in = Mt dS_out + G; compose from the last segment to the first.
        std::vector<double> Mt(M.size(), 0), G(N.size(), 0);
        for (index_t i = 0; i < NH; ++i)
          for (index_t j = 0; j < s.K; ++j) Mt[std::size_t((i * s.K + j) * s.K + j)] = 1;
        for (std::size_t c = cuts.size() - 1; c-- > 0;) {
          auto seg = maps_of(d, cuts[c], cuts[c + 1], chunk, bk, &d_o);
          // (Mt_seg, G_seg) after (Mt, G): dS_in = Mt_seg (Mt dS + G) + G_seg.
          std::vector<double> M2(Mt.size()), G2(G.size());
          dplr::compose_maps(bk, dplr::compose_args<double>{cv(seg.M, s.N(), s.H, s.K, s.K), cv(seg.N, s.N(), s.H, s.K, s.V), cv(Mt, s.N(), s.H, s.K, s.K),
                                                            cv(G, s.N(), s.H, s.K, s.V), mv(M2, s.N(), s.H, s.K, s.K), mv(G2, s.N(), s.H, s.K, s.V)});
          Mt.swap(M2), G.swap(G2);
        }
        std::vector<double> dh0(G.size());
        dplr::apply_map(bk, dplr::apply_args<double>{cv(Mt, s.N(), s.H, s.K, s.K), cv(G, s.N(), s.H, s.K, s.V), cv(dht, s.N(), s.H, s.K, s.V),
                                                     mv(dh0, s.N(), s.H, s.K, s.V)});
        CHECK(rel_rms(dh0, gr.dh0) <= 1e-11);
      };
      run(cpu::serial{});
      run(cpu::threads<>(3));
    }
  }
  }
}

TEST_CASE("dplr: maps of packed sequences equal the per-sequence states (empty and length-1 sequences)") {
  shape const s{.B = 1, .T = 50, .H = 2, .K = 3, .V = 4, .cu = {0, 0, 1, 25, 25, 50}};
  auto const d = random_dplr(s, 91);
  std::vector<double> o_ref, ht_ref;
  reference(d, o_ref, ht_ref);
  views x(d);
  for (index_t chunk : {1, 7, 64})
    for (unsigned th : {1u, 4u}) {
      auto opt = options_for(s, chunk);
      strided<double, 4> M(A4{s.N(), s.H, s.K, s.K}, {2, 1, 0}, 1, -3), N(A4{s.N(), s.H, s.K, s.V}, {1, 0, 2}, 3, -3);
      auto const in = x.in();
      dplr::segment_maps(cpu::threads<>(th), dplr::maps_args<double>{in.q, in.k, in.v, in.a, in.b, in.gk, M.view, N.view}, opt);
      std::vector<double> ht(std::size_t(s.N() * s.H * s.K * s.V));
      auto Mv = M.get(), Nv = N.get();
      dplr::apply_map(cpu::serial{}, dplr::apply_args<double>{cv(Mv, s.N(), s.H, s.K, s.K), cv(Nv, s.N(), s.H, s.K, s.V), cv(d.h0, s.N(), s.H, s.K, s.V),
                                                              mv(ht, s.N(), s.H, s.K, s.V)});
      CHECK(rel_rms(ht, ht_ref) <= 1e-12);
      CHECK(M.padding_is(-3));
      CHECK(N.padding_is(-3));
    }
}

TEST_CASE("dplr: KDA segment maps with grouped value heads equal the KDA recurrence") {
  // KDA written as DPLR per the spec (4.4): a = e^g k, b = -beta k, v' = beta v; h0 via the map.
  index_t const B = 2, T = 23, H = 2, HV = 6, K = 5, V = 3;
  std::mt19937_64 rng(5);
  std::normal_distribution<double> nd(0, 1);
  std::uniform_real_distribution<double> ud(0, 1);
  std::vector<double> q(std::size_t(B * T * H * K)), k(q.size()), v(std::size_t(B * T * HV * V)), g(std::size_t(B * T * HV * K)),
      beta(std::size_t(B * T * HV)), h0(std::size_t(B * HV * K * V));
  for (auto* x : {&q, &k, &v, &h0}) for (auto& e : *x) e = 0.5 * nd(rng);
  for (auto& e : g) e = -0.5 * ud(rng);
  for (auto& e : beta) e = ud(rng);
  // The expected final state: the KDA recurrence, written out here.
  std::vector<double> ht_ref = h0;
  for (index_t b = 0; b < B; ++b)
    for (index_t hv = 0; hv < HV; ++hv) {
      double* S = &ht_ref[std::size_t((b * HV + hv) * K * V)];
      index_t const h = hv / (HV / H);
      for (index_t t = 0; t < T; ++t) {
        double const* kk = &k[std::size_t(((b * T + t) * H + h) * K)];
        for (index_t i = 0; i < K; ++i)
          for (index_t j = 0; j < V; ++j) S[i * V + j] *= std::exp(g[std::size_t(((b * T + t) * HV + hv) * K + i)]);
        for (index_t j = 0; j < V; ++j) {
          double p = 0;
          for (index_t i = 0; i < K; ++i) p += S[i * V + j] * kk[i];
          double const u = beta[std::size_t((b * T + t) * HV + hv)] * (v[std::size_t(((b * T + t) * HV + hv) * V + j)] - p);
          for (index_t i = 0; i < K; ++i) S[i * V + j] += kk[i] * u;
        }
      }
    }
  dplr::kda_inputs<double> in{host_view(static_cast<double const*>(q.data()), B, T, H, K), host_view(static_cast<double const*>(k.data()), B, T, H, K),
                              host_view(static_cast<double const*>(v.data()), B, T, HV, V), host_view(static_cast<double const*>(g.data()), B, T, HV, K),
                              host_view(static_cast<double const*>(beta.data()), B, T, HV), {}};
  for (index_t chunk : {3, 64}) {
    std::vector<double> M(std::size_t(B * HV * K * K)), N(std::size_t(B * HV * K * V)), ht(N.size());
    dplr::options opt;
    opt.chunk_size = chunk;
    dplr::kda_segment_maps(cpu::threads<>(3), dplr::kda_maps_args<double>{in.q, in.k, in.v, in.g, in.beta, mv(M, B, HV, K, K), mv(N, B, HV, K, V)}, opt);
    dplr::apply_map(cpu::serial{}, dplr::apply_args<double>{cv(M, B, HV, K, K), cv(N, B, HV, K, V), cv(h0, B, HV, K, V), mv(ht, B, HV, K, V)});
    CHECK(rel_rms(ht, ht_ref) <= 1e-12);
  }
}

TEST_CASE("dplr: context-parallel entry points on one process equal the reference") {
  shape const s{.B = 2, .T = 30, .H = 1, .K = 4, .V = 2};
  auto const d = random_dplr(s, 31);
  std::mt19937_64 rng(32);
  std::normal_distribution<double> nd(0, 1);
  std::vector<double> d_o(std::size_t(s.B * s.T * s.H * s.V)), dht(std::size_t(s.N() * s.H * s.K * s.V));
  for (auto& e : d_o) e = nd(rng);
  for (auto& e : dht) e = nd(rng);
  grads const gr = reference_grads(d, d_o, dht);
  single_process comm;
  check_all(
      d, options_for(s, 7),
      [&](auto const& a, auto const& o) {
        dplr::forward(cpu::threads<>(2), dplr::cp_forward_args<double, single_process>{&comm, a.q, a.k, a.v, a.a, a.b, a.gk, a.h0, a.o, a.ht}, o);
      },
      [&](auto const& a, auto const& o) {
        dplr::backward(cpu::threads<>(2),
                       dplr::cp_backward_args<double, single_process>{&comm, a.q, a.k, a.v, a.a, a.b, a.gk, a.h0, a.d_o, a.dht, a.dq, a.dk, a.dv, a.da,
                                                                      a.db, a.dgk, a.dh0},
                       o);
      },
      gr, d_o, dht);
}

TEST_CASE("dplr: IPLR entry points (gk = 0) on padded views, chunked on every backend and recurrent") {
  for (auto const& s : {shape{.B = 2, .T = 19, .H = 2, .K = 4, .V = 3}, shape{.B = 1, .T = 33, .H = 1, .K = 5, .V = 2, .cu = {0, 1, 1, 33}}}) {
    auto d = random_dplr(s, 55);
    std::fill(d.gk.begin(), d.gk.end(), 0.0);
    std::mt19937_64 rng(56);
    std::normal_distribution<double> nd(0, 1);
    std::vector<double> d_o(std::size_t(s.B * s.T * s.H * s.V)), dht(std::size_t(s.N() * s.H * s.K * s.V));
    for (auto& e : d_o) e = nd(rng);
    for (auto& e : dht) e = nd(rng);
    grads gr = reference_grads(d, d_o, dht);
    // IPLR has no gate gradient: the checks compare dgk with this (the call leaves dgk alone).
    std::fill(gr.dgk.begin(), gr.dgk.end(), -3.0);
    auto as_iplr = [](dplr::forward_args<double> const& a) { return dplr::iplr_forward_args<double>{a.q, a.k, a.v, a.a, a.b, a.h0, a.o, a.ht}; };
    auto as_iplr_grads = [](dplr::backward_args<double> const& g) {
      return dplr::iplr_backward_args<double>{g.q, g.k, g.v, g.a, g.b, g.h0, g.d_o, g.dht, g.dq, g.dk, g.dv, g.da, g.db, g.dh0};
    };
    auto rec = options_for(s, 64);
    rec.mode = dplr::algorithm::recurrent;
    check_all(
        d, rec, [&](auto const& a, auto const& o) { dplr::forward(cpu::serial{}, as_iplr(a), o); },
        [&](auto const& a, auto const& o) { dplr::backward(cpu::serial{}, as_iplr_grads(a), o); }, gr, d_o, dht);
    for (index_t chunk : {5, 16}) {
      auto run = [&](auto const& be) {
        check_all(
            d, options_for(s, chunk), [&](auto const& a, auto const& o) { dplr::forward(be, as_iplr(a), o); },
            [&](auto const& a, auto const& o) { dplr::backward(be, as_iplr_grads(a), o); }, gr, d_o, dht);
      };
      run(cpu::serial{});
      run(cpu::simd<>{});
      run(cpu::threads<>(4));
    }
  }
}

namespace {
template <class A>
constexpr bool has_h0 = requires(A a) { a.h0; };
}  // namespace

TEST_CASE("dplr: segment maps take no h0 (a map does not depend on the entering state)") {
  // Regression: the maps once took the forward's inputs, h0 included, and rejected an h0 whose
  // shape was not the span's [N, H, K, V]; their args now have no h0 to give.
  static_assert(!has_h0<dplr::maps_args<double>> && !has_h0<dplr::transposed_maps_args<double>> && !has_h0<dplr::kda_maps_args<double>>);
  static_assert(has_h0<dplr::forward_args<double>>);  // the check itself sees a member
}
