// k3/quant/arch/avx512.hpp — the quantisers on AVX-512: the vector primitives (AVX-512F) and
// the bf16 row kernels (AVX-512BW; BF16, VBMI and DQ where noted), for xsimd::avx512f /
// avx512bw and the architectures derived from them. Each part is empty unless the translation
// unit is compiled for its ISA; k3/quant/arch/generic.hpp serves every Arch otherwise.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "k3/core/backend_traits.hpp"
#include "k3/quant/arch/generic.hpp"
#include "k3/quant/reference.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace k3::quant::simd_impl::kernel {

// AVX-512 intrinsics are used in their zero-masked forms throughout: the unmasked ones (and
// xsimd 8.1's shifts) start from _mm512_undefined_*, which g++ 12 flags as uninitialised
// (-Werror) at -O2 with sanitizers.
template <int S, class Arch>
inline xsimd::batch<std::int32_t, Arch> shr(xsimd::batch<std::int32_t, Arch> v, requires_arch<xsimd::avx512f>) noexcept {
  return _mm512_maskz_srli_epi32(__mmask16(0xFFFF), v, S);
}
template <int S, class Arch>
inline xsimd::batch<std::int32_t, Arch> shl(xsimd::batch<std::int32_t, Arch> v, requires_arch<xsimd::avx512f>) noexcept {
  return _mm512_maskz_slli_epi32(__mmask16(0xFFFF), v, S);
}
template <class Arch>
inline xsimd::batch<std::int32_t, Arch> imin(xsimd::batch<std::int32_t, Arch> a, xsimd::batch<std::int32_t, Arch> b,
                                             requires_arch<xsimd::avx512f>) noexcept {
  return _mm512_maskz_min_epi32(__mmask16(0xFFFF), a, b);
}
template <class Arch>
inline xsimd::batch<std::int32_t, Arch> imax(xsimd::batch<std::int32_t, Arch> a, xsimd::batch<std::int32_t, Arch> b,
                                             requires_arch<xsimd::avx512f>) noexcept {
  return _mm512_maskz_max_epi32(__mmask16(0xFFFF), a, b);
}

// bf16 widened in registers: a zero-extension and a 16-bit shift.
template <class Arch>
inline xsimd::batch<float, Arch> load_bf16(bfloat16 const* p, requires_arch<xsimd::avx512f>) noexcept {
  __m512i w = _mm512_maskz_cvtepu16_epi32(__mmask16(0xFFFF), _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(__mmask16(0xFFFF), w, 16));
}

template <class Arch>
inline void store_bytes(xsimd::batch<std::int32_t, Arch> c, std::uint8_t* out, requires_arch<xsimd::avx512f>) noexcept {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_maskz_cvtepi32_epi8(__mmask16(0xFFFF), c));
}
template <class Arch>
inline void store_nibbles(xsimd::batch<std::int32_t, Arch> c, std::uint8_t* out, requires_arch<xsimd::avx512f>) noexcept {
  __m512i const v = c;
  __m512i const packed = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi64(0xF)),
                                         _mm512_maskz_slli_epi64(__mmask8(0xFF), _mm512_maskz_srli_epi64(__mmask8(0xFF), v, 32), 4));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_maskz_cvtepi64_epi8(__mmask8(0xFF), packed));
}

}  // namespace k3::quant::simd_impl::kernel
#endif

#if defined(__AVX512BW__)
namespace k3::quant::simd_impl {

// Writes a row of n bytes given as consecutive 64-byte registers (put(r) for bytes [64t, 64t+64),
// the last one partial). Cached: plain and masked stores. Streaming: the destination's whole
// cache lines inside the row by non-temporal stores, realigned from two consecutive registers
// with vpermt2b when dst is not 64-byte aligned; the partial first and last lines by masked
// ordinary stores, so no store touches a byte outside the row (a neighbouring row may share those
// lines, possibly written by another thread). A streaming kernel ends its task with _mm_sfence.
class row_writer {
 public:
  row_writer(std::uint8_t* dst, index_t n, bool stream) noexcept
      : dst_(dst), n_(n), stream_(stream), head_(static_cast<int>((64 - (reinterpret_cast<std::uintptr_t>(dst) & 63)) & 63)) {
#if defined(__AVX512VBMI__)
    if (stream_ && head_ != 0) idx_ = _mm512_add_epi8(_mm512_set1_epi8(static_cast<char>(head_)), iota());
#else
    if (head_ != 0) stream_ = false;  // realigning needs vpermt2b
#endif
  }
  K3_INLINE void put(__m512i r) noexcept {
    index_t const start = pos_;
    pos_ += 64;
    int const v = static_cast<int>(std::min<index_t>(64, n_ - start));  // valid bytes of r
    if (!stream_ || head_ == 0) {
      if (v == 64) {
        if (stream_)
          _mm512_stream_si512(reinterpret_cast<__m512i*>(dst_ + start), r);
        else
          _mm512_storeu_si512(dst_ + start, r);
      } else {
        _mm512_mask_storeu_epi8(dst_ + start, bits(0, v), r);
      }
      return;
    }
    if (start == 0) {
      _mm512_mask_storeu_epi8(dst_, bits(0, std::min(head_, v)), r);  // up to the first line boundary
    } else {  // the line at dst + head + start - 64: carry[head, 64) then r[0, head)
#if defined(__AVX512VBMI__)
      __m512i const line = _mm512_permutex2var_epi8(carry_, idx_, r);
#else
      __m512i const line = r;  // unreachable: streaming is off for unaligned rows
#endif
      std::uint8_t* const at = dst_ + head_ + start - 64;
      if (v >= head_)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(at), line);
      else
        _mm512_mask_storeu_epi8(at, bits(0, 64 - head_ + v), line);
    }
    if (pos_ >= n_ && v > head_) _mm512_mask_storeu_epi8(dst_ + start, bits(head_, v), r);  // the row's last, partial line
    carry_ = r;
  }
  // 64 bytes at p (only the row's remaining bytes are used).
  K3_INLINE void put_bytes(std::uint8_t const* p) noexcept { put(_mm512_loadu_si512(p)); }

 private:
  static __m512i iota() noexcept {
    return _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41, 40, 39, 38, 37, 36, 35, 34,
                           33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                           1, 0);
  }
  // byte mask of [lo, hi), 0 <= lo <= hi <= 64
  static __mmask64 bits(int lo, int hi) noexcept {
    std::uint64_t const upto = hi >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << hi) - 1;
    return static_cast<__mmask64>(upto & ~((std::uint64_t{1} << lo) - 1));
  }
  std::uint8_t* dst_;
  index_t n_, pos_ = 0;
  bool stream_;
  int head_;  // bytes before dst's first line boundary (0: aligned)
  __m512i idx_ = _mm512_setzero_si512(), carry_ = _mm512_setzero_si512();
};

// ---- 1x128 E4M3 of bfloat16 rows on AVX-512BW: the DeepSeek activation hot path ------------
// Same bytes as reference::fp8_quantize_rows, with about 7-8 vector instructions per 16 elements:
//  * amax: u16 max over 2|x| bit patterns (x + x; bf16 is the top half of an fp32), 32 lanes at a
//    time, with the u16 min alongside for the subnormal-code test;
//  * scales: 16 tiles at once with vdivps (the same IEEE divisions amax'/448 and 1/s as
//    detail::deepseek_scale, so the same bits);
//  * encode of y = |x| * (1/s), which lies in [0, 448·(1 + 2^-22)] (no saturation, no NaN:
//    non-finite tiles are all-NaN and written by memset):
//      normal (y >= 2^-6):  code = (bits(y) + 0x7FFFF + bit20(y)) >> 20 - (120 << 3)  (RNE)
//      subnormal:           code = round(y · 2^9) via y + 2^14 in fp32 (RNE), capped at 8
//    and code = max(normal formula, capped subnormal one): for y >= 2^-6 both give >= 8 and the
//    capped one exactly 8; below, the normal formula rounds 8f where the subnormal one rounds
//    4 + 4f or more (y = 2^-7(1+f)), and is negative further down.
//  * bf16 -> fp32 by interleaving with zero words (vpunpck[lh]wd); vpackusdw undoes the
//    in-lane interleave, so codes come back in order; signs are OR-ed in as 16-bit words.
namespace avx512_1x128 {
inline constexpr __mmask16 all16 = 0xFFFF;

// Per-lane max of |x| and min of |x| - 1 (zeros wrap to 0xFFFF, out of the way of the minimum)
// over the tile at p, as 32 u16 lanes each.
K3_INLINE void tile_lanes(std::uint16_t const* p, __m512i& vmax, __m512i& vmin1) noexcept {
  __m512i const m = _mm512_set1_epi16(0x7FFF), one = _mm512_set1_epi16(1);
  __m512i const a0 = _mm512_and_si512(_mm512_loadu_si512(p), m);
  __m512i const a1 = _mm512_and_si512(_mm512_loadu_si512(p + 32), m);
  __m512i const a2 = _mm512_and_si512(_mm512_loadu_si512(p + 64), m);
  __m512i const a3 = _mm512_and_si512(_mm512_loadu_si512(p + 96), m);
  vmax = _mm512_max_epu16(_mm512_max_epu16(a0, a1), _mm512_max_epu16(a2, a3));
  vmin1 = _mm512_min_epu16(_mm512_min_epu16(_mm512_sub_epi16(a0, one), _mm512_sub_epi16(a1, one)),
                           _mm512_min_epu16(_mm512_sub_epi16(a2, one), _mm512_sub_epi16(a3, one)));
}

// E8M0 scale codes of 16 MX blocks of format F from their fp32 amax patterns a (finite or not;
// the caller sends non-finite blocks elsewhere), as detail::mx_block_scale<F>, before its clamp
// of se at -127 (which only matters for codes the fast paths do not take).
template <class F>
K3_INLINE __m512i mx_scale_codes(__m512i a, mx_rule rule) noexcept {
  if (rule == mx_rule::floor)  // floor(log2 amax) - emax_elem + 127, 0 for zero and subnormal amax
    return _mm512_maskz_max_epi32(all16, _mm512_sub_epi32(_mm512_maskz_srli_epi32(all16, a, 23), _mm512_set1_epi32(F::emax_elem)),
                                  _mm512_setzero_si512());
  // e8m0_ceil(amax / max): the quotient is finite and < 2^126
  constexpr float mx = decode<F>(static_cast<std::uint8_t>(F::max_code));
  __m512i const d = _mm512_castps_si512(_mm512_maskz_div_ps(all16, _mm512_castsi512_ps(a), _mm512_set1_ps(mx)));
  __m512i const e = _mm512_maskz_srli_epi32(all16, d, 23), man = _mm512_and_si512(d, _mm512_set1_epi32(0x7FFFFF));
  __mmask16 const up = _mm512_test_epi32_mask(man, man), sub = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
  __m512i const c = _mm512_mask_add_epi32(e, up, e, _mm512_set1_epi32(1));
  return _mm512_mask_mov_epi32(c, sub, _mm512_maskz_srli_epi32(all16, _mm512_add_epi32(man, _mm512_set1_epi32(0x3FFFFF)), 23));
}

// Per-lane max and min of d = x + x over the tile at p, as 32 u16 lanes each: d = 2|x| (the add
// drops the sign bit), so max(d) is the amax pattern shifted by one and min(d) is 0 exactly when
// the tile holds a ±0 (such tiles are then checked with nonzero_min). One add per 32 elements
// instead of an AND and a subtract (tile_lanes).
K3_INLINE void tile_lanes2(std::uint16_t const* p, __m512i& vmax, __m512i& vmin) noexcept {
  __m512i const r0 = _mm512_loadu_si512(p), r1 = _mm512_loadu_si512(p + 32), r2 = _mm512_loadu_si512(p + 64), r3 = _mm512_loadu_si512(p + 96);
  __m512i const d0 = _mm512_add_epi16(r0, r0), d1 = _mm512_add_epi16(r1, r1), d2 = _mm512_add_epi16(r2, r2), d3 = _mm512_add_epi16(r3, r3);
  vmax = _mm512_max_epu16(_mm512_max_epu16(d0, d1), _mm512_max_epu16(d2, d3));
  vmin = _mm512_min_epu16(_mm512_min_epu16(d0, d1), _mm512_min_epu16(d2, d3));
}

// Smallest nonzero |x| pattern (16 bits) of the 128-element tile at p; 0x10000 when every x is ±0.
inline std::uint32_t nonzero_min(std::uint16_t const* p) noexcept {
  __m512i vmax, vmin1;
  tile_lanes(p, vmax, vmin1);
  alignas(64) std::uint16_t l[32];
  _mm512_store_si512(reinterpret_cast<void*>(l), vmin1);
  std::uint32_t r = 0xFFFF;
  for (int i = 0; i < 32; ++i) r = std::min<std::uint32_t>(r, l[i]);
  return r + 1;
}

// Max (and, WithMin, min) over the 32 u16 lanes of each of n <= 16 blocks, in block order, as 16
// u16: a transposing tree (unpack 16/32/64-bit, then 128-bit lanes, ~3 instructions per block);
// lanes(t, vmax, vmin) gives block t's lane vectors (absent blocks count as 0), fed to the tree as
// the blocks are read, so that the partial results stay in registers. (Storing the 16 or 32 lane vectors to the stack and
// reading them back put stores among the block loads whose addresses can match a later load's in
// bits 0-11 (4K aliasing); such a load then waits for the store, i.e. for the previous block's
// cache misses, which serialises the misses with the input in DRAM; benchmarks/quant.md.)
template <bool WithMin, class F>
K3_INLINE void reduce16_streamed(F&& lanes, int n, __m256i& rmax, __m256i& rmin) noexcept {
  auto const pair = [&](int t, __m512i& xm, __m512i& xn) {  // blocks t, t + 1: level 1
    __m512i a0 = _mm512_setzero_si512(), b0 = a0, a1 = a0, b1 = a0;
    if (t < n) lanes(t, a0, b0);
    if (t + 1 < n) lanes(t + 1, a1, b1);
    xm = _mm512_max_epu16(_mm512_unpacklo_epi16(a0, a1), _mm512_unpackhi_epi16(a0, a1));
    if constexpr (WithMin) xn = _mm512_min_epu16(_mm512_unpacklo_epi16(b0, b1), _mm512_unpackhi_epi16(b0, b1));
  };
  auto const quad = [&](int t, __m512i& zm, __m512i& zn) {  // blocks t .. t + 3: level 2
    __m512i xm0, xn0 = _mm512_setzero_si512(), xm1, xn1 = xn0;
    pair(t, xm0, xn0);
    pair(t + 2, xm1, xn1);
    zm = _mm512_max_epu16(_mm512_maskz_unpacklo_epi32(all16, xm0, xm1), _mm512_maskz_unpackhi_epi32(all16, xm0, xm1));
    if constexpr (WithMin) zn = _mm512_min_epu16(_mm512_maskz_unpacklo_epi32(all16, xn0, xn1), _mm512_maskz_unpackhi_epi32(all16, xn0, xn1));
  };
  auto const oct = [&](int t, __m512i& qm, __m512i& qn) {  // blocks t .. t + 7: level 3
    __m512i zm0, zn0 = _mm512_setzero_si512(), zm1, zn1 = zn0;
    quad(t, zm0, zn0);
    quad(t + 4, zm1, zn1);
    qm = _mm512_max_epu16(_mm512_maskz_unpacklo_epi64(__mmask8(0xFF), zm0, zm1), _mm512_maskz_unpackhi_epi64(__mmask8(0xFF), zm0, zm1));
    if constexpr (WithMin)
      qn = _mm512_min_epu16(_mm512_maskz_unpacklo_epi64(__mmask8(0xFF), zn0, zn1), _mm512_maskz_unpackhi_epi64(__mmask8(0xFF), zn0, zn1));
  };
  __m512i vm[2], vn[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  oct(0, vm[0], vn[0]);
  oct(8, vm[1], vn[1]);
  auto const last = [](__m512i const* q, auto op) {  // 128-bit lanes, then the 16 results in order
    __m512i r = op(_mm512_maskz_shuffle_i64x2(__mmask8(0xFF), q[0], q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                   _mm512_maskz_shuffle_i64x2(__mmask8(0xFF), q[0], q[1], _MM_SHUFFLE(3, 2, 3, 2)));
    r = op(r, _mm512_maskz_shuffle_i64x2(__mmask8(0xFF), r, r, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_maskz_extracti64x4_epi64(__mmask8(0xFF), _mm512_maskz_permutexvar_epi64(__mmask8(0xFF), _mm512_setr_epi64(0, 1, 4, 5, 0, 1, 4, 5), r), 0);
  };
  rmax = last(vm, [](__m512i a, __m512i b) { return _mm512_max_epu16(a, b); });
  if constexpr (WithMin) rmin = last(vn, [](__m512i a, __m512i b) { return _mm512_min_epu16(a, b); });
}

// max(d) and min(d) (d = 2|x|) of each of the n <= 16 tiles at p, p + 128, ..., as 16 u16 each.
K3_INLINE void group_max_min(std::uint16_t const* p, int n, __m256i& rmax, __m256i& rmin) noexcept {
  reduce16_streamed<true>([p](int t, __m512i& a, __m512i& b) { tile_lanes2(p + t * 128, a, b); }, n, rmax, rmin);
}

// s, 1/s and 2^-88/s of n <= 16 tiles from max(d) and min(d) (d = 2|x|), as detail::deepseek_scale
// (NaN s and 1/s for non-finite tiles). Classes, one bit per tile: nan; normal: every nonzero
// y = |x|·(1/s) is >= 2^-6 (no E4M3 subnormal codes) and 1/s >= 2^-38, judged on min |x| with the
// same fp32 product (monotone); check: finite tiles with 1/s >= 2^-38 holding a ±0, for which
// min(d) says nothing: the caller judges them on nonzero_min.
struct tile_classes {
  std::uint32_t nan, normal, check;
};
K3_INLINE tile_classes scales(__m256i dmax, __m256i dmin, int n, scale_format fmt, float* s, float* inv, float* inv88) noexcept {
  __mmask16 const ld = static_cast<__mmask16>((1u << n) - 1u);
  __m512i const a = _mm512_maskz_slli_epi32(all16, _mm512_maskz_cvtepu16_epi32(all16, dmax), 15);  // d is even: |x| << 16
  __mmask16 const nan = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(detail::nonfinite_bits)));
  __m512 const af = _mm512_maskz_max_ps(all16, _mm512_castsi512_ps(a), _mm512_set1_ps(deepseek_amax_floor));
  __m512 sv = _mm512_maskz_div_ps(all16, af, _mm512_set1_ps(448.0f));
  if (fmt == scale_format::ue8m0)  // s is a normal float in (2^-23, 2^119): round up to a power of two
    sv = _mm512_castsi512_ps(_mm512_and_si512(_mm512_add_epi32(_mm512_castps_si512(sv), _mm512_set1_epi32(0x7FFFFF)),
                                              _mm512_set1_epi32(static_cast<int>(0xFF800000u))));
  __m512 const iv = _mm512_maskz_div_ps(all16, _mm512_set1_ps(1.0f), sv);
  __m512i const dn = _mm512_maskz_cvtepu16_epi32(all16, dmin);
  __m512 const ymin = _mm512_maskz_mul_ps(all16, _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all16, dn, 15)), iv);
  __mmask16 const ok = _mm512_cmp_ps_mask(iv, _mm512_set1_ps(0x1p-38f), _CMP_GE_OQ) & ~nan & ld;
  __mmask16 const normal = _mm512_cmp_ps_mask(ymin, _mm512_set1_ps(0.015625f), _CMP_GE_OQ) & ok;
  __mmask16 const zero = _mm512_cmpeq_epi32_mask(dn, _mm512_setzero_si512()) & ok;
  __m512 const qn = _mm512_set1_ps(detail::quiet_nan());
  _mm512_store_ps(s, _mm512_mask_mov_ps(sv, nan, qn));
  _mm512_store_ps(inv, _mm512_mask_mov_ps(iv, nan, qn));
  _mm512_store_ps(inv88, _mm512_mul_ps(iv, _mm512_set1_ps(0x1p-88f)));  // exact where used (1/s >= 2^-38)
  return {static_cast<std::uint32_t>(nan & ld), static_cast<std::uint32_t>(normal), static_cast<std::uint32_t>(zero)};
}

// Codes of 16 values y = |x|·(1/s) that are 0 or >= 2^-6 (negative for 0; vpackusdw makes it 0).
K3_INLINE __m512i encode16_normal(__m512i xbits, __m512 vinv) noexcept {
  __m512i const a = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(xbits), vinv));
  __m512i const odd = _mm512_and_si512(_mm512_maskz_srli_epi32(all16, a, 20), _mm512_set1_epi32(1));
  return _mm512_maskz_srai_epi32(all16, _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF - (0x3C0 << 20))), odd), 20);
}

K3_INLINE __m512i encode16(__m512i xbits, __m512 vinv) noexcept {
  __m512 const y = _mm512_mul_ps(_mm512_castsi512_ps(xbits), vinv);
  __m512i const a = _mm512_castps_si512(y);
  __m512i const odd = _mm512_and_si512(_mm512_maskz_srli_epi32(all16, a, 20), _mm512_set1_epi32(1));
  __m512i const cn = _mm512_maskz_srai_epi32(all16, _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF - (0x3C0 << 20))), odd), 20);
  __m512i cs = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(y, _mm512_set1_ps(16384.0f))), _mm512_set1_epi32(0x46800000));
  cs = _mm512_maskz_min_epi32(all16, cs, _mm512_set1_epi32(8));
  return _mm512_maskz_max_epi32(all16, cn, cs);
}

// 64 codes (sign included) of p[0, 64).
template <bool Normal>
K3_INLINE __m512i encode64(std::uint16_t const* p, __m512 vinv) noexcept {
  auto const enc = [&](__m512i xb) { return Normal ? encode16_normal(xb, vinv) : encode16(xb, vinv); };
  __m512i const absm = _mm512_set1_epi16(0x7FFF), z = _mm512_setzero_si512(), sgn = _mm512_set1_epi16(0x80);
  __m512i const r0 = _mm512_loadu_si512(p), r1 = _mm512_loadu_si512(p + 32);
  __m512i const v0 = _mm512_and_si512(r0, absm), v1 = _mm512_and_si512(r1, absm);
  __m512i w0 = _mm512_packus_epi32(enc(_mm512_unpacklo_epi16(z, v0)), enc(_mm512_unpackhi_epi16(z, v0)));
  __m512i w1 = _mm512_packus_epi32(enc(_mm512_unpacklo_epi16(z, v1)), enc(_mm512_unpackhi_epi16(z, v1)));
  w0 = _mm512_ternarylogic_epi32(w0, _mm512_srli_epi16(r0, 8), sgn, 0xF8);  // w | (sign byte & 0x80)
  w1 = _mm512_ternarylogic_epi32(w1, _mm512_srli_epi16(r1, 8), sgn, 0xF8);
  __m512i const b = _mm512_packus_epi16(w0, w1);  // per 128-bit lane: 8 of w0, 8 of w1
  return _mm512_maskz_permutexvar_epi64(__mmask8(0xFF), _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), b);
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// Normal-range tiles with AVX512-BF16 and VBMI: vcvtne2ps2bf16 is an integer round-to-nearest-even
// of an fp32 pattern at bit 16 for 32 lanes at once (always RNE, MXCSR-independent). It gets
// p = (bits(y') >> 4) | (bits(y') & 0xF): bit 20 moved to 16, the 4 dropped bits kept as sticky,
// so it rounds bits(y') at bit 20 exactly. y' = x · (2^-88/s) = y · 2^-88 exactly (the caller
// ensures 1/s >= 2^-38 and every nonzero y >= 2^-6, so both are normal floats): its exponent
// field is 88 less, which makes the rounded pattern code + 0x100 (+ 0x800 for a negative x)
// and gives p the exponent field 2 or 18 (never a denormal or NaN pattern); x = ±0 gives a low
// byte 0. The low bytes are the codes; they and the sign bytes are gathered in element order
// with vpermt2b.
K3_INLINE __m512i round_at_bit20(__m512 y) noexcept {
  __m512i const a = _mm512_castps_si512(y);
  return _mm512_ternarylogic_epi32(_mm512_maskz_srli_epi32(all16, a, 4), a, _mm512_set1_epi32(0xF), 0xF8);
}
inline constexpr auto byte_order = [] {
  struct t { std::int8_t code[64], sign[64]; } r{};
  for (int i = 0; i < 64; ++i) {
    int const c = i / 32, e = i % 32, word = e % 2 == 0 ? e / 2 : 16 + e / 2;
    r.code[i] = static_cast<std::int8_t>(2 * word + 64 * c);
    r.sign[i] = static_cast<std::int8_t>(2 * e + 1 + 64 * c);
  }
  return r;
}();
// The encoder's constants, made once per task and kept in registers: g++ 12 otherwise
// re-broadcasts the set1 constants from general registers inside the tile loop (three extra
// shuffle-port instructions per tile).
struct normal_consts {
  __m512i c15, hi, sgn, code, sign;
  normal_consts() noexcept
      : c15(_mm512_set1_epi32(0xF)), hi(_mm512_set1_epi32(static_cast<int>(0xFFFF0000u))), sgn(_mm512_set1_epi8(static_cast<char>(0x80))),
        code(_mm512_loadu_si512(byte_order.code)), sign(_mm512_loadu_si512(byte_order.sign)) {
    asm("" : "+v"(c15), "+v"(hi), "+v"(sgn));  // opaque values: not rematerialised
  }
};
K3_INLINE __m512i codes32_normal(__m512i raw, __m512 vinv88, normal_consts const& c) noexcept {
  __m512 const ye = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_maskz_slli_epi32(all16, raw, 16)), vinv88);
  __m512 const yo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(raw, c.hi)), vinv88);
  __m512i const ae = _mm512_castps_si512(ye), ao = _mm512_castps_si512(yo);
  __m512i const pe = _mm512_ternarylogic_epi32(_mm512_maskz_srli_epi32(all16, ae, 4), ae, c.c15, 0xF8);  // round_at_bit20
  __m512i const po = _mm512_ternarylogic_epi32(_mm512_maskz_srli_epi32(all16, ao, 4), ao, c.c15, 0xF8);
  // words 0..15: elements 0, 2, .., 30; words 16..31: elements 1, 3, .., 31
  __m512bh const h = _mm512_cvtne2ps_pbh(_mm512_castsi512_ps(po), _mm512_castsi512_ps(pe));
  return reinterpret_cast<__m512i const&>(h);
}
K3_INLINE __m512i encode64_normal_bf16(std::uint16_t const* p, __m512 vinv88, normal_consts const& c) noexcept {
  __m512i const r0 = _mm512_loadu_si512(p), r1 = _mm512_loadu_si512(p + 32);
  __m512i const cd = _mm512_permutex2var_epi8(codes32_normal(r0, vinv88, c), c.code, codes32_normal(r1, vinv88, c));
  __m512i const sg = _mm512_permutex2var_epi8(r0, c.sign, r1);
  return _mm512_ternarylogic_epi32(cd, sg, c.sgn, 0xF8);
}

// OCP MXFP8 (E4M3) of bf16 blocks of 32, two blocks per call: as encode64_normal_bf16 with a
// power-of-two multiplier per block (2^-se · 2^-88) and |y'| capped at 448 · 2^-88 with the sign
// kept (vrangeps "min |.|, sign of the first operand"): the reference's saturating encode, since
// every y in (448, 464) rounds to 448 anyway. Same preconditions on y (nonzero >= 2^-6, 2^-se >= 2^-38).
K3_INLINE __m512i codes32_mx(__m512i raw, __m512 vinv88) noexcept {
  __m512 const cap = _mm512_set1_ps(448.0f * 0x1p-88f);
  __m512 const ye = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_maskz_slli_epi32(all16, raw, 16)), vinv88);
  __m512 const yo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))), vinv88);
  __m512 const ce = _mm512_maskz_range_ps(all16, ye, cap, 0x6), co = _mm512_maskz_range_ps(all16, yo, cap, 0x6);
  __m512bh const h = _mm512_cvtne2ps_pbh(_mm512_castsi512_ps(round_at_bit20(co)), _mm512_castsi512_ps(round_at_bit20(ce)));
  return reinterpret_cast<__m512i const&>(h);
}
K3_INLINE __m512i encode64_mx(std::uint16_t const* p, __m512 vinv88a, __m512 vinv88b) noexcept {
  __m512i const r0 = _mm512_loadu_si512(p), r1 = _mm512_loadu_si512(p + 32);
  __m512i const c = _mm512_permutex2var_epi8(codes32_mx(r0, vinv88a), _mm512_loadu_si512(byte_order.code), codes32_mx(r1, vinv88b));
  __m512i const sg = _mm512_permutex2var_epi8(r0, _mm512_loadu_si512(byte_order.sign), r1);
  return _mm512_ternarylogic_epi32(c, sg, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
}

// Rows [i0, i1) of an MXFP8 (E4M3) quantisation of bf16 (k a multiple of 64 here).
template <class Arch>
void mx_e4m3_rows(const_view<bfloat16, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<std::uint8_t, 2> s, mx_rule rule, index_t i0, index_t i1,
                  bool stream, index_t ahead) {
  using K = kernels<Arch>;
  index_t const k = x.extent(1), nb = k / mx_block;
  alignas(64) std::uint16_t am[16], nz[16];
  alignas(64) std::uint32_t code[16];
  alignas(64) std::uint8_t pair[64];
  alignas(64) float iv[16];
  // contiguous rows are one stream: only its two ends can be partial cache lines
  bool const span = q.stride(0) == k;
  row_writer out(&q(i0, 0), span ? (i1 - i0) * k : k, stream);
  for (index_t i = i0; i < i1; ++i) {
    std::uint16_t const* xr = reinterpret_cast<std::uint16_t const*>(&x(i, 0));
    if (!span && i > i0) out = row_writer(&q(i, 0), k, stream);
    for (index_t g = 0; g < nb; g += 16) {
      int const n = static_cast<int>(std::min<index_t>(16, nb - g));  // even: nb is
      __m512i const m = _mm512_set1_epi16(0x7FFF), one = _mm512_set1_epi16(1);
      __m256i rmax, rmin;
      reduce16_streamed<true>(
          [&](int t, __m512i& vmax, __m512i& vmin1) {
            vmax = _mm512_and_si512(_mm512_loadu_si512(xr + (g + t) * mx_block), m);
            vmin1 = _mm512_sub_epi16(vmax, one);
          },
          n, rmax, rmin);
      __m512i const a = _mm512_maskz_slli_epi32(all16, _mm512_maskz_cvtepu16_epi32(all16, rmax), 16);
      __m512i const mn = _mm512_maskz_add_epi32(all16, _mm512_maskz_cvtepu16_epi32(all16, rmin), _mm512_set1_epi32(1));
      _mm256_store_si256(reinterpret_cast<__m256i*>(am), _mm512_maskz_cvtepi32_epi16(all16, _mm512_maskz_srli_epi32(all16, a, 16)));
      (void)nz;
      __m512i const c = mx_scale_codes<e4m3_format>(a, rule);
      // 2^(127 - code) · 2^-88, for the fast blocks (code <= 165)
      __m512 const inv = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all16, _mm512_sub_epi32(_mm512_set1_epi32(254), c), 23));
      __m512 const ymin = _mm512_maskz_mul_ps(all16, _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all16, mn, 16)), inv);
      __mmask16 const fast = _mm512_cmp_ps_mask(ymin, _mm512_set1_ps(0.015625f), _CMP_GE_OQ) &
                             _mm512_cmple_epi32_mask(c, _mm512_set1_epi32(165)) &
                             _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(detail::nonfinite_bits)));
      _mm512_store_si512(code, c);
      _mm512_store_ps(iv, _mm512_mul_ps(inv, _mm512_set1_ps(0x1p-88f)));
      for (int t = 0; t < n; t += 2) {
        index_t const j = (g + t) * mx_block;
        if (ahead) prefetch_ahead(x, i, j, 2 * mx_block, i1, ahead);
        if (((fast >> t) & 3u) == 3u) {
          s(i, g + t) = static_cast<std::uint8_t>(code[t]);
          s(i, g + t + 1) = static_cast<std::uint8_t>(code[t + 1]);
          out.put(encode64_mx(xr + j, _mm512_set1_ps(iv[t]), _mm512_set1_ps(iv[t + 1])));
          continue;
        }
        for (int u = t; u < t + 2; ++u) {
          index_t const jj = (g + u) * mx_block;
          auto const sc = detail::mx_block_scale<e4m3_format>(std::uint32_t{am[u]} << 16, rule);
          s(i, g + u) = sc.code;
          K::template encode_store<e4m3_format>(&x(i, jj), sc.inv, pair + (u - t) * mx_block, mx_block);
        }
        out.put_bytes(pair);
      }
    }
  }
  if (stream) _mm_sfence();
}
#endif

// ---- OCP MXFP4 (E2M1) of bf16 on AVX-512BW: one 32-element block per register ------------------
// With the scale 2^se, y = x · 2^-se rounds (RNE, saturating) to an E2M1 magnitude code that
// changes only at 0.25 (tie down), 0.75 (tie up), 1.25, 1.75, 2.5, 3.5 and 5 (ties to even), all
// bf16 values whose mantissas end in 5 zero bits. On the 16-bit |x| pattern shifted by se in the
// exponent field and offset by 0.25's pattern,
//   d = |x| + (-se << 7) - (se << 7) - 0x3E80   (unsigned saturating; one of the shifts is 0),
// the code is a function of d >> 5 and of whether d's low 5 bits are nonzero: a 40-entry table
// (vpermt2w). Exact: for normal x the shift is exact scaling and |y| < 8 (d < 0x280); patterns
// saturated to 0 (|y| <= 0.25 or below 2^-126) and bf16-subnormal x (|y| < 2^(-se-126) <= 0.25
// while se >= -124) give code 0, as their y. So: scale codes >= 3, finite blocks. The sign is
// x's (so -0 gives 0x8).
inline constexpr auto e2m1_table = [] {
  struct t { std::uint16_t v[64]; } r{};
  for (std::uint32_t i = 0; i < 64; ++i)  // entry 2h + f: y = bf16(0x3E80 + 32h + f), f = 1 standing for (0, 32)
    r.v[i] = i < 40 ? k3::encode<e2m1_format>(k3::detail::bit_cast<float>((0x3E80u + 32u * (i / 2) + i % 2) << 16), saturation::finite) : 7;
  return r;
}();

K3_INLINE __m128i e2m1_block(__m512i raw, int se) noexcept {
  __m512i const a = _mm512_and_si512(raw, _mm512_set1_epi16(0x7FFF));
  __m512i const d = _mm512_subs_epu16(_mm512_adds_epu16(a, _mm512_set1_epi16(static_cast<short>(std::max(-se, 0) << 7))),
                                      _mm512_set1_epi16(static_cast<short>((std::max(se, 0) << 7) + 0x3E80)));
  __mmask32 const frac = _mm512_test_epi16_mask(d, _mm512_set1_epi16(0x1F));
  __m512i const idx = _mm512_and_si512(_mm512_srli_epi16(d, 4), _mm512_set1_epi16(0x3E));  // 2 (d >> 5)
  __m512i const ix = _mm512_mask_add_epi16(idx, frac, idx, _mm512_set1_epi16(1));
  __m512i c = _mm512_permutex2var_epi16(_mm512_loadu_si512(e2m1_table.v), ix, _mm512_loadu_si512(e2m1_table.v + 32));
  c = _mm512_ternarylogic_epi32(c, _mm512_srli_epi16(raw, 12), _mm512_set1_epi16(8), 0xF8);  // | sign << 3
  // 32-bit lane i: code 2i in bits 0-3, code 2i+1 in bits 16-19 -> byte code 2i | code 2i+1 << 4
  return _mm512_cvtepi32_epi8(_mm512_or_si512(c, _mm512_srli_epi32(c, 12)));
}

// Rows [i0, i1) of an MXFP4 (E2M1) quantisation of bf16 (k a multiple of 32).
template <class Arch>
void mx_e2m1_rows(const_view<bfloat16, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<std::uint8_t, 2> s, mx_rule rule, index_t i0, index_t i1,
                  index_t ahead) {
  using K = kernels<Arch>;
  index_t const k = x.extent(1), nb = k / mx_block;
  alignas(64) std::uint16_t am[16];
  alignas(64) std::uint32_t code[16];
  for (index_t i = i0; i < i1; ++i) {
    std::uint16_t const* xr = reinterpret_cast<std::uint16_t const*>(&x(i, 0));
    std::uint8_t* const qr = &q(i, 0);
    for (index_t g = 0; g < nb; g += 16) {
      int const n = static_cast<int>(std::min<index_t>(16, nb - g));
      __m256i rmax, unused;
      reduce16_streamed<false>(
          [&](int t, __m512i& vmax, __m512i&) { vmax = _mm512_and_si512(_mm512_loadu_si512(xr + (g + t) * mx_block), _mm512_set1_epi16(0x7FFF)); }, n,
          rmax, unused);
      __m512i const a = _mm512_maskz_slli_epi32(all16, _mm512_maskz_cvtepu16_epi32(all16, rmax), 16);
      _mm256_store_si256(reinterpret_cast<__m256i*>(am), _mm512_maskz_cvtepi32_epi16(all16, _mm512_maskz_srli_epi32(all16, a, 16)));
      __m512i const c = mx_scale_codes<e2m1_format>(a, rule);
      __mmask16 const fast = _mm512_cmpge_epi32_mask(c, _mm512_set1_epi32(3)) &
                             _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(detail::nonfinite_bits)));
      _mm512_store_si512(code, c);
      for (int t = 0; t < n; ++t) {
        index_t const j = (g + t) * mx_block;
        if (ahead) prefetch_ahead(x, i, j, mx_block, i1, ahead);
        if ((fast >> t) & 1u) {
          s(i, g + t) = static_cast<std::uint8_t>(code[t]);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + j / 2), e2m1_block(_mm512_loadu_si512(xr + j), static_cast<int>(code[t]) - 127));
        } else {
          auto const sc = detail::mx_block_scale<e2m1_format>(std::uint32_t{am[t]} << 16, rule);
          s(i, g + t) = sc.code;
          K::template encode_store<e2m1_format>(&x(i, j), sc.inv, qr + j / 2, mx_block);
        }
      }
    }
  }
}

// Rows [i0, i1) of a 1x128 quantisation; the last, partial tile goes through kernels<Arch>.
// Per group of 16 tiles: the lane pass (the loads that miss), one transposing reduction per
// quantity, 16 scales in one vector, then the codes from L1. (On AMD, interleaving the next
// group's lane pass with this group's encoding, prefetching whole groups and larger groups were
// all slower with the tensor in DRAM; on Intel, prefetching each tile of the next group while
// encoding the same tile of this one pays: tuning, benchmarks/quant.md.)
template <class Arch, bool Stream>
void rows_impl(const_view<bfloat16, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<float, 2> s, scale_format fmt, index_t i0, index_t i1,
               index_t ahead) {
  using K = kernels<Arch>;
  index_t const k = x.extent(1), full = k / 128;
  if (i0 >= i1) return;
  alignas(64) float sv[16], iv[16], iv88[16];
  alignas(64) std::uint8_t part[128] = {};
  // streaming: contiguous rows of whole 64-byte registers are one stream, so only its two ends
  // can be partial cache lines (masked stores to partial lines are costly next to streaming)
  bool const span = q.stride(0) == k && k % 64 == 0;
  row_writer out(&q(i0, 0), Stream ? (span ? (i1 - i0) * k : k) : 0, Stream);
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  normal_consts const nc;
#endif
  for (index_t i = i0; i < i1; ++i) {
    std::uint16_t const* xr = reinterpret_cast<std::uint16_t const*>(&x(i, 0));
    std::uint8_t* const qr = &q(i, 0);
    if (Stream && !span && i > i0) out = row_writer(qr, k, true);
    auto const emit = [&](index_t j, __m512i r) {  // the 64 codes of columns [j, j + 64)
      if constexpr (Stream)
        out.put(r);
      else
        _mm512_storeu_si512(qr + j, r);
    };
    for (index_t g = 0; g < full; g += 16) {
      int const n = static_cast<int>(std::min<index_t>(16, full - g));
      __m256i dmax, dmin;
      group_max_min(xr + g * 128, n, dmax, dmin);
      tile_classes const c = scales(dmax, dmin, n, fmt, sv, iv, iv88);
      std::uint32_t normal = c.normal;
      for (std::uint32_t z = c.check; z != 0; z &= z - 1) {  // tiles holding a zero (rare)
        int const t = __builtin_ctz(z);
        std::uint32_t const mn = nonzero_min(xr + (g + t) * 128);
        if (mn == 0x10000u || k3::detail::bit_cast<float>(mn << 16) * iv[t] >= 0.015625f) normal |= 1u << t;
      }
      for (int t = 0; t < n; ++t) {
        index_t const j = (g + t) * 128;
        if (ahead) prefetch_ahead(x, i, j, 128, i1, ahead);  // the same tile of the next group
        s(i, g + t) = sv[t];
        if ((c.nan >> t) & 1u) {
          emit(j, _mm512_set1_epi8(static_cast<char>(e4m3_format::nan_code)));
          emit(j + 64, _mm512_set1_epi8(static_cast<char>(e4m3_format::nan_code)));
        } else if ((normal >> t) & 1u) {
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
          __m512 const v = _mm512_set1_ps(iv88[t]);
          emit(j, encode64_normal_bf16(xr + j, v, nc));
          emit(j + 64, encode64_normal_bf16(xr + j + 64, v, nc));
#else
          __m512 const v = _mm512_set1_ps(iv[t]);
          emit(j, encode64<true>(xr + j, v));
          emit(j + 64, encode64<true>(xr + j + 64, v));
#endif
        } else {
          __m512 const v = _mm512_set1_ps(iv[t]);
          emit(j, encode64<false>(xr + j, v));
          emit(j + 64, encode64<false>(xr + j + 64, v));
        }
      }
    }
    if (index_t const j0 = full * 128; j0 < k) {
      bfloat16 const* p = &x(i, j0);
      index_t const n = k - j0;
      std::uint32_t const amax = K::amax_bits(p, n);
      auto const sc = detail::deepseek_scale(amax, fmt);
      s(i, full) = sc.s;
      if (amax >= detail::nonfinite_bits)
        std::memset(part, e4m3_format::nan_code, static_cast<std::size_t>(n));
      else
        K::template encode_store<e4m3_format, false, false>(p, sc.inv, part, n);
      if constexpr (Stream) {
        out.put_bytes(part);
        if (n > 64) out.put_bytes(part + 64);
      } else {
        std::memcpy(qr + j0, part, static_cast<std::size_t>(n));
      }
    }
  }
  if (Stream) _mm_sfence();
}

template <class Arch>
void rows(const_view<bfloat16, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<float, 2> s, scale_format fmt, index_t i0, index_t i1,
          bool stream, index_t ahead) {
  if (stream)
    rows_impl<Arch, true>(x, q, s, fmt, i0, i1, ahead);
  else
    rows_impl<Arch, false>(x, q, s, fmt, i0, i1, ahead);
}
}  // namespace avx512_1x128

namespace kernel {

// bf16 is the top half of an fp32: the max over 16-bit |x| patterns, shifted, is the fp32 amax
// pattern (NaN > Inf > finite still holds), at 32 values per instruction.
template <class Arch>
inline bool amax_bits_bf16(bfloat16 const* p, index_t n, std::uint32_t& out, requires_arch<xsimd::avx512bw>) noexcept {
  __m512i m = _mm512_setzero_si512();
  __m512i const mask = _mm512_set1_epi16(0x7FFF);
  index_t j = 0;
  for (; j + 32 <= n; j += 32)
    m = _mm512_maskz_max_epu16(__mmask32(0xFFFFFFFFu), m, _mm512_and_si512(_mm512_loadu_si512(reinterpret_cast<void const*>(p + j)), mask));
  alignas(64) std::uint16_t lanes[32];
  _mm512_store_si512(reinterpret_cast<void*>(lanes), m);
  std::uint32_t r = 0;
  for (int l = 0; l < 32; ++l) r = std::max<std::uint32_t>(r, lanes[l]);
  r <<= 16;
  for (; j < n; ++j) r = std::max(r, detail::abs_bits(load_as<float>(p[j])));
  out = r;
  return true;
}

template <class Arch, class B>
inline bool fp8_1x128_rows(B const& b, const_view<bfloat16, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<float, 2> s, scale_format fmt,
                           store_mode mode, tuning const& tune, requires_arch<xsimd::avx512bw>) {
  index_t const m = x.extent(0), k = x.extent(1);
  bool const stream = tune.stream(mode, static_cast<std::size_t>(m * k));
  index_t const rpt = task_rows(b, m, 16);
  k3::run_tasks(b, detail::ceil_div(m, rpt), [&](index_t task) {
    avx512_1x128::rows<Arch>(x, q, s, fmt, task * rpt, std::min(m, (task + 1) * rpt), stream, tune.prefetch_distance);
  });
  return true;
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512DQ__)
template <class Arch, class B>
inline bool mx_e4m3_rows(B const& b, const_view<bfloat16, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<std::uint8_t, 2> s, mx_rule rule,
                         store_mode mode, tuning const& tune, requires_arch<xsimd::avx512bw>) {
  index_t const m = x.extent(0), k = x.extent(1);
  if (k % (2 * mx_block) != 0) return false;
  bool const stream = tune.stream(mode, static_cast<std::size_t>(m * k));
  index_t const rpt = task_rows(b, m, 8);
  k3::run_tasks(b, detail::ceil_div(m, rpt), [&](index_t task) {
    avx512_1x128::mx_e4m3_rows<Arch>(x, q, s, rule, task * rpt, std::min(m, (task + 1) * rpt), stream, tune.prefetch_distance);
  });
  return true;
}
#endif

template <class Arch, class B>
inline bool mx_e2m1_rows(B const& b, const_view<bfloat16, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<std::uint8_t, 2> s, mx_rule rule,
                         index_t rows_per_task, tuning const& tune, requires_arch<xsimd::avx512bw>) {
  index_t const m = x.extent(0);
  k3::run_tasks(b, detail::ceil_div(m, rows_per_task), [&](index_t task) {
    avx512_1x128::mx_e2m1_rows<Arch>(x, q, s, rule, task * rows_per_task, std::min(m, (task + 1) * rows_per_task), tune.prefetch_distance);
  });
  return true;
}

}  // namespace kernel
}  // namespace k3::quant::simd_impl
#endif
