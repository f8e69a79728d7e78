// k3::cuda::stream_backend against the CPU: the same K3_HD functor runs through
// cpu::serial on host views and through stream_backend on device views; copies round-trip
// strided views both ways; a raw launch with shared memory is checked against a float64 sum.
#include <k3/backend/cuda/backend.cuh>
// (the backend header first: it must be self-sufficient)
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <k3/backend/cpu/serial.hpp>
#include <k3/core/math.hpp>
#include <k3/core/numeric/bfloat16.hpp>
#include <k3/core/tensor.hpp>

K3_CUDA_INSTANTIATE_COPY(float, 2);

std::vector<float> k3_test_roundtrip_from_host_tu(std::vector<float> const& in, int rows, int cols, float* device_buffer,
                                                   CUstream_st* stream);

using k3::cuda_device_space;
using k3::host_space;
using k3::index_t;
using k3::tensor_view;
using k3::cuda::stream_backend;

// Compile-time: host/device mix-ups are concept failures.
static_assert(k3::CudaBackend<stream_backend>);
static_assert(!k3::CudaBackend<k3::cpu::serial>);
static_assert(k3::AccessibleFrom<tensor_view<float, 2, cuda_device_space>, stream_backend>);
static_assert(!k3::AccessibleFrom<tensor_view<float, 2, host_space>, stream_backend>);
static_assert(!k3::AccessibleFrom<tensor_view<float, 2, cuda_device_space>, k3::cpu::serial>);
static_assert(std::is_same_v<decltype(std::declval<k3::tensor<float, 3, stream_backend>&>().view()),
                             tensor_view<float, 3, cuda_device_space>>);

namespace {

std::vector<float> random_vector(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(-3.f, 3.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// y = a * x + b * sigmoid(y) (exercises core/math.hpp on the device too).
template <class Space>
struct axpby_fn {
  float a, b;
  tensor_view<float const, 2, Space> x;
  tensor_view<float, 2, Space> y;
  K3_HD void operator()(std::int64_t i) const {
    index_t const r = i / y.extent(1), c = i % y.extent(1);
    y(r, c) = a * x(r, c) + b * k3::detail::sigmoid(y(r, c));
  }
};

}  // namespace

// Each block sums its grid-stride share into partial[blockIdx.x] through shared memory.
// (Outside the anonymous namespace: hidden visibility needs external linkage.)
K3_KERNEL void block_sum_kernel(tensor_view<float const, 1, cuda_device_space> x, float* partial) {
  K3_DYNAMIC_SHARED(float, smem);
  float s = 0.f;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < x.extent(0);
       i += static_cast<index_t>(gridDim.x) * blockDim.x)
    s += x(i);
  smem[threadIdx.x] = s;
  __syncthreads();
  for (unsigned w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) smem[threadIdx.x] += smem[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = smem[0];
}

namespace {

template <class T, std::size_t R>
std::vector<T> to_host(tensor_view<T, R, cuda_device_space> d) {
  std::vector<T> out(static_cast<std::size_t>(d.size()));
  k3::array<index_t, R> ext = d.extents();
  k3::cuda::copy<T, R>(d, tensor_view<T, R, host_space>(out.data(), ext), nullptr);
  return out;
}

}  // namespace

TEST_CASE("device tensors are zero-filled and round-trip exactly") {
  stream_backend be;
  k3::tensor<float, 2, stream_backend> t({5, 7}, be);
  CHECK(t.size() == 35);
  auto zeros = to_host(t.view());
  for (float z : zeros) CHECK(z == 0.f);

  auto h = random_vector(35, 1);
  be.copy(k3::host_view(h.data(), 5, 7), t.view());
  CHECK(to_host(t.view()) == h);

  k3::tensor<float, 2, stream_backend> empty({0, 4}, be);
  CHECK(empty.data() == nullptr);
  CHECK(to_host(empty.view()).empty());
}

TEST_CASE("for_each matches cpu::serial on awkward shapes") {
  stream_backend be;
  for (auto shape : {std::pair<int, int>{1, 1}, {3, 5}, {257, 33}, {1031, 1029}}) {
    int const rows = shape.first, cols = shape.second;  // (not a structured binding: doctest's CAPTURE is a lambda)
    CAPTURE(rows);
    CAPTURE(cols);
    std::size_t const n = std::size_t(rows) * cols;
    auto x = random_vector(n, 2), y = random_vector(n, 3);
    auto y_ref = y;
    k3::cpu::serial{}.for_each(0, index_t(n),
                               axpby_fn<host_space>{1.5f, -0.5f, k3::host_view(x.data(), rows, cols),
                                                    k3::host_view(y_ref.data(), rows, cols)});

    k3::tensor<float, 2, stream_backend> dx({rows, cols}, be), dy({rows, cols}, be);
    be.copy(k3::host_view(x.data(), rows, cols), dx.view());
    be.copy(k3::host_view(y.data(), rows, cols), dy.view());
    be.for_each(0, index_t(n), axpby_fn<cuda_device_space>{1.5f, -0.5f, dx.view(), dy.view()});
    be.fence();
    auto y_gpu = to_host(dy.view());
    for (std::size_t i = 0; i < n; ++i) REQUIRE(y_gpu[i] == doctest::Approx(y_ref[i]).epsilon(1e-6));
  }
}

TEST_CASE("for_each: empty ranges launch nothing and offsets reach f") {
  stream_backend be;
  k3::tensor<std::int64_t, 1, stream_backend> out({10}, be);
  auto v = out.view();
  be.for_each(5, 5, [=] __device__(std::int64_t i) { v(i) = -1; });
  be.for_each(7, 3, [=] __device__(std::int64_t i) { v(i) = -1; });
  be.for_each(3, 10, [=] __device__(std::int64_t i) { v(i) = i * i; });
  be.fence();
  auto h = to_host(out.view());
  for (std::int64_t i = 0; i < 10; ++i) CHECK(h[std::size_t(i)] == (i < 3 ? 0 : i * i));
}

TEST_CASE("strided copies in every direction match the host") {
  stream_backend be;
  int const rows = 9, cols = 13;
  auto h = random_vector(std::size_t(rows) * cols, 4);
  auto hv = k3::host_view(h.data(), rows, cols);
  auto h_sub = hv.sub(1, 2, 7).sub(0, 1, 6);  // 6 x 7, strides {13, 1}

  // host strided -> device contiguous
  k3::tensor<float, 2, stream_backend> d({6, 7}, be);
  be.copy(tensor_view<float const, 2>(h_sub), d.view());
  auto back = to_host(d.view());
  for (index_t r = 0; r < 6; ++r)
    for (index_t c = 0; c < 7; ++c) CHECK(back[std::size_t(r * 7 + c)] == h_sub(r, c));

  // device -> device strided (a transposed destination), then device strided -> host strided
  k3::tensor<float, 2, stream_backend> big({7, 6}, be);
  tensor_view<float, 2, cuda_device_space> transposed(big.data(), {6, 7}, {1, 6});
  be.copy(d.view(), transposed);
  std::vector<float> out(std::size_t(rows) * cols, -7.f);
  auto ov = k3::host_view(out.data(), rows, cols);
  be.copy(tensor_view<float const, 2, cuda_device_space>(transposed), ov.sub(1, 3, 7).sub(0, 2, 6));
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) {
      bool inside = r >= 2 && r < 8 && c >= 3 && c < 10;
      CHECK(ov(r, c) == (inside ? h_sub(r - 2, c - 3) : -7.f));
    }

  // host strided -> device strided (column 4 of h into a column of the device buffer)
  k3::tensor<float, 2, stream_backend> col({rows, 2}, be);
  tensor_view<float, 1, cuda_device_space> dcol = col.view().slice(1, 1);
  be.copy(tensor_view<float const, 1>(hv.slice(1, 4)), dcol);
  auto cols_back = to_host(col.view());
  for (index_t r = 0; r < rows; ++r) {
    CHECK(cols_back[std::size_t(2 * r)] == 0.f);
    CHECK(cols_back[std::size_t(2 * r + 1)] == hv(r, 4));
  }
}

TEST_CASE("copies reject mismatched shapes and overlapping device views") {
  stream_backend be;
  k3::tensor<float, 2, stream_backend> d({3, 4}, be);
  std::vector<float> h(12);
  auto msg = [](auto&& f) {
    try {
      f();
    } catch (k3::error const& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string m = msg([&] { be.copy(k3::host_view(h.data(), 4, 3), d.view()); });
  CHECK(m.find("'dst'") != std::string::npos);
  CHECK(m.find("[4, 3]") != std::string::npos);
  CHECK(m.find("[3, 4]") != std::string::npos);
  m = msg([&] { be.copy(d.view().sub(0, 0, 2), d.view().sub(0, 1, 2)); });
  CHECK(m.find("overlap") != std::string::npos);
  m = msg([&] { be.copy(k3::host_view(static_cast<float const*>(nullptr), 3, 4), d.view()); });
  CHECK(m.find("'src'") != std::string::npos);
}

TEST_CASE("launch: a shared-memory block reduction matches a float64 sum") {
  stream_backend be;
  std::size_t const n = 100003;
  auto h = random_vector(n, 5);
  k3::tensor<float, 1, stream_backend> d({index_t(n)}, be);
  be.copy(k3::host_view(h.data(), n), d.view());
  unsigned const blocks = 37, threads = 128;
  k3::tensor<float, 1, stream_backend> partial({index_t(blocks)}, be);
  be.launch(dim3(blocks), dim3(threads), threads * sizeof(float), block_sum_kernel,
            tensor_view<float const, 1, cuda_device_space>(d.view()), partial.data());
  be.fence();
  double gpu = 0, ref = 0;
  for (float p : to_host(partial.view())) gpu += p;
  for (float x : h) ref += x;
  CHECK(gpu == doctest::Approx(ref).epsilon(1e-4));

  k3::cuda::launch_config cfg{{blocks, 1, 1}, {threads, 1, 1}, threads * sizeof(float)};
  be.launch(cfg, block_sum_kernel, tensor_view<float const, 1, cuda_device_space>(d.view()), partial.data());
  be.fence();
  double gpu2 = 0;
  for (float p : to_host(partial.view())) gpu2 += p;
  CHECK(gpu2 == gpu);

  CHECK_THROWS_AS(be.launch(dim3(0), dim3(32), 0, block_sum_kernel, tensor_view<float const, 1, cuda_device_space>(d.view()),
                            partial.data()),
                  k3::error);
  // Too many threads per block: the launch error surfaces as a cuda_error (a k3::error).
  CHECK_THROWS_AS(be.launch(dim3(1), dim3(4096), 0, block_sum_kernel,
                            tensor_view<float const, 1, cuda_device_space>(d.view()), partial.data()),
                  k3::cuda::cuda_error);
}

TEST_CASE("a scoped_stream backend runs work on its own stream") {
  k3::cuda::scoped_stream s;
  auto be = s.backend();
  CHECK(be.stream() == s.get());
  CHECK(be.device() == s.device());
  CHECK(k3::cuda::device_count() >= 1);
  k3::tensor<float, 2, stream_backend> d({64, 64}, be);
  auto v = d.view();
  be.for_each(0, 64 * 64, [=] __device__(std::int64_t i) { v(i / 64, i % 64) = float(i) * 0.5f; });
  be.fence();
  auto h = to_host(d.view());
  for (std::size_t i = 0; i < h.size(); ++i) REQUIRE(h[i] == float(i) * 0.5f);
}

TEST_CASE("a host-compiler TU copies through api.hpp") {
  stream_backend be;
  k3::tensor<float, 2, stream_backend> d({4, 6}, be);
  auto h = random_vector(24, 6);
  CHECK(k3_test_roundtrip_from_host_tu(h, 4, 6, d.data(), be.stream()) == h);
}

TEST_CASE("core numerics behave the same in device code: bfloat16 for every bit pattern") {
  stream_backend be;
  k3::tensor<float, 1, stream_backend> widened({65536}, be);
  k3::tensor<std::uint16_t, 1, stream_backend> rounded({65536}, be);
  auto w = widened.view();
  auto r = rounded.view();
  // Widen every bf16 pattern; round a float derived from it (exercises ties and NaN payloads).
  be.for_each(0, 65536, [=] __device__(std::int64_t i) {
    auto b = k3::bfloat16::from_bits(static_cast<std::uint16_t>(i));
    w(i) = float(b);
    float f = __uint_as_float((static_cast<unsigned>(i) << 16) | 0x8000u | (static_cast<unsigned>(i) & 0x7fffu));
    r(i) = k3::bfloat16(f).bits;
  });
  be.fence();
  auto wh = to_host(w);
  auto rh = to_host(r);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    float host_w = float(k3::bfloat16::from_bits(static_cast<std::uint16_t>(i)));
    std::uint32_t u = (i << 16) | 0x8000u | (i & 0x7fffu);
    float f;
    std::memcpy(&f, &u, 4);
    REQUIRE(std::memcmp(&wh[i], &host_w, 4) == 0);
    REQUIRE(rh[i] == k3::bfloat16(f).bits);
  }
}
