// k3::quant's ops on k3::cuda::stream_backend (k3/quant/cuda/backend.cuh) against the same calls
// on k3::cpu::serial: the same bytes for codes and scales (the GEMM the same bits) for float and
// bfloat16 inputs and outputs, every tile / format / MX element / rule / NVFP4 rounding, shapes with
// partial tiles, one row and no rows, strided views; the host backends' errors for bad input
// (same kind, argument and message), and what the CUDA backend does not serve. Runs on the SIMT
// host runtime in every build and on a GPU where nvcc is.
#include "support/device_buffer.hpp"
// (device_buffer.hpp first: its config.cuh picks the CUDA runtime)
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/quant.hpp"
#include "k3/quant/cuda/backend.cuh"
#include "quant_test_util.hpp"

using namespace k3;
using namespace k3::quant;
using k3::test::device_buffer;

namespace {

using dev = cuda_device_space;

struct shape {
  index_t m, k;
};

// An [m, k] matrix held twice, on the host and on the device, with the same bytes (outputs start
// as 0xFF bytes on both, so elements an op must not write are compared too).
template <class T>
struct mirrored {
  index_t m, k;
  std::vector<T> host;
  device_buffer<T> device;
  mirrored(index_t m_, index_t k_) : m(m_), k(k_), host(filled(m_ * k_)), device(static_cast<std::size_t>(m_ * k_), 0xFF) {}
  mirrored(index_t m_, index_t k_, std::vector<T> const& v) : m(m_), k(k_), host(v), device(v) {}
  static std::vector<T> filled(index_t n) {
    std::vector<T> v(static_cast<std::size_t>(n));
    if (n) std::memset(static_cast<void*>(v.data()), 0xFF, v.size() * sizeof(T));
    return v;
  }
  tensor_view<T const, 2> hc() const { return tensor_view<T const, 2>(host.data(), {m, k}); }
  tensor_view<T, 2> h() { return tensor_view<T, 2>(host.data(), {m, k}); }
  tensor_view<T const, 2, dev> dc() const { return tensor_view<T const, 2, dev>(device.p, {m, k}); }
  tensor_view<T, 2, dev> d() const { return tensor_view<T, 2, dev>(device.p, {m, k}); }
  // Whether the device bytes equal the host bytes.
  bool same() const {
    std::vector<T> const g = device.get();
    return g.size() == host.size() && (g.empty() || std::memcmp(g.data(), host.data(), g.size() * sizeof(T)) == 0);
  }
};

// qt::random_matrix as In, with one NaN and one +Inf (a non-finite tile or block each) when n > 2.
template <class In>
std::vector<In> input(index_t m, index_t k, std::uint32_t seed) {
  std::vector<float> x = qt::random_matrix(m, k, seed);
  if (x.size() > 2) {
    x[x.size() / 3] = std::numeric_limits<float>::quiet_NaN();
    x[2 * x.size() / 3] = std::numeric_limits<float>::infinity();
  }
  if constexpr (std::is_same_v<In, float>)
    return x;
  else
    return qt::to_bf16(x);
}

struct caught {
  bool thrown = false;
  error_kind kind = error_kind::value;
  std::string argument, message;
};
template <class F>
caught catch_of(F&& f) {
  try {
    f();
  } catch (k3::error const& e) {
    return {true, e.kind(), e.argument(), e.what()};
  }
  return {};
}

// The same k3::error (kind, argument, message) from the serial call and the CUDA call.
template <class Host, class Cuda>
void check_same_error(Host&& host, Cuda&& cuda, error_kind kind, char const* argument) {
  caught const h = catch_of(host), c = catch_of(cuda);
  CAPTURE(h.message);
  CAPTURE(c.message);
  CHECK(h.thrown);
  CHECK(c.thrown);
  CHECK(h.kind == kind);
  CHECK(h.argument == argument);
  CHECK(c.kind == h.kind);
  CHECK(c.argument == h.argument);
  CHECK(c.message == h.message);
}

template <class F>
void check_unsupported(F&& call, char const* argument) {
  caught const c = catch_of(call);
  CAPTURE(c.message);
  CHECK(c.thrown);
  CHECK(c.kind == error_kind::unsupported);
  CHECK(c.argument == argument);
}

template <class Out>
void check_fp8_dequantize(k3::cuda::stream_backend const& be, mirrored<std::uint8_t> const& q, mirrored<float> const& s, tile t) {
  mirrored<Out> y(q.m, q.k);
  fp8_dequantize(cpu::serial{}, fp8_dequantize_args<Out>{.q = q.hc(), .scales = s.hc(), .y = y.h()}, {.tile = t});
  fp8_dequantize(be, fp8_dequantize_args<Out, std::uint8_t const, float const, dev>{.q = q.dc(), .scales = s.dc(), .y = y.d()},
                 {.tile = t});
  CHECK(y.same());
}

template <class Out>
void check_mx_dequantize(k3::cuda::stream_backend const& be, mirrored<std::uint8_t> const& q, mirrored<std::uint8_t> const& s, index_t k,
                         mx_element e) {
  mirrored<Out> y(q.m, k);
  mx_dequantize(cpu::serial{}, mx_dequantize_args<Out>{.q = q.hc(), .scales = s.hc(), .y = y.h()}, {.element = e});
  mx_dequantize(be, mx_dequantize_args<Out, std::uint8_t const, std::uint8_t const, dev>{.q = q.dc(), .scales = s.dc(), .y = y.d()},
                {.element = e});
  CHECK(y.same());
}

template <class Out>
void check_nvfp4_dequantize(k3::cuda::stream_backend const& be, mirrored<std::uint8_t> const& q, mirrored<std::uint8_t> const& s, index_t k,
                            float g) {
  mirrored<Out> y(q.m, k);
  nvfp4_dequantize(cpu::serial{}, nvfp4_dequantize_args<Out>{.q = q.hc(), .scales = s.hc(), .y = y.h()}, {.tensor_scale = g});
  nvfp4_dequantize(be, nvfp4_dequantize_args<Out, std::uint8_t const, std::uint8_t const, dev>{.q = q.dc(), .scales = s.dc(), .y = y.d()},
                   {.tensor_scale = g});
  CHECK(y.same());
}

}  // namespace

TEST_CASE_TEMPLATE("quant on the CUDA backend: fp8 tile quantise and dequantise give the serial backend's bytes", In, float, bfloat16) {
  k3::cuda::stream_backend be;
  for (shape const sh : {shape{0, 300}, shape{4, 0}, shape{1, 1}, shape{1, 200}, shape{5, 129}, shape{130, 257}}) {
    for (tile const t : {tile_1x128, tile_128x128, tile_128x1, tile{3, 5}}) {
      for (scale_format const fmt : {scale_format::fp32, scale_format::ue8m0}) {
        CAPTURE(sh.m);
        CAPTURE(sh.k);
        CAPTURE(t.rows);
        CAPTURE(t.cols);
        CAPTURE(int(fmt));
        index_t const sr = qt::cdiv(sh.m, t.rows), sc = qt::cdiv(sh.k, t.cols);
        mirrored<In> const x(sh.m, sh.k, input<In>(sh.m, sh.k, 11));
        mirrored<std::uint8_t> q(sh.m, sh.k);
        mirrored<float> s(sr, sc);
        fp8_quantize(cpu::serial{}, fp8_quantize_args<In>{.x = x.hc(), .q = q.h(), .scales = s.h()}, {.tile = t, .format = fmt});
        fp8_quantize(be, fp8_quantize_args<In, dev>{.x = x.dc(), .q = q.d(), .scales = s.d()}, {.tile = t, .format = fmt});
        CHECK(q.same());
        CHECK(s.same());
        // The serial codes on both sides, so the dequantiser is checked on its own.
        mirrored<std::uint8_t> const q0(sh.m, sh.k, q.host);
        mirrored<float> const s0(sr, sc, s.host);
        check_fp8_dequantize<float>(be, q0, s0, t);
        check_fp8_dequantize<bfloat16>(be, q0, s0, t);
      }
    }
  }
}

TEST_CASE("quant on the CUDA backend: 1x128 -> 128x1 requantisation gives the serial backend's bytes") {
  k3::cuda::stream_backend be;
  for (shape const sh : {shape{0, 128}, shape{3, 0}, shape{1, 1}, shape{1, 200}, shape{129, 300}, shape{260, 130}}) {
    for (scale_format const fmt : {scale_format::ue8m0, scale_format::fp32}) {
      CAPTURE(sh.m);
      CAPTURE(sh.k);
      CAPTURE(int(fmt));
      index_t const kb = qt::cdiv(sh.k, 128), mb = qt::cdiv(sh.m, 128);
      std::vector<float> const x = input<float>(sh.m, sh.k, 12);
      std::vector<std::uint8_t> q(x.size());
      std::vector<float> s(static_cast<std::size_t>(sh.m * kb));
      fp8_quantize(cpu::serial{},
                   fp8_quantize_args<float>{.x = tensor_view<float const, 2>(x.data(), {sh.m, sh.k}),
                                            .q = tensor_view<std::uint8_t, 2>(q.data(), {sh.m, sh.k}),
                                            .scales = tensor_view<float, 2>(s.data(), {sh.m, kb})},
                   {.tile = tile_1x128, .format = scale_format::fp32});
      mirrored<std::uint8_t> const q1(sh.m, sh.k, q);
      mirrored<float> const s1(sh.m, kb, s);
      mirrored<std::uint8_t> q2(sh.m, sh.k);
      mirrored<float> s2(mb, sh.k);
      fp8_requantize_1x128_to_128x1(cpu::serial{}, fp8_requantize_args<>{.q = q1.hc(), .scales = s1.hc(), .q2 = q2.h(), .scales2 = s2.h()},
                                    {.format = fmt});
      fp8_requantize_1x128_to_128x1(
          be, fp8_requantize_args<std::uint8_t const, float const, dev>{.q = q1.dc(), .scales = s1.dc(), .q2 = q2.d(), .scales2 = s2.d()},
          {.format = fmt});
      CHECK(q2.same());
      CHECK(s2.same());
    }
  }
}

TEST_CASE_TEMPLATE("quant on the CUDA backend: MX quantise and dequantise give the serial backend's bytes", In, float, bfloat16) {
  k3::cuda::stream_backend be;
  for (shape const sh : {shape{0, 64}, shape{3, 0}, shape{1, 32}, shape{7, 96}, shape{33, 160}}) {
    for (mx_element const e : {mx_element::e4m3, mx_element::e5m2, mx_element::e3m2, mx_element::e2m3, mx_element::e2m1}) {
      for (mx_rule const rule : {mx_rule::floor, mx_rule::rceil}) {
        CAPTURE(sh.m);
        CAPTURE(sh.k);
        CAPTURE(name(e));
        CAPTURE(int(rule));
        index_t const qc = mx_code_columns(e, sh.k), sc = sh.k / mx_block;
        mirrored<In> const x(sh.m, sh.k, input<In>(sh.m, sh.k, 13));
        mirrored<std::uint8_t> q(sh.m, qc), s(sh.m, sc);
        mx_quantize(cpu::serial{}, mx_quantize_args<In>{.x = x.hc(), .q = q.h(), .scales = s.h()}, {.element = e, .rule = rule});
        mx_quantize(be, mx_quantize_args<In, dev>{.x = x.dc(), .q = q.d(), .scales = s.d()}, {.element = e, .rule = rule});
        CHECK(q.same());
        CHECK(s.same());
        mirrored<std::uint8_t> const q0(sh.m, qc, q.host), s0(sh.m, sc, s.host);
        check_mx_dequantize<float>(be, q0, s0, sh.k, e);
        check_mx_dequantize<bfloat16>(be, q0, s0, sh.k, e);
      }
    }
  }
}

TEST_CASE_TEMPLATE("quant on the CUDA backend: NVFP4 tensor scale, quantise and dequantise give the serial backend's bytes", In, float,
                   bfloat16) {
  k3::cuda::stream_backend be;
  for (shape const sh : {shape{0, 32}, shape{3, 0}, shape{1, 16}, shape{7, 48}, shape{33, 160}}) {
    for (nvfp4_rounding const rounding : {nvfp4_rounding::reciprocal, nvfp4_rounding::divide}) {
      CAPTURE(sh.m);
      CAPTURE(sh.k);
      CAPTURE(int(rounding));
      mirrored<In> const x(sh.m, sh.k, input<In>(sh.m, sh.k, 14));
      float const g = nvfp4_tensor_scale(cpu::serial{}, nvfp4_tensor_scale_args<In>{.x = x.hc()});
      float const g_cuda = nvfp4_tensor_scale(be, nvfp4_tensor_scale_args<In, dev>{.x = x.dc()});
      CHECK(std::memcmp(&g, &g_cuda, sizeof g) == 0);
      mirrored<std::uint8_t> q(sh.m, sh.k / 2), s(sh.m, sh.k / nvfp4_block);
      nvfp4_quantize(cpu::serial{}, nvfp4_quantize_args<In>{.x = x.hc(), .q = q.h(), .scales = s.h()},
                     {.tensor_scale = g, .rounding = rounding});
      nvfp4_quantize(be, nvfp4_quantize_args<In, dev>{.x = x.dc(), .q = q.d(), .scales = s.d()}, {.tensor_scale = g, .rounding = rounding});
      CHECK(q.same());
      CHECK(s.same());
      mirrored<std::uint8_t> const q0(sh.m, sh.k / 2, q.host), s0(sh.m, sh.k / nvfp4_block, s.host);
      check_nvfp4_dequantize<float>(be, q0, s0, sh.k, g);
      check_nvfp4_dequantize<bfloat16>(be, q0, s0, sh.k, g);
    }
  }
  // An all-zero tensor: g = 1 on both.
  mirrored<In> const zeros(2, 32, std::vector<In>(64, In(0.0f)));
  CHECK(nvfp4_tensor_scale(be, nvfp4_tensor_scale_args<In, dev>{.x = zeros.dc()}) == 1.0f);
}

// The two scalings round apart only next to E2M1 ties: on this tensor a few codes differ (as in
// tests/quant/test_mx.cpp), so each rounding's bytes are told apart from the other's.
TEST_CASE("quant on the CUDA backend: NVFP4 quantise follows the reciprocal and the divide rounding, each as the serial backend") {
  k3::cuda::stream_backend be;
  index_t const m = 256, k = 1024;
  mirrored<bfloat16> const x(m, k, qt::to_bf16(qt::random_matrix(m, k, 4242, 3.0f)));
  float const g = nvfp4_tensor_scale(cpu::serial{}, nvfp4_tensor_scale_args<bfloat16>{.x = x.hc()});
  std::vector<std::uint8_t> serial_codes[2];
  for (nvfp4_rounding const rounding : {nvfp4_rounding::reciprocal, nvfp4_rounding::divide}) {
    CAPTURE(int(rounding));
    mirrored<std::uint8_t> q(m, k / 2), s(m, k / nvfp4_block);
    nvfp4_quantize(cpu::serial{}, nvfp4_quantize_args<bfloat16>{.x = x.hc(), .q = q.h(), .scales = s.h()},
                   {.tensor_scale = g, .rounding = rounding});
    nvfp4_quantize(be, nvfp4_quantize_args<bfloat16, dev>{.x = x.dc(), .q = q.d(), .scales = s.d()},
                   {.tensor_scale = g, .rounding = rounding});
    CHECK(q.same());
    CHECK(s.same());
    serial_codes[int(rounding)] = q.host;
  }
  CHECK(serial_codes[0] != serial_codes[1]);
}

TEST_CASE("quant on the CUDA backend: the block-scaled FP8 GEMM gives the serial backend's bits") {
  k3::cuda::stream_backend be;
  struct mnk {
    index_t m, n, k;
  };
  for (mnk const p : {mnk{1, 1, 1}, mnk{0, 5, 128}, mnk{5, 0, 128}, mnk{3, 4, 0}, mnk{17, 33, 129}, mnk{130, 129, 300}}) {
    CAPTURE(p.m);
    CAPTURE(p.n);
    CAPTURE(p.k);
    index_t const kb = qt::cdiv(p.k, 128), nb = qt::cdiv(p.n, 128);
    std::vector<float> const a = qt::random_matrix(p.m, p.k, 15), b = qt::random_matrix(p.n, p.k, 16);  // finite operands
    std::vector<std::uint8_t> qa(a.size()), qb(b.size());
    std::vector<float> sa(static_cast<std::size_t>(p.m * kb)), sb(static_cast<std::size_t>(nb * kb));
    fp8_quantize(cpu::serial{},
                 fp8_quantize_args<float>{.x = tensor_view<float const, 2>(a.data(), {p.m, p.k}),
                                          .q = tensor_view<std::uint8_t, 2>(qa.data(), {p.m, p.k}),
                                          .scales = tensor_view<float, 2>(sa.data(), {p.m, kb})},
                 {.tile = tile_1x128, .format = scale_format::fp32});
    fp8_quantize(cpu::serial{},
                 fp8_quantize_args<float>{.x = tensor_view<float const, 2>(b.data(), {p.n, p.k}),
                                          .q = tensor_view<std::uint8_t, 2>(qb.data(), {p.n, p.k}),
                                          .scales = tensor_view<float, 2>(sb.data(), {nb, kb})},
                 {.tile = tile_128x128, .format = scale_format::fp32});
    mirrored<std::uint8_t> const dqa(p.m, p.k, qa), dqb(p.n, p.k, qb);
    mirrored<float> const dsa(p.m, kb, sa), dsb(nb, kb, sb);
    mirrored<float> c(p.m, p.n);
    fp8_block_gemm(cpu::serial{},
                   fp8_block_gemm_args<>{.a_q = dqa.hc(), .a_scales = dsa.hc(), .b_q = dqb.hc(), .b_scales = dsb.hc(), .c = c.h()});
    fp8_block_gemm(be, fp8_block_gemm_args<std::uint8_t const, float const, std::uint8_t const, float const, dev>{
                           .a_q = dqa.dc(), .a_scales = dsa.dc(), .b_q = dqb.dc(), .b_scales = dsb.dc(), .c = c.d()});
    CHECK(c.same());
  }
}

TEST_CASE("quant on the CUDA backend: strided views and non-const code views give the serial backend's bytes") {
  k3::cuda::stream_backend be;
  // x: the first 96 columns of a [9, 101] matrix; codes and scales in padded rows, y column-major.
  index_t const m = 9, k = 96, ld = 101;
  mirrored<bfloat16> const x(m, ld, input<bfloat16>(m, ld, 17));
  tensor_view<bfloat16 const, 2> const xh(x.host.data(), {m, k}, {ld, 1});
  tensor_view<bfloat16 const, 2, dev> const xd(x.device.p, {m, k}, {ld, 1});
  {
    mirrored<std::uint8_t> q(m, ld);
    mirrored<float> s(m, 3);  // [m, 1] scales with row stride 3
    fp8_quantize(cpu::serial{}, fp8_quantize_args<bfloat16>{.x = xh,
                                                            .q = tensor_view<std::uint8_t, 2>(q.host.data(), {m, k}, {ld, 1}),
                                                            .scales = tensor_view<float, 2>(s.host.data(), {m, 1}, {3, 1})});
    fp8_quantize(be, fp8_quantize_args<bfloat16, dev>{.x = xd,
                                                      .q = tensor_view<std::uint8_t, 2, dev>(q.device.p, {m, k}, {ld, 1}),
                                                      .scales = tensor_view<float, 2, dev>(s.device.p, {m, 1}, {3, 1})});
    CHECK(q.same());
    CHECK(s.same());
    mirrored<bfloat16> y(k, m);  // y^T: a column-major [m, k] output
    fp8_dequantize(cpu::serial{},
                   fp8_dequantize_args<bfloat16, std::uint8_t, float>{.q = tensor_view<std::uint8_t, 2>(q.host.data(), {m, k}, {ld, 1}),
                                                                      .scales = tensor_view<float, 2>(s.host.data(), {m, 1}, {3, 1}),
                                                                      .y = tensor_view<bfloat16, 2>(y.host.data(), {m, k}, {1, m})});
    fp8_dequantize(be,
                   fp8_dequantize_args<bfloat16, std::uint8_t, float, dev>{.q = q.d().sub(1, 0, k),
                                                                           .scales = tensor_view<float, 2, dev>(s.device.p, {m, 1}, {3, 1}),
                                                                           .y = tensor_view<bfloat16, 2, dev>(y.device.p, {m, k}, {1, m})});
    CHECK(y.same());
  }
  {
    mirrored<std::uint8_t> q(m, ld / 2), s(m, 5);
    mx_quantize(cpu::serial{},
                mx_quantize_args<bfloat16>{.x = xh,
                                           .q = tensor_view<std::uint8_t, 2>(q.host.data(), {m, k / 2}, {ld / 2, 1}),
                                           .scales = tensor_view<std::uint8_t, 2>(s.host.data(), {m, 3}, {5, 1})},
                {.element = mx_element::e2m1, .rule = mx_rule::rceil});
    mx_quantize(be,
                mx_quantize_args<bfloat16, dev>{.x = xd,
                                                .q = tensor_view<std::uint8_t, 2, dev>(q.device.p, {m, k / 2}, {ld / 2, 1}),
                                                .scales = tensor_view<std::uint8_t, 2, dev>(s.device.p, {m, 3}, {5, 1})},
                {.element = mx_element::e2m1, .rule = mx_rule::rceil});
    CHECK(q.same());
    CHECK(s.same());
  }
}

TEST_CASE("quant on the CUDA backend: bad input gets the serial backend's k3::error") {
  k3::cuda::stream_backend be;
  index_t const m = 4, k = 256;
  mirrored<float> const x(m, k, input<float>(m, k, 18));
  mirrored<std::uint8_t> q(m, k), q8(m, k / 32);
  mirrored<float> s(m, 2), wrong(m, 3);

  SUBCASE("fp8_quantize: scales of the wrong shape") {
    check_same_error([&] { fp8_quantize(cpu::serial{}, fp8_quantize_args<float>{.x = x.hc(), .q = q.h(), .scales = wrong.h()}); },
                     [&] { fp8_quantize(be, fp8_quantize_args<float, dev>{.x = x.dc(), .q = q.d(), .scales = wrong.d()}); },
                     error_kind::shape, "scales");
  }
  SUBCASE("fp8_dequantize: a tile with no rows") {
    mirrored<float> y(m, k);
    check_same_error(
        [&] {
          fp8_dequantize(cpu::serial{}, fp8_dequantize_args<float>{.q = q.hc(), .scales = s.hc(), .y = y.h()}, {.tile = {0, 128}});
        },
        [&] {
          fp8_dequantize(be, fp8_dequantize_args<float, std::uint8_t const, float const, dev>{.q = q.dc(), .scales = s.dc(), .y = y.d()},
                         {.tile = {0, 128}});
        },
        error_kind::shape, "tile");
  }
  SUBCASE("mx_quantize: K not a multiple of the 32-element block") {
    mirrored<float> const x48(m, 48, input<float>(m, 48, 19));
    mirrored<std::uint8_t> q48(m, 48), s48(m, 1);
    check_same_error([&] { mx_quantize(cpu::serial{}, mx_quantize_args<float>{.x = x48.hc(), .q = q48.h(), .scales = s48.h()}); },
                     [&] { mx_quantize(be, mx_quantize_args<float, dev>{.x = x48.dc(), .q = q48.d(), .scales = s48.d()}); },
                     error_kind::shape, "x");
  }
  SUBCASE("nvfp4_quantize and nvfp4_dequantize: no tensor scale") {
    mirrored<std::uint8_t> q4(m, k / 2), s4(m, k / 16);
    check_same_error([&] { nvfp4_quantize(cpu::serial{}, nvfp4_quantize_args<float>{.x = x.hc(), .q = q4.h(), .scales = s4.h()}); },
                     [&] { nvfp4_quantize(be, nvfp4_quantize_args<float, dev>{.x = x.dc(), .q = q4.d(), .scales = s4.d()}); },
                     error_kind::value, "tensor_scale");
    mirrored<float> y(m, k);
    check_same_error(
        [&] {
          nvfp4_dequantize(cpu::serial{}, nvfp4_dequantize_args<float>{.q = q4.hc(), .scales = s4.hc(), .y = y.h()},
                           {.tensor_scale = -1.0f});
        },
        [&] {
          nvfp4_dequantize(
              be, nvfp4_dequantize_args<float, std::uint8_t const, std::uint8_t const, dev>{.q = q4.dc(), .scales = s4.dc(), .y = y.d()},
              {.tensor_scale = -1.0f});
        },
        error_kind::value, "tensor_scale");
  }
  SUBCASE("mx_dequantize: codes of the wrong width for MXFP4") {
    mirrored<float> y(m, k);
    check_same_error(
        [&] {
          mx_dequantize(cpu::serial{}, mx_dequantize_args<float>{.q = q.hc(), .scales = q8.hc(), .y = y.h()},
                        {.element = mx_element::e2m1});
        },
        [&] {
          mx_dequantize(be,
                        mx_dequantize_args<float, std::uint8_t const, std::uint8_t const, dev>{.q = q.dc(), .scales = q8.dc(), .y = y.d()},
                        {.element = mx_element::e2m1});
        },
        error_kind::shape, "q");
  }
  SUBCASE("fp8_requantize_1x128_to_128x1: scales2 of the wrong shape") {
    mirrored<std::uint8_t> q2(m, k);
    check_same_error(
        [&] {
          fp8_requantize_1x128_to_128x1(cpu::serial{},
                                        fp8_requantize_args<>{.q = q.hc(), .scales = s.hc(), .q2 = q2.h(), .scales2 = wrong.h()});
        },
        [&] {
          fp8_requantize_1x128_to_128x1(be, fp8_requantize_args<std::uint8_t const, float const, dev>{
                                                .q = q.dc(), .scales = s.dc(), .q2 = q2.d(), .scales2 = wrong.d()});
        },
        error_kind::shape, "scales2");
  }
  SUBCASE("fp8_block_gemm: b_scales of the wrong shape, and c over a_scales") {
    mirrored<float> c(m, m);
    check_same_error(
        [&] {
          fp8_block_gemm(cpu::serial{},
                         fp8_block_gemm_args<>{.a_q = q.hc(), .a_scales = s.hc(), .b_q = q.hc(), .b_scales = wrong.hc(), .c = c.h()});
        },
        [&] {
          fp8_block_gemm(be, fp8_block_gemm_args<std::uint8_t const, float const, std::uint8_t const, float const, dev>{
                                 .a_q = q.dc(), .a_scales = s.dc(), .b_q = q.dc(), .b_scales = wrong.dc(), .c = c.d()});
        },
        error_kind::shape, "b_scales");
    // c over a_scales ([m, 2] in the first rows of c's memory). Messages print the addresses,
    // which differ between host and device: the same kind and names.
    mirrored<float> cs(m, m);
    mirrored<float> const sb1(1, 2, std::vector<float>(2, 1.0f));
    caught const h = catch_of([&] {
      fp8_block_gemm(cpu::serial{}, fp8_block_gemm_args<>{.a_q = q.hc(),
                                                          .a_scales = tensor_view<float const, 2>(cs.host.data(), {m, 2}, {m, 1}),
                                                          .b_q = q.hc(),
                                                          .b_scales = sb1.hc(),
                                                          .c = cs.h()});
    });
    caught const d = catch_of([&] {
      fp8_block_gemm(be, fp8_block_gemm_args<std::uint8_t const, float const, std::uint8_t const, float const, dev>{
                             .a_q = q.dc(),
                             .a_scales = tensor_view<float const, 2, dev>(cs.device.p, {m, 2}, {m, 1}),
                             .b_q = q.dc(),
                             .b_scales = sb1.dc(),
                             .c = cs.d()});
    });
    CAPTURE(h.message);
    CAPTURE(d.message);
    CHECK(h.thrown);
    CHECK(h.kind == error_kind::aliasing);
    CHECK(d.kind == h.kind);
    CHECK(d.argument == h.argument);
    CHECK(d.message.find("'a_scales'") != std::string::npos);
  }
}

TEST_CASE("quant on the CUDA backend: launch grids past CUDA's limits are unsupported, naming the argument") {
  k3::cuda::stream_backend be;
  // 65536 rows of 1x128 tiles: one thread block per tile row, past gridDim.y's 65535.
  index_t const rows = 65536;
  mirrored<float> const x(rows, 1, std::vector<float>(std::size_t(rows), 1.0f));
  mirrored<std::uint8_t> q(rows, 1);
  mirrored<float> s(rows, 1);
  check_unsupported([&] { fp8_quantize(be, fp8_quantize_args<float, dev>{.x = x.dc(), .q = q.d(), .scales = s.d()}); }, "x");
  // The same rows in 128x128 tiles launch 512 blocks: served.
  mirrored<float> s128(rows / 128, 1);
  fp8_quantize(be, fp8_quantize_args<float, dev>{.x = x.dc(), .q = q.d(), .scales = s128.d()}, {.tile = tile_128x128});
  CHECK(s128.device.get()[0] == 1.0f / 448.0f);

  // The GEMM launches one block per 16 rows of c: 65536 · 16 rows are past gridDim.y.
  index_t const gm = 65536 * 16;
  mirrored<std::uint8_t> const qa(gm, 1, std::vector<std::uint8_t>(std::size_t(gm), 0x38));
  mirrored<float> const sa(gm, 1, std::vector<float>(std::size_t(gm), 1.0f));
  mirrored<std::uint8_t> const qb(1, 1, {0x38});
  mirrored<float> const sb(1, 1, {1.0f});
  mirrored<float> c(gm, 1);
  check_unsupported(
      [&] {
        fp8_block_gemm(be, fp8_block_gemm_args<std::uint8_t const, float const, std::uint8_t const, float const, dev>{
                               .a_q = qa.dc(), .a_scales = sa.dc(), .b_q = qb.dc(), .b_scales = sb.dc(), .c = c.d()});
      },
      "a_q");
}
