// k3/backend/cuda/api.hpp — the host-parsable face of the CUDA backend: what a .cpp TU
// compiled by g++/clang++ may name without any CUDA header.
//
// Under CUDA 13 a kernel (or its template host stub) cannot be instantiated in one TU and
// used from another, so the boundary between .cpp and .cu code is a host *function template*
// declared here and explicitly instantiated in some .cu TU (see K3_CUDA_INSTANTIATE_COPY in
// backend.cuh). A .cpp caller then links against that instantiation.
#pragma once
#include <cstddef>
#include <type_traits>

#include "k3/core/memory_space.hpp"
#include "k3/core/tensor_view.hpp"

// cudaStream_t is `CUstream_st*`; naming the struct keeps CUDA headers out of host TUs.
struct CUstream_st;

namespace k3::cuda {

using stream_handle = CUstream_st*;

// A launch shape without dim3 (a CUDA type). backend.cuh converts it.
struct dim {
  unsigned x = 1, y = 1, z = 1;
};

struct launch_config {
  dim grid{};
  dim block{};
  std::size_t shared_bytes = 0;
};

class stream_backend;

// Blocking copies between host and device views of the same shape (any strides). They
// return when the data has arrived, so host buffers may be reused or read right away.
// Device-to-device copies are ordered on `stream` and do not block the host.
// Shape mismatches and null data throw k3::error naming `src` and `dst`.
template <class T, std::size_t Rank>
  requires(!std::is_const_v<T>)
void copy(std::type_identity_t<tensor_view<T const, Rank, host_space>> src, tensor_view<T, Rank, cuda_device_space> dst,
          stream_handle stream);
template <class T, std::size_t Rank>
  requires(!std::is_const_v<T>)
void copy(std::type_identity_t<tensor_view<T const, Rank, cuda_device_space>> src, tensor_view<T, Rank, host_space> dst,
          stream_handle stream);
template <class T, std::size_t Rank>
  requires(!std::is_const_v<T>)
void copy(std::type_identity_t<tensor_view<T const, Rank, cuda_device_space>> src,
          tensor_view<T, Rank, cuda_device_space> dst, stream_handle stream);

}  // namespace k3::cuda
