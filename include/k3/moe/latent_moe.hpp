// k3/moe/latent_moe.hpp — the Stable LatentMoE layer of Kimi K3 as one op, forward and
// backward (spec moe_routing.md A.1, C.1, C.2):
//
//   s    = sigmoid(x w_routerᵀ)                               [T, n]
//   I_t  = top-k of s_t + bias (ties -> lower expert index), listed by descending s + bias
//   p_te = scale · s_te / Σ_{e' ∈ I_t} s_te'                   (the sum taken as 1 when it is 0)
//   z    = x w_downᵀ                                          [T, l]
//   a_te = SiTU(z we_gate[e]ᵀ, z we_up[e]ᵀ)                    softcap(g, β_gate)·sigmoid(g)·softcap(u, β_up)
//   u_t  = Σ_{e ∈ I_t} p_te · a_te we_down[e]ᵀ                 [l]
//   r_t  = u_t / sqrt(mean(u_t²) + eps) · norm_weight
//   y_t  = r_t w_upᵀ + Σ_j SiTU(x ws_gate[j]ᵀ, x ws_up[j]ᵀ) ws_down[j]ᵀ
//
// k3::moe::latent_moe_forward(backend, latent_moe_args<T>{...}, options) and
// latent_moe_backward(backend, args with dy and the gradient views, options). Storage float,
// double or k3::bfloat16; float and bfloat16 compute in float32 (every intermediate: s, z, a, u,
// r), double in double. The experts run as grouped GEMMs (Eigen) over the tokens routed to each,
// one expert per task on the backend's threads; every sum over tokens or slots runs in a fixed
// order, so the results do not depend on the thread count.
//
// The backward holds the selection fixed (the bias gets no gradient: Quantile Balancing owns
// it). It uses the rewrite of C.2: the router-probability gradient is <we_down[e]ᵀ du_t, a_te>,
// from the activation recomputed from z; no expert output and no dispatched copy is kept, only
// the layer input x (and z, recomputed from it). A selected expert with p = 0 keeps its id and
// gets its gradient.
//
// Non-finite input (x, dy or any weight) is a k3::error naming the argument and the position:
// routing cannot rank NaN scores, and one NaN token would reach every expert's weight gradient.
#pragma once
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/math.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"
#include "k3/moe/situ.hpp"

namespace k3::moe {

struct latent_moe_options {
  index_t k = 16;
  double scale = 1.0;
  double eps = 1e-6;
  double beta_gate = 4.0, beta_up = 25.0;
};

// Inputs and (forward) outputs. Optional views are empty (default-constructed): bias (zeros),
// norm_weight (ones), the shared experts (all three or none).
template <class T>
struct latent_moe_args {
  const_view<T, 2> x;            // [T, d]
  const_view<T, 2> w_router;     // [n, d]
  const_view<T, 1> bias{};         // [n]
  const_view<T, 2> w_down;       // [l, d]
  const_view<T, 3> we_gate;      // [n, f, l]
  const_view<T, 3> we_up;        // [n, f, l]
  const_view<T, 3> we_down;      // [n, l, f]
  const_view<T, 1> norm_weight{};  // [l]
  const_view<T, 2> w_up;         // [d, l]
  const_view<T, 3> ws_gate{};      // [s, F, d]
  const_view<T, 3> ws_up{};        // [s, F, d]
  const_view<T, 3> ws_down{};      // [s, d, F]
  tensor_view<T, 2> y{};                   // [T, d]
  tensor_view<std::int64_t, 2> indices{};  // [T, k]
  tensor_view<T, 2> weights{};             // [T, k], p
};

// The backward's extra input and its outputs (each may be empty: not computed).
template <class T>
struct latent_moe_gradients {
  const_view<T, 2> dy;  // [T, d]
  tensor_view<T, 2> dx{}, dw_router{}, dw_down{};
  tensor_view<T, 3> dwe_gate{}, dwe_up{}, dwe_down{};
  tensor_view<T, 1> dnorm_weight{};
  tensor_view<T, 2> dw_up{};
  tensor_view<T, 3> dws_gate{}, dws_up{}, dws_down{};
};

namespace detail {

template <class C>
using lm_matrix = Eigen::Matrix<C, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <class S>
using lm_compute_t = std::conditional_t<std::is_same_v<S, double>, double, float>;

template <class C, class V>
lm_matrix<C> lm_load(V const& v) {
  lm_matrix<C> m(v.extent(0), v.extent(1));
  for (index_t i = 0; i < v.extent(0); ++i)
    for (index_t j = 0; j < v.extent(1); ++j) m(i, j) = load_as<C>(v(i, j));
  return m;
}
template <class C>
using lm_cmap = Eigen::Map<lm_matrix<C> const, Eigen::Unaligned, Eigen::OuterStride<>>;

// A matrix view as Eigen sees it: the caller's memory when it already holds the compute type
// with unit-stride rows (no copy of the experts' weights), else a converted copy in `own`.
template <class C, class V>
lm_cmap<C> lm_map(V const& v, lm_matrix<C>& own) {
  using E = std::remove_const_t<typename V::element_type>;
  if constexpr (std::is_same_v<E, C>) {
    if (v.extent(1) <= 1 || v.stride(1) == 1)
      return lm_cmap<C>(v.data_handle(), v.extent(0), v.extent(1), Eigen::OuterStride<>(std::max<index_t>(v.stride(0), v.extent(1))));
  }
  own = lm_load<C>(v);
  return lm_cmap<C>(own.data(), own.rows(), own.cols(), Eigen::OuterStride<>(std::max<Eigen::Index>(own.cols(), 1)));
}
template <class M, class V>
void lm_store(M const& m, V const& v) {
  using S = std::remove_const_t<typename V::element_type>;
  for (index_t i = 0; i < v.extent(0); ++i)
    for (index_t j = 0; j < v.extent(1); ++j) v(i, j) = store_as<S>(m(i, j));
}

// v = the product expr, written straight into v when it holds the compute type with contiguous
// rows (no temporary the size of an expert's weights), else through one.
template <class C, class V, class Expr>
void lm_assign(V const& v, Expr const& expr) {
  using E = std::remove_const_t<typename V::element_type>;
  if constexpr (std::is_same_v<E, C>) {
    if (v.extent(1) <= 1 || v.stride(1) == 1) {
      Eigen::Map<lm_matrix<C>, Eigen::Unaligned, Eigen::OuterStride<>> out(v.data_handle(), v.extent(0), v.extent(1),
                                                                             Eigen::OuterStride<>(std::max<index_t>(v.stride(0), v.extent(1))));
      out.noalias() = expr;
      return;
    }
  }
  lm_store(lm_matrix<C>(expr), v);
}

template <class V>
void lm_check_finite(char const* name, V const& v) {
  if constexpr (V::rank() == 1) {
    for (index_t i = 0; i < v.extent(0); ++i)
      ::k3::detail::require(std::isfinite(load_as<double>(v(i))), [&] {
        return std::string("argument '") + name + "': non-finite value at [" + std::to_string(i) + "]";
      });
  } else if constexpr (V::rank() == 2) {
    for (index_t i = 0; i < v.extent(0); ++i)
      for (index_t j = 0; j < v.extent(1); ++j)
        ::k3::detail::require(std::isfinite(load_as<double>(v(i, j))), [&] {
          return std::string("argument '") + name + "': non-finite value at [" + std::to_string(i) + ", " + std::to_string(j) + "]" +
                 (std::string(name) == "x" || std::string(name) == "dy" ? " (token " + std::to_string(i) + ")" : "");
        });
  } else {
    for (index_t e = 0; e < v.extent(0); ++e) lm_check_finite(name, v.slice(0, e));
  }
}

template <class V>
void lm_check_out(char const* name, V const& v, std::initializer_list<index_t> shape) {
  if (v.data_handle() == nullptr && v.size() == 0 && v.extent(0) == 0) return;  // not requested
  ::k3::detail::check_view(name, v);
  ::k3::detail::check_shape(name, v, shape);
  ::k3::detail::check_not_broadcast(name, v);
}

template <class V>
bool lm_present(V const& v) {
  return !(v.data_handle() == nullptr && v.size() == 0 && v.extent(0) == 0);
}

struct lm_dims {
  index_t T, d, n, l, f, s, F;
};

template <class T>
lm_dims check_latent_moe(latent_moe_args<T> const& a, latent_moe_options const& o) {
  using ::k3::detail::any_extent;
  ::k3::detail::check_view("x", a.x);
  ::k3::detail::check_view("w_router", a.w_router);
  ::k3::detail::check_view("w_down", a.w_down);
  ::k3::detail::check_view("we_gate", a.we_gate);
  ::k3::detail::check_view("we_up", a.we_up);
  ::k3::detail::check_view("we_down", a.we_down);
  ::k3::detail::check_view("w_up", a.w_up);
  lm_dims m{};
  m.T = a.x.extent(0);
  m.d = a.x.extent(1);
  ::k3::detail::check_shape("w_router", a.w_router, {any_extent, m.d});
  m.n = a.w_router.extent(0);
  ::k3::detail::check_shape("w_down", a.w_down, {any_extent, m.d});
  m.l = a.w_down.extent(0);
  ::k3::detail::check_shape("we_gate", a.we_gate, {m.n, any_extent, m.l});
  m.f = a.we_gate.extent(1);
  ::k3::detail::check_shape("we_up", a.we_up, {m.n, m.f, m.l});
  ::k3::detail::check_shape("we_down", a.we_down, {m.n, m.l, m.f});
  ::k3::detail::check_shape("w_up", a.w_up, {m.d, m.l});
  if (lm_present(a.bias)) ::k3::detail::check_shape("bias", a.bias, {m.n});
  if (lm_present(a.norm_weight)) ::k3::detail::check_shape("norm_weight", a.norm_weight, {m.l});
  bool const sg = lm_present(a.ws_gate), su = lm_present(a.ws_up), sd = lm_present(a.ws_down);
  ::k3::detail::require(sg == su && su == sd, "arguments 'ws_gate', 'ws_up', 'ws_down': the shared experts need all three or none");
  if (sg) {
    m.s = a.ws_gate.extent(0);
    m.F = a.ws_gate.extent(1);
    ::k3::detail::check_shape("ws_gate", a.ws_gate, {m.s, m.F, m.d});
    ::k3::detail::check_shape("ws_up", a.ws_up, {m.s, m.F, m.d});
    ::k3::detail::check_shape("ws_down", a.ws_down, {m.s, m.d, m.F});
  }
  ::k3::detail::require(o.k >= 1 && o.k <= m.n, [&] {
    return "option 'k': expected 1 <= k <= n = " + std::to_string(m.n) + " experts, got " + std::to_string(o.k);
  });
  ::k3::detail::require(std::isfinite(o.scale), "option 'scale': must be finite");
  ::k3::detail::require(std::isfinite(o.eps) && o.eps > 0, [&] { return "option 'eps': expected a finite value > 0, got " + ::k3::detail::format_number(o.eps); });
  ::k3::detail::require(std::isfinite(o.beta_gate) && o.beta_gate > 0 && std::isfinite(o.beta_up) && o.beta_up > 0,
                        "options 'beta_gate', 'beta_up': expected finite values > 0");
  lm_check_out("y", a.y, {m.T, m.d});
  lm_check_out("indices", a.indices, {m.T, o.k});
  lm_check_out("weights", a.weights, {m.T, o.k});
  lm_check_finite("x", a.x);
  lm_check_finite("w_router", a.w_router);
  if (lm_present(a.bias)) lm_check_finite("bias", a.bias);
  lm_check_finite("w_down", a.w_down);
  lm_check_finite("we_gate", a.we_gate);
  lm_check_finite("we_up", a.we_up);
  lm_check_finite("we_down", a.we_down);
  if (lm_present(a.norm_weight)) lm_check_finite("norm_weight", a.norm_weight);
  lm_check_finite("w_up", a.w_up);
  if (sg) {
    lm_check_finite("ws_gate", a.ws_gate);
    lm_check_finite("ws_up", a.ws_up);
    lm_check_finite("ws_down", a.ws_down);
  }
  return m;
}

// SiTU of two matrices, and (with grads) its partial derivatives.
template <class C>
void lm_situ(lm_matrix<C> const& g, lm_matrix<C> const& u, situ_params<C> const& sp, lm_matrix<C>& a, lm_matrix<C>* dg, lm_matrix<C>* du) {
  a.resize(g.rows(), g.cols());
  if (dg) {
    dg->resize(g.rows(), g.cols());
    du->resize(g.rows(), g.cols());
  }
  for (Eigen::Index i = 0; i < g.rows(); ++i)
    for (Eigen::Index j = 0; j < g.cols(); ++j) {
      if (dg) {
        situ_grad<C> const r = situ_glu_grad(g(i, j), u(i, j), sp);
        a(i, j) = r.value;
        (*dg)(i, j) = r.d_gate;
        (*du)(i, j) = r.d_up;
      } else {
        a(i, j) = situ_glu(g(i, j), u(i, j), sp);
      }
    }
}

template <class C, HostBackend Bk, class T>
void latent_moe_run(Bk const& b, latent_moe_args<T> const& a, latent_moe_options const& o, lm_dims const& m,
                    latent_moe_gradients<T> const* grad) {
  index_t const T_ = m.T, k = o.k, n = m.n, l = m.l;
  situ_params<C> const sp{static_cast<C>(o.beta_gate), static_cast<C>(o.beta_up)};
  lm_matrix<C> own_x, own_wr, own_wd, own_wup;
  lm_cmap<C> const X = lm_map(a.x, own_x), Wr = lm_map(a.w_router, own_wr), Wd = lm_map(a.w_down, own_wd), Wup = lm_map(a.w_up, own_wup);
  std::vector<C> bias(static_cast<std::size_t>(n), C(0)), nw(static_cast<std::size_t>(l), C(1));
  if (lm_present(a.bias))
    for (index_t e = 0; e < n; ++e) bias[static_cast<std::size_t>(e)] = load_as<C>(a.bias(e));
  if (lm_present(a.norm_weight))
    for (index_t j = 0; j < l; ++j) nw[static_cast<std::size_t>(j)] = load_as<C>(a.norm_weight(j));

  // Routing.
  lm_matrix<C> S(T_, n);
  S.noalias() = X * Wr.transpose();
  for (Eigen::Index i = 0; i < S.size(); ++i) S.data()[i] = ::k3::detail::sigmoid(S.data()[i]);
  std::vector<index_t> idx(static_cast<std::size_t>(T_ * k));
  std::vector<C> p(idx.size()), denom(static_cast<std::size_t>(T_));
  std::vector<unsigned char> zero_sums(static_cast<std::size_t>(T_), 0);
  std::vector<index_t> order(static_cast<std::size_t>(n));
  for (index_t t = 0; t < T_; ++t) {
    std::iota(order.begin(), order.end(), index_t(0));
    auto key = [&](index_t e) { return S(t, e) + bias[static_cast<std::size_t>(e)]; };
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](index_t x1, index_t x2) {
      C const v1 = key(x1), v2 = key(x2);
      return v1 > v2 || (v1 == v2 && x1 < x2);
    });
    C sum = 0;
    for (index_t r = 0; r < k; ++r) sum += S(t, order[static_cast<std::size_t>(r)]);
    C const dn = sum > C(0) ? sum : C(1);
    denom[static_cast<std::size_t>(t)] = dn;
    zero_sums[static_cast<std::size_t>(t)] = sum > C(0) ? 0 : 1;
    for (index_t r = 0; r < k; ++r) {
      index_t const e = order[static_cast<std::size_t>(r)];
      idx[static_cast<std::size_t>(t * k + r)] = e;
      p[static_cast<std::size_t>(t * k + r)] = S(t, e) / dn * static_cast<C>(o.scale);
    }
  }
  // Slots grouped by expert, in token order.
  std::vector<std::vector<index_t>> slots(static_cast<std::size_t>(n));
  for (index_t q = 0; q < T_ * k; ++q) slots[static_cast<std::size_t>(idx[static_cast<std::size_t>(q)])].push_back(q);

  lm_matrix<C> Z(T_, l);
  Z.noalias() = X * Wd.transpose();

  // Forward of every expert: its outputs per slot (each slot written by its one expert).
  lm_matrix<C> O(T_ * k, l);
  b.for_each(0, n, [&](std::int64_t e) {
    auto const& q = slots[static_cast<std::size_t>(e)];
    if (q.empty()) return;
    index_t const ne = static_cast<index_t>(q.size());
    lm_matrix<C> Ze(ne, l);
    for (index_t i = 0; i < ne; ++i) Ze.row(i) = Z.row(q[static_cast<std::size_t>(i)] / k);
    lm_matrix<C> own_g, own_u, own_dn;
    lm_cmap<C> const Wg = lm_map(a.we_gate.slice(0, e), own_g), Wu = lm_map(a.we_up.slice(0, e), own_u), Wdn = lm_map(a.we_down.slice(0, e), own_dn);
    lm_matrix<C> G = Ze * Wg.transpose(), U = Ze * Wu.transpose(), A;
    lm_situ<C>(G, U, sp, A, nullptr, nullptr);
    lm_matrix<C> const Oe = A * Wdn.transpose();
    for (index_t i = 0; i < ne; ++i) O.row(q[static_cast<std::size_t>(i)]) = Oe.row(i);
  });
  lm_matrix<C> Umix = lm_matrix<C>::Zero(T_, l);
  for (index_t t = 0; t < T_; ++t)
    for (index_t r = 0; r < k; ++r) Umix.row(t) += p[static_cast<std::size_t>(t * k + r)] * O.row(t * k + r);
  O.resize(0, 0);  // the expert outputs are not kept
  std::vector<C> rstd(static_cast<std::size_t>(T_));
  lm_matrix<C> Nrm(T_, l), R(T_, l);
  for (index_t t = 0; t < T_; ++t) {
    C ms = 0;
    for (index_t j = 0; j < l; ++j) ms += Umix(t, j) * Umix(t, j);
    ms /= static_cast<C>(l);
    C const rs = C(1) / std::sqrt(ms + static_cast<C>(o.eps));
    rstd[static_cast<std::size_t>(t)] = rs;
    for (index_t j = 0; j < l; ++j) {
      Nrm(t, j) = Umix(t, j) * rs;
      R(t, j) = Nrm(t, j) * nw[static_cast<std::size_t>(j)];
    }
  }
  lm_matrix<C> Y = R * Wup.transpose();
  std::vector<lm_matrix<C>> shared_a, shared_dg, shared_du;
  for (index_t j = 0; j < m.s; ++j) {
    lm_matrix<C> own_g, own_u, own_dn;
    lm_cmap<C> const Wsg = lm_map(a.ws_gate.slice(0, j), own_g), Wsu = lm_map(a.ws_up.slice(0, j), own_u), Wsd = lm_map(a.ws_down.slice(0, j), own_dn);
    lm_matrix<C> Hg = X * Wsg.transpose(), Hu = X * Wsu.transpose(), As, Dg, Du;
    lm_situ<C>(Hg, Hu, sp, As, grad ? &Dg : nullptr, grad ? &Du : nullptr);
    Y.noalias() += As * Wsd.transpose();
    if (grad) {
      shared_a.push_back(std::move(As));
      shared_dg.push_back(std::move(Dg));
      shared_du.push_back(std::move(Du));
    }
  }
  using S_ = std::remove_const_t<T>;
  if (lm_present(a.y)) lm_store(Y, a.y);
  for (index_t t = 0; t < T_; ++t)
    for (index_t r = 0; r < k; ++r) {
      if (lm_present(a.indices)) a.indices(t, r) = idx[static_cast<std::size_t>(t * k + r)];
      if (lm_present(a.weights)) a.weights(t, r) = store_as<S_>(p[static_cast<std::size_t>(t * k + r)]);
    }
  if (!grad) return;

  // Backward.
  lm_matrix<C> const DY = lm_load<C>(grad->dy);
  if (lm_present(grad->dw_up)) lm_assign<C>(grad->dw_up, DY.transpose() * R);
  lm_matrix<C> const DR = DY * Wup;
  lm_matrix<C> DU(T_, l);
  std::vector<C> dnw(static_cast<std::size_t>(l), C(0));
  for (index_t t = 0; t < T_; ++t) {
    C dot = 0;
    for (index_t j = 0; j < l; ++j) {
      C const dn = DR(t, j) * nw[static_cast<std::size_t>(j)];
      dnw[static_cast<std::size_t>(j)] += DR(t, j) * Nrm(t, j);
      dot += dn * Nrm(t, j);
    }
    dot /= static_cast<C>(l);
    C const rs = rstd[static_cast<std::size_t>(t)];
    for (index_t j = 0; j < l; ++j) DU(t, j) = rs * (DR(t, j) * nw[static_cast<std::size_t>(j)] - Nrm(t, j) * dot);
  }
  if (lm_present(grad->dnorm_weight))
    for (index_t j = 0; j < l; ++j) grad->dnorm_weight(j) = store_as<S_>(dnw[static_cast<std::size_t>(j)]);

  lm_matrix<C> DZslot(T_ * k, l);
  std::vector<C> dp(static_cast<std::size_t>(T_ * k), C(0));
  bool const want_we = lm_present(grad->dwe_gate) || lm_present(grad->dwe_up) || lm_present(grad->dwe_down);
  b.for_each(0, n, [&](std::int64_t e) {
    auto const& q = slots[static_cast<std::size_t>(e)];
    index_t const ne = static_cast<index_t>(q.size());
    lm_matrix<C> own_g, own_u, own_dn;
    lm_cmap<C> const Wg = lm_map(a.we_gate.slice(0, e), own_g), Wu = lm_map(a.we_up.slice(0, e), own_u), Wdn = lm_map(a.we_down.slice(0, e), own_dn);
    lm_matrix<C> Ze(ne, l), DUe(ne, l);
    std::vector<C> pe(static_cast<std::size_t>(ne));
    for (index_t i = 0; i < ne; ++i) {
      index_t const slot = q[static_cast<std::size_t>(i)];
      Ze.row(i) = Z.row(slot / k);
      DUe.row(i) = DU.row(slot / k);
      pe[static_cast<std::size_t>(i)] = p[static_cast<std::size_t>(slot)];
    }
    lm_matrix<C> G = Ze * Wg.transpose(), U = Ze * Wu.transpose(), A, Dg, Du;
    lm_situ<C>(G, U, sp, A, &Dg, &Du);
    lm_matrix<C> const DAp = DUe * Wdn;  // we_down[e]ᵀ du_t per slot, [ne, f]
    lm_matrix<C> PDU = DUe, DG(ne, m.f), DUp(ne, m.f);
    for (index_t i = 0; i < ne; ++i) {
      dp[static_cast<std::size_t>(q[static_cast<std::size_t>(i)])] = DAp.row(i).dot(A.row(i));
      PDU.row(i) *= pe[static_cast<std::size_t>(i)];
      for (index_t c = 0; c < m.f; ++c) {
        C const da = pe[static_cast<std::size_t>(i)] * DAp(i, c);
        DG(i, c) = da * Dg(i, c);
        DUp(i, c) = da * Du(i, c);
      }
    }
    if (want_we) {
      if (lm_present(grad->dwe_down)) lm_assign<C>(grad->dwe_down.slice(0, e), PDU.transpose() * A);
      if (lm_present(grad->dwe_gate)) lm_assign<C>(grad->dwe_gate.slice(0, e), DG.transpose() * Ze);
      if (lm_present(grad->dwe_up)) lm_assign<C>(grad->dwe_up.slice(0, e), DUp.transpose() * Ze);
    }
    lm_matrix<C> const DZe = DG * Wg + DUp * Wu;
    for (index_t i = 0; i < ne; ++i) DZslot.row(q[static_cast<std::size_t>(i)]) = DZe.row(i);
  });
  lm_matrix<C> DZ = lm_matrix<C>::Zero(T_, l);
  for (index_t t = 0; t < T_; ++t)
    for (index_t r = 0; r < k; ++r) DZ.row(t) += DZslot.row(t * k + r);
  // Router: p -> s (renormalisation and scale) -> logits (sigmoid); the bias gets nothing.
  lm_matrix<C> DL = lm_matrix<C>::Zero(T_, n);
  C const sc = static_cast<C>(o.scale);
  for (index_t t = 0; t < T_; ++t) {
    C const dn = denom[static_cast<std::size_t>(t)];
    C acc = 0;
    // ds_j = scale · (dp_j − Σ_r dp_r ŝ_r) / Σ with ŝ_r = s_r / Σ: exactly 0 for k = 1, where p is the constant scale.
    for (index_t r = 0; r < k; ++r) acc += dp[static_cast<std::size_t>(t * k + r)] * (S(t, idx[static_cast<std::size_t>(t * k + r)]) / dn);
    bool const zero_sum = zero_sums[static_cast<std::size_t>(t)] != 0;
    for (index_t r = 0; r < k; ++r) {
      index_t const e = idx[static_cast<std::size_t>(t * k + r)];
      // With all chosen scores 0 the sum is taken as 1: p = scale·s, no renormalisation term.
      C const ds = zero_sum ? sc * dp[static_cast<std::size_t>(t * k + r)] : sc * (dp[static_cast<std::size_t>(t * k + r)] - acc) / dn;
      DL(t, e) = ds * S(t, e) * (C(1) - S(t, e));
    }
  }
  if (lm_present(grad->dw_router)) lm_assign<C>(grad->dw_router, DL.transpose() * X);
  if (lm_present(grad->dw_down)) lm_assign<C>(grad->dw_down, DZ.transpose() * X);
  lm_matrix<C> DX = DZ * Wd + DL * Wr;
  for (index_t j = 0; j < m.s; ++j) {
    lm_matrix<C> own_g, own_u, own_dn;
    lm_cmap<C> const Wsg = lm_map(a.ws_gate.slice(0, j), own_g), Wsu = lm_map(a.ws_up.slice(0, j), own_u), Wsd = lm_map(a.ws_down.slice(0, j), own_dn);
    lm_matrix<C> const DAs = DY * Wsd;
    if (lm_present(grad->dws_down)) lm_assign<C>(grad->dws_down.slice(0, j), DY.transpose() * shared_a[static_cast<std::size_t>(j)]);
    lm_matrix<C> const DHg = DAs.cwiseProduct(shared_dg[static_cast<std::size_t>(j)]), DHu = DAs.cwiseProduct(shared_du[static_cast<std::size_t>(j)]);
    if (lm_present(grad->dws_gate)) lm_assign<C>(grad->dws_gate.slice(0, j), DHg.transpose() * X);
    if (lm_present(grad->dws_up)) lm_assign<C>(grad->dws_up.slice(0, j), DHu.transpose() * X);
    DX.noalias() += DHg * Wsg + DHu * Wsu;
  }
  if (lm_present(grad->dx)) lm_store(DX, grad->dx);
}

}  // namespace detail

// y, indices, weights (whichever views are given) of the layer.
template <HostBackend Bk, class T>
void latent_moe_forward(Bk const& b, latent_moe_args<T> const& a, latent_moe_options const& o = {}) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16>,
                "latent_moe: storage must be float, double or k3::bfloat16");
  detail::lm_dims const m = detail::check_latent_moe(a, o);
  detail::latent_moe_run<detail::lm_compute_t<T>>(b, a, o, m, static_cast<latent_moe_gradients<T> const*>(nullptr));
}

// The forward's outputs (whichever are given) and every requested gradient, for dy.
template <HostBackend Bk, class T>
void latent_moe_backward(Bk const& b, latent_moe_args<T> const& a, latent_moe_gradients<T> const& g, latent_moe_options const& o = {}) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16>,
                "latent_moe: storage must be float, double or k3::bfloat16");
  detail::lm_dims const m = detail::check_latent_moe(a, o);
  ::k3::detail::check_view("dy", g.dy);
  ::k3::detail::check_shape("dy", g.dy, {m.T, m.d});
  detail::lm_check_finite("dy", g.dy);
  detail::lm_check_out("dx", g.dx, {m.T, m.d});
  detail::lm_check_out("dw_router", g.dw_router, {m.n, m.d});
  detail::lm_check_out("dw_down", g.dw_down, {m.l, m.d});
  detail::lm_check_out("dwe_gate", g.dwe_gate, {m.n, m.f, m.l});
  detail::lm_check_out("dwe_up", g.dwe_up, {m.n, m.f, m.l});
  detail::lm_check_out("dwe_down", g.dwe_down, {m.n, m.l, m.f});
  detail::lm_check_out("dnorm_weight", g.dnorm_weight, {m.l});
  detail::lm_check_out("dw_up", g.dw_up, {m.d, m.l});
  detail::lm_check_out("dws_gate", g.dws_gate, {m.s, m.F, m.d});
  detail::lm_check_out("dws_up", g.dws_up, {m.s, m.F, m.d});
  detail::lm_check_out("dws_down", g.dws_down, {m.s, m.d, m.F});
  detail::latent_moe_run<detail::lm_compute_t<T>>(b, a, o, m, &g);
}

}  // namespace k3::moe
