// k3/kda/cuda/backend.cuh — KDA on k3::cuda::stream_backend: k3::kda::forward / backward /
// decode (k3/kda.hpp's calls) for args of device views, in a TU compiled by nvcc or against
// the SIMT host runtime. The arguments go through the host backends' validation
// (k3::kda::detail::validate: shapes, options, cu_seqlens, aliasing), then the launchers of
// k3/kda/cuda/*.cuh run on the backend's stream. The launchers also instantiate here, so no
// K3_KDA_CUDA_INSTANTIATE is needed for these calls.
//
//   k3::cuda::stream_backend be{stream};
//   k3::kda::forward(be, k3::kda::forward_args<k3::bfloat16, float, k3::cuda_device_space>{...}, opt);
//
// What the CUDA backend serves: storage float or bfloat16 with float states; contiguous
// views; 1 <= K <= 128 (wider heads are an unsupported-kind k3::error); the chunked form
// (options::mode automatic or chunk: there is no recurrent CUDA kernel); scale > 0. Not
// served: forward_args::saved / backward_args::saved (the CUDA backward recomputes the
// per-chunk states). options::gate_lower_bound is checked as an option, but g itself is not
// read to check the promise: the CUDA kernels are exact for any gate. cu_seqlens stays a host
// view in options; it is copied to the device for the call. Calls return without
// synchronising, except that the small device buffers they allocate are freed at the end
// (cudaFree waits for the device).
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/backend/cuda/backend.cuh"
#include "k3/core/storage.hpp"
#include "k3/kda/common.hpp"
#include "k3/kda/cuda/kda.cuh"

namespace k3::kda {
namespace detail {

template <class V>
void require_contiguous_on_device(char const* name, V const& v) {
  ::k3::detail::require(!present(v) || v.is_contiguous(), error_kind::unsupported, [&] {
    return std::string("argument '") + name + "': the CUDA backend takes contiguous views, got shape " + ::k3::format_shape(v.extents()) +
           " with strides " + ::k3::format_shape(v.strides());
  });
}

// The form and options the CUDA kernels serve (see the header comment).
inline void check_cuda_call(problem const& p, options const& opt, bool saved) {
  ::k3::detail::require(opt.mode != algorithm::recurrent, error_kind::unsupported,
                        "option 'mode': the CUDA backend runs the chunked form (automatic or chunk), got recurrent");
  ::k3::detail::require(!saved, error_kind::unsupported,
                        "argument 'saved': the CUDA backward recomputes the per-chunk states; saved states are for the host backends");
  ::k3::detail::require(p.scale > 0, error_kind::unsupported,
                        [&] { return "option 'scale': the CUDA kernels take a scale > 0, got " + ::k3::format_number(p.scale); });
}

using ::k3::cuda::detail::call_buffer;  // k3/backend/cuda/backend.cuh

// options::cu_seqlens (host, int32 or int64) as the launchers take it: int64 on the host and
// on the device.
template <class B>
struct device_offsets {
  std::vector<std::int64_t> host;
  call_buffer<std::int64_t, B> device;
  device_offsets(B const& be, problem const& p)
      : host(p.varlen ? p.offsets.begin() : p.offsets.end(), p.offsets.end()), device(be, host.size()) {
    if (!host.empty())
      ::k3::cuda::copy<std::int64_t, 1>(tensor_view<std::int64_t const, 1>(host.data(), {index_t(host.size())}),
                                        tensor_view<std::int64_t, 1, cuda_device_space>(device.get(), {index_t(host.size())}), be.stream());
  }
  std::int64_t const* device_ptr() const noexcept { return host.empty() ? nullptr : device.get(); }
  std::int64_t const* host_ptr() const noexcept { return host.empty() ? nullptr : host.data(); }
};

// The dimensions, sequences and scale the chunked launchers' args (fwd_args, bwd_args) share.
template <class B, class LauncherArgs>
void set_sequences(problem const& p, device_offsets<B> const& cu, LauncherArgs& l) {
  l.cu_seqlens = cu.device_ptr();
  l.cu_seqlens_host = cu.host_ptr();
  l.N = p.N;
  l.B = p.B;
  l.T = p.T;
  l.H = p.H;
  l.HV = p.HV;
  l.K = p.K;
  l.V = p.V;
  l.scale = static_cast<float>(p.scale);
}

template <class T, std::size_t R>
T const* data_or_null(tensor_view<T, R, cuda_device_space> const& v) noexcept {
  return present(v) ? v.data_handle() : nullptr;
}

// y = x as bfloat16 (rounded to nearest even), elementwise on the device.
struct store_bfloat16 {
  float const* x;
  bfloat16* y;
  K3_HD void operator()(std::int64_t i) const { y[i] = bfloat16(x[i]); }
};

template <class B, class T, std::size_t R>
void zero_on_device(B const& be, tensor_view<T, R, cuda_device_space> const& v) {
  if (v.size() > 0)
    K3_CUDA_CHECK(cudaMemsetAsync(v.data_handle(), 0, static_cast<std::size_t>(v.size()) * sizeof(T), be.stream()));
}

template <class In, class S>
inline constexpr bool cuda_types = (std::is_same_v<In, float> || std::is_same_v<In, bfloat16>) && std::is_same_v<S, float>;

}  // namespace detail

template <CudaBackend B, Storage In, Real S, class Space, class = ::k3::detail::reachable<B, Space>>
void forward(B const& be, forward_args<In, S, Space> const& a, options const& opt = {}) {
  static_assert(detail::cuda_types<In, S>, "k3::kda::forward on CUDA: storage float or k3::bfloat16, state float");
  detail::problem const p = detail::validate(a, opt);
  detail::check_cuda_call(p, opt, present(a.saved));
  detail::shared_inputs(a)([](char const* name, auto const& v) { detail::require_contiguous_on_device(name, v); });
  detail::require_contiguous_on_device("o", a.o);
  detail::require_contiguous_on_device("ht", a.ht);
  if (p.K == 0 || p.V == 0) {  // an empty state: o = 0 (the kernels need K, V >= 1)
    detail::zero_on_device(be, a.o);
    return;
  }
  detail::device_offsets<B> const cu(be, p);
  cuda::fwd_args<In> f;
  f.q = a.q.data_handle();
  f.k = a.k.data_handle();
  f.v = a.v.data_handle();
  f.g = a.g.data_handle();
  f.beta = a.beta.data_handle();
  f.h0 = detail::data_or_null(a.h0);
  f.o = a.o.data_handle();
  f.ht = present(a.ht) ? a.ht.data_handle() : nullptr;
  detail::set_sequences(p, cu, f);
  cuda::chunk_fwd<In>(f, be.stream());
}

template <CudaBackend B, Storage In, Real S, class Space, class = ::k3::detail::reachable<B, Space>>
void backward(B const& be, backward_args<In, S, Space> const& a, options const& opt = {}) {
  static_assert(detail::cuda_types<In, S>, "k3::kda::backward on CUDA: storage float or k3::bfloat16, state float");
  detail::problem const p = detail::validate(a, opt);
  detail::check_cuda_call(p, opt, present(a.saved));
  detail::shared_inputs(a)([](char const* name, auto const& v) { detail::require_contiguous_on_device(name, v); });
  detail::require_contiguous_on_device("do", a.d_o);
  detail::require_contiguous_on_device("dht", a.dht);
  detail::require_contiguous_on_device("dq", a.dq);
  detail::require_contiguous_on_device("dk", a.dk);
  detail::require_contiguous_on_device("dv", a.dv);
  detail::require_contiguous_on_device("dg", a.dg);
  detail::require_contiguous_on_device("dbeta", a.dbeta);
  detail::require_contiguous_on_device("dh0", a.dh0);
  if (p.K == 0 || p.V == 0) {  // an empty state: o = 0 whatever the inputs, every gradient 0
    detail::zero_on_device(be, a.dq);
    detail::zero_on_device(be, a.dk);
    detail::zero_on_device(be, a.dv);
    detail::zero_on_device(be, a.dg);
    detail::zero_on_device(be, a.dbeta);
    return;
  }
  // The kernels write float gradients: bfloat16 ones go through float buffers.
  constexpr bool narrow = std::is_same_v<In, bfloat16>;
  auto const elems = [](auto const& v) { return narrow ? static_cast<std::size_t>(v.size()) : std::size_t(0); };
  detail::call_buffer<float, B> dq(be, elems(a.dq)), dk(be, elems(a.dk)), dv(be, elems(a.dv)), dg(be, elems(a.dg)), dbeta(be, elems(a.dbeta));
  auto const out = [&](auto const& v, detail::call_buffer<float, B> const& buf) -> float* {
    if constexpr (narrow)
      return buf.get();
    else
      return v.data_handle();
  };
  detail::device_offsets<B> const cu(be, p);
  cuda::bwd_args<In> g;
  g.q = a.q.data_handle();
  g.k = a.k.data_handle();
  g.v = a.v.data_handle();
  g.g = a.g.data_handle();
  g.beta = a.beta.data_handle();
  g.h0 = detail::data_or_null(a.h0);
  g.do_ = a.d_o.data_handle();
  g.dht = detail::data_or_null(a.dht);
  g.dq = out(a.dq, dq);
  g.dk = out(a.dk, dk);
  g.dv = out(a.dv, dv);
  g.dg = out(a.dg, dg);
  g.dbeta = out(a.dbeta, dbeta);
  g.dh0 = present(a.dh0) ? a.dh0.data_handle() : nullptr;
  detail::set_sequences(p, cu, g);
  cuda::chunk_bwd<In>(g, be.stream());
  if constexpr (narrow) {
    auto const store = [&](auto const& v, detail::call_buffer<float, B> const& buf) {
      if (v.size() > 0) be.for_each(0, v.size(), detail::store_bfloat16{buf.get(), v.data_handle()});
    };
    store(a.dq, dq);
    store(a.dk, dk);
    store(a.dv, dv);
    store(a.dg, dg);
    store(a.dbeta, dbeta);
  }
}

// One token per sequence over a device pool of float states, slot by slot (negative: padding,
// skipped). The slots are read back to the host once to check them as the host backends do.
template <CudaBackend B, Storage In, Real S, class Space, class = ::k3::detail::reachable<B, Space>>
void decode(B const& be, decode_args<In, S, Space> const& a, options const& opt = {}) {
  static_assert(detail::cuda_types<In, S>, "k3::kda::decode on CUDA: storage float or k3::bfloat16, state float");
  detail::problem const p = detail::validate(a, opt);
  ::k3::detail::require(p.scale > 0, error_kind::unsupported,
                        [&] { return "option 'scale': the CUDA kernels take a scale > 0, got " + ::k3::format_number(p.scale); });
  detail::require_contiguous_on_device("q", a.q);
  detail::require_contiguous_on_device("k", a.k);
  detail::require_contiguous_on_device("v", a.v);
  detail::require_contiguous_on_device("g", a.g);
  detail::require_contiguous_on_device("beta", a.beta);
  detail::require_contiguous_on_device("o", a.o);
  detail::require_contiguous_on_device("state_pool", a.state_pool);
  detail::require_contiguous_on_device("slots", a.slots32);
  detail::require_contiguous_on_device("slots", a.slots64);
  index_t const N = p.N, P = a.state_pool.extent(0);
  if (N == 0 || p.K == 0 || p.V == 0) {  // nothing to decode, or an empty state: o = 0 for every live entry
    if (N == 0) return;
    std::vector<std::int64_t> slots(static_cast<std::size_t>(N));
    if (present(a.slots32)) {
      std::vector<std::int32_t> s32(slots.size());
      ::k3::cuda::copy<std::int32_t, 1>(a.slots32, tensor_view<std::int32_t, 1>(s32.data(), {N}), be.stream());
      slots.assign(s32.begin(), s32.end());
    } else {
      ::k3::cuda::copy<std::int64_t, 1>(a.slots64, tensor_view<std::int64_t, 1>(slots.data(), {N}), be.stream());
    }
    detail::check_slots([&](index_t n) { return index_t(slots[std::size_t(n)]); }, N, P);
    for (index_t n = 0; n < N; ++n)
      if (slots[std::size_t(n)] >= 0 && p.V > 0)
        K3_CUDA_CHECK(cudaMemsetAsync(&a.o(n, 0, 0), 0, static_cast<std::size_t>(p.HV * p.V) * sizeof(In), be.stream()));
    return;
  }
  std::vector<std::int64_t> host_slots(static_cast<std::size_t>(N));
  detail::call_buffer<std::int64_t, B> wide(be, present(a.slots32) ? host_slots.size() : 0);
  std::int64_t const* dev_slots = a.slots64.data_handle();
  if (present(a.slots32)) {
    std::vector<std::int32_t> s32(host_slots.size());
    ::k3::cuda::copy<std::int32_t, 1>(a.slots32, tensor_view<std::int32_t, 1>(s32.data(), {N}), be.stream());
    host_slots.assign(s32.begin(), s32.end());
    ::k3::cuda::copy<std::int64_t, 1>(tensor_view<std::int64_t const, 1>(host_slots.data(), {N}),
                                      tensor_view<std::int64_t, 1, cuda_device_space>(wide.get(), {N}), be.stream());
    dev_slots = wide.get();
  } else {
    ::k3::cuda::copy<std::int64_t, 1>(a.slots64, tensor_view<std::int64_t, 1>(host_slots.data(), {N}), be.stream());
  }
  detail::check_slots([&](index_t n) { return index_t(host_slots[std::size_t(n)]); }, N, P);
  cuda::decode_args<In> d;
  d.q = a.q.data_handle();
  d.k = a.k.data_handle();
  d.v = a.v.data_handle();
  d.g = a.g.data_handle();
  d.beta = a.beta.data_handle();
  d.state = a.state_pool.data_handle();
  d.slots = dev_slots;
  d.slots_host = host_slots.data();
  d.o = a.o.data_handle();
  d.N = N;
  d.P = P;
  d.H = p.H;
  d.HV = p.HV;
  d.K = p.K;
  d.V = p.V;
  d.scale = static_cast<float>(p.scale);
  cuda::decode<In>(d, be.stream());
  K3_CUDA_CHECK(cudaStreamSynchronize(be.stream()));  // host_slots is read by the launch's checks only, but `wide` goes now
}

}  // namespace k3::kda
