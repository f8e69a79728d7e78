// k3/core/memory_space.hpp — memory spaces as empty trait types (Kokkos' idea, checked by a
// concept instead of macros). A view's space is part of its type, so passing device memory
// to a host algorithm is a compile error, not a segfault.
#pragma once
#include <concepts>

namespace k3 {

struct host_space {
  static constexpr bool host_accessible = true;
  static constexpr bool device_accessible = false;
  static constexpr char const* name() noexcept { return "host"; }
};

struct cuda_device_space {
  static constexpr bool host_accessible = false;
  static constexpr bool device_accessible = true;
  static constexpr char const* name() noexcept { return "cuda_device"; }
};

// Page-locked host memory mapped into the device address space.
struct cuda_pinned_space {
  static constexpr bool host_accessible = true;
  static constexpr bool device_accessible = true;
  static constexpr char const* name() noexcept { return "cuda_pinned"; }
};

template <class S>
concept MemorySpace = requires {
  { S::host_accessible } -> std::convertible_to<bool>;
  { S::device_accessible } -> std::convertible_to<bool>;
};

// Can code running in space `Exec` dereference memory living in space `Mem`?
template <MemorySpace Exec, MemorySpace Mem>
inline constexpr bool space_accessible_v =
    std::same_as<Exec, Mem> || (Exec::host_accessible && Mem::host_accessible) ||
    (Exec::device_accessible && !Exec::host_accessible && Mem::device_accessible);

}  // namespace k3
