// Block-scaled FP8 GEMM (1x128 A tiles, 128x128 B blocks): the SIMD/threads kernel is
// bit-identical to the scalar reference; both match a float64 GEMM of the dequantised
// operands within fp32 accumulation error, and the original float GEMM within FP8 error.
#include <doctest/doctest.h>

#include <cmath>

#include "quant_test_util.hpp"

using namespace k3;
using namespace k3::quant;

namespace {
struct operands {
  index_t m, n, k;
  std::vector<float> a, b;
  std::vector<std::uint8_t> qa, qb;
  std::vector<float> sa, sb;
};

operands make(index_t m, index_t n, index_t k, std::uint32_t seed) {
  operands o{m, n, k, qt::random_matrix(m, k, seed, 2.0f), qt::random_matrix(n, k, seed + 1, 1.0f), {}, {}, {}, {}};
  o.qa.resize(m * k);
  o.qb.resize(n * k);
  o.sa.resize(m * qt::cdiv(k, 128));
  o.sb.resize(qt::cdiv(n, 128) * qt::cdiv(k, 128));
  cpu::threads<> thr(2);
  fp8_quantize(thr,
               fp8_quantize_args<float>{
                   .x = host_view(o.a.data(), m, k), .q = host_view(o.qa.data(), m, k), .scales = host_view(o.sa.data(), m, qt::cdiv(k, 128))},
               {.tile = tile_1x128});
  fp8_quantize(
      thr,
      fp8_quantize_args<float>{
          .x = host_view(o.b.data(), n, k), .q = host_view(o.qb.data(), n, k), .scales = host_view(o.sb.data(), qt::cdiv(n, 128), qt::cdiv(k, 128))},
      {.tile = tile_128x128});
  return o;
}

template <class B>
std::vector<float> gemm(B const& be, operands const& o) {
  std::vector<float> c(o.m * o.n, -7.0f);
  fp8_block_gemm(be, fp8_block_gemm_args<>{.a_q = host_view(o.qa.data(), o.m, o.k),
                                           .a_scales = host_view(o.sa.data(), o.m, qt::cdiv(o.k, 128)),
                                           .b_q = host_view(o.qb.data(), o.n, o.k),
                                           .b_scales = host_view(o.sb.data(), qt::cdiv(o.n, 128), qt::cdiv(o.k, 128)),
                                           .c = host_view(c.data(), o.m, o.n)});
  return c;
}
}  // namespace

TEST_CASE("fp8 block GEMM: SIMD/threads == reference, close to float64 of dequantised operands") {
  std::uint32_t seed = 10;
  for (auto mnk : {std::tuple<index_t, index_t, index_t>{1, 1, 1}, {1, 129, 128}, {7, 33, 300}, {67, 200, 257}, {130, 256, 512}, {9, 130, 129}}) {
    auto const [m_, n_, k_] = mnk;
    index_t const m = m_, n = n_, k = k_;  // named copies: clang 14 lambdas cannot capture bindings
    CAPTURE(m);
    CAPTURE(n);
    CAPTURE(k);
    auto o = make(m, n, k, seed += 2);
    auto ref = gemm(cpu::serial{}, o);
    auto sim = gemm(cpu::simd<>{}, o);
    auto thr = gemm(cpu::threads<>(3), o);
    long diff = 0;
    for (std::size_t i = 0; i < ref.size(); ++i)
      diff += k3::detail::bit_cast<std::uint32_t>(ref[i]) != k3::detail::bit_cast<std::uint32_t>(sim[i]) ||
              k3::detail::bit_cast<std::uint32_t>(ref[i]) != k3::detail::bit_cast<std::uint32_t>(thr[i]);
    CHECK(diff == 0);
    // float64 of dequantised operands
    long bad = 0;
    double num = 0, den = 0;
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < n; ++j) {
        double exact = 0, mag = 0, orig = 0;
        for (index_t kk = 0; kk < k; ++kk) {
          double const a = double(decode<e4m3_format>(o.qa[i * k + kk])) * o.sa[i * qt::cdiv(k, 128) + kk / 128];
          double const b = double(decode<e4m3_format>(o.qb[j * k + kk])) * o.sb[(j / 128) * qt::cdiv(k, 128) + kk / 128];
          exact += a * b;
          mag += std::fabs(a * b);
          orig += double(o.a[i * k + kk]) * o.b[j * k + kk];
        }
        bad += std::fabs(ref[i * n + j] - exact) > (k + 4) * 0x1p-24 * mag + 1e-30;
        num += (ref[i * n + j] - orig) * (ref[i * n + j] - orig);
        den += orig * orig;
      }
    CHECK(bad == 0);
    // FP8 error against the unquantised product: relative Frobenius error a few percent at most
    CHECK(std::sqrt(num / std::max(den, 1e-300)) < 0.1);
  }
}

TEST_CASE("fp8 block GEMM: strided output and bad arguments") {
  auto o = make(20, 40, 256, 77);
  auto ref = gemm(cpu::serial{}, o);
  std::vector<float> big(20 * 50, 0.0f);
  tensor_view<float, 2> cv(big.data(), {20, 40}, {50, 1});
  fp8_block_gemm(cpu::threads<>(2), fp8_block_gemm_args<>{.a_q = host_view(o.qa.data(), 20, 256),
                                                          .a_scales = host_view(o.sa.data(), 20, 2),
                                                          .b_q = host_view(o.qb.data(), 40, 256),
                                                          .b_scales = host_view(o.sb.data(), 1, 2),
                                                          .c = cv});
  long diff = 0;
  for (int i = 0; i < 20; ++i)
    for (int j = 0; j < 40; ++j) diff += big[i * 50 + j] != ref[i * 40 + j];
  CHECK(diff == 0);
  std::vector<float> c(20 * 40);
  cpu::serial ser;
  CHECK_THROWS_AS(fp8_block_gemm(ser, fp8_block_gemm_args<>{.a_q = host_view(o.qa.data(), 20, 256),
                                                            .a_scales = host_view(o.sa.data(), 20, 1),
                                                            .b_q = host_view(o.qb.data(), 40, 256),
                                                            .b_scales = host_view(o.sb.data(), 1, 2),
                                                            .c = host_view(c.data(), 20, 40)}),
                  k3::error);
  CHECK_THROWS_AS(fp8_block_gemm(ser, fp8_block_gemm_args<>{.a_q = host_view(o.qa.data(), 20, 256),
                                                            .a_scales = host_view(o.sa.data(), 20, 2),
                                                            .b_q = host_view(o.qb.data(), 40, 256),
                                                            .b_scales = host_view(o.sb.data(), 2, 2),
                                                            .c = host_view(c.data(), 20, 40)}),
                  k3::error);
  CHECK_THROWS_AS(fp8_block_gemm(ser, fp8_block_gemm_args<>{.a_q = host_view(o.qa.data(), 20, 256),
                                                            .a_scales = host_view(o.sa.data(), 20, 2),
                                                            .b_q = host_view(o.qb.data(), 40, 128),
                                                            .b_scales = host_view(o.sb.data(), 1, 1),
                                                            .c = host_view(c.data(), 20, 40)}),
                  k3::error);
  CHECK_THROWS_AS(fp8_block_gemm(ser, fp8_block_gemm_args<>{.a_q = host_view(o.qa.data(), 20, 256),
                                                            .a_scales = host_view(o.sa.data(), 20, 2),
                                                            .b_q = host_view(o.qb.data(), 40, 256),
                                                            .b_scales = host_view(o.sb.data(), 1, 2),
                                                            .c = host_view(c.data(), 20, 41)}),
                  k3::error);
}
