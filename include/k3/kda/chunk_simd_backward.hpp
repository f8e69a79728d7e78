// k3/kda/chunk_simd_backward.hpp — the chunked backward on the simd and threads backends:
// the algebra of chunk_backward_task (chunk.hpp) with every product over the state or the
// value dimension done by small_gemm (chunk_simd.hpp).
//
// Per chunk, in reverse order, the backward reads the chunk's record (saved_layout: the
// chunk-start state S, Aqk, KK, A, R = V - Ke S and U). With backward_args::saved the records
// are the ones the chunked forward wrote and are read in place; without it, a first pass over
// the sequence recomputes them (the forward's state recurrence) into a per-thread buffer.
#pragma once
#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/simd.hpp"
#include "k3/kda/chunk.hpp"
#include "k3/kda/chunk_simd.hpp"
#include "k3/kda/common.hpp"
#include "k3/kda/recurrent.hpp"
#include "k3/kda/recurrent_simd.hpp"

namespace k3::kda::detail {

// chunk_intra_backward for the lower-bounded gate with the same batching as chunk_intra_simd:
// per row block I and anchor, [dQa; dKa] = [scale dAq; dAk] Kb and
// dKb = [scale dAq; dAk]^T [Qa; Ka] over all columns J at once (the anchors drop out, as there).
template <class Arch, class Acc>
struct chunk_intra_backward_simd {
  using Mat = typename chunk_workspace<Acc>::Mat;
  using batch = xsimd::batch<Acc, Arch>;
  static constexpr index_t L = index_t(batch::size);
  index_t K, Kp;
  Mat EI, QKa, EJ, Kb, Xa, D1, dKb;
  std::vector<Acc> cv;

  explicit chunk_intra_backward_simd(index_t K_) : K(K_), Kp(padded_v<Arch, Acc>(K_)) {
    index_t const C = chunk_size, s = sub_chunk;
    EI.setZero(s, Kp);
    QKa.setZero(2 * s, Kp);
    EJ.setZero(C, Kp);
    Kb.setZero(C, Kp);
    Xa.setZero(2 * s, C);
    D1.setZero(2 * s, Kp);
    dKb.setZero(C, Kp);
    cv.assign(std::size_t(K), Acc(0));
  }

  void operator()(chunk_workspace<Acc>& w, index_t c, Acc scale, std::optional<double> lb) {
    if (!lb) return chunk_intra_backward(w, c, scale, lb);
    using gemm = small_gemm<Arch, Acc>;
    index_t const C = chunk_size, BC = sub_chunk;
    Acc const lb8 = Acc(8 * *lb);
    for (index_t i0 = 0; i0 < c; i0 += BC) {
      index_t const ci = std::min(BC, c - i0);
      for (int diag = 0; diag < 2; ++diag) {
        if (!diag && i0 == 0) continue;
        Acc const* an = w.G.row(i0).data();
        if (diag) {
          for (index_t d = 0; d < K; ++d) cv[std::size_t(d)] = (i0 == 0 ? Acc(0) : w.G(i0 - 1, d)) + lb8;
          an = cv.data();
        }
        index_t const j0 = diag ? i0 : 0, nj = diag ? ci : i0;
        for (index_t r = 0; r < ci; ++r) {
          Acc const* K3_RESTRICT g = w.G.row(i0 + r).data();
          Acc const* K3_RESTRICT q = w.Q.row(i0 + r).data();
          Acc const* K3_RESTRICT k = w.Kc.row(i0 + r).data();
          Acc* K3_RESTRICT ei = EI.row(r).data();
          Acc* K3_RESTRICT qa = QKa.row(r).data();
          Acc* K3_RESTRICT ka = QKa.row(ci + r).data();
          index_t d = 0;
          for (; d + L <= K; d += L) {
            batch const e = xsimd::exp(batch::load_unaligned(g + d) - batch::load_unaligned(an + d));
            e.store_unaligned(ei + d);
            (batch::load_unaligned(q + d) * e).store_unaligned(qa + d);
            (batch::load_unaligned(k + d) * e).store_unaligned(ka + d);
          }
          for (; d < K; ++d) {
            ei[d] = std::exp(g[d] - an[d]);
            qa[d] = q[d] * ei[d];
            ka[d] = k[d] * ei[d];
          }
        }
        for (index_t j = 0; j < nj; ++j) {
          Acc const* K3_RESTRICT g = w.G.row(j0 + j).data();
          Acc const* K3_RESTRICT k = w.Kc.row(j0 + j).data();
          Acc* K3_RESTRICT ej = EJ.row(j).data();
          Acc* K3_RESTRICT kb = Kb.row(j).data();
          index_t d = 0;
          for (; d + L <= K; d += L) {
            batch const e = xsimd::exp(batch::load_unaligned(an + d) - batch::load_unaligned(g + d));
            e.store_unaligned(ej + d);
            (batch::load_unaligned(k + d) * e).store_unaligned(kb + d);
          }
          for (; d < K; ++d) {
            ej[d] = std::exp(an[d] - g[d]);
            kb[d] = k[d] * ej[d];
          }
        }
        for (index_t r = 0; r < ci; ++r) {
          Acc const* aq = w.dAqk.row(i0 + r).data() + j0;
          Acc const* ak = w.dKK.row(i0 + r).data() + j0;
          Acc* xq = Xa.row(r).data();
          Acc* xk = Xa.row(ci + r).data();
          for (index_t j = 0; j < nj; ++j) {
            xq[j] = scale * aq[j];
            xk[j] = ak[j];
          }
        }
        gemm::run(2 * ci, Kp, nj, Xa.data(), C, Kb.data(), Kp, D1.data(), Kp);
        gemm::run_t(nj, Kp, 2 * ci, Xa.data(), C, QKa.data(), Kp, dKb.data(), Kp);
        for (index_t j = 0; j < nj; ++j) {
          Acc const* K3_RESTRICT x = dKb.row(j).data();
          Acc const* K3_RESTRICT ej = EJ.row(j).data();
          Acc const* K3_RESTRICT kb = Kb.row(j).data();
          Acc* K3_RESTRICT dk = w.dK.row(j0 + j).data();
          Acc* K3_RESTRICT dg = w.dG.row(j0 + j).data();
          // explicit batches: g++ does not vectorise these loops (it ignores restrict on locals)
          index_t d = 0;
          for (; d + L <= K; d += L) {
            batch const xv = batch::load_unaligned(x + d);
            k3::simd::fma(xv, batch::load_unaligned(ej + d), batch::load_unaligned(dk + d)).store_unaligned(dk + d);
            k3::simd::fnma(xv, batch::load_unaligned(kb + d), batch::load_unaligned(dg + d)).store_unaligned(dg + d);
          }
          for (; d < K; ++d) {
            dk[d] += x[d] * ej[d];
            dg[d] -= x[d] * kb[d];
          }
        }
        for (index_t r = 0; r < ci; ++r) {
          Acc const* K3_RESTRICT dqa = D1.row(r).data();
          Acc const* K3_RESTRICT dka = D1.row(ci + r).data();
          Acc const* K3_RESTRICT ei = EI.row(r).data();
          Acc const* K3_RESTRICT qa = QKa.row(r).data();
          Acc const* K3_RESTRICT ka = QKa.row(ci + r).data();
          Acc* K3_RESTRICT dq = w.dQ.row(i0 + r).data();
          Acc* K3_RESTRICT dk = w.dK.row(i0 + r).data();
          Acc* K3_RESTRICT dg = w.dG.row(i0 + r).data();
          index_t d = 0;
          for (; d + L <= K; d += L) {
            batch const a1 = batch::load_unaligned(dqa + d), a2 = batch::load_unaligned(dka + d), e = batch::load_unaligned(ei + d);
            k3::simd::fma(a1, e, batch::load_unaligned(dq + d)).store_unaligned(dq + d);
            k3::simd::fma(a2, e, batch::load_unaligned(dk + d)).store_unaligned(dk + d);
            k3::simd::fma(a2, batch::load_unaligned(ka + d), k3::simd::fma(a1, batch::load_unaligned(qa + d), batch::load_unaligned(dg + d)))
                .store_unaligned(dg + d);
          }
          for (; d < K; ++d) {
            dq[d] += dqa[d] * ei[d];
            dk[d] += dka[d] * ei[d];
            dg[d] += dqa[d] * qa[d] + dka[d] * ka[d];
          }
        }
      }
    }
  }
};

// The rows of one head sit at a stride of H*K (HV*V) elements, each on its own page, which the
// hardware prefetchers do not follow: the next chunk's input rows are prefetched while this
// chunk computes, with prefetch_l2 (common.hpp).
template <class T>
void prefetch_rows_l2(tensor_view<T, 4> x, index_t b, index_t t0, index_t h, index_t r0, index_t r1) noexcept {
  index_t const bytes = x.extent(3) * index_t(sizeof(T));
  for (index_t r = r0; r < r1; ++r) {
    char const* c = reinterpret_cast<char const*>(&x(b, t0 + r, h, 0));
    for (index_t o = 0; o < bytes; o += 64) prefetch_l2(c + o);
  }
}

// sum_i x_i y_i over n entries, vectorised (n a multiple of the batch width or not).
template <class Arch, class Acc>
inline Acc dot_simd(Acc const* K3_RESTRICT x, Acc const* K3_RESTRICT y, index_t n) noexcept {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  batch acc0(Acc(0)), acc1(Acc(0));
  index_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    acc0 = k3::simd::fma(batch::load_unaligned(x + i), batch::load_unaligned(y + i), acc0);
    acc1 = k3::simd::fma(batch::load_unaligned(x + i + L), batch::load_unaligned(y + i + L), acc1);
  }
  for (; i + L <= n; i += L) acc0 = k3::simd::fma(batch::load_unaligned(x + i), batch::load_unaligned(y + i), acc0);
  Acc r = ::k3::simd::reduce_add(acc0 + acc1);
  for (; i < n; ++i) r += x[i] * y[i];
  return r;
}

// The chunk operands the backward reads (chunk_simd_operands::build without the forward-only
// Kd^T and A Diag(beta)): e^G, e^{G_last - G}, [scale Q e^G; K e^G], K e^{G_last - G}, e^{G_last}.
template <class Arch, class Acc>
void build_backward_operands(chunk_simd_operands<Arch, Acc>& op, chunk_workspace<Acc> const& w, index_t c, Acc scale) {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  index_t const K = op.K;
  Acc const* gl = w.G.row(c - 1).data();
  batch const sc(scale);
  if (w.split) {
    op.build_split_factors(w, c, scale);
    chunk_decay_row<Arch>(w, c, op.decay.data());
    return;
  }
  for (index_t r = 0; r < c; ++r) {
    Acc const* G = w.G.row(r).data();
    Acc const* q = w.Q.row(r).data();
    Acc const* k = w.Kc.row(r).data();
    Acc* eg = op.EG.row(r).data();
    Acc* egd = op.EGd.row(r).data();
    Acc* qe = op.QK.row(r).data();
    Acc* ke = op.QK.row(c + r).data();
    Acc* kd = op.Kd.row(r).data();
    index_t d = 0;
    for (; d + L <= K; d += L) {
      batch const g = batch::load_unaligned(G + d), kv = batch::load_unaligned(k + d);
      batch const e = xsimd::exp(g), ed = xsimd::exp(batch::load_unaligned(gl + d) - g);
      e.store_unaligned(eg + d);
      ed.store_unaligned(egd + d);
      (sc * batch::load_unaligned(q + d) * e).store_unaligned(qe + d);
      (kv * e).store_unaligned(ke + d);
      (kv * ed).store_unaligned(kd + d);
    }
    for (; d < K; ++d) {
      eg[d] = std::exp(G[d]);
      egd[d] = std::exp(gl[d] - G[d]);
      qe[d] = scale * q[d] * eg[d];
      ke[d] = k[d] * eg[d];
      kd[d] = k[d] * egd[d];
    }
  }
  exp_row<Arch>(gl, op.decay.data(), K);
}

// Backward of sequence n, q/k head h, all value heads of its group.
template <class Arch, class Acc, class In, class S>
void chunk_backward_simd_task(problem const& p, backward_args<In, S> const& a, index_t n, index_t h) {
  using gemm = small_gemm<Arch, Acc>;
  using Mat = typename chunk_workspace<Acc>::Mat;
  using Vec = typename chunk_workspace<Acc>::Vec;
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = gemm::L;
  index_t const K = p.K, V = p.V, Vp = padded_v<Arch, Acc>(V), Kp = padded_v<Arch, Acc>(K);
  index_t const b = p.batch(n), bos = p.bos(n), eos = p.eos(n), Tn = eos - bos, C = chunk_size;
  Acc const scale = static_cast<Acc>(p.scale);
  chunk_workspace<Acc> w(K, Vp, true);
  for (Mat* m : {&w.Q, &w.Kc, &w.G, &w.Vc, &w.Aqk, &w.KK, &w.A, &w.dAqk, &w.dKK, &w.dA, &w.dQ, &w.dK, &w.dG}) m->setZero();
  chunk_simd_operands<Arch, Acc> op(K, Vp);
  chunk_intra_simd<Arch, Acc> intra(K);
  intra.fwd_QK = &op.QK;  // as the forward: [scale Qe; Ke] and Kd^T from the intra factors
  intra.fwd_KdT = &op.KdT;
  chunk_intra_backward_simd<Arch, Acc> intra_bwd(K);
  Mat St = Mat::Zero(K, Vp), dS = Mat::Zero(K, Vp), P = Mat::Zero(2 * C, Vp);
  Mat R = Mat::Zero(C, Vp), U = Mat::Zero(C, Vp), Y = Mat::Zero(2 * C, Vp), dU = Mat::Zero(C, Vp), dB = Mat::Zero(C, Vp);
  Mat Bm = Mat::Zero(C, Vp), BT = Mat::Zero(Vp, C), UT = Mat::Zero(Vp, C), ST = Mat::Zero(Vp, Kp), dST = Mat::Zero(Vp, Kp);
  Mat Z = Mat::Zero(2 * C, Kp), dKd = Mat::Zero(C, Kp), AT = Mat::Zero(C, C), T1 = Mat::Zero(C, C);
  index_t const nch = (Tn + C - 1) / C;
  bool const given = present(a.saved);
  bool const in_place = given && V == Vp;  // the forward's records are read where they are
  saved_layout const own{K, Vp};           // this task's records (padded V)
  // Per-thread, grow-only, never zeroed (every record entry read is written first): a fresh
  // zeroed vector per task cost page faults and a memset of ~11 MiB per head at T = 4096 and
  // ~90 MiB at T = 32768.
  struct scratch {
    std::unique_ptr<Acc[]> p;
    std::size_t n = 0;
  };
  thread_local scratch buf;
  std::size_t const need = in_place ? 0 : std::size_t((given ? 1 : nch) * own.per());
  if (buf.n < need) {
    buf.p.reset();
    buf.p.reset(new Acc[need]);
    buf.n = need;
  }
  Acc* const own_data = buf.p.get();
  // dq, dk sum over the value heads of the group (accumulated here when there are several)
  Mat dq = p.G > 1 ? Mat(Mat::Zero(Tn, K)) : Mat(), dk = p.G > 1 ? Mat(Mat::Zero(Tn, K)) : Mat();
  Vec dbeta(C), dl(K);
  auto prefetch_next = [&](index_t hv, index_t tn, index_t cn, index_t part, bool grad) {
    index_t const r0 = cn * part / 4, r1 = cn * (part + 1) / 4;
    prefetch_rows_l2(a.q, b, tn, h, r0, r1);
    prefetch_rows_l2(a.k, b, tn, h, r0, r1);
    if (!grad || !given) prefetch_rows_l2(a.v, b, tn, hv, r0, r1);  // v: read by the recompute pass only
    prefetch_rows_l2(a.g, b, tn, hv, r0, r1);
    // (prefetching the gradient rows for writing as well does not pay)
    if (grad) prefetch_rows_l2(a.d_o, b, tn, hv, r0, r1);
    // (prefetching the next chunk's saved record as well does not pay: each record
    // is one contiguous 176 KiB stream, which the hardware prefetchers follow)
  };
  for (index_t hv = h * p.G; hv < (h + 1) * p.G; ++hv) {
    if (!given) {
      St.setZero();
      if (present(a.h0))
        for (index_t d = 0; d < K; ++d) load_row(&a.h0(n, hv, d, 0), St.row(d).data(), V);
      for (index_t ch = 0; ch < nch; ++ch) {
        index_t const t0 = bos + ch * C, c = std::min(C, eos - t0);
        load_chunk(w, a.q, a.k, a.v, a.g, a.beta, b, h, hv, t0, c);
        index_t const cn = std::min(C, eos - t0 - c);
        prefetch_next(hv, t0 + c, cn, 0, false);
        auto const lb = chunk_lower_bound(w, p.lower_bound);
        intra(w, c, scale, lb);
        prefetch_next(hv, t0 + c, cn, 1, false);
        // The forward's own per-chunk steps (chunk_forward_simd_group), so that recomputed
        // records equal saved ones bit for bit.
        chunk_inverse_simd<Arch>(w, c);
        op.build_forward(w, c, scale, !lb);
        prefetch_next(hv, t0 + c, cn, 2, false);
        gemm::run(c, Vp, K, op.QK.row(c).data(), K, St.data(), Vp, P.data(), Vp);  // Ke S
        prefetch_next(hv, t0 + c, cn, 3, false);
        for (index_t r = 0; r < c; ++r) {
          Acc* rr = R.row(r).data();
          Acc const* pr = P.row(r).data();
          Acc const* vr = w.Vc.row(r).data();
          for (index_t e = 0; e < Vp; ++e) rr[e] = vr[e] - pr[e];
        }
        gemm::run(c, Vp, c, op.Ab.data(), C, R.data(), Vp, U.data(), Vp, gemm::zero, nullptr, 1);
        save_chunk_record(own_data + ch * own.per(), own, Vp, c, St.data(), Vp, w.Aqk.data(), w.KK.data(), w.A.data(), R.data(), Vp,
                          U.data(), Vp);
        gemm::run(K, Vp, c, op.KdT.data(), C, U.data(), Vp, St.data(), Vp, gemm::row_scaled, op.decay.data());
      }
    }
    dS.setZero();
    if (present(a.dht))
      for (index_t d = 0; d < K; ++d) load_row(&a.dht(n, hv, d, 0), dS.row(d).data(), V);
    for (index_t ch = nch; ch-- > 0;) {
      index_t const t0 = bos + ch * C, c = std::min(C, eos - t0);
      load_chunk(w, a.q, a.k, a.v, a.g, a.beta, b, h, hv, t0, c, !given);
      for (index_t r = 0; r < c; ++r) load_row(&a.d_o(b, t0 + r, hv, 0), Y.row(r).data(), V);
      index_t const cp = ch > 0 ? C : 0, tp = t0 - cp;  // previous chunk (next to be processed)
      prefetch_next(hv, tp, cp, 0, true);
      // This chunk's record: Sp (K x ldv), Aqk, KK, A (C x C), Rp, Up (C x ldv).
      Acc const* rec;
      index_t ldv = Vp;
      if (in_place) {
        rec = &a.saved(hv, p.first_chunk(n) + ch, 0);
        ldv = V;
      } else if (given) {
        Acc const* src = &a.saved(hv, p.first_chunk(n) + ch, 0);
        saved_layout const pub{K, V};
        save_chunk_record(own_data, own, V, c, src + pub.S(), V, src + pub.Aqk(), src + pub.KK(), src + pub.A(), src + pub.R(), V,
                          src + pub.U(), V);
        rec = own_data;
      } else {
        rec = own_data + ch * own.per();
      }
      saved_layout const lay{K, ldv};
      Acc const *Sp = rec + lay.S(), *Aqkp = rec + lay.Aqk(), *KKp = rec + lay.KK(), *Ap = rec + lay.A();
      Acc const *Rp = rec + lay.R(), *Up = rec + lay.U();
      build_backward_operands(op, w, c, scale);
      prefetch_next(hv, tp, cp, 1, true);
      index_t const cL = (c + L - 1) / L * L;  // columns of the c x c products, padded
      // dU = Kd dS + Aqk^T dO
      gemm::run(c, Vp, K, op.Kd.data(), K, dS.data(), Vp, dU.data(), Vp);
      gemm::run_t(c, Vp, c, Aqkp, C, Y.data(), Vp, dU.data(), Vp, gemm::accumulate, nullptr, 2);
      // C (c x c) = X (c x Vp) Yt (Vp x c), the lower triangle (by column slices of the kernel's
      // width: the slice starting at column j0 needs rows j0.. only); the rest is zeroed.
      auto lower_product = [&](Acc const* X, Acc const* Yt, Mat& out, bool strict) {
        constexpr index_t W = gemm::NV * L;
        for (index_t j0 = 0; j0 < c; j0 += W) {
          index_t const nw = std::min(W, cL - j0);
          gemm::run(c - j0, nw, Vp, X + j0 * Vp, Vp, Yt + j0, C, out.row(j0).data() + j0, C);
        }
        auto o = out.topLeftCorner(c, c);
        if (strict)
          o.template triangularView<Eigen::Upper>().setZero();
        else
          o.template triangularView<Eigen::StrictlyUpper>().setZero();
      };
      // dAqk = dO U^T (lower part kept)
      transpose_fast<Arch>(Up, c, Vp, ldv, UT.data(), C);
      lower_product(Y.data(), UT.data(), w.dAqk, false);
      // dB = A^T dU, dA = dU B^T
      transpose_fast<Arch>(Ap, c, c, C, AT.data(), C);
      gemm::run(c, Vp, c, AT.data(), C, dU.data(), Vp, dB.data(), Vp, gemm::zero, nullptr, 2);
      for (index_t r = 0; r < c; ++r) {
        Acc const br = w.beta(r);
        Acc const* rr = Rp + r * ldv;
        Acc const* db = dB.row(r).data();
        Acc* bm = Bm.row(r).data();
        Acc* y = Y.row(c + r).data();
        batch const bv(br), nbv(-br);
        for (index_t e = 0; e < Vp; e += L) {  // Vp: a multiple of the batch width
          (bv * batch::load_unaligned(rr + e)).store_unaligned(bm + e);
          (nbv * batch::load_unaligned(db + e)).store_unaligned(y + e);  // -dR
        }
        dbeta(r) = dot_simd<Arch>(rr, db, Vp);
      }
      transpose_fast<Arch>(Bm.data(), c, Vp, Vp, BT.data(), C);
      // dA = dU B^T, strictly lower part only: A = (I + L)^{-1} with L strictly lower, so every
      // variation of A is strictly lower and the rest of dA does not reach dKK.
      lower_product(dU.data(), BT.data(), w.dA, true);
      prefetch_next(hv, tp, cp, 2, true);
      // dL = -A^T dA A^T (strictly lower part; L = Diag(beta) KK): A^T is upper triangular.
      // Columns c..cL-1 of the products are padding and never read.
      gemm::run(c, cL, c, AT.data(), C, w.dA.data(), C, T1.data(), C, gemm::zero, nullptr, 2);
      gemm::run(c, cL, c, T1.data(), C, AT.data(), C, w.dKK.data(), C);
      for (index_t i = 0; i < c; ++i) {
        Acc* x = w.dKK.row(i).data();
        Acc const* kk = KKp + i * C;
        Acc const bi = w.beta(i);
        Acc acc = 0;
        for (index_t j = 0; j < i; ++j) {
          Acc const dl_ij = -x[j];
          acc += dl_ij * kk[j];
          x[j] = bi * dl_ij;
        }
        for (index_t j = i; j < c; ++j) x[j] = 0;
        dbeta(i) += acc;
      }
      // [dO; -dR] S^T = [d(scale Qe)/scale; dKe], U dS^T = dKd
      transpose_fast<Arch>(Sp, K, Vp, ldv, ST.data(), Kp);
      transpose_fast<Arch>(dS.data(), K, Vp, Vp, dST.data(), Kp);
      gemm::run(2 * c, Kp, Vp, Y.data(), Vp, ST.data(), Kp, Z.data(), Kp);
      gemm::run(c, Kp, Vp, Up, ldv, dST.data(), Kp, dKd.data(), Kp);
      // d G_last from the state decay: e^{G_last} rowsum(S .* dS)
      for (index_t d = 0; d < K; ++d) dl(d) = op.decay[std::size_t(d)] * dot_simd<Arch>(Sp + d * ldv, dS.row(d).data(), Vp);
      // state gradient for the previous chunk: e^{G_last} dS + scale Qe^T dO - Ke^T dR
      // (in place: dS has no reader after this point in the chunk)
      gemm::run_t(K, Vp, 2 * c, op.QK.data(), K, Y.data(), Vp, dS.data(), Vp, gemm::row_scaled, op.decay.data());
      prefetch_next(hv, tp, cp, 3, true);
      for (index_t r = 0; r < c; ++r) {
        Acc const* zq = Z.row(r).data();
        Acc const* zk = Z.row(c + r).data();
        Acc const* dkd = dKd.row(r).data();
        Acc const* qe = op.QK.row(r).data();  // scale Q e^G
        Acc const* ke = op.QK.row(c + r).data();
        Acc const* kd = op.Kd.row(r).data();
        Acc const* eg = op.EG.row(r).data();
        Acc const* egd = op.EGd.row(r).data();
        Acc* K3_RESTRICT dQr = w.dQ.row(r).data();
        Acc* K3_RESTRICT dKr = w.dK.row(r).data();
        Acc* K3_RESTRICT dGr = w.dG.row(r).data();
        Acc* K3_RESTRICT dlp = dl.data();
        index_t d = 0;
        for (; d + L <= K; d += L) {
          batch const a1 = batch::load_unaligned(dkd + d), zqv = batch::load_unaligned(zq + d), zkv = batch::load_unaligned(zk + d);
          batch const egv = batch::load_unaligned(eg + d);
          batch const t = a1 * batch::load_unaligned(kd + d);
          (k3::simd::fma(zkv, batch::load_unaligned(ke + d), zqv * batch::load_unaligned(qe + d)) - t).store_unaligned(dGr + d);
          (batch::load_unaligned(dlp + d) + t).store_unaligned(dlp + d);
          (batch(scale) * zqv * egv).store_unaligned(dQr + d);
          k3::simd::fma(zkv, egv, a1 * batch::load_unaligned(egd + d)).store_unaligned(dKr + d);
        }
        for (; d < K; ++d) {
          Acc const t = dkd[d] * kd[d];
          dGr[d] = zq[d] * qe[d] + zk[d] * ke[d] - t;
          dlp[d] += t;
          dQr[d] = scale * zq[d] * eg[d];
          dKr[d] = dkd[d] * egd[d] + zk[d] * eg[d];
        }
      }
      w.dG.row(c - 1) += dl.transpose();
      intra_bwd(w, c, scale, chunk_lower_bound(w, p.lower_bound));
      auto dG = w.dG.topRows(c);
      for (index_t r = c - 1; r-- > 0;) dG.row(r) += dG.row(r + 1);
      for (index_t r = 0; r < c; ++r) {
        store_row(w.dG.row(r).data(), &a.dg(b, t0 + r, hv, 0), K);
        Acc const* y = Y.row(c + r).data();
        In* dv = &a.dv(b, t0 + r, hv, 0);
        index_t e = 0;
        if constexpr (std::is_same_v<In, Acc>)
          for (; e + L <= V; e += L) (-batch::load_unaligned(y + e)).store_unaligned(dv + e);
        for (; e < V; ++e) dv[e] = store_as<In>(-y[e]);
        a.dbeta(b, t0 + r, hv) = store_as<In>(dbeta(r));
      }
      if (p.G == 1) {
        for (index_t r = 0; r < c; ++r) {
          store_row(w.dQ.row(r).data(), &a.dq(b, t0 + r, h, 0), K);
          store_row(w.dK.row(r).data(), &a.dk(b, t0 + r, h, 0), K);
        }
      } else {
        dq.middleRows(t0 - bos, c) += w.dQ.topRows(c);
        dk.middleRows(t0 - bos, c) += w.dK.topRows(c);
      }
    }
    if (present(a.dh0))
      for (index_t d = 0; d < K; ++d) store_row(dS.row(d).data(), &a.dh0(n, hv, d, 0), V);
  }
  if (p.G > 1)
    for (index_t t = 0; t < Tn; ++t) {
      store_row(dq.row(t).data(), &a.dq(b, bos + t, h, 0), K);
      store_row(dk.row(t).data(), &a.dk(b, bos + t, h, 0), K);
    }
}

}  // namespace k3::kda::detail
