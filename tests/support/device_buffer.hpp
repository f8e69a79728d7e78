// A device allocation for kernel tests (cudaMalloc, on a GPU or on the SIMT host runtime):
// filled with a byte value or uploaded from a host vector, read back with get().
#pragma once
#include "k3/backend/cuda/config.cuh"
// (config.cuh first: it picks the runtime)
#include <cstddef>
#include <vector>

namespace k3::test {

template <class T>
struct device_buffer {
  T* p = nullptr;
  std::size_t n = 0;
  explicit device_buffer(std::size_t count, int fill_byte = 0) : n(count) {
    if (n == 0) return;
    K3_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    K3_CUDA_CHECK(cudaMemset(p, fill_byte, n * sizeof(T)));
  }
  explicit device_buffer(std::vector<T> const& h) : device_buffer(h.size()) {
    if (n) K3_CUDA_CHECK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  device_buffer(device_buffer const&) = delete;
  device_buffer& operator=(device_buffer const&) = delete;
  ~device_buffer() {
    if (p) (void)cudaFree(p);
  }
  // Waits for the device, then copies the contents back.
  std::vector<T> get() const {
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> h(n);
    if (n) K3_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

}  // namespace k3::test
