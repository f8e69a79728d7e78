// k3/quant/cuda/backend.cuh — block quantisation on k3::cuda::stream_backend: k3::quant::fp8_quantize,
// fp8_dequantize, fp8_requantize_1x128_to_128x1, mx_quantize / mx_dequantize, nvfp4_tensor_scale,
// nvfp4_quantize / nvfp4_dequantize and fp8_block_gemm (k3/quant.hpp's calls) for args of device
// views, in a TU compiled by nvcc or against the SIMT host runtime. The arguments go through the
// host backends' validation (k3::quant::detail::validate: shapes, block sizes, tensor scale,
// aliasing), then the launchers of k3/quant/cuda.cuh run on the backend's stream (on its device).
//
//   k3::cuda::stream_backend be{stream};
//   k3::quant::fp8_quantize(be, k3::quant::fp8_quantize_args<k3::bfloat16, k3::cuda_device_space>{...}, {.tile = ...});
//
// What the CUDA backend serves: what the host backends do, with their bytes (the GEMM its bits):
// float or bfloat16 inputs and dequantised outputs, any strides, every tile and scale format, MX
// element and rule, and NVFP4 rounding. The host kernels' memory tuning (options::stores and
// options::tuning) means nothing here and is ignored. A bfloat16 dequantised output and the
// re-quantisation go through a temporary float matrix on the device (the launchers write float;
// re-quantisation is fp8_quantize(fp8_dequantize(q, scales), 128x1), which the host reference
// equals bit for bit).
// Not served (an unsupported-kind k3::error naming the argument): shapes whose launch grid is past
// CUDA's limits, i.e. fp8_quantize with more than 65535 tile rows (ceil(M / tile.rows): M > 65535
// for 1x128 tiles), re-quantisation with M > 65535 · 128, the GEMM with M > 65535 · 16, and MX /
// NVFP4 quantisation of more than (2^31 - 1) · 256 elements.
// Calls return without synchronising, except nvfp4_tensor_scale (it returns the value on the host)
// and the calls with a temporary matrix (its cudaFree waits for the device).
#pragma once
#include "k3/backend/cuda/backend.cuh"
// (backend.cuh first: its config.cuh picks the CUDA runtime)
#include <cstdint>
#include <string>
#include <type_traits>

#include "k3/quant.hpp"
#include "k3/quant/cuda.cuh"

namespace k3::quant {
namespace detail {

inline constexpr index_t cuda_max_grid_x = 2147483647;  // gridDim.x
inline constexpr index_t cuda_max_grid_y = 65535;       // gridDim.y

// A launch grid past CUDA's limit would fail (or, cast to unsigned, wrap) inside the launcher.
inline void check_cuda_grid(char const* arg, char const* per, index_t blocks, index_t limit) {
  ::k3::detail::require(blocks <= limit, error_kind::unsupported, [&] {
    return std::string("argument '") + arg + "': the CUDA kernel launches one thread block per " + per + ", at most " +
           std::to_string(limit) + " in that grid dimension, got " + std::to_string(blocks);
  });
}

// The 256-thread blocks of the MX / NVFP4 quantisers (one thread per element) fit in gridDim.x.
template <class X>
void check_element_grid(X const& x) {
  check_cuda_grid("x", "256 elements", ceil_div(x.size(), 256), cuda_max_grid_x);
}

// An [m, k] contiguous float matrix on the device for the duration of a call.
struct device_matrix {
  ::k3::cuda::detail::device_scratch<float> memory;
  tensor_view<float, 2, cuda_device_space> view;
  device_matrix(index_t m, index_t k) : memory(static_cast<std::size_t>(m * k)), view(memory.get(), {m, k}) {}
};

// dst(i, j) = src(i, j) stored as Out (store_as: the host reference's rounding), one thread per element.
template <class Out>
struct store_matrix {
  tensor_view<float const, 2, cuda_device_space> src;
  tensor_view<Out, 2, cuda_device_space> dst;
  K3_HD void operator()(std::int64_t e) const {
    index_t const k = dst.extent(1), i = e / k, j = e % k;
    dst(i, j) = store_as<Out>(src(i, j));
  }
};

// Runs launch(view) on the float view a dequantising launcher writes: y itself, or a temporary
// float matrix that is then stored into y (the launchers write float only).
template <class Out, class B, class Launch>
void dequantize_into(B const& be, tensor_view<Out, 2, cuda_device_space> const& y, Launch&& launch) {
  if constexpr (std::is_same_v<Out, float>) {
    launch(y);
  } else {
    device_matrix tmp(y.extent(0), y.extent(1));
    launch(tmp.view);
    be.for_each(0, y.size(), store_matrix<Out>{tmp.view, y});
  }
}

}  // namespace detail

// ---- DeepSeek FP8 tiles ------------------------------------------------------------------------
template <CudaBackend B, detail::quant_input T>
void fp8_quantize(B const& be, fp8_quantize_args<T, cuda_device_space> const& a, fp8_quantize_options const& o = {}) {
  detail::validate(a, o);
  detail::check_cuda_grid("x", "row of tiles (ceil(M / tile.rows))", a.scales.extent(0), detail::cuda_max_grid_y);
  detail::check_cuda_grid("x", "column of tiles (ceil(K / tile.cols))", a.scales.extent(1), detail::cuda_max_grid_x);
  if (a.x.size() == 0) return;
  ::k3::cuda::detail::device_guard g(be.requested_device());
  cuda::fp8_quantize<std::remove_const_t<T>>(a.x, a.q, a.scales, o.tile, o.format, be.stream());
}

template <CudaBackend B, detail::quant_output Out, detail::code_type QT, detail::float_scale_type ST>
void fp8_dequantize(B const& be, fp8_dequantize_args<Out, QT, ST, cuda_device_space> const& a, fp8_dequantize_options const& o = {}) {
  detail::validate(a, o);
  if (a.y.size() == 0) return;
  ::k3::cuda::detail::device_guard g(be.requested_device());
  detail::dequantize_into(be, a.y, [&](cuda::dview<float, 2> y) { cuda::fp8_dequantize(a.q, a.scales, y, o.tile, be.stream()); });
}

template <CudaBackend B, detail::code_type QT, detail::float_scale_type ST>
void fp8_requantize_1x128_to_128x1(B const& be, fp8_requantize_args<QT, ST, cuda_device_space> const& a,
                                   fp8_requantize_options const& o = {}) {
  detail::validate(a, o);
  detail::check_cuda_grid("q", "128 rows (ceil(M / 128))", a.scales2.extent(0), detail::cuda_max_grid_y);
  detail::check_cuda_grid("q", "column", a.scales2.extent(1), detail::cuda_max_grid_x);
  if (a.q.size() == 0) return;
  ::k3::cuda::detail::device_guard g(be.requested_device());
  detail::device_matrix y(a.q.extent(0), a.q.extent(1));
  cuda::fp8_dequantize(a.q, a.scales, y.view, tile_1x128, be.stream());
  cuda::fp8_quantize<float>(y.view, a.q2, a.scales2, tile_128x1, o.format, be.stream());
}

// ---- OCP MX --------------------------------------------------------------------------------------
template <CudaBackend B, detail::quant_input T>
void mx_quantize(B const& be, mx_quantize_args<T, cuda_device_space> const& a, mx_quantize_options const& o = {}) {
  detail::validate(a, o);
  detail::check_element_grid(a.x);
  if (a.x.size() == 0) return;
  ::k3::cuda::detail::device_guard g(be.requested_device());
  cuda::mx_quantize<std::remove_const_t<T>>(a.x, a.q, a.scales, o.element, o.rule, be.stream());
}

template <CudaBackend B, detail::quant_output Out, detail::code_type QT, detail::code_type ST>
void mx_dequantize(B const& be, mx_dequantize_args<Out, QT, ST, cuda_device_space> const& a, mx_dequantize_options const& o = {}) {
  detail::validate(a, o);
  if (a.y.size() == 0) return;
  ::k3::cuda::detail::device_guard g(be.requested_device());
  detail::dequantize_into(be, a.y, [&](cuda::dview<float, 2> y) { cuda::mx_dequantize(a.q, a.scales, y, o.element, be.stream()); });
}

// ---- NVFP4 --------------------------------------------------------------------------------------------
// Synchronous: the value comes back to the host.
template <CudaBackend B, detail::quant_input T>
float nvfp4_tensor_scale(B const& be, nvfp4_tensor_scale_args<T, cuda_device_space> const& a, nvfp4_tensor_scale_options const& = {}) {
  ::k3::detail::check_view("x", a.x);
  if (a.x.size() == 0) return 1.0f;
  ::k3::cuda::detail::device_guard g(be.requested_device());
  return cuda::nvfp4_tensor_scale<std::remove_const_t<T>>(a.x, be.stream());
}

template <CudaBackend B, detail::quant_input T>
void nvfp4_quantize(B const& be, nvfp4_quantize_args<T, cuda_device_space> const& a, nvfp4_quantize_options const& o = {}) {
  detail::validate(a, o);
  detail::check_element_grid(a.x);
  if (a.x.size() == 0) return;
  ::k3::cuda::detail::device_guard g(be.requested_device());
  cuda::nvfp4_quantize<std::remove_const_t<T>>(a.x, a.q, a.scales, o.tensor_scale, be.stream(), o.rounding);
}

template <CudaBackend B, detail::quant_output Out, detail::code_type QT, detail::code_type ST>
void nvfp4_dequantize(B const& be, nvfp4_dequantize_args<Out, QT, ST, cuda_device_space> const& a, nvfp4_dequantize_options const& o = {}) {
  detail::validate(a, o);
  if (a.y.size() == 0) return;
  ::k3::cuda::detail::device_guard g(be.requested_device());
  detail::dequantize_into(be, a.y, [&](cuda::dview<float, 2> y) { cuda::nvfp4_dequantize(a.q, a.scales, o.tensor_scale, y, be.stream()); });
}

// ---- block-scaled FP8 GEMM ----------------------------------------------------------------------
// K = 0 writes C = 0, as on the host (the kernel's K-block loop is empty).
template <CudaBackend B, detail::code_type QA, detail::float_scale_type SA, detail::code_type QB, detail::float_scale_type SB>
void fp8_block_gemm(B const& be, fp8_block_gemm_args<QA, SA, QB, SB, cuda_device_space> const& a, fp8_block_gemm_options const& o = {}) {
  detail::validate(a, o);
  detail::check_cuda_grid("a_q", "16 rows of c (ceil(M / 16))", detail::ceil_div(a.c.extent(0), cuda::kernels::gemm_tile),
                          detail::cuda_max_grid_y);
  detail::check_cuda_grid("b_q", "16 columns of c (ceil(N / 16))", detail::ceil_div(a.c.extent(1), cuda::kernels::gemm_tile),
                          detail::cuda_max_grid_x);
  if (a.c.size() == 0) return;
  ::k3::cuda::detail::device_guard g(be.requested_device());
  cuda::fp8_block_gemm(a.a_q, a.a_scales, a.b_q, a.b_scales, a.c, be.stream());
}

}  // namespace k3::quant
