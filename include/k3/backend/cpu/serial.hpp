// k3/backend/cpu/serial.hpp — k3::cpu::serial: plain loops on one thread. The reference
// backend every faster path is tested against.
#pragma once
#include <cstddef>
#include <cstdint>

#include "k3/core/concepts.hpp"
#include "k3/core/host_memory.hpp"
#include "k3/core/memory_space.hpp"

namespace k3::cpu {

struct serial : ::k3::detail::host_memory {
  static constexpr char const* name() noexcept { return "cpu::serial"; }

  template <class F>
  void for_each(std::int64_t begin, std::int64_t end, F&& f) const {
    for (std::int64_t i = begin; i < end; ++i) f(i);
  }
  void fence() const noexcept {}
  static constexpr int concurrency() noexcept { return 1; }
};

static_assert(HostBackend<serial>);

}  // namespace k3::cpu
