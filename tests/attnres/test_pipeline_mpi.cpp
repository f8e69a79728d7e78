// Block AttnRes under pipeline parallelism: P ranks x 2 virtual stages (chunks wrap around the
// ring) against the same stack run in one process. Runs under mpirun -np 2 and -np 4; no
// doctest: every rank takes part in every check.
#include <cmath>
#include <cstdio>
#include <vector>

#include "attnres/toy_model.hpp"
#include "k3/attnres.hpp"
#include "k3/comm/mpi.hpp"
#include "support/mpi_check.hpp"

namespace ar = k3::attnres;
using k3::index_t;


static double max_rel(std::vector<double> const& a, std::vector<double> const& b) { return attnres_ref::rel_err(a, b); }

int main(int argc, char** argv) {
  k3::mpi_session session(&argc, &argv);
  k3::mpi_communicator comm;
  int const P = comm.size(), me = comm.rank();
  index_t const L = 22, S = 4, d = 8, T = 3, V = 2, C = P * V;
  using St = float;
  for (ar::mode md : {ar::mode::train_stored, ar::mode::train_recompute}) {
    toy::model m(L, d, 7);
    attnres_ref::rng r(8);
    auto w = toy::to<float>(r.normals<double>(std::size_t((L + 1) * d), 1.0));
    auto g = toy::to<float>(r.normals<double>(std::size_t((L + 1) * d), 0.2));
    for (auto& x : g) x += 1;
    auto emb = r.normals<double>(std::size_t(T * d)), dout = r.normals<double>(std::size_t(T * d));
    ar::block_config cfg;
    cfg.d = d;
    cfg.tokens = T;
    cfg.sublayers = L;
    cfg.block_sublayers = S;
    cfg.run_mode = md;
    auto wv = k3::tensor_view<float const, 2>(w.data(), {L + 1, d}), gv = k3::tensor_view<float const, 2>(g.data(), {L + 1, d});

    // --- one process ---
    ar::block_attn_res<St> ref(cfg, wv, gv);
    auto xs_ref = toy::run_forward(ref, m, emb, T);
    std::vector<std::vector<double>> dy_ref(static_cast<std::size_t>(L));
    {
      ref.backward_begin();
      auto dov = toy::to<St>(dout);
      ref.backward_site(k3::host_view(dov.data(), T, d));
      std::vector<double> dx;
      for (index_t l = L - 1; l >= 0; --l) {
        dy_ref[std::size_t(l)] = toy::from(ref.grad_sublayer_output().data_handle(), std::size_t(T * d));
        m.backward(l, xs_ref[std::size_t(l)], dy_ref[std::size_t(l)], dx, T);
        auto dxs = toy::to<float>(dx);
        ref.backward_site(k3::host_view(dxs.data(), T, d));
      }
    }
    auto demb_ref = toy::from(ref.grad_embedding().data_handle(), std::size_t(T * d));

    // --- pipeline: chunk c runs sublayers [c L / C, (c + 1) L / C) on rank c % P ---
    ar::block_attn_res<St> a(cfg, wv, gv);
    ar::pipeline_cache<k3::mpi_communicator> cache(comm);
    auto lo = [&](index_t c) { return c * L / C; };
    std::vector<std::vector<double>> xs(std::size_t(L + 1));
    auto e = toy::to<St>(emb);
    std::vector<St> x(std::size_t(T * d)), ys;
    std::vector<double> y;
    int const prev = (me + P - 1) % P, next = (me + 1) % P;
    for (index_t c = 0; c < C; ++c) {
      if (c % P != me) continue;
      if (c == 0) a.begin(k3::host_view(e.data(), T, d));
      else cache.recv_forward(a, prev, int(c));
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
        cache.send_forward(a, next, int(c + 1));
      }
    }
    // forward results: bit-identical inputs at every site this rank ran
    for (index_t c = me; c < C; c += P)
      for (index_t l = lo(c); l < (c == C - 1 ? L + 1 : lo(c + 1)); ++l) EXPECT(xs[std::size_t(l)] == xs_ref[std::size_t(l)]);

    // backward, chunks in reverse
    a.backward_prepare();
    std::vector<double> dx;
    for (index_t c = C - 1; c >= 0; --c) {
      if (c % P != me) continue;
      if (c == C - 1) {
        a.backward_begin();
        auto dov = toy::to<St>(dout);
        a.backward_site(k3::host_view(dov.data(), T, d));
      } else {
        cache.recv_backward(a, next, int(1000 + c));
      }
      for (index_t l = lo(c + 1) - 1; l >= lo(c); --l) {
        auto dy = toy::from(a.grad_sublayer_output().data_handle(), std::size_t(T * d));
        EXPECT(max_rel(dy, dy_ref[std::size_t(l)]) <= 1e-6);
        m.backward(l, xs[std::size_t(l)], dy, dx, T);
        auto dxs = toy::to<float>(dx);
        a.backward_site(k3::host_view(dxs.data(), T, d));
      }
      if (c > 0) cache.send_backward(a, prev, int(1000 + c - 1));
    }
    // parameter gradients of this rank's sites, and the embedding's on rank 0
    for (index_t c = me; c < C; c += P)
      for (index_t l = lo(c); l < (c == C - 1 ? L + 1 : lo(c + 1)); ++l) {
        std::vector<double> gw(a.grad_w().data_handle() + l * d, a.grad_w().data_handle() + (l + 1) * d),
            rw(ref.grad_w().data_handle() + l * d, ref.grad_w().data_handle() + (l + 1) * d),
            gg(a.grad_gain().data_handle() + l * d, a.grad_gain().data_handle() + (l + 1) * d),
            rg(ref.grad_gain().data_handle() + l * d, ref.grad_gain().data_handle() + (l + 1) * d);
        EXPECT(max_rel(gw, rw) <= 1e-6);
        EXPECT(max_rel(gg, rg) <= 1e-6);
      }
    if (me == 0) {
      auto demb = toy::from(a.grad_embedding().data_handle(), std::size_t(T * d));
      EXPECT(max_rel(demb, demb_ref) <= 1e-6);
    }
    // communication: cached rows vs resending the whole bank at every hop
    std::vector<std::int64_t> counts = {cache.rows_sent(), cache.rows_naive()};
    comm.all_reduce_sum(k3::host_view(counts.data(), 2));
    EXPECT(counts[0] < counts[1]);
    // with two ranks every bank row crosses exactly once: the rows held at the last hop
    if (P == 2) EXPECT(counts[0] == cfg.bank_rows_at(lo(C - 1) - 1));
    if (me == 0)
      std::printf("mode %d, %d ranks x %d virtual stages: bank rows sent %lld (cached) vs %lld (resend all)\n", int(md), P, int(V),
                  (long long)counts[0], (long long)counts[1]);
  }
  return k3::test::mpi_verdict(comm);
}
