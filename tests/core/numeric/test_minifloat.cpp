// Element types: every code of every format decoded and re-encoded at compile time and at run
// time against an independent value formula; encode checked against a brute-force
// nearest-value (ties-to-even) search over a dense sweep of each format's range, every value
// and midpoint neighbourhood, and the special values, in both saturation modes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "k3/core/numeric/fp4.hpp"
#include "k3/core/numeric/fp6.hpp"
#include "k3/core/numeric/fp8.hpp"

using namespace k3;

namespace {

// ---- an independent model of each format, written from the spec's table (B.1) ----------
constexpr double pow2(int k) {
  double r = 1.0;
  for (; k > 0; --k) r *= 2.0;
  for (; k < 0; ++k) r *= 0.5;
  return r;
}

template <class F>
constexpr bool ref_is_nan(unsigned c) {
  if constexpr (F::special == special_values::e8m0) return c == 0xFF;
  unsigned const mag = c & ((1u << (F::ebits + F::mbits)) - 1u);
  unsigned const e = mag >> F::mbits, m = mag & ((1u << F::mbits) - 1u);
  if constexpr (F::special == special_values::fn) return e == (1u << F::ebits) - 1u && m == (1u << F::mbits) - 1u;
  if constexpr (F::special == special_values::ieee) return e == (1u << F::ebits) - 1u && m != 0;
  return false;
}

template <class F>
constexpr double ref_value(unsigned c) {  // NaN codes excluded by the caller
  if constexpr (F::special == special_values::e8m0) return pow2(static_cast<int>(c) - 127);
  bool const neg = F::is_signed && ((c >> (F::ebits + F::mbits)) & 1u);
  unsigned const mag = c & ((1u << (F::ebits + F::mbits)) - 1u);
  unsigned const e = mag >> F::mbits, m = mag & ((1u << F::mbits) - 1u);
  double v;
  if (F::special == special_values::ieee && e == (1u << F::ebits) - 1u)
    v = std::numeric_limits<double>::infinity();
  else if (e == 0)
    v = (m / pow2(F::mbits)) * pow2(1 - F::bias);
  else
    v = (1.0 + m / pow2(F::mbits)) * pow2(static_cast<int>(e) - F::bias);
  return neg ? -v : v;
}

constexpr bool sign_of(double x) { return (k3::detail::bit_cast<std::uint64_t>(x) >> 63) != 0; }  // std::signbit is not constexpr in clang

// Exhaustive over all codes: decode matches the model, NaN stays NaN, and every non-NaN code
// re-encodes to itself (both modes; −0 included).
template <class F>
constexpr bool all_codes_round_trip() {
  for (unsigned c = 0; c < F::codes; ++c) {
    float const d = decode<F>(static_cast<std::uint8_t>(c));
    if (ref_is_nan<F>(c)) {
      if (d == d) return false;
      if (!is_nan_code<F>(static_cast<std::uint8_t>(c))) return false;
      continue;
    }
    if (is_nan_code<F>(static_cast<std::uint8_t>(c))) return false;
    double const r = ref_value<F>(c);
    if (static_cast<double>(d) != r) return false;
    if (sign_of(static_cast<double>(d)) != sign_of(r)) return false;
    if (encode<F>(d, saturation::finite) != c && !(F::has_inf && (r == r + r) && r != 0)) return false;
    if (encode<F>(d, saturation::none) != c) return false;
    if (encode<F>(static_cast<double>(d), saturation::none) != c) return false;
  }
  return true;
}

}  // namespace

// ---- compile time: every code of every format ------------------------------------------
static_assert(all_codes_round_trip<e4m3_format>());
static_assert(all_codes_round_trip<e5m2_format>());
static_assert(all_codes_round_trip<e3m2_format>());
static_assert(all_codes_round_trip<e2m3_format>());
static_assert(all_codes_round_trip<e2m1_format>());
static_assert(all_codes_round_trip<e8m0_format>());
static_assert(all_codes_round_trip<ue4m3_format>());

// Limits (spec B.1 table, ml_dtypes NumericLimits).
static_assert(e4m3::max() == 448.0f && e4m3::min_normal() == 0x1p-6f && e4m3::denorm_min() == 0x1p-9f && e4m3::epsilon() == 0.125f);
static_assert(!e4m3::has_infinity && e4m3::has_quiet_nan);
static_assert(e5m2::max() == 57344.0f && e5m2::min_normal() == 0x1p-14f && e5m2::denorm_min() == 0x1p-16f && e5m2::epsilon() == 0.25f);
static_assert(e5m2::has_infinity);
static_assert(e3m2::max() == 28.0f && e3m2::min_normal() == 0.25f && e3m2::denorm_min() == 0.0625f);
static_assert(e2m3::max() == 7.5f && e2m3::min_normal() == 1.0f && e2m3::denorm_min() == 0.125f);
static_assert(e2m1::max() == 6.0f && e2m1::min_normal() == 1.0f && e2m1::denorm_min() == 0.5f);
static_assert(e8m0::max() == 0x1p127f && e8m0::min_normal() == 0x1p-127f && e8m0::epsilon() == 1.0f);
static_assert(ue4m3::max() == 448.0f && ue4m3::lowest() == 0.0f);
static_assert(e4m3_format::max_code == 0x7E && e5m2_format::max_code == 0x7B && e8m0_format::max_code == 0xFE);
static_assert(e3m2_format::max_code == 0x1F && e2m3_format::max_code == 0x1F && e2m1_format::max_code == 0x7);

// Decode tables from the spec text.
static_assert(decode<e4m3_format>(0x78) == 256 && decode<e4m3_format>(0x79) == 288 && decode<e4m3_format>(0x7A) == 320 &&
              decode<e4m3_format>(0x7B) == 352 && decode<e4m3_format>(0x7C) == 384 && decode<e4m3_format>(0x7D) == 416 &&
              decode<e4m3_format>(0x7E) == 448);
static_assert(decode<e4m3_format>(0x08) == 0x1p-6f && decode<e4m3_format>(0x01) == 0x1p-9f);
static_assert(decode<e2m1_format>(0) == 0 && decode<e2m1_format>(1) == 0.5f && decode<e2m1_format>(2) == 1 &&
              decode<e2m1_format>(3) == 1.5f && decode<e2m1_format>(4) == 2 && decode<e2m1_format>(5) == 3 &&
              decode<e2m1_format>(6) == 4 && decode<e2m1_format>(7) == 6 && decode<e2m1_format>(0xF) == -6);
static_assert(decode<e5m2_format>(0x7C) == std::numeric_limits<float>::infinity());
static_assert(decode<e5m2_format>(0xFC) == -std::numeric_limits<float>::infinity());

namespace {
template <class F>
constexpr int count_non_nan() {
  int n = 0;
  for (unsigned c = 0; c < F::codes; ++c) n += !is_nan_code<F>(static_cast<std::uint8_t>(c));
  return n;
}
template <class F>
constexpr int count_finite() {
  int n = 0;
  for (unsigned c = 0; c < F::codes; ++c) {
    float d = decode<F>(static_cast<std::uint8_t>(c));
    n += (d == d && d != std::numeric_limits<float>::infinity() && d != -std::numeric_limits<float>::infinity());
  }
  return n;
}
}  // namespace
static_assert(count_non_nan<e4m3_format>() == 254);
static_assert(count_finite<e5m2_format>() == 248);

// Spec B.8 spot values (RNE), B.2 overflow boundaries, saturation.
constexpr auto sat = saturation::finite;
constexpr auto nosat = saturation::none;
static_assert(encode<e4m3_format>(1.0f) == 0x38 && encode<e4m3_format>(3.0f) == 0x44 && encode<e4m3_format>(0.1f) == 0x1D);
static_assert(encode<e4m3_format>(0x1p-6f) == 0x08 && encode<e4m3_format>(0x1p-9f) == 0x01 && encode<e4m3_format>(0x1p-10f) == 0x00);
static_assert(encode<e4m3_format>(1.5f * 0x1p-10f) == 0x01 && encode<e4m3_format>(0.013671875f) == 0x07);
static_assert(encode<e4m3_format>(-0.0f) == 0x80);
static_assert(encode<e4m3_format>(400.0f) == 0x7C);  // 384 under ties-to-even (416 under ties-away)
static_assert(encode<e4m3_format>(416.0f) == 0x7D && encode<e4m3_format>(450.0f) == 0x7E);
static_assert(encode<e4m3_format>(464.0f, sat) == 0x7E && encode<e4m3_format>(464.0f, nosat) == 0x7E);  // 464 -> 448
static_assert(encode<e4m3_format>(464.0001f, nosat) == 0x7F && encode<e4m3_format>(464.0001f, sat) == 0x7E);
static_assert(encode<e4m3_format>(480.0f, nosat) == 0x7F && encode<e4m3_format>(480.0f, sat) == 0x7E);
static_assert(encode<e4m3_format>(-500.0f, nosat) == 0xFF && encode<e4m3_format>(-500.0f, sat) == 0xFE);
static_assert(encode<e4m3_format>(2 * 448.0f, sat) == 0x7E);
static_assert(encode<e4m3_format>(std::numeric_limits<float>::infinity(), sat) == 0x7E);
static_assert(encode<e4m3_format>(-std::numeric_limits<float>::infinity(), sat) == 0xFE);
static_assert(encode<e4m3_format>(-std::numeric_limits<float>::infinity(), nosat) == 0xFF);
static_assert(encode<e4m3_format>(std::numeric_limits<float>::quiet_NaN(), sat) == 0x7F);
static_assert(encode<e4m3_format>(-std::numeric_limits<float>::quiet_NaN(), nosat) == 0x7F);
static_assert(encode<e5m2_format>(1.0f) == 0x3C && encode<e5m2_format>(61439.0f) == 0x7B);
static_assert(encode<e5m2_format>(61440.0f, nosat) == 0x7C && encode<e5m2_format>(61440.0f, sat) == 0x7B);
static_assert(encode<e5m2_format>(0x1p-16f) == 0x01 && encode<e5m2_format>(0x1p-17f) == 0x00);
static_assert(encode<e5m2_format>(-std::numeric_limits<float>::infinity(), nosat) == 0xFC);
static_assert(encode<e5m2_format>(-std::numeric_limits<float>::infinity(), sat) == 0xFB);
static_assert(encode<e5m2_format>(std::numeric_limits<float>::quiet_NaN(), nosat) == 0x7F);
// E2M1 ties (B.2): RNE gives 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
static_assert(encode<e2m1_format>(0.25f) == 0 && encode<e2m1_format>(0.75f) == 2 && encode<e2m1_format>(1.25f) == 2 &&
              encode<e2m1_format>(1.75f) == 4 && encode<e2m1_format>(2.5f) == 4 && encode<e2m1_format>(3.5f) == 6 &&
              encode<e2m1_format>(5.0f) == 6);
static_assert(encode<e2m1_format>(-0.0f) == 0x8 && encode<e2m1_format>(-5.0f) == 0xE);
static_assert(encode<e2m1_format>(7.0f) == 0x7 && encode<e2m1_format>(-100.0f, nosat) == 0xF);
static_assert(encode<e2m1_format>(std::numeric_limits<float>::quiet_NaN()) == 0x7);  // CUDA: NaN -> +max
static_assert(encode<e3m2_format>(30.0f) == 0x1F && encode<e3m2_format>(-std::numeric_limits<float>::infinity()) == 0x3F);
static_assert(encode<e2m3_format>(7.75f) == 0x1F && encode<e2m3_format>(-0.0f) == 0x20);
// E8M0 (ml_dtypes cast semantics for none; saturating clamps).
static_assert(encode<e8m0_format>(1.0f) == 127 && encode<e8m0_format>(1.5f) == 128 && encode<e8m0_format>(3.0f) == 129 &&
              encode<e8m0_format>(0.75f) == 127 && encode<e8m0_format>(1.4f) == 127);
static_assert(encode<e8m0_format>(0.0f, nosat) == 0xFF && encode<e8m0_format>(0.0f, sat) == 0x00);
static_assert(encode<e8m0_format>(-1.0f, nosat) == 0xFF && encode<e8m0_format>(-1.0f, sat) == 0x00);
static_assert(encode<e8m0_format>(0x1p-129f, nosat) == 0x00 && encode<e8m0_format>(0x1p127f) == 0xFE);
static_assert(encode<e8m0_format>(0x1.8p127f, nosat) == 0xFF && encode<e8m0_format>(0x1.8p127f, sat) == 0xFE);
// UE4M3: unsigned.
static_assert(encode<ue4m3_format>(-1.0f, sat) == 0x00 && encode<ue4m3_format>(-1.0f, nosat) == 0x7F);
static_assert(encode<ue4m3_format>(1000.0f, sat) == 0x7E && encode<ue4m3_format>(-0.0f) == 0x00);
// E8M0 scale rules (B.4 / B.7).
static_assert(e8m0_ceil(1.0f) == 127 && e8m0_ceil(1.0000001f) == 128 && e8m0_ceil(0.0f) == 0);
static_assert(e8m0_ceil(0x1p-127f) == 0 && e8m0_ceil(0x1.000008p-127f) == 1 && e8m0_ceil(0x1p-149f) == 0);
static_assert(e8m0_ceil(std::numeric_limits<float>::infinity()) == 0xFE && e8m0_ceil(std::numeric_limits<float>::max()) == 0xFE);
static_assert(e8m0_ceil(std::numeric_limits<float>::quiet_NaN()) == 0xFF);
static_assert(floor_log2(1.0f) == 0 && floor_log2(1.99f) == 0 && floor_log2(0x1p-149f) == -149 && floor_log2(0x1.8p-130f) == -130);
// FP4 packing: even element in the low nibble.
static_assert(pack_fp4(0x3, 0xA) == 0xA3 && fp4_even(0xA3) == 0x3 && fp4_odd(0xA3) == 0xA);
// The storage types.
static_assert(e4m3(448.0f).bits == 0x7E && float(e4m3::from_bits(0x38)) == 1.0f && e4m3(1000.0f).bits == 0x7E);
static_assert(e4m3(1000.0f, saturation::none).is_nan());

// ---- run time --------------------------------------------------------------------------
namespace {

template <class F>
void check_codes_runtime() {
  for (unsigned c = 0; c < F::codes; ++c) {
    volatile unsigned vc = c;  // defeat constant folding: this runs the run-time code path
    std::uint8_t code = static_cast<std::uint8_t>(vc);
    float d = decode<F>(code);
    if (ref_is_nan<F>(c)) {
      CHECK(std::isnan(d));
      continue;
    }
    double r = ref_value<F>(c);
    CHECK(static_cast<double>(d) == r);
    CHECK(std::signbit(d) == std::signbit(r));
    CHECK(encode<F>(d, saturation::none) == code);
  }
}

// Brute force: nearest representable value by scanning the sorted value list, ties to the
// even code (E8M0: ties up), with the first value beyond max standing for "overflow".
template <class F>
struct brute_force {
  std::vector<double> vals;        // non-negative non-NaN finite values, ascending
  std::vector<unsigned> codes;     // their (non-negative) codes
  double beyond;                   // max + one top-binade ulp: rounding to it means overflow

  brute_force() {
    for (unsigned c = 0; c < F::codes; ++c) {
      if (F::is_signed && (c & F::sign_bit)) continue;
      if (ref_is_nan<F>(c)) continue;
      double v = ref_value<F>(c);
      if (std::isinf(v)) continue;
      vals.push_back(v);
      codes.push_back(c);
    }
    std::vector<std::size_t> idx(vals.size());
    for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](auto a, auto b) { return vals[a] < vals[b]; });
    std::vector<double> v2;
    std::vector<unsigned> c2;
    for (auto i : idx) {
      v2.push_back(vals[i]);
      c2.push_back(codes[i]);
    }
    vals = v2;
    codes = c2;
    double const mx = vals.back();
    beyond = F::special == special_values::e8m0 ? 2 * mx : mx + (mx - vals[vals.size() - 2]);
  }

  std::uint8_t overflow(bool neg, saturation s) const {
    unsigned sign = neg ? F::sign_bit : 0u;
    if (F::special == special_values::e8m0) return s == saturation::finite ? 0xFE : 0xFF;
    if (!F::is_signed && neg) return s == saturation::finite ? 0 : F::nan_code;
    if (s == saturation::finite || F::special == special_values::none) return static_cast<std::uint8_t>(sign | F::max_code);
    if (F::special == special_values::fn) return static_cast<std::uint8_t>(sign | F::nan_code);
    return static_cast<std::uint8_t>(sign | F::inf_code);
  }

  std::uint8_t operator()(double x, saturation s) const {
    if (std::isnan(x)) return static_cast<std::uint8_t>(F::nan_code);
    bool const neg = std::signbit(x);
    double const a = std::fabs(x);
    if (std::isinf(x)) return overflow(neg, s);
    if (F::special == special_values::e8m0) {
      if (a == 0 || neg) return s == saturation::finite ? 0 : 0xFF;
      if (a < vals.front()) return 0;
    }
    if (!F::is_signed && neg && a != 0) return s == saturation::finite ? 0 : F::nan_code;
    unsigned const sign = (neg && F::is_signed) ? F::sign_bit : 0u;
    // lo = largest value <= a, hi = next (or "beyond")
    auto it = std::upper_bound(vals.begin(), vals.end(), a);
    std::size_t const i = static_cast<std::size_t>(it - vals.begin()) - 1;
    if (vals[i] == a) return static_cast<std::uint8_t>(sign | codes[i]);
    bool const hi_is_beyond = i + 1 == vals.size();
    double const lo = vals[i], hi = hi_is_beyond ? beyond : vals[i + 1];
    if (a >= hi) return overflow(neg, s);  // beyond the virtual next value
    unsigned const clo = codes[i], chi = hi_is_beyond ? F::max_code + 1 : codes[i + 1];
    double const mid = lo + (hi - lo) / 2;  // exact: few significant bits
    unsigned pick;
    if (a < mid)
      pick = clo;
    else if (a > mid)
      pick = chi;
    else
      pick = F::special == special_values::e8m0 ? chi : ((clo & 1u) ? chi : clo);
    if (pick > F::max_code) return overflow(neg, s);
    return static_cast<std::uint8_t>(sign | pick);
  }
};

float next_up(float f, int n) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += static_cast<std::uint32_t>(n);
  std::memcpy(&f, &u, 4);
  return f;
}

template <class F>
void sweep() {
  brute_force<F> bf;
  long checked = 0, bad = 0;
  auto check = [&](double x) {
    for (auto s : {saturation::finite, saturation::none}) {
      std::uint8_t got = encode<F>(x, s), want = bf(x, s);
      ++checked;
      if (got != want) {
        if (++bad <= 10) FAIL_CHECK(std::string(F::name) << ": encode(" << x << ", " << int(s) << ") = " << int(got) << ", brute force " << int(want));
      }
    }
  };
  auto check_float = [&](float f) {
    check(f);
    check(-f);
    if (encode<F>(f, saturation::finite) != encode<F>(static_cast<double>(f), saturation::finite)) ++bad;
  };
  // Dense sweep of float bit patterns from well below the smallest value to 4x beyond max.
  float const lo = static_cast<float>(bf.vals[F::special == special_values::e8m0 ? 0 : 1] / 64);
  float const hi = static_cast<float>(bf.beyond * 4);
  std::uint32_t ulo, uhi;
  std::memcpy(&ulo, &lo, 4);
  std::memcpy(&uhi, &hi, 4);
  std::uint32_t const step = std::max<std::uint32_t>(1, (uhi - ulo) / (1u << 20));
  for (std::uint32_t u = ulo; u < uhi; u += step) {
    float f;
    std::memcpy(&f, &u, 4);
    check_float(f);
  }
  // Every float within 64 ulps of each value and each midpoint (where ties and carries live).
  std::vector<double> pts = bf.vals;
  pts.push_back(bf.beyond);
  std::size_t const nv = pts.size();
  for (std::size_t i = 0; i + 1 < nv; ++i) pts.push_back(pts[i] + (pts[i + 1] - pts[i]) / 2);
  for (double p : pts) {
    float pf = static_cast<float>(p);
    for (int d = -64; d <= 64; ++d) check_float(next_up(pf, d));
    // doubles just either side of the point: must be rounded once, from double
    check(p * (1 + 0x1p-45));
    check(p * (1 - 0x1p-45));
    check(-p * (1 + 0x1p-45));
  }
  // Specials.
  for (double x : {0.0, -0.0, std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                   std::numeric_limits<double>::quiet_NaN(), -std::numeric_limits<double>::quiet_NaN(),
                   double(std::numeric_limits<float>::denorm_min()), double(std::numeric_limits<float>::min()),
                   double(std::numeric_limits<float>::max()), std::numeric_limits<double>::max(),
                   std::numeric_limits<double>::denorm_min(), 1e-300, 1e300})
    check(x);
  // Random float bit patterns (NaNs, Infs, all exponents).
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    check(f);
  }
  CHECK(bad == 0);
  MESSAGE(std::string(F::name) << ": " << checked << " encodes checked against brute force");
}

}  // namespace

TEST_CASE("decode and re-encode every code at run time") {
  check_codes_runtime<e4m3_format>();
  check_codes_runtime<e5m2_format>();
  check_codes_runtime<e3m2_format>();
  check_codes_runtime<e2m3_format>();
  check_codes_runtime<e2m1_format>();
  check_codes_runtime<e8m0_format>();
  check_codes_runtime<ue4m3_format>();
}

TEST_CASE("encode agrees with brute-force nearest-even search: e4m3") { sweep<e4m3_format>(); }
TEST_CASE("encode agrees with brute-force nearest-even search: e5m2") { sweep<e5m2_format>(); }
TEST_CASE("encode agrees with brute-force nearest-even search: e3m2") { sweep<e3m2_format>(); }
TEST_CASE("encode agrees with brute-force nearest-even search: e2m3") { sweep<e2m3_format>(); }
TEST_CASE("encode agrees with brute-force nearest-even search: e2m1") { sweep<e2m1_format>(); }
TEST_CASE("encode agrees with brute-force nearest-even search: e8m0") { sweep<e8m0_format>(); }
TEST_CASE("encode agrees with brute-force nearest-even search: ue4m3") { sweep<ue4m3_format>(); }

TEST_CASE("e8m0_ceil is the exact power-of-two ceiling") {
  std::mt19937 rng(11);
  for (int i = 0; i < 1000000; ++i) {
    std::uint32_t u = rng() & 0x7FFFFFFFu;
    float v;
    std::memcpy(&v, &u, 4);
    if (!std::isfinite(v)) continue;
    std::uint8_t c = e8m0_ceil(v);
    double const p = std::ldexp(1.0, int(c) - 127);
    if (v <= 0x1p-127f) {
      CHECK(c == 0);
    } else if (v > 0x1p127f) {
      CHECK(c == 0xFE);
    } else {
      REQUIRE(p >= v);
      REQUIRE(p / 2 < v);
    }
  }
}

TEST_CASE("floor_log2 is exact on every exponent and on subnormals") {
  for (int k = -149; k <= 127; ++k) {
    float p = std::ldexp(1.0f, k);
    CHECK(floor_log2(p) == k);
    if (k < 127) CHECK(floor_log2(next_up(std::ldexp(1.0f, k + 1), -1)) == k);
  }
}

TEST_CASE("fp4 packing round trip") {
  std::uint8_t row[3] = {pack_fp4(1, 2), pack_fp4(3, 4), pack_fp4(0xF, 0x8)};
  std::uint8_t want[6] = {1, 2, 3, 4, 0xF, 0x8};
  for (int i = 0; i < 6; ++i) CHECK(fp4_at(row, i) == want[i]);
}
