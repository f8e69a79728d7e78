// DPLR context parallelism over MPI (run under mpirun -np 2 and -np 4). Every rank builds the
// same global problem, takes its token block (uneven, cuts inside chunks, an empty block),
// and the distributed forward/backward must match the single-process chunked result.
// No doctest: every rank takes part in every check.
#include <cstdio>
#include <string>

#include "cp_check.hpp"
#include "k3/comm/any_communicator.hpp"
#include "k3/comm/mpi.hpp"
#include "mpi_check.hpp"

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
