// k3/backend/cuda/config.cuh — the CUDA side's common ground. Needs nvcc: .cuh files are
// reachable only through the k3::cuda target and refuse host compilers.
#pragma once
#if !defined(__CUDACC__)
#error "k3/backend/cuda/*.cuh needs a CUDA compiler; link k3::cuda and compile this file as CUDA"
#endif
#include <cuda_runtime.h>

#include <string>

#include "k3/core/config.hpp"
#include "k3/core/error.hpp"

namespace k3::cuda {

// CUDA runtime failures on the host side are k3 errors that say which call failed and why.
class cuda_error : public k3::error {
 public:
  cuda_error(cudaError_t e, char const* what)
      : k3::error(std::string("CUDA error in ") + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")"),
        code_(e) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

inline void check(cudaError_t e, char const* what) {
  if (e != cudaSuccess) throw cuda_error(e, what);
}

}  // namespace k3::cuda

#define K3_CUDA_CHECK(expr) ::k3::cuda::check((expr), #expr)
