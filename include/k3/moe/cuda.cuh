// k3/moe/cuda.cuh — CUDA router + fused Quantile-Balancing histogram (see cuda.hpp).
#pragma once
#include "k3/backend/cuda/config.cuh"
// (config.cuh first: it refuses host compilers)
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "k3/core/error.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"
#include "k3/moe/cuda.hpp"

namespace k3::moe::cuda {
namespace detail {

inline constexpr int route_threads = 256;

// (v, i) ranks before (w, j): higher score, then lower index. NaN marks a taken expert and
// never ranks before anything.
__device__ __forceinline__ void keep_better(float& v, int& i, float w, int j) {
  if (w > v || (w == v && j < i)) {
    v = w;
    i = j;
  }
}

// A template so that the header can be included by several TUs of one program.
template <class Score>
K3_KERNEL void route_kernel(route_args a) {
  K3_DYNAMIC_SHARED(unsigned char, smem_raw);
  int const n = static_cast<int>(a.n), k = static_cast<int>(a.k);
  float* z = reinterpret_cast<float*>(smem_raw);          // [n]
  float* top_z = z + n;                                     // [k + 1]
  int* top_i = reinterpret_cast<int*>(top_z + (k + 1));     // [k + 1]
  float* warp_v = reinterpret_cast<float*>(top_i + (k + 1));  // [warps]
  int* warp_i = reinterpret_cast<int*>(warp_v + route_threads / 32);
  int const tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  for (std::int64_t t = blockIdx.x; t < a.m; t += gridDim.x) {
    float const* row = a.scores + t * a.n;
    bool const real = a.mask == nullptr || a.mask[t] != 0;
    if (!real) {
      for (int r = tid; r < k; r += blockDim.x) {
        a.indices[t * k + r] = -1;
        a.weights[t * k + r] = 0.f;
      }
      if (tid == 0 && a.cutoff) a.cutoff[t] = 0.f;
      continue;  // uniform across the block: no barrier skipped by only some threads
    }
    for (int j = tid; j < n; j += blockDim.x) z[j] = __fadd_rn(row[j], a.bias[j]);
    __syncthreads();
    for (int r = 0; r <= k; ++r) {
      float v = -INFINITY;
      int i = INT_MAX;
      for (int j = tid; j < n; j += blockDim.x) keep_better(v, i, z[j], j);
      for (int off = 16; off > 0; off >>= 1) {
        float w = __shfl_down_sync(0xffffffffu, v, off);
        int jj = __shfl_down_sync(0xffffffffu, i, off);
        keep_better(v, i, w, jj);
      }
      if (lane == 0) {
        warp_v[warp] = v;
        warp_i[warp] = i;
      }
      __syncthreads();
      if (tid == 0) {
        float bv = warp_v[0];
        int bi = warp_i[0];
        for (int w = 1; w < warps; ++w) keep_better(bv, bi, warp_v[w], warp_i[w]);
        top_z[r] = bv;
        top_i[r] = bi;
        z[bi] = __int_as_float(0x7fc00000);  // NaN: taken
      }
      __syncthreads();
    }
    if (tid == 0) {
      float sum = 0.f;
      for (int r = 0; r < k; ++r) sum = __fadd_rn(sum, row[top_i[r]]);
      float const denom = sum > 0.f ? sum : 1.f;  // as the CPU router (k3/moe/router.hpp)
      for (int r = 0; r < k; ++r) {
        a.indices[t * k + r] = top_i[r];
        a.weights[t * k + r] = __fmul_rn(__fdiv_rn(row[top_i[r]], denom), a.routed_scale);
        if (a.load) atomicAdd(a.load + top_i[r], 1ull);
      }
      if (a.cutoff) a.cutoff[t] = top_z[k];
    }
    if (a.hist) {
      float const alpha = top_z[k], top = float(a.bins - 1);
      for (int j = tid; j < n; j += blockDim.x) {
        float f = floorf(__fmul_rn(__fsub_rn(__fsub_rn(alpha, row[j]), a.hist_lo), a.hist_inv_width));
        f = f < 0.f ? 0.f : f;
        f = f > top ? top : f;
        atomicAdd(a.hist + static_cast<std::int64_t>(j) * a.bins + static_cast<int>(f), 1ull);
      }
    }
    __syncthreads();  // top_z / z reused by the next token
  }
}

}  // namespace detail

template <class Score>
void route_launch(route_args const& a, CUstream_st* stream) {
  static_assert(std::is_same_v<Score, float>, "the CUDA router reads float32 scores");
  auto need = [](bool ok, char const* msg) {
    if (!ok) throw k3::error(error_kind::value, msg);
  };
  need(a.m > 0, "cuda route: argument 'scores': zero tokens");
  need(a.k >= 1 && a.k < a.n, "cuda route: argument 'k': need 1 <= k < n");
  need(a.n <= 16384, "cuda route: argument 'scores': at most 16384 experts (shared-memory staging)");
  need(a.scores && a.bias && a.indices && a.weights, "cuda route: null scores/bias/indices/weights pointer");
  need(!a.hist || (a.bins >= 1 && a.hist_inv_width > 0.f), "cuda route: argument 'hist': bins and inverse bin width must be positive");
  // Blocks read scores, bias and mask while others write: no output over an input or another
  // output (a null pointer is an absent argument: an empty view).
  auto dv = [](auto* p, std::int64_t n) { return k3::detail::flat_view<cuda_device_space>(p, n); };
  k3::detail::check_outputs_apart(::k3::detail::named_views("indices", dv(a.indices, a.m * a.k),
                                                            "weights", dv(a.weights, a.m * a.k), "cutoff", dv(a.cutoff, a.m),
                                                            "load", dv(a.load, a.n), "hist", dv(a.hist, a.n * a.bins)),
                                  ::k3::detail::named_views("scores", dv(a.scores, a.m * a.n), "bias", dv(a.bias, a.n),
                                                            "mask", dv(a.mask, a.m)));
  std::size_t const smem = static_cast<std::size_t>(a.n) * 4 + static_cast<std::size_t>(a.k + 1) * 8 + detail::route_threads / 32 * 8;
  if (smem > 48 * 1024)
    K3_CUDA_CHECK(cudaFuncSetAttribute(detail::route_kernel<Score>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  unsigned const grid = static_cast<unsigned>(a.m < 65535 * 8 ? a.m : 65535 * 8);
  ::k3::cuda::launch_kernel(detail::route_kernel<Score>, {grid, detail::route_threads, smem, stream}, a);
  K3_CUDA_CHECK(cudaGetLastError());
}

}  // namespace k3::moe::cuda

// Explicit instantiation for programs whose host code (.cpp) calls route_launch.
#define K3_MOE_CUDA_INSTANTIATE() template void k3::moe::cuda::route_launch<float>(k3::moe::cuda::route_args const&, CUstream_st*);
