// k3/quant.hpp — block quantization: FP8 E4M3/E5M2, FP6, FP4, the MX (E8M0-scaled) formats,
// NVFP4 and DeepSeek-V3's fine-grained FP8 (1x128 / 128x128 / 128x1 tiles), their
// dequantizers, and the block-scaled FP8 GEMM.
//
//   namespace k3::quant:
//     fp8_quantize(b, x, q, s, tile, scale_format)      DeepSeek E4M3 tiles
//     fp8_dequantize(b, q, s, y, tile)
//     fp8_requantize_1x128_to_128x1(b, q, s, q2, s2, scale_format)
//     mx_quantize(b, x, q, s, mx_element, mx_rule)      OCP MX, 32-element blocks
//     mx_dequantize(b, q, s, y, mx_element)
//     nvfp4_tensor_scale(b, x) -> g;  nvfp4_quantize(b, x, q, s, g [, rounding]);  nvfp4_dequantize(b, q, s, g, y)
//     fp8_block_gemm(b, qa, sa, qb, sb, c)              C = dequant(A) · dequant(B)^T
//
// CUDA: k3/quant/cuda.hpp declares the same operations on device views (k3::quant::cuda::*),
// defined in k3/quant/cuda.cuh (include it from a .cu file); they reproduce the reference bytes.
//
// Backends: k3::cpu::serial runs the scalar reference (k3/quant/reference.hpp);
// k3::cpu::simd<Arch> and k3::cpu::threads<Arch> run vectorised kernels (threads: over rows /
// tiles) that produce the same bytes. Inputs are float or bfloat16 views of rank 2 with any
// strides (the vector path needs unit-stride rows and otherwise uses the reference); a tensor
// of higher rank is quantised as its [rows, last] matrix. Layouts: see k3/quant/common.hpp.
// Memory tuning (never the bytes): on Intel CPUs the bf16 row kernels prefetch their input and
// write outputs of 16 MiB of codes or more with non-temporal stores, which leaves the codes in
// DRAM, not in cache (simd_impl::row_tuning; simd_impl::fp8_quantize / mx_quantize take a
// store_mode to force either way).
//
// Special inputs (documented results, tested):
//   * DeepSeek: amax is clamped up to 1e-4 (an all-zero tile gets s = 1e-4/448 and zero codes).
//     A tile holding NaN or ±Inf gets s = NaN and all codes 0x7F: it decodes to NaN.
//   * MX: an all-zero block gets scale 0x00 (2^-127) and zero codes; a block holding NaN or
//     ±Inf gets scale 0xFF (NaN) and decodes to NaN (element codes: the format's NaN, or +max
//     for FP6/FP4, which have no NaN). Elements beyond the range after scaling are clamped to
//     ±max (FLOOR can clip the top binade; RCEIL never does).
//   * NVFP4: the tensor scale g = amax/(448·6) is taken over the finite values; g = 1 for an
//     all-zero tensor (or when g < 2^-140: amax < 2.4e-39), so zero tensors encode as zeros. A block
//     holding NaN/±Inf gets scale 0x7F (NaN) and decodes to NaN; other blocks are unaffected.
//   * Every element conversion is saturating (saturation::finite, CUDA __NV_SATFINITE).
// Bad input (wrong shapes, K not a multiple of the MX/NVFP4 block, overlapping outputs, a
// non-positive tensor scale) throws k3::error naming the argument.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/core/concepts.hpp"
#include "k3/core/numeric/fp4.hpp"
#include "k3/core/numeric/fp6.hpp"
#include "k3/core/numeric/fp8.hpp"
#include "k3/quant/common.hpp"
#include "k3/quant/gemm.hpp"
#include "k3/quant/reference.hpp"
#include "k3/quant/simd.hpp"

namespace k3::quant {

namespace detail {

template <class T>
concept quant_input = std::is_same_v<std::remove_const_t<T>, float> || std::is_same_v<std::remove_const_t<T>, bfloat16>;
template <class T>
concept quant_output = std::is_same_v<T, float> || std::is_same_v<T, bfloat16>;

// Backends that carry an xsimd Arch (cpu::simd, cpu::threads) take the vector path.
template <class B>
concept vector_backend = requires { typename B::arch_type; };

template <class T, std::size_t R>
bool unit_rows(tensor_view<T, R> const& v) {
  return v.extent(R - 1) <= 1 || v.stride(R - 1) == 1;
}

// Splits rows [0, m) over the backend (threads: for_each_task) for the reference paths.
template <class B, class F>
void rows_parallel(B const& b, index_t m, index_t rows_per_task, F&& f) {
  index_t const tasks = ceil_div(m, rows_per_task);
  simd_impl::run_tasks(b, tasks, [&](index_t t) { f(t * rows_per_task, std::min(m, (t + 1) * rows_per_task)); });
}

// The codes q [m, code_columns(k)] and block scales s [m, k / block] of the [m, k] tensor
// `name` (x quantized, or y dequantized into), whose k must be a multiple of the block.
template <class X, class Q, class S, class Codes>
void check_block_layout(char const* name, X const& x, Q const& q, S const& s, index_t block, Codes&& code_columns) {
  index_t const m = x.extent(0), k = x.extent(1);
  check_divides(name, k, block);
  k3::detail::check_shape("q", q, {m, code_columns(k)});
  k3::detail::check_shape("s", s, {m, k / block});
}

}  // namespace detail

// ---- DeepSeek FP8 tiles ------------------------------------------------------------------------
template <HostBackend B, detail::quant_input T>
void fp8_quantize(B const& b, tensor_view<T, 2> x_in, tensor_view<std::uint8_t, 2> q, tensor_view<float, 2> s, tile t = tile_1x128,
                  scale_format fmt = scale_format::fp32) {
  const_view<std::remove_const_t<T>, 2> x = x_in;
  detail::check_tile(t);
  k3::detail::check_view("x", x);
  k3::detail::check_view("q", q);
  k3::detail::check_view("s", s);
  index_t const m = x.extent(0), k = x.extent(1);
  k3::detail::check_shape("q", q, {m, k});
  k3::detail::check_shape("s", s, {detail::ceil_div(m, t.rows), detail::ceil_div(k, t.cols)});
  detail::check_quantize_outputs(q, s, x);
  if (x.size() == 0) return;
  if constexpr (detail::vector_backend<B>) {
    if (detail::unit_rows(x) && detail::unit_rows(q) && t.cols > 1) {
      simd_impl::fp8_quantize<typename B::arch_type>(b, x, q, s, t, fmt);
      return;
    }
  }
  index_t const rb = s.extent(0);
  detail::rows_parallel(b, rb, std::max<index_t>(1, 16 / t.rows),
                        [&](index_t r0, index_t r1) { reference::fp8_quantize_rows(x, q, s, t, fmt, r0, r1); });
}

template <HostBackend B, class QT, class ST, detail::quant_output Out>
void fp8_dequantize(B const& b, tensor_view<QT, 2> q_in, tensor_view<ST, 2> s_in, tensor_view<Out, 2> y, tile t = tile_1x128) {
  const_view<std::uint8_t, 2> q = q_in;
  const_view<float, 2> s = s_in;
  detail::check_tile(t);
  k3::detail::check_view("q", q);
  k3::detail::check_view("s", s);
  k3::detail::check_view("y", y);
  index_t const m = q.extent(0), k = q.extent(1);
  k3::detail::check_shape("s", s, {detail::ceil_div(m, t.rows), detail::ceil_div(k, t.cols)});
  k3::detail::check_shape("y", y, {m, k});
  detail::check_dequantize_output(y, q, s);
  detail::rows_parallel(b, m, 16, [&](index_t i0, index_t i1) { reference::fp8_dequantize_rows(q, s, y, t, i0, i1); });
}

// Backward re-quantisation: 1x128 tiles (q [M, K], s [M, ceil(K/128)]) to 128x1 tiles
// (q2 [M, K], s2 [ceil(M/128), K]); equal to fp8_quantize(fp8_dequantize(q, s), 128x1). With
// UE8M0 scales it is exact for every element that stays a normal E4M3 number.
template <HostBackend B, class QT, class ST>
void fp8_requantize_1x128_to_128x1(B const& b, tensor_view<QT, 2> q_in, tensor_view<ST, 2> s_in, tensor_view<std::uint8_t, 2> q2,
                                   tensor_view<float, 2> s2, scale_format fmt = scale_format::ue8m0) {
  const_view<std::uint8_t, 2> q = q_in;
  const_view<float, 2> s = s_in;
  k3::detail::check_view("q", q);
  k3::detail::check_view("s", s);
  k3::detail::check_view("q2", q2);
  k3::detail::check_view("s2", s2);
  index_t const m = q.extent(0), k = q.extent(1);
  k3::detail::check_shape("s", s, {m, detail::ceil_div(k, 128)});
  k3::detail::check_shape("q2", q2, {m, k});
  k3::detail::check_shape("s2", s2, {detail::ceil_div(m, 128), k});
  k3::detail::check_outputs_apart(
      [&](auto&& f) {
        f("q2", q2);
        f("s2", s2);
      },
      [&](auto&& f) {
        f("q", q);
        f("s", s);
      });
  if (q.size() == 0) return;
  detail::rows_parallel(b, k, 128, [&](index_t j0, index_t j1) { reference::fp8_requantize_cols(q, s, q2, s2, fmt, j0, j1); });
}

// ---- OCP MX --------------------------------------------------------------------------------------
template <HostBackend B, detail::quant_input T>
void mx_quantize(B const& b, tensor_view<T, 2> x_in, tensor_view<std::uint8_t, 2> q, tensor_view<std::uint8_t, 2> s, mx_element e,
                 mx_rule rule = mx_rule::floor) {
  const_view<std::remove_const_t<T>, 2> x = x_in;
  k3::detail::check_view("x", x);
  k3::detail::check_view("q", q);
  k3::detail::check_view("s", s);
  index_t const m = x.extent(0);
  detail::check_block_layout("x", x, q, s, mx_block, [&](index_t k) { return mx_code_columns(e, k); });
  detail::check_quantize_outputs(q, s, x);
  if (x.size() == 0) return;
  visit(e, [&]<class F>(F) {
    if constexpr (detail::vector_backend<B>) {
      if (detail::unit_rows(x) && detail::unit_rows(q)) {
        simd_impl::mx_quantize<typename B::arch_type, F>(b, x, q, s, rule);
        return;
      }
    }
    detail::rows_parallel(b, m, 8, [&](index_t i0, index_t i1) { reference::mx_quantize_rows<F>(x, q, s, rule, i0, i1); });
  });
}

template <HostBackend B, class QT, class ST, detail::quant_output Out>
void mx_dequantize(B const& b, tensor_view<QT, 2> q_in, tensor_view<ST, 2> s_in, tensor_view<Out, 2> y, mx_element e) {
  const_view<std::uint8_t, 2> q = q_in;
  const_view<std::uint8_t, 2> s = s_in;
  k3::detail::check_view("q", q);
  k3::detail::check_view("s", s);
  k3::detail::check_view("y", y);
  index_t const m = y.extent(0);
  detail::check_block_layout("y", y, q, s, mx_block, [&](index_t k) { return mx_code_columns(e, k); });
  detail::check_dequantize_output(y, q, s);
  visit(e, [&]<class F>(F) {
    detail::rows_parallel(b, m, 16, [&](index_t i0, index_t i1) { reference::mx_dequantize_rows<F>(q, s, y, i0, i1); });
  });
}

// ---- NVFP4 --------------------------------------------------------------------------------------------
// The fp32 tensor scale g = amax/(448·6) over the finite values (1 for an all-zero tensor).
template <HostBackend B, detail::quant_input T>
float nvfp4_tensor_scale(B const& b, tensor_view<T, 2> x_in) {
  const_view<std::remove_const_t<T>, 2> x = x_in;
  k3::detail::check_view("x", x);
  if (x.size() == 0) return 1.0f;
  std::uint32_t amax = 0;
  if constexpr (detail::vector_backend<B>) {
    if (detail::unit_rows(x)) return reference::nvfp4_scale_from_amax(simd_impl::finite_amax_bits<typename B::arch_type>(b, x));
  }
  amax = reference::finite_amax_bits(x, 0, x.extent(0));
  return reference::nvfp4_scale_from_amax(amax);
}

template <HostBackend B, detail::quant_input T>
void nvfp4_quantize(B const& b, tensor_view<T, 2> x_in, tensor_view<std::uint8_t, 2> q, tensor_view<std::uint8_t, 2> s, float g,
                    nvfp4_rounding rounding = nvfp4_rounding::reciprocal) {
  const_view<std::remove_const_t<T>, 2> x = x_in;
  k3::detail::check_view("x", x);
  k3::detail::check_view("q", q);
  k3::detail::check_view("s", s);
  detail::check_tensor_scale(g);
  index_t const m = x.extent(0);
  detail::check_block_layout("x", x, q, s, nvfp4_block, [](index_t k) { return k / 2; });
  detail::check_quantize_outputs(q, s, x);
  if (x.size() == 0) return;
  if constexpr (detail::vector_backend<B>) {
    if (detail::unit_rows(x) && detail::unit_rows(q)) {
      simd_impl::nvfp4_quantize<typename B::arch_type>(b, x, q, s, g, rounding);
      return;
    }
  }
  detail::rows_parallel(b, m, 8, [&](index_t i0, index_t i1) { reference::nvfp4_quantize_rows(x, q, s, g, i0, i1, rounding); });
}

template <HostBackend B, class QT, class ST, detail::quant_output Out>
void nvfp4_dequantize(B const& b, tensor_view<QT, 2> q_in, tensor_view<ST, 2> s_in, float g, tensor_view<Out, 2> y) {
  const_view<std::uint8_t, 2> q = q_in;
  const_view<std::uint8_t, 2> s = s_in;
  k3::detail::check_view("q", q);
  k3::detail::check_view("s", s);
  k3::detail::check_view("y", y);
  detail::check_tensor_scale(g);
  index_t const m = y.extent(0);
  detail::check_block_layout("y", y, q, s, nvfp4_block, [](index_t k) { return k / 2; });
  detail::check_dequantize_output(y, q, s);
  detail::rows_parallel(b, m, 16, [&](index_t i0, index_t i1) { reference::nvfp4_dequantize_rows(q, s, g, y, i0, i1); });
}

// ---- block-scaled FP8 GEMM ----------------------------------------------------------------------
// qa [M, K] E4M3 with 1x128 scales sa [M, ceil(K/128)]; qb [N, K] E4M3 with 128x128 scales
// sb [ceil(N/128), ceil(K/128)]; c [M, N] float. See reference::fp8_block_gemm_rows for the
// accumulation order (fp32 partial sums per 128-wide K block, promoted with one fma).
template <HostBackend B, class QA, class SA, class QB, class SB>
void fp8_block_gemm(B const& b, tensor_view<QA, 2> qa_in, tensor_view<SA, 2> sa_in, tensor_view<QB, 2> qb_in, tensor_view<SB, 2> sb_in,
                    tensor_view<float, 2> c) {
  const_view<std::uint8_t, 2> qa = qa_in, qb = qb_in;
  const_view<float, 2> sa = sa_in, sb = sb_in;
  k3::detail::check_view("qa", qa);
  k3::detail::check_view("sa", sa);
  k3::detail::check_view("qb", qb);
  k3::detail::check_view("sb", sb);
  k3::detail::check_view("c", c);
  index_t const m = qa.extent(0), k = qa.extent(1), n = qb.extent(0);
  k3::detail::check_shape("qb", qb, {n, k});
  k3::detail::check_shape("sa", sa, {m, detail::ceil_div(k, 128)});
  k3::detail::check_shape("sb", sb, {detail::ceil_div(n, 128), detail::ceil_div(k, 128)});
  k3::detail::check_shape("c", c, {m, n});
  detail::check_gemm_output(c, qa, sa, qb, sb);
  if (c.size() == 0) return;
  if (k == 0) {  // an empty sum (the vector kernel writes C only from inside its K-block loop)
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < n; ++j) c(i, j) = 0.0f;
    return;
  }
  if constexpr (detail::vector_backend<B>) {
    gemm_impl::fp8_block_gemm<typename B::arch_type>(b, qa, sa, qb, sb, c);
  } else {
    detail::rows_parallel(b, m, 16, [&](index_t i0, index_t i1) { reference::fp8_block_gemm_rows(qa, sa, qb, sb, c, i0, i1); });
  }
}

}  // namespace k3::quant
