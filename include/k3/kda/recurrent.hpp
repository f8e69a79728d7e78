// k3/kda/recurrent.hpp — the serial recurrence, token by token: the reference every other
// form is tested against, and the decode path. Per value head (state S is K x V):
//
//   S'_t = Diag(exp g_t) S_{t-1}                       decay each key row first
//   S_t  = S'_t + k_t u_t^T,  u_t = beta_t (v_t - S'_t^T k_t)
//   o_t  = S_t^T (scale q_t)                           reads the state after token t
//
// The backward keeps a checkpoint of the state every `checkpoint` tokens and recomputes the
// states inside each segment, so memory stays O(T/checkpoint * K * V) per head.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "k3/kda/common.hpp"

namespace k3::kda::detail {

template <class Acc, class In>
inline void load_row(In const* src, Acc* dst, index_t n) noexcept {
  for (index_t i = 0; i < n; ++i) dst[i] = load_as<Acc>(src[i]);
}
template <class Out, class Acc>
inline void store_row(Acc const* src, Out* dst, index_t n) noexcept {
  for (index_t i = 0; i < n; ++i) dst[i] = store_as<Out>(src[i]);
}

// Initial state of sequence n, value head hv, into S (K*V, row-major).
template <class Acc, class S>
void load_state(tensor_view<S const, 4> h0, index_t n, index_t hv, Acc* dst, index_t K, index_t V) {
  if (!present(h0)) {
    std::fill(dst, dst + K * V, Acc(0));
    return;
  }
  for (index_t d = 0; d < K; ++d) load_row(&h0(n, hv, d, 0), dst + d * V, V);
}
template <class Acc, class S>
void store_state(tensor_view<S, 4> ht, index_t n, index_t hv, Acc const* src, index_t K, index_t V) {
  if (!present(ht)) return;
  for (index_t d = 0; d < K; ++d) store_row(src + d * V, &ht(n, hv, d, 0), V);
}

// One token of the recurrence on state S (K x V). `qs` is already scaled. Writes o (V).
template <class Acc>
inline void recurrent_step(Acc* K3_RESTRICT S, Acc const* qs, Acc const* k, Acc const* v, Acc const* g, Acc beta, Acc* K3_RESTRICT u,
                           Acc* K3_RESTRICT o, index_t K, index_t V) noexcept {
  for (index_t e = 0; e < V; ++e) u[e] = 0;
  for (index_t d = 0; d < K; ++d) {
    Acc const a = std::exp(g[d]);
    Acc* row = S + d * V;
    for (index_t e = 0; e < V; ++e) {
      row[e] *= a;
      u[e] += k[d] * row[e];
    }
  }
  for (index_t e = 0; e < V; ++e) u[e] = beta * (v[e] - u[e]);
  for (index_t e = 0; e < V; ++e) o[e] = 0;
  for (index_t d = 0; d < K; ++d) {
    Acc* row = S + d * V;
    for (index_t e = 0; e < V; ++e) {
      row[e] += k[d] * u[e];
      o[e] += qs[d] * row[e];
    }
  }
}

// Forward of sequence n, value head hv, serial recurrence.
template <class Acc, class In, class S>
void recurrent_forward_task(problem const& p, forward_args<In, S> const& a, index_t n, index_t hv) {
  index_t const K = p.K, V = p.V, b = p.batch(n), h = hv / p.G;
  std::vector<Acc> st(std::size_t(K * V)), buf(std::size_t(3 * K + 3 * V));
  Acc *qs = buf.data(), *k = qs + K, *g = k + K, *v = g + K, *u = v + V, *o = u + V;
  load_state<Acc>(a.h0, n, hv, st.data(), K, V);
  Acc const scale = static_cast<Acc>(p.scale);
  for (index_t t = p.bos(n); t < p.eos(n); ++t) {
    load_row(&a.q(b, t, h, 0), qs, K);
    for (index_t d = 0; d < K; ++d) qs[d] *= scale;
    load_row(&a.k(b, t, h, 0), k, K);
    load_row(&a.g(b, t, hv, 0), g, K);
    load_row(&a.v(b, t, hv, 0), v, V);
    Acc const beta = load_as<Acc>(a.beta(b, t, hv));
    recurrent_step(st.data(), qs, k, v, g, beta, u, o, K, V);
    store_row(o, &a.o(b, t, hv, 0), V);
  }
  store_state(a.ht, n, hv, st.data(), K, V);
}

// Backward of sequence n, q/k head h (all value heads of its group: dq and dk sum over them).
template <class Acc, class In, class S>
void recurrent_backward_task(problem const& p, backward_args<In, S> const& a, index_t n, index_t h, index_t checkpoint = 64) {
  index_t const K = p.K, V = p.V, b = p.batch(n), bos = p.bos(n), Tn = p.eos(n) - bos;
  Acc const scale = static_cast<Acc>(p.scale);
  std::vector<Acc> dq(std::size_t(Tn * K), Acc(0)), dk(std::size_t(Tn * K), Acc(0));
  index_t const nseg = (Tn + checkpoint - 1) / checkpoint;
  std::vector<Acc> ckpt(std::size_t(std::max<index_t>(nseg, 1) * K * V));
  std::vector<Acc> states(std::size_t((checkpoint + 1) * K * V));  // S_{t0-1} .. S_{t1-1}
  std::vector<Acc> dS(std::size_t(K * V)), Sp(std::size_t(K * V));
  std::vector<Acc> buf(std::size_t(4 * K + 6 * V));
  Acc *qs = buf.data(), *k = qs + K, *g = k + K, *ag = g + K, *v = ag + K, *u = v + V, *o = u + V, *du = o + V, *r = du + V,
      *dpred = r + V;
  std::vector<Acc> dgrow(static_cast<std::size_t>(K));
  auto load_tok = [&](index_t t, index_t hv) {
    load_row(&a.q(b, t, h, 0), qs, K);
    for (index_t d = 0; d < K; ++d) qs[d] *= scale;
    load_row(&a.k(b, t, h, 0), k, K);
    load_row(&a.g(b, t, hv, 0), g, K);
    load_row(&a.v(b, t, hv, 0), v, V);
  };
  for (index_t hv = h * p.G; hv < (h + 1) * p.G; ++hv) {
    // Forward: checkpoints of the state at the start of every segment.
    std::vector<Acc> st(std::size_t(K * V));
    load_state<Acc>(a.h0, n, hv, st.data(), K, V);
    for (index_t s = 0; s < nseg; ++s) {
      std::copy(st.begin(), st.end(), ckpt.begin() + s * K * V);
      for (index_t t = bos + s * checkpoint; t < std::min(bos + (s + 1) * checkpoint, bos + Tn); ++t) {
        load_tok(t, hv);
        recurrent_step(st.data(), qs, k, v, g, load_as<Acc>(a.beta(b, t, hv)), u, o, K, V);
      }
    }
    if (present(a.dht)) {
      for (index_t d = 0; d < K; ++d) load_row(&a.dht(n, hv, d, 0), dS.data() + d * V, V);
    } else {
      std::fill(dS.begin(), dS.end(), Acc(0));
    }
    for (index_t s = nseg; s-- > 0;) {
      index_t const t0 = bos + s * checkpoint, t1 = std::min(t0 + checkpoint, bos + Tn);
      std::copy(ckpt.begin() + s * K * V, ckpt.begin() + (s + 1) * K * V, states.begin());
      for (index_t t = t0; t < t1; ++t) {
        std::copy(states.begin() + (t - t0) * K * V, states.begin() + (t - t0 + 1) * K * V, states.begin() + (t - t0 + 1) * K * V);
        load_tok(t, hv);
        recurrent_step(states.data() + (t - t0 + 1) * K * V, qs, k, v, g, load_as<Acc>(a.beta(b, t, hv)), u, o, K, V);
      }
      for (index_t t = t1; t-- > t0;) {
        Acc const* Sprev = states.data() + (t - t0) * K * V;
        Acc const* St = Sprev + K * V;
        load_tok(t, hv);
        Acc const beta = load_as<Acc>(a.beta(b, t, hv));
        Acc* dqt = dq.data() + (t - bos) * K;
        Acc* dkt = dk.data() + (t - bos) * K;
        // o row gradient
        load_row(&a.d_o(b, t, hv, 0), o, V);  // reuse o as do_t
        for (index_t d = 0; d < K; ++d) ag[d] = std::exp(g[d]);
        // S' = D S_prev, r = v - S'^T k, u = beta r
        for (index_t e = 0; e < V; ++e) r[e] = v[e];
        for (index_t d = 0; d < K; ++d)
          for (index_t e = 0; e < V; ++e) {
            Sp[std::size_t(d * V + e)] = ag[d] * Sprev[d * V + e];
            r[e] -= k[d] * Sp[std::size_t(d * V + e)];
          }
        for (index_t e = 0; e < V; ++e) u[e] = beta * r[e];
        // dS += qs do^T; dq += scale S_t do
        for (index_t d = 0; d < K; ++d) {
          Acc acc = 0;
          for (index_t e = 0; e < V; ++e) {
            dS[std::size_t(d * V + e)] += qs[d] * o[e];
            acc += St[d * V + e] * o[e];
          }
          dqt[d] += scale * acc;
        }
        // S_t = S' + k u^T
        for (index_t e = 0; e < V; ++e) du[e] = 0;
        for (index_t d = 0; d < K; ++d) {
          Acc acc = 0;
          for (index_t e = 0; e < V; ++e) {
            du[e] += dS[std::size_t(d * V + e)] * k[d];
            acc += dS[std::size_t(d * V + e)] * u[e];
          }
          dkt[d] += acc;
        }
        Acc dbeta = 0;
        for (index_t e = 0; e < V; ++e) {
          dbeta += du[e] * r[e];
          dpred[e] = -beta * du[e];
          du[e] *= beta;  // dv
        }
        store_row(du, &a.dv(b, t, hv, 0), V);
        a.dbeta(b, t, hv) = store_as<In>(dbeta);
        // dS' = dS + k dpred^T; dk += S' dpred; dg = rowsum(S' .* dS'); dS_prev = D dS'
        for (index_t d = 0; d < K; ++d) {
          Acc acck = 0, accg = 0;
          for (index_t e = 0; e < V; ++e) {
            Acc& x = dS[std::size_t(d * V + e)];
            x += k[d] * dpred[e];
            Acc const sp = Sp[std::size_t(d * V + e)];
            acck += sp * dpred[e];
            accg += sp * x;
            x *= ag[d];
          }
          dkt[d] += acck;
          dgrow[std::size_t(d)] = accg;
        }
        store_row(dgrow.data(), &a.dg(b, t, hv, 0), K);
      }
    }
    if (present(a.dh0))
      for (index_t d = 0; d < K; ++d) store_row(dS.data() + d * V, &a.dh0(n, hv, d, 0), V);
  }
  for (index_t t = 0; t < Tn; ++t) {
    store_row(dq.data() + t * K, &a.dq(b, bos + t, h, 0), K);
    store_row(dk.data() + t * K, &a.dk(b, bos + t, h, 0), K);
  }
}

// Decode: one token for sequence n, state in the pool at slot `slot`, value head hv.
template <class Acc, class In, class S>
void decode_task(problem const& p, decode_args<In, S> const& a, index_t n, index_t slot, index_t hv) {
  index_t const K = p.K, V = p.V, h = hv / p.G;
  std::vector<Acc> st(std::size_t(K * V)), buf(std::size_t(3 * K + 3 * V));
  Acc *qs = buf.data(), *k = qs + K, *g = k + K, *v = g + K, *u = v + V, *o = u + V;
  for (index_t d = 0; d < K; ++d) load_row(&a.state_pool(slot, hv, d, 0), st.data() + d * V, V);
  load_row(&a.q(n, h, 0), qs, K);
  for (index_t d = 0; d < K; ++d) qs[d] *= static_cast<Acc>(p.scale);
  load_row(&a.k(n, h, 0), k, K);
  load_row(&a.g(n, hv, 0), g, K);
  load_row(&a.v(n, hv, 0), v, V);
  recurrent_step(st.data(), qs, k, v, g, load_as<Acc>(a.beta(n, hv)), u, o, K, V);
  store_row(o, &a.o(n, hv, 0), V);
  for (index_t d = 0; d < K; ++d) store_row(st.data() + d * V, &a.state_pool(slot, hv, d, 0), V);
}

}  // namespace k3::kda::detail
