// The pipeline cache over an in-process loopback communicator: P simulated ranks run their
// chunks one after another (each receive follows its send), bfloat16 storage, against one
// driver running the whole stack. The MPI version is test_pipeline_mpi.cpp.
#include <doctest/doctest.h>

#include <memory>
#include <vector>

#include "attnres/loopback.hpp"
#include "attnres/toy_model.hpp"
#include "k3/attnres.hpp"

namespace ar = k3::attnres;
using k3::index_t;

using k3::test::loopback;
using k3::test::mailbox;

TEST_CASE("pipeline cache, 3 simulated ranks x 2 virtual stages, bfloat16: same results as one process") {
  using St = k3::bfloat16;
  index_t const L = 25, S = 4, d = 6, T = 2, P = 3, V = 2, C = P * V;
  toy::model m(L, d, 17);
  attnres_ref::rng r(18);
  auto w = toy::to<float>(r.normals<double>(std::size_t((L + 1) * d), 1.0));
  auto g = toy::to<float>(r.normals<double>(std::size_t((L + 1) * d), 0.2));
  for (auto& x : g) x += 1;
  auto emb = r.normals<double>(std::size_t(T * d)), dout = r.normals<double>(std::size_t(T * d));
  ar::block_config cfg;
  cfg.d = d;
  cfg.tokens = T + 1;  // spare capacity: bank rows travel packed
  cfg.sublayers = L;
  cfg.block_sublayers = S;
  cfg.run_mode = ar::mode::train_recompute;
  auto wv = k3::tensor_view<float const, 2>(w.data(), {L + 1, d}), gv = k3::tensor_view<float const, 2>(g.data(), {L + 1, d});

  ar::block_attn_res<St> ref(cfg, wv, gv);
  auto xs_ref = toy::run_forward(ref, m, emb, T);
  ref.backward_begin();
  auto dov = toy::to<St>(dout);
  ref.backward_site(k3::host_view(dov.data(), T, d));
  std::vector<double> dx;
  for (index_t l = L - 1; l >= 0; --l) {
    auto dy = toy::from(ref.grad_sublayer_output().data_handle(), std::size_t(T * d));
    m.backward(l, xs_ref[std::size_t(l)], dy, dx, T);
    auto dxs = toy::to<float>(dx);
    ref.backward_site(k3::host_view(dxs.data(), T, d));
  }

  auto box = std::make_shared<mailbox>();
  std::vector<loopback> comms;
  std::vector<std::unique_ptr<ar::block_attn_res<St>>> drivers;
  std::vector<std::unique_ptr<ar::pipeline_cache<loopback>>> caches;
  for (int q = 0; q < P; ++q) comms.emplace_back(box, q, int(P));
  for (int q = 0; q < P; ++q) {
    drivers.push_back(std::make_unique<ar::block_attn_res<St>>(cfg, wv, gv));
    caches.push_back(std::make_unique<ar::pipeline_cache<loopback>>(comms[std::size_t(q)]));
  }
  auto lo = [&](index_t c) { return c * L / C; };
  std::vector<std::vector<double>> xs(std::size_t(L + 1));
  auto e = toy::to<St>(emb);
  std::vector<St> x(std::size_t(T * d)), ys;
  std::vector<double> y;
  for (index_t c = 0; c < C; ++c) {
    int const q = int(c % P);
    auto& a = *drivers[std::size_t(q)];
    if (c == 0) a.begin(k3::host_view(e.data(), T, d));
    else caches[std::size_t(q)]->recv_forward(a, int((q + P - 1) % P), int(c));
    for (index_t l = lo(c); l < lo(c + 1); ++l) {
      a.input(k3::host_view(x.data(), T, d));
      xs[std::size_t(l)] = toy::from(x.data(), x.size());
      m.forward(l, xs[std::size_t(l)], y, T);
      ys = toy::to<St>(y);
      a.add(k3::host_view(ys.data(), T, d));
    }
    if (c == C - 1) {
      a.output(k3::host_view(x.data(), T, d));
      xs[std::size_t(L)] = toy::from(x.data(), x.size());
    } else {
      caches[std::size_t(q)]->send_forward(a, int((q + 1) % P), int(c + 1));
    }
  }
  for (index_t l = 0; l <= L; ++l) CHECK(xs[std::size_t(l)] == xs_ref[std::size_t(l)]);
  for (auto& a : drivers) a->backward_prepare();
  for (index_t c = C - 1; c >= 0; --c) {
    int const q = int(c % P);
    auto& a = *drivers[std::size_t(q)];
    if (c == C - 1) {
      a.backward_begin();
      a.backward_site(k3::host_view(dov.data(), T, d));
    } else {
      caches[std::size_t(q)]->recv_backward(a, int((q + 1) % P), int(1000 + c));
    }
    for (index_t l = lo(c + 1) - 1; l >= lo(c); --l) {
      auto dy = toy::from(a.grad_sublayer_output().data_handle(), std::size_t(T * d));
      m.backward(l, xs[std::size_t(l)], dy, dx, T);
      auto dxs = toy::to<float>(dx);
      a.backward_site(k3::host_view(dxs.data(), T, d));
    }
    if (c > 0) caches[std::size_t(q)]->send_backward(a, int((q + P - 1) % P), int(1000 + c - 1));
  }
  double err = 0;
  for (index_t c = 0; c < C; ++c) {
    auto& a = *drivers[std::size_t(c % P)];
    for (index_t l = lo(c); l < (c == C - 1 ? L + 1 : lo(c + 1)); ++l)
      for (index_t k = 0; k < d; ++k) {
        err = std::max(err, std::abs(double(a.grad_w()(l, k)) - double(ref.grad_w()(l, k))));
        err = std::max(err, std::abs(double(a.grad_gain()(l, k)) - double(ref.grad_gain()(l, k))));
      }
  }
  for (index_t t = 0; t < T; ++t)
    for (index_t k = 0; k < d; ++k)
      err = std::max(err, std::abs(double(drivers[0]->grad_embedding()(t, k)) - double(ref.grad_embedding()(t, k))));
  CHECK(err <= 1e-5);
  std::int64_t sent = 0, naive = 0;
  for (auto& cc : caches) {
    sent += cc->rows_sent();
    naive += cc->rows_naive();
  }
  CHECK(sent < naive);
  for (auto& kv : box->q) CHECK(kv.second.empty());  // every message consumed
}

TEST_CASE("pipeline cache: a state that does not fit the receiver is a k3::error") {
  using St = float;
  auto box = std::make_shared<mailbox>();
  loopback c0(box, 0, 2), c1(box, 1, 2);
  ar::pipeline_cache<loopback> p0(c0), p1(c1);
  index_t const d = 3;
  auto mk = [&](index_t L, index_t T) {
    ar::block_config c;
    c.d = d;
    c.tokens = T;
    c.sublayers = L;
    c.block_sublayers = 2;
    return c;
  };
  std::vector<float> w(13 * d, 0.1f), g(13 * d, 1.0f), e(2 * d, 1.0f), x(2 * d), y(2 * d, 0.5f);
  ar::block_attn_res<St> big(mk(12, 2), k3::tensor_view<float const, 2>(w.data(), {13, d}), k3::tensor_view<float const, 2>(g.data(), {13, d}));
  ar::block_attn_res<St> small_bank(mk(4, 2), k3::tensor_view<float const, 2>(w.data(), {5, d}), k3::tensor_view<float const, 2>(g.data(), {5, d}));
  ar::block_attn_res<St> few_tokens(mk(12, 1), k3::tensor_view<float const, 2>(w.data(), {13, d}), k3::tensor_view<float const, 2>(g.data(), {13, d}));
  big.begin(k3::host_view(e.data(), 2, d));
  for (int l = 0; l < 10; ++l) {
    big.input(k3::host_view(x.data(), 2, d));
    big.add(k3::host_view(y.data(), 2, d));
  }
  p0.send_forward(big, 1, 5);
  try {
    p1.recv_forward(small_bank, 0, 5);  // 5 bank rows, the receiver's bank holds 3
    FAIL("no throw");
  } catch (k3::error const& err) {
    CHECK(std::string(err.what()).find("exceed the bank") != std::string::npos);
  }
  p0.reset();
  p1.reset();
  box->q.clear();
  p0.send_forward(big, 1, 6);
  CHECK_THROWS_AS(p1.recv_forward(few_tokens, 0, 6), k3::error);  // 2 tokens, capacity 1
  CHECK_THROWS_AS(p0.send_forward(big, 0, 7), k3::error);          // sending to itself
}
