// k3/kda/recurrent_simd.hpp — the serial recurrence vectorised with xsimd, for the simd and
// threads backends: the forward over a sequence, and the decode step in place on a state pool.
//
// The state of one value head is split into column slices of W = 2 SIMD batches (32 floats
// with AVX-512), stored slice-major so a K x W slice (16 KiB for K = 128) stays in L1 while a
// buffer of tokens streams through it. Within a block of tokens the state is kept as S / A (A
// the block's cumulative decay, per row), which turns the decay multiply into a per-token
// rescaling of the K-vectors; each token touches a state row once: the write of token t
// (S~ += k~ u^T, o += q~.S~) is fused with the prediction of token t+1, so the state is loaded
// and stored once per token with 3 FMAs per element (see recurrent_forward_simd_group).
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/simd.hpp"
#include "k3/kda/common.hpp"
#include "k3/kda/recurrent.hpp"

namespace k3::kda::detail {

// e^x over n values, vectorised.
template <class Arch, class Acc>
inline void exp_row(Acc const* x, Acc* y, index_t n) noexcept {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  index_t i = 0;
  for (; i + L <= n; i += L) xsimd::exp(batch::load_unaligned(x + i)).store_unaligned(y + i);
  for (; i < n; ++i) y[i] = std::exp(x[i]);
}

template <class Arch, class Acc>
constexpr bool simd_recurrent_ok(index_t V) noexcept {
  return V % index_t(xsimd::batch<Acc, Arch>::size) == 0;
}

// NB batches per slice. Runs tokens [0, nt) of a buffer on one slice S (K x NB*L, contiguous;
// it holds the slice of S~, see recurrent_forward_simd_task). kt, qt, pt, ct: [nt][ks] (ks >= K),
// start: [nt]; vv: [nt][vstride] already offset to the slice; ob likewise. Token 0 is a block start.
template <class Arch, class Acc, int NB, class Pf>
void recurrent_slice_block(Acc* K3_RESTRICT S, index_t K, index_t ks, index_t nt, Acc const* kt, Acc const* qt, Acc const* pt, Acc const* ct,
                           unsigned char const* start, Acc const* vv, Acc const* bb, Acc* ob, index_t vstride, Pf const& pf) noexcept {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size), W = NB * L;
  batch pred[NB];
  // prologue: token 0 starts a block: the decay c (previous block's cumulative decay times
  // a_0) is applied to the stored slice, and token 0's prediction taken from the result
  for (int j = 0; j < NB; ++j) pred[j] = batch(Acc(0));
  for (index_t d = 0; d < K; ++d) {
    batch const cd(ct[d]), pd(pt[d]);
    for (int j = 0; j < NB; ++j) {
      batch s = batch::load_aligned(S + d * W + j * L) * cd;
      s.store_aligned(S + d * W + j * L);
      pred[j] = k3::simd::fma(pd, s, pred[j]);
    }
  }
  for (index_t t = 0; t < nt; ++t) {
    Acc const* k = kt + t * ks;
    Acc const* q = qt + t * ks;
    batch const beta(bb[t]);
    pf(t);
    batch u[NB], o[NB], pn[NB];
    for (int j = 0; j < NB; ++j) {
      u[j] = beta * (batch::load_unaligned(vv + t * vstride + j * L) - pred[j]);
      o[j] = batch(Acc(0));
      pn[j] = batch(Acc(0));
    }
    if (t + 1 < nt && !start[t + 1]) {
      // inside a block: S~ += (k / A) u^T, o = (A q)^T S~, next pred = (A' k')^T S~
      Acc const* p = pt + (t + 1) * ks;
      for (index_t d = 0; d < K; ++d) {
        batch const kd(k[d]), qd(q[d]), pd(p[d]);
        for (int j = 0; j < NB; ++j) {
          batch const s = k3::simd::fma(kd, u[j], batch::load_aligned(S + d * W + j * L));
          o[j] = k3::simd::fma(qd, s, o[j]);
          pn[j] = k3::simd::fma(pd, s, pn[j]);
          s.store_aligned(S + d * W + j * L);
        }
      }
    } else if (t + 1 < nt) {
      // token t + 1 starts a block: its decay c is applied here
      Acc const* p = pt + (t + 1) * ks;
      Acc const* c = ct + (t + 1) * ks;
      for (index_t d = 0; d < K; ++d) {
        batch const kd(k[d]), qd(q[d]), cd(c[d]), pd(p[d]);
        for (int j = 0; j < NB; ++j) {
          batch s = k3::simd::fma(kd, u[j], batch::load_aligned(S + d * W + j * L));
          o[j] = k3::simd::fma(qd, s, o[j]);
          s *= cd;
          pn[j] = k3::simd::fma(pd, s, pn[j]);
          s.store_aligned(S + d * W + j * L);
        }
      }
    } else {
      for (index_t d = 0; d < K; ++d) {
        batch const kd(k[d]), qd(q[d]);
        for (int j = 0; j < NB; ++j) {
          batch const s = k3::simd::fma(kd, u[j], batch::load_aligned(S + d * W + j * L));
          o[j] = k3::simd::fma(qd, s, o[j]);
          s.store_aligned(S + d * W + j * L);
        }
      }
    }
    for (int j = 0; j < NB; ++j) {
      o[j].store_unaligned(ob + t * vstride + j * L);
      pred[j] = pn[j];
    }
  }
}

// Takes the rows of the next buffer of tokens (inputs, and o's rows, written soon) into L2 while
// the current buffer runs, spread over its (slice, token) steps: the rows of one head are
// strided H K values apart, which the hardware prefetchers do not follow, and loading them
// only when the buffer is built left the core waiting on DRAM for a fifth of the time.
template <class In, class S>
struct forward_prefetcher {
  problem const* p = nullptr;
  forward_args<In, S> const* a = nullptr;
  index_t b = 0, h = 0, hv = 0, t0 = 0, nt = 0, steps = 1;  // next buffer: tokens [t0, t0 + nt)
  static void bytes(void const* ptr, index_t n) noexcept {
    if (n <= 0) return;
    char const* c = static_cast<char const*>(ptr);
    for (index_t i = 0; i < n; i += 64) prefetch_l2(c + i);
    prefetch_l2(c + n - 1);
  }
  // Call i of steps takes its share of the buffer's rows (6 per token: q, k, g, v, o, beta),
  // so a few rows at a time are in flight (a whole token's at once stalled on the miss queue).
  void operator()(index_t i) const noexcept {
    index_t const lo = 6 * nt * i / steps, hi = 6 * nt * (i + 1) / steps;
    index_t const kb = p->K * index_t(sizeof(In)), vb = p->V * index_t(sizeof(In));
    for (index_t r = lo; r < hi; ++r) {
      index_t const t = t0 + r / 6;
      switch (r % 6) {
        case 0: bytes(&a->q(b, t, h, 0), kb); break;
        case 1: bytes(&a->k(b, t, h, 0), kb); break;
        case 2: bytes(&a->g(b, t, hv, 0), kb); break;
        case 3: bytes(&a->v(b, t, hv, 0), vb); break;
        case 4: bytes(&a->o(b, t, hv, 0), vb); break;
        default: prefetch_l2(&a->beta(b, t, hv)); break;
      }
    }
  }
};

// Smallest cumulative decay a block may reach (and the inverse of the largest): S~ = S / A
// grows like 1 / A, so this bounds it (float: 1 / A <= 2^40); a block ends when a row's A
// would leave [thr, 1 / thr]. A large state raises thr (block_floors).
template <class Acc>
constexpr Acc block_decay_floor() noexcept {
  if constexpr (sizeof(Acc) >= 8)
    return Acc(0x1p-80);
  else
    return Acc(0x1p-40);
}

// Per-token floors of the block decay that keep S~ = S / A finite. With 1 / A up to 2^40
// (2^80 in double), S~ overflows once |S| passes ~3e26 in float (~1.5e284 in double) although
// S itself is far from overflow. F bounds ||S_t||_F (a row of S~ is at most F / A):
//   S_t = (I - b k k^T) diag(a) S_{t-1} + b k v^T
//   =>  F_t = max(1, |1 - b |k|^2|) max(1, max a) F_{t-1} + |b| |k| |v|
// (the decay is not credited: the bound grows by at most |b| |k| |v| per token, which for
// any sensible input stays below 2^72, so the floor stays block_decay_floor; once F passes
// that, the floor is F 2^16 / max(), up to 1 (every token its own block, the direct
// recurrence), so S~ stays 2^16 below overflow. NaN or overflow in the bound: floor 1.
// F depends on tokens up to t only, so the floors keep the forward exactly causal.
// kk, aa: [nt][ks] (k, e^g); vv: [nt][V]; bb: beta. F in: the bound before token 0; returned:
// after the last token.
template <class Arch, class Acc>
double block_floors(index_t K, index_t ks, index_t V, index_t nt, Acc const* kk, Acc const* aa, Acc const* vv, Acc const* bb, double F,
                    Acc* fl) noexcept {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  index_t const V0 = V / L * L;
  batch const one(Acc(1));
  double const big = double(std::numeric_limits<Acc>::max()), lim = big * 0x1p-16 * double(block_decay_floor<Acc>());
  for (index_t t = 0; t < nt; ++t) {
    batch sk(Acc(0)), sv(Acc(0));
    auto grow = one > one;  // any e^g > 1 (NaN ignored; the padding is 1)
    for (index_t d = 0; d < ks; d += L) {  // padding: k = 0, a = 1
      batch const x = batch::load_unaligned(kk + t * ks + d);
      sk = k3::simd::fma(x, x, sk);
      grow = grow | (batch::load_unaligned(aa + t * ks + d) > one);
    }
    for (index_t e = 0; e < V0; e += L) {
      batch const x = batch::load_unaligned(vv + t * V + e);
      sv = k3::simd::fma(x, x, sv);
    }
    double const kn2 = double(::k3::simd::reduce_add(sk));
    double vn2 = double(::k3::simd::reduce_add(sv));
    for (index_t e = V0; e < V; ++e) vn2 += double(vv[t * V + e]) * double(vv[t * V + e]);
    double const b = double(bb[t]);
    double rho = std::max(1.0, std::abs(1 - b * kn2));
    if (xsimd::any(grow)) {
      double am = 1;
      for (index_t d = 0; d < K; ++d) am = std::max(am, double(aa[t * ks + d]));
      rho *= am;
    }
    F = rho * F + std::abs(b) * std::sqrt(kn2 * vn2);
    if (F <= lim) {
      fl[t] = block_decay_floor<Acc>();
    } else {
      double const r = F * 0x1p16 / big;  // NaN: 1
      fl[t] = r < 1 ? Acc(r) : Acc(1);
    }
  }
  return F;
}

// The per-token vectors of a buffer of nt tokens (rows of ks >= K values, ks a multiple of the
// batch size, the padding neutral: q = k = 0, a = 1), shared by all slices. In: qs = scale q,
// kk = k, aa = e^g, fl = the floors of the block decay (block_floors). Out: kt = k / A,
// qt = A qs, pt = A k (k at a block start), ct = the decay a block start applies to the stored
// state (a_t times the previous block's final A), start.
// A (ks values) is the cumulative decay of the current block up to the previous token; it
// carries from one buffer to the next (every buffer's token 0 starts a block).
template <class Arch, class Acc>
void recurrent_token_vectors(index_t ks, index_t nt, Acc const* qs, Acc const* kk, Acc const* aa, Acc const* fl, Acc* kt, Acc* qt, Acc* pt,
                             Acc* ct, unsigned char* start, Acc* A, Acc* An) noexcept {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  batch const one(Acc(1));
  for (index_t t = 0; t < nt; ++t) {
    batch const lo(fl[t]), hi(Acc(1) / fl[t]);
    Acc const *q = qs + t * ks, *k = kk + t * ks, *a = aa + t * ks;
    Acc *kto = kt + t * ks, *qto = qt + t * ks, *pto = pt + t * ks, *cto = ct + t * ks;
    bool in_block = t > 0;
    if (in_block) {
      auto ok = batch(Acc(0)) == batch(Acc(0));
      for (index_t d = 0; d < ks; d += L) {
        batch const x = batch::load_unaligned(A + d) * batch::load_unaligned(a + d);
        x.store_unaligned(An + d);
        ok = ok & (x >= lo) & (x <= hi);  // false for NaN: a NaN starts a block (and spreads anyway)
      }
      in_block = xsimd::all(ok);
    }
    start[t] = !in_block;
    if (in_block) {
      for (index_t d = 0; d < ks; d += L) {
        batch const x = batch::load_unaligned(An + d), kd = batch::load_unaligned(k + d);
        x.store_unaligned(A + d);
        (kd / x).store_unaligned(kto + d);
        (x * batch::load_unaligned(q + d)).store_unaligned(qto + d);
        (x * kd).store_unaligned(pto + d);
      }
    } else {
      for (index_t d = 0; d < ks; d += L) {
        batch const kd = batch::load_unaligned(k + d);
        (batch::load_unaligned(A + d) * batch::load_unaligned(a + d)).store_unaligned(cto + d);
        one.store_unaligned(A + d);
        kd.store_unaligned(kto + d);
        batch::load_unaligned(q + d).store_unaligned(qto + d);
        kd.store_unaligned(pto + d);
      }
    }
  }
}

// One sequence, value heads [hv0, hv1). The state is kept per block of tokens in a rescaled form:
// with A_t the product of the decays e^g since the block's start (row-wise, A = 1 at the
// start, whose own decay is applied to the stored state), S_t = diag(A_t) S~_t and
//   S~_t = S~_{t-1} + (k_t / A_t) u_t^T,  pred_t = (A_t k_t)^T S~_{t-1},  o_t = (A_t qs_t)^T S~_t,
// so a token costs 3 FMAs per state element instead of a decay multiply and 3 FMAs; the
// multiply is paid once per block. Blocks end where A would leave [floor, 1 / floor] (see
// block_decay_floor): rounding stays as in the direct recurrence (S~'s error relative to its
// newest, largest terms scales back with A), and g = -inf (A = 0) starts a block whose decay
// zeroes the state, exactly.
template <class Arch, class Acc, class In, class S>
void recurrent_forward_simd_group(problem const& p, forward_args<In, S> const& a, index_t n, index_t hv0, index_t hv1) {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  index_t const K = p.K, V = p.V, b = p.batch(n), bos = p.bos(n), eos = p.eos(n), gh = hv1 - hv0;
  int const NB = V % (2 * L) == 0 ? 2 : 1;
  index_t const W = NB * L, ns = V / W, ks = (K + L - 1) / L * L;
  constexpr index_t TB = 64;
  using avec = std::vector<Acc, xsimd::aligned_allocator<Acc>>;
  index_t const hs = ns * K * W;  // one head's state
  avec st(std::size_t(gh * hs));
  std::size_t const tk = std::size_t(TB * ks);
  // per buffer: qs, kk, aa (inputs), kt, qt, pt, ct (token vectors); padding stays neutral
  avec in(3 * tk), tv(4 * tk);
  Acc *qs = in.data(), *kk = qs + tk, *aa = kk + tk;
  Acc *kt = tv.data(), *qt = kt + tk, *pt = qt + tk, *ct = pt + tk;
  std::fill(qs, qs + 2 * tk, Acc(0));
  std::fill(aa, aa + tk, Acc(1));
  avec A(std::size_t(gh * ks), Acc(1)), An(static_cast<std::size_t>(ks));  // A: per head of the group
  std::vector<Acc> vv(std::size_t(TB * V)), ob(vv.size()), bb(static_cast<std::size_t>(TB)), row(static_cast<std::size_t>(V));
  std::vector<unsigned char> start(static_cast<std::size_t>(TB));
  std::vector<Acc> fl(static_cast<std::size_t>(TB));  // floors of the block decay per token
  std::vector<double> F(static_cast<std::size_t>(gh), 0.0);  // per head: bound on ||S||_F (block_floors)
  for (index_t j = 0; j < gh; ++j)
    for (index_t d = 0; d < K; ++d) {
      if (present(a.h0))
        load_row(&a.h0(n, hv0 + j, d, 0), row.data(), V);
      else
        std::fill(row.begin(), row.end(), Acc(0));
      for (index_t e = 0; e < V; ++e) F[std::size_t(j)] += double(row[std::size_t(e)]) * double(row[std::size_t(e)]);
      if (d + 1 == K) F[std::size_t(j)] = std::sqrt(F[std::size_t(j)]);
      for (index_t s = 0; s < ns; ++s) std::copy(row.begin() + s * W, row.begin() + (s + 1) * W, st.begin() + j * hs + (s * K + d) * W);
    }
  Acc const scale = static_cast<Acc>(p.scale);
  // The heads of the group take turns per buffer of tokens: a token's rows of neighbouring
  // heads share pages, so the group walks each page of the inputs once per buffer (one head
  // at a time walked a new page per row: TLB misses cost a quarter of the time).
  for (index_t t0 = bos; t0 < eos; t0 += TB) {
    index_t const nt = std::min(TB, eos - t0);
    for (index_t j = 0; j < gh; ++j) {
      index_t const hv = hv0 + j, h = hv / p.G;
      for (index_t t = 0; t < nt; ++t) {
        Acc* q = qs + t * ks;
        load_row(&a.q(b, t0 + t, h, 0), q, K);
        for (index_t d = 0; d < K; ++d) q[d] *= scale;
        load_row(&a.k(b, t0 + t, h, 0), kk + t * ks, K);
        Acc* g = aa + t * ks;
        load_row(&a.g(b, t0 + t, hv, 0), g, K);
        exp_row<Arch>(g, g, K);
        load_row(&a.v(b, t0 + t, hv, 0), vv.data() + t * V, V);
        bb[std::size_t(t)] = load_as<Acc>(a.beta(b, t0 + t, hv));
      }
      Acc* Aj = A.data() + j * ks;
      F[std::size_t(j)] = block_floors<Arch>(K, ks, V, nt, kk, aa, vv.data(), bb.data(), F[std::size_t(j)], fl.data());
      recurrent_token_vectors<Arch>(ks, nt, qs, kk, aa, fl.data(), kt, qt, pt, ct, start.data(), Aj, An.data());
      // next unit: the next head on this buffer, or the group's first head on the next buffer
      index_t const nhv = j + 1 < gh ? hv + 1 : hv0, nt0 = j + 1 < gh ? t0 : t0 + nt;
      forward_prefetcher<In, S> pf{&p, &a, b, nhv / p.G, nhv, nt0, std::clamp<index_t>(eos - nt0, 0, TB), ns * nt};
      for (index_t s = 0; s < ns; ++s) {
        Acc* Ss = st.data() + j * hs + s * K * W;
        auto pfs = [&](index_t t) { pf(s * nt + t); };
        if (NB == 2)
          recurrent_slice_block<Arch, Acc, 2>(Ss, K, ks, nt, kt, qt, pt, ct, start.data(), vv.data() + s * W, bb.data(), ob.data() + s * W, V, pfs);
        else
          recurrent_slice_block<Arch, Acc, 1>(Ss, K, ks, nt, kt, qt, pt, ct, start.data(), vv.data() + s * W, bb.data(), ob.data() + s * W, V, pfs);
      }
      for (index_t t = 0; t < nt; ++t) store_row(ob.data() + t * V, &a.o(b, t0 + t, hv, 0), V);
    }
  }
  if (present(a.ht))
    for (index_t j = 0; j < gh; ++j)
      for (index_t d = 0; d < K; ++d) {
        Acc const Ad = A[std::size_t(j * ks + d)];
        for (index_t s = 0; s < ns; ++s)
          for (index_t e = 0; e < W; ++e) row[std::size_t(s * W + e)] = Ad * st[std::size_t(j * hs + (s * K + d) * W + e)];
        store_row(row.data(), &a.ht(n, hv0 + j, d, 0), V);
      }
}

// Value heads per task of the recurrent forward: up to 8 (see recurrent_forward_simd_group),
// but at least two tasks per thread where the heads allow, so a thread slowed by other load
// hands work to the other (B = 1, H = 16 on 2 threads: groups of 4).
inline index_t recurrent_head_group(index_t N, index_t HV, index_t threads) {
  index_t const target = (N * HV) / std::max<index_t>(1, 2 * threads);
  return std::clamp<index_t>(target, 1, std::min<index_t>(HV, 8));
}

// ---------------------------------------------------------------------------------------------
// Decode: one token for each of N sequences, states updated in place in a slot-addressed pool.
//
// Memory traffic is the whole cost (one 128 x 128 fp32 state is 64 KiB and sees 4 flops per
// element), so the kernel is built around the memory stream:
//   - a thread walks a contiguous range of (sequence, value head) pairs, so a sequence's
//     states (contiguous in the pool) stream in address order;
//   - each state is walked row by row over whole rows (up to 8 SIMD batches of columns held
//     in registers): pass 1 reads row d and accumulates the prediction a.k^T S; pass 2
//     re-reads the row (now in L1/L2), decays it, adds k u^T, stores it and accumulates
//     o = S^T q. The delta rule needs the full prediction before any element is written, so
//     two touches are unavoidable; the second one hits the cache, so DRAM sees one read and
//     one write per element, in sequential order;
//   - pairs go decode_streams (4) at a time: pass 1 of all of them runs row by row together
//     (independent read streams keep more lines in flight than one), then pass 2 of each;
//     meanwhile the states of the next four pairs are prefetched into L2 (half a row per row
//     step of either pass, round-robin over the four in the order the next pass 1 reads them),
//     so DRAM reads overlap the arithmetic. Per state the arithmetic and its order are those
//     of a single state (bit for bit where xsimd's fma is a fused instruction; on avx2 and
//     avx512f it is x * y + z, which g++ may contract differently where it is inlined: the
//     tests compare the grouped and single paths with a tolerance);
//   - the per-pair inputs (q scaled, k, e^g, e^g k, v) are converted into a small stack
//     buffer: no heap allocation per pair.

// prefetch_l2 (common.hpp) takes the next state into L2, not L1: pulling it into L1 would evict
// the rows pass 2 is about to re-read.
// Prefetches one state of a coming pair, half a row per call: call i in [0, 2 K) covers row
// i / 2, half i % 2, so one call per row step of the two passes covers the whole state.
struct decode_prefetcher {
  char const* base = nullptr;  // null: nothing to prefetch
  index_t row_bytes = 0, half_bytes = 0, stride_bytes = 0;
  void half_row(index_t i) const noexcept {
    if (base == nullptr) return;
    char const* r = base + (i >> 1) * stride_bytes;
    if (i & 1) {
      for (index_t b = half_bytes; b < row_bytes; b += 64) prefetch_l2(r + b);
      prefetch_l2(r + row_bytes - 1);  // the row's last line when rows are not line-aligned
    } else {
      for (index_t b = 0; b < half_bytes; b += 64) prefetch_l2(r + b);
    }
  }
};

// Per-pair inputs, converted to Acc.
template <class Acc>
struct decode_vectors {
  Acc const *qs, *k, *a, *ak, *v;  // scale q, k, e^g, e^g k (K each); v (V)
  Acc beta;
};

// Pass 1 over columns [c0, c0 + NB L) of one state (K rows, row stride rs), for NS states at
// once, row by row: acc[s] = (e^g k)^T S_s. Two states read together are two independent
// streams for the hardware prefetchers.
template <class Arch, class Acc, int NB, int NS>
inline void decode_predict(Acc* const* S, index_t rs, index_t K, index_t c0, decode_vectors<Acc> const* x, xsimd::batch<Acc, Arch> (&acc)[NS][NB],
                           decode_prefetcher const* pf) noexcept {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  for (int s = 0; s < NS; ++s)
    for (int j = 0; j < NB; ++j) acc[s][j] = batch(Acc(0));
  for (index_t d = 0; d < K; ++d) {
    for (int s = 0; s < NS; ++s) {
      batch const akd(x[s].ak[d]);
      Acc const* row = S[s] + d * rs + c0;
      for (int j = 0; j < NB; ++j) acc[s][j] = k3::simd::fma(akd, batch::load_unaligned(row + j * L), acc[s][j]);
    }
    for (int s = 0; s < NS; ++s) pf[s].half_row(d);
  }
}

// Pass 2 over the same columns of state `which` of NS, from the cache: S = e^g S + k u^T with
// u = beta (v - pred), stored; o = S^T (scale q). The NS pass-2 loops together cover the second
// halves of the NS coming states, round-robin by half row (step i of them prefetches half row
// K + i / NS of coming state i % NS), so those states arrive in the order the next group's pass 1
// reads them: row by row across all of them. Giving each loop its own coming state instead is
// slower, likely because the last coming state's second half is then requested late, in one
// burst from one stream (benchmarks/kda.md).
template <class Arch, class Acc, int NB, int NS>
inline void decode_update(Acc* K3_RESTRICT S, index_t rs, index_t K, index_t c0, decode_vectors<Acc> const& x, xsimd::batch<Acc, Arch> (&pred)[NB],
                          Acc* K3_RESTRICT o, decode_prefetcher const* pf, int which) noexcept {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  batch u[NB], acc[NB];
  batch const beta(x.beta);
  for (int j = 0; j < NB; ++j) {
    u[j] = beta * (batch::load_unaligned(x.v + c0 + j * L) - pred[j]);
    acc[j] = batch(Acc(0));
  }
  Acc* row = S + c0;
  for (index_t d = 0; d < K; ++d, row += rs) {
    batch const ad(x.a[d]), kd(x.k[d]), qd(x.qs[d]);
    for (int j = 0; j < NB; ++j) {
      batch const s = k3::simd::fma(kd, u[j], batch::load_unaligned(row + j * L) * ad);
      s.store_unaligned(row + j * L);
      acc[j] = k3::simd::fma(qd, s, acc[j]);
    }
    index_t const i = index_t(which) * K + d;
    pf[i % NS].half_row(K + i / NS);
  }
  for (int j = 0; j < NB; ++j) acc[j].store_unaligned(o + c0 + j * L);
}

// Columns [c0, c0 + NB L) of NS states: pass 1 for all of them together, then pass 2 of each.
template <class Arch, class Acc, int NB, int NS = 1>
inline void decode_column_block(Acc* const* S, index_t rs, index_t K, index_t c0, decode_vectors<Acc> const* x, Acc* const* o,
                                decode_prefetcher const* pf) noexcept {
  xsimd::batch<Acc, Arch> pred[NS][NB];
  decode_predict<Arch, Acc, NB, NS>(S, rs, K, c0, x, pred, pf);
  for (int s = 0; s < NS; ++s) decode_update<Arch, Acc, NB, NS>(S[s], rs, K, c0, x[s], pred[s], o[s], pf, s);
}

// The columns [c0, V) that do not fill a SIMD batch, scalar.
template <class Acc>
inline void decode_column_tail(Acc* K3_RESTRICT S, index_t rs, index_t K, index_t c0, index_t V, decode_vectors<Acc> const& x,
                               Acc* K3_RESTRICT o) noexcept {
  for (index_t e = c0; e < V; ++e) {
    Acc pred = 0;
    for (index_t d = 0; d < K; ++d) pred += x.ak[d] * S[d * rs + e];
    Acc const u = x.beta * (x.v[e] - pred);
    Acc oe = 0;
    for (index_t d = 0; d < K; ++d) {
      Acc const s = x.a[d] * S[d * rs + e] + x.k[d] * u;
      S[d * rs + e] = s;
      oe += x.qs[d] * s;
    }
    o[e] = oe;
  }
}

// Batches per column block: the block's prediction, u and output accumulators stay in
// registers (3 NB of them), so 8 with 32 vector registers (AVX-512), 4 otherwise.
template <class Arch, class Acc>
constexpr int decode_max_batches() noexcept {
  return sizeof(xsimd::batch<Acc, Arch>) >= 64 ? 8 : 4;
}

// States decoded together (see decode_simd_range). One core reads several sequential streams
// faster than one (the hardware prefetchers keep more lines in flight), and the software
// prefetch of the next group keeps the states coming; four states in flight (256 KiB) plus the
// four being prefetched fit the 1 MiB L2, while more states would no longer fit it with their
// successors. Measurements: benchmarks/kda.md.
inline constexpr int decode_streams = 4;

// NS states with the same K, V and row stride.
template <class Arch, class Acc, int NS>
inline void decode_states(Acc* const* S, index_t rs, index_t K, index_t V, decode_vectors<Acc> const* x, Acc* const* o,
                          decode_prefetcher* pf) noexcept {
  constexpr index_t L = index_t(xsimd::batch<Acc, Arch>::size);
  constexpr int NBMAX = decode_max_batches<Arch, Acc>();
  index_t c0 = 0;
  for (; c0 + NBMAX * L <= V; c0 += NBMAX * L) {
    decode_column_block<Arch, Acc, NBMAX, NS>(S, rs, K, c0, x, o, pf);
    for (int s = 0; s < NS; ++s) pf[s].base = nullptr;  // one block's passes already covered the whole next state
  }
  int const nb = int((V - c0) / L);
  auto block = [&](auto NBc) {
    decode_column_block<Arch, Acc, decltype(NBc)::value, NS>(S, rs, K, c0, x, o, pf);
    c0 += decltype(NBc)::value * L;
  };
  switch (nb) {
    case 0: break;
    case 1: block(std::integral_constant<int, 1>{}); break;
    case 2: block(std::integral_constant<int, 2>{}); break;
    case 3: block(std::integral_constant<int, 3>{}); break;
    default:
      if constexpr (NBMAX > 4) {
        switch (nb) {
          case 4: block(std::integral_constant<int, 4>{}); break;
          case 5: block(std::integral_constant<int, 5>{}); break;
          case 6: block(std::integral_constant<int, 6>{}); break;
          default: block(std::integral_constant<int, 7>{}); break;
        }
      }
      break;
  }
  if (c0 < V)
    for (int s = 0; s < NS; ++s) decode_column_tail(S[s], rs, K, c0, V, x[s], o[s]);
}

// Pairs [lo, hi) of the flattened index j * HV + hv, in place on the pool; `seq(j)` is the
// sequence of the j-th decoded entry (padding entries are left out by the caller) and
// `slot(n)` the pool slot of sequence n.
template <class Arch, class Acc, class In, class SlotOf, class SeqOf>
void decode_simd_range(problem const& p, decode_args<In, Acc> const& a, SlotOf const& slot, SeqOf const& seq, index_t lo, index_t hi) {
  index_t const K = p.K, V = p.V;
  if (lo >= hi) return;
  // per state in flight: qs, k, a, ak (K each), v, o (V each)
  constexpr std::size_t stack_elems = 4096 / sizeof(Acc) * 4;
  std::size_t const need = std::size_t(4 * K + 2 * V);
  alignas(64) Acc stack_buf[stack_elems];
  std::vector<Acc> heap_buf;  // only for K, V beyond the stack buffer (once per range, not per pair)
  Acc* buf = stack_buf;
  if (decode_streams * need > stack_elems) {
    heap_buf.resize(decode_streams * need);
    buf = heap_buf.data();
  }
  Acc const scale = static_cast<Acc>(p.scale);
  index_t const rs = a.state_pool.stride(2);
  auto state_of = [&](index_t i) { return &a.state_pool(slot(seq(i / p.HV)), i % p.HV, 0, 0); };
  // Converts pair i's inputs into buffer b (< decode_streams).
  auto stage = [&](index_t i, int b) {
    Acc* qs = buf + std::size_t(b) * need;
    Acc *k = qs + K, *ea = k + K, *ak = ea + K, *v = ak + K;
    index_t const n = seq(i / p.HV), hv = i % p.HV, h = hv / p.G;
    load_row(&a.q(n, h, 0), qs, K);
    for (index_t d = 0; d < K; ++d) qs[d] *= scale;
    load_row(&a.k(n, h, 0), k, K);
    load_row(&a.g(n, hv, 0), ea, K);
    exp_row<Arch>(ea, ea, K);
    for (index_t d = 0; d < K; ++d) ak[d] = ea[d] * k[d];
    load_row(&a.v(n, hv, 0), v, V);
    return decode_vectors<Acc>{qs, k, ea, ak, v, load_as<Acc>(a.beta(n, hv))};
  };
  auto out_of = [&](int b) { return buf + std::size_t(b) * need + std::size_t(4 * K + V); };
  // The state that pair j's prefetch covers (none past the range).
  auto prefetcher_for = [&](index_t j) {
    decode_prefetcher pf;
    if (j < hi && K > 0) {
      pf.base = reinterpret_cast<char const*>(state_of(j));
      pf.row_bytes = V * index_t(sizeof(Acc));
      pf.half_bytes = pf.row_bytes / 2;
      pf.stride_bytes = rs * index_t(sizeof(Acc));
    }
    return pf;
  };
  // NS pairs at a time: their first passes run together (NS read streams), and the NS pairs
  // after them are prefetched meanwhile.
  auto group = [&](auto NSc, index_t i0) {
    constexpr int NS = decltype(NSc)::value;
    decode_vectors<Acc> x[NS];
    Acc* S[NS];
    Acc* o[NS];
    decode_prefetcher pf[NS];
    for (int b = 0; b < NS; ++b) {
      x[b] = stage(i0 + b, b);
      S[b] = state_of(i0 + b);
      o[b] = out_of(b);
      pf[b] = prefetcher_for(i0 + NS + b);
    }
    decode_states<Arch, Acc, NS>(S, rs, K, V, x, o, pf);
    for (int b = 0; b < NS; ++b) store_row(o[b], &a.o(seq((i0 + b) / p.HV), (i0 + b) % p.HV, 0), V);
  };
  index_t i = lo;
  for (; i + decode_streams <= hi; i += decode_streams) group(std::integral_constant<int, decode_streams>{}, i);
  for (; i < hi; ++i) group(std::integral_constant<int, 1>{}, i);
}

}  // namespace k3::kda::detail
