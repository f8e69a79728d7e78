// k3/kda/cuda/chunk_fwd.cuh — chunked KDA forward in WY/UT form, chunk 64.
//
// One block per (sequence, value head, 32-column V tile); the chunks of a sequence are
// walked in order with the state tile S [K, 32] in shared memory. Per chunk of L <= 64
// tokens, with G the chunk-local inclusive cumsum of g (so every exponent below is
// G_i - G_j with i >= j, or G_i, hence <= 0 for g <= 0: nothing can overflow):
//
//   L[i,j]   = beta_i sum_d k_i[d] k_j[d] e^{G_i[d]-G_j[d]}            (j < i)
//   Aqk[i,j] = sum_d (scale q_i[d]) k_j[d] e^{G_i[d]-G_j[d]}             (j <= i)
//   (I + L) U = Diag(beta) (V - (K * e^G) S)                             (forward substitution)
//   O        = (scale Q * e^G) S + Aqk U
//   S       <- Diag(e^{G_L}) S + (K * e^{G_L - G})^T U
//
// Simple over fast: the C x C matrices are recomputed per V tile and evaluated pairwise
// (no dense tiles), the substitution runs one thread per column.
//
// Hard resets: G is kept as two cumsums per channel, H of the log decays below
// split_log_decay() (clamped, core/math.hpp) and G of the others, and every exponent is
// (G_i - G_j) + (H_i - H_j), as in the CPU path's split chunks (kda/chunk.hpp
// split_gate_cumsum): a pair without a reset between its tokens has H_i - H_j = 0 exactly, so
// its exponent does not lose the |G| u a single float cumsum would (1e-5 relative error at
// T = 8192 with 10% reset tokens). Without resets H = 0 and the values are those of a single
// cumsum.
#pragma once
#include "k3/kda/cuda/common.cuh"

namespace k3::kda::cuda::detail {

inline constexpr int fwd_threads = 128;

inline std::size_t fwd_smem_bytes(index_t K) {
  return static_cast<std::size_t>(4 * chunk * K + 2 * chunk * chunk + chunk * tile_v + K * tile_v + chunk) * sizeof(float);
}

template <class S>
K3_KERNEL void __launch_bounds__(fwd_threads) chunk_fwd_kernel(fwd_args<S> a, float scale, index_t nvt) {
  K3_DYNAMIC_SHARED(float, smem);
  constexpr int C = chunk, BV = tile_v;
  int const K = static_cast<int>(a.K);
  float* sK = smem;
  float* sQ = sK + C * K;
  float* sG = sQ + C * K;
  float* sH = sG + C * K;
  float* sL = sH + C * K;
  float* sA = sL + C * C;
  float* sU = sA + C * C;
  float* sS = sU + C * BV;
  float* sB = sS + K * BV;

  index_t const blk = blockIdx.x;
  index_t const vt = blk % nvt, nh = blk / nvt;
  index_t const h = nh % a.HV, n = nh / a.HV;
  index_t const hq = h / (a.HV / a.H);
  index_t const v0 = vt * BV;
  int const nv = static_cast<int>(a.V - v0 < BV ? a.V - v0 : BV);
  seq_span const sp = sequence(a.cu_seqlens, n, a.T);
  int const tid = threadIdx.x, nt = blockDim.x;
  index_t const state_off = (n * a.HV + h) * a.K * a.V;

  for (int i = tid; i < K * BV; i += nt) {
    int const d = i / BV, c = i % BV;
    sS[i] = (c < nv && a.h0 != nullptr) ? a.h0[state_off + d * a.V + v0 + c] : 0.f;
  }
  __syncthreads();

  for (index_t c0 = 0; c0 < sp.len; c0 += C) {
    int const L = static_cast<int>(sp.len - c0 < C ? sp.len - c0 : C);
    index_t const tok0 = sp.bos + c0;
    // 1. the chunk's k, scale*q, g, beta
    for (int i = tid; i < L * K; i += nt) {
      int const r = i / K, d = i % K;
      index_t const tok = tok0 + r;
      sK[i] = ld(a.k[(tok * a.H + hq) * a.K + d]);
      sQ[i] = scale * ld(a.q[(tok * a.H + hq) * a.K + d]);
      sG[i] = ld(a.g[(tok * a.HV + h) * a.K + d]);
    }
    for (int r = tid; r < L; r += nt) sB[r] = ld(a.beta[(tok0 + r) * a.HV + h]);
    __syncthreads();
    // 2. chunk-local inclusive cumsums of g: H of the large log decays, G of the others
    for (int d = tid; d < K; d += nt) {
      float acc = 0.f, big = 0.f;
      for (int r = 0; r < L; ++r) {
        float const x = ::k3::detail::clamp_log_decay(sG[r * K + d]);
        if (x < split_log_decay)
          big += x;
        else
          acc += x;
        sG[r * K + d] = acc;
        sH[r * K + d] = big;
      }
    }
    __syncthreads();
    // 3. L (strictly lower, beta folded in) and Aqk (lower with diagonal), pairwise
    for (int i = tid; i < L * L; i += nt) {
      int const r = i / L, j = i % L;
      float akk = 0.f, aqk = 0.f;
      if (j <= r) {
        for (int d = 0; d < K; ++d) {
          float const e = expf((sG[r * K + d] - sG[j * K + d]) + (sH[r * K + d] - sH[j * K + d]));
          float const kj = sK[j * K + d] * e;
          akk += sK[r * K + d] * kj;
          aqk += sQ[r * K + d] * kj;
        }
      }
      sL[r * C + j] = j < r ? sB[r] * akk : 0.f;
      sA[r * C + j] = j <= r ? aqk : 0.f;
    }
    // 4. right-hand side beta (v - (k e^G)^T S), reads the chunk-start state
    for (int i = tid; i < L * BV; i += nt) {
      int const r = i / BV, c = i % BV;
      float val = 0.f;
      if (c < nv) {
        float p = 0.f;
        for (int d = 0; d < K; ++d) p += sK[r * K + d] * expf(sG[r * K + d] + sH[r * K + d]) * sS[d * BV + c];
        val = sB[r] * (ld(a.v[((tok0 + r) * a.HV + h) * a.V + v0 + c]) - p);
      }
      sU[i] = val;
    }
    __syncthreads();
    // 5. (I + L) U = rhs by forward substitution, one thread per column
    for (int c = tid; c < BV; c += nt) {
      for (int r = 1; r < L; ++r) {
        float u = sU[r * BV + c];
        for (int j = 0; j < r; ++j) u -= sL[r * C + j] * sU[j * BV + c];
        sU[r * BV + c] = u;
      }
    }
    __syncthreads();
    // 6. outputs
    for (int i = tid; i < L * BV; i += nt) {
      int const r = i / BV, c = i % BV;
      if (c >= nv) continue;
      float o = 0.f;
      for (int d = 0; d < K; ++d) o += sQ[r * K + d] * expf(sG[r * K + d] + sH[r * K + d]) * sS[d * BV + c];
      for (int j = 0; j <= r; ++j) o += sA[r * C + j] * sU[j * BV + c];
      a.o[((tok0 + r) * a.HV + h) * a.V + v0 + c] = st<S>(o);
    }
    __syncthreads();
    // 7. state to the end of the chunk (each element read and written by one thread)
    for (int i = tid; i < K * BV; i += nt) {
      int const d = i / BV, c = i % BV;
      float const gl = sG[(L - 1) * K + d], hl = sH[(L - 1) * K + d];
      float s = expf(gl + hl) * sS[i];
      for (int j = 0; j < L; ++j) s += sK[j * K + d] * expf((gl - sG[j * K + d]) + (hl - sH[j * K + d])) * sU[j * BV + c];
      sS[i] = s;
    }
    __syncthreads();
  }

  if (a.ht != nullptr) {
    for (int i = tid; i < K * BV; i += nt) {
      int const d = i / BV, c = i % BV;
      if (c < nv) a.ht[state_off + d * a.V + v0 + c] = sS[i];
    }
  }
}

inline void set_smem(void const* kernel, std::size_t bytes) {
  int dev = 0, optin = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  K3_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  ::k3::detail::require(bytes <= static_cast<std::size_t>(optin), error_kind::unsupported, [&] {
    return "argument 'K': the chunked kernel needs " + std::to_string(bytes) + " bytes of shared memory per block, the device allows " +
           std::to_string(optin);
  });
  K3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace k3::kda::cuda::detail

namespace k3::kda::cuda {

template <class S>
void chunk_fwd(fwd_args<S> const& a, CUstream_st* stream) {
  detail::layout const l = detail::check(a);
  if (l.N == 0) return;
  index_t const nvt = (a.V + detail::tile_v - 1) / detail::tile_v;
  std::size_t const smem = detail::fwd_smem_bytes(a.K);
  detail::set_smem(reinterpret_cast<void const*>(&detail::chunk_fwd_kernel<S>), smem);
  ::k3::cuda::launch_kernel(detail::chunk_fwd_kernel<S>, {detail::grid3(l.N * a.HV * nvt, 1, 1), detail::fwd_threads, smem, stream}, a, l.scale, nvt);
  K3_CUDA_CHECK(cudaGetLastError());
}

}  // namespace k3::kda::cuda
