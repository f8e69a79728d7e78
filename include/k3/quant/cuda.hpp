// k3/quant/cuda.hpp — host-parsable declarations of the CUDA block quantizers, dequantizers
// and block-scaled GEMM (definitions in k3/quant/cuda.cuh, instantiated by including it in a
// .cu file). Views live in device memory; layouts and special-value rules are those of
// k3/quant.hpp, and each kernel produces the CPU reference's bytes (the GEMM its bits).
#pragma once
#include <cstdint>

#include "k3/core/memory_space.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/quant/common.hpp"

struct CUstream_st;

namespace k3::quant::cuda {

template <class T, std::size_t R>
using dview = tensor_view<T, R, cuda_device_space>;

template <class T>
void fp8_quantize(dview<T const, 2> x, dview<std::uint8_t, 2> q, dview<float, 2> s, tile t, scale_format fmt, CUstream_st* stream = nullptr);
void fp8_dequantize(dview<std::uint8_t const, 2> q, dview<float const, 2> s, dview<float, 2> y, tile t, CUstream_st* stream = nullptr);

template <class T>
void mx_quantize(dview<T const, 2> x, dview<std::uint8_t, 2> q, dview<std::uint8_t, 2> s, mx_element e, mx_rule rule,
                 CUstream_st* stream = nullptr);
void mx_dequantize(dview<std::uint8_t const, 2> q, dview<std::uint8_t const, 2> s, dview<float, 2> y, mx_element e,
                   CUstream_st* stream = nullptr);

// g: the fp32 tensor scale (k3::quant::nvfp4_tensor_scale, or nvfp4_tensor_scale below).
template <class T>
void nvfp4_quantize(dview<T const, 2> x, dview<std::uint8_t, 2> q, dview<std::uint8_t, 2> s, float g, CUstream_st* stream = nullptr,
                    nvfp4_rounding rounding = nvfp4_rounding::reciprocal);
void nvfp4_dequantize(dview<std::uint8_t const, 2> q, dview<std::uint8_t const, 2> s, float g, dview<float, 2> y,
                      CUstream_st* stream = nullptr);
// Synchronous: the tensor scale from a device-side finite amax.
template <class T>
float nvfp4_tensor_scale(dview<T const, 2> x, CUstream_st* stream = nullptr);

void fp8_block_gemm(dview<std::uint8_t const, 2> qa, dview<float const, 2> sa, dview<std::uint8_t const, 2> qb, dview<float const, 2> sb,
                    dview<float, 2> c, CUstream_st* stream = nullptr);

}  // namespace k3::quant::cuda
