// The decode step's vectorised path (cpu::simd, cpu::threads) against an independent float64
// step and against the serial backend: column counts that are not a multiple of the SIMD
// width (tail columns), more columns than one register block, odd K, a single head, grouped
// value heads, padded state rows, more threads than (sequence, head) pairs, an empty batch,
// several steps in a row, bfloat16 inputs, NaN confinement and untouched pool slots.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "k3/kda.hpp"
#include "support/metrics.hpp"

using namespace k3;
using namespace k3::test;

namespace {

// What o holds before a decode step: padding entries keep it.
constexpr double untouched_o = 7.0;

struct shape {
  index_t N, H, HV, K, V, P;
  index_t Vpad = 0;  // row stride of the pool's states (>= V); 0 means V
};

// One decode problem in float64: inputs, slots and the pool.
struct problem64 {
  shape s;
  std::vector<double> q, k, v, g, beta, pool;
  std::vector<std::int64_t> slots;
  double scale;
  index_t rs() const { return s.Vpad ? s.Vpad : s.V; }
  problem64(shape s_, unsigned seed) : s(s_) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> nd;
    std::uniform_real_distribution<double> ud(0.0, 1.0);
    auto fill = [&](std::vector<double>& x, std::size_t n, double sc) {
      x.resize(n);
      for (auto& y : x) y = sc * nd(rng);
    };
    fill(q, std::size_t(s.N * s.H * s.K), 1.0 / std::sqrt(double(std::max<index_t>(s.K, 1))));
    fill(k, q.size(), 1.0 / std::sqrt(double(std::max<index_t>(s.K, 1))));
    fill(v, std::size_t(s.N * s.HV * s.V), 1.0);
    g.resize(std::size_t(s.N * s.HV * s.K));
    for (auto& x : g) x = -0.5 * ud(rng);
    beta.resize(std::size_t(s.N * s.HV));
    for (auto& x : beta) x = ud(rng);
    fill(pool, std::size_t(s.P * s.HV * s.K * rs()), 0.5);
    slots.resize(std::size_t(s.P));
    std::iota(slots.begin(), slots.end(), std::int64_t(0));
    std::shuffle(slots.begin(), slots.end(), rng);
    slots.resize(std::size_t(s.N));
    scale = 1.0 / std::sqrt(double(std::max<index_t>(s.K, 1)));
  }

  // The step written out from the definition, in float64, on a copy of the pool.
  void reference(std::vector<double>& pool_out, std::vector<double>& o) const {
    pool_out = pool;
    o.assign(std::size_t(s.N * s.HV * s.V), untouched_o);
    index_t const K = s.K, V = s.V, R = rs();
    for (index_t n = 0; n < s.N; ++n)
      for (index_t hv = 0; hv < s.HV && slots[std::size_t(n)] >= 0; ++hv) {  // a negative slot: padding, skipped
        index_t const h = hv / (s.HV / s.H);
        double* S = pool_out.data() + (slots[std::size_t(n)] * s.HV + hv) * K * R;
        double const* qn = q.data() + (n * s.H + h) * K;
        double const* kn = k.data() + (n * s.H + h) * K;
        double const* gn = g.data() + (n * s.HV + hv) * K;
        double const* vn = v.data() + (n * s.HV + hv) * V;
        double const b = beta[std::size_t(n * s.HV + hv)];
        for (index_t d = 0; d < K; ++d)
          for (index_t e = 0; e < V; ++e) S[d * R + e] *= std::exp(gn[d]);
        for (index_t e = 0; e < V; ++e) {
          double pred = 0;
          for (index_t d = 0; d < K; ++d) pred += kn[d] * S[d * R + e];
          double const u = b * (vn[e] - pred);
          double oe = 0;
          for (index_t d = 0; d < K; ++d) {
            S[d * R + e] += kn[d] * u;
            oe += scale * qn[d] * S[d * R + e];
          }
          o[std::size_t((n * s.HV + hv) * V + e)] = oe;
        }
      }
  }
};

template <class T>
std::vector<T> cast(std::vector<double> const& x) {
  std::vector<T> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = store_as<T>(x[i]);
  return y;
}
template <class T>
std::vector<double> widen(std::vector<T> const& x) {
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = load_as<double>(x[i]);
  return y;
}

// Runs `steps` decode steps with storage In and state S on backend `be`, the same inputs each
// step; returns the pool and the last o, widened.
template <class In, class S, class Backend>
void run_decode(problem64 const& pr, Backend const& be, int steps, std::vector<double>& pool_out, std::vector<double>& o_out,
                bool slots32 = false) {
  auto const& s = pr.s;
  std::vector<In> q = cast<In>(pr.q), k = cast<In>(pr.k), v = cast<In>(pr.v), g = cast<In>(pr.g), beta = cast<In>(pr.beta);
  std::vector<In> o(std::size_t(s.N * s.HV * s.V), store_as<In>(untouched_o));
  std::vector<S> pool = cast<S>(pr.pool);
  std::vector<std::int32_t> s32(pr.slots.begin(), pr.slots.end());
  kda::decode_args<In, S> a;
  a.q = host_view(static_cast<In const*>(q.data()), s.N, s.H, s.K);
  a.k = host_view(static_cast<In const*>(k.data()), s.N, s.H, s.K);
  a.v = host_view(static_cast<In const*>(v.data()), s.N, s.HV, s.V);
  a.g = host_view(static_cast<In const*>(g.data()), s.N, s.HV, s.K);
  a.beta = host_view(static_cast<In const*>(beta.data()), s.N, s.HV);
  a.o = host_view(o.data(), s.N, s.HV, s.V);
  a.state_pool = host_view(pool.data(), s.P, s.HV, s.K, pr.rs()).sub(3, 0, s.V);
  if (slots32)
    a.slots32 = host_view(static_cast<std::int32_t const*>(s32.data()), s.N);
  else
    a.slots64 = host_view(static_cast<std::int64_t const*>(pr.slots.data()), s.N);
  kda::options opt;
  opt.scale = pr.scale;
  for (int t = 0; t < steps; ++t) kda::decode(be, a, opt);
  pool_out = widen(pool);
  o_out = widen(o);
}

// Elements of the pool outside the states that `slots` address (other slots, row padding).
std::vector<double> untouched(problem64 const& pr, std::vector<double> const& pool) {
  auto const& s = pr.s;
  std::vector<char> used(std::size_t(s.P), 0);
  for (auto sl : pr.slots)
    if (sl >= 0) used[std::size_t(sl)] = 1;
  std::vector<double> r;
  index_t const per = s.HV * s.K * pr.rs();
  for (index_t p = 0; p < s.P; ++p)
    for (index_t i = 0; i < per; ++i)
      if (!used[std::size_t(p)] || i % pr.rs() >= s.V) r.push_back(pool[std::size_t(p * per + i)]);
  return r;
}

std::vector<shape> edge_shapes() {
  return {
      {3, 2, 4, 128, 128, 5},          // the benchmark's head shape, grouped value heads
      {2, 1, 2, 20, 40, 3},            // V = 2.5 AVX-512 float batches
      {1, 1, 1, 7, 5, 2},              // V below one batch: tail columns only
      {2, 1, 1, 16, 17, 2},            // one batch plus one tail column
      {2, 2, 2, 33, 200, 4},           // V beyond one register block: 128 + 64 + 8 tail (float)
      {1, 1, 1, 1, 1, 1},              // K = V = 1
      {2, 1, 3, 9, 136, 3},            // 8 batches + 1 batch (float); odd K; 3 value heads per q head
      {2, 1, 1, 12, 24, 3, 40},        // padded state rows: row stride 40 > V
      {1, 1, 1, 128, 128, 1},          // one pair: more threads than pairs
  };
}

}  // namespace

TEST_CASE_TEMPLATE("decode: vectorised backends match the float64 step and the serial backend", S, double, float) {
  double const tol = std::is_same_v<S, double> ? 1e-13 : 2e-6;
  for (shape const& sh : edge_shapes()) {
    problem64 pr(sh, unsigned(sh.K * 1000 + sh.V * 10 + sh.HV));
    std::vector<double> ref_pool, ref_o;
    pr.reference(ref_pool, ref_o);
    std::vector<double> ser_pool, ser_o;
    run_decode<S, S>(pr, cpu::serial{}, 1, ser_pool, ser_o);
    auto check = [&](char const* name, std::vector<double> const& pool, std::vector<double> const& o) {
      INFO("backend " << name << ", N " << sh.N << " H " << sh.H << " HV " << sh.HV << " K " << sh.K << " V " << sh.V << " row stride "
                      << pr.rs());
      CHECK(rel_rms(o, ref_o) < tol);
      CHECK(rel_rms(pool, ref_pool) < tol);
      CHECK(rel_rms(o, ser_o) < tol);
      // slots not addressed and the padding of rows are not touched, bit for bit
      std::vector<double> const before = untouched(pr, widen(cast<S>(pr.pool)));
      CHECK(untouched(pr, pool) == before);
    };
    check("serial", ser_pool, ser_o);
    std::vector<double> pool, o;
    run_decode<S, S>(pr, cpu::simd<>{}, 1, pool, o);
    check("simd", pool, o);
    for (int th : {1, 2, 3, 8}) {
      run_decode<S, S>(pr, cpu::threads<>(th), 1, pool, o, th % 2 == 1);
      check(("threads " + std::to_string(th)).c_str(), pool, o);
    }
    // Narrower ISAs than the build's default: 4-batch register blocks, other tail widths.
#if XSIMD_WITH_AVX2
    run_decode<S, S>(pr, cpu::threads<xsimd::avx2>(2), 1, pool, o);
    check("threads<avx2>", pool, o);
#endif
#if XSIMD_WITH_SSE2
    run_decode<S, S>(pr, cpu::simd<xsimd::sse2>{}, 1, pool, o);
    check("simd<sse2>", pool, o);
#endif
  }
}

// The vectorised path decodes decode_streams (4) (sequence, head) pairs together and prefetches
// the next group's states meanwhile. cpu::simd splits the pairs into 4 ranges, so a range holds
// a full group only from 16 pairs on: the shapes above (at most 12 pairs) never form one. Here
// the grouped path (cpu::simd) is checked against the float64 step and against ranges of one
// pair each (cpu::threads with as many threads as pairs). Per state the arithmetic is the same
// in both; it is compared with a tolerance, not bit for bit, because xsimd's fma is x * y + z
// on avx2 and avx512f (no fma3 arch), and g++ contracts that differently depending on where it
// is inlined (g++ 12 with xsimd::avx2 rounds some elements of the two paths differently).
TEST_CASE_TEMPLATE("decode: pairs decoded in groups match single pairs and the float64 step", S, double, float) {
  double const tol = std::is_same_v<S, double> ? 1e-13 : 2e-6;
  double const same_tol = std::is_same_v<S, double> ? 1e-15 : 1e-7;
  // pairs per simd range: 4 (one group); 9 (two groups, one single); 5, 6 (one group, then
  // singles); V = 200 is a 128-column block, a 64-column block and a tail; row stride 40 > V
  for (shape const& sh : {shape{4, 2, 4, 128, 128, 5}, shape{12, 1, 3, 9, 136, 13}, shape{10, 1, 2, 33, 200, 11},
                          shape{8, 1, 3, 12, 24, 9, 40}}) {
    problem64 pr(sh, 7);
    std::vector<double> ref_pool, ref_o;
    pr.reference(ref_pool, ref_o);
    int const pairs = int(sh.N * sh.HV);
    auto check = [&](auto arch, std::string const& name) {
      using A = decltype(arch);
      INFO("arch " << name << ", N " << sh.N << " HV " << sh.HV << " K " << sh.K << " V " << sh.V << " row stride " << pr.rs());
      std::vector<double> gp, go, sp, so;
      run_decode<S, S>(pr, cpu::simd<A>{}, 1, gp, go);
      run_decode<S, S>(pr, cpu::threads<A>(pairs), 1, sp, so);
      CHECK(rel_rms(gp, ref_pool) < tol);
      CHECK(rel_rms(go, ref_o) < tol);
      CHECK(rel_rms(gp, sp) < same_tol);
      CHECK(rel_rms(go, so) < same_tol);
      CHECK(untouched(pr, gp) == untouched(pr, widen(cast<S>(pr.pool))));
    };
    check(xsimd::default_arch{}, "default");
#if XSIMD_WITH_AVX2
    check(xsimd::avx2{}, "avx2");
#endif
#if XSIMD_WITH_SSE2
    check(xsimd::sse2{}, "sse2");
#endif
  }
}

TEST_CASE("decode: several steps in a row agree with the serial backend") {
  for (shape const& sh : {shape{4, 2, 4, 64, 72, 6}, shape{3, 1, 1, 128, 128, 3}}) {
    problem64 pr(sh, 11);
    std::vector<double> sp, so, tp, to;
    run_decode<float, float>(pr, cpu::serial{}, 6, sp, so);
    run_decode<float, float>(pr, cpu::threads<>(3), 6, tp, to);
    CHECK(rel_rms(tp, sp) < 1e-5);
    CHECK(rel_rms(to, so) < 1e-5);
    run_decode<double, double>(pr, cpu::serial{}, 6, sp, so);
    run_decode<double, double>(pr, cpu::threads<>(2), 6, tp, to);
    CHECK(rel_rms(tp, sp) < 1e-13);
    CHECK(rel_rms(to, so) < 1e-13);
  }
}

TEST_CASE("decode: bfloat16 inputs and outputs, fp32 state") {
  for (shape const& sh : {shape{3, 2, 4, 128, 128, 5}, shape{2, 1, 2, 20, 40, 3}, shape{2, 1, 1, 16, 17, 2}}) {
    problem64 pr(sh, 21);
    std::vector<double> sp, so, tp, to;
    run_decode<bfloat16, float>(pr, cpu::serial{}, 1, sp, so);
    run_decode<bfloat16, float>(pr, cpu::threads<>(2), 1, tp, to);
    // Same bf16 inputs, fp32 arithmetic in both: the states agree to fp32 rounding; o is
    // rounded to bf16 in both, so an element may differ by one bf16 step.
    CHECK(rel_rms(tp, sp) < 1e-5);
    CHECK(rel_rms(to, so) < 8e-3);
    // And both are close to the float64 step on the bf16-rounded inputs.
    problem64 rounded = pr;
    for (auto* x : {&rounded.q, &rounded.k, &rounded.v, &rounded.g, &rounded.beta}) *x = widen(cast<bfloat16>(*x));
    std::vector<double> rp, ro;
    rounded.reference(rp, ro);
    CHECK(rel_rms(tp, rp) < 1e-5);
    CHECK(rel_rms(to, ro) < 5e-3);
  }
}

TEST_CASE("decode: negative slots are padding on every backend: skipped, o and the pool untouched") {
  for (shape const& sh : {shape{6, 2, 4, 33, 40, 7}, shape{9, 1, 1, 16, 17, 9}, shape{3, 1, 2, 8, 8, 3}}) {
    for (unsigned pattern : {0b000001u, 0b100000u, 0b010110u, 0b111111u, 0b101010101u}) {
      problem64 pr(sh, 17u + pattern);
      for (index_t n = 0; n < sh.N; ++n)
        if ((pattern >> n) & 1u) pr.slots[std::size_t(n)] = n % 2 ? -1 : -7;
      std::vector<double> ref_pool, ref_o;
      pr.reference(ref_pool, ref_o);
      auto check = [&](char const* name, std::vector<double> const& pool, std::vector<double> const& o) {
        INFO("backend " << name << ", N " << sh.N << ", padding pattern " << pattern);
        CHECK(rel_rms(o, ref_o) < 2e-6);
        CHECK(rel_rms(pool, ref_pool) < 2e-6);
        for (index_t n = 0; n < sh.N; ++n)
          if (pr.slots[std::size_t(n)] < 0)
            for (index_t i = 0; i < sh.HV * sh.V; ++i) REQUIRE(o[std::size_t(n * sh.HV * sh.V + i)] == untouched_o);
        CHECK(untouched(pr, pool) == untouched(pr, widen(cast<float>(pr.pool))));
      };
      std::vector<double> pool, o;
      run_decode<float, float>(pr, cpu::serial{}, 1, pool, o);
      check("serial", pool, o);
      run_decode<float, float>(pr, cpu::simd<>{}, 1, pool, o, true);
      check("simd", pool, o);
      run_decode<float, float>(pr, cpu::threads<>(3), 1, pool, o);
      check("threads 3", pool, o);
    }
  }
}

TEST_CASE("decode: an empty batch does nothing") {
  shape const sh{0, 2, 4, 16, 32, 3};
  problem64 pr(sh, 31);
  for (int th : {1, 2, 4}) {
    std::vector<double> pool, o;
    run_decode<float, float>(pr, cpu::threads<>(th), 1, pool, o);
    CHECK(pool == widen(cast<float>(pr.pool)));
    CHECK(o.empty());
  }
  std::vector<double> pool, o;
  run_decode<float, float>(pr, cpu::simd<>{}, 1, pool, o);
  CHECK(pool == widen(cast<float>(pr.pool)));
}

TEST_CASE("decode: a NaN in one state stays in that (sequence, head)") {
  shape const sh{3, 1, 2, 24, 40, 4};
  problem64 pr(sh, 41);
  index_t const per = sh.K * sh.V;
  index_t const bad_n = 1, bad_hv = 1;
  pr.pool[std::size_t((pr.slots[bad_n] * sh.HV + bad_hv) * per + 5 * sh.V + 3)] = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> pool, o;
  run_decode<float, float>(pr, cpu::threads<>(2), 1, pool, o);
  for (index_t n = 0; n < sh.N; ++n)
    for (index_t hv = 0; hv < sh.HV; ++hv) {
      bool const bad = n == bad_n && hv == bad_hv;
      bool any_nan = false;
      for (index_t e = 0; e < sh.V; ++e) any_nan |= std::isnan(o[std::size_t((n * sh.HV + hv) * sh.V + e)]);
      for (index_t i = 0; i < per; ++i) any_nan |= std::isnan(pool[std::size_t((pr.slots[std::size_t(n)] * sh.HV + hv) * per + i)]);
      CHECK(any_nan == bad);
    }
}

TEST_CASE("decode: o aliasing the pool is refused by every backend") {
  index_t const N = 1, H = 1, HV = 1, K = 4, V = 16, P = 2;
  std::vector<float> q(std::size_t(K), 0.1f), k(q), v(std::size_t(V), 1.f), g(std::size_t(K), -0.1f), beta(1, 0.5f),
      pool(std::size_t(P * K * V));
  std::vector<std::int64_t> slots{1};
  kda::decode_args<float> a;
  a.q = host_view(static_cast<float const*>(q.data()), N, H, K);
  a.k = host_view(static_cast<float const*>(k.data()), N, H, K);
  a.v = host_view(static_cast<float const*>(v.data()), N, HV, V);
  a.g = host_view(static_cast<float const*>(g.data()), N, HV, K);
  a.beta = host_view(static_cast<float const*>(beta.data()), N, HV);
  a.o = host_view(pool.data() + 8, N, HV, V);
  a.state_pool = host_view(pool.data(), P, HV, K, V);
  a.slots64 = host_view(static_cast<std::int64_t const*>(slots.data()), N);
  auto msg = [&](auto const& be) {
    try {
      kda::decode(be, a);
    } catch (k3::error const& e) {
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  for (std::string const& m : {msg(cpu::serial{}), msg(cpu::simd<>{}), msg(cpu::threads<>(2))}) {
    CHECK(m.find("'o'") != std::string::npos);
    CHECK(m.find("state_pool") != std::string::npos);
  }
}
