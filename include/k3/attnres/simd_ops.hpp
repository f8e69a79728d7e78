// k3/attnres/simd_ops.hpp — the row primitives of the AttnRes CPU kernels: conversion between
// storage and compute precision, and the two reductions (u.v and v.v) every source needs.
// The xsimd policy is a template on Arch (ODR: the ISA is part of the type).
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/simd.hpp"
#include "k3/core/config.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3::attnres::detail {

// Element conversions the compiler can vectorise: bfloat16 <-> float without branches
// (bfloat16's own constructor returns early for NaN, which keeps loops scalar). Same results:
// round to nearest even, NaN kept quiet with its sign, Inf kept.
inline std::uint16_t bf16_bits(float f) noexcept {
  std::uint32_t const u = std::bit_cast<std::uint32_t>(f);
  std::uint32_t const rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  std::uint32_t const quiet = (u >> 16) | 0x40u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

template <class C, class S>
inline C to_c(S x) noexcept {
  if constexpr (std::is_same_v<std::remove_cv_t<S>, bfloat16>)
    return static_cast<C>(std::bit_cast<float>(std::uint32_t(x.bits) << 16));
  else
    return static_cast<C>(x);
}

template <class S, class C>
inline void put(S& out, C v) noexcept {
  if constexpr (std::is_same_v<S, bfloat16>)
    out.bits = bf16_bits(static_cast<float>(v));
  else
    out = static_cast<S>(v);
}

// Storage -> compute.
template <class S, class C>
inline void convert_row(S const* K3_RESTRICT in, C* K3_RESTRICT out, index_t d) noexcept {
  for (index_t k = 0; k < d; ++k) out[k] = to_c<C>(in[k]);
}

template <class C, class H>
inline void store_row(C const* K3_RESTRICT in, H* K3_RESTRICT out, index_t d) noexcept {
  for (index_t k = 0; k < d; ++k) put(out[k], in[k]);
}

// The reductions accumulate in double even for float mixing: the logits are r_j (u . v_j) with
// d up to 7168, and float accumulation alone costs about 1e-6 relative in h and the gradients.
// Reference reductions: one running double sum, in index order.
struct scalar_reduce {
  template <class C>
  static void dot_ss(C const* K3_RESTRICT v, C const* K3_RESTRICT u, index_t d, double& dot, double& ss) noexcept {
    double a = 0, b = 0;
    for (index_t k = 0; k < d; ++k) {
      a += double(u[k]) * double(v[k]);
      b += double(v[k]) * double(v[k]);
    }
    dot = a;
    ss = b;
  }
  template <class C>
  static double dot(C const* K3_RESTRICT v, C const* K3_RESTRICT u, index_t d) noexcept {
    double a = 0;
    for (index_t k = 0; k < d; ++k) a += double(u[k]) * double(v[k]);
    return a;
  }
  template <class C>
  static void dot_ss_fast(C const* K3_RESTRICT v, C const* K3_RESTRICT u, index_t d, double& dot, double& ss) noexcept {
    dot_ss(v, u, d, dot, ss);
  }
};

// Lane-parallel double reductions: L independent partial sums per quantity, which the
// compiler turns into vector registers of doubles (no reassociation needed, so no fast-math).
// A template on Arch because the code generated depends on the ISA (ODR, see simd.hpp); L is
// two registers' worth of doubles.
template <class Arch>
struct simd_reduce {
  static constexpr index_t L = 2 * index_t(xsimd::batch<double, Arch>::size);

  template <class C>
  static void dot_ss(C const* K3_RESTRICT v, C const* K3_RESTRICT u, index_t d, double& dot, double& ss) noexcept {
    double a[L] = {}, b[L] = {};
    index_t k = 0;
    for (; k + L <= d; k += L)
      for (index_t i = 0; i < L; ++i) {
        double const x = double(v[k + i]);
        a[i] += double(u[k + i]) * x;
        b[i] += x * x;
      }
    double sa = 0, sb = 0;
    for (index_t i = 0; i < L; ++i) {
      sa += a[i];
      sb += b[i];
    }
    for (; k < d; ++k) {
      sa += double(u[k]) * double(v[k]);
      sb += double(v[k]) * double(v[k]);
    }
    dot = sa;
    ss = sb;
  }
  template <class C>
  static double dot(C const* K3_RESTRICT v, C const* K3_RESTRICT u, index_t d) noexcept {
    double a[L] = {};
    index_t k = 0;
    for (; k + L <= d; k += L)
      for (index_t i = 0; i < L; ++i) a[i] += double(u[k + i]) * double(v[k + i]);
    double sa = 0;
    for (index_t i = 0; i < L; ++i) sa += a[i];
    for (; k < d; ++k) sa += double(u[k]) * double(v[k]);
    return sa;
  }

  // Lane sums in the compute type (float: 4 x 16 partial sums of d / 64 terms each), rounded
  // into double once. For the phase-2 merge, where the sum only sets the sigmoid weight p
  // and the double version costs a third of the bandwidth-bound step.
  template <class C>
  static void dot_ss_fast(C const* K3_RESTRICT v, C const* K3_RESTRICT u, index_t d, double& dot, double& ss) noexcept {
    using batch = xsimd::batch<C, Arch>;
    constexpr index_t N = index_t(batch::size);
    batch a0(C(0)), a1(C(0)), b0(C(0)), b1(C(0));
    index_t k = 0;
    for (; k + 2 * N <= d; k += 2 * N) {
      batch const x0 = batch::load_unaligned(v + k), x1 = batch::load_unaligned(v + k + N);
      a0 = k3::simd::fma(batch::load_unaligned(u + k), x0, a0);
      a1 = k3::simd::fma(batch::load_unaligned(u + k + N), x1, a1);
      b0 = k3::simd::fma(x0, x0, b0);
      b1 = k3::simd::fma(x1, x1, b1);
    }
    double sa = double(k3::simd::reduce_add(a0)) + double(k3::simd::reduce_add(a1));
    double sb = double(k3::simd::reduce_add(b0)) + double(k3::simd::reduce_add(b1));
    for (; k < d; ++k) {
      sa += double(u[k]) * double(v[k]);
      sb += double(v[k]) * double(v[k]);
    }
    // Float lanes overflow for rows beyond ~1e18 (v.v past FLT_MAX) where double does not:
    // such rows (and rows holding Inf/NaN, which stay non-finite) are summed again in double.
    if (!(std::abs(sa) <= std::numeric_limits<double>::max() && sb <= std::numeric_limits<double>::max())) {
      dot_ss(v, u, d, dot, ss);
      return;
    }
    dot = sa;
    ss = sb;
  }
};

// Phase-1 scores summed in float registers (phase1_dots_simd, the AVX-512 bfloat16 tiles)
// overflow for rows beyond ~1e36; those scores (and the non-finite ones of rows holding
// Inf/NaN, which stay non-finite) are summed again in double, in index order.
template <class X, class Q>
void redo_nonfinite_dots(X const* const* x, index_t n, Q const* const* q, index_t nq, index_t d, double* dots) noexcept {
  for (index_t l = 0; l < nq; ++l)
    for (index_t j = 0; j < n; ++j) {
      double& s = dots[l * n + j];
      if (std::abs(s) <= std::numeric_limits<double>::max()) continue;
      double a = 0;
      for (index_t k = 0; k < d; ++k) a += double(q[l][k]) * to_c<double>(x[j][k]);
      s = a;
    }
}

}  // namespace k3::attnres::detail
