// k3/kda/cuda/preprocess_backend.cuh — KDA's pre-processing ops (k3/kda/preprocess.hpp) on
// k3::cuda::stream_backend: short_conv / short_conv_backward / short_conv_decode, l2norm /
// l2norm_backward, beta_sigmoid / beta_sigmoid_backward, gate_softplus / gate_lower_bound and
// their backwards, for args of device views, in a TU compiled by nvcc or against the SIMT host
// runtime. The call is the host one with device views:
//
//   k3::cuda::stream_backend be{stream};
//   k3::kda::short_conv(be, k3::kda::short_conv_args<k3::bfloat16, float, k3::cuda_device_space>{...}, {.cu_seqlens = cu});
//
// The args go through the host backends' own checks (the detail::pp_validate_* functions:
// shapes, options, cu_seqlens, slots, aliasing: the same k3::error), then the launchers of
// k3/kda/cuda/preprocess.cuh run on the backend's stream.
//
// What the CUDA backend serves: activations float or k3::bfloat16 (fp32 math); parameters and
// conv states float (a P other than float, or double activations, is an unsupported-kind
// k3::error naming the argument); contiguous views. Parameter gradients are summed with fp32
// atomics (their last bits may vary between runs; the host backends sum in double, in a fixed
// order). cu_seqlens stays a host view in the options; it is copied to the device for the
// call, as are the decode slots, which are first read back to check them as the host does.
// Calls return without synchronising, except that the small device buffers they allocate are
// freed at the end (cudaFree waits for the device).
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "k3/backend/cuda/backend.cuh"
#include "k3/kda/cuda/backend.cuh"
#include "k3/kda/preprocess.hpp"

namespace k3::kda {
namespace detail {

template <class T>
constexpr char const* pp_type_name() noexcept {
  if constexpr (std::is_same_v<T, float>) return "float";
  else if constexpr (std::is_same_v<T, double>) return "double";
  else return "k3::bfloat16";
}

// The storage the launchers take: activations float or bfloat16, parameters and states float.
template <class In>
inline constexpr bool pp_cuda_storage = std::is_same_v<In, float> || std::is_same_v<In, bfloat16>;

template <class In>
void pp_require_cuda_storage(char const* name) {
  ::k3::detail::require(pp_cuda_storage<In>, error_kind::unsupported, [&] {
    return std::string("argument '") + name + "': the CUDA backend takes float or k3::bfloat16 storage, got " + pp_type_name<In>();
  });
}

template <class P>
void pp_require_cuda_parameters(char const* name) {
  ::k3::detail::require(std::is_same_v<P, float>, error_kind::unsupported, [&] {
    return std::string("argument '") + name + "': the CUDA backend takes float parameters and states, got " + pp_type_name<P>();
  });
}

// A parameter view as the launchers' float pointer: null when absent, and when P is not float
// (then the caller has checked that the view is absent).
template <class T, std::size_t R>
auto pp_float_ptr(tensor_view<T, R, cuda_device_space> const& v) noexcept {
  using F = std::conditional_t<std::is_const_v<T>, float const, float>;
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>)
    return present(v) ? v.data_handle() : static_cast<F*>(nullptr);
  else
    return static_cast<F*>(nullptr);
}

// options::cu_seqlens (host, int32 or int64, any stride) as the launchers take it: int64 on
// the host and on the device.
template <class B>
struct pp_device_offsets {
  std::vector<std::int64_t> host;
  call_buffer<std::int64_t, B> device;
  pp_device_offsets(B const& be, cu_seqlens_view const& cu) : host(values(cu)), device(be, host.size()) {
    if (!host.empty())
      ::k3::cuda::copy<std::int64_t, 1>(tensor_view<std::int64_t const, 1>(host.data(), {index_t(host.size())}),
                                        tensor_view<std::int64_t, 1, cuda_device_space>(device.get(), {index_t(host.size())}), be.stream());
  }
  static std::vector<std::int64_t> values(cu_seqlens_view const& cu) {
    std::vector<std::int64_t> v(cu.present() ? static_cast<std::size_t>(cu.size()) : 0);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = cu[static_cast<index_t>(i)];
    return v;
  }
};

// The launchers' conv description of a validated prefill call.
template <class B, class Wt, class Bias>
cuda::conv_params pp_conv_params(pp_conv_problem const& pr, Wt const& weight, Bias const& bias, pp_device_offsets<B> const& cu, bool silu) {
  cuda::conv_params p;
  p.B = pr.B;
  p.T = pr.T;
  p.C = pr.C;
  p.W = pr.W;
  p.weight = pp_float_ptr(weight);
  p.bias = pp_float_ptr(bias);
  p.cu_seqlens = cu.host.empty() ? nullptr : cu.device.get();
  p.cu_seqlens_host = cu.host.empty() ? nullptr : cu.host.data();
  p.N = static_cast<index_t>(pr.seqs.size());
  p.silu = silu;
  return p;
}

// The launchers' gate description; rows = B * T.
template <class X, class A, class Bias>
cuda::gate_params pp_gate_params(cuda::gate_kind kind, X const& x, A const& A_log, Bias const& dt_bias, double lb) {
  cuda::gate_params p;
  p.kind = kind;
  p.A_log = pp_float_ptr(A_log);
  p.dt_bias = pp_float_ptr(dt_bias);
  p.lower_bound = static_cast<float>(lb);
  p.rows = x.extent(0) * x.extent(1);
  p.HV = x.extent(2);
  p.K = x.extent(3);
  return p;
}

// The gates' parameters and their gradients, all optional: float on the CUDA backend when
// present (without any, P is never read).
template <class P, class... V>
void pp_require_gate_parameters(V const&... named) {
  auto const one = [](auto const& nv) {
    if (present(nv.second)) pp_require_cuda_parameters<P>(nv.first);
  };
  (one(named), ...);
}
template <class V>
std::pair<char const*, V const&> pp_named(char const* name, V const& v) {
  return {name, v};
}

template <cuda::gate_kind Kind, class B, class In, class P>
void pp_gate_cuda(B const& be, gate_args<In, P, cuda_device_space> const& a, double lb) {
  pp_require_cuda_storage<In>("x");
  pp_require_gate_parameters<P>(pp_named("A_log", a.A_log), pp_named("dt_bias", a.dt_bias));
  require_contiguous_on_device("x", a.x);
  require_contiguous_on_device("A_log", a.A_log);
  require_contiguous_on_device("dt_bias", a.dt_bias);
  require_contiguous_on_device("g", a.g);
  if constexpr (pp_cuda_storage<In>) {
    if (a.x.size() == 0) return;  // nothing to compute (the launcher needs HV, K >= 1)
    cuda::gate_fwd<In>(pp_gate_params(Kind, a.x, a.A_log, a.dt_bias, lb), a.x.data_handle(), a.g.data_handle(), be.stream());
  }
}

template <cuda::gate_kind Kind, class B, class In, class P>
void pp_gate_backward_cuda(B const& be, gate_backward_args<In, P, cuda_device_space> const& a, double lb) {
  pp_require_cuda_storage<In>("x");
  pp_require_gate_parameters<P>(pp_named("A_log", a.A_log), pp_named("dt_bias", a.dt_bias), pp_named("d_A_log", a.d_A_log),
                                pp_named("d_dt_bias", a.d_dt_bias));
  require_contiguous_on_device("x", a.x);
  require_contiguous_on_device("A_log", a.A_log);
  require_contiguous_on_device("dt_bias", a.dt_bias);
  require_contiguous_on_device("d_g", a.d_g);
  require_contiguous_on_device("d_x", a.d_x);
  require_contiguous_on_device("d_A_log", a.d_A_log);
  require_contiguous_on_device("d_dt_bias", a.d_dt_bias);
  if constexpr (pp_cuda_storage<In>) {
    if (a.x.extent(2) == 0 || a.x.extent(3) == 0) {  // no heads or channels: d_A_log sums nothing (the launcher needs HV, K >= 1)
      if constexpr (std::is_same_v<P, float>) {
        zero_on_device(be, a.d_A_log);
        zero_on_device(be, a.d_dt_bias);
      }
      return;
    }
    cuda::gate_bwd<In>(pp_gate_params(Kind, a.x, a.A_log, a.dt_bias, lb), a.x.data_handle(), a.d_g.data_handle(), a.d_x.data_handle(),
                       pp_float_ptr(a.d_A_log), pp_float_ptr(a.d_dt_bias), be.stream());
  }
}

}  // namespace detail

// ---- short conv ---------------------------------------------------------------------------

// final_state may be initial_state itself, as on the host: the launcher reads the initial
// state while it writes the final one, so an in-place call reads a copy.
template <CudaBackend B, Storage In, Storage P>
void short_conv(B const& be, short_conv_args<In, P, cuda_device_space> const& a, short_conv_options const& opt = {}) {
  detail::pp_conv_problem const pr = detail::pp_validate_short_conv(a, opt);
  detail::pp_require_cuda_storage<In>("x");
  detail::pp_require_cuda_parameters<P>("weight");
  detail::require_contiguous_on_device("x", a.x);
  detail::require_contiguous_on_device("weight", a.weight);
  detail::require_contiguous_on_device("bias", a.bias);
  detail::require_contiguous_on_device("y", a.y);
  detail::require_contiguous_on_device("initial_state", a.initial_state);
  detail::require_contiguous_on_device("final_state", a.final_state);
  if constexpr (detail::pp_cuda_storage<In> && std::is_same_v<P, float>) {
    if (pr.C == 0) return;  // no channels: y and the states are empty (the launcher needs C >= 1)
    detail::pp_device_offsets<B> const cu(be, opt.cu_seqlens);
    float const* init = detail::pp_float_ptr(a.initial_state);
    std::size_t const states = pr.in_place ? static_cast<std::size_t>(a.initial_state.size()) : 0;
    detail::call_buffer<float, B> const init_copy(be, states);
    if (states > 0) {
      K3_CUDA_CHECK(cudaMemcpyAsync(init_copy.get(), init, states * sizeof(float), cudaMemcpyDeviceToDevice, be.stream()));
      init = init_copy.get();
    }
    cuda::short_conv_fwd<In>(detail::pp_conv_params(pr, a.weight, a.bias, cu, opt.silu), a.x.data_handle(), a.y.data_handle(), init,
                             detail::pp_float_ptr(a.final_state), be.stream());
  }
}

template <CudaBackend B, Storage In, Storage P>
void short_conv_backward(B const& be, short_conv_backward_args<In, P, cuda_device_space> const& a, short_conv_options const& opt = {}) {
  detail::pp_conv_problem const pr = detail::pp_validate_short_conv_backward(a, opt);
  detail::pp_require_cuda_storage<In>("x");
  detail::pp_require_cuda_parameters<P>("weight");
  detail::require_contiguous_on_device("x", a.x);
  detail::require_contiguous_on_device("weight", a.weight);
  detail::require_contiguous_on_device("bias", a.bias);
  detail::require_contiguous_on_device("d_y", a.d_y);
  detail::require_contiguous_on_device("d_x", a.d_x);
  detail::require_contiguous_on_device("d_weight", a.d_weight);
  detail::require_contiguous_on_device("d_bias", a.d_bias);
  detail::require_contiguous_on_device("initial_state", a.initial_state);
  detail::require_contiguous_on_device("d_initial_state", a.d_initial_state);
  if constexpr (detail::pp_cuda_storage<In> && std::is_same_v<P, float>) {
    if (pr.C == 0) return;  // no channels: every gradient is empty
    detail::pp_device_offsets<B> const cu(be, opt.cu_seqlens);
    cuda::short_conv_bwd<In>(detail::pp_conv_params(pr, a.weight, a.bias, cu, opt.silu), a.x.data_handle(), a.d_y.data_handle(),
                             a.d_x.data_handle(), detail::pp_float_ptr(a.d_weight), detail::pp_float_ptr(a.d_bias),
                             detail::pp_float_ptr(a.initial_state), detail::pp_float_ptr(a.d_initial_state), be.stream());
  }
}

// The slots are read back to the host once, checked there as the host backends check them,
// and the checked values (int64) are what the kernel reads: slots32 and strided slots work.
template <CudaBackend B, Storage In, Storage P>
void short_conv_decode(B const& be, short_conv_decode_args<In, P, cuda_device_space> const& a, short_conv_options const& opt = {}) {
  detail::pp_decode_problem const pr = detail::pp_validate_short_conv_decode(a, opt, [&] {
    index_t const N = a.x.extent(0);
    std::vector<index_t> s(static_cast<std::size_t>(N));
    if (present(a.slots32)) {
      std::vector<std::int32_t> s32(s.size());
      ::k3::cuda::copy<std::int32_t, 1>(a.slots32, tensor_view<std::int32_t, 1>(s32.data(), {N}), be.stream());
      s.assign(s32.begin(), s32.end());
    } else {
      std::vector<std::int64_t> s64(s.size());
      ::k3::cuda::copy<std::int64_t, 1>(a.slots64, tensor_view<std::int64_t, 1>(s64.data(), {N}), be.stream());
      s.assign(s64.begin(), s64.end());
    }
    return s;
  });
  detail::pp_require_cuda_storage<In>("x");
  detail::pp_require_cuda_parameters<P>("weight");
  detail::require_contiguous_on_device("x", a.x);
  detail::require_contiguous_on_device("weight", a.weight);
  detail::require_contiguous_on_device("bias", a.bias);
  detail::require_contiguous_on_device("conv_state", a.conv_state);
  detail::require_contiguous_on_device("y", a.y);
  if constexpr (detail::pp_cuda_storage<In> && std::is_same_v<P, float>) {
    if (pr.N == 0 || pr.C == 0) return;  // nothing to decode (the launcher needs C >= 1)
    bool const slotted = present(a.slots32) || present(a.slots64);
    std::vector<std::int64_t> const host_slots(pr.slot.begin(), slotted ? pr.slot.end() : pr.slot.begin());
    detail::call_buffer<std::int64_t, B> const dev_slots(be, host_slots.size());
    if (slotted)
      ::k3::cuda::copy<std::int64_t, 1>(tensor_view<std::int64_t const, 1>(host_slots.data(), {pr.N}),
                                        tensor_view<std::int64_t, 1, cuda_device_space>(dev_slots.get(), {pr.N}), be.stream());
    cuda::conv_params p;
    p.C = pr.C;
    p.W = pr.W;
    p.weight = detail::pp_float_ptr(a.weight);
    p.bias = detail::pp_float_ptr(a.bias);
    p.silu = opt.silu;
    cuda::short_conv_decode<In>(p, a.x.data_handle(), a.y.data_handle(), pr.N, a.conv_state.data_handle(), pr.pool,
                                slotted ? dev_slots.get() : nullptr, be.stream());
  }
}

// ---- l2norm and beta -------------------------------------------------------------------------

template <CudaBackend B, Storage In, std::size_t Rank>
void l2norm(B const& be, l2norm_args<In, Rank, cuda_device_space> const& a, l2norm_options const& = {}) {
  static_assert(Rank >= 1, "l2norm_args: x and y need rank >= 1 (the norm runs over the last dimension)");
  detail::pp_validate_l2norm(a);
  detail::pp_require_cuda_storage<In>("x");
  detail::require_contiguous_on_device("x", a.x);
  detail::require_contiguous_on_device("y", a.y);
  if constexpr (detail::pp_cuda_storage<In>)
    cuda::l2norm_fwd<In>(a.x.data_handle(), a.y.data_handle(), detail::pp_rows(a.x), a.x.extent(Rank - 1), be.stream());
}

template <CudaBackend B, Storage In, std::size_t Rank>
void l2norm_backward(B const& be, l2norm_backward_args<In, Rank, cuda_device_space> const& a, l2norm_options const& = {}) {
  static_assert(Rank >= 1, "l2norm_backward_args: x, d_y and d_x need rank >= 1 (the norm runs over the last dimension)");
  detail::pp_validate_l2norm_backward(a);
  detail::pp_require_cuda_storage<In>("x");
  detail::require_contiguous_on_device("x", a.x);
  detail::require_contiguous_on_device("d_y", a.d_y);
  detail::require_contiguous_on_device("d_x", a.d_x);
  if constexpr (detail::pp_cuda_storage<In>)
    cuda::l2norm_bwd<In>(a.x.data_handle(), a.d_y.data_handle(), a.d_x.data_handle(), detail::pp_rows(a.x), a.x.extent(Rank - 1),
                         be.stream());
}

template <CudaBackend B, Storage In, std::size_t Rank>
void beta_sigmoid(B const& be, beta_sigmoid_args<In, Rank, cuda_device_space> const& a, beta_sigmoid_options const& opt = {}) {
  static_assert(Rank >= 1, "beta_sigmoid_args: x and beta need rank >= 1");
  detail::pp_validate_beta_sigmoid(a);
  detail::pp_require_cuda_storage<In>("x");
  detail::require_contiguous_on_device("x", a.x);
  detail::require_contiguous_on_device("beta", a.beta);
  if constexpr (detail::pp_cuda_storage<In>)
    cuda::beta_sigmoid_fwd<In>(a.x.data_handle(), a.beta.data_handle(), a.x.size(), opt.allow_neg_eigval, be.stream());
}

template <CudaBackend B, Storage In, std::size_t Rank>
void beta_sigmoid_backward(B const& be, beta_sigmoid_backward_args<In, Rank, cuda_device_space> const& a,
                           beta_sigmoid_options const& opt = {}) {
  static_assert(Rank >= 1, "beta_sigmoid_backward_args: x, d_beta and d_x need rank >= 1");
  detail::pp_validate_beta_sigmoid_backward(a);
  detail::pp_require_cuda_storage<In>("x");
  detail::require_contiguous_on_device("x", a.x);
  detail::require_contiguous_on_device("d_beta", a.d_beta);
  detail::require_contiguous_on_device("d_x", a.d_x);
  if constexpr (detail::pp_cuda_storage<In>)
    cuda::beta_sigmoid_bwd<In>(a.x.data_handle(), a.d_beta.data_handle(), a.d_x.data_handle(), a.x.size(), opt.allow_neg_eigval,
                               be.stream());
}

// ---- the two gates ---------------------------------------------------------------------------

template <CudaBackend B, Storage In, Storage P>
void gate_softplus(B const& be, gate_args<In, P, cuda_device_space> const& a, gate_softplus_options const& = {}) {
  detail::pp_validate_gate<detail::pp_gate::softplus>(a, 0.0);
  detail::pp_gate_cuda<cuda::gate_kind::softplus>(be, a, 0.0);
}

template <CudaBackend B, Storage In, Storage P>
void gate_softplus_backward(B const& be, gate_backward_args<In, P, cuda_device_space> const& a, gate_softplus_options const& = {}) {
  detail::pp_validate_gate_backward<detail::pp_gate::softplus>(a, 0.0);
  detail::pp_gate_backward_cuda<cuda::gate_kind::softplus>(be, a, 0.0);
}

template <CudaBackend B, Storage In, Storage P>
void gate_lower_bound(B const& be, gate_args<In, P, cuda_device_space> const& a, gate_options const& opt = {}) {
  detail::pp_validate_gate<detail::pp_gate::lower_bound>(a, opt.lower_bound);
  detail::pp_gate_cuda<cuda::gate_kind::lower_bound>(be, a, opt.lower_bound);
}

template <CudaBackend B, Storage In, Storage P>
void gate_lower_bound_backward(B const& be, gate_backward_args<In, P, cuda_device_space> const& a, gate_options const& opt = {}) {
  detail::pp_validate_gate_backward<detail::pp_gate::lower_bound>(a, opt.lower_bound);
  detail::pp_gate_backward_cuda<cuda::gate_kind::lower_bound>(be, a, opt.lower_bound);
}

}  // namespace k3::kda
