// k3/attnres/arch/avx512.hpp — AVX-512 kernels of two-phase Block AttnRes for bfloat16 storage,
// for xsimd::avx512bw and the architectures derived from it (kernel::two_phase_kernels<Arch>).
// Empty unless the translation unit is compiled for AVX-512F and BW.
//
// Phase 1 is two small GEMM-shaped products per token: the scores [S x d] . [d x N] (the
// folded queries are shared by every token) and the mix [S x N] . [N x d]. The portable
// kernels in two_phase.hpp convert the token's N bank rows to float first and then stream
// them from L2; these read the bfloat16 rows directly (bf16 -> float is a 16-bit shift, done
// once per loaded vector and reused by every site of the register tile) and tile the work so
// the operands stay in L1:
//   * scores: 6 sites x 4 sources = 24 float accumulators, d in tiles of KB elements (the
//     accumulators are parked between tiles), so each query vector feeds 4 FMAs and each
//     converted source vector 6; queries stay float (no bf16 rounding of u).
//   * mix: 32 columns at a time, up to 8 sources' columns in 16 registers, every site's two
//     output vectors formed from them with the weight broadcast from memory; one full 64-byte
//     line per site and column step, written with a streaming store when the output is far
//     larger than the last-level cache (it is read back only by phase 2, a whole block later).
// Phase 2 (phase2_add) is one pass over prefix/delta (residual add, rounding, dot and sum of
// squares) and one over the float row and o (the merge), with h streamed the same way.
//
// Arithmetic matches the portable kernels' precision class: float lane sums of the products
// rounded into double (tests: 1e-6 against the one-pass mix); phase2_add's residual add is
// bit-identical to the portable path.
// Every bfloat16 result rounds exactly as detail::put does (nearest even, NaN kept quiet with
// its sign, subnormals kept): vcvtne2ps2bf16 where AVX512-BF16 exists and the chunk holds no
// subnormal float, integer rounding otherwise.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <xsimd/xsimd.hpp>

#include "k3/attnres/arch/generic.hpp"
#include "k3/attnres/simd_ops.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/prefetch.hpp"
#include "k3/core/tensor_view.hpp"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace k3::attnres::detail {

inline __m512 bf16_lo16(bfloat16 const* p) noexcept {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p))), 16));
}
inline __m512 bf16_lo16_mask(bfloat16 const* p, __mmask16 m) noexcept {
  __m256i const v = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(__mmask32(m), p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// x rounded to bfloat16 exactly as bf16_bits does, returned as the float whose upper half is
// the bfloat16 pattern (lower half zero).
inline __m512i bf16_round_hi(__m512 x) noexcept {
  __m512i const u = _mm512_castps_si512(x);
  __m512i const lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  __mmask16 const nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
  return _mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u)));
}

// 32 bfloat16 patterns from two vectors of bf16_round_hi results (the upper 16-bit words).
inline __m512i bf16_pack_hi(__m512i lo, __m512i hi) noexcept {
  __m512i const idx = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15,
                                       13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(lo, idx, hi);
}

// 32 bfloat16 patterns in column order (lo: columns 0..15), rounded to nearest even: with
// AVX512-BF16 by vcvtne2ps2bf16, which matches put() except that it flushes subnormal inputs
// to zero; `sub` collects the subnormal lanes so the caller can redo those rows exactly (in
// phase 1 the registers are too precious for an inline fallback).
inline __m512i bf16_pack_fast(__m512 lo, __m512 hi, __mmask16& sub) noexcept {
#if defined(__AVX512BF16__)
  sub = _kor_mask16(sub, _kor_mask16(_mm512_fpclass_ps_mask(lo, 0x20), _mm512_fpclass_ps_mask(hi, 0x20)));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
#else
  (void)sub;
  return bf16_pack_hi(bf16_round_hi(lo), bf16_round_hi(hi));
#endif
}

inline __mmask16& no_sub() noexcept {
  static thread_local __mmask16 m = 0;
  return m;
}

inline bool aligned64(void const* p) noexcept { return (reinterpret_cast<std::uintptr_t>(p) & 63u) == 0; }

// 32 results (c0: columns 0..15, c1: 16..31) into a storage row; kn < 32 stores the first kn.
inline void store32(bfloat16* dst, __m512 c0, __m512 c1, index_t kn, bool stream, __mmask16& sub) noexcept {
  __m512i const v = bf16_pack_fast(c0, c1, sub);
  if (kn == 32) {
    if (stream && aligned64(dst))
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
    else
      _mm512_storeu_si512(dst, v);
  } else {
    _mm512_mask_storeu_epi16(dst, __mmask32((std::uint64_t(1) << kn) - 1), v);
  }
}
inline void store32(float* dst, __m512 c0, __m512 c1, index_t kn, bool stream, __mmask16& = no_sub()) noexcept {
  if (kn == 32) {
    if (stream && aligned64(dst)) {
      _mm512_stream_ps(dst, c0);
      _mm512_stream_ps(dst + 16, c1);
    } else {
      _mm512_storeu_ps(dst, c0);
      _mm512_storeu_ps(dst + 16, c1);
    }
  } else {
    __mmask16 const m0 = __mmask16(kn >= 16 ? 0xffff : (1u << kn) - 1), m1 = __mmask16(kn > 16 ? (1u << (kn - 16)) - 1 : 0);
    _mm512_mask_storeu_ps(dst, m0, c0);
    _mm512_mask_storeu_ps(dst + 16, m1, c1);
  }
}

// ---- phase 1: scores ----------------------------------------------------------------------
inline constexpr index_t p1_tl = 6, p1_tj = 4, p1_kb = 512;

// Scratch doubles the score kernel parks its accumulators in.
inline index_t p1_dots_scratch(index_t n, index_t nq) noexcept {
  return ((nq + p1_tl - 1) / p1_tl) * ((n + p1_tj - 1) / p1_tj) * p1_tl * p1_tj * 8;
}

// Adds the 16 float lanes of c, pairwise summed into 8, into the 8 doubles at p (or sets them).
inline void p1_park(double* p, __m512 c, bool set) noexcept {
  __m512d const v = _mm512_cvtps_pd(_mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1)));
  _mm512_store_pd(p, set ? v : _mm512_add_pd(_mm512_load_pd(p), v));
}

// One d tile [k0, k0 + KB) of every site x source product, lanes added into acc.
template <class Arch>
void p1_dots_tile(bfloat16 const* const* x, index_t n, float const* const* q, index_t nq, index_t d, index_t k0, bfloat16 const* bzero,
                  double* acc) {
  constexpr index_t TL = p1_tl, TJ = p1_tj, KB = p1_kb;
  index_t const nlt = (nq + TL - 1) / TL, njt = (n + TJ - 1) / TJ;
  index_t const dv = d / 16 * 16;
  __mmask16 const tail = __mmask16((1u << (d - dv)) - 1);
  index_t const k1 = std::min(d, k0 + KB), kv = std::min(k1, dv);
  bool const has_tail = k1 == d && dv < d;
  for (index_t lt = 0; lt < nlt; ++lt) {
    float const* ql[TL];
    for (index_t l = 0; l < TL; ++l) ql[l] = q[lt * TL + l];
    for (index_t jt = 0; jt < njt; ++jt) {
      bfloat16 const* xj[TJ];
      for (index_t j = 0; j < TJ; ++j) xj[j] = jt * TJ + j < n ? x[jt * TJ + j] : bzero;
      double* a = acc + (lt * njt + jt) * TL * TJ * 8;
      __m512 c[TL][TJ];
      for (index_t l = 0; l < TL; ++l)
        for (index_t j = 0; j < TJ; ++j) c[l][j] = _mm512_setzero_ps();
      for (index_t k = k0; k < kv; k += 16) {
        __m512 bv[TJ];
        for (index_t j = 0; j < TJ; ++j) bv[j] = bf16_lo16(xj[j] + k);
        for (index_t l = 0; l < TL; ++l) {
          __m512 qv = _mm512_loadu_ps(ql[l] + k);
          // one load per query vector, not one folded into each of its 4 FMAs (the loads,
          // not the FMAs, would then bound the loop)
          __asm__("" : "+v"(qv));
          for (index_t j = 0; j < TJ; ++j) c[l][j] = _mm512_fmadd_ps(qv, bv[j], c[l][j]);
        }
      }
      if (has_tail) {
        __m512 bv[TJ];
        for (index_t j = 0; j < TJ; ++j) bv[j] = bf16_lo16_mask(xj[j] + dv, tail);
        for (index_t l = 0; l < TL; ++l) {
          __m512 const qv = _mm512_maskz_loadu_ps(tail, ql[l] + dv);
          for (index_t j = 0; j < TJ; ++j) c[l][j] = _mm512_fmadd_ps(qv, bv[j], c[l][j]);
        }
      }
      // fully unrolled, so that c stays in registers
#pragma GCC unroll 8
      for (index_t l = 0; l < TL; ++l)
#pragma GCC unroll 4
        for (index_t j = 0; j < TJ; ++j) p1_park(a + (l * TJ + j) * 8, c[l][j], k0 == 0);
    }
  }
}

// dots[l * n + j] from the parked lanes.
inline void p1_dots_finish(index_t n, index_t nq, double const* acc, double* dots) noexcept {
  constexpr index_t TL = p1_tl, TJ = p1_tj;
  index_t const nlt = (nq + TL - 1) / TL, njt = (n + TJ - 1) / TJ;
  for (index_t lt = 0; lt < nlt; ++lt)
    for (index_t jt = 0; jt < njt; ++jt) {
      double const* a = acc + (lt * njt + jt) * TL * TJ * 8;
      for (index_t l = 0; l < TL && lt * TL + l < nq; ++l)
        for (index_t j = 0; j < TJ && jt * TJ + j < n; ++j)
          dots[(lt * TL + l) * n + jt * TJ + j] = _mm512_reduce_add_pd(_mm512_load_pd(a + (l * TJ + j) * 8));
    }
}

// dots[l * n + j] = q_l . x_j. q holds ceil(nq / 6) * 6 row pointers (rows past nq point at a
// zero row), bzero a zero bfloat16 row of length d; acc has p1_dots_scratch(n, nq) doubles
// (64-byte aligned). Each d tile is summed in float registers (16 lanes, KB / 16 terms each)
// and the lanes are added into double: a logit of a few units from d = 7168 terms keeps an
// error near float rounding, which float lanes over the whole row do not.
template <class Arch>
void p1_dots_bf16(bfloat16 const* const* x, index_t n, float const* const* q, index_t nq, index_t d, bfloat16 const* bzero, double* acc,
                  double* dots) {
  for (index_t k0 = 0; k0 < d; k0 += p1_kb) p1_dots_tile<Arch>(x, n, q, nq, d, k0, bzero, acc);
  p1_dots_finish(n, nq, acc, dots);
}

// ---- phase 1: mix -------------------------------------------------------------------------
// One group of NJ <= 8 sources at columns [k, k + kn): every site's 32 outputs. The first group
// starts from zero, later ones from tile (nq x 32 floats); the last writes out.
template <int NJ, class O>
inline void p1_mix_group(bfloat16 const* const* xg, float const* a, index_t n, index_t nq, index_t k, index_t kn, bool first, bool last,
                         O* const* out, float* tile, bool stream, __mmask16& sub_out) {
  // The subnormal lanes are collected in a local mask and reported once: through the caller's
  // reference, which the output stores may alias as far as the compiler knows, every site's
  // store went through memory (load, or, store), a serial chain through every site that
  // bounds the mix's arithmetic; the local stays in a mask register.
  __mmask16 sub = 0;
  __m512 b0[NJ], b1[NJ];
  if (kn == 32) {
    for (int j = 0; j < NJ; ++j) {
      b0[j] = bf16_lo16(xg[j] + k);
      b1[j] = bf16_lo16(xg[j] + k + 16);
    }
  } else {
    __mmask16 const m0 = __mmask16(kn >= 16 ? 0xffff : (1u << kn) - 1), m1 = __mmask16(kn > 16 ? (1u << (kn - 16)) - 1 : 0);
    for (int j = 0; j < NJ; ++j) {
      b0[j] = bf16_lo16_mask(xg[j] + k, m0);
      b1[j] = bf16_lo16_mask(xg[j] + k + 16, m1);
    }
  }
  auto load_acc = [&](index_t l, __m512& c0, __m512& c1) {
    if (first) {
      c0 = _mm512_setzero_ps();
      c1 = _mm512_setzero_ps();
    } else {
      c0 = _mm512_load_ps(tile + l * 32);
      c1 = _mm512_load_ps(tile + l * 32 + 16);
    }
  };
  auto put_acc = [&](index_t l, __m512 c0, __m512 c1) {
    if (last) {
      store32(out[l] + k, c0, c1, kn, stream, sub);
    } else {
      _mm512_store_ps(tile + l * 32, c0);
      _mm512_store_ps(tile + l * 32 + 16, c1);
    }
  };
  // two sites per step: four independent FMA chains cover the FMA latency
  index_t l = 0;
  for (; l + 2 <= nq; l += 2) {
    float const* al = a + l * n;
    __m512 c0, c1, d0, d1;
    load_acc(l, c0, c1);
    load_acc(l + 1, d0, d1);
    for (int j = 0; j < NJ; ++j) {
      __m512 const w = _mm512_set1_ps(al[j]), v = _mm512_set1_ps(al[n + j]);
      c0 = _mm512_fmadd_ps(w, b0[j], c0);
      c1 = _mm512_fmadd_ps(w, b1[j], c1);
      d0 = _mm512_fmadd_ps(v, b0[j], d0);
      d1 = _mm512_fmadd_ps(v, b1[j], d1);
    }
    put_acc(l, c0, c1);
    put_acc(l + 1, d0, d1);
  }
  if (l < nq) {
    float const* al = a + l * n;
    __m512 c0, c1;
    load_acc(l, c0, c1);
    for (int j = 0; j < NJ; ++j) {
      __m512 const w = _mm512_set1_ps(al[j]);
      c0 = _mm512_fmadd_ps(w, b0[j], c0);
      c1 = _mm512_fmadd_ps(w, b1[j], c1);
    }
    put_acc(l, c0, c1);
  }
  sub_out |= sub;
}

// out[l][k] = sum_j a[l * n + j] x_j[k] for every site and the columns [k0, k1) (k0 a multiple
// of 32); tile has nq * 32 floats (64-byte aligned). Per output element: one FMA chain from
// zero over the sources in order, then rounding; `sub` collects subnormal results (p1_mix_fix).
template <class Arch, class O>
void p1_mix_cols(bfloat16 const* const* x, index_t n, float const* a, index_t nq, index_t k0, index_t k1, O* const* out, float* tile,
                 bool stream, __mmask16& sub) {
  for (index_t k = k0; k < k1; k += 32) {
    index_t const kn = std::min<index_t>(32, k1 - k);
    for (index_t g = 0; g < n; g += 8) {
      index_t const gn = std::min<index_t>(8, n - g);
      bool const first = g == 0, last = g + gn == n;
      switch (gn) {
        case 1: p1_mix_group<1>(x + g, a + g, n, nq, k, kn, first, last, out, tile, stream, sub); break;
        case 2: p1_mix_group<2>(x + g, a + g, n, nq, k, kn, first, last, out, tile, stream, sub); break;
        case 3: p1_mix_group<3>(x + g, a + g, n, nq, k, kn, first, last, out, tile, stream, sub); break;
        case 4: p1_mix_group<4>(x + g, a + g, n, nq, k, kn, first, last, out, tile, stream, sub); break;
        case 5: p1_mix_group<5>(x + g, a + g, n, nq, k, kn, first, last, out, tile, stream, sub); break;
        case 6: p1_mix_group<6>(x + g, a + g, n, nq, k, kn, first, last, out, tile, stream, sub); break;
        case 7: p1_mix_group<7>(x + g, a + g, n, nq, k, kn, first, last, out, tile, stream, sub); break;
        default: p1_mix_group<8>(x + g, a + g, n, nq, k, kn, first, last, out, tile, stream, sub); break;
      }
    }
  }
}

// After a token's mix: if a result was subnormal (vcvtne2ps2bf16 flushed it), the same sums
// again, rounded by put().
template <class O>
void p1_mix_fix(bfloat16 const* const* x, index_t n, float const* a, index_t nq, index_t d, O* const* out, __mmask16 sub) {
  if constexpr (std::is_same_v<O, bfloat16>) {
    if (sub != 0) {
      for (index_t l = 0; l < nq; ++l)
        for (index_t k = 0; k < d; ++k) {
          float c = 0.0f;
          for (index_t j = 0; j < n; ++j) c = std::fma(a[l * n + j], to_c<float>(x[j][k]), c);
          put(out[l][k], c);
        }
    }
  } else {
    (void)x, (void)n, (void)a, (void)nq, (void)d, (void)out, (void)sub;
  }
}

template <class Arch, class O>
void p1_mix_bf16(bfloat16 const* const* x, index_t n, float const* a, index_t nq, index_t d, O* const* out, float* tile, bool stream) {
  __mmask16 sub = 0;
  p1_mix_cols<Arch>(x, n, a, nq, 0, d, out, tile, stream, sub);
  p1_mix_fix(x, n, a, nq, d, out, sub);
}

// ---- phase 2 ------------------------------------------------------------------------------
// Phase 2 is memory-bound only if it is cheap per element: 512-bit operations take two cycles
// of a 256-bit pipe on some cores (AMD Zen 4), and the straightforward kernel (zero-extend and
// shift per 16 elements, integer rounding) came out compute-bound there. So it works on
// 32-column chunks split into even and odd columns: a bfloat16 pair (2k, 2k+1) sits in one
// 32-bit lane, the even column is the lane shifted left by 16, the odd one the lane with its
// low half cleared (one operation each for 32 columns); the rounding is vcvtne2ps2bf16 plus a
// word permutation back into column order. The query is permuted the same way once per call.

inline __m512i eo_hi_mask() noexcept { return _mm512_set1_epi32(int(0xffff0000u)); }

inline void eo_load(bfloat16 const* p, __m512& e, __m512& o) noexcept {
  __m512i const v = _mm512_loadu_si512(p);
  e = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  o = _mm512_castsi512_ps(_mm512_and_si512(v, eo_hi_mask()));
}
inline void eo_load(float const* p, __m512& e, __m512& o) noexcept {
  __m512 const a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
  __m512i const ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  __m512i const io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  e = _mm512_permutex2var_ps(a, ie, b);
  o = _mm512_permutex2var_ps(a, io, b);
}

// 32 bfloat16 patterns in column order from the even and odd columns, rounded exactly as put()
// rounds. vcvtne2ps2bf16 flushes subnormal inputs to zero, so chunks holding one take the
// integer path (bf16_round_hi); it also quiets NaN the way bf16_bits does.
inline __m512i eo_pack(__m512 e, __m512 o) noexcept {
#if defined(__AVX512BF16__)
  if ((_mm512_fpclass_ps_mask(e, 0x20) | _mm512_fpclass_ps_mask(o, 0x20)) == 0) {
    __m512i const idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                         17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(o, e)));
  }
#endif
  return _mm512_or_si512(_mm512_srli_epi32(bf16_round_hi(e), 16), bf16_round_hi(o));
}

inline void eo_store(bfloat16* dst, __m512 e, __m512 o, bool stream) noexcept {
  __m512i const v = eo_pack(e, o);
  if (stream && aligned64(dst))
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
  else
    _mm512_storeu_si512(dst, v);
}
inline void eo_store(float* dst, __m512 e, __m512 o, bool stream) noexcept {
  __m512i const il = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512i const ih = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  store32(dst, _mm512_permutex2var_ps(e, il, o), _mm512_permutex2var_ps(e, ih, o), 32, stream);
}

// u permuted into the even/odd layout of each full 32-column chunk (the tail stays in order).
inline void eo_permute_query(float const* u, index_t d, float* out) noexcept {
  index_t const d32 = d / 32 * 32;
  for (index_t k = 0; k < d32; k += 32)
    for (index_t i = 0; i < 16; ++i) {
      out[k + i] = u[k + 2 * i];
      out[k + 16 + i] = u[k + 2 * i + 1];
    }
  for (index_t k = d32; k < d; ++k) out[k] = u[k];
}

// Software prefetch over token rows: at column k of the current rows, one line `ahead` columns
// further on, in the same row or (past its end) in the next token's row. A single server core
// keeps too few lines in flight for phase 2's three read streams on its own; the distance
// (2048 columns, 4 KB of bf16) is not critical. Phase 1 does not use it: the same prefetch of
// the next token's sources there did not pay (benchmarks/attnres.md).
template <int Streams>
struct row_prefetch {
  char const* cur[Streams] = {};
  char const* next[Streams] = {};  // null: no next row
  std::size_t esize[Streams] = {};
  index_t d = 0, ahead = 2048;
  K3_INLINE void at(int s, index_t k) const noexcept { k3::detail::prefetch_row_ahead(cur[s], next[s], esize[s], d, k + ahead, 1); }
  template <class T>
  void set(int s, T const* row, T const* next_row) noexcept {
    cur[s] = reinterpret_cast<char const*>(row);
    next[s] = reinterpret_cast<char const*>(next_row);
    esize[s] = sizeof(T);
  }
};

// One token of phase2_add for a bfloat16 prefix: prefix += delta (each sum rounded to bfloat16
// as put() does, so prefix is bit-identical to the portable path), the merge weight
// p = sigmoid(r_b (u . b) - lse) from float lane sums of the rounded row (16 lanes of even and
// 16 of odd columns, rounded into double; remaining columns in double), then
// h = o + p (b - o) with b read back from the prefix row just written (still in L1).
// ue is u in the even/odd layout (eo_permute_query).
template <class Arch, class D, class O, class H>
void p2_add_token_bf16(bfloat16* K3_RESTRICT pr, D const* K3_RESTRICT dl, O const* K3_RESTRICT o, float const* K3_RESTRICT ue, float lse,
                       index_t d, double eps, H* K3_RESTRICT h, bool stream, row_prefetch<3> const& pf) {
  index_t const d32 = d / 32 * 32;
  __m512 ae = _mm512_setzero_ps(), ao = ae, se = ae, so = ae;
  for (index_t k = 0; k < d32; k += 32) {
    pf.at(0, k);  // prefix
    pf.at(1, k);  // delta
    __m512 pe, po, de, dq;
    eo_load(pr + k, pe, po);
    eo_load(dl + k, de, dq);
    __m512i const v = eo_pack(_mm512_add_ps(pe, de), _mm512_add_ps(po, dq));
    _mm512_storeu_si512(pr + k, v);
    __m512 const be = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), bo = _mm512_castsi512_ps(_mm512_and_si512(v, eo_hi_mask()));
    ae = _mm512_fmadd_ps(_mm512_loadu_ps(ue + k), be, ae);
    ao = _mm512_fmadd_ps(_mm512_loadu_ps(ue + k + 16), bo, ao);
    se = _mm512_fmadd_ps(be, be, se);
    so = _mm512_fmadd_ps(bo, bo, so);
  }
  double dot = double(_mm512_reduce_add_ps(ae)) + double(_mm512_reduce_add_ps(ao));
  double ss = double(_mm512_reduce_add_ps(se)) + double(_mm512_reduce_add_ps(so));
  for (index_t k = d32; k < d; ++k) {
    bfloat16 v;
    put(v, to_c<float>(pr[k]) + to_c<float>(dl[k]));
    pr[k] = v;
    double const b = double(to_c<float>(v));
    dot += double(ue[k]) * b;
    ss += b * b;
  }
  if (!(std::abs(dot) <= std::numeric_limits<double>::max() && ss <= std::numeric_limits<double>::max())) {
    // Float lanes overflowed (a row beyond ~1e18) or the row holds Inf/NaN: sum the written
    // row again in double (ue is in the even/odd layout of eo_permute_query).
    dot = 0;
    ss = 0;
    for (index_t k = 0; k < d; ++k) {
      double const b = double(to_c<float>(pr[k]));
      index_t const kk = k < d32 ? (k / 32 * 32 + (k % 2) * 16 + (k % 32) / 2) : k;
      dot += double(ue[kk]) * b;
      ss += b * b;
    }
  }
  double const s2 = dot / std::sqrt(ss / double(d) + eps);
  float const p = float(1.0 / (1.0 + std::exp(double(lse) - s2)));
  __m512 const pv = _mm512_set1_ps(p);
  for (index_t k = 0; k < d32; k += 32) {
    pf.at(2, k);  // o
    __m512 be, bo, oe, oo;
    eo_load(pr + k, be, bo);
    eo_load(o + k, oe, oo);
    eo_store(h + k, _mm512_fmadd_ps(pv, _mm512_sub_ps(be, oe), oe), _mm512_fmadd_ps(pv, _mm512_sub_ps(bo, oo), oo), stream);
  }
  for (index_t k = d32; k < d; ++k) {
    float const ok = to_c<float>(o[k]);
    put(h[k], ok + p * (to_c<float>(pr[k]) - ok));
  }
}

// h = o for one row, each element through float and rounded as put() rounds (which for bf16
// to bf16 only quiets a signalling NaN).
template <class O, class H>
void copy_row_bf16(O const* K3_RESTRICT o, H* K3_RESTRICT h, index_t d, bool stream) {
  index_t const d32 = d / 32 * 32;
  for (index_t k = 0; k < d32; k += 32) {
    __m512 e, q;
    eo_load(o + k, e, q);
    eo_store(h + k, e, q, stream);
  }
  for (index_t k = d32; k < d; ++k) put(h[k], to_c<float>(o[k]));
}

inline void stream_fence() noexcept { _mm_sfence(); }

}  // namespace k3::attnres::detail

namespace k3::attnres::kernel {

// What two_phase.hpp calls for an AVX-512BW Arch.
template <class Arch>
  requires std::is_base_of_v<xsimd::avx512bw, Arch>
struct two_phase_kernels<Arch> {
  static constexpr bool available = true;
  static constexpr index_t p1_tl = detail::p1_tl;
  static index_t p1_dots_scratch(index_t n, index_t nq) noexcept { return detail::p1_dots_scratch(n, nq); }
  template <class... A>
  static void p1_dots_bf16(A&&... a) {
    detail::p1_dots_bf16<Arch>(std::forward<A>(a)...);
  }
  template <class... A>
  static void p1_mix_bf16(A&&... a) {
    detail::p1_mix_bf16<Arch>(std::forward<A>(a)...);
  }
  template <class... A>
  static void copy_row_bf16(A&&... a) {
    detail::copy_row_bf16(std::forward<A>(a)...);
  }
  static void eo_permute_query(float const* u, index_t d, float* out) noexcept { detail::eo_permute_query(u, d, out); }
  template <int Streams>
  using row_prefetch = detail::row_prefetch<Streams>;
  template <class... A>
  static void p2_add_token_bf16(A&&... a) {
    detail::p2_add_token_bf16<Arch>(std::forward<A>(a)...);
  }
  static void stream_fence() noexcept { detail::stream_fence(); }
};

}  // namespace k3::attnres::kernel

#endif
