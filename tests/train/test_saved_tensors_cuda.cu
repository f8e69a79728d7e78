// k3::train::saved_tensor_store on a CUDA backend (k3/train/saved_tensors.cuh): keep, offload
// (with and without prefetch) and recompute give device tensors back bit for bit after the
// caller overwrote them; the resident and host pools count the bytes; the errors are the host
// store's. Runs on the CPU through the SIMT host runtime in every build, and on a GPU in the
// nvcc build.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

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
  CHECK(k3::test::error_of([&] { store.save(dview(d, {3, 4}), tr::fp8); }).find("not available on the CUDA backend") != std::string::npos);
  CHECK(k3::test::error_of([&] { store.save(dview(d, {3, 2}, {4, 2}), tr::keep); }).find("contiguous") != std::string::npos);
  auto const k = store.save(dview(d, {3, 4}), tr::keep);
  CHECK(k3::test::error_of([&] { store.load(k, dview(d, {4, 3})); }).find("argument 'out': expected a float32 tensor of shape [3, 4]") !=
        std::string::npos);
  store.release(k);
  b.deallocate(d, 12);
}
