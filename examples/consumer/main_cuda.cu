// Uses the installed k3::cuda component (nvcc) or k3::simt (a host compiler, the kernels run
// on the CPU): stream_backend, a device tensor, a kernel, copies.
#include <k3/backend/cuda/backend.cuh>
#include <k3/core/tensor.hpp>

#include <cstdio>
#include <vector>

int main() {
  if (k3::cuda::device_count() == 0) {
    std::printf("k3 consumer (CUDA): built; no CUDA device, skipping\n");
    return 77;
  }
  k3::cuda::stream_backend be;
  k3::tensor<float, 1, k3::cuda::stream_backend> d({1000}, be);
  auto v = d.view();
  be.for_each(0, 1000, [=] __device__(std::int64_t i) { v(i) = 2.0f * static_cast<float>(i); });
  std::vector<float> h(1000);
  be.copy(d.view(), k3::host_view(h.data(), 1000));
  for (int i = 0; i < 1000; ++i)
    if (h[i] != 2.0f * i) return 1;
#if defined(K3_SIMT_RUNTIME)
  std::printf("k3 consumer (CUDA source on the SIMT host runtime): ok\n");
#else
  std::printf("k3 consumer (CUDA): ok on device %d\n", be.device());
#endif
  return 0;
}
