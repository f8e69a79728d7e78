// k3/kda/cuda/preprocess.cuh — the KDA pre-processing ops on the GPU (same math and
// conventions as k3/kda/preprocess.hpp): L2 norm (one warp per row), beta sigmoid and the
// two gates (one thread per element), the short causal conv + SiLU (one thread per
// (token, channel)), each with its backward, and the conv decode step on a slot pool.
// Parameter gradients are accumulated with fp32 atomics.
#pragma once
#include "k3/kda/cuda/common.cuh"

namespace k3::kda::cuda::detail {

inline constexpr int pp_threads = 256;

__device__ __forceinline__ float dsigmoid(float x) {
  if (x >= 0.f) return 1.f / (1.f + expf(-x));
  float const e = expf(x);
  return e / (1.f + e);
}
__device__ __forceinline__ float dsoftplus(float x) { return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x))); }

inline unsigned blocks_for(index_t n, int per_block) { return static_cast<unsigned>((n + per_block - 1) / per_block); }

// ---- L2 norm: one warp per row ----
// 1/sqrt(ss + eps) of a row; when the fp32 sum of squares overflowed while the row is finite,
// the row is summed again scaled by a power of two (k3::kda::detail::l2norm_rstd on the CPU).
// ss is the warp-reduced sum, so every lane takes the same branch.
template <class S>
__device__ __forceinline__ float l2norm_rstd(S const* xr, index_t D, int lane, float ss) {
  if (ss <= 3.402823466e38f) return 1.f / sqrtf(ss + 1e-6f);
  float m = 0.f;
  for (index_t d = lane; d < D; d += 32) m = fmaxf(m, fabsf(ld(xr[d])));
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (!(m <= 3.402823466e38f)) return 1.f / sqrtf(ss + 1e-6f);
  int e = 0;
  (void)frexpf(m, &e);
  float const sc = ldexpf(1.f, -e);
  float s2 = 0.f;
  for (index_t d = lane; d < D; d += 32) {
    float const v = ld(xr[d]) * sc;
    s2 += v * v;
  }
  return sc / sqrtf(warp_sum(s2) + 1e-6f * sc * sc);
}

template <class S>
K3_KERNEL void l2norm_fwd_kernel(S const* x, S* y, index_t rows, index_t D) {
  index_t const row = (static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  int const lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together
  S const* xr = x + row * D;
  float ss = 0.f;
  for (index_t d = lane; d < D; d += 32) {
    float const v = ld(xr[d]);
    ss += v * v;
  }
  float const rstd = l2norm_rstd(xr, D, lane, warp_sum(ss));
  for (index_t d = lane; d < D; d += 32) y[row * D + d] = st<S>(ld(xr[d]) * rstd);
}

template <class S>
K3_KERNEL void l2norm_bwd_kernel(S const* x, S const* dy, S* dx, index_t rows, index_t D) {
  index_t const row = (static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  int const lane = threadIdx.x % 32;
  if (row >= rows) return;
  float ss = 0.f, gx = 0.f;
  for (index_t d = lane; d < D; d += 32) {
    float const v = ld(x[row * D + d]);
    ss += v * v;
    gx += ld(dy[row * D + d]) * v;
  }
  ss = warp_sum(ss);
  gx = warp_sum(gx);
  float const rstd = l2norm_rstd(x + row * D, D, lane, ss);
  float const c = gx * rstd * rstd;
  for (index_t d = lane; d < D; d += 32) dx[row * D + d] = st<S>(rstd * (ld(dy[row * D + d]) - c * ld(x[row * D + d])));
}

// ---- beta ----
template <class S>
K3_KERNEL void beta_fwd_kernel(S const* x, S* y, index_t n, float s) {
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += static_cast<index_t>(gridDim.x) * blockDim.x)
    y[i] = st<S>(s * dsigmoid(ld(x[i])));
}
template <class S>
K3_KERNEL void beta_bwd_kernel(S const* x, S const* dy, S* dx, index_t n, float s) {
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    float const v = ld(x[i]);
    dx[i] = st<S>(ld(dy[i]) * s * dsigmoid(v) * dsigmoid(-v));
  }
}

// ---- gates ----
template <class S>
K3_KERNEL void gate_fwd_kernel(gate_params p, S const* x, S* g) {
  index_t const n = p.rows * p.HV * p.K;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    index_t const k = i % p.K, h = (i / p.K) % p.HV;
    float const a = p.A_log != nullptr ? expf(p.A_log[h]) : 1.f;
    float const u = ld(x[i]) + (p.dt_bias != nullptr ? p.dt_bias[h * p.K + k] : 0.f);
    g[i] = st<S>(p.kind == gate_kind::softplus ? -a * dsoftplus(u) : p.lower_bound * dsigmoid(a * u));
  }
}

template <class S>
K3_KERNEL void gate_bwd_kernel(gate_params p, S const* x, S const* dg, S* dx, float* dA_log, float* ddt_bias) {
  index_t const n = p.rows * p.HV * p.K;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    index_t const k = i % p.K, h = (i / p.K) % p.HV;
    float const a = p.A_log != nullptr ? expf(p.A_log[h]) : 1.f;
    float const u = ld(x[i]) + (p.dt_bias != nullptr ? p.dt_bias[h * p.K + k] : 0.f);
    float const gy = ld(dg[i]);
    float du, da;
    if (p.kind == gate_kind::softplus) {
      du = -a * dsigmoid(u) * gy;
      da = gy * (-a * dsoftplus(u));
    } else {
      float const z = a * u;
      float const dz = gy * p.lower_bound * dsigmoid(z) * dsigmoid(-z);
      du = dz * a;
      da = dz * z;
    }
    dx[i] = st<S>(du);
    if (ddt_bias != nullptr) atomicAdd(&ddt_bias[h * p.K + k], du);
    if (dA_log != nullptr) atomicAdd(&dA_log[h], da);
  }
}

// ---- short conv ----
struct conv_seq {
  index_t n, start, len;  // sequence index, first flattened token, length
};

// Sequence n: its cu_seqlens segment, or batch row n.
__device__ __forceinline__ conv_seq conv_sequence_at(conv_params const& p, index_t n) {
  if (p.cu_seqlens == nullptr) return {n, n * p.T, p.T};
  return {n, p.cu_seqlens[n], p.cu_seqlens[n + 1] - p.cu_seqlens[n]};
}

// Sequence of flattened token `tok`: the cu_seqlens segment holding it, or its batch row.
__device__ __forceinline__ conv_seq conv_sequence(conv_params const& p, index_t tok) {
  if (p.cu_seqlens == nullptr) return conv_sequence_at(p, tok / p.T);
  index_t lo = 0, hi = p.N + 1;  // first index with cu[idx] > tok
  while (lo < hi) {
    index_t const mid = (lo + hi) / 2;
    if (p.cu_seqlens[mid] > tok)
      hi = mid;
    else
      lo = mid + 1;
  }
  return conv_sequence_at(p, lo - 1);
}

// Input at sequence-relative position rel (negative: the initial state, or zero).
template <class S>
__device__ __forceinline__ float conv_in(conv_params const& p, S const* x, float const* init, conv_seq const& q, index_t rel, index_t c) {
  if (rel >= 0) return ld(x[(q.start + rel) * p.C + c]);
  if (init == nullptr) return 0.f;
  return init[(q.n * p.C + c) * (p.W - 1) + rel + (p.W - 1)];
}

template <class S>
__device__ __forceinline__ float conv_pre(conv_params const& p, S const* x, float const* init, conv_seq const& q, index_t rel, index_t c) {
  float acc = p.bias != nullptr ? p.bias[c] : 0.f;
  for (index_t j = 0; j < p.W; ++j) acc += p.weight[c * p.W + j] * conv_in(p, x, init, q, rel - (p.W - 1) + j, c);
  return acc;
}

template <class S>
K3_KERNEL void conv_fwd_kernel(conv_params p, S const* x, S* y, float const* init) {
  index_t const n = p.B * p.T * p.C;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    index_t const tok = i / p.C, c = i % p.C;
    conv_seq const q = conv_sequence(p, tok);
    float const z = conv_pre(p, x, init, q, tok - q.start, c);
    y[i] = st<S>(p.silu ? z * dsigmoid(z) : z);
  }
}

template <class S>
K3_KERNEL void conv_final_state_kernel(conv_params p, S const* x, float const* init, float* fin, index_t N) {
  index_t const n_all = N * p.C * (p.W - 1);
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_all; i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    index_t const s = i % (p.W - 1), c = (i / (p.W - 1)) % p.C, n = i / ((p.W - 1) * p.C);
    conv_seq const q = conv_sequence_at(p, n);
    fin[i] = conv_in(p, x, init, q, q.len - (p.W - 1) + s, c);
  }
}

template <class S>
__device__ __forceinline__ float conv_dpre(conv_params const& p, S const* x, S const* dy, float const* init, conv_seq const& q, index_t rel,
                                           index_t c) {
  float const g = ld(dy[(q.start + rel) * p.C + c]);
  if (!p.silu) return g;
  float const z = conv_pre(p, x, init, q, rel, c);
  return g * dsigmoid(z) * (1.f + z * dsigmoid(-z));
}

template <class S>
K3_KERNEL void conv_bwd_kernel(conv_params p, S const* x, S const* dy, S* dx, float* dweight, float* dbias, float const* init) {
  index_t const n = p.B * p.T * p.C;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    index_t const tok = i / p.C, c = i % p.C;
    conv_seq const q = conv_sequence(p, tok);
    index_t const rel = tok - q.start;
    // dx: outputs rel + (W-1) - j inside the sequence
    float acc = 0.f;
    for (index_t j = 0; j < p.W; ++j) {
      index_t const to = rel + (p.W - 1) - j;
      if (to < q.len) acc += p.weight[c * p.W + j] * conv_dpre(p, x, dy, init, q, to, c);
    }
    dx[i] = st<S>(acc);
    if (dweight != nullptr || dbias != nullptr) {
      float const d = conv_dpre(p, x, dy, init, q, rel, c);
      if (dbias != nullptr) atomicAdd(&dbias[c], d);
      if (dweight != nullptr)
        for (index_t j = 0; j < p.W; ++j) atomicAdd(&dweight[c * p.W + j], d * conv_in(p, x, init, q, rel - (p.W - 1) + j, c));
    }
  }
}

template <class S>
K3_KERNEL void conv_dinit_kernel(conv_params p, S const* x, S const* dy, float const* init, float* dinit, index_t N) {
  index_t const n_all = N * p.C * (p.W - 1);
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_all; i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    index_t const s = i % (p.W - 1), c = (i / (p.W - 1)) % p.C, n = i / ((p.W - 1) * p.C);
    conv_seq const q = conv_sequence_at(p, n);
    float acc = 0.f;
    for (index_t j = 0; j <= s; ++j)
      if (s - j < q.len) acc += p.weight[c * p.W + j] * conv_dpre(p, x, dy, init, q, s - j, c);
    dinit[i] = acc;
  }
}

template <class S>
K3_KERNEL void conv_decode_kernel(conv_params p, S const* x, S* y, index_t N, float* state, index_t P, std::int64_t const* slots) {
  index_t const n_all = N * p.C;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_all; i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    index_t const n = i / p.C, c = i % p.C;
    index_t const slot = slots != nullptr ? slots[n] : n;
    if (slot < 0 || slot >= P) continue;
    float* sp = state + (slot * p.C + c) * (p.W - 1);
    float const xv = ld(x[i]);
    float acc = p.bias != nullptr ? p.bias[c] : 0.f;
    for (index_t j = 0; j + 1 < p.W; ++j) acc += p.weight[c * p.W + j] * sp[j];
    acc += p.weight[c * p.W + p.W - 1] * xv;
    y[i] = st<S>(p.silu ? acc * dsigmoid(acc) : acc);
    for (index_t j = 0; j + 2 < p.W; ++j) sp[j] = sp[j + 1];
    if (p.W > 1) sp[p.W - 2] = xv;
  }
}

inline unsigned grid_for(index_t n) {
  index_t const b = (n + pp_threads - 1) / pp_threads;
  return static_cast<unsigned>(b < 65536 ? (b > 0 ? b : 1) : 65536);  // grid-stride loops cover the rest
}

}  // namespace k3::kda::cuda::detail

namespace k3::kda::cuda {

template <class S>
void l2norm_fwd(S const* x, S* y, index_t rows, index_t D, CUstream_st* stream) {
  detail::check_rows(rows, D);
  if (rows == 0) return;
  detail::require_ptr(x, "x", D > 0);
  detail::require_ptr(y, "y", D > 0);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("y", detail::span(y, rows * D)),
                                    ::k3::detail::named_views("x", detail::span(x, rows * D)));
  ::k3::cuda::launch_kernel(detail::l2norm_fwd_kernel<S>, {detail::blocks_for(rows * 32, detail::pp_threads), detail::pp_threads, 0, stream}, x, y, rows, D);
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void l2norm_bwd(S const* x, S const* dy, S* dx, index_t rows, index_t D, CUstream_st* stream) {
  detail::check_rows(rows, D);
  if (rows == 0) return;
  detail::require_ptr(x, "x", D > 0);
  detail::require_ptr(dy, "dy", D > 0);
  detail::require_ptr(dx, "dx", D > 0);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("dx", detail::span(dx, rows * D)),
                                    ::k3::detail::named_views("x", detail::span(x, rows * D), "dy", detail::span(dy, rows * D)));
  ::k3::cuda::launch_kernel(detail::l2norm_bwd_kernel<S>, {detail::blocks_for(rows * 32, detail::pp_threads), detail::pp_threads, 0, stream}, x, dy, dx, rows, D);
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void beta_sigmoid_fwd(S const* x, S* beta, index_t n, bool allow_neg_eigval, CUstream_st* stream) {
  detail::check_rows(n, 1);
  if (n == 0) return;
  detail::require_ptr(x, "x", true);
  detail::require_ptr(beta, "beta", true);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("beta", detail::span(beta, n)),
                                    ::k3::detail::named_views("x", detail::span(x, n)));
  ::k3::cuda::launch_kernel(detail::beta_fwd_kernel<S>, {detail::grid_for(n), detail::pp_threads, 0, stream}, x, beta, n, allow_neg_eigval ? 2.f : 1.f);
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void beta_sigmoid_bwd(S const* x, S const* dbeta, S* dx, index_t n, bool allow_neg_eigval, CUstream_st* stream) {
  detail::check_rows(n, 1);
  if (n == 0) return;
  detail::require_ptr(x, "x", true);
  detail::require_ptr(dbeta, "dbeta", true);
  detail::require_ptr(dx, "dx", true);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("dx", detail::span(dx, n)),
                                    ::k3::detail::named_views("x", detail::span(x, n), "dbeta", detail::span(dbeta, n)));
  ::k3::cuda::launch_kernel(detail::beta_bwd_kernel<S>, {detail::grid_for(n), detail::pp_threads, 0, stream}, x, dbeta, dx, n, allow_neg_eigval ? 2.f : 1.f);
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void gate_fwd(gate_params const& p, S const* x, S* g, CUstream_st* stream) {
  detail::check(p);
  index_t const n = p.rows * p.HV * p.K;
  if (n == 0) return;
  detail::require_ptr(x, "x", true);
  detail::require_ptr(g, "g", true);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("g", detail::span(g, n)),
                                    ::k3::detail::named_views("x", detail::span(x, n), "A_log", detail::span(p.A_log, p.HV),
                                                              "dt_bias", detail::span(p.dt_bias, p.HV * p.K)));
  ::k3::cuda::launch_kernel(detail::gate_fwd_kernel<S>, {detail::grid_for(n), detail::pp_threads, 0, stream}, p, x, g);
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void gate_bwd(gate_params const& p, S const* x, S const* dg, S* dx, float* dA_log, float* ddt_bias, CUstream_st* stream) {
  detail::check(p);
  index_t const rows = p.rows * p.HV * p.K;
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("dx", detail::span(dx, rows), "dA_log", detail::span(dA_log, p.HV),
                                                              "ddt_bias", detail::span(ddt_bias, p.HV * p.K)),
                                    ::k3::detail::named_views("x", detail::span(x, rows), "dg", detail::span(dg, rows),
                                                              "A_log", detail::span(p.A_log, p.HV),
                                                              "dt_bias", detail::span(p.dt_bias, p.HV * p.K)));
  cudaStream_t const s = stream;
  if (dA_log != nullptr) K3_CUDA_CHECK(cudaMemsetAsync(dA_log, 0, static_cast<std::size_t>(p.HV) * sizeof(float), s));
  if (ddt_bias != nullptr) K3_CUDA_CHECK(cudaMemsetAsync(ddt_bias, 0, static_cast<std::size_t>(p.HV * p.K) * sizeof(float), s));
  index_t const n = p.rows * p.HV * p.K;
  if (n == 0) return;
  detail::require_ptr(x, "x", true);
  detail::require_ptr(dg, "dg", true);
  detail::require_ptr(dx, "dx", true);
  ::k3::cuda::launch_kernel(detail::gate_bwd_kernel<S>, {detail::grid_for(n), detail::pp_threads, 0, s}, p, x, dg, dx, dA_log, ddt_bias);
  K3_CUDA_CHECK(cudaGetLastError());
}

template <class S>
void short_conv_fwd(conv_params const& p, S const* x, S* y, float const* initial_state, float* final_state, CUstream_st* stream) {
  index_t const N = detail::check(p);
  ::k3::detail::require(final_state == nullptr || final_state != initial_state, error_kind::aliasing,
                        "arguments 'final_state' and 'initial_state': must not alias on the GPU (copy the state first)");
  index_t const states = N * p.C * (p.W - 1);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("y", detail::span(y, p.B * p.T * p.C),
                                                              "final_state", detail::span(final_state, states)),
                                    ::k3::detail::named_views("x", detail::span(x, p.B * p.T * p.C),
                                                              "weight", detail::span(p.weight, p.C * p.W),
                                                              "bias", detail::span(p.bias, p.C),
                                                              "initial_state", detail::span(initial_state, states),
                                                              "cu_seqlens", detail::span(p.cu_seqlens, p.cu_seqlens ? N + 1 : 0)));
  index_t const n = p.B * p.T * p.C;
  if (n > 0) {
    detail::require_ptr(x, "x", true);
    detail::require_ptr(y, "y", true);
    ::k3::cuda::launch_kernel(detail::conv_fwd_kernel<S>, {detail::grid_for(n), detail::pp_threads, 0, stream}, p, x, y, initial_state);
    K3_CUDA_CHECK(cudaGetLastError());
  }
  if (final_state != nullptr && N * (p.W - 1) > 0) {
    ::k3::cuda::launch_kernel(detail::conv_final_state_kernel<S>, {detail::grid_for(N * p.C * (p.W - 1)), detail::pp_threads, 0, stream}, p, x, initial_state,
                                                                                                                  final_state, N);
    K3_CUDA_CHECK(cudaGetLastError());
  }
}

template <class S>
void short_conv_bwd(conv_params const& p, S const* x, S const* dy, S* dx, float* dweight, float* dbias, float const* initial_state,
                    float* d_initial_state, CUstream_st* stream) {
  index_t const N = detail::check(p);
  ::k3::detail::require(d_initial_state == nullptr || initial_state != nullptr, error_kind::value,
                        "argument 'd_initial_state': needs the initial_state it differentiates");
  index_t const states = N * p.C * (p.W - 1), tokens = p.B * p.T * p.C;
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("dx", detail::span(dx, tokens),
                                                              "dweight", detail::span(dweight, p.C * p.W),
                                                              "dbias", detail::span(dbias, p.C),
                                                              "d_initial_state", detail::span(d_initial_state, states)),
                                    ::k3::detail::named_views("x", detail::span(x, tokens), "dy", detail::span(dy, tokens),
                                                              "weight", detail::span(p.weight, p.C * p.W),
                                                              "bias", detail::span(p.bias, p.C),
                                                              "initial_state", detail::span(initial_state, states),
                                                              "cu_seqlens", detail::span(p.cu_seqlens, p.cu_seqlens ? N + 1 : 0)));
  cudaStream_t const s = stream;
  if (dweight != nullptr) K3_CUDA_CHECK(cudaMemsetAsync(dweight, 0, static_cast<std::size_t>(p.C * p.W) * sizeof(float), s));
  if (dbias != nullptr) K3_CUDA_CHECK(cudaMemsetAsync(dbias, 0, static_cast<std::size_t>(p.C) * sizeof(float), s));
  index_t const n = p.B * p.T * p.C;
  if (n > 0) {
    detail::require_ptr(x, "x", true);
    detail::require_ptr(dy, "dy", true);
    detail::require_ptr(dx, "dx", true);
    ::k3::cuda::launch_kernel(detail::conv_bwd_kernel<S>, {detail::grid_for(n), detail::pp_threads, 0, s}, p, x, dy, dx, dweight, dbias, initial_state);
    K3_CUDA_CHECK(cudaGetLastError());
  }
  if (d_initial_state != nullptr && N * (p.W - 1) > 0) {
    ::k3::cuda::launch_kernel(detail::conv_dinit_kernel<S>, {detail::grid_for(N * p.C * (p.W - 1)), detail::pp_threads, 0, s}, p, x, dy, initial_state,
                                                                                                       d_initial_state, N);
    K3_CUDA_CHECK(cudaGetLastError());
  }
}

template <class S>
void short_conv_decode(conv_params const& p, S const* x, S* y, index_t N, float* conv_state, index_t P, std::int64_t const* slots,
                       CUstream_st* stream) {
  ::k3::detail::require(p.C >= 1 && p.W >= 1, error_kind::value, [&] {
    return "arguments 'C', 'W': need C >= 1 and W >= 1, got C = " + std::to_string(p.C) + ", W = " + std::to_string(p.W);
  });
  ::k3::detail::require(N >= 0 && P >= 0, error_kind::value, "arguments 'N', 'P': must be >= 0");
  ::k3::detail::require(slots != nullptr || P >= N, error_kind::value, [&] {
    return "argument 'conv_state': without slots the pool needs at least N = " + std::to_string(N) + " states, got P = " + std::to_string(P);
  });
  if (N == 0) return;
  detail::require_ptr(p.weight, "weight", true);
  detail::require_ptr(x, "x", true);
  detail::require_ptr(y, "y", true);
  detail::require_ptr(conv_state, "conv_state", p.W > 1 && P > 0);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("y", detail::span(y, N * p.C),
                                                              "conv_state", detail::span(conv_state, P * p.C * (p.W - 1))),
                                    ::k3::detail::named_views("x", detail::span(x, N * p.C),
                                                              "weight", detail::span(p.weight, p.C * p.W),
                                                              "bias", detail::span(p.bias, p.C), "slots", detail::span(slots, N)));
  ::k3::cuda::launch_kernel(detail::conv_decode_kernel<S>, {detail::grid_for(N * p.C), detail::pp_threads, 0, stream}, p, x, y, N, conv_state, P, slots);
  K3_CUDA_CHECK(cudaGetLastError());
}

}  // namespace k3::kda::cuda
