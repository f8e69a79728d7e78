// k3/attnres/cuda/backend.cuh — AttnRes on k3::cuda::stream_backend: k3::attnres::mix_forward,
// mix_backward, block_rinv, phase1 and phase2_add (k3/attnres.hpp's calls) for args of device
// views, in a TU compiled by nvcc or against the SIMT host runtime. The arguments go through
// the host backends' validation (the detail::validate_* functions of k3/attnres/mix.hpp and
// k3/attnres/two_phase.hpp: shapes, options, aliasing, the same k3::error), then the launchers
// of k3/attnres/cuda.cuh run on the backend's stream (on its device).
//
//   k3::cuda::stream_backend be{stream};
//   k3::attnres::mix_forward(be, k3::attnres::mix_forward_args<float, float, float, k3::cuda_device_space>{
//                                    .sources = k3::attnres::make_sources(bank, partial), .w = w, .gain = gain, .h = h});
//
// What the CUDA backend serves: float or k3::bfloat16 storage S for the sources, the block, the
// bank, o, prefix, delta and h (each of the same S within a call); float w, gain, u, rinv, lse,
// d_h, d_sources, d_w and d_gain; contiguous views; at most 32 sources per site (phase 1: 32
// completed blocks), T < 2^31 tokens (one thread block per token). Math runs in float (the
// host backends sum in double), so results agree to float rounding, not bit for bit, and
// mix_backward sums d_w and d_gain with float atomics (their last bits may vary between runs).
// Not served (an unsupported-kind k3::error naming the argument or option, raised after the
// host's checks and before any device work): other types or strides, more sources, stats
// (the kernels neither keep nor read the token statistics: the backward recomputes them),
// options::accumulate in mix_backward (the kernels overwrite the gradients), and block_rinv /
// phase1 with d = 0 features. phase2 (no kernel of its own) stays on the host backends.
// two_phase_options::tuning, the host kernels' store streaming, means nothing here and is
// ignored.
// Calls return without synchronising, except those that allocate a device buffer for the
// call (the folded query of mix_forward, the workspace of mix_backward): its cudaFree waits
// for the device.
#pragma once
#include "k3/backend/cuda/backend.cuh"
// (backend.cuh first: its config.cuh picks the CUDA runtime)
#include <cstdint>
#include <string>
#include <type_traits>

#include "k3/attnres/cuda.cuh"
#include "k3/attnres/mix.hpp"
#include "k3/attnres/two_phase.hpp"
#include "k3/core/memory_space.hpp"

namespace k3::attnres {
namespace detail {

using ::k3::cuda::detail::call_buffer;      // k3/backend/cuda/backend.cuh
namespace kernels = ::k3::cuda::attnres;   // the raw launchers of k3/attnres/cuda.cuh

template <class T>
constexpr char const* cuda_type_name() noexcept {
  if constexpr (std::is_same_v<T, float>) return "float";
  else if constexpr (std::is_same_v<T, double>) return "double";
  else if constexpr (std::is_same_v<T, bfloat16>) return "k3::bfloat16";
  else return "a type other than float, double or k3::bfloat16";
}

// The storage the kernels read and write.
template <class S>
inline constexpr bool cuda_storage = std::is_same_v<S, float> || std::is_same_v<S, bfloat16>;

template <class S>
void require_cuda_storage(char const* name) {
  require(cuda_storage<S>, error_kind::unsupported, [&] {
    return std::string("argument '") + name + "': the CUDA kernels take float or k3::bfloat16 storage, got " + cuda_type_name<S>();
  });
}

// A view whose element type the launchers fix (float, or the call's storage S).
template <class Got, class Want>
void require_cuda_type(char const* name) {
  require(std::is_same_v<std::remove_const_t<Got>, Want>, error_kind::unsupported, [&] {
    return std::string("argument '") + name + "': the CUDA kernels take " + cuda_type_name<Want>() + " here, got " +
           cuda_type_name<std::remove_const_t<Got>>();
  });
}

// The launchers take raw row-major pointers.
template <class V>
void require_cuda_contiguous(char const* name, V const& v) {
  require(!present(v) || v.is_contiguous(), error_kind::unsupported, [&] {
    return std::string("argument '") + name + "': the CUDA backend takes contiguous views, got shape " + ::k3::format_shape(v.extents()) +
           " with strides " + ::k3::format_shape(v.strides());
  });
}

// One thread block per token: gridDim.x bounds T; per-token statistics live in shared arrays
// of max_sources entries.
inline void require_cuda_sizes(char const* name, index_t sources, index_t T) {
  require(sources <= kernels::max_sources, error_kind::unsupported, [&] {
    return std::string("argument '") + name + "': the CUDA kernels mix at most " + std::to_string(kernels::max_sources) +
           " sources per site, got " + std::to_string(sources);
  });
  require(T <= 0x7fffffff, error_kind::unsupported, [&] {
    return std::string("argument '") + name + "': the CUDA kernels launch one thread block per token, at most 2^31 - 1, got T = " +
           std::to_string(T);
  });
}

// block_rinv and phase1 still write outputs when d = 0 (rinv, lse), which the kernels (d >= 1) do not produce.
inline void require_cuda_features(char const* name, index_t d, bool writes) {
  require(d >= 1 || !writes, error_kind::unsupported, [&] {
    return std::string("argument '") + name + "': the CUDA kernels need d >= 1 features, got d = " + std::to_string(d);
  });
}

template <class Stats>
void require_no_stats(Stats const& stats) {
  require(!present(stats), error_kind::unsupported,
          "argument 'stats': the CUDA kernels neither keep nor read the token statistics (the backward recomputes them); "
          "leave stats absent");
}

template <class S, class Space>
S const* partial_ptr(sources<S, Space> const& s) noexcept {
  return s.has_partial() ? s.partial.data_handle() : nullptr;
}

}  // namespace detail

// ---- one mixing site --------------------------------------------------------------------------
// u = w * gain is folded into a device buffer first (the launcher takes the folded query).
template <CudaBackend B, class S, class W, class H>
void mix_forward(B const& be, mix_forward_args<S, W, H, cuda_device_space> const& a, options const& opt = {}) {
  detail::mix_problem const p = detail::validate_mix_forward(a, opt);
  detail::require_cuda_storage<S>("sources");
  detail::require_cuda_type<W, float>("w");
  detail::require_cuda_type<H, S>("h");
  detail::require_no_stats(a.stats);
  detail::require_cuda_sizes("sources", p.m, p.T);
  detail::require_cuda_contiguous("sources", a.sources.bank);
  detail::require_cuda_contiguous("partial", a.sources.partial);
  detail::require_cuda_contiguous("w", a.w);
  detail::require_cuda_contiguous("gain", a.gain);
  detail::require_cuda_contiguous("h", a.h);
  if constexpr (detail::cuda_storage<S> && std::is_same_v<std::remove_const_t<W>, float> && std::is_same_v<H, S>) {
    if (p.T == 0 || p.d == 0) return;
    ::k3::cuda::detail::device_guard const on_device(be.requested_device());
    detail::call_buffer<float, B> const u(be, static_cast<std::size_t>(p.d));
    be.launch(dim3(static_cast<unsigned>((p.d + 255) / 256)), dim3(256), 0, detail::kernels::detail::fold_query_kernel<>, a.w.data_handle(),
              a.gain.data_handle(), p.d, u.get());
    detail::kernels::mix_forward<S>(a.sources.bank.data_handle(), a.sources.bank.extent(0), detail::partial_ptr(a.sources), p.T, p.d,
                                    u.get(), static_cast<float>(opt.eps), a.h.data_handle(), be.stream());
  }
}

// d_h may be the partial's gradient itself, as on the host: it is then read from a copy (the
// launcher refuses an output over an input).
template <CudaBackend B, class S, class W, class DH, class G, class DW>
void mix_backward(B const& be, mix_backward_args<S, W, DH, G, DW, cuda_device_space> const& a, options const& opt = {}) {
  detail::mix_problem const p = detail::validate_mix_backward(a, opt);
  detail::require_cuda_storage<S>("sources");
  detail::require_cuda_type<W, float>("w");
  detail::require_cuda_type<DH, float>("d_h");
  detail::require_cuda_type<G, float>("d_sources");
  detail::require_cuda_type<DW, float>("d_w");
  detail::require_no_stats(a.stats);
  ::k3::detail::require(!opt.accumulate, error_kind::unsupported,
                        "option 'accumulate': the CUDA kernels overwrite d_sources, d_w and d_gain; accumulation is served by the "
                        "host backends");
  detail::require_cuda_sizes("sources", p.m, p.T);
  bool const has_partial = a.sources.has_partial();
  detail::require_cuda_contiguous("sources", a.sources.bank);
  detail::require_cuda_contiguous("partial", a.sources.partial);
  detail::require_cuda_contiguous("w", a.w);
  detail::require_cuda_contiguous("gain", a.gain);
  detail::require_cuda_contiguous("d_h", a.d_h);
  detail::require_cuda_contiguous("d_sources", a.d_sources.bank);
  if (has_partial) detail::require_cuda_contiguous("d_partial", a.d_sources.partial);
  detail::require_cuda_contiguous("d_w", a.d_w);
  detail::require_cuda_contiguous("d_gain", a.d_gain);
  if constexpr (detail::cuda_storage<S> && std::is_same_v<std::remove_const_t<W>, float> && std::is_same_v<std::remove_const_t<DH>, float> &&
                std::is_same_v<G, float> && std::is_same_v<DW, float>) {
    if (p.d == 0) return;
    ::k3::cuda::detail::device_guard const on_device(be.requested_device());
    std::size_t const rows = static_cast<std::size_t>(p.T * p.d);
    bool const dh_aliased = has_partial && detail::d_h_is_d_partial(a.d_h, a.d_sources.partial);
    detail::call_buffer<float, B> const dh_copy(be, dh_aliased ? rows : 0), workspace(be, static_cast<std::size_t>(p.d));
    float const* dh = a.d_h.data_handle();
    if (dh_aliased && rows > 0) {
      K3_CUDA_CHECK(cudaMemcpyAsync(dh_copy.get(), dh, rows * sizeof(float), cudaMemcpyDeviceToDevice, be.stream()));
      dh = dh_copy.get();
    }
    detail::kernels::mix_backward<S>(a.sources.bank.data_handle(), a.sources.bank.extent(0), detail::partial_ptr(a.sources), p.T, p.d,
                                     a.w.data_handle(), a.gain.data_handle(), static_cast<float>(opt.eps), dh, a.d_sources.bank.data_handle(),
                                     has_partial ? a.d_sources.partial.data_handle() : nullptr, a.d_w.data_handle(), a.d_gain.data_handle(),
                                     workspace.get(), be.stream());
  }
}

// ---- two-phase inference ------------------------------------------------------------------------
template <CudaBackend B, class S>
void block_rinv(B const& be, block_rinv_args<S, cuda_device_space> const& a, two_phase_options const& opt = {}) {
  index_t T = 0, d = 0;
  detail::validate_block_rinv(a, opt, T, d);
  detail::require_cuda_storage<S>("block");
  detail::require_cuda_sizes("block", 1, T);
  detail::require_cuda_features("block", d, T > 0);
  detail::require_cuda_contiguous("block", a.block);
  detail::require_cuda_contiguous("rinv", a.rinv);
  if constexpr (detail::cuda_storage<S>) {
    if (T == 0) return;
    ::k3::cuda::detail::device_guard const on_device(be.requested_device());
    detail::kernels::block_rinv<S>(a.block.data_handle(), T, d, static_cast<float>(opt.eps), a.rinv.data_handle(), be.stream());
  }
}

template <CudaBackend B, class S, class O>
void phase1(B const& be, phase1_args<S, O, cuda_device_space> const& a, two_phase_options const& opt = {}) {
  detail::phase1_problem const p = detail::validate_phase1(a, opt);
  detail::require_cuda_storage<S>("bank");
  detail::require_cuda_type<O, S>("o");
  detail::require_cuda_sizes("bank", p.n, p.T);
  detail::require_cuda_features("bank", p.d, p.T > 0 && p.nq > 0);
  detail::require_cuda_contiguous("bank", a.bank);
  detail::require_cuda_contiguous("bank_rinv", a.bank_rinv);
  detail::require_cuda_contiguous("u", a.u);
  detail::require_cuda_contiguous("o", a.o);
  detail::require_cuda_contiguous("lse", a.lse);
  if constexpr (detail::cuda_storage<S> && std::is_same_v<O, S>) {
    if (p.T == 0 || p.nq == 0) return;
    ::k3::cuda::detail::device_guard const on_device(be.requested_device());
    detail::kernels::phase1<S>(a.bank.data_handle(), a.bank_rinv.data_handle(), p.n, p.T, p.d, a.u.data_handle(), p.nq, a.o.data_handle(),
                               a.lse.data_handle(), be.stream());
  }
}

template <CudaBackend B, class S, class D, class O, class H>
void phase2_add(B const& be, phase2_add_args<S, D, O, H, cuda_device_space> const& a, two_phase_options const& opt = {}) {
  index_t T = 0, d = 0;
  detail::validate_phase2_add(a, opt, T, d);
  detail::require_cuda_storage<S>("prefix");
  detail::require_cuda_type<D, S>("delta");
  detail::require_cuda_type<O, S>("o");
  detail::require_cuda_type<H, S>("h");
  detail::require_cuda_sizes("prefix", 1, T);
  detail::require_cuda_contiguous("o", a.o);
  detail::require_cuda_contiguous("lse", a.lse);
  detail::require_cuda_contiguous("prefix", a.prefix);
  detail::require_cuda_contiguous("delta", a.delta);
  detail::require_cuda_contiguous("u", a.u);
  detail::require_cuda_contiguous("h", a.h);
  if constexpr (detail::cuda_storage<S> && std::is_same_v<std::remove_const_t<D>, S> && std::is_same_v<std::remove_const_t<O>, S> &&
                std::is_same_v<H, S>) {
    if (T == 0 || d == 0) return;  // nothing to write (the kernels need d >= 1)
    ::k3::cuda::detail::device_guard const on_device(be.requested_device());
    detail::kernels::phase2_add<S>(a.o.data_handle(), a.lse.data_handle(), a.prefix.data_handle(), a.delta.data_handle(), a.u.data_handle(), T,
                                   d, static_cast<float>(opt.eps), a.h.data_handle(), be.stream());
  }
}

}  // namespace k3::attnres
