// k3/core/concepts.hpp — the small, flat concepts every algorithm is constrained on.
// Kept shallow on purpose: deep hierarchies cost compile time and nvcc < 12.4 had gaps in
// subsumption.
#pragma once
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "k3/core/config.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/core/storage.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3 {

namespace detail {
// Stands in for "any index callable" in requires-expressions (a lambda cannot appear there).
struct index_fn_archetype {
  K3_HD void operator()(std::int64_t) const noexcept {}
};
}  // namespace detail

// A backend: where memory lives, how to get it, how to run independent work, how to wait.
template <class B>
concept Backend = std::copy_constructible<B> && requires(B const& b, std::size_t n, float* p) {
  typename B::memory_space;
  requires MemorySpace<typename B::memory_space>;
  { b.template allocate<float>(n) } -> std::same_as<float*>;
  { b.deallocate(p, n) } noexcept;
  b.for_each(std::int64_t{0}, std::int64_t{1}, detail::index_fn_archetype{});
  b.fence();
};

// A backend whose code runs on the host (CPU backends).
template <class B>
concept HostBackend = Backend<B> && B::memory_space::host_accessible;

// A CUDA backend adds a stream and kernel launch.
template <class B>
concept CudaBackend = Backend<B> && requires(B const& b) {
  b.stream();
  { b.device() } -> std::convertible_to<int>;
};

namespace detail {
// The memory-space check of every host op, as a defaulted template parameter
// (`class = detail::reachable<B, Space>`): defaults are substituted before the constraints
// are checked, so the host overload names both mix-ups (device views on a host backend,
// host views on a CUDA backend) in one readable error, and no op needs a rejecting overload.
template <class B, class Space>
struct space_gate {
  static_assert(!HostBackend<B> || Space::host_accessible,
                "the args hold device views (cuda_device_space) but the backend runs on the host; "
                "give host views or k3::cuda::stream_backend");
  static_assert(!CudaBackend<B> || Space::device_accessible,
                "the backend is CUDA but the args hold host views; give device views "
                "(args<..., cuda_device_space>) or a host backend");
  // Absent when a check fails, so the op drops out of overload resolution and its body is not
  // instantiated: the assertion above stays the only error.
  using type = std::enable_if_t<(!HostBackend<B> || Space::host_accessible) && (!CudaBackend<B> || Space::device_accessible)>;
};
template <class B, class Space>
using reachable = typename space_gate<B, Space>::type;
}  // namespace detail

template <class V>
concept TensorView = detail::is_tensor_view<std::remove_cvref_t<V>>::value;

template <class V, std::size_t Rank>
concept TensorViewOfRank = TensorView<V> && (std::remove_cvref_t<V>::rank() == Rank);

// Host/device mix-ups as compile errors: a view is usable by a backend only if the
// backend's execution space can dereference the view's memory space.
template <class V, class B>
concept AccessibleFrom = TensorView<V> && Backend<B> &&
                         space_accessible_v<typename B::memory_space, typename std::remove_cvref_t<V>::memory_space>;

// Element types k3 computes in (storage types such as bfloat16 are converted on load).
template <class T>
concept Real = std::same_as<T, float> || std::same_as<T, double>;

}  // namespace k3
