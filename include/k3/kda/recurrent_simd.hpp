// k3/kda/recurrent_simd.hpp — the serial recurrence vectorised with xsimd, for the simd and
// threads backends: the forward over a sequence, and the decode step in place on a state pool.
//
// The state of one value head is split into column slices of W = 2 SIMD batches (32 floats
// with AVX-512), stored slice-major so a K x W slice (16 KiB for K = 128) stays in L1 while a
// block of tokens streams through it. Each token touches a state row once: the write of token
// t (S += k u^T, o += q.S) is fused with the decay and the prediction of token t+1
// (S <- a S, pred += k.S), so the state is loaded and stored once per token.
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>
#include <xsimd/xsimd.hpp>

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

// NB batches per slice. Runs tokens [0, nt) of a block on one slice S (K x NB*L, contiguous).
// qs, kk, aa: [nt][K]; vv: [nt][vstride] already offset to the slice; ob likewise.
template <class Arch, class Acc, int NB>
void recurrent_slice_block(Acc* K3_RESTRICT S, index_t K, index_t nt, Acc const* qs, Acc const* kk, Acc const* aa, Acc const* vv,
                           Acc const* bb, Acc* ob, index_t vstride) noexcept {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size), W = NB * L;
  batch pred[NB];
  // prologue: decay for token 0 and its prediction
  for (int j = 0; j < NB; ++j) pred[j] = batch(Acc(0));
  {
    Acc const* a0 = aa;
    Acc const* k0 = kk;
    for (index_t d = 0; d < K; ++d) {
      batch const ad(a0[d]), kd(k0[d]);
      for (int j = 0; j < NB; ++j) {
        batch s = batch::load_aligned(S + d * W + j * L) * ad;
        s.store_aligned(S + d * W + j * L);
        pred[j] = xsimd::fma(kd, s, pred[j]);
      }
    }
  }
  for (index_t t = 0; t < nt; ++t) {
    Acc const* q = qs + t * K;
    Acc const* k = kk + t * K;
    batch const beta(bb[t]);
    batch u[NB], o[NB], pn[NB];
    for (int j = 0; j < NB; ++j) {
      u[j] = beta * (batch::load_unaligned(vv + t * vstride + j * L) - pred[j]);
      o[j] = batch(Acc(0));
      pn[j] = batch(Acc(0));
    }
    if (t + 1 < nt) {
      Acc const* an = aa + (t + 1) * K;
      Acc const* kn = kk + (t + 1) * K;
      for (index_t d = 0; d < K; ++d) {
        batch const kd(k[d]), qd(q[d]), ad(an[d]), knd(kn[d]);
        for (int j = 0; j < NB; ++j) {
          batch s = xsimd::fma(kd, u[j], batch::load_aligned(S + d * W + j * L));
          o[j] = xsimd::fma(qd, s, o[j]);
          s *= ad;
          pn[j] = xsimd::fma(knd, s, pn[j]);
          s.store_aligned(S + d * W + j * L);
        }
      }
    } else {
      for (index_t d = 0; d < K; ++d) {
        batch const kd(k[d]), qd(q[d]);
        for (int j = 0; j < NB; ++j) {
          batch s = xsimd::fma(kd, u[j], batch::load_aligned(S + d * W + j * L));
          o[j] = xsimd::fma(qd, s, o[j]);
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

template <class Arch, class Acc, class In, class S>
void recurrent_forward_simd_task(problem const& p, forward_args<In, S> const& a, index_t n, index_t hv) {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  index_t const K = p.K, V = p.V, b = p.batch(n), h = hv / p.G, bos = p.bos(n), eos = p.eos(n);
  int const NB = V % (2 * L) == 0 ? 2 : 1;
  index_t const W = NB * L, ns = V / W;
  constexpr index_t TB = 64;
  std::vector<Acc, xsimd::aligned_allocator<Acc>> st(std::size_t(ns * K * W));
  std::vector<Acc> qs(std::size_t(TB * K)), kk(qs.size()), gg(qs.size()), aa(qs.size()), vv(std::size_t(TB * V)), ob(vv.size()),
      bb(static_cast<std::size_t>(TB)), row(static_cast<std::size_t>(V));
  for (index_t d = 0; d < K; ++d) {
    if (present(a.h0))
      load_row(&a.h0(n, hv, d, 0), row.data(), V);
    else
      std::fill(row.begin(), row.end(), Acc(0));
    for (index_t s = 0; s < ns; ++s) std::copy(row.begin() + s * W, row.begin() + (s + 1) * W, st.begin() + (s * K + d) * W);
  }
  Acc const scale = static_cast<Acc>(p.scale);
  for (index_t t0 = bos; t0 < eos; t0 += TB) {
    index_t const nt = std::min(TB, eos - t0);
    for (index_t t = 0; t < nt; ++t) {
      load_row(&a.q(b, t0 + t, h, 0), qs.data() + t * K, K);
      for (index_t d = 0; d < K; ++d) qs[std::size_t(t * K + d)] *= scale;
      load_row(&a.k(b, t0 + t, h, 0), kk.data() + t * K, K);
      load_row(&a.g(b, t0 + t, hv, 0), gg.data() + t * K, K);
      load_row(&a.v(b, t0 + t, hv, 0), vv.data() + t * V, V);
      bb[std::size_t(t)] = load_as<Acc>(a.beta(b, t0 + t, hv));
    }
    exp_row<Arch>(gg.data(), aa.data(), nt * K);
    for (index_t s = 0; s < ns; ++s) {
      Acc* Ss = st.data() + s * K * W;
      if (NB == 2)
        recurrent_slice_block<Arch, Acc, 2>(Ss, K, nt, qs.data(), kk.data(), aa.data(), vv.data() + s * W, bb.data(), ob.data() + s * W, V);
      else
        recurrent_slice_block<Arch, Acc, 1>(Ss, K, nt, qs.data(), kk.data(), aa.data(), vv.data() + s * W, bb.data(), ob.data() + s * W, V);
    }
    for (index_t t = 0; t < nt; ++t) store_row(ob.data() + t * V, &a.o(b, t0 + t, hv, 0), V);
  }
  if (present(a.ht))
    for (index_t d = 0; d < K; ++d) {
      for (index_t s = 0; s < ns; ++s) std::copy(st.begin() + (s * K + d) * W, st.begin() + (s * K + d + 1) * W, row.begin() + s * W);
      store_row(row.data(), &a.ht(n, hv, d, 0), V);
    }
}

// Decode in place on the pool: the slice is read once for the prediction and once (from
// cache) for the update, so memory traffic is one read and one write of the state.
template <class Arch, class Acc, class In>
void decode_simd_task(problem const& p, decode_args<In, Acc> const& a, index_t n, index_t slot, index_t hv) {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  index_t const K = p.K, V = p.V, h = hv / p.G;
  constexpr index_t NB = 2;
  std::vector<Acc> buf(std::size_t(4 * K + 2 * V));
  Acc *qs = buf.data(), *k = qs + K, *g = k + K, *ak = g + K, *v = ak + K, *o = v + V;
  load_row(&a.q(n, h, 0), qs, K);
  for (index_t d = 0; d < K; ++d) qs[d] *= static_cast<Acc>(p.scale);
  load_row(&a.k(n, h, 0), k, K);
  load_row(&a.g(n, hv, 0), g, K);
  exp_row<Arch>(g, g, K);  // g now holds a = e^g
  for (index_t d = 0; d < K; ++d) ak[d] = k[d] * g[d];
  load_row(&a.v(n, hv, 0), v, V);
  batch const beta(load_as<Acc>(a.beta(n, hv)));
  Acc* S0 = &a.state_pool(slot, hv, 0, 0);
  index_t const rs = a.state_pool.stride(2);
  index_t c0 = 0;
  for (; c0 + NB * L <= V; c0 += NB * L) {
    batch pred[NB], u[NB], oo[NB];
    for (index_t j = 0; j < NB; ++j) pred[j] = batch(Acc(0));
    for (index_t d = 0; d < K; ++d) {
      batch const kd(ak[d]);
      for (index_t j = 0; j < NB; ++j) pred[j] = xsimd::fma(kd, batch::load_unaligned(S0 + d * rs + c0 + j * L), pred[j]);
    }
    for (index_t j = 0; j < NB; ++j) {
      u[j] = beta * (batch::load_unaligned(v + c0 + j * L) - pred[j]);
      oo[j] = batch(Acc(0));
    }
    for (index_t d = 0; d < K; ++d) {
      batch const ad(g[d]), kd(k[d]), qd(qs[d]);
      for (index_t j = 0; j < NB; ++j) {
        Acc* ps = S0 + d * rs + c0 + j * L;
        batch s = xsimd::fma(kd, u[j], batch::load_unaligned(ps) * ad);
        s.store_unaligned(ps);
        oo[j] = xsimd::fma(qd, s, oo[j]);
      }
    }
    for (index_t j = 0; j < NB; ++j) oo[j].store_unaligned(o + c0 + j * L);
  }
  for (; c0 < V; c0 += L) {  // V % L == 0 is required by the caller
    batch pred(Acc(0));
    for (index_t d = 0; d < K; ++d) pred = xsimd::fma(batch(ak[d]), batch::load_unaligned(S0 + d * rs + c0), pred);
    batch const u = beta * (batch::load_unaligned(v + c0) - pred);
    batch oo(Acc(0));
    for (index_t d = 0; d < K; ++d) {
      Acc* ps = S0 + d * rs + c0;
      batch s = xsimd::fma(batch(k[d]), u, batch::load_unaligned(ps) * batch(g[d]));
      s.store_unaligned(ps);
      oo = xsimd::fma(batch(qs[d]), s, oo);
    }
    oo.store_unaligned(o + c0);
  }
  store_row(o, &a.o(n, hv, 0), V);
}

}  // namespace k3::kda::detail
