// k3/kda/cuda/decode.cuh — the KDA decode step: one token per sequence, fp32 states in a
// pool addressed by slots, updated in place. One block per (sequence, value head); each
// thread owns state columns (a column of S evolves independently of the others), so reads
// and writes of the state are coalesced along V and need no synchronisation.
#pragma once
#include "k3/kda/cuda/common.cuh"

namespace k3::kda::cuda::detail {

template <class S>
K3_KERNEL void decode_kernel(decode_args<S> a, float scale) {
  __shared__ float sk[kmax], sq[kmax], se[kmax];
  index_t const n = blockIdx.x / a.HV, h = blockIdx.x % a.HV;
  index_t const hq = h / (a.HV / a.H);
  index_t const slot = a.slots != nullptr ? a.slots[n] : n;
  if (slot < 0 || slot >= a.P) return;  // padding (or an unchecked bad slot): skipped
  int const K = static_cast<int>(a.K);
  for (int d = threadIdx.x; d < K; d += blockDim.x) {
    sk[d] = ld(a.k[(n * a.H + hq) * a.K + d]);
    sq[d] = scale * ld(a.q[(n * a.H + hq) * a.K + d]);
    se[d] = expf(ld(a.g[(n * a.HV + h) * a.K + d]));
  }
  __syncthreads();
  float const b = ld(a.beta[n * a.HV + h]);
  float* Sp = a.state + (slot * a.HV + h) * a.K * a.V;
  for (index_t c = threadIdx.x; c < a.V; c += blockDim.x) {
    // S' = Diag(e^g) S; r = beta (v - S'^T k); S = S' + k r^T; o = S^T q.
    float pred = 0.f;
    for (int d = 0; d < K; ++d) pred += sk[d] * se[d] * Sp[d * a.V + c];
    float const r = b * (ld(a.v[(n * a.HV + h) * a.V + c]) - pred);
    float o = 0.f;
    for (int d = 0; d < K; ++d) {
      float const s = se[d] * Sp[d * a.V + c] + sk[d] * r;
      Sp[d * a.V + c] = s;
      o += sq[d] * s;
    }
    a.o[(n * a.HV + h) * a.V + c] = st<S>(o);
  }
}

}  // namespace k3::kda::cuda::detail

namespace k3::kda::cuda {

template <class S>
void decode(decode_args<S> const& a, CUstream_st* stream) {
  float const scale = detail::check(a);
  if (a.N == 0) return;
  int const threads = a.V >= 128 ? 128 : (a.V >= 64 ? 64 : 32);
  ::k3::cuda::launch_kernel(detail::decode_kernel<S>, {detail::grid3(a.N * a.HV, 1, 1), threads, 0, stream}, a, scale);
  K3_CUDA_CHECK(cudaGetLastError());
}

}  // namespace k3::kda::cuda
