// k3/kda/chunk_simd.hpp — the chunked form's state products with register-blocked xsimd
// kernels, for the simd and threads backends. Same algebra as chunk.hpp (which keeps the
// Eigen formulation for the serial backend); only the products over the state change:
//
//   forward, per chunk:   P = [scale Qe; Ke] S          one (2c x K) x (K x V) product
//                         U = (A Diag(beta)) (V - Ke S)  lower triangular
//                         O = scale Qe S + Aqk U         lower triangular
//                         S = Diag(e^{G_last}) S + Kd^T U
//
// Small Eigen products at these sizes (64 x 128 x 128) spend most of their time packing.
// The kernel here packs nothing: for each column slice of NV SIMD batches (32 floats with
// AVX-512) it walks the rows in blocks of MR, broadcasting one A element per row and FMA-ing
// against the slice's B row, so the B slice (K x 32 floats = 16 KiB) stays in L1 while every
// row block streams over it. V is padded to a multiple of the batch width with zero columns
// (zero state columns and zero values give zero updates and outputs there).
#pragma once
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "k3/kda/chunk.hpp"
#include "k3/kda/common.hpp"
#include "k3/kda/recurrent.hpp"

namespace k3::kda::detail {

template <class Arch, class T>
struct small_gemm {
  using batch = xsimd::batch<T, Arch>;
  static constexpr index_t L = index_t(batch::size);
  static constexpr int NV = 2;
  // Accumulators MR x NV plus NV B vectors and a broadcast must fit the register file:
  // 32 registers with 64-byte vectors (AVX-512), 16 otherwise.
  static constexpr int MR = sizeof(T) * batch::size >= 64 ? 8 : 4;

  enum init_mode { zero, accumulate, row_scaled };

  // C[MRr x NVr*L] (init) + A[rows, kb..ke) B[kb..ke, cols).
  template <int MRr, int NVr>
  static void micro(index_t kb, index_t ke, T const* K3_RESTRICT A, index_t lda, T const* K3_RESTRICT B, index_t ldb, T* K3_RESTRICT C,
                    index_t ldc, init_mode init, T const* rs) noexcept {
    batch acc[MRr][NVr];
    for (int i = 0; i < MRr; ++i)
      for (int j = 0; j < NVr; ++j) {
        if (init == zero)
          acc[i][j] = batch(T(0));
        else if (init == accumulate)
          acc[i][j] = batch::load_unaligned(C + i * ldc + j * L);
        else
          acc[i][j] = batch::load_unaligned(C + i * ldc + j * L) * batch(rs[i]);
      }
    for (index_t p = kb; p < ke; ++p) {
      batch bv[NVr];
      for (int j = 0; j < NVr; ++j) bv[j] = batch::load_unaligned(B + p * ldb + j * L);
      for (int i = 0; i < MRr; ++i) {
        batch const a(A[i * lda + p]);
        for (int j = 0; j < NVr; ++j) acc[i][j] = xsimd::fma(a, bv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < MRr; ++i)
      for (int j = 0; j < NVr; ++j) acc[i][j].store_unaligned(C + i * ldc + j * L);
  }

  template <int NVr>
  static void rows(index_t mr, index_t kb, index_t ke, T const* A, index_t lda, T const* B, index_t ldb, T* C, index_t ldc, init_mode init,
                   T const* rs) noexcept {
    if constexpr (MR == 8) {
      switch (mr) {
        case 8: return micro<8, NVr>(kb, ke, A, lda, B, ldb, C, ldc, init, rs);
        case 7: return micro<7, NVr>(kb, ke, A, lda, B, ldb, C, ldc, init, rs);
        case 6: return micro<6, NVr>(kb, ke, A, lda, B, ldb, C, ldc, init, rs);
        case 5: return micro<5, NVr>(kb, ke, A, lda, B, ldb, C, ldc, init, rs);
        default: break;
      }
    }
    switch (mr) {
      case 4: return micro<4, NVr>(kb, ke, A, lda, B, ldb, C, ldc, init, rs);
      case 3: return micro<3, NVr>(kb, ke, A, lda, B, ldb, C, ldc, init, rs);
      case 2: return micro<2, NVr>(kb, ke, A, lda, B, ldb, C, ldc, init, rs);
      default: return micro<1, NVr>(kb, ke, A, lda, B, ldb, C, ldc, init, rs);
    }
  }

  // C (m x n, n a multiple of L) = init + A (m x k) B (k x n); all row-major.
  // shape: 0 dense; 1 A lower triangular (row block i0 reads k < i0 + mr; entries above the
  // diagonal inside the block must be zero); 2 A upper triangular (row block reads k >= i0).
  static void run(index_t m, index_t n, index_t k, T const* A, index_t lda, T const* B, index_t ldb, T* C, index_t ldc,
                  init_mode init = zero, T const* rs = nullptr, int shape = 0) noexcept {
    index_t const nb = n / L;
    for (index_t j0 = 0; j0 < nb; j0 += NV) {
      index_t const nv = std::min<index_t>(NV, nb - j0);
      for (index_t i0 = 0; i0 < m; i0 += MR) {
        index_t const mr = std::min<index_t>(MR, m - i0);
        index_t const kb = shape == 2 ? std::min(i0, k) : 0;
        index_t const ke = shape == 1 ? std::min(k, i0 + mr) : k;
        T const* Ai = A + i0 * lda;
        T const* Bj = B + j0 * L;
        T* Cij = C + i0 * ldc + j0 * L;
        T const* r = rs ? rs + i0 : nullptr;
        if (nv == NV)
          rows<NV>(mr, kb, ke, Ai, lda, Bj, ldb, Cij, ldc, init, r);
        else
          rows<1>(mr, kb, ke, Ai, lda, Bj, ldb, Cij, ldc, init, r);
      }
    }
  }
};

template <class Arch, class Acc>
inline void chunk_exp_row(Acc const* x, Acc* y, index_t n) noexcept {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  index_t i = 0;
  for (; i + L <= n; i += L) xsimd::exp(batch::load_unaligned(x + i)).store_unaligned(y + i);
  for (; i < n; ++i) y[i] = std::exp(x[i]);
}

// dst (cols x rows, leading dimension ldd) = src^T (src rows x cols, leading dimension lds).
template <class T>
inline void transpose_into(T const* K3_RESTRICT src, index_t rows, index_t cols, index_t lds, T* K3_RESTRICT dst, index_t ldd) noexcept {
  constexpr index_t bs = 16;
  for (index_t i0 = 0; i0 < rows; i0 += bs)
    for (index_t j0 = 0; j0 < cols; j0 += bs) {
      index_t const ie = std::min(rows, i0 + bs), je = std::min(cols, j0 + bs);
      for (index_t j = j0; j < je; ++j)
        for (index_t i = i0; i < ie; ++i) dst[j * ldd + i] = src[i * lds + j];
    }
}

// The inputs of one head are rows of 256-512 bytes at a stride of H*K elements, which the
// hardware prefetchers follow poorly: the next chunk's rows are prefetched in a few batches
// while the current chunk computes, instead of each row missing to memory when it is loaded.
inline void prefetch_bytes(void const* p, index_t bytes) noexcept {
  char const* c = static_cast<char const*>(p);
  for (index_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
}

template <class In>
void prefetch_rows(tensor_view<In const, 4> x, index_t b, index_t t0, index_t h, index_t r0, index_t r1) noexcept {
  index_t const n = x.extent(3);
  for (index_t r = r0; r < r1; ++r) prefetch_bytes(&x(b, t0 + r, h, 0), n * index_t(sizeof(In)));
}

template <class Arch, class Acc>
constexpr index_t padded_v(index_t V) noexcept {
  constexpr index_t L = index_t(xsimd::batch<Acc, Arch>::size);
  return (V + L - 1) / L * L;
}

// Per-chunk state-independent operands for the simd path, built from the loaded workspace
// (Q, Kc, G, beta) after chunk_intra and chunk_inverse.
template <class Arch, class Acc>
struct chunk_simd_operands {
  using Mat = typename chunk_workspace<Acc>::Mat;
  index_t K, Vp;
  Mat QK;   // [scale Q e^G; K e^G]  (2C x K)
  Mat KdT;  // (K e^{G_last - G})^T   (K x C)
  Mat Ab;   // A Diag(beta)           (C x C)
  Mat EG, EGd, Kd;  // e^G, e^{G_last - G}, K e^{G_last - G}  (C x K)
  std::vector<Acc> decay;  // e^{G_last}  (K)

  chunk_simd_operands(index_t K_, index_t Vp_) : K(K_), Vp(Vp_) {
    index_t const C = chunk_size;
    QK.setZero(2 * C, K);
    KdT.setZero(K, C);
    Ab.setZero(C, C);
    EG.setZero(C, K);
    EGd.setZero(C, K);
    Kd.setZero(C, K);
    decay.assign(std::size_t(K), Acc(0));
  }

  void build(chunk_workspace<Acc> const& w, index_t c, Acc scale) {
    Acc const* gl = w.G.row(c - 1).data();
    for (index_t r = 0; r < c; ++r) {
      Acc const* G = w.G.row(r).data();
      Acc* eg = EG.row(r).data();
      Acc* egd = EGd.row(r).data();
      chunk_exp_row<Arch>(G, eg, K);
      for (index_t d = 0; d < K; ++d) egd[d] = gl[d] - G[d];
      chunk_exp_row<Arch>(egd, egd, K);
      Acc const* q = w.Q.row(r).data();
      Acc const* k = w.Kc.row(r).data();
      Acc* qe = QK.row(r).data();
      Acc* ke = QK.row(c + r).data();
      Acc* kd = Kd.row(r).data();
      for (index_t d = 0; d < K; ++d) {
        qe[d] = scale * q[d] * eg[d];
        ke[d] = k[d] * eg[d];
        kd[d] = k[d] * egd[d];
      }
    }
    transpose_into(Kd.data(), c, K, K, KdT.data(), chunk_size);
    chunk_exp_row<Arch>(gl, decay.data(), K);
    for (index_t i = 0; i < c; ++i)
      for (index_t j = 0; j <= i; ++j) Ab(i, j) = w.A(i, j) * w.beta(j);
  }
};

// Aqk and KK of a chunk with the lower-bounded gate (dense diagonal tiles), by small_gemm:
// row block I (16 rows) against all earlier columns at once, anchored at the block's first
// row n (factors e^{G_I - G_n} and e^{G_n - G_j}, both <= 1), then the diagonal tile anchored
// at c = G_{i0-1} + 8 lb as in chunk_intra. The column factors are formed on transposed keys
// and gates (K x C) so the exponentials vectorise along the tokens. Without a lower bound the
// pairwise diagonal tiles of chunk_intra are used.
template <class Arch, class Acc>
struct chunk_intra_simd {
  using Mat = typename chunk_workspace<Acc>::Mat;
  using batch = xsimd::batch<Acc, Arch>;
  static constexpr index_t L = index_t(batch::size);
  index_t K;
  Mat KcT, GT, QKa, KbT, Tm;
  std::vector<Acc> cv;

  explicit chunk_intra_simd(index_t K_) : K(K_) {
    index_t const C = chunk_size, s = sub_chunk;
    KcT.setZero(K, C);
    GT.setZero(K, C);
    QKa.setZero(2 * s, K);
    KbT.setZero(K, C);
    Tm.setZero(2 * s, C);
    cv.assign(std::size_t(K), Acc(0));
  }

  void operator()(chunk_workspace<Acc>& w, index_t c, Acc scale, std::optional<double> lb) {
    if (!lb) return chunk_intra(w, c, scale, lb);
    using gemm = small_gemm<Arch, Acc>;
    index_t const C = chunk_size, BC = sub_chunk, cB = (c + BC - 1) / BC * BC;
    transpose_into(w.Kc.data(), c, K, K, KcT.data(), C);
    transpose_into(w.G.data(), c, K, K, GT.data(), C);
    for (index_t d = 0; d < K; ++d)
      for (index_t j = c; j < cB; ++j) {
        KcT(d, j) = 0;
        GT(d, j) = w.G(c - 1, d);
      }
    w.Aqk.topLeftCorner(c, c).setZero();
    w.KK.topLeftCorner(c, c).setZero();
    Acc const lb8 = Acc(8 * *lb);
    for (index_t i0 = 0; i0 < c; i0 += BC) {
      index_t const ci = std::min(BC, c - i0);
      for (int diag = 0; diag < 2; ++diag) {
        if (!diag && i0 == 0) continue;
        // anchor: G_n (off-diagonal) or G_{i0-1} + 8 lb (diagonal)
        Acc const* an = w.G.row(i0).data();
        if (diag) {
          for (index_t d = 0; d < K; ++d) cv[std::size_t(d)] = (i0 == 0 ? Acc(0) : w.G(i0 - 1, d)) + lb8;
          an = cv.data();
        }
        for (index_t r = 0; r < ci; ++r) {
          Acc const* g = w.G.row(i0 + r).data();
          Acc const* q = w.Q.row(i0 + r).data();
          Acc const* k = w.Kc.row(i0 + r).data();
          Acc* qa = QKa.row(r).data();
          Acc* ka = QKa.row(ci + r).data();
          index_t d = 0;
          batch const sc(scale);
          for (; d + L <= K; d += L) {
            batch const e = xsimd::exp(batch::load_unaligned(g + d) - batch::load_unaligned(an + d));
            (sc * batch::load_unaligned(q + d) * e).store_unaligned(qa + d);
            (batch::load_unaligned(k + d) * e).store_unaligned(ka + d);
          }
          for (; d < K; ++d) {
            Acc const e = std::exp(g[d] - an[d]);
            qa[d] = scale * q[d] * e;
            ka[d] = k[d] * e;
          }
        }
        index_t const j0 = diag ? i0 : 0, nj = diag ? BC : i0;
        for (index_t d = 0; d < K; ++d) {
          batch const a(an[d]);
          Acc const* kt = KcT.row(d).data() + j0;
          Acc const* gt = GT.row(d).data() + j0;
          Acc* kb = KbT.row(d).data();
          for (index_t j = 0; j < nj; j += L)
            (batch::load_unaligned(kt + j) * xsimd::exp(a - batch::load_unaligned(gt + j))).store_unaligned(kb + j);
        }
        gemm::run(2 * ci, nj, K, QKa.data(), K, KbT.data(), C, Tm.data(), C);
        for (index_t r = 0; r < ci; ++r) {
          Acc const* tq = Tm.row(r).data();
          Acc const* tk = Tm.row(ci + r).data();
          Acc* aq = w.Aqk.row(i0 + r).data() + j0;
          Acc* kk = w.KK.row(i0 + r).data() + j0;
          index_t const mq = diag ? r + 1 : nj, mk = diag ? r : nj;  // mask after the product: factors are bounded
          for (index_t j = 0; j < mq; ++j) aq[j] = tq[j];
          for (index_t j = 0; j < mk; ++j) kk[j] = tk[j];
        }
      }
    }
  }
};

// One chunk's record of saved_layout{K, Vw} (see common.hpp): the first V columns of each
// source row, zeros in the columns [V, Vw) of a padded record.
template <class Acc>
void save_chunk_record(Acc* K3_RESTRICT dst, saved_layout l, index_t V, index_t c, Acc const* S, index_t lds, Acc const* Aqk, Acc const* KK,
                       Acc const* A, Acc const* R, index_t ldr, Acc const* U, index_t ldu) noexcept {
  index_t const C = chunk_size;
  auto row = [&](Acc const* src, Acc* out) {
    std::copy(src, src + V, out);
    std::fill(out + V, out + l.Vw, Acc(0));
  };
  for (index_t d = 0; d < l.K; ++d) row(S + d * lds, dst + l.S() + d * l.Vw);
  std::copy(Aqk, Aqk + c * C, dst + l.Aqk());
  std::copy(KK, KK + c * C, dst + l.KK());
  std::copy(A, A + c * C, dst + l.A());
  for (index_t r = 0; r < c; ++r) {
    row(R + r * ldr, dst + l.R() + r * l.Vw);
    row(U + r * ldu, dst + l.U() + r * l.Vw);
  }
}

template <class Arch, class Acc, class In, class S>
void chunk_forward_simd_task(problem const& p, forward_args<In, S> const& a, index_t n, index_t hv) {
  using gemm = small_gemm<Arch, Acc>;
  using Mat = typename chunk_workspace<Acc>::Mat;
  index_t const K = p.K, V = p.V, Vp = padded_v<Arch, Acc>(V), b = p.batch(n), h = hv / p.G, bos = p.bos(n), eos = p.eos(n);
  index_t const C = chunk_size;
  chunk_workspace<Acc> w(K, Vp, false);
  w.Vc.setZero();
  chunk_simd_operands<Arch, Acc> op(K, Vp);
  chunk_intra_simd<Arch, Acc> intra(K);
  Mat P = Mat::Zero(2 * C, Vp), U = Mat::Zero(C, Vp), St = Mat::Zero(K, Vp);
  Acc const scale = static_cast<Acc>(p.scale);
  if (present(a.h0))
    for (index_t d = 0; d < K; ++d) load_row(&a.h0(n, hv, d, 0), St.row(d).data(), V);
  for (index_t t0 = bos; t0 < eos; t0 += C) {
    index_t const c = std::min(C, eos - t0);
    load_chunk(w, a.q, a.k, a.v, a.g, a.beta, b, h, hv, t0, c);
    index_t const cn = std::min(C, eos - t0 - c), t1 = t0 + c;  // next chunk
    auto prefetch = [&](index_t part) {
      index_t const r0 = cn * part / 4, r1 = cn * (part + 1) / 4;
      prefetch_rows(a.q, b, t1, h, r0, r1);
      prefetch_rows(a.k, b, t1, h, r0, r1);
      prefetch_rows(a.v, b, t1, hv, r0, r1);
      prefetch_rows(a.g, b, t1, hv, r0, r1);
    };
    prefetch(0);
    intra(w, c, scale, p.lower_bound);
    prefetch(1);
    chunk_inverse(w, c);
    op.build(w, c, scale);
    prefetch(2);
    // [scale Qe; Ke] S: rows 0..c-1 are the inter-chunk output, rows c..2c-1 Ke S.
    gemm::run(2 * c, Vp, K, op.QK.data(), K, St.data(), Vp, P.data(), Vp);
    prefetch(3);
    for (index_t r = 0; r < c; ++r) {
      Acc* pr = P.row(c + r).data();
      Acc const* vr = w.Vc.row(r).data();
      for (index_t e = 0; e < Vp; ++e) pr[e] = vr[e] - pr[e];
    }
    gemm::run(c, Vp, c, op.Ab.data(), C, P.row(c).data(), Vp, U.data(), Vp, gemm::zero, nullptr, 1);
    if (present(a.saved))
      save_chunk_record(&a.saved(hv, p.first_chunk(n) + (t0 - bos) / C, 0), saved_layout{K, V}, V, c, St.data(), Vp, w.Aqk.data(),
                        w.KK.data(), w.A.data(), P.row(c).data(), Vp, U.data(), Vp);
    gemm::run(c, Vp, c, w.Aqk.data(), C, U.data(), Vp, P.data(), Vp, gemm::accumulate, nullptr, 1);
    for (index_t r = 0; r < c; ++r) store_row(P.row(r).data(), &a.o(b, t0 + r, hv, 0), V);
    gemm::run(K, Vp, c, op.KdT.data(), C, U.data(), Vp, St.data(), Vp, gemm::row_scaled, op.decay.data());
  }
  if (present(a.ht))
    for (index_t d = 0; d < K; ++d) store_row(St.row(d).data(), &a.ht(n, hv, d, 0), V);
}

}  // namespace k3::kda::detail
