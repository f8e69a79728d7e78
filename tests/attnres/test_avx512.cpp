// The AVX-512 two-phase kernels (k3/attnres/arch/avx512.hpp) at their edges: d not a multiple of
// 16/32 or of the score kernel's d tile, site and source counts not multiples of the register
// tiles, more than 8 sources, T = 1, more threads than tokens, streaming stores (aligned and
// unaligned rows), subnormal results, special values. Each is checked against a float64
// reference or, where the rounding must be exact, bit for bit. On a machine without AVX-512
// the same tests run the portable kernels.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attnres/reference.hpp"
#include "k3/attnres.hpp"

namespace ar = k3::attnres;
using k3::bfloat16;
using k3::index_t;

namespace {

double widen(bfloat16 x) { return double(float(x)); }
double widen(float x) { return double(x); }

std::uint16_t bits(bfloat16 x) { return x.bits; }

// float64 phase 1 of one token and site: logits, softmax, normalised mix and lse.
struct p1_ref {
  std::vector<double> o;
  double lse;
};
p1_ref phase1_ref(std::vector<bfloat16> const& bank, std::vector<float> const& rinv, std::vector<float> const& u, index_t n, index_t T,
                  index_t d, index_t l, index_t t) {
  std::vector<double> s(static_cast<std::size_t>(n));
  double mx = -std::numeric_limits<double>::infinity();
  for (index_t j = 0; j < n; ++j) {
    double c = 0;
    for (index_t k = 0; k < d; ++k) c += double(u[std::size_t(l * d + k)]) * widen(bank[std::size_t((j * T + t) * d + k)]);
    s[std::size_t(j)] = double(rinv[std::size_t(j * T + t)]) * c;
    mx = std::max(mx, s[std::size_t(j)]);
  }
  double z = 0;
  for (auto& x : s) z += (x = std::exp(x - mx));
  p1_ref r{std::vector<double>(std::size_t(d), 0.0), mx + std::log(z)};
  for (index_t j = 0; j < n; ++j)
    for (index_t k = 0; k < d; ++k) r.o[std::size_t(k)] += s[std::size_t(j)] / z * widen(bank[std::size_t((j * T + t) * d + k)]);
  return r;
}

struct p1_case {
  index_t n, nq, T, d;
};

template <class B>
void check_phase1(B const& b, p1_case c, std::uint64_t seed, double tiny_token_scale = 0, ar::two_phase_options const& opt = {}) {
  auto [n, nq, T, d] = c;
  attnres_ref::rng r(seed);
  k3::tensor<bfloat16, 3> bank({n, T, d});
  for (index_t j = 0; j < n; ++j) {
    double const sc = std::exp(r.uniform(-1, 1));
    for (index_t t = 0; t < T; ++t)
      for (index_t k = 0; k < d; ++k) {
        // the last token optionally tiny, so that its mix is subnormal
        double const x = sc * r.normal() * (tiny_token_scale != 0 && t == T - 1 ? tiny_token_scale : 1.0);
        bank.data()[(j * T + t) * d + k] = bfloat16(float(x));
      }
  }
  std::vector<bfloat16> bankv(bank.data(), bank.data() + n * T * d);
  std::vector<float> u = r.normals<float>(std::size_t(nq * d), 4.0 / std::sqrt(double(d)));
  std::vector<float> rinv(std::size_t(n * T));
  for (index_t j = 0; j < n; ++j)
    ar::block_rinv(b, ar::block_rinv_args<bfloat16>{.block = bank.view().slice(0, j), .rinv = k3::host_view(rinv.data() + j * T, T)});
  k3::tensor<float, 3> of({nq, T, d});
  k3::tensor<bfloat16, 3> ob({nq, T, d});
  std::vector<float> lf(std::size_t(nq * T)), lb(lf.size());
  auto bv = k3::tensor_view<bfloat16 const, 3>(bank.view());
  auto rv = k3::tensor_view<float const, 2>(rinv.data(), {n, T});
  auto uv = k3::tensor_view<float const, 2>(u.data(), {nq, d});
  ar::phase1(b, ar::phase1_args<bfloat16, float>{.bank = bv, .bank_rinv = rv, .u = uv, .o = of.view(), .lse = k3::host_view(lf.data(), nq, T)}, opt);
  ar::phase1(b, ar::phase1_args<bfloat16>{.bank = bv, .bank_rinv = rv, .u = uv, .o = ob.view(), .lse = k3::host_view(lb.data(), nq, T)}, opt);
  double err = 0, lerr = 0;
  bool same_bits = true, same_lse = true;
  index_t subnormal = 0;
  for (index_t l = 0; l < nq; ++l)
    for (index_t t = 0; t < T; ++t) {
      auto ref = phase1_ref(bankv, rinv, u, n, T, d, l, t);
      std::vector<double> got(static_cast<std::size_t>(d));
      for (index_t k = 0; k < d; ++k) {
        float const x = of.data()[(l * T + t) * d + k];
        got[std::size_t(k)] = x;
        subnormal += std::fpclassify(x) == FP_SUBNORMAL;
        bfloat16 rounded;
        ar::detail::put(rounded, x);
        same_bits &= bits(rounded) == bits(ob.data()[(l * T + t) * d + k]);
      }
      err = std::max(err, attnres_ref::rel_err(got, ref.o));
      lerr = std::max(lerr, std::abs(double(lf[std::size_t(l * T + t)]) - ref.lse) / (1 + std::abs(ref.lse)));
      same_lse &= lf[std::size_t(l * T + t)] == lb[std::size_t(l * T + t)];
    }
  // Float arithmetic over d up to 7168 and up to 16 sources, logits up to ~10: the AVX-512
  // kernels measured up to 1.1e-6 here (float lanes per 512-column tile, summed in double),
  // the portable kernels (float lanes over the whole row) up to 3.3e-6. A subnormal float mix
  // has fewer significant bits: then only the rounding relation below counts.
  CHECK(err <= (tiny_token_scale != 0 ? 1e-4 : (ar::kernel::two_phase_kernels<xsimd::default_arch>::available ? 2e-6 : 5e-6)));
  CHECK(lerr <= (ar::kernel::two_phase_kernels<xsimd::default_arch>::available ? 1e-6 : 5e-6));
  CHECK(same_bits);  // bf16 o is the float o rounded as k3::bfloat16 rounds, subnormals included
  CHECK(same_lse);
  if (tiny_token_scale != 0) CHECK(subnormal > 0);
}

}  // namespace

TEST_CASE("phase 1 kernels: awkward d, site and source counts against float64, bf16 o is the float o rounded") {
  constexpr bool fast = ar::kernel::two_phase_kernels<xsimd::default_arch>::available;
  std::string const kernels = fast ? "AVX-512 kernels" : "portable kernels (no AVX-512 in this build)";
  MESSAGE(kernels);
  std::uint64_t seed = 100;
  for (p1_case c : {p1_case{1, 1, 1, 1}, p1_case{3, 5, 2, 15}, p1_case{4, 6, 1, 16}, p1_case{5, 7, 3, 17}, p1_case{8, 24, 2, 33},
                    p1_case{9, 13, 2, 100}, p1_case{12, 25, 1, 513}, p1_case{8, 24, 1, 1040}, p1_case{7, 11, 2, 1031},
                    p1_case{2, 3, 1, 7168}, p1_case{16, 2, 2, 48}}) {
    CAPTURE(c.n);
    CAPTURE(c.nq);
    CAPTURE(c.T);
    CAPTURE(c.d);
    check_phase1(k3::cpu::threads<>(2), c, seed++);
    check_phase1(k3::cpu::threads<>(4), c, seed++);  // more threads than tokens
    check_phase1(k3::cpu::simd<>{}, c, seed++);
  }
}

TEST_CASE("phase 1 kernels: subnormal mixes round exactly, streaming stores on aligned and unaligned rows") {
  check_phase1(k3::cpu::threads<>(2), p1_case{8, 24, 3, 64}, 7, 1e-39);
  check_phase1(k3::cpu::threads<>(2), p1_case{5, 7, 2, 37}, 8, 1e-40);
  ar::two_phase_options const streamed{.tuning = {.stream_threshold_bytes = 0}};
  check_phase1(k3::cpu::threads<>(2), p1_case{8, 24, 3, 64}, 9, 0, streamed);   // every row 64-byte aligned
  check_phase1(k3::cpu::threads<>(2), p1_case{8, 24, 3, 77}, 10, 0, streamed);  // rows at odd offsets
  check_phase1(k3::cpu::threads<>(2), p1_case{3, 5, 4, 32}, 11, 1e-39, streamed);
}

TEST_CASE("phase 1 kernels: a NaN in one bf16 token stays in that token") {
  index_t const n = 8, nq = 7, T = 5, d = 70;
  attnres_ref::rng r(21);
  k3::tensor<bfloat16, 3> bank({n, T, d});
  for (index_t i = 0; i < n * T * d; ++i) bank.data()[i] = bfloat16(float(r.normal()));
  bank.data()[(5 * T + 2) * d + 69] = bfloat16(std::numeric_limits<float>::quiet_NaN());  // token 2, last column
  std::vector<float> rinv(std::size_t(n * T)), u = r.normals<float>(std::size_t(nq * d)), lse(std::size_t(nq * T));
  k3::cpu::threads<> b(2);
  for (index_t j = 0; j < n; ++j)
    ar::block_rinv(b, ar::block_rinv_args<bfloat16>{.block = bank.view().slice(0, j), .rinv = k3::host_view(rinv.data() + j * T, T)});
  k3::tensor<bfloat16, 3> o({nq, T, d});
  ar::phase1(b, ar::phase1_args<bfloat16>{.bank = bank.view(),
                                          .bank_rinv = k3::tensor_view<float const, 2>(rinv.data(), {n, T}),
                                          .u = k3::tensor_view<float const, 2>(u.data(), {nq, d}),
                                          .o = o.view(),
                                          .lse = k3::host_view(lse.data(), nq, T)});
  for (index_t l = 0; l < nq; ++l)
    for (index_t t = 0; t < T; ++t) {
      bool all_nan = true, all_finite = true;
      for (index_t k = 0; k < d; ++k) {
        float const x = float(o.data()[(l * T + t) * d + k]);
        all_nan &= std::isnan(x);
        all_finite &= std::isfinite(x);
      }
      CHECK((t == 2 ? all_nan : all_finite));
      CHECK(std::isnan(lse[std::size_t(l * T + t)]) == (t == 2));
    }
}

namespace {

// phase2_add against float64: the prefix update bit for bit (k3::bfloat16 rounding of the
// float sum), h against o + p (b - o) with p = sigmoid(r_b (u . b) - lse) in double.
template <class D, class O, class H, class B>
void check_phase2_add(B const& b, index_t T, index_t d, std::uint64_t seed, ar::two_phase_options const& opt = {}) {
  attnres_ref::rng r(seed);
  k3::tensor<bfloat16, 2> prefix({T, d});
  k3::tensor<D, 2> delta({T, d});
  k3::tensor<O, 2> o({T, d});
  k3::tensor<H, 2> h({T, d});
  for (index_t i = 0; i < T * d; ++i) {
    prefix.data()[i] = bfloat16(float(2 * r.normal()));
    delta.data()[i] = D(float(0.5 * r.normal()));
    o.data()[i] = O(float(r.normal()));
  }
  std::vector<float> u = r.normals<float>(std::size_t(d), 3.0 / std::sqrt(double(d))), lse(static_cast<std::size_t>(T));
  for (auto& x : lse) x = float(r.uniform(-2, 2));
  std::vector<bfloat16> pre0(prefix.data(), prefix.data() + T * d);
  ar::phase2_add(b,
                 ar::phase2_add_args<bfloat16, D, O, H>{.o = o.view(),
                                                        .lse = k3::tensor_view<float const, 1>(lse.data(), {T}),
                                                        .prefix = prefix.view(),
                                                        .delta = delta.view(),
                                                        .u = k3::tensor_view<float const, 1>(u.data(), {d}),
                                                        .h = h.view()},
                 opt);
  bool prefix_exact = true;
  double err = 0;
  for (index_t t = 0; t < T; ++t) {
    std::vector<double> bd(static_cast<std::size_t>(d));
    double dot = 0, ss = 0;
    for (index_t k = 0; k < d; ++k) {
      bfloat16 v;
      ar::detail::put(v, float(pre0[std::size_t(t * d + k)]) + float(delta.data()[t * d + k]));
      prefix_exact &= bits(v) == bits(prefix.data()[t * d + k]);
      bd[std::size_t(k)] = widen(v);
      dot += double(u[std::size_t(k)]) * bd[std::size_t(k)];
      ss += bd[std::size_t(k)] * bd[std::size_t(k)];
    }
    double const p = 1 / (1 + std::exp(double(lse[std::size_t(t)]) - dot / std::sqrt(ss / double(d) + 1e-5)));
    for (index_t k = 0; k < d; ++k) {
      double const ok = widen(o.data()[t * d + k]);
      double const ref = ok + p * (bd[std::size_t(k)] - ok);
      double const got = widen(h.data()[t * d + k]);
      // p from float lane sums (about 1e-6 relative in the logit, as in the portable path),
      // float arithmetic, and for bf16 h half an ulp of rounding (at most 2^-8 relative)
      double const tol = 2e-6 * std::abs(bd[std::size_t(k)] - ok) + 1e-6 * (1 + std::abs(ref)) +
                         (std::is_same_v<H, bfloat16> ? std::ldexp(std::abs(ref), -8) : 0.0);
      err = std::max(err, std::abs(got - ref) / tol);
    }
  }
  CHECK(prefix_exact);
  CHECK(err <= 1.0);
}

}  // namespace

TEST_CASE("phase2_add kernels: d around the 32-column chunk, T = 1, float and bf16 operands, streaming") {
  std::uint64_t seed = 300;
  for (index_t d : {index_t(1), index_t(31), index_t(32), index_t(33), index_t(95), index_t(1000), index_t(7168)})
    for (index_t T : {index_t(1), index_t(3)}) {
      CAPTURE(d);
      CAPTURE(T);
      check_phase2_add<bfloat16, bfloat16, bfloat16>(k3::cpu::threads<>(2), T, d, seed++);
      check_phase2_add<float, float, float>(k3::cpu::threads<>(4), T, d, seed++);
      check_phase2_add<bfloat16, float, bfloat16>(k3::cpu::simd<>{}, T, d, seed++);
      check_phase2_add<float, bfloat16, float>(k3::cpu::threads<>(2), T, d, seed++);
    }
  ar::two_phase_options const streamed{.tuning = {.stream_threshold_bytes = 0}};
  for (index_t d : {index_t(64), index_t(7168), index_t(77)}) {
    CAPTURE(d);
    check_phase2_add<bfloat16, bfloat16, bfloat16>(k3::cpu::threads<>(2), 5, d, seed++, streamed);
    check_phase2_add<bfloat16, bfloat16, float>(k3::cpu::threads<>(2), 5, d, seed++, streamed);
  }
}

TEST_CASE("phase2_add kernels: the residual add rounds every bit pattern as k3::bfloat16 does, NaN stays in its token") {
  // prefix and delta over random 16-bit patterns: NaNs (signalling and quiet), infinities,
  // subnormals, zeros of both signs.
  index_t const T = 4, d = 4096 + 17;
  attnres_ref::rng r(77);
  k3::tensor<bfloat16, 2> prefix({T, d}), delta({T, d}), o({T, d}), h({T, d});
  std::vector<float> u(std::size_t(d), 0.01f), lse(static_cast<std::size_t>(T), 0.0f);
  for (index_t i = 0; i < T * d; ++i) {
    prefix.data()[i].bits = std::uint16_t(r.g() & 0xffff);
    delta.data()[i].bits = std::uint16_t(r.g() & 0xffff);
    // half of the pairs subnormal so that their sums are too
    if (i % 2) {
      prefix.data()[i].bits &= 0x807f;
      delta.data()[i].bits &= 0x807f;
    }
    o.data()[i] = bfloat16(1.0f);
  }
  std::vector<bfloat16> pre0(prefix.data(), prefix.data() + T * d);
  k3::cpu::threads<> b(2);
  ar::phase2_add(b, ar::phase2_add_args<bfloat16>{.o = o.view(),
                                                  .lse = k3::tensor_view<float const, 1>(lse.data(), {T}),
                                                  .prefix = prefix.view(),
                                                  .delta = delta.view(),
                                                  .u = k3::tensor_view<float const, 1>(u.data(), {d}),
                                                  .h = h.view()});
  index_t mismatches = 0;
  for (index_t i = 0; i < T * d; ++i) {
    bfloat16 v;
    ar::detail::put(v, float(pre0[std::size_t(i)]) + float(delta.data()[i]));
    mismatches += bits(v) != bits(prefix.data()[i]);
  }
  CHECK(mismatches == 0);

  // NaN confinement: finite data except one NaN in token 1's delta
  for (index_t i = 0; i < T * d; ++i) {
    prefix.data()[i] = bfloat16(float(r.normal()));
    delta.data()[i] = bfloat16(float(r.normal()));
    o.data()[i] = bfloat16(float(r.normal()));
  }
  delta.data()[1 * d + 40] = bfloat16(std::numeric_limits<float>::quiet_NaN());
  ar::phase2_add(b, ar::phase2_add_args<bfloat16>{.o = o.view(),
                                                  .lse = k3::tensor_view<float const, 1>(lse.data(), {T}),
                                                  .prefix = prefix.view(),
                                                  .delta = delta.view(),
                                                  .u = k3::tensor_view<float const, 1>(u.data(), {d}),
                                                  .h = h.view()});
  for (index_t t = 0; t < T; ++t) {
    bool all_nan = true, all_finite = true;
    for (index_t k = 0; k < d; ++k) {
      all_nan &= std::isnan(float(h.data()[t * d + k]));
      all_finite &= std::isfinite(float(h.data()[t * d + k]));
    }
    CHECK((t == 1 ? all_nan : all_finite));
  }
}

TEST_CASE("phase 2 at a block's first site (h = o): every value rounded as k3::bfloat16 rounds, streamed or not") {
  attnres_ref::rng r(91);
  for (std::size_t threshold : {ar::tuning::host().stream_threshold_bytes, std::size_t(0)})
    for (index_t d : {index_t(1), index_t(31), index_t(32), index_t(77), index_t(4096)}) {
      CAPTURE(d);
      ar::two_phase_options const opt{.tuning = {.stream_threshold_bytes = threshold}};
      index_t const T = 3;
      k3::tensor<bfloat16, 2> ob({T, d}), hb({T, d}), part({T, d});
      k3::tensor<float, 2> of({T, d}), hf({T, d});
      for (index_t i = 0; i < T * d; ++i) {
        ob.data()[i].bits = std::uint16_t(r.g() & 0xffff);  // every kind of pattern, NaNs included
        std::uint32_t const fb = std::uint32_t(r.g());
        of.data()[i] = std::bit_cast<float>(i % 3 ? fb : fb & 0x807fffffu);  // a third subnormal
      }
      std::vector<float> lse(static_cast<std::size_t>(T), 0.0f), u(static_cast<std::size_t>(d), 0.0f);
      k3::cpu::threads<> b(2);
      auto lv = k3::tensor_view<float const, 1>(lse.data(), {T});
      auto uv = k3::tensor_view<float const, 1>(u.data(), {d});
      // no partial: the block's first site
      ar::phase2(b, ar::phase2_args<bfloat16>{.o = ob.view(), .lse = lv, .u = uv, .h = hb.view()}, opt);
      ar::phase2(b, ar::phase2_args<bfloat16, float, float>{.o = of.view(), .lse = lv, .u = uv, .h = hf.view()}, opt);
      index_t bad = 0;
      for (index_t i = 0; i < T * d; ++i) {
        bfloat16 v;
        ar::detail::put(v, float(ob.data()[i]));
        bad += bits(v) != bits(hb.data()[i]);
        float const x = of.data()[i], y = hf.data()[i];
        bad += !(std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y) || (std::isnan(x) && std::isnan(y)));
      }
      CHECK(bad == 0);
      ar::phase2(b, ar::phase2_args<bfloat16, float>{.o = of.view(), .lse = lv, .u = uv, .h = hb.view()}, opt);
      for (index_t i = 0; i < T * d; ++i) {
        bfloat16 v;
        ar::detail::put(v, of.data()[i]);
        bad += bits(v) != bits(hb.data()[i]);
      }
      CHECK(bad == 0);
    }
}

TEST_CASE("tuning: the streaming threshold follows the cache sizes, and the host's come from the host's caches") {
  // a 2 MiB private L2 (the Xeon VM measured): eight L2s
  CHECK(ar::tuning::for_caches({48 << 10, 2 << 20, 105 << 20}).stream_threshold_bytes == (std::size_t(16) << 20));
  // a smaller L2 (the Zen 4 VM): twice the L3; nothing reported: 64 MiB
  CHECK(ar::tuning::for_caches({32 << 10, 1 << 20, 32 << 20}).stream_threshold_bytes == (std::size_t(64) << 20));
  CHECK(ar::tuning::for_caches({32 << 10, 1 << 20, 96 << 20}).stream_threshold_bytes == (std::size_t(192) << 20));
  CHECK(ar::tuning::for_caches({}).stream_threshold_bytes == (std::size_t(64) << 20));
  CHECK(ar::tuning::host().stream_threshold_bytes == ar::tuning::for_caches(k3::host_cache_sizes()).stream_threshold_bytes);
  CHECK(ar::two_phase_options{}.tuning.stream_threshold_bytes == ar::tuning::host().stream_threshold_bytes);
}
