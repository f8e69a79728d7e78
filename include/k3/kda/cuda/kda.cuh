// k3/kda/cuda/kda.cuh — all KDA CUDA launchers (chunked forward/backward, decode, and the
// pre-processing ops) (declared in k3/kda/cuda_api.hpp) and the
// macro that instantiates them for one storage type in a user's .cu file:
//
//   #include <k3/kda/cuda/kda.cuh>
//   K3_KDA_CUDA_INSTANTIATE(float)
//   K3_KDA_CUDA_INSTANTIATE(k3::bfloat16)
#pragma once
#include "k3/kda/cuda/chunk_bwd.cuh"
#include "k3/kda/cuda/chunk_fwd.cuh"
#include "k3/kda/cuda/decode.cuh"
#include "k3/kda/cuda/preprocess.cuh"

#define K3_KDA_CUDA_INSTANTIATE(S)                                                                  \
  template void k3::kda::cuda::chunk_fwd<S>(k3::kda::cuda::fwd_args<S> const&, CUstream_st*);       \
  template void k3::kda::cuda::chunk_bwd<S>(k3::kda::cuda::bwd_args<S> const&, CUstream_st*);       \
  template void k3::kda::cuda::decode<S>(k3::kda::cuda::decode_args<S> const&, CUstream_st*);      \
  template void k3::kda::cuda::l2norm_fwd<S>(S const*, S*, k3::kda::cuda::index_t, k3::kda::cuda::index_t, CUstream_st*); \
  template void k3::kda::cuda::l2norm_bwd<S>(S const*, S const*, S*, k3::kda::cuda::index_t, k3::kda::cuda::index_t,       \
                                             CUstream_st*);                                                                \
  template void k3::kda::cuda::beta_sigmoid_fwd<S>(S const*, S*, k3::kda::cuda::index_t, bool, CUstream_st*);             \
  template void k3::kda::cuda::beta_sigmoid_bwd<S>(S const*, S const*, S*, k3::kda::cuda::index_t, bool, CUstream_st*);   \
  template void k3::kda::cuda::gate_fwd<S>(k3::kda::cuda::gate_params const&, S const*, S*, CUstream_st*);                \
  template void k3::kda::cuda::gate_bwd<S>(k3::kda::cuda::gate_params const&, S const*, S const*, S*, float*, float*,     \
                                           CUstream_st*);                                                                  \
  template void k3::kda::cuda::short_conv_fwd<S>(k3::kda::cuda::conv_params const&, S const*, S*, float const*, float*,   \
                                                 CUstream_st*);                                                            \
  template void k3::kda::cuda::short_conv_bwd<S>(k3::kda::cuda::conv_params const&, S const*, S const*, S*, float*,        \
                                                 float*, float const*, float*, CUstream_st*);                              \
  template void k3::kda::cuda::short_conv_decode<S>(k3::kda::cuda::conv_params const&, S const*, S*,                     \
                                                    k3::kda::cuda::index_t, float*, k3::kda::cuda::index_t,                \
                                                    std::int64_t const*, CUstream_st*);
