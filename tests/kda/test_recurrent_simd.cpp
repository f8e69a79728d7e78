// The vectorised recurrent forward (k3/kda/recurrent_simd.hpp: state slices in L1, the state
// kept per block of tokens as S / A with A the block's cumulative decay) against the serial
// reference recurrence: 1e-12 in double on awkward shapes (T = 1, odd K, V not a multiple of
// the slice width, varlen with empty sequences, HV = 2H, h0 / ht present or absent), decays that
// end blocks every few tokens (strong decays, hard resets, growth beyond the block bound), on
// every backend and on narrower SIMD architectures; float against a double reference; NaN
// confinement per head and exact causality.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <string>

#include "kda/kda_fixture.hpp"

using namespace k3;
using namespace k3::test;

namespace {

// The forward with ht present or absent (o only then).
template <class In, class Backend>
fwd_result forward_ht(typed_data<In> const& d, Backend const& be, bool with_ht) {
  if (with_ht) return run_forward(d, kda::algorithm::recurrent, be);
  auto const& c = d.c;
  std::vector<In> o(std::size_t(c.B * c.T * c.HV * c.V));
  kda::forward_args<In, k3::accumulation_t<In>> a{.q = d.qv(), .k = d.kv(), .v = d.vv(), .g = d.gv(), .beta = d.bv(),
                                                    .o = host_view(o.data(), c.B, c.T, c.HV, c.V), .h0 = d.h0v()};
  kda::forward(be, a, d.opts(kda::algorithm::recurrent));
  return {to_double(o), {}};
}

enum class decay { fixture, strong, growth, infinite_resets };

// Replaces the fixture's gates: `strong` decays up to e^-40 per step (a block of the float path
// lasts one or two tokens, of the double path a few), `growth` has stretches of g > 0 that push
// the cumulative factor above the block's upper bound, `infinite_resets` has g = -inf.
void set_decay(kda_data64& d, decay k, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  index_t const rows = d.c.B * d.c.T;
  for (index_t r = 0; r < rows; ++r)
    for (index_t i = 0; i < d.c.HV * d.c.K; ++i) {
      double& x = d.g[std::size_t(r * d.c.HV * d.c.K + i)];
      switch (k) {
        case decay::fixture: break;
        case decay::strong: x = -40 * ud(rng) * ud(rng); break;
        case decay::growth: x = (r / 20) % 2 == 1 ? 6 * ud(rng) : -0.1 * ud(rng); break;
        case decay::infinite_resets:
          if (ud(rng) < 0.02) x = -INFINITY;
          break;
      }
    }
}

struct shape_case {
  kda_case c;
  decay dk;
};

template <class Backend>
void check_double(Backend const& be, char const* name) {
  shape_case const cases[] = {
      {{.T = 1, .K = 16, .V = 16, .seed = 301}, decay::fixture},
      {{.T = 15, .K = 7, .V = 24, .seed = 302}, decay::strong},  // odd K; V: one batch per slice (double, AVX-512)
      {{.T = 130, .H = 2, .HV = 4, .K = 60, .V = 48, .h0 = false, .seed = 303}, decay::fixture},
      {{.B = 1, .T = 200, .H = 1, .HV = 2, .K = 33, .V = 32, .cu = {0, 0, 5, 5, 70, 200, 200}, .seed = 304}, decay::strong},
      {{.T = 150, .K = 20, .V = 40, .gate = gate_kind::resets, .seed = 305}, decay::fixture},
      {{.T = 150, .K = 20, .V = 64, .seed = 306}, decay::infinite_resets},
      {{.T = 140, .K = 16, .V = 16, .seed = 307}, decay::growth},
      {{.B = 2, .T = 97, .H = 1, .HV = 2, .K = 128, .V = 128, .gate = gate_kind::lower_bound, .seed = 308}, decay::fixture},
      {{.T = 70, .K = 9, .V = 12, .seed = 309}, decay::strong},  // V not a multiple of a batch: the portable path
      // head groups (several value heads per task): uneven (5 heads), and the largest (8)
      {{.T = 70, .H = 1, .HV = 5, .K = 24, .V = 32, .seed = 310}, decay::strong},
      {{.T = 66, .H = 2, .HV = 16, .K = 16, .V = 16, .cu = {0, 30, 30, 66}, .seed = 311}, decay::fixture},
  };
  for (auto const& sc : cases)
    for (bool with_ht : {true, false}) {
      kda_data64 d = make_data(sc.c);
      set_decay(d, sc.dk, sc.c.seed + 7);
      typed_data<double> td(d);
      auto ref = run_forward(td, kda::algorithm::recurrent);  // the serial backend's reference step
      auto x = forward_ht(td, be, with_ht);
      INFO(std::string(name) << " T=" << sc.c.T << " K=" << sc.c.K << " V=" << sc.c.V << " decay " << int(sc.dk) << " ht " << with_ht << " o "
                << rel_rms(x.o, ref.o) << " ht " << (with_ht ? rel_rms(x.ht, ref.ht) : 0.0));
      CHECK(rel_rms(x.o, ref.o) <= 1e-12);
      if (with_ht) CHECK(rel_rms(x.ht, ref.ht) <= 1e-12);
      if (sc.dk == decay::infinite_resets) {
        // a hard reset zeroes the state exactly: outputs right after one only see that token
        CHECK(std::isfinite(rel_rms(x.o, ref.o)));
      }
    }
}

}  // namespace

TEST_CASE("simd recurrent forward matches the reference recurrence in double") {
  check_double(cpu::simd<>{}, "simd");
  check_double(cpu::threads<>(2), "threads(2)");
  check_double(cpu::threads<>(5), "threads(5)");  // more threads than tasks
  check_double(cpu::threads<>(1), "threads(1)");
  check_double(cpu::threads<xsimd::avx2>(2), "threads<avx2>");
  check_double(cpu::simd<xsimd::sse2>{}, "simd<sse2>");
}

TEST_CASE("simd recurrent forward in float against a double reference") {
  shape_case const cases[] = {
      {{.T = 3000, .K = 128, .V = 128, .gate = gate_kind::lower_bound, .seed = 320}, decay::fixture},
      {{.T = 2000, .K = 64, .V = 32, .seed = 321}, decay::strong},
      {{.T = 1000, .H = 1, .HV = 2, .K = 64, .V = 64, .gate = gate_kind::resets, .seed = 322}, decay::fixture},
  };
  for (auto const& sc : cases) {
    kda_data64 d = make_data(sc.c);
    set_decay(d, sc.dk, sc.c.seed + 7);
    d = rounded<float>(d);
    typed_data<double> ref64(d);
    typed_data<float> f32(d);
    auto r = run_forward(ref64, kda::algorithm::recurrent);
    auto x = run_forward(f32, kda::algorithm::recurrent, cpu::threads<>(2));
    auto s = run_forward(f32, kda::algorithm::recurrent);  // the float reference step
    INFO("T=" << sc.c.T << " decay " << int(sc.dk) << " o " << rel_rms(x.o, r.o) << " ht " << rel_rms(x.ht, r.ht) << " (reference step in float: o "
              << rel_rms(s.o, r.o) << ")");
    CHECK(rel_rms(x.o, r.o) <= 1e-5);
    CHECK(rel_rms(x.ht, r.ht) <= 1e-5);
    // no worse than the direct recurrence in float, within a small factor
    CHECK(rel_rms(x.o, r.o) <= 4 * rel_rms(s.o, r.o) + 1e-7);
  }
}

TEST_CASE("simd recurrent forward: a NaN stays in its head, outputs before it are unchanged") {
  kda_case c{.B = 1, .T = 200, .H = 2, .HV = 4, .K = 32, .V = 32, .cu = {0, 0, 90, 200}, .seed = 330};
  kda_data64 clean = make_data(c);
  for (int where : {0, 1, 2}) {  // NaN in g, in k, in v
    kda_data64 dirty = clean;
    index_t const t = 120, hv = 3, h = hv / 2;
    if (where == 0) dirty.g[std::size_t((t * c.HV + hv) * c.K + 5)] = NAN;
    if (where == 1) dirty.k[std::size_t((t * c.H + h) * c.K + 5)] = NAN;
    if (where == 2) dirty.v[std::size_t((t * c.HV + hv) * c.V + 5)] = NAN;
    for (bool dbl : {true, false}) {
      fwd_result fc, fd;
      if (dbl) {
        fc = run_forward(typed_data<double>(clean), kda::algorithm::recurrent, cpu::threads<>(2));
        fd = run_forward(typed_data<double>(dirty), kda::algorithm::recurrent, cpu::threads<>(2));
      } else {
        fc = run_forward(typed_data<float>(clean), kda::algorithm::recurrent, cpu::threads<>(2));
        fd = run_forward(typed_data<float>(dirty), kda::algorithm::recurrent, cpu::threads<>(2));
      }
      bool nan_seen = false;
      for (index_t s = 0; s < c.T; ++s)
        for (index_t j = 0; j < c.HV; ++j) {
          // a NaN in k reaches both value heads of its q/k head
          bool const hit = s >= t && (j == hv || (where == 1 && j / 2 == h));
          for (index_t e = 0; e < c.V; ++e) {
            std::size_t const i = std::size_t((s * c.HV + j) * c.V + e);
            INFO("where " << where << " double " << dbl << " t " << s << " hv " << j);
            if (hit)
              nan_seen |= std::isnan(fd.o[i]);
            else
              REQUIRE(fd.o[i] == fc.o[i]);
          }
        }
      CHECK(nan_seen);
      index_t const per = c.HV * c.K * c.V;
      for (index_t i = 0; i < 2 * per; ++i) REQUIRE(fd.ht[std::size_t(i)] == fc.ht[std::size_t(i)]);  // sequences 0 (empty) and 1
    }
  }
}

TEST_CASE("simd recurrent forward is exactly causal") {
  kda_case c{.T = 150, .H = 1, .HV = 2, .K = 48, .V = 64, .seed = 340};
  kda_data64 a = make_data(c);
  set_decay(a, decay::strong, 341);
  kda_data64 b = a;
  index_t const t = 77;  // inside a buffer of tokens; later tokens all changed
  for (index_t s = t; s < c.T; ++s) {
    for (index_t i = 0; i < c.HV * c.K; ++i) b.g[std::size_t(s * c.HV * c.K + i)] = -0.01 * double(i % 3);
    for (index_t i = 0; i < c.HV * c.V; ++i) b.v[std::size_t(s * c.HV * c.V + i)] += 1;
  }
  auto ra = run_forward(typed_data<float>(a), kda::algorithm::recurrent, cpu::simd<>{});
  auto rb = run_forward(typed_data<float>(b), kda::algorithm::recurrent, cpu::simd<>{});
  for (std::size_t i = 0; i < std::size_t(t * c.HV * c.V); ++i) REQUIRE(ra.o[i] == rb.o[i]);
  CHECK(ra.o[std::size_t(t * c.HV * c.V)] != rb.o[std::size_t(t * c.HV * c.V)]);
}

// The rescaled state S~ = S / A may be 2^40 (float; 2^80 in double) times larger than S: a
// state far from overflow (|S| ~ 1e28 in float, ~1e286 in double) under strong decays
// (g = -2 per token and channel: a block reaches A = 2^-40 after 14 tokens) used to overflow
// in S~ while the direct recurrence stays finite. Also a large h0 alone, and a state that is
// large only in the middle of the sequence (a burst of large values, then ordinary ones).
TEST_CASE("simd recurrent forward: a large state under strong decays does not overflow the rescaled state") {
  auto rel_max = [](std::vector<double> const& ref, std::vector<double> const& x) {
    double m = 0, e = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      m = std::max(m, std::abs(ref[i]));
      double const d = std::abs(x[i] - ref[i]);
      e = std::isnan(d) ? INFINITY : std::max(e, d);
    }
    return e / m;
  };
  auto all_finite = [](std::vector<double> const& x) {
    for (double e : x)
      if (!std::isfinite(e)) return false;
    return true;
  };
  for (bool dbl : {false, true})
    for (int kind = 0; kind < 3; ++kind) {  // large v and h0; large h0 only; a burst of large v
      kda_case c{.T = 150, .H = 1, .HV = 2, .K = 32, .V = 32, .seed = 350};
      kda_data64 d = make_data(c);
      double const big = dbl ? 1e286 : 1e28;
      for (auto& x : d.g) x = -2;
      if (kind != 1)
        for (index_t t = 0; t < c.T; ++t)
          if (kind == 0 || (t >= 40 && t < 60))
            for (index_t i = 0; i < c.HV * c.V; ++i) d.v[std::size_t(t * c.HV * c.V + i)] *= big;
      if (kind != 2)
        for (auto& x : d.h0) x *= big;
      auto check = [&](auto tag) {
        using T = decltype(tag);
        typed_data<T> td(d);
        auto ref = run_forward(td, kda::algorithm::recurrent);  // cpu::serial
        REQUIRE(all_finite(ref.o));
        REQUIRE(all_finite(ref.ht));
        double const tol = sizeof(T) == 8 ? 1e-12 : 1e-5;
        for (int b = 0; b < 2; ++b) {
          auto x = b == 0 ? run_forward(td, kda::algorithm::recurrent, cpu::simd<>{}) : run_forward(td, kda::algorithm::recurrent, cpu::threads<>(2));
          INFO("double " << dbl << " kind " << kind << " backend " << b << " o " << rel_max(ref.o, x.o) << " ht " << rel_max(ref.ht, x.ht));
          CHECK(rel_max(ref.o, x.o) <= tol);
          CHECK(rel_max(ref.ht, x.ht) <= tol);
        }
      };
      if (dbl)
        check(double{});
      else
        check(float{});
    }
}
