// k3/core/numeric/fp8.hpp — 8-bit element and scale types: FP8 E4M3 ("fn": max 448, NaN
// 0x7F/0xFF, no Inf), FP8 E5M2 (IEEE-like, Inf 0x7C), the MX scale E8M0 (2^(c-127), 0xFF NaN,
// no zero) and the NVFP4 block scale UE4M3 (E4M3 without sign). Rounding, saturation and NaN
// rules are in minifloat.hpp. Also the bit-exact power-of-two scale rules used by block
// quantizers (RCEIL ceiling, FLOOR exponent).
#pragma once
#include <cstdint>

#include "k3/core/numeric/minifloat.hpp"

namespace k3 {

using e4m3 = minifloat<e4m3_format>;
using e5m2 = minifloat<e5m2_format>;
using e8m0 = minifloat<e8m0_format>;
using ue4m3 = minifloat<ue4m3_format>;

static_assert(sizeof(e4m3) == 1 && sizeof(e5m2) == 1 && sizeof(e8m0) == 1 && sizeof(ue4m3) == 1);

// E8M0 code of the smallest power of two >= v (the RCEIL rule: cuDNN "quantize_round_up",
// Blackwell cvt.rp.satfinite.ue8m0x2.f32, TE/torchao bit fallback), for v >= 0.
// Policy (matches CUDA __nv_cvt_float_to_e8m0(v, __NV_SATFINITE, cudaRoundPosInf)):
// 0 and v <= 2^-127 -> 0x00; v > 2^127 and +Inf -> 0xFE; NaN -> 0xFF. Negative v is treated as |v|.
K3_INLINE constexpr std::uint8_t e8m0_ceil(float v) noexcept {
  std::uint32_t const bits = detail::bit_cast<std::uint32_t>(v) & 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return 0xFF;
  if (bits == 0x7F800000u) return 0xFE;
  std::uint32_t e = bits >> 23;
  std::uint32_t const man = bits & 0x7FFFFFu;
  if (e == 0) {
    e = man > 0x400000u ? 1u : 0u;  // E8M0 0x00 is 2^-127 = FP32 0x00400000
  } else if (man != 0 && e != 0xFEu) {
    ++e;
  }
  return static_cast<std::uint8_t>(e);
}

// floor(log2 v) for finite v > 0 (FP32 subnormals included: -127 .. -149).
K3_INLINE constexpr int floor_log2(float v) noexcept {
  std::uint32_t const bits = detail::bit_cast<std::uint32_t>(v) & 0x7FFFFFFFu;
  int const e = static_cast<int>(bits >> 23);
  if (e != 0) return e - 127;
  int k = 22;
  while (k > 0 && !((bits >> k) & 1u)) --k;
  return k - 149;
}

}  // namespace k3
