// k3/core/arch/aarch64.hpp — the target primitives on AArch64: the FPCR control word, a
// prefetch into L2 and the spin-wait hint. Selected by k3/core/arch/target.hpp.
#pragma once
#include <cstdint>

#include "k3/core/arch/tags.hpp"

#if defined(K3_TARGET_AARCH64)

namespace k3::detail::target {

// The tag kernels dispatch on: overloads for a base tag serve every target derived from it.
using tag = aarch64_tag;
inline constexpr char const* name = "aarch64";
inline constexpr bool has_float_env = true;

inline std::uint64_t read_float_control() noexcept {
  std::uint64_t v;
  asm volatile("mrs %0, fpcr" : "=r"(v));
  return v;
}
inline void write_float_control(std::uint64_t bits) noexcept { asm volatile("msr fpcr, %0" : : "r"(bits)); }
// FZ: flushes subnormal results and operands both.
inline constexpr std::uint64_t flush_subnormals_bits = std::uint64_t(1) << 24;

inline void prefetch_l2(void const* p) noexcept { __builtin_prefetch(p, 0, 2); }

inline void cpu_relax() noexcept { asm volatile("yield"); }

}  // namespace k3::detail::target

#endif
