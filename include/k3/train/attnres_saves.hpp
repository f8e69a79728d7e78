// k3/train/attnres_saves.hpp — the Block AttnRes driver's training path on a saved-tensor
// store: every site's partial sum and softmax statistics saved under a policy, loaded once by
// the site's backward.
//
//   k3::train::saved_tensor_store<k3::cpu::threads<>> store(cpu);
//   k3::attnres::block_attn_res<float, k3::cpu::threads<>> ar(cfg /* a training mode */, w, gain, cpu);
//   ar.save_sites_through(k3::train::attnres_site_saves<float>(store, k3::train::fp8 | k3::train::offload,
//                                                               k3::train::recompute));
//
// partials: any policy but recompute (a partial sum is a running sum of sublayer outputs the
// driver does not keep, so there is nothing to recompute it from). stats: any policy;
// recompute stores nothing and lets the backward recompute them (what train_recompute does).
#pragma once
#include <cstdint>

#include "k3/attnres/block.hpp"
#include "k3/core/error.hpp"
#include "k3/core/storage.hpp"
#include "k3/train/saved_tensors.hpp"

namespace k3::train {

template <class S, class Bk>
::k3::attnres::site_saves<S, k3::accumulation_t<S>> attnres_site_saves(saved_tensor_store<Bk>& store, save_policy partials,
                                                                             save_policy stats) {
  using C = k3::accumulation_t<S>;
  ::k3::detail::require(!has_policy(partials, recompute), error_kind::value, [&] {
    return "attnres_site_saves: policy " + policy_name(partials) +
           " for the partial sums: they are running sums of sublayer outputs the driver does not keep, so nothing can recompute them";
  });
  detail::check_policy(partials, false);
  detail::check_policy(stats, true);
  ::k3::attnres::site_saves<S, C> s;
  s.save_partial = [&store, partials](tensor_view<S const, 2> x) { return store.save(x, partials).id; };
  s.load_partial = [&store](std::uint64_t id, tensor_view<S, 2> out) { store.load(saved_handle{id}, out); };
  if (stats != recompute) {
    s.save_stats = [&store, stats](tensor_view<C const, 3> x) { return store.save(x, stats).id; };
    s.load_stats = [&store](std::uint64_t id, tensor_view<C, 3> out) { store.load(saved_handle{id}, out); };
  }
  s.release = [&store](std::uint64_t id) { store.release(saved_handle{id}); };
  return s;
}

}  // namespace k3::train
