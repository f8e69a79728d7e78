// k3::attnres's ops on k3::cuda::stream_backend (k3/attnres/cuda/backend.cuh) against the same
// calls on k3::cpu::serial: mix_forward / mix_backward, block_rinv, phase1 and phase2_add for
// float and bfloat16 storage on fixed awkward shapes (one token, one source, odd d, d not a
// multiple of the kernels' 256-thread blocks, 32 sources, no completed block) and random ones;
// the host backends' errors for bad input (same kind, argument and message), and what the CUDA
// backend does not serve. Runs on the SIMT host runtime in every build and on a GPU where nvcc is.
#include "support/device_buffer.hpp"
// (device_buffer.hpp first: its config.cuh picks the CUDA runtime)
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/attnres/cuda/backend.cuh"
#include "k3/attnres/mix.hpp"
#include "k3/attnres/two_phase.hpp"
#include "support/error_of.hpp"

using namespace k3;
using namespace k3::attnres;
using k3::test::device_buffer;

namespace {

using dev = cuda_device_space;

std::vector<float> randn(index_t n, std::uint64_t seed, float scale = 1.f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = nd(g);
  return v;
}

template <class S>
std::vector<S> as(std::vector<float> const& x) {
  if constexpr (std::is_same_v<S, float>) {
    return x;
  } else {
    std::vector<S> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = S(x[i]);
    return y;
  }
}

// Largest absolute difference over the largest reference magnitude; equal values (infinities
// included) and NaN on both sides count as no error, a NaN on one side as an infinite one.
template <class A, class B>
double rel(A const& x, B const& y) {
  REQUIRE(x.size() == y.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    double const a = double(float(x[i])), b = double(float(y[i]));
    if (a == b || (std::isnan(a) && std::isnan(b))) continue;
    double const e = std::abs(a - b);
    if (!(e <= num)) num = std::isnan(e) ? INFINITY : e;
    if (std::isfinite(b)) den = std::max(den, std::abs(b));
  }
  return den == 0 ? num : num / den;
}

// A buffer held twice, on the host and on the device, with the same bytes (outputs start as
// 0xFF bytes, NaN, on both, so an element one backend leaves unwritten shows).
template <class T>
struct mirrored {
  std::vector<T> host;
  device_buffer<T> device;
  explicit mirrored(std::vector<T> v) : host(std::move(v)), device(host) {}
  explicit mirrored(index_t n) : host(filled(n)), device(static_cast<std::size_t>(n), 0xFF) {}
  static std::vector<T> filled(index_t n) {
    std::vector<T> v(static_cast<std::size_t>(n));
    if (n) std::memset(static_cast<void*>(v.data()), 0xFF, v.size() * sizeof(T));
    return v;
  }
  template <class... I>
  tensor_view<T, sizeof...(I)> h(I... ext) {
    return {host.data(), {index_t(ext)...}};
  }
  template <class... I>
  tensor_view<T, sizeof...(I), dev> d(I... ext) const {
    return {device.p, {index_t(ext)...}};
  }
  double error() const { return rel(device.get(), host); }
};

// Float math on the device against double per-source scalars on the host: the tolerances of
// test_attnres_cuda.cu (bfloat16 outputs: within bfloat16 rounding).
template <class S>
constexpr double out_tol = std::is_same_v<S, float> ? 2e-5 : 2e-2;

struct site {
  index_t n, T, d;
  bool partial;
};

std::vector<site> mix_shapes() {
  std::vector<site> s = {{1, 1, 1, false},  {0, 1, 5, true},    {1, 3, 7, false},   {2, 1, 257, true}, {3, 5, 33, true},
                         {31, 2, 19, true}, {32, 3, 300, false}, {4, 17, 513, true}, {5, 6, 1000, false}};
  std::mt19937 g(7);
  for (int i = 0; i < 6; ++i) {
    index_t const n = index_t(g() % 9), T = 1 + index_t(g() % 12), d = 1 + index_t(g() % 700);
    s.push_back({n, T, d, n == 0 || g() % 2 == 0});
  }
  return s;
}

struct two_phase_shape {
  index_t n, nq, T, d;
};

std::vector<two_phase_shape> two_phase_shapes() {
  std::vector<two_phase_shape> s = {{0, 2, 3, 5}, {1, 1, 1, 1}, {3, 5, 7, 257}, {32, 2, 4, 300}, {8, 3, 9, 1000}, {2, 4, 1, 31}};
  std::mt19937 g(8);
  for (int i = 0; i < 5; ++i) s.push_back({index_t(g() % 12), 1 + index_t(g() % 5), 1 + index_t(g() % 10), 1 + index_t(g() % 700)});
  return s;
}

template <class S>
void check_mix(site const& c, std::uint64_t seed) {
  k3::cuda::stream_backend be;
  index_t const n = c.n, T = c.T, d = c.d;
  mirrored<S> bank(as<S>(randn(n * T * d, seed))), part(as<S>(randn(c.partial ? T * d : 0, seed + 1, 2.f)));
  std::vector<float> gv = randn(d, seed + 3, 0.2f);
  for (auto& x : gv) x += 1;
  mirrored<float> w(randn(d, seed + 2, 2.f / std::sqrt(float(d)))), g(gv), dh(randn(T * d, seed + 4));
  mirrored<S> h(T * d);
  mirrored<float> dbank(n * T * d), dpart(T * d), dw(d), dg(d);
  auto const hs = c.partial ? make_sources(bank.h(n, T, d), part.h(T, d)) : make_sources(bank.h(n, T, d));
  auto const ds = c.partial ? make_sources(bank.d(n, T, d), part.d(T, d)) : make_sources(bank.d(n, T, d));
  auto const hg = c.partial ? make_grads(dbank.h(n, T, d), dpart.h(T, d)) : make_grads(dbank.h(n, T, d));
  auto const dgr = c.partial ? make_grads(dbank.d(n, T, d), dpart.d(T, d)) : make_grads(dbank.d(n, T, d));

  mix_forward(cpu::serial{}, mix_forward_args<S, float, S>{.sources = hs, .w = w.h(d), .gain = g.h(d), .h = h.h(T, d)});
  mix_forward(be, mix_forward_args<S, float, S, dev>{.sources = ds, .w = w.d(d), .gain = g.d(d), .h = h.d(T, d)});
  CHECK(h.error() <= out_tol<S>);

  mix_backward(cpu::serial{}, mix_backward_args<S, float, float, float, float>{
                                  .sources = hs, .w = w.h(d), .gain = g.h(d), .d_h = dh.h(T, d), .d_sources = hg, .d_w = dw.h(d), .d_gain = dg.h(d)});
  mix_backward(be, mix_backward_args<S, float, float, float, float, dev>{
                       .sources = ds, .w = w.d(d), .gain = g.d(d), .d_h = dh.d(T, d), .d_sources = dgr, .d_w = dw.d(d), .d_gain = dg.d(d)});
  CHECK(dbank.error() <= 2e-5);
  if (c.partial) {
    CHECK(dpart.error() <= 2e-5);
  } else {
    CHECK(dpart.error() == 0);  // untouched on both: NaN bytes either side
  }
  CHECK(dw.error() <= 1e-4);
  CHECK(dg.error() <= 1e-4);
}

template <class S>
void check_two_phase(two_phase_shape const& c, std::uint64_t seed) {
  k3::cuda::stream_backend be;
  index_t const n = c.n, nq = c.nq, T = c.T, d = c.d;
  mirrored<S> bank(as<S>(randn(n * T * d, seed)));
  mirrored<float> rinv(n * T);
  for (index_t j = 0; j < n; ++j) {
    block_rinv(cpu::serial{}, block_rinv_args<S>{.block = bank.h(n, T, d).slice(0, j), .rinv = rinv.h(n, T).slice(0, j)});
    block_rinv(be, block_rinv_args<S, dev>{.block = bank.d(n, T, d).slice(0, j), .rinv = rinv.d(n, T).slice(0, j)});
  }
  CHECK(rinv.error() <= 1e-5);

  // phase 1 from the host's rinv on both sides, so that it is compared on its own
  mirrored<float> rin(rinv.host), u(randn(nq * d, seed + 1, 2.f / std::sqrt(float(d))));
  mirrored<S> o(nq * T * d);
  mirrored<float> lse(nq * T);
  phase1(cpu::serial{}, phase1_args<S>{.bank = bank.h(n, T, d), .bank_rinv = rin.h(n, T), .u = u.h(nq, d), .o = o.h(nq, T, d), .lse = lse.h(nq, T)});
  phase1(be, phase1_args<S, S, dev>{.bank = bank.d(n, T, d), .bank_rinv = rin.d(n, T), .u = u.d(nq, d), .o = o.d(nq, T, d), .lse = lse.d(nq, T)});
  CHECK(o.error() <= out_tol<S>);
  CHECK(lse.error() <= 2e-5);

  mirrored<S> o2(as<S>(randn(T * d, seed + 2))), prefix(as<S>(randn(T * d, seed + 3, 2.f))), delta(as<S>(randn(T * d, seed + 4)));
  mirrored<float> lse2(randn(T, seed + 5)), u2(randn(d, seed + 6, 2.f / std::sqrt(float(d))));
  mirrored<S> h(T * d);
  phase2_add(cpu::serial{}, phase2_add_args<S>{.o = o2.h(T, d), .lse = lse2.h(T), .prefix = prefix.h(T, d), .delta = delta.h(T, d), .u = u2.h(d), .h = h.h(T, d)});
  phase2_add(be, phase2_add_args<S, S, S, S, dev>{.o = o2.d(T, d), .lse = lse2.d(T), .prefix = prefix.d(T, d), .delta = delta.d(T, d), .u = u2.d(d), .h = h.d(T, d)});
  CHECK(prefix.error() == 0);  // one add in float, rounded once to S, on both
  CHECK(h.error() <= out_tol<S>);
}

// The same k3::error (kind, argument, message) from the host call and the CUDA call.
template <class Host, class Cuda>
void check_same_error(Host&& host, Cuda&& cuda, error_kind kind, char const* argument) {
  std::string const hm = k3::test::error_of(host), cm = k3::test::error_of(cuda);
  CAPTURE(hm);
  CAPTURE(cm);
  auto const hk = k3::test::error_kind_of(host), ck = k3::test::error_kind_of(cuda);
  REQUIRE(hk.has_value());
  REQUIRE(ck.has_value());
  CHECK(*hk == kind);
  CHECK(*ck == *hk);
  CHECK(k3::test::argument_of(host) == argument);
  CHECK(k3::test::argument_of(cuda) == argument);
  CHECK(cm == hm);
}

template <class F>
void check_unsupported(F&& call, char const* argument) {
  CAPTURE(k3::test::error_of(call));
  CHECK(k3::test::error_kind_of(call) == error_kind::unsupported);
  CHECK(k3::test::argument_of(call) == argument);
}

}  // namespace

TEST_CASE_TEMPLATE("attnres on the CUDA backend: mix_forward and mix_backward match the serial backend", S, float, bfloat16) {
  std::uint64_t seed = 100;
  for (site const& c : mix_shapes()) {
    CAPTURE(c.n);
    CAPTURE(c.T);
    CAPTURE(c.d);
    CAPTURE(c.partial);
    check_mix<S>(c, seed += 10);
  }
}

TEST_CASE_TEMPLATE("attnres on the CUDA backend: block_rinv, phase1 and phase2_add match the serial backend", S, float, bfloat16) {
  std::uint64_t seed = 200;
  for (two_phase_shape const& c : two_phase_shapes()) {
    CAPTURE(c.n);
    CAPTURE(c.nq);
    CAPTURE(c.T);
    CAPTURE(c.d);
    check_two_phase<S>(c, seed += 10);
  }
}

TEST_CASE("attnres on the CUDA backend: d_h may be the partial's gradient, as on the host") {
  k3::cuda::stream_backend be;
  index_t const n = 3, T = 4, d = 37;
  mirrored<float> bank(randn(n * T * d, 1)), part(randn(T * d, 2)), w(randn(d, 3, 0.3f)), g(randn(d, 4, 0.2f));
  mirrored<float> dbank(n * T * d), dpart(randn(T * d, 5)), dw(d), dg(d);  // dpart holds d_h on entry
  mix_backward(cpu::serial{}, mix_backward_args<float, float, float>{.sources = make_sources(bank.h(n, T, d), part.h(T, d)),
                                                                     .w = w.h(d),
                                                                     .gain = g.h(d),
                                                                     .d_h = dpart.h(T, d),
                                                                     .d_sources = make_grads(dbank.h(n, T, d), dpart.h(T, d)),
                                                                     .d_w = dw.h(d),
                                                                     .d_gain = dg.h(d)});
  mix_backward(be, mix_backward_args<float, float, float, float, float, dev>{.sources = make_sources(bank.d(n, T, d), part.d(T, d)),
                                                                             .w = w.d(d),
                                                                             .gain = g.d(d),
                                                                             .d_h = dpart.d(T, d),
                                                                             .d_sources = make_grads(dbank.d(n, T, d), dpart.d(T, d)),
                                                                             .d_w = dw.d(d),
                                                                             .d_gain = dg.d(d)});
  CHECK(dbank.error() <= 2e-5);
  CHECK(dpart.error() <= 2e-5);
  CHECK(dw.error() <= 1e-4);
  CHECK(dg.error() <= 1e-4);
}

TEST_CASE("attnres on the CUDA backend: bad input raises the host backends' k3::error") {
  k3::cuda::stream_backend be;
  index_t const n = 2, T = 3, d = 4, nq = 2;
  // One arena on each side with the same layout, so that aliasing looks the same to both.
  std::vector<float> hm(2048, 1.f);
  device_buffer<float> dm(2048);
  auto H = [&](index_t i) { return hm.data() + 128 * i; };
  auto D = [&](index_t i) { return dm.p + 128 * i; };
  using hv1 = tensor_view<float, 1>;
  using hv2 = tensor_view<float, 2>;
  using hv3 = tensor_view<float, 3>;
  using dv1 = tensor_view<float, 1, dev>;
  using dv2 = tensor_view<float, 2, dev>;
  using dv3 = tensor_view<float, 3, dev>;

  // mix_forward: bank 0, w 2, gain 3, h 4 (or over the bank)
  auto forward_pair = [&](index_t h_at, index_t h_off, index_t h_cols, index_t bank_rows, options opt) {
    auto host = [=, &hm] {
      float* base = hm.data();
      mix_forward(cpu::serial{}, mix_forward_args<float>{.sources = make_sources(hv3(base, {bank_rows, T, d})),
                                                         .w = hv1(base + 256, {d}),
                                                         .gain = hv1(base + 384, {d}),
                                                         .h = hv2(base + 128 * h_at + h_off, {T, h_cols})},
                  opt);
    };
    auto cuda = [=, &dm] {
      float* base = dm.p;
      mix_forward(be, mix_forward_args<float, float, float, dev>{.sources = make_sources(dv3(base, {bank_rows, T, d})),
                                                                 .w = dv1(base + 256, {d}),
                                                                 .gain = dv1(base + 384, {d}),
                                                                 .h = dv2(base + 128 * h_at + h_off, {T, h_cols})},
                  opt);
    };
    return std::pair{host, cuda};
  };
  {
    auto [h, c] = forward_pair(4, 0, d + 1, n, {});
    check_same_error(h, c, error_kind::shape, "h");
  }
  {
    auto [h, c] = forward_pair(4, 0, d, n, {.eps = -1.0});
    check_same_error(h, c, error_kind::value, "eps");
  }
  {
    auto [h, c] = forward_pair(0, 5, d, n, {});  // h over the bank
    check_same_error(h, c, error_kind::aliasing, "h");
  }
  {
    auto [h, c] = forward_pair(4, 0, d, 0, {});  // no source at all
    check_same_error(h, c, error_kind::shape, "sources");
  }

  // mix_backward: bank 0, partial 1, w 2, gain 3, d_h 4, d_bank 5, d_partial 6, d_w 7, d_gain 8
  auto backward_pair = [&](index_t dw_at, index_t dbank_rows) {
    auto host = [=] {
      mix_backward(cpu::serial{}, mix_backward_args<float, float, float>{.sources = make_sources(hv3(H(0), {n, T, d}), hv2(H(1), {T, d})),
                                                                         .w = hv1(H(2), {d}),
                                                                         .gain = hv1(H(3), {d}),
                                                                         .d_h = hv2(H(4), {T, d}),
                                                                         .d_sources = make_grads(hv3(H(5), {dbank_rows, T, d}), hv2(H(6), {T, d})),
                                                                         .d_w = hv1(H(dw_at), {d}),
                                                                         .d_gain = hv1(H(8), {d})});
    };
    auto cuda = [=] {
      mix_backward(be, mix_backward_args<float, float, float, float, float, dev>{
                           .sources = make_sources(dv3(D(0), {n, T, d}), dv2(D(1), {T, d})),
                           .w = dv1(D(2), {d}),
                           .gain = dv1(D(3), {d}),
                           .d_h = dv2(D(4), {T, d}),
                           .d_sources = make_grads(dv3(D(5), {dbank_rows, T, d}), dv2(D(6), {T, d})),
                           .d_w = dv1(D(dw_at), {d}),
                           .d_gain = dv1(D(8), {d})});
    };
    return std::pair{host, cuda};
  };
  {
    auto [h, c] = backward_pair(7, n + 1);
    check_same_error(h, c, error_kind::shape, "d_sources");
  }
  {
    auto [h, c] = backward_pair(2, n);  // d_w over w
    check_same_error(h, c, error_kind::aliasing, "d_w");
  }

  // block_rinv: rinv one element too long
  check_same_error([&] { block_rinv(cpu::serial{}, block_rinv_args<float>{.block = hv2(H(0), {T, d}), .rinv = hv1(H(1), {T + 1})}); },
                   [&] { block_rinv(be, block_rinv_args<float, dev>{.block = dv2(D(0), {T, d}), .rinv = dv1(D(1), {T + 1})}); },
                   error_kind::shape, "rinv");

  // phase1: bank 0, bank_rinv 1, u 2, o 3, lse 4
  auto phase1_pair = [&](index_t rinv_cols, index_t lse_at, index_t u_stride) {
    auto host = [=] {
      phase1(cpu::serial{}, phase1_args<float>{.bank = hv3(H(0), {n, T, d}),
                                               .bank_rinv = hv2(H(1), {n, rinv_cols}),
                                               .u = hv2(H(2), {nq, d}, {d * u_stride, u_stride}),
                                               .o = hv3(H(3), {nq, T, d}),
                                               .lse = hv2(H(lse_at), {nq, T})});
    };
    auto cuda = [=] {
      phase1(be, phase1_args<float, float, dev>{.bank = dv3(D(0), {n, T, d}),
                                                .bank_rinv = dv2(D(1), {n, rinv_cols}),
                                                .u = dv2(D(2), {nq, d}, {d * u_stride, u_stride}),
                                                .o = dv3(D(3), {nq, T, d}),
                                                .lse = dv2(D(lse_at), {nq, T})});
    };
    return std::pair{host, cuda};
  };
  {
    auto [h, c] = phase1_pair(T + 1, 4, 1);
    check_same_error(h, c, error_kind::shape, "bank_rinv");
  }
  {
    auto [h, c] = phase1_pair(T, 3, 1);  // lse over o
    check_same_error(h, c, error_kind::aliasing, "o");
  }
  {
    auto [h, c] = phase1_pair(T, 4, 2);  // u's rows not unit-stride
    check_same_error(h, c, error_kind::shape, "u");
  }

  // phase2_add: o 0, lse 1, prefix 2, delta 3, u 4, h 5
  auto phase2_pair = [&](index_t h_at, double eps) {
    auto host = [=] {
      phase2_add(cpu::serial{}, phase2_add_args<float>{.o = hv2(H(0), {T, d}),
                                                       .lse = hv1(H(1), {T}),
                                                       .prefix = hv2(H(2), {T, d}),
                                                       .delta = hv2(H(3), {T, d}),
                                                       .u = hv1(H(4), {d}),
                                                       .h = hv2(H(h_at), {T, d})},
                 {.eps = eps});
    };
    auto cuda = [=] {
      phase2_add(be, phase2_add_args<float, float, float, float, dev>{.o = dv2(D(0), {T, d}),
                                                                      .lse = dv1(D(1), {T}),
                                                                      .prefix = dv2(D(2), {T, d}),
                                                                      .delta = dv2(D(3), {T, d}),
                                                                      .u = dv1(D(4), {d}),
                                                                      .h = dv2(D(h_at), {T, d})},
                 {.eps = eps});
    };
    return std::pair{host, cuda};
  };
  {
    auto [h, c] = phase2_pair(2, 1e-5);  // h over prefix
    check_same_error(h, c, error_kind::aliasing, "prefix");
  }
  {
    auto [h, c] = phase2_pair(5, std::numeric_limits<double>::quiet_NaN());
    check_same_error(h, c, error_kind::value, "eps");
  }
}

TEST_CASE("attnres on the CUDA backend: what the kernels do not serve is an unsupported-kind k3::error") {
  k3::cuda::stream_backend be;
  index_t const T = 3, d = 8;
  device_buffer<float> m(40 * T * (d + 1) + 4096);
  auto at = [&](index_t i) { return m.p + 1024 * i; };
  auto dv1 = [](float* p, index_t a) { return tensor_view<float, 1, dev>(p, {a}); };
  auto dv2 = [](float* p, index_t a, index_t b) { return tensor_view<float, 2, dev>(p, {a, b}); };
  auto forward = [&](index_t n, options opt, tensor_view<float, 3, dev> stats, index_t bank_row_stride) {
    return [=, &m] {
      float* bank = m.p + 4096;
      mix_forward(be, mix_forward_args<float, float, float, dev>{
                          .sources = make_sources(tensor_view<float, 3, dev>(bank, {n, T, d}, {T * bank_row_stride, bank_row_stride, 1})),
                          .w = dv1(at(0), d),
                          .gain = dv1(at(1), d),
                          .h = dv2(at(2), T, d),
                          .stats = stats},
                  opt);
    };
  };
  check_unsupported(forward(33, {}, {}, d), "sources");
  check_unsupported(forward(2, {}, tensor_view<float, 3, dev>(at(3), {T, 2, 3}), d), "stats");
  check_unsupported(forward(2, {}, {}, d + 1), "sources");  // rows padded: not contiguous

  check_unsupported(
      [&] {
        mix_backward(be, mix_backward_args<float, float, float, float, float, dev>{.sources = make_sources(tensor_view<float, 3, dev>(at(0), {2, T, d})),
                                                                                   .w = dv1(at(1), d),
                                                                                   .gain = dv1(at(2), d),
                                                                                   .d_h = dv2(at(3), T, d),
                                                                                   .d_sources = make_grads(tensor_view<float, 3, dev>(at(4), {2, T, d})),
                                                                                   .d_w = dv1(at(5), d),
                                                                                   .d_gain = dv1(at(6), d)},
                     {.accumulate = true});
      },
      "accumulate");

  device_buffer<double> dd(256);
  check_unsupported(
      [&] {
        mix_forward(be, mix_forward_args<double, double, double, dev>{.sources = make_sources(tensor_view<double, 3, dev>(dd.p, {1, 2, 4})),
                                                                      .w = tensor_view<double, 1, dev>(dd.p + 64, {4}),
                                                                      .gain = tensor_view<double, 1, dev>(dd.p + 128, {4}),
                                                                      .h = tensor_view<double, 2, dev>(dd.p + 192, {2, 4})});
      },
      "sources");
  check_unsupported(
      [&] {
        phase1(be, phase1_args<float, float, dev>{.bank = tensor_view<float, 3, dev>(at(0), {2, T, 0}),
                                                  .bank_rinv = dv2(at(1), 2, T),
                                                  .u = dv2(at(2), 1, 0),
                                                  .o = tensor_view<float, 3, dev>(at(3), {1, T, 0}),
                                                  .lse = dv2(at(4), 1, T)});
      },
      "bank");
}
