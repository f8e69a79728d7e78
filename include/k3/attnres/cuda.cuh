// k3/attnres/cuda.cuh — CUDA kernels for AttnRes: one mixing site (forward, backward), block
// inverse RMS, two-phase inference (phase 1, phase 2 fused with the residual add).
// One thread block per token; block-wide reductions with warp shuffles. Launchers are
// declared in k3/attnres/cuda.hpp.
#pragma once
#include "k3/backend/cuda/config.cuh"
// (config.cuh first: it refuses host compilers)
#include <cstdint>
#include <string>

#include "k3/attnres/cuda.hpp"
#include "k3/core/error.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"

namespace k3::cuda::attnres {

namespace detail {

inline constexpr int threads = 256;

__device__ __forceinline__ float ld(float x) { return x; }
__device__ __forceinline__ float ld(k3::bfloat16 x) { return __uint_as_float(std::uint32_t(x.bits) << 16); }
__device__ __forceinline__ void st(float& o, float v) { o = v; }
__device__ __forceinline__ void st(k3::bfloat16& o, float v) {
  std::uint32_t const u = __float_as_uint(v);
  std::uint32_t const r = (u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  o.bits = static_cast<std::uint16_t>(r);
}

// Sums NV values across the block; every thread gets the totals in out (shared scratch
// `red` holds NV * 32 floats).
template <int NV>
__device__ __forceinline__ void block_sum(float (&v)[NV], float* red) {
  int const lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
K3_UNROLL
  for (int i = 0; i < NV; ++i)
    for (int o = 16; o > 0; o >>= 1) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  __syncthreads();
  if (lane == 0)
K3_UNROLL
    for (int i = 0; i < NV; ++i) red[i * 32 + warp] = v[i];
  __syncthreads();
K3_UNROLL
  for (int i = 0; i < NV; ++i) {
    float s = 0;
    for (int w = 0; w < warps; ++w) s += red[i * 32 + w];
    v[i] = s;
  }
}

template <class S>
__device__ __forceinline__ S const* row(S const* bank, index_t n, S const* partial, index_t T, index_t d, index_t j, index_t t) {
  return j < n ? bank + (j * T + t) * d : partial + t * d;
}

// r_j, c_j and alpha_j of token t into shared arrays (m <= max_sources).
template <class S>
__device__ void token_stats(S const* bank, index_t n, S const* partial, index_t T, index_t d, index_t t, float const* u, float eps,
                            float* r, float* c, float* a, float* red) {
  index_t const m = n + (partial ? 1 : 0);
  for (index_t j = 0; j < m; ++j) {
    S const* v = row(bank, n, partial, T, d, j, t);
    float acc[2] = {0.f, 0.f};
    for (index_t k = threadIdx.x; k < d; k += blockDim.x) {
      float const x = ld(v[k]);
      acc[0] += u[k] * x;
      acc[1] += x * x;
    }
    block_sum<2>(acc, red);
    if (threadIdx.x == 0) {
      c[j] = acc[0];
      r[j] = rsqrtf(acc[1] / float(d) + eps);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float mx = -INFINITY;
    bool nan = false;
    for (index_t j = 0; j < m; ++j) {
      float const s = r[j] * c[j];
      nan |= isnan(s);
      mx = fmaxf(mx, s);
    }
    float z = 0;
    for (index_t j = 0; j < m; ++j) z += (a[j] = expf(r[j] * c[j] - mx));
    if (nan) z = NAN;
    for (index_t j = 0; j < m; ++j) a[j] /= z;
  }
  __syncthreads();
}

template <class S>
K3_KERNEL void mix_forward_kernel(S const* bank, index_t n, S const* partial, index_t T, index_t d, float const* u, float eps, S* h) {
  __shared__ float red[2 * 32], r[max_sources], c[max_sources], a[max_sources];
  index_t const t = blockIdx.x;
  token_stats(bank, n, partial, T, d, t, u, eps, r, c, a, red);
  index_t const m = n + (partial ? 1 : 0);
  for (index_t k = threadIdx.x; k < d; k += blockDim.x) {
    float acc = 0;
    for (index_t j = 0; j < m; ++j) acc += a[j] * ld(row(bank, n, partial, T, d, j, t)[k]);
    st(h[t * d + k], acc);
  }
}

template <class S>
K3_KERNEL void mix_backward_kernel(S const* bank, index_t n, S const* partial, index_t T, index_t d, float const* u, float eps,
                                   float const* dh, float* dbank, float* dpartial, float* du) {
  __shared__ float red[2 * 32], r[max_sources], c[max_sources], a[max_sources], da[max_sources], cu[max_sources], cv[max_sources];
  index_t const t = blockIdx.x;
  token_stats(bank, n, partial, T, d, t, u, eps, r, c, a, red);
  index_t const m = n + (partial ? 1 : 0);
  float const* g = dh + t * d;
  for (index_t j = 0; j < m; ++j) {
    S const* v = row(bank, n, partial, T, d, j, t);
    float acc[1] = {0.f};
    for (index_t k = threadIdx.x; k < d; k += blockDim.x) acc[0] += g[k] * ld(v[k]);
    block_sum<1>(acc, red);
    if (threadIdx.x == 0) da[j] = acc[0];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float dhh = 0;
    for (index_t j = 0; j < m; ++j) dhh += a[j] * da[j];
    for (index_t j = 0; j < m; ++j) {
      float const ds = a[j] * (da[j] - dhh);
      cu[j] = ds * r[j];
      cv[j] = ds * c[j] * r[j] * r[j] * r[j] / float(d);
    }
  }
  __syncthreads();
  for (index_t k = threadIdx.x; k < d; k += blockDim.x) {
    float dus = 0;
    for (index_t j = 0; j < m; ++j) {
      float const x = ld(row(bank, n, partial, T, d, j, t)[k]);
      float const gv = a[j] * g[k] + cu[j] * u[k] - cv[j] * x;
      if (j < n) dbank[(j * T + t) * d + k] = gv;
      else dpartial[t * d + k] = gv;
      dus += cu[j] * x;
    }
    atomicAdd(du + k, dus);
  }
}

template <int = 0>
K3_KERNEL void fold_grads_kernel(float const* du, float const* w, float const* g, index_t d, float* dw, float* dg) {
  index_t const k = index_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k < d) {
    dw[k] = du[k] * g[k];
    dg[k] = du[k] * w[k];
  }
}

template <int = 0>
K3_KERNEL void fold_query_kernel(float const* w, float const* g, index_t d, float* u) {
  index_t const k = index_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k < d) u[k] = w[k] * g[k];
}

template <class S>
K3_KERNEL void block_rinv_kernel(S const* block, index_t d, float eps, float* rinv) {
  __shared__ float red[32];
  index_t const t = blockIdx.x;
  float acc[1] = {0.f};
  for (index_t k = threadIdx.x; k < d; k += blockDim.x) {
    float const x = ld(block[t * d + k]);
    acc[0] += x * x;
  }
  block_sum<1>(acc, red);
  if (threadIdx.x == 0) rinv[t] = rsqrtf(acc[0] / float(d) + eps);
}

// Phase 1, one block per token: for each site the n scores (block sums), the softmax, then
// o_l. The bank rows of the token are re-read per site from L1/L2.
template <class S>
K3_KERNEL void phase1_kernel(S const* bank, float const* rinv, index_t n, index_t T, index_t d, float const* u, index_t nq, S* o,
                             float* lse) {
  __shared__ float red[max_sources * 32], a[max_sources];
  index_t const t = blockIdx.x;
  for (index_t l = 0; l < nq; ++l) {
    float acc[max_sources];
K3_UNROLL
    for (int j = 0; j < int(max_sources); ++j) acc[j] = 0.f;
    float const* ul = u + l * d;
    for (index_t k = threadIdx.x; k < d; k += blockDim.x) {
      float const uk = ul[k];
K3_UNROLL
      for (int j = 0; j < int(max_sources); ++j)
        if (j < n) acc[j] += uk * ld(bank[(j * T + t) * d + k]);
    }
    block_sum<int(max_sources)>(acc, red);
    if (threadIdx.x == 0) {
      float mx = -INFINITY;
      bool nan = false;
      for (index_t j = 0; j < n; ++j) {
        acc[j] *= rinv[j * T + t];
        nan |= isnan(acc[j]);
        mx = fmaxf(mx, acc[j]);
      }
      float z = 0;
      for (index_t j = 0; j < n; ++j) z += (a[j] = expf(acc[j] - mx));
      if (nan) z = mx = NAN;
      for (index_t j = 0; j < n; ++j) a[j] /= z;
      lse[l * T + t] = n > 0 ? mx + logf(z) : -INFINITY;
    }
    __syncthreads();
    for (index_t k = threadIdx.x; k < d; k += blockDim.x) {
      float s = 0;
      for (index_t j = 0; j < n; ++j) s += a[j] * ld(bank[(j * T + t) * d + k]);
      st(o[(l * T + t) * d + k], s);
    }
    __syncthreads();
  }
}

template <class S>
K3_KERNEL void phase2_add_kernel(S const* o, float const* lse, S* prefix, S const* delta, float const* u, index_t d, float eps, S* h) {
  __shared__ float red[2 * 32];
  index_t const t = blockIdx.x;
  S* pr = prefix + t * d;
  float acc[2] = {0.f, 0.f};
  for (index_t k = threadIdx.x; k < d; k += blockDim.x) {
    S v;
    st(v, ld(pr[k]) + ld(delta[t * d + k]));
    pr[k] = v;  // each thread re-reads only its own elements below
    float const b = ld(v);
    acc[0] += u[k] * b;
    acc[1] += b * b;
  }
  block_sum<2>(acc, red);
  float const s2 = acc[0] * rsqrtf(acc[1] / float(d) + eps);
  float const p = 1.f / (1.f + expf(lse[t] - s2));
  for (index_t k = threadIdx.x; k < d; k += blockDim.x) {
    float const ok = ld(o[t * d + k]);
    st(h[t * d + k], ok + p * (ld(pr[k]) - ok));
  }
}

// The n elements at p as a flat device view, for k3::detail::check_outputs_apart: no output
// over an input or another output (blocks of other tokens still read the inputs while one
// writes).
template <class T>
tensor_view<T, 1, cuda_device_space> flat(T* p, index_t n) {
  return k3::detail::flat_view<cuda_device_space>(p, n);
}

inline void check_sizes(char const* op, index_t m, index_t T, index_t d) {
  k3::detail::require(m >= 0 && m <= max_sources, error_kind::unsupported, [&] {
    return std::string(op) + ": " + std::to_string(m) + " sources exceed the CUDA kernels' limit of " + std::to_string(max_sources);
  });
  k3::detail::require(T >= 0 && T <= 0x7fffffff && d >= 1, error_kind::value, [&] {
    return std::string(op) + ": need 0 <= T < 2^31 and d >= 1, got T = " + std::to_string(T) + ", d = " + std::to_string(d);
  });
}

}  // namespace detail

template <class S>
void mix_forward(S const* bank, index_t n, S const* partial, index_t T, index_t d, float const* u, float eps, S* h, stream_t stream) {
  index_t const m = n + (partial ? 1 : 0);
  detail::check_sizes("attnres::mix_forward", m, T, d);
  k3::detail::require(m >= 1, error_kind::value, "attnres::mix_forward: a mixing site needs at least one source");
  k3::detail::check_outputs_apart([&](auto&& f) { f("h", detail::flat(h, T * d)); },
                                  [&](auto&& f) {
                                    f("bank", detail::flat(bank, n * T * d));
                                    f("partial", detail::flat(partial, T * d));
                                    f("u", detail::flat(u, d));
                                  });
  if (T == 0) return;
  ::k3::cuda::launch_kernel(detail::mix_forward_kernel<S>, {unsigned(T), detail::threads, 0, stream}, bank, n, partial, T, d, u, eps, h);
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void mix_backward(S const* bank, index_t n, S const* partial, index_t T, index_t d, float const* w, float const* gain, float eps,
                  float const* dh, float* dbank, float* dpartial, float* dw, float* dgain, float* du_workspace, stream_t stream) {
  index_t const m = n + (partial ? 1 : 0);
  detail::check_sizes("attnres::mix_backward", m, T, d);
  k3::detail::require(m >= 1, error_kind::value, "attnres::mix_backward: a mixing site needs at least one source");
  k3::detail::check_outputs_apart(
      [&](auto&& f) {
        f("dbank", detail::flat(dbank, n * T * d));
        f("dpartial", detail::flat(partial ? dpartial : nullptr, T * d));
        f("dw", detail::flat(dw, d));
        f("dgain", detail::flat(dgain, d));
        f("du_workspace", detail::flat(du_workspace, d));
      },
      [&](auto&& f) {
        f("bank", detail::flat(bank, n * T * d));
        f("partial", detail::flat(partial, T * d));
        f("w", detail::flat(w, d));
        f("gain", detail::flat(gain, d));
        f("dh", detail::flat(dh, T * d));
      });
  // u = g * w lives in dgain's buffer until the last kernel overwrites it with the gradient.
  unsigned const blocks_d = unsigned((d + 255) / 256);
  ::k3::cuda::launch_kernel(detail::fold_query_kernel<>, {blocks_d, 256, 0, stream}, w, gain, d, dgain);
  K3_CUDA_CHECK(cudaMemsetAsync(du_workspace, 0, std::size_t(d) * sizeof(float), stream));
  if (T > 0) ::k3::cuda::launch_kernel(detail::mix_backward_kernel<S>, {unsigned(T), detail::threads, 0, stream}, bank, n, partial, T, d, dgain, eps, dh, dbank, dpartial, du_workspace);
  ::k3::cuda::launch_kernel(detail::fold_grads_kernel<>, {blocks_d, 256, 0, stream}, du_workspace, w, gain, d, dw, dgain);
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void block_rinv(S const* block, index_t T, index_t d, float eps, float* rinv, stream_t stream) {
  detail::check_sizes("attnres::block_rinv", 1, T, d);
  k3::detail::check_outputs_apart([&](auto&& f) { f("rinv", detail::flat(rinv, T)); }, [&](auto&& f) { f("block", detail::flat(block, T * d)); });
  if (T == 0) return;
  ::k3::cuda::launch_kernel(detail::block_rinv_kernel<S>, {unsigned(T), detail::threads, 0, stream}, block, d, eps, rinv);
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void phase1(S const* bank, float const* rinv, index_t n, index_t T, index_t d, float const* u, index_t nq, S* o, float* lse,
            stream_t stream) {
  detail::check_sizes("attnres::phase1", n, T, d);
  k3::detail::require(nq >= 0, error_kind::value, "attnres::phase1: nq must be >= 0");
  k3::detail::check_outputs_apart(
      [&](auto&& f) {
        f("o", detail::flat(o, nq * T * d));
        f("lse", detail::flat(lse, nq * T));
      },
      [&](auto&& f) {
        f("bank", detail::flat(bank, n * T * d));
        f("rinv", detail::flat(rinv, n * T));
        f("u", detail::flat(u, nq * d));
      });
  if (T == 0 || nq == 0) return;
  ::k3::cuda::launch_kernel(detail::phase1_kernel<S>, {unsigned(T), detail::threads, 0, stream}, bank, rinv, n, T, d, u, nq, o, lse);
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void phase2_add(S const* o, float const* lse, S* prefix, S const* delta, float const* u, index_t T, index_t d, float eps, S* h,
                stream_t stream) {
  detail::check_sizes("attnres::phase2_add", 1, T, d);
  k3::detail::check_outputs_apart(
      [&](auto&& f) {
        f("prefix", detail::flat(prefix, T * d));
        f("h", detail::flat(h, T * d));
      },
      [&](auto&& f) {
        f("o", detail::flat(o, T * d));
        f("lse", detail::flat(lse, T));
        f("delta", detail::flat(delta, T * d));
        f("u", detail::flat(u, d));
      });
  if (T == 0) return;
  ::k3::cuda::launch_kernel(detail::phase2_add_kernel<S>, {unsigned(T), detail::threads, 0, stream}, o, lse, prefix, delta, u, d, eps, h);
  K3_CUDA_CHECK(cudaGetLastError());
}

}  // namespace k3::cuda::attnres

// Explicit instantiation of every launcher for storage type S, for a .cu file of the
// program (so .cpp files can call the declarations in k3/attnres/cuda.hpp).
#define K3_ATTNRES_CUDA_INSTANTIATE(S)                                                                                  \
  namespace k3::cuda::attnres {                                                                                         \
  template void mix_forward<S>(S const*, index_t, S const*, index_t, index_t, float const*, float, S*, stream_t);        \
  template void mix_backward<S>(S const*, index_t, S const*, index_t, index_t, float const*, float const*, float,        \
                                float const*, float*, float*, float*, float*, float*, stream_t);                        \
  template void block_rinv<S>(S const*, index_t, index_t, float, float*, stream_t);                                     \
  template void phase1<S>(S const*, float const*, index_t, index_t, index_t, float const*, index_t, S*, float*, stream_t); \
  template void phase2_add<S>(S const*, float const*, S*, S const*, float const*, index_t, index_t, float, S*, stream_t); \
  }
