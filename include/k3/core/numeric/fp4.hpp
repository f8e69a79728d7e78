// k3/core/numeric/fp4.hpp — the FP4 E2M1 element type (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6;
// no Inf, no NaN) and its packing: two codes per byte, element 2i in the LOW nibble and 2i+1
// in the high nibble (torchao pack_uint4, DeepGEMM per_token_cast_to_fp4, CUDA __nv_fp4x2).
#pragma once
#include <cstdint>

#include "k3/core/numeric/minifloat.hpp"

namespace k3 {

using e2m1 = minifloat<e2m1_format>;

K3_INLINE constexpr std::uint8_t pack_fp4(std::uint8_t even, std::uint8_t odd) noexcept {
  return static_cast<std::uint8_t>((even & 0x0Fu) | ((odd & 0x0Fu) << 4));
}
K3_INLINE constexpr std::uint8_t fp4_even(std::uint8_t packed) noexcept { return packed & 0x0Fu; }
K3_INLINE constexpr std::uint8_t fp4_odd(std::uint8_t packed) noexcept { return static_cast<std::uint8_t>(packed >> 4); }
// Code of element i in a packed row.
K3_INLINE constexpr std::uint8_t fp4_at(std::uint8_t const* row, std::int64_t i) noexcept {
  return (i & 1) ? fp4_odd(row[i >> 1]) : fp4_even(row[i >> 1]);
}

}  // namespace k3
