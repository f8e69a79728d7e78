// Compile-time tests of the concepts, positive and negative; the runtime case only keeps
// doctest's runner happy.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/core/backend_traits.hpp"
#include "k3/core/concepts.hpp"
#include "k3/core/sequence_offsets.hpp"
#include "k3/core/storage.hpp"

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

// The one vocabulary every capability uses (k3/core/storage.hpp, backend_traits.hpp).
static_assert(k3::Storage<float> && k3::Storage<double> && k3::Storage<k3::bfloat16>);
static_assert(!k3::Storage<int> && !k3::Storage<float const> && !k3::Storage<std::uint8_t>);
static_assert(std::is_same_v<k3::accumulation_t<float>, float>);
static_assert(std::is_same_v<k3::accumulation_t<k3::bfloat16, float>, float>);
static_assert(std::is_same_v<k3::accumulation_t<double const>, double>);
static_assert(std::is_same_v<k3::accumulation_t<k3::bfloat16, double>, double>);
static_assert(!k3::VectorBackend<k3::cpu::serial>);
static_assert(k3::VectorBackend<k3::cpu::simd<>> && k3::VectorBackend<k3::cpu::threads<>>);
static_assert(!k3::TaskBackend<k3::cpu::serial> && !k3::TaskBackend<k3::cpu::simd<>>);
static_assert(k3::TaskBackend<k3::cpu::threads<>>);
static_assert(k3::backend_traits<k3::cpu::threads<>>::vectorised && k3::backend_traits<k3::cpu::threads<>>::has_tasks);
static_assert(!k3::backend_traits<k3::cpu::serial>::vectorised && !k3::backend_traits<fake_device_backend>::has_tasks);
static_assert(!k3::present(k3::tensor_view<float, 2>{}));
static_assert(k3::present(k3::tensor_view<float, 2>(nullptr, {0, 3})));  // given, empty: checked like any view

TEST_CASE("run_tasks runs every task once, on the pool or in order") {
  std::vector<int> seen(37, 0);
  k3::run_tasks(k3::cpu::threads<>(3), 37, [&](k3::index_t i) { seen[std::size_t(i)] += 1; });
  CHECK(std::count(seen.begin(), seen.end(), 1) == 37);
  std::vector<k3::index_t> order;
  k3::run_tasks(k3::cpu::serial{}, 5, [&](k3::index_t i) { order.push_back(i); });
  CHECK(order == std::vector<k3::index_t>{0, 1, 2, 3, 4});
  k3::run_tasks(k3::cpu::serial{}, -2, [&](k3::index_t) { order.push_back(99); });
  CHECK(order.size() == 5);
  CHECK(k3::concurrency(k3::cpu::threads<>(3)) == 3);
  CHECK(k3::concurrency(k3::cpu::serial{}) == 1);
}

TEST_CASE("sequence offsets: one type for int32 and int64") {
  std::vector<std::int32_t> o32 = {0, 2, 7};
  std::vector<std::int64_t> o64 = {0, 5};
  k3::cu_seqlens_view a = o32, b = o64, none;
  CHECK(a.present());
  CHECK(a.is_int32());
  CHECK(a.size() == 3);
  CHECK(a[2] == 7);
  CHECK(b.present());
  CHECK(!b.is_int32());
  CHECK(b[1] == 5);
  CHECK(!none.present());
  CHECK(!k3::present(none));
  std::vector<std::int64_t> every_other = {0, -1, 4, -1, 9};
  k3::cu_seqlens_view strided = k3::tensor_view<std::int64_t const, 1>(every_other.data(), {3}, {2});
  CHECK(strided[1] == 4);
  CHECK(strided[2] == 9);
  static_assert(!std::is_constructible_v<k3::cu_seqlens_view, std::vector<std::int64_t>&&>);  // would dangle
}

TEST_CASE("backends run for_each over the whole range") {
  int sum = 0;
  k3::cpu::serial{}.for_each(0, 10, [&](std::int64_t i) { sum += static_cast<int>(i); });
  CHECK(sum == 45);
}
