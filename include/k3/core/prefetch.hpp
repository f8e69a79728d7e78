// k3/core/prefetch.hpp — software prefetch into L2, for streams the hardware prefetchers do
// not run far enough ahead on (one core of a server Xeon reads a sequential stream at a fraction
// of the socket's bandwidth unless more lines are in flight).
#pragma once
#include <cstddef>
#include <cstdint>

#include "k3/core/arch/target.hpp"

namespace k3::detail {

// One cache line into L2 (x86: prefetcht1; see k3/core/arch/).
inline void prefetch_l2(void const* p) noexcept { target::prefetch_l2(p); }

// Every line that [p, p + bytes) touches, once each.
inline void prefetch_span_l2(void const* p, std::size_t bytes) noexcept {
  if (bytes == 0) return;
  std::uintptr_t const a = reinterpret_cast<std::uintptr_t>(p);
  std::uintptr_t const last = (a + bytes - 1) & ~std::uintptr_t{63};
  for (std::uintptr_t line = a & ~std::uintptr_t{63}; line <= last; line += 64) prefetch_l2(reinterpret_cast<void const*>(line));
}

// For kernels that walk rows of d elements of `esize` bytes, column by column: the lines of
// columns [c, c + n) of the current row, or, for c >= d, of columns [c - d, c - d + n) of the
// next one (null: none). Clipped to the row; nothing past the next row. Spread over the loop (a
// few lines per step), such prefetches keep a server core's stream from DRAM going where the
// hardware prefetchers alone fall behind and one burst per row waits on the fill buffers.
inline void prefetch_row_ahead(void const* row, void const* next_row, std::size_t esize, std::int64_t d, std::int64_t c,
                               std::int64_t n) noexcept {
  if (c >= d) {
    row = next_row;
    c -= d;
  }
  if (row == nullptr || c >= d) return;
  prefetch_span_l2(static_cast<char const*>(row) + static_cast<std::size_t>(c) * esize, static_cast<std::size_t>(n < d - c ? n : d - c) * esize);
}

// A stream of `rows` rows of row_bytes bytes, stride_bytes apart, prefetched into L2 a few
// lines per step() over `steps` steps: for a loop that computes on one batch of rows while the
// next one comes in (the MoE router prefetches its next chunk of scores during its work on the
// current one). Each line of each row once; steps past the end do nothing. step(lines) issues
// a given number instead, and spread_over(steps) shares what is left over that many step()s.
class rows_ahead {
 public:
  rows_ahead() = default;
  rows_ahead(void const* first, std::ptrdiff_t stride_bytes, std::size_t row_bytes, std::int64_t rows, std::int64_t steps) noexcept
      : row_(static_cast<char const*>(first)), stride_(stride_bytes), row_bytes_(row_bytes), rows_(row_bytes ? rows : 0) {
    if (rows_ > 0) start_row();
    spread_over(steps);
  }
  // Lines still to go (rows after the current one counted at the most a row can span).
  std::size_t lines_left() const noexcept {
    if (rows_ <= 0) return 0;
    return static_cast<std::size_t>(rows_ - 1) * ((row_bytes_ + 127) / 64) + static_cast<std::size_t>((last_ - line_) / 64 + 1);
  }
  void spread_over(std::int64_t steps) noexcept {
    std::size_t const lines = lines_left();
    per_step_ = steps > 0 ? (lines + static_cast<std::size_t>(steps) - 1) / static_cast<std::size_t>(steps) : lines;
  }
  void step() noexcept { step(per_step_); }
  // Up to `lines` more lines (all that are left: std::size_t(-1)).
  void step(std::size_t lines) noexcept {
    for (std::size_t k = 0; k < lines && rows_ > 0; ++k) {
      prefetch_l2(reinterpret_cast<void const*>(line_));
      line_ += 64;
      if (line_ > last_ && --rows_ > 0) {
        row_ += stride_;
        start_row();
      }
    }
  }

 private:
  void start_row() noexcept {
    std::uintptr_t const a = reinterpret_cast<std::uintptr_t>(row_);
    line_ = a & ~std::uintptr_t{63};
    last_ = (a + row_bytes_ - 1) & ~std::uintptr_t{63};
  }
  char const* row_ = nullptr;
  std::ptrdiff_t stride_ = 0;
  std::size_t row_bytes_ = 0;
  std::int64_t rows_ = 0;
  std::uintptr_t line_ = 0, last_ = 0;
  std::size_t per_step_ = 0;
};

}  // namespace k3::detail
