#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "k3/backend/cpu/simd.hpp"

TEST_CASE("the reduce_add shim sums every lane") {
  using batch = xsimd::batch<float>;
  std::vector<float> v(batch::size);
  std::iota(v.begin(), v.end(), 1.f);
  auto b = batch::load_unaligned(v.data());
  float n = float(batch::size);
  CHECK(k3::simd::reduce_add(b) == doctest::Approx(n * (n + 1) / 2));
  using dbatch = xsimd::batch<double>;
  std::vector<double> d(dbatch::size, 0.25);
  CHECK(k3::simd::reduce_add(dbatch::load_unaligned(d.data())) == doctest::Approx(0.25 * dbatch::size));
}

TEST_CASE("the ISA name is reported") {
  CHECK(std::strlen(k3::simd::isa_name<xsimd::default_arch>()) > 0);
}

// Distance in units of the last place of the correctly rounded float (2^-149 among subnormals).
static double ulps_from(float got, double want) {
  float const near = static_cast<float>(want);
  double const ulp = std::max(std::ldexp(1.0, -149), double(std::nextafter(std::abs(near), INFINITY)) - double(std::abs(near)));
  return std::abs(double(got) - want) / ulp;
}

TEST_CASE("exp_nonpositive of the build's ISA: within 2 ulp on [-104 to 0] and exact at NaN, -inf, 0 and below -104") {
  using batch = xsimd::batch<float>;
  using arch = xsimd::default_arch;
  // The AVX2 and AVX-512 kernels underflow gradually; xsimd::exp, which serves the others, flushes
  // results below the normal range to zero.
  constexpr bool gradual = std::is_base_of_v<xsimd::avx512f, arch> || std::is_base_of_v<xsimd::fma3<xsimd::avx2>, arch>;
  constexpr std::size_t L = batch::size;
  // A dense sweep: every 997th float bit pattern from 0 down to -104 (about 1.1 million inputs),
  // plus the points where the result turns subnormal and where it rounds to zero.
  std::vector<float> in;
  for (std::uint32_t bits = 0x80000000u; bits <= 0xC2D00000u; bits += 997) {
    float v;
    std::memcpy(&v, &bits, sizeof v);
    in.push_back(v);
  }
  for (float v : {-87.3365f, -87.3366f, -88.0f, -100.0f, -103.2789f, -103.9f, -104.0f, -0.0f, -1e-30f}) in.push_back(v);
  while (in.size() % (4 * L) != 0) in.push_back(-1.0f);
  double worst = 0;
  float worst_at = 0;
  std::size_t unlike = 0;
  for (std::size_t i = 0; i < in.size(); i += 4 * L) {
    batch one = batch::load_unaligned(in.data() + i);
    float single[L];
    k3::simd::exp_nonpositive(one).store_unaligned(single);
    batch four[4];
    for (std::size_t u = 0; u < 4; ++u) four[u] = batch::load_unaligned(in.data() + i + u * L);
    k3::simd::exp_nonpositive_n(four);
    float got[4 * L];
    for (std::size_t u = 0; u < 4; ++u) four[u].store_unaligned(got + u * L);
    for (std::size_t l = 0; l < L; ++l) unlike += std::memcmp(&single[l], &got[l], sizeof(float)) != 0;  // U chains round alike
    for (std::size_t l = 0; l < 4 * L; ++l) {
      double const want = std::exp(double(in[i + l]));
      double const e = !gradual && want < std::numeric_limits<float>::min() ? (got[l] <= std::numeric_limits<float>::min() ? 0.0 : 1e9)
                                                                           : ulps_from(got[l], want);
      if (e > worst) worst = e, worst_at = in[i + l];
    }
  }
  INFO("worst input " << worst_at << " (" << std::string(k3::simd::isa_name<arch>()) << ")");
  CHECK(worst <= 2.0);
  CHECK(unlike == 0);
  // Special values: NaN stays NaN, -inf and anything below -104 give 0, 0 gives exactly 1.
  float sp[L];
  for (std::size_t l = 0; l < L; ++l) sp[l] = -200.0f;
  sp[0] = std::numeric_limits<float>::quiet_NaN();
  sp[1 % L] = 0.0f;
  if (L > 2) sp[2] = -std::numeric_limits<float>::infinity();
  float out[L];
  k3::simd::exp_nonpositive(batch::load_unaligned(sp)).store_unaligned(out);
  if (L > 1) {
    CHECK(std::isnan(out[0]));
    CHECK(out[1] == 1.0f);
  }
  for (std::size_t l = 2; l < L; ++l) CHECK(out[l] == 0.0f);
}

TEST_CASE("store_stream writes every lane of a 64-byte-aligned vector") {
  using batch = xsimd::batch<float>;
  alignas(64) float out[16 + batch::size] = {};
  float v[batch::size];
  std::iota(v, v + batch::size, 1.0f);
  k3::simd::store_stream(out + 16, batch::load_unaligned(v));
  k3::simd::stream_fence<xsimd::default_arch>();
  for (std::size_t l = 0; l < 16; ++l) CHECK(out[l] == 0.0f);
  for (std::size_t l = 0; l < batch::size; ++l) CHECK(out[16 + l] == v[l]);
}

TEST_CASE("threads backend covers the range exactly once") {
  for (int nt : {1, 2, 3, 8}) {
    k3::cpu::threads<> b(nt);
    CHECK(b.concurrency() == nt);
    for (std::int64_t n : {0, 1, 2, 7, 1000}) {
      std::vector<int> hits(static_cast<std::size_t>(n), 0);
      b.for_each(0, n, [&](std::int64_t i) { ++hits[static_cast<std::size_t>(i)]; });
      for (int h : hits) REQUIRE(h == 1);
    }
  }
}

TEST_CASE("simd backend: aligned allocation, in-order for_each, a vector loop over its memory") {
  k3::cpu::simd<> b;
  std::size_t const n = 1000;
  float* p = b.allocate<float>(n);
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 64 == 0);
  b.for_each(0, std::int64_t(n), [&](std::int64_t i) { p[i] = float(i % 7); });
  using batch = xsimd::batch<float>;
  std::size_t const vec = n - n % batch::size;
  batch acc(0.f);
  for (std::size_t i = 0; i < vec; i += batch::size) acc += batch::load_aligned(p + i);
  float s = k3::simd::reduce_add(acc);
  for (std::size_t i = vec; i < n; ++i) s += p[i];
  double ref = 0;
  for (std::size_t i = 0; i < n; ++i) ref += double(i % 7);
  CHECK(s == doctest::Approx(ref));
  b.deallocate(p, n);
  static_assert(k3::cpu::simd<>::concurrency() == 1);
  static_assert(std::is_same_v<k3::cpu::simd<>::arch_type, xsimd::default_arch>);
}

TEST_CASE("threads backend: shared pools, dynamic tasks, exceptions, bad pool") {
  auto pool = std::make_shared<k3::cpu::thread_pool>(3);
  k3::cpu::threads<> a(pool);
  k3::cpu::threads<> b = a;  // copies share the pool
  CHECK(&a.pool() == &b.pool());
  CHECK(a.concurrency() == 3);
  std::vector<std::atomic<int>> hits(50);
  b.for_each_task(50, [&](std::int64_t i) { hits[std::size_t(i)]++; });
  for (auto& h : hits) REQUIRE(h.load() == 1);
  std::atomic<std::int64_t> sum{0};
  a.for_each(-5, 5, [&](std::int64_t i) { sum += i; });
  CHECK(sum.load() == -5);
  CHECK_THROWS_AS(a.for_each(0, 100,
                             [&](std::int64_t i) {
                               if (i == 50) throw k3::error(k3::error_kind::value, "task failed");
                             }),
                  k3::error);
  CHECK_THROWS_AS(k3::cpu::threads<>(std::shared_ptr<k3::cpu::thread_pool>{}), k3::error);
  CHECK(k3::cpu::threads<>().concurrency() >= 1);  // default: one per hardware thread
}
