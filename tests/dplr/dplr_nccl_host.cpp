// Host half of test_dplr_nccl: the DPLR context-parallel drivers (Eigen, xsimd: host compiler
// only) run over whatever communicator the nvcc half hands in, here an NCCL clique.
#include "cp_check.hpp"
#include "dplr_nccl_host.hpp"
#include "k3/comm/any_communicator.hpp"

double dplr_cp_error_over(k3::any_communicator const& comm) {
  k3::index_t const T = 130;
  std::vector<k3::index_t> cuts(static_cast<std::size_t>(comm.size()) + 1);
  for (int r = 0; r <= comm.size(); ++r) cuts[static_cast<std::size_t>(r)] = T * r / comm.size();
  return dplr_test::cp_check<double>(comm, comm.rank(), 5, 1, T, 2, 12, 20, 64, cuts, true).max();
}
