// k3/k3.hpp — the umbrella header for CPU users: the core vocabulary, the CPU backends
// (serial, simd<Arch>, threads<Arch>), Eigen interop, .npy I/O, and the Communicator
// concept with single_process. Not included: k3/comm/mpi.hpp (needs <mpi.h>; link
// MPI::MPI_CXX) and anything CUDA (.cuh files, through k3::cuda).
#pragma once
#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/backend/cpu/thread_pool.hpp"
#include "k3/comm/communicator.hpp"
#include "k3/core.hpp"
#include "k3/core/interop/eigen.hpp"
#include "k3/io/npy.hpp"
#include "k3/version.hpp"
