// k3/moe/grouped_ffn.cuh — the routed experts on a CUDA backend: k3::moe::grouped_ffn_forward /
// grouped_ffn_backward(cuda_backend, grouped_ffn_args<T, cuda_device_space>{...}, options), the
// same call, contract and results as on the host (k3/moe/grouped_ffn.hpp) up to the products'
// summation order. Include from a .cu file (or a host file built for k3's SIMT runtime).
//
// Grouping: a counting kernel (expert ids checked there), the counts copied to the host, which
// lays out the offsets and the schedule of 16-row tiles of every expert's slots; a placing kernel
// (one block per expert, a block scan over the slots) lists each expert's slots in token order.
// The products are tiled GEMMs (16 x 16 outputs per block, 16-deep panels of both operands in
// shared memory) whose rows are one expert's slots, gathered from the undispatched z or du:
//   forward   [h_g | h_u] = z w_gateᵀ, z w_upᵀ, with p·SiTU in the epilogue;  o = (p a) w_downᵀ;
//             u_t = Σ_j o_(t,j) in slot order
//   backward  q = du w_down; per slot a recomputed from h_g, h_u, dp = <q, a> (a fixed tree),
//             dh = p q ∂a; dz_slot = dh_g w_gate + dh_u w_up, dz_t = Σ_j; and per expert the
//             weight gradients as sums over its slots in list order.
// Every sum has a fixed order, so results do not depend on the launch. Workspace ([S, f] and
// [S, l] panels in the compute type, S = T·k) is allocated per call from the backend.
#pragma once
#include "k3/backend/cuda/config.cuh"
// (config.cuh first: it refuses host compilers)
#include <climits>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "k3/backend/cuda/backend.cuh"
#include "k3/core/concepts.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/moe/grouped_ffn.hpp"
#include "k3/moe/situ.hpp"

namespace k3::moe {

namespace detail {

inline constexpr int gf_tile = 16, gf_threads = 256;

template <class V>
using gf_dview = tensor_view<V, 2, cuda_device_space>;
template <class V>
using gf_dview3 = tensor_view<V, 3, cuda_device_space>;

template <class T>
K3_KERNEL void gf_fill_kernel(T* p, index_t n, T v) {
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += static_cast<index_t>(gridDim.x) * blockDim.x) p[i] = v;
}

template <class C>
K3_KERNEL void gf_zero_kernel(gf_dview3<C> h) {
  index_t const k = h.extent(1), f = h.extent(2), total = h.extent(0) * k * f;
  for (index_t e = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += static_cast<index_t>(gridDim.x) * blockDim.x)
    h(e / (k * f), (e / f) % k, e % f) = C(0);
}

// counts[e] = slots routed to e; the first slot holding an id outside [-1, n) into *bad.
template <class I>
K3_KERNEL void gf_count_kernel(gf_dview<I const> idx, index_t n, int* counts, long long* bad) {
  index_t const k = idx.extent(1), S = idx.extent(0) * k;
  for (index_t s = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < S; s += static_cast<index_t>(gridDim.x) * blockDim.x) {
    I const e = idx(s / k, s % k);
    if (e < -1 || e >= n)
      atomicMin(bad, static_cast<long long>(s));
    else if (e >= 0)
      atomicAdd(counts + e, 1);
  }
}

// Block e lists the slots routed to expert e, in slot order, from list[offs[e]].
template <class I>
K3_KERNEL void gf_place_kernel(gf_dview<I const> idx, index_t const* offs, index_t* list) {
  __shared__ int scan[gf_threads];
  index_t const k = idx.extent(1), S = idx.extent(0) * k, e = blockIdx.x;
  int const tid = static_cast<int>(threadIdx.x);
  index_t base = offs[e];
  for (index_t s0 = 0; s0 < S; s0 += gf_threads) {
    index_t const s = s0 + tid;
    int const mine = s < S && idx(s / k, s % k) == e ? 1 : 0;
    scan[tid] = mine;
    __syncthreads();
    for (int w = 1; w < gf_threads; w *= 2) {  // inclusive Hillis-Steele scan
      int const add = tid >= w ? scan[tid - w] : 0;
      __syncthreads();
      scan[tid] += add;
      __syncthreads();
    }
    if (mine) list[base + scan[tid] - 1] = s;
    base += scan[gf_threads - 1];
    __syncthreads();
  }
}

// Operand rows by slot: a [T, c] view read at the slot's token, or an [S, ld] panel.
template <class C, class V>
struct gf_token_rows {
  gf_dview<V const> v;
  index_t k;
  K3_INLINE C operator()(index_t s, index_t c) const { return load_as<C>(v(s / k, c)); }
};
template <class C>
struct gf_slot_rows {
  C const* p;
  index_t ld;
  K3_INLINE C operator()(index_t s, index_t c) const { return p[s * ld + c]; }
};
// An expert's weight as the right operand, element (kk, cc) of w[e] or of w[e]ᵀ.
template <class C, class V>
struct gf_weight {
  gf_dview3<V const> w;
  bool transposed;
  K3_INLINE C operator()(index_t e, index_t kk, index_t cc) const { return load_as<C>(transposed ? w(e, cc, kk) : w(e, kk, cc)); }
};

// Epilogues: (slot, column, first product, second product).
template <class C, class S>
struct gf_up_epilogue {
  gf_dview<std::int64_t const> idx;
  gf_dview<S const> p;
  gf_dview3<C> hg, hu;
  C* pa;  // [S, f]: p · SiTU
  situ_params<C> sp;
  K3_INLINE void operator()(index_t s, index_t c, C g, C u) const {
    index_t const k = idx.extent(1), f = hg.extent(2);
    hg(s / k, s % k, c) = g;
    hu(s / k, s % k, c) = u;
    pa[s * f + c] = load_as<C>(p(s / k, s % k)) * situ_glu(g, u, sp);
  }
};
template <class C>
struct gf_store_epilogue {
  C* out;
  index_t ld;
  K3_INLINE void operator()(index_t s, index_t c, C a, C b) const { out[s * ld + c] = a + b; }
};

// For the tile (expert, first row) of blockIdx.x and the 16 columns of blockIdx.y:
// epi(s, c, Σ_kk A1(s, kk) W1(e, kk, c), Σ_kk A2(s, kk) W2(e, kk, c)), kk over [0, K).
template <class C, class A1, class W1, class A2, class W2, class Epi>
K3_KERNEL void gf_rows_gemm_kernel(index_t const* tiles, index_t const* offs, index_t const* list, A1 a1, W1 w1, A2 a2, W2 w2, bool two,
                                   index_t K, index_t N, Epi epi) {
  __shared__ C as1[gf_tile][gf_tile + 1];
  __shared__ C ws1[gf_tile][gf_tile + 1];
  __shared__ C as2[gf_tile][gf_tile + 1];
  __shared__ C ws2[gf_tile][gf_tile + 1];
  int const tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  index_t const e = tiles[2 * blockIdx.x], r = tiles[2 * blockIdx.x + 1] + ty;
  index_t const rows = offs[e + 1] - offs[e], c0 = static_cast<index_t>(blockIdx.y) * gf_tile, c = c0 + tx;
  bool const row_ok = r < rows;
  index_t const s = row_ok ? list[offs[e] + r] : 0;
  C acc1 = 0, acc2 = 0;
  for (index_t k0 = 0; k0 < K; k0 += gf_tile) {
    bool const ka = k0 + tx < K, kw = k0 + ty < K && c < N;
    as1[ty][tx] = row_ok && ka ? a1(s, k0 + tx) : C(0);
    ws1[ty][tx] = kw ? w1(e, k0 + ty, c) : C(0);
    if (two) {
      as2[ty][tx] = row_ok && ka ? a2(s, k0 + tx) : C(0);
      ws2[ty][tx] = kw ? w2(e, k0 + ty, c) : C(0);
    }
    __syncthreads();
    for (int kk = 0; kk < gf_tile; ++kk) acc1 += as1[ty][kk] * ws1[kk][tx];
    if (two)
      for (int kk = 0; kk < gf_tile; ++kk) acc2 += as2[ty][kk] * ws2[kk][tx];
    __syncthreads();
  }
  if (row_ok && c < N) epi(s, c, acc1, acc2);
}

// out[t, c] = Σ_j panel[(t, j), c] over the slots that have an expert, j in order.
template <class C, class S>
K3_KERNEL void gf_combine_kernel(gf_dview<std::int64_t const> idx, C const* panel, gf_dview<S> out) {
  index_t const k = idx.extent(1), n = out.extent(1), total = out.extent(0) * n;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    index_t const t = i / n, c = i % n;
    C acc = 0;
    for (index_t j = 0; j < k; ++j)
      if (idx(t, j) >= 0) acc += panel[(t * k + j) * n + c];
    out(t, c) = store_as<S>(acc);
  }
}

// Per slot (one block each): a and its partials from h_g, h_u; dp = <q, a> by a fixed tree;
// dh_g = p q ∂a/∂g, dh_u = p q ∂a/∂u, pa = p a (in place of q's panel neighbours).
template <class C, class S>
K3_KERNEL void gf_act_grad_kernel(gf_dview<std::int64_t const> idx, gf_dview<S const> p, gf_dview3<C const> hg, gf_dview3<C const> hu,
                                  C const* q, situ_params<C> sp, C* dhg, C* dhu, C* pa, gf_dview<S> dp, bool want_dp) {
  __shared__ C red[gf_threads];
  index_t const k = idx.extent(1), f = hg.extent(2), S_ = idx.extent(0) * k;
  int const tid = static_cast<int>(threadIdx.x);
  for (index_t s = blockIdx.x; s < S_; s += gridDim.x) {
    index_t const t = s / k, j = s % k;
    if (idx(t, j) < 0) {  // uniform across the block
      if (tid == 0 && want_dp) dp(t, j) = store_as<S>(C(0));
      continue;
    }
    C const pw = load_as<C>(p(t, j));
    C part = 0;
    for (index_t c = tid; c < f; c += gf_threads) {
      situ_partials<C> const a = situ_glu_partials(hg(t, j, c), hu(t, j, c), sp);
      C const qc = q[s * f + c];
      part += qc * a.value;
      dhg[s * f + c] = pw * qc * a.d_gate;
      dhu[s * f + c] = pw * qc * a.d_up;
      pa[s * f + c] = pw * a.value;
    }
    red[tid] = part;
    __syncthreads();
    for (int w = gf_threads / 2; w > 0; w /= 2) {
      if (tid < w) red[tid] += red[tid + w];
      __syncthreads();
    }
    if (tid == 0 && want_dp) dp(t, j) = store_as<S>(red[0]);
    __syncthreads();
  }
}

// Expert blockIdx.z's weight gradient: out[e](i, c) = Σ_r L(s_r, i) R(s_r, c) over its slots in
// list order, [R_rows, R_cols] tiled by blockIdx.y, blockIdx.x; zeros for an expert without slots.
template <class C, class L, class R, class S>
K3_KERNEL void gf_wgrad_kernel(index_t const* offs, index_t const* list, L lhs, R rhs, gf_dview3<S> out) {
  __shared__ C ls[gf_tile][gf_tile + 1];
  __shared__ C rs[gf_tile][gf_tile + 1];
  int const tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  index_t const e = blockIdx.z, i0 = static_cast<index_t>(blockIdx.y) * gf_tile, c0 = static_cast<index_t>(blockIdx.x) * gf_tile;
  index_t const rows = out.extent(1), cols = out.extent(2), r0 = offs[e], ne = offs[e + 1] - r0;
  C acc = 0;
  for (index_t b = 0; b < ne; b += gf_tile) {
    // Thread (ty, tx) loads slot b + ty: its column i0 + tx of L and c0 + tx of R.
    bool const ok = b + ty < ne;
    index_t const s = ok ? list[r0 + b + ty] : 0;
    ls[ty][tx] = ok && i0 + tx < rows ? lhs(s, i0 + tx) : C(0);
    rs[ty][tx] = ok && c0 + tx < cols ? rhs(s, c0 + tx) : C(0);
    __syncthreads();
    for (int rr = 0; rr < gf_tile; ++rr) acc += ls[rr][ty] * rs[rr][tx];
    __syncthreads();
  }
  if (i0 + ty < rows && c0 + tx < cols) out(e, i0 + ty, c0 + tx) = store_as<S>(acc);
}

inline unsigned gf_grid(index_t total, int threads) {
  index_t const g = (total + threads - 1) / threads;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 65535 ? 65535 : g));
}

// Device memory from the backend for one call.
template <class T, class Bk>
class gf_buffer {
 public:
  gf_buffer(Bk const& b, std::size_t n) : b_(b), n_(n ? n : 1), p_(b.template allocate<T>(n_)) {}
  gf_buffer(gf_buffer const&) = delete;
  gf_buffer& operator=(gf_buffer const&) = delete;
  ~gf_buffer() { b_.deallocate(p_, n_); }
  T* get() const noexcept { return p_; }

 private:
  Bk const& b_;
  std::size_t n_;
  T* p_;
};

// The slots grouped by expert on the device, and the host's schedule of 16-row tiles (at most
// S / 16 + n of them).
template <class Bk>
struct gf_device_grouping {
  gf_device_grouping(Bk const& b, index_t n, index_t S)
      : offs(b, static_cast<std::size_t>(n + 1)), list(b, static_cast<std::size_t>(S)), tiles(b, static_cast<std::size_t>(2 * (S / gf_tile + n))) {}
  gf_buffer<index_t, Bk> offs, list, tiles;
  index_t tile_count = 0;
};

template <class Bk>
void gf_group_device(Bk const& b, gf_dview<std::int64_t const> idx, index_t n, gf_device_grouping<Bk>& g) {
  index_t const T_ = idx.extent(0), k = idx.extent(1), S = T_ * k;
  gf_buffer<int, Bk> counts(b, static_cast<std::size_t>(n));
  gf_buffer<long long, Bk> bad(b, 1);
  b.zero_fill(counts.get(), static_cast<std::size_t>(n));
  b.launch(dim3(1), dim3(1), 0, gf_fill_kernel<long long>, bad.get(), index_t(1), static_cast<long long>(LLONG_MAX));
  if (S > 0) b.launch(dim3(gf_grid(S, gf_threads)), dim3(gf_threads), 0, gf_count_kernel<std::int64_t>, idx, n, counts.get(), bad.get());
  std::vector<int> hc(static_cast<std::size_t>(n));
  long long hbad = 0;
  b.copy(tensor_view<int const, 1, cuda_device_space>(counts.get(), {n}), tensor_view<int, 1>(hc.data(), {n}));
  b.copy(tensor_view<long long const, 1, cuda_device_space>(bad.get(), {1}), tensor_view<long long, 1>(&hbad, {1}));
  if (hbad != LLONG_MAX) {
    index_t const t = hbad / k, j = hbad % k;
    std::int64_t e = 0;
    b.copy(tensor_view<std::int64_t const, 1, cuda_device_space>(idx.data_handle() + t * idx.stride(0) + j * idx.stride(1), {1}),
           tensor_view<std::int64_t, 1>(&e, {1}));
    throw ::k3::error(error_kind::value, gf_bad_index(t, j, e, n));
  }
  std::vector<index_t> ho(static_cast<std::size_t>(n + 1), 0), ht;
  for (index_t e = 0; e < n; ++e) {
    ho[static_cast<std::size_t>(e + 1)] = ho[static_cast<std::size_t>(e)] + hc[static_cast<std::size_t>(e)];
    for (index_t r = 0; r < hc[static_cast<std::size_t>(e)]; r += gf_tile) {
      ht.push_back(e);
      ht.push_back(r);
    }
  }
  g.tile_count = static_cast<index_t>(ht.size() / 2);
  b.copy(tensor_view<index_t const, 1>(ho.data(), {n + 1}), tensor_view<index_t, 1, cuda_device_space>(g.offs.get(), {n + 1}));
  if (g.tile_count > 0)
    b.copy(tensor_view<index_t const, 1>(ht.data(), {2 * g.tile_count}), tensor_view<index_t, 1, cuda_device_space>(g.tiles.get(), {2 * g.tile_count}));
  if (n > 0 && S > 0)
    b.launch(dim3(static_cast<unsigned>(n)), dim3(gf_threads), 0, gf_place_kernel<std::int64_t>, idx, static_cast<index_t const*>(g.offs.get()), g.list.get());
}

inline dim3 gf_row_tiles(index_t tiles, index_t cols) {
  return dim3(static_cast<unsigned>(tiles), static_cast<unsigned>((cols + gf_tile - 1) / gf_tile));
}

}  // namespace detail

template <CudaBackend Bk, class T>
void grouped_ffn_forward(Bk const& b, grouped_ffn_args<T, cuda_device_space> const& a, grouped_ffn_options const& o = {}) {
  using C = k3::accumulation_t<T>;
  using S = std::remove_const_t<T>;
  namespace d = detail;
  d::gf_dims const m = d::check_grouped_ffn(a, o, false);
  d::check_grouped_ffn_forward_outputs(a);
  index_t const slots = m.T * m.k;
  d::gf_device_grouping<Bk> g(b, m.n, slots);
  d::gf_group_device(b, a.indices, m.n, g);
  if (m.T == 0) return;
  std::size_t const sf = static_cast<std::size_t>(slots * m.f), tkf = static_cast<std::size_t>(m.T * m.k * m.f);
  bool const keep = k3::present(a.h_gate);
  d::gf_buffer<C, Bk> own_g(b, keep ? 0 : tkf), own_u(b, keep ? 0 : tkf), pa(b, sf), out(b, static_cast<std::size_t>(slots * m.l));
  d::gf_dview3<C> const hg = keep ? a.h_gate : d::gf_dview3<C>(own_g.get(), {m.T, m.k, m.f});
  d::gf_dview3<C> const hu = keep ? a.h_up : d::gf_dview3<C>(own_u.get(), {m.T, m.k, m.f});
  if (tkf > 0) {
    b.launch(dim3(d::gf_grid(static_cast<index_t>(tkf), d::gf_threads)), dim3(d::gf_threads), 0, d::gf_zero_kernel<C>, hg);
    b.launch(dim3(d::gf_grid(static_cast<index_t>(tkf), d::gf_threads)), dim3(d::gf_threads), 0, d::gf_zero_kernel<C>, hu);
  }
  dim3 const tile(d::gf_tile, d::gf_tile);
  if (g.tile_count > 0 && m.f > 0) {
    using A = d::gf_token_rows<C, S>;
    using W = d::gf_weight<C, S>;
    situ_params<C> const sp{static_cast<C>(o.beta_gate), static_cast<C>(o.beta_up)};
    b.launch(d::gf_row_tiles(g.tile_count, m.f), tile, 0, d::gf_rows_gemm_kernel<C, A, W, A, W, d::gf_up_epilogue<C, S>>,
             static_cast<index_t const*>(g.tiles.get()), static_cast<index_t const*>(g.offs.get()), static_cast<index_t const*>(g.list.get()),
             A{a.z, m.k}, W{a.w_gate, true}, A{a.z, m.k}, W{a.w_up, true}, true, m.l, m.f,
             d::gf_up_epilogue<C, S>{a.indices, a.weights, hg, hu, pa.get(), sp});
  }
  if (g.tile_count > 0 && m.l > 0) {
    using A = d::gf_slot_rows<C>;
    using W = d::gf_weight<C, S>;
    if (m.f > 0)
      b.launch(d::gf_row_tiles(g.tile_count, m.l), tile, 0, d::gf_rows_gemm_kernel<C, A, W, A, W, d::gf_store_epilogue<C>>,
               static_cast<index_t const*>(g.tiles.get()), static_cast<index_t const*>(g.offs.get()), static_cast<index_t const*>(g.list.get()),
               A{pa.get(), m.f}, W{a.w_down, true}, A{pa.get(), m.f}, W{a.w_down, true}, false, m.f, m.l, d::gf_store_epilogue<C>{out.get(), m.l});
    else  // no hidden units: every expert's output is 0
      b.zero_fill(out.get(), static_cast<std::size_t>(slots * m.l));
  }
  b.launch(dim3(d::gf_grid(m.T * m.l, d::gf_threads)), dim3(d::gf_threads), 0, d::gf_combine_kernel<C, S>, a.indices,
           static_cast<C const*>(out.get()), a.u);
  b.fence();
}

template <CudaBackend Bk, class T>
void grouped_ffn_backward(Bk const& b, grouped_ffn_backward_args<T, cuda_device_space> const& args, grouped_ffn_options const& o = {}) {
  auto const& a = args.forward;
  auto const& gr = args.gradients;
  using C = k3::accumulation_t<T>;
  using S = std::remove_const_t<T>;
  namespace d = detail;
  d::gf_dims const m = d::check_grouped_ffn(a, gr, o);
  index_t const slots = m.T * m.k;
  d::gf_device_grouping<Bk> g(b, m.n, slots);
  d::gf_group_device(b, a.indices, m.n, g);
  std::size_t const sf = static_cast<std::size_t>(slots * m.f), sl = static_cast<std::size_t>(slots * m.l);
  d::gf_buffer<C, Bk> q(b, sf), dhg(b, sf), dhu(b, sf), pa(b, sf), dzs(b, sl);
  dim3 const tile(d::gf_tile, d::gf_tile);
  using TR = d::gf_token_rows<C, S>;
  using SR = d::gf_slot_rows<C>;
  using W = d::gf_weight<C, S>;
  if (m.l == 0 && sf > 0) b.zero_fill(q.get(), sf);  // du w_down over no latent unit
  if (g.tile_count > 0 && m.f > 0 && m.l > 0)  // q = du w_down
    b.launch(d::gf_row_tiles(g.tile_count, m.f), tile, 0, d::gf_rows_gemm_kernel<C, TR, W, TR, W, d::gf_store_epilogue<C>>,
             static_cast<index_t const*>(g.tiles.get()), static_cast<index_t const*>(g.offs.get()), static_cast<index_t const*>(g.list.get()),
             TR{gr.du, m.k}, W{a.w_down, false}, TR{gr.du, m.k}, W{a.w_down, false}, false, m.l, m.f, d::gf_store_epilogue<C>{q.get(), m.f});
  bool const want_dp = k3::present(gr.d_weights);
  if (slots > 0)
    b.launch(dim3(d::gf_grid(slots, 1)), dim3(d::gf_threads), 0, d::gf_act_grad_kernel<C, S>, a.indices, a.weights,
             d::gf_dview3<C const>(a.h_gate), d::gf_dview3<C const>(a.h_up), static_cast<C const*>(q.get()),
             situ_params<C>{static_cast<C>(o.beta_gate), static_cast<C>(o.beta_up)}, dhg.get(), dhu.get(), pa.get(), gr.d_weights, want_dp);
  if (k3::present(gr.dz) && m.T > 0 && m.l > 0) {
    if (m.f == 0) b.zero_fill(dzs.get(), sl);  // no hidden unit: dz = 0
    if (g.tile_count > 0 && m.f > 0)  // dz per slot = dh_g w_gate + dh_u w_up
      b.launch(d::gf_row_tiles(g.tile_count, m.l), tile, 0, d::gf_rows_gemm_kernel<C, SR, W, SR, W, d::gf_store_epilogue<C>>,
               static_cast<index_t const*>(g.tiles.get()), static_cast<index_t const*>(g.offs.get()), static_cast<index_t const*>(g.list.get()),
               SR{dhg.get(), m.f}, W{a.w_gate, false}, SR{dhu.get(), m.f}, W{a.w_up, false}, true, m.f, m.l, d::gf_store_epilogue<C>{dzs.get(), m.l});
    b.launch(dim3(d::gf_grid(m.T * m.l, d::gf_threads)), dim3(d::gf_threads), 0, d::gf_combine_kernel<C, S>, a.indices,
             static_cast<C const*>(dzs.get()), gr.dz);
  }
  auto wgrad = [&](auto lhs, auto rhs, d::gf_dview3<S> const& out) {
    if (!k3::present(out) || out.size() == 0) return;
    dim3 const grid(static_cast<unsigned>((out.extent(2) + d::gf_tile - 1) / d::gf_tile), static_cast<unsigned>((out.extent(1) + d::gf_tile - 1) / d::gf_tile),
                    static_cast<unsigned>(m.n));
    b.launch(grid, tile, 0, d::gf_wgrad_kernel<C, decltype(lhs), decltype(rhs), S>, static_cast<index_t const*>(g.offs.get()),
             static_cast<index_t const*>(g.list.get()), lhs, rhs, out);
  };
  wgrad(TR{gr.du, m.k}, SR{pa.get(), m.f}, gr.dw_down);   // Σ du_t (p a_s)ᵀ
  wgrad(SR{dhg.get(), m.f}, TR{a.z, m.k}, gr.dw_gate);    // Σ dh_g z_tᵀ
  wgrad(SR{dhu.get(), m.f}, TR{a.z, m.k}, gr.dw_up);
  b.fence();
}

}  // namespace k3::moe
