// k3/dplr/iplr.hpp — IPLR: DPLR with the identity as the diagonal (gk = 0),
//   S_t = (I + b_t a_t^T) S_{t-1} + k_t v_t^T.
// The args have no gk (and no dgk); k3::dplr::forward / backward take them like the DPLR
// args, options::mode included. Implemented as DPLR with a broadcast zero gate, so every DPLR
// path applies unchanged.
#pragma once
#include <vector>

#include "k3/dplr/chunked.hpp"

namespace k3::dplr {

template <class T>
struct iplr_forward_args {
  const_view<T, 4> q = {}, k = {}, v = {}, a = {}, b = {};
  const_view<state_t<T>, 4> h0 = {};
  tensor_view<T, 4> o = {};
  tensor_view<state_t<T>, 4> ht = {};
};

template <class T>
struct iplr_backward_args {
  const_view<T, 4> q = {}, k = {}, v = {}, a = {}, b = {};
  const_view<state_t<T>, 4> h0 = {};
  const_view<T, 4> d_o = {};
  const_view<state_t<T>, 4> dht = {};
  tensor_view<T, 4> dq = {}, dk = {}, dv = {}, da = {}, db = {};
  tensor_view<state_t<T>, 4> dh0 = {};
};

}  // namespace k3::dplr

namespace k3::detail::dplr {
// A [B,T,H,K] view of zeros backed by K elements (zero strides on the leading dimensions).
template <class T>
const_view<T, 4> zero_gate(const_view<T, 4> const& like, std::vector<T>& store) {
  store.assign(static_cast<std::size_t>(std::max<index_t>(like.extent(3), 1)), T(0));
  return const_view<T, 4>(store.data(), {like.extent(0), like.extent(1), like.extent(2), like.extent(3)}, {0, 0, 0, 1});
}
}  // namespace k3::detail::dplr

namespace k3::dplr {

template <HostBackend B, class T>
void forward(B const& be, iplr_forward_args<T> const& x, options const& opt = {}) {
  std::vector<T> z;
  forward(be, forward_args<T>{x.q, x.k, x.v, x.a, x.b, detail::dplr::zero_gate(x.q, z), x.h0, x.o, x.ht}, opt);
}

// dgk is computed into scratch and dropped (IPLR has no gate).
template <HostBackend B, class T>
void backward(B const& be, iplr_backward_args<T> const& x, options const& opt = {}) {
  std::vector<T> z;
  k3::detail::check_view("q", x.q);
  std::vector<T> dgk(static_cast<std::size_t>(x.q.size()));
  tensor_view<T, 4> dgkv(dgk.data(), x.q.extents());
  backward(be,
           backward_args<T>{x.q, x.k, x.v, x.a, x.b, detail::dplr::zero_gate(x.q, z), x.h0, x.d_o, x.dht, x.dq, x.dk, x.dv, x.da, x.db, dgkv,
                            x.dh0},
           opt);
}

}  // namespace k3::dplr
