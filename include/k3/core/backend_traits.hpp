// k3/core/backend_traits.hpp — what an algorithm may ask of a backend beyond the Backend
// concept: its SIMD architecture, how many threads it runs tasks on, and how to run tasks.
// Every capability asks through these, so that "this backend vectorises" has one meaning.
#pragma once
#include <cstdint>
#include <type_traits>

#include "k3/core/concepts.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3 {

// A backend that carries an xsimd architecture (cpu::simd<Arch>, cpu::threads<Arch>): the
// vectorised kernels are instantiated for B::arch_type.
template <class B>
concept VectorBackend = requires { typename B::arch_type; };

// A backend with a task pool (cpu::threads): for_each_task(n, f) runs f(0..n-1) concurrently.
template <class B>
concept TaskBackend = requires(B const& b) {
  b.for_each_task(std::int64_t{1}, detail::index_fn_archetype{});
  { b.concurrency() } -> std::convertible_to<int>;
};

template <class B>
struct backend_traits {
  static constexpr bool vectorised = VectorBackend<B>;
  static constexpr bool has_tasks = TaskBackend<B>;
};

// Threads a backend runs tasks on (1 for the single-threaded ones).
template <class B>
index_t concurrency(B const& b) noexcept {
  if constexpr (requires { b.concurrency(); })
    return index_t(b.concurrency());
  else
    return 1;
}

// Runs f(i) for i in [0, n): on the backend's pool when it has one, in order otherwise.
template <class B, class F>
void run_tasks(B const& b, index_t n, F&& f) {
  if (n <= 0) return;
  if constexpr (requires { b.for_each_task(n, f); })
    b.for_each_task(n, f);
  else
    for (index_t i = 0; i < n; ++i) f(i);
}

}  // namespace k3
