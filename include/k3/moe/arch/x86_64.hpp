// k3/moe/arch/x86_64.hpp — the histogram's 8-bit count on x86-64: one indexed `incb` and the
// branch on its zero flag; the carry's index is formed only on the (rare) wrap path. From the
// plain C++ g++ 12 emits a `lea` of the address before each `incb` (it keeps the address for the
// carry path): one more micro-op per increment, in the loop that bounds routing + histogram; the
// asm drops it (benchmarks/moe.md). Empty unless compiled for x86 by g++ or clang.
#pragma once
#include <cstddef>
#include <cstdint>

#include "k3/moe/arch/generic.hpp"

#if defined(K3_TARGET_X86_64)
namespace k3::moe::kernel {

K3_INLINE void bump(std::uint8_t* K3_RESTRICT row, std::size_t row_at, std::size_t bin, std::size_t*& carry,
                    ::k3::detail::target::x86_64_tag const&) {
  asm goto("incb (%0,%1)\n\tje %l[wrapped]" : : "r"(row), "r"(bin) : "memory", "cc" : wrapped);
  return;
wrapped:
  *carry++ = row_at + bin;
}

}  // namespace k3::moe::kernel
#endif
