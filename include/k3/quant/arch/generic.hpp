// k3/quant/arch/generic.hpp — the portable forms of the quantisers' vector primitives, and the
// row kernels' "not served here" for every Arch that no ISA file of this folder serves (dispatch
// by overload on the architecture tag, as in k3/backend/cpu/arch/).
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/arch/generic.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/quant/common.hpp"
#include "k3/quant/tuning.hpp"

namespace k3::quant::simd_impl {

template <class T>
K3_INLINE void to_float(T const* K3_RESTRICT p, float* K3_RESTRICT out, index_t n) noexcept {
  if constexpr (std::is_same_v<std::remove_cv_t<T>, bfloat16>) {
    // bf16 -> f32 is a 16-bit shift; written as a plain loop the compiler widens it in SIMD.
    std::uint16_t const* K3_RESTRICT u = reinterpret_cast<std::uint16_t const*>(p);
    std::uint32_t* K3_RESTRICT o = reinterpret_cast<std::uint32_t*>(out);
    for (index_t j = 0; j < n; ++j) o[j] = std::uint32_t(u[j]) << 16;
  } else {
    std::memcpy(out, p, static_cast<std::size_t>(n) * sizeof(float));
  }
}

template <class Arch>
struct kernels;  // k3/quant/simd.hpp

namespace kernel {

using ::k3::simd::kernel::requires_arch;

template <int S, class Arch>
inline xsimd::batch<std::int32_t, Arch> shr(xsimd::batch<std::int32_t, Arch> v, requires_arch<xsimd::generic>) noexcept {
  return v >> S;
}
template <int S, class Arch>
inline xsimd::batch<std::int32_t, Arch> shl(xsimd::batch<std::int32_t, Arch> v, requires_arch<xsimd::generic>) noexcept {
  return v << S;
}
template <class Arch>
inline xsimd::batch<std::int32_t, Arch> imin(xsimd::batch<std::int32_t, Arch> a, xsimd::batch<std::int32_t, Arch> b,
                                             requires_arch<xsimd::generic>) noexcept {
  return xsimd::min(a, b);
}
template <class Arch>
inline xsimd::batch<std::int32_t, Arch> imax(xsimd::batch<std::int32_t, Arch> a, xsimd::batch<std::int32_t, Arch> b,
                                             requires_arch<xsimd::generic>) noexcept {
  return xsimd::max(a, b);
}

// One batch of bf16 inputs as floats.
template <class Arch>
inline xsimd::batch<float, Arch> load_bf16(bfloat16 const* p, requires_arch<xsimd::generic>) noexcept {
  constexpr index_t L = index_t(xsimd::batch<float, Arch>::size);
  alignas(64) float f[L];
  to_float(p, f, L);
  return xsimd::batch<float, Arch>::load_aligned(f);
}

// One code per int32 lane to one byte each.
template <class Arch>
inline void store_bytes(xsimd::batch<std::int32_t, Arch> c, std::uint8_t* out, requires_arch<xsimd::generic>) noexcept {
  constexpr index_t L = index_t(xsimd::batch<std::int32_t, Arch>::size);
  alignas(64) std::int32_t t[L];
  c.store_aligned(t);
  for (index_t j = 0; j < L; ++j) out[j] = static_cast<std::uint8_t>(t[j]);
}
// 4-bit codes (one per int32 lane) to half as many bytes, even element in the low nibble.
template <class Arch>
inline void store_nibbles(xsimd::batch<std::int32_t, Arch> c, std::uint8_t* out, requires_arch<xsimd::generic>) noexcept {
  using bl = xsimd::batch<std::int64_t, Arch>;
  constexpr index_t L = index_t(xsimd::batch<std::int32_t, Arch>::size);
  bl const v = xsimd::bitwise_cast<bl>(c);
  bl const packed = (v & bl(0xF)) | ((v >> 32) << 4);
  alignas(64) std::int64_t t[L / 2];
  packed.store_aligned(t);
  for (index_t j = 0; j < L / 2; ++j) out[j] = static_cast<std::uint8_t>(t[j]);
}

// max of the |x| bit patterns of n bf16 inputs into r; false: not served here (the caller's
// portable loop runs).
template <class Arch>
inline bool amax_bits_bf16(bfloat16 const*, index_t, std::uint32_t&, requires_arch<xsimd::generic>) noexcept {
  return false;
}

// The row kernels: each quantises all of x and returns true, or returns false at once when it
// does not serve Arch or this shape (the portable kernels of k3/quant/simd.hpp then run).
template <class Arch, class B>
inline bool fp8_1x128_rows(B const&, const_view<bfloat16, 2>, tensor_view<std::uint8_t, 2>, tensor_view<float, 2>, scale_format, store_mode,
                           tuning const&, requires_arch<xsimd::generic>) {
  return false;
}
template <class Arch, class B>
inline bool mx_e4m3_rows(B const&, const_view<bfloat16, 2>, tensor_view<std::uint8_t, 2>, tensor_view<std::uint8_t, 2>, mx_rule, store_mode,
                         tuning const&, requires_arch<xsimd::generic>) {
  return false;
}
template <class Arch, class B>
inline bool mx_e2m1_rows(B const&, const_view<bfloat16, 2>, tensor_view<std::uint8_t, 2>, tensor_view<std::uint8_t, 2>, mx_rule, index_t,
                         tuning const&, requires_arch<xsimd::generic>) {
  return false;
}

}  // namespace kernel
}  // namespace k3::quant::simd_impl
