// k3/kda/cuda/kda.cuh — all KDA CUDA launchers (declared in k3/kda/cuda_api.hpp) and the
// macro that instantiates them for one storage type in a user's .cu file:
//
//   #include <k3/kda/cuda/kda.cuh>
//   K3_KDA_CUDA_INSTANTIATE(float)
//   K3_KDA_CUDA_INSTANTIATE(k3::bfloat16)
#pragma once
#include "k3/kda/cuda/chunk_bwd.cuh"
#include "k3/kda/cuda/chunk_fwd.cuh"
#include "k3/kda/cuda/decode.cuh"

#define K3_KDA_CUDA_INSTANTIATE(S)                                                                  \
  template void k3::kda::cuda::chunk_fwd<S>(k3::kda::cuda::fwd_args<S> const&, CUstream_st*);       \
  template void k3::kda::cuda::chunk_bwd<S>(k3::kda::cuda::bwd_args<S> const&, CUstream_st*);       \
  template void k3::kda::cuda::decode<S>(k3::kda::cuda::decode_args<S> const&, CUstream_st*);
