// Memory spaces and the accessibility table behind AccessibleFrom. All compile-time.
#include <doctest/doctest.h>

#include <string>

#include "k3/core/memory_space.hpp"

using k3::cuda_device_space;
using k3::cuda_pinned_space;
using k3::host_space;
using k3::space_accessible_v;

namespace {
struct only_host_flag {
  static constexpr bool host_accessible = true;
};
struct custom_space {  // a user-defined space is fine if it states both traits
  static constexpr bool host_accessible = true;
  static constexpr bool device_accessible = false;
};
}  // namespace

static_assert(k3::MemorySpace<host_space> && k3::MemorySpace<cuda_device_space> && k3::MemorySpace<cuda_pinned_space>);
static_assert(k3::MemorySpace<custom_space>);
static_assert(!k3::MemorySpace<only_host_flag>);
static_assert(!k3::MemorySpace<void>);

// (executing space, memory space)
static_assert(space_accessible_v<host_space, host_space>);
static_assert(!space_accessible_v<host_space, cuda_device_space>);
static_assert(space_accessible_v<host_space, cuda_pinned_space>);
static_assert(!space_accessible_v<cuda_device_space, host_space>);
static_assert(space_accessible_v<cuda_device_space, cuda_device_space>);
static_assert(space_accessible_v<cuda_device_space, cuda_pinned_space>);
static_assert(space_accessible_v<cuda_pinned_space, cuda_pinned_space>);
static_assert(space_accessible_v<cuda_pinned_space, host_space>);
static_assert(space_accessible_v<custom_space, host_space>);
static_assert(!space_accessible_v<custom_space, cuda_device_space>);

TEST_CASE("memory spaces name themselves") {
  CHECK(std::string(host_space::name()) == "host");
  CHECK(std::string(cuda_device_space::name()) == "cuda_device");
  CHECK(std::string(cuda_pinned_space::name()) == "cuda_pinned");
}
