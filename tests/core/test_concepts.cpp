// Compile-time tests of the concepts, positive and negative; the runtime case only keeps
// doctest's runner happy.
#include <doctest/doctest.h>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/core/concepts.hpp"

namespace {
struct not_a_backend {};
struct missing_fence {
  using memory_space = k3::host_space;
  template <class T>
  T* allocate(std::size_t) const { return nullptr; }
  template <class T>
  void deallocate(T*, std::size_t) const noexcept {}
  template <class F>
  void for_each(std::int64_t, std::int64_t, F&&) const {}
};
struct throwing_deallocate {
  using memory_space = k3::host_space;
  template <class T>
  T* allocate(std::size_t) const { return nullptr; }
  template <class T>
  void deallocate(T*, std::size_t) const {}  // not noexcept
  template <class F>
  void for_each(std::int64_t, std::int64_t, F&&) const {}
  void fence() const {}
};
struct fake_device_backend {
  using memory_space = k3::cuda_device_space;
  template <class T>
  T* allocate(std::size_t) const { return nullptr; }
  template <class T>
  void deallocate(T*, std::size_t) const noexcept {}
  template <class F>
  void for_each(std::int64_t, std::int64_t, F&&) const {}
  void fence() const {}
  void* stream() const { return nullptr; }
  int device() const { return 0; }
};
}  // namespace

static_assert(k3::MemorySpace<k3::host_space>);
static_assert(k3::MemorySpace<k3::cuda_device_space>);
static_assert(!k3::MemorySpace<int>);

static_assert(k3::Backend<k3::cpu::serial>);
static_assert(k3::Backend<k3::cpu::simd<>>);
static_assert(k3::Backend<k3::cpu::threads<>>);
static_assert(k3::HostBackend<k3::cpu::threads<>>);
static_assert(!k3::Backend<not_a_backend>);
static_assert(!k3::Backend<missing_fence>);
static_assert(!k3::Backend<throwing_deallocate>);
static_assert(!k3::Backend<int>);
static_assert(!k3::CudaBackend<k3::cpu::serial>);
static_assert(k3::CudaBackend<fake_device_backend>);
static_assert(!k3::HostBackend<fake_device_backend>);

using host_view = k3::tensor_view<float, 2>;
using device_view = k3::tensor_view<float, 2, k3::cuda_device_space>;
using pinned_view = k3::tensor_view<float, 2, k3::cuda_pinned_space>;
static_assert(k3::AccessibleFrom<host_view, k3::cpu::serial>);
static_assert(k3::AccessibleFrom<pinned_view, k3::cpu::serial>);
static_assert(!k3::AccessibleFrom<device_view, k3::cpu::serial>);  // host code, device memory
static_assert(k3::AccessibleFrom<device_view, fake_device_backend>);
static_assert(k3::AccessibleFrom<pinned_view, fake_device_backend>);
static_assert(!k3::AccessibleFrom<host_view, fake_device_backend>);  // device code, host memory
static_assert(!k3::AccessibleFrom<int, k3::cpu::serial>);
static_assert(k3::TensorViewOfRank<host_view, 2>);
static_assert(!k3::TensorViewOfRank<host_view, 3>);
static_assert(k3::Real<float> && k3::Real<double> && !k3::Real<int>);

// An algorithm constrained like k3's: only callable with accessible views.
template <class B, class V>
  requires k3::AccessibleFrom<V, B>
constexpr bool callable_with(B const&, V const&) {
  return true;
}
template <class B, class V>
concept can_call = requires(B b, V v) { callable_with(b, v); };
static_assert(can_call<k3::cpu::serial, host_view>);
static_assert(!can_call<k3::cpu::serial, device_view>);

TEST_CASE("backends run for_each over the whole range") {
  int sum = 0;
  k3::cpu::serial{}.for_each(0, 10, [&](std::int64_t i) { sum += static_cast<int>(i); });
  CHECK(sum == 45);
}
