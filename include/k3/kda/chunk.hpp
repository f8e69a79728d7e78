// k3/kda/chunk.hpp — the chunked WY/UT form of KDA (chunk C = 64, 16-token sub-chunks),
// forward and backward, per (sequence, head), with Eigen for the per-chunk products.
//
// Inside a chunk, G is the inclusive cumsum of g restarted at the chunk start, so every
// exponential used below is exp(G_i - G_j) with i >= j, or exp(G_last - G_i), or exp(G_i):
// all <= 1 for g <= 0.
//
//   Aqk[i,j] = scale q_i.(k_j e^{G_i-G_j}) (j <= i),  KK[i,j] = k_i.(k_j e^{G_i-G_j}) (j < i)
//   A = (I + Diag(beta) KK)^{-1}                        (unit lower triangular)
//   U = A Diag(beta) (V - (K e^G) S)                     (state correction before the inverse)
//   O = scale (Q e^G) S + Aqk U
//   S <- Diag(e^{G_last}) S + (K e^{G_last - G})^T U
//
// The 16x16 tiles of Aqk and KK: an off-diagonal tile (rows I after columns J) is a dense
// product anchored at the first row n of I — factors e^{G_I - G_n} and e^{G_n - G_J}, both
// <= 1. A diagonal tile is dense only when the gate is lower-bounded (every g >= lb >= -5):
// anchored at c = G_{i0-1} + 8 lb, which depends on earlier tokens only (fla #1240 anchored on
// a row that could be in the future), both factors are within e^{+-40}. Otherwise the
// diagonal tile is evaluated pair by pair, with only causal (masked-before-exp) exponents.
#pragma once
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "k3/core/gate_cumsum.hpp"
#include "k3/core/math.hpp"
#include "k3/kda/common.hpp"
#include "k3/kda/recurrent.hpp"

namespace k3::kda::detail {

template <class Acc>
struct chunk_workspace {
  using Mat = Eigen::Matrix<Acc, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using RowVec = Eigen::Matrix<Acc, 1, Eigen::Dynamic>;
  using Vec = Eigen::Matrix<Acc, Eigen::Dynamic, 1>;
  index_t K, V;
  Mat Q, Kc, G, Vc, Aqk, KK, A, Qe, Ke, Kd, R, B, U, O, S, tmpK, tmpK2, tmpV;
  Mat EI, Qa, Ka, EJ, Kb;
  // A chunk with a log decay below split_log_decay() (split_gate_cumsum): G holds the cumsum
  // of the other log decays, H the cumsum of those (see split_gate_cumsum).
  Mat H;
  bool split = false;
  Vec beta;
  // backward
  Mat dO, dU, dAqk, dKK, dB, dA, dQ, dK, dG, dR, dQa, dKa, dKb, dS, dSn;

  chunk_workspace(index_t K_, index_t V_, bool backward) : K(K_), V(V_) {
    index_t const C = chunk_size, s = sub_chunk;
    for (Mat* m : {&Q, &Kc, &G, &H, &Qe, &Ke, &Kd, &tmpK, &tmpK2}) m->resize(C, K);
    for (Mat* m : {&Vc, &R, &B, &U, &O, &tmpV}) m->resize(C, V);
    for (Mat* m : {&Aqk, &KK, &A}) m->resize(C, C);
    for (Mat* m : {&EI, &Qa, &Ka, &EJ, &Kb}) m->resize(s, K);
    S.resize(K, V);
    beta.resize(C);
    if (backward) {
      for (Mat* m : {&dO, &dU, &dB, &dR}) m->resize(C, V);
      for (Mat* m : {&dAqk, &dKK, &dA}) m->resize(C, C);
      for (Mat* m : {&dQ, &dK, &dG}) m->resize(C, K);
      for (Mat* m : {&dQa, &dKa, &dKb}) m->resize(s, K);
      dS.resize(K, V);
      dSn.resize(K, V);
    }
  }
};

// In-place e^x over the rows of a row-major block. Eigen evaluates .exp() with SIMD packets
// on plain rows, but falls back to scalar libm on broadcast (rowwise) expressions.
template <class Block>
inline void exp_rows(Block&& b) {
  using Acc = typename std::remove_cvref_t<Block>::Scalar;
  for (Eigen::Index r = 0; r < b.rows(); ++r) {
    Eigen::Map<Eigen::Array<Acc, 1, Eigen::Dynamic>> m(b.row(r).data(), b.cols());
    m = m.exp();
  }
}

using ::k3::detail::split_log_decay;

// Row r of the chunk-local gate cumsum G from the gate row g (K values) and row r - 1 (null for
// the chunk's first row). Hard resets are clamped first (core/math.hpp full_decay_log): e^g is
// already 0 there, and the cumsum stays finite. Every chunked path loads G here. Returns
// whether the row holds a log decay below split_log_decay(): the chunk then has to be
// reloaded by split_gate_cumsum.
// One pass, written so that g++ vectorises it (the clamp as a select on a local, the flag an
// unsigned OR tested on the unclamped value: the clamp floor is below split_log_decay()).
template <class Acc, class In>
inline bool load_gate_cumsum_row(In const* g, Acc* G, Acc const* G_prev, index_t K) noexcept {
  static_assert(::k3::detail::full_decay_log<Acc>() < split_log_decay<Acc>());
  Acc const floor = ::k3::detail::full_decay_log<Acc>(), split = split_log_decay<Acc>();
  unsigned large = 0;
  if (G_prev)
    for (index_t d = 0; d < K; ++d) {
      Acc const x = load_as<Acc>(g[d]);
      large |= unsigned(x < split);
      G[d] = (x < floor ? floor : x) + G_prev[d];
    }
  else
    for (index_t d = 0; d < K; ++d) {
      Acc const x = load_as<Acc>(g[d]);
      large |= unsigned(x < split);
      G[d] = x < floor ? floor : x;
    }
  return large != 0;
}

// Hard resets: a chunk holding a log decay below split_log_decay() keeps two cumsums per
// channel, G of the small log decays and H of the large ones (core/gate_cumsum.hpp says why).
// Chunks without a large decay (every chunk of the lower-bounded gate) keep the single
// cumsum and their arithmetic bit for bit; the split ones run the pairwise diagonal tiles.
using ::k3::detail::split_gate_cumsum;

// The lower bound a chunk's tiles may use: none for a split chunk (its G is not the full
// cumsum; a valid lower-bounded gate never has one).
template <class Acc>
inline std::optional<double> chunk_lower_bound(chunk_workspace<Acc> const& w, std::optional<double> lb) noexcept {
  return w.split ? std::nullopt : lb;
}

// E (m rows) = G_n - G_{r0..r0+m} per channel (row n not before the rows), H added for a
// split chunk.
template <class Acc, class E>
inline void log_decay_from(chunk_workspace<Acc> const& w, E&& e, index_t r0, index_t m, index_t n) {
  e = (-w.G.middleRows(r0, m)).rowwise() + w.G.row(n);
  if (w.split) e += (-w.H.middleRows(r0, m)).rowwise() + w.H.row(n);
}

// Loads chunk rows [t0, t0+c) of sequence batch row b, heads h (q/k) and hv, and the gate cumsum.
template <class Acc, class In>
void load_chunk(chunk_workspace<Acc>& w, tensor_view<In const, 4> q, tensor_view<In const, 4> k, tensor_view<In const, 4> v,
                tensor_view<In const, 4> g, tensor_view<In const, 3> beta, index_t b, index_t h, index_t hv, index_t t0, index_t c,
                bool with_v = true) {
  // v has V = v.extent(3) columns; the workspace may be wider (chunk_simd.hpp pads V to the
  // vector width, and those columns must stay zero).
  index_t const K = w.K, V = v.extent(3);
  bool large = false;
  for (index_t r = 0; r < c; ++r) {
    load_row(&q(b, t0 + r, h, 0), w.Q.row(r).data(), K);
    load_row(&k(b, t0 + r, h, 0), w.Kc.row(r).data(), K);
    if (with_v) load_row(&v(b, t0 + r, hv, 0), w.Vc.row(r).data(), V);
    large |= load_gate_cumsum_row(&g(b, t0 + r, hv, 0), w.G.row(r).data(), r > 0 ? w.G.row(r - 1).data() : nullptr, K);
    w.beta(r) = load_as<Acc>(beta(b, t0 + r, hv));
  }
  w.split = large;
  if (large) split_gate_cumsum(w.G.data(), w.H.data(), w.G.cols(), &g(b, t0, hv, 0), g.stride(1), c, K);
}

// Aqk (lower, diagonal included) and KK (strictly lower) of a chunk of c rows.
// Gated factors of a dense diagonal tile (rows i0..i0+ci), shared by forward and backward:
// EI = e^{G_i - c}, EJ = e^{c - G_j} with the causal anchor c = G_{i0-1} + 8 lb (see the top of
// this file), then Qa = Q * EI, Ka = K * EI, Kb = K * EJ.
template <class Acc>
void dense_diagonal_factors(chunk_workspace<Acc>& w, index_t i0, index_t ci, double lb) {
  typename chunk_workspace<Acc>::RowVec cv(w.K);
  if (i0 == 0)
    cv.setConstant(Acc(8 * lb));
  else
    cv = w.G.row(i0 - 1).array() + Acc(8 * lb);
  auto GI = w.G.middleRows(i0, ci);
  auto EI = w.EI.topRows(ci);
  auto EJ = w.EJ.topRows(ci);
  EI = GI.rowwise() - cv;
  exp_rows(EI);
  EJ = (-GI).rowwise() + cv;
  exp_rows(EJ);
  w.Qa.topRows(ci).array() = w.Q.middleRows(i0, ci).array() * EI.array();
  w.Ka.topRows(ci).array() = w.Kc.middleRows(i0, ci).array() * EI.array();
  w.Kb.topRows(ci).array() = w.Kc.middleRows(i0, ci).array() * EJ.array();
}

// Gated factors of an off-diagonal tile anchored at row i0, shared by forward and backward:
// rows i0..i0+ci get EI = e^{G_i - G_i0}, Qa = Q * EI, Ka = K * EI (anchored_rows); the
// columns j0..j0+BC get EJ = e^{G_i0 - G_j}, Kb = K * EJ (anchored_columns). The split part H
// of the gate, when present, joins both exponents.
template <class Acc>
void anchored_rows(chunk_workspace<Acc>& w, index_t i0, index_t ci) {
  auto EI = w.EI.topRows(ci);
  EI = w.G.middleRows(i0, ci).rowwise() - w.G.row(i0);
  if (w.split) EI += w.H.middleRows(i0, ci).rowwise() - w.H.row(i0);
  exp_rows(EI);
  w.Qa.topRows(ci).array() = w.Q.middleRows(i0, ci).array() * EI.array();
  w.Ka.topRows(ci).array() = w.Kc.middleRows(i0, ci).array() * EI.array();
}

template <class Acc>
void anchored_columns(chunk_workspace<Acc>& w, index_t i0, index_t j0) {
  w.EJ = (-w.G.middleRows(j0, sub_chunk)).rowwise() + w.G.row(i0);
  if (w.split) w.EJ += (-w.H.middleRows(j0, sub_chunk)).rowwise() + w.H.row(i0);
  exp_rows(w.EJ);
  w.Kb.array() = w.Kc.middleRows(j0, sub_chunk).array() * w.EJ.array();
}

template <class Acc>
void chunk_intra(chunk_workspace<Acc>& w, index_t c, Acc scale, std::optional<double> lb) {
  index_t const BC = sub_chunk;
  w.Aqk.topLeftCorner(c, c).setZero();
  w.KK.topLeftCorner(c, c).setZero();
  for (index_t i0 = 0; i0 < c; i0 += BC) {
    index_t const ci = std::min(BC, c - i0);
    // Off-diagonal tiles, anchored at row i0.
    if (i0 > 0) {
      anchored_rows(w, i0, ci);
      for (index_t j0 = 0; j0 < i0; j0 += BC) {
        anchored_columns(w, i0, j0);
        w.Aqk.block(i0, j0, ci, BC).noalias() = scale * w.Qa.topRows(ci) * w.Kb.transpose();
        w.KK.block(i0, j0, ci, BC).noalias() = w.Ka.topRows(ci) * w.Kb.transpose();
      }
    }
    // Diagonal tile.
    if (lb) {
      dense_diagonal_factors(w, i0, ci, *lb);
      auto Qa = w.Qa.topRows(ci);
      auto Ka = w.Ka.topRows(ci);
      auto Kb = w.Kb.topRows(ci);
      auto tq = w.Aqk.block(i0, i0, ci, ci);
      auto tk = w.KK.block(i0, i0, ci, ci);
      tq.noalias() = scale * Qa * Kb.transpose();
      tk.noalias() = Ka * Kb.transpose();
      tq.template triangularView<Eigen::StrictlyUpper>().setZero();  // mask after the product: factors are bounded
      tk.template triangularView<Eigen::Upper>().setZero();
    } else {
      // Row i against columns i0..i only: every exponent G_i - G_j is causal (<= 0).
      for (index_t i = i0; i < i0 + ci; ++i) {
        index_t const m = i - i0 + 1;
        auto Kt = w.Kb.topRows(m);
        auto E = w.EJ.topRows(m);
        log_decay_from(w, E, i0, m, i);
        exp_rows(E);
        Kt.array() = w.Kc.middleRows(i0, m).array() * E.array();
        w.Aqk.row(i).segment(i0, m).noalias() = scale * (Kt * w.Q.row(i).transpose()).transpose();
        w.KK.row(i).segment(i0, m - 1).noalias() = (Kt.topRows(m - 1) * w.Kc.row(i).transpose()).transpose();
      }
    }
  }
}

// A = (I + Diag(beta) KK)^{-1} by forward substitution, rows of A: A_i = e_i - sum_{m<i} L_im A_m.
template <class Acc>
void chunk_inverse(chunk_workspace<Acc>& w, index_t c) {
  auto A = w.A.topLeftCorner(c, c);
  A.setIdentity();
  for (index_t i = 1; i < c; ++i) {
    Acc* Ai = w.A.row(i).data();
    Acc const bi = w.beta(i);
    for (index_t m = 0; m < i; ++m) {
      Acc const l = bi * w.KK(i, m);
      Acc const* Am = w.A.row(m).data();
      for (index_t j = 0; j <= m; ++j) Ai[j] -= l * Am[j];
    }
  }
}

// Everything the chunk needs given the loaded rows and the chunk-start state w.S:
// Aqk, KK, A, Qe = Q e^G, Ke = K e^G, Kd = K e^{G_last - G}, R = V - Ke S, B = beta R, U = A B.
template <class Acc>
void chunk_gates(chunk_workspace<Acc>& w, index_t c) {
  auto G = w.G.topRows(c);
  auto gl = w.G.row(c - 1);
  w.tmpK.topRows(c) = G;
  if (w.split) w.tmpK.topRows(c) += w.H.topRows(c);
  exp_rows(w.tmpK.topRows(c));  // e^G
  w.Qe.topRows(c).array() = w.Q.topRows(c).array() * w.tmpK.topRows(c).array();
  w.Ke.topRows(c).array() = w.Kc.topRows(c).array() * w.tmpK.topRows(c).array();
  if (w.split)
    log_decay_from(w, w.tmpK2.topRows(c), 0, c, c - 1);
  else
    w.tmpK2.topRows(c) = (-G).rowwise() + gl;
  exp_rows(w.tmpK2.topRows(c));  // e^{G_last - G}
  w.Kd.topRows(c).array() = w.Kc.topRows(c).array() * w.tmpK2.topRows(c).array();
}

template <class Acc>
void chunk_prepare(chunk_workspace<Acc>& w, index_t c, Acc scale, std::optional<double> lb) {
  chunk_intra(w, c, scale, lb);
  chunk_inverse(w, c);
  chunk_gates(w, c);
  w.R.topRows(c) = w.Vc.topRows(c);
  w.R.topRows(c).noalias() -= w.Ke.topRows(c) * w.S;
  w.B.topRows(c) = w.beta.head(c).asDiagonal() * w.R.topRows(c);
  // A and Aqk keep explicit zeros above the diagonal: a dense product is faster than Eigen's
  // triangular kernels at these sizes.
  w.U.topRows(c).noalias() = w.A.topLeftCorner(c, c) * w.B.topRows(c);
}

// e^{G_last}: the decay over the whole chunk, per channel.
template <class Acc>
typename chunk_workspace<Acc>::Vec chunk_decay(chunk_workspace<Acc> const& w, index_t c) {
  if (w.split) return (w.G.row(c - 1) + w.H.row(c - 1)).transpose().array().exp();
  return w.G.row(c - 1).transpose().array().exp();
}

template <class Acc>
void chunk_state_update(chunk_workspace<Acc>& w, index_t c) {
  typename chunk_workspace<Acc>::Vec dl = chunk_decay(w, c);
  w.S = dl.asDiagonal() * w.S;
  w.S.noalias() += w.Kd.topRows(c).transpose() * w.U.topRows(c);
}

// The per-chunk record of saved_layout (Vw = V): what the backward's second pass reads.
template <class Acc>
void save_chunk(chunk_workspace<Acc> const& w, Acc* dst) {
  saved_layout const l{w.K, w.V};
  index_t const C = chunk_size;
  std::copy(w.S.data(), w.S.data() + w.K * w.V, dst + l.S());
  std::copy(w.Aqk.data(), w.Aqk.data() + C * C, dst + l.Aqk());
  std::copy(w.KK.data(), w.KK.data() + C * C, dst + l.KK());
  std::copy(w.A.data(), w.A.data() + C * C, dst + l.A());
  std::copy(w.R.data(), w.R.data() + C * w.V, dst + l.R());
  std::copy(w.U.data(), w.U.data() + C * w.V, dst + l.U());
}

template <class Acc>
void restore_chunk(chunk_workspace<Acc>& w, Acc const* src) {
  saved_layout const l{w.K, w.V};
  index_t const C = chunk_size;
  std::copy(src + l.S(), src + l.S() + w.K * w.V, w.S.data());
  std::copy(src + l.Aqk(), src + l.Aqk() + C * C, w.Aqk.data());
  std::copy(src + l.KK(), src + l.KK() + C * C, w.KK.data());
  std::copy(src + l.A(), src + l.A() + C * C, w.A.data());
  std::copy(src + l.R(), src + l.R() + C * w.V, w.R.data());
  std::copy(src + l.U(), src + l.U() + C * w.V, w.U.data());
}

template <class Acc, class In, class S>
void chunk_forward_task(problem const& p, forward_args<In, S> const& a, index_t n, index_t hv) {
  index_t const K = p.K, V = p.V, b = p.batch(n), h = hv / p.G, bos = p.bos(n), eos = p.eos(n);
  chunk_workspace<Acc> w(K, V, false);
  Acc const scale = static_cast<Acc>(p.scale);
  load_state<Acc>(a.h0, n, hv, w.S.data(), K, V);
  for (index_t t0 = bos; t0 < eos; t0 += chunk_size) {
    index_t const c = std::min(chunk_size, eos - t0);
    load_chunk(w, a.q, a.k, a.v, a.g, a.beta, b, h, hv, t0, c);
    chunk_prepare(w, c, scale, chunk_lower_bound(w, p.lower_bound));
    if (present(a.saved)) save_chunk(w, &a.saved(hv, p.first_chunk(n) + (t0 - bos) / chunk_size, 0));
    auto O = w.O.topRows(c);
    O.noalias() = scale * w.Qe.topRows(c) * w.S;
    O.noalias() += w.Aqk.topLeftCorner(c, c) * w.U.topRows(c);
    for (index_t r = 0; r < c; ++r) store_row(w.O.row(r).data(), &a.o(b, t0 + r, hv, 0), V);
    chunk_state_update(w, c);
  }
  store_state(a.ht, n, hv, w.S.data(), K, V);
}

// Pushes dAqk (lower incl. diagonal) and dKK (strictly lower) back to dQ, dK, dG (all c x K),
// through the same tiling as chunk_intra. The anchors drop out: each pair's product does not
// depend on them, so their gradient contributions cancel exactly.
template <class Acc>
void chunk_intra_backward(chunk_workspace<Acc>& w, index_t c, Acc scale, std::optional<double> lb) {
  index_t const BC = sub_chunk;
  for (index_t i0 = 0; i0 < c; i0 += BC) {
    index_t const ci = std::min(BC, c - i0);
    auto dQa = w.dQa.topRows(ci);
    auto dKa = w.dKa.topRows(ci);
    if (i0 > 0) {
      anchored_rows(w, i0, ci);
      auto EI = w.EI.topRows(ci);
      auto Qa = w.Qa.topRows(ci);
      auto Ka = w.Ka.topRows(ci);
      dQa.setZero();
      dKa.setZero();
      for (index_t j0 = 0; j0 < i0; j0 += BC) {
        anchored_columns(w, i0, j0);
        auto dAq = w.dAqk.block(i0, j0, ci, BC);
        auto dAk = w.dKK.block(i0, j0, ci, BC);
        dQa.noalias() += scale * dAq * w.Kb;
        dKa.noalias() += dAk * w.Kb;
        w.dKb.noalias() = scale * dAq.transpose() * Qa;
        w.dKb.noalias() += dAk.transpose() * Ka;
        w.dK.middleRows(j0, BC).array() += w.dKb.array() * w.EJ.array();
        w.dG.middleRows(j0, BC).array() -= w.dKb.array() * w.Kb.array();
      }
      w.dQ.middleRows(i0, ci).array() += dQa.array() * EI.array();
      w.dK.middleRows(i0, ci).array() += dKa.array() * EI.array();
      w.dG.middleRows(i0, ci).array() += dQa.array() * Qa.array() + dKa.array() * Ka.array();
    }
    if (lb) {
      dense_diagonal_factors(w, i0, ci, *lb);
      auto EI = w.EI.topRows(ci);
      auto EJ = w.EJ.topRows(ci);
      auto Qa = w.Qa.topRows(ci);
      auto Ka = w.Ka.topRows(ci);
      auto Kb = w.Kb.topRows(ci);
      auto dKb = w.dKb.topRows(ci);
      auto dAq = w.dAqk.block(i0, i0, ci, ci);  // upper part is zero
      auto dAk = w.dKK.block(i0, i0, ci, ci);   // diagonal and upper part are zero
      dQa.noalias() = scale * dAq * Kb;
      dKa.noalias() = dAk * Kb;
      dKb.noalias() = scale * dAq.transpose() * Qa;
      dKb.noalias() += dAk.transpose() * Ka;
      w.dQ.middleRows(i0, ci).array() += dQa.array() * EI.array();
      w.dK.middleRows(i0, ci).array() += dKa.array() * EI.array() + dKb.array() * EJ.array();
      w.dG.middleRows(i0, ci).array() += dQa.array() * Qa.array() + dKa.array() * Ka.array() - dKb.array() * Kb.array();
    } else {
      typename chunk_workspace<Acc>::RowVec aq(BC), ak(BC);
      for (index_t i = i0; i < i0 + ci; ++i) {
        index_t const m = i - i0 + 1;
        auto E = w.EJ.topRows(m);
        auto Kt = w.Kb.topRows(m);
        auto X = w.dKb.topRows(m);
        log_decay_from(w, E, i0, m, i);
        exp_rows(E);
        Kt.array() = w.Kc.middleRows(i0, m).array() * E.array();
        aq.head(m) = scale * w.dAqk.row(i).segment(i0, m);
        ak.head(m) = w.dKK.row(i).segment(i0, m);  // its diagonal entry is zero
        w.dQ.row(i).noalias() += aq.head(m) * Kt;
        w.dK.row(i).noalias() += ak.head(m) * Kt;
        X.noalias() = aq.head(m).transpose() * w.Q.row(i);
        X.noalias() += ak.head(m).transpose() * w.Kc.row(i);
        X.array() *= E.array();
        w.dK.middleRows(i0, m) += X;
        X.array() *= w.Kc.middleRows(i0, m).array();
        w.dG.row(i) += X.colwise().sum();
        w.dG.middleRows(i0, m) -= X;
      }
    }
  }
}

// Backward of sequence n, q/k head h, all value heads of its group.
template <class Acc, class In, class S>
void chunk_backward_task(problem const& p, backward_args<In, S> const& a, index_t n, index_t h) {
  using Mat = typename chunk_workspace<Acc>::Mat;
  using Vec = typename chunk_workspace<Acc>::Vec;
  index_t const K = p.K, V = p.V, b = p.batch(n), bos = p.bos(n), eos = p.eos(n), Tn = eos - bos;
  Acc const scale = static_cast<Acc>(p.scale);
  chunk_workspace<Acc> w(K, V, true);
  index_t const nch = (Tn + chunk_size - 1) / chunk_size;
  // Without the forward's saved states, a first pass recomputes them into the same record.
  bool const given = present(a.saved);
  saved_layout const lay{K, V};
  std::vector<Acc> own(given ? 0 : std::size_t(nch * lay.per()));
  Mat dq = Mat::Zero(Tn, K), dk = Mat::Zero(Tn, K);
  Vec dbeta(chunk_size), dl(K);
  for (index_t hv = h * p.G; hv < (h + 1) * p.G; ++hv) {
    auto record = [&](index_t ch) -> Acc const* {
      return given ? &a.saved(hv, p.first_chunk(n) + ch, 0) : own.data() + ch * lay.per();
    };
    if (!given) {
      load_state<Acc>(a.h0, n, hv, w.S.data(), K, V);
      for (index_t ch = 0; ch < nch; ++ch) {
        index_t const t0 = bos + ch * chunk_size, c = std::min(chunk_size, eos - t0);
        load_chunk(w, a.q, a.k, a.v, a.g, a.beta, b, h, hv, t0, c);
        chunk_prepare(w, c, scale, chunk_lower_bound(w, p.lower_bound));
        save_chunk(w, own.data() + ch * lay.per());
        chunk_state_update(w, c);
      }
    }
    if (present(a.dht))
      load_state<Acc>(a.dht, n, hv, w.dS.data(), K, V);
    else
      w.dS.setZero();
    for (index_t ch = nch; ch-- > 0;) {
      index_t const t0 = bos + ch * chunk_size, c = std::min(chunk_size, eos - t0);
      load_chunk(w, a.q, a.k, a.v, a.g, a.beta, b, h, hv, t0, c);
      restore_chunk(w, record(ch));
      chunk_gates(w, c);
      w.B.topRows(c) = w.beta.head(c).asDiagonal() * w.R.topRows(c);
      for (index_t r = 0; r < c; ++r) load_row(&a.d_o(b, t0 + r, hv, 0), w.dO.row(r).data(), V);
      auto dO = w.dO.topRows(c);
      auto U = w.U.topRows(c);
      auto Aqk = w.Aqk.topLeftCorner(c, c);
      auto A = w.A.topLeftCorner(c, c);
      auto dU = w.dU.topRows(c);
      dU.noalias() = Aqk.transpose() * dO;
      dU.noalias() += w.Kd.topRows(c) * w.dS;
      auto dAqk = w.dAqk.topLeftCorner(c, c);
      dAqk.noalias() = dO * U.transpose();
      dAqk.template triangularView<Eigen::StrictlyUpper>().setZero();
      auto dQ = w.dQ.topRows(c);
      auto dK = w.dK.topRows(c);
      auto dG = w.dG.topRows(c);
      dQ.noalias() = scale * dO * w.S.transpose();  // d(Qe) for now
      dK.noalias() = U * w.dS.transpose();          // d(Kd) for now
      // d G_last from the state decay: e^{G_last} rowsum(S .* dS).
      if (w.split)
        dl = chunk_decay(w, c).array() * (w.S.array() * w.dS.array()).rowwise().sum();
      else
        dl = (w.G.row(c - 1).transpose().array().exp()) * (w.S.array() * w.dS.array()).rowwise().sum();
      auto dB = w.dB.topRows(c);
      dB.noalias() = A.transpose() * dU;
      auto dA = w.dA.topLeftCorner(c, c);
      dA.noalias() = dU * w.B.topRows(c).transpose();
      Mat t1 = A.transpose() * dA;
      auto dKK = w.dKK.topLeftCorner(c, c);
      dKK.noalias() = -t1 * A.transpose();
      dKK.template triangularView<Eigen::Upper>().setZero();
      auto dR = w.dR.topRows(c);
      dR = w.beta.head(c).asDiagonal() * dB;
      dbeta.head(c) = (w.R.topRows(c).array() * dB.array()).rowwise().sum();
      // KK enters through L = Diag(beta) KK.
      dbeta.head(c) += (dKK.array() * w.KK.topLeftCorner(c, c).array()).rowwise().sum().matrix();
      dKK = w.beta.head(c).asDiagonal() * dKK;
      // state gradient for the previous chunk
      if (w.split)
        w.dSn = chunk_decay(w, c).asDiagonal() * w.dS;
      else
        w.dSn = (w.G.row(c - 1).transpose().array().exp()).matrix().asDiagonal() * w.dS;
      w.dSn.noalias() += scale * w.Qe.topRows(c).transpose() * dO;
      w.dSn.noalias() -= w.Ke.topRows(c).transpose() * dR;
      // dKe = -dR S^T; turn d(Qe), d(Ke), d(Kd) into dQ, dK, dG.
      w.tmpV.topRows(c) = dR;  // keep dR (dv) for the store
      Mat dKeM = -(dR * w.S.transpose());
      dG.array() = dQ.array() * w.Qe.topRows(c).array() + dKeM.array() * w.Ke.topRows(c).array() -
                   dK.array() * w.Kd.topRows(c).array();
      dl += (dK.array() * w.Kd.topRows(c).array()).colwise().sum().transpose().matrix();
      dQ.array() *= w.tmpK.topRows(c).array();
      dK.array() = dK.array() * w.tmpK2.topRows(c).array() + dKeM.array() * w.tmpK.topRows(c).array();
      dG.row(c - 1) += dl.transpose();
      chunk_intra_backward(w, c, scale, chunk_lower_bound(w, p.lower_bound));
      // G = cumsum(g) within the chunk: dg is the reverse cumsum of dG.
      for (index_t r = c - 1; r-- > 0;) dG.row(r) += dG.row(r + 1);
      for (index_t r = 0; r < c; ++r) {
        store_row(w.dG.row(r).data(), &a.dg(b, t0 + r, hv, 0), K);
        store_row(w.tmpV.row(r).data(), &a.dv(b, t0 + r, hv, 0), V);
        a.dbeta(b, t0 + r, hv) = store_as<In>(dbeta(r));
      }
      dq.middleRows(t0 - bos, c) += dQ;
      dk.middleRows(t0 - bos, c) += dK;
      std::swap(w.dS, w.dSn);
    }
    store_state(a.dh0, n, hv, w.dS.data(), K, V);
  }
  for (index_t t = 0; t < Tn; ++t) {
    store_row(dq.row(t).data(), &a.dq(b, bos + t, h, 0), K);
    store_row(dk.row(t).data(), &a.dk(b, bos + t, h, 0), K);
  }
}

}  // namespace k3::kda::detail
