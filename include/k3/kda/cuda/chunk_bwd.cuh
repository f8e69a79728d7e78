// k3/kda/cuda/chunk_bwd.cuh — KDA backward, chunk by chunk in reverse.
//
// One warp per (sequence, value head, 32-column V tile), one lane per state column: every
// column of S evolves independently given k, g, beta, so the state and its gradient split
// across lanes and only the K-vector gradients (dq, dk, dg) and dbeta need a sum over
// columns (warp shuffles, then atomics across tiles and grouped value heads).
//
//   1. forward sweep over the sequence, saving the state at every chunk start (scratch);
//   2. chunks in reverse: replay the chunk from its saved start, keeping S_{t-1} of each
//      token (scratch), then walk its tokens in reverse with the exact per-token adjoint of
//        P = Diag(e^g) S_{t-1},  r = v - P^T k,  S_t = P + beta k r^T,  o = S_t^T (scale q):
//        dS += scale q do^T;  dr = beta dS^T k;  dv = dr;  dbeta = r . (dS^T k);
//        dk = beta dS r - P dr;  dq = scale S_t do;  dP = dS - k dr^T;  dg = rowsum(dP * P);
//        dS_{t-1} = Diag(e^g) dP.
// This is the recurrent adjoint on chunk checkpoints, not the WY-form backward: simple,
// exact, O(T K V) work per head with chunk-sized replay.
#pragma once
#include "k3/kda/cuda/common.cuh"

namespace k3::kda::cuda::detail {

template <class S>
K3_KERNEL void __launch_bounds__(32) chunk_bwd_kernel(bwd_args<S> a, float scale, index_t nvt, index_t maxc, float* scratch) {
  constexpr int C = chunk, BV = tile_v;
  __shared__ float sS[kmax * tile_v], sD[kmax * tile_v], sk[kmax], sq[kmax], se[kmax];
  int const K = static_cast<int>(a.K);
  index_t const blk = blockIdx.x;
  index_t const vt = blk % nvt, nh = blk / nvt;
  index_t const h = nh % a.HV, n = nh / a.HV;
  index_t const hq = h / (a.HV / a.H);
  index_t const v0 = vt * BV;
  int const c = threadIdx.x;
  bool const valid = v0 + c < a.V;
  index_t const col = v0 + c;
  seq_span const sp = sequence(a.cu_seqlens, n, a.T);
  index_t const state_off = (n * a.HV + h) * a.K * a.V;
  std::size_t const tile = static_cast<std::size_t>(K) * BV;
  float* chk = scratch + static_cast<std::size_t>(blk) * static_cast<std::size_t>(maxc + C) * tile;
  float* rep = chk + static_cast<std::size_t>(maxc) * tile;

  // Loads token tok's k, e^g (and scale*q) into shared memory; all lanes take part.
  auto load = [&](index_t tok) {
    __syncwarp();
    for (int d = c; d < K; d += BV) {
      sk[d] = ld(a.k[(tok * a.H + hq) * a.K + d]);
      sq[d] = scale * ld(a.q[(tok * a.H + hq) * a.K + d]);
      se[d] = expf(ld(a.g[(tok * a.HV + h) * a.K + d]));
    }
    __syncwarp();
  };
  // One forward step of this lane's column.
  auto step = [&](index_t tok) {
    float const b = ld(a.beta[tok * a.HV + h]);
    float const vv = valid ? ld(a.v[(tok * a.HV + h) * a.V + col]) : 0.f;
    float pred = 0.f;
    for (int d = 0; d < K; ++d) pred += sk[d] * se[d] * sS[d * BV + c];
    float const r = b * (vv - pred);
    for (int d = 0; d < K; ++d) sS[d * BV + c] = se[d] * sS[d * BV + c] + sk[d] * r;
  };

  for (int d = 0; d < K; ++d) {
    sS[d * BV + c] = (valid && a.h0 != nullptr) ? a.h0[state_off + d * a.V + col] : 0.f;
    sD[d * BV + c] = (valid && a.dht != nullptr) ? a.dht[state_off + d * a.V + col] : 0.f;
  }

  // 1. forward sweep, checkpoint at chunk starts
  for (index_t t = 0; t < sp.len; ++t) {
    if (t % C == 0)
      for (int d = 0; d < K; ++d) chk[static_cast<std::size_t>(t / C) * tile + d * BV + c] = sS[d * BV + c];
    load(sp.bos + t);
    step(sp.bos + t);
  }

  // 2. chunks in reverse
  index_t const nch = (sp.len + C - 1) / C;
  for (index_t ci = nch - 1; ci >= 0; --ci) {
    index_t const c0 = ci * C;
    int const L = static_cast<int>(sp.len - c0 < C ? sp.len - c0 : C);
    for (int d = 0; d < K; ++d) sS[d * BV + c] = chk[static_cast<std::size_t>(ci) * tile + d * BV + c];
    for (int r = 0; r < L; ++r) {
      for (int d = 0; d < K; ++d) rep[static_cast<std::size_t>(r) * tile + d * BV + c] = sS[d * BV + c];
      load(sp.bos + c0 + r);
      step(sp.bos + c0 + r);
    }
    for (int r = L - 1; r >= 0; --r) {
      index_t const tok = sp.bos + c0 + r;
      load(tok);
      float const* prev = rep + static_cast<std::size_t>(r) * tile;
      float const b = ld(a.beta[tok * a.HV + h]);
      float const vv = valid ? ld(a.v[(tok * a.HV + h) * a.V + col]) : 0.f;
      float const dov = valid ? ld(a.do_[(tok * a.HV + h) * a.V + col]) : 0.f;
      float pred = 0.f, kds = 0.f;
      for (int d = 0; d < K; ++d) {
        pred += sk[d] * se[d] * prev[d * BV + c];
        float const ds = sD[d * BV + c] + sq[d] * dov;  // o_t reads S_t
        sD[d * BV + c] = ds;
        kds += sk[d] * ds;
      }
      float const rr = vv - pred;  // residual before beta
      float const dr = b * kds;
      if (valid) a.dv[(tok * a.HV + h) * a.V + col] = dr;
      float const db = warp_sum(rr * kds);
      if (c == 0) atomicAdd(&a.dbeta[tok * a.HV + h], db);
      for (int d = 0; d < K; ++d) {
        float const P = se[d] * prev[d * BV + c];
        float const St = P + b * sk[d] * rr;
        float const ds = sD[d * BV + c];
        float const dP = ds - sk[d] * dr;
        sD[d * BV + c] = se[d] * dP;
        float const gq = warp_sum(St * dov);
        float const gk = warp_sum(b * ds * rr - P * dr);
        float const gg = warp_sum(dP * P);
        if (c == 0) {
          atomicAdd(&a.dq[(tok * a.H + hq) * a.K + d], scale * gq);
          atomicAdd(&a.dk[(tok * a.H + hq) * a.K + d], gk);
          atomicAdd(&a.dg[(tok * a.HV + h) * a.K + d], gg);
        }
      }
    }
  }

  if (a.dh0 != nullptr && valid)
    for (int d = 0; d < K; ++d) a.dh0[state_off + d * a.V + col] = sD[d * BV + c];
}

}  // namespace k3::kda::cuda::detail

namespace k3::kda::cuda {

template <class S>
void chunk_bwd(bwd_args<S> const& a, CUstream_st* stream) {
  detail::layout const l = detail::check(a);
  index_t const tokens = a.B * a.T;
  cudaStream_t const s = stream;
  if (tokens > 0) {
    K3_CUDA_CHECK(cudaMemsetAsync(a.dq, 0, static_cast<std::size_t>(tokens * a.H * a.K) * sizeof(float), s));
    K3_CUDA_CHECK(cudaMemsetAsync(a.dk, 0, static_cast<std::size_t>(tokens * a.H * a.K) * sizeof(float), s));
    K3_CUDA_CHECK(cudaMemsetAsync(a.dg, 0, static_cast<std::size_t>(tokens * a.HV * a.K) * sizeof(float), s));
    K3_CUDA_CHECK(cudaMemsetAsync(a.dbeta, 0, static_cast<std::size_t>(tokens * a.HV) * sizeof(float), s));
  }
  if (l.N == 0) return;
  index_t const nvt = (a.V + detail::tile_v - 1) / detail::tile_v;
  index_t const maxc = (l.max_len + detail::chunk - 1) / detail::chunk;
  index_t const blocks = l.N * a.HV * nvt;
  std::size_t const bytes =
      static_cast<std::size_t>(blocks) * static_cast<std::size_t>(maxc + detail::chunk) * static_cast<std::size_t>(a.K) * detail::tile_v * sizeof(float);
  void* scratch = nullptr;
  K3_CUDA_CHECK(cudaMallocAsync(&scratch, bytes, s));
  ::k3::cuda::launch_kernel(detail::chunk_bwd_kernel<S>, {detail::grid3(blocks, 1, 1), 32, 0, s}, a, l.scale, nvt, maxc, static_cast<float*>(scratch));
  cudaError_t const launch = cudaGetLastError();
  K3_CUDA_CHECK(cudaFreeAsync(scratch, s));
  K3_CUDA_CHECK(launch);
}

}  // namespace k3::kda::cuda
