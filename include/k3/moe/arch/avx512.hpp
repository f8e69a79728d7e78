// k3/moe/arch/avx512.hpp — the router's kernels on AVX-512 (F, BW and BMI2): the mask-pass
// selection of a token's k+1 best, the paired binning, the merge of the per-thread counts, and
// the lane masks and compresses of the portable selection, for xsimd::avx512bw and the
// architectures derived from it (kernel::route_kernels<Arch>). Empty unless the translation unit
// is compiled for all three.
#pragma once
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "k3/moe/arch/generic.hpp"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__BMI2__)
#include <immintrin.h>

namespace k3::moe::detail {

// AVX-512 top-(k+1) for one token, exact and bit-identical to rank_token:
//  1. one pass over the row keeps only the 16-lane masks of z >= g_lo (generous guess, from
//     running statistics of the cut-off) and checks finiteness: no compress, no data stores;
//  2. the ~20 non-empty vectors give the candidates (index order): their s and b are
//     reloaded from L1 and compressed;
//  3. in registers, the candidates z >= g_hi (tight guess) are compressed again; if at least
//     k+1 remain, only they are ranked (the k+1 best overall are among them);
//  4. rank(a) = #{b : z_b > z_a}, a popcount of one broadcast compare per candidate vector;
//     without ties the ranks are 0..c-1 (checked), so each candidate lands in its slot.
//     A tie, too few or too many candidates take the general path.
// The guesses only affect speed.
struct select_state512 {
  float mean = 0.f, dev = 0.f;  // running mean / mean absolute deviation of the cut-off
  bool primed = false;
  // Candidate masks of the two guesses, 1024 experts at most; past the row: 0.
  alignas(64) std::uint16_t mlo[64] = {};
  alignas(64) std::uint16_t mhi[64] = {};
  alignas(64) float cz[64 + 64] = {};  // <= 64 candidates, plus room for the -inf pads
  alignas(64) std::int32_t cj[64 + 64] = {};
  alignas(64) float tz[64] = {};  // the result: biased scores and experts in ranking order
  alignas(64) std::int32_t tj[64] = {};
};

// Count and bitmap of the non-empty 16-lane masks (bit v: experts 16 v .. 16 v + 15).
inline index_t mask_summary512(std::uint16_t const* masks, std::uint64_t& nz) {
  __m512i const m0 = _mm512_load_si512(masks), m1 = _mm512_load_si512(masks + 32);
  nz = std::uint64_t(_mm512_test_epi16_mask(m0, m0)) | std::uint64_t(_mm512_test_epi16_mask(m1, m1)) << 32;
#if defined(__AVX512VPOPCNTDQ__)
  return static_cast<index_t>(_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_popcnt_epi64(m0), _mm512_popcnt_epi64(m1))));
#else
  alignas(64) std::uint64_t words[16];
  _mm512_store_si512(words, m0);
  _mm512_store_si512(words + 8, m1);
  index_t c = 0;
  for (auto x : words) c += std::popcount(x);
  return c;
#endif
}


// The candidate pass: the masks of z >= lo and z >= hi (lo <= hi), nothing else stored.
// Finiteness rides along as an FMA accumulator z * 0 + acc (NaN iff some z is inf or NaN; a
// finite s whose s + b overflows also lands there, and the general path then tells the two
// apart), one per unrolled vector so that its latency chain stays short.
inline bool mask_pass512(float const* K3_RESTRICT s, float const* K3_RESTRICT b, index_t n, float lo, float hi,
                         std::uint16_t* K3_RESTRICT mlo, std::uint16_t* K3_RESTRICT mhi, select_prefetch const& ahead = {}) {
  __m512 const vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi), zero = _mm512_setzero_ps();
  __m512 f0 = zero, f1 = zero, f2 = zero, f3 = zero;
  index_t const nw = n / 64;
  for (index_t q = 0; q < nw; ++q) {
    float const* K3_RESTRICT sq = s + 64 * q;
    float const* K3_RESTRICT bq = b + 64 * q;
    ahead.in_pass();
    __m512 const z0 = _mm512_add_ps(_mm512_loadu_ps(sq), _mm512_loadu_ps(bq));
    __m512 const z1 = _mm512_add_ps(_mm512_loadu_ps(sq + 16), _mm512_loadu_ps(bq + 16));
    __m512 const z2 = _mm512_add_ps(_mm512_loadu_ps(sq + 32), _mm512_loadu_ps(bq + 32));
    __m512 const z3 = _mm512_add_ps(_mm512_loadu_ps(sq + 48), _mm512_loadu_ps(bq + 48));
    f0 = _mm512_fmadd_ps(z0, zero, f0);
    f1 = _mm512_fmadd_ps(z1, zero, f1);
    f2 = _mm512_fmadd_ps(z2, zero, f2);
    f3 = _mm512_fmadd_ps(z3, zero, f3);
    mlo[4 * q] = _mm512_cmp_ps_mask(z0, vlo, _CMP_GE_OQ);
    mlo[4 * q + 1] = _mm512_cmp_ps_mask(z1, vlo, _CMP_GE_OQ);
    mlo[4 * q + 2] = _mm512_cmp_ps_mask(z2, vlo, _CMP_GE_OQ);
    mlo[4 * q + 3] = _mm512_cmp_ps_mask(z3, vlo, _CMP_GE_OQ);
    mhi[4 * q] = _mm512_cmp_ps_mask(z0, vhi, _CMP_GE_OQ);
    mhi[4 * q + 1] = _mm512_cmp_ps_mask(z1, vhi, _CMP_GE_OQ);
    mhi[4 * q + 2] = _mm512_cmp_ps_mask(z2, vhi, _CMP_GE_OQ);
    mhi[4 * q + 3] = _mm512_cmp_ps_mask(z3, vhi, _CMP_GE_OQ);
  }
  for (index_t j = 64 * nw; j < n; j += 16) {
    ahead.in_pass();
    __mmask16 const valid = static_cast<__mmask16>(_bzhi_u32(0xffffu, static_cast<unsigned>(std::min<index_t>(n - j, 16))));
    __m512 const z = _mm512_add_ps(_mm512_maskz_loadu_ps(valid, s + j), _mm512_maskz_loadu_ps(valid, b + j));
    f0 = _mm512_fmadd_ps(z, zero, f0);
    mlo[j / 16] = _mm512_mask_cmp_ps_mask(valid, z, vlo, _CMP_GE_OQ);
    mhi[j / 16] = _mm512_mask_cmp_ps_mask(valid, z, vhi, _CMP_GE_OQ);
  }
  __m512 const f = _mm512_add_ps(_mm512_add_ps(f0, f1), _mm512_add_ps(f2, f3));
  return _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q) == 0;
}

// The candidates of one mask set, in index order, from the non-empty vectors only (their s
// and b are still in L1), padded with -inf to whole vectors (two past the count).
inline index_t extract512(float const* K3_RESTRICT s, float const* K3_RESTRICT b, std::uint16_t const* K3_RESTRICT masks,
                          std::uint64_t nz, float* K3_RESTRICT cz, std::int32_t* K3_RESTRICT cj) {
  __m512i const lane_iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 const ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  index_t o = 0;
  while (nz) {
    unsigned const v = static_cast<unsigned>(std::countr_zero(nz));
    nz &= nz - 1;
    __mmask16 const mk = masks[v];
    index_t const j = 16 * index_t(v);
    __m512 const z = _mm512_add_ps(_mm512_maskz_loadu_ps(mk, s + j), _mm512_maskz_loadu_ps(mk, b + j));
    _mm512_storeu_ps(cz + o, _mm512_maskz_compress_ps(mk, z));
    _mm512_storeu_si512(cj + o, _mm512_maskz_compress_epi32(mk, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j)), lane_iota)));
    o += std::popcount(static_cast<unsigned>(mk));
  }
  _mm512_storeu_ps(cz + o, ninf);
  _mm512_storeu_ps(cz + o + 16, ninf);
  return o;
}

// Ranks the c candidates (index order; lanes from c up to 16 NV hold -inf, which never
// counts) into tz/tj in ranking order. Returns false on a tie (two candidates with one rank).
template <int NV>
inline bool rank_candidates512(float const* K3_RESTRICT cz, std::int32_t const* K3_RESTRICT cj, index_t c, float* K3_RESTRICT tz,
                               std::int32_t* K3_RESTRICT tj, select_prefetch const& ahead) {
  __m512 zv[NV];
  for (int v = 0; v < NV; ++v) zv[v] = _mm512_load_ps(cz + 16 * v);
  std::uint64_t used = 0;
  for (index_t a = 0; a < c; ++a) {
    __m512 const za = _mm512_set1_ps(cz[a]);
    std::uint64_t gt;
    if constexpr (NV == 1) {
      gt = _mm512_cmp_ps_mask(zv[0], za, _CMP_GT_OQ);
    } else if constexpr (NV == 2) {
      gt = _cvtmask32_u32(_mm512_kunpackw(_mm512_cmp_ps_mask(zv[1], za, _CMP_GT_OQ), _mm512_cmp_ps_mask(zv[0], za, _CMP_GT_OQ)));
    } else {
      gt = 0;
      for (int v = 0; v < NV; ++v) gt |= std::uint64_t(_mm512_cmp_ps_mask(zv[v], za, _CMP_GT_OQ)) << (16 * v);
    }
    unsigned const r = static_cast<unsigned>(std::popcount(gt));
    tz[r] = cz[a];
    tj[r] = cj[a];
    used |= std::uint64_t(1) << r;
    ahead.in_rank();
  }
  return used == _bzhi_u64(~std::uint64_t(0), static_cast<unsigned>(c));
}

// Returns false when the caller must use the general path (exact for any input, and the one
// that reports non-finite scores). On success st.tz / st.tj hold the kk best in ranking order.
// `ahead` spreads a prefetch stream over the pass and the ranking (the caller chooses how much
// of it goes where; see route_threads_impl).
inline bool select_token512(float const* K3_RESTRICT s, float const* K3_RESTRICT b, index_t n, index_t kk, select_state512& st,
                            select_prefetch const& ahead = {}) {
  if (!st.primed || n > 1024 || kk > 49) return false;
  float const g_lo = st.mean - 2.5f * st.dev - 1e-30f, g_hi = st.mean - 0.6f * st.dev;
  if (!mask_pass512(s, b, n, g_lo, g_hi, st.mlo, st.mhi, ahead)) return false;  // non-finite: the general path reports it
  std::uint64_t nz;
  // The tight set if it holds k+1 candidates (the k+1 best overall are then among them),
  // else the generous one; a token far below the running cut-off lowers the guess twice.
  index_t c = mask_summary512(st.mhi, nz);
  std::uint16_t const* masks = st.mhi;
  if (c < kk) {
    masks = st.mlo;
    c = mask_summary512(st.mlo, nz);
    for (int tries = 0; c < kk && tries < 2; ++tries) {
      float const g = g_lo - float(4 << (2 * tries)) * (st.dev + 1e-30f);
      mask_pass512(s, b, n, g, g, st.mlo, st.mhi);
      c = mask_summary512(st.mlo, nz);
    }
  }
  if (c < kk || c > 64) return false;
  extract512(s, b, masks, nz, st.cz, st.cj);
  if (c <= 16) return rank_candidates512<1>(st.cz, st.cj, c, st.tz, st.tj, ahead);
  if (c <= 32) return rank_candidates512<2>(st.cz, st.cj, c, st.tz, st.tj, ahead);
  return rank_candidates512<4>(st.cz, st.cj, c, st.tz, st.tj, ahead);
}

// emit_token from the ranked arrays, the divisions done 16 lanes at a time (the same IEEE
// operations per weight, so the results are identical; the sum keeps its sequential order).
inline void emit_token512(index_t i, float const* s, float const* tz, std::int32_t const* tj, router_options const& opt,
                          route_outputs const& out, bool contiguous) {
  index_t const k = opt.k;
  alignas(64) float sv[64];
  float sum = 0.f;
  for (index_t r = 0; r < k; ++r) {
    float x = s[tj[r]];
    asm("" : "+x"(x));  // 16 plain loads: a vector gather is slower here
    sv[r] = x;
    sum += x;
  }
  __m512 const denom = _mm512_set1_ps(sum > 0.f ? sum : 1.f), scale = _mm512_set1_ps(opt.routed_scale);
  if (contiguous) {
    float* K3_RESTRICT wrow = &out.weights(i, 0);
    std::int32_t* K3_RESTRICT irow = &out.indices(i, 0);
    for (index_t r = 0; r < k; r += 16) {
      __mmask16 const m = static_cast<__mmask16>(_bzhi_u32(0xffffu, static_cast<unsigned>(std::min<index_t>(k - r, 16))));
      _mm512_mask_storeu_ps(wrow + r, m, _mm512_mul_ps(_mm512_div_ps(_mm512_load_ps(sv + r), denom), scale));
      _mm512_mask_storeu_epi32(irow + r, m, _mm512_load_si512(tj + r));
    }
  } else {
    for (index_t r = 0; r < k; r += 16)
      _mm512_store_ps(sv + r, _mm512_mul_ps(_mm512_div_ps(_mm512_load_ps(sv + r), denom), scale));
    for (index_t r = 0; r < k; ++r) {
      out.indices(i, r) = tj[r];
      out.weights(i, r) = sv[r];
    }
  }
  if (!out.cutoff.empty()) out.cutoff(i) = tz[k];
}

// Running statistics of the cut-off (rank k) that set the next token's guesses.
inline void observe_cutoff512(select_state512& st, float cut, float top) {
  if (!st.primed) {
    st.mean = cut;
    st.dev = 0.25f * (top - cut);
    st.primed = std::isfinite(st.mean) && std::isfinite(st.dev);
    return;
  }
  float const d = cut - st.mean;
  st.mean += 0.125f * d;
  st.dev += 0.125f * (std::fabs(d) - st.dev);
  if (!(std::isfinite(st.mean) && std::isfinite(st.dev))) st.primed = false;
}

}  // namespace k3::moe::detail

namespace k3::moe::kernel {

// An AVX-512 comparison gives a mask register: its bits are the lanes.
template <class Arch>
inline std::uint64_t lane_mask(xsimd::batch_bool<float, Arch> const& b, requires_arch<xsimd::avx512f>) noexcept {
  __mmask16 const m = b;
  return static_cast<std::uint64_t>(m);
}

template <class Arch>
  requires std::is_base_of_v<xsimd::avx512bw, Arch>
struct route_kernels<Arch> {
  static constexpr bool fast_select = true;
  using select_state = detail::select_state512;
  static bool select(float const* K3_RESTRICT s, float const* K3_RESTRICT b, index_t n, index_t kk, select_state& st,
                     detail::select_prefetch const& ahead) {
    return detail::select_token512(s, b, n, kk, st, ahead);
  }
  static void observe(select_state& st, float cut, float top) { detail::observe_cutoff512(st, cut, top); }
  static void emit(index_t i, float const* s, float const* tz, std::int32_t const* tj, router_options const& opt, detail::route_outputs const& out,
                   bool contiguous) {
    detail::emit_token512(i, s, tz, tj, opt, out, contiguous);
  }

  static constexpr bool paired_bins = true;
  // qb_bin of experts [0, n / 32 * 32), two 16-lane vectors packed by one vpackusdw.
  static index_t bin_pairs(float const* K3_RESTRICT s, float alpha, index_t n, float lo, float inv_w, std::int32_t B,
                           std::uint16_t* K3_RESTRICT out) noexcept {
    index_t j = 0;
    // qb_bin in fewer micro-ops (512-bit operations issue on two ports only): the upper clamp
    // in float, the floor folded into the conversion (round toward -inf), the lower clamp
    // done by the unsigned saturation of the pack. Same bins: below B - 1 both take the floor
    // of the same float; -inf and values under INT_MIN convert to INT_MIN and saturate to 0.
    __m512 const a = _mm512_set1_ps(alpha), l = _mm512_set1_ps(lo), iv = _mm512_set1_ps(inv_w), mx = _mm512_set1_ps(float(B - 1));
    for (; j + 32 <= n; j += 32) {
      __m512 const x0 = _mm512_mul_ps(_mm512_sub_ps(_mm512_sub_ps(a, _mm512_loadu_ps(s + j)), l), iv);
      __m512 const x1 = _mm512_mul_ps(_mm512_sub_ps(_mm512_sub_ps(a, _mm512_loadu_ps(s + j + 16)), l), iv);
      __m512i const i0 = _mm512_cvt_roundps_epi32(_mm512_min_ps(x0, mx), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      __m512i const i1 = _mm512_cvt_roundps_epi32(_mm512_min_ps(x1, mx), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      _mm512_storeu_si512(out + j, _mm512_packus_epi32(i0, i1));
    }
    return j;
  }
  static bool store_bins(xsimd::batch<std::int32_t, Arch> const& ib, std::uint16_t* out) noexcept {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(static_cast<__m512i>(ib)));
    return true;
  }
  // 64 counts at a time, in 16-bit sums (P <= 257 counts below 256 cannot wrap); lines of eight
  // sums that are all 0 are neither read nor written, and `fresh` ones are streamed.
  static std::int64_t merge_lines(std::int64_t* K3_RESTRICT H, std::uint8_t const* const* parts, std::int64_t P, std::int64_t x, std::int64_t e,
                                  bool fresh) noexcept {
    if (P > 257) return x;
    auto one = [&](std::int64_t y) {
      std::int64_t v = 0;
      for (std::int64_t p = 0; p < P; ++p) v += parts[p][y];
      if (v != 0) H[y] = fresh ? v : H[y] + v;
    };
    for (; x < e && (reinterpret_cast<std::uintptr_t>(H + x) & 63) != 0; ++x) one(x);
    for (; x + 64 <= e; x += 64) {
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (std::int64_t p = 0; p < P; ++p) {
        lo = _mm512_add_epi16(lo, _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(parts[p] + x))));
        hi = _mm512_add_epi16(hi, _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(parts[p] + x + 32))));
      }
      if ((_mm512_test_epi16_mask(lo, lo) | _mm512_test_epi16_mask(hi, hi)) == 0) continue;
      alignas(64) std::uint16_t sum[64];
      _mm512_store_si512(sum, lo);
      _mm512_store_si512(sum + 32, hi);
      for (int q = 0; q < 8; ++q) {
        __m512i const v = _mm512_cvtepu16_epi64(_mm_load_si128(reinterpret_cast<__m128i const*>(sum + 8 * q)));
        if (_mm512_test_epi64_mask(v, v) == 0) continue;
        auto* at = reinterpret_cast<__m512i*>(H + x + 8 * q);
        if (fresh)
          _mm512_stream_si512(at, v);
        else
          _mm512_store_si512(at, _mm512_add_epi64(v, _mm512_load_si512(at)));
      }
    }
    if (fresh) _mm_sfence();  // the streamed counts before the task's end is published
    return x;
  }
  // Branchless: compress the qualifying lanes in a register (a compress straight to memory is
  // microcoded on some cores), store the full vector, advance by the popcount.
  static bool compress_candidates(xsimd::batch<float, Arch> const& z, xsimd::batch<float, Arch> const& vg, index_t j, float* K3_RESTRICT cz,
                                  std::int32_t* K3_RESTRICT cj, index_t& c) noexcept {
    __m512i const lane_iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 const mk = _mm512_cmp_ps_mask(z, vg, _CMP_GE_OQ);
    __m512i const ids = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j)), lane_iota);
    _mm512_storeu_ps(cz + c, _mm512_maskz_compress_ps(mk, static_cast<__m512>(z)));
    _mm512_storeu_si512(cj + c, _mm512_maskz_compress_epi32(mk, ids));
    c += std::popcount(static_cast<unsigned>(mk));
    return true;
  }
};

}  // namespace k3::moe::kernel
#endif
