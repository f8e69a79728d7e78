// k3/core/arch/generic.hpp — the target primitives where k3 knows no ISA-specific form: no
// control word to change (subnormals are not flushed), the compiler's prefetch, no spin hint.
#pragma once
#include <cstdint>

#include "k3/core/arch/tags.hpp"

#if !defined(K3_TARGET_X86_64) && !defined(K3_TARGET_AARCH64)

namespace k3::detail::target {

// The tag kernels dispatch on: overloads for a base tag serve every target derived from it.
using tag = generic_tag;
inline constexpr char const* name = "generic";
inline constexpr bool has_float_env = false;

inline std::uint64_t read_float_control() noexcept { return 0; }
inline void write_float_control(std::uint64_t) noexcept {}
inline constexpr std::uint64_t flush_subnormals_bits = 0;

inline void prefetch_l2([[maybe_unused]] void const* p) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 2);
#endif
}

inline void cpu_relax() noexcept {}

}  // namespace k3::detail::target

#endif
