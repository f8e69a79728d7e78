// k3/core/numeric/bfloat16.hpp — bfloat16 storage type: conversion from float rounds to
// nearest even; NaN stays NaN (quiet bit forced, sign kept); Inf stays Inf. Arithmetic is
// done by converting to float: k3 accumulates in fp32 or wider.
#pragma once
#include <cstdint>
#include <type_traits>

#include "k3/core/config.hpp"

namespace k3 {

struct bfloat16 {
  std::uint16_t bits = 0;

  bfloat16() = default;
  K3_INLINE constexpr explicit bfloat16(float f) noexcept : bits(from_float(f)) {}
  K3_INLINE constexpr explicit bfloat16(double d) noexcept : bits(from_float(static_cast<float>(d))) {}

  K3_INLINE static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 r;
    r.bits = b;
    return r;
  }
  // __builtin_bit_cast, not std::bit_cast: the latter is a host-only function for nvcc, and
  // the builtin (g++ >= 11, clang++ >= 9, nvcc) keeps one definition for .cpp and .cu TUs.
  K3_INLINE constexpr operator float() const noexcept { return __builtin_bit_cast(float, std::uint32_t(bits) << 16); }

  K3_INLINE static constexpr std::uint16_t from_float(float f) noexcept {
    std::uint32_t u = __builtin_bit_cast(std::uint32_t, f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0)  // NaN: keep sign, make quiet
      return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even (overflow -> Inf is right)
    return static_cast<std::uint16_t>(u >> 16);
  }

  friend constexpr bool operator==(bfloat16 a, bfloat16 b) noexcept { return float(a) == float(b); }
};

static_assert(sizeof(bfloat16) == 2);

// Loads any storage type as compute type T (float or double).
template <class T, class S>
K3_INLINE constexpr T load_as(S s) noexcept {
  return static_cast<T>(static_cast<float>(s));
}
template <class T>
K3_INLINE constexpr T load_as(double s) noexcept {
  return static_cast<T>(s);
}
template <class T>
K3_INLINE constexpr T load_as(float s) noexcept {
  return static_cast<T>(s);
}

// Stores a compute value into storage type S (rounding to nearest even for bfloat16).
template <class S, class T>
K3_INLINE constexpr S store_as(T v) noexcept {
  if constexpr (std::is_same_v<S, bfloat16>)
    return bfloat16(static_cast<float>(v));
  else
    return static_cast<S>(v);
}

}  // namespace k3
