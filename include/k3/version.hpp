// k3/version.hpp — library version.
#pragma once

#define K3_VERSION_MAJOR 0
#define K3_VERSION_MINOR 1
#define K3_VERSION_PATCH 0

namespace k3 {
inline constexpr int version_major = K3_VERSION_MAJOR;
inline constexpr int version_minor = K3_VERSION_MINOR;
inline constexpr int version_patch = K3_VERSION_PATCH;
inline constexpr char const* version_string = "0.1.0";
}  // namespace k3
