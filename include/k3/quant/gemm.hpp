// k3/quant/gemm.hpp — the block-scaled FP8 GEMM for the SIMD/threads CPU backends:
// C = dequant(A) · dequant(B)^T with A in 1x128 tiles and B in 128x128 blocks, computed the
// DeepSeek-V3 way. Per 128-wide K block, E4M3 operands are decoded (a 256-entry table) into
// packed float panels and an MR x NR register tile accumulates the block's partial sums in
// fp32 in k order (every e4m3·e4m3 product is exact in fp32, so fma == add of the product);
// the partial tile is then promoted into C with one fma by sa[i,kb]·sb[n/128,kb]. This is the
// reference's exact operation order, so the result is bit-identical to
// reference::fp8_block_gemm_rows. Threads split C into (MC rows x 128 columns) tasks.
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/simd.hpp"
#include "k3/quant/common.hpp"
#include "k3/quant/simd.hpp"

namespace k3::quant::gemm_impl {

inline constexpr std::array<float, 256> e4m3_table = [] {
  std::array<float, 256> t{};
  for (unsigned c = 0; c < 256; ++c) t[c] = decode<e4m3_format>(static_cast<std::uint8_t>(c));
  return t;
}();

// c + a·b with a single rounding. On AVX-512 k3::simd::fma is the fused instruction (the
// intrinsic: xsimd 8.1 has no AVX-512 fma kernel); other ISAs fma lane by lane: the promotion
// must round exactly as the reference's std::fma. (The partial sums need no fused
// multiply-add: e4m3 products are exact in fp32.)
template <class Arch>
K3_INLINE xsimd::batch<float, Arch> fused_fma(xsimd::batch<float, Arch> a, xsimd::batch<float, Arch> b, xsimd::batch<float, Arch> c) {
  if constexpr (std::is_base_of_v<xsimd::avx512f, Arch>) {
    return k3::simd::fma(a, b, c);
  } else
  {
    constexpr std::size_t L = xsimd::batch<float, Arch>::size;
    alignas(64) float av[L], bv[L], cv[L];
    a.store_aligned(av);
    b.store_aligned(bv);
    c.store_aligned(cv);
    for (std::size_t l = 0; l < L; ++l) cv[l] = std::fma(av[l], bv[l], cv[l]);
    return xsimd::batch<float, Arch>::load_aligned(cv);
  }
}

template <class Arch, class B>
void fp8_block_gemm(B const& b, const_view<std::uint8_t, 2> qa, const_view<float, 2> sa, const_view<std::uint8_t, 2> qb,
                    const_view<float, 2> sb, tensor_view<float, 2> c) {
  using bf = xsimd::batch<float, Arch>;
  constexpr index_t L = static_cast<index_t>(bf::size);
  constexpr index_t NR = 2 * L;             // divides 128 for L in {4, 8, 16}
  constexpr index_t MR = L >= 16 ? 8 : 6;   // 2·MR accumulators fit the register file
  constexpr index_t MC = MR * 8;
  constexpr index_t KB = 128, NB = 128;
  static_assert(NB % NR == 0);
  index_t const m = qa.extent(0), k = qa.extent(1), n = qb.extent(0);
  index_t const mblocks = detail::ceil_div(m, MC), nblocks = detail::ceil_div(n, NB), kblocks = detail::ceil_div(k, KB);
  float const* lut = e4m3_table.data();

  k3::run_tasks(b, mblocks * nblocks, [&](index_t task) {
    index_t const mb = task / nblocks, nb = task % nblocks;
    index_t const i0 = mb * MC, mc = std::min(MC, m - i0);
    index_t const n0 = nb * NB, nc = std::min(NB, n - n0);
    std::vector<float> ap_store(static_cast<std::size_t>(MC * KB) + 16), bp_store(static_cast<std::size_t>(NB * KB) + 16);
    float* ap = ap_store.data();
    float* bp = bp_store.data();
    alignas(64) float tmp[MR * NR] = {};
    for (index_t kb = 0; kb < kblocks; ++kb) {
      index_t const k0 = kb * KB, kc = std::min(KB, k - k0);
      // A as ap[ii / MR][kk][r] and B as bp[jj / NR][kk][cc]: `rows` decoded rows of q from
      // row0 in panels of R, zero past `live`.
      auto pack = [&]<index_t R>(float* out, const_view<std::uint8_t, 2> q, index_t row0, index_t rows, index_t live) {
        for (index_t ii = 0; ii < rows; ii += R)
          for (index_t r = 0; r < R; ++r) {
            float* dst = out + ii * kc + r;
            if (ii + r < live) {
              std::uint8_t const* src = &q(row0 + ii + r, k0);
              index_t const st = q.stride(1);
              for (index_t kk = 0; kk < kc; ++kk) dst[kk * R] = lut[src[kk * st]];
            } else {
              for (index_t kk = 0; kk < kc; ++kk) dst[kk * R] = 0.0f;
            }
          }
      };
      pack.template operator()<MR>(ap, qa, i0, MC, mc);
      pack.template operator()<NR>(bp, qb, n0, NB, nc);
      float const sbv = sb(nb, kb);
      for (index_t ii = 0; ii < mc; ii += MR) {
        float const* a = ap + ii * kc;
        for (index_t jj = 0; jj < nc; jj += NR) {
          float const* bpan = bp + jj * kc;
          bf p0[MR], p1[MR];
          for (index_t r = 0; r < MR; ++r) p0[r] = p1[r] = bf(0.0f);
          for (index_t kk = 0; kk < kc; ++kk) {
            bf const b0 = bf::load_unaligned(bpan + kk * NR), b1 = bf::load_unaligned(bpan + kk * NR + L);
            for (index_t r = 0; r < MR; ++r) {
              bf const av(a[kk * MR + r]);
              p0[r] = k3::simd::fma(av, b0, p0[r]);
              p1[r] = k3::simd::fma(av, b1, p1[r]);
            }
          }
          // promote: c = fma(p, sa·sb, c) (c = 0 before the first K block)
          index_t const rows = std::min(MR, mc - ii), cols = std::min(NR, nc - jj);
          bool const direct = cols == NR && c.stride(1) == 1;
          for (index_t r = 0; r < rows; ++r) {
            bf const sc(sa(i0 + ii + r, kb) * sbv);
            float* crow = direct ? &c(i0 + ii + r, n0 + jj) : tmp + r * NR;
            if (!direct && kb > 0)
              for (index_t cc = 0; cc < cols; ++cc) crow[cc] = c(i0 + ii + r, n0 + jj + cc);
            bf c0 = kb > 0 ? bf::load_unaligned(crow) : bf(0.0f);
            bf c1 = kb > 0 ? bf::load_unaligned(crow + L) : bf(0.0f);
            fused_fma<Arch>(p0[r], sc, c0).store_unaligned(crow);
            fused_fma<Arch>(p1[r], sc, c1).store_unaligned(crow + L);
            if (!direct)
              for (index_t cc = 0; cc < cols; ++cc) c(i0 + ii + r, n0 + jj + cc) = crow[cc];
          }
        }
      }
    }
  });
}

}  // namespace k3::quant::gemm_impl
