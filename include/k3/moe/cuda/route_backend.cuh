// k3/moe/cuda/route_backend.cuh — MoE routing on k3::cuda::stream_backend: k3::moe::route (the
// call of k3/moe.hpp) for route_args<float, cuda_device_space>, in a TU compiled by nvcc or
// against the SIMT host runtime. The arguments go through the host backends' checks (shapes,
// options, aliasing, histogram; scores and bias finite, with the host's messages), then
// k3::moe::cuda::route_launch (k3/moe/cuda.cuh) runs on the backend's stream. Indices, weights,
// cut-offs, loads and histogram counts are bit-identical to route() on k3::cpu::serial.
//
//   k3::cuda::stream_backend be{stream};
//   k3::moe::route(be, k3::moe::route_args<float, k3::cuda_device_space>{...}, opt);
//
// What the CUDA backend serves: sigmoid scores (router_options::input == score_kind::scores),
// router_options::n_groups == 1, contiguous views, at most 16384 experts (a token's scores are
// staged in shared memory); anything else is an unsupported-kind k3::error naming the option or
// argument, raised after the host's checks and before any device work. load is overwritten,
// as on the host. route_args::histogram stays a host qb_histogram: the margins are counted in
// a device buffer whose counts are added to it at the end of the call.
//
// Synchronisation: every call waits for the stream once before the launch, to read back where
// scores or bias are not finite (the host's value checks: the kernel cannot throw, and a NaN
// would make it index out of bounds); with a histogram it waits again at the end, to add the
// counts. Without a histogram the routing itself returns without waiting.
#pragma once
#include "k3/backend/cuda/backend.cuh"
// (backend.cuh first: its config.cuh picks the CUDA runtime)
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"
#include "k3/moe/cuda.cuh"
#include "k3/moe/quantile_balancing.hpp"
#include "k3/moe/router.hpp"

namespace k3::moe {
namespace detail {

// The launcher counts load and histogram bins in unsigned long long; load is int64 on device.
static_assert(sizeof(unsigned long long) == sizeof(std::int64_t) && alignof(unsigned long long) == alignof(std::int64_t),
              "the CUDA router writes the int64 load through unsigned long long atomics");

// The largest n whose scores one block of the launcher stages in shared memory.
inline constexpr index_t cuda_route_max_experts = 16384;

template <class V>
void require_contiguous_route_view(char const* name, V const& v) {
  require(v.empty() || v.is_contiguous(), error_kind::unsupported, [&] {
    return std::string("argument '") + name + "': the CUDA router takes contiguous views, got shape " + ::k3::format_shape(v.extents()) +
           " with strides " + ::k3::format_shape(v.strides());
  });
}

// What route_launch cannot do (see the header comment), after the host's checks.
inline void check_cuda_route_call(route_args<float, cuda_device_space> const& a, router_options const& opt) {
  require(opt.input == score_kind::scores, error_kind::unsupported,
          "option 'input': the CUDA router takes sigmoid scores (score_kind::scores), got score_kind::logits");
  require(opt.n_groups == 1, error_kind::unsupported, [&] {
    return "option 'n_groups': group-limited routing is served by the host backends only (n_groups must be 1 on CUDA), got " +
           std::to_string(opt.n_groups);
  });
  require(a.scores.extent(1) <= cuda_route_max_experts, error_kind::unsupported, [&] {
    return "argument 'scores': the CUDA router stages a token's scores in shared memory, at most " + std::to_string(cuda_route_max_experts) +
           " experts, got " + std::to_string(a.scores.extent(1));
  });
  require_contiguous_route_view("scores", a.scores);
  require_contiguous_route_view("bias", a.bias);
  require_contiguous_route_view("mask", a.mask);
  require_contiguous_route_view("indices", a.indices);
  require_contiguous_route_view("weights", a.weights);
  require_contiguous_route_view("cutoff", a.cutoff);
  require_contiguous_route_view("load", a.load);
}

using ::k3::cuda::detail::call_buffer;  // k3/backend/cuda/backend.cuh

// first[0] = the lowest expert whose bias is not finite, first[1] = the lowest flat index
// (token-major, the host's scan order) of a non-finite score; left at ~0 when there is none.
// A template so that the header can be included by several TUs of one program.
template <class Score>
K3_KERNEL void route_nonfinite_kernel(float const* bias, Score const* scores, std::int64_t n, std::int64_t total,
                                      unsigned long long* first) {
  std::int64_t const step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t x = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; x < n + total; x += step) {
    bool const in_bias = x < n;
    float const v = in_bias ? bias[x] : scores[x - n];
    if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u)  // exponent all ones: inf or NaN
      atomicMin(first + (in_bias ? 0 : 1), static_cast<unsigned long long>(in_bias ? x : x - n));
  }
}

// The host's value checks (validate_route's on bias, route_serial's on scores) on the device:
// one pass over both, one read back.
template <class B>
void check_route_finite(B const& be, route_args<float, cuda_device_space> const& a, router_options const& opt) {
  index_t const m = a.scores.extent(0), n = a.scores.extent(1), total = m * n;
  call_buffer<unsigned long long, B> first(be, 2);
  K3_CUDA_CHECK(cudaMemsetAsync(first.get(), 0xFF, 2 * sizeof(unsigned long long), be.stream()));
  index_t const blocks = (n + total + 255) / 256;
  be.launch(dim3(static_cast<unsigned>(blocks < 4096 ? blocks : 4096)), dim3(256), 0, route_nonfinite_kernel<float>, a.bias.data_handle(),
            a.scores.data_handle(), std::int64_t(n), std::int64_t(total), first.get());
  unsigned long long found[2] = {0, 0};
  be.copy(tensor_view<unsigned long long const, 1, cuda_device_space>(first.get(), {2}), tensor_view<unsigned long long, 1>(found, {2}));
  unsigned long long const none = ~0ull;
  require(found[0] == none, error_kind::value, [&] { return "argument 'bias': non-finite value at expert " + std::to_string(found[0]); });
  if (found[1] != none) {
    index_t const x = static_cast<index_t>(found[1]);
    throw k3::error(error_kind::value, nonfinite_message(x / n, x % n, opt.input));
  }
}

}  // namespace detail

// Routes m tokens as k3::moe::route on a host backend does (router.hpp), on the backend's
// stream; see the header comment for what is served and when the call waits.
template <CudaBackend B, class T, class Space, class = ::k3::detail::reachable<B, Space>>
void route(B const& be, route_args<T, Space> const& a, router_options const& opt = {}) {
  static_assert(std::is_same_v<T, float>, "k3::moe::route on CUDA: float scores (route_args<float, cuda_device_space>)");
  detail::validate_route_args(a.scores, a.bias, a, opt, a.mask, [](index_t) {});  // bias values: check_route_finite
  qb_histogram* const hist = a.histogram;
  index_t const m = a.scores.extent(0), n = a.scores.extent(1);
  if (hist) detail::check_route_histogram(*hist, opt, n);
  detail::check_cuda_route_call(a, opt);
  ::k3::cuda::detail::device_guard const on_device(be.device());
  detail::check_route_finite(be, a, opt);
  std::size_t const cells = hist ? static_cast<std::size_t>(n * hist->bins()) : 0;
  detail::call_buffer<unsigned long long, B> counts(be, cells);
  if (cells) be.zero_fill(counts.get(), cells);
  if (!a.load.empty()) be.zero_fill(a.load.data_handle(), static_cast<std::size_t>(n));  // the launcher adds; the host overwrites
  cuda::route_args l;
  l.scores = a.scores.data_handle();
  l.bias = a.bias.data_handle();
  l.mask = a.mask.empty() ? nullptr : a.mask.data_handle();
  l.m = m;
  l.n = n;
  l.k = opt.k;
  l.routed_scale = opt.routed_scale;
  l.indices = a.indices.data_handle();
  l.weights = a.weights.data_handle();
  l.cutoff = a.cutoff.empty() ? nullptr : a.cutoff.data_handle();
  l.load = a.load.empty() ? nullptr : reinterpret_cast<unsigned long long*>(a.load.data_handle());
  if (hist) {
    l.hist = counts.get();
    l.hist_lo = hist->lo();
    l.hist_inv_width = hist->inv_width();
    l.bins = static_cast<std::int32_t>(hist->bins());
  }
  cuda::route_launch<float>(l, be.stream());
  if (!hist) return;
  std::vector<unsigned long long> add(cells);
  be.copy(tensor_view<unsigned long long const, 1, cuda_device_space>(counts.get(), {index_t(cells)}),
          tensor_view<unsigned long long, 1>(add.data(), {index_t(cells)}));
  std::int64_t* const c = hist->data();
  for (std::size_t x = 0; x < cells; ++x) c[x] += static_cast<std::int64_t>(add[x]);
}

}  // namespace k3::moe
