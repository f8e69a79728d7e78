// The header's version agrees with itself and with CMake's project(VERSION).
#include <doctest/doctest.h>

#include <string>

#include "k3/version.hpp"

static_assert(k3::version_major == K3_VERSION_MAJOR);
static_assert(k3::version_minor == K3_VERSION_MINOR);
static_assert(k3::version_patch == K3_VERSION_PATCH);
static_assert(k3::version_major >= 0 && k3::version_minor >= 0 && k3::version_patch >= 0);

TEST_CASE("version_string is major.minor.patch and matches the CMake project version") {
  std::string const expect = std::to_string(K3_VERSION_MAJOR) + "." + std::to_string(K3_VERSION_MINOR) + "." +
                             std::to_string(K3_VERSION_PATCH);
  CHECK(std::string(k3::version_string) == expect);
  CHECK(std::string(k3::version_string) == K3_TEST_PROJECT_VERSION);
}
