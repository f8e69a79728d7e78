// DPLR context parallelism over MPI (run under mpirun -np 2 and -np 4). Every rank builds the
// same global problem, takes its token block (uneven, cuts inside chunks, an empty block),
// and the distributed forward/backward must match the single-process chunked result.
// No doctest: every rank takes part in every check.
#include <cstdio>
#include <string>

#include "dplr_test_util.hpp"
#include "k3/comm/mpi.hpp"
#include "mpi_check.hpp"

using namespace dplr_test;
using k3::index_t;


template <class T>
std::vector<T> block(std::vector<T> const& x, index_t B, index_t T_, index_t H, index_t D, index_t t0, index_t n) {
  std::vector<T> out;
  for (index_t b = 0; b < B; ++b) out.insert(out.end(), x.begin() + (b * T_ + t0) * H * D, x.begin() + (b * T_ + t0 + n) * H * D);
  return out;
}

template <class T>
void run_case(k3::mpi_communicator const& comm, int rank, std::uint64_t seed, index_t B, index_t Tn, index_t H, index_t K, index_t V,
              index_t chunk, std::vector<index_t> cuts, double tol, bool with_h0) {
  using S = k3::dplr_state_t<T>;
  std::mt19937_64 rng(seed);
  auto p = make<T>(rng, B, Tn, H, K, V, {}, with_h0);
  auto dO = randn<T>(rng, p.nv());
  auto dht = randn<S>(rng, p.ns());
  auto ref = run_fwd(p, chunked_fwd(k3::cpu::serial{}, p.options(chunk)));
  auto gref = run_bwd(p, dO, dht, chunked_bwd(k3::cpu::serial{}, p.options(chunk)));
  index_t t0 = cuts[rank], n = cuts[rank + 1] - cuts[rank];
  problem<T> lp = p;
  lp.T_ = n;
  lp.q = block(p.q, B, Tn, H, K, t0, n), lp.k = block(p.k, B, Tn, H, K, t0, n), lp.a = block(p.a, B, Tn, H, K, t0, n);
  lp.b = block(p.b, B, Tn, H, K, t0, n), lp.gk = block(p.gk, B, Tn, H, K, t0, n), lp.v = block(p.v, B, Tn, H, V, t0, n);
  auto ldO = block(dO, B, Tn, H, V, t0, n);
  auto opt = lp.options(chunk);
  auto got = run_fwd(lp, [&](auto const& in, auto const& out) { k3::dplr_cp_forward(comm, in, out, opt); });
  auto want_o = block(ref.o, B, Tn, H, V, t0, n);
  double e1 = rel_err(got.o, want_o), e2 = rel_err(got.ht, ref.ht);
  EXPECT(e1 < tol && e2 < tol, "forward T=%lld K=%lld V=%lld: o err %g, ht err %g", (long long)Tn, (long long)K, (long long)V, e1, e2);
  auto g = run_bwd(lp, ldO, dht, [&](auto const& in, auto const& gin, auto const& gg) { k3::dplr_cp_backward(comm, in, gin, gg, opt); });
  double eb = 0;
  eb = std::max(eb, rel_err(g.dq, block(gref.dq, B, Tn, H, K, t0, n)));
  eb = std::max(eb, rel_err(g.dk, block(gref.dk, B, Tn, H, K, t0, n)));
  eb = std::max(eb, rel_err(g.da, block(gref.da, B, Tn, H, K, t0, n)));
  eb = std::max(eb, rel_err(g.db, block(gref.db, B, Tn, H, K, t0, n)));
  eb = std::max(eb, rel_err(g.dgk, block(gref.dgk, B, Tn, H, K, t0, n)));
  eb = std::max(eb, rel_err(g.dv, block(gref.dv, B, Tn, H, V, t0, n)));
  double eh = rel_err(g.dh0, gref.dh0);
  EXPECT(eb < tol && eh < tol, "backward T=%lld: grads err %g, dh0 err %g", (long long)Tn, eb, eh);
  // threaded backend inside each rank gives the same
  k3::cpu::threads<> th(2);
  auto got2 = run_fwd(lp, [&](auto const& in, auto const& out) { k3::dplr_cp_forward(comm, in, out, opt, th); });
  EXPECT(rel_err(got2.o, want_o) < tol && rel_err(got2.ht, ref.ht) < tol, "threaded forward");
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

int main(int argc, char** argv) {
  k3::mpi_session session(&argc, &argv);
  k3::mpi_communicator comm;
  int const rank = comm.rank(), P = comm.size();
  try {
    run_case<double>(comm, rank, 1, 2, 200, 2, 16, 60, 64, split(200, P, 0), 1e-12, true);
    run_case<double>(comm, rank, 2, 1, 65, 1, 60, 16, 16, split(65, P, 1), 1e-12, true);
    run_case<double>(comm, rank, 3, 1, 63, 2, 8, 8, 64, split(63, P, 2), 1e-12, false);
    run_case<float>(comm, rank, 4, 1, 150, 1, 32, 32, 32, split(150, P, 1), 2e-4, true);
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
      run_fwd(p, [&](auto const& in, auto const& out) { k3::dplr_cp_forward(comm, in, out, p.options()); });
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
      run_fwd(p, [&](auto const& in, auto const& out) { k3::dplr_cp_forward(comm, in, out, p.options()); });
    } catch (k3::error const& e) {
      msg = e.what();
    }
    EXPECT(msg.find("h0 given") != std::string::npos, "message: '%s'", msg.c_str());
  }

  comm.barrier();
  return k3::test::mpi_verdict(comm);
}
