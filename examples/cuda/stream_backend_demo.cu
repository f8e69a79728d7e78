// k3::cuda::stream_backend in 40 lines: a device tensor, a K3_HD functor run by for_each on
// the GPU and by cpu::serial on the host, copies both ways, and the comparison.
#include <k3/backend/cuda/backend.cuh>
#include <k3/backend/cpu/serial.hpp>
#include <k3/core/math.hpp>
#include <k3/core/tensor.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

// y[i] = silu(x[i]) + 0.5 * y[i], written once for both memory spaces.
template <class Space>
struct gated_update {
  k3::tensor_view<float const, 1, Space> x;
  k3::tensor_view<float, 1, Space> y;
  K3_HD void operator()(std::int64_t i) const { y(i) = x(i) / (1.f + expf(-x(i))) + 0.5f * y(i); }
};

int main() {
  int const n = 1 << 20;
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; ++i) {
    x[i] = std::sin(0.001f * float(i)) * 8.f;
    y[i] = std::cos(0.002f * float(i));
  }
  std::vector<float> ref = y;
  k3::cpu::serial{}.for_each(0, n, gated_update<k3::host_space>{k3::host_view(x.data(), n), k3::host_view(ref.data(), n)});
  if (k3::cuda::device_count() == 0) {
    std::printf("stream_backend_demo: no CUDA device; CPU reference computed, nothing to compare\n");
    return 0;
  }
  k3::cuda::scoped_stream stream;
  auto be = stream.backend();
  k3::tensor<float, 1, k3::cuda::stream_backend> dx({n}, be), dy({n}, be);
  be.copy(k3::host_view(x.data(), n), dx.view());
  be.copy(k3::host_view(y.data(), n), dy.view());
  be.for_each(0, n, gated_update<k3::cuda_device_space>{dx.view(), dy.view()});
  be.copy(dy.view(), k3::host_view(y.data(), n));  // blocking: waits for the kernel too
  double err = 0;
  for (int i = 0; i < n; ++i) err = std::fmax(err, std::fabs(double(y[i]) - ref[i]));
  std::printf("stream_backend_demo: %d elements on device %d, max |gpu - cpu| = %g\n", n, be.device(), err);
  return err < 1e-5 ? 0 : 1;
}
