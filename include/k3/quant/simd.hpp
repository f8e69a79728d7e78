// k3/quant/simd.hpp — vectorised block quantizers for k3::cpu::simd<Arch> and
// k3::cpu::threads<Arch>: amax as an integer max over |x| bit patterns, one scalar scale per
// block (the same bit-exact functions the reference uses), and a branch-free SIMD float ->
// minifloat encoder (RNE, gradual underflow, saturating). Produces exactly the reference's
// bytes. Rows must be unit-stride; quant.hpp falls back to the reference otherwise. The
// ISA-specific primitives and row kernels are in k3/quant/arch/<isa>.hpp, chosen by Arch.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/simd.hpp"
#include "k3/core/backend_traits.hpp"
#include "k3/core/host_memory.hpp"
#include "k3/quant/arch/avx512.hpp"
#include "k3/quant/arch/generic.hpp"
#include "k3/quant/common.hpp"
#include "k3/quant/reference.hpp"
#include "k3/quant/tuning.hpp"

namespace k3::quant::simd_impl {

template <class Arch>
struct kernels {
  using bf = xsimd::batch<float, Arch>;
  using bi = xsimd::batch<std::int32_t, Arch>;
  static constexpr index_t L = static_cast<index_t>(bf::size);

  // Logical shifts by an immediate, integer min and max (ISA forms: k3/quant/arch/).
  template <int S>
  static bi shr(bi v) noexcept {
    return kernel::shr<S>(v, Arch{});
  }
  template <int S>
  static bi shl(bi v) noexcept {
    return kernel::shl<S>(v, Arch{});
  }
  static bi imin(bi a, bi b) noexcept { return kernel::imin(a, b, Arch{}); }
  static bi imax(bi a, bi b) noexcept { return kernel::imax(a, b, Arch{}); }

  // L consecutive inputs as floats.
  template <class T>
  static bf load(T const* p) noexcept {
    if constexpr (std::is_same_v<std::remove_cv_t<T>, float>)
      return bf::load_unaligned(p);
    else
      return kernel::load_bf16<Arch>(p, Arch{});
  }

  // L codes (one per int32 lane) to L bytes.
  static void store_bytes(bi c, std::uint8_t* out) noexcept { kernel::store_bytes(c, out, Arch{}); }
  // L 4-bit codes to L/2 bytes, even element in the low nibble.
  static void store_nibbles(bi c, std::uint8_t* out) noexcept { kernel::store_nibbles(c, out, Arch{}); }

  // max of |x| bit patterns (see detail::abs_bits) over n inputs.
  template <class T>
  static std::uint32_t amax_bits(T const* p, index_t n) noexcept {
    if constexpr (std::is_same_v<std::remove_cv_t<T>, bfloat16>) {
      std::uint32_t r = 0;
      if (kernel::amax_bits_bf16<Arch>(p, n, r, Arch{})) return r;
    }
    bi m(0);
    bi const mask(0x7FFFFFFF);
    index_t j = 0;
    for (; j + L <= n; j += L) m = imax(m, xsimd::bitwise_cast<bi>(load(p + j)) & mask);
    alignas(64) std::int32_t lanes[L];
    m.store_aligned(lanes);
    std::uint32_t r = 0;
    for (index_t l = 0; l < L; ++l) r = std::max(r, static_cast<std::uint32_t>(lanes[l]));
    for (; j < n; ++j) r = std::max(r, detail::abs_bits(load_as<float>(p[j])));
    return r;
  }

  // Saturating encode of y (F::bits-bit codes in int32 lanes): bit-identical to
  // encode<F>(y, saturation::finite).
  // Checked=false drops the saturation and NaN steps; valid only when every |y| rounds to at
  // most max (DeepSeek tiles: |x|·(1/s) <= 448·(1 + 2^-21) < 464) and no y is NaN.
  template <class F, bool Checked = true>
  static bi encode(bf y) noexcept {
    constexpr int m = F::mbits, shift = 23 - F::mbits;
    bi const u = xsimd::bitwise_cast<bi>(y);
    bi const a = u & bi(0x7FFFFFFF);
    // normal: round the FP32 mantissa to m bits (ties to even), then rebias the exponent
    bi const r = a + bi((1 << (shift - 1)) - 1) + (shr<shift>(a) & bi(1));
    bi const cn = shr<shift>(r) - bi((127 - F::bias) << m);
    // subnormal: adding 2^(1-bias-m+23) makes the FP32 ulp the format's subnormal step
    constexpr float magic = k3::detail::exp2i_float(1 - F::bias - m + 23);
    bi const cs = xsimd::bitwise_cast<bi>(xsimd::bitwise_cast<bf>(a) + bf(magic)) - bi(k3::detail::bit_cast<std::int32_t>(magic));
    bi c = xsimd::select(a < bi((128 - F::bias) << 23), cs, cn);
    if constexpr (Checked) c = imin(c, bi(static_cast<std::int32_t>(F::max_code)));
    if constexpr (F::is_signed) c = c | (shr<32 - F::bits>(u) & bi(static_cast<std::int32_t>(F::sign_bit)));
    if constexpr (!Checked) return c;
    return xsimd::select(a > bi(0x7F800000), bi(static_cast<std::int32_t>(F::nan_code)), c);
  }

  // out = codes of p[j] * f (or p[j] / f when Divide), one per byte, or packed two per byte
  // for 4-bit formats (n even).
  template <class F, bool Divide = false, bool Checked = true, class T>
  static void encode_store(T const* p, float f, std::uint8_t* out, index_t n) noexcept {
    constexpr bool packed = F::bits == 4;
    bf const vf(f);
    index_t j = 0;
    for (; j + L <= n; j += L) {
      bf x = load(p + j);
      bi const c = encode<F, Checked>(Divide ? x / vf : x * vf);
      if constexpr (packed)
        store_nibbles(c, out + j / 2);
      else
        store_bytes(c, out + j);
    }
    // The tail counts down what is left (a loop on j alone made g++ 12 at -O3 without AVX-512
    // warn of an overflow of j after inlining: -Waggressive-loop-optimizations).
    constexpr index_t step = packed ? 2 : 1;
    for (index_t left = n - j; left > 0; left -= step, j += step) {
      float const x0 = load_as<float>(p[j]);
      std::uint8_t const c0 = k3::encode<F>(Divide ? x0 / f : x0 * f, saturation::finite);
      if constexpr (packed) {
        float const x1 = load_as<float>(p[j + 1]);
        out[j / 2] = pack_fp4(c0, k3::encode<F>(Divide ? x1 / f : x1 * f, saturation::finite));
      } else {
        out[j] = c0;
      }
    }
  }
};

// ---- DeepSeek tiles, rows unit-stride -----------------------------------------------------
template <class Arch, class B, class T>
void fp8_quantize(B const& b, const_view<T, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<float, 2> s, tile t, scale_format fmt,
                  store_mode mode = store_mode::automatic, tuning const tune = tuning::host()) {
  using K = kernels<Arch>;
  index_t const m = x.extent(0), k = x.extent(1);
  if constexpr (std::is_same_v<std::remove_cv_t<T>, bfloat16>) {
    if (t.rows == 1 && t.cols == 128 && kernel::fp8_1x128_rows<Arch>(b, x, q, s, fmt, mode, tune, Arch{})) return;
  }
  index_t const rows_per_task = t.rows == 1 ? 16 : t.rows;
  k3::run_tasks(b, detail::ceil_div(m, rows_per_task), [&](index_t task) {
    index_t const r0 = task * rows_per_task, r1 = std::min(m, r0 + rows_per_task);
    for (index_t i0 = r0; i0 < r1; i0 += t.rows) {
      index_t const i1 = std::min(m, i0 + t.rows);
      for (index_t cb = 0; cb < s.extent(1); ++cb) {
        index_t const j0 = cb * t.cols, n = std::min(k, j0 + t.cols) - j0;
        std::uint32_t amax = 0;
        for (index_t i = i0; i < i1; ++i) amax = std::max(amax, K::amax_bits(&x(i, j0), n));
        auto const sc = detail::deepseek_scale(amax, fmt);
        s(i0 / t.rows, cb) = sc.s;
        if (amax >= detail::nonfinite_bits) {  // NaN tile: every code is NaN (as the reference gives)
          for (index_t i = i0; i < i1; ++i) std::memset(&q(i, j0), e4m3_format::nan_code, static_cast<std::size_t>(n));
          continue;
        }
        for (index_t i = i0; i < i1; ++i) K::template encode_store<e4m3_format, false, false>(&x(i, j0), sc.inv, &q(i, j0), n);
      }
    }
  });
}

// ---- OCP MX, rows unit-stride ----------------------------------------------------------------
template <class Arch, class F, class B, class T>
void mx_quantize(B const& b, const_view<T, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<std::uint8_t, 2> s, mx_rule rule,
                 store_mode mode = store_mode::automatic, tuning const tune = tuning::host()) {
  using K = kernels<Arch>;
  constexpr bool packed = F::bits == 4;
  index_t const m = x.extent(0), k = x.extent(1);
  index_t const rows_per_task = 8;  // the generic paths
  if constexpr (std::is_same_v<std::remove_cv_t<T>, bfloat16>) {
    if constexpr (std::is_same_v<F, e4m3_format>)
      if (kernel::mx_e4m3_rows<Arch>(b, x, q, s, rule, mode, tune, Arch{})) return;
    if constexpr (std::is_same_v<F, e2m1_format>)
      if (kernel::mx_e2m1_rows<Arch>(b, x, q, s, rule, rows_per_task, tune, Arch{})) return;
  }
  k3::run_tasks(b, detail::ceil_div(m, rows_per_task), [&](index_t task) {
    index_t const r0 = task * rows_per_task, r1 = std::min(m, r0 + rows_per_task);
    for (index_t i = r0; i < r1; ++i) {
      T const* xr = &x(i, 0);
      for (index_t j = 0; j < k; j += mx_block) {
        auto const sc = detail::mx_block_scale<F>(K::amax_bits(xr + j, mx_block), rule);
        s(i, j / mx_block) = sc.code;
        K::template encode_store<F>(xr + j, sc.inv, packed ? &q(i, j / 2) : &q(i, j), mx_block);
      }
    }
  });
}

// ---- NVFP4, rows unit-stride -------------------------------------------------------------------
template <class Arch, class B, class T>
void nvfp4_quantize(B const& b, const_view<T, 2> x, tensor_view<std::uint8_t, 2> q, tensor_view<std::uint8_t, 2> s, float g,
                    nvfp4_rounding rounding) {
  using K = kernels<Arch>;
  index_t const m = x.extent(0), k = x.extent(1);
  index_t const rows_per_task = 8;
  k3::run_tasks(b, detail::ceil_div(m, rows_per_task), [&](index_t task) {
    index_t const r0 = task * rows_per_task, r1 = std::min(m, r0 + rows_per_task);
    for (index_t i = r0; i < r1; ++i) {
      T const* xr = &x(i, 0);
      for (index_t j = 0; j < k; j += nvfp4_block) {
        auto const sc = detail::nvfp4_block_scale(K::amax_bits(xr + j, nvfp4_block), g, rounding);
        s(i, j / nvfp4_block) = sc.code;
        if (sc.divide)
          K::template encode_store<e2m1_format, true>(xr + j, sc.factor, &q(i, j / 2), nvfp4_block);
        else
          K::template encode_store<e2m1_format, false>(xr + j, sc.factor, &q(i, j / 2), nvfp4_block);
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
  k3::run_tasks(b, tasks, [&](index_t task) {
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
