// k3/optim/muon.hpp — one optimizer step over a list of parameters: Muon (Moonlight's or
// Keller Jordan's rule, optionally per head) for the matrices, AdamW for what Muon does not
// take (embeddings, the output head, vectors). Spec moe_routing.md C.3.
//
//   Moonlight: buf = μ·buf + g;  u = g + μ·buf (Nesterov) or buf;  O = NS5(u)
//              p *= 1 − lr·wd;  p −= lr · 0.2·sqrt(max(A, B)) · O
//   Keller:    m = β·m + (1 − β)·g;  u = (1 − β)·g + β·m (Nesterov) or m;  O = NS5(u)
//              p *= 1 − lr·wd;  p −= lr · sqrt(max(1, A / B)) · O
//   AdamW:     m = β1·m + (1 − β1)·g;  v = β2·v + (1 − β2)·g²;  m̂ = m / (1 − β1ᵗ);  v̂ = v / (1 − β2ᵗ)
//              p *= 1 − lr·wd;  p −= lr · m̂ / (sqrt(v̂) + eps)
//
// k3::optim::step(backend, step_args<T>{.params}, step_options) updates every parameter in
// place; the state (momentum, second moment) lives in the compute type of T (double for
// double, float otherwise), owned by the caller so it can be sharded, saved and restored.
// With heads = H a Muon matrix is orthogonalised as H row blocks (Per-Head Muon); the
// Moonlight factor stays that of the whole matrix.
#pragma once
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"
#include "k3/optim/newton_schulz.hpp"

namespace k3::optim {

enum class update_rule { muon, adamw };
enum class muon_variant { moonlight, keller };

// The optimizer state's element type for storage T.
template <class T>
using state_t = k3::accumulation_t<std::remove_const_t<T>>;

// One parameter: its value [A, B] (vectors as [1, n]), its gradient, and its state.
// momentum: Muon's buffer or AdamW's first moment; second_moment: AdamW only.
template <class T>
struct parameter {
  tensor_view<T, 2> value;
  tensor_view<T const, 2> grad;
  tensor_view<state_t<T>, 2> momentum;
  tensor_view<state_t<T>, 2> second_moment{};
  update_rule rule = update_rule::muon;
  index_t heads = 1;
};

struct muon_options {
  double lr = 0.02;
  double momentum = 0.95;
  double weight_decay = 0.0;
  bool nesterov = true;
  muon_variant variant = muon_variant::moonlight;
  int steps = 5;  // Newton–Schulz steps
};

struct adamw_options {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

struct step_options {
  muon_options muon{};
  adamw_options adamw{};
  std::int64_t step = 1;  // 1-based step count (AdamW's bias correction)
};

template <class T>
struct step_args {
  std::span<parameter<T> const> params;
};

namespace detail {

template <class T>
void check_parameter(parameter<T> const& p, std::size_t i) {
  std::string const at = "params[" + std::to_string(i) + "]";
  ::k3::detail::check_view(at + ".value", p.value);
  ::k3::detail::check_view(at + ".grad", p.grad);
  ::k3::detail::check_view(at + ".momentum", p.momentum);
  index_t const A = p.value.extent(0), B = p.value.extent(1);
  ::k3::detail::check_shape(at + ".grad", p.grad, {A, B});
  ::k3::detail::check_shape(at + ".momentum", p.momentum, {A, B});
  ::k3::detail::check_not_broadcast(at + ".value", p.value);
  ::k3::detail::check_not_broadcast(at + ".momentum", p.momentum);
  ::k3::detail::check_no_overlap(at + ".value", p.value, at + ".grad", p.grad);
  ::k3::detail::check_no_overlap(at + ".value", p.value, at + ".momentum", p.momentum);
  if (p.rule == update_rule::adamw) {
    ::k3::detail::check_view(at + ".second_moment", p.second_moment);
    ::k3::detail::check_shape(at + ".second_moment", p.second_moment, {A, B});
    ::k3::detail::check_not_broadcast(at + ".second_moment", p.second_moment);
    ::k3::detail::check_no_overlap(at + ".second_moment", p.second_moment, at + ".momentum", p.momentum);
    ::k3::detail::check_no_overlap(at + ".second_moment", p.second_moment, at + ".value", p.value);
  } else {
    ::k3::detail::require(p.heads >= 1 && A % p.heads == 0, error_kind::shape, [&] {
      return "argument '" + at + ".heads': " + std::to_string(p.heads) + " heads do not divide the A = " + std::to_string(A) + " rows of " +
             ::k3::detail::shape_of(p.value);
    });
  }
}

inline void check_step_options(step_options const& o) {
  auto finite = [](double x) { return std::isfinite(x); };
  ::k3::detail::require(o.step >= 1, error_kind::value, [&] { return "option 'step': expected >= 1 (1-based), got " + std::to_string(o.step); });
  ::k3::detail::require(finite(o.muon.lr) && finite(o.muon.weight_decay) && finite(o.muon.momentum) && o.muon.momentum >= 0 && o.muon.momentum < 1, error_kind::value,
                        [&] { return "option 'muon': lr and weight_decay must be finite and momentum in [0, 1), got momentum " +
                                     ::k3::detail::format_number(o.muon.momentum); });
  ::k3::detail::require(o.muon.steps >= 1, error_kind::value, [&] { return "option 'muon.steps': expected >= 1, got " + std::to_string(o.muon.steps); });
  ::k3::detail::require(finite(o.adamw.lr) && finite(o.adamw.weight_decay) && o.adamw.beta1 >= 0 && o.adamw.beta1 < 1 && o.adamw.beta2 >= 0 &&
                            o.adamw.beta2 < 1 && finite(o.adamw.eps) && o.adamw.eps >= 0, error_kind::value,
                        "option 'adamw': lr, weight_decay and eps must be finite, eps >= 0 and beta1, beta2 in [0, 1)");
}

template <HostBackend Bk, class T>
void muon_update(Bk const& b, parameter<T> const& p, step_options const& o) {
  using C = state_t<T>;
  index_t const A = p.value.extent(0), B = p.value.extent(1);
  if (A == 0 || B == 0) return;
  C const mu = static_cast<C>(o.muon.momentum);
  bool const keller = o.muon.variant == muon_variant::keller;
  std::vector<C> u(static_cast<std::size_t>(A * B)), ortho(u.size());
  for (index_t i = 0; i < A; ++i)
    for (index_t j = 0; j < B; ++j) {
      C const g = load_as<C>(p.grad(i, j));
      C& m = p.momentum(i, j);
      m = keller ? mu * m + (C(1) - mu) * g : mu * m + g;
      C const nest = keller ? (C(1) - mu) * g + mu * m : g + mu * m;
      u[static_cast<std::size_t>(i * B + j)] = o.muon.nesterov ? nest : m;
    }
  newton_schulz_options ns;
  ns.steps = o.muon.steps;
  ns.heads = p.heads;
  newton_schulz(b, newton_schulz_args<C, 2>{{u.data(), {A, B}}, {ortho.data(), {A, B}}}, ns);
  C const scale = keller ? static_cast<C>(std::sqrt(std::max(1.0, static_cast<double>(A) / static_cast<double>(B))))
                         : static_cast<C>(moonlight_factor(A, B));
  C const lr = static_cast<C>(o.muon.lr), decay = C(1) - lr * static_cast<C>(o.muon.weight_decay);
  using S = std::remove_const_t<T>;
  for (index_t i = 0; i < A; ++i)
    for (index_t j = 0; j < B; ++j) {
      C const v = load_as<C>(p.value(i, j)) * decay - lr * scale * ortho[static_cast<std::size_t>(i * B + j)];
      p.value(i, j) = store_as<S>(v);
    }
}

template <class T>
void adamw_update(parameter<T> const& p, step_options const& o) {
  using C = state_t<T>;
  using S = std::remove_const_t<T>;
  C const b1 = static_cast<C>(o.adamw.beta1), b2 = static_cast<C>(o.adamw.beta2);
  C const c1 = static_cast<C>(1.0 - std::pow(o.adamw.beta1, static_cast<double>(o.step)));
  C const c2 = static_cast<C>(1.0 - std::pow(o.adamw.beta2, static_cast<double>(o.step)));
  C const lr = static_cast<C>(o.adamw.lr), decay = C(1) - lr * static_cast<C>(o.adamw.weight_decay), eps = static_cast<C>(o.adamw.eps);
  for (index_t i = 0; i < p.value.extent(0); ++i)
    for (index_t j = 0; j < p.value.extent(1); ++j) {
      C const g = load_as<C>(p.grad(i, j));
      C& m = p.momentum(i, j);
      C& v = p.second_moment(i, j);
      m = b1 * m + (C(1) - b1) * g;
      v = b2 * v + (C(1) - b2) * g * g;
      C const mh = m / c1, vh = v / c2;
      p.value(i, j) = store_as<S>(load_as<C>(p.value(i, j)) * decay - lr * mh / (std::sqrt(vh) + eps));
    }
}

}  // namespace detail

// Updates every parameter (and its state) in place. All checks run before anything changes.
template <HostBackend Bk, class T>
void step(Bk const& b, step_args<T> const& args, step_options const& opt = {}) {
  static_assert(k3::Storage<std::remove_const_t<T>>, "optim::step: storage must be float, double or k3::bfloat16");
  detail::check_step_options(opt);
  for (std::size_t i = 0; i < args.params.size(); ++i) detail::check_parameter(args.params[i], i);
  for (auto const& p : args.params) {
    if (p.rule == update_rule::muon)
      detail::muon_update(b, p, opt);
    else
      detail::adamw_update(p, opt);
  }
}

}  // namespace k3::optim
