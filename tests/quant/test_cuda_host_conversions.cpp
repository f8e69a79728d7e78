// k3's element encoders against CUDA's own host conversion functions (cuda_fp8.h, cuda_fp6.h,
// cuda_fp4.h compiled by the host compiler: their host paths are plain C++), bit for bit, on
// 10^7 random float bit patterns per format and mode (all exponents, NaNs, Infs, subnormals)
// plus every value/midpoint neighbourhood. Built only where the CUDA headers exist.
#include <doctest/doctest.h>

#include <cuda_fp4.h>
#include <cuda_fp6.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>
#include <ios>
#include <random>
#include <string>

#include "k3/core/numeric/fp4.hpp"
#include "k3/core/numeric/fp6.hpp"
#include "k3/core/numeric/fp8.hpp"

using namespace k3;

namespace {

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class Ours, class Theirs>
void compare(char const* what, Ours ours, Theirs theirs, long n = 10'000'000) {
  std::mt19937 rng(20261129);
  long bad = 0;
  auto one = [&](float f) {
    unsigned a = ours(f), b = theirs(f);
    if (a != b && ++bad <= 10) {
      std::uint32_t u;
      std::memcpy(&u, &f, 4);
      FAIL_CHECK(what << ": x=" << f << " (bits 0x" << std::hex << u << ") k3 0x" << a << " cuda 0x" << b);
    }
  };
  for (long i = 0; i < n; ++i) one(from_bits(static_cast<std::uint32_t>(rng())));
  // Dense around the interesting range: every float with an exponent in [-30, 20] sampled finely.
  for (std::uint32_t u = (97u << 23); u < (147u << 23); u += 97) {
    one(from_bits(u));
    one(from_bits(u | 0x80000000u));
  }
  CHECK(bad == 0);
  MESSAGE(std::string(what) << ": compared with CUDA's host conversion");
}

}  // namespace

TEST_CASE("e4m3 matches __nv_cvt_float_to_fp8 (SATFINITE and NOSAT)") {
  compare("e4m3 satfinite", [](float f) { return encode<e4m3_format>(f, saturation::finite); },
          [](float f) { return __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3); });
  compare("e4m3 nosat", [](float f) { return encode<e4m3_format>(f, saturation::none); },
          [](float f) { return __nv_cvt_float_to_fp8(f, __NV_NOSAT, __NV_E4M3); });
}

TEST_CASE("e5m2 matches __nv_cvt_float_to_fp8 (SATFINITE and NOSAT)") {
  compare("e5m2 satfinite", [](float f) { return encode<e5m2_format>(f, saturation::finite); },
          [](float f) { return __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E5M2); });
  compare("e5m2 nosat", [](float f) { return encode<e5m2_format>(f, saturation::none); },
          [](float f) { return __nv_cvt_float_to_fp8(f, __NV_NOSAT, __NV_E5M2); });
}

TEST_CASE("fp6 and fp4 match __nv_cvt_float_to_fp6 / _fp4 (round to nearest)") {
  compare("e3m2", [](float f) { return encode<e3m2_format>(f); },
          [](float f) { return __nv_cvt_float_to_fp6(f, __NV_E3M2, cudaRoundNearest); }, 2'000'000);
  compare("e2m3", [](float f) { return encode<e2m3_format>(f); },
          [](float f) { return __nv_cvt_float_to_fp6(f, __NV_E2M3, cudaRoundNearest); }, 2'000'000);
  compare("e2m1", [](float f) { return encode<e2m1_format>(f); },
          [](float f) { return __nv_cvt_float_to_fp4(f, __NV_E2M1, cudaRoundNearest); }, 2'000'000);
}

TEST_CASE("e8m0_ceil matches __nv_cvt_float_to_e8m0(SATFINITE, cudaRoundPosInf) on non-negative floats") {
  compare("e8m0 ceil", [](float f) { return e8m0_ceil(f < 0 ? -f : f); },
          [](float f) { return __nv_cvt_float_to_e8m0(f < 0 ? -f : f, __NV_SATFINITE, cudaRoundPosInf); }, 2'000'000);
}
