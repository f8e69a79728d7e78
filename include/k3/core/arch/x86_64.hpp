// k3/core/arch/x86_64.hpp — the target primitives on x86 (with SSE): the MXCSR control word,
// a prefetch into L2 and the spin-wait hint. Selected by k3/core/arch/target.hpp.
#pragma once
#include <cstdint>

#include "k3/core/arch/tags.hpp"

#if defined(K3_TARGET_X86_64)
#include <immintrin.h>

namespace k3::detail::target {

// The tag kernels dispatch on: overloads for a base tag serve every target derived from it.
using tag = x86_64_tag;

// MXCSR without its low six bits, the sticky exception flags (they stay per thread).
inline std::uint64_t read_float_control() noexcept { return _mm_getcsr() & ~std::uint64_t(0x3F); }
inline void write_float_control(std::uint64_t bits) noexcept { _mm_setcsr(static_cast<unsigned>((_mm_getcsr() & 0x3Fu) | bits)); }
inline constexpr bool has_float_env = true;
inline constexpr char const* name = "x86-64";
// FTZ | DAZ: subnormal results flushed, subnormal operands read as zero.
inline constexpr std::uint64_t flush_subnormals_bits = 0x8040u;

// prefetcht1 as an asm statement: g++ 12 deletes a loop whose body is only __builtin_prefetch
// calls (nothing to keep), which once silently disabled a prefetch in KDA. The address goes in a
// register, not as a memory operand, so the compiler need not assume the asm reads memory (it
// would then spill register accumulators around every prefetch).
inline void prefetch_l2(void const* p) noexcept { asm volatile("prefetcht1 (%0)" : : "r"(p)); }

inline void cpu_relax() noexcept { _mm_pause(); }

}  // namespace k3::detail::target

#endif
