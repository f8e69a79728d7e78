// k3::train::saved_tensor_store on a CUDA backend (k3/train/saved_tensors.cuh): keep, offload
// (with and without prefetch) and recompute give device tensors back bit for bit after the
// caller overwrote them; the resident and host pools count the bytes; the errors are the host
// store's. Runs on the CPU through the SIMT host runtime in every build, and on a GPU in the
// nvcc build.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/train/saved_tensors.cuh"
#include "support/error_of.hpp"
#include "support/random.hpp"

namespace tr = k3::train;
using k3::index_t;

namespace {

using dview = k3::tensor_view<float, 2, k3::cuda_device_space>;

void upload(k3::cuda::stream_backend const& b, std::vector<float> const& h, float* d) {
  b.copy(k3::tensor_view<float const, 1>(h.data(), {static_cast<index_t>(h.size())}),
         k3::tensor_view<float, 1, k3::cuda_device_space>(d, {static_cast<index_t>(h.size())}));
}
std::vector<float> download(k3::cuda::stream_backend const& b, float const* d, std::size_t n) {
  std::vector<float> h(n);
  b.copy(k3::tensor_view<float const, 1, k3::cuda_device_space>(d, {static_cast<index_t>(n)}), k3::tensor_view<float, 1>(h.data(), {static_cast<index_t>(n)}));
  b.fence();
  return h;
}

}  // namespace

TEST_CASE("CUDA saved_tensor_store: keep, offload, prefetch and recompute give the tensor back bit for bit") {
  k3::cuda::scoped_stream stream;
  auto const b = stream.backend();
  index_t const m = 5, k = 37;
  std::size_t const n = static_cast<std::size_t>(m * k), bytes = n * sizeof(float);
  auto const g = k3::test::gaussian(n, 3);
  std::vector<float> const x(g.begin(), g.end()), junk(n, -3.f);
  float* dx = b.allocate<float>(n);
  float* dy = b.allocate<float>(n);
  {
    tr::saved_tensor_store<k3::cuda::stream_backend> store(b);
    upload(b, x, dx);
    auto const hk = store.save(dview(dx, {m, k}), tr::keep);
    auto const ho = store.save(dview(dx, {m, k}), tr::offload);
    auto const hp = store.save(dview(dx, {m, k}), tr::offload);
    int calls = 0;
    auto const hr = store.save(dview(dx, {m, k}), tr::recompute, [&](dview out) {
      ++calls;
      upload(b, x, out.data_handle());
    });
    CHECK(store.stats().resident_bytes == bytes);
    CHECK(store.stats().host_bytes == 2 * bytes);
    CHECK(store.stats().saved_bytes == 3 * bytes);
    upload(b, junk, dx);  // the caller reuses its buffer
    store.prefetch(hp);
    CHECK(store.stats().resident_bytes == 2 * bytes);
    for (auto h : {hk, ho, hp, hr}) {
      upload(b, junk, dy);
      store.load(h, dview(dy, {m, k}));
      CHECK(download(b, dy, n) == x);
    }
    CHECK(calls == 1);
    CHECK(store.size() == 0);
    CHECK(store.stats().resident_bytes == 0);
    CHECK(store.stats().host_bytes == 0);
    CHECK(store.stats().host_peak_bytes == 2 * bytes);
    CHECK(store.stats().resident_peak_bytes == 2 * bytes);
    store.save(dview(dx, {m, k}), tr::offload);  // left in the store: its destructor frees it
  }
  b.deallocate(dx, n);
  b.deallocate(dy, n);
}

TEST_CASE("CUDA saved_tensor_store: fp8, kept or offloaded, is the CUDA quantiser's round trip, in the host store's bytes") {
  k3::cuda::stream_backend b;
  index_t const m = 3, k = 200;
  std::size_t const n = static_cast<std::size_t>(m * k);
  auto const g = k3::test::gaussian(n, 8, 2.0);
  std::vector<float> const x(g.begin(), g.end());
  float* dx = b.allocate<float>(n);
  float* dy = b.allocate<float>(n);
  std::uint8_t* q = b.allocate<std::uint8_t>(n);
  float* s = b.allocate<float>(static_cast<std::size_t>(m * 2));
  upload(b, x, dx);
  namespace qc = k3::quant::cuda;
  qc::fp8_quantize<float>(qc::dview<float const, 2>(dx, {m, k}), qc::dview<std::uint8_t, 2>(q, {m, k}), qc::dview<float, 2>(s, {m, 2}),
                          k3::quant::tile_1x128, k3::quant::scale_format::fp32);
  qc::fp8_dequantize(qc::dview<std::uint8_t const, 2>(q, {m, k}), qc::dview<float const, 2>(s, {m, 2}), qc::dview<float, 2>(dy, {m, k}),
                     k3::quant::tile_1x128);
  b.fence();
  auto const want = download(b, dy, n);
  tr::saved_tensor_store<k3::cuda::stream_backend> store(b);
  auto const hk = store.save(dview(dx, {m, k}), tr::fp8);
  auto const ho = store.save(dview(dx, {m, k}), tr::fp8 | tr::offload);
  auto const hp = store.save(dview(dx, {m, k}), tr::fp8 | tr::offload);
  std::size_t const bytes = n + static_cast<std::size_t>(m * 2) * sizeof(float);
  CHECK(store.stats().resident_bytes == bytes);
  CHECK(store.stats().host_bytes == 2 * bytes);
  store.prefetch(hp);
  for (auto h : {hk, ho, hp}) {
    b.zero_fill(dy, n);
    store.load(h, dview(dy, {m, k}));
    auto const got = download(b, dy, n);
    CHECK(got == want);
    for (std::size_t i = 0; i < n; ++i) CHECK(std::abs(got[i] - x[i]) <= std::abs(x[i]) / 16 + 1e-2f);
  }
  b.deallocate(dx, n);
  b.deallocate(dy, n);
  b.deallocate(s, static_cast<std::size_t>(m * 2));
  b.deallocate(q, n);
}

TEST_CASE("CUDA saved_tensor_store: fp8 of bfloat16, kept or offloaded, loads the host store's bits") {
  k3::cuda::stream_backend b;
  using bf = k3::bfloat16;
  for (index_t k : {index_t(200), index_t(128), index_t(1)}) {
    CAPTURE(k);
    index_t const m = 5;
    std::size_t const n = static_cast<std::size_t>(m * k);
    auto const g = k3::test::gaussian(n, 9, 3.0);
    std::vector<bf> x(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = bf(static_cast<float>(g[i]));
    x[3] = bf(0.0f);
    x[n - 1] = bf(-1e-30f);  // a subnormal step of its tile
    // The host store's round trip, the reference.
    k3::cpu::serial host;
    tr::saved_tensor_store<k3::cpu::serial> hs(host);
    std::vector<bf> want(n);
    hs.load(hs.save(k3::tensor_view<bf const, 2>(x.data(), {m, k}), tr::fp8), k3::tensor_view<bf, 2>(want.data(), {m, k}));
    bf* dx = b.allocate<bf>(n);
    bf* dy = b.allocate<bf>(n);
    b.copy(k3::tensor_view<bf const, 1>(x.data(), {index_t(n)}), k3::tensor_view<bf, 1, k3::cuda_device_space>(dx, {index_t(n)}));
    tr::saved_tensor_store<k3::cuda::stream_backend> store(b);
    using bview = k3::tensor_view<bf, 2, k3::cuda_device_space>;
    auto const hk = store.save(bview(dx, {m, k}), tr::fp8);
    auto const ho = store.save(bview(dx, {m, k}), tr::fp8 | tr::offload);
    std::size_t const bytes = n + static_cast<std::size_t>(m * ((k + 127) / 128)) * sizeof(float);
    CHECK(store.stats().saved_bytes == 2 * bytes);
    CHECK(hs.stats().saved_bytes == bytes);
    b.zero_fill(dx, n);  // the saved tensor is the store's copy
    for (auto h : {hk, ho}) {
      b.zero_fill(dy, n);
      store.load(h, bview(dy, {m, k}));
      std::vector<bf> got(n);
      b.copy(k3::tensor_view<bf const, 1, k3::cuda_device_space>(dy, {index_t(n)}), k3::tensor_view<bf, 1>(got.data(), {index_t(n)}));
      b.fence();
      std::size_t same = 0;
      for (std::size_t i = 0; i < n; ++i) same += got[i].bits == want[i].bits;
      CHECK(same == n);
    }
    b.deallocate(dx, n);
    b.deallocate(dy, n);
  }
}

TEST_CASE("CUDA saved_tensor_store: errors name what went wrong") {
  k3::cuda::stream_backend b;
  tr::saved_tensor_store<k3::cuda::stream_backend> store(b);
  float* d = b.allocate<float>(12);
  b.zero_fill(d, 12);
  auto const h = store.save(dview(d, {3, 4}), tr::offload);
  store.load(h, dview(d, {3, 4}));
  CHECK(k3::test::error_of([&] { store.load(h, dview(d, {3, 4})); }).find("already loaded") != std::string::npos);
  auto const r = store.save(dview(d, {3, 4}), tr::keep);
  store.release(r);
  CHECK(k3::test::error_of([&] { store.prefetch(r); }).find("already released") != std::string::npos);
  double* dd = b.allocate<double>(4);
  CHECK(k3::test::error_of([&] { store.save(k3::tensor_view<double, 1, k3::cuda_device_space>(dd, {4}), tr::fp8); })
            .find("policy fp8 on the CUDA backend holds float32 or bfloat16 tensors, got float64") != std::string::npos);
  b.deallocate(dd, 4);
  CHECK(k3::test::error_of([&] { store.save(dview(d, {3, 2}, {4, 2}), tr::keep); }).find("contiguous") != std::string::npos);
  auto const k = store.save(dview(d, {3, 4}), tr::keep);
  CHECK(k3::test::error_of([&] { store.load(k, dview(d, {4, 3})); }).find("argument 'out': expected a float32 tensor of shape [3, 4]") !=
        std::string::npos);
  store.release(k);
  b.deallocate(d, 12);
}
