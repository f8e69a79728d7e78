// k3/kda/preprocess/pointwise.hpp — the row-wise KDA pre-processing ops and their backwards:
//
//   l2norm:            y = x / sqrt(sum_d x_d^2 + 1e-6)            (over the last dimension)
//   beta_sigmoid:      beta = sigmoid(x), or 2 sigmoid(x) (allow_neg_eigval: beta in (0, 2))
//   gate_softplus:     g = -exp(A_log[h]) * softplus(x + dt_bias[h, :])
//   gate_lower_bound:  g = lb * sigmoid(exp(A_log[h]) * (x + dt_bias[h, :])),  lb in [-5, 0)
//
// Every op is op(backend, args, options = {}), e.g.
//   l2norm(be, l2norm_args<float>{.x = q, .y = qn});
//   gate_lower_bound(be, gate_args<k3::bfloat16, float>{.x, .A_log, .dt_bias, .g}, {.lower_bound = -5});
// l2norm and beta_sigmoid work over the last dimension of a view of any rank (the args' second
// template parameter: 4 for l2norm's [B, T, H, K], 3 for beta's [B, T, HV]).
//
// Gate shapes: x, g [B, T, HV, K]; A_log [HV]; dt_bias [HV, K] (fla's [HV*K] viewed as 2-D).
// A_log and dt_bias are optional (absent members): absent means A_log = 0 and dt_bias = 0, and
// their gradients, when asked for, are then the gradients at that point.
//
// Storage may be float, double or k3::bfloat16; the gates' parameters (type P) may differ from
// the activations (In). Math runs in double when any storage is double, else in float. Backwards recompute what they need from
// the forward's inputs (cheaper than storing it). Work is spread over rows through the
// backend; parameter gradients are reduced in fixed blocks, so results do not depend on the
// backend or its thread count.
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "k3/core/math.hpp"
#include "k3/core/storage.hpp"
#include "k3/kda/preprocess/common.hpp"
#include "k3/kda/preprocess/tuning.hpp"

namespace k3::kda {

// Space: where the views live (host_space for the CPU backends, cuda_device_space for
// k3::cuda::stream_backend, k3/kda/cuda/preprocess_backend.cuh).
template <Storage In, std::size_t Rank = 4, class Space = host_space>
struct l2norm_args {
  tensor_view<In const, Rank, Space> x;
  tensor_view<In, Rank, Space> y;  // same shape as x
};
template <Storage In, std::size_t Rank = 4, class Space = host_space>
struct l2norm_backward_args {
  tensor_view<In const, Rank, Space> x;    // the forward's input (y is recomputed from it)
  tensor_view<In const, Rank, Space> d_y;
  tensor_view<In, Rank, Space> d_x;
};
// The epsilon is fixed at l2norm_eps (fla's); the struct keeps the call shape uniform.
struct l2norm_options {};

template <Storage In, std::size_t Rank = 3, class Space = host_space>
struct beta_sigmoid_args {
  tensor_view<In const, Rank, Space> x;
  tensor_view<In, Rank, Space> beta;  // same shape as x
};
template <Storage In, std::size_t Rank = 3, class Space = host_space>
struct beta_sigmoid_backward_args {
  tensor_view<In const, Rank, Space> x;
  tensor_view<In const, Rank, Space> d_beta;
  tensor_view<In, Rank, Space> d_x;
};
struct beta_sigmoid_options {
  bool allow_neg_eigval = false;  // beta = 2 sigmoid(x), in (0, 2)
};

// In: x, g and their gradients; P: A_log, dt_bias and their gradients.
template <Storage In, Storage P = In, class Space = host_space>
struct gate_args {
  tensor_view<In const, 4, Space> x;           // [B, T, HV, K]
  tensor_view<P const, 1, Space> A_log = {};   // [HV]; absent = 0
  tensor_view<P const, 2, Space> dt_bias = {}; // [HV, K]; absent = 0
  tensor_view<In, 4, Space> g;                 // [B, T, HV, K]
};
template <Storage In, Storage P = In, class Space = host_space>
struct gate_backward_args {
  tensor_view<In const, 4, Space> x;
  tensor_view<P const, 1, Space> A_log = {};
  tensor_view<P const, 2, Space> dt_bias = {};
  tensor_view<In const, 4, Space> d_g;
  tensor_view<In, 4, Space> d_x;
  tensor_view<P, 1, Space> d_A_log = {};    // sum over B, T, K; absent = not wanted
  tensor_view<P, 2, Space> d_dt_bias = {};  // sum over B, T; absent = not wanted
};
// gate_softplus has no options; the struct keeps the call shape uniform.
struct gate_softplus_options {};
struct gate_options {
  // In [-5, 0): Kimi Linear's -5 by default; the chunked kernels' dense diagonal path relies on
  // the range.
  double lower_bound = -5.0;
  preprocess_tuning tuning = preprocess_tuning::host();  // the host backends' streaming stores
};

// ---- L2 norm over the last dimension ------------------------------------------------------

inline constexpr double l2norm_eps = 1e-6;

namespace detail {

// The row sums below are written as explicit fused multiply-adds: left to the compiler, g++
// fused them in the strided loop but not in the vectorised unit-stride one, so the same rows
// gave different last bits through a transposed view than through a contiguous one.

// 1 / sqrt(ss + eps) for a row whose sum of squares ss was accumulated in T. When ss overflowed
// (|x| beyond ~1e19 in float, ~1e154 in double) while every element is finite, the row is
// summed again scaled by a power of two (exact), so huge rows still normalise to unit length
// instead of to 0 (y = x / inf). Rows whose ss is finite take the plain formula, bit for bit.
template <class T, class Load>
T l2norm_rstd(T ss, index_t D, Load const& load) {
  if (ss <= std::numeric_limits<T>::max()) return T(1) / std::sqrt(ss + T(l2norm_eps));
  T m = 0;
  for (index_t d = 0; d < D; ++d) m = std::max(m, std::fabs(load(d)));
  if (!(m <= std::numeric_limits<T>::max())) return T(1) / std::sqrt(ss + T(l2norm_eps));  // Inf/NaN in the row: as before
  int e = 0;
  (void)std::frexp(m, &e);
  T const sc = std::ldexp(T(1), -e);  // m * sc in [0.5, 1)
  T s2 = 0;
  for (index_t d = 0; d < D; ++d) {
    T const v = load(d) * sc;
    s2 = std::fma(v, v, s2);
  }
  return sc / std::sqrt(s2 + T(l2norm_eps) * sc * sc);
}

// The checks of each row-wise op, for views in any memory space (no element is read): the host
// backends and k3::cuda::stream_backend report the same k3::error.
template <class In, std::size_t Rank, class Space>
void pp_validate_l2norm(l2norm_args<In, Rank, Space> const& a) {
  ::k3::detail::check_view("x", a.x);
  ::k3::detail::check_view("y", a.y);
  pp_check_same_shape("x", a.x, "y", a.y);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("y", a.y), ::k3::detail::named_views("x", a.x));
}
template <class In, std::size_t Rank, class Space>
void pp_validate_l2norm_backward(l2norm_backward_args<In, Rank, Space> const& a) {
  ::k3::detail::check_view("x", a.x);
  ::k3::detail::check_view("d_y", a.d_y);
  ::k3::detail::check_view("d_x", a.d_x);
  pp_check_same_shape("x", a.x, "d_y", a.d_y);
  pp_check_same_shape("x", a.x, "d_x", a.d_x);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("d_x", a.d_x), ::k3::detail::named_views("x", a.x, "d_y", a.d_y));
}
template <class In, std::size_t Rank, class Space>
void pp_validate_beta_sigmoid(beta_sigmoid_args<In, Rank, Space> const& a) {
  ::k3::detail::check_view("x", a.x);
  ::k3::detail::check_view("beta", a.beta);
  pp_check_same_shape("x", a.x, "beta", a.beta);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("beta", a.beta), ::k3::detail::named_views("x", a.x));
}
template <class In, std::size_t Rank, class Space>
void pp_validate_beta_sigmoid_backward(beta_sigmoid_backward_args<In, Rank, Space> const& a) {
  ::k3::detail::check_view("x", a.x);
  ::k3::detail::check_view("d_beta", a.d_beta);
  ::k3::detail::check_view("d_x", a.d_x);
  pp_check_same_shape("x", a.x, "d_beta", a.d_beta);
  pp_check_same_shape("x", a.x, "d_x", a.d_x);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("d_x", a.d_x),
                                    ::k3::detail::named_views("x", a.x, "d_beta", a.d_beta));
}

}  // namespace detail

template <HostBackend Bk, class In, std::size_t Rank, class Space, class = ::k3::detail::reachable<Bk, Space>>
void l2norm(Bk const& b, l2norm_args<In, Rank, Space> const& a, l2norm_options const& = {}) {
  static_assert(Rank >= 1, "l2norm_args: x and y need rank >= 1 (the norm runs over the last dimension)");
  auto const& x = a.x;
  auto const& y = a.y;
  using X = std::remove_cvref_t<decltype(x)>;
  using Y = std::remove_cvref_t<decltype(y)>;
  using T = detail::pp_compute_t<X, Y>;
  detail::pp_validate_l2norm(a);
  constexpr std::size_t L = X::rank() - 1;
  index_t const D = x.extent(L), sx = x.stride(L), sy = y.stride(L);
  auto const x_row = detail::pp_row_map(x);
  auto const y_row = detail::pp_row_map(y);
  b.for_each(0, detail::pp_rows(x), [&](index_t r) {
    auto const* xp = x.data_handle() + x_row(r);
    auto* yp = y.data_handle() + y_row(r);
    T ss = 0;
    if constexpr (std::is_same_v<T, float>) {
      // Float rows are summed in vector registers; other layouts and storage types are first
      // gathered into a contiguous float row, so every layout gives the same bits.
      bool summed = false;
      if constexpr (std::is_same_v<detail::pp_elem_t<X>, float>) {
        if (sx == 1) {
          ss = detail::pp_sum_squares_row(xp, D);
          summed = true;
        }
      }
      if (!summed) {
        float small[detail::pp_row_block];
        std::vector<float> large(D > detail::pp_row_block ? static_cast<std::size_t>(D) : 0);
        float* row = D > detail::pp_row_block ? large.data() : small;
        for (index_t d = 0; d < D; ++d) row[d] = load_as<float>(xp[d * sx]);
        ss = detail::pp_sum_squares_row(row, D);
      }
    } else {
      for (index_t d = 0; d < D; ++d) {
        T const v = load_as<T>(xp[d * sx]);
        ss = std::fma(v, v, ss);
      }
    }
    T const rstd = detail::l2norm_rstd(ss, D, [&](index_t d) { return load_as<T>(xp[d * sx]); });
    if constexpr (std::is_same_v<detail::pp_elem_t<X>, T> && std::is_same_v<detail::pp_elem_t<Y>, T>) {
      if (sx == 1 && sy == 1) {
        for (index_t d = 0; d < D; ++d) yp[d] = xp[d] * rstd;  // the same products, vectorised
        return;
      }
    }
    for (index_t d = 0; d < D; ++d) yp[d * sy] = store_as<detail::pp_elem_t<Y>>(load_as<T>(xp[d * sx]) * rstd);
  });
}

// d_x = rstd * (d_y - (d_y . y) y), with y = x * rstd recomputed from x.
template <HostBackend Bk, class In, std::size_t Rank, class Space, class = ::k3::detail::reachable<Bk, Space>>
void l2norm_backward(Bk const& b, l2norm_backward_args<In, Rank, Space> const& a, l2norm_options const& = {}) {
  static_assert(Rank >= 1, "l2norm_backward_args: x, d_y and d_x need rank >= 1 (the norm runs over the last dimension)");
  auto const& x = a.x;
  auto const& dy = a.d_y;
  auto const& dx = a.d_x;
  using X = std::remove_cvref_t<decltype(x)>;
  using DY = std::remove_cvref_t<decltype(dy)>;
  using DX = std::remove_cvref_t<decltype(dx)>;
  using T = detail::pp_compute_t<X, DY, DX>;
  detail::pp_validate_l2norm_backward(a);
  constexpr std::size_t L = X::rank() - 1;
  index_t const D = x.extent(L), sx = x.stride(L), sg = dy.stride(L), sd = dx.stride(L);
  auto const x_row = detail::pp_row_map(x);
  auto const dy_row = detail::pp_row_map(dy);
  auto const dx_row = detail::pp_row_map(dx);
  b.for_each(0, detail::pp_rows(x), [&](index_t r) {
    auto const* xp = x.data_handle() + x_row(r);
    auto const* gp = dy.data_handle() + dy_row(r);
    auto* dp = dx.data_handle() + dx_row(r);
    T ss = 0, gx = 0;
    if constexpr (std::is_same_v<T, float>) {
      bool summed = false;
      // As in the forward: float rows are summed in vector registers (the same ss, so the same
      // rstd, as the forward's), other layouts and storage types gathered first.
      if constexpr (std::is_same_v<detail::pp_elem_t<X>, float> && std::is_same_v<detail::pp_elem_t<DY>, float>) {
        if (sx == 1 && sg == 1) {
          detail::pp_sum_squares_and_dot_row(xp, gp, D, ss, gx);
          summed = true;
        }
      }
      if (!summed) {
        detail::pp_aligned_vector<float> rows(static_cast<std::size_t>(2 * D));
        for (index_t d = 0; d < D; ++d) {
          rows[static_cast<std::size_t>(d)] = load_as<float>(xp[d * sx]);
          rows[static_cast<std::size_t>(D + d)] = load_as<float>(gp[d * sg]);
        }
        detail::pp_sum_squares_and_dot_row(rows.data(), rows.data() + D, D, ss, gx);
      }
    } else {
      for (index_t d = 0; d < D; ++d) {
        T const v = load_as<T>(xp[d * sx]);
        ss = std::fma(v, v, ss);
        gx = std::fma(load_as<T>(gp[d * sg]), v, gx);
      }
    }
    T const rstd = detail::l2norm_rstd(ss, D, [&](index_t d) { return load_as<T>(xp[d * sx]); });
    T c = gx * rstd * rstd;  // (dy . y) / |x|_eps, folded so y is never formed (left to right: no rstd^2 underflow)
    if (!(std::fabs(gx) <= std::numeric_limits<T>::max())) {
      // dy . x overflowed (huge rows: |x| |dy| beyond the type's range) although dy . y is
      // finite: sum dy * (x rstd) instead. Rows whose dy . x is finite keep the formula above.
      T gy = 0;
      for (index_t d = 0; d < D; ++d) gy = std::fma(load_as<T>(gp[d * sg]), load_as<T>(xp[d * sx]) * rstd, gy);
      c = gy * rstd;
    }
    if constexpr (std::is_same_v<detail::pp_elem_t<X>, T> && std::is_same_v<detail::pp_elem_t<DY>, T> && std::is_same_v<detail::pp_elem_t<DX>, T>) {
      if (sx == 1 && sg == 1 && sd == 1) {
        for (index_t d = 0; d < D; ++d) dp[d] = rstd * (gp[d] - c * xp[d]);  // the same arithmetic, vectorised
        return;
      }
    }
    for (index_t d = 0; d < D; ++d)
      dp[d * sd] = store_as<detail::pp_elem_t<DX>>(rstd * (load_as<T>(gp[d * sg]) - c * load_as<T>(xp[d * sx])));
  });
}

// ---- beta = sigmoid(x) (times 2 with negative eigenvalues allowed) ------------------------

template <HostBackend Bk, class In, std::size_t Rank, class Space, class = ::k3::detail::reachable<Bk, Space>>
void beta_sigmoid(Bk const& b, beta_sigmoid_args<In, Rank, Space> const& a, beta_sigmoid_options const& opt = {}) {
  static_assert(Rank >= 1, "beta_sigmoid_args: x and beta need rank >= 1");
  auto const& x = a.x;
  auto const& beta = a.beta;
  bool const allow_neg_eigval = opt.allow_neg_eigval;
  using X = std::remove_cvref_t<decltype(x)>;
  using Y = std::remove_cvref_t<decltype(beta)>;
  using T = detail::pp_compute_t<X, Y>;
  detail::pp_validate_beta_sigmoid(a);
  constexpr std::size_t L = X::rank() - 1;
  index_t const D = x.extent(L), sx = x.stride(L), sy = beta.stride(L);
  T const s = allow_neg_eigval ? T(2) : T(1);
  auto const x_row = detail::pp_row_map(x);
  auto const beta_row = detail::pp_row_map(beta);
  b.for_each(0, detail::pp_rows(x), [&](index_t r) {
    auto const* xp = x.data_handle() + x_row(r);
    auto* yp = beta.data_handle() + beta_row(r);
    for (index_t d = 0; d < D; ++d) yp[d * sy] = store_as<detail::pp_elem_t<Y>>(s * ::k3::detail::sigmoid(load_as<T>(xp[d * sx])));
  });
}

template <HostBackend Bk, class In, std::size_t Rank, class Space, class = ::k3::detail::reachable<Bk, Space>>
void beta_sigmoid_backward(Bk const& b, beta_sigmoid_backward_args<In, Rank, Space> const& a, beta_sigmoid_options const& opt = {}) {
  static_assert(Rank >= 1, "beta_sigmoid_backward_args: x, d_beta and d_x need rank >= 1");
  auto const& x = a.x;
  auto const& dbeta = a.d_beta;
  auto const& dx = a.d_x;
  bool const allow_neg_eigval = opt.allow_neg_eigval;
  using X = std::remove_cvref_t<decltype(x)>;
  using DY = std::remove_cvref_t<decltype(dbeta)>;
  using DX = std::remove_cvref_t<decltype(dx)>;
  using T = detail::pp_compute_t<X, DY, DX>;
  detail::pp_validate_beta_sigmoid_backward(a);
  constexpr std::size_t L = X::rank() - 1;
  index_t const D = x.extent(L), sx = x.stride(L), sg = dbeta.stride(L), sd = dx.stride(L);
  T const s = allow_neg_eigval ? T(2) : T(1);
  auto const x_row = detail::pp_row_map(x);
  auto const dbeta_row = detail::pp_row_map(dbeta);
  auto const dx_row = detail::pp_row_map(dx);
  b.for_each(0, detail::pp_rows(x), [&](index_t r) {
    auto const* xp = x.data_handle() + x_row(r);
    auto const* gp = dbeta.data_handle() + dbeta_row(r);
    auto* dp = dx.data_handle() + dx_row(r);
    for (index_t d = 0; d < D; ++d) {
      // sigmoid'(x) = sigmoid(x) sigmoid(-x): no cancellation in 1 - sigmoid(x) for large x.
      T const xv = load_as<T>(xp[d * sx]);
      T const ds = ::k3::detail::sigmoid(xv) * ::k3::detail::sigmoid(-xv);
      dp[d * sd] = store_as<detail::pp_elem_t<DX>>(load_as<T>(gp[d * sg]) * s * ds);
    }
  });
}

// ---- the two KDA gates ----------------------------------------------------------------------

namespace detail {

enum class pp_gate { softplus, lower_bound };

template <class X, class A, class Bias, class G>
void pp_check_gate(std::string_view gname, X const& x, A const& A_log, Bias const& dt_bias, G const& g) {
  ::k3::detail::check_view("x", x);
  ::k3::detail::check_view(gname, g);
  index_t const HV = x.extent(2), K = x.extent(3);
  ::k3::detail::check_shape(gname, g, {x.extent(0), x.extent(1), HV, K});
  if (::k3::present(A_log)) {
    ::k3::detail::check_view("A_log", A_log);
    ::k3::detail::check_shape("A_log", A_log, {HV});
  }
  if (::k3::present(dt_bias)) {
    ::k3::detail::check_view("dt_bias", dt_bias);
    ::k3::detail::check_shape("dt_bias", dt_bias, {HV, K});
  }
}


inline void pp_check_lower_bound(double lb) {
  ::k3::detail::require(lb >= -5.0 && lb < 0.0, error_kind::value, [&] {
    return "option 'lower_bound': must lie in [-5, 0), got " + ::k3::detail::format_number(lb);
  });
}

// exp(A_log[h]) per head (1 without A_log), and dt_bias as a dense [HV, K] row table (empty
// without it): computed once, not per row.
template <class T, class A>
std::vector<T> pp_gate_scales(A const& A_log, index_t HV) {
  std::vector<T> a(static_cast<std::size_t>(HV), T(1));
  if (::k3::present(A_log))
    for (index_t h = 0; h < HV; ++h) a[static_cast<std::size_t>(h)] = std::exp(load_as<T>(A_log(h)));
  return a;
}
template <class T, class Bias>
std::vector<T> pp_gate_bias(Bias const& dt_bias, index_t HV, index_t K) {
  std::vector<T> bias;
  if (::k3::present(dt_bias)) {
    bias.resize(static_cast<std::size_t>(HV * K));
    for (index_t h = 0; h < HV; ++h)
      for (index_t k = 0; k < K; ++k) bias[static_cast<std::size_t>(h * K + k)] = load_as<T>(dt_bias(h, k));
  }
  return bias;
}

// The lower-bound gate's backward over a contiguous float block of n <= pp_row_block
// elements: z = a (x + bias) (bias may be null), s = sigmoid(z), dz = dg lb s (1 - s),
// du = dz a into du and, when acc is not null, added to acc[k] in double; returns
// sum_k dz z (a saturated z with dz = 0 adds 0, not 0 * inf), summed per lane and then across
// lanes in a fixed order. In vector registers from end to end: one serial sum over the row, or
// separate passes through scratch rows, would leave the core waiting on latencies.
template <class Arch = xsimd::default_arch>
float pp_gate_lb_backward_block(float const* x, float const* bias, float const* dg, index_t n, float a, float lb, float* du,
                                double* acc, bool stream = false) noexcept {
  using batch = xsimd::batch<float, Arch>;
  constexpr index_t L = static_cast<index_t>(batch::size);
  constexpr index_t U = static_cast<index_t>(pp_unroll);
  batch da(0.0f);
  // U vectors from x, bias and dg at p (m valid lanes in the last, zero-padded by the caller).
  auto block = [&]<std::size_t N>(float const* xs, float const* bs, float const* gs, float* us, double* as, bool st) {
    batch z[N], sp[N], sm[N];
    for (std::size_t u = 0; u < N; ++u) {
      batch xv = batch::load_unaligned(xs + u * L);
      if (bs) xv = xv + batch::load_unaligned(bs + u * L);
      z[u] = batch(a) * xv;
    }
    pp_sigmoid_pair_n(z, sp, sm);
    alignas(64) float dus[N * L];
    for (std::size_t u = 0; u < N; ++u) {
      batch const dz = batch::load_unaligned(gs + u * L) * batch(lb) * sp[u] * sm[u];
      batch const uv = dz * batch(a);
      if (st)
        k3::simd::store_stream(us + u * L, uv);
      else
        uv.store_unaligned(us + u * L);
      uv.store_aligned(dus + u * L);
      da += xsimd::select((dz == batch(0.0f)) && xsimd::isinf(z[u]), batch(0.0f), dz * z[u]);
    }
    if (as)
      for (std::size_t k = 0; k < N * L; ++k) as[k] += static_cast<double>(dus[k]);
  };
  index_t c = 0;
  for (; c + U * L <= n; c += U * L)
    block.template operator()<pp_unroll>(x + c, bias ? bias + c : nullptr, dg + c, du + c, acc ? acc + c : nullptr, stream);
  for (; c + L <= n; c += L) block.template operator()<1>(x + c, bias ? bias + c : nullptr, dg + c, du + c, acc ? acc + c : nullptr, stream);
  if (c < n) {
    alignas(64) float bx[L] = {}, bb[L] = {}, bg[L] = {}, bu[L];
    alignas(64) double ba[L] = {};
    std::copy(x + c, x + n, bx);
    if (bias) std::copy(bias + c, bias + n, bb);
    std::copy(dg + c, dg + n, bg);
    block.template operator()<1>(bx, bias ? bb : nullptr, bg, bu, ba, false);
    std::copy(bu, bu + (n - c), du + c);
    if (acc)
      for (index_t k = c; k < n; ++k) acc[k] += ba[k - c];
  }
  alignas(64) float lanes[L];
  da.store_aligned(lanes);
  float s = 0.0f;
  for (index_t i = 0; i < L; ++i) s += lanes[i];
  return s;
}

// HasBias: whether dt_bias is present, a template parameter so that the row loops keep no
// per-element test of it.
template <pp_gate Kind, bool HasBias, class Bk, class X, class A, class Bias, class G>
void pp_gate_forward(Bk const& b, X const& x, A const& A_log, Bias const& dt_bias, double lb, G const& g) {
  using T = pp_compute_t<X, A, Bias, G>;
  index_t const B = x.extent(0), Tn = x.extent(1), HV = x.extent(2), K = x.extent(3);
  std::vector<T> const a_of = pp_gate_scales<T>(A_log, HV);
  std::vector<T> const bias_of = pp_gate_bias<T>(dt_bias, HV, K);
  auto const x_row = pp_row_map(x);
  auto const g_row = pp_row_map(g);
  index_t const sx = x.stride(3), sg = g.stride(3);
  b.for_each(0, B * Tn * HV, [&](index_t r) {
    index_t const h = r % HV;
    T const a = a_of[static_cast<std::size_t>(h)];
    [[maybe_unused]] T const* bias = nullptr;
    if constexpr (HasBias) bias = bias_of.data() + h * K;
    auto const* xp = x.data_handle() + x_row(r);
    auto* gp = g.data_handle() + g_row(r);
    auto u_at = [&](index_t k) {
      if constexpr (!HasBias) return load_as<T>(xp[k * sx]);
      else return load_as<T>(xp[k * sx]) + bias[k];
    };
    if constexpr (Kind == pp_gate::softplus) {
      for (index_t k = 0; k < K; ++k) gp[k * sg] = store_as<pp_elem_t<G>>(-a * ::k3::detail::softplus(u_at(k)));
    } else {
      // z = a (x + dt_bias) elementwise, then the sigmoid of the row (pp_sigmoid_row: one
      // rounding for every layout), then the bound.
      alignas(64) T z[pp_row_block];
      for (index_t k0 = 0; k0 < K; k0 += pp_row_block) {
        index_t const nk = std::min(pp_row_block, K - k0);
        for (index_t k = 0; k < nk; ++k) z[k] = a * u_at(k0 + k);
        pp_sigmoid_row(z, nk);
        for (index_t k = 0; k < nk; ++k) gp[(k0 + k) * sg] = store_as<pp_elem_t<G>>(T(lb) * z[k]);
      }
    }
  });
}

template <pp_gate Kind, class X, class A, class Bias, class G>
void pp_gate_forward_checks(X const& x, A const& A_log, Bias const& dt_bias, double lb, G const& g) {
  pp_check_gate("g", x, A_log, dt_bias, g);
  if constexpr (Kind == pp_gate::lower_bound) pp_check_lower_bound(lb);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("g", g),
                                    ::k3::detail::named_views("x", x, "A_log", A_log, "dt_bias", dt_bias));
}

// Every check of a gate's forward, for views in any memory space (shared with the CUDA backend).
template <pp_gate Kind, class In, class P, class Space>
void pp_validate_gate(gate_args<In, P, Space> const& a, double lb) {
  pp_gate_forward_checks<Kind>(a.x, a.A_log, a.dt_bias, lb, a.g);
}

template <pp_gate Kind, class Bk, class In, class P>
void pp_gate_run(Bk const& b, gate_args<In, P> const& a, double lb) {
  pp_validate_gate<Kind>(a, lb);
  if (::k3::present(a.dt_bias))
    pp_gate_forward<Kind, true>(b, a.x, a.A_log, a.dt_bias, lb, a.g);
  else
    pp_gate_forward<Kind, false>(b, a.x, a.A_log, a.dt_bias, lb, a.g);
}

template <pp_gate Kind, class X, class A, class Bias, class DG, class DX, class DA, class DB>
void pp_gate_backward_checks(X const& x, A const& A_log, Bias const& dt_bias, double lb, DG const& dg, DX const& dx, DA const& dA_log,
                             DB const& ddt_bias) {
  pp_check_gate("d_g", x, A_log, dt_bias, dg);
  if constexpr (Kind == pp_gate::lower_bound) pp_check_lower_bound(lb);
  index_t const B = x.extent(0), Tn = x.extent(1), HV = x.extent(2), K = x.extent(3);
  ::k3::detail::check_view("d_x", dx);
  ::k3::detail::check_shape("d_x", dx, {B, Tn, HV, K});
  if (::k3::present(dA_log)) {
    ::k3::detail::check_view("d_A_log", dA_log);
    ::k3::detail::check_shape("d_A_log", dA_log, {HV});
  }
  if (::k3::present(ddt_bias)) {
    ::k3::detail::check_view("d_dt_bias", ddt_bias);
    ::k3::detail::check_shape("d_dt_bias", ddt_bias, {HV, K});
  }
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("d_x", dx, "d_A_log", dA_log, "d_dt_bias", ddt_bias),
                                    ::k3::detail::named_views("x", x, "d_g", dg, "A_log", A_log, "dt_bias", dt_bias));
}

template <pp_gate Kind, bool HasBias, class Bk, class X, class A, class Bias, class DG, class DX, class DA, class DB>
void pp_gate_backward(Bk const& b, X const& x, A const& A_log, Bias const& dt_bias, double lb, DG const& dg, DX const& dx,
                      DA const& dA_log, DB const& ddt_bias, preprocess_tuning const& tune) {
  index_t const B = x.extent(0), Tn = x.extent(1), HV = x.extent(2), K = x.extent(3);
  using T = pp_compute_t<X, A, Bias, DG, DX, DA, DB>;
  bool const has_da = ::k3::present(dA_log), has_ddt = ::k3::present(ddt_bias);
  bool const want_params = has_da || has_ddt;
  std::size_t const width = static_cast<std::size_t>(HV * (K + 1));
  // Per row (b, t, h): writes dx and adds this row's parameter gradients into acc
  // (acc[h*K + k] for dt_bias, acc[HV*K + h] for A_log) when acc is not null.
  std::vector<T> const a_of = pp_gate_scales<T>(A_log, HV);
  std::vector<T> const bias_of = pp_gate_bias<T>(dt_bias, HV, K);
  auto const x_row = pp_row_map(x);
  auto const dg_row = pp_row_map(dg);
  auto const dx_row = pp_row_map(dx);
  index_t const sx = x.stride(3), sdg = dg.stride(3), sdx = dx.stride(3);
  index_t const rows = B * Tn * HV;
  // dx bypasses the caches when large and on cache lines; then each task fences its stores.
  bool const stream = std::is_same_v<pp_elem_t<DX>, float> && sdx == 1 && K % 16 == 0 &&
                      reinterpret_cast<std::uintptr_t>(dx.data_handle()) % 64 == 0 && (HV == 1 || dx.stride(2) % 16 == 0) &&
                      tune.stream(static_cast<std::size_t>(B * Tn * HV * K) * sizeof(pp_elem_t<DX>));
  auto row = [&](index_t r, double* acc) {
    index_t const h = r % HV;
    T const a = a_of[static_cast<std::size_t>(h)];
    [[maybe_unused]] T const* bias = nullptr;
    if constexpr (HasBias) bias = bias_of.data() + h * K;
    auto const* xp = x.data_handle() + x_row(r);
    auto const* dgp = dg.data_handle() + dg_row(r);
    auto* dxp = dx.data_handle() + dx_row(r);
    auto u_at = [&](index_t k) {
      if constexpr (!HasBias) return load_as<T>(xp[k * sx]);
      else return load_as<T>(xp[k * sx]) + bias[k];
    };
    T da = 0;
    if constexpr (Kind == pp_gate::lower_bound) {
      // The sigmoids of a block of the row at once (pp_sigmoid_pair_row), then the same
      // elementwise products as one element at a time.
      for (index_t k0 = 0; k0 < K; k0 += pp_row_block) {
        index_t const nk = std::min(pp_row_block, K - k0);
        if constexpr (std::is_same_v<T, float>) {
          // Float: one fused pass over the block (pp_gate_lb_backward_block); other layouts
          // and storage types are gathered into contiguous rows first, so every layout gives
          // the same bits.
          float const* bk = nullptr;
          if constexpr (HasBias) bk = bias + k0;
          double* ak = acc ? acc + h * K + k0 : nullptr;
          if constexpr (std::is_same_v<pp_elem_t<X>, float> && std::is_same_v<pp_elem_t<DG>, float> && std::is_same_v<pp_elem_t<DX>, float>) {
            if (sx == 1 && sdg == 1 && sdx == 1) {
              da += pp_gate_lb_backward_block(xp + k0, bk, dgp + k0, nk, a, T(lb), dxp + k0, ak, stream);
              continue;
            }
          }
          alignas(64) float xv[pp_row_block], dgv[pp_row_block], du[pp_row_block];
          for (index_t k = 0; k < nk; ++k) {
            xv[k] = load_as<float>(xp[(k0 + k) * sx]);
            dgv[k] = load_as<float>(dgp[(k0 + k) * sdg]);
          }
          da += pp_gate_lb_backward_block(xv, bk, dgv, nk, a, T(lb), du, ak);
          for (index_t k = 0; k < nk; ++k) dxp[(k0 + k) * sdx] = store_as<pp_elem_t<DX>>(du[k]);
        } else {
          alignas(64) T z[pp_row_block], sp[pp_row_block], sm[pp_row_block];
          for (index_t k = 0; k < nk; ++k) z[k] = a * u_at(k0 + k);
          pp_sigmoid_pair_row(z, sp, sm, nk);
          for (index_t k = 0; k < nk; ++k) {
            // g = lb sigmoid(z), z = a u: dg/dz = lb s (1 - s), dz/du = a, dz/dA_log = z.
            T const dz = load_as<T>(dgp[(k0 + k) * sdg]) * T(lb) * sp[k] * sm[k];
            T const du = dz * a;
            // Saturated (z = +-inf in T, e.g. |x| ~ 1e38 in float): s (1 - s) z -> 0, not 0 * inf.
            da += (dz == T(0) && std::isinf(z[k])) ? T(0) : dz * z[k];
            dxp[(k0 + k) * sdx] = store_as<pp_elem_t<DX>>(du);
            if (acc) acc[h * K + k0 + k] += static_cast<double>(du);
          }
        }
      }
    } else {
      for (index_t k = 0; k < K; ++k) {
        T const u = u_at(k);
        T const gy = load_as<T>(dgp[k * sdg]);
        // g = -a softplus(u): dg/du = -a sigmoid(u), dg/dA_log = g.
        T const du = -a * ::k3::detail::sigmoid(u) * gy;
        da += gy * (-a * ::k3::detail::softplus(u));
        dxp[k * sdx] = store_as<pp_elem_t<DX>>(du);
        if (acc) acc[h * K + k] += static_cast<double>(du);
      }
    }
    if (acc) acc[HV * K + h] += static_cast<double>(da);
    // Each block of pp_reduce_block rows runs on one thread: its last row fences the block.
    if (stream && ((r + 1) % pp_reduce_block == 0 || r + 1 == rows)) k3::simd::stream_fence<xsimd::default_arch>();
  };
  if (want_params) {
    std::vector<double> const sums = pp_blocked_reduce(b, rows, width, row);
    if (has_ddt)
      for (index_t h = 0; h < HV; ++h)
        for (index_t k = 0; k < K; ++k) ddt_bias(h, k) = store_as<pp_elem_t<DB>>(sums[static_cast<std::size_t>(h * K + k)]);
    if (has_da)
      for (index_t h = 0; h < HV; ++h) dA_log(h) = store_as<pp_elem_t<DA>>(sums[static_cast<std::size_t>(HV * K + h)]);
  } else {
    b.for_each(0, (rows + pp_reduce_block - 1) / pp_reduce_block, [&](index_t blk) {
      for (index_t r = blk * pp_reduce_block, end = std::min(rows, r + pp_reduce_block); r < end; ++r) row(r, nullptr);
    });
  }
}

// Every check of a gate's backward, for views in any memory space.
template <pp_gate Kind, class In, class P, class Space>
void pp_validate_gate_backward(gate_backward_args<In, P, Space> const& a, double lb) {
  pp_gate_backward_checks<Kind>(a.x, a.A_log, a.dt_bias, lb, a.d_g, a.d_x, a.d_A_log, a.d_dt_bias);
}

template <pp_gate Kind, class Bk, class In, class P>
void pp_gate_backward_run(Bk const& b, gate_backward_args<In, P> const& a, double lb, preprocess_tuning const& tune = {}) {
  pp_validate_gate_backward<Kind>(a, lb);
  if (::k3::present(a.dt_bias))
    pp_gate_backward<Kind, true>(b, a.x, a.A_log, a.dt_bias, lb, a.d_g, a.d_x, a.d_A_log, a.d_dt_bias, tune);
  else
    pp_gate_backward<Kind, false>(b, a.x, a.A_log, a.dt_bias, lb, a.d_g, a.d_x, a.d_A_log, a.d_dt_bias, tune);
}

}  // namespace detail

// g = -exp(A_log[h]) * softplus(x + dt_bias[h, :]); range (-inf, 0].
template <HostBackend Bk, class In, class P, class Space, class = ::k3::detail::reachable<Bk, Space>>
void gate_softplus(Bk const& b, gate_args<In, P, Space> const& a, gate_softplus_options const& = {}) {
  detail::pp_gate_run<detail::pp_gate::softplus>(b, a, 0.0);
}

// d_x, and optionally d_A_log [HV] (sum over B, T, K) and d_dt_bias [HV, K] (sum over B, T).
template <HostBackend Bk, class In, class P, class Space, class = ::k3::detail::reachable<Bk, Space>>
void gate_softplus_backward(Bk const& b, gate_backward_args<In, P, Space> const& a, gate_softplus_options const& = {}) {
  detail::pp_gate_backward_run<detail::pp_gate::softplus>(b, a, 0.0);
}

// g = lower_bound * sigmoid(exp(A_log[h]) * (x + dt_bias[h, :])); range (lower_bound, 0).
template <HostBackend Bk, class In, class P, class Space, class = ::k3::detail::reachable<Bk, Space>>
void gate_lower_bound(Bk const& b, gate_args<In, P, Space> const& a, gate_options const& opt = {}) {
  detail::pp_gate_run<detail::pp_gate::lower_bound>(b, a, opt.lower_bound);
}

template <HostBackend Bk, class In, class P, class Space, class = ::k3::detail::reachable<Bk, Space>>
void gate_lower_bound_backward(Bk const& b, gate_backward_args<In, P, Space> const& a, gate_options const& opt = {}) {
  detail::pp_gate_backward_run<detail::pp_gate::lower_bound>(b, a, opt.lower_bound, opt.tuning);
}

}  // namespace k3::kda
