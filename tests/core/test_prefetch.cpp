// k3/core/prefetch.hpp: the bookkeeping of rows_ahead (which lines remain, how many go out per
// step). The prefetches themselves have no visible effect; these counts decide how a stream is
// spread over a loop, and a wrong count silently drops or bunches lines.
#include <doctest/doctest.h>

#include <cstddef>

#include "k3/core/prefetch.hpp"

namespace {
alignas(64) char buffer[4096];
}

TEST_CASE("rows_ahead counts the lines of aligned and misaligned rows") {
  using k3::detail::rows_ahead;
  // Three rows of 100 bytes, 256 apart, the first aligned: 2 lines now, later rows counted at
  // the most a 100-byte row can span (3 lines).
  rows_ahead r(buffer, 256, 100, 3, 0);
  CHECK(r.lines_left() == 2 + 2 * 3);
  r.step(1);
  CHECK(r.lines_left() == 1 + 2 * 3);
  r.step(1);  // the first row is done; the second (aligned) has 2 lines
  CHECK(r.lines_left() == 2 + 3);
  r.step(std::size_t(-1));
  CHECK(r.lines_left() == 0);
  r.step(5);  // past the end: nothing
  r.step();
  CHECK(r.lines_left() == 0);

  // 8 bytes straddling a line boundary: two lines.
  rows_ahead straddle(buffer + 60, 0, 8, 1, 0);
  CHECK(straddle.lines_left() == 2);
  rows_ahead inside(buffer + 8, 0, 8, 1, 0);
  CHECK(inside.lines_left() == 1);

  // No rows, or empty rows: nothing to do.
  CHECK(rows_ahead(buffer, 64, 100, 0, 4).lines_left() == 0);
  CHECK(rows_ahead(buffer, 64, 0, 5, 4).lines_left() == 0);
  CHECK(rows_ahead().lines_left() == 0);
}

TEST_CASE("rows_ahead spreads what is left over the given steps") {
  using k3::detail::rows_ahead;
  // Four aligned rows of 256 bytes (4 lines each; later rows counted at 5).
  rows_ahead r(buffer, 512, 256, 4, 0);
  std::size_t const total = r.lines_left();
  CHECK(total == 4 + 3 * 5);
  r.spread_over(5);  // ceil(19 / 5) = 4 per step
  r.step();
  CHECK(r.lines_left() == 4 + 2 * 5);  // the first row (4 lines) is done
  r.step(2);
  CHECK(r.lines_left() == 2 + 2 * 5);
  r.spread_over(2);  // ceil(12 / 2) = 6 per step: two steps finish the stream
  r.step();
  CHECK(r.lines_left() > 0);
  r.step();
  CHECK(r.lines_left() == 0);

  // Constructed with a step count: the same spreading from the start.
  rows_ahead s(buffer, 512, 256, 4, 19);
  s.step();
  CHECK(s.lines_left() == total - 1);
  // Zero steps: everything in one step.
  rows_ahead z(buffer, 512, 256, 4, 0);
  z.step();
  CHECK(z.lines_left() == 0);
}
