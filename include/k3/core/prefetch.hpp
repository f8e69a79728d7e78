// k3/core/prefetch.hpp — software prefetch into L2, for streams the hardware prefetchers do
// not run far enough ahead on (one core of a server Xeon reads a sequential stream at a fraction
// of the socket's bandwidth unless more lines are in flight).
#pragma once
#include <cstddef>
#include <cstdint>

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

// Every line that [p, p + bytes) touches, once each.
inline void prefetch_span_l2(void const* p, std::size_t bytes) noexcept {
  if (bytes == 0) return;
  std::uintptr_t const a = reinterpret_cast<std::uintptr_t>(p);
  std::uintptr_t const last = (a + bytes - 1) & ~std::uintptr_t{63};
  for (std::uintptr_t line = a & ~std::uintptr_t{63}; line <= last; line += 64) prefetch_l2(reinterpret_cast<void const*>(line));
}

// For kernels that walk rows of d elements of `esize` bytes, column by column: the lines of
// columns [c, c + n) of the current row, or, for c >= d, of columns [c - d, c - d + n) of the
// next one (null: none). Clipped to the row; nothing past the next row. A Xeon core streams
// from DRAM far faster with such prefetches spread over its loop (a few lines per step) than
// with the hardware prefetchers alone or with one burst per row.
inline void prefetch_row_ahead(void const* row, void const* next_row, std::size_t esize, std::int64_t d, std::int64_t c,
                               std::int64_t n) noexcept {
  if (c >= d) {
    row = next_row;
    c -= d;
  }
  if (row == nullptr || c >= d) return;
  prefetch_span_l2(static_cast<char const*>(row) + static_cast<std::size_t>(c) * esize, static_cast<std::size_t>(n < d - c ? n : d - c) * esize);
}

}  // namespace k3::detail
