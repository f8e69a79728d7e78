// k3/dplr/chunked.hpp — chunked DPLR forward and backward on the CPU backends.
//
// Work split: with at least as many (sequence, head) pairs as threads, each pair runs on one
// thread. With fewer (a single long sequence), each pair uses every thread: either
//  - value_split: the V state columns are split across threads (columns of the state evolve
//    independently; the K-side intra-chunk quantities are shared); the intra-chunk work of
//    each chunk is done once, by whichever thread is free, a few chunks ahead of the state
//    pass, in one fan-out with atomic hand-offs (pipeline.hpp), or
//  - segment_maps: the tokens are split into one segment per thread; each segment's affine
//    map S -> M S + N is computed, an exclusive scan composes them, and each segment is then
//    finished from its true initial state (see maps.hpp).
// The value split is deterministic: 1, 2, ... threads give the single-thread outputs, final
// states and gradients bit for bit (and so do the maps, whose K + V columns split the same way).
// Every product over state columns is one fma chain per entry whatever block of columns
// computes it (cols_gemm, chunk_kernels.hpp), and the backward's sums over the V columns (the
// parameter gradients) are taken once per chunk over the whole width, not per part and added.
// segment_maps is a different computation (composed maps): close, not bit for bit.
//
// Non-finite inputs: a NaN or Inf at token t of a (sequence, head) reaches no output before t
// and no other sequence or head (bit for bit as without it), and no gradient before t when it
// is in k or v (gradients before t read later q, a, b, gk through the state-gradient chain,
// where a NaN spreads as in the recurrent reference). Each chunk holding one is also computed
// as its "twin" with those inputs set to 0 (chunk_kernels.hpp), which costs nothing otherwise.
// One exception: a -inf gate at t in the backward may move its chunk onto the pairwise
// intra-chunk form, so gradients before t stay finite and accurate but not bit for bit.
#pragma once
#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/core/concepts.hpp"
#include "k3/dplr/chunk_kernels.hpp"
#include "k3/dplr/pipeline.hpp"
#include "k3/dplr/serial.hpp"

namespace k3 {
namespace detail::dplr {

// Executors: run(n, f) calls f(i) for i in [0, n).
struct serial_par {
  int size() const { return 1; }
  template <class F>
  void run(index_t n, F&& f) const {
    for (index_t i = 0; i < n; ++i) f(i);
  }
};
struct pool_par {
  cpu::thread_pool* pool;
  int size() const { return pool->size(); }
  template <class F>
  void run(index_t n, F&& f) const {
    pool->run(n, f);
  }
};

template <class Bk>
auto make_par(Bk const& bk) {
  if constexpr (requires { bk.pool(); }) return pool_par{&bk.pool()};
  else return serial_par{};
}

template <class R>
struct head_cfg {
  R scale;
  index_t C;
  intra_form mode;
  index_t K, V;
};

inline index_t num_chunks(index_t L, index_t C) { return (L + C - 1) / C; }

// Column ranges for a split of `w` columns into `parts`.
inline std::pair<index_t, index_t> col_range(index_t w, index_t parts, index_t p) { return {w * p / parts, w * (p + 1) / parts}; }

// Threads and ring slots of the single-sequence pipeline (pipeline.hpp): one part (block of
// state columns) per thread, at most one per column.
template <class Par>
index_t pipeline_parts(Par const& par, index_t W) {
  return par.size() > 1 ? std::max<index_t>(1, std::min<index_t>(par.size(), W)) : 1;
}
template <class Par>
index_t pipeline_slots(Par const& par, index_t nch) {
  return std::max<index_t>(1, std::min<index_t>(par.size() > 1 ? 2 * par.size() + 2 : 1, nch));
}

// Forward over one (sequence, head). W = width of the state columns; load(t0, c, c0, w, m)
// fills m (c x w) with the value columns [c0, c0+w) of tokens t0..t0+c. S (K x W) is advanced
// in place. emit(t0, c0, O) receives outputs (when non-null). states, when non-null, receives
// the start state of every chunk.
// tk: the twin of a chunk with non-finite inputs (chunk_kernels.hpp): outputs when emitting
// values, kv for a map (its first K columns, M, have zero values and take the twin).
template <class T, class R, class Par, class Load, class Emit>
void head_forward(Par const& par, head_views<T> const& hv, head_cfg<R> const& cfg, index_t W, mat<R>& S, Load&& load, Emit* emit,
                  std::vector<mat<R>>* states, twin_kind tk = twin_kind::none) {
  index_t const L = hv.len, C = cfg.C, nch = num_chunks(L, C);
  index_t const ns = pipeline_parts(par, W);
  std::vector<chunk_fwd<R>> pres(static_cast<std::size_t>(pipeline_slots(par, nch)));
  std::vector<chunk_pre<R>> scratch(static_cast<std::size_t>(par.size()));
  struct part {
    mat<R> S, Vc, O;
  };
  std::vector<part> pt(static_cast<std::size_t>(ns));
  for (index_t p = 0; p < ns; ++p) {
    auto [c0, c1] = col_range(W, ns, p);
    pt[p].S = S.middleCols(c0, c1 - c0);
  }
  if (states) states->assign(static_cast<std::size_t>(nch), mat<R>(cfg.K, W));
  run_pipeline(
      par, nch, ns, static_cast<index_t>(pres.size()),
      [&](index_t s, index_t k, index_t worker) {
        index_t t0 = s * C;
        make_pre(hv, t0, std::min(C, L - t0), cfg.scale, cfg.mode, scratch[worker], false, tk);
        pres[k].take(scratch[worker]);
      },
      [&](index_t p, index_t s, index_t k) {
        auto [c0, c1] = col_range(W, ns, p);
        auto const& pr = pres[k];
        auto& q = pt[p];
        if (states) (*states)[s].middleCols(c0, c1 - c0) = q.S;
        load(pr.t0, pr.c, c0, c1 - c0, q.Vc);
        if (pr.twin && tk == twin_kind::outputs) {
          // rows before the first non-finite input from the twin
          mat<R> S2 = q.S, V2 = pr.tv.middleCols(c0, c1 - c0), O2;
          chunk_forward(*pr.twin, V2, S2, &O2);
          chunk_forward(pr, q.Vc, q.S, &q.O);
          q.O.topRows(pr.bad) = O2.topRows(pr.bad);
        } else if (pr.twin && tk == twin_kind::kv && c0 < cfg.K) {
          // the map's M columns (zero values) from the twin, its N columns as they are
          index_t const m = std::min(c1, cfg.K) - c0, w = c1 - c0;
          mat<R> Sm = q.S.leftCols(m), Vm = mat<R>::Zero(pr.c, m);
          chunk_forward(*pr.twin, Vm, Sm, static_cast<mat<R>*>(nullptr));
          if (m < w) {
            mat<R> Sn = q.S.rightCols(w - m), Vn = q.Vc.rightCols(w - m);
            chunk_forward(pr, Vn, Sn, static_cast<mat<R>*>(nullptr));
            q.S.rightCols(w - m) = Sn;
          }
          q.S.leftCols(m) = Sm;
        } else {
          chunk_forward(pr, q.Vc, q.S, emit ? &q.O : nullptr);
        }
        if (emit) (*emit)(pr.t0, c0, q.O);
      },
      [](index_t, index_t) {});
  for (index_t p = 0; p < ns; ++p) {
    auto [c0, c1] = col_range(W, ns, p);
    S.middleCols(c0, c1 - c0) = pt[p].S;
  }
}

template <class T>
struct head_grad_views {
  tensor_view<T, 2> dq, dk, dv, da, db, dgk;
};

// Backward over one (sequence, head). S0: initial state; dS: in = gradient of the final state,
// out = gradient of the initial state.
template <class T, class R, class Par>
void head_backward(Par const& par, head_views<T> const& hv, head_cfg<R> const& cfg, mat<R> const& S0, mat<R>& dS, const_view<T, 2> const& dO,
                   head_grad_views<T> const& g) {
  index_t const L = hv.len, C = cfg.C, nch = num_chunks(L, C), V = cfg.V, K = cfg.K;
  std::vector<mat<R>> states;
  {
    mat<R> S = S0;
    auto load = [&](index_t t0, index_t c, index_t c0, index_t w, mat<R>& m) { load_cols(hv.v, t0, c, c0, w, m); };
    using E = void (*)(index_t, index_t, mat<R> const&);
    head_forward<T, R>(par, hv, cfg, V, S, load, static_cast<E*>(nullptr), &states);
  }
  index_t const ns = pipeline_parts(par, V);
  std::vector<chunk_pre<R>> pres(static_cast<std::size_t>(pipeline_slots(par, nch))), scratch(static_cast<std::size_t>(par.size()));
  // Per ring slot, over all V columns (each part writes its own): X and Y of the chunk (and of
  // its twin, a chunk with a non-finite k or v) and the gradient of its end state. The sums over
  // the columns that the parameter gradients need are then taken once, in finish, the same way
  // whatever the number of parts: the gradients do not depend on the thread count.
  struct slot {
    mat<R> X, Y, dS, X2, Y2;
  };
  std::vector<slot> sl(pres.size());
  struct part {
    mat<R> dS, Vc, dOc, dVc, Sc;
  };
  std::vector<part> pt(static_cast<std::size_t>(ns));
  for (index_t p = 0; p < ns; ++p) {
    auto [c0, c1] = col_range(V, ns, p);
    pt[p].dS = dS.middleCols(c0, c1 - c0);
  }
  run_pipeline(
      par, nch, ns, static_cast<index_t>(pres.size()),
      [&](index_t s, index_t k, index_t worker) {
        index_t t0 = (nch - 1 - s) * C;
        make_pre(hv, t0, std::min(C, L - t0), cfg.scale, cfg.mode, scratch[worker], true, twin_kind::kv);
        pres[k].take(scratch[worker]);
        index_t const c = pres[k].c;
        sl[k].X.resize(c, V);
        sl[k].Y.resize(c, V);
        sl[k].dS.resize(K, V);
        if (pres[k].twin) {
          sl[k].X2.resize(c, V);
          sl[k].Y2.resize(c, V);
        }
      },
      [&](index_t p, index_t s, index_t k) {
        auto [c0, c1] = col_range(V, ns, p);
        auto const& pr = pres[k];
        auto& q = pt[p];
        auto& b = sl[k];
        load_cols(hv.v, pr.t0, pr.c, c0, c1 - c0, q.Vc);
        load_cols(dO, pr.t0, pr.c, c0, c1 - c0, q.dOc);
        q.Sc = states[nch - 1 - s].middleCols(c0, c1 - c0);
        b.dS.middleCols(c0, c1 - c0) = q.dS;
        if (pr.twin) {
          // The twin's X and Y for its parameter-gradient sums; its dV and state gradient equal
          // the chunk's before `bad` (neither reads k or v of later tokens), so they are dropped.
          mat<R> dS2 = q.dS, dV2, V2 = pr.tv.middleCols(c0, c1 - c0);
          chunk_backward(*pr.twin, V2, q.Sc, dS2, q.dOc, dV2, b.X2.data() + c0, b.Y2.data() + c0, V);
        }
        chunk_backward(pr, q.Vc, q.Sc, q.dS, q.dOc, q.dVc, b.X.data() + c0, b.Y.data() + c0, V);
        store_cols(g.dv, pr.t0, c0, q.dVc);
      },
      [&](index_t s, index_t k) {
        auto const& pr = pres[k];
        auto& b = sl[k];
        mat<R> Vf, dOf;
        load_cols(hv.v, pr.t0, pr.c, 0, V, Vf);
        load_cols(dO, pr.t0, pr.c, 0, V, dOf);
        mat<R> const& S = states[nch - 1 - s];
        chunk_acc<R> acc;
        chunk_accumulate(acc, Vf, S, b.dS, dOf, b.X, b.Y);
        if (pr.twin) {
          chunk_acc<R> acc2;
          chunk_accumulate(acc2, pr.tv, S, b.dS, dOf, b.X2, b.Y2);
          chunk_param_grads<T, R>(*pr.twin, acc2, g.dq, g.dk, g.da, g.db, g.dgk, 0, pr.bad);
          chunk_param_grads<T, R>(pr, acc, g.dq, g.dk, g.da, g.db, g.dgk, pr.bad, pr.c);
        } else {
          chunk_param_grads<T, R>(pr, acc, g.dq, g.dk, g.da, g.db, g.dgk);
        }
      });
  for (index_t p = 0; p < ns; ++p) {
    auto [c0, c1] = col_range(V, ns, p);
    dS.middleCols(c0, c1 - c0) = pt[p].dS;
  }
}

// Gradient chain alone over a span: dS in = gradient at the span end, out = at its start.
// W-wide columns; loadO(t0, c, c0, w, m) gives the output-gradient columns.
template <class T, class R, class Par, class LoadO>
void head_dstate(Par const& par, head_views<T> const& hv, head_cfg<R> const& cfg, index_t W, mat<R>& dS, LoadO&& loadO) {
  index_t const L = hv.len, C = cfg.C, nch = num_chunks(L, C);
  index_t const ns = pipeline_parts(par, W);
  std::vector<chunk_pre<R>> pres(static_cast<std::size_t>(pipeline_slots(par, nch))), scratch(static_cast<std::size_t>(par.size()));
  struct part {
    mat<R> dS, dOc;
  };
  std::vector<part> pt(static_cast<std::size_t>(ns));
  for (index_t p = 0; p < ns; ++p) {
    auto [c0, c1] = col_range(W, ns, p);
    pt[p].dS = dS.middleCols(c0, c1 - c0);
  }
  run_pipeline(
      par, nch, ns, static_cast<index_t>(pres.size()),
      [&](index_t s, index_t k, index_t worker) {
        index_t t0 = (nch - 1 - s) * C;
        make_pre(hv, t0, std::min(C, L - t0), cfg.scale, cfg.mode, scratch[worker]);
        pres[k].take(scratch[worker]);
      },
      [&](index_t p, index_t, index_t k) {
        auto [c0, c1] = col_range(W, ns, p);
        auto& q = pt[p];
        loadO(pres[k].t0, pres[k].c, c0, c1 - c0, q.dOc);
        chunk_dstate(pres[k], q.dOc, q.dS);
      },
      [](index_t, index_t) {});
  for (index_t p = 0; p < ns; ++p) {
    auto [c0, c1] = col_range(W, ns, p);
    dS.middleCols(c0, c1 - c0) = pt[p].dS;
  }
}

// one(executor, task) over (sequence, head) tasks: one task per thread when there are enough,
// else every thread works inside each task in turn (the single-sequence pipeline).
template <class Par, class F>
void for_each_head(Par const& par, index_t tasks, F&& one) {
  if (par.size() == 1 || tasks >= par.size()) par.run(tasks, [&](index_t i) { one(serial_par{}, i); });
  else
    for (index_t i = 0; i < tasks; ++i) one(par, i);
}

template <class S, class R>
void load_state_mat(const_view<S, 4> const& h0, index_t n, index_t h, index_t K, index_t V, mat<R>& m) {
  m.setZero(K, V);
  if (!k3::present(h0)) return;
  for (index_t i = 0; i < K; ++i)
    for (index_t j = 0; j < V; ++j) m(i, j) = R(h0(n, h, i, j));
}

template <class S, class R>
void store_state_mat(tensor_view<S, 4> const& ht, index_t n, index_t h, mat<R> const& m) {
  if (!k3::present(ht)) return;
  for (index_t i = 0; i < m.rows(); ++i)
    for (index_t j = 0; j < m.cols(); ++j) ht(n, h, i, j) = static_cast<S>(m(i, j));
}

// Forward of one (sequence, head) on par: value columns, outputs into o.
template <class T, class R, class Par>
void head_forward_values(Par const& par, head_views<T> const& hv, head_cfg<R> const& cfg, mat<R>& S, tensor_view<T, 2> const& o) {
  auto load = [&](index_t t0, index_t c, index_t c0, index_t w, mat<R>& m) { load_cols(hv.v, t0, c, c0, w, m); };
  auto emit = [&](index_t t0, index_t c0, mat<R> const& O) { store_cols(o, t0, c0, O); };
  head_forward<T, R>(par, hv, cfg, cfg.V, S, load, &emit, nullptr, twin_kind::outputs);
}

// The affine map of a whole span: [M | N] = run the homogeneous recurrence from [I | 0] with
// values [0 | V] (the augmented state has K + V columns).
template <class T, class R, class Par>
void head_map(Par const& par, head_views<T> const& hv, head_cfg<R> const& cfg, mat<R>& MN) {
  index_t const K = cfg.K, V = cfg.V;
  MN.setZero(K, K + V);
  MN.leftCols(K).setIdentity();
  auto load = [&](index_t t0, index_t c, index_t c0, index_t w, mat<R>& m) {
    m.setZero(c, w);
    index_t lo = std::max(c0, K), hi = c0 + w;
    for (index_t r = 0; r < c && lo < hi; ++r)
      for (index_t j = lo; j < hi; ++j) m(r, j - c0) = R(hv.v(t0 + r, j - K));
  };
  using E = void (*)(index_t, index_t, mat<R> const&);
  head_forward<T, R>(par, hv, cfg, K + V, MN, load, static_cast<E*>(nullptr), nullptr, twin_kind::kv);
}

// The transposed map of a span: [Mt | G] with dS_in = Mt dS_out + G(dO).
template <class T, class R, class Par>
void head_map_transposed(Par const& par, head_views<T> const& hv, head_cfg<R> const& cfg, const_view<T, 2> const& dO, mat<R>& MtG) {
  index_t const K = cfg.K, V = cfg.V;
  MtG.setZero(K, K + V);
  MtG.leftCols(K).setIdentity();
  auto loadO = [&](index_t t0, index_t c, index_t c0, index_t w, mat<R>& m) {
    m.setZero(c, w);
    index_t lo = std::max(c0, K), hi = c0 + w;
    for (index_t r = 0; r < c && lo < hi; ++r)
      for (index_t j = lo; j < hi; ++j) m(r, j - c0) = R(dO(t0 + r, j - K));
  };
  head_dstate<T, R>(par, hv, cfg, K + V, MtG, loadO);
}

template <class T>
head_views<T> sub_span(head_views<T> const& hv, index_t t0, index_t n) {
  return {hv.q.sub(0, t0, n), hv.k.sub(0, t0, n), hv.v.sub(0, t0, n), hv.a.sub(0, t0, n), hv.b.sub(0, t0, n), hv.gk.sub(0, t0, n), n};
}

// Segment boundaries for splitting L tokens across P workers, aligned to chunks so that each
// segment's chunking is the single-thread chunking.
inline std::vector<index_t> segment_bounds(index_t L, index_t C, index_t P) {
  index_t nch = num_chunks(L, C);
  std::vector<index_t> b(static_cast<std::size_t>(P + 1));
  for (index_t p = 0; p <= P; ++p) b[p] = std::min(L, (nch * p / P) * C);
  b[P] = L;
  return b;
}

// Segment-map context parallelism on threads, forward.
template <class T, class R, class Par>
void head_forward_segments(Par const& par, head_views<T> const& hv, head_cfg<R> const& cfg, mat<R>& S, tensor_view<T, 2> const& o) {
  index_t const P = par.size(), K = cfg.K, V = cfg.V;
  auto bnd = segment_bounds(hv.len, cfg.C, P);
  std::vector<mat<R>> MN(static_cast<std::size_t>(P)), Sin(static_cast<std::size_t>(P + 1));
  Sin[0] = S;
  serial_par one;
  par.run(P, [&](index_t p) {
    auto seg = sub_span(hv, bnd[p], bnd[p + 1] - bnd[p]);
    if (p == 0) {
      Sin[1] = Sin[0];
      head_forward_values<T, R>(one, seg, cfg, Sin[1], o.sub(0, bnd[0], bnd[1] - bnd[0]));
    } else {
      head_map<T, R>(one, seg, cfg, MN[p]);
    }
  });
  for (index_t p = 1; p < P; ++p) {
    Sin[p + 1] = MN[p].rightCols(V);
    Sin[p + 1].noalias() += MN[p].leftCols(K) * Sin[p];
  }
  par.run(P - 1, [&](index_t i) {
    index_t p = i + 1;
    auto seg = sub_span(hv, bnd[p], bnd[p + 1] - bnd[p]);
    mat<R> Sp = Sin[p];
    head_forward_values<T, R>(one, seg, cfg, Sp, o.sub(0, bnd[p], bnd[p + 1] - bnd[p]));
  });
  S = Sin[P];
}

template <class T>
head_grad_views<T> sub_grads(head_grad_views<T> const& g, index_t t0, index_t n) {
  return {g.dq.sub(0, t0, n), g.dk.sub(0, t0, n), g.dv.sub(0, t0, n), g.da.sub(0, t0, n), g.db.sub(0, t0, n), g.dgk.sub(0, t0, n)};
}

// Segment-map context parallelism on threads, backward: the forward scan gives each
// segment's initial state, the mirrored scan with the transposed maps gives the gradient at
// each segment's end, then every segment runs its ordinary backward.
template <class T, class R, class Par>
void head_backward_segments(Par const& par, head_views<T> const& hv, head_cfg<R> const& cfg, mat<R> const& S0, mat<R>& dS,
                            const_view<T, 2> const& dO, head_grad_views<T> const& g) {
  index_t const P = par.size(), K = cfg.K, V = cfg.V;
  auto bnd = segment_bounds(hv.len, cfg.C, P);
  std::vector<mat<R>> MN(static_cast<std::size_t>(P)), G(static_cast<std::size_t>(P));
  serial_par one;
  par.run(P, [&](index_t p) {
    auto seg = sub_span(hv, bnd[p], bnd[p + 1] - bnd[p]);
    head_map<T, R>(one, seg, cfg, MN[p]);
    if (p > 0) {
      // G: the state gradient the segment's own outputs send back (zero gradient at its end).
      G[p].setZero(K, V);
      auto dOs = dO.sub(0, bnd[p], bnd[p + 1] - bnd[p]);
      auto loadO = [&](index_t t0, index_t c, index_t c0, index_t w, mat<R>& m) { load_cols(dOs, t0, c, c0, w, m); };
      head_dstate<T, R>(one, seg, cfg, V, G[p], loadO);
    }
  });
  std::vector<mat<R>> Sin(static_cast<std::size_t>(P)), dSout(static_cast<std::size_t>(P));
  Sin[0] = S0;
  for (index_t p = 0; p + 1 < P; ++p) {
    Sin[p + 1] = MN[p].rightCols(V);
    Sin[p + 1].noalias() += MN[p].leftCols(K) * Sin[p];
  }
  dSout[P - 1] = dS;
  for (index_t p = P - 1; p > 0; --p) {
    dSout[p - 1] = G[p];
    dSout[p - 1].noalias() += MN[p].leftCols(K).transpose() * dSout[p];
  }
  par.run(P, [&](index_t p) {
    auto seg = sub_span(hv, bnd[p], bnd[p + 1] - bnd[p]);
    head_backward<T, R>(one, seg, cfg, Sin[p], dSout[p], dO.sub(0, bnd[p], bnd[p + 1] - bnd[p]), sub_grads(g, bnd[p], bnd[p + 1] - bnd[p]));
  });
  dS = dSout[0];
}

}  // namespace detail::dplr
}  // namespace k3

namespace k3 {
namespace detail::dplr {

// Chunked forward. Backends: cpu::serial, cpu::simd<>, cpu::threads<> (threads fan out over
// (sequence, head) pairs, or inside each pair when there are fewer pairs than threads).
template <class T, class Bk>
void chunked_forward(Bk const& bk, ::k3::dplr::forward_args<T> const& a, options const& opt) {
  using R = state_t<T>;
  namespace d = ::k3::detail::dplr;
  auto const in = inputs_of(a);
  auto p = d::make_problem(in, opt);
  d::check_outputs(p, in, a.o, a.ht);
  d::head_cfg<R> cfg{R(p.scale), p.chunk, opt.intra, p.K, p.V};
  k3::detail::subnormals_flushed const flush;  // chunk forms: see k3/core/float_env.hpp
  auto par = d::make_par(bk);
  index_t const tasks = p.N * p.H;
  auto one = [&](auto const& ex, index_t task) {
    index_t n = task / p.H, h = task % p.H;
    d::mat<R> S;
    d::load_state_mat(in.h0, n, h, p.K, p.V, S);
    auto hv = d::head_of(in, p.seqs[n], h);
    auto o = d::head_slice<T>(a.o, p.seqs[n], h);
    if (ex.size() > 1 && opt.long_sequence == sequence_split::segment_maps) d::head_forward_segments<T, R>(ex, hv, cfg, S, o);
    else d::head_forward_values<T, R>(ex, hv, cfg, S, o);
    d::store_state_mat(a.ht, n, h, S);
  };
  d::for_each_head(par, tasks, one);
}

// Chunked backward: dq dk dv da db dgk (and dh0 when given) from d_o (and dht when given).
template <class T, class Bk>
void chunked_backward(Bk const& bk, ::k3::dplr::backward_args<T> const& g, options const& opt) {
  using R = state_t<T>;
  namespace d = ::k3::detail::dplr;
  auto const in = inputs_of(g);
  auto p = d::make_problem(in, opt);
  d::check_grads(p, g);
  d::head_cfg<R> cfg{R(p.scale), p.chunk, opt.intra, p.K, p.V};
  k3::detail::subnormals_flushed const flush;  // chunk forms: see k3/core/float_env.hpp
  auto par = d::make_par(bk);
  index_t const tasks = p.N * p.H;
  auto one = [&](auto const& ex, index_t task) {
    index_t n = task / p.H, h = task % p.H;
    auto const& s = p.seqs[n];
    d::mat<R> S0, dS;
    d::load_state_mat(in.h0, n, h, p.K, p.V, S0);
    d::load_state_mat(g.dht, n, h, p.K, p.V, dS);
    auto hv = d::head_of(in, s, h);
    d::head_grad_views<T> hg = {d::head_slice<T>(g.dq, s, h), d::head_slice<T>(g.dk, s, h), d::head_slice<T>(g.dv, s, h),
                                d::head_slice<T>(g.da, s, h), d::head_slice<T>(g.db, s, h), d::head_slice<T>(g.dgk, s, h)};
    auto dO = d::head_slice<T>(g.d_o, s, h);
    if (ex.size() > 1 && opt.long_sequence == sequence_split::segment_maps) d::head_backward_segments<T, R>(ex, hv, cfg, S0, dS, dO, hg);
    else d::head_backward<T, R>(ex, hv, cfg, S0, dS, dO, hg);
    d::store_state_mat(g.dh0, n, h, dS);
  };
  d::for_each_head(par, tasks, one);
}

}  // namespace detail::dplr
}  // namespace k3

namespace k3::dplr {

// o and ht (when given) from the inputs. options::mode chunk: the chunked form on `be`
// (cpu::serial, cpu::simd<>, cpu::threads<>: threads fan out over (sequence, head) pairs, or
// inside each pair when there are fewer pairs than threads); recurrent: the token-by-token
// reference, serially on the calling thread for any host backend.
template <HostBackend B, class T>
void forward(B const& be, forward_args<T> const& a, options const& opt = {}) {
  if (opt.mode == algorithm::recurrent) detail::dplr::recurrent_forward(a, opt);
  else detail::dplr::chunked_forward(be, a, opt);
}

// dq dk dv da db dgk (and dh0 when given) from d_o (and dht when given); forms as for forward.
template <HostBackend B, class T>
void backward(B const& be, backward_args<T> const& a, options const& opt = {}) {
  if (opt.mode == algorithm::recurrent) detail::dplr::recurrent_backward(a, opt);
  else detail::dplr::chunked_backward(be, a, opt);
}

}  // namespace k3::dplr
