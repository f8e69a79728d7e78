// k3/attnres/mix.hpp — one AttnRes mixing site, forward and backward, on the CPU backends.
//
// Per token t, over sources v_0..v_{m-1} (the n rows of a bank [n, T, d] plus, optionally, a
// partial sum [T, d] as source n):
//     u = gain * w,   r_j = (mean_k v_j[k]^2 + eps)^-1/2,   c_j = u . v_j,
//     alpha = softmax_j(r_j c_j),   h = sum_j alpha_j v_j.
// The RMSNorm gain is folded into the pseudo-query so every site of a block shares one key
// set (spec §2.1, §4.2). Values are the raw sources. Mixing runs in float (double for double
// storage) whatever the storage type; the cross-token sums for d_w and d_gain run in double.
//
// Backward (spec §5.2): ds_j = alpha_j (dh.v_j - dh.h);
//     dv_j = alpha_j dh + ds_j (r_j u - c_j r_j^3 v_j / d);  du = sum_t sum_j ds_j r_j v_j;
//     d_w = du * gain;  d_gain = du * w.
// Each token is independent: a NaN or Inf in one token's sources stays in that token's h and
// d_sources (d_w and d_gain, being sums over tokens, do see it).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "k3/core/backend_traits.hpp"
#include "k3/attnres/simd_ops.hpp"
#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"

namespace k3::attnres {

struct options {
  double eps = 1e-5;        // the key RMSNorm's eps (K3: rms_norm_eps = 1e-5)
  bool accumulate = false;  // backward: add into d_sources/d_w/d_gain instead of overwriting
};


// The sources of one site: bank rows [0, n) and, when the partial view is present, the
// partial sum as source n. Views live in `Space` (host_space for the CPU backends).
template <class S, class Space = host_space>
struct sources {
  tensor_view<S const, 3, Space> bank;          // [n, T, d]
  tensor_view<S const, 2, Space> partial = {};  // optional [T, d]

  bool has_partial() const noexcept { return present(partial); }
  index_t count() const noexcept { return bank.extent(0) + (has_partial() ? 1 : 0); }
};

template <class S, std::size_t R, class Space>
sources<std::remove_const_t<S>, Space> make_sources(tensor_view<S, R, Space> bank) {
  static_assert(R == 3, "make_sources: the bank is [n, T, d]");
  return {bank, {}};
}
template <class S, class P, class Space>
sources<std::remove_const_t<S>, Space> make_sources(tensor_view<S, 3, Space> bank, tensor_view<P, 2, Space> partial) {
  static_assert(std::is_same_v<std::remove_const_t<S>, std::remove_const_t<P>>, "bank and partial must share a storage type");
  return {bank, partial};
}

// Gradients for the sources, laid out like them (partial read only when the sources have one).
template <class G, class Space = host_space>
struct source_grads {
  tensor_view<G, 3, Space> bank;          // [n, T, d]
  tensor_view<G, 2, Space> partial = {};  // [T, d] when the sources have a partial
};

template <class G, class Space>
source_grads<G, Space> make_grads(tensor_view<G, 3, Space> bank) {
  return {bank, {}};
}
template <class G, class Space>
source_grads<G, Space> make_grads(tensor_view<G, 3, Space> bank, tensor_view<G, 2, Space> partial) {
  return {bank, partial};
}

namespace detail {
using namespace ::k3::detail;  // the shared argument checks

// A [rows, columns] argument the kernels walk row by row: valid, unit column stride, shape.
template <class V>
void check_rows(std::string_view name, V const& v, std::initializer_list<index_t> expected) {
  check_view(name, v);
  check_inner_contiguous(name, v);
  check_shape(name, v, expected);
}

template <class S>
struct rows {
  S* bank = nullptr;
  index_t sj = 0, st = 0, n = 0;
  S* part = nullptr;
  index_t pt = 0;
  S* row(index_t j, index_t t) const noexcept { return j < n ? bank + j * sj + t * st : part + t * pt; }
};

template <class S>
rows<S const> rows_of(sources<S> const& s) {
  return {s.bank.data_handle(), s.bank.stride(0), s.bank.stride(1), s.bank.extent(0),
          s.has_partial() ? s.partial.data_handle() : nullptr, s.has_partial() ? s.partial.stride(0) : 0};
}
template <class G>
rows<G> rows_of(source_grads<G> const& g, bool has_partial) {
  return {g.bank.data_handle(), g.bank.stride(0), g.bank.stride(1), g.bank.extent(0),
          has_partial ? g.partial.data_handle() : nullptr, has_partial ? g.partial.stride(0) : 0};
}

// Checks the sources and returns (T, d).
template <class S, class Space>
void check_sources(sources<S, Space> const& s, index_t& T, index_t& d) {
  check_view("sources", s.bank);
  check_inner_contiguous("sources", s.bank);
  if (s.has_partial()) {
    check_view("partial", s.partial);
    check_inner_contiguous("partial", s.partial);
  }
  require(s.count() >= 1, error_kind::shape, "argument 'sources': a mixing site needs at least one source (bank has 0 rows and no partial)");
  if (s.bank.extent(0) > 0) {
    T = s.bank.extent(1);
    d = s.bank.extent(2);
    if (s.has_partial()) check_shape("partial", s.partial, {T, d});
  } else {
    T = s.partial.extent(0);
    d = s.partial.extent(1);
  }
}

template <class G, class Space>
void check_grads(source_grads<G, Space> const& g, index_t n, bool has_partial, index_t T, index_t d) {
  check_view("d_sources", g.bank);
  check_inner_contiguous("d_sources", g.bank);
  check_shape("d_sources", g.bank, {n, T, d});
  if (has_partial) {
    check_view("d_partial", g.partial);
    check_inner_contiguous("d_partial", g.partial);
    check_shape("d_partial", g.partial, {T, d});
  }
}

// Which backends get the xsimd token kernels.
template <class B>
struct simd_arch {
  static constexpr bool value = false;
  using type = void;
};
template <class A>
struct simd_arch<cpu::simd<A>> {
  static constexpr bool value = true;
  using type = A;
};
template <class A>
struct simd_arch<cpu::threads<A>> {
  static constexpr bool value = true;
  using type = A;
};

// Token blocks of the backward's cross-token sums (d_w, d_gain): a constant, so the summation
// order does not depend on the thread count; enough blocks to feed 16 threads 4 each.
inline constexpr index_t grad_blocks = 64;

// Runs f(lo, hi, task) over contiguous token ranges; returns the task count (task < count).
template <class B>
index_t token_tasks(B const& b, index_t T) {
  if (T <= 0) return 0;
  return TaskBackend<B> ? std::min<index_t>(T, 4 * k3::concurrency(b)) : 1;
}
template <class B, class F>
void for_token_ranges(B const& b, index_t T, index_t tasks, F&& f) {
  k3::run_tasks(b, tasks, [&](index_t i) { f(T * i / tasks, T * (i + 1) / tasks, i); });
}

// Per-thread scratch for one token: the m source rows in compute precision (only when the
// storage differs), the stats, and a row accumulator.
template <class C>
struct token_scratch {
  std::vector<C> rowbuf, acc, r, c, a;
  std::vector<double> s, da;
  std::vector<C const*> p;
  void reserve(index_t m, index_t d, bool convert) {
    if (convert) rowbuf.resize(std::size_t(m * d));
    acc.resize(std::size_t(d));
    r.resize(std::size_t(m));
    c.resize(std::size_t(m));
    a.resize(std::size_t(m));
    s.resize(std::size_t(m));
    da.resize(std::size_t(m));
    p.resize(std::size_t(m));
  }
};

// Loads the m source rows of token t as compute-type pointers (converting when needed).
template <class C, class S>
void load_rows(rows<S const> const& src, index_t m, index_t t, index_t d, token_scratch<C>& w) {
  for (index_t j = 0; j < m; ++j) {
    S const* row = src.row(j, t);
    if constexpr (std::is_same_v<S, C>) {
      w.p[j] = row;
    } else {
      C* out = w.rowbuf.data() + j * d;
      convert_row(row, out, d);
      w.p[j] = out;
    }
  }
}

// r, c, alpha of one token from its rows. Ops selects scalar or xsimd reductions; both are
// deterministic, so re-running this (recompute mode) reproduces the stored stats bit for bit.
template <class Ops, class C>
void token_stats(index_t m, index_t d, C const* u, C eps, token_scratch<C>& w) {
  // The per-source scalars (r, logits, softmax) are computed in double and rounded once.
  double mx = -std::numeric_limits<double>::infinity();
  bool nan = false;
  for (index_t j = 0; j < m; ++j) {
    double dot, ss;
    Ops::dot_ss(w.p[j], u, d, dot, ss);
    double const r = 1.0 / std::sqrt(ss / double(d) + double(eps));
    w.c[j] = C(dot);
    w.r[j] = C(r);
    w.s[j] = r * dot;
    nan |= std::isnan(w.s[j]);
    mx = std::max(mx, w.s[j]);
  }
  double z = 0;
  for (index_t j = 0; j < m; ++j) {
    w.s[j] = std::exp(w.s[j] - mx);
    z += w.s[j];
  }
  // A NaN logit turns the whole token (and only it) into NaN.
  if (nan) z = std::numeric_limits<double>::quiet_NaN();
  for (index_t j = 0; j < m; ++j) w.a[j] = C(w.s[j] / z);
}

template <class C>
void token_combine(index_t m, index_t d, token_scratch<C>& w) {
  C* K3_RESTRICT acc = w.acc.data();
  {
    C const a0 = w.a[0];
    C const* K3_RESTRICT v = w.p[0];
    for (index_t k = 0; k < d; ++k) acc[k] = a0 * v[k];
  }
  for (index_t j = 1; j < m; ++j) {
    C const aj = w.a[j];
    C const* K3_RESTRICT v = w.p[j];
    for (index_t k = 0; k < d; ++k) acc[k] += aj * v[k];
  }
}

// The backward of one token: writes d_sources rows, adds ds_j r_j v_j into du (double).
template <class Ops, class C, class G, class DH>
void token_backward(index_t m, index_t d, C const* u, DH const* dh_row, token_scratch<C>& w, rows<G> const& dsrc, index_t t,
                    bool accumulate, double* K3_RESTRICT du) {
  // dh in compute precision (acc is free here)
  C* K3_RESTRICT dh = w.acc.data();
  convert_row(dh_row, dh, d);
  double dhh = 0;
  for (index_t j = 0; j < m; ++j) {
    w.da[j] = Ops::dot(w.p[j], dh, d);
    dhh += double(w.a[j]) * w.da[j];
  }
  for (index_t j = 0; j < m; ++j) {
    double const ds = double(w.a[j]) * (w.da[j] - dhh), r = w.r[j];
    C const cu = C(ds * r);                                  // coefficient of u (and of v in du)
    // Coefficient of v through the RMSNorm, c r^3 formed as (c r) r^2: c r is the logit, so a row
    // whose sum of squares overflows double (r = 0, |v| beyond ~1e154) gives 0, not (ds c) * 0 = NaN.
    C const cv = C(ds * (double(w.c[j]) * r) * r * r / double(d));
    C const aj = w.a[j];
    C const* K3_RESTRICT v = w.p[j];
    G* K3_RESTRICT out = dsrc.row(j, t);
    for (index_t k = 0; k < d; ++k) {
      C g = aj * dh[k] + cu * u[k] - cv * v[k];
      if (accumulate) g += to_c<C>(out[k]);
      put(out[k], g);
    }
    for (index_t k = 0; k < d; ++k) du[k] += double(cu * v[k]);
  }
}

template <class B>
struct ops_for {
  template <class C>
  using type = std::conditional_t<simd_arch<B>::value, simd_reduce<typename simd_arch<B>::type>, scalar_reduce>;
};

template <class C, class WV, class GV>
std::vector<C> fold_query(WV w, GV g, index_t d) {
  std::vector<C> u(static_cast<std::size_t>(d));
  for (index_t k = 0; k < d; ++k) u[k] = load_as<C>(w(k)) * load_as<C>(g(k));
  return u;
}

}  // namespace detail

// Token-local statistics a stored-mode forward can keep for the backward: [T, m, 3] holding
// (r_j, c_j, alpha_j) in compute precision. Leave it absent when not wanted.
template <class C, class Space = host_space>
using stats_view = tensor_view<C, 3, Space>;

// The views of mix_forward: S the sources' storage, W the type of w and gain, H that of h;
// Space where they live (host_space for the CPU backends).
template <Storage S, class W = k3::accumulation_t<S>, class H = S, class Space = host_space>
struct mix_forward_args {
  ::k3::attnres::sources<S, Space> sources;
  tensor_view<W const, 1, Space> w, gain;                      // [d] pseudo-query and key-norm gain
  tensor_view<H, 2, Space> h;                                  // [T, d], written
  stats_view<k3::accumulation_t<S>, Space> stats = {};         // optional, filled for a stored-mode backward
};

// The views of mix_backward: DH the type of d_h, G that of d_sources, DW that of d_w and d_gain.
template <Storage S, class W = k3::accumulation_t<S>, class DH = S, class G = k3::accumulation_t<S>, class DW = k3::accumulation_t<S>,
          class Space = host_space>
struct mix_backward_args {
  ::k3::attnres::sources<S, Space> sources;
  tensor_view<W const, 1, Space> w, gain;
  tensor_view<DH const, 2, Space> d_h;                         // [T, d]
  source_grads<G, Space> d_sources;                            // d_sources.partial used when sources has a partial
  tensor_view<DW, 1, Space> d_w, d_gain;                       // [d]
  stats_view<k3::accumulation_t<S> const, Space> stats = {};   // optional: the forward's stats (stored mode)
};

namespace detail {

// The sizes of a validated mixing site: T tokens of d features, m sources.
struct mix_problem {
  index_t T = 0, d = 0, m = 0;
};

// Every check of mix_forward's views and options (shapes, option values, aliasing), for the
// host and the CUDA backend alike, so both raise the same k3::error for the same call.
template <class S, class W, class H, class Space>
mix_problem validate_mix_forward(mix_forward_args<S, W, H, Space> const& args, options const& opt) {
  static_assert(!std::is_const_v<H>, "attnres: h is written");
  auto const& src = args.sources;
  auto const w = args.w;
  auto const g = args.gain;
  auto const h = args.h;
  auto const stats = args.stats;
  index_t T = 0, d = 0;
  check_sources(src, T, d);
  check_view("w", w);
  check_view("gain", g);
  check_view("h", h);
  check_shape("w", w, {d});
  check_shape("gain", g, {d});
  check_shape("h", h, {T, d});
  check_inner_contiguous("h", h);
  require(opt.eps >= 0 && std::isfinite(opt.eps), error_kind::value, [&] { return "option 'eps' must be finite and >= 0, got " + std::to_string(opt.eps); });
  index_t const m = src.count();
  if (stats.size() > 0) {
    check_view("stats", stats);
    check_shape("stats", stats, {T, m, 3});
    require(stats.is_contiguous(), error_kind::shape, "argument 'stats': must be contiguous");
  }
  // h and stats: neither broadcast (a stride-0 dimension: several tokens into one row, racing
  // between threads), over the other or over an input.
  ::k3::detail::check_outputs_apart(
      [&](auto&& f) {
        f("h", h);
        f("stats", stats);
      },
      [&](auto&& f) {
        f("sources", src.bank);
        if (src.has_partial()) f("partial", src.partial);
        f("w", w);
        f("gain", g);
      });
  return {T, d, m};
}

// d_h may BE the partial's gradient (same view: an identity sublayer handing the driver's
// grad_sublayer_output() straight back): each token converts its dh row before writing
// that token's rows, so an exact alias is safe; any other overlap is not.
template <class DHV, class GV>
bool d_h_is_d_partial(DHV const& dh, GV const& dpart) {
  if constexpr (DHV::rank() == GV::rank() && std::is_same_v<typename DHV::value_type, typename GV::value_type>) {
    return static_cast<void const*>(dh.data_handle()) == static_cast<void const*>(dpart.data_handle()) && dh.extents() == dpart.extents() &&
           dh.strides() == dpart.strides();
  } else {
    return false;
  }
}

// Every check of mix_backward's views and options, shared by the host and the CUDA backend.
template <class S, class W, class DH, class G, class DW, class Space>
mix_problem validate_mix_backward(mix_backward_args<S, W, DH, G, DW, Space> const& args, options const& opt) {
  auto const& src = args.sources;
  auto const w = args.w;
  auto const g = args.gain;
  auto const dh = args.d_h;
  auto const& dsrc = args.d_sources;
  auto const dw = args.d_w;
  auto const dg = args.d_gain;
  auto const stats = args.stats;
  index_t T = 0, d = 0;
  check_sources(src, T, d);
  index_t const n = src.bank.extent(0), m = src.count();
  check_view("w", w);
  check_view("gain", g);
  check_shape("w", w, {d});
  check_shape("gain", g, {d});
  check_rows("d_h", dh, {T, d});
  check_grads(dsrc, n, src.has_partial(), T, d);
  check_view("d_w", dw);
  check_view("d_gain", dg);
  check_shape("d_w", dw, {d});
  check_shape("d_gain", dg, {d});
  require(opt.eps >= 0 && std::isfinite(opt.eps), error_kind::value, [&] { return "option 'eps' must be finite and >= 0, got " + std::to_string(opt.eps); });
  if (stats.size() > 0) {
    check_view("stats", stats);
    check_shape("stats", stats, {T, m, 3});
    require(stats.is_contiguous(), error_kind::shape, "argument 'stats': must be contiguous");
  }
  // Every output against every input and the outputs pairwise: a gradient written over an
  // input (or over another gradient) is read back half-updated by later tokens.
  tensor_view<G const, 2, Space> const dpart = src.has_partial() ? tensor_view<G const, 2, Space>(dsrc.partial) : tensor_view<G const, 2, Space>{};
  auto outs = [&](auto&& f) {
    f("d_sources", dsrc.bank);
    f("d_partial", dpart);
    f("d_w", dw);
    f("d_gain", dg);
  };
  auto ins = [&](auto&& f) {
    f("sources", src.bank);
    f("partial", src.has_partial() ? src.partial : tensor_view<S const, 2, Space>{});
    f("w", w);
    f("gain", g);
    f("d_h", dh);
    f("stats", stats);
  };
  outs([&](char const* on, auto const& ov) { ::k3::detail::check_not_broadcast(on, ov); });
  outs([&](char const* on, auto const& ov) {
    ins([&](char const* in, auto const& iv) {
      if (std::string_view(on) == "d_partial" && std::string_view(in) == "d_h" && d_h_is_d_partial(iv, ov)) return;
      check_no_overlap(on, ov, in, iv);
    });
  });
  ::k3::detail::check_outputs_disjoint(outs);
  return {T, d, m};
}

}  // namespace detail

// h[T, d] = the mix of `sources` with pseudo-query w[d] and key-norm gain gain[d].
template <HostBackend B, class S, class W, class H, class Space, class = ::k3::detail::reachable<B, Space>>
void mix_forward(B const& b, mix_forward_args<S, W, H, Space> const& args, options const& opt = {}) {
  detail::mix_problem const p = detail::validate_mix_forward(args, opt);
  index_t const T = p.T, d = p.d, m = p.m;
  auto const& src = args.sources;
  auto const w = args.w;
  auto const g = args.gain;
  auto const h = args.h;
  auto const stats = args.stats;
  using C = k3::accumulation_t<S>;
  bool const keep = stats.size() > 0;
  if (T == 0 || d == 0) return;
  auto const u = detail::fold_query<C>(w, g, d);
  auto const rows = detail::rows_of(src);
  C const eps = C(opt.eps);
  using Ops = typename detail::ops_for<B>::template type<C>;
  index_t const tasks = detail::token_tasks(b, T);
  detail::for_token_ranges(b, T, tasks, [&](index_t lo, index_t hi, index_t) {
    detail::token_scratch<C> ws;
    ws.reserve(m, d, !std::is_same_v<S, C>);
    for (index_t t = lo; t < hi; ++t) {
      detail::load_rows(rows, m, t, d, ws);
      detail::token_stats<Ops>(m, d, u.data(), eps, ws);
      detail::token_combine(m, d, ws);
      detail::store_row(ws.acc.data(), &h(t, 0), d);
      if (keep) {
        C* st = &stats(t, 0, 0);
        for (index_t j = 0; j < m; ++j) {
          st[3 * j] = ws.r[j];
          st[3 * j + 1] = ws.c[j];
          st[3 * j + 2] = ws.a[j];
        }
      }
    }
  });
}

// Gradients of the mix: d_sources (and d_sources.partial), d_w[d], d_gain[d], given d_h[T, d].
// With `stats` from the forward the token statistics are taken from there (stored mode);
// without, they are recomputed (recompute mode) — bit-identical either way.
template <HostBackend B, class S, class W, class DH, class G, class DW, class Space, class = ::k3::detail::reachable<B, Space>>
void mix_backward(B const& b, mix_backward_args<S, W, DH, G, DW, Space> const& args, options const& opt = {}) {
  detail::mix_problem const p = detail::validate_mix_backward(args, opt);
  index_t const T = p.T, d = p.d, m = p.m;
  auto const& src = args.sources;
  auto const w = args.w;
  auto const g = args.gain;
  auto const dh = args.d_h;
  auto const& dsrc = args.d_sources;
  auto const dw = args.d_w;
  auto const dg = args.d_gain;
  auto const stats = args.stats;
  using C = k3::accumulation_t<S>;
  bool const have_stats = stats.size() > 0;
  if (d == 0) return;
  auto const u = detail::fold_query<C>(w, g, d);
  auto const rows = detail::rows_of(src);
  auto const grows = detail::rows_of(dsrc, src.has_partial());
  C const eps = C(opt.eps);
  using Ops = typename detail::ops_for<B>::template type<C>;
  // d_w and d_gain sum over tokens: in a fixed number of contiguous token blocks (not one per
  // thread task), added in block order, so they are bitwise the same for every backend and
  // thread count (they differed in the last bits of double between 1, 2 and 3 threads).
  index_t const tasks = std::min<index_t>(T, detail::grad_blocks);
  std::vector<double> du(std::size_t(std::max<index_t>(tasks, 1) * d), 0.0);
  detail::for_token_ranges(b, T, tasks, [&](index_t lo, index_t hi, index_t task) {
    detail::token_scratch<C> ws;
    ws.reserve(m, d, !std::is_same_v<S, C>);
    double* dut = du.data() + task * d;
    for (index_t t = lo; t < hi; ++t) {
      detail::load_rows(rows, m, t, d, ws);
      if (have_stats) {
        C const* st = &stats(t, 0, 0);
        for (index_t j = 0; j < m; ++j) {
          ws.r[j] = st[3 * j];
          ws.c[j] = st[3 * j + 1];
          ws.a[j] = st[3 * j + 2];
        }
      } else {
        detail::token_stats<Ops>(m, d, u.data(), eps, ws);
      }
      detail::token_backward<Ops>(m, d, u.data(), &dh(t, 0), ws, grows, t, opt.accumulate, dut);
    }
  });
  for (index_t k = 0; k < d; ++k) {
    double s = 0;
    for (index_t i = 0; i < tasks; ++i) s += du[i * d + k];
    double const gw = s * double(load_as<C>(g(k))), gg = s * double(load_as<C>(w(k)));
    if (opt.accumulate) {
      dw(k) = store_as<DW>(double(load_as<double>(dw(k))) + gw);
      dg(k) = store_as<DW>(double(load_as<double>(dg(k))) + gg);
    } else {
      dw(k) = store_as<DW>(gw);
      dg(k) = store_as<DW>(gg);
    }
  }
}

}  // namespace k3::attnres
