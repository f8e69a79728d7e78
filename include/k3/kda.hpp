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
// kernels over (sequence x head) tasks on a thread pool); k3::cuda::stream_backend with args of
// device views, forward_args<In, float, cuda_device_space> (k3/kda/cuda/backend.cuh, in a TU
// compiled by nvcc or against the SIMT host runtime). Views of the wrong memory space for the
// backend are a compile error that says so.
//
// Non-finite values. g = -inf is a hard reset (e^g = 0), exact in both forms: the chunked form
// clamps log decays at the underflow of e^g (k3/core/math.hpp full_decay_log), where they
// already give 0. A NaN or Inf in an input of token t (sequence n, value head hv) makes that
// head's outputs non-finite from t on (the state carries it) and never touches other heads or
// sequences (tested). The recurrent form and the chunked form of the simd and threads
// backends are exactly causal: outputs before t stay as they were (tested; their triangular
// kernels skip the zeros above the diagonal instead of multiplying them). The serial
// backend's chunked form (Eigen products over whole chunks) can also reach the earlier tokens
// of t's own chunk (0 * NaN), never an earlier chunk. In the backward the whole head can
// become non-finite.
//
// Subnormals. The simd and threads backends run their kernels with subnormal floats flushed to
// zero (operands and results; k3/core/float_env.hpp says why: Intel cores are slow on them), so
// their results can differ from gradual underflow by less than 2^-126 (float state) or 2^-1022
// (double) per operation. cpu::serial keeps IEEE gradual underflow. The caller's own
// floating-point state is left as it was.
#pragma once
#include <algorithm>
#include <type_traits>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/core/backend_traits.hpp"
#include "k3/core/concepts.hpp"
#include "k3/core/float_env.hpp"
#include "k3/kda/chunk.hpp"
#include "k3/kda/chunk_simd.hpp"
#include "k3/kda/chunk_simd_backward.hpp"
#include "k3/kda/common.hpp"
#include "k3/kda/recurrent.hpp"
#include "k3/kda/recurrent_simd.hpp"

namespace k3::kda {

namespace detail {

template <class V>
void zero_fill(V const& v) {
  using E = typename V::value_type;
  if constexpr (V::rank() == 3) {
    for (index_t i = 0; i < v.extent(0); ++i)
      for (index_t j = 0; j < v.extent(1); ++j)
        for (index_t l = 0; l < v.extent(2); ++l) v(i, j, l) = E(0.0f);
  } else {
    for (index_t i = 0; i < v.extent(0); ++i)
      for (index_t j = 0; j < v.extent(1); ++j)
        for (index_t l = 0; l < v.extent(2); ++l)
          for (index_t m = 0; m < v.extent(3); ++m) v(i, j, l, m) = E(0.0f);
  }
}

// k3::run_tasks with the vectorised kernels' floating-point state: subnormals flushed for
// the whole parallel region (the pool's workers take the caller's state).
template <class B, class F>
void run_flushed_tasks(B const& be, index_t n, F&& f) {
  if constexpr (VectorBackend<B>) {
    k3::detail::subnormals_flushed const flush;
    k3::run_tasks(be, n, f);
  } else {
    k3::run_tasks(be, n, f);
  }
}

}  // namespace detail

template <HostBackend B, Storage In, Real S, class Space, class = ::k3::detail::reachable<B, Space>>
void forward(B const& be, forward_args<In, S, Space> const& a, options const& opt = {}) {
  // The vectorised backends check the gate's lower bound themselves (validate reads all of g
  // sequentially): the chunked form while staging its rows, the recurrent form by a scan on
  // every thread. Either runs the exact sequential check (which names the first offending
  // element and throws) only when its fast float filter hits.
  detail::problem const p = detail::validate(a, opt, !VectorBackend<B>);
  if (p.K == 0 || p.V == 0) {
    // An empty state (ht and saved have no elements): o = 0. The kernels would form references
    // into the empty (possibly null) K- or V-rows. The gate bound is still checked.
    if constexpr (VectorBackend<B>) detail::check_gate_bound(p, a.g);
    detail::zero_fill(a.o);
    return;
  }
  algorithm const form = detail::host_form(opt, present(a.saved), false);
  if constexpr (VectorBackend<B>) {
    if (p.lower_bound && p.T > 0 && form == algorithm::recurrent) {
      index_t parts = 1;
      if constexpr (requires { be.concurrency(); }) parts = std::min<index_t>(p.T, 4 * index_t(be.concurrency()));
      std::vector<char> hit(std::size_t(parts), 0);
      detail::run_flushed_tasks(be, parts, [&](index_t i) { hit[std::size_t(i)] = detail::gate_may_be_below(p, a.g, p.T * i / parts, p.T * (i + 1) / parts); });
      if (std::find(hit.begin(), hit.end(), char(1)) != hit.end()) detail::check_gate_bound(p, a.g);
    }
  }
  index_t const tasks = p.N * p.HV;
  if (form == algorithm::recurrent) {
    if constexpr (VectorBackend<B>) {
      if (detail::simd_recurrent_ok<typename B::arch_type, S>(p.V)) {
        index_t const gs = detail::recurrent_head_group(p.N, p.HV, k3::concurrency(be)), groups = (p.HV + gs - 1) / gs;
        detail::run_flushed_tasks(be, p.N * groups, [&](index_t i) {
          index_t const hv0 = i % groups * gs;
          detail::recurrent_forward_simd_group<typename B::arch_type, S>(p, a, i / groups, hv0, std::min(p.HV, hv0 + gs));
        });
        return;
      }
    }
    detail::run_flushed_tasks(be, tasks, [&](index_t i) { detail::recurrent_forward_task<S>(p, a, i / p.HV, i % p.HV); });
  } else {
    if constexpr (VectorBackend<B>) {
      index_t const gs = detail::forward_head_group(p.N, p.HV, k3::concurrency(be)), groups = (p.HV + gs - 1) / gs;
      std::vector<char> hit(std::size_t(p.N * groups), 0);
      detail::run_flushed_tasks(be, p.N * groups, [&](index_t i) {
        index_t const hv0 = i % groups * gs;
        hit[std::size_t(i)] = detail::chunk_forward_simd_group<typename B::arch_type, S>(p, a, i / groups, hv0, std::min(p.HV, hv0 + gs));
      });
      // Outputs are unspecified when this throws (as for any error raised after the kernels ran).
      if (std::find(hit.begin(), hit.end(), char(1)) != hit.end()) detail::check_gate_bound(p, a.g);
      return;
    }
    detail::run_flushed_tasks(be, tasks, [&](index_t i) { detail::chunk_forward_task<S>(p, a, i / p.HV, i % p.HV); });
  }
}

template <HostBackend B, Storage In, Real S, class Space, class = ::k3::detail::reachable<B, Space>>
void backward(B const& be, backward_args<In, S, Space> const& a, options const& opt = {}) {
  detail::problem const p = detail::validate(a, opt);
  if (p.K == 0 || p.V == 0) {
    // An empty state: o = 0 whatever the inputs, so every gradient is 0 (dh0 has no elements).
    // The kernels would form references into the empty (possibly null) K- or V-rows.
    detail::zero_fill(a.dq);
    detail::zero_fill(a.dk);
    detail::zero_fill(a.dv);
    detail::zero_fill(a.dg);
    detail::zero_fill(a.dbeta);
    return;
  }
  index_t const tasks = p.N * p.H;  // one task per q/k head: dq and dk sum over its value heads
  if (detail::host_form(opt, present(a.saved), true) == algorithm::recurrent) {
    detail::run_flushed_tasks(be, tasks, [&](index_t i) { detail::recurrent_backward_task<S>(p, a, i / p.H, i % p.H); });
  } else {
    if constexpr (VectorBackend<B>) {
      detail::run_flushed_tasks(be, tasks, [&](index_t i) {
        detail::chunk_backward_simd_task<typename B::arch_type, S>(p, a, i / p.H, i % p.H);
      });
      return;
    }
    detail::run_flushed_tasks(be, tasks, [&](index_t i) { detail::chunk_backward_task<S>(p, a, i / p.H, i % p.H); });
  }
}

// One token per sequence n: state_pool[slot(n)] is read and updated in place; o[n] written.
// A negative slot marks a padding entry: skipped, its o left untouched (as on CUDA).
// The vectorised backends hand each thread a few contiguous ranges of (sequence, value head)
// pairs (see decode_simd_range); the serial backend runs the reference step per pair.
template <HostBackend B, Storage In, Real S, class Space, class = ::k3::detail::reachable<B, Space>>
void decode(B const& be, decode_args<In, S, Space> const& a, options const& opt = {}) {
  detail::problem const p = detail::validate(a, opt);
  bool const s32 = present(a.slots32);
  auto slot = [&](index_t n) { return s32 ? index_t(a.slots32(n)) : index_t(a.slots64(n)); };
  bool padded = false;
  for (index_t n = 0; n < p.N && !padded; ++n) padded = slot(n) < 0;
  std::vector<index_t> live;  // the sequences to decode, when some entries are padding
  if (padded)
    for (index_t n = 0; n < p.N; ++n)
      if (slot(n) >= 0) live.push_back(n);
  index_t const entries = padded ? index_t(live.size()) : p.N;
  auto run = [&](auto const& seq) {
    index_t const pairs = entries * p.HV;
    if (pairs == 0) return;
    if constexpr (VectorBackend<B>) {
      // A few ranges per thread rather than one: a thread slowed by other load on the machine
      // does not hold up the call, and each range still streams through many states.
      index_t parts = 1;
      if constexpr (requires { be.concurrency(); }) parts = std::min<index_t>(pairs, 4 * index_t(be.concurrency()));
      detail::run_flushed_tasks(be, parts, [&](index_t t) {
        detail::decode_simd_range<typename B::arch_type>(p, a, slot, seq, pairs * t / parts, pairs * (t + 1) / parts);
      });
    } else {
      detail::run_flushed_tasks(be, pairs, [&](index_t i) { detail::decode_task<S>(p, a, seq(i / p.HV), slot(seq(i / p.HV)), i % p.HV); });
    }
  };
  if (!padded)
    run([](index_t j) { return j; });
  else
    run([&](index_t j) { return live[std::size_t(j)]; });
}

}  // namespace k3::kda
