// k3/optim/cuda.cuh — NS5 on a CUDA backend: k3::optim::newton_schulz(cuda_backend,
// newton_schulz_args<T, R, cuda_device_space>{.g, .o}, options), the same call, options and
// results as on the CPU (k3/optim/newton_schulz.hpp) up to the products' summation order.
// Include from a .cu file.
//
// Per block (a matrix, or one head of it): a load kernel writes X (transposed when the block
// has more rows than columns) and flags non-finite input; one thread block sums X's squares
// in double in a fixed tree order and writes 1 / (‖X‖ + eps), or NaN for a non-finite block
// (which then stays NaN, as on the CPU); a scale kernel; per step three launches of one tiled
// GEMM (16 x 16 output tiles, 16-deep panels of both operands in shared memory) that computes
// alpha·P·op(Q) + beta·R; a store kernel undoes the transpose and applies the Moonlight
// factor. The workspace (X, A, B, Y in the compute type) is allocated once per call.
#pragma once
#include "k3/backend/cuda/config.cuh"
// (config.cuh first: it refuses host compilers)
#include <algorithm>
#include <cstdint>
#include <utility>
#include <type_traits>

#include "k3/backend/cuda/backend.cuh"
#include "k3/core/concepts.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/optim/common.hpp"

namespace k3::optim {

namespace detail {

inline constexpr int ns_tile = 16, ns_reduce_threads = 256;

template <class C, class S>
K3_KERNEL void ns_load_kernel(tensor_view<S const, 2, cuda_device_space> g, C* x, index_t n, bool tr, int* bad) {
  index_t const rows = g.extent(0), cols = g.extent(1), total = rows * cols;
  for (index_t e = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += static_cast<index_t>(gridDim.x) * blockDim.x) {
    index_t const i = e / cols, j = e % cols;
    C const v = load_as<C>(g(i, j));
    if (!isfinite(v)) atomicMax(bad, 1);
    x[tr ? j * n + i : i * n + j] = v;
  }
}

// One block: inv[0] = 1 / (sqrt(sum x²) + eps) in a fixed order, or NaN for a flagged block.
template <class C>
K3_KERNEL void ns_norm_kernel(C const* x, index_t total, double eps, int const* bad, C* inv) {
  __shared__ double part[ns_reduce_threads];
  double s = 0;
  for (index_t e = threadIdx.x; e < total; e += blockDim.x) s += static_cast<double>(x[e]) * static_cast<double>(x[e]);
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = ns_reduce_threads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    C const denom = static_cast<C>(sqrt(part[0])) + static_cast<C>(eps);
    inv[0] = *bad ? static_cast<C>(NAN) : C(1) / denom;
  }
}

template <class C>
K3_KERNEL void ns_scale_kernel(C* x, index_t total, C const* inv) {
  C const f = inv[0];
  for (index_t e = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += static_cast<index_t>(gridDim.x) * blockDim.x)
    x[e] = f == f ? x[e] * f : f;
}

// out[M, N] = alpha · P[M, K] · op(Q) + beta · R[M, N] (R may be null); op(Q) = Qᵀ of Q[N, K]
// when q_transposed, else Q[K, N]. All row-major and contiguous.
template <class C>
K3_KERNEL void ns_gemm_kernel(C const* P, C const* Q, C const* R, C* out, index_t M, index_t N, index_t K, bool q_transposed, C alpha,
                              C beta) {
  __shared__ C ps[ns_tile][ns_tile + 1];
  __shared__ C qs[ns_tile][ns_tile + 1];
  int const tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  index_t const row = static_cast<index_t>(blockIdx.y) * ns_tile + ty, col = static_cast<index_t>(blockIdx.x) * ns_tile + tx;
  C acc = 0;
  for (index_t k0 = 0; k0 < K; k0 += ns_tile) {
    index_t const pk = k0 + tx, qk = k0 + ty;
    ps[ty][tx] = row < M && pk < K ? P[row * K + pk] : C(0);
    if (q_transposed) {
      index_t const qrow = static_cast<index_t>(blockIdx.x) * ns_tile + ty, qcol = k0 + tx;  // Q[N, K], element (qrow, qcol)
      qs[tx][ty] = qrow < N && qcol < K ? Q[qrow * K + qcol] : C(0);
    } else {
      qs[ty][tx] = qk < K && col < N ? Q[qk * N + col] : C(0);
    }
    __syncthreads();
    for (int k = 0; k < ns_tile; ++k) acc += ps[ty][k] * qs[k][tx];
    __syncthreads();
  }
  if (row < M && col < N) out[row * N + col] = alpha * acc + (R ? beta * R[row * N + col] : C(0));
}

template <class C, class S>
K3_KERNEL void ns_store_kernel(C const* x, index_t n, bool tr, C post, tensor_view<S, 2, cuda_device_space> o) {
  index_t const rows = o.extent(0), cols = o.extent(1), total = rows * cols;
  for (index_t e = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += static_cast<index_t>(gridDim.x) * blockDim.x) {
    index_t const i = e / cols, j = e % cols;
    o(i, j) = store_as<S>(post * x[tr ? j * n + i : i * n + j]);
  }
}

inline unsigned ns_grid(index_t total, int threads) {
  index_t const g = (total + threads - 1) / threads;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 65535 ? 65535 : g));
}

template <class C, CudaBackend Bk, class T, std::size_t Rank>
void newton_schulz_cuda(Bk const& b, newton_schulz_args<T, Rank, cuda_device_space> const& args, newton_schulz_options const& opt) {
  using S = std::remove_const_t<T>;
  auto const g3 = ns_as_stack(args.g);
  auto const o3 = ns_as_stack(args.o);
  index_t const M = g3.extent(0), A = g3.extent(1), B = g3.extent(2), H = opt.heads, rows = A / H;
  if (M == 0 || rows == 0 || B == 0) return;
  index_t const m = std::min(rows, B), n = std::max(rows, B);
  bool const tr = rows > B;
  C const post = opt.scale == muon_scale::moonlight ? static_cast<C>(moonlight_factor(A, B)) : C(1);
  std::size_t const mn = static_cast<std::size_t>(m * n), mm = static_cast<std::size_t>(m * m);
  C* x = b.template allocate<C>(mn);
  C* y = b.template allocate<C>(mn);
  C* a = b.template allocate<C>(mm);
  C* bm = b.template allocate<C>(mm);
  C* inv = b.template allocate<C>(1);
  int* bad = b.template allocate<int>(1);
  struct release {
    Bk const& b;
    C *x, *y, *a, *bm, *inv;
    int* bad;
    std::size_t mn, mm;
    ~release() {
      b.deallocate(x, mn);
      b.deallocate(y, mn);
      b.deallocate(a, mm);
      b.deallocate(bm, mm);
      b.deallocate(inv, 1);
      b.deallocate(bad, 1);
    }
  } guard{b, x, y, a, bm, inv, bad, mn, mm};
  C const ca = static_cast<C>(opt.a), cb = static_cast<C>(opt.b), cc = static_cast<C>(opt.c);
  dim3 const tile(ns_tile, ns_tile);
  auto tiles = [](index_t r, index_t c) {
    return dim3(static_cast<unsigned>((c + ns_tile - 1) / ns_tile), static_cast<unsigned>((r + ns_tile - 1) / ns_tile));
  };
  for (index_t blk = 0; blk < M * H; ++blk) {
    auto const gb = g3.slice(0, blk / H).sub(0, (blk % H) * rows, rows);
    auto const ob = o3.slice(0, blk / H).sub(0, (blk % H) * rows, rows);
    b.zero_fill(bad, 1);
    index_t const total = rows * B;
    b.launch(dim3(ns_grid(total, 256)), dim3(256), 0, ns_load_kernel<C, S>, tensor_view<S const, 2, cuda_device_space>(gb), x, n, tr, bad);
    b.launch(dim3(1), dim3(ns_reduce_threads), 0, ns_norm_kernel<C>, static_cast<C const*>(x), total, opt.eps, static_cast<int const*>(bad), inv);
    b.launch(dim3(ns_grid(total, 256)), dim3(256), 0, ns_scale_kernel<C>, x, total, static_cast<C const*>(inv));
    for (int s = 0; s < opt.steps; ++s) {
      b.launch(tiles(m, m), tile, 0, ns_gemm_kernel<C>, static_cast<C const*>(x), static_cast<C const*>(x), static_cast<C const*>(nullptr), a, m, m, n,
               true, C(1), C(0));
      b.launch(tiles(m, m), tile, 0, ns_gemm_kernel<C>, static_cast<C const*>(a), static_cast<C const*>(a), static_cast<C const*>(a), bm, m, m, m,
               false, cc, cb);
      b.launch(tiles(m, n), tile, 0, ns_gemm_kernel<C>, static_cast<C const*>(bm), static_cast<C const*>(x), static_cast<C const*>(x), y, m, n, m,
               false, C(1), ca);
      std::swap(x, y);
    }
    b.launch(dim3(ns_grid(total, 256)), dim3(256), 0, ns_store_kernel<C, S>, static_cast<C const*>(x), n, tr, post, ob);
  }
  b.fence();
}

}  // namespace detail

// o = NS5(g) per matrix (and per head block) on the backend's device and stream.
template <CudaBackend Bk, class T, std::size_t Rank>
void newton_schulz(Bk const& b, newton_schulz_args<T, Rank, cuda_device_space> const& args, newton_schulz_options const& opt = {}) {
  if (detail::check_newton_schulz(args, opt))
    detail::newton_schulz_cuda<double>(b, args, opt);
  else
    detail::newton_schulz_cuda<float>(b, args, opt);
}

}  // namespace k3::optim
