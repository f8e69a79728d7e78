// DPLR context parallelism over MPI (run under mpirun -np 2 and -np 4). Every rank builds the
// same global problem, takes its token block (uneven, cuts inside chunks, an empty block),
// and the distributed forward/backward must match the single-process chunked result.
// No doctest: every rank takes part in every check.
#include <cstdio>
#include <string>

#include "cp_check.hpp"
#include "k3/comm/any_communicator.hpp"
#include "k3/comm/mpi.hpp"
#include "support/mpi_check.hpp"

using namespace dplr_test;
using k3::index_t;


template <class T, class Comm>
void run_case(Comm const& comm, int rank, std::uint64_t seed, index_t B, index_t Tn, index_t H, index_t K, index_t V, index_t chunk,
              std::vector<index_t> cuts, double tol, bool with_h0) {
  cp_errors const e = cp_check<T>(comm, rank, seed, B, Tn, H, K, V, chunk, cuts, with_h0);
  EXPECT(e.o < tol && e.ht < tol, "forward T=%lld K=%lld V=%lld: o err %g, ht err %g", (long long)Tn, (long long)K, (long long)V, e.o, e.ht);
  EXPECT(e.grads < tol && e.dh0 < tol, "backward T=%lld: grads err %g, dh0 err %g", (long long)Tn, e.grads, e.dh0);
  EXPECT(e.threaded < tol, "threaded forward: err %g", e.threaded);
}

std::vector<index_t> split(index_t T, int P, int variant) {
  std::vector<index_t> c(P + 1);
  for (int r = 0; r <= P; ++r) c[r] = T * r / P;
  if (variant == 1 && P >= 2) {
    c[1] = std::min<index_t>(T, c[1] + 5);  // a cut inside a chunk
    for (int r = 2; r < P; ++r) c[r] = std::max(c[r], c[1]);
  }
  if (variant == 2 && P >= 2) c[1] = 0;  // rank 0 holds no tokens
  return c;
}

// KDA over ranks (KCP for KDA): each rank maps its token block of a KDA problem (grouped value
// heads) to DPLR, runs the distributed forward and backward, folds the gradients back to KDA;
// the whole-sequence single-process result (same mapping, serial chunked) is the reference.
template <class Comm>
void kda_case(Comm const& comm, int rank, int P) {
  index_t const B = 1, Tn = 150, H = 1, HV = 2, K = 12, V = 10;
  std::mt19937_64 rng(77);
  std::normal_distribution<double> nd(0, 1);
  std::uniform_real_distribution<double> ud(0, 1);
  auto gen = [&](index_t n, auto f) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = f();
    return x;
  };
  auto q = gen(B * Tn * H * K, [&] { return 0.3 * nd(rng); }), k = gen(B * Tn * H * K, [&] { return 0.3 * nd(rng); });
  auto v = gen(B * Tn * HV * V, [&] { return nd(rng); }), g = gen(B * Tn * HV * K, [&] { return -0.5 * ud(rng); });
  auto beta = gen(B * Tn * HV, [&] { return ud(rng); }), dO = gen(B * Tn * HV * V, [&] { return nd(rng); });
  auto inputs = [&](index_t n, std::vector<double> const& q_, std::vector<double> const& k_, std::vector<double> const& v_,
                    std::vector<double> const& g_, std::vector<double> const& b_) {
    return k3::dplr::kda_inputs<double>{k3::const_view<double, 4>(q_.data(), {B, n, H, K}), k3::const_view<double, 4>(k_.data(), {B, n, H, K}),
                                  k3::const_view<double, 4>(v_.data(), {B, n, HV, V}), k3::const_view<double, 4>(g_.data(), {B, n, HV, K}),
                                  k3::const_view<double, 3>(b_.data(), {B, n, HV}), {}};
  };
  auto cuts = split(Tn, P, 1);
  index_t const t0 = cuts[static_cast<std::size_t>(rank)], n = cuts[static_cast<std::size_t>(rank) + 1] - t0;
  auto lq = block(q, B, Tn, H, K, t0, n), lk = block(k, B, Tn, H, K, t0, n), lv = block(v, B, Tn, HV, V, t0, n);
  auto lg = block(g, B, Tn, HV, K, t0, n), lb = block(beta, B, Tn, HV, 1, t0, n), ldO = block(dO, B, Tn, HV, V, t0, n);

  struct result {
    std::vector<double> o, ht, dq, dk, dv, dg, dbeta;
  };
  auto run = [&](k3::dplr::kda_inputs<double> const& in, index_t n_, std::vector<double> const& dO_, auto&& fwd, auto&& bwd) {
    k3::dplr::kda_as_dplr<double> m(in);
    result r;
    r.o.resize(static_cast<std::size_t>(B * n_ * HV * V));
    r.ht.resize(static_cast<std::size_t>(B * HV * K * V));
    auto fa = m.forward_inputs();
    fa.o = k3::host_view(r.o.data(), B, n_, HV, V);
    fa.ht = k3::host_view(r.ht.data(), B, HV, K, V);
    fwd(fa);
    std::vector<double> dq(static_cast<std::size_t>(B * n_ * HV * K)), dk(dq.size()), da(dq.size()), db(dq.size()), dgk(dq.size()),
        dv(static_cast<std::size_t>(B * n_ * HV * V));
    auto gd = m.backward_inputs();
    gd.d_o = k3::const_view<double, 4>(dO_.data(), {B, n_, HV, V});
    gd.dq = k3::host_view(dq.data(), B, n_, HV, K), gd.dk = k3::host_view(dk.data(), B, n_, HV, K), gd.dv = k3::host_view(dv.data(), B, n_, HV, V);
    gd.da = k3::host_view(da.data(), B, n_, HV, K), gd.db = k3::host_view(db.data(), B, n_, HV, K), gd.dgk = k3::host_view(dgk.data(), B, n_, HV, K);
    bwd(gd);
    r.dq.resize(static_cast<std::size_t>(B * n_ * H * K));
    r.dk.resize(r.dq.size());
    r.dv.resize(dv.size());
    r.dg.resize(static_cast<std::size_t>(B * n_ * HV * K));
    r.dbeta.resize(static_cast<std::size_t>(B * n_ * HV));
    m.grads_to_kda(gd, k3::dplr::kda_grads<double>{k3::host_view(r.dq.data(), B, n_, H, K), k3::host_view(r.dk.data(), B, n_, H, K),
                                              k3::host_view(r.dv.data(), B, n_, HV, V), k3::host_view(r.dg.data(), B, n_, HV, K),
                                              k3::host_view(r.dbeta.data(), B, n_, HV)});
    return r;
  };
  k3::dplr::options opt;
  opt.chunk_size = 32;
  k3::cpu::serial const one;
  auto ref = run(inputs(Tn, q, k, v, g, beta), Tn, dO, [&](auto const& a) { k3::dplr::forward(one, a, opt); },
                 [&](auto const& a) { k3::dplr::backward(one, a, opt); });
  auto got = run(inputs(n, lq, lk, lv, lg, lb), n, ldO, [&](auto const& a) { k3::dplr::forward(one, on(comm, a), opt); },
                 [&](auto const& a) { k3::dplr::backward(one, on(comm, a), opt); });
  double const eo = rel_err(got.o, block(ref.o, B, Tn, HV, V, t0, n)), eh = rel_err(got.ht, ref.ht);
  double eg = rel_err(got.dq, block(ref.dq, B, Tn, H, K, t0, n));
  eg = std::max(eg, rel_err(got.dk, block(ref.dk, B, Tn, H, K, t0, n)));
  eg = std::max(eg, rel_err(got.dv, block(ref.dv, B, Tn, HV, V, t0, n)));
  eg = std::max(eg, rel_err(got.dg, block(ref.dg, B, Tn, HV, K, t0, n)));
  eg = std::max(eg, rel_err(got.dbeta, block(ref.dbeta, B, Tn, HV, 1, t0, n)));
  EXPECT(eo < 1e-12 && eh < 1e-12 && eg < 1e-12, "KDA over %d ranks: o err %g, ht err %g, grads err %g", P, eo, eh, eg);
}

int main(int argc, char** argv) {
  k3::mpi_session session(&argc, &argv);
  k3::mpi_communicator comm;
  int const rank = comm.rank(), P = comm.size();
  try {
    run_case<double>(comm, rank, 1, 2, 200, 2, 16, 60, 64, split(200, P, 0), 1e-12, true);
    run_case<double>(comm, rank, 2, 1, 65, 1, 60, 16, 16, split(65, P, 1), 1e-12, true);
    run_case<double>(comm, rank, 3, 1, 63, 2, 8, 8, 64, split(63, P, 2), 1e-12, false);
    run_case<float>(comm, rank, 4, 1, 150, 1, 32, 32, 32, split(150, P, 1), 2e-4, true);
    // The same drivers over the type-erased communicator (how host code runs over NCCL).
    k3::any_communicator const erased(comm);
    run_case<double>(erased, rank, 5, 1, 130, 2, 12, 20, 64, split(130, P, 1), 1e-12, true);
    kda_case(comm, rank, P);
  } catch (std::exception const& e) {
    std::printf("rank %d: unexpected exception: %s\n", rank, e.what());
    ++k3::test::mpi_failures();
  }

  // A rank passing a different K: every rank reports a clear error, nobody hangs.
  {
    std::mt19937_64 rng(9);
    index_t K = rank == P - 1 ? 6 : 5;
    auto p = make<double>(rng, 1, 10, 1, K, 3);
    std::string msg;
    try {
      run_fwd(p, [&](auto const& a) { k3::dplr::forward(k3::cpu::serial{}, on(comm, a), p.options()); });
    } catch (k3::error const& e) {
      msg = e.what();
    }
    EXPECT(msg.find("disagree on K") != std::string::npos && msg.find("rank " + std::to_string(P - 1) + " has 6") != std::string::npos,
           "message: '%s'", msg.c_str());
  }
  // h0 on some ranks only
  {
    std::mt19937_64 rng(10);
    auto p = make<double>(rng, 1, 10, 1, 4, 3, {}, rank == 0);
    std::string msg;
    try {
      run_fwd(p, [&](auto const& a) { k3::dplr::forward(k3::cpu::serial{}, on(comm, a), p.options()); });
    } catch (k3::error const& e) {
      msg = e.what();
    }
    EXPECT(msg.find("h0 given") != std::string::npos, "message: '%s'", msg.c_str());
  }

  comm.barrier();
  return k3::test::mpi_verdict(comm);
}
