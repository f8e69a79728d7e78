// DPLR context parallelism over NCCL: the nvcc half builds the NCCL clique and wraps it in a
// k3::any_communicator; the host half (dplr_nccl_host.cpp) runs the drivers over it. Also
// checks the type-erased collectives on host buffers (staged through the device by NCCL).
// One process, one GPU: a one-rank clique (NCCL refuses two ranks on one device); the
// multi-rank drivers are exercised over MPI by test_dplr_mpi. Skipped (77) without a GPU.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include <k3/comm/any_communicator.hpp>
#include <k3/comm/nccl.cuh>

#include "dplr_nccl_host.hpp"

static_assert(k3::Communicator<k3::any_communicator>);

TEST_CASE("DPLR context parallelism over an NCCL clique through any_communicator") {
  auto nccl = k3::nccl_communicator::bootstrap(k3::single_process{});
  k3::any_communicator const comm(nccl);
  REQUIRE(comm.size() == nccl.size());

  std::vector<double> x = {1.5, -2};
  comm.all_reduce_sum(k3::host_view(x.data(), 2));
  CHECK(x == std::vector<double>{1.5, -2});
  std::vector<std::int64_t> in = {7, 9}, out(2 * static_cast<std::size_t>(comm.size()));
  comm.all_gather(k3::const_view<std::int64_t, 1>(in.data(), {2}), k3::host_view(out.data(), static_cast<k3::index_t>(out.size())));
  CHECK(out[0] == 7);
  CHECK(out[1] == 9);

  CHECK(dplr_cp_error_over(comm) < 1e-12);
}
