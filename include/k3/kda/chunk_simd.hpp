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
#include <optional>
#include <type_traits>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/simd.hpp"
#include "k3/kda/arch/avx512.hpp"
#include "k3/kda/arch/generic.hpp"
#include "k3/kda/chunk.hpp"
#include "k3/kda/common.hpp"
#include "k3/kda/recurrent.hpp"
#include "k3/kda/recurrent_simd.hpp"

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

  // C[MRr x NVr*L] (init) + A[rows, kb..ke) B[kb..ke, cols). From k = tri on, row i takes
  // only k <= tri + i (a lower triangular A's diagonal block): its zeros above the diagonal
  // are skipped, not multiplied, so a non-finite later row of B cannot reach an earlier row
  // of C (0 * NaN), and the triangular products stay causal.
  template <int MRr, int NVr, bool AT = false>
  static void micro(index_t kb, index_t ke, index_t tri, T const* K3_RESTRICT A, index_t lda, T const* K3_RESTRICT B, index_t ldb,
                    T* K3_RESTRICT C, index_t ldc, init_mode init, T const* rs) noexcept {
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
    index_t const kf = std::min(ke, std::max(kb, tri));
    for (index_t p = kb; p < kf; ++p) {
      batch bv[NVr];
      for (int j = 0; j < NVr; ++j) bv[j] = batch::load_unaligned(B + p * ldb + j * L);
      for (int i = 0; i < MRr; ++i) {
        batch const a(AT ? A[p * lda + i] : A[i * lda + p]);
        for (int j = 0; j < NVr; ++j) acc[i][j] = k3::simd::fma(a, bv[j], acc[i][j]);
      }
    }
    for (index_t p = kf; p < ke; ++p) {
      batch bv[NVr];
      for (int j = 0; j < NVr; ++j) bv[j] = batch::load_unaligned(B + p * ldb + j * L);
      for (int i = 0; i < MRr; ++i) {
        if (p - tri > i) continue;
        batch const a(AT ? A[p * lda + i] : A[i * lda + p]);
        for (int j = 0; j < NVr; ++j) acc[i][j] = k3::simd::fma(a, bv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < MRr; ++i)
      for (int j = 0; j < NVr; ++j) acc[i][j].store_unaligned(C + i * ldc + j * L);
  }

  template <int NVr, bool AT = false>
  static void rows(index_t mr, index_t kb, index_t ke, index_t tri, T const* A, index_t lda, T const* B, index_t ldb, T* C, index_t ldc,
                   init_mode init, T const* rs) noexcept {
    if constexpr (MR == 8) {
      switch (mr) {
        case 8: return micro<8, NVr, AT>(kb, ke, tri, A, lda, B, ldb, C, ldc, init, rs);
        case 7: return micro<7, NVr, AT>(kb, ke, tri, A, lda, B, ldb, C, ldc, init, rs);
        case 6: return micro<6, NVr, AT>(kb, ke, tri, A, lda, B, ldb, C, ldc, init, rs);
        case 5: return micro<5, NVr, AT>(kb, ke, tri, A, lda, B, ldb, C, ldc, init, rs);
        default: break;
      }
    }
    switch (mr) {
      case 4: return micro<4, NVr, AT>(kb, ke, tri, A, lda, B, ldb, C, ldc, init, rs);
      case 3: return micro<3, NVr, AT>(kb, ke, tri, A, lda, B, ldb, C, ldc, init, rs);
      case 2: return micro<2, NVr, AT>(kb, ke, tri, A, lda, B, ldb, C, ldc, init, rs);
      default: return micro<1, NVr, AT>(kb, ke, tri, A, lda, B, ldb, C, ldc, init, rs);
    }
  }

  // hook() runs before every register tile (the forward spreads its prefetches with it).
  struct no_hook {
    void operator()() const noexcept {}
  };

  // C (m x n, n a multiple of L) = init + A (m x k) B (k x n); all row-major.
  // shape: 0 dense; 1 A lower triangular (row i reads k <= i only); 2 A upper triangular (row
  // block i0 reads k >= i0; entries below the diagonal inside the block must be zero).
  template <class Hook = no_hook>
  static void run(index_t m, index_t n, index_t k, T const* A, index_t lda, T const* B, index_t ldb, T* C, index_t ldc,
                  init_mode init = zero, T const* rs = nullptr, int shape = 0, Hook&& hook = {}) noexcept {
    run_impl<false>(m, n, k, A, lda, B, ldb, C, ldc, init, rs, shape, hook);
  }

  // run() with A given transposed: A^T is stored k x m (row-major, leading dimension lda), so
  // the product reads A(i, p) at A[p * lda + i] and needs no transposed copy. The same
  // products in the same order as run() on the transposed copy: bit for bit the same result.
  static void run_t(index_t m, index_t n, index_t k, T const* A, index_t lda, T const* B, index_t ldb, T* C, index_t ldc,
                    init_mode init = zero, T const* rs = nullptr, int shape = 0) noexcept {
    run_impl<true>(m, n, k, A, lda, B, ldb, C, ldc, init, rs, shape, no_hook{});
  }

  template <bool AT, class Hook>
  static void run_impl(index_t m, index_t n, index_t k, T const* A, index_t lda, T const* B, index_t ldb, T* C, index_t ldc,
                       init_mode init, T const* rs, int shape, Hook&& hook) noexcept {
    index_t const nb = n / L;
    for (index_t j0 = 0; j0 < nb; j0 += NV) {
      index_t const nv = std::min<index_t>(NV, nb - j0);
      for (index_t i0 = 0; i0 < m; i0 += MR) {
        index_t const mr = std::min<index_t>(MR, m - i0);
        index_t const kb = shape == 2 ? std::min(i0, k) : 0;
        index_t const ke = shape == 1 ? std::min(k, i0 + mr) : k;
        T const* Ai = AT ? A + i0 : A + i0 * lda;
        T const* Bj = B + j0 * L;
        T* Cij = C + i0 * ldc + j0 * L;
        index_t const tri = shape == 1 ? i0 : ke;
        T const* r = rs ? rs + i0 : nullptr;
        hook();
        if (nv == NV)
          rows<NV, AT>(mr, kb, ke, tri, Ai, lda, Bj, ldb, Cij, ldc, init, r);
        else
          rows<1, AT>(mr, kb, ke, tri, Ai, lda, Bj, ldb, Cij, ldc, init, r);
      }
    }
  }
};

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

// transpose_into with whole 16 x 16 blocks transposed in registers where the ISA file of
// k3/kda/arch/ serves Arch (the scalar loop costs about two cycles per element; the intra-chunk
// step transposes the keys and gates of every chunk). Exact: only moves values.
template <class Arch, class T>
inline void transpose_fast(T const* K3_RESTRICT src, index_t rows, index_t cols, index_t lds, T* K3_RESTRICT dst, index_t ldd) noexcept {
  index_t const rb = rows / 16 * 16, cb = cols / 16 * 16;
  if (kernel::transpose_16x16_blocks(src, rb, cb, lds, dst, ldd, Arch{})) {
    if (cb < cols) transpose_into(src + cb, rb, cols - cb, lds, dst + cb * ldd, ldd);
    if (rb < rows) transpose_into(src + rb * lds, rows - rb, cols, lds, dst + rb, ldd);
    return;
  }
  transpose_into(src, rows, cols, lds, dst, ldd);
}

// Walks a list of byte runs, a few cache lines per call: called between the register tiles
// of the big products, it keeps a handful of prefetches in flight at a time (bursts of
// hundreds stall on the miss buffers and gained nothing).
struct line_prefetcher {
  // rows of `bytes` bytes, `stride` bytes apart (one head's rows of a token-major tensor)
  struct block {
    char const* p;
    index_t stride, rows, bytes;
  };
  std::vector<block> blocks;
  std::size_t bi = 0;
  index_t row = 0, off = 0, per_call = 0;

  void reset() noexcept {
    blocks.clear();
    bi = 0;
    row = 0;
    off = 0;
  }
  // rows [t0, t0 + rows) of head h of x [B, T, H, n]
  template <class In>
  void add_rows(tensor_view<In const, 4> x, index_t b, index_t t0, index_t rows, index_t h) {
    if (rows <= 0) return;
    blocks.push_back({reinterpret_cast<char const*>(&x(b, t0, h, 0)), x.stride(1) * index_t(sizeof(In)), rows, x.extent(3) * index_t(sizeof(In))});
  }
  index_t lines() const noexcept {
    index_t l = 0;
    for (block const& k : blocks) l += k.rows * ((k.bytes + 63) / 64);
    return l;
  }
  void operator()() noexcept {
    for (index_t n = 0; n < per_call && bi < blocks.size(); ++n) {
      block const& k = blocks[bi];
      char const* r = k.p + row * k.stride;
      prefetch_l2(r + off);
      off += 64;
      if (off >= k.bytes) {
        prefetch_l2(r + k.bytes - 1);  // a row not aligned to a line ends in one more
        off = 0;
        if (++row == k.rows) {
          row = 0;
          ++bi;
        }
      }
    }
  }
};

template <class Arch, class Acc>
constexpr index_t padded_v(index_t V) noexcept {
  constexpr index_t L = index_t(xsimd::batch<Acc, Arch>::size);
  return (V + L - 1) / L * L;
}

// Row r of a split chunk (chunk.hpp split_gate_cumsum): eg = e^{G_r + H_r} and
// egd = e^{(G_last - G_r) + (H_last - H_r)}.
template <class Arch, class Acc>
void split_row_factors(chunk_workspace<Acc> const& w, index_t c, index_t r, Acc* eg, Acc* egd) noexcept {
  index_t const K = w.K;
  Acc const *G = w.G.row(r).data(), *H = w.H.row(r).data(), *gl = w.G.row(c - 1).data(), *hl = w.H.row(c - 1).data();
  for (index_t d = 0; d < K; ++d) {
    eg[d] = G[d] + H[d];
    egd[d] = (gl[d] - G[d]) + (hl[d] - H[d]);
  }
  exp_row<Arch>(eg, eg, K);
  exp_row<Arch>(egd, egd, K);
}

// decay = e^{G_last} (H_last added for a split chunk)
template <class Arch, class Acc>
void chunk_decay_row(chunk_workspace<Acc> const& w, index_t c, Acc* decay) noexcept {
  Acc const* gl = w.G.row(c - 1).data();
  if (!w.split) return exp_row<Arch>(gl, decay, w.K);
  Acc const* hl = w.H.row(c - 1).data();
  for (index_t d = 0; d < w.K; ++d) decay[d] = gl[d] + hl[d];
  exp_row<Arch>(decay, decay, w.K);
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

  // A split chunk's factors (forward and backward): EG = e^{G + H}, EGd = e^{(G_last - G) +
  // (H_last - H)}, QK = [scale Q EG; K EG], Kd = K EGd.
  void build_split_factors(chunk_workspace<Acc> const& w, index_t c, Acc scale) noexcept {
    for (index_t r = 0; r < c; ++r) {
      Acc* eg = EG.row(r).data();
      Acc* egd = EGd.row(r).data();
      split_row_factors<Arch>(w, c, r, eg, egd);
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
  }

  // What the forward needs: QK and KdT (unless chunk_intra_simd already formed them from its
  // factors, with_qk = false: its fwd_QK / fwd_KdT outputs, lower-bounded gate only),
  // e^{G_last} and A Diag(beta). EG and EGd are left untouched, except as scratch for a
  // split chunk.
  void build_forward(chunk_workspace<Acc> const& w, index_t c, Acc scale, bool with_qk) noexcept {
    using batch = xsimd::batch<Acc, Arch>;
    constexpr index_t L = index_t(batch::size);
    Acc const* gl = w.G.row(c - 1).data();
    if (w.split) {
      build_split_factors(w, c, scale);
      transpose_fast<Arch>(Kd.data(), c, K, K, KdT.data(), chunk_size);
    } else if (with_qk) {
      batch const sc(scale);
      for (index_t r = 0; r < c; ++r) {
        Acc const* G = w.G.row(r).data();
        Acc const* q = w.Q.row(r).data();
        Acc const* k = w.Kc.row(r).data();
        Acc* qe = QK.row(r).data();
        Acc* ke = QK.row(c + r).data();
        Acc* kd = Kd.row(r).data();
        index_t d = 0;
        for (; d + L <= K; d += L) {
          batch const g = batch::load_unaligned(G + d), kv = batch::load_unaligned(k + d);
          batch const eg = xsimd::exp(g), egd = xsimd::exp(batch::load_unaligned(gl + d) - g);
          (sc * batch::load_unaligned(q + d) * eg).store_unaligned(qe + d);
          (kv * eg).store_unaligned(ke + d);
          (kv * egd).store_unaligned(kd + d);
        }
        for (; d < K; ++d) {
          Acc const eg = std::exp(G[d]), egd = std::exp(gl[d] - G[d]);
          qe[d] = scale * q[d] * eg;
          ke[d] = k[d] * eg;
          kd[d] = k[d] * egd;
        }
      }
      transpose_fast<Arch>(Kd.data(), c, K, K, KdT.data(), chunk_size);
    }
    chunk_decay_row<Arch>(w, c, decay.data());
    // Only j <= i is written (the rest stays zero): the triangular kernel reads the entries
    // above the diagonal inside a row block, and they must not pick up later tokens' beta.
    Acc const* beta = w.beta.data();
    for (index_t i = 0; i < c; ++i) {
      Acc const* a = w.A.row(i).data();
      Acc* ab = Ab.row(i).data();
      index_t j = 0;
      for (; j + L <= i + 1; j += L) (batch::load_unaligned(a + j) * batch::load_unaligned(beta + j)).store_unaligned(ab + j);
      for (; j <= i; ++j) ab[j] = a[j] * beta[j];
    }
  }
};

// Rows i in [i0, i1) of A minus beta_i KK_im times row m (NB batches of row m).
template <class Arch, class Acc, int NB>
inline void chunk_inverse_rows(Acc* K3_RESTRICT A, index_t ld, Acc const* K3_RESTRICT Am, Acc const* K3_RESTRICT lcol, index_t ldl,
                               Acc const* K3_RESTRICT beta, index_t i0, index_t i1) noexcept {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  batch am[NB];
  for (int b = 0; b < NB; ++b) am[b] = batch::load_unaligned(Am + b * L);
  for (index_t i = i0; i < i1; ++i) {
    batch const l(beta[i] * lcol[i * ldl]);
    Acc* Ai = A + i * ld;
    for (int b = 0; b < NB; ++b) k3::simd::fnma(l, am[b], batch::load_unaligned(Ai + b * L)).store_unaligned(Ai + b * L);
  }
}

// A = (I + Diag(beta) KK)^{-1} (c x c, unit lower triangular) as chunk_inverse computes it
// (A_i = e_i - sum_{m<i} beta_i KK_im A_m, the sum taken in increasing m), right-looking
// and vectorised: once row m is final it is subtracted from every later row at once, over
// the whole batches covering its nonzero columns 0..m. Rows are zeroed over all C columns
// first, so the columns right of row m's diagonal contribute exact zeros.
template <class Arch, class Acc>
void chunk_inverse_simd(chunk_workspace<Acc>& w, index_t c) noexcept {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  index_t const C = chunk_size, ld = w.A.cols(), ldl = w.KK.cols();
  Acc* const A = w.A.data();
  Acc const* const KK = w.KK.data();
  Acc const* const beta = w.beta.data();
  for (index_t i = 0; i < c; ++i) {
    std::fill(A + i * ld, A + i * ld + C, Acc(0));
    A[i * ld + i] = Acc(1);
  }
  for (index_t m = 0; m + 1 < c; ++m) {
    index_t const nb = std::min(C, (m + L) / L * L) / L;  // batches covering columns 0..m
    Acc const* Am = A + m * ld;
    Acc const* lcol = KK + m;  // KK(i, m) = lcol[i * ldl]
    switch (nb) {
      case 1: chunk_inverse_rows<Arch, Acc, 1>(A, ld, Am, lcol, ldl, beta, m + 1, c); break;
      case 2: chunk_inverse_rows<Arch, Acc, 2>(A, ld, Am, lcol, ldl, beta, m + 1, c); break;
      case 3: chunk_inverse_rows<Arch, Acc, 3>(A, ld, Am, lcol, ldl, beta, m + 1, c); break;
      case 4: chunk_inverse_rows<Arch, Acc, 4>(A, ld, Am, lcol, ldl, beta, m + 1, c); break;
      default:
        for (index_t i = m + 1; i < c; ++i) {
          batch const l(beta[i] * lcol[i * ldl]);
          Acc* Ai = A + i * ld;
          for (index_t j = 0; j < nb * L; j += L) k3::simd::fnma(l, batch::load_unaligned(Am + j), batch::load_unaligned(Ai + j)).store_unaligned(Ai + j);
        }
    }
  }
}

// Aqk and KK of a chunk with the lower-bounded gate (dense diagonal tiles), by small_gemm:
// row block I (16 rows) against all earlier columns at once, anchored at the block's first
// row n (factors e^{G_I - G_n} and e^{G_n - G_j}, both <= 1), then the diagonal tile anchored
// at c = G_{i0-1} + 8 lb as in chunk_intra. The column factors are formed along the channels
// and transposed (K x 16 per block) for the products. Without a lower bound the pairwise
// diagonal tiles of chunk_intra are used.
template <class Arch, class Acc>
struct chunk_intra_simd {
  using Mat = typename chunk_workspace<Acc>::Mat;
  using batch = xsimd::batch<Acc, Arch>;
  static constexpr index_t L = index_t(batch::size);
  index_t K;
  Mat Kbr, QKo, QKa, KoT, KbT, Tm;
  std::vector<Acc> cv, cvp, s1, s2, s3, s4;
  // When set (the forward), the state products' operands are taken from the factors formed
  // here instead of new exponentials: rows 0..c-1 of fwd_QK = scale Q e^G, rows c..2c-1 =
  // K e^G (2C x K), and fwd_KdT = (K e^{G_last - G})^T (K x C).
  Mat* fwd_QK = nullptr;
  Mat* fwd_KdT = nullptr;

  explicit chunk_intra_simd(index_t K_) : K(K_) {
    index_t const C = chunk_size, s = sub_chunk;
    Kbr.setZero(s, K);
    QKo.setZero(2 * s, K);
    QKa.setZero(2 * s, K);
    KoT.setZero(K, C);
    KbT.setZero(K, C);
    Tm.setZero(2 * s, C);
    for (auto* v : {&cv, &cvp, &s1, &s2, &s3, &s4}) v->assign(std::size_t(K), Acc(0));
  }

  // y = e^{x - z} over K channels
  void exp_diff(Acc const* x, Acc const* z, Acc* y) const noexcept {
    index_t d = 0;
    for (; d + L <= K; d += L) xsimd::exp(batch::load_unaligned(x + d) - batch::load_unaligned(z + d)).store_unaligned(y + d);
    for (; d < K; ++d) y[d] = std::exp(x[d] - z[d]);
  }

  // dst rows [d0, d0 + n) = src rows [s0, s0 + n) * f (per channel)
  void scale_rows_into(Mat const& src, index_t s0, index_t n, Acc const* f, Mat& dst, index_t d0) const noexcept {
    for (index_t r = 0; r < n; ++r) {
      Acc const* x = src.row(s0 + r).data();
      Acc* y = dst.row(d0 + r).data();
      index_t d = 0;
      for (; d + L <= K; d += L) (batch::load_unaligned(x + d) * batch::load_unaligned(f + d)).store_unaligned(y + d);
      for (; d < K; ++d) y[d] = x[d] * f[d];
    }
  }

  // Rows [qs * q e; k e] with e = e^{G_r - an} for the ci rows of block i0 (qs = scale).
  void row_factors(chunk_workspace<Acc> const& w, index_t i0, index_t ci, Acc const* an, Acc scale, Mat& out) const noexcept {
    batch const sc(scale);
    for (index_t r = 0; r < ci; ++r) {
      Acc const* g = w.G.row(i0 + r).data();
      Acc const* q = w.Q.row(i0 + r).data();
      Acc const* k = w.Kc.row(i0 + r).data();
      Acc* qa = out.row(r).data();
      Acc* ka = out.row(ci + r).data();
      index_t d = 0;
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
  }

  // Off-diagonal tiles of row block I = [i0, i0 + 16) are anchored at its first row, G_{i0}:
  // factors e^{G_I - G_{i0}} and e^{G_{i0} - G_J} (both <= 1). Its diagonal tile is anchored at
  // cI = G_{i0-1} + 8 lb: factors e^{G_I - cI}, e^{cI - G_I} (within e^{+-40}; causal anchor,
  // fla #1240). Fewer exponentials than forming each factor directly, all products of
  // bounded factors (so no overflow, and only a few roundings apart from the direct forms):
  //   e^{G_I - cI}       = e^{G_I - G_{i0}} e^{G_{i0} - cI}
  //   e^{G_{i0} - G_J}   = e^{G_{i0-16} - G_J} e^{G_{i0} - G_{i0-16}}    (J before block I-1)
  //   e^{G_{i0} - G_J}   = e^{c_{I-1} - G_J} e^{G_{i0} - c_{I-1}}        (J = block I-1)
  void operator()(chunk_workspace<Acc>& w, index_t c, Acc scale, std::optional<double> lb) {
    if (!lb) return chunk_intra(w, c, scale, lb);
    using gemm = small_gemm<Arch, Acc>;
    index_t const C = chunk_size, BC = sub_chunk;
    w.Aqk.topLeftCorner(c, c).setZero();
    w.KK.topLeftCorner(c, c).setZero();
    Acc const lb8 = Acc(8 * *lb);
    for (index_t i0 = 0; i0 < c; i0 += BC) {
      index_t const ci = std::min(BC, c - i0);
      for (index_t d = 0; d < K; ++d) cv[std::size_t(d)] = (i0 == 0 ? Acc(0) : w.G(i0 - 1, d)) + lb8;
      if (i0 > 0) {
        Acc const* gn = w.G.row(i0).data();
        exp_diff(gn, w.G.row(i0 - BC).data(), s1.data());
        exp_diff(gn, cvp.data(), s3.data());
        exp_diff(gn, cv.data(), s2.data());
        index_t const jo = i0 - BC;  // columns before jo carry over, [jo, i0) come from block I-1's diagonal factors
        for (index_t d = 0; d < K; ++d) {
          Acc* ko = KoT.row(d).data();
          Acc const* kb = KbT.row(d).data();
          batch const f1(s1[std::size_t(d)]), f3(s3[std::size_t(d)]);
          for (index_t j = 0; j < jo; j += L) (batch::load_unaligned(ko + j) * f1).store_unaligned(ko + j);
          for (index_t j = 0; j < BC; j += L) (batch::load_unaligned(kb + j) * f3).store_unaligned(ko + jo + j);
        }
        row_factors(w, i0, ci, gn, scale, QKo);
        if (fwd_QK) {
          // e^{G_r} = e^{G_r - G_{i0}} e^{G_{i0}}
          exp_row<Arch>(gn, s4.data(), K);
          scale_rows_into(QKo, 0, ci, s4.data(), *fwd_QK, i0);
          scale_rows_into(QKo, ci, ci, s4.data(), *fwd_QK, c + i0);
        }
        gemm::run(2 * ci, i0, K, QKo.data(), K, KoT.data(), C, Tm.data(), C);
        for (index_t r = 0; r < ci; ++r) {
          std::copy(Tm.row(r).data(), Tm.row(r).data() + i0, w.Aqk.row(i0 + r).data());
          std::copy(Tm.row(ci + r).data(), Tm.row(ci + r).data() + i0, w.KK.row(i0 + r).data());
        }
        for (index_t r = 0; r < 2 * ci; ++r) {
          Acc const* src = QKo.row(r).data();
          Acc* dst = QKa.row(r).data();
          index_t d = 0;
          for (; d + L <= K; d += L) (batch::load_unaligned(src + d) * batch::load_unaligned(s2.data() + d)).store_unaligned(dst + d);
          for (; d < K; ++d) dst[d] = src[d] * s2[std::size_t(d)];
        }
      } else {
        row_factors(w, i0, ci, cv.data(), scale, QKa);
        if (fwd_QK) {
          // e^{G_r} = e^{G_r - 8 lb} e^{8 lb}
          std::fill(s4.begin(), s4.end(), std::exp(lb8));
          scale_rows_into(QKa, 0, ci, s4.data(), *fwd_QK, 0);
          scale_rows_into(QKa, ci, ci, s4.data(), *fwd_QK, c);
        }
      }
      // diagonal column factors k_j e^{cI - G_j}, formed along the channels and transposed
      // (rows past the chunk end are zero)
      for (index_t j = 0; j < BC; ++j) {
        Acc* kb = Kbr.row(j).data();
        if (i0 + j >= c) {
          std::fill(kb, kb + K, Acc(0));
          continue;
        }
        Acc const* g = w.G.row(i0 + j).data();
        Acc const* k = w.Kc.row(i0 + j).data();
        index_t d = 0;
        for (; d + L <= K; d += L)
          (batch::load_unaligned(k + d) * xsimd::exp(batch::load_unaligned(cv.data() + d) - batch::load_unaligned(g + d))).store_unaligned(kb + d);
        for (; d < K; ++d) kb[d] = k[d] * std::exp(cv[std::size_t(d)] - g[d]);
      }
      transpose_fast<Arch>(Kbr.data(), BC, K, K, KbT.data(), C);
      if (fwd_KdT) {
        // e^{G_last - G_j} = e^{cI - G_j} e^{G_last - cI} for the columns j of block I
        exp_diff(w.G.row(c - 1).data(), cv.data(), s4.data());
        for (index_t d = 0; d < K; ++d) {
          batch const f(s4[std::size_t(d)]);
          Acc const* kb = KbT.row(d).data();
          Acc* kd = fwd_KdT->row(d).data() + i0;
          for (index_t j = 0; j < BC; j += L) (batch::load_unaligned(kb + j) * f).store_unaligned(kd + j);
        }
      }
      gemm::run(2 * ci, BC, K, QKa.data(), K, KbT.data(), C, Tm.data(), C);
      for (index_t r = 0; r < ci; ++r) {
        Acc const* tq = Tm.row(r).data();
        Acc const* tk = Tm.row(ci + r).data();
        Acc* aq = w.Aqk.row(i0 + r).data() + i0;
        Acc* kk = w.KK.row(i0 + r).data() + i0;
        for (index_t j = 0; j <= r; ++j) aq[j] = tq[j];  // mask after the product: factors are bounded
        for (index_t j = 0; j < r; ++j) kk[j] = tk[j];
      }
      std::swap(cv, cvp);
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

// Buffers of chunk_forward_simd_group for a group of nq q/k heads and nv value heads:
// staged chunk inputs per head (q/k per q/k head, the rest per value head), the states, the
// staged outputs, and the per-chunk workspaces. Padded value columns of SV stay zero (only
// the first V columns are ever written).
template <class Arch, class Acc>
struct forward_scratch {
  using Mat = typename chunk_workspace<Acc>::Mat;
  index_t K = -1, Vp = -1, nv = -1;
  std::optional<chunk_workspace<Acc>> w;
  std::optional<chunk_simd_operands<Arch, Acc>> op;
  std::optional<chunk_intra_simd<Arch, Acc>> intra;
  Mat P, U, Vc;
  std::vector<Mat> St;
  line_prefetcher pf;

  void ensure(index_t K_, index_t Vp_, index_t nv_) {
    if (K_ == K && Vp_ == Vp && nv_ == nv) return;
    index_t const C = chunk_size;
    K = K_, Vp = Vp_, nv = nv_;
    w.emplace(K, Vp, false);
    op.emplace(K, Vp);
    intra.emplace(K);
    intra->fwd_QK = &op->QK;
    intra->fwd_KdT = &op->KdT;
    P = Mat::Zero(2 * C, Vp);
    U = Mat::Zero(C, Vp);
    Vc = Mat::Zero(C, Vp);
    St.assign(std::size_t(nv), Mat::Zero(K, Vp));
  }
};

// Forward of sequence n, value heads [hv0, hv1), in lockstep chunk by chunk: every head keeps
// its own state and runs exactly the per-head arithmetic of a single-head task, so results do
// not depend on the grouping (nor on the thread count that picks it).
// The inputs are token-major: one head's chunk rows are K elements at a stride of H*K, which
// the hardware prefetchers follow badly (load-latency bound). So while head j computes, the
// rows of the next (chunk, head) pair are prefetched into L2 in small slices spread over its
// products; staging them then reads from L2. One head ahead (128 KiB at K = V = 128) stays in
// L2 next to the working set, where a whole chunk of the group ahead (1 MiB for 8 heads) was
// evicted before use.
// Returns true when a staged g may be below the gate's lower bound (row_may_be_below): the
// caller then runs the exact check, which throws. Scanning here, on rows already in cache,
// saves a separate pass over all of g.
template <class Arch, class Acc, class In, class S>
bool chunk_forward_simd_group(problem const& p, forward_args<In, S> const& a, index_t n, index_t hv0, index_t hv1) {
  using gemm = small_gemm<Arch, Acc>;
  using Mat = typename chunk_workspace<Acc>::Mat;
  index_t const K = p.K, V = p.V, Vp = padded_v<Arch, Acc>(V), b = p.batch(n), bos = p.bos(n), eos = p.eos(n);
  index_t const C = chunk_size, nv = hv1 - hv0;
  // Per-thread buffers kept between calls (rebuilt when the dimensions change): allocating
  // ~2 MiB per task cost page faults and zeroing on every call.
  thread_local forward_scratch<Arch, Acc> scratch;
  scratch.ensure(K, Vp, nv);
  chunk_workspace<Acc>& w = *scratch.w;
  chunk_simd_operands<Arch, Acc>& op = *scratch.op;
  chunk_intra_simd<Arch, Acc>& intra = *scratch.intra;
  Mat &P = scratch.P, &U = scratch.U, &Vc = scratch.Vc;
  std::vector<Mat>& St = scratch.St;
  line_prefetcher& pf = scratch.pf;
  for (Mat& m : St) m.setZero();
  Acc const scale = static_cast<Acc>(p.scale);
  if (present(a.h0))
    for (index_t j = 0; j < nv; ++j)
      for (index_t d = 0; d < K; ++d) load_row(&a.h0(n, hv0 + j, d, 0), St[std::size_t(j)].row(d).data(), V);
  // register tiles per head of [Qe; Ke] S, U, O and the state update: the prefetch hooks
  auto tiles_of = [&](index_t c) {
    index_t const mt = (c + gemm::MR - 1) / gemm::MR;
    return ((Vp / gemm::L + gemm::NV - 1) / gemm::NV) * ((2 * c + gemm::MR - 1) / gemm::MR + 2 * mt + (K + gemm::MR - 1) / gemm::MR);
  };
  bool below = false;
  float const lbf = p.lower_bound ? filter_bound<In>(*p.lower_bound) : 0.f;
  for (index_t t0 = bos; t0 < eos; t0 += C) {
    index_t const c = std::min(C, eos - t0);
    index_t staged_q = -1;  // the query head whose rows w.Q / w.Kc hold for this chunk
    for (index_t j = 0; j < nv; ++j) {
      index_t const hv = hv0 + j, hq = hv / p.G;
      if (hq != staged_q) {
        for (index_t r = 0; r < c; ++r) load_row(&a.q(b, t0 + r, hq, 0), w.Q.row(r).data(), K);
        for (index_t r = 0; r < c; ++r) load_row(&a.k(b, t0 + r, hq, 0), w.Kc.row(r).data(), K);
        staged_q = hq;
      }
      for (index_t r = 0; r < c; ++r) load_row(&a.v(b, t0 + r, hv, 0), Vc.row(r).data(), V);
      bool large = false;
      for (index_t r = 0; r < c; ++r) {
        In const* g = &a.g(b, t0 + r, hv, 0);
        if (p.lower_bound) below |= row_may_be_below(g, K, lbf);
        large |= load_gate_cumsum_row(g, w.G.row(r).data(), r > 0 ? w.G.row(r - 1).data() : nullptr, K);
      }
      w.split = large;
      if (large) split_gate_cumsum(w.G.data(), w.H.data(), w.G.cols(), &a.g(b, t0, hv, 0), a.g.stride(1), c, K);
      for (index_t r = 0; r < c; ++r) w.beta(r) = load_as<Acc>(a.beta(b, t0 + r, hv));
      {
        // the next (chunk, head) pair's rows
        index_t const tn = j + 1 < nv ? t0 : t0 + c, cn = std::min(C, eos - tn), hvn = j + 1 < nv ? hv + 1 : hv0, hqn = hvn / p.G;
        bool const new_q = j + 1 >= nv || hqn != hq;
        pf.reset();
        if (new_q) {
          pf.add_rows(a.q, b, tn, cn, hqn);
          pf.add_rows(a.k, b, tn, cn, hqn);
        }
        pf.add_rows(a.v, b, tn, cn, hvn);
        pf.add_rows(a.g, b, tn, cn, hvn);
        pf.per_call = pf.lines() / std::max<index_t>(1, tiles_of(c)) + 1;
      }
      Mat& St_ = St[std::size_t(j)];
      auto const lb = chunk_lower_bound(w, p.lower_bound);
      intra(w, c, scale, lb);
      chunk_inverse_simd<Arch>(w, c);
      op.build_forward(w, c, scale, !lb);
      // [scale Qe; Ke] S: rows 0..c-1 are the inter-chunk output, rows c..2c-1 Ke S.
      gemm::run(2 * c, Vp, K, op.QK.data(), K, St_.data(), Vp, P.data(), Vp, gemm::zero, nullptr, 0, pf);
      for (index_t r = 0; r < c; ++r) {
        Acc* pr = P.row(c + r).data();
        Acc const* vr = Vc.row(r).data();
        for (index_t e = 0; e < Vp; ++e) pr[e] = vr[e] - pr[e];
      }
      gemm::run(c, Vp, c, op.Ab.data(), C, P.row(c).data(), Vp, U.data(), Vp, gemm::zero, nullptr, 1, pf);
      if (present(a.saved))
        save_chunk_record(&a.saved(hv, p.first_chunk(n) + (t0 - bos) / C, 0), saved_layout{K, V}, V, c, St_.data(), Vp, w.Aqk.data(),
                          w.KK.data(), w.A.data(), P.row(c).data(), Vp, U.data(), Vp);
      gemm::run(c, Vp, c, w.Aqk.data(), C, U.data(), Vp, P.data(), Vp, gemm::accumulate, nullptr, 1, pf);
      for (index_t r = 0; r < c; ++r) store_row(P.row(r).data(), &a.o(b, t0 + r, hv, 0), V);
      gemm::run(K, Vp, c, op.KdT.data(), C, U.data(), Vp, St_.data(), Vp, gemm::row_scaled, op.decay.data(), 0, pf);
    }
  }
  if (present(a.ht))
    for (index_t j = 0; j < nv; ++j)
      for (index_t d = 0; d < K; ++d) store_row(St[std::size_t(j)].row(d).data(), &a.ht(n, hv0 + j, d, 0), V);
  return below;
}

// Value heads per forward task: as many as give every thread one task, up to 8 (neighbouring
// heads share the pages of a token's rows, so one larger group per thread beats two smaller
// ones with the same heads; benchmarks/kda.md).
inline index_t forward_head_group(index_t N, index_t HV, index_t threads) {
  index_t const target = std::max<index_t>(1, (N * HV) / std::max<index_t>(1, threads));
  return std::clamp<index_t>(target, 1, std::min<index_t>(HV, 8));
}

}  // namespace k3::kda::detail
