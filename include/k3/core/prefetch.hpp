// k3/core/prefetch.hpp — software prefetch into L2, for streams the hardware prefetchers do
// not run far enough ahead on (one core of a server Xeon reads a sequential stream at a fraction
// of the socket's bandwidth unless more lines are in flight).
#pragma once
#include <cstddef>

namespace k3::detail {

// One cache line into L2 (prefetcht1). On x86 an asm statement: g++ 12 deletes a loop whose
// body is only __builtin_prefetch calls (it has no side effect to keep), which silently
// disabled an earlier prefetch in KDA. The address goes in a register, not as a memory operand,
// so the compiler need not assume the asm reads memory (it would then spill register
// accumulators around every prefetch).
inline void prefetch_l2(void const* p) noexcept {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  asm volatile("prefetcht1 (%0)" : : "r"(p));
#elif defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 2);
#else
  (void)p;
#endif
}

// Every line of [p, p + bytes), including the last one of a span not aligned to a line.
inline void prefetch_span_l2(void const* p, std::size_t bytes) noexcept {
  if (bytes == 0) return;
  char const* c = static_cast<char const*>(p);
  for (std::size_t b = 0; b < bytes; b += 64) prefetch_l2(c + b);
  prefetch_l2(c + bytes - 1);
}

}  // namespace k3::detail
