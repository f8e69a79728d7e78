// k3/dplr/chunk_kernels.hpp — the per-chunk algebra of chunked DPLR (one sequence, one head).
//
// For a chunk of c tokens with start state S, gi the inclusive and ge = gi - gk the exclusive
// chunk-local cumsum of gk (ge appears because a_t contracts with S_{t-1}, before token t's
// decay):
//   Aqk[i,j] = s q_i.(k_j e^{gi_i-gi_j}), Aqb likewise with b   (j <= i)
//   Aak[i,j] = a_i.(k_j e^{ge_i-gi_j}),   Aab likewise with b   (j <  i)
//   Tm = (I - Aab)^{-1},  w = Tm (a e^{ge})
//   X  = Tm Aak V + w S               (X_i = S_{i-1}^T a_i)
//   O  = Aqk V + Aqb X + (s q e^{gi}) S
//   S' = Diag(e^{gi_c}) S + (k e^{gi_c-gi})^T V + (b e^{gi_c-gi})^T X
// Everything that does not touch V or S ("pre") is independent across chunks and across
// state columns, which is what the threaded paths exploit.
#pragma once
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "k3/core/gate_cumsum.hpp"
#include "k3/core/math.hpp"
#include "k3/dplr/common.hpp"
#include "k3/kda/chunk_simd.hpp"  // kda::detail::small_gemm

namespace k3::detail::dplr {

template <class R>
using mat = Eigen::Matrix<R, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class R>
using vec = Eigen::Matrix<R, Eigen::Dynamic, 1>;

// Largest total in-chunk decay (nats) for which the factored form e^{gi_i} * e^{-gi_j} stays
// far from overflow; beyond it the pairwise form is used.
template <class R>
constexpr R factored_decay_limit() {
  return std::is_same_v<R, double> ? R(200) : R(30);
}

// Largest total in-chunk decay for which the factored form is valid at all: e^{-gi} below
// overflow and e^{gi} a normal number. intra_form::factored is used wherever it holds; a chunk
// beyond it (a hard reset, say) takes the pairwise form rather than giving inf * 0 = NaN.
template <class R>
constexpr R factored_valid_limit() {
  return std::is_same_v<R, double> ? R(700) : R(85);
}

// Non-finite inputs. Inside a chunk every product is a GEMM over all of its tokens, with the
// entries that pair token i with a later token j masked to exact zeros; a NaN or Inf at token
// j then turns those zeros into NaN (0 * NaN), reaching tokens before j. So a chunk holding a
// non-finite input is also computed once more as its "twin", the same chunk with those
// inputs set to 0: the twin's rows before the first such token are bit for bit those of the
// chunk without them (every entry a later token touches is multiplied by an exact 0 either
// way), and they replace the plain computation's rows there. Which inputs are replaced
// depends on what the rows are:
//  - outputs: an output before token j reads no input at or after j (all six replaced);
//  - kv: a gradient before token j reads later q, a, b, gk (through the state-gradient chain,
//    where the reference recurrence also gives 0 * NaN) but never later k or v, and neither
//    does the transition part M of a segment map (the values enter only N);
// so only k and v are replaced for the backward and for maps.
enum class twin_kind { none, outputs, kv };

// All n values finite: the largest exponent field of the block is not the all-ones one
// (an integer max, which vectorises; no branch per element).
template <class T>
bool all_finite(T const* x, index_t n) {
  using U = std::conditional_t<sizeof(T) == 8, std::uint64_t, std::uint32_t>;
  static_assert(sizeof(T) == sizeof(U) && std::numeric_limits<T>::is_iec559);
  constexpr U e = sizeof(T) == 8 ? U(0x7ff0000000000000ull) : U(0x7f800000u);
  U m = 0;
  for (index_t i = 0; i < n; ++i) {
    U u;
    std::memcpy(&u, x + i, sizeof(U));
    m = std::max<U>(m, u & e);
  }
  return m != e;
}

// First row in [0, c) of tokens t0.. of x holding a non-finite value; c when none.
template <class T>
index_t first_nonfinite_row(const_view<T, 2> const& x, index_t t0, index_t c) {
  for (index_t r = 0; r < c; ++r)
    if (!all_finite(x.data_handle() + (t0 + r) * x.stride(0), x.extent(1))) return r;
  return c;
}
template <class R>
index_t first_nonfinite_row(mat<R> const& m) {
  if (all_finite(m.data(), m.size())) return m.rows();
  for (index_t r = 0; r < m.rows(); ++r)
    if (!all_finite(m.data() + r * m.cols(), m.cols())) return r;
  return m.rows();
}

template <class T, class R>
void load_rows(const_view<T, 2> const& x, index_t t0, index_t c, mat<R>& m) {
  index_t const D = x.extent(1);
  m.resize(c, D);
  for (index_t r = 0; r < c; ++r) {
    T const* row = x.data_handle() + (t0 + r) * x.stride(0);
    for (index_t d = 0; d < D; ++d) m(r, d) = R(row[d]);
  }
}

template <class T, class R>
void load_cols(const_view<T, 2> const& x, index_t t0, index_t c, index_t c0, index_t w, mat<R>& m) {
  m.resize(c, w);
  for (index_t r = 0; r < c; ++r) {
    T const* row = x.data_handle() + (t0 + r) * x.stride(0) + c0;
    for (index_t d = 0; d < w; ++d) m(r, d) = R(row[d]);
  }
}

template <class T, class R>
void store_cols(tensor_view<T, 2> const& x, index_t t0, index_t c0, mat<R> const& m) {
  for (index_t r = 0; r < m.rows(); ++r) {
    T* row = x.data_handle() + (t0 + r) * x.stride(0) + c0;
    for (index_t d = 0; d < m.cols(); ++d) row[d] = static_cast<T>(m(r, d));
  }
}

template <class R>
struct chunk_pre {
  index_t t0 = 0, c = 0;
  bool factored = true;
  R scale = 1;
  mat<R> q, k, a, b, gi, ge;  // raw rows and cumsums (backward)
  // A chunk on the pairwise path that holds a log decay below split_log_decay() (a hard reset):
  // gs is the cumsum of its other log decays, h that of those (core/gate_cumsum.hpp says why);
  // gi and ge stay the full cumsums, for the factors from the chunk start.
  bool split = false;
  mat<R> gs, h;
  // Row-stacked pairs (2c x K), so that the four intra matrices come from one GEMM:
  mat<R> QA;    // [Qe; Ae] = [s q e^{gi}; a e^{ge}]
  mat<R> KB;    // [kh; bh] = [k e^{-gi}; b e^{-gi}], factored form only
  mat<R> KdBd;  // [Kd; Bd] = [k e^{gi_c-gi}; b e^{gi_c-gi}]
  mat<R> Aqk, Aqb, Aak, Tm;  // c x c; Tm (the backward's) only when make_pre is asked for it
  vec<R> dC;                 // e^{gi_c}
  // The forward state pass as three GEMMs over the stacked operand Z = [S; V; X]:
  //   X = P1 [S; V], P1 = [w | Tm Aak];  O = P2 Z, P2 = [Qe | Aqk | Aqb];
  //   S' = e^{gi_c} S + KdBd^T [V; X]
  mat<R> P1, P2;
  mat<R> g_, G_, eg_;  // scratch, kept to avoid reallocating per chunk
  // Non-finite inputs (see twin_kind): `bad` is the chunk's first row holding one (c when
  // none); then `twin` is the chunk with them set to 0 and `tv` its values (c x V).
  index_t bad = 0;
  std::unique_ptr<chunk_pre> twin;
  mat<R> tv;

  // Moves what the backward's steps and parameter gradients read out of a builder's scratch
  // (the scratch keeps its temporaries and P2, hot in the builder's cache).
  void take(chunk_pre& o) {
    t0 = o.t0;
    c = o.c;
    factored = o.factored;
    split = o.split;
    scale = o.scale;
    for (auto m : {&chunk_pre::q, &chunk_pre::k, &chunk_pre::a, &chunk_pre::b, &chunk_pre::gi, &chunk_pre::ge, &chunk_pre::gs, &chunk_pre::h, &chunk_pre::QA, &chunk_pre::KB,
                   &chunk_pre::KdBd, &chunk_pre::Aqk, &chunk_pre::Aqb, &chunk_pre::Aak, &chunk_pre::Tm, &chunk_pre::P1})
      (this->*m).swap(o.*m);
    dC.swap(o.dC);
    bad = o.bad;
    twin.swap(o.twin);
    tv.swap(o.tv);
  }

  auto Qe() const { return QA.topRows(c); }
  auto Ae() const { return QA.bottomRows(c); }
  auto kh() const { return KB.topRows(c); }
  auto bh() const { return KB.bottomRows(c); }
  auto Kd() const { return KdBd.topRows(c); }
  auto Bd() const { return KdBd.bottomRows(c); }
  auto w() const { return P1.leftCols(q.cols()); }

  // The log decay from token j to token i (j <= i), and to just before token i (j < i).
  R pair_log(index_t i, index_t j, index_t d) const { return split ? (gs(i, d) - gs(j, d)) + (h(i, d) - h(j, d)) : gi(i, d) - gi(j, d); }
  R pair_log_before(index_t i, index_t j, index_t d) const { return split ? pair_log(i - 1, j, d) : ge(i, d) - gi(j, d); }
  // e^{gi_c - gi}: the decay from each token to the chunk end (c x K), each factor <= 1
  mat<R> end_factors() const {
    if (!split) return (gi.rowwise() - gi.row(c - 1)).array().operator-().exp().matrix();
    mat<R> e(c, gi.cols());
    for (index_t j = 0; j < c; ++j)
      for (index_t d = 0; d < e.cols(); ++d) e(j, d) = std::exp(pair_log(c - 1, j, d));
    return e;
  }
};

template <class T, class R>
void make_twin(head_views<T> const& hv, index_t t0, index_t c, R scale, intra_form mode, chunk_pre<R>& p, bool with_tm, twin_kind tk);

template <class T, class R>
void make_pre(head_views<T> const& hv, index_t t0, index_t c, R scale, intra_form mode, chunk_pre<R>& p, bool with_tm = true,
              twin_kind tk = twin_kind::none) {
  p.t0 = t0;
  p.c = c;
  p.scale = scale;
  load_rows(hv.q, t0, c, p.q);
  load_rows(hv.k, t0, c, p.k);
  load_rows(hv.a, t0, c, p.a);
  load_rows(hv.b, t0, c, p.b);
  mat<R>& g = p.g_;
  load_rows(hv.gk, t0, c, g);
  p.bad = c;
  p.twin.reset();
  if (tk != twin_kind::none) {
    p.bad = std::min(first_nonfinite_row(p.k), first_nonfinite_row(hv.v, t0, c));
    if (tk == twin_kind::outputs)  // the raw gate: a -inf one is clamped below
      for (auto const* m : {&p.q, &p.a, &p.b, &g}) p.bad = std::min(p.bad, first_nonfinite_row(*m));
    if (p.bad < c) make_twin(hv, t0, c, scale, mode, p, with_tm, tk);
  }
  g = g.unaryExpr([](R x) { return ::k3::detail::clamp_log_decay(x); });
  index_t const K = g.cols();
  p.gi.resize(c, K);
  p.ge.resize(c, K);
  p.ge.row(0).setZero();
  p.gi.row(0) = g.row(0);
  for (index_t r = 1; r < c; ++r) {
    p.ge.row(r) = p.gi.row(r - 1);  // exclusive cumsum: the decay before token r's own
    p.gi.row(r) = p.gi.row(r - 1) + g.row(r);
  }
  auto last = p.gi.row(c - 1);
  R span = K > 0 ? (-last.array()).maxCoeff() : R(0);
  p.factored = (mode == intra_form::factored && span <= factored_valid_limit<R>()) ||
               (mode == intra_form::automatic && span <= factored_decay_limit<R>());
  p.split = !p.factored && (g.array() < split_log_decay<R>()).any();
  if (p.split) {
    p.gs.resize(c, K);
    p.h.resize(c, K);
    split_gate_cumsum(p.gs.data(), p.h.data(), K, static_cast<R const*>(g.data()), K, c, K);
  }
  // One exponential per element: e^{ge} is the previous row of e^{gi}, and in the factored
  // form e^{-gi} = 1 / e^{gi}, e^{gi_c - gi} = e^{gi_c} e^{-gi}.
  mat<R>& eg = p.eg_;
  eg = p.gi.array().exp().matrix();
  p.dC = last.transpose().array().exp();
  p.QA.resize(2 * c, K);
  p.QA.topRows(c) = scale * (p.q.array() * eg.array()).matrix();
  p.QA.row(c) = p.a.row(0);
  if (c > 1) p.QA.bottomRows(c - 1) = (p.a.bottomRows(c - 1).array() * eg.topRows(c - 1).array()).matrix();
  p.KdBd.resize(2 * c, K);
  mat<R>& G = p.G_;
  if (p.factored) {
    p.KB.resize(2 * c, K);
    eg = eg.array().inverse().matrix();
    p.KB.topRows(c) = (p.k.array() * eg.array()).matrix();
    p.KB.bottomRows(c) = (p.b.array() * eg.array()).matrix();
    p.KdBd = (p.KB.array().rowwise() * p.dC.transpose().array()).matrix();
    G.noalias() = p.QA * p.KB.transpose();  // [[Aqk, Aqb], [Aak, Aab]] before masking
  } else {
    eg = p.end_factors();
    p.KdBd.topRows(c) = (p.k.array() * eg.array()).matrix();
    p.KdBd.bottomRows(c) = (p.b.array() * eg.array()).matrix();
    G.setZero(2 * c, 2 * c);
    for (index_t i = 0; i < c; ++i) {
      for (index_t j = 0; j <= i; ++j) {
        R sqk = 0, sqb = 0, sak = 0, sab = 0;
        for (index_t d = 0; d < K; ++d) {
          R e = std::exp(p.pair_log(i, j, d));
          sqk += p.q(i, d) * p.k(j, d) * e;
          sqb += p.q(i, d) * p.b(j, d) * e;
          if (j < i) {
            R f = std::exp(p.pair_log_before(i, j, d));
            sak += p.a(i, d) * p.k(j, d) * f;
            sab += p.a(i, d) * p.b(j, d) * f;
          }
        }
        G(i, j) = scale * sqk;
        G(i, c + j) = scale * sqb;
        G(c + i, j) = sak;
        G(c + i, c + j) = sab;
      }
    }
  }
  p.Aqk = G.topLeftCorner(c, c).template triangularView<Eigen::Lower>();
  p.Aqb = G.topRightCorner(c, c).template triangularView<Eigen::Lower>();
  p.Aak = G.bottomLeftCorner(c, c).template triangularView<Eigen::StrictlyLower>();
  // Tm = (I - Aab)^{-1}: Aab's strictly lower part, negated, over a unit diagonal
  auto Aab = G.bottomRightCorner(c, c);
  Aab = -Aab;
  p.P1.resize(c, K + c);
  p.P1.leftCols(K) = p.Ae();
  p.P1.rightCols(c) = p.Aak;
  Aab.template triangularView<Eigen::UnitLower>().solveInPlace(p.P1);  // [w | Tm Aak]
  if (with_tm) {
    p.Tm.setIdentity(c, c);
    Aab.template triangularView<Eigen::UnitLower>().solveInPlace(p.Tm);
  }
  p.P2.resize(c, K + 2 * c);
  p.P2.leftCols(K) = p.Qe();
  p.P2.middleCols(K, c) = p.Aqk;
  p.P2.rightCols(c) = p.Aqb;
}

// The chunk with its non-finite inputs of kind tk set to 0 (p.twin), and those values (p.tv).
template <class T, class R>
void make_twin(head_views<T> const& hv, index_t t0, index_t c, R scale, intra_form mode, chunk_pre<R>& p, bool with_tm, twin_kind tk) {
  bool const all = tk == twin_kind::outputs;
  const_view<T, 2> const* src[6] = {&hv.q, &hv.k, &hv.v, &hv.a, &hv.b, &hv.gk};
  bool const fix[6] = {all, true, true, all, all, all};
  std::vector<std::vector<T>> buf(6);
  const_view<T, 2> views[6];
  for (int i = 0; i < 6; ++i) {
    const_view<T, 2> const& x = *src[i];
    index_t const D = x.extent(1);
    if (!fix[i]) {
      views[i] = x.sub(0, t0, c);
      continue;
    }
    buf[i].resize(static_cast<std::size_t>(c * D));
    for (index_t r = 0; r < c; ++r) {
      T const* row = x.data_handle() + (t0 + r) * x.stride(0);
      for (index_t d = 0; d < D; ++d) buf[i][std::size_t(r * D + d)] = std::isfinite(row[d]) ? row[d] : T(0);
    }
    views[i] = host_view(static_cast<T const*>(buf[i].data()), c, D);
  }
  head_views<T> tw{views[0], views[1], views[2], views[3], views[4], views[5], c};
  p.twin = std::make_unique<chunk_pre<R>>();
  make_pre(tw, 0, c, scale, mode, *p.twin, with_tm, twin_kind::none);
  p.twin->t0 = t0;
  load_rows(tw.v, 0, c, p.tv);
}

// What the forward state pass of a chunk reads (the rest of chunk_pre is only needed by the
// backward): the threaded forward moves these out of the builder's scratch, so the ring of
// built chunks shared between threads stays small.
template <class R>
struct chunk_fwd {
  index_t t0 = 0, c = 0;
  mat<R> P1, P2, KdBd;
  vec<R> dC;
  index_t bad = 0;                   // as in chunk_pre
  std::unique_ptr<chunk_fwd> twin;
  mat<R> tv;
  void take(chunk_pre<R>& p) {
    t0 = p.t0;
    c = p.c;
    P1.swap(p.P1);
    P2.swap(p.P2);
    KdBd.swap(p.KdBd);
    dC.swap(p.dC);
    bad = p.bad;
    if (p.twin) {
      if (!twin) twin = std::make_unique<chunk_fwd>();
      twin->take(*p.twin);
      tv.swap(p.tv);
    } else {
      twin.reset();
    }
  }
};

// The products over state columns: C (m x n) = init + A (m x k) B (k x n), row-major, A given
// transposed (stored k x m) when `at`. Every entry of C is one chain of fmas over k in order,
// from the same start, whether a SIMD lane of small_gemm or the padded tail computes it: a
// column's value does not depend on which block of columns it is computed in, so the value
// split (one block of columns per thread) gives the single-thread result bit for bit. Eigen's
// GEMM does not: its 1-packet micro-kernel alternates two accumulators over k where the 3- and
// 2-packet kernels use one, and which one a column meets depends on its offset in the block
// (benchmarks/dplr.md). It also packs both operands, which costs more than it saves here.
enum class cols_init { zero, accumulate, row_scaled };

template <class Arch = xsimd::default_arch, class R>
void cols_gemm(index_t m, index_t n, index_t k, R const* A, index_t lda, bool at, R const* B, index_t ldb, R* C, index_t ldc, cols_init init,
               R const* rs = nullptr) {
  using gemm = ::k3::kda::detail::small_gemm<Arch, R>;
  auto const mode = init == cols_init::zero ? gemm::zero : init == cols_init::accumulate ? gemm::accumulate : gemm::row_scaled;
  index_t const L = gemm::L, nb = n / L * L;
  if (nb > 0) {
    if (at) gemm::run_t(m, nb, k, A, lda, B, ldb, C, ldc, mode, rs);
    else gemm::run(m, nb, k, A, lda, B, ldb, C, ldc, mode, rs);
  }
  if (nb == n || m == 0) return;
  // The last n - nb columns through the same kernel, zero-padded to one batch.
  index_t const t = n - nb;
  thread_local std::vector<R> bp, cp;
  bp.assign(static_cast<std::size_t>(k * L), R(0));
  cp.assign(static_cast<std::size_t>(m * L), R(0));
  for (index_t p = 0; p < k; ++p) std::copy_n(B + p * ldb + nb, t, bp.data() + p * L);
  if (init != cols_init::zero)
    for (index_t i = 0; i < m; ++i) std::copy_n(C + i * ldc + nb, t, cp.data() + i * L);
  if (at) gemm::run_t(m, L, k, A, lda, bp.data(), L, cp.data(), L, mode, rs);
  else gemm::run(m, L, k, A, lda, bp.data(), L, cp.data(), L, mode, rs);
  for (index_t i = 0; i < m; ++i) std::copy_n(cp.data() + i * L, t, C + i * ldc + nb);
}

// Forward over one chunk for a block of state columns: S (K x w) is advanced in place; O (c x w)
// is written when non-null. Pre: chunk_pre or chunk_fwd.
template <class R, class Pre>
void chunk_forward(Pre const& p, mat<R> const& Vc, mat<R>& S, mat<R>* O) {
  index_t const K = S.rows(), c = p.c, w = S.cols();
  mat<R> Z(K + 2 * c, w);
  Z.topRows(K) = S;
  Z.middleRows(K, c) = Vc;
  R* const X = Z.data() + (K + c) * w;
  cols_gemm(c, w, K + c, p.P1.data(), K + c, false, Z.data(), w, X, w, cols_init::zero);  // X = P1 [S; V]
  if (O) {
    O->resize(c, w);
    cols_gemm(c, w, K + 2 * c, p.P2.data(), K + 2 * c, false, Z.data(), w, O->data(), w, cols_init::zero);  // O = P2 Z
  }
  // S' = e^{gi_c} S + KdBd^T [V; X]
  cols_gemm(K, w, 2 * c, p.KdBd.data(), K, true, Z.data() + K * w, w, S.data(), w, cols_init::row_scaled, p.dC.data());
}

// Gradients of the V- and S-contracted products of one chunk, summed over state columns.
template <class R>
struct chunk_acc {
  mat<R> Aqk, Aqb, Aak, Aab;  // c x c
  mat<R> Qe, Ae, Kd, Bd;      // c x K
  vec<R> dC;                  // K
};

// The state-gradient chain of one chunk for a block of w columns: dS (K x w) in = gradient of
// the chunk-end state, out = of the chunk-start state; Y = Tm^T (Aqb^T dO + Bd dS) (c x w) is
// written at (Y, ldy). dV (c x w), when non-null, gets Aqk^T dO + Kd dS + Aak^T Y. Every
// product through cols_gemm: per column the same bits whatever the block of columns.
template <class R>
void chunk_dstate_cols(chunk_pre<R> const& p, mat<R> const& dO, mat<R>& dS, R* Y, index_t ldy, mat<R>* dV) {
  index_t const c = p.c, K = dS.rows(), w = dS.cols();
  R const* const Bd = p.KdBd.data() + c * K;
  mat<R> dX(c, w), dSp(K, w);
  cols_gemm(c, w, c, p.Aqb.data(), c, true, dO.data(), w, dX.data(), w, cols_init::zero);
  cols_gemm(c, w, K, Bd, K, false, dS.data(), w, dX.data(), w, cols_init::accumulate);
  cols_gemm(c, w, c, p.Tm.data(), c, true, dX.data(), w, Y, ldy, cols_init::zero);
  if (dV) {
    dV->resize(c, w);
    cols_gemm(c, w, c, p.Aqk.data(), c, true, dO.data(), w, dV->data(), w, cols_init::zero);
    cols_gemm(c, w, K, p.KdBd.data(), K, false, dS.data(), w, dV->data(), w, cols_init::accumulate);
    cols_gemm(c, w, c, p.Aak.data(), c, true, Y, ldy, dV->data(), w, cols_init::accumulate);
  }
  cols_gemm(K, w, c, p.QA.data(), K, true, dO.data(), w, dSp.data(), w, cols_init::zero);
  cols_gemm(K, w, c, p.QA.data() + c * K, K, true, Y, ldy, dSp.data(), w, cols_init::accumulate);
  dSp.array() += dS.array().colwise() * p.dC.array();
  dS.swap(dSp);
}

// Backward over one chunk for a block of w columns. S: chunk-start state; dS: on entry the
// gradient of the chunk-end state, on exit that of the chunk-start state. dV (c x w) written;
// X = P1 [S; V] and Y (what the parameter gradients contract with) written at (X, ld), (Y, ld).
template <class R>
void chunk_backward(chunk_pre<R> const& p, mat<R> const& Vc, mat<R> const& S, mat<R>& dS, mat<R> const& dO, mat<R>& dV, R* X, R* Y, index_t ld) {
  index_t const c = p.c, K = S.rows(), w = S.cols();
  mat<R> Z(K + c, w);
  Z.topRows(K) = S;
  Z.bottomRows(c) = Vc;
  cols_gemm(c, w, K + c, p.P1.data(), K + c, false, Z.data(), w, X, ld, cols_init::zero);
  chunk_dstate_cols(p, dO, dS, Y, ld, &dV);
}

// The state-gradient chain alone (the transposed map): no S, no V needed.
template <class R>
void chunk_dstate(chunk_pre<R> const& p, mat<R> const& dO, mat<R>& dS) {
  mat<R> Y(p.c, dS.cols());
  chunk_dstate_cols(p, dO, dS, Y.data(), dS.cols(), static_cast<mat<R>*>(nullptr));
}

// The sums over all V state columns that the parameter gradients need (V, X, Y, dO: c x V;
// S, dS: K x V; dS the gradient of the chunk-end state). Taken over the whole width in one
// place, so that they do not depend on how the columns were split across threads.
template <class R>
void chunk_accumulate(chunk_acc<R>& acc, mat<R> const& Vc, mat<R> const& S, mat<R> const& dS, mat<R> const& dO, mat<R> const& X, mat<R> const& Y) {
  acc.Aqk.noalias() = dO * Vc.transpose();
  acc.Aqb.noalias() = dO * X.transpose();
  acc.Aak.noalias() = Y * Vc.transpose();
  acc.Aab.noalias() = Y * X.transpose();
  acc.Qe.noalias() = dO * S.transpose();
  acc.Ae.noalias() = Y * S.transpose();
  acc.Kd.noalias() = Vc * dS.transpose();
  acc.Bd.noalias() = X * dS.transpose();
  acc.dC = (S.array() * dS.array()).rowwise().sum().matrix();
}

// From the summed accumulators to dq dk da db dgk of the chunk's tokens (rows t0..t0+c).
// Only rows [r0, r1) of the chunk are stored (r1 < 0: to its end).
template <class T, class R>
void chunk_param_grads(chunk_pre<R> const& p, chunk_acc<R> const& acc, tensor_view<T, 2> const& dq, tensor_view<T, 2> const& dk,
                       tensor_view<T, 2> const& da, tensor_view<T, 2> const& db, tensor_view<T, 2> const& dgk, index_t r0 = 0, index_t r1 = -1) {
  index_t const c = p.c, K = p.q.cols();
  mat<R> gAqk = acc.Aqk.template triangularView<Eigen::Lower>();
  mat<R> gAqb = acc.Aqb.template triangularView<Eigen::Lower>();
  mat<R> gAak = acc.Aak.template triangularView<Eigen::StrictlyLower>();
  mat<R> gAab = acc.Aab.template triangularView<Eigen::StrictlyLower>();
  mat<R> dQe = acc.Qe, dAe = acc.Ae;
  mat<R> Dq = mat<R>::Zero(c, K), Dk = Dq, Da = Dq, Db = Dq, dgi = Dq, dge = Dq;
  vec<R> dlast = (acc.dC.array() * p.dC.array()).matrix();
  mat<R> Eend = p.end_factors();
  {
    mat<R> t1 = (acc.Kd.array() * p.Kd().array()).matrix(), t2 = (acc.Bd.array() * p.Bd().array()).matrix();
    Dk.array() += acc.Kd.array() * Eend.array();
    Db.array() += acc.Bd.array() * Eend.array();
    dgi -= t1 + t2;
    dlast += (t1 + t2).colwise().sum().transpose();
  }
  if (p.factored) {
    dQe.noalias() += gAqk * p.kh();
    dQe.noalias() += gAqb * p.bh();
    dAe.noalias() += gAak * p.kh();
    dAe.noalias() += gAab * p.bh();
    mat<R> dkh = gAqk.transpose() * p.Qe();
    dkh.noalias() += gAak.transpose() * p.Ae();
    mat<R> dbh = gAqb.transpose() * p.Qe();
    dbh.noalias() += gAab.transpose() * p.Ae();
    mat<R> Einv = (-p.gi.array()).exp().matrix();
    Dk.array() += dkh.array() * Einv.array();
    Db.array() += dbh.array() * Einv.array();
    dgi.array() -= dkh.array() * p.kh().array() + dbh.array() * p.bh().array();
  } else {
    R const s = p.scale;
    for (index_t i = 0; i < c; ++i) {
      for (index_t j = 0; j <= i; ++j) {
        R gqk = gAqk(i, j), gqb = gAqb(i, j), gak = j < i ? gAak(i, j) : R(0), gab = j < i ? gAab(i, j) : R(0);
        if (gqk == R(0) && gqb == R(0) && gak == R(0) && gab == R(0)) continue;
        for (index_t d = 0; d < K; ++d) {
          R e = std::exp(p.pair_log(i, j, d));
          R sq = s * p.q(i, d);
          R side = (gqk * p.k(j, d) + gqb * p.b(j, d)) * e;
          Dq(i, d) += s * side;
          Dk(j, d) += gqk * sq * e;
          Db(j, d) += gqb * sq * e;
          R term = side * sq;
          dgi(i, d) += term;
          dgi(j, d) -= term;
          if (j < i) {
            R f = std::exp(p.pair_log_before(i, j, d));
            R aside = (gak * p.k(j, d) + gab * p.b(j, d)) * f;
            Da(i, d) += aside;
            Dk(j, d) += gak * p.a(i, d) * f;
            Db(j, d) += gab * p.a(i, d) * f;
            R t2 = aside * p.a(i, d);
            dge(i, d) += t2;
            dgi(j, d) -= t2;
          }
        }
      }
    }
  }
  // Qe = s q e^{gi}, Ae = a e^{ge}
  Dq.array() += p.scale * dQe.array() * p.gi.array().exp();
  dgi.array() += dQe.array() * p.Qe().array();
  Da.array() += dAe.array() * p.ge.array().exp();
  dge.array() += dAe.array() * p.Ae().array();
  dgi.row(c - 1) += dlast.transpose();
  // ge = gi - gk, gi = cumsum(gk)
  dgi += dge;
  mat<R> Dg = -dge;
  vec<R> run = vec<R>::Zero(K);
  for (index_t r = c; r-- > 0;) {
    run += dgi.row(r).transpose();
    Dg.row(r) += run.transpose();
  }
  if (r0 == 0 && (r1 < 0 || r1 == c)) {
    store_cols(dq, p.t0, 0, Dq);
    store_cols(dk, p.t0, 0, Dk);
    store_cols(da, p.t0, 0, Da);
    store_cols(db, p.t0, 0, Db);
    store_cols(dgk, p.t0, 0, Dg);
    return;
  }
  index_t const n = (r1 < 0 ? c : r1) - r0;
  store_cols(dq, p.t0 + r0, 0, mat<R>(Dq.middleRows(r0, n)));
  store_cols(dk, p.t0 + r0, 0, mat<R>(Dk.middleRows(r0, n)));
  store_cols(da, p.t0 + r0, 0, mat<R>(Da.middleRows(r0, n)));
  store_cols(db, p.t0 + r0, 0, mat<R>(Db.middleRows(r0, n)));
  store_cols(dgk, p.t0 + r0, 0, mat<R>(Dg.middleRows(r0, n)));
}

}  // namespace k3::detail::dplr
