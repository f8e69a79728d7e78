// k3/quant/cuda.cuh — CUDA kernels behind k3/quant/cuda.hpp. Include from a .cu file.
//   * DeepSeek tiles: one thread block per scale tile; amax by warp max-reduction and a
//     shared atomicMax over |x| bit patterns; the scale by the same bit-exact function as the
//     CPU; then every thread encodes its elements.
//   * MX: one warp per 32-element block, one lane per element; NVFP4: half a warp per block.
//   * GEMM: 16x16 C tiles, decoded 16x128 A/B panels in shared memory; per K block the fp32
//     partial sum runs in k order and is promoted with one fmaf, as the CPU reference does.
#pragma once
#include "k3/backend/cuda/config.cuh"
// (config.cuh first: it refuses host compilers)
#include <cstdint>

#include "k3/quant/common.hpp"
#include "k3/quant/cuda.hpp"

namespace k3::quant::cuda {

namespace kernels {

__device__ __forceinline__ std::uint32_t warp_max(std::uint32_t v, int width = 32) {
  for (int off = width / 2; off > 0; off /= 2) {
    std::uint32_t o = __shfl_xor_sync(0xFFFFFFFFu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

template <class T>
K3_KERNEL void fp8_quantize(dview<T const, 2> x, dview<std::uint8_t, 2> q, dview<float, 2> s, tile t, scale_format fmt) {
  __shared__ std::uint32_t amax_s;
  __shared__ float inv_s;
  index_t const rb = blockIdx.y, cb = blockIdx.x;
  index_t const m = x.extent(0), k = x.extent(1);
  index_t const i0 = rb * t.rows, j0 = cb * t.cols;
  index_t const rows = (m - i0 < t.rows ? m - i0 : t.rows), cols = (k - j0 < t.cols ? k - j0 : t.cols);
  index_t const n = rows * cols;
  if (threadIdx.x == 0) amax_s = 0;
  __syncthreads();
  std::uint32_t a = 0;
  for (index_t e = threadIdx.x; e < n; e += blockDim.x) {
    std::uint32_t v = detail::abs_bits(detail::to_f32(x(i0 + e / cols, j0 + e % cols)));
    a = v > a ? v : a;
  }
  a = warp_max(a);
  if ((threadIdx.x & 31) == 0) atomicMax(&amax_s, a);
  __syncthreads();
  if (threadIdx.x == 0) {
    auto const sc = detail::deepseek_scale(amax_s, fmt);
    s(rb, cb) = sc.s;
    inv_s = sc.inv;
  }
  __syncthreads();
  float const inv = inv_s;
  for (index_t e = threadIdx.x; e < n; e += blockDim.x) {
    index_t const i = i0 + e / cols, j = j0 + e % cols;
    q(i, j) = encode<e4m3_format>(detail::to_f32(x(i, j)) * inv, saturation::finite);
  }
}

// A template (with a defaulted parameter) so that every TU including this header may define it (ODR).
template <int = 0>
K3_KERNEL void fp8_dequantize(dview<std::uint8_t const, 2> q, dview<float const, 2> s, dview<float, 2> y, tile t) {
  index_t const k = q.extent(1), n = q.extent(0) * k;
  for (index_t e = blockIdx.x * index_t(blockDim.x) + threadIdx.x; e < n; e += index_t(gridDim.x) * blockDim.x) {
    index_t const i = e / k, j = e % k;
    y(i, j) = decode<e4m3_format>(q(i, j)) * s(i / t.rows, j / t.cols);
  }
}

// One warp per (row, 32-block); `blocks` = rows * K/32.
template <class F, class T>
K3_KERNEL void mx_quantize(dview<T const, 2> x, dview<std::uint8_t, 2> q, dview<std::uint8_t, 2> s, mx_rule rule) {
  index_t const nb = x.extent(1) / mx_block;
  index_t const w = (blockIdx.x * index_t(blockDim.x) + threadIdx.x) / 32;
  int const lane = threadIdx.x & 31;
  if (w >= x.extent(0) * nb) return;  // whole warps exit together
  index_t const i = w / nb, j = (w % nb) * mx_block + lane;
  float const v = detail::to_f32(x(i, j));
  auto const sc = detail::mx_block_scale<F>(warp_max(detail::abs_bits(v)), rule);
  std::uint8_t const c = encode<F>(v * sc.inv, saturation::finite);
  if (lane == 0) s(i, j / mx_block) = sc.code;
  if constexpr (F::bits == 4) {
    std::uint8_t const odd = static_cast<std::uint8_t>(__shfl_down_sync(0xFFFFFFFFu, unsigned(c), 1));
    if ((lane & 1) == 0) q(i, j / 2) = pack_fp4(c, odd);
  } else {
    q(i, j) = c;
  }
}

template <class F>
K3_KERNEL void mx_dequantize(dview<std::uint8_t const, 2> q, dview<std::uint8_t const, 2> s, dview<float, 2> y) {
  index_t const k = y.extent(1), n = y.extent(0) * k;
  for (index_t e = blockIdx.x * index_t(blockDim.x) + threadIdx.x; e < n; e += index_t(gridDim.x) * blockDim.x) {
    index_t const i = e / k, j = e % k;
    std::uint8_t const c = F::bits == 4 ? ((j & 1) ? fp4_odd(q(i, j / 2)) : fp4_even(q(i, j / 2))) : q(i, j);
    y(i, j) = decode<F>(c) * decode<e8m0_format>(s(i, j / mx_block));
  }
}

// Half a warp per (row, 16-block).
template <class T>
K3_KERNEL void nvfp4_quantize(dview<T const, 2> x, dview<std::uint8_t, 2> q, dview<std::uint8_t, 2> s, float g, nvfp4_rounding rounding) {
  index_t const nb = x.extent(1) / nvfp4_block;
  index_t const h = (blockIdx.x * index_t(blockDim.x) + threadIdx.x) / 16;
  int const lane = threadIdx.x & 15;
  index_t const total = x.extent(0) * nb;
  bool const active = h < total;
  index_t const i = active ? h / nb : 0, j = active ? (h % nb) * nvfp4_block + lane : 0;
  float const v = active ? detail::to_f32(x(i, j)) : 0.0f;
  auto const sc = detail::nvfp4_block_scale(warp_max(detail::abs_bits(v), 16), g, rounding);
  std::uint8_t const c = encode<e2m1_format>(detail::nvfp4_scaled(v, sc), saturation::finite);
  std::uint8_t const odd = static_cast<std::uint8_t>(__shfl_down_sync(0xFFFFFFFFu, unsigned(c), 1));
  if (!active) return;
  if (lane == 0) s(i, j / nvfp4_block) = sc.code;
  if ((lane & 1) == 0) q(i, j / 2) = pack_fp4(c, odd);
}

// A template (with a defaulted parameter) so that every TU including this header may define it (ODR).
template <int = 0>
K3_KERNEL void nvfp4_dequantize(dview<std::uint8_t const, 2> q, dview<std::uint8_t const, 2> s, float g, dview<float, 2> y) {
  index_t const k = y.extent(1), n = y.extent(0) * k;
  for (index_t e = blockIdx.x * index_t(blockDim.x) + threadIdx.x; e < n; e += index_t(gridDim.x) * blockDim.x) {
    index_t const i = e / k, j = e % k;
    std::uint8_t const c = (j & 1) ? fp4_odd(q(i, j / 2)) : fp4_even(q(i, j / 2));
    y(i, j) = decode<e2m1_format>(c) * (decode<ue4m3_format>(s(i, j / nvfp4_block)) * g);
  }
}

template <class T>
K3_KERNEL void finite_amax(dview<T const, 2> x, std::uint32_t* out) {
  index_t const k = x.extent(1), n = x.extent(0) * k;
  std::uint32_t a = 0;
  for (index_t e = blockIdx.x * index_t(blockDim.x) + threadIdx.x; e < n; e += index_t(gridDim.x) * blockDim.x) {
    std::uint32_t v = detail::abs_bits(detail::to_f32(x(e / k, e % k)));
    if (v < detail::nonfinite_bits && v > a) a = v;
  }
  a = warp_max(a);
  if ((threadIdx.x & 31) == 0) atomicMax(out, a);
}

inline constexpr int gemm_tile = 16;

// A template (with a defaulted parameter) so that every TU including this header may define it (ODR).
template <int = 0>
K3_KERNEL void fp8_block_gemm(dview<std::uint8_t const, 2> qa, dview<float const, 2> sa, dview<std::uint8_t const, 2> qb,
                              dview<float const, 2> sb, dview<float, 2> c) {
  __shared__ float as[gemm_tile][129], bs[gemm_tile][129];
  index_t const m = qa.extent(0), k = qa.extent(1), n = qb.extent(0);
  index_t const i = blockIdx.y * index_t(gemm_tile) + threadIdx.y, jn = blockIdx.x * index_t(gemm_tile) + threadIdx.x;
  int const tid = threadIdx.y * gemm_tile + threadIdx.x;
  float acc = 0.0f;
  for (index_t k0 = 0; k0 < k; k0 += 128) {
    index_t const kc = (k - k0 < 128 ? k - k0 : 128);
    for (int e = tid; e < gemm_tile * 128; e += gemm_tile * gemm_tile) {
      int const r = e / 128, kk = e % 128;
      index_t const ia = blockIdx.y * index_t(gemm_tile) + r, ib = blockIdx.x * index_t(gemm_tile) + r;
      as[r][kk] = (ia < m && kk < kc) ? decode<e4m3_format>(qa(ia, k0 + kk)) : 0.0f;
      bs[r][kk] = (ib < n && kk < kc) ? decode<e4m3_format>(qb(ib, k0 + kk)) : 0.0f;
    }
    __syncthreads();
    if (i < m && jn < n) {
      float p = 0.0f;
      for (index_t kk = 0; kk < kc; ++kk) p = __fmaf_rn(as[threadIdx.y][kk], bs[threadIdx.x][kk], p);  // exact products
      acc = __fmaf_rn(p, __fmul_rn(sa(i, k0 / 128), sb(jn / 128, k0 / 128)), acc);
    }
    __syncthreads();
  }
  if (i < m && jn < n) c(i, jn) = acc;
}

}  // namespace kernels

namespace launch_detail {
inline unsigned grid_for(index_t n, unsigned block) {
  index_t g = (n + block - 1) / block;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 65535 * 8 ? 65535 * 8 : g));
}
}  // namespace launch_detail

template <class T>
void fp8_quantize(dview<T const, 2> x, dview<std::uint8_t, 2> q, dview<float, 2> s, tile t, scale_format fmt, CUstream_st* stream) {
  detail::check_tile(t);
  index_t const m = x.extent(0), k = x.extent(1);
  k3::detail::check_shape("q", q, {m, k});
  k3::detail::check_shape("scales", s, {detail::ceil_div(m, t.rows), detail::ceil_div(k, t.cols)});
  detail::check_2d("x", x);
  detail::check_2d("q", q);
  detail::check_2d("s", s);
  detail::check_quantize_outputs(q, s, x);
  if (x.size() == 0) return;
  dim3 grid(static_cast<unsigned>(s.extent(1)), static_cast<unsigned>(s.extent(0)));
  ::k3::cuda::launch_kernel(kernels::fp8_quantize<T>, {grid, 256, 0, stream}, x, q, s, t, fmt);
  K3_CUDA_CHECK(cudaGetLastError());
}

inline void fp8_dequantize(dview<std::uint8_t const, 2> q, dview<float const, 2> s, dview<float, 2> y, tile t, CUstream_st* stream) {
  detail::check_tile(t);
  k3::detail::check_shape("scales", s, {detail::ceil_div(q.extent(0), t.rows), detail::ceil_div(q.extent(1), t.cols)});
  k3::detail::check_shape("y", y, {q.extent(0), q.extent(1)});
  detail::check_2d("q", q);
  detail::check_2d("s", s);
  detail::check_2d("y", y);
  detail::check_dequantize_output(y, q, s);
  if (y.size() == 0) return;
  ::k3::cuda::launch_kernel(kernels::fp8_dequantize<>, {launch_detail::grid_for(y.size(), 256), 256, 0, stream}, q, s, y, t);
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void mx_quantize(dview<T const, 2> x, dview<std::uint8_t, 2> q, dview<std::uint8_t, 2> s, mx_element e, mx_rule rule, CUstream_st* stream) {
  index_t const m = x.extent(0), k = x.extent(1);
  detail::check_divides("x", k, mx_block);
  k3::detail::check_shape("q", q, {m, mx_code_columns(e, k)});
  k3::detail::check_shape("scales", s, {m, k / mx_block});
  detail::check_2d("x", x);
  detail::check_2d("q", q);
  detail::check_2d("s", s);
  detail::check_quantize_outputs(q, s, x);
  if (x.size() == 0) return;
  index_t const threads = m * k;  // one lane per element
  visit(e, [&]<class F>(F) {
    ::k3::cuda::launch_kernel(kernels::mx_quantize<F, T>, {static_cast<unsigned>((threads + 255) / 256), 256, 0, stream}, x, q, s, rule);
  });
  K3_CUDA_CHECK(cudaGetLastError());
}

inline void mx_dequantize(dview<std::uint8_t const, 2> q, dview<std::uint8_t const, 2> s, dview<float, 2> y, mx_element e,
                          CUstream_st* stream) {
  index_t const m = y.extent(0), k = y.extent(1);
  detail::check_divides("y", k, mx_block);
  k3::detail::check_shape("q", q, {m, mx_code_columns(e, k)});
  k3::detail::check_shape("scales", s, {m, k / mx_block});
  detail::check_2d("q", q);
  detail::check_2d("s", s);
  detail::check_2d("y", y);
  detail::check_dequantize_output(y, q, s);
  if (y.size() == 0) return;
  visit(e, [&]<class F>(F) { ::k3::cuda::launch_kernel(kernels::mx_dequantize<F>, {launch_detail::grid_for(y.size(), 256), 256, 0, stream}, q, s, y); });
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void nvfp4_quantize(dview<T const, 2> x, dview<std::uint8_t, 2> q, dview<std::uint8_t, 2> s, float g, CUstream_st* stream,
                    nvfp4_rounding rounding) {
  index_t const m = x.extent(0), k = x.extent(1);
  detail::check_tensor_scale(g);
  detail::check_divides("x", k, nvfp4_block);
  k3::detail::check_shape("q", q, {m, k / 2});
  k3::detail::check_shape("scales", s, {m, k / nvfp4_block});
  detail::check_2d("x", x);
  detail::check_2d("q", q);
  detail::check_2d("s", s);
  detail::check_quantize_outputs(q, s, x);
  if (x.size() == 0) return;
  ::k3::cuda::launch_kernel(kernels::nvfp4_quantize<T>, {static_cast<unsigned>((m * k + 255) / 256), 256, 0, stream}, x, q, s, g, rounding);
  K3_CUDA_CHECK(cudaGetLastError());
}

inline void nvfp4_dequantize(dview<std::uint8_t const, 2> q, dview<std::uint8_t const, 2> s, float g, dview<float, 2> y,
                             CUstream_st* stream) {
  index_t const m = y.extent(0), k = y.extent(1);
  detail::check_tensor_scale(g);
  detail::check_divides("y", k, nvfp4_block);
  k3::detail::check_shape("q", q, {m, k / 2});
  k3::detail::check_shape("scales", s, {m, k / nvfp4_block});
  detail::check_2d("q", q);
  detail::check_2d("s", s);
  detail::check_2d("y", y);
  detail::check_dequantize_output(y, q, s);
  if (y.size() == 0) return;
  ::k3::cuda::launch_kernel(kernels::nvfp4_dequantize<>, {launch_detail::grid_for(y.size(), 256), 256, 0, stream}, q, s, g, y);
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class T>
float nvfp4_tensor_scale(dview<T const, 2> x, CUstream_st* stream) {
  detail::check_2d("x", x);
  if (x.size() == 0) return 1.0f;
  std::uint32_t* d = nullptr;
  K3_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&d), sizeof(std::uint32_t), stream));
  K3_CUDA_CHECK(cudaMemsetAsync(d, 0, sizeof(std::uint32_t), stream));
  ::k3::cuda::launch_kernel(kernels::finite_amax<T>, {launch_detail::grid_for(x.size(), 256), 256, 0, stream}, x, d);
  K3_CUDA_CHECK(cudaGetLastError());
  std::uint32_t h = 0;
  K3_CUDA_CHECK(cudaMemcpyAsync(&h, d, sizeof(h), cudaMemcpyDeviceToHost, stream));
  K3_CUDA_CHECK(cudaFreeAsync(d, stream));
  K3_CUDA_CHECK(cudaStreamSynchronize(stream));
  float const g = k3::detail::bit_cast<float>(h) / (448.0f * 6.0f);
  return g >= 0x1p-140f ? g : 1.0f;  // reference::nvfp4_scale_from_amax
}

inline void fp8_block_gemm(dview<std::uint8_t const, 2> qa, dview<float const, 2> sa, dview<std::uint8_t const, 2> qb,
                           dview<float const, 2> sb, dview<float, 2> c, CUstream_st* stream) {
  index_t const m = qa.extent(0), k = qa.extent(1), n = qb.extent(0);
  k3::detail::check_shape("b_q", qb, {n, k});
  k3::detail::check_shape("a_scales", sa, {m, detail::ceil_div(k, 128)});
  k3::detail::check_shape("b_scales", sb, {detail::ceil_div(n, 128), detail::ceil_div(k, 128)});
  k3::detail::check_shape("c", c, {m, n});
  detail::check_2d("qa", qa);
  detail::check_2d("sa", sa);
  detail::check_2d("qb", qb);
  detail::check_2d("sb", sb);
  detail::check_2d("c", c);
  detail::check_gemm_output(c, qa, sa, qb, sb);
  if (c.size() == 0) return;
  dim3 grid(static_cast<unsigned>(detail::ceil_div(n, kernels::gemm_tile)), static_cast<unsigned>(detail::ceil_div(m, kernels::gemm_tile)));
  ::k3::cuda::launch_kernel(kernels::fp8_block_gemm<>, {grid, dim3(kernels::gemm_tile, kernels::gemm_tile), 0, stream}, qa, sa, qb, sb, c);
  K3_CUDA_CHECK(cudaGetLastError());
}

}  // namespace k3::quant::cuda
