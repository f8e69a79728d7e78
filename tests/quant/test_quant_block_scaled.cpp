// Checks of the quantisation API the CLI cannot reach: the block-scaled GEMM on
// awkward M/N/K with transposed (column-strided) operand views against a float64 reference of
// dequant(A) dequant(B)^T with per-128-block fp32 promotion; 1x128 -> 128x1 requantisation on
// row and column tails on every backend; scale-shape errors naming the argument with expected
// vs actual shapes.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "quant_test_util.hpp"
#include "support/error_of.hpp"

using namespace k3;
using namespace k3::quant;
using qt::cdiv;

namespace {

struct quantised {
  index_t rows, k;
  std::vector<std::uint8_t> q;
  std::vector<float> s;
};

quantised quantise(std::vector<float> const& x, index_t rows, index_t k, tile t) {
  quantised o{rows, k, std::vector<std::uint8_t>(std::size_t(rows * k)), std::vector<float>(std::size_t(cdiv(rows, t.rows) * cdiv(k, t.cols)))};
  fp8_quantize(cpu::serial{},
               fp8_quantize_args<float>{.x = host_view(x.data(), rows, k),
                                        .q = host_view(o.q.data(), rows, k),
                                        .scales = host_view(o.s.data(), cdiv(rows, t.rows), cdiv(k, t.cols))},
               {.tile = t});
  return o;
}

// Transposed copy of an [r, c] byte matrix, viewed back as [r, c] with strides (1, r).
std::vector<std::uint8_t> transposed(std::vector<std::uint8_t> const& v, index_t r, index_t c) {
  std::vector<std::uint8_t> t(v.size());
  for (index_t i = 0; i < r; ++i)
    for (index_t j = 0; j < c; ++j) t[std::size_t(j * r + i)] = v[std::size_t(i * c + j)];
  return t;
}

double dec8(std::uint8_t c) { return double(decode<e4m3_format>(c)); }

}  // namespace

TEST_CASE("block-scaled GEMM on awkward M/N/K, transposed operand views, every backend, vs float64") {
  cpu::threads<> thr(2);
  struct mnk {
    index_t m, n, k;
  };
  for (mnk s : {mnk{1, 1, 1}, mnk{1, 127, 129}, mnk{127, 1, 257}, mnk{129, 257, 1}, mnk{257, 129, 127}, mnk{3, 130, 256}, mnk{1, 1, 385}}) {
    CAPTURE(s.m);
    CAPTURE(s.n);
    CAPTURE(s.k);
    auto A = quantise(qt::random_matrix(s.m, s.k, std::uint32_t(s.m * 7 + s.k), 2.0f), s.m, s.k, tile_1x128);
    auto B = quantise(qt::random_matrix(s.n, s.k, std::uint32_t(s.n * 5 + s.k), 2.0f), s.n, s.k, tile_128x128);
    index_t const kb = cdiv(s.k, 128);
    // float64 reference: per K block, the exact sum of products (|sum| < 2^24 ulps of fp32 here
    // only approximately: compare with a tolerance of the fp32 partial sums' rounding)
    std::vector<double> ref(std::size_t(s.m * s.n)), mag(std::size_t(s.m * s.n));
    for (index_t i = 0; i < s.m; ++i)
      for (index_t j = 0; j < s.n; ++j) {
        double acc = 0, am = 0;
        for (index_t b = 0; b < kb; ++b) {
          double p = 0, pm = 0;
          for (index_t x = b * 128; x < std::min(s.k, b * 128 + 128); ++x) {
            double const t = dec8(A.q[std::size_t(i * s.k + x)]) * dec8(B.q[std::size_t(j * s.k + x)]);
            p += t;
            pm += std::fabs(t);
          }
          double const sc = double(A.s[std::size_t(i * kb + b)]) * double(B.s[std::size_t((j / 128) * kb + b)]);
          acc += p * sc;
          am += pm * std::fabs(sc);
        }
        ref[std::size_t(i * s.n + j)] = acc;
        mag[std::size_t(i * s.n + j)] = am;
      }
    auto qat = transposed(A.q, s.m, s.k), qbt = transposed(B.q, s.n, s.k);
    const_view<std::uint8_t, 2> qa_t(qat.data(), {s.m, s.k}, {1, s.m}), qb_t(qbt.data(), {s.n, s.k}, {1, s.n});
    std::vector<float> c0(std::size_t(s.m * s.n));
    fp8_block_gemm(cpu::serial{}, fp8_block_gemm_args<>{.a_q = host_view(A.q.data(), s.m, s.k),
                                                        .a_scales = host_view(A.s.data(), s.m, kb),
                                                        .b_q = host_view(B.q.data(), s.n, s.k),
                                                        .b_scales = host_view(B.s.data(), cdiv(s.n, 128), kb),
                                                        .c = host_view(c0.data(), s.m, s.n)});
    double worst = 0;
    for (std::size_t e = 0; e < ref.size(); ++e)
      worst = std::max(worst, std::fabs(double(c0[e]) - ref[e]) / (mag[e] * 0x1p-22 + 1e-300));
    CHECK(worst <= 1.0);  // within (128 + kb) fp32 roundings of the magnitudes
    auto check_same = [&](auto const& be, bool ta, bool tb) {
      std::vector<float> c(std::size_t(s.m * s.n), -3.0f);
      const_view<std::uint8_t, 2> qa = ta ? qa_t : const_view<std::uint8_t, 2>(A.q.data(), {s.m, s.k});
      const_view<std::uint8_t, 2> qb = tb ? qb_t : const_view<std::uint8_t, 2>(B.q.data(), {s.n, s.k});
      fp8_block_gemm(be, fp8_block_gemm_args<>{.a_q = qa,
                                               .a_scales = host_view(A.s.data(), s.m, kb),
                                               .b_q = qb,
                                               .b_scales = host_view(B.s.data(), cdiv(s.n, 128), kb),
                                               .c = host_view(c.data(), s.m, s.n)});
      CHECK(std::memcmp(c.data(), c0.data(), c.size() * sizeof(float)) == 0);
    };
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        CAPTURE(ta);
        CAPTURE(tb);
        check_same(cpu::serial{}, ta, tb);
        check_same(cpu::simd<>{}, ta, tb);
        check_same(thr, ta, tb);
      }
  }
}

TEST_CASE("1x128 -> 128x1 requantisation on row/column tails equals quantise(dequantise), every backend") {
  cpu::threads<> thr(3);
  struct mk {
    index_t m, k;
  };
  for (mk s : {mk{1, 1}, mk{1, 129}, mk{127, 1}, mk{129, 127}, mk{257, 130}, mk{128, 128}, mk{130, 257}}) {
    for (scale_format fmt : {scale_format::fp32, scale_format::ue8m0}) {
      CAPTURE(s.m);
      CAPTURE(s.k);
      CAPTURE(int(fmt));
      auto x = qt::random_matrix(s.m, s.k, std::uint32_t(s.m + 31 * s.k), 4.0f);
      index_t const kb = cdiv(s.k, 128), mb = cdiv(s.m, 128);
      std::vector<std::uint8_t> q(std::size_t(s.m * s.k));
      std::vector<float> sc(std::size_t(s.m * kb));
      fp8_quantize(
          cpu::serial{},
          fp8_quantize_args<float>{.x = host_view(x.data(), s.m, s.k), .q = host_view(q.data(), s.m, s.k), .scales = host_view(sc.data(), s.m, kb)},
          {.tile = tile_1x128, .format = fmt});
      std::vector<float> y(x.size());
      fp8_dequantize(cpu::serial{},
                     fp8_dequantize_args<float>{
                         .q = host_view(q.data(), s.m, s.k), .scales = host_view(sc.data(), s.m, kb), .y = host_view(y.data(), s.m, s.k)});
      std::vector<std::uint8_t> qr(q.size());
      std::vector<float> sr(std::size_t(mb * s.k));
      fp8_quantize(
          cpu::serial{},
          fp8_quantize_args<float>{.x = host_view(y.data(), s.m, s.k), .q = host_view(qr.data(), s.m, s.k), .scales = host_view(sr.data(), mb, s.k)},
          {.tile = tile_128x1, .format = fmt});
      auto run = [&](auto const& be) {
        std::vector<std::uint8_t> q2(q.size(), 0xAA);
        std::vector<float> s2(sr.size(), -1.0f);
        fp8_requantize_1x128_to_128x1(be,
                                      fp8_requantize_args<>{.q = host_view(q.data(), s.m, s.k),
                                                            .scales = host_view(sc.data(), s.m, kb),
                                                            .q2 = host_view(q2.data(), s.m, s.k),
                                                            .scales2 = host_view(s2.data(), mb, s.k)},
                                      {.format = fmt});
        CHECK(q2 == qr);
        CHECK(std::memcmp(s2.data(), sr.data(), sr.size() * sizeof(float)) == 0);
      };
      run(cpu::serial{});
      run(cpu::simd<>{});
      run(thr);
    }
  }
}

TEST_CASE("wrong scale shapes name the argument with expected and actual shapes") {
  index_t const m = 3, k = 130;
  std::vector<float> x(std::size_t(m * k), 1.0f), s(300), y(std::size_t(m * k));
  std::vector<std::uint8_t> q(std::size_t(m * k)), sm(16);
  auto e1 = k3::test::error_of([&] {
    fp8_quantize(cpu::serial{},
                 fp8_quantize_args<float>{.x = host_view(x.data(), m, k), .q = host_view(q.data(), m, k), .scales = host_view(s.data(), 3, 1)},
                 {.tile = tile_1x128});
  });
  CHECK(e1.find("'scales'") != std::string::npos);
  CHECK(e1.find("[3, 2]") != std::string::npos);
  CHECK(e1.find("[3, 1]") != std::string::npos);
  auto e2 = k3::test::error_of([&] {
    fp8_dequantize(cpu::serial{},
                   fp8_dequantize_args<float>{.q = host_view(q.data(), m, k), .scales = host_view(s.data(), 2, 2), .y = host_view(y.data(), m, k)},
                   {.tile = tile_128x128});
  });
  CHECK(e2.find("'scales'") != std::string::npos);
  CHECK(e2.find("[1, 2]") != std::string::npos);
  std::vector<float> x2(64 * 2);
  auto e3 = k3::test::error_of([&] {
    mx_quantize(cpu::serial{},
                mx_quantize_args<float>{.x = host_view(x2.data(), 2, 64), .q = host_view(q.data(), 2, 64), .scales = host_view(sm.data(), 2, 3)},
                {.element = mx_element::e4m3});
  });
  CHECK(e3.find("'scales'") != std::string::npos);
  CHECK(e3.find("[2, 2]") != std::string::npos);
  CHECK(e3.find("[2, 3]") != std::string::npos);
  auto e4 = k3::test::error_of([&] {
    fp8_block_gemm(cpu::serial{}, fp8_block_gemm_args<>{.a_q = host_view(q.data(), m, k),
                                                        .a_scales = host_view(s.data(), m, 1),
                                                        .b_q = host_view(q.data(), m, k),
                                                        .b_scales = host_view(s.data(), 1, 2),
                                                        .c = host_view(y.data(), m, m)});
  });
  CHECK(e4.find("'a_scales'") != std::string::npos);
  CHECK(e4.find("[3, 2]") != std::string::npos);
  auto e5 = k3::test::error_of([&] {
    fp8_requantize_1x128_to_128x1(cpu::serial{},
                                  fp8_requantize_args<>{.q = host_view(q.data(), m, k),
                                                        .scales = host_view(s.data(), m, 2),
                                                        .q2 = host_view(q.data(), m, k),
                                                        .scales2 = host_view(s.data(), 1, k)},
                                  {.format = scale_format::ue8m0});
  });
  CHECK(e5.find("(no error)") == std::string::npos);  // q2 over q (and s2 over s) is an overlap error
}

TEST_CASE("DeepSeek FP8 quantisation with custom tiles (1x1, 1x7, 3x5, 2x128, 128x2, 5x300) on every backend vs the recipe") {
  cpu::threads<> thr(2);
  struct tl {
    index_t r, c;
  };
  index_t const m = 131, k = 301;
  auto xf = qt::random_matrix(m, k, 77, 5.0f);
  auto xb = qt::to_bf16(xf);
  for (tl t : {tl{1, 1}, tl{1, 7}, tl{3, 5}, tl{2, 128}, tl{128, 2}, tl{5, 300}, tl{131, 301}, tl{200, 400}}) {
    for (scale_format fmt : {scale_format::fp32, scale_format::ue8m0}) {
      CAPTURE(t.r);
      CAPTURE(t.c);
      CAPTURE(int(fmt));
      tile const tt{t.r, t.c};
      index_t const sr = cdiv(m, t.r), scn = cdiv(k, t.c);
      for (int bf = 0; bf < 2; ++bf) {
        // the recipe: s = max(amax, 1e-4) / 448 (ue8m0: the power-of-two ceiling), q = e4m3(x * (1/s))
        std::vector<float> xs(std::size_t(m * k));
        for (std::size_t e = 0; e < xs.size(); ++e) xs[e] = bf ? float(xb[e]) : xf[e];
        std::vector<float> s_ref(std::size_t(sr * scn));
        std::vector<std::uint8_t> q_ref(std::size_t(m * k));
        for (index_t a = 0; a < sr; ++a)
          for (index_t b = 0; b < scn; ++b) {
            float amax = 0;
            for (index_t i = a * t.r; i < std::min(m, (a + 1) * t.r); ++i)
              for (index_t j = b * t.c; j < std::min(k, (b + 1) * t.c); ++j) amax = std::max(amax, std::fabs(xs[std::size_t(i * k + j)]));
            float s = std::max(amax, 1e-4f) / 448.0f;
            if (fmt == scale_format::ue8m0) s = std::ldexp(1.0f, int(std::ceil(std::log2(double(s)))));
            s_ref[std::size_t(a * scn + b)] = s;
            for (index_t i = a * t.r; i < std::min(m, (a + 1) * t.r); ++i)
              for (index_t j = b * t.c; j < std::min(k, (b + 1) * t.c); ++j)
                q_ref[std::size_t(i * k + j)] = encode<e4m3_format>(xs[std::size_t(i * k + j)] * (1.0f / s));
          }
        auto run = [&](auto const& be) {
          std::vector<std::uint8_t> q(std::size_t(m * k), 0x55);
          std::vector<float> s(std::size_t(sr * scn), -1.0f);
          if (bf)
            fp8_quantize(
                be,
                fp8_quantize_args<bfloat16>{.x = host_view(xb.data(), m, k), .q = host_view(q.data(), m, k), .scales = host_view(s.data(), sr, scn)},
                {.tile = tt, .format = fmt});
          else
            fp8_quantize(
                be, fp8_quantize_args<float>{.x = host_view(xf.data(), m, k), .q = host_view(q.data(), m, k), .scales = host_view(s.data(), sr, scn)},
                {.tile = tt, .format = fmt});
          CHECK(q == q_ref);
          CHECK(std::memcmp(s.data(), s_ref.data(), s.size() * sizeof(float)) == 0);
          std::vector<float> y(std::size_t(m * k));
          fp8_dequantize(
              be, fp8_dequantize_args<float>{.q = host_view(q.data(), m, k), .scales = host_view(s.data(), sr, scn), .y = host_view(y.data(), m, k)},
              {.tile = tt});
          bool ok = true;
          for (index_t i = 0; i < m; ++i)
            for (index_t j = 0; j < k; ++j)
              ok &= y[std::size_t(i * k + j)] == decode<e4m3_format>(q[std::size_t(i * k + j)]) * s[std::size_t((i / t.r) * scn + j / t.c)];
          CHECK(ok);
        };
        CAPTURE(bf);
        run(cpu::serial{});
        run(cpu::simd<>{});
        run(thr);
      }
    }
  }
}
