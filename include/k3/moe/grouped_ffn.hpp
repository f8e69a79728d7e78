// k3/moe/grouped_ffn.hpp — the routed experts of a MoE layer as one op over tokens grouped by
// expert (spec moe_routing.md C.2), forward and backward, on any backend:
//
//   a_s  = SiTU(z_t w_gate[e]ᵀ, z_t w_up[e]ᵀ)       for every slot s = (t, j) with e = indices[t, j]
//   u_t  = Σ_j weights[t, j] · a_s w_down[e]ᵀ        (slots with index -1 contribute nothing)
//
// k3::moe::grouped_ffn_forward(backend, grouped_ffn_args<T, Space>{...}, options) writes u and
// each slot's pre-activations h_gate, h_up [T, k, f] (in the compute type), the only per-expert
// state the backward needs. grouped_ffn_backward(backend, grouped_ffn_backward_args<T, Space>{.forward =
// args with h_gate and h_up filled, .gradients = {du, ...}}, options) recomputes a from them and takes the router-weight
// gradient as <w_down[e]ᵀ du_t, a_s>: no expert output is stored, and z is re-dispatched from
// the pre-dispatch input. A slot with weight 0 keeps its expert and gets its gradient.
//
// The host backends are in k3/moe/latent_moe.hpp (Eigen GEMMs per expert, one expert per task),
// the CUDA backend in k3/moe/grouped_ffn.cuh. Storage float, double or k3::bfloat16; float and
// bfloat16 compute in float32, double in double. Every sum over tokens or slots runs in a fixed
// order, so results do not depend on thread or block counts.
//
// Non-finite values are not an error here (the layer op checks its inputs): a NaN in z_t stays
// in u_t and, in the backward, in dz_t, t's router-weight gradients and the weight gradients of
// the experts t was routed to; no other token or expert sees it.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "k3/core/error.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/storage.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"

namespace k3::moe {

struct grouped_ffn_options {
  double beta_gate = 4.0, beta_up = 25.0;  // SiTU's soft-caps (K3: 4 and 25)
};

template <class T, class Space = host_space>
struct grouped_ffn_args {
  using compute_type = k3::accumulation_t<T>;
  tensor_view<T const, 2, Space> z;                   // [T, l] every token's input (not dispatched)
  tensor_view<std::int64_t const, 2, Space> indices;  // [T, k] expert of each slot, -1: no expert
  tensor_view<T const, 2, Space> weights;             // [T, k] router weights p
  tensor_view<T const, 3, Space> w_gate;              // [n, f, l]
  tensor_view<T const, 3, Space> w_up;                // [n, f, l]
  tensor_view<T const, 3, Space> w_down;              // [n, l, f]
  tensor_view<T, 2, Space> u{};                       // [T, l] forward output
  tensor_view<compute_type, 3, Space> h_gate{};       // [T, k, f] written by the forward, read by the backward
  tensor_view<compute_type, 3, Space> h_up{};         // [T, k, f]
};

// The backward's input and outputs; every output may be empty (not computed). All are written,
// not accumulated; an expert no slot reaches gets zero weight gradients.
template <class T, class Space = host_space>
struct grouped_ffn_gradients {
  tensor_view<T const, 2, Space> du;  // [T, l]
  tensor_view<T, 2, Space> dz{};      // [T, l]
  tensor_view<T, 2, Space> d_weights{};  // [T, k]
  tensor_view<T, 3, Space> dw_gate{}, dw_up{}, dw_down{};
};

// The backward's one aggregate: the forward's args (with the h_gate, h_up it wrote) and the
// gradients.
template <class T, class Space = host_space>
struct grouped_ffn_backward_args {
  grouped_ffn_args<T, Space> forward;
  grouped_ffn_gradients<T, Space> gradients;
};

// Multiply-adds of the forward's three GEMMs, times two (the FLOPs of its routed slots).
inline constexpr double grouped_ffn_flops(index_t routed_slots, index_t l, index_t f) noexcept {
  return 6.0 * static_cast<double>(routed_slots) * static_cast<double>(l) * static_cast<double>(f);
}

namespace detail {


struct gf_dims {
  index_t T = 0, k = 0, n = 0, l = 0, f = 0;
};

template <class T>
inline constexpr bool gf_storage = std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16>;

// The inputs the forward reads, as a list of named views (gf_inputs(a)(f) calls f(name, view)).
template <class T, class Space>
auto gf_inputs(grouped_ffn_args<T, Space> const& a) {
  return ::k3::detail::named_views("z", a.z, "indices", a.indices, "weights", a.weights, "w_gate", a.w_gate, "w_up", a.w_up, "w_down", a.w_down);
}

// Shapes, options and aliasing; the expert ids are data and are checked where they are read.
template <class T, class Space>
gf_dims check_grouped_ffn(grouped_ffn_args<T, Space> const& a, grouped_ffn_options const& o, bool backward) {
  static_assert(gf_storage<std::remove_const_t<T>>, "grouped_ffn: storage must be float, double or k3::bfloat16");
  namespace kd = ::k3::detail;
  kd::check_view("z", a.z);
  kd::check_view("indices", a.indices);
  kd::check_view("weights", a.weights);
  kd::check_view("w_gate", a.w_gate);
  kd::check_view("w_up", a.w_up);
  kd::check_view("w_down", a.w_down);
  gf_dims m{a.z.extent(0), a.indices.extent(1), a.w_gate.extent(0), a.z.extent(1), a.w_gate.extent(1)};
  kd::check_shape("indices", a.indices, {m.T, kd::any_extent});
  kd::check_shape("weights", a.weights, {m.T, m.k});
  kd::check_shape("w_gate", a.w_gate, {m.n, m.f, m.l});
  kd::check_shape("w_up", a.w_up, {m.n, m.f, m.l});
  kd::check_shape("w_down", a.w_down, {m.n, m.l, m.f});
  kd::require(std::isfinite(o.beta_gate) && o.beta_gate > 0, error_kind::value, [&] {
    return "option 'beta_gate': expected a finite value > 0, got " + kd::format_number(o.beta_gate);
  });
  kd::require(std::isfinite(o.beta_up) && o.beta_up > 0, error_kind::value, [&] {
    return "option 'beta_up': expected a finite value > 0, got " + kd::format_number(o.beta_up);
  });
  if (backward) {
    kd::require(m.T == 0 || (k3::present(a.h_gate) && k3::present(a.h_up)), error_kind::value, "arguments 'h_gate', 'h_up': the backward reads the pre-activations the forward wrote");
  } else {
    kd::require(m.T == 0 || k3::present(a.u), error_kind::value, "argument 'u': the forward's output is required");
    kd::check_view("u", a.u);
    if (k3::present(a.u)) kd::check_shape("u", a.u, {m.T, m.l});
  }
  if (k3::present(a.h_gate) || k3::present(a.h_up)) {
    kd::check_view("h_gate", a.h_gate);
    kd::check_view("h_up", a.h_up);
    kd::check_shape("h_gate", a.h_gate, {m.T, m.k, m.f});
    kd::check_shape("h_up", a.h_up, {m.T, m.k, m.f});
  }
  return m;
}

template <class T, class Space>
gf_dims check_grouped_ffn(grouped_ffn_args<T, Space> const& a, grouped_ffn_gradients<T, Space> const& g, grouped_ffn_options const& o) {
  namespace kd = ::k3::detail;
  gf_dims const m = check_grouped_ffn(a, o, true);
  kd::check_view("du", g.du);
  kd::check_shape("du", g.du, {m.T, m.l});
  if (k3::present(g.dz)) kd::check_shape("dz", g.dz, {m.T, m.l});
  if (k3::present(g.d_weights)) kd::check_shape("d_weights", g.d_weights, {m.T, m.k});
  if (k3::present(g.dw_gate)) kd::check_shape("dw_gate", g.dw_gate, {m.n, m.f, m.l});
  if (k3::present(g.dw_up)) kd::check_shape("dw_up", g.dw_up, {m.n, m.f, m.l});
  if (k3::present(g.dw_down)) kd::check_shape("dw_down", g.dw_down, {m.n, m.l, m.f});
  kd::check_outputs_apart(kd::named_views("dz", g.dz, "d_weights", g.d_weights, "dw_gate", g.dw_gate, "dw_up", g.dw_up, "dw_down", g.dw_down),
                          kd::joined(gf_inputs(a), kd::named_views("h_gate", a.h_gate, "h_up", a.h_up, "du", g.du)));
  return m;
}

template <class T, class Space>
void check_grouped_ffn_forward_outputs(grouped_ffn_args<T, Space> const& a) {
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("u", a.u, "h_gate", a.h_gate, "h_up", a.h_up), gf_inputs(a));
}

inline std::string gf_bad_index(index_t t, index_t j, std::int64_t e, index_t n) {
  return "argument 'indices': expected expert ids in [-1, " + std::to_string(n) + "), got " + std::to_string(e) + " at [" + std::to_string(t) +
         ", " + std::to_string(j) + "]";
}

}  // namespace detail
}  // namespace k3::moe
