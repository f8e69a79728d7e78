// k3 moe — the Stable LatentMoE layer (k3/moe/latent_moe.hpp), forward and --backward, on .npy files.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "cli.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/moe/latent_moe.hpp"

namespace {

using k3::index_t;
namespace moe = k3::moe;

// An input in the layer's storage type T (x's dtype), with its shape.
template <class T>
struct tensor_in {
  std::vector<T> data;
  std::vector<index_t> shape;
  bool present = false;
};

template <class T>
tensor_in<T> read_as(std::optional<k3::io::npy_array> const& a, std::string const& name, std::size_t rank) {
  tensor_in<T> t;
  if (!a) return t;
  k3::cli::check(a->rank() == rank, k3::error_kind::shape, [&] {
    return "argument '" + name + "': expected rank " + std::to_string(rank) + ", got shape " + k3::format_shape(a->shape());
  });
  auto const ty = a->type();
  bool const bits = ty == k3::io::dtype::uint16 || ty == k3::io::dtype::bfloat16;
  k3::cli::check(ty == k3::io::dtype::float32 || ty == k3::io::dtype::float64 || bits, k3::error_kind::dtype, [&] {
    return "argument '" + name + "': expected a float32, float64 or bfloat16 array, got " + std::string(k3::io::dtype_name(ty));
  });
  t.shape = a->shape();
  t.present = true;
  t.data.resize(static_cast<std::size_t>(a->size()));
  for (index_t i = 0; i < a->size(); ++i)
    t.data[static_cast<std::size_t>(i)] =
        bits ? k3::store_as<T>(float(k3::bfloat16::from_bits(static_cast<std::uint16_t>(a->as_int(i))))) : k3::store_as<T>(a->as_double(i));
  return t;
}

template <class T, std::size_t R>
k3::const_view<T, R> view_of(tensor_in<T> const& t) {
  if (!t.present) return {};
  k3::array<index_t, R> e{};
  for (std::size_t r = 0; r < R; ++r) e[r] = t.shape[r];
  return {t.data.data(), e};
}

template <class T>
int run_typed(k3::cli::args const& args, moe::latent_moe_options const& o) {
  auto in = [&](char const* name, std::size_t rank, bool required) {
    auto a = required ? std::optional<k3::io::npy_array>(args.load(name)) : args.load_optional(name);
    return read_as<T>(a, name, rank);
  };
  auto const x = in("x", 2, true), w_router = in("w_router", 2, true), bias = in("bias", 1, false), w_down = in("w_down", 2, true);
  auto const we_gate = in("we_gate", 3, true), we_up = in("we_up", 3, true), we_down = in("we_down", 3, true);
  auto const norm_weight = in("norm_weight", 1, false), w_up = in("w_up", 2, true);
  auto const ws_gate = in("ws_gate", 3, false), ws_up = in("ws_up", 3, false), ws_down = in("ws_down", 3, false);
  moe::latent_moe_args<T> a{view_of<T, 2>(x),      view_of<T, 2>(w_router), view_of<T, 1>(bias),        view_of<T, 2>(w_down),
                            view_of<T, 3>(we_gate), view_of<T, 3>(we_up),   view_of<T, 3>(we_down),     view_of<T, 1>(norm_weight),
                            view_of<T, 2>(w_up),   view_of<T, 3>(ws_gate),  view_of<T, 3>(ws_up),       view_of<T, 3>(ws_down)};
  index_t const Tn = x.shape[0], d = x.shape[1];
  k3::cli::check(o.k >= 1 && w_router.shape.size() == 2 && o.k <= w_router.shape[0], k3::error_kind::shape, [&] {
    return "option '--k': expected 1 <= k <= n = " + std::to_string(w_router.shape.empty() ? 0 : w_router.shape[0]) + " experts, got " +
           std::to_string(o.k);
  });
  std::vector<T> y(static_cast<std::size_t>(k3::cli::output_elements("y", {Tn, d}))), weights(static_cast<std::size_t>(Tn * o.k));
  std::vector<std::int64_t> indices(weights.size());
  a.y = {y.data(), {Tn, d}};
  a.indices = {indices.data(), {Tn, o.k}};
  a.weights = {weights.data(), {Tn, o.k}};
  k3::cpu::threads<> backend(args.threads(0));
  if (!args.flag("backward")) {
    moe::latent_moe_forward(backend, a, o);
  } else {
    auto const dy = in("dy", 2, true);
    auto out = [](tensor_in<T> const& ref) { return std::vector<T>(ref.data.size()); };
    std::vector<T> dx = out(x), dw_router = out(w_router), dw_down = out(w_down), dwe_gate = out(we_gate), dwe_up = out(we_up),
                   dwe_down = out(we_down), dw_up = out(w_up), dws_gate = out(ws_gate), dws_up = out(ws_up), dws_down = out(ws_down);
    index_t const l = w_down.shape.size() == 2 ? w_down.shape[0] : 0;
    std::vector<T> dnorm(static_cast<std::size_t>(l));
    auto mut2 = [](std::vector<T>& v, tensor_in<T> const& ref) {
      return ref.present ? k3::tensor_view<T, 2>(v.data(), {ref.shape[0], ref.shape[1]}) : k3::tensor_view<T, 2>{};
    };
    auto mut3 = [](std::vector<T>& v, tensor_in<T> const& ref) {
      return ref.present ? k3::tensor_view<T, 3>(v.data(), {ref.shape[0], ref.shape[1], ref.shape[2]}) : k3::tensor_view<T, 3>{};
    };
    moe::latent_moe_gradients<T> g{view_of<T, 2>(dy),         mut2(dx, x),           mut2(dw_router, w_router), mut2(dw_down, w_down),
                                   mut3(dwe_gate, we_gate),   mut3(dwe_up, we_up),   mut3(dwe_down, we_down),
                                   {dnorm.data(), {l}},       mut2(dw_up, w_up),     mut3(dws_gate, ws_gate),
                                   mut3(dws_up, ws_up),       mut3(dws_down, ws_down)};
    // The forward saves its state; the backward starts from it.
    moe::latent_moe_saved<T> saved;
    a.saved = &saved;
    moe::latent_moe_forward(backend, a, o);
    moe::latent_moe_backward(backend, moe::latent_moe_backward_args<T>{a, g}, o);
    args.save("dx", g.dx);
    args.save("dw_router", g.dw_router);
    args.save("dw_down", g.dw_down);
    args.save("dwe_gate", g.dwe_gate);
    args.save("dwe_up", g.dwe_up);
    args.save("dwe_down", g.dwe_down);
    args.save("dnorm_weight", g.dnorm_weight);
    args.save("dw_up", g.dw_up);
    if (ws_gate.present) {
      args.save("dws_gate", g.dws_gate);
      args.save("dws_up", g.dws_up);
      args.save("dws_down", g.dws_down);
    }
  }
  args.save("y", a.y);
  args.save("indices", a.indices);
  args.save("weights", a.weights);
  std::printf("latent MoE: %lld tokens, top-%lld of %lld experts%s\n", static_cast<long long>(Tn), static_cast<long long>(o.k),
              static_cast<long long>(w_router.shape[0]), args.flag("backward") ? ", forward and backward" : "");
  return 0;
}

int run_moe(k3::cli::args& args) {
  moe::latent_moe_options o;
  o.k = args.integer("k", 16);
  o.scale = args.number("scale", 1.0);
  o.eps = args.number("eps", 1e-6);
  o.beta_gate = args.number("beta-gate", 4.0);
  o.beta_up = args.number("beta-up", 25.0);
  if (!(o.k >= 1)) throw k3::cli::usage_error("option '--k' must be >= 1, got " + std::to_string(o.k));
  if (!(o.eps > 0) || !std::isfinite(o.eps)) throw k3::cli::usage_error("option '--eps' must be a finite number > 0, got " + args.value("eps"));
  if (!(o.beta_gate > 0) || !std::isfinite(o.beta_gate))
    throw k3::cli::usage_error("option '--beta-gate' must be a finite number > 0, got " + args.value("beta-gate"));
  if (!(o.beta_up > 0) || !std::isfinite(o.beta_up))
    throw k3::cli::usage_error("option '--beta-up' must be a finite number > 0, got " + args.value("beta-up"));
  if (!std::isfinite(o.scale)) throw k3::cli::usage_error("option '--scale' must be finite, got " + args.value("scale"));
  k3::io::npy_array const x = args.load("x");
  switch (x.type()) {
    case k3::io::dtype::float32: return run_typed<float>(args, o);
    case k3::io::dtype::float64: return run_typed<double>(args, o);
    case k3::io::dtype::bfloat16:
    case k3::io::dtype::uint16: return run_typed<k3::bfloat16>(args, o);
    default:
      throw k3::error(k3::error_kind::dtype, "argument 'x': expected a float32, float64 or bfloat16 array, got " + std::string(k3::io::dtype_name(x.type())));
  }
}

k3::cli::registrar reg({"moe", "the Stable LatentMoE layer (router, latent experts, RMSNorm, shared experts), forward and --backward",
                        "Reads x [T,d], w_router [n,d], bias [n] (optional: zeros), w_down [l,d], we_gate [n,f,l], we_up [n,f,l],\n"
                        "we_down [n,l,f], norm_weight [l] (optional: ones), w_up [d,l] and optionally the shared experts\n"
                        "ws_gate [s,F,d], ws_up [s,F,d], ws_down [s,d,F] (all three or none):\n"
                        "  s = sigmoid(x w_router^T); I_t = top-k of s_t + bias (ties -> lower index), by descending s + bias;\n"
                        "  p_te = scale s_te / sum_{I_t} s; z = x w_down^T; a_te = SiTU(z we_gate[e]^T, z we_up[e]^T) with\n"
                        "  SiTU(g, u) = softcap(g, beta_gate) sigmoid(g) softcap(u, beta_up), softcap(v, b) = b tanh(v/b);\n"
                        "  u_t = sum_{I_t} p_te a_te we_down[e]^T; r_t = u_t / sqrt(mean(u_t^2) + eps) norm_weight;\n"
                        "  y_t = r_t w_up^T + sum_j SiTU(x ws_gate[j]^T, x ws_up[j]^T) ws_down[j]^T.\n"
                        "Writes y [T,d], indices [T,k] (int64) and weights [T,k] (p) in x's dtype (float32, float64 or bfloat16;\n"
                        "the other inputs are converted to it; bfloat16 computes every intermediate in float32). --backward also\n"
                        "reads dy [T,d] and writes dx dw_router dw_down dwe_gate dwe_up dwe_down dnorm_weight dw_up (and dws_gate\n"
                        "dws_up dws_down): the selection held fixed, the router gradient through p, none for the bias.\n"
                        "NaN or Inf in any input the step reads is an error naming the argument and the position (the token for x and dy;\n"
                        "the weights of an expert that no token is routed to are not read).",
                        k3::cli::io_options({{"k", true, "experts per token (default 16)"},
                                             {"scale", true, "routed scaling factor (default 1.0)"},
                                             {"eps", true, "RMSNorm epsilon (default 1e-6)"},
                                             {"beta-gate", true, "SiTU gate soft-cap (default 4)"},
                                             {"beta-up", true, "SiTU linear soft-cap (default 25)"},
                                             {"backward", false, "also compute the gradients for dy.npy"},
                                             {"threads", true, "worker threads (default: all)"}}),
                        true, run_moe});

}  // namespace
