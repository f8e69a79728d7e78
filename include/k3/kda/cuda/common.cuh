// k3/kda/cuda/common.cuh — device helpers shared by the KDA kernels: storage loads/stores
// (float, bfloat16 with fp32 math), sequence bounds, warp reduction.
#pragma once
#include "k3/backend/cuda/config.cuh"
#include "k3/core/math.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/kda/cuda/validate.hpp"
#include "k3/kda/cuda_api.hpp"

namespace k3::kda::cuda::detail {

inline constexpr int chunk = static_cast<int>(chunk_size);  // tokens per chunk
inline constexpr int tile_v = 32;                           // V columns per block
inline constexpr int kmax = static_cast<int>(max_head_dim_k);
// Log decays below this one are kept in a separate cumsum by the chunked forward (the CPU
// path's split_log_decay in core/math.hpp).
inline constexpr float split_log_decay = -16.f;

__device__ __forceinline__ float ld(float x) { return x; }
__device__ __forceinline__ float ld(k3::bfloat16 x) { return __uint_as_float(static_cast<unsigned>(x.bits) << 16); }

template <class S>
__device__ __forceinline__ S st(float v);
template <>
__device__ __forceinline__ float st<float>(float v) {
  return v;
}
// Round to nearest even; NaN stays a quiet NaN with its sign (as k3::bfloat16 on the host).
template <>
__device__ __forceinline__ k3::bfloat16 st<k3::bfloat16>(float v) {
  unsigned u = __float_as_uint(v);
  k3::bfloat16 r;
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0u) {
    r.bits = static_cast<unsigned short>((u >> 16) | 0x0040u);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = static_cast<unsigned short>(u >> 16);
  }
  return r;
}

// Sequence n: first flattened token (row b * T + t of the [B*T, ...] tensors) and length.
struct seq_span {
  index_t bos, len;
};
__device__ __forceinline__ seq_span sequence(std::int64_t const* cu, index_t n, index_t T) {
  if (cu != nullptr) return {cu[n], cu[n + 1] - cu[n]};
  return {n * T, T};
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

inline dim3 grid3(index_t x, index_t y, index_t z) {
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y), static_cast<unsigned>(z));
}

}  // namespace k3::kda::cuda::detail
