// k3/backend/cpu/arch/avx512.hpp — k3's vector primitives with AVX-512F intrinsics, for
// xsimd::avx512f and the architectures derived from it. Empty unless the translation unit is
// compiled for AVX-512F; k3/backend/cpu/arch/generic.hpp serves every Arch otherwise.
#pragma once
#include "k3/backend/cpu/arch/generic.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#include <type_traits>

namespace k3::simd::kernel {

// xsimd 8 has no AVX-512 kernel for fma/fnma and falls back to a separate multiply and add,
// which the compiler fuses at -O2 but not at -O1 (results would depend on the optimisation level).
template <class T>
inline constexpr bool avx512_real = std::is_same_v<T, float> || std::is_same_v<T, double>;

// x * y + z, or z - x * y when Negate, with one rounding.
template <bool Negate, class T, class Arch>
inline xsimd::batch<T, Arch> fused_multiply_add(xsimd::batch<T, Arch> const& x, xsimd::batch<T, Arch> const& y, xsimd::batch<T, Arch> const& z) noexcept {
  if constexpr (std::is_same_v<T, float>) return Negate ? _mm512_fnmadd_ps(x, y, z) : _mm512_fmadd_ps(x, y, z);
  else return Negate ? _mm512_fnmadd_pd(x, y, z) : _mm512_fmadd_pd(x, y, z);
}
template <class T, class Arch>
  requires avx512_real<T>
inline auto fma(xsimd::batch<T, Arch> const& x, xsimd::batch<T, Arch> const& y, xsimd::batch<T, Arch> const& z, requires_arch<xsimd::avx512f>) noexcept {
  return fused_multiply_add<false>(x, y, z);
}
template <class T, class Arch>
  requires avx512_real<T>
inline auto fnma(xsimd::batch<T, Arch> const& x, xsimd::batch<T, Arch> const& y, xsimd::batch<T, Arch> const& z, requires_arch<xsimd::avx512f>) noexcept {
  return fused_multiply_add<true>(x, y, z);
}

// A Cody-Waite reduction, a degree-7 polynomial and one vscalefps (which scales by 2^n and
// underflows gracefully): 13 vector operations against xsimd::exp's 25 with its special-case
// blends, which decides whether a sigmoid keeps up with memory.
template <class Arch>
inline xsimd::batch<float, Arch> exp_nonpositive(xsimd::batch<float, Arch> const& x, requires_arch<xsimd::avx512f>) noexcept {
  __m512 const v = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);  // NaN: the second operand, x
  __m512 const n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);  // ln 2 = 0.693359375 - 2.12194440e-4
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace k3::simd::kernel

#endif
