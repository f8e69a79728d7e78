// k3/train.hpp — memory-efficient training (K3 §5.2.2): the per-GPU memory ledger of a training
// step under the pipeline, expert and data parallel sliders, with and without K3's memory
// techniques, and the saved-tensor store of the activation manager (docs/training_memory.md).
//
//   namespace k3::train:
//     ledger_of(model_config{}, parallel_config{}, toggles::all()) -> ledger   rows per GPU, per pipeline rank
//     parameters_of(model_config) -> parameter_counts;  in_flight(parallel_config, rank)
//     saved_tensor_store<Backend>: save(x, keep | recompute | fp8 | offload) -> handle, prefetch,
//                                  load(handle, out) once, stats() of the resident and host pools
//     train_step(backend, stack_config, stack_parameters<T>(c), stack_inputs<T>(c), step_policy)
//                                  one step of KDA layers + a LatentMoE layer through the store
//     attnres_site_saves<S>(store, partials, stats) -> the Block AttnRes driver's per-site saves
//     kda_forward / kda_backward(backend, {.store = &store, ...}, options), latent_moe_forward / _backward(...)
//                                  KDA's and the MoE layer's training paths on the store
#pragma once
#include "k3/train/ledger.hpp"
#include "k3/train/attnres_saves.hpp"
#include "k3/train/kda_saves.hpp"
#include "k3/train/latent_moe_saves.hpp"
#include "k3/train/saved_tensors.hpp"
#include "k3/train/stack.hpp"
