// k3/dplr/iplr.hpp — IPLR: DPLR with the identity as the diagonal (gk = 0),
//   S_t = (I + b_t a_t^T) S_{t-1} + k_t v_t^T.
// Implemented as DPLR with a broadcast zero gate, so every DPLR path applies unchanged.
#pragma once
#include <vector>

#include "k3/dplr/chunked.hpp"

namespace k3 {

template <class T>
struct iplr_inputs {
  const_view<T, 4> q, k, v, a, b;
  const_view<dplr_state_t<T>, 4> h0;
};

template <class T>
struct iplr_grads {
  tensor_view<T, 4> dq, dk, dv, da, db;
  tensor_view<dplr_state_t<T>, 4> dh0;
};

namespace detail::dplr {
// A [B,T,H,K] view of zeros backed by K elements (zero strides on the leading dimensions).
template <class T>
const_view<T, 4> zero_gate(const_view<T, 4> const& like, std::vector<T>& store) {
  store.assign(static_cast<std::size_t>(std::max<index_t>(like.extent(3), 1)), T(0));
  return const_view<T, 4>(store.data(), {like.extent(0), like.extent(1), like.extent(2), like.extent(3)}, {0, 0, 0, 1});
}
}  // namespace detail::dplr

template <class T, class Bk>
void iplr_chunked_forward(Bk const& bk, iplr_inputs<T> const& in, dplr_outputs<T> const& out, dplr_options const& opt = {}) {
  std::vector<T> z;
  dplr_chunked_forward(bk, dplr_inputs<T>{in.q, in.k, in.v, in.a, in.b, detail::dplr::zero_gate(in.q, z), in.h0}, out, opt);
}

template <class T>
void iplr_recurrent_forward(iplr_inputs<T> const& in, dplr_outputs<T> const& out, dplr_options const& opt = {}) {
  std::vector<T> z;
  dplr_recurrent_forward(dplr_inputs<T>{in.q, in.k, in.v, in.a, in.b, detail::dplr::zero_gate(in.q, z), in.h0}, out, opt);
}

template <class T, class Bk>
void iplr_chunked_backward(Bk const& bk, iplr_inputs<T> const& in, dplr_grad_inputs<T> const& gin, iplr_grads<T> const& g,
                           dplr_options const& opt = {}) {
  std::vector<T> z;
  detail::check_view("q", in.q);
  std::vector<T> dgk(static_cast<std::size_t>(in.q.size()));
  tensor_view<T, 4> dgkv(dgk.data(), in.q.extents());
  dplr_chunked_backward(bk, dplr_inputs<T>{in.q, in.k, in.v, in.a, in.b, detail::dplr::zero_gate(in.q, z), in.h0}, gin,
                        dplr_grads<T>{g.dq, g.dk, g.dv, g.da, g.db, dgkv, g.dh0}, opt);
}

template <class T>
void iplr_recurrent_backward(iplr_inputs<T> const& in, dplr_grad_inputs<T> const& gin, iplr_grads<T> const& g, dplr_options const& opt = {}) {
  std::vector<T> z;
  detail::check_view("q", in.q);
  std::vector<T> dgk(static_cast<std::size_t>(in.q.size()));
  tensor_view<T, 4> dgkv(dgk.data(), in.q.extents());
  dplr_recurrent_backward(dplr_inputs<T>{in.q, in.k, in.v, in.a, in.b, detail::dplr::zero_gate(in.q, z), in.h0}, gin,
                          dplr_grads<T>{g.dq, g.dk, g.dv, g.da, g.db, dgkv, g.dh0}, opt);
}

}  // namespace k3
