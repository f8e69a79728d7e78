// k3/kda.hpp — Kimi Delta Attention (KDA): chunked and serial forms, forward and backward,
// and a decode step over a pool of states. See k3/kda/common.hpp for the conventions.
//
//   k3::kda::forward(backend, forward_args<In, S>{...}, options)
//   k3::kda::backward(backend, backward_args<In, S>{...}, options)
//   k3::kda::decode(backend, decode_args<In, S>{...}, options)
//
// In is the storage type of q, k, v, g, beta, o and their gradients (float, double or
// bfloat16); S is the state type (float or double) and also the accumulation type.
// Training (chunked form): give forward_args::saved, a [HV, chunks, record] tensor of the state
// type sized by k3::kda::saved_shape(args, options), and pass the same tensor as
// backward_args::saved; the backward then reads the forward's per-chunk states instead of
// recomputing them (same gradients, bit for bit).
// Backends: k3::cpu::serial (one thread; with algorithm::recurrent it is the reference),
// k3::cpu::simd<Arch> (one thread, vectorised kernels) and k3::cpu::threads<Arch> (the same
// kernels over (sequence x head) tasks on a thread pool).
#pragma once
#include <algorithm>
#include <type_traits>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/core/concepts.hpp"
#include "k3/kda/chunk.hpp"
#include "k3/kda/chunk_simd.hpp"
#include "k3/kda/chunk_simd_backward.hpp"
#include "k3/kda/common.hpp"
#include "k3/kda/recurrent.hpp"
#include "k3/kda/recurrent_simd.hpp"

namespace k3::kda {

namespace detail {

// The vectorised kernels need the backend's SIMD architecture (simd<Arch>, threads<Arch>).
template <class B>
concept SimdBackend = requires { typename B::arch_type; };

template <class B, class F>
void run_tasks(B const& be, index_t n, F&& f) {
  if (n <= 0) return;
  if constexpr (requires { be.for_each_task(n, f); })
    be.for_each_task(n, f);
  else
    be.for_each(0, n, f);
}

}  // namespace detail

template <HostBackend B, Storage In, Real S>
void forward(B const& be, forward_args<In, S> const& a, options const& opt = {}) {
  detail::problem const p = detail::validate(a, opt);
  index_t const tasks = p.N * p.HV;
  if (opt.mode == algorithm::recurrent) {
    if constexpr (detail::SimdBackend<B>) {
      if (detail::simd_recurrent_ok<typename B::arch_type, S>(p.V)) {
        detail::run_tasks(be, tasks, [&](index_t i) {
          detail::recurrent_forward_simd_task<typename B::arch_type, S>(p, a, i / p.HV, i % p.HV);
        });
        return;
      }
    }
    detail::run_tasks(be, tasks, [&](index_t i) { detail::recurrent_forward_task<S>(p, a, i / p.HV, i % p.HV); });
  } else {
    if constexpr (detail::SimdBackend<B>) {
      detail::run_tasks(be, tasks, [&](index_t i) {
        detail::chunk_forward_simd_task<typename B::arch_type, S>(p, a, i / p.HV, i % p.HV);
      });
      return;
    }
    detail::run_tasks(be, tasks, [&](index_t i) { detail::chunk_forward_task<S>(p, a, i / p.HV, i % p.HV); });
  }
}

template <HostBackend B, Storage In, Real S>
void backward(B const& be, backward_args<In, S> const& a, options const& opt = {}) {
  detail::problem const p = detail::validate(a, opt);
  index_t const tasks = p.N * p.H;  // one task per q/k head: dq and dk sum over its value heads
  if (opt.mode == algorithm::recurrent) {
    detail::run_tasks(be, tasks, [&](index_t i) { detail::recurrent_backward_task<S>(p, a, i / p.H, i % p.H); });
  } else {
    if constexpr (detail::SimdBackend<B>) {
      detail::run_tasks(be, tasks, [&](index_t i) {
        detail::chunk_backward_simd_task<typename B::arch_type, S>(p, a, i / p.H, i % p.H);
      });
      return;
    }
    detail::run_tasks(be, tasks, [&](index_t i) { detail::chunk_backward_task<S>(p, a, i / p.H, i % p.H); });
  }
}

// One token per sequence n: state_pool[slot(n)] is read and updated in place; o[n] written.
// The vectorised backends hand each thread a few contiguous ranges of (sequence, value head)
// pairs (see decode_simd_range); the serial backend runs the reference step per pair.
template <HostBackend B, Storage In, Real S>
void decode(B const& be, decode_args<In, S> const& a, options const& opt = {}) {
  detail::problem const p = detail::validate(a, opt);
  bool const s32 = present(a.slots32);
  auto slot = [&](index_t n) { return s32 ? index_t(a.slots32(n)) : index_t(a.slots64(n)); };
  index_t const pairs = p.N * p.HV;
  if (pairs == 0) return;
  if constexpr (detail::SimdBackend<B>) {
    // A few ranges per thread rather than one: a thread slowed by other load on the machine
    // does not hold up the call, and each range still streams through many states.
    index_t parts = 1;
    if constexpr (requires { be.concurrency(); }) parts = std::min<index_t>(pairs, 4 * index_t(be.concurrency()));
    detail::run_tasks(be, parts, [&](index_t t) {
      detail::decode_simd_range<typename B::arch_type>(p, a, slot, pairs * t / parts, pairs * (t + 1) / parts);
    });
  } else {
    detail::run_tasks(be, pairs, [&](index_t i) { detail::decode_task<S>(p, a, i / p.HV, slot(i / p.HV), i % p.HV); });
  }
}

}  // namespace k3::kda
