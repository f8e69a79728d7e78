// k3/moe/situ.hpp — SiTU-GLU (Kimi K3's expert activation) and a reference routed-expert FFN
// whose backward gets the router-probability gradient without stored expert outputs
// (SonicMoE identity).
//
//   softcap(x, c)  = c tanh(x / c)
//   SiTU-GLU(g, u) = softcap(g, beta1) * sigmoid(g) * softcap(u, beta2),   K3: beta1 = 4, beta2 = 25
//
// The sigmoid sees the UNCAPPED gate (silu(softcap(g)) is a different function that differs in
// the negative tail). |SiTU-GLU| < beta1 * beta2.
//
// Expert FFN per token t and selected expert e (slot r): h_g = x W_g[e], h_u = x W_u[e],
// a = SiTU(h_g, h_u), y = a W_d[e] + b_d[e], o_t = sum_r p_tr y. The naive backward needs the
// cached y for dL/dp_tr = <dL/do_t, y>. Since y = a W_d + b_d,
//   dL/dp_tr = <W_d[e] dL/do_t, a> + <dL/do_t, b_d[e]>,
// and W_d[e] dL/do_t is needed anyway for dL/da; a is recomputed from the cached
// pre-activations. So only x, h_g, h_u and the routing are kept, never y or a.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "k3/core/concepts.hpp"
#include "k3/core/config.hpp"
#include "k3/core/error.hpp"
#include "k3/core/math.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"

namespace k3::moe {

template <class T>
struct situ_params {
  T beta1 = T(4);   // gate soft-cap (config: activation_situ_beta)
  T beta2 = T(25);  // linear soft-cap (config: activation_situ_linear_beta)
};

template <class T>
struct situ_grad {
  T value, d_gate, d_up, d_beta1, d_beta2;
};

template <class T>
struct situ_partials {
  T value, d_gate, d_up;
};

template <class T>
K3_INLINE T situ_glu(T g, T u, situ_params<T> const& c = {}) noexcept {
  return c.beta1 * std::tanh(g / c.beta1) * ::k3::detail::sigmoid(g) * c.beta2 * std::tanh(u / c.beta2);
}

namespace detail {

// sech^2(z) = 1 - tanh^2(z), without the cancellation of that form once |tanh z| rounds to 1
// (|z| > ~19 in double, ~9 in float: 1 - tanh^2 gave 0, the exact value is 4 e^{-2|z|}).
template <class T>
K3_INLINE T sech2(T z) noexcept {
  T const e = std::exp(T(-2) * std::fabs(z));
  return T(4) * e / ((T(1) + e) * (T(1) + e));
}

// d/dc [c tanh(x/c)] = tanh(z) - z sech^2(z), z = x/c, which is 2z^3/3 + O(z^5): the direct
// difference cancels for small |z| (0 instead of ~1e-26 at z = 2.5e-9). There it is computed
// as sech^2(z) (sinh(w) - w) / 2, w = 2z, with the all-positive series of sinh(w) - w.
template <class T>
inline T softcap_dcap(T z) noexcept {
  if (std::fabs(z) >= T(0.5)) return std::tanh(z) - z * sech2(z);
  T const w = T(2) * z, w2 = w * w;
  T term = w * w2 / T(6), sum = term;
  for (int k = 5; k <= 25; k += 2) {
    term *= w2 / T((k - 1) * k);
    sum += term;
  }
  return sech2(z) * sum / T(2);
}

}  // namespace detail

// Value and partial derivatives with respect to g and u, every factor in a form that keeps its
// relative precision in the tails (sigma(g)(1 - sigma(g)) as sigma(g) sigma(-g), 1 - tanh^2 as
// sech^2). Host and device code (the CUDA experts) share it.
template <class T>
K3_INLINE situ_partials<T> situ_glu_partials(T g, T u, situ_params<T> const& c = {}) noexcept {
  T const zg = g / c.beta1, zu = u / c.beta2;
  T const tg = std::tanh(zg), tu = std::tanh(zu), sg = ::k3::detail::sigmoid(g), sgm = ::k3::detail::sigmoid(-g);
  T const cg = c.beta1 * tg, cu = c.beta2 * tu;
  return {cg * sg * cu, cu * (detail::sech2(zg) * sg + cg * sg * sgm), cg * sg * detail::sech2(zu)};
}

// The same and the partial derivatives with respect to the two caps (the cap derivative by its
// series near 0).
template <class T>
inline situ_grad<T> situ_glu_grad(T g, T u, situ_params<T> const& c = {}) noexcept {
  situ_partials<T> const p = situ_glu_partials(g, u, c);
  T const zg = g / c.beta1, zu = u / c.beta2;
  T const sg = ::k3::detail::sigmoid(g), cg = c.beta1 * std::tanh(zg), cu = c.beta2 * std::tanh(zu);
  return {p.value, p.d_gate, p.d_up, detail::softcap_dcap(zg) * sg * cu, cg * sg * detail::softcap_dcap(zu)};
}

// The routed-expert FFN forward: inputs x, idx (-1 = padding / dropped slot), p and the expert
// weights; outputs o and the pre-activations h_gate, h_up (the backward's only per-expert
// cache), and y, the expert outputs, when present (the naive scheme).
template <class T>
struct expert_ffn_args {
  const_view<T, 2> x;               // [Tn, d]
  const_view<std::int32_t, 2> idx;  // [Tn, K]
  const_view<T, 2> p;               // [Tn, K]
  const_view<T, 3> w_gate;          // [E, d, f]
  const_view<T, 3> w_up;            // [E, d, f]
  const_view<T, 3> w_down;          // [E, f, d]
  const_view<T, 2> b_down = {};     // [E, d]  absent: no bias
  tensor_view<T, 2> o;              // [Tn, d]
  tensor_view<T, 3> h_gate;         // [Tn, K, f]
  tensor_view<T, 3> h_up;           // [Tn, K, f]
  tensor_view<T, 3> y = {};         // [Tn, K, d]
};

// The backward: the forward's inputs and cache, d_o, and the gradients. d_x and d_p are
// overwritten; the weight gradients and d_beta1 / d_beta2 (when given) are ACCUMULATED (zero
// them first). With y present, d_p is the naive <d_o, y> from the stored expert outputs.
template <class T>
struct expert_ffn_backward_args {
  const_view<T, 2> x;                // [Tn, d]
  const_view<std::int32_t, 2> idx;   // [Tn, K]
  const_view<T, 2> p;                // [Tn, K]
  const_view<T, 3> w_gate;           // [E, d, f]
  const_view<T, 3> w_up;             // [E, d, f]
  const_view<T, 3> w_down;           // [E, f, d]
  const_view<T, 2> b_down = {};      // [E, d]
  const_view<T, 3> h_gate;           // [Tn, K, f]
  const_view<T, 3> h_up;             // [Tn, K, f]
  const_view<T, 3> y = {};           // [Tn, K, d]
  const_view<T, 2> d_o;              // [Tn, d]
  tensor_view<T, 2> d_x;             // [Tn, d]
  tensor_view<T, 2> d_p;             // [Tn, K]
  tensor_view<T, 3> d_w_gate;        // [E, d, f]
  tensor_view<T, 3> d_w_up;          // [E, d, f]
  tensor_view<T, 3> d_w_down;        // [E, f, d]
  tensor_view<T, 2> d_b_down = {};   // [E, d]  required with b_down
  T* d_beta1 = nullptr;              // the gate soft-cap's gradient
  T* d_beta2 = nullptr;              // the linear soft-cap's gradient
};

template <class T>
struct expert_ffn_options {
  situ_params<T> act{};
};

namespace detail {

// The weights and gradients as the reference kernels take them.
template <class T>
struct expert_ffn_weights {
  const_view<T, 3> w_gate;  // [E, d, f]
  const_view<T, 3> w_up;    // [E, d, f]
  const_view<T, 3> w_down;  // [E, f, d]
  const_view<T, 2> b_down;  // [E, d]  (may be empty: no bias)
  situ_params<T> act{};
};

template <class T>
struct expert_ffn_grads {
  tensor_view<T, 2> dx;       // [Tn, d]
  tensor_view<T, 2> dp;       // [Tn, K]
  tensor_view<T, 3> dw_gate;  // [E, d, f]  (accumulated: zero it first)
  tensor_view<T, 3> dw_up;    // [E, d, f]
  tensor_view<T, 3> dw_down;  // [E, f, d]
  tensor_view<T, 2> db_down;  // [E, d] (empty if no bias)
  T d_beta1 = T(0), d_beta2 = T(0);
};

}  // namespace detail

namespace detail {

template <class T>
void check_ffn(const_view<T, 2> x, const_view<std::int32_t, 2> idx, const_view<T, 2> p, expert_ffn_weights<T> const& w) {
  using ::k3::detail::check_shape;
  using ::k3::detail::require;
  index_t const Tn = x.extent(0), d = x.extent(1), K = idx.extent(1);
  index_t const E = w.w_gate.extent(0), f = w.w_gate.extent(2);
  ::k3::detail::check_view("x", x);
  ::k3::detail::check_view("idx", idx);
  ::k3::detail::check_view("p", p);
  ::k3::detail::check_view("w_gate", w.w_gate);
  ::k3::detail::check_view("w_up", w.w_up);
  ::k3::detail::check_view("w_down", w.w_down);
  ::k3::detail::check_view("b_down", w.b_down);
  // softcap(x, c) = c tanh(x / c) needs a finite positive cap (0 gives NaN, a negative cap
  // flips the sign of the activation).
  require(std::isfinite(double(w.act.beta1)) && w.act.beta1 > T(0), error_kind::value,
          [&] { return "argument 'beta1': the gate soft-cap must be finite and > 0, got " + std::to_string(double(w.act.beta1)); });
  require(std::isfinite(double(w.act.beta2)) && w.act.beta2 > T(0), error_kind::value,
          [&] { return "argument 'beta2': the linear soft-cap must be finite and > 0, got " + std::to_string(double(w.act.beta2)); });
  check_shape("idx", idx, {Tn, ::k3::detail::any_extent});
  check_shape("p", p, {Tn, K});
  check_shape("w_gate", w.w_gate, {E, d, f});
  check_shape("w_up", w.w_up, {E, d, f});
  check_shape("w_down", w.w_down, {E, f, d});
  if (!w.b_down.empty()) check_shape("b_down", w.b_down, {E, d});
  for (index_t t = 0; t < Tn; ++t)
    for (index_t r = 0; r < K; ++r)
      require(idx(t, r) >= -1 && idx(t, r) < E, error_kind::value, [&] {
        return "argument 'idx': expert id " + std::to_string(idx(t, r)) + " at (" + std::to_string(t) + ", " + std::to_string(r) +
               ") outside [-1, " + std::to_string(E) + ")";
      });
}

template <class T>
auto ffn_inputs(const_view<T, 2> x, const_view<std::int32_t, 2> idx, const_view<T, 2> p, expert_ffn_weights<T> const& w) {
  return ::k3::detail::named_views("x", x, "idx", idx, "p", p, "w_gate", w.w_gate, "w_up", w.w_up, "w_down", w.w_down, "b_down", w.b_down);
}

}  // namespace detail

namespace detail {

// The reference forward (see expert_ffn_args). Slots with idx = -1 contribute nothing.
template <class T>
void expert_ffn_forward_impl(const_view<T, 2> x, const_view<std::int32_t, 2> idx, const_view<T, 2> p, expert_ffn_weights<T> const& w,
                        tensor_view<T, 2> o, tensor_view<T, 3> h_gate, tensor_view<T, 3> h_up, tensor_view<T, 3> y = {}) {
  detail::check_ffn(x, idx, p, w);
  index_t const Tn = x.extent(0), d = x.extent(1), K = idx.extent(1), f = w.w_gate.extent(2);
  ::k3::detail::check_shape("o", o, {Tn, d});
  ::k3::detail::check_shape("h_gate", h_gate, {Tn, K, f});
  ::k3::detail::check_shape("h_up", h_up, {Tn, K, f});
  if (!y.empty()) ::k3::detail::check_shape("y", y, {Tn, K, d});
  ::k3::detail::check_view("o", o);
  ::k3::detail::check_view("h_gate", h_gate);
  ::k3::detail::check_view("h_up", h_up);
  ::k3::detail::check_view("y", y);
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("o", o, "h_gate", h_gate, "h_up", h_up, "y", y),
                                    detail::ffn_inputs(x, idx, p, w));
  std::vector<T> a(static_cast<std::size_t>(f)), ye(static_cast<std::size_t>(d));
  for (index_t t = 0; t < Tn; ++t) {
    for (index_t c = 0; c < d; ++c) o(t, c) = T(0);
    for (index_t r = 0; r < K; ++r) {
      index_t const e = idx(t, r);
      if (e < 0) {
        for (index_t c = 0; c < f; ++c) h_gate(t, r, c) = h_up(t, r, c) = T(0);
        if (!y.empty())
          for (index_t c = 0; c < d; ++c) y(t, r, c) = T(0);
        continue;
      }
      for (index_t c = 0; c < f; ++c) {
        T hg = 0, hu = 0;
        for (index_t i = 0; i < d; ++i) {
          hg += x(t, i) * w.w_gate(e, i, c);
          hu += x(t, i) * w.w_up(e, i, c);
        }
        h_gate(t, r, c) = hg;
        h_up(t, r, c) = hu;
        a[c] = situ_glu(hg, hu, w.act);
      }
      for (index_t c = 0; c < d; ++c) {
        T v = w.b_down.empty() ? T(0) : w.b_down(e, c);
        for (index_t i = 0; i < f; ++i) v += a[i] * w.w_down(e, i, c);
        ye[c] = v;
        if (!y.empty()) y(t, r, c) = v;
        o(t, c) += p(t, r) * v;
      }
    }
  }
}

// Shared backward; `y` empty = the memory-efficient identity, else the naive dp = <dO, y>.
template <class T>
void expert_ffn_backward_impl(const_view<T, 2> x, const_view<std::int32_t, 2> idx, const_view<T, 2> p, expert_ffn_weights<T> const& w,
                              const_view<T, 3> h_gate, const_view<T, 3> h_up, const_view<T, 3> y, const_view<T, 2> d_o,
                              expert_ffn_grads<T>& g) {
  check_ffn(x, idx, p, w);
  index_t const Tn = x.extent(0), d = x.extent(1), K = idx.extent(1), f = w.w_gate.extent(2), E = w.w_gate.extent(0);
  using ::k3::detail::check_shape;
  check_shape("h_gate", h_gate, {Tn, K, f});
  check_shape("h_up", h_up, {Tn, K, f});
  check_shape("d_o", d_o, {Tn, d});
  if (!y.empty()) check_shape("y", y, {Tn, K, d});
  check_shape("d_x", g.dx, {Tn, d});
  check_shape("d_p", g.dp, {Tn, K});
  check_shape("d_w_gate", g.dw_gate, {E, d, f});
  check_shape("d_w_up", g.dw_up, {E, d, f});
  check_shape("d_w_down", g.dw_down, {E, f, d});
  if (!w.b_down.empty()) check_shape("d_b_down", g.db_down, {E, d});
  ::k3::detail::check_view("h_gate", h_gate);
  ::k3::detail::check_view("h_up", h_up);
  ::k3::detail::check_view("y", y);
  ::k3::detail::check_view("d_w_gate", g.dw_gate);
  ::k3::detail::check_view("d_w_up", g.dw_up);
  ::k3::detail::check_view("d_w_down", g.dw_down);
  ::k3::detail::check_view("d_o", d_o);
  ::k3::detail::check_view("d_x", g.dx);
  ::k3::detail::check_view("d_p", g.dp);
  ::k3::detail::check_view("d_b_down", g.db_down);
  tensor_view<T, 2> const db_down = w.b_down.empty() ? tensor_view<T, 2>{} : g.db_down;  // ignored without a bias
  ::k3::detail::check_outputs_apart(
      ::k3::detail::named_views("d_x", g.dx, "d_p", g.dp, "d_w_gate", g.dw_gate, "d_w_up", g.dw_up, "d_w_down", g.dw_down, "d_b_down", db_down),
      ::k3::detail::joined(ffn_inputs(x, idx, p, w), ::k3::detail::named_views("h_gate", h_gate, "h_up", h_up, "y", y, "d_o", d_o)));
  std::vector<T> dA(static_cast<std::size_t>(f)), a(static_cast<std::size_t>(f)), dhg(static_cast<std::size_t>(f)),
      dhu(static_cast<std::size_t>(f));
  for (index_t t = 0; t < Tn; ++t) {
    for (index_t c = 0; c < d; ++c) g.dx(t, c) = T(0);
    for (index_t r = 0; r < K; ++r) {
      index_t const e = idx(t, r);
      if (e < 0) {
        g.dp(t, r) = T(0);
        continue;
      }
      T const pr = p(t, r);
      // dA' = W_d[e] dO_t  (the down-projection's input gradient before the p scaling)
      T dp_a = 0;
      for (index_t i = 0; i < f; ++i) {
        T v = 0;
        for (index_t c = 0; c < d; ++c) v += w.w_down(e, i, c) * d_o(t, c);
        dA[i] = v;
        auto gr = situ_glu_grad(h_gate(t, r, i), h_up(t, r, i), w.act);
        a[i] = gr.value;
        dp_a += v * gr.value;
        dhg[i] = gr.d_gate * pr * v;
        dhu[i] = gr.d_up * pr * v;
        g.d_beta1 += gr.d_beta1 * pr * v;
        g.d_beta2 += gr.d_beta2 * pr * v;
      }
      if (y.empty()) {
        T dpb = 0;
        if (!w.b_down.empty())
          for (index_t c = 0; c < d; ++c) dpb += d_o(t, c) * w.b_down(e, c);
        g.dp(t, r) = dp_a + dpb;
      } else {
        T v = 0;
        for (index_t c = 0; c < d; ++c) v += d_o(t, c) * y(t, r, c);
        g.dp(t, r) = v;
      }
      for (index_t i = 0; i < f; ++i)
        for (index_t c = 0; c < d; ++c) g.dw_down(e, i, c) += pr * a[i] * d_o(t, c);
      if (!w.b_down.empty())
        for (index_t c = 0; c < d; ++c) g.db_down(e, c) += pr * d_o(t, c);
      for (index_t c = 0; c < d; ++c) {
        T v = 0;
        for (index_t i = 0; i < f; ++i) v += dhg[i] * w.w_gate(e, c, i) + dhu[i] * w.w_up(e, c, i);
        g.dx(t, c) += v;
        for (index_t i = 0; i < f; ++i) {
          g.dw_gate(e, c, i) += x(t, c) * dhg[i];
          g.dw_up(e, c, i) += x(t, c) * dhu[i];
        }
      }
    }
  }
}

}  // namespace detail

// The routed-expert FFN forward (see expert_ffn_args); a reference on every host backend.
template <HostBackend B, class T>
void expert_ffn_forward(B const&, expert_ffn_args<T> const& a, expert_ffn_options<T> const& opt = {}) {
  detail::expert_ffn_forward_impl<T>(a.x, a.idx, a.p, {a.w_gate, a.w_up, a.w_down, a.b_down, opt.act}, a.o, a.h_gate, a.h_up, a.y);
}

// Backward without stored expert outputs: d_p from <W_d d_o, a> (+ <d_o, b_d>), a recomputed
// from h (or, with args.y, the naive <d_o, y>). A selected expert with p = 0 keeps its id and
// gets its d_p.
template <HostBackend B, class T>
void expert_ffn_backward(B const&, expert_ffn_backward_args<T> const& a, expert_ffn_options<T> const& opt = {}) {
  detail::expert_ffn_grads<T> g{a.d_x, a.d_p, a.d_w_gate, a.d_w_up, a.d_w_down, a.d_b_down, T(0), T(0)};
  detail::expert_ffn_backward_impl<T>(a.x, a.idx, a.p, {a.w_gate, a.w_up, a.w_down, a.b_down, opt.act}, a.h_gate, a.h_up, a.y, a.d_o, g);
  if (a.d_beta1) *a.d_beta1 += g.d_beta1;
  if (a.d_beta2) *a.d_beta2 += g.d_beta2;
}

}  // namespace k3::moe
