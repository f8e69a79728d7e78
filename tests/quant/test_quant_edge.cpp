// Adversarial API checks (round 4): empty contractions, every backend agreeing, in-place and
// aliasing arguments.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "k3/quant.hpp"

using namespace k3;
using namespace k3::quant;

TEST_CASE("fp8_block_gemm: K = 0 gives C = 0 on every backend (an empty sum)") {
  for (index_t m : {1, 5, 70})
    for (index_t n : {1, 17, 130}) {
      std::vector<std::uint8_t> qa(1), qb(1);
      std::vector<float> sa(1), sb(1);
      auto run = [&](auto const& be) {
        std::vector<float> c(std::size_t(m * n), -7.0f);
        fp8_block_gemm(be, host_view(qa.data(), m, index_t(0)), host_view(sa.data(), m, index_t(0)), host_view(qb.data(), n, index_t(0)),
                       host_view(sb.data(), (n + 127) / 128, index_t(0)), host_view(c.data(), m, n));
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
        mx_quantize(cpu::serial{}, dense, host_view(q0.data(), m, qc), host_view(s0.data(), m, sc), e, mx_rule::rceil);
        std::vector<float> y0(std::size_t(m * k));
        mx_dequantize(cpu::serial{}, host_view(static_cast<std::uint8_t const*>(q0.data()), m, qc), host_view(static_cast<std::uint8_t const*>(s0.data()), m, sc),
                      host_view(y0.data(), m, k), e);
        auto check = [&](auto const& be) {
          // outputs with padded rows
          std::vector<std::uint8_t> q(std::size_t(m * (qc + 5)), 0xAB), s(std::size_t(m * (sc + 3)), 0xAB);
          tensor_view<std::uint8_t, 2> qv(q.data(), {m, qc}, {qc + 5, 1}), sv(s.data(), {m, sc}, {sc + 3, 1});
          mx_quantize(be, in.view, qv, sv, e, mx_rule::rceil);
          for (index_t i = 0; i < m; ++i) {
            for (index_t j = 0; j < qc; ++j) REQUIRE(qv(i, j) == q0[std::size_t(i * qc + j)]);
            for (index_t j = 0; j < sc; ++j) REQUIRE(sv(i, j) == s0[std::size_t(i * sc + j)]);
            for (index_t j = qc; j < qc + 5 && i + 1 < m; ++j) REQUIRE(q[std::size_t(i * (qc + 5) + j)] == 0xAB);
          }
          // dequantise into a column-strided y
          std::vector<float> y(std::size_t(m * k * 2), -1.0f);
          tensor_view<float, 2> yv(y.data(), {m, k}, {2 * k, 2});
          mx_dequantize(be, tensor_view<std::uint8_t const, 2>(qv), tensor_view<std::uint8_t const, 2>(sv), yv, e);
          for (index_t i = 0; i < m; ++i)
            for (index_t j = 0; j < k; ++j) REQUIRE(std::memcmp(&yv(i, j), &y0[std::size_t(i * k + j)], sizeof(float)) == 0);
        };
        check(cpu::serial{});
        check(cpu::simd<>{});
        check(cpu::threads<>(3));
      }
      // NVFP4
      float const g = nvfp4_tensor_scale(cpu::serial{}, dense);
      CHECK(nvfp4_tensor_scale(cpu::threads<>(2), in.view) == g);
      std::vector<std::uint8_t> q0(std::size_t(m * k / 2)), s0(std::size_t(m * k / 16));
      nvfp4_quantize(cpu::serial{}, dense, host_view(q0.data(), m, k / 2), host_view(s0.data(), m, k / 16), g);
      for (int b = 0; b < 3; ++b) {
        std::vector<std::uint8_t> q(std::size_t(m * (k / 2 + 3))), s(std::size_t(m * (k / 16 + 1)));
        tensor_view<std::uint8_t, 2> qv(q.data(), {m, k / 2}, {k / 2 + 3, 1}), sv(s.data(), {m, k / 16}, {k / 16 + 1, 1});
        if (b == 0) nvfp4_quantize(cpu::serial{}, in.view, qv, sv, g);
        if (b == 1) nvfp4_quantize(cpu::simd<>{}, in.view, qv, sv, g);
        if (b == 2) nvfp4_quantize(cpu::threads<>(4), in.view, qv, sv, g);
        for (index_t i = 0; i < m; ++i) {
          for (index_t j = 0; j < k / 2; ++j) REQUIRE(qv(i, j) == q0[std::size_t(i * k / 2 + j)]);
          for (index_t j = 0; j < k / 16; ++j) REQUIRE(sv(i, j) == s0[std::size_t(i * k / 16 + j)]);
        }
      }
    }
}
