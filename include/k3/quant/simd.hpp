// k3/quant/simd.hpp — vectorised block quantizers for k3::cpu::simd<Arch> and
// k3::cpu::threads<Arch>: amax as an integer max over |x| bit patterns, one scalar scale per
// block (the same bit-exact functions the reference uses), and a branch-free SIMD float ->
// minifloat encoder (RNE, gradual underflow, saturating). Produces exactly the reference's
// bytes. Rows must be unit-stride; quant.hpp falls back to the reference otherwise.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/simd.hpp"
#include "k3/quant/common.hpp"
#include "k3/quant/reference.hpp"

namespace k3::quant::simd_impl {

// Runs task(i) for i in [0, n): on the pool when the backend has one.
template <class B, class F>
void run_tasks(B const& b, index_t n, F&& f) {
  if constexpr (requires { b.for_each_task(n, f); }) {
    b.for_each_task(n, f);
  } else {
    for (index_t i = 0; i < n; ++i) f(i);
  }
}

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
struct kernels {
  using bf = xsimd::batch<float, Arch>;
  using bi = xsimd::batch<std::int32_t, Arch>;
  static constexpr index_t L = static_cast<index_t>(bf::size);

  // max of |x| bit patterns (see detail::abs_bits).
  static std::uint32_t amax_bits(float const* p, index_t n) noexcept {
    bi m(0);
    bi const mask(0x7FFFFFFF);
    index_t j = 0;
    for (; j + L <= n; j += L) m = xsimd::max(m, xsimd::bitwise_cast<bi>(bf::load_unaligned(p + j)) & mask);
    alignas(64) std::int32_t lanes[L];
    m.store_aligned(lanes);
    std::uint32_t r = 0;
    for (index_t l = 0; l < L; ++l) r = std::max(r, static_cast<std::uint32_t>(lanes[l]));
    for (; j < n; ++j) r = std::max(r, detail::abs_bits(p[j]));
    return r;
  }

  // Saturating encode of y (F::bits-bit codes in int32 lanes): bit-identical to
  // encode<F>(y, saturation::finite).
  template <class F>
  static bi encode(bf y) noexcept {
    constexpr int m = F::mbits, shift = 23 - F::mbits;
    bi const u = xsimd::bitwise_cast<bi>(y);
    bi const a = u & bi(0x7FFFFFFF);
    // normal: round the FP32 mantissa to m bits (ties to even), then rebias the exponent
    bi const r = a + bi((1 << (shift - 1)) - 1) + ((a >> shift) & bi(1));
    bi const cn = (r >> shift) - bi((127 - F::bias) << m);
    // subnormal: adding 2^(1-bias-m+23) makes the FP32 ulp the format's subnormal step
    constexpr float magic = k3::detail::exp2i_float(1 - F::bias - m + 23);
    bi const cs = xsimd::bitwise_cast<bi>(xsimd::bitwise_cast<bf>(a) + bf(magic)) - bi(k3::detail::bit_cast<std::int32_t>(magic));
    bi c = xsimd::select(a < bi((128 - F::bias) << 23), cs, cn);
    c = xsimd::min(c, bi(static_cast<std::int32_t>(F::max_code)));
    if constexpr (F::is_signed) c = c | ((u >> 31) & bi(1)) << (F::bits - 1);
    return xsimd::select(a > bi(0x7F800000), bi(static_cast<std::int32_t>(F::nan_code)), c);
  }

  // codes[j] = encode<F>(p[j] * mul) (or p[j] / div when Divide).
  template <class F, bool Divide = false>
  static void encode_block(float const* p, float f, std::int32_t* codes, index_t n) noexcept {
    bf const vf(f);
    index_t j = 0;
    for (; j + L <= n; j += L) {
      bf x = bf::load_unaligned(p + j);
      x = Divide ? x / vf : x * vf;
      encode<F>(x).store_unaligned(codes + j);
    }
    for (; j < n; ++j) codes[j] = k3::encode<F>(Divide ? p[j] / f : p[j] * f, saturation::finite);
  }
};

K3_INLINE void narrow(std::int32_t const* K3_RESTRICT c, std::uint8_t* K3_RESTRICT out, index_t n) noexcept {
  for (index_t j = 0; j < n; ++j) out[j] = static_cast<std::uint8_t>(c[j]);
}
K3_INLINE void narrow_fp4(std::int32_t const* K3_RESTRICT c, std::uint8_t* K3_RESTRICT out, index_t n) noexcept {
  for (index_t j = 0; j < n / 2; ++j) out[j] = static_cast<std::uint8_t>(c[2 * j] | (c[2 * j + 1] << 4));
}

// ---- DeepSeek tiles with 128-wide (or any tc) column tiles, rows unit-stride --------------
template <class Arch, class B, class T>
void fp8_quantize(B const& b, const_view<T, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<float, 2> s, tile t, scale_format fmt) {
  using K = kernels<Arch>;
  index_t const m = x.extent(0), k = x.extent(1);
  index_t const rows_per_task = t.rows == 1 ? 16 : t.rows;
  index_t const tasks = detail::ceil_div(m, rows_per_task);
  run_tasks(b, tasks, [&](index_t task) {
    std::vector<float> buf(static_cast<std::size_t>(t.rows == 1 ? t.cols : t.cols));
    std::vector<std::int32_t> codes(static_cast<std::size_t>(t.cols));
    index_t const r0 = task * rows_per_task, r1 = std::min(m, r0 + rows_per_task);
    for (index_t i0 = r0; i0 < r1; i0 += t.rows) {
      index_t const i1 = std::min(m, i0 + t.rows);
      for (index_t cb = 0; cb < s.extent(1); ++cb) {
        index_t const j0 = cb * t.cols, n = std::min(k, j0 + t.cols) - j0;
        std::uint32_t amax = 0;
        for (index_t i = i0; i < i1; ++i) {
          to_float(&x(i, j0), buf.data(), n);
          amax = std::max(amax, K::amax_bits(buf.data(), n));
        }
        auto const sc = detail::deepseek_scale(amax, fmt);
        s(i0 / t.rows, cb) = sc.s;
        for (index_t i = i0; i < i1; ++i) {
          if (t.rows != 1) to_float(&x(i, j0), buf.data(), n);  // 1-row tiles reuse the first pass
          K::template encode_block<e4m3_format>(buf.data(), sc.inv, codes.data(), n);
          narrow(codes.data(), &q(i, j0), n);
        }
      }
    }
  });
}

// ---- OCP MX, rows unit-stride ----------------------------------------------------------------
template <class Arch, class F, class B, class T>
void mx_quantize(B const& b, const_view<T, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<std::uint8_t, 2> s, mx_rule rule) {
  using K = kernels<Arch>;
  constexpr bool packed = F::bits == 4;
  constexpr index_t chunk = 1024;  // elements converted at a time (32 blocks)
  index_t const m = x.extent(0), k = x.extent(1);
  index_t const rows_per_task = 8;
  run_tasks(b, detail::ceil_div(m, rows_per_task), [&](index_t task) {
    alignas(64) float buf[chunk];
    alignas(64) std::int32_t codes[mx_block];
    index_t const r0 = task * rows_per_task, r1 = std::min(m, r0 + rows_per_task);
    for (index_t i = r0; i < r1; ++i) {
      for (index_t c0 = 0; c0 < k; c0 += chunk) {
        index_t const n = std::min(chunk, k - c0);
        to_float(&x(i, c0), buf, n);
        for (index_t j = 0; j < n; j += mx_block) {
          auto const sc = detail::mx_block_scale<F>(K::amax_bits(buf + j, mx_block), rule);
          s(i, (c0 + j) / mx_block) = sc.code;
          K::template encode_block<F>(buf + j, sc.inv, codes, mx_block);
          if constexpr (packed)
            narrow_fp4(codes, &q(i, (c0 + j) / 2), mx_block);
          else
            narrow(codes, &q(i, c0 + j), mx_block);
        }
      }
    }
  });
}

// ---- NVFP4, rows unit-stride -------------------------------------------------------------------
template <class Arch, class B, class T>
void nvfp4_quantize(B const& b, const_view<T, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<std::uint8_t, 2> s, float g) {
  using K = kernels<Arch>;
  constexpr index_t chunk = 1024;
  index_t const m = x.extent(0), k = x.extent(1);
  index_t const rows_per_task = 8;
  run_tasks(b, detail::ceil_div(m, rows_per_task), [&](index_t task) {
    alignas(64) float buf[chunk];
    alignas(64) std::int32_t codes[nvfp4_block];
    index_t const r0 = task * rows_per_task, r1 = std::min(m, r0 + rows_per_task);
    for (index_t i = r0; i < r1; ++i) {
      for (index_t c0 = 0; c0 < k; c0 += chunk) {
        index_t const n = std::min(chunk, k - c0);
        to_float(&x(i, c0), buf, n);
        for (index_t j = 0; j < n; j += nvfp4_block) {
          auto const sc = detail::nvfp4_block_scale(K::amax_bits(buf + j, nvfp4_block), g);
          s(i, (c0 + j) / nvfp4_block) = sc.code;
          K::template encode_block<e2m1_format, true>(buf + j, sc.div, codes, nvfp4_block);
          narrow_fp4(codes, &q(i, (c0 + j) / 2), nvfp4_block);
        }
      }
    }
  });
}

// Finite amax of a tensor with unit-stride rows (NVFP4 tensor scale).
template <class Arch, class B, class T>
std::uint32_t finite_amax_bits(B const& b, const_view<T, 2> x) {
  using K = kernels<Arch>;
  index_t const m = x.extent(0), k = x.extent(1);
  index_t const rows_per_task = 16, tasks = detail::ceil_div(m, rows_per_task);
  std::vector<std::uint32_t> part(static_cast<std::size_t>(tasks), 0);
  run_tasks(b, tasks, [&](index_t task) {
    std::vector<float> buf(static_cast<std::size_t>(std::min<index_t>(k, 4096)));
    std::uint32_t r = 0;
    for (index_t i = task * rows_per_task; i < std::min(m, (task + 1) * rows_per_task); ++i)
      for (index_t c0 = 0; c0 < k; c0 += 4096) {
        index_t const n = std::min<index_t>(4096, k - c0);
        to_float(&x(i, c0), buf.data(), n);
        // non-finite values are excluded: only fall back to a scalar scan when one is present
        std::uint32_t a = K::amax_bits(buf.data(), n);
        if (a >= detail::nonfinite_bits) {
          a = 0;
          for (index_t j = 0; j < n; ++j) {
            std::uint32_t v = detail::abs_bits(buf[static_cast<std::size_t>(j)]);
            if (v < detail::nonfinite_bits) a = std::max(a, v);
          }
        }
        r = std::max(r, a);
      }
    part[static_cast<std::size_t>(task)] = r;
  });
  std::uint32_t r = 0;
  for (auto v : part) r = std::max(r, v);
  return r;
}

}  // namespace k3::quant::simd_impl
