// k3/train/stack.hpp — one training step of a small K3-like stack with every tensor its
// backward needs bound to a saved_tensor_store (k3/train/saved_tensors.hpp) under one policy
// preset: KDA layers with their pre-processing, then a Stable LatentMoE layer.
//
//   auto params = k3::train::stack_parameters<float>(config);        // seeded, fixed order
//   auto in     = k3::train::stack_inputs<float>(config);            // x and the output gradient
//   auto r      = k3::train::train_step(backend, {.parameters = &params, .input = &in},
//                                       {.config = config, .policy = k3::train::step_policy::mixed});
//   r.gradients  (same names, shapes and order as params), r.y, r.stats (the store's pools)
//
// Each KDA layer (d = heads · head_dim, residual):
//   q = l2norm(conv(x W_qᵀ)), k = l2norm(conv(x W_kᵀ)), v = conv(x W_vᵀ)    conv: causal depthwise + SiLU
//   g = lb · sigmoid(exp(A_log) (x W_gᵀ + dt_bias)),  beta = sigmoid(x W_betaᵀ)
//   y = x + KDA(q, k, v, g, beta) W_oᵀ                                       chunked form, gate bound lb
// The MoE layer: y = x + latent_moe(x) (k3/moe/latent_moe.hpp, no shared experts), trained
// through k3/train/latent_moe_saves.hpp.
// The step's loss is <y, dy> for the given dy; gradients of every parameter, by the same ops'
// backward functions.
//
// What each layer saves, by role (saved_role), and where each preset puts it (policy_for):
//   checkpoint   the layer's input x
//   activation   projection outputs (x W_*ᵀ), the attention output, the MoE's z, h_gate,
//                h_up and normalised u
//   elementwise  conv outputs, q and k after l2norm, g and beta
//   state        KDA's per-chunk states (forward_args::saved)
//   routing      the MoE's selection: expert ids, slots, probabilities, per-token scalars
// Presets: keep (all kept); recompute (checkpoints kept, everything else recomputed from them
// on demand: a recomputed tensor is rebuilt from the tensors it came from, themselves loaded or
// recomputed, so recompute can run several ops back to the layer input); fp8 (every floating
// tensor as 1x128 E4M3 blocks, integers kept); offload (all in the host pool, the next layer's
// prefetched while the current one computes its backward); mixed (K3's choice: elementwise
// recomputed, routing offloaded, everything else fp8 and offloaded). recompute and offload
// give the gradients of keep bit for bit (the ops are deterministic for a given backend);
// fp8's and mixed's differ by the E4M3 rounding.
#pragma once
#include <Eigen/Core>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/tensor.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/kda.hpp"
#include "k3/kda/preprocess.hpp"
#include "k3/moe/latent_moe.hpp"
#include "k3/train/latent_moe_saves.hpp"
#include "k3/train/saved_tensors.hpp"

namespace k3::train {

enum class step_policy { keep, recompute, fp8, offload, mixed };
inline constexpr std::array<std::string_view, 5> step_policy_names{"keep", "recompute", "fp8", "offload", "mixed"};

constexpr std::string_view name_of(step_policy p) noexcept { return step_policy_names[static_cast<std::size_t>(p)]; }

inline std::optional<step_policy> parse_step_policy(std::string_view s) noexcept {
  for (std::size_t i = 0; i < step_policy_names.size(); ++i)
    if (s == step_policy_names[i]) return static_cast<step_policy>(i);
  return std::nullopt;
}

enum class saved_role { checkpoint, activation, elementwise, state, routing };

// The store policy a preset gives a saved tensor of a role (`floating`: float or double data).
constexpr save_policy policy_for(step_policy p, saved_role r, bool floating) noexcept {
  switch (p) {
    case step_policy::keep: return keep;
    case step_policy::recompute: return r == saved_role::checkpoint ? keep : recompute;
    case step_policy::fp8: return floating ? fp8 : keep;
    case step_policy::offload: return offload;
    case step_policy::mixed:
      if (r == saved_role::elementwise) return recompute;
      if (r == saved_role::routing || !floating) return offload;
      return fp8 | offload;
  }
  return keep;
}

static_assert(policy_for(step_policy::recompute, saved_role::checkpoint, true) == keep);
static_assert(policy_for(step_policy::fp8, saved_role::routing, false) == keep);
static_assert(policy_for(step_policy::mixed, saved_role::activation, true) == (fp8 | offload));
static_assert(policy_for(step_policy::mixed, saved_role::elementwise, true) == recompute);

struct stack_config {
  index_t layers = 4;  // KDA layers before the MoE layer
  index_t tokens = 2048;
  index_t heads = 2, head_dim = 128;  // d = heads · head_dim; K = V = head_dim
  index_t experts = 16, top_k = 4, latent = 128, expert_ffn = 256;
  index_t conv_width = 4;
  double gate_lower_bound = -5.0;
  std::uint64_t seed = 0;
  index_t d() const noexcept { return heads * head_dim; }
};

// Tensors by name in a fixed order: the parameters, and their gradients in the same layout.
template <class T>
struct named_tensors {
  std::vector<std::string> names;
  std::vector<std::vector<index_t>> shapes;
  std::vector<std::vector<T>> values;

  std::size_t add(std::string name, std::vector<index_t> shape) {
    index_t n = 1;
    for (index_t e : shape) n *= e;
    names.push_back(std::move(name));
    shapes.push_back(std::move(shape));
    values.emplace_back(static_cast<std::size_t>(n), T(0));
    return names.size() - 1;
  }
  std::size_t size() const noexcept { return names.size(); }
  T* data(std::size_t i) noexcept { return values[i].data(); }
  T const* data(std::size_t i) const noexcept { return values[i].data(); }
};

template <class T>
struct stack_input {
  std::vector<T> x, dy;  // [tokens, d] each
};

template <class T>
struct step_result {
  named_tensors<T> gradients;
  std::vector<T> y;  // [tokens, d]
  pool_stats stats;  // the store's pools over the whole step
};

namespace detail {

inline void check_stack_config(stack_config const& c) {
  auto pos = [](char const* name, index_t v) {
    ::k3::detail::require(v >= 1, error_kind::value, [&] { return std::string("stack_config: '") + name + "' must be >= 1, got " + std::to_string(v); });
  };
  pos("layers", c.layers);
  pos("tokens", c.tokens);
  pos("heads", c.heads);
  pos("head_dim", c.head_dim);
  pos("experts", c.experts);
  pos("top_k", c.top_k);
  pos("latent", c.latent);
  pos("expert_ffn", c.expert_ffn);
  pos("conv_width", c.conv_width);
  ::k3::detail::require(c.top_k <= c.experts, error_kind::value, [&] {
    return "stack_config: 'top_k' must be <= experts (" + std::to_string(c.experts) + "), got " + std::to_string(c.top_k);
  });
  ::k3::detail::require(c.gate_lower_bound >= -5.0 && c.gate_lower_bound < 0.0, error_kind::value,
                        [&] { return "stack_config: 'gate_lower_bound' must lie in [-5, 0), got " + std::to_string(c.gate_lower_bound); });
}

// A seeded uniform source whose values do not depend on the standard library (splitmix64).
class stack_rng {
 public:
  explicit stack_rng(std::uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
  double uniform() noexcept {  // [-1, 1)
    std::uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0;
  }
  template <class T>
  void fill(std::vector<T>& v, double scale, double offset = 0.0) {
    for (auto& e : v) e = static_cast<T>(offset + scale * uniform());
  }

 private:
  std::uint64_t s_;
};

// Indices of one KDA layer's parameters in named_tensors, in order.
enum kda_param : std::size_t { w_q, w_k, w_v, w_g, w_beta, w_o, conv_q, conv_k, conv_v, a_log, dt_bias, kda_param_count };
enum moe_param : std::size_t { w_router, w_down, we_gate, we_up, we_down, norm_weight, w_up, moe_param_count };

// Row-major Eigen maps over flat buffers.
template <class T>
using stack_matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
Eigen::Map<stack_matrix<T> const> cmat(T const* p, index_t r, index_t c) {
  return {p, static_cast<Eigen::Index>(r), static_cast<Eigen::Index>(c)};
}
template <class T>
Eigen::Map<stack_matrix<T>> mat(T* p, index_t r, index_t c) {
  return {p, static_cast<Eigen::Index>(r), static_cast<Eigen::Index>(c)};
}

// out [rows, n] = x [rows, m] · Wᵀ with W [n, m].
template <class T>
void project(T const* x, T const* w, index_t rows, index_t m, index_t n, T* out) {
  mat(out, rows, n).noalias() = cmat(x, rows, m) * cmat(w, n, m).transpose();
}
// dW [n, m] = dyᵀ x (written), dx [rows, m] += dy · W.
template <class T>
void project_backward(T const* x, T const* w, T const* dy, index_t rows, index_t m, index_t n, T* dw, T* dx) {
  mat(dw, n, m).noalias() = cmat(dy, rows, n).transpose() * cmat(x, rows, m);
  mat(dx, rows, m).noalias() += cmat(dy, rows, n) * cmat(w, n, m);
}

// An aligned flat buffer (every tensor of the step lives in one: the same alignment for a
// first computation and its recomputation).
template <class E>
using flat = ::k3::tensor<E, 1>;
template <class E>
flat<E> make_flat(index_t n) {
  return flat<E>({n});
}

// What one layer saved, and its loads in the backward: each saved tensor is loaded from the
// store at most once, on first use (get), and kept in the layer's workspace until the layer's
// backward ends; recompute callables rebuild a tensor from get() of the tensors it came from.
template <class Bk>
class layer_saves {
 public:
  layer_saves(saved_tensor_store<Bk>& store, step_policy preset) : store_(store), preset_(preset) {}
  layer_saves(layer_saves const&) = delete;
  layer_saves& operator=(layer_saves const&) = delete;

  // Saves data [rows, cols] (a 2-D view of the tensor: FP8 blocks run along its last axis);
  // again(out) rewrites it, used when the preset recomputes this role.
  template <class E>
  std::size_t save(E const* data, index_t rows, index_t cols, saved_role role, std::function<void(E*)> again = {}) {
    constexpr bool floating = std::is_floating_point_v<E>;
    save_policy p = policy_for(preset_, role, floating);
    slot s;
    s.rows = rows;
    s.cols = cols;
    std::function<void(tensor_view<E, 2>)> rebuild;
    if (p == recompute) {
      ::k3::detail::require(static_cast<bool>(again), error_kind::value, "layer_saves: a tensor recomputed under this preset needs its recompute function");
      rebuild = [again = std::move(again), n = rows * cols](tensor_view<E, 2> out) {
        // Into an aligned buffer first, as every first computation of the step runs.
        flat<E> tmp = make_flat<E>(n);
        again(tmp.data());
        if (n) std::memcpy(out.data_handle(), tmp.data(), static_cast<std::size_t>(n) * sizeof(E));
      };
    }
    s.handle = store_.save(tensor_view<E const, 2>(data, {rows, cols}), p, std::move(rebuild));
    s.load = [this](slot& me) {
      flat<E> buf = make_flat<E>(me.rows * me.cols);
      store_.load(me.handle, tensor_view<E, 2>(buf.data(), {me.rows, me.cols}));
      me.data = std::make_shared<flat<E>>(std::move(buf));
      me.ptr = static_cast<void*>(static_cast<flat<E>*>(me.data.get())->data());
    };
    slots_.push_back(std::move(s));
    return slots_.size() - 1;
  }

  template <class E>
  E* get(std::size_t id) {
    slot& s = slots_[id];
    if (!s.ptr && !s.data) s.load(s);
    return static_cast<E*>(s.ptr);
  }

  void prefetch_all() {
    for (auto& s : slots_)
      if (!s.data) store_.prefetch(s.handle);
  }
  // Loads every saved tensor (in the order saved; recompute pulls its sources on the way).
  void load_all() {
    for (auto& s : slots_)
      if (!s.data) s.load(s);
  }
  void clear() { slots_.clear(); }

 private:
  struct slot {
    saved_handle handle;
    index_t rows = 0, cols = 0;
    std::shared_ptr<void> data;  // the loaded tensor (a flat<E>)
    void* ptr = nullptr;
    std::function<void(slot&)> load;
  };
  saved_tensor_store<Bk>& store_;
  step_policy preset_;
  std::vector<slot> slots_;
};

// One KDA layer's forward: y = x + KDA(pre-processing(x)) W_oᵀ, saving what the backward needs.
template <class T, HostBackend Bk>
struct kda_layer {
  using S = k3::accumulation_t<T>;
  enum saved_id : std::size_t { x_, qr_, kr_, vr_, gr_, br_, qc_, kc_, q_, k_, v_, g_, beta_, states_, o_ };

  Bk const& b;
  stack_config const& c;
  std::array<T const*, kda_param_count> w;
  layer_saves<Bk> sv;

  kda_layer(Bk const& be, stack_config const& cfg, named_tensors<T> const& p, std::size_t first, saved_tensor_store<Bk>& store, step_policy pre)
      : b(be), c(cfg), sv(store, pre) {
    for (std::size_t i = 0; i < kda_param_count; ++i) w[i] = p.data(first + i);
  }

  index_t T_() const { return c.tokens; }
  ::k3::kda::options kda_options() const {
    ::k3::kda::options o;
    o.gate_lower_bound = c.gate_lower_bound;
    return o;
  }
  tensor_view<T, 4> heads4(T* p) const { return {p, {1, c.tokens, c.heads, c.head_dim}}; }
  tensor_view<T const, 4> heads4(T const* p) const { return {p, {1, c.tokens, c.heads, c.head_dim}}; }
  tensor_view<T const, 3> seq3(T const* p) const { return {p, {1, c.tokens, c.d()}}; }
  tensor_view<T, 3> seq3(T* p) const { return {p, {1, c.tokens, c.d()}}; }
  tensor_view<T const, 2> conv_weight(std::size_t i) const { return {w[i], {c.d(), c.conv_width}}; }
  tensor_view<T const, 1> a_log_view() const { return {w[a_log], {c.heads}}; }
  tensor_view<T const, 2> dt_bias_view() const { return {w[dt_bias], {c.heads, c.head_dim}}; }

  void conv(T const* in, std::size_t weight, T* out) const {
    ::k3::kda::short_conv(b, ::k3::kda::short_conv_args<T>{.x = seq3(in), .weight = conv_weight(weight), .y = seq3(out)});
  }
  void norm(T const* in, T* out) const { ::k3::kda::l2norm(b, ::k3::kda::l2norm_args<T>{.x = heads4(in), .y = heads4(out)}); }
  void gate(T const* in, T* out) const {
    ::k3::kda::gate_lower_bound(b, ::k3::kda::gate_args<T>{.x = heads4(in), .A_log = a_log_view(), .dt_bias = dt_bias_view(), .g = heads4(out)},
                                {.lower_bound = c.gate_lower_bound});
  }
  void beta(T const* in, T* out) const {
    ::k3::kda::beta_sigmoid(b, ::k3::kda::beta_sigmoid_args<T>{.x = tensor_view<T const, 3>(in, {1, c.tokens, c.heads}),
                                                               .beta = tensor_view<T, 3>(out, {1, c.tokens, c.heads})});
  }
  // The per-chunk states' shape, k3::kda::saved_shape of the forward's q and v (set by forward).
  ::k3::array<index_t, 3> states_ext{};
  ::k3::array<index_t, 3> states_shape() const { return states_ext; }
  index_t states_size() const {
    auto const s = states_shape();
    return s[0] * s[1] * s[2];
  }
  void attend(T const* q, T const* k, T const* v, T const* g, T const* bt, T* o, S* states) const {
    ::k3::kda::forward_args<T, S> a;
    a.q = heads4(q);
    a.k = heads4(k);
    a.v = heads4(v);
    a.g = heads4(g);
    a.beta = tensor_view<T const, 3>(bt, {1, c.tokens, c.heads});
    a.o = heads4(o);
    a.saved = tensor_view<S, 3>(states, states_shape());
    ::k3::kda::forward(b, a, kda_options());
  }
  // The attention from the saved (or recomputed) inputs, writing o or the states.
  void attend_again(T* o, S* states) {
    flat<T> o_tmp = make_flat<T>(o ? 0 : T_() * c.d());
    flat<S> s_tmp = make_flat<S>(states ? 0 : states_size());
    attend(sv.template get<T>(q_), sv.template get<T>(k_), sv.template get<T>(v_), sv.template get<T>(g_), sv.template get<T>(beta_),
           o ? o : o_tmp.data(), states ? states : s_tmp.data());
  }

  void forward(T const* x, T* y) {
    index_t const Tn = T_(), d = c.d(), H = c.heads;
    auto buf = [&](index_t n) { return make_flat<T>(n); };
    flat<T> qr = buf(Tn * d), kr = buf(Tn * d), vr = buf(Tn * d), gr = buf(Tn * d), br = buf(Tn * H);
    flat<T> qc = buf(Tn * d), kc = buf(Tn * d), q = buf(Tn * d), k = buf(Tn * d), v = buf(Tn * d), g = buf(Tn * d), bt = buf(Tn * H),
            o = buf(Tn * d);
    {
      ::k3::kda::forward_args<T, S> shape_of;
      shape_of.q = heads4(static_cast<T const*>(q.data()));
      shape_of.v = heads4(static_cast<T const*>(v.data()));
      auto const e = ::k3::kda::saved_shape(shape_of, kda_options());
      states_ext = {e[0], e[1], e[2]};
    }
    flat<S> states = make_flat<S>(states_size());
    project(x, w[w_q], Tn, d, d, qr.data());
    project(x, w[w_k], Tn, d, d, kr.data());
    project(x, w[w_v], Tn, d, d, vr.data());
    project(x, w[w_g], Tn, d, d, gr.data());
    project(x, w[w_beta], Tn, d, H, br.data());
    conv(qr.data(), conv_q, qc.data());
    conv(kr.data(), conv_k, kc.data());
    conv(vr.data(), conv_v, v.data());
    norm(qc.data(), q.data());
    norm(kc.data(), k.data());
    gate(gr.data(), g.data());
    beta(br.data(), bt.data());
    attend(q.data(), k.data(), v.data(), g.data(), bt.data(), o.data(), states.data());
    std::memcpy(y, x, static_cast<std::size_t>(Tn * d) * sizeof(T));
    mat(y, Tn, d).noalias() += cmat(o.data(), Tn, d) * cmat(w[w_o], d, d).transpose();

    // Saved in the order of saved_id; each recompute function names the tensors it reads.
    using R = saved_role;
    auto gt = [this](std::size_t id) { return sv.template get<T>(id); };
    sv.template save<T>(x, Tn, d, R::checkpoint);
    sv.template save<T>(qr.data(), Tn, d, R::activation, [this, gt](T* out) { project(gt(x_), w[w_q], T_(), c.d(), c.d(), out); });
    sv.template save<T>(kr.data(), Tn, d, R::activation, [this, gt](T* out) { project(gt(x_), w[w_k], T_(), c.d(), c.d(), out); });
    sv.template save<T>(vr.data(), Tn, d, R::activation, [this, gt](T* out) { project(gt(x_), w[w_v], T_(), c.d(), c.d(), out); });
    sv.template save<T>(gr.data(), Tn, d, R::activation, [this, gt](T* out) { project(gt(x_), w[w_g], T_(), c.d(), c.d(), out); });
    sv.template save<T>(br.data(), Tn, H, R::activation, [this, gt](T* out) { project(gt(x_), w[w_beta], T_(), c.d(), c.heads, out); });
    sv.template save<T>(qc.data(), Tn, d, R::elementwise, [this, gt](T* out) { conv(gt(qr_), conv_q, out); });
    sv.template save<T>(kc.data(), Tn, d, R::elementwise, [this, gt](T* out) { conv(gt(kr_), conv_k, out); });
    sv.template save<T>(q.data(), Tn * H, c.head_dim, R::elementwise, [this, gt](T* out) { norm(gt(qc_), out); });
    sv.template save<T>(k.data(), Tn * H, c.head_dim, R::elementwise, [this, gt](T* out) { norm(gt(kc_), out); });
    sv.template save<T>(v.data(), Tn, d, R::elementwise, [this, gt](T* out) { conv(gt(vr_), conv_v, out); });
    sv.template save<T>(g.data(), Tn * H, c.head_dim, R::elementwise, [this, gt](T* out) { gate(gt(gr_), out); });
    sv.template save<T>(bt.data(), Tn, H, R::elementwise, [this, gt](T* out) { beta(gt(br_), out); });
    auto const ss = states_shape();
    sv.template save<S>(states.data(), ss[0] * ss[1], ss[2], R::state, [this](S* out) { attend_again(nullptr, out); });
    sv.template save<T>(o.data(), Tn, d, R::activation, [this](T* out) { attend_again(out, nullptr); });
  }

  // dx [tokens, d] from dy; the layer's parameter gradients into gw (its slots of the gradients).
  void backward(T const* dy, T* dx, std::array<T*, kda_param_count> gw) {
    index_t const Tn = T_(), d = c.d(), H = c.heads;
    sv.load_all();
    auto gt = [this](std::size_t id) { return sv.template get<T>(id); };
    auto buf = [&](index_t n) { return make_flat<T>(n); };
    std::memcpy(dx, dy, static_cast<std::size_t>(Tn * d) * sizeof(T));
    flat<T> d_o = buf(Tn * d), dq = buf(Tn * d), dk = buf(Tn * d), dv = buf(Tn * d), dg = buf(Tn * d), dbt = buf(Tn * H);
    mat(gw[w_o], d, d).noalias() = cmat(dy, Tn, d).transpose() * cmat(gt(o_), Tn, d);
    mat(d_o.data(), Tn, d).noalias() = cmat(dy, Tn, d) * cmat(w[w_o], d, d);
    {
      ::k3::kda::backward_args<T, S> a;
      a.q = heads4(static_cast<T const*>(gt(q_)));
      a.k = heads4(static_cast<T const*>(gt(k_)));
      a.v = heads4(static_cast<T const*>(gt(v_)));
      a.g = heads4(static_cast<T const*>(gt(g_)));
      a.beta = tensor_view<T const, 3>(gt(beta_), {1, Tn, H});
      a.d_o = heads4(static_cast<T const*>(d_o.data()));
      a.dq = heads4(dq.data());
      a.dk = heads4(dk.data());
      a.dv = heads4(dv.data());
      a.dg = heads4(dg.data());
      a.dbeta = tensor_view<T, 3>(dbt.data(), {1, Tn, H});
      a.saved = tensor_view<S const, 3>(sv.template get<S>(states_), states_shape());
      ::k3::kda::backward(b, a, kda_options());
    }
    flat<T> dbr = buf(Tn * H), dgr = buf(Tn * d), dqc = buf(Tn * d), dkc = buf(Tn * d), dqr = buf(Tn * d), dkr = buf(Tn * d), dvr = buf(Tn * d);
    ::k3::kda::beta_sigmoid_backward(b, ::k3::kda::beta_sigmoid_backward_args<T>{.x = tensor_view<T const, 3>(gt(br_), {1, Tn, H}),
                                                                                 .d_beta = tensor_view<T const, 3>(dbt.data(), {1, Tn, H}),
                                                                                 .d_x = tensor_view<T, 3>(dbr.data(), {1, Tn, H})});
    ::k3::kda::gate_lower_bound_backward(
        b,
        ::k3::kda::gate_backward_args<T>{.x = heads4(static_cast<T const*>(gt(gr_))), .A_log = a_log_view(), .dt_bias = dt_bias_view(),
                                         .d_g = heads4(static_cast<T const*>(dg.data())), .d_x = heads4(dgr.data()),
                                         .d_A_log = tensor_view<T, 1>(gw[a_log], {H}), .d_dt_bias = tensor_view<T, 2>(gw[dt_bias], {H, c.head_dim})},
        {.lower_bound = c.gate_lower_bound});
    ::k3::kda::l2norm_backward(b, ::k3::kda::l2norm_backward_args<T>{.x = heads4(static_cast<T const*>(gt(qc_))),
                                                                     .d_y = heads4(static_cast<T const*>(dq.data())), .d_x = heads4(dqc.data())});
    ::k3::kda::l2norm_backward(b, ::k3::kda::l2norm_backward_args<T>{.x = heads4(static_cast<T const*>(gt(kc_))),
                                                                     .d_y = heads4(static_cast<T const*>(dk.data())), .d_x = heads4(dkc.data())});
    auto conv_back = [&](std::size_t in_id, std::size_t weight, T const* dout, T* din) {
      ::k3::kda::short_conv_backward(b, ::k3::kda::short_conv_backward_args<T>{.x = seq3(static_cast<T const*>(gt(in_id))), .weight = conv_weight(weight),
                                                                               .d_y = seq3(dout), .d_x = seq3(din),
                                                                               .d_weight = tensor_view<T, 2>(gw[weight], {d, c.conv_width})});
    };
    conv_back(qr_, conv_q, dqc.data(), dqr.data());
    conv_back(kr_, conv_k, dkc.data(), dkr.data());
    conv_back(vr_, conv_v, dv.data(), dvr.data());
    T const* x = gt(x_);
    project_backward(x, w[w_q], dqr.data(), Tn, d, d, gw[w_q], dx);
    project_backward(x, w[w_k], dkr.data(), Tn, d, d, gw[w_k], dx);
    project_backward(x, w[w_v], dvr.data(), Tn, d, d, gw[w_v], dx);
    project_backward(x, w[w_g], dgr.data(), Tn, d, d, gw[w_g], dx);
    project_backward(x, w[w_beta], dbr.data(), Tn, d, H, gw[w_beta], dx);
    sv.clear();
  }
};

// The MoE layer: y = x + latent_moe(x), its input and state saved through the store by
// k3/train/latent_moe_saves.hpp.
template <class T, HostBackend Bk>
struct moe_layer {
  Bk const& b;
  stack_config const& c;
  std::array<T const*, moe_param_count> w;
  saved_tensor_store<Bk>& store;
  step_policy preset;
  std::optional<latent_moe_record<T, Bk>> rec;

  moe_layer(Bk const& be, stack_config const& cfg, named_tensors<T> const& p, std::size_t first, saved_tensor_store<Bk>& st, step_policy pre)
      : b(be), c(cfg), store(st), preset(pre) {
    for (std::size_t i = 0; i < moe_param_count; ++i) w[i] = p.data(first + i);
  }

  ::k3::moe::latent_moe_options options() const {
    ::k3::moe::latent_moe_options o;
    o.k = c.top_k;
    return o;
  }
  ::k3::moe::latent_moe_args<T> args(T const* x) const {
    index_t const d = c.d(), n = c.experts, l = c.latent, f = c.expert_ffn;
    ::k3::moe::latent_moe_args<T> a;
    a.x = const_view<T, 2>(x, {c.tokens, d});
    a.w_router = const_view<T, 2>(w[w_router], {n, d});
    a.w_down = const_view<T, 2>(w[w_down], {l, d});
    a.we_gate = const_view<T, 3>(w[we_gate], {n, f, l});
    a.we_up = const_view<T, 3>(w[we_up], {n, f, l});
    a.we_down = const_view<T, 3>(w[we_down], {n, l, f});
    a.norm_weight = const_view<T, 1>(w[norm_weight], {l});
    a.w_up = const_view<T, 2>(w[w_up], {d, l});
    return a;
  }

  void forward(T const* x, T* y) {
    index_t const Tn = c.tokens, d = c.d();
    auto a = args(x);
    a.y = tensor_view<T, 2>(y, {Tn, d});
    using R = saved_role;
    latent_moe_policies const p{policy_for(preset, R::checkpoint, true), policy_for(preset, R::activation, true), policy_for(preset, R::routing, true)};
    rec = latent_moe_forward(b, latent_moe_forward_args<Bk, T>{&store, a}, {options(), p});
    for (index_t i = 0; i < Tn * d; ++i) y[i] += x[i];
  }

  void backward(T const* dy, T* dx, std::array<T*, moe_param_count> gw) {
    index_t const Tn = c.tokens, d = c.d(), n = c.experts, l = c.latent, f = c.expert_ffn;
    ::k3::moe::latent_moe_gradients<T> g;
    g.dy = const_view<T, 2>(dy, {Tn, d});
    g.dx = tensor_view<T, 2>(dx, {Tn, d});
    g.dw_router = tensor_view<T, 2>(gw[w_router], {n, d});
    g.dw_down = tensor_view<T, 2>(gw[w_down], {l, d});
    g.dwe_gate = tensor_view<T, 3>(gw[we_gate], {n, f, l});
    g.dwe_up = tensor_view<T, 3>(gw[we_up], {n, f, l});
    g.dwe_down = tensor_view<T, 3>(gw[we_down], {n, l, f});
    g.dnorm_weight = tensor_view<T, 1>(gw[norm_weight], {l});
    g.dw_up = tensor_view<T, 2>(gw[w_up], {d, l});
    latent_moe_backward(b, latent_moe_backward_args<Bk, T>{&store, &*rec, args(nullptr), g}, options());
    for (index_t i = 0; i < Tn * d; ++i) dx[i] += dy[i];
    rec.reset();
  }
};

}  // namespace detail

// The stack's parameters for c, seeded by c.seed: per KDA layer i "kda<i>.w_q", w_k, w_v, w_g
// [d, d], w_beta [heads, d], w_o [d, d], conv_q, conv_k, conv_v [d, conv_width], A_log [heads],
// dt_bias [heads, head_dim]; then "moe.w_router" [experts, d], w_down [latent, d], we_gate,
// we_up [experts, expert_ffn, latent], we_down [experts, latent, expert_ffn], norm_weight
// [latent], w_up [d, latent].
template <class T>
named_tensors<T> stack_parameters(stack_config const& c) {
  detail::check_stack_config(c);
  named_tensors<T> p;
  detail::stack_rng rng(c.seed);
  index_t const d = c.d(), H = c.heads, K = c.head_dim;
  auto inv_sqrt = [](index_t n) { return 1.0 / std::sqrt(static_cast<double>(n)); };
  for (index_t i = 0; i < c.layers; ++i) {
    std::string const pre = "kda" + std::to_string(i) + ".";
    for (char const* nm : {"w_q", "w_k", "w_v", "w_g"}) rng.fill(p.values[p.add(pre + nm, {d, d})], inv_sqrt(d));
    rng.fill(p.values[p.add(pre + "w_beta", {H, d})], inv_sqrt(d));
    rng.fill(p.values[p.add(pre + "w_o", {d, d})], inv_sqrt(d));
    for (char const* nm : {"conv_q", "conv_k", "conv_v"}) rng.fill(p.values[p.add(pre + nm, {d, c.conv_width})], 0.5);
    rng.fill(p.values[p.add(pre + "A_log", {H})], 0.5);
    rng.fill(p.values[p.add(pre + "dt_bias", {H, K})], 0.5);
  }
  index_t const n = c.experts, l = c.latent, f = c.expert_ffn;
  rng.fill(p.values[p.add("moe.w_router", {n, d})], inv_sqrt(d));
  rng.fill(p.values[p.add("moe.w_down", {l, d})], inv_sqrt(d));
  rng.fill(p.values[p.add("moe.we_gate", {n, f, l})], inv_sqrt(l));
  rng.fill(p.values[p.add("moe.we_up", {n, f, l})], inv_sqrt(l));
  rng.fill(p.values[p.add("moe.we_down", {n, l, f})], inv_sqrt(f));
  rng.fill(p.values[p.add("moe.norm_weight", {l})], 0.1, 1.0);
  rng.fill(p.values[p.add("moe.w_up", {d, l})], inv_sqrt(l));
  return p;
}

// x and dy [tokens, d], seeded by c.seed (a stream apart from the parameters').
template <class T>
stack_input<T> stack_inputs(stack_config const& c) {
  detail::check_stack_config(c);
  stack_input<T> in;
  detail::stack_rng rng(~c.seed);
  in.x.resize(static_cast<std::size_t>(c.tokens * c.d()));
  in.dy.resize(in.x.size());
  rng.fill(in.x, 1.0);
  rng.fill(in.dy, 1.0);
  return in;
}

// What a step reads: the parameters (stack_parameters<T>(config) or trained ones of the same
// shapes) and the input x with the output gradient dy.
template <class T>
struct train_step_args {
  named_tensors<T> const* parameters = nullptr;
  stack_input<T> const* input = nullptr;
};
struct train_step_options {
  stack_config config = {};
  step_policy policy = step_policy::keep;  // what every saved tensor is stored as
};

// Forward and backward of the stack with every saved tensor under the policy's preset.
template <class T, HostBackend Bk>
step_result<T> train_step(Bk const& b, train_step_args<T> const& args, train_step_options const& opt = {}) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "train_step: float or double parameters");
  ::k3::detail::require(args.parameters != nullptr && args.input != nullptr, error_kind::value,
                        "train_step: arguments 'parameters', 'input': required");
  stack_config const& c = opt.config;
  named_tensors<T> const& params = *args.parameters;
  stack_input<T> const& in = *args.input;
  step_policy const preset = opt.policy;
  detail::check_stack_config(c);
  std::size_t const expected = static_cast<std::size_t>(c.layers) * detail::kda_param_count + detail::moe_param_count;
  ::k3::detail::require(params.size() == expected, error_kind::shape, [&] {
    return "train_step: argument 'parameters': expected " + std::to_string(expected) + " tensors (stack_parameters of the same config), got " +
           std::to_string(params.size());
  });
  named_tensors<T> shape_ref = stack_parameters<T>(stack_config{c.layers, 1, c.heads, c.head_dim, c.experts, c.top_k, c.latent, c.expert_ffn,
                                                                 c.conv_width, c.gate_lower_bound, 0});
  for (std::size_t i = 0; i < expected; ++i)
    ::k3::detail::require(params.shapes[i] == shape_ref.shapes[i] && params.values[i].size() == shape_ref.values[i].size(), error_kind::shape,
                          [&] { return "train_step: argument 'parameters': tensor '" + params.names[i] + "' has another shape than the config's"; });
  std::size_t const td = static_cast<std::size_t>(c.tokens * c.d());
  ::k3::detail::require(in.x.size() == td && in.dy.size() == td, error_kind::shape, [&] {
    return "train_step: argument 'input': x and dy must hold tokens * d = " + std::to_string(td) + " values, got " + std::to_string(in.x.size()) +
           " and " + std::to_string(in.dy.size());
  });

  saved_tensor_store<Bk> store(b);
  std::vector<std::unique_ptr<detail::kda_layer<T, Bk>>> kda;
  for (index_t i = 0; i < c.layers; ++i)
    kda.push_back(std::make_unique<detail::kda_layer<T, Bk>>(b, c, params, static_cast<std::size_t>(i) * detail::kda_param_count, store, preset));
  detail::moe_layer<T, Bk> moe(b, c, params, static_cast<std::size_t>(c.layers) * detail::kda_param_count, store, preset);

  step_result<T> r;
  std::vector<T> h = in.x, next(td);
  for (auto& layer : kda) {
    layer->forward(h.data(), next.data());
    std::swap(h, next);
  }
  r.y.resize(td);
  moe.forward(h.data(), r.y.data());

  r.gradients = params;
  for (auto& v : r.gradients.values) std::fill(v.begin(), v.end(), T(0));
  std::vector<T> dh(td), dnext(td);
  auto slots = [&](std::size_t first, auto count) {
    std::array<T*, decltype(count)::value> out{};
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = r.gradients.data(first + i);
    return out;
  };
  // Offloaded tensors of the layer after the current one come back while the current one
  // computes: each KDA layer loads its own tensors first, then prefetches the next layer's.
  if (!kda.empty()) kda.back()->sv.prefetch_all();
  moe.backward(in.dy.data(), dh.data(),
               slots(static_cast<std::size_t>(c.layers) * detail::kda_param_count, std::integral_constant<std::size_t, detail::moe_param_count>{}));
  for (index_t i = c.layers; i-- > 0;) {
    kda[static_cast<std::size_t>(i)]->sv.load_all();
    if (i > 0) kda[static_cast<std::size_t>(i - 1)]->sv.prefetch_all();
    kda[static_cast<std::size_t>(i)]->backward(dh.data(), dnext.data(),
                                               slots(static_cast<std::size_t>(i) * detail::kda_param_count,
                                                     std::integral_constant<std::size_t, detail::kda_param_count>{}));
    std::swap(dh, dnext);
  }
  r.stats = store.stats();
  return r;
}

}  // namespace k3::train
