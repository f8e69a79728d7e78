// Chunked DPLR (forward and all gradients) against the recurrent reference, in double to
// 1e-12 on awkward shapes; both intra-chunk forms; float sanity; threaded paths.
#include <doctest/doctest.h>

#include <tuple>

#include "dplr_test_util.hpp"
#include "support/metrics.hpp"

using namespace dplr_test;
using k3::index_t;
using k3::test::rel_rms;

namespace {

// k3::dplr::forward and backward take every CPU backend (the recurrent mode included: any host
// backend); `compare` below runs both modes through them.
template <class B, class T>
constexpr bool takes = requires(B const& be, k3::dplr::forward_args<T> const& f, k3::dplr::backward_args<T> const& g, k3::dplr::options const& o) {
  k3::dplr::forward(be, f, o);
  k3::dplr::backward(be, g, o);
  k3::dplr::forward(be, f);
};
static_assert(takes<k3::cpu::serial, float> && takes<k3::cpu::simd<>, float> && takes<k3::cpu::threads<>, float>);
static_assert(takes<k3::cpu::serial, double> && takes<k3::cpu::simd<>, double> && takes<k3::cpu::threads<>, double>);
static_assert(!takes<int, float>);

void compare(problem<double> const& p, index_t chunk, k3::dplr::intra_form mode, double tol = 1e-12) {
  std::mt19937_64 rng(static_cast<std::uint64_t>(p.T_ * 131 + p.K * 7 + p.V + chunk));
  auto o = p.options(chunk);
  o.intra = mode;
  auto ref = run_fwd(p, recurrent_fwd(p.options()));
  auto got = run_fwd(p, chunked_fwd(k3::cpu::serial{}, o));
  CHECK(max_err(got, ref) < tol);
  auto dO = randn<double>(rng, p.nv());
  auto dht = randn<double>(rng, p.ns());
  auto gref = run_bwd(p, dO, dht, recurrent_bwd(p.options()));
  auto ggot = run_bwd(p, dO, dht, chunked_bwd(k3::cpu::serial{}, o));
  double e = max_err(ggot, gref);
  CHECK(e < tol);
}

}  // namespace

TEST_CASE("chunked DPLR equals recurrent on awkward shapes (double, 1e-12)") {
  std::mt19937_64 rng(11);
  index_t const Ts[] = {1, 15, 63, 64, 65, 200};
  index_t const Ds[] = {16, 60, 100, 128};
  int i = 0;
  for (index_t T : Ts) {
    for (int j = 0; j < 2; ++j, ++i) {
      index_t K = Ds[i % 4], V = Ds[(i + 1 + j) % 4];
      INFO("T=" << T << " K=" << K << " V=" << V);
      auto p = make<double>(rng, 1, T, 2, K, V, {}, true, gate::normal, j == 1);
      compare(p, 64, k3::dplr::intra_form::automatic);
    }
  }
}

TEST_CASE("chunked DPLR: small chunks, both intra forms, hard resets, zero gates") {
  std::mt19937_64 rng(12);
  for (index_t chunk : {1, 7, 16}) {
    auto p = make<double>(rng, 2, 37, 1, 9, 5);
    INFO("chunk=" << chunk);
    compare(p, chunk, k3::dplr::intra_form::factored);
    compare(p, chunk, k3::dplr::intra_form::pairwise);
  }
  auto pr = make<double>(rng, 1, 70, 2, 12, 8, {}, true, gate::resets);
  compare(pr, 32, k3::dplr::intra_form::automatic);  // resets push chunks onto the pairwise form
  compare(pr, 32, k3::dplr::intra_form::pairwise);
  // Resets far below the underflow of e^g, down to -inf: clamped in the chunk-local cumsum.
  for (gate gk : {gate::huge_resets, gate::infinite_resets}) {
    auto ph = make<double>(rng, 1, 70, 2, 12, 8, {}, true, gk);
    compare(ph, 32, k3::dplr::intra_form::automatic);
    compare(ph, 16, k3::dplr::intra_form::factored);
  }
  auto pz = make<double>(rng, 1, 40, 1, 8, 8, {}, true, gate::zero);
  compare(pz, 16, k3::dplr::intra_form::automatic);
  auto ps = make<double>(rng, 1, 50, 1, 8, 6, {}, false, gate::strong);
  compare(ps, 16, k3::dplr::intra_form::automatic);
}

TEST_CASE("chunked DPLR varlen with short and empty sequences") {
  std::mt19937_64 rng(13);
  auto p = make<double>(rng, 1, 200, 2, 16, 60, {0, 15, 15, 100, 101, 164, 200});
  compare(p, 64, k3::dplr::intra_form::automatic);
  compare(p, 16, k3::dplr::intra_form::pairwise);
  auto p2 = make<double>(rng, 1, 65, 1, 60, 16, {0, 1, 64, 65}, false);
  compare(p2, 64, k3::dplr::intra_form::automatic);
}

TEST_CASE("chunked DPLR in float tracks the double reference") {
  std::mt19937_64 rng(14);
  auto pd = make<double>(rng, 1, 130, 2, 32, 24);
  problem<float> pf;
  pf.B = pd.B, pf.T_ = pd.T_, pf.H = pd.H, pf.K = pd.K, pf.V = pd.V, pf.N = pd.N, pf.with_h0 = true;
  auto cvt = [](auto const& x) { return std::vector<float>(x.begin(), x.end()); };
  pf.q = cvt(pd.q), pf.k = cvt(pd.k), pf.v = cvt(pd.v), pf.a = cvt(pd.a), pf.b = cvt(pd.b), pf.gk = cvt(pd.gk), pf.h0 = cvt(pd.h0);
  auto rd = run_fwd(pd, recurrent_fwd(pd.options()));
  auto rf = run_fwd(pf, chunked_fwd(k3::cpu::serial{}, pf.options(64)));
  CHECK(rel_err(rf.o, rd.o) < 1e-4);
  CHECK(rel_err(rf.ht, rd.ht) < 1e-4);
  auto dO = randn<double>(rng, pd.nv());
  auto dht = randn<double>(rng, pd.ns());
  auto gd = run_bwd(pd, dO, dht, recurrent_bwd(pd.options()));
  auto gf = run_bwd(pf, cvt(dO), cvt(dht), chunked_bwd(k3::cpu::serial{}, pf.options(64)));
  CHECK(rel_err(gf.dq, gd.dq) < 1e-3);
  CHECK(rel_err(gf.dk, gd.dk) < 1e-3);
  CHECK(rel_err(gf.dv, gd.dv) < 1e-3);
  CHECK(rel_err(gf.da, gd.da) < 1e-3);
  CHECK(rel_err(gf.db, gd.db) < 1e-3);
  CHECK(rel_err(gf.dgk, gd.dgk) < 1e-3);
  CHECK(rel_err(gf.dh0, gd.dh0) < 1e-3);
}

// Hard resets inside chunks: with one chunk-local cumsum, every exponent after a reset was the
// difference of two numbers near -112 (float) or -750 (double), each rounded to that size; the
// split cumsum (core/gate_cumsum.hpp) keeps such pairs as accurate as without resets. Here,
// before it: float o/ht 1.3e-5 to 2.7e-5, gradients up to 4.3e-5, double 1.7e-13 to 3.6e-13;
// with it: float at most 8e-7 (o, ht) and 1.4e-6 (gradients), double 1.5e-15.
TEST_CASE("chunked DPLR with hard resets: float and double track the double recurrence") {
  std::mt19937_64 rng(17);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  for (bool per_token : {true, false}) {
    INFO("per_token=" << per_token);
    auto pd = make<double>(rng, 1, 2048, 1, 32, 32, {}, true, per_token ? gate::normal : gate::resets);
    if (per_token)  // 10% of the tokens reset every channel, some to -inf
      for (index_t t = 0; t < pd.T_; ++t)
        if (u01(rng) < 0.1)
          for (index_t d = 0; d < pd.K; ++d) pd.gk[std::size_t(t * pd.K + d)] = t % 3 ? -1000.0 : -std::numeric_limits<double>::infinity();
    problem<float> pf;
    pf.B = pd.B, pf.T_ = pd.T_, pf.H = pd.H, pf.K = pd.K, pf.V = pd.V, pf.N = pd.N, pf.with_h0 = true;
    auto cvt = [](auto const& x) { return std::vector<float>(x.begin(), x.end()); };
    pf.q = cvt(pd.q), pf.k = cvt(pd.k), pf.v = cvt(pd.v), pf.a = cvt(pd.a), pf.b = cvt(pd.b), pf.gk = cvt(pd.gk), pf.h0 = cvt(pd.h0);
    auto rd = run_fwd(pd, recurrent_fwd(pd.options()));
    auto dO = randn<double>(rng, pd.nv());
    auto dht = randn<double>(rng, pd.ns());
    auto gd = run_bwd(pd, dO, dht, recurrent_bwd(pd.options()));
    for (index_t chunk : {64, 128}) {
      INFO("chunk=" << chunk);
      auto cd = run_fwd(pd, chunked_fwd(k3::cpu::serial{}, pd.options(chunk)));
      CHECK(rel_rms(cd.o, rd.o) < 2e-14);
      CHECK(rel_rms(cd.ht, rd.ht) < 2e-14);
      auto rf = run_fwd(pf, chunked_fwd(k3::cpu::serial{}, pf.options(chunk)));
      CHECK(rel_rms(rf.o, rd.o) < 2e-6);
      CHECK(rel_rms(rf.ht, rd.ht) < 2e-6);
      auto gf = run_bwd(pf, cvt(dO), cvt(dht), chunked_bwd(k3::cpu::threads<>(2), pf.options(chunk)));
      for (auto [name, x, y] : {std::tuple{"dq", &gf.dq, &gd.dq}, std::tuple{"dk", &gf.dk, &gd.dk}, std::tuple{"dv", &gf.dv, &gd.dv},
                                std::tuple{"da", &gf.da, &gd.da}, std::tuple{"db", &gf.db, &gd.db}, std::tuple{"dgk", &gf.dgk, &gd.dgk},
                                std::tuple{"dh0", &gf.dh0, &gd.dh0}}) {
        char const* label = name;  // INFO's lambda cannot capture a structured binding (clang 14)
        INFO(label);
        CHECK(rel_rms(*x, *y) < 4e-6);
      }
    }
  }
}

TEST_CASE("threaded paths equal the single-thread result") {
  std::mt19937_64 rng(15);
  k3::cpu::threads<> th(3);
  // many (sequence, head) pairs: one pair per thread
  auto pm = make<double>(rng, 2, 90, 3, 16, 20);
  // one long sequence: value split and segment maps
  auto p1 = make<double>(rng, 1, 333, 1, 24, 40);
  auto pv = make<double>(rng, 1, 150, 1, 16, 16, {0, 3, 3, 150});
  for (auto const* p : {&pm, &p1, &pv}) {
    auto dO = randn<double>(rng, p->nv());
    auto dht = randn<double>(rng, p->ns());
    auto ref = run_fwd(*p, chunked_fwd(k3::cpu::serial{}, p->options(32)));
    auto gref = run_bwd(*p, dO, dht, chunked_bwd(k3::cpu::serial{}, p->options(32)));
    for (auto mode : {k3::dplr::sequence_split::value_split, k3::dplr::sequence_split::segment_maps}) {
      auto o = p->options(32);
      o.long_sequence = mode;
      INFO("mode=" << int(mode) << " T=" << p->T_);
      CHECK(max_err(run_fwd(*p, chunked_fwd(th, o)), ref) < 1e-12);
      CHECK(max_err(run_bwd(*p, dO, dht, chunked_bwd(th, o)), gref) < 1e-12);
    }
  }
}

TEST_CASE("context-parallel entry points on a single-process communicator") {
  std::mt19937_64 rng(16);
  auto p = make<double>(rng, 2, 70, 2, 8, 6);
  auto dO = randn<double>(rng, p.nv());
  auto dht = randn<double>(rng, p.ns());
  k3::single_process one;
  auto ref = run_fwd(p, recurrent_fwd(p.options()));
  auto got = run_fwd(p, [&](auto const& a) { k3::dplr::forward(k3::cpu::serial{}, on(one, a), p.options(16)); });
  CHECK(max_err(got, ref) < 1e-12);
  auto gref = run_bwd(p, dO, dht, recurrent_bwd(p.options()));
  auto g = run_bwd(p, dO, dht, [&](auto const& a) { k3::dplr::backward(k3::cpu::serial{}, on(one, a), p.options(16)); });
  CHECK(max_err(g, gref) < 1e-12);
  auto p1 = make<double>(rng, 1, 70, 1, 4, 4, {0, 70});
  CHECK_THROWS_WITH_AS(run_fwd(p1, [&](auto const& a) { k3::dplr::forward(k3::cpu::serial{}, on(one, a), p1.options()); }),
                       doctest::Contains("cu_seqlens"), k3::error);
  // Only the chunked form runs across ranks, and the args must carry a communicator.
  CHECK_THROWS_WITH_AS(run_fwd(p, [&](auto const& a) { k3::dplr::forward(k3::cpu::serial{}, on(one, a), recurrent({})); }),
                       doctest::Contains("option 'mode'"), k3::error);
  k3::dplr::cp_forward_args<double, k3::single_process> const no_comm{};
  CHECK_THROWS_WITH_AS(k3::dplr::forward(k3::cpu::serial{}, no_comm), doctest::Contains("argument 'comm'"), k3::error);
}

TEST_CASE("single-sequence pipeline: awkward shapes, more threads than work, nested inline call") {
  std::mt19937_64 rng(17);
  struct shape {
    index_t T, K, V, chunk;
  };
  // T < one chunk, T = one chunk, T not a multiple of the chunk, V odd / not a multiple of the
  // vector width / smaller than the thread count, more chunks than ring slots, T = 1.
  shape const shapes[] = {{1, 5, 1, 16}, {20, 8, 3, 32}, {32, 6, 2, 32}, {97, 12, 17, 16}, {300, 24, 33, 16}, {130, 9, 1, 8}};
  for (int nt : {2, 3, 5}) {
    k3::cpu::threads<> th(nt);
    for (auto const& s : shapes) {
      auto p = make<double>(rng, 1, s.T, 1, s.K, s.V);
      auto o = p.options(s.chunk);
      auto dO = randn<double>(rng, p.nv());
      auto dht = randn<double>(rng, p.ns());
      auto ref = run_fwd(p, chunked_fwd(k3::cpu::serial{}, o));
      auto gref = run_bwd(p, dO, dht, chunked_bwd(k3::cpu::serial{}, o));
      INFO("threads=" << nt << " T=" << s.T << " K=" << s.K << " V=" << s.V << " chunk=" << s.chunk);
      CHECK(max_err(run_fwd(p, chunked_fwd(th, o)), ref) < 1e-12);
      CHECK(max_err(run_bwd(p, dO, dht, chunked_bwd(th, o)), gref) < 1e-12);
      // The maps run through the same pipeline (the transposed one: the gradient chain alone).
      std::vector<double> M1(static_cast<std::size_t>(s.K * s.K)), G1(static_cast<std::size_t>(s.K * s.V)), M2 = M1, G2 = G1;
      auto in = p.inputs();
      auto dOv = k3::host_view(static_cast<double const*>(dO.data()), index_t(1), s.T, index_t(1), s.V);
      k3::dplr::segment_maps_transposed(k3::cpu::serial{}, transposed_maps_of(in, dOv, k3::host_view(M1.data(), 1, 1, s.K, s.K), k3::host_view(G1.data(), 1, 1, s.K, s.V)), o);
      k3::dplr::segment_maps_transposed(th, transposed_maps_of(in, dOv, k3::host_view(M2.data(), 1, 1, s.K, s.K), k3::host_view(G2.data(), 1, 1, s.K, s.V)), o);
      CHECK(rel_err(M2, M1) < 1e-12);
      CHECK(rel_err(G2, G1) < 1e-12);
      // and the forward map (K + V columns split across the threads)
      k3::dplr::segment_maps(k3::cpu::serial{}, maps_of(in, k3::host_view(M1.data(), 1, 1, s.K, s.K), k3::host_view(G1.data(), 1, 1, s.K, s.V)), o);
      k3::dplr::segment_maps(th, maps_of(in, k3::host_view(M2.data(), 1, 1, s.K, s.K), k3::host_view(G2.data(), 1, 1, s.K, s.V)), o);
      CHECK(rel_err(M2, M1) < 1e-12);
      CHECK(rel_err(G2, G1) < 1e-12);
    }
    // Called from inside one of the pool's own tasks, the pool runs the pipeline's
    // participants one after another on this thread: it must still finish, with the same result.
    auto p = make<double>(rng, 1, 200, 1, 8, 6);
    auto o = p.options(16);
    auto ref = run_fwd(p, chunked_fwd(k3::cpu::serial{}, o));
    auto dO = randn<double>(rng, p.nv());
    auto dht = randn<double>(rng, p.ns());
    auto gref = run_bwd(p, dO, dht, chunked_bwd(k3::cpu::serial{}, o));
    th.pool().run(2, [&](std::int64_t i) {
      if (i != 0) return;
      auto got = run_fwd(p, chunked_fwd(th, o));
      auto g = run_bwd(p, dO, dht, chunked_bwd(th, o));
      CHECK(max_err(got, ref) < 1e-12);
      CHECK(max_err(g, gref) < 1e-12);
    });
  }
}
