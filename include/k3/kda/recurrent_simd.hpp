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
#include <type_traits>
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
//   - while pair i is processed, the state of pair i+1 is prefetched into L2 (half a row per
//     row step of either pass), so DRAM reads overlap the arithmetic;
//   - the per-pair inputs (q scaled, k, e^g, e^g k, v) are converted into a small stack
//     buffer: no heap allocation per pair.

// prefetch_l2 (common.hpp) takes the next state into L2, not L1: pulling it into L1 would evict
// the rows pass 2 is about to re-read.
// Prefetches the state of the next pair, half a row per call: call i in [0, 2 K) covers row
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

// Columns [c0, c0 + NB L) of one state (K rows, row stride rs): both passes.
template <class Arch, class Acc, int NB>
inline void decode_column_block(Acc* K3_RESTRICT S, index_t rs, index_t K, index_t c0, decode_vectors<Acc> const& x, Acc* K3_RESTRICT o,
                                decode_prefetcher const& pf) noexcept {
  using batch = xsimd::batch<Acc, Arch>;
  constexpr index_t L = index_t(batch::size);
  batch acc[NB];
  for (int j = 0; j < NB; ++j) acc[j] = batch(Acc(0));
  Acc* row = S + c0;
  for (index_t d = 0; d < K; ++d, row += rs) {
    batch const akd(x.ak[d]);
    for (int j = 0; j < NB; ++j) acc[j] = xsimd::fma(akd, batch::load_unaligned(row + j * L), acc[j]);
    pf.half_row(d);
  }
  batch u[NB];
  batch const beta(x.beta);
  for (int j = 0; j < NB; ++j) {
    u[j] = beta * (batch::load_unaligned(x.v + c0 + j * L) - acc[j]);
    acc[j] = batch(Acc(0));
  }
  row = S + c0;
  for (index_t d = 0; d < K; ++d, row += rs) {
    batch const ad(x.a[d]), kd(x.k[d]), qd(x.qs[d]);
    for (int j = 0; j < NB; ++j) {
      batch const s = xsimd::fma(kd, u[j], batch::load_unaligned(row + j * L) * ad);
      s.store_unaligned(row + j * L);
      acc[j] = xsimd::fma(qd, s, acc[j]);
    }
    pf.half_row(K + d);
  }
  for (int j = 0; j < NB; ++j) acc[j].store_unaligned(o + c0 + j * L);
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

template <class Arch, class Acc>
inline void decode_state(Acc* S, index_t rs, index_t K, index_t V, decode_vectors<Acc> const& x, Acc* o, decode_prefetcher pf) noexcept {
  constexpr index_t L = index_t(xsimd::batch<Acc, Arch>::size);
  constexpr int NBMAX = decode_max_batches<Arch, Acc>();
  index_t c0 = 0;
  for (; c0 + NBMAX * L <= V; c0 += NBMAX * L) {
    decode_column_block<Arch, Acc, NBMAX>(S, rs, K, c0, x, o, pf);
    pf.base = nullptr;  // one block's passes already covered the whole next state
  }
  int const nb = int((V - c0) / L);
  auto block = [&](auto NBc) {
    decode_column_block<Arch, Acc, decltype(NBc)::value>(S, rs, K, c0, x, o, pf);
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
  if (c0 < V) decode_column_tail(S, rs, K, c0, V, x, o);
}

// Pairs [lo, hi) of the flattened (sequence, value head) index n * HV + hv, in place on the
// pool; `slot(n)` maps a sequence to its pool slot.
template <class Arch, class Acc, class In, class SlotOf>
void decode_simd_range(problem const& p, decode_args<In, Acc> const& a, SlotOf const& slot, index_t lo, index_t hi) {
  index_t const K = p.K, V = p.V;
  if (lo >= hi) return;
  // qs, k, a, ak (K each), v, o (V each)
  constexpr std::size_t stack_elems = 4096 / sizeof(Acc) * 4;
  std::size_t const need = std::size_t(4 * K + 2 * V);
  alignas(64) Acc stack_buf[stack_elems];
  std::vector<Acc> heap_buf;  // only for K, V beyond the stack buffer (once per range, not per pair)
  Acc* buf = stack_buf;
  if (need > stack_elems) {
    heap_buf.resize(need);
    buf = heap_buf.data();
  }
  Acc *qs = buf, *k = qs + K, *ea = k + K, *ak = ea + K, *v = ak + K, *o = v + V;
  Acc const scale = static_cast<Acc>(p.scale);
  index_t const rs = a.state_pool.stride(2);
  auto state_of = [&](index_t i) { return &a.state_pool(slot(i / p.HV), i % p.HV, 0, 0); };
  for (index_t i = lo; i < hi; ++i) {
    index_t const n = i / p.HV, hv = i % p.HV, h = hv / p.G;
    load_row(&a.q(n, h, 0), qs, K);
    for (index_t d = 0; d < K; ++d) qs[d] *= scale;
    load_row(&a.k(n, h, 0), k, K);
    load_row(&a.g(n, hv, 0), ea, K);
    exp_row<Arch>(ea, ea, K);
    for (index_t d = 0; d < K; ++d) ak[d] = ea[d] * k[d];
    load_row(&a.v(n, hv, 0), v, V);
    decode_vectors<Acc> const x{qs, k, ea, ak, v, load_as<Acc>(a.beta(n, hv))};
    decode_prefetcher pf;
    if (i + 1 < hi && K > 0) {
      pf.base = reinterpret_cast<char const*>(state_of(i + 1));
      pf.row_bytes = V * index_t(sizeof(Acc));
      pf.half_bytes = pf.row_bytes / 2;
      pf.stride_bytes = rs * index_t(sizeof(Acc));
    }
    decode_state<Arch>(state_of(i), rs, K, V, x, o, pf);
    store_row(o, &a.o(n, hv, 0), V);
  }
}

}  // namespace k3::kda::detail
