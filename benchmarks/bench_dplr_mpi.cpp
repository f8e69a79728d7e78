// DPLR context parallelism over MPI: run as `mpirun -np P bench_dplr_mpi [reps]` for P = 1, 2, 4.
// B=1, H=1, T=65536, K=V=128, float; rank r holds tokens [r T/P, (r+1) T/P).
// Rank 0 prints: the plain single-process chunked forward on the whole sequence (measured on
// rank 0 while the others wait), the distributed forward (slowest rank, median), their ratio,
// and the ratio predicted from the same-run cost of the map pass m and of the forward f per
// token: each rank runs a map pass and a forward over T/P tokens, so
//     predicted speedup = P f / (m + f)      (communication B H K (K+V) floats per rank;
// one rank runs the plain forward, predicted 1).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC bug 105593 in AVX-512 intrinsics via Eigen
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/bench.hpp"
#include "k3/comm/mpi.hpp"
#include "k3/dplr.hpp"

int main(int argc, char** argv) {
  using namespace k3::bench;
  using k3::index_t;
  k3::mpi_session session(&argc, &argv);
  csv_init(argc, argv);  // --csv FILE (rank 0 writes)
  k3::mpi_communicator comm;
  int const rank = comm.rank(), P = comm.size();
  int const reps = argc > 1 ? std::atoi(argv[1]) : 3;
  index_t const T = 65536, K = 128, V = 128;
  index_t const t0 = T * rank / P, n = T * (rank + 1) / P - t0;
  std::mt19937_64 rng(3);
  std::normal_distribution<float> n01;
  auto fill = [&](index_t cnt, float s) {
    std::vector<float> x(static_cast<std::size_t>(cnt));
    for (auto& e : x) e = s * n01(rng);
    return x;
  };
  auto q = fill(T * K, 1), k = fill(T * K, 0.088f), v = fill(T * V, 1), a = fill(T * K, 0.088f), b = fill(T * K, 0.05f), gk = fill(T * K, 1);
  for (auto& e : gk) e = -std::log1p(std::exp(-e)) / 16;
  std::vector<float> o(static_cast<std::size_t>(T * V)), ht(static_cast<std::size_t>(K * V)), M(K * K), N(K * V);
  auto view = [&](std::vector<float> const& x, index_t D, index_t s, index_t c) { return k3::host_view(x.data() + s * D, 1, c, 1, D); };
  auto in = [&](index_t s, index_t c) {
    return k3::dplr::forward_args<float>{view(q, K, s, c), view(k, K, s, c), view(v, V, s, c), view(a, K, s, c), view(b, K, s, c), view(gk, K, s, c)};
  };
  // This rank's tokens with the communicator: the context-parallel call.
  auto on_ranks = [&](k3::dplr::forward_args<float> const& x) {
    return k3::dplr::cp_forward_args<float, k3::mpi_communicator>{&comm, x.q, x.k, x.v, x.a, x.b, x.gk, x.h0, x.o, x.ht};
  };
  auto with_o = [](k3::dplr::forward_args<float> x, k3::tensor_view<float, 4> o, k3::tensor_view<float, 4> ht = {}) {
    x.o = o;
    x.ht = ht;
    return x;
  };
  k3::dplr::options opt;
  std::vector<double> whole, cp, fwd_local, map_local;
  for (int r = 0; r < reps; ++r) {
    comm.barrier();
    if (rank == 0)
      whole.push_back(seconds([&] {
        k3::dplr::forward(k3::cpu::serial{}, with_o(in(0, T), k3::host_view(o.data(), 1, T, 1, V)), opt);
      }));
    comm.barrier();
    double t = seconds([&] {
      k3::dplr::forward(k3::cpu::serial{}, on_ranks(with_o(in(t0, n), k3::host_view(o.data() + t0 * V, 1, n, 1, V), k3::host_view(ht.data(), 1, 1, K, V))), opt);
    });
    double tmax = t;
    MPI_Allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    cp.push_back(tmax);
    if (rank == 0) {
      fwd_local.push_back(seconds([&] {
        k3::dplr::forward(k3::cpu::serial{}, with_o(in(t0, n), k3::host_view(o.data(), 1, n, 1, V)), opt);
      }));
      map_local.push_back(seconds([&] {
        auto const x = in(t0, n);
        k3::dplr::segment_maps(k3::cpu::serial{}, k3::dplr::maps_args<float>{x.q, x.k, x.v, x.a, x.b, x.gk, k3::host_view(M.data(), 1, 1, K, K),
                                                                             k3::host_view(N.data(), 1, 1, K, V)},
                               opt);
      }));
    }
  }
  if (rank == 0) {
    print_header("dplr_mpi: DPLR context-parallel forward over MPI (B=1, H=1, T=65536, K=V=128, float)");
    double f = median(fwd_local), m = median(map_local), w = median(whole), c = median(cp);
    std::printf("ranks %d: single-process forward %.3f s, distributed forward %.3f s, speedup %.2fx, predicted %.2fx (map pass / forward = %.2f)\n",
                P, w, c, w / c, P == 1 ? 1.0 : P * f / (m + f), m / f);
    emit({"dplr_mpi", "cp_forward", "segment_maps", "mpi(" + std::to_string(P) + " ranks)", "B=1;T=65536;H=1;K=128;V=128", (long long)T, c,
          T / c, "tok/s", T / c, "k3 single-process forward (time)", w, "s", w / c, P});
    std::printf("communication per rank: %lld floats (B H K (K+V)), independent of T\n", (long long)(K * (K + V)));
  }
  return 0;
}
