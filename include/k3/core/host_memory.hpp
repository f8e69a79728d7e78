// k3/core/host_memory.hpp — aligned host allocation shared by the CPU backends.
#pragma once
#include <cstddef>
#include <cstdlib>
#include <new>

#include "k3/core/memory_space.hpp"

namespace k3::detail {

inline constexpr std::size_t host_alignment = 64;  // a cache line, and one AVX-512 register

template <class T>
T* host_allocate(std::size_t n) {
  if (n == 0) return nullptr;
  if (n > (std::size_t(-1) - host_alignment) / sizeof(T)) throw std::bad_alloc();
  std::size_t bytes = (n * sizeof(T) + host_alignment - 1) / host_alignment * host_alignment;
  void* p = std::aligned_alloc(host_alignment, bytes);
  if (!p) throw std::bad_alloc();
  return static_cast<T*>(p);
}

template <class T>
void host_deallocate(T* p, std::size_t) noexcept {
  std::free(p);
}

// The memory half of a CPU backend (its base class): every CPU backend hands out the same
// aligned host blocks.
struct host_memory {
  using memory_space = host_space;

  template <class T>
  T* allocate(std::size_t n) const {
    return host_allocate<T>(n);
  }
  template <class T>
  void deallocate(T* p, std::size_t n) const noexcept {
    host_deallocate(p, n);
  }
};

}  // namespace k3::detail
