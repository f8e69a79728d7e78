// The token-by-token DPLR reference: against an explicit-matrix recurrence written here,
// finite differences for every gradient, IPLR, varlen with empty sequences, input checks.
#include <doctest/doctest.h>

#include <string>

#include "dplr_test_util.hpp"

using namespace dplr_test;
using k3::index_t;

namespace {

// S_t = P_t S_{t-1} + k v^T with P_t = Diag(e^gk) + b a^T formed explicitly.
fwd_result<double> naive(problem<double> const& p, double scale) {
  fwd_result<double> r;
  r.o.assign(p.nv(), 0.0);
  r.ht.assign(p.ns(), 0.0);
  std::vector<std::array<index_t, 3>> seqs;  // batch, bos, eos
  if (p.cu.empty())
    for (index_t b = 0; b < p.B; ++b) seqs.push_back({b, 0, p.T_});
  else
    for (std::size_t i = 0; i + 1 < p.cu.size(); ++i) seqs.push_back({0, p.cu[i], p.cu[i + 1]});
  index_t K = p.K, V = p.V, H = p.H;
  auto at = [&](std::vector<double> const& x, index_t b, index_t t, index_t h, index_t D, index_t d) {
    return x[((b * p.T_ + t) * H + h) * D + d];
  };
  for (std::size_t n = 0; n < seqs.size(); ++n) {
    auto [bb, bos, eos] = seqs[n];
    for (index_t h = 0; h < H; ++h) {
      std::vector<double> S(K * V), Pm(K * K), S2(K * V);
      for (index_t i = 0; i < K * V; ++i) S[i] = p.with_h0 ? p.h0[(n * H + h) * K * V + i] : 0.0;
      for (index_t t = bos; t < eos; ++t) {
        for (index_t i = 0; i < K; ++i)
          for (index_t j = 0; j < K; ++j)
            Pm[i * K + j] = (i == j ? std::exp(at(p.gk, bb, t, h, K, i)) : 0.0) + at(p.b, bb, t, h, K, i) * at(p.a, bb, t, h, K, j);
        for (index_t i = 0; i < K; ++i)
          for (index_t j = 0; j < V; ++j) {
            double s = at(p.k, bb, t, h, K, i) * at(p.v, bb, t, h, V, j);
            for (index_t m = 0; m < K; ++m) s += Pm[i * K + m] * S[m * V + j];
            S2[i * V + j] = s;
          }
        S = S2;
        for (index_t j = 0; j < V; ++j) {
          double s = 0;
          for (index_t i = 0; i < K; ++i) s += scale * at(p.q, bb, t, h, K, i) * S[i * V + j];
          r.o[((bb * p.T_ + t) * H + h) * V + j] = s;
        }
      }
      for (index_t i = 0; i < K * V; ++i) r.ht[(n * H + h) * K * V + i] = S[i];
    }
  }
  return r;
}

double loss(problem<double> const& p, std::vector<double> const& dO, std::vector<double> const& dht) {
  auto r = run_fwd(p, recurrent_fwd(p.options()));
  double l = 0;
  for (std::size_t i = 0; i < dO.size(); ++i) l += r.o[i] * dO[i];
  for (std::size_t i = 0; i < dht.size(); ++i) l += r.ht[i] * dht[i];
  return l;
}

}  // namespace

TEST_CASE("recurrent DPLR matches the explicit-matrix recurrence") {
  std::mt19937_64 rng(1);
  struct shape {
    index_t B, T, H, K, V;
    std::vector<std::int64_t> cu;
  };
  for (auto const& s : std::vector<shape>{{1, 1, 1, 1, 1, {}},
                                          {2, 7, 3, 5, 4, {}},
                                          {1, 20, 2, 8, 3, {0, 3, 3, 11, 20}},
                                          {1, 9, 1, 4, 6, {0, 0, 9}},
                                          {3, 0, 2, 3, 2, {}}}) {
    for (bool generic : {false, true}) {
      auto p = make<double>(rng, s.B, s.T, s.H, s.K, s.V, s.cu, true, gate::normal, generic);
      auto ref = naive(p, 1.0 / std::sqrt(double(s.K)));
      auto got = run_fwd(p, recurrent_fwd(p.options()));
      CHECK(max_err(got, ref) < 1e-13);
    }
  }
}

TEST_CASE("recurrent DPLR float agrees with double") {
  std::mt19937_64 rng(2);
  auto pd = make<double>(rng, 2, 33, 2, 16, 12);
  problem<float> pf;
  pf.B = pd.B, pf.T_ = pd.T_, pf.H = pd.H, pf.K = pd.K, pf.V = pd.V, pf.N = pd.N, pf.with_h0 = true;
  auto cvt = [](auto const& x) { return std::vector<float>(x.begin(), x.end()); };
  pf.q = cvt(pd.q), pf.k = cvt(pd.k), pf.v = cvt(pd.v), pf.a = cvt(pd.a), pf.b = cvt(pd.b), pf.gk = cvt(pd.gk), pf.h0 = cvt(pd.h0);
  auto rd = run_fwd(pd, recurrent_fwd(pd.options()));
  auto rf = run_fwd(pf, recurrent_fwd(pf.options()));
  CHECK(rel_err(rf.o, rd.o) < 1e-4);
  CHECK(rel_err(rf.ht, rd.ht) < 1e-4);
}

TEST_CASE("recurrent DPLR backward matches central finite differences") {
  std::mt19937_64 rng(3);
  struct shape {
    index_t B, T, H, K, V;
    std::vector<std::int64_t> cu;
  };
  for (auto const& s : std::vector<shape>{{1, 5, 1, 3, 2, {}}, {2, 4, 2, 2, 3, {}}, {1, 7, 1, 3, 2, {0, 2, 2, 7}}}) {
    auto p = make<double>(rng, s.B, s.T, s.H, s.K, s.V, s.cu, true, gate::normal, true);
    auto dO = randn<double>(rng, p.nv());
    auto dht = randn<double>(rng, p.ns());
    auto g = run_bwd(p, dO, dht, recurrent_bwd(p.options()));
    double const eps = 1e-6;
    auto check = [&](std::vector<double>& x, std::vector<double> const& grad, char const* name) {
      double worst = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        double x0 = x[i];
        x[i] = x0 + eps;
        double lp = loss(p, dO, dht);
        x[i] = x0 - eps;
        double lm = loss(p, dO, dht);
        x[i] = x0;
        double fd = (lp - lm) / (2 * eps);
        worst = std::max(worst, std::abs(fd - grad[i]) / std::max(1.0, std::abs(fd)));
      }
      INFO(name);
      CHECK(worst < 1e-7);
    };
    check(p.q, g.dq, "dq");
    check(p.k, g.dk, "dk");
    check(p.v, g.dv, "dv");
    check(p.a, g.da, "da");
    check(p.b, g.db, "db");
    check(p.gk, g.dgk, "dgk");
    check(p.h0, g.dh0, "dh0");
  }
}

TEST_CASE("recurrent backward checkpointing: long sequence equals short-block replay") {
  // T > the 64-token checkpoint block, so the recompute-from-checkpoint path runs.
  std::mt19937_64 rng(4);
  auto p = make<double>(rng, 1, 150, 1, 4, 3);
  auto dO = randn<double>(rng, p.nv());
  auto dht = randn<double>(rng, p.ns());
  auto g = run_bwd(p, dO, dht, recurrent_bwd(p.options()));
  // directional derivative along a random direction in every input
  double const eps = 1e-6;
  auto dir = randn<double>(rng, p.nk());
  double analytic = 0;
  for (std::size_t i = 0; i < dir.size(); ++i) analytic += dir[i] * (g.dq[i] + g.dk[i] + g.da[i] + g.db[i] + g.dgk[i]);
  auto shift = [&](double s) {
    auto q = p;
    for (std::size_t i = 0; i < dir.size(); ++i) {
      q.q[i] += s * dir[i];
      q.k[i] += s * dir[i];
      q.a[i] += s * dir[i];
      q.b[i] += s * dir[i];
      q.gk[i] += s * dir[i];
    }
    return loss(q, dO, dht);
  };
  double fd = (shift(eps) - shift(-eps)) / (2 * eps);
  CHECK(std::abs(fd - analytic) < 1e-6 * std::max(1.0, std::abs(fd)));
}

TEST_CASE("IPLR is DPLR with gk = 0") {
  std::mt19937_64 rng(5);
  auto p = make<double>(rng, 2, 19, 2, 6, 5, {}, true, gate::zero);
  auto ref = naive(p, 1.0 / std::sqrt(6.0));
  std::vector<double> o(p.nv()), ht(p.ns());
  auto in = p.inputs();
  k3::dplr::iplr_forward_args<double> ii{in.q, in.k, in.v, in.a, in.b, in.h0, k3::host_view(o.data(), p.B, p.T_, p.H, p.V),
                                         k3::host_view(ht.data(), p.N, p.H, p.K, p.V)};
  k3::dplr::forward(k3::cpu::serial{}, ii, recurrent({}));
  CHECK(rel_err(o, ref.o) < 1e-13);
  CHECK(rel_err(ht, ref.ht) < 1e-13);
  std::fill(o.begin(), o.end(), 0.0);
  k3::dplr::forward(k3::cpu::serial{}, ii, p.options(8));
  CHECK(rel_err(o, ref.o) < 1e-12);
  // gradients agree with DPLR's (gk = 0)
  auto dO = randn<double>(rng, p.nv());
  auto dht = randn<double>(rng, p.ns());
  auto g = run_bwd(p, dO, dht, recurrent_bwd(p.options()));
  std::vector<double> dq(p.nk()), dk(p.nk()), dv(p.nv()), da(p.nk()), db(p.nk()), dh0(p.ns());
  auto v4 = [&](std::vector<double>& x, index_t D) { return k3::host_view(x.data(), p.B, p.T_, p.H, D); };
  k3::dplr::iplr_backward_args<double> ig{in.q, in.k, in.v, in.a, in.b, in.h0, k3::host_view(dO.data(), p.B, p.T_, p.H, p.V),
                                          k3::host_view(dht.data(), p.N, p.H, p.K, p.V)};
  ig.dq = v4(dq, p.K), ig.dk = v4(dk, p.K), ig.dv = v4(dv, p.V), ig.da = v4(da, p.K), ig.db = v4(db, p.K);
  ig.dh0 = k3::host_view(dh0.data(), p.N, p.H, p.K, p.V);
  k3::dplr::backward(k3::cpu::serial{}, ig, p.options(8));
  CHECK(rel_err(dq, g.dq) < 1e-12);
  CHECK(rel_err(dk, g.dk) < 1e-12);
  CHECK(rel_err(dv, g.dv) < 1e-12);
  CHECK(rel_err(da, g.da) < 1e-12);
  CHECK(rel_err(db, g.db) < 1e-12);
  CHECK(rel_err(dh0, g.dh0) < 1e-12);
}

TEST_CASE("empty sequences pass h0 through, zero dht and do give zero gradients") {
  std::mt19937_64 rng(6);
  auto p = make<double>(rng, 1, 4, 1, 3, 2, {0, 0, 4, 4});
  auto r = run_fwd(p, recurrent_fwd(p.options()));
  for (index_t i = 0; i < p.K * p.V; ++i) {
    CHECK(r.ht[i] == p.h0[i]);
    CHECK(r.ht[2 * p.K * p.V + i] == p.h0[2 * p.K * p.V + i]);
  }
  std::vector<double> dO(p.nv(), 0.0), dht(p.ns(), 0.0);
  auto g = run_bwd(p, dO, dht, recurrent_bwd(p.options()));
  for (double x : g.dq) CHECK(x == 0.0);
  for (double x : g.dh0) CHECK(x == 0.0);
}

TEST_CASE("bad inputs throw k3::error naming the argument") {
  std::mt19937_64 rng(7);
  auto p = make<double>(rng, 1, 6, 2, 4, 3);
  std::vector<double> o(p.nv()), ht(p.ns());
  auto in = p.inputs();
  in.o = k3::host_view(o.data(), 1, 6, 2, 3);
  in.ht = k3::host_view(ht.data(), 1, 2, 4, 3);
  auto const rec = recurrent({});
  auto expect = [&](auto&& f, std::string const& what) {
    try {
      f();
      FAIL("no throw: " << what);
    } catch (k3::error const& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  k3::cpu::serial const one;
  auto bad = in;
  bad.a = k3::host_view(p.a.data(), 1, 6, 2, 3);
  expect([&] { k3::dplr::forward(one, bad, rec); }, "'a'");
  bad = in;
  bad.gk = k3::host_view(p.gk.data(), 1, 5, 2, 4);
  expect([&] { k3::dplr::forward(one, bad); }, "'gk'");
  bad = in;
  bad.h0 = k3::host_view(p.h0.data(), 1, 2, 3, 4);
  expect([&] { k3::dplr::forward(one, bad, rec); }, "'h0'");
  auto out2 = in;
  out2.o = k3::host_view(o.data(), 1, 6, 2, 2);
  expect([&] { k3::dplr::forward(one, out2, rec); }, "'o'");
  out2 = in;
  out2.ht = k3::host_view(ht.data(), 2, 2, 4, 3);
  expect([&] { k3::dplr::forward(one, out2, rec); }, "'ht'");
  auto o3 = in;
  o3.o = k3::tensor_view<double, 4>(const_cast<double*>(p.v.data()), {1, 6, 2, 3});
  expect([&] { k3::dplr::forward(one, o3, rec); }, "overlap");
  std::vector<std::int64_t> cu = {0, 4, 3, 6};
  auto opt = recurrent(p.options());
  opt.cu_seqlens = k3::host_view(cu.data(), 4);
  expect([&] { k3::dplr::forward(one, in, opt); }, "non-decreasing");
  cu = {1, 6};
  opt.cu_seqlens = k3::host_view(cu.data(), 2);
  expect([&] { k3::dplr::forward(one, in, opt); }, "start at 0");
  cu = {0, 5};
  opt.cu_seqlens = k3::host_view(cu.data(), 2);
  expect([&] { k3::dplr::forward(one, in, opt); }, "end at T");
  // Offsets are one type (int32 or int64); a null pointer with a length is an error, not "no offsets".
  opt.cu_seqlens = k3::tensor_view<std::int32_t const, 1>(nullptr, {2});
  expect([&] { k3::dplr::forward(one, in, opt); }, "null data for 2 offsets");
  opt = p.options();
  opt.chunk_size = 0;
  expect([&] { k3::dplr::forward(one, in, opt); }, "chunk_size");
  // B > 1 with offsets
  auto p2 = make<double>(rng, 2, 3, 1, 2, 2);
  std::vector<double> o2(p2.nv());
  auto in3 = p2.inputs();
  in3.o = k3::host_view(o2.data(), 2, 3, 1, 2);
  cu = {0, 3};
  auto opt2 = recurrent(p2.options());
  opt2.cu_seqlens = k3::host_view(cu.data(), 2);
  expect([&] { k3::dplr::forward(one, in3, opt2); }, "batch size 1");
  // int32 offsets work
  std::vector<std::int32_t> c32 = {0, 2, 6};
  auto opt3 = recurrent(p.options());
  opt3.cu_seqlens = k3::host_view(c32.data(), 3);
  std::vector<double> ht3(2 * p.H * p.K * p.V);
  auto in_no_h0 = in;
  in_no_h0.h0 = {};
  in_no_h0.o = k3::host_view(o.data(), 1, 6, 2, 3);
  in_no_h0.ht = k3::host_view(ht3.data(), 2, 2, 4, 3);
  CHECK_NOTHROW(k3::dplr::forward(one, in_no_h0, opt3));
}
