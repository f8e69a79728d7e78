// k3/backend/cpu/arch/avx2.hpp — k3's vector primitives with AVX2 and FMA3 intrinsics, for
// xsimd::fma3<xsimd::avx2> (the architecture xsimd picks on an AVX2 core). Empty unless the
// translation unit is compiled for both; k3/backend/cpu/arch/generic.hpp serves every Arch otherwise.
#pragma once
#include "k3/backend/cpu/arch/generic.hpp"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <cstddef>

namespace k3::simd::kernel {

// The exponential of arch/avx512.hpp (the same reduction, polynomial and roundings, so both ISAs
// give the same bits) with the final scaling by 2^n done as two exact-range multiplies: AVX2 has
// no vscalefps, and 2^n alone is not a normal float below n = -126. n1 = floor(n / 2) and
// n - n1 are both >= -75 for n >= -150, so p * 2^n1 is exact and p * 2^n1 * 2^(n - n1) rounds
// once, as vscalefps does (gradual underflow included). xsimd::exp costs twice as many
// operations with its special-case blends, which decides whether a sigmoid keeps up with memory.
template <std::size_t U, class Arch>
[[gnu::always_inline]] inline void exp_nonpositive_n(xsimd::batch<float, Arch> (&x)[U], requires_arch<xsimd::fma3<xsimd::avx2>>) noexcept {
  __m256 n[U], r[U], p[U];
  for (std::size_t u = 0; u < U; ++u) {
    __m256 const v = _mm256_max_ps(_mm256_set1_ps(-104.0f), x[u]);  // NaN: the second operand, x
    n[u] = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r[u] = _mm256_fnmadd_ps(n[u], _mm256_set1_ps(0.693359375f), v);  // ln 2 = 0.693359375 - 2.12194440e-4
  }
  for (std::size_t u = 0; u < U; ++u) r[u] = _mm256_fnmadd_ps(n[u], _mm256_set1_ps(-2.12194440e-4f), r[u]);
  for (std::size_t u = 0; u < U; ++u) p[u] = _mm256_fmadd_ps(_mm256_set1_ps(1.0f / 5040.0f), r[u], _mm256_set1_ps(1.0f / 720.0f));
  auto const horner = [&](float c) {
    for (std::size_t u = 0; u < U; ++u) p[u] = _mm256_fmadd_ps(p[u], r[u], _mm256_set1_ps(c));
  };
  horner(1.0f / 120.0f);
  horner(1.0f / 24.0f);
  horner(1.0f / 6.0f);
  horner(0.5f);
  horner(1.0f);
  horner(1.0f);
  for (std::size_t u = 0; u < U; ++u) {
    // NaN converts to INT_MIN: the scale is garbage, but p is already NaN and stays NaN.
    __m256i const k = _mm256_cvtps_epi32(n[u]);
    __m256i const k1 = _mm256_srai_epi32(k, 1);
    __m256i const k2 = _mm256_sub_epi32(k, k1);
    __m256 const s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, _mm256_set1_epi32(127)), 23));
    __m256 const s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, _mm256_set1_epi32(127)), 23));
    x[u] = _mm256_mul_ps(_mm256_mul_ps(p[u], s1), s2);
  }
}
template <class Arch>
inline xsimd::batch<float, Arch> exp_nonpositive(xsimd::batch<float, Arch> const& x, requires_arch<xsimd::fma3<xsimd::avx2>>) noexcept {
  xsimd::batch<float, Arch> v[1] = {x};
  exp_nonpositive_n(v, Arch{});
  return v[0];
}

// A store that bypasses the caches (see arch/avx512.hpp); p is 64-byte aligned.
template <class Arch>
inline void store_stream(float* p, xsimd::batch<float, Arch> const& v, requires_arch<xsimd::fma3<xsimd::avx2>>) noexcept {
  _mm256_stream_ps(p, v);
}
inline void stream_fence(requires_arch<xsimd::fma3<xsimd::avx2>>) noexcept { _mm_sfence(); }

}  // namespace k3::simd::kernel

#endif
