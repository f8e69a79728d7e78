// k3/quant.hpp — block quantization: FP8 E4M3/E5M2, FP6, FP4, the MX (E8M0-scaled) formats,
// NVFP4 and DeepSeek-V3's fine-grained FP8 (1x128 / 128x128 / 128x1 tiles), their
// dequantizers, and the block-scaled FP8 GEMM.
//
// Every op is k3::quant::<op>(backend, <op>_args<T>{...}, <op>_options{...}):
//     fp8_quantize(b, fp8_quantize_args<T>{.x, .q, .scales}, {.tile, .format})      DeepSeek E4M3 tiles
//     fp8_dequantize(b, fp8_dequantize_args<Out>{.q, .scales, .y}, {.tile})
//     fp8_requantize_1x128_to_128x1(b, fp8_requantize_args<>{.q, .scales, .q2, .scales2}, {.format})
//     mx_quantize(b, mx_quantize_args<T>{.x, .q, .scales}, {.element, .rule})        OCP MX, 32-element blocks
//     mx_dequantize(b, mx_dequantize_args<Out>{.q, .scales, .y}, {.element})
//     nvfp4_tensor_scale(b, nvfp4_tensor_scale_args<T>{.x}) -> float tensor scale
//     nvfp4_quantize(b, nvfp4_quantize_args<T>{.x, .q, .scales}, {.tensor_scale, .rounding})
//     nvfp4_dequantize(b, nvfp4_dequantize_args<Out>{.q, .scales, .y}, {.tensor_scale})
//     fp8_block_gemm(b, fp8_block_gemm_args<>{.a_q, .a_scales, .b_q, .b_scales, .c})   C = dequant(A) · dequant(B)^T
// T is float or bfloat16 (the input views are const), Out the same (non-const); the code and
// scale views of the dequantisers and the GEMM may be const or not (template parameters with
// const defaults).
//
// CUDA: k3/quant/cuda.hpp declares raw launchers on device views (k3::quant::cuda::*),
// defined in k3/quant/cuda.cuh (include it from a .cu file); they reproduce the reference bytes.
//
// Backends: k3::cpu::serial runs the scalar reference (k3/quant/reference.hpp);
// k3::cpu::simd<Arch> and k3::cpu::threads<Arch> run vectorised kernels (threads: over rows /
// tiles) that produce the same bytes. Inputs are float or bfloat16 views of rank 2 with any
// strides (the vector path needs unit-stride rows and otherwise uses the reference); a tensor
// of higher rank is quantised as its [rows, last] matrix. Layouts: see k3/quant/common.hpp.
// Memory tuning (never the bytes): the bf16 row kernels may prefetch their input and write
// large code outputs with non-temporal stores (which leaves the codes in DRAM, not in cache);
// fp8_quantize_options / mx_quantize_options carry `stores` (force either way) and `tuning`,
// whose defaults come from the host's cache sizes (k3/quant/tuning.hpp).
//
// Special inputs (documented results, tested):
//   * DeepSeek: amax is clamped up to 1e-4 (an all-zero tile gets s = 1e-4/448 and zero codes).
//     A tile holding NaN or ±Inf gets s = NaN and all codes 0x7F: it decodes to NaN.
//   * MX: an all-zero block gets scale 0x00 (2^-127) and zero codes; a block holding NaN or
//     ±Inf gets scale 0xFF (NaN) and decodes to NaN (element codes: the format's NaN, or +max
//     for FP6/FP4, which have no NaN). Elements beyond the range after scaling are clamped to
//     ±max (FLOOR can clip the top binade; RCEIL never does).
//   * NVFP4: the tensor scale g (options::tensor_scale) = amax/(448·6) is taken over the finite
//     values; g = 1 for an all-zero tensor (or when g < 2^-140: amax < 2.4e-39), so zero tensors
//     encode as zeros. A block
//     holding NaN/±Inf gets scale 0x7F (NaN) and decodes to NaN; other blocks are unaffected.
//   * Every element conversion is saturating (saturation::finite, CUDA __NV_SATFINITE).
// Bad input (wrong shapes, K not a multiple of the MX/NVFP4 block, overlapping outputs, a
// non-positive or missing tensor scale) throws k3::error naming the argument or option.
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


template <class T, std::size_t R>
bool unit_rows(tensor_view<T, R> const& v) {
  return v.extent(R - 1) <= 1 || v.stride(R - 1) == 1;
}

// Splits rows [0, m) over the backend (threads: for_each_task) for the reference paths.
template <class B, class F>
void rows_parallel(B const& b, index_t m, index_t rows_per_task, F&& f) {
  index_t const tasks = ceil_div(m, rows_per_task);
  k3::run_tasks(b, tasks, [&](index_t t) { f(t * rows_per_task, std::min(m, (t + 1) * rows_per_task)); });
}

}  // namespace detail

// ---- argument bundles and options --------------------------------------------------------------
// Views live in `Space` (host_space for the CPU backends); options stay on the host.

// DeepSeek tiles: x [M, K] -> q [M, K] E4M3 codes, scales [ceil(M/tr), ceil(K/tc)] float.
template <class In, class Space = host_space>
struct fp8_quantize_args {
  tensor_view<In const, 2, Space> x;
  tensor_view<std::uint8_t, 2, Space> q;
  tensor_view<float, 2, Space> scales;
};
struct fp8_quantize_options {
  ::k3::quant::tile tile = tile_1x128;
  scale_format format = scale_format::fp32;
  store_mode stores = store_mode::automatic;                      // the vector row kernels' code stores
  ::k3::quant::tuning tuning = ::k3::quant::tuning::host();  // their prefetch and streaming (k3/quant/tuning.hpp)
};

template <class Out, class QT = std::uint8_t const, class ST = float const, class Space = host_space>
struct fp8_dequantize_args {
  tensor_view<QT, 2, Space> q;
  tensor_view<ST, 2, Space> scales;
  tensor_view<Out, 2, Space> y;
};
struct fp8_dequantize_options {
  ::k3::quant::tile tile = tile_1x128;  // the tile the codes were quantised with
};

// 1x128 tiles (q [M, K], scales [M, ceil(K/128)]) to 128x1 tiles (q2 [M, K], scales2 [ceil(M/128), K]).
template <class QT = std::uint8_t const, class ST = float const, class Space = host_space>
struct fp8_requantize_args {
  tensor_view<QT, 2, Space> q;
  tensor_view<ST, 2, Space> scales;
  tensor_view<std::uint8_t, 2, Space> q2;
  tensor_view<float, 2, Space> scales2;
};
struct fp8_requantize_options {
  scale_format format = scale_format::ue8m0;  // of scales2
};

// OCP MX: x [M, K] -> q [M, mx_code_columns(element, K)], scales [M, K/32] E8M0.
template <class In, class Space = host_space>
struct mx_quantize_args {
  tensor_view<In const, 2, Space> x;
  tensor_view<std::uint8_t, 2, Space> q;
  tensor_view<std::uint8_t, 2, Space> scales;
};
struct mx_quantize_options {
  mx_element element = mx_element::e4m3;  // MXFP8 E4M3 unless told otherwise
  mx_rule rule = mx_rule::floor;
  store_mode stores = store_mode::automatic;                      // as in fp8_quantize_options
  ::k3::quant::tuning tuning = ::k3::quant::tuning::host();
};

template <class Out, class QT = std::uint8_t const, class ST = std::uint8_t const, class Space = host_space>
struct mx_dequantize_args {
  tensor_view<QT, 2, Space> q;
  tensor_view<ST, 2, Space> scales;
  tensor_view<Out, 2, Space> y;
};
struct mx_dequantize_options {
  mx_element element = mx_element::e4m3;  // the element the codes were quantised to
};

// NVFP4: x [M, K] -> q [M, K/2] packed E2M1, scales [M, K/16] UE4M3, plus the fp32 tensor
// scale, which both directions take as options::tensor_scale.
template <class In, class Space = host_space>
struct nvfp4_tensor_scale_args {
  tensor_view<In const, 2, Space> x;
};
struct nvfp4_tensor_scale_options {};

template <class In, class Space = host_space>
struct nvfp4_quantize_args {
  tensor_view<In const, 2, Space> x;
  tensor_view<std::uint8_t, 2, Space> q;
  tensor_view<std::uint8_t, 2, Space> scales;
};
struct nvfp4_quantize_options {
  // nvfp4_tensor_scale of x (or a calibrated value); the 0 default is rejected, so it is never forgotten.
  float tensor_scale = 0.0f;
  nvfp4_rounding rounding = nvfp4_rounding::reciprocal;
};

template <class Out, class QT = std::uint8_t const, class ST = std::uint8_t const, class Space = host_space>
struct nvfp4_dequantize_args {
  tensor_view<QT, 2, Space> q;
  tensor_view<ST, 2, Space> scales;
  tensor_view<Out, 2, Space> y;
};
struct nvfp4_dequantize_options {
  float tensor_scale = 0.0f;  // the value the codes were quantised with; 0 is rejected
};

// a_q [M, K] E4M3 with 1x128 scales a_scales [M, ceil(K/128)]; b_q [N, K] E4M3 with 128x128
// scales b_scales [ceil(N/128), ceil(K/128)]; c [M, N] float.
template <class QA = std::uint8_t const, class SA = float const, class QB = std::uint8_t const, class SB = float const, class Space = host_space>
struct fp8_block_gemm_args {
  tensor_view<QA, 2, Space> a_q;
  tensor_view<SA, 2, Space> a_scales;
  tensor_view<QB, 2, Space> b_q;
  tensor_view<SB, 2, Space> b_scales;
  tensor_view<float, 2, Space> c;
};
struct fp8_block_gemm_options {};

// ---- validation shared by every backend ----------------------------------------------------------
namespace detail {

template <class T>
concept code_type = std::is_same_v<std::remove_const_t<T>, std::uint8_t>;
template <class T>
concept float_scale_type = std::is_same_v<std::remove_const_t<T>, float>;

template <class In, class Space>
void validate(fp8_quantize_args<In, Space> const& a, fp8_quantize_options const& o) {
  check_tile(o.tile);
  k3::detail::check_view("x", a.x);
  k3::detail::check_view("q", a.q);
  k3::detail::check_view("scales", a.scales);
  index_t const m = a.x.extent(0), k = a.x.extent(1);
  k3::detail::check_shape("q", a.q, {m, k});
  k3::detail::check_shape("scales", a.scales, {ceil_div(m, o.tile.rows), ceil_div(k, o.tile.cols)});
  check_quantize_outputs(a.q, a.scales, a.x);
}

template <class Out, class QT, class ST, class Space>
void validate(fp8_dequantize_args<Out, QT, ST, Space> const& a, fp8_dequantize_options const& o) {
  check_tile(o.tile);
  k3::detail::check_view("q", a.q);
  k3::detail::check_view("scales", a.scales);
  k3::detail::check_view("y", a.y);
  index_t const m = a.q.extent(0), k = a.q.extent(1);
  k3::detail::check_shape("scales", a.scales, {ceil_div(m, o.tile.rows), ceil_div(k, o.tile.cols)});
  k3::detail::check_shape("y", a.y, {m, k});
  check_dequantize_output(a.y, a.q, a.scales);
}

template <class QT, class ST, class Space>
void validate(fp8_requantize_args<QT, ST, Space> const& a, fp8_requantize_options const&) {
  k3::detail::check_view("q", a.q);
  k3::detail::check_view("scales", a.scales);
  k3::detail::check_view("q2", a.q2);
  k3::detail::check_view("scales2", a.scales2);
  index_t const m = a.q.extent(0), k = a.q.extent(1);
  k3::detail::check_shape("scales", a.scales, {m, ceil_div(k, 128)});
  k3::detail::check_shape("q2", a.q2, {m, k});
  k3::detail::check_shape("scales2", a.scales2, {ceil_div(m, 128), k});
  k3::detail::check_outputs_apart(::k3::detail::named_views("q2", a.q2, "scales2", a.scales2),
                                  ::k3::detail::named_views("q", a.q, "scales", a.scales));
}

// The codes q [m, code_columns(k)] and block scales [m, k / block] of the [m, k] tensor
// `name` (x quantized, or y dequantized into), whose k must be a multiple of the block.
template <class X, class Q, class S, class Codes>
void check_block_layout(char const* name, X const& x, Q const& q, S const& s, index_t block, Codes&& code_columns) {
  index_t const m = x.extent(0), k = x.extent(1);
  check_divides(name, k, block);
  k3::detail::check_shape("q", q, {m, code_columns(k)});
  k3::detail::check_shape("scales", s, {m, k / block});
}

template <class In, class Space>
void validate(mx_quantize_args<In, Space> const& a, mx_quantize_options const& o) {
  k3::detail::check_view("x", a.x);
  k3::detail::check_view("q", a.q);
  k3::detail::check_view("scales", a.scales);
  check_block_layout("x", a.x, a.q, a.scales, mx_block, [&](index_t k) { return mx_code_columns(o.element, k); });
  check_quantize_outputs(a.q, a.scales, a.x);
}

template <class Out, class QT, class ST, class Space>
void validate(mx_dequantize_args<Out, QT, ST, Space> const& a, mx_dequantize_options const& o) {
  k3::detail::check_view("q", a.q);
  k3::detail::check_view("scales", a.scales);
  k3::detail::check_view("y", a.y);
  check_block_layout("y", a.y, a.q, a.scales, mx_block, [&](index_t k) { return mx_code_columns(o.element, k); });
  check_dequantize_output(a.y, a.q, a.scales);
}

template <class In, class Space>
void validate(nvfp4_quantize_args<In, Space> const& a, nvfp4_quantize_options const& o) {
  k3::detail::check_view("x", a.x);
  k3::detail::check_view("q", a.q);
  k3::detail::check_view("scales", a.scales);
  check_tensor_scale(o.tensor_scale);
  check_block_layout("x", a.x, a.q, a.scales, nvfp4_block, [](index_t k) { return k / 2; });
  check_quantize_outputs(a.q, a.scales, a.x);
}

template <class Out, class QT, class ST, class Space>
void validate(nvfp4_dequantize_args<Out, QT, ST, Space> const& a, nvfp4_dequantize_options const& o) {
  k3::detail::check_view("q", a.q);
  k3::detail::check_view("scales", a.scales);
  k3::detail::check_view("y", a.y);
  check_tensor_scale(o.tensor_scale);
  check_block_layout("y", a.y, a.q, a.scales, nvfp4_block, [](index_t k) { return k / 2; });
  check_dequantize_output(a.y, a.q, a.scales);
}

template <class QA, class SA, class QB, class SB, class Space>
void validate(fp8_block_gemm_args<QA, SA, QB, SB, Space> const& a, fp8_block_gemm_options const&) {
  k3::detail::check_view("a_q", a.a_q);
  k3::detail::check_view("a_scales", a.a_scales);
  k3::detail::check_view("b_q", a.b_q);
  k3::detail::check_view("b_scales", a.b_scales);
  k3::detail::check_view("c", a.c);
  index_t const m = a.a_q.extent(0), k = a.a_q.extent(1), n = a.b_q.extent(0);
  k3::detail::check_shape("b_q", a.b_q, {n, k});
  k3::detail::check_shape("a_scales", a.a_scales, {m, ceil_div(k, 128)});
  k3::detail::check_shape("b_scales", a.b_scales, {ceil_div(n, 128), ceil_div(k, 128)});
  k3::detail::check_shape("c", a.c, {m, n});
  check_gemm_output(a.c, a.a_q, a.a_scales, a.b_q, a.b_scales);
}

}  // namespace detail

// ---- DeepSeek FP8 tiles ------------------------------------------------------------------------
template <HostBackend B, detail::quant_input T, class Space, class = ::k3::detail::reachable<B, Space>>
void fp8_quantize(B const& b, fp8_quantize_args<T, Space> const& a, fp8_quantize_options const& o = {}) {
  detail::validate(a, o);
  const_view<std::remove_const_t<T>, 2> x = a.x;
  tensor_view<std::uint8_t, 2> q = a.q;
  tensor_view<float, 2> s = a.scales;
  tile const t = o.tile;
  scale_format const fmt = o.format;
  if (x.size() == 0) return;
  if constexpr (VectorBackend<B>) {
    if (detail::unit_rows(x) && detail::unit_rows(q) && t.cols > 1) {
      simd_impl::fp8_quantize<typename B::arch_type>(b, x, q, s, t, fmt, o.stores, o.tuning);
      return;
    }
  }
  index_t const rb = s.extent(0);
  detail::rows_parallel(b, rb, std::max<index_t>(1, 16 / t.rows),
                        [&](index_t r0, index_t r1) { reference::fp8_quantize_rows(x, q, s, t, fmt, r0, r1); });
}

template <HostBackend B, detail::quant_output Out, detail::code_type QT, detail::float_scale_type ST, class Space, class = ::k3::detail::reachable<B, Space>>
void fp8_dequantize(B const& b, fp8_dequantize_args<Out, QT, ST, Space> const& a, fp8_dequantize_options const& o = {}) {
  detail::validate(a, o);
  const_view<std::uint8_t, 2> q = a.q;
  const_view<float, 2> s = a.scales;
  tensor_view<Out, 2> y = a.y;
  tile const t = o.tile;
  index_t const m = q.extent(0);
  detail::rows_parallel(b, m, 16, [&](index_t i0, index_t i1) { reference::fp8_dequantize_rows(q, s, y, t, i0, i1); });
}

// Backward re-quantisation; equal to fp8_quantize(fp8_dequantize(q, scales), 128x1). With
// UE8M0 scales it is exact for every element that stays a normal E4M3 number.
template <HostBackend B, detail::code_type QT, detail::float_scale_type ST, class Space, class = ::k3::detail::reachable<B, Space>>
void fp8_requantize_1x128_to_128x1(B const& b, fp8_requantize_args<QT, ST, Space> const& a, fp8_requantize_options const& o = {}) {
  detail::validate(a, o);
  const_view<std::uint8_t, 2> q = a.q;
  const_view<float, 2> s = a.scales;
  tensor_view<std::uint8_t, 2> q2 = a.q2;
  tensor_view<float, 2> s2 = a.scales2;
  scale_format const fmt = o.format;
  if (q.size() == 0) return;
  index_t const k = q.extent(1);
  detail::rows_parallel(b, k, 128, [&](index_t j0, index_t j1) { reference::fp8_requantize_cols(q, s, q2, s2, fmt, j0, j1); });
}

// ---- OCP MX --------------------------------------------------------------------------------------
template <HostBackend B, detail::quant_input T, class Space, class = ::k3::detail::reachable<B, Space>>
void mx_quantize(B const& b, mx_quantize_args<T, Space> const& a, mx_quantize_options const& o = {}) {
  detail::validate(a, o);
  const_view<std::remove_const_t<T>, 2> x = a.x;
  tensor_view<std::uint8_t, 2> q = a.q;
  tensor_view<std::uint8_t, 2> s = a.scales;
  mx_rule const rule = o.rule;
  index_t const m = x.extent(0);
  if (x.size() == 0) return;
  visit(o.element, [&]<class F>(F) {
    if constexpr (VectorBackend<B>) {
      if (detail::unit_rows(x) && detail::unit_rows(q)) {
        simd_impl::mx_quantize<typename B::arch_type, F>(b, x, q, s, rule, o.stores, o.tuning);
        return;
      }
    }
    detail::rows_parallel(b, m, 8, [&](index_t i0, index_t i1) { reference::mx_quantize_rows<F>(x, q, s, rule, i0, i1); });
  });
}

template <HostBackend B, detail::quant_output Out, detail::code_type QT, detail::code_type ST, class Space, class = ::k3::detail::reachable<B, Space>>
void mx_dequantize(B const& b, mx_dequantize_args<Out, QT, ST, Space> const& a, mx_dequantize_options const& o = {}) {
  detail::validate(a, o);
  const_view<std::uint8_t, 2> q = a.q;
  const_view<std::uint8_t, 2> s = a.scales;
  tensor_view<Out, 2> y = a.y;
  index_t const m = y.extent(0);
  visit(o.element, [&]<class F>(F) {
    detail::rows_parallel(b, m, 16, [&](index_t i0, index_t i1) { reference::mx_dequantize_rows<F>(q, s, y, i0, i1); });
  });
}

// ---- NVFP4 --------------------------------------------------------------------------------------------
// The fp32 tensor scale amax/(448·6) over the finite values (1 for an all-zero tensor).
template <HostBackend B, detail::quant_input T, class Space, class = ::k3::detail::reachable<B, Space>>
float nvfp4_tensor_scale(B const& b, nvfp4_tensor_scale_args<T, Space> const& a, nvfp4_tensor_scale_options const& = {}) {
  const_view<std::remove_const_t<T>, 2> x = a.x;
  k3::detail::check_view("x", x);
  if (x.size() == 0) return 1.0f;
  std::uint32_t amax = 0;
  if constexpr (VectorBackend<B>) {
    if (detail::unit_rows(x)) return reference::nvfp4_scale_from_amax(simd_impl::finite_amax_bits<typename B::arch_type>(b, x));
  }
  amax = reference::finite_amax_bits(x, 0, x.extent(0));
  return reference::nvfp4_scale_from_amax(amax);
}

template <HostBackend B, detail::quant_input T, class Space, class = ::k3::detail::reachable<B, Space>>
void nvfp4_quantize(B const& b, nvfp4_quantize_args<T, Space> const& a, nvfp4_quantize_options const& o = {}) {
  detail::validate(a, o);
  const_view<std::remove_const_t<T>, 2> x = a.x;
  tensor_view<std::uint8_t, 2> q = a.q;
  tensor_view<std::uint8_t, 2> s = a.scales;
  float const g = o.tensor_scale;
  nvfp4_rounding const rounding = o.rounding;
  index_t const m = x.extent(0);
  if (x.size() == 0) return;
  if constexpr (VectorBackend<B>) {
    if (detail::unit_rows(x) && detail::unit_rows(q)) {
      simd_impl::nvfp4_quantize<typename B::arch_type>(b, x, q, s, g, rounding);
      return;
    }
  }
  detail::rows_parallel(b, m, 8, [&](index_t i0, index_t i1) { reference::nvfp4_quantize_rows(x, q, s, g, i0, i1, rounding); });
}

template <HostBackend B, detail::quant_output Out, detail::code_type QT, detail::code_type ST, class Space, class = ::k3::detail::reachable<B, Space>>
void nvfp4_dequantize(B const& b, nvfp4_dequantize_args<Out, QT, ST, Space> const& a, nvfp4_dequantize_options const& o = {}) {
  detail::validate(a, o);
  const_view<std::uint8_t, 2> q = a.q;
  const_view<std::uint8_t, 2> s = a.scales;
  tensor_view<Out, 2> y = a.y;
  float const g = o.tensor_scale;
  index_t const m = y.extent(0);
  detail::rows_parallel(b, m, 16, [&](index_t i0, index_t i1) { reference::nvfp4_dequantize_rows(q, s, g, y, i0, i1); });
}

// ---- block-scaled FP8 GEMM ----------------------------------------------------------------------
// See reference::fp8_block_gemm_rows for the accumulation order (fp32 partial sums per
// 128-wide K block, promoted with one fma).
template <HostBackend B, detail::code_type QA, detail::float_scale_type SA, detail::code_type QB, detail::float_scale_type SB, class Space, class = ::k3::detail::reachable<B, Space>>
void fp8_block_gemm(B const& b, fp8_block_gemm_args<QA, SA, QB, SB, Space> const& a, fp8_block_gemm_options const& o = {}) {
  detail::validate(a, o);
  const_view<std::uint8_t, 2> qa = a.a_q, qb = a.b_q;
  const_view<float, 2> sa = a.a_scales, sb = a.b_scales;
  tensor_view<float, 2> c = a.c;
  index_t const m = qa.extent(0), k = qa.extent(1), n = qb.extent(0);
  if (c.size() == 0) return;
  if (k == 0) {  // an empty sum (the vector kernel writes C only from inside its K-block loop)
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < n; ++j) c(i, j) = 0.0f;
    return;
  }
  if constexpr (VectorBackend<B>) {
    gemm_impl::fp8_block_gemm<typename B::arch_type>(b, qa, sa, qb, sb, c);
  } else {
    detail::rows_parallel(b, m, 16, [&](index_t i0, index_t i1) { reference::fp8_block_gemm_rows(qa, sa, qb, sb, c, i0, i1); });
  }
}

}  // namespace k3::quant
