// Segment transfer maps: composing the maps of random splits (inside chunks, empty
// segments) reproduces the recurrent state to 1e-12 in double; transposed maps reproduce the
// recurrent dh0; KDA maps through the DPLR mapping; float maps track double.
#include <doctest/doctest.h>

#include "dplr_test_util.hpp"

using namespace dplr_test;
using k3::index_t;

namespace {

template <class T>
k3::dplr::forward_args<T> span(k3::dplr::forward_args<T> in, index_t t0, index_t n) {
  in.q = in.q.sub(1, t0, n);
  in.k = in.k.sub(1, t0, n);
  in.v = in.v.sub(1, t0, n);
  in.a = in.a.sub(1, t0, n);
  in.b = in.b.sub(1, t0, n);
  in.gk = in.gk.sub(1, t0, n);
  in.h0 = {};
  return in;
}

std::vector<index_t> random_split(std::mt19937_64& rng, index_t T, int pieces) {
  std::uniform_int_distribution<index_t> u(0, T);
  std::vector<index_t> b = {0, T};
  for (int i = 0; i < pieces - 1; ++i) b.push_back(u(rng));
  b.push_back(b[2]);  // a duplicate cut: an empty segment
  std::sort(b.begin(), b.end());
  return b;
}

}  // namespace

TEST_CASE("composed segment maps reproduce the recurrent state (double, 1e-12)") {
  std::mt19937_64 rng(21);
  for (auto const& shape : std::vector<std::array<index_t, 4>>{{200, 16, 60, 64}, {65, 60, 16, 16}, {37, 5, 7, 8}, {130, 128, 100, 64}}) {
    index_t const T = shape[0], K = shape[1], V = shape[2], chunk = shape[3];  // (clang 14 cannot capture bindings)
    auto p = make<double>(rng, 2, T, 2, K, V);
    auto ref = run_fwd(p, recurrent_fwd(p.options()));
    auto bnd = random_split(rng, T, 4);
    index_t const NS = p.N * p.H;
    std::vector<double> M(NS * K * K, 0.0), N(NS * K * V, 0.0), Mi(M.size()), Ni(N.size()), Mc(M.size()), Nc(N.size());
    for (index_t i = 0; i < NS; ++i)
      for (index_t d = 0; d < K; ++d) M[i * K * K + d * K + d] = 1.0;  // identity map
    auto v4 = [&](std::vector<double>& x, index_t c) { return k3::host_view(x.data(), p.N, p.H, K, c); };
    auto c4 = [&](std::vector<double> const& x, index_t c) { return k3::host_view(x.data(), p.N, p.H, K, c); };
    for (std::size_t s = 0; s + 1 < bnd.size(); ++s) {
      index_t t0 = bnd[s], n = bnd[s + 1] - bnd[s];
      k3::dplr::segment_maps(k3::cpu::serial{}, maps_of(span(p.inputs(), t0, n), v4(Mi, K), v4(Ni, V)), p.options(chunk));
      k3::dplr::compose_maps(k3::cpu::serial{}, k3::dplr::compose_args<double>{c4(Mi, K), c4(Ni, V), c4(M, K), c4(N, V), v4(Mc, K), v4(Nc, V)});
      M.swap(Mc);
      N.swap(Nc);
      // the composed prefix applied to h0 equals the recurrent state after t0 + n tokens
      auto pp = p;
      pp.T_ = t0 + n;
      for (auto* x : {&pp.q, &pp.k, &pp.a, &pp.b, &pp.gk}) x->clear();
      pp.v.clear();
      for (index_t b = 0; b < p.B; ++b) {
        auto cp = [&](std::vector<double> const& src, std::vector<double>& dst, index_t D) {
          dst.insert(dst.end(), src.begin() + b * T * p.H * D, src.begin() + (b * T + t0 + n) * p.H * D);
        };
        cp(p.q, pp.q, K), cp(p.k, pp.k, K), cp(p.a, pp.a, K), cp(p.b, pp.b, K), cp(p.gk, pp.gk, K), cp(p.v, pp.v, V);
      }
      auto pre = run_fwd(pp, recurrent_fwd(pp.options()));
      std::vector<double> St(N.size());
      k3::dplr::apply_map(k3::cpu::serial{}, k3::dplr::apply_args<double>{c4(M, K), c4(N, V), c4(p.h0, V), v4(St, V)});
      INFO("T=" << T << " K=" << K << " V=" << V << " segment " << s << " [" << t0 << ", " << t0 + n << ")");
      CHECK(rel_err(St, pre.ht) < 1e-12);
    }
    std::vector<double> St(N.size());
    k3::dplr::apply_map(k3::cpu::serial{}, k3::dplr::apply_args<double>{c4(M, K), c4(N, V), c4(p.h0, V), v4(St, V)});
    CHECK(rel_err(St, ref.ht) < 1e-12);
  }
}

TEST_CASE("transposed maps give the recurrent state gradient, Mt = M^T") {
  std::mt19937_64 rng(22);
  auto p = make<double>(rng, 1, 90, 2, 12, 9, {0, 20, 20, 90});
  index_t const K = p.K, V = p.V, NS = p.N * p.H;
  auto dO = randn<double>(rng, p.nv());
  auto dht = randn<double>(rng, p.ns());
  auto g = run_bwd(p, dO, dht, recurrent_bwd(p.options()));
  std::vector<double> Mt(NS * K * K), G(NS * K * V), M(Mt.size()), N(G.size()), dS(G.size());
  auto v4 = [&](std::vector<double>& x, index_t c) { return k3::host_view(x.data(), p.N, p.H, K, c); };
  auto c4 = [&](std::vector<double> const& x, index_t c) { return k3::host_view(x.data(), p.N, p.H, K, c); };
  auto in = p.inputs();
  in.h0 = {};
  k3::dplr::segment_maps_transposed(k3::cpu::serial{}, transposed_maps_of(in, k3::host_view(dO.data(), p.B, p.T_, p.H, V), v4(Mt, K), v4(G, V)),
                                    p.options(16));
  k3::dplr::segment_maps(k3::cpu::serial{}, maps_of(in, v4(M, K), v4(N, V)), p.options(16));
  // dh0 = Mt dht + G, i.e. apply_map with (Mt, G)
  k3::dplr::apply_map(k3::cpu::serial{}, k3::dplr::apply_args<double>{c4(Mt, K), c4(G, V), c4(dht, V), v4(dS, V)});
  CHECK(rel_err(dS, g.dh0) < 1e-12);
  double e = 0;
  for (index_t s = 0; s < NS; ++s)
    for (index_t i = 0; i < K; ++i)
      for (index_t j = 0; j < K; ++j) e = std::max(e, std::abs(Mt[s * K * K + i * K + j] - M[s * K * K + j * K + i]));
  CHECK(e < 1e-12);
}

TEST_CASE("float maps track the double maps") {
  std::mt19937_64 rng(23);
  auto pd = make<double>(rng, 1, 300, 1, 32, 32);
  problem<float> pf;
  pf.B = pd.B, pf.T_ = pd.T_, pf.H = pd.H, pf.K = pd.K, pf.V = pd.V, pf.N = pd.N;
  auto cvt = [](auto const& x) { return std::vector<float>(x.begin(), x.end()); };
  pf.q = cvt(pd.q), pf.k = cvt(pd.k), pf.v = cvt(pd.v), pf.a = cvt(pd.a), pf.b = cvt(pd.b), pf.gk = cvt(pd.gk);
  std::vector<double> Md(32 * 32), Nd(32 * 32);
  std::vector<float> Mf(32 * 32), Nf(32 * 32);
  k3::dplr::segment_maps(k3::cpu::serial{}, maps_of(pd.inputs(), k3::host_view(Md.data(), 1, 1, 32, 32), k3::host_view(Nd.data(), 1, 1, 32, 32)),
                         pd.options());
  k3::dplr::segment_maps(k3::cpu::serial{}, maps_of(pf.inputs(), k3::host_view(Mf.data(), 1, 1, 32, 32), k3::host_view(Nf.data(), 1, 1, 32, 32)),
                         pf.options());
  CHECK(rel_err(Mf, Md) < 1e-4);
  CHECK(rel_err(Nf, Nd) < 1e-4);
}

TEST_CASE("map arguments are checked") {
  std::vector<double> a(16), b(16), c(16);
  auto m = k3::host_view(a.data(), 1, 1, 4, 4);
  auto bad = k3::host_view(b.data(), 1, 1, 4, 3);
  k3::cpu::serial const one;
  CHECK_THROWS_AS(
      k3::dplr::compose_maps(one, k3::dplr::compose_args<double>{m, m, m, bad, k3::host_view(c.data(), 1, 1, 4, 4), k3::host_view(b.data(), 1, 1, 4, 4)}),
      k3::error);
  CHECK_THROWS_AS(k3::dplr::apply_map(one, k3::dplr::apply_args<double>{m, m, m, m}), k3::error);  // S_out aliases S_in
}
