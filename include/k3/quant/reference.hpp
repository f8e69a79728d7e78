// k3/quant/reference.hpp — scalar reference block quantizers, dequantizers and the
// block-scaled GEMM (k3::cpu::serial runs these; the SIMD/threads paths are tested against
// them byte for byte). Any strides. Arguments are validated by the callers in k3/quant.hpp.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "k3/quant/common.hpp"

namespace k3::quant::reference {

using k3::quant::detail::abs_bits;

// ---- DeepSeek FP8 tiles ----------------------------------------------------------------------
// Tile rows [rb0, rb1) of the scale grid.
template <class T>
void fp8_quantize_rows(const_view<T, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<float, 2> s, tile t, scale_format fmt,
                       index_t rb0, index_t rb1) {
  index_t const m = x.extent(0), k = x.extent(1);
  for (index_t rb = rb0; rb < rb1; ++rb) {
    index_t const i0 = rb * t.rows, i1 = std::min(m, i0 + t.rows);
    for (index_t cb = 0; cb < s.extent(1); ++cb) {
      index_t const j0 = cb * t.cols, j1 = std::min(k, j0 + t.cols);
      std::uint32_t amax = 0;
      for (index_t i = i0; i < i1; ++i)
        for (index_t j = j0; j < j1; ++j) amax = std::max(amax, abs_bits(load_as<float>(x(i, j))));
      auto const sc = detail::deepseek_scale(amax, fmt);
      s(rb, cb) = sc.s;
      for (index_t i = i0; i < i1; ++i)
        for (index_t j = j0; j < j1; ++j) q(i, j) = encode<e4m3_format>(load_as<float>(x(i, j)) * sc.inv, saturation::finite);
    }
  }
}

template <class Out>
void fp8_dequantize_rows(const_view<std::uint8_t, 2> q, const_view<float, 2> s, tensor_view<Out, 2> y, tile t, index_t i0, index_t i1) {
  for (index_t i = i0; i < i1; ++i)
    for (index_t j = 0; j < q.extent(1); ++j)
      y(i, j) = store_as<Out>(decode<e4m3_format>(q(i, j)) * s(i / t.rows, j / t.cols));
}

// 1x128 -> 128x1: dequantize each value, re-quantize in 128-row column tiles (columns
// [j0, j1)). Identical to fp8_quantize(dequantize(q, s), 128x1) without the temporary.
inline void fp8_requantize_cols(const_view<std::uint8_t, 2> q, const_view<float, 2> s, tensor_view<std::uint8_t, 2> q2,
                                tensor_view<float, 2> s2, scale_format fmt, index_t j0, index_t j1) {
  index_t const m = q.extent(0);
  for (index_t rb = 0; rb < s2.extent(0); ++rb) {
    index_t const i0 = rb * 128, i1 = std::min(m, i0 + 128);
    for (index_t j = j0; j < j1; ++j) {
      std::uint32_t amax = 0;
      for (index_t i = i0; i < i1; ++i) amax = std::max(amax, abs_bits(decode<e4m3_format>(q(i, j)) * s(i, j / 128)));
      auto const sc = detail::deepseek_scale(amax, fmt);
      s2(rb, j) = sc.s;
      for (index_t i = i0; i < i1; ++i)
        q2(i, j) = encode<e4m3_format>((decode<e4m3_format>(q(i, j)) * s(i, j / 128)) * sc.inv, saturation::finite);
    }
  }
}

// ---- OCP MX ------------------------------------------------------------------------------------
template <class F, class T>
void mx_quantize_rows(const_view<T, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<std::uint8_t, 2> s, mx_rule rule, index_t i0,
                      index_t i1) {
  constexpr bool packed = F::bits == 4;
  for (index_t i = i0; i < i1; ++i) {
    for (index_t b = 0; b < s.extent(1); ++b) {
      index_t const j0 = b * mx_block;
      std::uint32_t amax = 0;
      for (index_t j = j0; j < j0 + mx_block; ++j) amax = std::max(amax, abs_bits(load_as<float>(x(i, j))));
      auto const sc = detail::mx_block_scale<F>(amax, rule);
      s(i, b) = sc.code;
      for (index_t j = j0; j < j0 + mx_block; j += (packed ? 2 : 1)) {
        std::uint8_t c0 = encode<F>(load_as<float>(x(i, j)) * sc.inv, saturation::finite);
        if constexpr (packed) {
          std::uint8_t c1 = encode<F>(load_as<float>(x(i, j + 1)) * sc.inv, saturation::finite);
          q(i, j / 2) = pack_fp4(c0, c1);
        } else {
          q(i, j) = c0;
        }
      }
    }
  }
}

template <class F, class Out>
void mx_dequantize_rows(const_view<std::uint8_t, 2> q, const_view<std::uint8_t, 2> s, tensor_view<Out, 2> y, index_t i0, index_t i1) {
  constexpr bool packed = F::bits == 4;
  for (index_t i = i0; i < i1; ++i)
    for (index_t j = 0; j < y.extent(1); ++j) {
      std::uint8_t const c = packed ? ((j & 1) ? fp4_odd(q(i, j / 2)) : fp4_even(q(i, j / 2))) : q(i, j);
      y(i, j) = store_as<Out>(decode<F>(c) * decode<e8m0_format>(s(i, j / mx_block)));
    }
}

// ---- NVFP4 ----------------------------------------------------------------------------------------
// Amax over the finite values (so a NaN/Inf only poisons its own block).
template <class T>
std::uint32_t finite_amax_bits(const_view<T, 2> x, index_t i0, index_t i1) {
  std::uint32_t amax = 0;
  for (index_t i = i0; i < i1; ++i)
    for (index_t j = 0; j < x.extent(1); ++j) {
      std::uint32_t a = abs_bits(load_as<float>(x(i, j)));
      if (a < detail::nonfinite_bits) amax = std::max(amax, a);
    }
  return amax;
}

// g = amax / (448·6). A subnormal g is kept: cutting at FLT_MIN (amax < 3.2e-35) sent whole
// tensors of normal floats to zero. Only below 2^-140 (amax < 2.4e-39, subnormal inputs) does
// an all-zero (or all-non-finite) tensor, or one whose g would lose its last bits, get g = 1
// (every block then encodes as zeros or NaN); from 2^-140 up the divisor g·sb >= g·2^-6 stays
// a non-zero float.
inline constexpr float nvfp4_min_tensor_scale = 0x1p-140f;
inline float nvfp4_scale_from_amax(std::uint32_t amax_bits) noexcept {
  float const g = k3::detail::bit_cast<float>(amax_bits) / (448.0f * 6.0f);
  return g >= nvfp4_min_tensor_scale ? g : 1.0f;
}

template <class T>
void nvfp4_quantize_rows(const_view<T, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<std::uint8_t, 2> s, float g, index_t i0,
                         index_t i1, nvfp4_rounding rounding = nvfp4_rounding::reciprocal) {
  for (index_t i = i0; i < i1; ++i)
    for (index_t b = 0; b < s.extent(1); ++b) {
      index_t const j0 = b * nvfp4_block;
      std::uint32_t amax = 0;
      for (index_t j = j0; j < j0 + nvfp4_block; ++j) amax = std::max(amax, abs_bits(load_as<float>(x(i, j))));
      auto const sc = detail::nvfp4_block_scale(amax, g, rounding);
      s(i, b) = sc.code;
      for (index_t j = j0; j < j0 + nvfp4_block; j += 2)
        q(i, j / 2) = pack_fp4(encode<e2m1_format>(detail::nvfp4_scaled(load_as<float>(x(i, j)), sc), saturation::finite),
                               encode<e2m1_format>(detail::nvfp4_scaled(load_as<float>(x(i, j + 1)), sc), saturation::finite));
    }
}

template <class Out>
void nvfp4_dequantize_rows(const_view<std::uint8_t, 2> q, const_view<std::uint8_t, 2> s, float g, tensor_view<Out, 2> y, index_t i0,
                           index_t i1) {
  for (index_t i = i0; i < i1; ++i)
    for (index_t j = 0; j < y.extent(1); ++j) {
      std::uint8_t const c = (j & 1) ? fp4_odd(q(i, j / 2)) : fp4_even(q(i, j / 2));
      y(i, j) = store_as<Out>(decode<e2m1_format>(c) * (decode<ue4m3_format>(s(i, j / nvfp4_block)) * g));
    }
}

// ---- block-scaled GEMM, the DeepSeek-V3 way ---------------------------------------------------
// C[i, n] = Σ_kb (sa[i, kb]·sb[n/128, kb]) · P_kb,  P_kb = Σ_{k in kb} e4m3(qa[i,k])·e4m3(qb[n,k])
// P_kb accumulates in fp32 in k order (each product is exact in fp32) and is promoted into the
// fp32 output with one fma per K block. Rows [i0, i1).
inline void fp8_block_gemm_rows(const_view<std::uint8_t, 2> qa, const_view<float, 2> sa, const_view<std::uint8_t, 2> qb,
                                const_view<float, 2> sb, tensor_view<float, 2> c, index_t i0, index_t i1) {
  index_t const n = qb.extent(0), k = qa.extent(1);
  for (index_t i = i0; i < i1; ++i)
    for (index_t jn = 0; jn < n; ++jn) {
      float acc = 0.0f;
      for (index_t kb = 0; kb * 128 < k; ++kb) {
        float p = 0.0f;
        for (index_t kk = kb * 128; kk < std::min(k, kb * 128 + 128); ++kk) {
          float const prod = decode<e4m3_format>(qa(i, kk)) * decode<e4m3_format>(qb(jn, kk));
          p = p + prod;
        }
        acc = std::fma(p, sa(i, kb) * sb(jn / 128, kb), acc);
      }
      c(i, jn) = acc;
    }
}

}  // namespace k3::quant::reference
