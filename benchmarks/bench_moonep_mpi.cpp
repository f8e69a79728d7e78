// MoonEP dispatch and combine of the expert-parallel Stable LatentMoE layer
// (k3/moe/expert_parallel.hpp) against a same-run MPI_Alltoall of the same bytes, under
// mpirun -np P. Each rank routes S tokens top-k over E experts (router scores with a skew that
// puts 1.5x the mean load on rank 0's experts, so MoonEP places pairs away from home); the
// figure is the bytes every rank sends to the others in the dispatch (z rows, l = 3584
// floats) and the combine (output rows) over the time of plan + dispatch + combine, and the
// yardstick is MPI_Alltoall moving the same number of bytes per rank in equal parts, twice.
// Medians of interleaved repetitions.
//   usage: mpirun -np P bench_moonep_mpi [tokens per rank (default 512)] [repetitions (default 5)]
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/bench.hpp"
#include "k3/comm/mpi.hpp"
#include "k3/moe/expert_parallel.hpp"

int main(int argc, char** argv) {
  k3::mpi_session session(&argc, &argv);
  k3::mpi_communicator comm;
  using namespace k3::bench;
  using k3::index_t;
  int const R = comm.size(), me = comm.rank();
  index_t const S = argc > 1 ? std::max(1, std::atoi(argv[1])) : 512;
  int const reps = argc > 2 ? std::max(1, std::atoi(argv[2])) : 5;
  index_t const k = 16, l = 3584, f = 8, E = 32 * R;  // f: the experts do not run here, only the exchange
  if (me == 0) print_header("MoonEP dispatch + combine vs MPI_Alltoall, float32 rows of l = 3584, top-16");

  k3::moe::moonep_buffers<float> B(R, S, k, E, l, f);
  k3::moe::detail::lm_state<float> st;
  st.idx.resize(static_cast<std::size_t>(S * k));
  st.Z = k3::moe::detail::lm_matrix<float>::Random(S, l);
  std::mt19937_64 rng(static_cast<unsigned>(17 + me));
  // Skewed routing: experts of rank 0 drawn 1.5x as often as the others.
  std::vector<double> wts(static_cast<std::size_t>(E), 1.0);
  for (index_t e = 0; e < E / R; ++e) wts[static_cast<std::size_t>(e)] = 1.5;
  for (index_t t = 0; t < S; ++t) {
    std::vector<double> w = wts;
    for (index_t r = 0; r < k; ++r) {
      std::discrete_distribution<index_t> pick(w.begin(), w.end());
      index_t const e = pick(rng);
      st.idx[static_cast<std::size_t>(t * k + r)] = e;
      w[static_cast<std::size_t>(e)] = 0;  // k distinct experts per token
    }
  }
  std::vector<float> we(static_cast<std::size_t>((E / R) * f * l), 0.5f);
  k3::moe::latent_moe_args<float> a{};
  a.we_gate = {we.data(), {E / R, f, l}};
  a.we_up = {we.data(), {E / R, f, l}};
  a.we_down = {we.data(), {E / R, l, f}};

  std::size_t const per_rank_floats = static_cast<std::size_t>(S * k * l);
  std::vector<float> a2a_send(per_rank_floats), a2a_recv(per_rank_floats);
  int const chunk = static_cast<int>(per_rank_floats / static_cast<std::size_t>(R));

  std::vector<double> t_ep, t_a2a, sent;
  for (int rep = 0; rep < reps; ++rep) {
    MPI_Barrier(MPI_COMM_WORLD);
    double const t0 = MPI_Wtime();
    k3::moe::detail::ep_plan(comm, B, st, a);
    for (index_t q = 0; q < S * k; ++q)
      std::copy(st.Z.row(q / k).data(), st.Z.row(q / k).data() + l, B.send.data() + B.pos[static_cast<std::size_t>(q)] * l);
    k3::moe::detail::ep_exchange(comm, B.send.data(), B.send_count, B.send_off, B.recv.data(), B.recv_count, B.recv_off, l,
                                 k3::moe::detail::ep_rows_tag);
    k3::moe::detail::ep_exchange(comm, B.recv.data(), B.recv_count, B.recv_off, B.send.data(), B.send_count, B.send_off, l,
                                 k3::moe::detail::ep_rows_tag);
    MPI_Barrier(MPI_COMM_WORLD);
    t_ep.push_back(MPI_Wtime() - t0);
    // Bytes this rank sent to other ranks (dispatch + combine), the most of any rank.
    double off = 0;
    for (int r = 0; r < R; ++r)
      if (r != me) off += double(B.send_count[static_cast<std::size_t>(r)] + B.recv_count[static_cast<std::size_t>(r)]) * l * sizeof(float);
    double mx = off;
    MPI_Allreduce(&off, &mx, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    sent.push_back(mx);

    MPI_Barrier(MPI_COMM_WORLD);
    double const t1 = MPI_Wtime();
    MPI_Alltoall(a2a_send.data(), chunk, MPI_FLOAT, a2a_recv.data(), chunk, MPI_FLOAT, MPI_COMM_WORLD);
    MPI_Alltoall(a2a_recv.data(), chunk, MPI_FLOAT, a2a_send.data(), chunk, MPI_FLOAT, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    t_a2a.push_back(MPI_Wtime() - t1);
  }
  if (me == 0) {
    double const te = median(t_ep), ta = median(t_a2a), bytes = median(sent);
    double const a2a_bytes = 2.0 * double(chunk) * (R - 1) * sizeof(float);
    double const rate = bytes / te * 1e-9, yard = a2a_bytes / ta * 1e-9;
    std::printf("ranks %d, S = %lld tokens per rank, E = %lld experts, replicas on this rank %zu\n", R, (long long)S, (long long)E,
                B.replicas().size());
    std::printf("%-44s %10s %10s %10s\n", "figure", "ms", "GB/s", "ratio");
    std::printf("%-44s %10.2f %10.2f %10.2f\n", "plan + dispatch + combine (most-sending rank)", te * 1e3, rate, rate / yard);
    std::printf("%-44s %10.2f %10.2f\n", "MPI_Alltoall x2, same bytes per rank", ta * 1e3, yard);
    emit({"bench_moonep_mpi", "moonep_dispatch_combine", "float", "mpi", "ranks=" + std::to_string(R) + ";S=" + std::to_string(S) + ";k=16;l=3584",
          S, te, rate, "GB/s", double(S) / te, "MPI_Alltoall", yard, "GB/s", rate / yard, R});
  }
  return 0;
}
