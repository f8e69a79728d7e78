// k3/dplr/kda_map.hpp — KDA expressed as DPLR.
//
// KDA (value heads HV = G * H, q/k head h serving value heads h*G .. h*G+G-1):
//   S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T
// Since (I - beta k k^T) Diag(alpha) S = Diag(alpha) S + (-beta k)((alpha * k)^T S), this is
// DPLR with, per value head:
//   q' = q, k' = k, v' = beta v, a = exp(g) * k, b = -beta k, gk = g.
// Grouped heads are expanded (q and k repeated per value head); the gradients fold back by
// the chain rule (dq, dk summed over each group).
#pragma once
#include <cmath>
#include <vector>

#include "k3/dplr/maps.hpp"

namespace k3::dplr {

template <class T>
struct kda_inputs {
  const_view<T, 4> q = {}, k = {};   // [B,T,H,K]
  const_view<T, 4> v = {};           // [B,T,HV,V]
  const_view<T, 4> g = {};           // [B,T,HV,K] log decay
  const_view<T, 3> beta = {};        // [B,T,HV]
  const_view<state_t<T>, 4> h0 = {};  // [N,HV,K,V], absent = zero
};

template <class T>
struct kda_grads {
  tensor_view<T, 4> dq = {}, dk = {}, dv = {}, dg = {};
  tensor_view<T, 3> dbeta = {};
};

// KDA segment maps: the span's KDA tokens (no h0) and the maps M [N,HV,K,K], N [N,HV,K,V].
template <class T>
struct kda_maps_args {
  const_view<T, 4> q = {}, k = {}, v = {}, g = {};
  const_view<T, 3> beta = {};
  tensor_view<state_t<T>, 4> M = {}, N = {};
};

}  // namespace k3::dplr

namespace k3 {
namespace detail::dplr {
struct kda_dims {
  index_t B, T, H, HV, K, V, G;
};
template <class T>
kda_dims check_kda(::k3::dplr::kda_inputs<T> const& in) {
  check_view("q", in.q);
  kda_dims d{in.q.extent(0), in.q.extent(1), in.q.extent(2), in.v.extent(2), in.q.extent(3), in.v.extent(3), 1};
  check_shape("k", in.k, {d.B, d.T, d.H, d.K});
  check_view("v", in.v);
  check_shape("v", in.v, {d.B, d.T, any_extent, any_extent});
  require(d.H > 0 ? d.HV % d.H == 0 : d.HV == 0, error_kind::shape, [&] {
    return "argument 'v': the value head count HV = " + std::to_string(d.HV) + " must be a multiple of the q/k head count H = " +
           std::to_string(d.H);
  });
  d.G = d.H > 0 ? d.HV / d.H : 1;
  check_view("g", in.g);
  check_shape("g", in.g, {d.B, d.T, d.HV, d.K});
  check_view("beta", in.beta);
  check_shape("beta", in.beta, {d.B, d.T, d.HV});
  check_view("k", in.k);
  return d;
}
}  // namespace detail::dplr
}  // namespace k3

namespace k3::dplr {

// Owns the DPLR inputs of a KDA problem ([B,T,HV,*], head-expanded).
template <class T>
class kda_as_dplr {
 public:
  explicit kda_as_dplr(kda_inputs<T> const& in) : in_(in), d_(detail::dplr::check_kda(in)) {
    index_t nk = d_.B * d_.T * d_.HV * d_.K, nv = d_.B * d_.T * d_.HV * d_.V;
    for (auto* x : {&q_, &k_, &a_, &b_, &gk_}) x->resize(static_cast<std::size_t>(nk));
    v_.resize(static_cast<std::size_t>(nv));
    for (index_t b = 0; b < d_.B; ++b)
      for (index_t t = 0; t < d_.T; ++t)
        for (index_t hv = 0; hv < d_.HV; ++hv) {
          index_t h = hv / d_.G, row = (b * d_.T + t) * d_.HV + hv;
          T beta = in.beta(b, t, hv);
          for (index_t i = 0; i < d_.K; ++i) {
            T kk = in.k(b, t, h, i), gg = in.g(b, t, hv, i);
            q_[row * d_.K + i] = in.q(b, t, h, i);
            k_[row * d_.K + i] = kk;
            a_[row * d_.K + i] = std::exp(gg) * kk;
            b_[row * d_.K + i] = -beta * kk;
            gk_[row * d_.K + i] = gg;
          }
          for (index_t j = 0; j < d_.V; ++j) v_[row * d_.V + j] = beta * in.v(b, t, hv, j);
        }
  }
  // The mapped problem's inputs (h0 included) in forward args; the caller sets o (and ht).
  forward_args<T> forward_inputs() const {
    auto vk = [&](std::vector<T> const& x) { return const_view<T, 4>(x.data(), {d_.B, d_.T, d_.HV, d_.K}); };
    return {vk(q_), vk(k_), const_view<T, 4>(v_.data(), {d_.B, d_.T, d_.HV, d_.V}), vk(a_), vk(b_), vk(gk_), in_.h0};
  }
  // The same inputs in backward args; the caller sets d_o (and dht) and the gradients.
  backward_args<T> backward_inputs() const {
    auto const f = forward_inputs();
    return {f.q, f.k, f.v, f.a, f.b, f.gk, f.h0};
  }
  index_t value_heads() const { return d_.HV; }

  // Folds the DPLR gradients g.dq .. g.dgk ([B,T,HV,*], e.g. from k3::dplr::backward on
  // backward_inputs()) back to the KDA inputs. dh0 needs no folding: the state is the same.
  void grads_to_kda(backward_args<T> const& g, kda_grads<T> const& out) const {
    auto const& d = d_;
    k3::detail::check_shape("dq", out.dq, {d.B, d.T, d.H, d.K});
    k3::detail::check_shape("dk", out.dk, {d.B, d.T, d.H, d.K});
    k3::detail::check_shape("dv", out.dv, {d.B, d.T, d.HV, d.V});
    k3::detail::check_shape("dg", out.dg, {d.B, d.T, d.HV, d.K});
    k3::detail::check_shape("dbeta", out.dbeta, {d.B, d.T, d.HV});
    for (auto [nm, x] : {std::pair<char const*, tensor_view<T, 4>>{"dq'", g.dq}, {"dk'", g.dk}, {"da", g.da}, {"db", g.db}, {"dgk", g.dgk}})
      k3::detail::check_shape(nm, x, {d.B, d.T, d.HV, d.K});
    k3::detail::check_shape("dv'", g.dv, {d.B, d.T, d.HV, d.V});
    // Null data with a non-empty shape, and outputs over the DPLR gradients or the KDA inputs
    // (the folds read them after zeroing dq and dk).
    std::pair<char const*, const_view<T, 4>> const ins[] = {{"dq'", g.dq}, {"dk'", g.dk}, {"dv'", g.dv}, {"da", g.da}, {"db", g.db},
                                                           {"dgk", g.dgk}, {"q", in_.q}, {"k", in_.k}, {"v", in_.v}, {"g", in_.g}};
    for (auto const& [nm, x] : ins) k3::detail::check_view(nm, x);
    std::pair<char const*, tensor_view<T, 4>> const outs[] = {{"dq", out.dq}, {"dk", out.dk}, {"dv", out.dv}, {"dg", out.dg}};
    for (auto const& [nm, x] : outs) k3::detail::check_view(nm, x);
    k3::detail::check_view("dbeta", out.dbeta);
    // dq and dk accumulate over the value heads of a group: a broadcast output would sum
    // several elements' gradients into one address.
    k3::detail::check_outputs_apart(
        [&](auto&& f) {
          for (auto const& [nm, x] : outs) f(nm, x);
          f("dbeta", out.dbeta);
        },
        [&](auto&& f) {
          for (auto const& [nm, x] : ins) f(nm, x);
          f("beta", in_.beta);
        });
    for (index_t b = 0; b < d.B; ++b)
      for (index_t t = 0; t < d.T; ++t) {
        for (index_t h = 0; h < d.H; ++h)
          for (index_t i = 0; i < d.K; ++i) out.dq(b, t, h, i) = out.dk(b, t, h, i) = T(0);
        for (index_t hv = 0; hv < d.HV; ++hv) {
          index_t h = hv / d.G;
          T beta = in_.beta(b, t, hv), dbeta = 0;
          for (index_t i = 0; i < d.K; ++i) {
            T kk = in_.k(b, t, h, i), e = std::exp(in_.g(b, t, hv, i));
            out.dq(b, t, h, i) += g.dq(b, t, hv, i);
            out.dk(b, t, h, i) += g.dk(b, t, hv, i) + g.da(b, t, hv, i) * e - beta * g.db(b, t, hv, i);
            out.dg(b, t, hv, i) = g.dgk(b, t, hv, i) + g.da(b, t, hv, i) * e * kk;
            dbeta -= g.db(b, t, hv, i) * kk;
          }
          for (index_t j = 0; j < d.V; ++j) {
            dbeta += g.dv(b, t, hv, j) * in_.v(b, t, hv, j);
            out.dv(b, t, hv, j) = beta * g.dv(b, t, hv, j);
          }
          out.dbeta(b, t, hv) = dbeta;
        }
      }
  }

 private:
  kda_inputs<T> in_;
  detail::dplr::kda_dims d_;
  std::vector<T> q_, k_, v_, a_, b_, gk_;
};

// KDA segment maps through the DPLR mapping: per sequence and value head, S_out = M S_in + N.
template <HostBackend B, class T>
void kda_segment_maps(B const& be, kda_maps_args<T> const& x, options const& opt = {}) {
  kda_as_dplr<T> m(kda_inputs<T>{x.q, x.k, x.v, x.g, x.beta, {}});
  auto const f = m.forward_inputs();
  segment_maps(be, maps_args<T>{f.q, f.k, f.v, f.a, f.b, f.gk, x.M, x.N}, opt);
}

}  // namespace k3::dplr
