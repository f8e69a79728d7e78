// The race detector's own check (ThreadSanitizer builds only): a kernel whose threads add to a
// shared counter with a plain += (an atomic was needed). Under the fiber schedule the sum is
// right, so only the detector can tell; ctest expects its report.
#include "k3/backend/cuda/config.cuh"

#include <cstdio>

namespace {

K3_KERNEL void unsynchronised_sum(int* out) {
  __shared__ int counter;
  if (threadIdx.x == 0) counter = 0;
  __syncthreads();
  counter += 1;  // the race: every thread of the block, no barrier, no atomic
  __syncthreads();
  if (threadIdx.x == 0) *out = counter;
}

}  // namespace

int main() {
  int* d = nullptr;
  K3_CUDA_CHECK(cudaMalloc(&d, sizeof(int)));
  k3::cuda::launch_kernel(unsynchronised_sum, {dim3(1), dim3(64)}, d);
  K3_CUDA_CHECK(cudaGetLastError());
  int h = 0;
  K3_CUDA_CHECK(cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost));
  std::printf("sum %d (64 expected, right by luck of the schedule)\n", h);
  K3_CUDA_CHECK(cudaFree(d));
  return 0;
}
