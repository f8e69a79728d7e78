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

namespace k3 {
namespace detail::dplr {
// The maps of an early (sequence, head) are stored while later ones still read the span (and
// `do`, for the transposed maps): neither map broadcast, over those inputs or over the other.
// h0 is not read.
template <class T, class S, class Do = const_view<T, 4>>
void check_maps(problem const& p, dplr_inputs<T> const& in, tensor_view<S, 4> const& M, char const* mname, tensor_view<S, 4> const& N,
                char const* nname, Do const& do_ = {}) {
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
        f("do", do_);
      });
}
}  // namespace detail::dplr

// For every sequence and head of `in` (the span; h0 is ignored, whatever its shape): S_out = M S_in + N.
template <class T, class Bk = cpu::serial>
void dplr_segment_maps(dplr_inputs<T> const& in, tensor_view<dplr_state_t<T>, 4> const& M, tensor_view<dplr_state_t<T>, 4> const& N,
                       dplr_options const& opt = {}, Bk const& bk = {}) {
  using R = dplr_state_t<T>;
  namespace d = detail::dplr;
  dplr_inputs<T> span = in;
  span.h0 = {};  // not read, so not checked either
  auto p = d::make_problem(span, opt);
  d::check_maps(p, in, M, "M", N, "N");
  d::head_cfg<R> cfg{R(p.scale), p.chunk, opt.intra, p.K, p.V};
  k3::detail::subnormals_flushed const flush;  // chunk forms: see k3/core/float_env.hpp
  auto par = d::make_par(bk);
  auto one = [&](auto const& ex, index_t task) {
    index_t n = task / p.H, h = task % p.H;
    d::mat<R> MN;
    d::head_map<T, R>(ex, d::head_of(in, p.seqs[n], h), cfg, MN);
    for (index_t i = 0; i < p.K; ++i) {
      for (index_t j = 0; j < p.K; ++j) M(n, h, i, j) = MN(i, j);
      for (index_t j = 0; j < p.V; ++j) N(n, h, i, j) = MN(i, p.K + j);
    }
  };
  d::for_each_head(par, p.N * p.H, one);
}

// Transposed maps of the span: dS_in = Mt dS_out + G(do), Mt = M^T.
template <class T, class Bk = cpu::serial>
void dplr_segment_maps_transposed(dplr_inputs<T> const& in, std::type_identity_t<const_view<T, 4>> const& do_, tensor_view<dplr_state_t<T>, 4> const& Mt,
                                  tensor_view<dplr_state_t<T>, 4> const& G, dplr_options const& opt = {}, Bk const& bk = {}) {
  using R = dplr_state_t<T>;
  namespace d = detail::dplr;
  dplr_inputs<T> span = in;
  span.h0 = {};  // not read, so not checked either
  auto p = d::make_problem(span, opt);
  detail::check_view("do", do_);
  detail::check_shape("do", do_, {p.B, p.T, p.H, p.V});
  detail::check_inner_contiguous("do", do_);
  d::check_maps(p, in, Mt, "Mt", G, "G", do_);
  d::head_cfg<R> cfg{R(p.scale), p.chunk, opt.intra, p.K, p.V};
  k3::detail::subnormals_flushed const flush;  // chunk forms: see k3/core/float_env.hpp
  auto par = d::make_par(bk);
  auto one = [&](auto const& ex, index_t task) {
    index_t n = task / p.H, h = task % p.H;
    d::mat<R> MtG;
    d::head_map_transposed<T, R>(ex, d::head_of(in, p.seqs[n], h), cfg, d::head_slice<T>(do_, p.seqs[n], h), MtG);
    for (index_t i = 0; i < p.K; ++i) {
      for (index_t j = 0; j < p.K; ++j) Mt(n, h, i, j) = MtG(i, j);
      for (index_t j = 0; j < p.V; ++j) G(n, h, i, j) = MtG(i, p.K + j);
    }
  };
  d::for_each_head(par, p.N * p.H, one);
}

namespace detail::dplr {
template <class S>
void check_same(char const* name, const_view<S, 4> const& x, index_t N, index_t H, index_t r, index_t c) {
  check_view(name, x);
  check_shape(name, x, {N, H, r, c});
}
}  // namespace detail::dplr

// (M, N) = (M2, N2) o (M1, N1) = (M2 M1, M2 N1 + N2): span 1 first, then span 2.
// Outputs may not alias inputs.
template <class S>
void dplr_compose_maps(const_view<S, 4> const& M2, const_view<S, 4> const& N2, const_view<S, 4> const& M1, const_view<S, 4> const& N1,
                       tensor_view<S, 4> const& M, tensor_view<S, 4> const& N) {
  detail::check_view("M2", M2);
  index_t const Nn = M2.extent(0), H = M2.extent(1), K = M2.extent(2);
  detail::check_shape("M2", M2, {Nn, H, K, K});
  detail::check_view("N2", N2);
  index_t const V = N2.extent(3);
  detail::dplr::check_same("N2", N2, Nn, H, K, V);
  detail::dplr::check_same("M1", M1, Nn, H, K, K);
  detail::dplr::check_same("N1", N1, Nn, H, K, V);
  detail::dplr::check_same<S>("M", M, Nn, H, K, K);
  detail::dplr::check_same<S>("N", N, Nn, H, K, V);
  detail::check_outputs_apart(
      [&](auto&& f) {
        f("M", M);
        f("N", N);
      },
      [&](auto&& f) {
        f("M2", M2);
        f("N2", N2);
        f("M1", M1);
        f("N1", N1);
      });
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

// S_out = M S_in + N (S_out may not alias S_in or M; it may be N itself, in place).
template <class S>
void dplr_apply_map(const_view<S, 4> const& M, const_view<S, 4> const& N, const_view<S, 4> const& S_in, tensor_view<S, 4> const& S_out) {
  detail::check_view("M", M);
  index_t const Nn = M.extent(0), H = M.extent(1), K = M.extent(2);
  detail::check_shape("M", M, {Nn, H, K, K});
  detail::check_view("N", N);
  index_t const V = N.extent(3);
  detail::dplr::check_same("N", N, Nn, H, K, V);
  detail::dplr::check_same("S_in", S_in, Nn, H, K, V);
  detail::dplr::check_same<S>("S_out", S_out, Nn, H, K, V);
  // S_out may be N itself (each N element is read once, just before its S_out element is
  // written); any other overlap with N is refused.
  bool const in_place = static_cast<void const*>(S_out.data_handle()) == static_cast<void const*>(N.data_handle()) &&
                        S_out.extents() == N.extents() && S_out.strides() == N.strides();
  detail::check_outputs_apart([&](auto&& f) { f("S_out", S_out); },
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

}  // namespace k3
