// k3/backend/cpu/arch/avx512.hpp — k3's vector primitives with AVX-512F intrinsics, for
// xsimd::avx512f and the architectures derived from it. Empty unless the translation unit is
// compiled for AVX-512F; k3/backend/cpu/arch/generic.hpp serves every Arch otherwise.
#pragma once
#include "k3/backend/cpu/arch/generic.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#include <cstddef>
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
// blends, which decides whether a sigmoid keeps up with memory. U independent vectors go step by
// step together: one chain alone waits on each operation's latency, and the core's scheduler
// does not look far enough ahead to overlap whole chains.
template <std::size_t U, class Arch>
[[gnu::always_inline]] inline void exp_nonpositive_n(xsimd::batch<float, Arch> (&x)[U], requires_arch<xsimd::avx512f>) noexcept {
  __m512 n[U], r[U], p[U];
  for (std::size_t u = 0; u < U; ++u) {
    __m512 const v = _mm512_max_ps(_mm512_set1_ps(-104.0f), x[u]);  // NaN: the second operand, x
    n[u] = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    r[u] = _mm512_fnmadd_ps(n[u], _mm512_set1_ps(0.693359375f), v);  // ln 2 = 0.693359375 - 2.12194440e-4
  }
  for (std::size_t u = 0; u < U; ++u) r[u] = _mm512_fnmadd_ps(n[u], _mm512_set1_ps(-2.12194440e-4f), r[u]);
  for (std::size_t u = 0; u < U; ++u) p[u] = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 5040.0f), r[u], _mm512_set1_ps(1.0f / 720.0f));
  auto const horner = [&](float c) {
    for (std::size_t u = 0; u < U; ++u) p[u] = _mm512_fmadd_ps(p[u], r[u], _mm512_set1_ps(c));
  };
  horner(1.0f / 120.0f);
  horner(1.0f / 24.0f);
  horner(1.0f / 6.0f);
  horner(0.5f);
  horner(1.0f);
  horner(1.0f);
  for (std::size_t u = 0; u < U; ++u) x[u] = _mm512_scalef_ps(p[u], n[u]);
}
template <class Arch>
inline xsimd::batch<float, Arch> exp_nonpositive(xsimd::batch<float, Arch> const& x, requires_arch<xsimd::avx512f>) noexcept {
  xsimd::batch<float, Arch> v[1] = {x};
  exp_nonpositive_n(v, Arch{});
  return v[0];
}

// A store that bypasses the caches, for outputs larger than they are: it saves the read for
// ownership of each line. p is 64-byte aligned; the writer ends with stream_fence.
template <class Arch>
inline void store_stream(float* p, xsimd::batch<float, Arch> const& v, requires_arch<xsimd::avx512f>) noexcept {
  _mm512_stream_ps(p, v);
}
inline void stream_fence(requires_arch<xsimd::avx512f>) noexcept { _mm_sfence(); }

}  // namespace k3::simd::kernel

#endif
