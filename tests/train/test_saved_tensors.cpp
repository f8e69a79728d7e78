// k3::train::saved_tensor_store: every policy gives the tensor back (keep, recompute and
// offload bit for bit, fp8 as the quantiser's round trip, within E4M3's bound), strided and
// empty views, the two pools' bytes and peaks, prefetch, and the errors.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/train/saved_tensors.hpp"
#include "support/error_of.hpp"
#include "support/random.hpp"

namespace tr = k3::train;
using k3::index_t;

namespace {

std::vector<float> random_floats(std::size_t n, unsigned seed) {
  auto const g = k3::test::gaussian(n, seed, 3.0);
  return {g.begin(), g.end()};
}

}  // namespace

TEST_CASE("saved_tensor_store: keep, offload and recompute give the tensor back bit for bit, the pools count their bytes") {
  tr::saved_tensor_store<k3::cpu::serial> store;
  auto x = random_floats(6 * 40, 1);
  k3::tensor_view<float, 2> xv(x.data(), {6, 40});
  auto const hk = store.save(xv, tr::keep);
  CHECK(store.stats().resident_bytes == x.size() * sizeof(float));
  auto const ho = store.save(xv, tr::offload);
  CHECK(store.stats().resident_bytes == x.size() * sizeof(float));
  CHECK(store.stats().host_bytes == x.size() * sizeof(float));
  int calls = 0;
  auto const hr = store.save(xv, tr::recompute, [&](k3::tensor_view<float, 2> out) {
    ++calls;
    for (index_t i = 0; i < 6; ++i)
      for (index_t j = 0; j < 40; ++j) out(i, j) = x[static_cast<std::size_t>(i * 40 + j)];
  });
  CHECK(store.stats().saved_bytes == 2 * x.size() * sizeof(float));  // recompute stores nothing
  CHECK(calls == 0);
  std::vector<float> const want = x;
  std::fill(x.begin(), x.end(), -1.f);  // the caller's buffer is reused after save
  std::vector<float> back(want.size());
  k3::tensor_view<float, 2> bv(back.data(), {6, 40});
  store.prefetch(ho);
  CHECK(store.stats().host_bytes == 0);
  CHECK(store.stats().resident_bytes == 2 * want.size() * sizeof(float));
  CHECK(store.stats().resident_peak_bytes == 2 * want.size() * sizeof(float));
  store.load(ho, bv);
  CHECK(std::memcmp(back.data(), want.data(), back.size() * sizeof(float)) == 0);
  store.load(hk, bv);
  CHECK(std::memcmp(back.data(), want.data(), back.size() * sizeof(float)) == 0);
  CHECK(store.stats().resident_bytes == 0);
  x = want;
  store.load(hr, bv);
  CHECK(calls == 1);
  CHECK(back == want);
  CHECK(store.size() == 0);
  CHECK(store.stats().host_peak_bytes == want.size() * sizeof(float));
}

TEST_CASE("saved_tensor_store: strided views in and out, rank 1 and 3, empty tensors, integers under keep") {
  tr::saved_tensor_store<k3::cpu::serial> store;
  std::vector<double> big(5 * 8);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<double>(i) * 0.25;
  k3::tensor_view<double, 2> strided(big.data(), {5, 3}, {8, 2});  // every other column of the first 6
  auto const h = store.save(strided, tr::fp8 | tr::offload);
  auto const hk = store.save(strided, tr::keep);
  std::vector<double> out(5 * 3 * 2);
  k3::tensor_view<double, 2> ov(out.data() + 1, {5, 3}, {6, 2});
  store.load(hk, ov);
  for (index_t i = 0; i < 5; ++i)
    for (index_t j = 0; j < 3; ++j) CHECK(ov(i, j) == strided(i, j));
  store.load(h, ov);
  for (index_t i = 0; i < 5; ++i)
    for (index_t j = 0; j < 3; ++j) CHECK(std::abs(ov(i, j) - strided(i, j)) <= std::abs(strided(i, j)) / 16 + 1e-3);
  std::vector<std::int32_t> ids{3, 1, 4, 1, 5, 9};
  auto const hi = store.save(k3::tensor_view<std::int32_t, 3>(ids.data(), {1, 2, 3}), tr::offload);
  std::vector<std::int32_t> ib(6);
  store.load(hi, k3::tensor_view<std::int32_t, 3>(ib.data(), {1, 2, 3}));
  CHECK(ib == ids);
  auto const he = store.save(k3::tensor_view<float, 1>(nullptr, {0}), tr::fp8);
  store.load(he, k3::tensor_view<float, 1>(nullptr, {0}));
  auto const he2 = store.save(k3::tensor_view<float, 2>(nullptr, {4, 0}), tr::fp8);
  store.load(he2, k3::tensor_view<float, 2>(nullptr, {4, 0}));
}

TEST_CASE("saved_tensor_store: fp8 is the 1x128 E4M3 round trip, at about a quarter of float's bytes, NaN stays in its tile") {
  k3::cpu::threads<> cpu(2);
  tr::saved_tensor_store<k3::cpu::threads<>> store(cpu);
  index_t const m = 7, k = 300;  // three 128-wide tiles per row, the last partial
  auto x = random_floats(static_cast<std::size_t>(m * k), 4);
  x[static_cast<std::size_t>(3 * k + 200)] = std::numeric_limits<float>::quiet_NaN();
  k3::tensor_view<float, 2> xv(x.data(), {m, k});
  auto const h = store.save(xv, tr::fp8);
  std::size_t const want_bytes = static_cast<std::size_t>(m * k) + static_cast<std::size_t>(m * 3) * sizeof(float);
  CHECK(store.stats().saved_bytes == want_bytes);
  CHECK(store.stats().resident_bytes == want_bytes);
  CHECK(static_cast<double>(want_bytes) <= 0.27 * static_cast<double>(x.size() * sizeof(float)));
  // The direct round trip through k3's quantiser, for comparison.
  std::vector<std::uint8_t> q(x.size());
  std::vector<float> s(static_cast<std::size_t>(m * 3)), rt(x.size()), back(x.size());
  k3::quant::fp8_quantize(cpu, k3::quant::fp8_quantize_args<float>{.x = k3::tensor_view<float const, 2>(x.data(), {m, k}),
                                                                   .q = k3::tensor_view<std::uint8_t, 2>(q.data(), {m, k}),
                                                                   .scales = k3::tensor_view<float, 2>(s.data(), {m, 3})});
  k3::quant::fp8_dequantize(cpu, k3::quant::fp8_dequantize_args<float>{.q = k3::tensor_view<std::uint8_t const, 2>(q.data(), {m, k}),
                                                                       .scales = k3::tensor_view<float const, 2>(s.data(), {m, 3}),
                                                                       .y = k3::tensor_view<float, 2>(rt.data(), {m, k})});
  store.load(h, k3::tensor_view<float, 2>(back.data(), {m, k}));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < k; ++j) {
      std::size_t const e = static_cast<std::size_t>(i * k + j);
      bool const nan_tile = i == 3 && j >= 128 && j < 256;
      CHECK(std::isnan(back[e]) == nan_tile);
      if (nan_tile) continue;
      CHECK(back[e] == rt[e]);
      CHECK(std::abs(back[e] - x[e]) <= std::abs(x[e]) / 16 + 1e-2f);
    }
  // bfloat16 and double go through the same codes.
  std::vector<k3::bfloat16> xb(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) xb[i] = k3::bfloat16(std::isnan(x[i]) ? 1.f : x[i]);
  auto const hb = store.save(k3::tensor_view<k3::bfloat16, 2>(xb.data(), {m, k}), tr::fp8);
  std::vector<k3::bfloat16> bb(x.size());
  store.load(hb, k3::tensor_view<k3::bfloat16, 2>(bb.data(), {m, k}));
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(std::abs(float(bb[i]) - float(xb[i])) <= std::abs(float(xb[i])) / 16 + 1e-2f);
}

TEST_CASE("saved_tensor_store: errors name what went wrong") {
  tr::saved_tensor_store<k3::cpu::serial> store;
  std::vector<float> x(12, 1.f), y(12);
  k3::tensor_view<float, 2> xv(x.data(), {3, 4}), yv(y.data(), {3, 4});
  auto const h = store.save(xv, tr::keep);
  store.load(h, yv);
  CHECK(k3::test::error_of([&] { store.load(h, yv); }).find("already loaded") != std::string::npos);
  auto const r = store.save(xv, tr::offload);
  store.release(r);
  CHECK(k3::test::error_of([&] { store.load(r, yv); }).find("already released") != std::string::npos);
  CHECK(k3::test::error_of([&] { store.load(tr::saved_handle{99}, yv); }).find("not issued by this store") != std::string::npos);
  std::vector<std::int64_t> ids(4);
  CHECK(k3::test::error_of([&] { store.save(k3::tensor_view<std::int64_t, 1>(ids.data(), {4}), tr::fp8); })
            .find("policy fp8 cannot apply to a tensor of int64") != std::string::npos);
  CHECK(k3::test::error_of([&] { store.save(xv, tr::recompute); }).find("needs the callable") != std::string::npos);
  CHECK(k3::test::error_of([&] { store.save(xv, tr::recompute | tr::offload, [](k3::tensor_view<float, 2>) {}); })
            .find("combines with no other policy") != std::string::npos);
  auto const k = store.save(xv, tr::keep);
  std::vector<double> d(12);
  CHECK(k3::test::error_of([&] { store.load(k, k3::tensor_view<double, 2>(d.data(), {3, 4})); })
            .find("argument 'out': expected a float32 tensor of shape [3, 4], got float64 [3, 4]") != std::string::npos);
  CHECK(k3::test::error_of([&] { store.load(k, k3::tensor_view<float, 2>(y.data(), {4, 3})); }).find("argument 'out'") != std::string::npos);
  store.load(k, yv);  // a failed load leaves the entry in place
  CHECK(y == x);
  CHECK(tr::policy_name(tr::fp8 | tr::offload) == "fp8|offload");
}
