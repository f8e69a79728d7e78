// k3/moe/cuda.hpp — host-parsable declarations of the CUDA router + histogram launcher
// (defined in k3/moe/cuda.cuh; a .cu file instantiates it with K3_MOE_CUDA_INSTANTIATE()).
//
// One thread block per token: biased scores staged in shared memory, k+1 rounds of a block
// arg-max (ties -> lower expert index, the CPU's order), weights renormalised by one thread in
// rank order (the CPU's float summation order), then every expert's margin binned with the
// CPU's float sequence and counted with 64-bit global atomics. Indices, weights, cut-offs,
// loads and histogram counts are therefore bit-identical to k3::moe::detail::route_serial +
// qb_accumulate. Inputs must be finite sigmoid scores (validate on the host; the kernel cannot
// throw); logits and group-limited routing are CPU-only.
#pragma once
#include <cstdint>

struct CUstream_st;

namespace k3::moe::cuda {

struct route_args {
  float const* scores = nullptr;        // device [m, n], row-major, sigmoid scores
  float const* bias = nullptr;          // device [n]
  std::uint8_t const* mask = nullptr;   // device [m] (nonzero = real token) or null
  std::int64_t m = 0, n = 0, k = 0;
  float routed_scale = 1.0f;
  std::int32_t* indices = nullptr;      // device [m, k]
  float* weights = nullptr;             // device [m, k]
  float* cutoff = nullptr;              // device [m] or null
  unsigned long long* load = nullptr;   // device [n] or null; ADDED to (zero it first)
  unsigned long long* hist = nullptr;   // device [n, bins] or null; ADDED to
  float hist_lo = 0.f;                  // qb_histogram::lo()
  float hist_inv_width = 0.f;           // qb_histogram::inv_width()
  std::int32_t bins = 0;
};

// Throws k3::error on bad arguments and k3::cuda::cuda_error on launch failure.
template <class Score = float>
void route_launch(route_args const& args, CUstream_st* stream);

}  // namespace k3::moe::cuda
