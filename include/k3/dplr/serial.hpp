// k3/dplr/serial.hpp — the token-by-token DPLR recurrence, forward and backward: the
// reference every chunked, threaded and distributed path is tested against.
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

#include "k3/dplr/common.hpp"

namespace k3 {
namespace detail::dplr {

// One (sequence, head). S is K x V row-major, updated in place; o may be null.
template <class T, class R>
void recurrent_head_forward(head_views<T> const& hv, R* S, index_t K, index_t V, R scale, tensor_view<T, 2> const* o) {
  std::vector<R> x(static_cast<std::size_t>(V));
  for (index_t t = 0; t < hv.len; ++t) {
    std::fill(x.begin(), x.end(), R(0));
    for (index_t i = 0; i < K; ++i) {
      R ai = R(hv.a(t, i));
      R const* Si = S + i * V;
      for (index_t j = 0; j < V; ++j) x[j] += ai * Si[j];
    }
    for (index_t i = 0; i < K; ++i) {
      R d = std::exp(R(hv.gk(t, i))), bi = R(hv.b(t, i)), ki = R(hv.k(t, i));
      R* Si = S + i * V;
      for (index_t j = 0; j < V; ++j) Si[j] = d * Si[j] + bi * x[j] + ki * R(hv.v(t, j));
    }
    if (o) {
      for (index_t j = 0; j < V; ++j) {
        R acc = 0;
        for (index_t i = 0; i < K; ++i) acc += R(hv.q(t, i)) * S[i * V + j];
        (*o)(t, j) = static_cast<T>(scale * acc);
      }
    }
  }
}

template <class T>
struct head_grads {
  tensor_view<T, 2> dq, dk, dv, da, db, dgk;
};

// Reverse pass of one (sequence, head). S0: initial state; dS: on entry the gradient of the
// final state, on exit the gradient of the initial state. States are checkpointed every
// `block` tokens and recomputed, so memory is O(block K V).
template <class T, class R>
void recurrent_head_backward(head_views<T> const& hv, R const* S0, R* dS, const_view<T, 2> const& dO, head_grads<T> const& g, index_t K,
                             index_t V, R scale, index_t block = 64) {
  index_t const L = hv.len, KV = K * V;
  index_t const nblocks = (L + block - 1) / block;
  std::vector<R> ck(static_cast<std::size_t>(std::max<index_t>(nblocks, 1) * KV));
  std::copy(S0, S0 + KV, ck.begin());
  for (index_t nb = 0; nb + 1 < nblocks; ++nb) {
    std::copy(ck.begin() + nb * KV, ck.begin() + (nb + 1) * KV, ck.begin() + (nb + 1) * KV);
    head_views<T> sub = {hv.q.sub(0, nb * block, block), hv.k.sub(0, nb * block, block), hv.v.sub(0, nb * block, block),
                         hv.a.sub(0, nb * block, block), hv.b.sub(0, nb * block, block), hv.gk.sub(0, nb * block, block), block};
    recurrent_head_forward<T, R>(sub, ck.data() + (nb + 1) * KV, K, V, scale, nullptr);
  }
  std::vector<R> st(static_cast<std::size_t>((block + 1) * KV)), x(V), y(V);
  for (index_t nb = nblocks; nb-- > 0;) {
    index_t t0 = nb * block, n = std::min(block, L - t0);
    // st[r] = state before token t0 + r
    std::copy(ck.begin() + nb * KV, ck.begin() + (nb + 1) * KV, st.begin());
    for (index_t r = 0; r < n; ++r) {
      std::copy(st.begin() + r * KV, st.begin() + (r + 1) * KV, st.begin() + (r + 1) * KV);
      head_views<T> one = {hv.q.sub(0, t0 + r, 1), hv.k.sub(0, t0 + r, 1), hv.v.sub(0, t0 + r, 1),
                           hv.a.sub(0, t0 + r, 1), hv.b.sub(0, t0 + r, 1), hv.gk.sub(0, t0 + r, 1), 1};
      recurrent_head_forward<T, R>(one, st.data() + (r + 1) * KV, K, V, scale, nullptr);
    }
    for (index_t r = n; r-- > 0;) {
      index_t t = t0 + r;
      R const* Sp = st.data() + r * KV;        // S_{t-1}
      R const* Sc = st.data() + (r + 1) * KV;  // S_t
      // o_t = S_t^T (scale q_t)
      for (index_t i = 0; i < K; ++i) {
        R qi = scale * R(hv.q(t, i)), acc = 0;
        for (index_t j = 0; j < V; ++j) {
          R dO_j = R(dO(t, j));
          dS[i * V + j] += qi * dO_j;
          acc += Sc[i * V + j] * dO_j;
        }
        g.dq(t, i) = static_cast<T>(scale * acc);
      }
      std::fill(x.begin(), x.end(), R(0));
      std::fill(y.begin(), y.end(), R(0));
      for (index_t i = 0; i < K; ++i) {
        R ai = R(hv.a(t, i)), bi = R(hv.b(t, i));
        for (index_t j = 0; j < V; ++j) {
          x[j] += ai * Sp[i * V + j];
          y[j] += bi * dS[i * V + j];
        }
      }
      for (index_t j = 0; j < V; ++j) {
        R acc = 0;
        for (index_t i = 0; i < K; ++i) acc += dS[i * V + j] * R(hv.k(t, i));
        g.dv(t, j) = static_cast<T>(acc);
      }
      for (index_t i = 0; i < K; ++i) {
        R dk = 0, da = 0, db = 0, dg = 0;
        for (index_t j = 0; j < V; ++j) {
          R d = dS[i * V + j];
          dk += d * R(hv.v(t, j));
          da += Sp[i * V + j] * y[j];
          db += d * x[j];
          dg += Sp[i * V + j] * d;
        }
        R e = std::exp(R(hv.gk(t, i)));
        g.dk(t, i) = static_cast<T>(dk);
        g.da(t, i) = static_cast<T>(da);
        g.db(t, i) = static_cast<T>(db);
        g.dgk(t, i) = static_cast<T>(e * dg);
      }
      // dS_{t-1} = (D + b a^T)^T dS_t = D dS_t + a (b^T dS_t)
      for (index_t i = 0; i < K; ++i) {
        R e = std::exp(R(hv.gk(t, i))), ai = R(hv.a(t, i));
        for (index_t j = 0; j < V; ++j) dS[i * V + j] = e * dS[i * V + j] + ai * y[j];
      }
    }
  }
}

template <class S>
void load_state(const_view<S, 4> const& h0, index_t n, index_t h, index_t K, index_t V, S* dst) {
  if (!k3::present(h0)) {
    std::fill(dst, dst + K * V, S(0));
    return;
  }
  for (index_t i = 0; i < K; ++i)
    for (index_t j = 0; j < V; ++j) dst[i * V + j] = h0(n, h, i, j);
}

template <class S>
void store_state(tensor_view<S, 4> const& ht, index_t n, index_t h, index_t K, index_t V, S const* src) {
  if (!k3::present(ht)) return;
  for (index_t i = 0; i < K; ++i)
    for (index_t j = 0; j < V; ++j) ht(n, h, i, j) = src[i * V + j];
}

// Token-by-token forward (the reference).
template <class T>
void recurrent_forward(::k3::dplr::forward_args<T> const& a, options const& opt) {
  using S = state_t<T>;
  auto const in = inputs_of(a);
  auto p = make_problem(in, opt);
  check_outputs(p, in, a.o, a.ht);
  std::vector<S> st(static_cast<std::size_t>(p.K * p.V));
  for (index_t n = 0; n < p.N; ++n) {
    auto const& s = p.seqs[n];
    for (index_t h = 0; h < p.H; ++h) {
      load_state(in.h0, n, h, p.K, p.V, st.data());
      auto hv = head_of(in, s, h);
      tensor_view<T, 2> o = head_slice<T>(a.o, s, h);
      recurrent_head_forward<T, S>(hv, st.data(), p.K, p.V, S(p.scale), &o);
      store_state(a.ht, n, h, p.K, p.V, st.data());
    }
  }
}

// Token-by-token backward: gradients of every input and of h0 from d_o and dht.
template <class T>
void recurrent_backward(::k3::dplr::backward_args<T> const& g, options const& opt) {
  using S = state_t<T>;
  auto const in = inputs_of(g);
  auto p = make_problem(in, opt);
  check_grads(p, g);
  std::vector<S> s0(static_cast<std::size_t>(p.K * p.V)), ds(s0.size());
  for (index_t n = 0; n < p.N; ++n) {
    auto const& s = p.seqs[n];
    for (index_t h = 0; h < p.H; ++h) {
      load_state(in.h0, n, h, p.K, p.V, s0.data());
      load_state(g.dht, n, h, p.K, p.V, ds.data());
      auto hv = head_of(in, s, h);
      head_grads<T> hg = {head_slice<T>(g.dq, s, h), head_slice<T>(g.dk, s, h), head_slice<T>(g.dv, s, h),
                          head_slice<T>(g.da, s, h), head_slice<T>(g.db, s, h), head_slice<T>(g.dgk, s, h)};
      recurrent_head_backward<T, S>(hv, s0.data(), ds.data(), head_slice<T>(g.d_o, s, h), hg, p.K, p.V, S(p.scale));
      store_state(g.dh0, n, h, p.K, p.V, ds.data());
    }
  }
}

}  // namespace detail::dplr
}  // namespace k3
