// k3/dplr.hpp — DPLR / IPLR linear-attention state updates (fla's convention):
//   S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t)
// q k a b gk [B,T,H,K], v o [B,T,H,V], states [N,H,K,V] (float, or double for double inputs);
// optional h0 / ht, packed sequences through k3::dplr::options::cu_seqlens (a
// k3::cu_seqlens_view of int32 or int64 offsets) with B = 1.
//
// One call shape, k3::dplr::<op>(backend, args, options = {}) (all throw k3::error naming
// the argument on bad input); the backend is cpu::serial, cpu::simd<> or cpu::threads<> (one
// long sequence uses every thread: value_split or segment_maps, options::long_sequence;
// value_split gives the 1-thread results bit for bit):
//   forward(be, forward_args<T>{q, k, v, a, b, gk, h0, o, ht}, options)
//   backward(be, backward_args<T>{q, k, v, a, b, gk, h0, d_o, dht, dq, dk, dv, da, db, dgk, dh0}, options)
//       options::mode: algorithm::chunk (default, on the backend) or algorithm::recurrent
//       (token by token, the reference, serially on the calling thread)
//   forward / backward(be, iplr_forward_args<T> / iplr_backward_args<T>, ...)   IPLR: gk = 0
//   forward / backward(be, cp_forward_args<T, Comm>{.comm = &comm, ...}, ...)   a sequence split
//       across the ranks of a k3 Communicator (KCP); the local work runs on `be`
//   segment_maps(be, maps_args<T>{span, M, N}, ...)                affine maps S_out = M S_in + N
//   segment_maps_transposed(be, transposed_maps_args<T>{span, d_o, Mt, G}, ...)   of a span,
//   compose_maps(be, compose_args<S>{...}), apply_map(be, apply_args<S>{...})     and their algebra
//   kda_segment_maps(be, kda_maps_args<T>{q, k, v, g, beta, M, N}, ...)
//   kda_as_dplr<T>(kda_inputs<T>)             KDA as DPLR (GVA expanded): forward_inputs(),
//     .grads_to_kda(backward_args, kda_grads)  backward_inputs(), and its gradients folded back
//   state_shape(args, options)                 {N, H, K, V} of ht / h0 / dht / dh0
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
