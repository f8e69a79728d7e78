// k3::moe::route on k3::cuda::stream_backend (k3/moe/cuda/route_backend.cuh) against route() on
// k3::cpu::serial, bit for bit: indices, weights, cut-offs, loads and histogram counts, for m = 1,
// k = 1 and k = n - 1, odd n, tied scores, more experts than 48 KiB of shared memory holds,
// padding rows, and every optional output present or absent. Then the host's validation on
// device views (same kind, same message) and what the CUDA backend does not serve. Runs on the
// SIMT host runtime in every build and on a GPU where nvcc is.
#include "support/device_buffer.hpp"
// (device_buffer.hpp first: its config.cuh picks the CUDA runtime)
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/moe/cuda/route_backend.cuh"
#include "k3/moe/quantile_balancing.hpp"
#include "k3/moe/router.hpp"
#if !defined(__CUDACC__)
#include "k3/moe.hpp"
#endif

namespace moe = k3::moe;
using k3::index_t;
using k3::test::device_buffer;

namespace {

using dev = k3::cuda_device_space;

// route() on cpu::serial. nvcc does not compile k3/moe.hpp (its host SIMD router); there, the
// steps of its branch for serial backends, with route()'s histogram checks left out.
void host_route(moe::route_args<float> const& a, moe::router_options const& opt) {
#if defined(__CUDACC__)
  moe::detail::route_outputs const out{a.indices, a.weights, a.cutoff, a.load};
  if (!a.histogram) {
    moe::detail::route_serial(a.scores, a.bias, out, opt, a.mask);
    return;
  }
  std::vector<float> cut(static_cast<std::size_t>(a.scores.extent(0)));
  moe::detail::route_outputs o = out;
  if (o.cutoff.empty()) o.cutoff = k3::host_view(cut.data(), a.scores.extent(0));
  moe::detail::route_serial(a.scores, a.bias, o, opt, a.mask);
  moe::qb_accumulate(k3::cpu::serial{},
                     moe::qb_accumulate_args<float>{.scores = a.scores, .cutoff = o.cutoff, .mask = a.mask, .histogram = a.histogram}, opt);
#else
  moe::route(k3::cpu::serial{}, a, opt);
#endif
}

enum class padding { none, every_fifth, all };

struct variant {
  padding mask;
  bool cutoff, load, histogram;
};

// One batch of routing inputs on the host and the same on the device. The outputs start as
// different garbage on the two sides (-7 and NaN on the host, 0xFF bytes on the device), so
// that anything one side leaves unwritten shows.
struct routing_data {
  index_t m, n, k;
  std::mt19937_64 g;
  std::vector<float> s, b;
  std::vector<std::uint8_t> mask;
  std::vector<std::int32_t> idx;
  std::vector<float> w, cut;
  std::vector<std::int64_t> load;
  device_buffer<float> ds, db, dw, dcut;
  device_buffer<std::uint8_t> dmask;
  device_buffer<std::int32_t> didx;
  device_buffer<std::int64_t> dload;

  static std::vector<float> sigmoid_scores(index_t count, bool ties, std::mt19937_64& g) {
    std::normal_distribution<float> nd;
    std::vector<float> v(static_cast<std::size_t>(count));
    for (auto& x : v) {
      x = 1.f / (1.f + std::exp(-nd(g)));
      if (ties) x = std::round(x * 16.f) / 16.f;  // equal scores: the lower expert must win
    }
    return v;
  }
  static std::vector<float> make_bias(index_t n, bool ties, std::mt19937_64& g) {
    std::normal_distribution<float> nd;
    std::vector<float> v(static_cast<std::size_t>(n));
    for (auto& x : v) {
      x = 0.1f * nd(g);
      if (ties) x = std::round(x * 16.f) / 16.f;  // on the scores' grid, so that biased scores tie too
    }
    return v;
  }
  static std::vector<std::uint8_t> make_mask(index_t m, padding p) {
    std::vector<std::uint8_t> v(static_cast<std::size_t>(m), 1);
    for (index_t i = 0; i < m; ++i)
      if (p == padding::all || (p == padding::every_fifth && i % 5 == 1)) v[static_cast<std::size_t>(i)] = 0;
    return v;
  }

  routing_data(index_t m_, index_t n_, index_t k_, bool ties, padding p, std::uint64_t seed)
      : m(m_), n(n_), k(k_), g(seed), s(sigmoid_scores(m * n, ties, g)), b(make_bias(n, ties, g)), mask(make_mask(m, p)),
        idx(static_cast<std::size_t>(m * k), -7), w(static_cast<std::size_t>(m * k), std::numeric_limits<float>::quiet_NaN()),
        cut(static_cast<std::size_t>(m), std::numeric_limits<float>::quiet_NaN()), load(static_cast<std::size_t>(n), -7), ds(s), db(b),
        dw(w.size(), 0xFF), dcut(cut.size(), 0xFF), dmask(mask), didx(idx.size(), 0xFF), dload(load.size(), 0xFF) {}

  // Re-uploads the inputs after a test changed them on the host.
  void upload() {
    K3_CUDA_CHECK(cudaMemcpy(ds.p, s.data(), s.size() * sizeof(float), cudaMemcpyHostToDevice));
    K3_CUDA_CHECK(cudaMemcpy(db.p, b.data(), b.size() * sizeof(float), cudaMemcpyHostToDevice));
  }

  template <class Space, class F, class U, class I, class L>
  moe::route_args<float, Space> args(F* sp, F* bp, U* mp, I* ip, F* wp, F* cp, L* lp, variant v) const {
    moe::route_args<float, Space> a;
    a.scores = {sp, {m, n}};
    a.bias = {bp, {n}};
    if (v.mask != padding::none) a.mask = {mp, {m}};
    a.indices = {ip, {m, k}};
    a.weights = {wp, {m, k}};
    if (v.cutoff) a.cutoff = {cp, {m}};
    if (v.load) a.load = {lp, {n}};
    return a;
  }
  moe::route_args<float> host_args(variant v) {
    return args<k3::host_space>(s.data(), b.data(), mask.data(), idx.data(), w.data(), cut.data(), load.data(), v);
  }
  moe::route_args<float, dev> device_args(variant v) { return args<dev>(ds.p, db.p, dmask.p, didx.p, dw.p, dcut.p, dload.p, v); }
};

// Histograms for `bias` that already hold the same counts: route() must add to them.
moe::qb_histogram primed_histogram(std::vector<float> const& bias, index_t bins) {
  auto h = moe::qb_histogram::for_bias(k3::const_view<float, 1>(bias.data(), {index_t(bias.size())}), bins);
  for (index_t j = 0; j < h.experts(); ++j) h(j, (j * 7) % bins) += 3;
  return h;
}

template <class T>
bool same_bits(std::vector<T> const& a, std::vector<T> const& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

void check_case(index_t m, index_t n, index_t k, bool ties, variant v, std::uint64_t seed) {
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(ties);
  CAPTURE(static_cast<int>(v.mask));
  CAPTURE(v.cutoff);
  CAPTURE(v.load);
  CAPTURE(v.histogram);
  routing_data d(m, n, k, ties, v.mask, seed);
  moe::router_options opt;
  opt.k = k;
  opt.routed_scale = 2.5f;
  index_t const bins = 97;
  auto host_hist = primed_histogram(d.b, bins), device_hist = primed_histogram(d.b, bins);
  auto ha = d.host_args(v);
  auto da = d.device_args(v);
  if (v.histogram) {
    ha.histogram = &host_hist;
    da.histogram = &device_hist;
  }
  host_route(ha, opt);
  k3::cuda::stream_backend be;
  moe::route(be, da, opt);
  CHECK(d.didx.get() == d.idx);
  CHECK(same_bits(d.dw.get(), d.w));
  if (v.cutoff) CHECK(same_bits(d.dcut.get(), d.cut));
  if (v.load) CHECK(d.dload.get() == d.load);
  bool same_counts = true;
  for (index_t x = 0; x < n * bins; ++x) same_counts &= host_hist.data()[x] == device_hist.data()[x];
  CHECK(same_counts);
  CHECK(host_hist.tokens() == device_hist.tokens());
}

struct outcome {
  bool threw = false;
  k3::error_kind kind = k3::error_kind::value;
  std::string what;
};
template <class F>
outcome outcome_of(F&& f) {
  try {
    f();
  } catch (k3::error const& e) {
    return {true, e.kind(), e.what()};
  }
  return {};
}

// The same mistake made on both backends: the same kind of error, the same message.
template <class Mistake>
void check_same_error(routing_data& d, moe::router_options const& opt, Mistake&& mistake, char const* names) {
  CAPTURE(names);
  variant const all{padding::every_fifth, true, true, false};
  auto ha = d.host_args(all);
  auto da = d.device_args(all);
  mistake(ha);
  mistake(da);
  outcome const on_host = outcome_of([&] { host_route(ha, opt); });
  outcome const on_device = outcome_of([&] { moe::route(k3::cuda::stream_backend{}, da, opt); });
  REQUIRE(on_host.threw);
  CHECK(on_device.threw);
  CHECK(on_device.kind == on_host.kind);
  CHECK(on_device.what == on_host.what);
  CHECK(on_host.what.find(names) != std::string::npos);
}

// What the host serves and the CUDA backend does not: an unsupported-kind error naming `names`.
template <class Change>
void check_unsupported(routing_data& d, moe::router_options const& opt, Change&& change, char const* names) {
  CAPTURE(names);
  variant const all{padding::every_fifth, true, true, false};
  auto ha = d.host_args(all);
  auto da = d.device_args(all);
  change(ha);
  change(da);
  CHECK_FALSE(outcome_of([&] { host_route(ha, opt); }).threw);
  outcome const on_device = outcome_of([&] { moe::route(k3::cuda::stream_backend{}, da, opt); });
  CHECK(on_device.threw);
  CHECK(on_device.kind == k3::error_kind::unsupported);
  CHECK(on_device.what.find(names) != std::string::npos);
}

moe::router_options with_k(index_t k) {
  moe::router_options o;
  o.k = k;
  return o;
}

}  // namespace

TEST_CASE("moe::route on the CUDA backend is bit-identical to route on cpu::serial") {
  std::vector<variant> const variants{
      {padding::none, false, false, false},        // the required outputs only
      {padding::every_fifth, true, true, true},    // everything, with padding rows
      {padding::every_fifth, false, false, true},  // a histogram without a cut-off to write
      {padding::none, true, true, false},
      {padding::all, true, true, true},  // every token padding: nothing counted
  };
  struct shape {
    index_t m, n, k;
    bool ties;
  };
  std::vector<shape> const shapes{
      {1, 2, 1, false},       // the smallest problem
      {1, 37, 36, false},     // m = 1, k = n - 1
      {333, 37, 5, true},     // odd n, tied biased scores
      {100, 64, 63, true},    // k = n - 1 with ties
      {64, 129, 1, false},    // k = 1, n just past a power of two
      {257, 896, 16, false},  // Kimi K3's router
      {3, 13001, 7, false},   // n * 4 bytes past 48 KiB of shared memory
  };
  std::uint64_t seed = 1;
  for (auto const& s : shapes)
    for (auto const& v : variants) check_case(s.m, s.n, s.k, s.ties, v, seed++);
}

TEST_CASE("moe::route on the CUDA backend: the host's checks on device views, same kind and message") {
  index_t const m = 6, n = 9, k = 3;
  routing_data d(m, n, k, false, padding::every_fifth, 41);
  auto const opt = with_k(k);
  check_same_error(d, opt, [&](auto& a) { a.indices = {a.indices.data_handle(), {m, k + 1}}; }, "argument 'indices'");
  check_same_error(d, opt, [&](auto& a) { a.weights = {a.weights.data_handle(), {m - 1, k}}; }, "argument 'weights'");
  check_same_error(d, opt, [&](auto& a) { a.bias = {a.bias.data_handle(), {n - 1}}; }, "argument 'bias'");
  check_same_error(d, opt, [&](auto& a) { a.load = {a.load.data_handle(), {n + 1}}; }, "argument 'load'");
  check_same_error(d, opt, [&](auto& a) { a.mask = {a.mask.data_handle(), {m + 1}}; }, "argument 'mask'");
  check_same_error(d, with_k(n), [](auto&) {}, "option 'k'");
  check_same_error(d, with_k(0), [](auto&) {}, "option 'k'");
  auto scale = opt;
  scale.routed_scale = std::numeric_limits<float>::infinity();
  check_same_error(d, scale, [](auto&) {}, "option 'routed_scale'");
  // m = 0: no tokens is an error on the host backends, and so here.
  check_same_error(
      d, opt,
      [&](auto& a) {
        a.scores = {a.scores.data_handle(), {0, n}};
        a.indices = {a.indices.data_handle(), {0, k}};
        a.weights = {a.weights.data_handle(), {0, k}};
        a.cutoff = {};
        a.mask = {};
      },
      "zero tokens");
  check_same_error(
      d, opt, [&](auto& a) { a.weights = {const_cast<float*>(a.scores.data_handle()) + 4, {m, k}}; }, "'weights' and 'scores' overlap");
  check_same_error(
      d, opt, [&](auto& a) { a.cutoff = {reinterpret_cast<float*>(a.indices.data_handle()) + 1, {m}}; }, "'indices' and 'cutoff' overlap");
  check_same_error(
      d, opt, [&](auto& a) { a.indices = {a.indices.data_handle(), {m, k}, {0, 1}}; }, "argument 'indices': dimension 0");
#if !defined(__CUDACC__)
  // route()'s own histogram checks (k3/moe.hpp; host_route leaves them out under nvcc).
  auto other = moe::qb_histogram::for_bias(k3::const_view<float, 1>(d.b.data(), {n - 1}), 10);
  check_same_error(d, opt, [&](auto& a) { a.histogram = &other; }, "argument 'histogram'");
  auto hist = moe::qb_histogram::for_bias(k3::const_view<float, 1>(d.b.data(), {n}), 10);
  auto grouped = opt;
  grouped.n_groups = 3;
  check_same_error(d, grouped, [&](auto& a) { a.histogram = &hist; }, "argument 'n_groups'");
#endif

  // Non-finite values: the first in the host's scan order is named, in a padding row too.
  d.b[5] = std::numeric_limits<float>::quiet_NaN();
  d.b[7] = std::numeric_limits<float>::infinity();
  d.upload();
  check_same_error(d, opt, [](auto&) {}, "argument 'bias': non-finite value at expert 5");
  d.b[5] = d.b[7] = 0.f;
  d.s[static_cast<std::size_t>(1 * n + 4)] = -std::numeric_limits<float>::infinity();  // token 1 is padding
  d.s[static_cast<std::size_t>(3 * n + 2)] = std::numeric_limits<float>::quiet_NaN();
  d.upload();
  check_same_error(d, opt, [](auto&) {}, "argument 'scores': non-finite value at token 1, expert 4");
}

TEST_CASE("moe::route on the CUDA backend: logits, group-limited routing, strided views and too many experts are unsupported") {
  index_t const m = 6, n = 8, k = 2;
  routing_data d(m, n, k, false, padding::every_fifth, 43);
  auto logits = with_k(k);
  logits.input = moe::score_kind::logits;
  check_unsupported(d, logits, [](auto&) {}, "option 'input'");
  auto grouped = with_k(k);
  grouped.n_groups = 2;
  check_unsupported(d, grouped, [](auto&) {}, "option 'n_groups'");
  // Half the tokens, contiguous; then one view of every other row, which the host takes (a
  // row stride) and the kernel does not (it reads rows n apart).
  auto const half = [&](auto& a) {
    a.scores = {a.scores.data_handle(), {m / 2, n}};
    a.indices = {a.indices.data_handle(), {m / 2, k}};
    a.weights = {a.weights.data_handle(), {m / 2, k}};
    a.cutoff = {a.cutoff.data_handle(), {m / 2}};
    a.mask = {a.mask.data_handle(), {m / 2}};
  };
  check_unsupported(
      d, with_k(k),
      [&](auto& a) {
        half(a);
        a.scores = {a.scores.data_handle(), {m / 2, n}, {2 * n, 1}};
      },
      "argument 'scores'");
  check_unsupported(
      d, with_k(k),
      [&](auto& a) {
        half(a);
        a.weights = {a.weights.data_handle(), {m / 2, k}, {2 * k, 1}};
      },
      "argument 'weights'");

  index_t const wide = moe::detail::cuda_route_max_experts + 1;
  routing_data w(1, wide, 4, false, padding::none, 44);
  check_unsupported(w, with_k(4), [](auto& a) { a.mask = {}; }, "at most 16384 experts");
}
