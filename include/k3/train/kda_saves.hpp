// k3/train/kda_saves.hpp — KDA's training path on a saved-tensor store: the forward saves q, k,
// v, g, beta (and h0) and the chunked form's per-chunk states (forward_args::saved) under
// policies, the backward loads each once.
//
//   auto rec = k3::train::kda_forward(cpu, k3::train::kda_forward_args<Backend, float>{.store = &store, .kda = fwd_args},
//                                     {.kda = options, .policies = {.inputs = k3::train::offload,
//                                                                   .states = k3::train::fp8 | k3::train::offload}});
//   ...
//   k3::train::kda_prefetch(cpu, {.store = &store, .record = &rec});
//   k3::train::kda_backward(cpu, k3::train::kda_backward_args<Backend, float>{.store = &store, .record = &rec,
//                                                                           .kda = bwd_args /* d_o, dht, gradients */}, options);
//
// inputs: any policy but recompute (they are the caller's tensors, made by the caller's ops:
// recompute them there). states: any policy; recompute stores nothing and the backward
// recomputes the states itself (what backward_args without saved does; the same gradients bit
// for bit). Under keep and offload the gradients are kda::backward's with the forward's saved
// states, bit for bit; fp8 rounds what it stores (the states by E4M3 blocks of 128 values).
// The recurrent form keeps no states: the policy for them is not used.
#pragma once
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/tensor.hpp"
#include "k3/kda.hpp"
#include "k3/train/saved_tensors.hpp"

namespace k3::train {

struct kda_policies {
  save_policy inputs = keep, states = keep;
};

template <class In, class S>
struct kda_record {
  saved_handle q, k, v, g, beta;
  std::optional<saved_handle> h0, states;
  ::k3::array<index_t, 4> qk_shape{}, v_shape{}, g_shape{}, h0_shape{};
  ::k3::array<index_t, 3> beta_shape{}, states_shape{};
};

// The store is a member of the args (the one call shape: backend, args, options).
template <class Bk, class In, class S = ::k3::accumulation_t<In>>
struct kda_forward_args {
  saved_tensor_store<Bk>* store = nullptr;  // receives what the backward reads
  ::k3::kda::forward_args<In, S> kda;       // o, ht as given; kda.saved is not used
};
struct kda_forward_options {
  ::k3::kda::options kda = {};
  kda_policies policies = {};
};
template <class Bk, class In, class S = ::k3::accumulation_t<In>>
struct kda_backward_args {
  saved_tensor_store<Bk>* store = nullptr;
  kda_record<In, S>* record = nullptr;  // the forward's; its one-shot handles are consumed
  ::k3::kda::backward_args<In, S> kda;  // d_o, dht and the gradient views
};
template <class Bk, class In, class S = ::k3::accumulation_t<In>>
struct kda_prefetch_args {
  saved_tensor_store<Bk>* store = nullptr;
  kda_record<In, S> const* record = nullptr;
};

namespace detail {
inline void require_store(bool given, char const* op) {
  ::k3::detail::require(given, error_kind::value, [&] { return std::string(op) + ": arguments 'store', 'record': required"; });
}
}  // namespace detail

// The forward (a.o, a.ht as given; a.saved is not used), saving what the backward reads.
template <HostBackend Bk, ::k3::Storage In, ::k3::Real S>
kda_record<In, S> kda_forward(Bk const& b, kda_forward_args<Bk, In, S> const& args, kda_forward_options const& o = {}) {
  detail::require_store(args.store != nullptr, "kda_forward");
  auto& store = *args.store;
  auto a = args.kda;
  auto opt = o.kda;
  auto const& p = o.policies;
  // A training forward runs the chunked form unless told otherwise, whether or not it keeps the
  // states: every policy then computes the same forward, bit for bit.
  if (opt.mode == ::k3::kda::algorithm::automatic) opt.mode = ::k3::kda::algorithm::chunk;
  ::k3::detail::require(!has_policy(p.inputs, recompute), error_kind::value,
                        "kda_forward: policy recompute for 'inputs': q, k, v, g, beta are the caller's tensors, nothing here can recompute them");
  detail::check_policy(p.states, true);
  bool const keep_states = opt.mode != ::k3::kda::algorithm::recurrent && p.states != recompute;
  ::k3::tensor<S, 3> states;
  if (keep_states) {
    auto const shape = ::k3::kda::saved_shape(a, opt);
    states = ::k3::tensor<S, 3>({shape[0], shape[1], shape[2]});
    a.saved = states.view();
  } else {
    a.saved = {};
  }
  ::k3::kda::forward(b, a, opt);
  kda_record<In, S> r;
  r.qk_shape = a.q.extents();
  r.v_shape = a.v.extents();
  r.g_shape = a.g.extents();
  r.beta_shape = a.beta.extents();
  r.q = store.save(a.q, p.inputs);
  r.k = store.save(a.k, p.inputs);
  r.v = store.save(a.v, p.inputs);
  r.g = store.save(a.g, p.inputs);
  r.beta = store.save(a.beta, p.inputs);
  if (::k3::present(a.h0)) {
    r.h0_shape = a.h0.extents();
    r.h0 = store.save(a.h0, p.inputs);
  }
  if (keep_states) {
    r.states_shape = states.view().extents();
    r.states = store.save(tensor_view<S const, 3>(states.view()), p.states);
  }
  return r;
}

template <HostBackend Bk, class In, class S>
void kda_prefetch(Bk const&, kda_prefetch_args<Bk, In, S> const& args) {
  detail::require_store(args.store != nullptr && args.record != nullptr, "kda_prefetch");
  auto& store = *args.store;
  auto const& r = *args.record;
  for (auto h : {r.q, r.k, r.v, r.g, r.beta}) store.prefetch(h);
  if (r.h0) store.prefetch(*r.h0);
  if (r.states) store.prefetch(*r.states);
}

// The backward: args.kda gives d_o, dht and the gradient views (its q, k, v, g, beta, h0 and
// saved are taken from the record); opt must be the forward's.
template <HostBackend Bk, ::k3::Storage In, ::k3::Real S>
void kda_backward(Bk const& b, kda_backward_args<Bk, In, S> const& args, ::k3::kda::options const& opt = {}) {
  detail::require_store(args.store != nullptr && args.record != nullptr, "kda_backward");
  auto& store = *args.store;
  auto& r = *args.record;
  auto a = args.kda;
  ::k3::tensor<In, 4> q(r.qk_shape), k(r.qk_shape), v(r.v_shape), g(r.g_shape);
  ::k3::tensor<In, 3> beta(r.beta_shape);
  ::k3::tensor<S, 4> h0;
  ::k3::tensor<S, 3> states;
  store.load(r.q, q.view());
  store.load(r.k, k.view());
  store.load(r.v, v.view());
  store.load(r.g, g.view());
  store.load(r.beta, beta.view());
  a.q = q.view();
  a.k = k.view();
  a.v = v.view();
  a.g = g.view();
  a.beta = beta.view();
  a.h0 = {};
  a.saved = {};
  if (r.h0) {
    h0 = ::k3::tensor<S, 4>(r.h0_shape);
    store.load(*std::exchange(r.h0, std::nullopt), h0.view());
    a.h0 = h0.view();
  }
  if (r.states) {
    states = ::k3::tensor<S, 3>(r.states_shape);
    store.load(*std::exchange(r.states, std::nullopt), states.view());
    a.saved = states.view();
  }
  ::k3::kda::backward(b, a, opt);
}

}  // namespace k3::train
