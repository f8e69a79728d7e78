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
// latent_moe_backward(backend, latent_moe_backward_args<T>{.forward = args, .gradients = {dy, ...}},
// options). Storage float,
// double or k3::bfloat16; float and bfloat16 compute in float32 (every intermediate: s, z, a, u,
// r), double in double. The experts run as grouped GEMMs (Eigen) over the tokens routed to each,
// one expert per task on the backend's threads; every sum over tokens or slots runs in a fixed
// order, so the results do not depend on the thread count.
//
// The backward holds the selection fixed (the bias gets no gradient: Quantile Balancing owns
// it). It uses the rewrite of C.2: the router-probability gradient is <we_down[e]ᵀ du_t, a_te>,
// from the activation recomputed from the saved pre-activations; no expert output and no
// dispatched copy is kept (args.saved holds z, h_g, h_u, the routing and the normalised u; see
// latent_moe_saved). A selected expert with p = 0 keeps its id and gets its gradient.
//
// Non-finite input the step reads (x, dy or a weight) is a k3::error naming the argument and
// the position: routing cannot rank NaN scores, and one NaN token would reach every expert's
// weight gradient. The routed experts' weights are checked through what they produce (an
// expert no token reaches is not read), which spares a pass over the largest tensors.
#pragma once
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
#include "k3/moe/grouped_ffn.hpp"
#include "k3/moe/situ.hpp"

namespace k3::moe {

struct latent_moe_options {
  index_t k = 16;
  double scale = 1.0;
  double eps = 1e-6;
  double beta_gate = 4.0, beta_up = 25.0;
};

template <class T>
class latent_moe_saved;

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
  // What the forward keeps for the backward (optional): latent_moe_forward fills it, and
  // latent_moe_backward given a filled one skips the forward (see latent_moe_saved).
  latent_moe_saved<T>* saved = nullptr;
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

// The backward's one aggregate: the forward's args (weights, and saved when the forward filled
// it) and the gradients.
template <class T>
struct latent_moe_backward_args {
  latent_moe_args<T> forward;
  latent_moe_gradients<T> gradients;
};

namespace detail {

template <class C>
using lm_matrix = Eigen::Matrix<C, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

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
void lm_check_finite_slow(char const* name, V const& v) {
  if constexpr (V::rank() == 1) {
    for (index_t i = 0; i < v.extent(0); ++i)
      ::k3::detail::require(std::isfinite(load_as<double>(v(i))), error_kind::value, [&] {
        return std::string("argument '") + name + "': non-finite value at [" + std::to_string(i) + "]";
      });
  } else if constexpr (V::rank() == 2) {
    for (index_t i = 0; i < v.extent(0); ++i)
      for (index_t j = 0; j < v.extent(1); ++j)
        ::k3::detail::require(std::isfinite(load_as<double>(v(i, j))), error_kind::value, [&] {
          return std::string("argument '") + name + "': non-finite value at [" + std::to_string(i) + ", " + std::to_string(j) + "]" +
                 (std::string(name) == "x" || std::string(name) == "dy" ? " (token " + std::to_string(i) + ")" : "");
        });
  } else {
    for (index_t e = 0; e < v.extent(0); ++e)
      for (index_t i = 0; i < v.extent(1); ++i)
        for (index_t j = 0; j < v.extent(2); ++j)
          ::k3::detail::require(std::isfinite(load_as<double>(v(e, i, j))), error_kind::value, [&] {
            return std::string("argument '") + name + "': non-finite value at [" + std::to_string(e) + ", " + std::to_string(i) + ", " +
                   std::to_string(j) + "]";
          });
  }
}

// True when none of p[0, n) is NaN or Inf: a test of the exponent bits that the compiler
// vectorises, so checking every weight costs one read of it.
template <class E>
bool lm_all_finite(E const* p, index_t n) noexcept {
  if constexpr (std::is_same_v<E, float> || std::is_same_v<E, double> || std::is_same_v<E, bfloat16>) {
    using W = std::conditional_t<std::is_same_v<E, double>, std::uint64_t, std::conditional_t<std::is_same_v<E, float>, std::uint32_t, std::uint16_t>>;
    constexpr W mask = std::is_same_v<E, double> ? W(0x7ff0000000000000ull) : std::is_same_v<E, float> ? W(0x7f800000u) : W(0x7f80u);
    unsigned bad = 0;
    for (index_t i = 0; i < n; ++i) {
      W w;
      std::memcpy(&w, p + i, sizeof(W));
      bad |= static_cast<unsigned>((w & mask) == mask);
    }
    return bad == 0;
  } else {
    for (index_t i = 0; i < n; ++i)
      if (!std::isfinite(load_as<double>(p[i]))) return false;
    return true;
  }
}

template <class V>
bool lm_row_finite(V const& v, index_t i) noexcept {
  if (v.extent(1) <= 1 || v.stride(1) == 1) return lm_all_finite(v.data_handle() + i * v.stride(0), v.extent(1));
  for (index_t j = 0; j < v.extent(1); ++j)
    if (!std::isfinite(load_as<double>(v(i, j)))) return false;
  return true;
}

template <class V>
bool lm_rows_finite(V const& v, index_t r0, index_t r1) noexcept {
  for (index_t i = r0; i < r1; ++i)
    if (!lm_row_finite(v, i)) return false;
  return true;
}

// A k3::error naming the argument and the first non-finite position, if v holds one; matrices
// (or the slices of a stack) are checked on the backend's threads.
template <HostBackend Bk, class V>
void lm_check_finite(Bk const& b, char const* name, V const& v) {
  if constexpr (V::rank() == 1) {
    lm_check_finite_slow(name, v);
  } else {
    bool const stack = V::rank() == 3;
    index_t const parts = stack ? v.extent(0) : (v.extent(0) + 255) / 256;
    std::vector<unsigned char> bad(static_cast<std::size_t>(parts), 0);
    b.for_each(0, parts, [&](std::int64_t i) {
      index_t const r = static_cast<index_t>(i);
      if constexpr (V::rank() == 3) {
        auto const m = v.slice(0, r);
        bad[static_cast<std::size_t>(i)] = !lm_rows_finite(m, 0, m.extent(0));
      } else {
        bad[static_cast<std::size_t>(i)] = !lm_rows_finite(v, r * 256, std::min<index_t>(v.extent(0), (r + 1) * 256));
      }
    });
    if (std::find(bad.begin(), bad.end(), 1) != bad.end()) lm_check_finite_slow(name, v);
  }
}

template <class V>
void lm_check_out(char const* name, V const& v, std::initializer_list<index_t> shape) {
  if (v.data_handle() == nullptr && v.size() == 0 && v.extent(0) == 0) return;  // not requested
  ::k3::detail::check_view(name, v);
  ::k3::detail::check_shape(name, v, shape);
  ::k3::detail::check_not_broadcast(name, v);
}


struct lm_dims {
  index_t T, d, n, l, f, s, F;
};

// The shapes of the layer's arguments; `experts_held` is how many experts' weights we_* hold
// (all n, or one rank's share under expert parallelism).
template <HostBackend Bk, class T>
// The routed experts' weights are checked for NaN and Inf here only with check_experts; the
// single-process layer instead checks what they produce, expert by expert (lm_expert_finite),
// which costs no extra pass over the largest tensors of the layer.
lm_dims check_latent_moe(Bk const& b, latent_moe_args<T> const& a, latent_moe_options const& o, index_t experts_held = -1, bool check_experts = true) {
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
  index_t const held = experts_held < 0 ? m.n : experts_held;
  ::k3::detail::check_shape("we_gate", a.we_gate, {held, any_extent, m.l});
  m.f = a.we_gate.extent(1);
  ::k3::detail::check_shape("we_up", a.we_up, {held, m.f, m.l});
  ::k3::detail::check_shape("we_down", a.we_down, {held, m.l, m.f});
  ::k3::detail::check_shape("w_up", a.w_up, {m.d, m.l});
  if (k3::present(a.bias)) ::k3::detail::check_shape("bias", a.bias, {m.n});
  if (k3::present(a.norm_weight)) ::k3::detail::check_shape("norm_weight", a.norm_weight, {m.l});
  bool const sg = k3::present(a.ws_gate), su = k3::present(a.ws_up), sd = k3::present(a.ws_down);
  ::k3::detail::require(sg == su && su == sd, error_kind::value, "arguments 'ws_gate', 'ws_up', 'ws_down': the shared experts need all three or none");
  if (sg) {
    m.s = a.ws_gate.extent(0);
    m.F = a.ws_gate.extent(1);
    ::k3::detail::check_shape("ws_gate", a.ws_gate, {m.s, m.F, m.d});
    ::k3::detail::check_shape("ws_up", a.ws_up, {m.s, m.F, m.d});
    ::k3::detail::check_shape("ws_down", a.ws_down, {m.s, m.d, m.F});
  }
  ::k3::detail::require(o.k >= 1 && o.k <= m.n, error_kind::value, [&] {
    return "option 'k': expected 1 <= k <= n = " + std::to_string(m.n) + " experts, got " + std::to_string(o.k);
  });
  ::k3::detail::require(std::isfinite(o.scale), error_kind::value, "option 'scale': must be finite");
  ::k3::detail::require(std::isfinite(o.eps) && o.eps > 0, error_kind::value, [&] { return "option 'eps': expected a finite value > 0, got " + ::k3::detail::format_number(o.eps); });
  ::k3::detail::require(std::isfinite(o.beta_gate) && o.beta_gate > 0 && std::isfinite(o.beta_up) && o.beta_up > 0, error_kind::value,
                        "options 'beta_gate', 'beta_up': expected finite values > 0");
  lm_check_out("y", a.y, {m.T, m.d});
  lm_check_out("indices", a.indices, {m.T, o.k});
  lm_check_out("weights", a.weights, {m.T, o.k});
  // Every present weight and input finite, in this order (the first bad one is named).
  auto finite = [&](char const* name, auto const& v) {
    if (k3::present(v)) lm_check_finite(b, name, v);
  };
  ::k3::detail::named_views("x", a.x, "w_router", a.w_router, "bias", a.bias, "w_down", a.w_down)(finite);
  if (check_experts) ::k3::detail::named_views("we_gate", a.we_gate, "we_up", a.we_up, "we_down", a.we_down)(finite);
  ::k3::detail::named_views("norm_weight", a.norm_weight, "w_up", a.w_up)(finite);
  if (sg) ::k3::detail::named_views("ws_gate", a.ws_gate, "ws_up", a.ws_up, "ws_down", a.ws_down)(finite);
  return m;
}

// Runs f(c0, nc) over fixed panels of 256 of [0, n) on the backend's threads. Every panel has
// the same shape whatever the thread count, so each element of a product split this way is
// computed the same way on every backend; a panel of output columns (or of weight-gradient
// rows) keeps every GEMM at the full token count, where splitting the tokens would repack the
// whole weight once per part.
template <HostBackend Bk, class F>
void lm_panels(Bk const& b, index_t n, F&& f) {
  constexpr index_t panel = 256;
  index_t const parts = (n + panel - 1) / panel;
  b.for_each(0, parts, [&](std::int64_t i) {
    index_t const c0 = static_cast<index_t>(i) * panel;
    f(c0, std::min(panel, n - c0));
  });
}

// v = a product computed by panels: f(out, c0, nc) writes rows [c0, c0 + nc) of `out` (which
// has v's shape); straight into v when it holds the compute type with contiguous rows.
template <class C, HostBackend Bk, class V, class F>
void lm_assign_rows(Bk const& b, V const& v, F&& f) {
  using E = std::remove_const_t<typename V::element_type>;
  index_t const rows = v.extent(0), cols = v.extent(1);
  if constexpr (std::is_same_v<E, C>) {
    if (cols <= 1 || v.stride(1) == 1) {
      Eigen::Map<lm_matrix<C>, Eigen::Unaligned, Eigen::OuterStride<>> out(v.data_handle(), rows, cols,
                                                                             Eigen::OuterStride<>(std::max<index_t>(v.stride(0), cols)));
      lm_panels(b, rows, [&](index_t c0, index_t nc) { f(out, c0, nc); });
      return;
    }
  }
  lm_matrix<C> out(rows, cols);
  lm_panels(b, rows, [&](index_t c0, index_t nc) { f(out, c0, nc); });
  lm_store(out, v);
}

// SiTU of two matrices, row by row, and (with dg, du) its partial derivatives. In float the
// rows run on Eigen's vectorised tanh and exp, in forms that keep their relative precision in
// the tails: sech²(z) = 4e/(1+e)² with e = exp(-2|z|), and sigma(-g) evaluated as itself, not as
// 1 - sigma(g). In double every element goes through the scalar situ_glu / situ_glu_partials.
template <class C, class G, class U, class A, class DG, class DU>
void lm_situ(G const& g, U const& u, situ_params<C> const& sp, A&& a, DG* dg, DU* du) {
  Eigen::Index const rows = g.rows(), cols = g.cols();
  if constexpr (std::is_same_v<C, float>) {
    using row_t = Eigen::Array<C, 1, Eigen::Dynamic>;
    row_t cg(cols), sg(cols), cu(cols), sn(cols), t1(cols);
    C const b1 = sp.beta1, b2 = sp.beta2;
    for (Eigen::Index i = 0; i < rows; ++i) {
      auto const gi = g.row(i).array();
      auto const ui = u.row(i).array();
      cg = b1 * (gi / b1).tanh();
      sg = (C(1) + (-gi).exp()).inverse();
      cu = b2 * (ui / b2).tanh();
      a.row(i).array() = cg * sg * cu;
      if (dg) {
        sn = (C(1) + gi.exp()).inverse();
        t1 = (C(-2) / b1 * gi.abs()).exp();
        dg->row(i).array() = (C(4) * t1 / (C(1) + t1).square() + cg * sn) * sg * cu;
        t1 = (C(-2) / b2 * ui.abs()).exp();
        du->row(i).array() = cg * sg * (C(4) * t1 / (C(1) + t1).square());
      }
    }
  } else {
    for (Eigen::Index i = 0; i < rows; ++i)
      for (Eigen::Index j = 0; j < cols; ++j) {
        if (dg) {
          situ_partials<C> const r = situ_glu_partials(g(i, j), u(i, j), sp);
          a(i, j) = r.value;
          (*dg)(i, j) = r.d_gate;
          (*du)(i, j) = r.d_up;
        } else {
          a(i, j) = situ_glu(g(i, j), u(i, j), sp);
        }
      }
  }
}

// One expert on the ne tokens it was dispatched (the rows of Ze): its pre-activations into G
// and U, its outputs a·we_downᵀ into Oe. The single-process and the expert-parallel layer both
// run their experts through this and lm_expert_backward.
template <class C, class ZE, class GM, class UM, class WM>
void lm_expert_forward(ZE const& Ze, WM const& Wg, WM const& Wu, WM const& Wdn, situ_params<C> const& sp, GM&& G, UM&& U, lm_matrix<C>& Oe) {
  G.noalias() = Ze * Wg.transpose();
  U.noalias() = Ze * Wu.transpose();
  lm_matrix<C> A(Ze.rows(), Wg.rows());
  lm_situ<C>(G, U, sp, A, static_cast<lm_matrix<C>*>(nullptr), static_cast<lm_matrix<C>*>(nullptr));
  Oe.noalias() = A * Wdn.transpose();
}

// Its backward (spec C.2): from du of its tokens (DUe, scaled by p here) and their p, with a
// recomputed from the saved pre-activations Hg, Hu: dp = <we_down du, a> (no expert output
// needed), dz of every token (DZe), and the weight gradients into the views that are given (an
// expert with no token gets zeros).
template <class C, class ZE, class HG, class HU, class WM, class VG, class VU, class VD>
void lm_expert_backward(ZE const& Ze, lm_matrix<C>& DUe, C const* pe, HG const& Hg, HU const& Hu, WM const& Wg, WM const& Wu, WM const& Wdn,
                        situ_params<C> const& sp, C* dp, lm_matrix<C>& DZe, VG const& dwe_gate, VU const& dwe_up, VD const& dwe_down) {
  Eigen::Index const ne = Ze.rows(), f = Wg.rows();
  lm_matrix<C> A(ne, f), Dg(ne, f), Du(ne, f);
  lm_situ<C>(Hg, Hu, sp, A, &Dg, &Du);
  lm_matrix<C> DA = DUe * Wdn;  // we_down[e]ᵀ du_t per token, [ne, f]
  for (Eigen::Index i = 0; i < ne; ++i) {
    dp[i] = DA.row(i).dot(A.row(i));
    DUe.row(i) *= pe[i];
    DA.row(i) *= pe[i];
  }
  Dg.array() *= DA.array();  // dL/dh_g
  Du.array() *= DA.array();  // dL/dh_u
  if (k3::present(dwe_down)) lm_assign<C>(dwe_down, DUe.transpose() * A);
  if (k3::present(dwe_gate)) lm_assign<C>(dwe_gate, Dg.transpose() * Ze);
  if (k3::present(dwe_up)) lm_assign<C>(dwe_up, Du.transpose() * Ze);
  DZe.resize(ne, Wg.cols());
  if (ne == 0) return;
  DZe.noalias() = Dg * Wg;
  DZe.noalias() += Du * Wu;
}

// What the forward keeps for the backward, in the compute type: the routing (ids, p, the
// chosen scores and their sum), z (the latent input of every expert, re-dispatched by the
// backward), every slot's pre-activations h_g, h_u (rows grouped by expert), the normalised u
// and its 1/rms, and the shared experts' pre-activations. No expert output and no dispatched
// copy of z is kept: 2·k·l values per token fewer than the naive layer (spec C.2).
template <class C>
struct lm_state {
  lm_dims m{};
  latent_moe_options o{};
  bool filled = false;
  std::vector<index_t> idx;         // [T·k] expert of slot t·k + r
  std::vector<C> p, ssel, denom;    // [T·k] p, [T·k] s of the chosen experts, [T] their sum (1 when 0)
  std::vector<unsigned char> zero_sum;  // [T] all chosen scores 0
  std::vector<index_t> offs, slot;  // [n + 1] first row of each expert; [T·k] slot of each row
  lm_matrix<C> Z, Hg, Hu, Nrm;      // [T, l]; [T·k, f] twice; [T, l]
  std::vector<C> rstd;              // [T]
  std::vector<lm_matrix<C>> sHg, sHu;  // [s] x [T, F]

  std::size_t bytes() const noexcept {
    auto mb = [](lm_matrix<C> const& x) { return static_cast<std::size_t>(x.size()) * sizeof(C); };
    std::size_t n = idx.size() * sizeof(index_t) + (p.size() + ssel.size() + denom.size() + rstd.size()) * sizeof(C) + zero_sum.size() +
                    (offs.size() + slot.size()) * sizeof(index_t) + mb(Z) + mb(Hg) + mb(Hu) + mb(Nrm);
    for (auto const& x : sHg) n += mb(x);
    for (auto const& x : sHu) n += mb(x);
    return n;
  }
};

template <class C>
bool lm_same_options(latent_moe_options const& a, latent_moe_options const& b) {
  return a.k == b.k && a.scale == b.scale && a.eps == b.eps && a.beta_gate == b.beta_gate && a.beta_up == b.beta_up;
}

// The error for expert e whose pre-activations or outputs are not finite: the weight holding
// the first NaN or Inf, or (all finite) an overflow.
template <class T>
[[noreturn]] void lm_expert_error(latent_moe_args<T> const& a, index_t e) {
  auto one = [&](char const* name, auto const& v) {
    auto const m = v.slice(0, e);
    for (index_t i = 0; i < m.extent(0); ++i)
      for (index_t j = 0; j < m.extent(1); ++j)
        ::k3::detail::require(std::isfinite(load_as<double>(m(i, j))), error_kind::value, [&] {
          return std::string("argument '") + name + "': non-finite value at [" + std::to_string(e) + ", " + std::to_string(i) + ", " +
                 std::to_string(j) + "]";
        });
  };
  one("we_gate", a.we_gate);
  one("we_up", a.we_up);
  one("we_down", a.we_down);
  throw k3::error(error_kind::value, "latent_moe: expert " + std::to_string(e) + " overflowed (its pre-activations or outputs are not finite for finite inputs)");
}

// The experts of the single-process layer: slots grouped by expert (each expert's in token
// order), every expert on its tokens as one task, h_g and h_u kept in st, the outputs per slot
// into O.
template <class C, HostBackend Bk, class T>
void lm_local_experts_forward(Bk const& b, latent_moe_args<T> const& a, lm_state<C>& st, lm_matrix<C>& O) {
  index_t const T_ = st.m.T, k = st.o.k, n = st.m.n, l = st.m.l, f = st.m.f;
  situ_params<C> const sp{static_cast<C>(st.o.beta_gate), static_cast<C>(st.o.beta_up)};
  std::size_t const slots = static_cast<std::size_t>(T_ * k);
  // Rows grouped by expert, each expert's slots in token order (a counting sort).
  st.offs.assign(static_cast<std::size_t>(n + 1), 0);
  for (std::size_t q = 0; q < slots; ++q) ++st.offs[static_cast<std::size_t>(st.idx[q] + 1)];
  for (index_t e = 0; e < n; ++e) st.offs[static_cast<std::size_t>(e + 1)] += st.offs[static_cast<std::size_t>(e)];
  st.slot.assign(slots, 0);
  {
    std::vector<index_t> fill(st.offs.begin(), st.offs.end() - 1);
    for (std::size_t q = 0; q < slots; ++q) st.slot[static_cast<std::size_t>(fill[static_cast<std::size_t>(st.idx[q])]++)] = static_cast<index_t>(q);
  }

  // Every expert on its tokens: h_g, h_u into the state, the outputs per slot into O. A NaN or
  // Inf in the weights of an expert that has tokens reaches its h_g, h_u or outputs (x and z
  // are finite), so those are checked instead of every weight.
  std::vector<unsigned char> bad(static_cast<std::size_t>(n), 0);
  st.Hg.resize(static_cast<Eigen::Index>(slots), f);
  st.Hu.resize(static_cast<Eigen::Index>(slots), f);
  b.for_each(0, n, [&](std::int64_t e) {
    index_t const r0 = st.offs[static_cast<std::size_t>(e)], ne = st.offs[static_cast<std::size_t>(e + 1)] - r0;
    if (ne == 0) return;
    lm_matrix<C> Ze(ne, l);
    for (index_t i = 0; i < ne; ++i) Ze.row(i) = st.Z.row(st.slot[static_cast<std::size_t>(r0 + i)] / k);
    lm_matrix<C> own_g, own_u, own_dn;
    lm_cmap<C> const Wg = lm_map(a.we_gate.slice(0, e), own_g), Wu = lm_map(a.we_up.slice(0, e), own_u), Wdn = lm_map(a.we_down.slice(0, e), own_dn);
    lm_matrix<C> Oe;
    lm_expert_forward<C>(Ze, Wg, Wu, Wdn, sp, st.Hg.middleRows(r0, ne), st.Hu.middleRows(r0, ne), Oe);
    bad[static_cast<std::size_t>(e)] = !lm_all_finite(st.Hg.row(r0).data(), ne * f) || !lm_all_finite(st.Hu.row(r0).data(), ne * f) ||
                                       !lm_all_finite(Oe.data(), ne * l);
    for (index_t i = 0; i < ne; ++i) O.row(st.slot[static_cast<std::size_t>(r0 + i)]) = Oe.row(i);
  });
  auto const first = std::find(bad.begin(), bad.end(), 1);
  if (first != bad.end()) lm_expert_error(a, static_cast<index_t>(first - bad.begin()));
}

// The forward: fills st and writes the outputs that are given; experts(st, O) writes every
// slot's expert output into O [T·k, l].
template <class C, HostBackend Bk, class T, class Experts>
void lm_forward(Bk const& b, latent_moe_args<T> const& a, latent_moe_options const& o, lm_dims const& m, lm_state<C>& st, Experts&& experts) {
  index_t const T_ = m.T, k = o.k, n = m.n, l = m.l;
  situ_params<C> const sp{static_cast<C>(o.beta_gate), static_cast<C>(o.beta_up)};
  st.m = m;
  st.o = o;
  st.filled = false;
  lm_matrix<C> own_x, own_wr, own_wd, own_wup;
  lm_cmap<C> const X = lm_map(a.x, own_x), Wr = lm_map(a.w_router, own_wr), Wd = lm_map(a.w_down, own_wd), Wup = lm_map(a.w_up, own_wup);
  std::vector<C> bias(static_cast<std::size_t>(n), C(0)), nw(static_cast<std::size_t>(l), C(1));
  if (k3::present(a.bias))
    for (index_t e = 0; e < n; ++e) bias[static_cast<std::size_t>(e)] = load_as<C>(a.bias(e));
  if (k3::present(a.norm_weight))
    for (index_t j = 0; j < l; ++j) nw[static_cast<std::size_t>(j)] = load_as<C>(a.norm_weight(j));

  // Routing: scores by panels of experts, then each token's top-k.
  lm_matrix<C> S(T_, n);
  lm_panels(b, n, [&](index_t c0, index_t nc) {
    S.middleCols(c0, nc).noalias() = X * Wr.middleRows(c0, nc).transpose();
    for (index_t t = 0; t < T_; ++t)
      for (index_t e = c0; e < c0 + nc; ++e) S(t, e) = ::k3::detail::sigmoid(S(t, e));
  });
  std::size_t const slots = static_cast<std::size_t>(T_ * k);
  st.idx.assign(slots, 0);
  st.p.assign(slots, C(0));
  st.ssel.assign(slots, C(0));
  st.denom.assign(static_cast<std::size_t>(T_), C(1));
  st.zero_sum.assign(static_cast<std::size_t>(T_), 0);
  lm_panels(b, T_, [&](index_t t0, index_t nt) {
    std::vector<index_t> order(static_cast<std::size_t>(n));
    for (index_t t = t0; t < t0 + nt; ++t) {
      std::iota(order.begin(), order.end(), index_t(0));
      auto key = [&](index_t e) { return S(t, e) + bias[static_cast<std::size_t>(e)]; };
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](index_t x1, index_t x2) {
        C const v1 = key(x1), v2 = key(x2);
        return v1 > v2 || (v1 == v2 && x1 < x2);
      });
      C sum = 0;
      for (index_t r = 0; r < k; ++r) sum += S(t, order[static_cast<std::size_t>(r)]);
      C const dn = sum > C(0) ? sum : C(1);
      st.denom[static_cast<std::size_t>(t)] = dn;
      st.zero_sum[static_cast<std::size_t>(t)] = sum > C(0) ? 0 : 1;
      for (index_t r = 0; r < k; ++r) {
        index_t const e = order[static_cast<std::size_t>(r)];
        std::size_t const q = static_cast<std::size_t>(t * k + r);
        st.idx[q] = e;
        st.ssel[q] = S(t, e);
        st.p[q] = S(t, e) / dn * static_cast<C>(o.scale);
      }
    }
  });
  st.Z.resize(T_, l);
  lm_panels(b, l, [&](index_t c0, index_t nc) { st.Z.middleCols(c0, nc).noalias() = X * Wd.middleRows(c0, nc).transpose(); });

  // The experts: every slot's output, in slot order t·k + r.
  lm_matrix<C> O(static_cast<Eigen::Index>(slots), l);
  experts(st, O);
  // u, then the RMSNorm, per token (slots summed in rank order).
  st.Nrm.resize(T_, l);
  st.rstd.assign(static_cast<std::size_t>(T_), C(0));
  lm_matrix<C> R(T_, l);
  lm_panels(b, T_, [&](index_t t0, index_t nt) {
    for (index_t t = t0; t < t0 + nt; ++t) {
      auto u = st.Nrm.row(t);
      u.setZero();
      for (index_t r = 0; r < k; ++r) u += st.p[static_cast<std::size_t>(t * k + r)] * O.row(t * k + r);
      C ms = 0;
      for (index_t j = 0; j < l; ++j) ms += u(j) * u(j);
      ms /= static_cast<C>(l);
      C const rs = C(1) / std::sqrt(ms + static_cast<C>(o.eps));
      st.rstd[static_cast<std::size_t>(t)] = rs;
      for (index_t j = 0; j < l; ++j) {
        u(j) *= rs;
        R(t, j) = u(j) * nw[static_cast<std::size_t>(j)];
      }
    }
  });
  O.resize(0, 0);  // the expert outputs are not kept

  lm_matrix<C> Y(T_, m.d);
  lm_panels(b, m.d, [&](index_t c0, index_t nc) { Y.middleCols(c0, nc).noalias() = R * Wup.middleRows(c0, nc).transpose(); });
  st.sHg.resize(static_cast<std::size_t>(m.s));
  st.sHu.resize(static_cast<std::size_t>(m.s));
  for (index_t j = 0; j < m.s; ++j) {
    lm_matrix<C> own_g, own_u, own_dn;
    lm_cmap<C> const Wsg = lm_map(a.ws_gate.slice(0, j), own_g), Wsu = lm_map(a.ws_up.slice(0, j), own_u), Wsd = lm_map(a.ws_down.slice(0, j), own_dn);
    lm_matrix<C>& Hg = st.sHg[static_cast<std::size_t>(j)];
    lm_matrix<C>& Hu = st.sHu[static_cast<std::size_t>(j)];
    Hg.resize(T_, m.F);
    Hu.resize(T_, m.F);
    lm_matrix<C> As(T_, m.F);
    lm_panels(b, m.F, [&](index_t c0, index_t nc) {
      Hg.middleCols(c0, nc).noalias() = X * Wsg.middleRows(c0, nc).transpose();
      Hu.middleCols(c0, nc).noalias() = X * Wsu.middleRows(c0, nc).transpose();
    });
    lm_panels(b, T_, [&](index_t t0, index_t nt) {
      auto As_ = As.middleRows(t0, nt);
      lm_situ<C>(Hg.middleRows(t0, nt), Hu.middleRows(t0, nt), sp, As_, static_cast<lm_matrix<C>*>(nullptr), static_cast<lm_matrix<C>*>(nullptr));
    });
    lm_panels(b, m.d, [&](index_t c0, index_t nc) { Y.middleCols(c0, nc).noalias() += As * Wsd.middleRows(c0, nc).transpose(); });
  }
  using S_ = std::remove_const_t<T>;
  if (k3::present(a.y)) lm_store(Y, a.y);
  for (index_t t = 0; t < T_; ++t)
    for (index_t r = 0; r < k; ++r) {
      if (k3::present(a.indices)) a.indices(t, r) = st.idx[static_cast<std::size_t>(t * k + r)];
      if (k3::present(a.weights)) a.weights(t, r) = store_as<S_>(st.p[static_cast<std::size_t>(t * k + r)]);
    }
  st.filled = true;
}

// The experts' backward of the single-process layer: a recomputed from h_g, h_u;
// dp = <we_down[e]ᵀ du_t, a_te>; z re-dispatched from st.Z; every slot's dz into DZslot.
template <class C, HostBackend Bk, class T>
void lm_local_experts_backward(Bk const& b, latent_moe_args<T> const& a, latent_moe_gradients<T> const& grad, lm_state<C> const& st,
                               lm_matrix<C> const& DU, lm_matrix<C>& DZslot, std::vector<C>& dp) {
  index_t const k = st.o.k, n = st.m.n, l = st.m.l;
  situ_params<C> const sp{static_cast<C>(st.o.beta_gate), static_cast<C>(st.o.beta_up)};
  // The experts: a recomputed from h_g, h_u; dp = <we_down[e]ᵀ du_t, a_te>; z re-dispatched.
  b.for_each(0, n, [&](std::int64_t e) {
    index_t const r0 = st.offs[static_cast<std::size_t>(e)], ne = st.offs[static_cast<std::size_t>(e + 1)] - r0;
    lm_matrix<C> own_g, own_u, own_dn;
    lm_cmap<C> const Wg = lm_map(a.we_gate.slice(0, e), own_g), Wu = lm_map(a.we_up.slice(0, e), own_u), Wdn = lm_map(a.we_down.slice(0, e), own_dn);
    lm_matrix<C> Ze(ne, l), PDU(ne, l);
    for (index_t i = 0; i < ne; ++i) {
      index_t const q = st.slot[static_cast<std::size_t>(r0 + i)];
      Ze.row(i) = st.Z.row(q / k);
      PDU.row(i) = DU.row(q / k);
    }
    std::vector<C> pe(static_cast<std::size_t>(ne)), dpe(static_cast<std::size_t>(ne));
    for (index_t i = 0; i < ne; ++i) pe[static_cast<std::size_t>(i)] = st.p[static_cast<std::size_t>(st.slot[static_cast<std::size_t>(r0 + i)])];
    auto pick = [&](auto const& g3) { return k3::present(g3) ? g3.slice(0, e) : decltype(g3.slice(0, e)){}; };
    lm_matrix<C> DZe;
    lm_expert_backward<C>(Ze, PDU, pe.data(), st.Hg.middleRows(r0, ne), st.Hu.middleRows(r0, ne), Wg, Wu, Wdn, sp, dpe.data(), DZe,
                          pick(grad.dwe_gate), pick(grad.dwe_up), pick(grad.dwe_down));
    for (index_t i = 0; i < ne; ++i) {
      index_t const q = st.slot[static_cast<std::size_t>(r0 + i)];
      dp[static_cast<std::size_t>(q)] = dpe[static_cast<std::size_t>(i)];
      DZslot.row(q) = DZe.row(i);
    }
  });
}

// The backward from the forward's state; experts(st, DU, DZslot, dp) writes every slot's dz and
// dp (and the expert weight gradients).
template <class C, HostBackend Bk, class T, class Experts>
void lm_backward(Bk const& b, latent_moe_args<T> const& a, latent_moe_gradients<T> const& grad, lm_state<C> const& st, Experts&& experts) {
  lm_dims const& m = st.m;
  latent_moe_options const& o = st.o;
  index_t const T_ = m.T, k = o.k, n = m.n, l = m.l;
  situ_params<C> const sp{static_cast<C>(o.beta_gate), static_cast<C>(o.beta_up)};
  using S_ = std::remove_const_t<T>;
  lm_matrix<C> own_x, own_wr, own_wd, own_wup;
  lm_cmap<C> const X = lm_map(a.x, own_x), Wr = lm_map(a.w_router, own_wr), Wd = lm_map(a.w_down, own_wd), Wup = lm_map(a.w_up, own_wup);
  std::vector<C> nw(static_cast<std::size_t>(l), C(1));
  if (k3::present(a.norm_weight))
    for (index_t j = 0; j < l; ++j) nw[static_cast<std::size_t>(j)] = load_as<C>(a.norm_weight(j));
  lm_matrix<C> DYown;
  lm_cmap<C> const DY = lm_map(grad.dy, DYown);

  // y = r w_upᵀ: dw_up = dyᵀ r, dr = dy w_up, then back through the RMSNorm.
  lm_matrix<C> R(T_, l);
  for (index_t t = 0; t < T_; ++t)
    for (index_t j = 0; j < l; ++j) R(t, j) = st.Nrm(t, j) * nw[static_cast<std::size_t>(j)];
  if (k3::present(grad.dw_up))
    lm_assign_rows<C>(b, grad.dw_up, [&](auto& out, index_t c0, index_t nc) { out.middleRows(c0, nc).noalias() = DY.middleCols(c0, nc).transpose() * R; });
  lm_matrix<C> DR(T_, l);
  lm_panels(b, l, [&](index_t c0, index_t nc) { DR.middleCols(c0, nc).noalias() = DY * Wup.middleCols(c0, nc); });
  lm_matrix<C> DU(T_, l);
  lm_panels(b, T_, [&](index_t t0, index_t nt) {
    for (index_t t = t0; t < t0 + nt; ++t) {
      C dot = 0;
      for (index_t j = 0; j < l; ++j) dot += DR(t, j) * nw[static_cast<std::size_t>(j)] * st.Nrm(t, j);
      dot /= static_cast<C>(l);
      C const rs = st.rstd[static_cast<std::size_t>(t)];
      for (index_t j = 0; j < l; ++j) DU(t, j) = rs * (DR(t, j) * nw[static_cast<std::size_t>(j)] - st.Nrm(t, j) * dot);
    }
  });
  if (k3::present(grad.dnorm_weight))
    lm_panels(b, l, [&](index_t c0, index_t nc) {
      for (index_t j = c0; j < c0 + nc; ++j) {
        C s = 0;
        for (index_t t = 0; t < T_; ++t) s += DR(t, j) * st.Nrm(t, j);
        grad.dnorm_weight(j) = store_as<S_>(s);
      }
    });

  // The experts: every slot's dz (DZslot) and dp.
  std::size_t const slots = static_cast<std::size_t>(T_ * k);
  lm_matrix<C> DZslot(static_cast<Eigen::Index>(slots), l);
  std::vector<C> dp(slots, C(0));
  experts(st, DU, DZslot, dp);
  lm_matrix<C> DZ(T_, l);
  lm_panels(b, T_, [&](index_t t0, index_t nt) {
    for (index_t t = t0; t < t0 + nt; ++t) {
      DZ.row(t).setZero();
      for (index_t r = 0; r < k; ++r) DZ.row(t) += DZslot.row(t * k + r);
    }
  });
  DZslot.resize(0, 0);
  // Router: p -> s (renormalisation and scale) -> logits (sigmoid); the bias gets nothing.
  lm_matrix<C> DL = lm_matrix<C>::Zero(T_, n);
  C const sc = static_cast<C>(o.scale);
  for (index_t t = 0; t < T_; ++t) {
    C const dn = st.denom[static_cast<std::size_t>(t)];
    C acc = 0;
    // ds_j = scale · (dp_j − Σ_r dp_r ŝ_r) / Σ with ŝ_r = s_r / Σ: exactly 0 for k = 1, where p is the constant scale.
    for (index_t r = 0; r < k; ++r) acc += dp[static_cast<std::size_t>(t * k + r)] * (st.ssel[static_cast<std::size_t>(t * k + r)] / dn);
    bool const zero_sum = st.zero_sum[static_cast<std::size_t>(t)] != 0;
    for (index_t r = 0; r < k; ++r) {
      std::size_t const q = static_cast<std::size_t>(t * k + r);
      C const s = st.ssel[q];
      // With all chosen scores 0 the sum is taken as 1: p = scale·s, no renormalisation term.
      C const ds = zero_sum ? sc * dp[q] : sc * (dp[q] - acc) / dn;
      DL(t, st.idx[q]) = ds * s * (C(1) - s);
    }
  }
  if (k3::present(grad.dw_router))
    lm_assign_rows<C>(b, grad.dw_router, [&](auto& out, index_t c0, index_t nc) { out.middleRows(c0, nc).noalias() = DL.middleCols(c0, nc).transpose() * X; });
  if (k3::present(grad.dw_down))
    lm_assign_rows<C>(b, grad.dw_down, [&](auto& out, index_t c0, index_t nc) { out.middleRows(c0, nc).noalias() = DZ.middleCols(c0, nc).transpose() * X; });
  lm_matrix<C> DX(T_, m.d);
  lm_panels(b, m.d, [&](index_t c0, index_t nc) {
    DX.middleCols(c0, nc).noalias() = DZ * Wd.middleCols(c0, nc);
    DX.middleCols(c0, nc).noalias() += DL * Wr.middleCols(c0, nc);
  });
  for (index_t j = 0; j < m.s; ++j) {
    lm_matrix<C> own_g, own_u, own_dn;
    lm_cmap<C> const Wsg = lm_map(a.ws_gate.slice(0, j), own_g), Wsu = lm_map(a.ws_up.slice(0, j), own_u), Wsd = lm_map(a.ws_down.slice(0, j), own_dn);
    lm_matrix<C> As(T_, m.F), Dg(T_, m.F), Du(T_, m.F), DAs(T_, m.F);
    lm_panels(b, T_, [&](index_t t0, index_t nt) {
      auto As_ = As.middleRows(t0, nt);
      auto Dg_ = Dg.middleRows(t0, nt);
      auto Du_ = Du.middleRows(t0, nt);
      lm_situ<C>(st.sHg[static_cast<std::size_t>(j)].middleRows(t0, nt), st.sHu[static_cast<std::size_t>(j)].middleRows(t0, nt), sp, As_, &Dg_, &Du_);
    });
    lm_panels(b, m.F, [&](index_t c0, index_t nc) { DAs.middleCols(c0, nc).noalias() = DY * Wsd.middleCols(c0, nc); });
    if (k3::present(grad.dws_down))
      lm_assign_rows<C>(b, grad.dws_down.slice(0, j),
                        [&](auto& out, index_t c0, index_t nc) { out.middleRows(c0, nc).noalias() = DY.middleCols(c0, nc).transpose() * As; });
    Dg.array() *= DAs.array();
    Du.array() *= DAs.array();
    if (k3::present(grad.dws_gate))
      lm_assign_rows<C>(b, grad.dws_gate.slice(0, j),
                        [&](auto& out, index_t c0, index_t nc) { out.middleRows(c0, nc).noalias() = Dg.middleCols(c0, nc).transpose() * X; });
    if (k3::present(grad.dws_up))
      lm_assign_rows<C>(b, grad.dws_up.slice(0, j),
                        [&](auto& out, index_t c0, index_t nc) { out.middleRows(c0, nc).noalias() = Du.middleCols(c0, nc).transpose() * X; });
    lm_panels(b, m.d, [&](index_t c0, index_t nc) {
      DX.middleCols(c0, nc).noalias() += Dg * Wsg.middleCols(c0, nc);
      DX.middleCols(c0, nc).noalias() += Du * Wsu.middleCols(c0, nc);
    });
  }
  if (k3::present(grad.dx)) lm_store(DX, grad.dx);
}

template <HostBackend Bk, class T>
auto lm_local_forward_fn(Bk const& b, latent_moe_args<T> const& a) {
  return [&b, &a](auto& st, auto& O) { lm_local_experts_forward(b, a, st, O); };
}
template <HostBackend Bk, class T>
auto lm_local_backward_fn(Bk const& b, latent_moe_args<T> const& a, latent_moe_gradients<T> const& g) {
  return [&b, &a, &g](auto const& st, auto const& DU, auto& DZslot, auto& dp) { lm_local_experts_backward(b, a, g, st, DU, DZslot, dp); };
}

}  // namespace detail

// The state latent_moe_forward keeps for latent_moe_backward (args.saved), in the compute type:
// the routing, z, every slot's pre-activations h_g and h_u, the normalised u and the shared
// experts' pre-activations. No expert output and no dispatched copy of z: bytes() is
// 2·k·l values per token below naive_bytes(), the layer that keeps both (spec C.2). A filled
// state belongs to the inputs of the forward that filled it: the backward checks the shapes
// and options, not the values.
template <class T>
class latent_moe_saved {
 public:
  using compute_type = k3::accumulation_t<T>;
  bool filled() const noexcept { return state.filled; }
  std::size_t bytes() const noexcept { return state.bytes(); }
  std::size_t naive_bytes() const noexcept {
    return bytes() + 2 * static_cast<std::size_t>(state.m.T) * static_cast<std::size_t>(state.o.k) * static_cast<std::size_t>(state.m.l) * sizeof(compute_type);
  }
  void clear() { state = {}; }
  detail::lm_state<compute_type> state;  // k3's own: read through the members above
};

// y, indices, weights (whichever views are given) of the layer; args.saved, when given, is
// filled for the backward.
template <HostBackend Bk, class T>
void latent_moe_forward(Bk const& b, latent_moe_args<T> const& a, latent_moe_options const& o = {}) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16>,
                "latent_moe: storage must be float, double or k3::bfloat16");
  detail::lm_dims const m = detail::check_latent_moe(b, a, o, -1, false);
  using C = k3::accumulation_t<T>;
  if (a.saved) {
    detail::lm_forward<C>(b, a, o, m, a.saved->state, detail::lm_local_forward_fn(b, a));
  } else {
    detail::lm_state<C> st;
    detail::lm_forward<C>(b, a, o, m, st, detail::lm_local_forward_fn(b, a));
  }
}

// Every requested gradient, for dy. With a filled args.saved the forward is not run again (and
// y, indices, weights are not written: they came from that forward); otherwise the backward
// runs the forward first, writing the forward outputs that are given (and filling args.saved,
// if given).
template <HostBackend Bk, class T>
void latent_moe_backward(Bk const& b, latent_moe_backward_args<T> const& args, latent_moe_options const& o = {}) {
  auto const& a = args.forward;
  auto const& g = args.gradients;
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16>,
                "latent_moe: storage must be float, double or k3::bfloat16");
  using C = k3::accumulation_t<T>;
  bool const reuse = a.saved && a.saved->filled();
  latent_moe_args<T> checked = a;
  if (reuse) {
    checked.y = {};
    checked.indices = {};
    checked.weights = {};
  }
  detail::lm_dims const m = detail::check_latent_moe(b, checked, o, -1, false);
  ::k3::detail::check_view("dy", g.dy);
  ::k3::detail::check_shape("dy", g.dy, {m.T, m.d});
  detail::lm_check_finite(b, "dy", g.dy);
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
  if (reuse) {
    detail::lm_state<C> const& st = a.saved->state;
    detail::lm_dims const& sm = st.m;
    ::k3::detail::require(sm.T == m.T && sm.d == m.d && sm.n == m.n && sm.l == m.l && sm.f == m.f && sm.s == m.s && sm.F == m.F &&
                              detail::lm_same_options<C>(st.o, o), error_kind::shape,
                          "argument 'saved': filled by a forward with other shapes or options (clear() it, or pass the forward's)");
    detail::lm_backward<C>(b, a, g, st, detail::lm_local_backward_fn(b, a, g));
  } else if (a.saved) {
    detail::lm_forward<C>(b, a, o, m, a.saved->state, detail::lm_local_forward_fn(b, a));
    detail::lm_backward<C>(b, a, g, a.saved->state, detail::lm_local_backward_fn(b, a, g));
  } else {
    detail::lm_state<C> st;
    detail::lm_forward<C>(b, a, o, m, st, detail::lm_local_forward_fn(b, a));
    detail::lm_backward<C>(b, a, g, st, detail::lm_local_backward_fn(b, a, g));
  }
}

// ---- the routed experts alone: k3::moe::grouped_ffn_forward / grouped_ffn_backward on a host
// backend (k3/moe/grouped_ffn.hpp), through the same per-expert kernels as the layer.

namespace detail {

// Slots grouped by expert, each expert's in token order (a counting sort); ids are checked here.
struct gf_grouping {
  std::vector<index_t> offs, slot;
};

inline gf_grouping gf_group(const_view<std::int64_t, 2> idx, index_t n) {
  index_t const T_ = idx.extent(0), k = idx.extent(1);
  gf_grouping g;
  g.offs.assign(static_cast<std::size_t>(n + 1), 0);
  for (index_t t = 0; t < T_; ++t)
    for (index_t j = 0; j < k; ++j) {
      std::int64_t const e = idx(t, j);
      if (e < -1 || e >= n) throw ::k3::error(error_kind::value, gf_bad_index(t, j, e, n));
      if (e >= 0) ++g.offs[static_cast<std::size_t>(e + 1)];
    }
  for (index_t e = 0; e < n; ++e) g.offs[static_cast<std::size_t>(e + 1)] += g.offs[static_cast<std::size_t>(e)];
  g.slot.assign(static_cast<std::size_t>(g.offs.back()), 0);
  std::vector<index_t> fill(g.offs.begin(), g.offs.end() - 1);
  for (index_t t = 0; t < T_; ++t)
    for (index_t j = 0; j < k; ++j)
      if (idx(t, j) >= 0) g.slot[static_cast<std::size_t>(fill[static_cast<std::size_t>(idx(t, j))]++)] = t * k + j;
  return g;
}

// Rows rows[i] / div of a [*, c] view, in the compute type.
template <class C, class V>
lm_matrix<C> gf_gather(V const& v, index_t const* rows, index_t ne, index_t div) {
  lm_matrix<C> m(ne, v.extent(1));
  for (index_t i = 0; i < ne; ++i)
    for (index_t c = 0; c < v.extent(1); ++c) m(i, c) = load_as<C>(v(rows[i] / div, c));
  return m;
}

template <class C, class V>
lm_matrix<C> gf_gather_slots(V const& h, index_t const* rows, index_t ne) {
  index_t const k = h.extent(1), f = h.extent(2);
  lm_matrix<C> m(ne, f);
  for (index_t i = 0; i < ne; ++i)
    for (index_t c = 0; c < f; ++c) m(i, c) = h(rows[i] / k, rows[i] % k, c);
  return m;
}

}  // namespace detail

template <HostBackend Bk, class T>
void grouped_ffn_forward(Bk const& b, grouped_ffn_args<T> const& a, grouped_ffn_options const& o = {}) {
  using C = k3::accumulation_t<T>;
  using S = std::remove_const_t<T>;
  detail::gf_dims const m = detail::check_grouped_ffn(a, o, false);
  detail::check_grouped_ffn_forward_outputs(a);
  detail::gf_grouping const gr = detail::gf_group(a.indices, m.n);
  situ_params<C> const sp{static_cast<C>(o.beta_gate), static_cast<C>(o.beta_up)};
  bool const keep = k3::present(a.h_gate);
  index_t const slots = m.T * m.k;
  detail::lm_matrix<C> O = detail::lm_matrix<C>::Zero(slots, m.l);
  if (keep)
    for (index_t s = 0; s < slots; ++s)
      for (index_t c = 0; c < m.f; ++c) a.h_gate(s / m.k, s % m.k, c) = a.h_up(s / m.k, s % m.k, c) = C(0);
  b.for_each(0, m.n, [&](std::int64_t e) {
    index_t const r0 = gr.offs[static_cast<std::size_t>(e)], ne = gr.offs[static_cast<std::size_t>(e + 1)] - r0;
    if (ne == 0) return;
    index_t const* rows = gr.slot.data() + r0;
    detail::lm_matrix<C> const Ze = detail::gf_gather<C>(a.z, rows, ne, m.k);
    detail::lm_matrix<C> own_g, own_u, own_dn, G(ne, m.f), U(ne, m.f), Oe;
    auto const Wg = detail::lm_map(a.w_gate.slice(0, e), own_g), Wu = detail::lm_map(a.w_up.slice(0, e), own_u),
               Wdn = detail::lm_map(a.w_down.slice(0, e), own_dn);
    detail::lm_expert_forward<C>(Ze, Wg, Wu, Wdn, sp, G, U, Oe);
    for (index_t i = 0; i < ne; ++i) {
      index_t const s = rows[i];
      O.row(s) = Oe.row(i);
      if (keep)
        for (index_t c = 0; c < m.f; ++c) {
          a.h_gate(s / m.k, s % m.k, c) = G(i, c);
          a.h_up(s / m.k, s % m.k, c) = U(i, c);
        }
    }
  });
  b.for_each(0, m.T, [&](std::int64_t t) {
    for (index_t c = 0; c < m.l; ++c) {
      C acc = 0;
      for (index_t j = 0; j < m.k; ++j)
        if (a.indices(t, j) >= 0) acc += load_as<C>(a.weights(t, j)) * O(t * m.k + j, c);
      a.u(t, c) = store_as<S>(acc);
    }
  });
}

template <HostBackend Bk, class T>
void grouped_ffn_backward(Bk const& b, grouped_ffn_backward_args<T> const& args, grouped_ffn_options const& o = {}) {
  auto const& a = args.forward;
  auto const& g = args.gradients;
  using C = k3::accumulation_t<T>;
  using S = std::remove_const_t<T>;
  detail::gf_dims const m = detail::check_grouped_ffn(a, g, o);
  detail::gf_grouping const gr = detail::gf_group(a.indices, m.n);
  situ_params<C> const sp{static_cast<C>(o.beta_gate), static_cast<C>(o.beta_up)};
  index_t const slots = m.T * m.k;
  detail::lm_matrix<C> DZ = detail::lm_matrix<C>::Zero(slots, m.l);
  std::vector<C> dp(static_cast<std::size_t>(slots), C(0));
  b.for_each(0, m.n, [&](std::int64_t e) {
    index_t const r0 = gr.offs[static_cast<std::size_t>(e)], ne = gr.offs[static_cast<std::size_t>(e + 1)] - r0;
    index_t const* rows = gr.slot.data() + r0;
    detail::lm_matrix<C> const Ze = detail::gf_gather<C>(a.z, rows, ne, m.k);
    detail::lm_matrix<C> DUe = detail::gf_gather<C>(g.du, rows, ne, m.k);
    detail::lm_matrix<C> const Hg = detail::gf_gather_slots<C>(a.h_gate, rows, ne), Hu = detail::gf_gather_slots<C>(a.h_up, rows, ne);
    std::vector<C> pe(static_cast<std::size_t>(ne)), dpe(static_cast<std::size_t>(ne));
    for (index_t i = 0; i < ne; ++i) pe[static_cast<std::size_t>(i)] = load_as<C>(a.weights(rows[i] / m.k, rows[i] % m.k));
    detail::lm_matrix<C> own_g, own_u, own_dn, DZe;
    auto const Wg = detail::lm_map(a.w_gate.slice(0, e), own_g), Wu = detail::lm_map(a.w_up.slice(0, e), own_u),
               Wdn = detail::lm_map(a.w_down.slice(0, e), own_dn);
    auto slice = [&](auto const& v) { return k3::present(v) ? v.slice(0, e) : decltype(v.slice(0, e)){}; };
    detail::lm_expert_backward<C>(Ze, DUe, pe.data(), Hg, Hu, Wg, Wu, Wdn, sp, dpe.data(), DZe, slice(g.dw_gate), slice(g.dw_up),
                                  slice(g.dw_down));
    for (index_t i = 0; i < ne; ++i) {
      dp[static_cast<std::size_t>(rows[i])] = dpe[static_cast<std::size_t>(i)];
      DZ.row(rows[i]) = DZe.row(i);
    }
  });
  b.for_each(0, m.T, [&](std::int64_t t) {
    if (k3::present(g.d_weights))
      for (index_t j = 0; j < m.k; ++j) g.d_weights(t, j) = store_as<S>(dp[static_cast<std::size_t>(t * m.k + j)]);
    if (k3::present(g.dz))
      for (index_t c = 0; c < m.l; ++c) {
        C acc = 0;
        for (index_t j = 0; j < m.k; ++j) acc += DZ(t * m.k + j, c);
        g.dz(t, c) = store_as<S>(acc);
      }
  });
}

}  // namespace k3::moe
