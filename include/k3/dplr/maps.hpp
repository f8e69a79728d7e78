// k3/dplr/maps.hpp — segment transfer maps. A span of tokens acts on the state entering it as
// an affine map S_out = M S_in + N (M: K x K, the product of the per-token transitions with
// later tokens on the left; N: K x V, the state the span produces from zero). The maps are
// computed chunk-wise from the same WY quantities as the chunked forward, by running the
// homogeneous recurrence on the augmented state [M | N] from [I | 0] with values [0 | V].
// Composition (M2, N2) o (M1, N1) = (M2 M1, M2 N1 + N2) is associative, so a prefix scan over
// segments gives every segment's initial state. The backward uses the transposed map:
// dS_in = M^T dS_out + G, with G the state gradient the span's own outputs send back.
// Maps are kept in float for float inputs (fp32 chain, as fla's KCP recommends) and in
// double for double inputs.
#pragma once
#include <type_traits>

#include "k3/dplr/chunked.hpp"

namespace k3::dplr {

// The span's tokens (q k a b gk [B,T,H,K], v [B,T,H,V]; no h0: a map does not depend on the
// state entering the span) and the map's outputs M [N,H,K,K], N [N,H,K,V].
template <class T>
struct maps_args {
  const_view<T, 4> q = {}, k = {}, v = {}, a = {}, b = {}, gk = {};
  tensor_view<state_t<T>, 4> M = {}, N = {};
};

// The span's tokens and the gradient of its outputs d_o [B,T,H,V]; outputs Mt [N,H,K,K] and
// G [N,H,K,V] with dS_in = Mt dS_out + G.
template <class T>
struct transposed_maps_args {
  const_view<T, 4> q = {}, k = {}, v = {}, a = {}, b = {}, gk = {};
  const_view<T, 4> d_o = {};
  tensor_view<state_t<T>, 4> Mt = {}, G = {};
};

// (M, N) = (M2, N2) o (M1, N1): span 1 first, then span 2. S is the state type.
template <class S>
struct compose_args {
  const_view<S, 4> M2 = {}, N2 = {}, M1 = {}, N1 = {};
  tensor_view<S, 4> M = {}, N = {};
};

// S_out = M S_in + N.
template <class S>
struct apply_args {
  const_view<S, 4> M = {}, N = {}, S_in = {};
  tensor_view<S, 4> S_out = {};
};

}  // namespace k3::dplr

namespace k3 {
namespace detail::dplr {
// The maps of an early (sequence, head) are stored while later ones still read the span (and
// `do`, for the transposed maps): neither map broadcast, over those inputs or over the other.
template <class T, class S, class Do = const_view<T, 4>>
void check_maps(problem const& p, inputs<T> const& in, tensor_view<S, 4> const& M, char const* mname, tensor_view<S, 4> const& N,
                char const* nname, Do const& d_o = {}) {
  check_view(mname, M);
  check_shape(mname, M, {p.N, p.H, p.K, p.K});
  check_view(nname, N);
  check_shape(nname, N, {p.N, p.H, p.K, p.V});
  ::k3::detail::check_outputs_apart(
      [&](auto&& f) {
        f(mname, M);
        f(nname, N);
      },
      [&](auto&& f) {
        for_each_input(in, f, false);
        f("do", d_o);
      });
}

template <class S>
void check_same(char const* name, const_view<S, 4> const& x, index_t N, index_t H, index_t r, index_t c) {
  check_view(name, x);
  check_shape(name, x, {N, H, r, c});
}
}  // namespace detail::dplr
}  // namespace k3

namespace k3::dplr {

// For every sequence and head of the span: S_out = M S_in + N. Runs on `be` as the chunked
// forward does (options::mode is not read: a map has only the chunked form).
template <HostBackend B, class T>
void segment_maps(B const& be, maps_args<T> const& x, options const& opt = {}) {
  using R = state_t<T>;
  namespace d = ::k3::detail::dplr;
  d::inputs<T> const in{x.q, x.k, x.v, x.a, x.b, x.gk, {}};
  auto p = d::make_problem(in, opt);
  d::check_maps(p, in, x.M, "M", x.N, "N");
  d::head_cfg<R> cfg{R(p.scale), p.chunk, opt.intra, p.K, p.V};
  k3::detail::subnormals_flushed const flush;  // chunk forms: see k3/core/float_env.hpp
  auto par = d::make_par(be);
  auto one = [&](auto const& ex, index_t task) {
    index_t n = task / p.H, h = task % p.H;
    d::mat<R> MN;
    d::head_map<T, R>(ex, d::head_of(in, p.seqs[n], h), cfg, MN);
    for (index_t i = 0; i < p.K; ++i) {
      for (index_t j = 0; j < p.K; ++j) x.M(n, h, i, j) = MN(i, j);
      for (index_t j = 0; j < p.V; ++j) x.N(n, h, i, j) = MN(i, p.K + j);
    }
  };
  d::for_each_head(par, p.N * p.H, one);
}

// Transposed maps of the span: dS_in = Mt dS_out + G(d_o), Mt = M^T.
template <HostBackend B, class T>
void segment_maps_transposed(B const& be, transposed_maps_args<T> const& x, options const& opt = {}) {
  using R = state_t<T>;
  namespace d = ::k3::detail::dplr;
  d::inputs<T> const in{x.q, x.k, x.v, x.a, x.b, x.gk, {}};
  auto p = d::make_problem(in, opt);
  k3::detail::check_view("do", x.d_o);
  k3::detail::check_shape("do", x.d_o, {p.B, p.T, p.H, p.V});
  k3::detail::check_inner_contiguous("do", x.d_o);
  d::check_maps(p, in, x.Mt, "Mt", x.G, "G", x.d_o);
  d::head_cfg<R> cfg{R(p.scale), p.chunk, opt.intra, p.K, p.V};
  k3::detail::subnormals_flushed const flush;  // chunk forms: see k3/core/float_env.hpp
  auto par = d::make_par(be);
  auto one = [&](auto const& ex, index_t task) {
    index_t n = task / p.H, h = task % p.H;
    d::mat<R> MtG;
    d::head_map_transposed<T, R>(ex, d::head_of(in, p.seqs[n], h), cfg, d::head_slice<T>(x.d_o, p.seqs[n], h), MtG);
    for (index_t i = 0; i < p.K; ++i) {
      for (index_t j = 0; j < p.K; ++j) x.Mt(n, h, i, j) = MtG(i, j);
      for (index_t j = 0; j < p.V; ++j) x.G(n, h, i, j) = MtG(i, p.K + j);
    }
  };
  d::for_each_head(par, p.N * p.H, one);
}

// (M, N) = (M2 M1, M2 N1 + N2). Outputs may not alias inputs. A small product: it runs on the
// calling thread whatever the backend, and reads no option (the call shape is the same as
// for every DPLR op).
template <HostBackend B, class S>
void compose_maps(B const&, compose_args<S> const& x, options const& = {}) {
  namespace d = ::k3::detail::dplr;
  auto const &M2 = x.M2, &N2 = x.N2, &M1 = x.M1, &N1 = x.N1;
  auto const &M = x.M, &N = x.N;
  k3::detail::check_view("M2", M2);
  index_t const Nn = M2.extent(0), H = M2.extent(1), K = M2.extent(2);
  k3::detail::check_shape("M2", M2, {Nn, H, K, K});
  k3::detail::check_view("N2", N2);
  index_t const V = N2.extent(3);
  d::check_same("N2", N2, Nn, H, K, V);
  d::check_same("M1", M1, Nn, H, K, K);
  d::check_same("N1", N1, Nn, H, K, V);
  d::check_same<S>("M", M, Nn, H, K, K);
  d::check_same<S>("N", N, Nn, H, K, V);
  k3::detail::check_outputs_apart(::k3::detail::named_views("M", M, "N", N),
                                  ::k3::detail::named_views("M2", M2, "N2", N2, "M1", M1, "N1", N1));
  for (index_t n = 0; n < Nn; ++n)
    for (index_t h = 0; h < H; ++h)
      for (index_t i = 0; i < K; ++i) {
        for (index_t j = 0; j < K; ++j) {
          S s = 0;
          for (index_t m = 0; m < K; ++m) s += M2(n, h, i, m) * M1(n, h, m, j);
          M(n, h, i, j) = s;
        }
        for (index_t j = 0; j < V; ++j) {
          S s = N2(n, h, i, j);
          for (index_t m = 0; m < K; ++m) s += M2(n, h, i, m) * N1(n, h, m, j);
          N(n, h, i, j) = s;
        }
      }
}

// S_out = M S_in + N (S_out may not alias S_in or M; it may be N itself, in place). Runs on
// the calling thread and reads no option, as compose_maps.
template <HostBackend B, class S>
void apply_map(B const&, apply_args<S> const& x, options const& = {}) {
  namespace d = ::k3::detail::dplr;
  auto const &M = x.M, &N = x.N, &S_in = x.S_in;
  auto const& S_out = x.S_out;
  k3::detail::check_view("M", M);
  index_t const Nn = M.extent(0), H = M.extent(1), K = M.extent(2);
  k3::detail::check_shape("M", M, {Nn, H, K, K});
  k3::detail::check_view("N", N);
  index_t const V = N.extent(3);
  d::check_same("N", N, Nn, H, K, V);
  d::check_same("S_in", S_in, Nn, H, K, V);
  d::check_same<S>("S_out", S_out, Nn, H, K, V);
  // S_out may be N itself (each N element is read once, just before its S_out element is
  // written); any other overlap with N is refused.
  bool const in_place = static_cast<void const*>(S_out.data_handle()) == static_cast<void const*>(N.data_handle()) &&
                        S_out.extents() == N.extents() && S_out.strides() == N.strides();
  k3::detail::check_outputs_apart([&](auto&& f) { f("S_out", S_out); },
                                  [&](auto&& f) {
                                    f("S_in", S_in);
                                    f("M", M);
                                    if (!in_place) f("N", N);
                                  });
  for (index_t n = 0; n < Nn; ++n)
    for (index_t h = 0; h < H; ++h)
      for (index_t i = 0; i < K; ++i)
        for (index_t j = 0; j < V; ++j) {
          S s = N(n, h, i, j);
          for (index_t m = 0; m < K; ++m) s += M(n, h, i, m) * S_in(n, h, m, j);
          S_out(n, h, i, j) = s;
        }
}

}  // namespace k3::dplr
