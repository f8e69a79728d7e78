// Compiled by the host compiler: sees only k3/backend/cuda/api.hpp (no CUDA header) and
// calls copies that test_stream_backend.cu instantiates with K3_CUDA_INSTANTIATE_COPY.
#include <k3/backend/cuda/api.hpp>

#include <cstddef>
#include <vector>

#ifdef __CUDACC__
#error "this file must be compiled by the host compiler"
#endif

std::vector<float> k3_test_roundtrip_from_host_tu(std::vector<float> const& in, int rows, int cols, float* device_buffer,
                                                   CUstream_st* stream) {
  k3::tensor_view<float, 2, k3::cuda_device_space> dev(device_buffer, {rows, cols});
  k3::cuda::copy(k3::host_view(in.data(), rows, cols), dev, stream);
  std::vector<float> out(in.size());
  k3::cuda::copy(dev, k3::host_view(out.data(), rows, cols), stream);
  return out;
}
