// k3/dplr.hpp — DPLR / IPLR linear-attention state updates (fla's convention):
//   S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t)
// q k a b gk [B,T,H,K], v o [B,T,H,V], states [N,H,K,V] (float, or double for double inputs);
// optional h0 / ht, packed sequences through dplr_options::cu_seqlens (int64) or
// cu_seqlens32 (int32) with B = 1.
//
// Entry points (all throw k3::error naming the argument on bad input):
//   dplr_recurrent_forward / _backward(in, ...)            token by token, the reference
//   dplr_chunked_forward / _backward(backend, in, ...)     chunked; cpu::serial, cpu::simd<>,
//                                                          cpu::threads<> (one long sequence
//                                                          uses every thread: value_split or
//                                                          segment_maps, dplr_options;
//                                                          value_split gives the 1-thread
//                                                          results bit for bit)
//   iplr_*                                                 gk = 0
//   kda_as_dplr<T>(kda_inputs)                             KDA as DPLR (GVA expanded), and
//     .grads_to_kda(dplr_grads, kda_grads)                 its gradients folded back
//   dplr_segment_maps, dplr_segment_maps_transposed,       affine maps S_out = M S_in + N of
//   dplr_compose_maps, dplr_apply_map, kda_segment_maps    a span, and their algebra
//   dplr_cp_forward / _backward(comm, in, ...)             a sequence split across the ranks
//                                                          of a k3 Communicator (KCP)
//
// Subnormals: the chunk forms (chunked, segment maps, CP) run with subnormal floats flushed
// to zero on every backend (k3/core/float_env.hpp: decays near K3's gate bound are several
// times slower on Intel cores otherwise); results differ from gradual underflow by less than
// 2^-126 (float state) or 2^-1022 (double) per operation. The recurrent reference keeps IEEE
// gradual underflow. The caller's floating-point state is left as it was.
#pragma once
#include "k3/dplr/common.hpp"
#include "k3/dplr/serial.hpp"
#include "k3/dplr/chunked.hpp"
#include "k3/dplr/iplr.hpp"
#include "k3/dplr/maps.hpp"
#include "k3/dplr/kda_map.hpp"
#include "k3/dplr/context_parallel.hpp"
