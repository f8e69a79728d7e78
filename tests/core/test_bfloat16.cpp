#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "k3/core/numeric/bfloat16.hpp"

using k3::bfloat16;

static_assert(bfloat16(1.0f).bits == 0x3f80);
static_assert(bfloat16(-2.0f).bits == 0xc000);
// ties to even: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 -> 1 (even mantissa)
static_assert(bfloat16(1.00390625f).bits == 0x3f80);
// 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 -> rounds up to even
static_assert(bfloat16(1.01171875f).bits == 0x3f82);
static_assert(float(bfloat16::from_bits(0x4049)) == 3.140625f);

namespace {
// Independent reference: nearest representable by exhaustive comparison of neighbours.
std::uint16_t reference_round(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  std::uint16_t lo = static_cast<std::uint16_t>(u >> 16);
  std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);
  double dl = std::fabs(double(float(bfloat16::from_bits(lo))) - f);
  double dh = std::fabs(double(float(bfloat16::from_bits(hi))) - f);
  if ((u & 0xffff) == 0) return lo;
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}
}  // namespace

TEST_CASE("float -> bfloat16 rounds to nearest even on random finite floats") {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<std::uint32_t> bits;
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t u = bits(rng);
    float f;
    std::memcpy(&f, &u, 4);
    if (!std::isfinite(f) || std::fabs(f) >= 3.38e38f) continue;
    REQUIRE(bfloat16(f).bits == reference_round(f));
    ++checked;
  }
  CHECK(checked > 100000);
}

TEST_CASE("NaN stays NaN, Inf stays Inf, overflow goes to Inf") {
  float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(float(bfloat16(nan))));
  CHECK(std::isnan(float(bfloat16(-nan))));
  // a signalling NaN whose payload lives only in the low bits must not become Inf
  std::uint32_t snan_bits = 0x7f800001u;
  float snan;
  std::memcpy(&snan, &snan_bits, 4);
  CHECK(std::isnan(float(bfloat16(snan))));
  float inf = std::numeric_limits<float>::infinity();
  CHECK(float(bfloat16(inf)) == inf);
  CHECK(float(bfloat16(-inf)) == -inf);
  CHECK(float(bfloat16(3.4e38f)) == inf);
  CHECK(float(bfloat16(0.0f)) == 0.0f);
  CHECK(std::signbit(float(bfloat16(-0.0f))));
}

TEST_CASE("every bfloat16 round-trips through float") {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    bfloat16 x = bfloat16::from_bits(static_cast<std::uint16_t>(b));
    float f = x;
    if (std::isnan(f)) continue;
    REQUIRE(bfloat16(f).bits == b);
  }
}
