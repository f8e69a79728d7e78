// CUDA-side checks that need nvcc but no GPU (this binary runs on CPU-only machines):
// config.cuh's error type, and the argument checks that stream_backend and the copies run
// before touching the device.
#include <k3/backend/cuda/backend.cuh>
// (first: self-sufficient)
#include <doctest/doctest.h>

#include <string>
#include <vector>

#if !defined(K3_CUDA_COMPILER)
#error "K3_CUDA_COMPILER must be defined under nvcc"
#endif

K3_KERNEL void k3_test_noop_kernel(int) {}

TEST_CASE("cuda_error names the call and the CUDA error") {
  k3::cuda::cuda_error e(cudaErrorInvalidValue, "cudaMemcpy(x)");
  std::string m = e.what();
  CHECK(m.find("k3: CUDA error in cudaMemcpy(x)") == 0);
  CHECK(m.find("cudaErrorInvalidValue") != std::string::npos);
  CHECK(e.code() == cudaErrorInvalidValue);
  CHECK_THROWS_AS(K3_CUDA_CHECK(cudaErrorMemoryAllocation), k3::cuda::cuda_error);
  CHECK_THROWS_AS(K3_CUDA_CHECK(cudaErrorMemoryAllocation), k3::error);  // one hierarchy
  CHECK_NOTHROW(K3_CUDA_CHECK(cudaSuccess));
  CHECK(k3::cuda::device_count() >= 0);  // no device: 0, not an exception
}

TEST_CASE("argument checks run before any CUDA call") {
  k3::cuda::stream_backend be;
  CHECK(be.stream() == nullptr);
  CHECK(be.requested_device() == -1);
  be.for_each(3, 3, [] __device__(std::int64_t) {});  // empty: nothing is launched
  CHECK(be.allocate<float>(0) == nullptr);
  be.deallocate<float>(nullptr, 0);
  CHECK_THROWS_WITH_AS(be.launch(dim3(1), dim3(0), 0, k3_test_noop_kernel, 1), doctest::Contains("'block'"), k3::error);
  CHECK_THROWS_AS(be.allocate<double>(std::size_t(-1) / 4), k3::error);

  std::vector<float> h(6);
  k3::tensor_view<float, 2, k3::cuda_device_space> d(reinterpret_cast<float*>(64), {3, 2});
  CHECK_THROWS_WITH_AS(be.copy(k3::host_view(h.data(), 2, 3), d), doctest::Contains("expected shape [2, 3]"), k3::error);
  CHECK_THROWS_WITH_AS(be.copy(d, k3::host_view(h.data(), 2, 3)), doctest::Contains("'dst'"), k3::error);
  k3::tensor_view<float, 2, k3::cuda_device_space> null_dev(nullptr, {2, 3});
  CHECK_THROWS_WITH_AS(be.copy(k3::host_view(h.data(), 2, 3), null_dev), doctest::Contains("'dst'"), k3::error);
  CHECK_THROWS_WITH_AS(be.copy(d, d), doctest::Contains("overlap"), k3::error);
  // empty copies are no-ops
  k3::tensor_view<float, 2, k3::cuda_device_space> empty(nullptr, {0, 3});
  CHECK_NOTHROW(be.copy(k3::host_view(h.data(), 0, 3), empty));
}

TEST_CASE("unravel walks C order") {
  k3::array<k3::index_t, 3> ext{2, 3, 4};
  auto idx = k3::cuda::detail::unravel<3>(23, ext);
  CHECK(idx[0] == 1);
  CHECK(idx[1] == 2);
  CHECK(idx[2] == 3);
  idx = k3::cuda::detail::unravel<3>(5, ext);
  CHECK((idx[0] == 0 && idx[1] == 1 && idx[2] == 1));
}
