// The seam between test_dplr_nccl's nvcc and host-compiler translation units.
#pragma once
#include "k3/comm/any_communicator.hpp"

// Largest relative error of this rank's distributed DPLR forward/backward (T split evenly over
// the ranks) against the single-process chunked result.
double dplr_cp_error_over(k3::any_communicator const& comm);
