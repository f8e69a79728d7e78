// k3/attnres/cuda.hpp — host-callable CUDA launchers for AttnRes (declarations only; this
// header parses under any C++20 compiler). Definitions: k3/attnres/cuda.cuh, which a .cu
// translation unit includes (K3_ATTNRES_CUDA_INSTANTIATE(S) instantiates them for storage
// type S, so .cpp code can call them).
//
// Every pointer is a device pointer to contiguous row-major data; S is float or k3::bfloat16;
// mixing runs in float (per-source scalars and reductions in float, one CUDA block per token).
// Shapes as in the CPU API: bank [n, T, d], partial [T, d] (nullptr: none), u = g * w [d] or
// [nq, d], o [nq, T, d], lse [nq, T], rinv [n, T]. At most max_sources sources per site.
// Bad sizes throw k3::error before anything is launched.
#pragma once
#include <cstdint>

#include "k3/core/numeric/bfloat16.hpp"

struct CUstream_st;

namespace k3::cuda::attnres {

using stream_t = CUstream_st*;
using index_t = std::int64_t;

inline constexpr index_t max_sources = 32;

// h = mix of bank rows (and the partial) with folded query u.
template <class S>
void mix_forward(S const* bank, index_t n, S const* partial, index_t T, index_t d, float const* u, float eps, S* h, stream_t stream);

// Gradients of the mix. dbank [n, T, d], dpartial [T, d] (when partial), dw, dgain [d] (all
// overwritten); du_workspace: d floats of device scratch.
template <class S>
void mix_backward(S const* bank, index_t n, S const* partial, index_t T, index_t d, float const* w, float const* gain, float eps,
                  float const* dh, float* dbank, float* dpartial, float* dw, float* dgain, float* du_workspace, stream_t stream);

// rinv[t] = (mean_k block[t, k]^2 + eps)^-1/2.
template <class S>
void block_rinv(S const* block, index_t T, index_t d, float eps, float* rinv, stream_t stream);

// Phase 1: all nq sites of a block against the n completed blocks.
template <class S>
void phase1(S const* bank, float const* rinv, index_t n, index_t T, index_t d, float const* u, index_t nq, S* o, float* lse,
            stream_t stream);

// Phase 2 fused with the residual add: prefix += delta, then h = o + p (prefix - o),
// p = sigmoid(rinv(prefix) (u . prefix) - lse).
template <class S>
void phase2_add(S const* o, float const* lse, S* prefix, S const* delta, float const* u, index_t T, index_t d, float eps, S* h,
                stream_t stream);

}  // namespace k3::cuda::attnres
