// k3/kda/arch/avx512.hpp — the KDA kernels' register-level helpers with AVX-512F intrinsics,
// for xsimd::avx512f and the architectures derived from it. Empty unless the translation unit is
// compiled for AVX-512F.
#pragma once
#include "k3/kda/arch/generic.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace k3::kda::kernel {

// dst (cb x rb, leading dimension ldd) = src^T for src rb x cb (leading dimension lds), rb and cb
// multiples of 16: sixteen rows in registers, three rounds of unpacks and lane shuffles.
inline bool transpose_16x16_blocks(float const* K3_RESTRICT src, index_t rb, index_t cb, index_t lds, float* K3_RESTRICT dst, index_t ldd,
                                   requires_arch<xsimd::avx512f>) noexcept {
  for (index_t i0 = 0; i0 < rb; i0 += 16)
    for (index_t j0 = 0; j0 < cb; j0 += 16) {
      __m512 r[16], t[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + (i0 + i) * lds + j0);
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      // u[4g + k] holds columns {k, k+4, k+8, k+12} (one per 128-bit lane) of rows 4g..4g+3
      for (int g = 0; g < 4; ++g) {
        __m512d const a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
        __m512d const c2 = _mm512_castps_pd(t[4 * g + 2]), d2 = _mm512_castps_pd(t[4 * g + 3]);
        r[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c2));
        r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c2));
        r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d2));
        r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d2));
      }
      for (int k = 0; k < 4; ++k) {
        __m512 const x = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44), y = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xEE);
        __m512 const x2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44), y2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xEE);
        t[k] = _mm512_shuffle_f32x4(x, x2, 0x88);
        t[k + 4] = _mm512_shuffle_f32x4(x, x2, 0xDD);
        t[k + 8] = _mm512_shuffle_f32x4(y, y2, 0x88);
        t[k + 12] = _mm512_shuffle_f32x4(y, y2, 0xDD);
      }
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(dst + (j0 + j) * ldd + i0, t[j]);
    }
  return true;
}

}  // namespace k3::kda::kernel

#endif
