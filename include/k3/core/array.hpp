// k3/core/array.hpp — a fixed-size array usable in device code (std::array's accessors are
// host-only constexpr and nvcc rejects them in kernels without --expt-relaxed-constexpr).
#pragma once
#include <cstddef>

#include "k3/core/config.hpp"

namespace k3 {

template <class T, std::size_t N>
struct array {
  T elems[N > 0 ? N : 1];

  K3_INLINE constexpr T& operator[](std::size_t i) noexcept { return elems[i]; }
  K3_INLINE constexpr T const& operator[](std::size_t i) const noexcept { return elems[i]; }
  K3_INLINE static constexpr std::size_t size() noexcept { return N; }
  K3_INLINE constexpr T* data() noexcept { return elems; }
  K3_INLINE constexpr T const* data() const noexcept { return elems; }
  K3_INLINE constexpr T* begin() noexcept { return elems; }
  K3_INLINE constexpr T* end() noexcept { return elems + N; }
  K3_INLINE constexpr T const* begin() const noexcept { return elems; }
  K3_INLINE constexpr T const* end() const noexcept { return elems + N; }

  friend constexpr bool operator==(array const& a, array const& b) noexcept {
    for (std::size_t i = 0; i < N; ++i)
      if (!(a.elems[i] == b.elems[i])) return false;
    return true;
  }
};

}  // namespace k3
