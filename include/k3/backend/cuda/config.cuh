// k3/backend/cuda/config.cuh — the CUDA side's common ground: the runtime (CUDA's under nvcc,
// k3's SIMT host runtime under a host compiler with K3_SIMT_RUNTIME, see
// k3/backend/simt/cuda_api.hpp), errors, and the one way k3 launches a kernel.
#pragma once
#if defined(K3_SIMT_RUNTIME) && !defined(__CUDACC__)
#include "k3/backend/simt/cuda_api.hpp"
#elif defined(__CUDACC__)
#include <cuda_runtime.h>
#else
#error "k3/backend/cuda/*.cuh needs a CUDA compiler (link k3::cuda, compile as CUDA) or k3's SIMT host runtime (link k3::simt)"
#endif

#include <cstddef>
#include <string>
#include <utility>

#include "k3/core/config.hpp"
#include "k3/core/error.hpp"

namespace k3::cuda {

// CUDA runtime failures on the host side are k3 errors that say which call failed and why.
class cuda_error : public k3::error {
 public:
  cuda_error(cudaError_t e, char const* what)
      : k3::error(error_kind::io, std::string("CUDA error in ") + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")"),
        code_(e) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

inline void check(cudaError_t e, char const* what) {
  if (e != cudaSuccess) throw cuda_error(e, what);
}

// Where and how a kernel runs: kernel<<<grid, block, shared_bytes, stream>>>.
struct kernel_launch {
  dim3 grid;
  dim3 block;
  std::size_t shared_bytes = 0;
  cudaStream_t stream = nullptr;
#if defined(K3_SIMT_RUNTIME)
  // The launch site, which names the kernel in the runtime's reports (the builtins give the
  // place of the aggregate initialisation, on g++ and clang++ alike).
  char const* site_file = __builtin_FILE();
  char const* site_function = __builtin_FUNCTION();
  unsigned site_line = __builtin_LINE();
#endif
};

// The one launch statement of k3's kernels, so that the same source compiles under nvcc and
// under the SIMT host runtime. Errors are reported as for <<<...>>>: by cudaGetLastError().
template <class... P, class... A>
void launch_kernel(void (*kernel)(P...), kernel_launch const& at, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "launch_kernel: argument count does not match the kernel");
#if defined(K3_SIMT_RUNTIME)
  ::k3::simt::launch_kernel(kernel, at.grid, at.block, at.shared_bytes, at.stream,
                            ::k3::simt::cuda_face::site_name(at.site_file, at.site_function, at.site_line), std::forward<A>(args)...);
#else
  kernel<<<at.grid, at.block, at.shared_bytes, at.stream>>>(static_cast<P>(std::forward<A>(args))...);
#endif
}

}  // namespace k3::cuda

#if !defined(K3_SIMT_RUNTIME)
// Dynamic shared memory: `K3_DYNAMIC_SHARED(float, smem);` declares `float* smem`.
#define K3_DYNAMIC_SHARED(T, name)                \
  extern __shared__ __align__(16) T name##_raw_[]; \
  T* const name = name##_raw_
#endif

#define K3_CUDA_CHECK(expr) ::k3::cuda::check((expr), #expr)
