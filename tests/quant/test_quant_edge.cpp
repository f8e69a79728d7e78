// Adversarial API checks: empty contractions, every backend agreeing, in-place and
// aliasing arguments.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <concepts>
#include <string>
#include <type_traits>
#include <vector>

#include "support/error_of.hpp"
#include "k3/quant.hpp"

using namespace k3;
using namespace k3::quant;
using k3::test::error_of;

namespace {
// The error names the argument and the stride-0 dimension.
bool broadcast_named(std::string const& e, char const* arg) {
  return e.find(std::string("argument '") + arg + "'") != std::string::npos && e.find("stride 0") != std::string::npos;
}
// A [rows, cols] output over `mem` whose dimension `dim` has stride 0 (the other dense).
template <class T>
tensor_view<T, 2> broadcast(std::vector<T>& mem, index_t rows, index_t cols, int dim) {
  return dim == 0 ? tensor_view<T, 2>(mem.data(), {rows, cols}, {0, 1}) : tensor_view<T, 2>(mem.data(), {rows, cols}, {1, 0});
}
}  // namespace

TEST_CASE("fp8_block_gemm: K = 0 gives C = 0 on every backend (an empty sum)") {
  for (index_t m : {1, 5, 70})
    for (index_t n : {1, 17, 130}) {
      std::vector<std::uint8_t> qa(1), qb(1);
      std::vector<float> sa(1), sb(1);
      auto run = [&](auto const& be) {
        std::vector<float> c(std::size_t(m * n), -7.0f);
        fp8_block_gemm(be, fp8_block_gemm_args<>{.a_q = host_view(qa.data(), m, index_t(0)),
                                                 .a_scales = host_view(sa.data(), m, index_t(0)),
                                                 .b_q = host_view(qb.data(), n, index_t(0)),
                                                 .b_scales = host_view(sb.data(), (n + 127) / 128, index_t(0)),
                                                 .c = host_view(c.data(), m, n)});
        for (float x : c) REQUIRE(x == 0.0f);
      };
      run(cpu::serial{});
      run(cpu::simd<>{});
      run(cpu::threads<>(3));
    }
}

namespace {
// x [m, k] stored with a padded row stride and, when `every_other`, a column stride of 2
// (the vector path needs unit-stride rows: that case runs the reference on every backend).
struct strided_input {
  std::vector<bfloat16> mem;
  tensor_view<bfloat16 const, 2> view;
  std::vector<bfloat16> dense;
  strided_input(index_t m, index_t k, bool every_other, std::uint32_t seed) {
    index_t const cs = every_other ? 2 : 1, rs = k * cs + 7;
    mem.assign(std::size_t(m * rs + 8), store_as<bfloat16>(1e30));
    dense.resize(std::size_t(m * k));
    std::uint32_t st = seed;
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < k; ++j) {
        st = st * 1664525u + 1013904223u;
        double x = (double(st >> 8) / double(1u << 24) - 0.5) * std::ldexp(1.0, int(st % 23) - 11);
        if (st % 97 == 0) x = 0;
        dense[std::size_t(i * k + j)] = mem[std::size_t(i * rs + j * cs)] = store_as<bfloat16>(x);
      }
    view = tensor_view<bfloat16 const, 2>(mem.data(), {m, k}, {rs, cs});
  }
};
}  // namespace

TEST_CASE("MX and NVFP4 on strided inputs and outputs: the bytes of the contiguous serial run, every backend") {
  for (bool every_other : {false, true})
    for (index_t m : {1, 5, 33}) {
      index_t const k = 96;
      CAPTURE(every_other);
      CAPTURE(m);
      strided_input in(m, k, every_other, std::uint32_t(m * 7 + every_other));
      auto dense = host_view(static_cast<bfloat16 const*>(in.dense.data()), m, k);
      for (auto e : {mx_element::e4m3, mx_element::e5m2, mx_element::e3m2, mx_element::e2m3, mx_element::e2m1}) {
        index_t const qc = mx_code_columns(e, k), sc = k / mx_block;
        std::vector<std::uint8_t> q0(std::size_t(m * qc)), s0(std::size_t(m * sc));
        mx_quantize(cpu::serial{}, mx_quantize_args<bfloat16>{.x = dense, .q = host_view(q0.data(), m, qc), .scales = host_view(s0.data(), m, sc)},
                    {.element = e, .rule = mx_rule::rceil});
        std::vector<float> y0(std::size_t(m * k));
        mx_dequantize(cpu::serial{},
                      mx_dequantize_args<float>{.q = host_view(static_cast<std::uint8_t const*>(q0.data()), m, qc),
                                                .scales = host_view(static_cast<std::uint8_t const*>(s0.data()), m, sc),
                                                .y = host_view(y0.data(), m, k)},
                      {.element = e});
        auto check = [&](auto const& be) {
          // outputs with padded rows
          std::vector<std::uint8_t> q(std::size_t(m * (qc + 5)), 0xAB), s(std::size_t(m * (sc + 3)), 0xAB);
          tensor_view<std::uint8_t, 2> qv(q.data(), {m, qc}, {qc + 5, 1}), sv(s.data(), {m, sc}, {sc + 3, 1});
          mx_quantize(be, mx_quantize_args<bfloat16>{.x = in.view, .q = qv, .scales = sv}, {.element = e, .rule = mx_rule::rceil});
          for (index_t i = 0; i < m; ++i) {
            for (index_t j = 0; j < qc; ++j) REQUIRE(qv(i, j) == q0[std::size_t(i * qc + j)]);
            for (index_t j = 0; j < sc; ++j) REQUIRE(sv(i, j) == s0[std::size_t(i * sc + j)]);
            for (index_t j = qc; j < qc + 5 && i + 1 < m; ++j) REQUIRE(q[std::size_t(i * (qc + 5) + j)] == 0xAB);
          }
          // dequantise into a column-strided y
          std::vector<float> y(std::size_t(m * k * 2), -1.0f);
          tensor_view<float, 2> yv(y.data(), {m, k}, {2 * k, 2});
          mx_dequantize(
              be, mx_dequantize_args<float>{.q = tensor_view<std::uint8_t const, 2>(qv), .scales = tensor_view<std::uint8_t const, 2>(sv), .y = yv},
              {.element = e});
          for (index_t i = 0; i < m; ++i)
            for (index_t j = 0; j < k; ++j) REQUIRE(std::memcmp(&yv(i, j), &y0[std::size_t(i * k + j)], sizeof(float)) == 0);
        };
        check(cpu::serial{});
        check(cpu::simd<>{});
        check(cpu::threads<>(3));
      }
      // NVFP4
      float const g = nvfp4_tensor_scale(cpu::serial{}, nvfp4_tensor_scale_args<bfloat16>{.x = dense});
      CHECK(nvfp4_tensor_scale(cpu::threads<>(2), nvfp4_tensor_scale_args<bfloat16>{.x = in.view}) == g);
      std::vector<std::uint8_t> q0(std::size_t(m * k / 2)), s0(std::size_t(m * k / 16));
      nvfp4_quantize(cpu::serial{},
                     nvfp4_quantize_args<bfloat16>{.x = dense, .q = host_view(q0.data(), m, k / 2), .scales = host_view(s0.data(), m, k / 16)},
                     {.tensor_scale = g});
      for (int b = 0; b < 3; ++b) {
        std::vector<std::uint8_t> q(std::size_t(m * (k / 2 + 3))), s(std::size_t(m * (k / 16 + 1)));
        tensor_view<std::uint8_t, 2> qv(q.data(), {m, k / 2}, {k / 2 + 3, 1}), sv(s.data(), {m, k / 16}, {k / 16 + 1, 1});
        if (b == 0) nvfp4_quantize(cpu::serial{}, nvfp4_quantize_args<bfloat16>{.x = in.view, .q = qv, .scales = sv}, {.tensor_scale = g});
        if (b == 1) nvfp4_quantize(cpu::simd<>{}, nvfp4_quantize_args<bfloat16>{.x = in.view, .q = qv, .scales = sv}, {.tensor_scale = g});
        if (b == 2) nvfp4_quantize(cpu::threads<>(4), nvfp4_quantize_args<bfloat16>{.x = in.view, .q = qv, .scales = sv}, {.tensor_scale = g});
        for (index_t i = 0; i < m; ++i) {
          for (index_t j = 0; j < k / 2; ++j) REQUIRE(qv(i, j) == q0[std::size_t(i * k / 2 + j)]);
          for (index_t j = 0; j < k / 16; ++j) REQUIRE(sv(i, j) == s0[std::size_t(i * k / 16 + j)]);
        }
      }
    }
}

TEST_CASE("quantisers, dequantisers and the GEMM reject an output with a stride-0 dimension (aliasing itself), naming it") {
  index_t const m = 4, k = 256;
  std::vector<float> xs(std::size_t(m * k));
  for (std::size_t i = 0; i < xs.size(); ++i) xs[i] = float(int(i % 29) - 14) * 0.37f;
  auto x = host_view(static_cast<float const*>(xs.data()), m, k);
  std::vector<std::uint8_t> qm(std::size_t(m * k)), sm8(std::size_t(m * k));
  std::vector<float> sf(std::size_t(m * k)), yf(std::size_t(m * k));
  auto q = host_view(qm.data(), m, k);
  auto run = [&](auto const& be) {
    for (int dim : {0, 1}) {
      CAPTURE(dim);
      // DeepSeek tiles
      fp8_quantize(be, fp8_quantize_args<float>{.x = x, .q = q, .scales = host_view(sf.data(), m, k / 128)});
      auto qc = host_view(static_cast<std::uint8_t const*>(qm.data()), m, k);
      auto sc = host_view(static_cast<float const*>(sf.data()), m, k / 128);
      CHECK(broadcast_named(error_of([&] {
                              fp8_quantize(be, fp8_quantize_args<float>{
                                                   .x = x, .q = broadcast(qm, m, k, dim), .scales = host_view(sf.data() + 64, m, k / 128)});
                            }),
                            "q"));
      CHECK(broadcast_named(error_of([&] { fp8_quantize(be, fp8_quantize_args<float>{.x = x, .q = q, .scales = broadcast(sf, m, k / 128, dim)}); }),
                            "scales"));
      CHECK(broadcast_named(error_of([&] { fp8_dequantize(be, fp8_dequantize_args<float>{.q = qc, .scales = sc, .y = broadcast(yf, m, k, dim)}); }),
                            "y"));
      std::vector<std::uint8_t> q2(std::size_t(m * k));
      std::vector<float> s2(static_cast<std::size_t>(k));
      CHECK(broadcast_named(error_of([&] {
                              fp8_requantize_1x128_to_128x1(
                                  be, fp8_requantize_args<>{
                                          .q = qc, .scales = sc, .q2 = broadcast(q2, m, k, dim), .scales2 = host_view(s2.data(), index_t(1), k)});
                            }),
                            "q2"));
      if (dim == 1)  // scales2 is [1, k]: only its columns can be broadcast
        CHECK(broadcast_named(error_of([&] {
                                fp8_requantize_1x128_to_128x1(
                                    be, fp8_requantize_args<>{
                                            .q = qc, .scales = sc, .q2 = host_view(q2.data(), m, k), .scales2 = broadcast(s2, 1, k, dim)});
                              }),
                              "scales2"));
      // MX and NVFP4
      index_t const qcols = mx_code_columns(mx_element::e4m3, k);
      CHECK(broadcast_named(
          error_of([&] {
            mx_quantize(be, mx_quantize_args<float>{.x = x, .q = broadcast(qm, m, qcols, dim), .scales = host_view(sm8.data(), m, k / mx_block)},
                        {.element = mx_element::e4m3});
          }),
          "q"));
      CHECK(broadcast_named(error_of([&] {
                              mx_quantize(be, mx_quantize_args<float>{.x = x, .q = q, .scales = broadcast(sm8, m, k / mx_block, dim)},
                                          {.element = mx_element::e4m3});
                            }),
                            "scales"));
      mx_quantize(be, mx_quantize_args<float>{.x = x, .q = q, .scales = host_view(sm8.data(), m, k / mx_block)}, {.element = mx_element::e4m3});
      auto s8c = host_view(static_cast<std::uint8_t const*>(sm8.data()), m, k / mx_block);
      CHECK(broadcast_named(error_of([&] {
                              mx_dequantize(be, mx_dequantize_args<float>{.q = qc, .scales = s8c, .y = broadcast(yf, m, k, dim)},
                                            {.element = mx_element::e4m3});
                            }),
                            "y"));
      float const g = nvfp4_tensor_scale(be, nvfp4_tensor_scale_args<float>{.x = x});
      CHECK(broadcast_named(
          error_of([&] {
            nvfp4_quantize(be, nvfp4_quantize_args<float>{.x = x, .q = broadcast(qm, m, k / 2, dim), .scales = host_view(sm8.data(), m, k / 16)},
                           {.tensor_scale = g});
          }),
          "q"));
      CHECK(broadcast_named(
          error_of([&] {
            nvfp4_quantize(be, nvfp4_quantize_args<float>{.x = x, .q = host_view(qm.data(), m, k / 2), .scales = broadcast(sm8, m, k / 16, dim)},
                           {.tensor_scale = g});
          }),
          "scales"));
      nvfp4_quantize(be, nvfp4_quantize_args<float>{.x = x, .q = host_view(qm.data(), m, k / 2), .scales = host_view(sm8.data(), m, k / 16)},
                     {.tensor_scale = g});
      CHECK(broadcast_named(error_of([&] {
                              nvfp4_dequantize(
                                  be,
                                  nvfp4_dequantize_args<float>{.q = host_view(static_cast<std::uint8_t const*>(qm.data()), m, k / 2),
                                                               .scales = host_view(static_cast<std::uint8_t const*>(sm8.data()), m, k / 16),
                                                               .y = broadcast(yf, m, k, dim)},
                                  {.tensor_scale = g});
                            }),
                            "y"));
      // GEMM: A [m, k] x B [n = m, k]^T
      fp8_quantize(be, fp8_quantize_args<float>{.x = x, .q = q, .scales = host_view(sf.data(), m, k / 128)});
      std::vector<float> sbm(std::size_t(k / 128), 1.0f);
      auto sb = host_view(static_cast<float const*>(sbm.data()), index_t(1), k / 128);
      CHECK(broadcast_named(error_of([&] {
                              fp8_block_gemm(
                                  be, fp8_block_gemm_args<>{.a_q = qc, .a_scales = sc, .b_q = qc, .b_scales = sb, .c = broadcast(yf, m, m, dim)});
                            }),
                            "c"));
      // a stride-0 dimension of extent 1 writes each element once: accepted
      CHECK(error_of([&] {
              fp8_block_gemm(
                  be, fp8_block_gemm_args<>{
                          .a_q = qc, .a_scales = sc, .b_q = qc.sub(0, 0, 1), .b_scales = sb, .c = tensor_view<float, 2>(yf.data(), {m, 1}, {1, 0})});
            }) == "");
    }
  };
  run(cpu::serial{});
  run(cpu::simd<>{});
  run(cpu::threads<>(2));
}

TEST_CASE("DeepSeek FP8 tiles and the GEMM into strided outputs: the bytes of the contiguous run, every backend") {
  for (index_t m : {1, 7, 130}) {
    index_t const k = 200, n = 9;  // k not a multiple of 128: a partial last tile
    CAPTURE(m);
    strided_input in(m, k, false, std::uint32_t(m * 13 + 1));
    auto dense = host_view(static_cast<bfloat16 const*>(in.dense.data()), m, k);
    index_t const kb = (k + 127) / 128;
    // contiguous serial reference
    std::vector<std::uint8_t> q0(std::size_t(m * k)), q20(std::size_t(m * k));
    std::vector<float> s0(std::size_t(m * kb)), y0(std::size_t(m * k)), s20(std::size_t((m + 127) / 128 * k)), c0(std::size_t(m * n));
    fp8_quantize(cpu::serial{}, fp8_quantize_args<bfloat16>{.x = dense, .q = host_view(q0.data(), m, k), .scales = host_view(s0.data(), m, kb)});
    auto q0c = host_view(static_cast<std::uint8_t const*>(q0.data()), m, k);
    auto s0c = host_view(static_cast<float const*>(s0.data()), m, kb);
    fp8_dequantize(cpu::serial{}, fp8_dequantize_args<float>{.q = q0c, .scales = s0c, .y = host_view(y0.data(), m, k)});
    fp8_requantize_1x128_to_128x1(
        cpu::serial{},
        fp8_requantize_args<>{.q = q0c, .scales = s0c, .q2 = host_view(q20.data(), m, k), .scales2 = host_view(s20.data(), (m + 127) / 128, k)});
    auto qb = q0c.sub(0, 0, std::min(m, n));  // B = the first rows of A (n' = min(m, n))
    index_t const nn = qb.extent(0);
    std::vector<float> sbm(std::size_t(kb), 0.5f);
    auto sb = host_view(static_cast<float const*>(sbm.data()), index_t(1), kb);
    fp8_block_gemm(cpu::serial{}, fp8_block_gemm_args<>{.a_q = q0c, .a_scales = s0c, .b_q = qb, .b_scales = sb, .c = host_view(c0.data(), m, nn)});
    auto check = [&](auto const& be) {
      // padded rows (q, s), column stride 2 (y, q2, s2), transposed (c)
      std::vector<std::uint8_t> q(std::size_t(m * (k + 5)), 0xAB), q2(std::size_t(m * k * 2), 0xAB);
      std::vector<float> s(std::size_t(m * (kb + 3))), y(std::size_t(m * k * 2)), s2(std::size_t((m + 127) / 128 * k * 2)), c(std::size_t(m * nn));
      tensor_view<std::uint8_t, 2> qv(q.data(), {m, k}, {k + 5, 1});
      tensor_view<float, 2> sv(s.data(), {m, kb}, {kb + 3, 1});
      fp8_quantize(be, fp8_quantize_args<bfloat16>{.x = in.view, .q = qv, .scales = sv});
      tensor_view<float, 2> yv(y.data(), {m, k}, {2 * k, 2});
      fp8_dequantize(be, fp8_dequantize_args<float>{.q = tensor_view<std::uint8_t const, 2>(qv), .scales = tensor_view<float const, 2>(sv), .y = yv});
      tensor_view<std::uint8_t, 2> q2v(q2.data(), {m, k}, {2 * k, 2});
      tensor_view<float, 2> s2v(s2.data(), {(m + 127) / 128, k}, {2 * k, 2});
      fp8_requantize_1x128_to_128x1(
          be,
          fp8_requantize_args<>{.q = tensor_view<std::uint8_t const, 2>(qv), .scales = tensor_view<float const, 2>(sv), .q2 = q2v, .scales2 = s2v});
      tensor_view<float, 2> cv(c.data(), {m, nn}, {1, m});
      fp8_block_gemm(
          be, fp8_block_gemm_args<>{
                  .a_q = tensor_view<std::uint8_t const, 2>(qv), .a_scales = tensor_view<float const, 2>(sv), .b_q = qb, .b_scales = sb, .c = cv});
      for (index_t i = 0; i < m; ++i) {
        for (index_t j = 0; j < k; ++j) {
          REQUIRE(qv(i, j) == q0[std::size_t(i * k + j)]);
          REQUIRE(std::memcmp(&yv(i, j), &y0[std::size_t(i * k + j)], sizeof(float)) == 0);
          REQUIRE(q2v(i, j) == q20[std::size_t(i * k + j)]);
        }
        for (index_t j = 0; j < kb; ++j) REQUIRE(std::memcmp(&sv(i, j), &s0[std::size_t(i * kb + j)], sizeof(float)) == 0);
        for (index_t j = 0; j < nn; ++j) REQUIRE(std::memcmp(&cv(i, j), &c0[std::size_t(i * nn + j)], sizeof(float)) == 0);
      }
      for (index_t i = 0; i < s2v.extent(0); ++i)
        for (index_t j = 0; j < k; ++j) REQUIRE(std::memcmp(&s2v(i, j), &s20[std::size_t(i * k + j)], sizeof(float)) == 0);
    };
    check(cpu::serial{});
    check(cpu::simd<>{});
    check(cpu::threads<>(3));
  }
}

// The args and options bundles are aggregates, and every CPU backend takes them in the one call shape.
namespace {
template <class B>
constexpr bool takes_call_shape() {
  return requires(B const& b, fp8_quantize_args<float> fq, fp8_dequantize_args<bfloat16> fd, fp8_requantize_args<> fr, mx_quantize_args<bfloat16> mq,
                  mx_dequantize_args<float, std::uint8_t, std::uint8_t> md, nvfp4_tensor_scale_args<float> nt, nvfp4_quantize_args<float const> nq,
                  nvfp4_dequantize_args<float> nd, fp8_block_gemm_args<std::uint8_t, float> g) {
    fp8_quantize(b, fq, {.tile = tile_128x128, .format = scale_format::ue8m0});
    fp8_dequantize(b, fd, {.tile = tile_128x128});
    fp8_requantize_1x128_to_128x1(b, fr, {.format = scale_format::fp32});
    mx_quantize(b, mq, {.element = mx_element::e2m1, .rule = mx_rule::rceil});
    mx_dequantize(b, md, {.element = mx_element::e2m1});
    { nvfp4_tensor_scale(b, nt) } -> std::same_as<float>;
    nvfp4_quantize(b, nq, {.tensor_scale = 1.0f, .rounding = nvfp4_rounding::divide});
    nvfp4_dequantize(b, nd, {.tensor_scale = 1.0f});
    fp8_block_gemm(b, g);
  };
}
}  // namespace
static_assert(std::is_aggregate_v<fp8_quantize_args<float>> && std::is_aggregate_v<fp8_dequantize_args<bfloat16>> &&
              std::is_aggregate_v<fp8_requantize_args<>> && std::is_aggregate_v<mx_quantize_args<float>> &&
              std::is_aggregate_v<mx_dequantize_args<float>> && std::is_aggregate_v<nvfp4_tensor_scale_args<bfloat16>> &&
              std::is_aggregate_v<nvfp4_quantize_args<bfloat16>> && std::is_aggregate_v<nvfp4_dequantize_args<bfloat16>> &&
              std::is_aggregate_v<fp8_block_gemm_args<>>);
static_assert(std::is_aggregate_v<fp8_quantize_options> && std::is_aggregate_v<fp8_dequantize_options> &&
              std::is_aggregate_v<fp8_requantize_options> && std::is_aggregate_v<mx_quantize_options> && std::is_aggregate_v<mx_dequantize_options> &&
              std::is_aggregate_v<nvfp4_tensor_scale_options> && std::is_aggregate_v<nvfp4_quantize_options> &&
              std::is_aggregate_v<nvfp4_dequantize_options> && std::is_aggregate_v<fp8_block_gemm_options>);
static_assert(takes_call_shape<cpu::serial>() && takes_call_shape<cpu::simd<>>() && takes_call_shape<cpu::threads<>>());

TEST_CASE("NVFP4: a missing tensor scale (the 0 default) is rejected, naming the option") {
  std::vector<float> x(32, 1.0f), y(32);
  std::vector<std::uint8_t> q(16), s(2);
  auto e = error_of([&] {
    nvfp4_quantize(cpu::serial{}, nvfp4_quantize_args<float>{.x = host_view(static_cast<float const*>(x.data()), 1, 32),
                                                             .q = host_view(q.data(), 1, 16),
                                                             .scales = host_view(s.data(), 1, 2)});
  });
  CHECK(e.find("option 'tensor_scale'") != std::string::npos);
  auto d = error_of([&] {
    nvfp4_dequantize(cpu::serial{}, nvfp4_dequantize_args<float>{.q = host_view(static_cast<std::uint8_t const*>(q.data()), 1, 16),
                                                                 .scales = host_view(static_cast<std::uint8_t const*>(s.data()), 1, 2),
                                                                 .y = host_view(y.data(), 1, 32)});
  });
  CHECK(d.find("option 'tensor_scale'") != std::string::npos);
}
