// k3/attnres/two_phase.hpp — two-phase Block AttnRes inference (spec §4.2, paper Algorithm 1).
//
// The pseudo-queries do not depend on the input, so all sites of a block can be scored against
// the completed blocks b_0..b_{n-1} at once (phase 1), before any sublayer of the block runs:
//     s_{l,j} = rinv_j (u_l . b_j),  o_l = sum_j softmax_j(s_l) b_j,  lse_l = logsumexp_j s_l.
// Phase 2 then merges the intra-block partial sum b (one extra source) site by site with the
// exact online-softmax step in its sigmoid form:
//     p = sigmoid(r_b (u . b) - lse_l),   h = o_l + p (b - o_l)        (h = o_l at a block's first site)
// and can fuse the preceding residual add (prefix += delta).
//
// rinv_j, the inverse RMS of a completed block, is computed once when the block is closed
// (block_rinv) and stored with it. Queries arrive folded: u_l = gain_l * w_l.
// Precision: float rows; phase-1 scores from float register tiles rounded into double, softmax
// and lse in double; the phase-2 weight p from float lane sums (the step is bandwidth-bound).
// Both agree with the one-pass mix to float rounding (tests: 1e-6 relative per site).
// With bfloat16 storage on an AVX-512 backend, phase 1, phase2_add and a block's first phase 2
// run the kernels of arch/avx512.hpp (bf16 rows read directly, register-tiled products, scores summed
// in double per 512-column tile, streamed outputs); every other case runs the portable ones.
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "k3/attnres/arch/avx512.hpp"
#include "k3/attnres/arch/generic.hpp"
#include "k3/attnres/mix.hpp"
#include "k3/attnres/tuning.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/core/storage.hpp"

namespace k3::attnres {

struct two_phase_options {
  double eps = 1e-5;  // the key RMSNorm's eps
  ::k3::attnres::tuning tuning = ::k3::attnres::tuning::host();
};

// The views of block_rinv: S the block's storage; rinv has the compute type. Space: where the
// views live (host_space for the CPU backends), for the ops the CUDA kernels also serve.
template <Storage S, class Space = host_space>
struct block_rinv_args {
  tensor_view<S const, 2, Space> block;                 // [T, d]
  tensor_view<k3::accumulation_t<S>, 1, Space> rinv;    // [T], written
};

// The views of phase1: S the bank's storage, O that of o.
template <Storage S, class O = S, class Space = host_space>
struct phase1_args {
  tensor_view<S const, 3, Space> bank;                               // [n, T, d] completed blocks
  tensor_view<k3::accumulation_t<S> const, 2, Space> bank_rinv;      // [n, T]
  tensor_view<k3::accumulation_t<S> const, 2, Space> u;              // [nq, d] folded queries
  tensor_view<O, 3, Space> o;                                        // [nq, T, d], written
  tensor_view<k3::accumulation_t<S>, 2, Space> lse;                  // [nq, T], written
};

// The views of phase2: S the partial's storage, O that of o, H that of h.
template <Storage S, class O = S, class H = S>
struct phase2_args {
  tensor_view<O const, 2> o;                                  // [T, d]
  tensor_view<k3::accumulation_t<S> const, 1> lse;            // [T]
  tensor_view<S const, 2> partial = {};                       // [T, d]; absent at a block's first site
  tensor_view<k3::accumulation_t<S> const, 1> u;              // [d]
  tensor_view<H, 2> h;                                        // [T, d], written
};

// The views of phase2_add: S the prefix's storage, D that of delta, O of o, H of h.
template <Storage S, class D = S, class O = S, class H = S, class Space = host_space>
struct phase2_add_args {
  tensor_view<O const, 2, Space> o;                                  // [T, d]
  tensor_view<k3::accumulation_t<S> const, 1, Space> lse;            // [T]
  tensor_view<S, 2, Space> prefix;                                   // [T, d], updated in place
  tensor_view<D const, 2, Space> delta;                              // [T, d]
  tensor_view<k3::accumulation_t<S> const, 1, Space> u;              // [d]
  tensor_view<H, 2, Space> h;                                        // [T, d], written
};

namespace detail {

inline void check_eps(double eps) {
  require(eps >= 0 && std::isfinite(eps), error_kind::value, [&] { return "option 'eps' must be finite and >= 0, got " + std::to_string(eps); });
}

// The checks of block_rinv, phase1 and phase2_add (shapes, options, aliasing), one function
// per op for the host and the CUDA backend alike, so both raise the same k3::error.

// Returns (T, d).
template <class S, class Space>
void validate_block_rinv(block_rinv_args<S, Space> const& args, two_phase_options const& opt, index_t& T, index_t& d) {
  auto const block = args.block;
  auto const rinv = args.rinv;
  check_view("block", block);
  check_inner_contiguous("block", block);
  T = block.extent(0);
  d = block.extent(1);
  check_view("rinv", rinv);
  check_shape("rinv", rinv, {T});
  check_outputs_apart(named_views("rinv", rinv), named_views("block", block));
  check_eps(opt.eps);
}

// The sizes of a validated phase 1: n completed blocks, nq sites, T tokens, d features.
struct phase1_problem {
  index_t n = 0, nq = 0, T = 0, d = 0;
};

template <class S, class O, class Space>
phase1_problem validate_phase1(phase1_args<S, O, Space> const& args, two_phase_options const&) {
  static_assert(!std::is_const_v<O>, "phase1: o is written");
  auto const bank = args.bank;
  auto const bank_rinv = args.bank_rinv;
  auto const u = args.u;
  auto const o = args.o;
  auto const lse = args.lse;
  check_view("bank", bank);
  check_inner_contiguous("bank", bank);
  index_t const n = bank.extent(0), T = bank.extent(1), d = bank.extent(2);
  check_view("u", u);
  check_inner_contiguous("u", u);
  index_t const nq = u.extent(0);
  check_shape("u", u, {nq, d});
  check_view("bank_rinv", bank_rinv);
  check_shape("bank_rinv", bank_rinv, {n, T});
  check_rows("o", o, {nq, T, d});
  check_view("lse", lse);
  check_shape("lse", lse, {nq, T});
  check_outputs_apart(named_views("o", o, "lse", lse), named_views("bank", bank, "bank_rinv", bank_rinv, "u", u));
  return {n, nq, T, d};
}

// Returns (T, d).
template <class S, class D, class O, class H, class Space>
void validate_phase2_add(phase2_add_args<S, D, O, H, Space> const& args, two_phase_options const& opt, index_t& T, index_t& d) {
  static_assert(!std::is_const_v<S> && !std::is_const_v<H>, "phase2_add: prefix and h are written");
  auto const o = args.o;
  auto const lse = args.lse;
  auto const prefix = args.prefix;
  auto const delta = args.delta;
  auto const u = args.u;
  auto const h = args.h;
  check_view("o", o);
  check_inner_contiguous("o", o);
  T = o.extent(0);
  d = o.extent(1);
  check_rows("prefix", prefix, {T, d});
  check_rows("delta", delta, {T, d});
  check_view("lse", lse);
  check_shape("lse", lse, {T});
  check_view("u", u);
  check_shape("u", u, {d});
  check_rows("h", h, {T, d});
  // prefix is updated in place (it is its own input); neither it nor h broadcast, over the
  // other or over o, delta, lse, u.
  check_outputs_apart(named_views("prefix", prefix, "h", h), named_views("o", o, "delta", delta, "lse", lse, "u", u));
  check_eps(opt.eps);
}

// Phase-1 scores of one token: dots[l * n + j] = u_l . x_j, in double. The xsimd version
// tiles 2 sites x 8 sources in float registers (a GEMM micro-kernel) and rounds each tile's
// lanes into double once.
template <class Arch, class C>
void phase1_dots_simd(C const* const* x, index_t n, C const* u, index_t su, index_t nq, index_t d, C const* zero_row,
                      double* dots) {
  using batch = xsimd::batch<C, Arch>;
  constexpr index_t N = index_t(batch::size);
  constexpr index_t TJ = 8, TL = 2;
  index_t const dv = d / N * N;
  for (index_t l0 = 0; l0 < nq; l0 += TL) {
    C const* ul[TL];
    for (index_t l = 0; l < TL; ++l) ul[l] = l0 + l < nq ? u + (l0 + l) * su : zero_row;
    for (index_t j0 = 0; j0 < n; j0 += TJ) {
      C const* xj[TJ];
      for (index_t j = 0; j < TJ; ++j) xj[j] = j0 + j < n ? x[j0 + j] : zero_row;
      batch acc[TL][TJ];
      for (index_t l = 0; l < TL; ++l)
        for (index_t j = 0; j < TJ; ++j) acc[l][j] = batch(C(0));
      for (index_t k = 0; k < dv; k += N) {
        batch xv[TJ];
        for (index_t j = 0; j < TJ; ++j) xv[j] = batch::load_unaligned(xj[j] + k);
        for (index_t l = 0; l < TL; ++l) {
          batch const uv = batch::load_unaligned(ul[l] + k);
          for (index_t j = 0; j < TJ; ++j) acc[l][j] = k3::simd::fma(uv, xv[j], acc[l][j]);
        }
      }
      for (index_t l = 0; l < TL && l0 + l < nq; ++l)
        for (index_t j = 0; j < TJ && j0 + j < n; ++j) {
          double s = double(k3::simd::reduce_add(acc[l][j]));
          for (index_t k = dv; k < d; ++k) s += double(ul[l][k]) * double(xj[j][k]);
          dots[(l0 + l) * n + j0 + j] = s;
        }
    }
  }
}

template <class C>
void phase1_dots_scalar(C const* const* x, index_t n, C const* u, index_t su, index_t nq, index_t d, double* dots) {
  for (index_t l = 0; l < nq; ++l)
    for (index_t j = 0; j < n; ++j) dots[l * n + j] = scalar_reduce::dot(x[j], u + l * su, d);
}

// o_l = sum_j a[l * n + j] x_j for every site, stored as O. Works on column tiles of KB
// elements so the n source tiles stay in L1 while all sites are formed from them; the
// conversion to the storage type runs as one long (vectorisable) loop per tile.
template <class Arch, class C, class O>
void phase1_combine_simd(C const* const* x, index_t n, C const* a, index_t nq, index_t d, O* const* out) {
  using batch = xsimd::batch<C, Arch>;
  constexpr index_t N = index_t(batch::size);
  constexpr index_t KB = 256;
  alignas(64) C tile[KB];
  for (index_t k0 = 0; k0 < d; k0 += KB) {
    index_t const kn = std::min(KB, d - k0), kv = kn / N * N;
    index_t const k4 = kn / (4 * N) * (4 * N);
    for (index_t l = 0; l < nq; ++l) {
      C const* al = a + l * n;
      // four independent accumulators hide the FMA latency of the sum over sources
      for (index_t k = 0; k < k4; k += 4 * N) {
        batch acc0(C(0)), acc1(C(0)), acc2(C(0)), acc3(C(0));
        for (index_t j = 0; j < n; ++j) {
          batch const aj(al[j]);
          C const* xj = x[j] + k0 + k;
          acc0 = k3::simd::fma(aj, batch::load_unaligned(xj), acc0);
          acc1 = k3::simd::fma(aj, batch::load_unaligned(xj + N), acc1);
          acc2 = k3::simd::fma(aj, batch::load_unaligned(xj + 2 * N), acc2);
          acc3 = k3::simd::fma(aj, batch::load_unaligned(xj + 3 * N), acc3);
        }
        acc0.store_aligned(tile + k);
        acc1.store_aligned(tile + k + N);
        acc2.store_aligned(tile + k + 2 * N);
        acc3.store_aligned(tile + k + 3 * N);
      }
      for (index_t k = k4; k < kv; k += N) {
        batch acc(C(0));
        for (index_t j = 0; j < n; ++j) acc = k3::simd::fma(batch(al[j]), batch::load_unaligned(x[j] + k0 + k), acc);
        acc.store_aligned(tile + k);
      }
      for (index_t k = kv; k < kn; ++k) {
        C acc = 0;
        for (index_t j = 0; j < n; ++j) acc += al[j] * x[j][k0 + k];
        tile[k] = acc;
      }
      store_row(tile, out[l] + k0, kn);
    }
  }
}

template <class C, class O>
void phase1_combine_scalar(C const* const* x, index_t n, C const* a, index_t nq, index_t d, O* const* out) {
  for (index_t l = 0; l < nq; ++l)
    for (index_t k = 0; k < d; ++k) {
      C acc = 0;
      for (index_t j = 0; j < n; ++j) acc += a[l * n + j] * x[j][k];
      put(out[l][k], acc);
    }
}

// Softmax of one site's logits s_j = rinv(j) * dots[j] (dots overwritten): a[j] = alpha_j,
// returns lse. A NaN logit makes every weight and lse NaN (confined to the token).
template <class C, class RF>
C p1_softmax(double* s, index_t n, RF rinv, C* a) {
  double mx = -std::numeric_limits<double>::infinity();
  bool nan = false;
  for (index_t j = 0; j < n; ++j) {
    s[j] *= rinv(j);
    nan |= std::isnan(s[j]);
    mx = std::max(mx, s[j]);
  }
  double z = 0;
  for (index_t j = 0; j < n; ++j) z += (s[j] = std::exp(s[j] - mx));
  if (nan) z = mx = std::numeric_limits<double>::quiet_NaN();
  for (index_t j = 0; j < n; ++j) a[j] = C(s[j] / z);
  return C(mx + std::log(z));
}

template <class Ops, class C, class S>
double row_rinv(S const* row, index_t d, double eps, std::vector<C>& buf) {
  C const* p;
  if constexpr (std::is_same_v<S, C>) {
    p = row;
  } else {
    convert_row(row, buf.data(), d);
    p = buf.data();
  }
  double const ss = Ops::dot(p, p, d);
  return 1.0 / std::sqrt(ss / double(d) + eps);
}

}  // namespace detail

// rinv[t] = (mean_k block[t, k]^2 + eps)^-1/2: computed once when a block is closed.
template <HostBackend B, class S, class Space, class = ::k3::detail::reachable<B, Space>>
void block_rinv(B const& b, block_rinv_args<S, Space> const& args, two_phase_options const& opt = {}) {
  using SS = S;
  using C = k3::accumulation_t<SS>;
  index_t T = 0, d = 0;
  detail::validate_block_rinv(args, opt, T, d);
  auto const block = args.block;
  auto const rinv = args.rinv;
  double const eps = opt.eps;
  using Ops = typename detail::ops_for<B>::template type<C>;
  index_t const tasks = detail::token_tasks(b, T);
  detail::for_token_ranges(b, T, tasks, [&](index_t lo, index_t hi, index_t) {
    std::vector<C> buf(static_cast<std::size_t>(std::is_same_v<SS, C> ? 0 : d));
    for (index_t t = lo; t < hi; ++t) rinv(t) = C(detail::row_rinv<Ops, C>(&block(t, 0), d, eps, buf));
  });
}

// Phase 1 for nq sites against the n completed blocks of `bank` ([n, T, d], their inverse RMS
// in bank_rinv [n, T]); u [nq, d] holds the folded queries gain_l * w_l. Writes o [nq, T, d]
// (normalised inter-block mix) and lse [nq, T]. With n = 0, o = 0 and lse = -inf.
template <HostBackend B, class S, class O, class Space, class = ::k3::detail::reachable<B, Space>>
void phase1(B const& b, phase1_args<S, O, Space> const& args, two_phase_options const& opt = {}) {
  using SS = S;
  using C = k3::accumulation_t<SS>;
  using U = C const;
  detail::phase1_problem const p = detail::validate_phase1(args, opt);
  index_t const n = p.n, nq = p.nq, T = p.T, d = p.d;
  auto const bank = args.bank;
  auto const bank_rinv = args.bank_rinv;
  auto const u = args.u;
  auto const o = args.o;
  auto const lse = args.lse;
  if (T == 0 || nq == 0) return;
  constexpr bool simd = detail::simd_arch<B>::value;
  using O_ = std::remove_const_t<O>;
  // The AVX-512 kernels read bfloat16 rows directly (arch/avx512.hpp).
  [[maybe_unused]] constexpr bool fast = [] {
    if constexpr (simd) {
      return kernel::two_phase_kernels<typename detail::simd_arch<B>::type>::available && std::is_same_v<SS, bfloat16> &&
             (std::is_same_v<O_, bfloat16> || std::is_same_v<O_, float>);
    } else {
      return false;
    }
  }();
  bool const stream = std::size_t(nq) * std::size_t(T) * std::size_t(d) * sizeof(O_) >= opt.tuning.stream_threshold_bytes;
  (void)stream;
  index_t const tasks = detail::token_tasks(b, T);
  detail::for_token_ranges(b, T, tasks, [&](index_t lo, index_t hi, index_t) {
    if constexpr (fast) {
      using K = kernel::two_phase_kernels<typename detail::simd_arch<B>::type>;
      index_t const nlq = (nq + K::p1_tl - 1) / K::p1_tl * K::p1_tl;
      // 64-byte aligned scratch: parked score accumulators (double), the mix tile (float)
      std::vector<double> scratch(static_cast<std::size_t>(K::p1_dots_scratch(n, nq) + (nq * 32 + d) / 2 + 16));
      double* acc = scratch.data() + (8 - (reinterpret_cast<std::uintptr_t>(scratch.data()) / sizeof(double)) % 8) % 8;
      float* tile = reinterpret_cast<float*>(acc + K::p1_dots_scratch(n, nq));
      float* qzero = tile + nq * 32;
      std::fill(qzero, qzero + d, 0.0f);
      std::vector<bfloat16> bzero(static_cast<std::size_t>(d), bfloat16(0.0f));
      std::vector<float const*> q(static_cast<std::size_t>(nlq));
      for (index_t l = 0; l < nlq; ++l) q[l] = l < nq ? &u(l, 0) : qzero;
      if (n == 0) {
        for (index_t t = lo; t < hi; ++t)
          for (index_t l = 0; l < nq; ++l) {
            for (index_t k = 0; k < d; ++k) o(l, t, k) = store_as<O_>(C(0));
            lse(l, t) = -std::numeric_limits<C>::infinity();
          }
        return;
      }
      std::vector<float> a(static_cast<std::size_t>(nq * n));
      std::vector<double> dots(static_cast<std::size_t>(nq * n));
      std::vector<bfloat16 const*> x(static_cast<std::size_t>(n));
      std::vector<O_*> out(static_cast<std::size_t>(nq));
      for (index_t t = lo; t < hi; ++t) {
        for (index_t j = 0; j < n; ++j) x[j] = &bank(j, t, 0);
        for (index_t l = 0; l < nq; ++l) out[l] = &o(l, t, 0);
        K::p1_dots_bf16(x.data(), n, q.data(), nq, d, bzero.data(), acc, dots.data());
        detail::redo_nonfinite_dots(x.data(), n, q.data(), nq, d, dots.data());
        for (index_t l = 0; l < nq; ++l) lse(l, t) = detail::p1_softmax(dots.data() + l * n, n, [&](index_t j) { return double(bank_rinv(j, t)); }, a.data() + l * n);
        K::p1_mix_bf16(x.data(), n, a.data(), nq, d, out.data(), tile, stream);
      }
      if (stream) K::stream_fence();
      return;
    }
    std::vector<C> rowbuf(static_cast<std::size_t>(std::is_same_v<SS, C> ? 0 : n * d)), zero(static_cast<std::size_t>(d), C(0)), a(static_cast<std::size_t>(nq * n));
    std::vector<double> dots(static_cast<std::size_t>(nq * n));
    std::vector<C const*> x(static_cast<std::size_t>(n));
    [[maybe_unused]] std::vector<std::remove_const_t<U> const*> ul(static_cast<std::size_t>(nq));
    std::vector<O*> out(static_cast<std::size_t>(nq));
    for (index_t t = lo; t < hi; ++t) {
      for (index_t j = 0; j < n; ++j) {
        if constexpr (std::is_same_v<SS, C>) {
          x[j] = &bank(j, t, 0);
        } else {
          detail::convert_row(&bank(j, t, 0), rowbuf.data() + j * d, d);
          x[j] = rowbuf.data() + j * d;
        }
      }
      for (index_t l = 0; l < nq; ++l) out[l] = &o(l, t, 0);
      if (n == 0) {
        for (index_t l = 0; l < nq; ++l) {
          for (index_t k = 0; k < d; ++k) out[l][k] = store_as<O>(C(0));
          lse(l, t) = -std::numeric_limits<C>::infinity();
        }
        continue;
      }
      if constexpr (simd) {
        detail::phase1_dots_simd<typename detail::simd_arch<B>::type>(x.data(), n, &u(0, 0), u.stride(0), nq, d, zero.data(), dots.data());
        for (index_t l = 0; l < nq; ++l) ul[l] = &u(l, 0);
        detail::redo_nonfinite_dots(x.data(), n, ul.data(), nq, d, dots.data());
      } else
        detail::phase1_dots_scalar(x.data(), n, &u(0, 0), u.stride(0), nq, d, dots.data());
      for (index_t l = 0; l < nq; ++l) lse(l, t) = detail::p1_softmax(dots.data() + l * n, n, [&](index_t j) { return double(bank_rinv(j, t)); }, a.data() + l * n);
      if constexpr (simd)
        detail::phase1_combine_simd<typename detail::simd_arch<B>::type>(x.data(), n, a.data(), nq, d, out.data());
      else
        detail::phase1_combine_scalar(x.data(), n, a.data(), nq, d, out.data());
    }
  });
}

namespace detail {

// One token of phase 2: b (compute-precision row), o (stored row) -> h.
// p = sigmoid(s2 - lse) from the partial's u-dot and sum of squares.
template <class C>
C merge_weight(double dot, double ss, C lse, index_t d, double eps) {
  double const s2 = dot / std::sqrt(ss / double(d) + eps);
  return C(1.0 / (1.0 + std::exp(double(lse) - s2)));
}

template <class C, class O, class H>
void merge_row(C const* K3_RESTRICT b, O const* K3_RESTRICT o, C p, index_t d, H* K3_RESTRICT h) {
  for (index_t k = 0; k < d; ++k) {
    C const ok = to_c<C>(o[k]);
    put(h[k], ok + p * (b[k] - ok));
  }
}

// One token of phase 2: b (compute-precision row), o (stored row) -> h.
template <class Ops, class C, class O, class H>
void merge_token(C const* b, O const* o, C lse, C const* u, index_t d, double eps, H* h) {
  double dot, ss;
  Ops::dot_ss_fast(b, u, d, dot, ss);
  merge_row(b, o, merge_weight(dot, ss, lse, d, eps), d, h);
}

}  // namespace detail

// Phase 2 at one site. With a partial: h = o + p (partial - o), p = sigmoid(s2 - lse);
// without (the block's first site): h = o.
template <HostBackend B, class S, class O, class H>
void phase2(B const& b, phase2_args<S, O, H> const& args, two_phase_options const& opt = {}) {
  using SS = S;
  using C = k3::accumulation_t<SS>;
  auto const o = args.o;
  auto const lse = args.lse;
  auto const partial = args.partial;
  bool const has_partial = present(partial);
  auto const u = args.u;
  auto const h = args.h;
  double const eps = opt.eps;
  static_assert(!std::is_const_v<H>, "phase2: h is written");
  detail::check_view("o", o);
  detail::check_inner_contiguous("o", o);
  index_t const T = o.extent(0), d = o.extent(1);
  detail::check_view("lse", lse);
  detail::check_shape("lse", lse, {T});
  detail::check_view("u", u);
  detail::check_shape("u", u, {d});
  detail::check_rows("h", h, {T, d});
  if (has_partial) detail::check_rows("partial", partial, {T, d});
  detail::check_outputs_apart([&](auto&& f) { f("h", h); },
                              [&](auto&& f) {
                                f("o", o);
                                f("lse", lse);
                                if (has_partial) f("partial", partial);
                                f("u", u);
                              });
  detail::check_eps(eps);
  using Ops = typename detail::ops_for<B>::template type<C>;
  std::vector<C> uc(static_cast<std::size_t>(d));
  for (index_t k = 0; k < d; ++k) uc[k] = load_as<C>(u(k));
  index_t const tasks = detail::token_tasks(b, T);
  using O_ = std::remove_const_t<O>;
  // A block's first site copies o into h: with AVX-512 in 32-column chunks, streamed when h is
  // far larger than the cache (same rounding as put(); see arch/avx512.hpp).
  [[maybe_unused]] constexpr bool fast_copy = [] {
    if constexpr (detail::simd_arch<B>::value) {
      return kernel::two_phase_kernels<typename detail::simd_arch<B>::type>::available && std::is_same_v<C, float> &&
             (std::is_same_v<O_, bfloat16> || std::is_same_v<O_, float>) && (std::is_same_v<H, bfloat16> || std::is_same_v<H, float>);
    } else {
      return false;
    }
  }();
  bool const stream = std::size_t(T) * std::size_t(d) * sizeof(H) >= opt.tuning.stream_threshold_bytes;
  (void)stream;
  detail::for_token_ranges(b, T, tasks, [&](index_t lo, index_t hi, index_t) {
    if constexpr (fast_copy) {
      using K = kernel::two_phase_kernels<typename detail::simd_arch<B>::type>;
      if (!has_partial) {
        for (index_t t = lo; t < hi; ++t) K::copy_row_bf16(&o(t, 0), &h(t, 0), d, stream);
        if (stream) K::stream_fence();
        return;
      }
    }
    std::vector<C> buf(static_cast<std::size_t>(d));
    for (index_t t = lo; t < hi; ++t) {
      if (!has_partial) {
        auto const* K3_RESTRICT src = &o(t, 0);
        auto* K3_RESTRICT dst = &h(t, 0);
        for (index_t k = 0; k < d; ++k) detail::put(dst[k], detail::to_c<C>(src[k]));
        continue;
      }
      C const* bp;
      if constexpr (std::is_same_v<SS, C>) {
        bp = &partial(t, 0);
      } else {
        detail::convert_row(&partial(t, 0), buf.data(), d);
        bp = buf.data();
      }
      detail::merge_token<Ops>(bp, &o(t, 0), C(lse(t)), uc.data(), d, eps, &h(t, 0));
    }
  });
}

// The fused step the sublayer loop runs (spec §4.5): prefix += delta (the residual add, in
// place, rounded to the storage type as a plain add would be), then phase 2 with b = prefix.
template <HostBackend B, class S, class D, class O, class H, class Space, class = ::k3::detail::reachable<B, Space>>
void phase2_add(B const& b, phase2_add_args<S, D, O, H, Space> const& args, two_phase_options const& opt = {}) {
  using C = k3::accumulation_t<S>;
  index_t T = 0, d = 0;
  detail::validate_phase2_add(args, opt, T, d);
  auto const o = args.o;
  auto const lse = args.lse;
  auto const prefix = args.prefix;
  auto const delta = args.delta;
  auto const u = args.u;
  auto const h = args.h;
  double const eps = opt.eps;
  using Ops = typename detail::ops_for<B>::template type<C>;
  std::vector<C> uc(static_cast<std::size_t>(d));
  for (index_t k = 0; k < d; ++k) uc[k] = load_as<C>(u(k));
  index_t const tasks = detail::token_tasks(b, T);
  using D_ = std::remove_const_t<D>;
  using O_ = std::remove_const_t<O>;
  [[maybe_unused]] constexpr bool fast = [] {
    if constexpr (detail::simd_arch<B>::value) {
      return kernel::two_phase_kernels<typename detail::simd_arch<B>::type>::available && std::is_same_v<S, bfloat16> &&
             (std::is_same_v<D_, bfloat16> || std::is_same_v<D_, float>) && (std::is_same_v<O_, bfloat16> || std::is_same_v<O_, float>) &&
             (std::is_same_v<H, bfloat16> || std::is_same_v<H, float>);
    } else {
      return false;
    }
  }();
  bool const stream = std::size_t(T) * std::size_t(d) * sizeof(H) >= opt.tuning.stream_threshold_bytes;
  (void)stream;
  detail::for_token_ranges(b, T, tasks, [&](index_t lo, index_t hi, index_t) {
    std::vector<C> buf(static_cast<std::size_t>(d));
    if constexpr (fast) {
      using K = kernel::two_phase_kernels<typename detail::simd_arch<B>::type>;
      K::eo_permute_query(uc.data(), d, buf.data());
      for (index_t t = lo; t < hi; ++t) {
        bool const more = t + 1 < hi;
        typename K::template row_prefetch<3> pf;
        pf.d = d;
        pf.set(0, &prefix(t, 0), more ? &prefix(t + 1, 0) : nullptr);
        pf.set(1, &delta(t, 0), more ? &delta(t + 1, 0) : nullptr);
        pf.set(2, &o(t, 0), more ? &o(t + 1, 0) : nullptr);
        K::p2_add_token_bf16(&prefix(t, 0), &delta(t, 0), &o(t, 0), buf.data(), C(lse(t)), d, eps,
                                                                        &h(t, 0), stream, pf);
      }
      if (stream) K::stream_fence();
      return;
    }
    for (index_t t = lo; t < hi; ++t) {
      S* K3_RESTRICT pr = &prefix(t, 0);
      auto const* K3_RESTRICT dl = &delta(t, 0);
      C* K3_RESTRICT bb = buf.data();
      for (index_t k = 0; k < d; ++k) {
        S v;
        detail::put(v, detail::to_c<C>(pr[k]) + detail::to_c<C>(dl[k]));
        pr[k] = v;
        bb[k] = detail::to_c<C>(v);
      }
      double dot, ss;
      Ops::dot_ss_fast(bb, uc.data(), d, dot, ss);
      detail::merge_row(bb, &o(t, 0), detail::merge_weight(dot, ss, C(lse(t)), d, eps), d, &h(t, 0));
    }
  });
}

}  // namespace k3::attnres
