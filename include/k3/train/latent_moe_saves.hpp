// k3/train/latent_moe_saves.hpp — the Stable LatentMoE layer's training path on a saved-tensor
// store: the forward saves its input and its state (latent_moe_saved: z, h_gate, h_up, the
// normalised u, the routing) tensor by tensor under policies, the backward loads each once.
//
//   auto rec = k3::train::latent_moe_forward(cpu, k3::train::latent_moe_forward_args<Backend, float>{.store = &store, .layer = args},
//                                            {.layer = options, .policies = {.input = k3::train::fp8 | k3::train::offload,
//                                                                            .activations = k3::train::fp8 | k3::train::offload,
//                                                                            .routing = k3::train::offload}});
//   ...
//   k3::train::latent_moe_prefetch(cpu, k3::train::latent_moe_prefetch_args<Backend, float>{&store, &rec});  // optional
//   k3::train::latent_moe_backward(cpu, k3::train::latent_moe_backward_args<Backend, float>{.store = &store, .record = &rec,
//                                  .layer = args /* the weights */, .gradients = grads}, options);
//
// Policies: `input` for x (not recompute: it is the caller's tensor); `activations` for z,
// h_gate, h_up, the normalised u and the shared experts' pre-activations; `routing` for expert
// ids, slots and offsets (integers: an fp8 bit is dropped for them), the probabilities and the
// per-token scalars. `recompute` for activations or routing stores nothing for them: the first
// load reruns the layer's forward from the loaded x (same bits: the forward is deterministic).
// With keep or offload the gradients are latent_moe_backward's with a filled latent_moe_saved,
// bit for bit; fp8 rounds what it stores.
#pragma once
#include <Eigen/Core>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/tensor.hpp"
#include "k3/moe/latent_moe.hpp"
#include "k3/train/saved_tensors.hpp"

namespace k3::train {

struct latent_moe_policies {
  save_policy input = keep, activations = keep, routing = keep;
};

namespace detail {

// Every tensor of a filled layer state, in a fixed order: f(id, data, rows, cols, routing),
// data typed (C*, index_t* or unsigned char*). size_state gives a state the shapes of st.m, st.o.
template <class C, class F>
void each_state_tensor(::k3::moe::detail::lm_state<C>& st, F&& f) {
  index_t const T = st.m.T, k = st.o.k, slots = T * k;
  std::size_t id = 0;
  f(id++, st.Z.data(), T, st.m.l, false);
  f(id++, st.Hg.data(), slots, st.m.f, false);
  f(id++, st.Hu.data(), slots, st.m.f, false);
  f(id++, st.Nrm.data(), T, st.m.l, false);
  for (auto& h : st.sHg) f(id++, h.data(), T, st.m.F, false);
  for (auto& h : st.sHu) f(id++, h.data(), T, st.m.F, false);
  f(id++, st.rstd.data(), index_t(1), T, true);
  f(id++, st.denom.data(), index_t(1), T, true);
  f(id++, st.p.data(), T, k, true);
  f(id++, st.ssel.data(), T, k, true);
  f(id++, st.idx.data(), T, k, true);
  f(id++, st.slot.data(), T, k, true);
  f(id++, st.offs.data(), index_t(1), st.m.n + 1, true);
  f(id++, st.zero_sum.data(), index_t(1), T, true);
}

template <class C>
void size_state(::k3::moe::detail::lm_state<C>& st) {
  auto const T = static_cast<Eigen::Index>(st.m.T), slots = static_cast<Eigen::Index>(st.m.T * st.o.k);
  st.Z.resize(T, st.m.l);
  st.Hg.resize(slots, st.m.f);
  st.Hu.resize(slots, st.m.f);
  st.Nrm.resize(T, st.m.l);
  st.sHg.assign(static_cast<std::size_t>(st.m.s), {});
  st.sHu.assign(static_cast<std::size_t>(st.m.s), {});
  for (auto& h : st.sHg) h.resize(T, st.m.F);
  for (auto& h : st.sHu) h.resize(T, st.m.F);
  st.rstd.assign(static_cast<std::size_t>(T), C(0));
  st.denom.assign(static_cast<std::size_t>(T), C(0));
  st.p.assign(static_cast<std::size_t>(slots), C(0));
  st.ssel.assign(static_cast<std::size_t>(slots), C(0));
  st.idx.assign(static_cast<std::size_t>(slots), 0);
  st.slot.assign(static_cast<std::size_t>(slots), 0);
  st.offs.assign(static_cast<std::size_t>(st.m.n + 1), 0);
  st.zero_sum.assign(static_cast<std::size_t>(T), 0);
}

// The policy for a tensor of element type E under p: no fp8 for integers.
template <class E>
constexpr save_policy for_element(save_policy p) noexcept {
  if constexpr (std::is_floating_point_v<E>) return p;
  else return has_policy(p, fp8) ? (has_policy(p, offload) ? offload : keep) : p;
}

// The layer's forward rerun once for every state tensor saved under recompute.
template <class T, class Bk>
struct lm_replay {
  Bk const* b = nullptr;
  ::k3::moe::latent_moe_args<T> a{};  // weights; x set at the backward
  ::k3::moe::latent_moe_options o{};
  std::unique_ptr<::k3::moe::latent_moe_saved<T>> state;
  void write(std::size_t id, void* out) {
    ::k3::detail::require(a.x.data_handle() != nullptr || a.x.size() == 0, error_kind::value, "latent_moe_backward: a recompute before x was loaded");
    if (!state) {
      state = std::make_unique<::k3::moe::latent_moe_saved<T>>();
      ::k3::tensor<T, 2> y({a.x.extent(0), a.w_up.extent(0)});
      auto run = a;
      run.y = y.view();
      run.indices = {};
      run.weights = {};
      run.saved = state.get();
      ::k3::moe::latent_moe_forward(*b, run, o);
    }
    each_state_tensor(state->state, [&](std::size_t i, auto* data, index_t rows, index_t cols, bool) {
      if (i == id && rows * cols > 0) std::memcpy(out, data, static_cast<std::size_t>(rows * cols) * sizeof(*data));
    });
  }
};

}  // namespace detail

// What latent_moe_forward saved: x's and each state tensor's handle.
template <class T, class Bk>
struct latent_moe_record {
  saved_handle x;
  std::vector<saved_handle> state;
  ::k3::moe::detail::lm_dims dims{};
  ::k3::moe::latent_moe_options options{};
  std::shared_ptr<detail::lm_replay<T, Bk>> replay;
};

// The store is a member of the args (the one call shape: backend, args, options).
template <class Bk, class T>
struct latent_moe_forward_args {
  saved_tensor_store<Bk>* store = nullptr;  // receives x and the layer's state
  ::k3::moe::latent_moe_args<T> layer;      // y, indices, weights as given; layer.saved is not used
};
struct latent_moe_forward_options {
  ::k3::moe::latent_moe_options layer = {};
  latent_moe_policies policies = {};
};
template <class Bk, class T>
struct latent_moe_backward_args {
  saved_tensor_store<Bk>* store = nullptr;
  latent_moe_record<T, Bk>* record = nullptr;  // the forward's; its one-shot handles are consumed
  ::k3::moe::latent_moe_args<T> layer;         // the weights (x and saved are not read)
  ::k3::moe::latent_moe_gradients<T> gradients;
};
template <class Bk, class T>
struct latent_moe_prefetch_args {
  saved_tensor_store<Bk>* store = nullptr;
  latent_moe_record<T, Bk> const* record = nullptr;
};

namespace detail {
inline void require_moe_store(bool given, char const* op) {
  ::k3::detail::require(given, error_kind::value, [&] { return std::string(op) + ": arguments 'store', 'record': required"; });
}
}  // namespace detail

// The layer's forward (y, indices, weights as given in args.layer; its saved is not used),
// saving x and the state through the store.
template <HostBackend Bk, class T>
latent_moe_record<T, Bk> latent_moe_forward(Bk const& b, latent_moe_forward_args<Bk, T> const& args, latent_moe_forward_options const& opt = {}) {
  detail::require_moe_store(args.store != nullptr, "latent_moe_forward");
  auto& store = *args.store;
  auto a = args.layer;
  auto const& o = opt.layer;
  auto const& p = opt.policies;
  ::k3::detail::require(!has_policy(p.input, recompute), error_kind::value, "latent_moe_forward: policy recompute for 'input': x is the caller's tensor, nothing here can recompute it");
  ::k3::moe::latent_moe_saved<T> saved;
  a.saved = &saved;
  ::k3::moe::latent_moe_forward(b, a, o);
  latent_moe_record<T, Bk> r;
  r.dims = saved.state.m;
  r.options = o;
  r.replay = std::make_shared<detail::lm_replay<T, Bk>>();
  r.replay->b = &b;
  r.replay->a = a;
  r.replay->a.x = {};
  r.replay->a.saved = nullptr;
  r.replay->o = o;
  r.x = store.save(a.x, p.input);
  detail::each_state_tensor(saved.state, [&](std::size_t id, auto* data, index_t rows, index_t cols, bool routing) {
    using E = std::remove_pointer_t<decltype(data)>;
    save_policy const pol = detail::for_element<E>(routing ? p.routing : p.activations);
    std::function<void(tensor_view<E, 2>)> again;
    if (pol == recompute) again = [rp = r.replay, id](tensor_view<E, 2> out) { rp->write(id, out.data_handle()); };
    r.state.push_back(store.save(tensor_view<E const, 2>(data, {rows, cols}), pol, std::move(again)));
  });
  return r;
}

// Starts bringing the record's offloaded tensors back (see saved_tensor_store::prefetch).
template <HostBackend Bk, class T>
void latent_moe_prefetch(Bk const&, latent_moe_prefetch_args<Bk, T> const& args) {
  detail::require_moe_store(args.store != nullptr && args.record != nullptr, "latent_moe_prefetch");
  auto& store = *args.store;
  auto const& r = *args.record;
  store.prefetch(r.x);
  for (auto h : r.state) store.prefetch(h);
}

// The layer's backward from what the record saved: args.layer gives the weights (its x and
// saved are not read; y, indices, weights are not written), args.gradients dy and the gradients.
template <HostBackend Bk, class T>
void latent_moe_backward(Bk const& b, latent_moe_backward_args<Bk, T> const& args, ::k3::moe::latent_moe_options const& o = {}) {
  detail::require_moe_store(args.store != nullptr && args.record != nullptr, "latent_moe_backward");
  auto& store = *args.store;
  auto& r = *args.record;
  auto a = args.layer;
  auto const& g = args.gradients;
  ::k3::detail::require(::k3::moe::detail::lm_same_options<double>(o, r.options), error_kind::value,
                        "latent_moe_backward: options differ from the forward's that filled the record");
  ::k3::tensor<T, 2> x({r.dims.T, r.dims.d});
  store.load(r.x, x.view());
  r.replay->a.x = x.view();
  ::k3::moe::latent_moe_saved<T> saved;
  auto& st = saved.state;
  st.m = r.dims;
  st.o = r.options;
  detail::size_state(st);
  detail::each_state_tensor(st, [&](std::size_t id, auto* data, index_t rows, index_t cols, bool) {
    using E = std::remove_pointer_t<decltype(data)>;
    store.load(r.state[id], tensor_view<E, 2>(data, {rows, cols}));
  });
  st.filled = true;
  r.replay.reset();
  a.x = x.view();
  a.y = {};
  a.indices = {};
  a.weights = {};
  a.saved = &saved;
  ::k3::moe::latent_moe_backward(b, ::k3::moe::latent_moe_backward_args<T>{a, g}, o);
}

}  // namespace k3::train
