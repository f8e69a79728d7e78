// k3/optim.hpp — the optimizer K3 trains with: Muon's Newton–Schulz orthogonalisation (NS5),
// Per-Head Muon, Moonlight's and Keller Jordan's update rules with AdamW for the other tensors,
// and P2P Muon over a communicator (spec moe_routing.md C.3; K3's memory report).
//
//   namespace k3::optim:
//     newton_schulz(b, newton_schulz_args<T, R>{.g, .o}, {.steps, .heads, .scale})   [A, B] or [M, A, B]
//     step(b, step_args<T>{.params}, step_options)                                    Muon / AdamW, in place
//     make_p2p_plan(shapes, ranks) -> p2p_plan;  p2p_traffic_of(plan, shapes, bytes)   owners, bytes moved
//     p2p_newton_schulz(b, p2p_newton_schulz_args<Comm, T>{.comm, .plan, .shapes, .g_shards, .o_shards}, opt)
//
// Backends: any host backend (k3::cpu::serial, simd, threads); the products are Eigen GEMMs
// and every backend gives bitwise the same results. Storage float, double or k3::bfloat16;
// the iteration runs in float (double for double storage) unless options.compute says.
//
//   std::vector<float> g(A * B), o(A * B);
//   k3::cpu::threads<> cpu;
//   k3::optim::newton_schulz(cpu, k3::optim::newton_schulz_args<float>{{g.data(), {A, B}}, {o.data(), {A, B}}},
//                            {.heads = 16, .scale = k3::optim::muon_scale::moonlight});
#pragma once
#include "k3/optim/muon.hpp"
#include "k3/optim/newton_schulz.hpp"
#include "k3/optim/p2p_muon.hpp"
