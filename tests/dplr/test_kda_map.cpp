// KDA as DPLR: the mapped DPLR (recurrent and chunked) equals a float64 KDA recurrence
// written here, and the DPLR gradients folded back by kda_as_dplr match finite differences
// of that KDA recurrence, with grouped value heads. KDA segment maps compose to the state.
#include <doctest/doctest.h>

#include "dplr_test_util.hpp"

using namespace dplr_test;
using k3::index_t;

namespace {

struct kda_problem {
  index_t B, T, H, HV, K, V;
  std::vector<double> q, k, v, g, beta, h0;
  k3::dplr::kda_inputs<double> inputs() const {
    return {k3::host_view(q.data(), B, T, H, K), k3::host_view(k.data(), B, T, H, K), k3::host_view(v.data(), B, T, HV, V),
            k3::host_view(g.data(), B, T, HV, K), k3::host_view(beta.data(), B, T, HV), k3::host_view(h0.data(), B, HV, K, V)};
  }
};

kda_problem make_kda(std::mt19937_64& rng, index_t B, index_t T, index_t H, index_t HV, index_t K, index_t V) {
  kda_problem p{B, T, H, HV, K, V, {}, {}, {}, {}, {}, {}};
  std::normal_distribution<double> n01;
  std::uniform_real_distribution<double> u01;
  p.q = randn<double>(rng, B * T * H * K);
  p.k.resize(B * T * H * K);
  for (index_t r = 0; r < B * T * H; ++r) {  // L2-normalised keys, as KDA uses them
    double s = 0;
    for (index_t i = 0; i < K; ++i) s += (p.k[r * K + i] = n01(rng)) * p.k[r * K + i];
    for (index_t i = 0; i < K; ++i) p.k[r * K + i] /= std::sqrt(s);
  }
  p.v = randn<double>(rng, B * T * HV * V);
  p.g.resize(B * T * HV * K);
  for (auto& x : p.g) x = -std::log1p(std::exp(-n01(rng))) / 4;
  p.beta.resize(B * T * HV);
  for (auto& x : p.beta) x = u01(rng);
  p.h0 = randn<double>(rng, B * HV * K * V, 0.5);
  return p;
}

// S' = Diag(e^g) S;  S = S' + beta k (v - S'^T k)^T;  o = S^T (scale q)
double kda_naive(kda_problem const& p, std::vector<double>& o, std::vector<double>& ht, std::vector<double> const* dO = nullptr,
                 std::vector<double> const* dht = nullptr) {
  index_t K = p.K, V = p.V, G = p.HV / p.H;
  double scale = 1 / std::sqrt(double(K)), L = 0;
  o.assign(p.B * p.T * p.HV * V, 0.0);
  ht.assign(p.B * p.HV * K * V, 0.0);
  for (index_t b = 0; b < p.B; ++b)
    for (index_t hv = 0; hv < p.HV; ++hv) {
      index_t h = hv / G;
      std::vector<double> S(p.h0.begin() + (b * p.HV + hv) * K * V, p.h0.begin() + (b * p.HV + hv + 1) * K * V);
      for (index_t t = 0; t < p.T; ++t) {
        double const* kt = &p.k[((b * p.T + t) * p.H + h) * K];
        double const* qt = &p.q[((b * p.T + t) * p.H + h) * K];
        double const* gt = &p.g[((b * p.T + t) * p.HV + hv) * K];
        double const* vt = &p.v[((b * p.T + t) * p.HV + hv) * V];
        double beta = p.beta[(b * p.T + t) * p.HV + hv];
        for (index_t i = 0; i < K; ++i)
          for (index_t j = 0; j < V; ++j) S[i * V + j] *= std::exp(gt[i]);
        for (index_t j = 0; j < V; ++j) {
          double pred = 0;
          for (index_t i = 0; i < K; ++i) pred += S[i * V + j] * kt[i];
          double u = beta * (vt[j] - pred);
          for (index_t i = 0; i < K; ++i) S[i * V + j] += kt[i] * u;
        }
        for (index_t j = 0; j < V; ++j) {
          double s = 0;
          for (index_t i = 0; i < K; ++i) s += scale * qt[i] * S[i * V + j];
          o[((b * p.T + t) * p.HV + hv) * V + j] = s;
        }
      }
      std::copy(S.begin(), S.end(), ht.begin() + (b * p.HV + hv) * K * V);
    }
  if (dO)
    for (std::size_t i = 0; i < o.size(); ++i) L += o[i] * (*dO)[i];
  if (dht)
    for (std::size_t i = 0; i < ht.size(); ++i) L += ht[i] * (*dht)[i];
  return L;
}

}  // namespace

TEST_CASE("KDA through the DPLR mapping equals the KDA recurrence (GVA)") {
  std::mt19937_64 rng(31);
  for (auto [H, HV, T, K, V] : std::vector<std::array<index_t, 5>>{{1, 1, 20, 8, 6}, {2, 4, 65, 16, 12}, {1, 3, 33, 7, 5}}) {
    auto p = make_kda(rng, 2, T, H, HV, K, V);
    std::vector<double> oref, htref;
    kda_naive(p, oref, htref);
    k3::dplr::kda_as_dplr<double> m(p.inputs());
    std::vector<double> o(oref.size()), ht(htref.size());
    auto args = m.forward_inputs();
    args.o = k3::host_view(o.data(), p.B, p.T, HV, V);
    args.ht = k3::host_view(ht.data(), p.B, HV, K, V);
    k3::dplr::forward(k3::cpu::serial{}, args, recurrent({}));
    CHECK(rel_err(o, oref) < 1e-13);
    CHECK(rel_err(ht, htref) < 1e-13);
    k3::dplr::options opt;
    opt.chunk_size = 16;
    k3::dplr::forward(k3::cpu::serial{}, args, opt);
    CHECK(rel_err(o, oref) < 1e-12);
    CHECK(rel_err(ht, htref) < 1e-12);
  }
}

TEST_CASE("KDA gradients folded back from DPLR match finite differences of the KDA recurrence") {
  std::mt19937_64 rng(32);
  auto p = make_kda(rng, 1, 13, 2, 4, 5, 3);
  std::vector<double> o, ht;
  kda_naive(p, o, ht);
  auto dO = randn<double>(rng, o.size());
  auto dht = randn<double>(rng, ht.size());
  k3::dplr::kda_as_dplr<double> m(p.inputs());
  index_t B = p.B, T = p.T, HV = p.HV, K = p.K, V = p.V;
  std::vector<double> dq(B * T * HV * K), dk(dq.size()), da(dq.size()), db(dq.size()), dgk(dq.size()), dv(B * T * HV * V), dh0(ht.size());
  auto vk = [&](std::vector<double>& x) { return k3::host_view(x.data(), B, T, HV, K); };
  auto g = m.backward_inputs();
  g.d_o = k3::host_view(dO.data(), B, T, HV, V);
  g.dht = k3::host_view(dht.data(), B, HV, K, V);
  g.dq = vk(dq), g.dk = vk(dk), g.dv = k3::host_view(dv.data(), B, T, HV, V), g.da = vk(da), g.db = vk(db), g.dgk = vk(dgk);
  g.dh0 = k3::host_view(dh0.data(), B, HV, K, V);
  k3::dplr::options opt;
  opt.chunk_size = 4;
  k3::dplr::backward(k3::cpu::serial{}, g, opt);
  std::vector<double> Dq(p.q.size()), Dk(p.k.size()), Dv(p.v.size()), Dg(p.g.size()), Dbeta(p.beta.size());
  m.grads_to_kda(g, k3::dplr::kda_grads<double>{k3::host_view(Dq.data(), B, T, p.H, K), k3::host_view(Dk.data(), B, T, p.H, K),
                                          k3::host_view(Dv.data(), B, T, HV, V), k3::host_view(Dg.data(), B, T, HV, K),
                                          k3::host_view(Dbeta.data(), B, T, HV)});
  double const eps = 1e-6;
  auto check = [&](std::vector<double>& x, std::vector<double> const& grad, char const* name) {
    double worst = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      double x0 = x[i], a, b;
      std::vector<double> oo, hh;
      x[i] = x0 + eps;
      a = kda_naive(p, oo, hh, &dO, &dht);
      x[i] = x0 - eps;
      b = kda_naive(p, oo, hh, &dO, &dht);
      x[i] = x0;
      double fd = (a - b) / (2 * eps);
      worst = std::max(worst, std::abs(fd - grad[i]) / std::max(1.0, std::abs(fd)));
    }
    INFO(name);
    CHECK(worst < 1e-7);
  };
  check(p.q, Dq, "dq");
  check(p.k, Dk, "dk");
  check(p.v, Dv, "dv");
  check(p.g, Dg, "dg");
  check(p.beta, Dbeta, "dbeta");
  check(p.h0, dh0, "dh0");
}

TEST_CASE("KDA segment maps compose to the KDA state") {
  std::mt19937_64 rng(33);
  auto p = make_kda(rng, 1, 50, 1, 2, 8, 6);
  std::vector<double> o, ht;
  kda_naive(p, o, ht);
  index_t K = p.K, V = p.V, HV = p.HV;
  std::vector<index_t> cuts = {0, 7, 7, 31, 50};
  std::vector<double> S(p.h0), S2(S.size()), M(HV * K * K), N(HV * K * V);
  for (std::size_t s = 0; s + 1 < cuts.size(); ++s) {
    auto in = p.inputs();
    index_t t0 = cuts[s], n = cuts[s + 1] - cuts[s];
    in.q = in.q.sub(1, t0, n), in.k = in.k.sub(1, t0, n), in.v = in.v.sub(1, t0, n), in.g = in.g.sub(1, t0, n), in.beta = in.beta.sub(1, t0, n);
    k3::dplr::options opt;
    opt.chunk_size = 16;
    k3::dplr::kda_segment_maps(k3::cpu::serial{},
                               k3::dplr::kda_maps_args<double>{in.q, in.k, in.v, in.g, in.beta, k3::host_view(M.data(), 1, HV, K, K),
                                                               k3::host_view(N.data(), 1, HV, K, V)},
                               opt);
    k3::dplr::apply_map(k3::cpu::serial{}, k3::dplr::apply_args<double>{k3::host_view(M.data(), 1, HV, K, K), k3::host_view(N.data(), 1, HV, K, V),
                                                                         k3::host_view(S.data(), 1, HV, K, V), k3::host_view(S2.data(), 1, HV, K, V)});
    S.swap(S2);
  }
  CHECK(rel_err(S, ht) < 1e-12);
}

TEST_CASE("KDA mapping checks its arguments") {
  std::mt19937_64 rng(34);
  auto p = make_kda(rng, 1, 4, 2, 3, 4, 2);  // HV = 3 is not a multiple of H = 2
  try {
    k3::dplr::kda_as_dplr<double> m(p.inputs());
    FAIL("no throw");
  } catch (k3::error const& e) {
    CHECK(std::string(e.what()).find("multiple") != std::string::npos);
  }
  auto p2 = make_kda(rng, 1, 4, 1, 2, 4, 2);
  auto in = p2.inputs();
  in.beta = k3::host_view(p2.beta.data(), 1, 4, 1);
  CHECK_THROWS_WITH_AS(k3::dplr::kda_as_dplr<double>{in}, doctest::Contains("'beta'"), k3::error);
}
