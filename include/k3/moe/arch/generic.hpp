// k3/moe/arch/generic.hpp — the router's kernels where no ISA file of this folder serves the
// architecture: kernel::route_kernels<Arch> reports that it does nothing (threads.hpp's portable
// loops then run), lane masks through memory, the histogram's 8-bit count in plain C++.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/arch/generic.hpp"
#include "k3/core/arch/tags.hpp"
#include "k3/core/prefetch.hpp"
#include "k3/moe/router.hpp"

namespace k3::moe::detail {

// Where a token's selection issues the lines of a prefetch stream (stream may be null):
// `pass` lines per 64 scores of the candidate pass, `rank` per ranked candidate.
struct select_prefetch {
  k3::detail::rows_ahead* stream = nullptr;
  std::size_t pass = 0, rank = 0;
  K3_INLINE void in_pass() const noexcept {
    if (stream) stream->step(pass);
  }
  K3_INLINE void in_rank() const noexcept {
    if (stream) stream->step(rank);
  }
};

}  // namespace k3::moe::detail

namespace k3::moe::kernel {

using ::k3::simd::kernel::requires_arch;

// Bit l set iff lane l of b is true.
template <class Arch>
inline std::uint64_t lane_mask(xsimd::batch_bool<float, Arch> const& b, requires_arch<xsimd::generic>) noexcept {
  using bb = xsimd::batch_bool<float, Arch>;
  alignas(64) bool t[bb::size];
  b.store_aligned(t);
  std::uint64_t m = 0;
  for (std::size_t l = 0; l < bb::size; ++l) m |= std::uint64_t(t[l]) << l;
  return m;
}

// One 8-bit count up; a wrap to 0 appends the count's index to the carries.
K3_INLINE void bump(std::uint8_t* K3_RESTRICT row, std::size_t row_at, std::size_t bin, std::size_t*& carry,
                    ::k3::detail::target::generic_tag const&) {
  if (++row[bin] == 0) [[unlikely]]
    *carry++ = row_at + bin;
}

// The routing kernels an ISA file gives an architecture (see k3/moe/arch/avx512.hpp); here none:
// each member does nothing and says so.
template <class Arch>
struct route_kernels {
  // select / observe / emit: the ISA selection of a token's k+1 best (false: not available).
  static constexpr bool fast_select = false;
  struct select_state {
    float tz[64] = {};
    std::int32_t tj[64] = {};
  };
  static bool select(float const*, float const*, index_t, index_t, select_state&, detail::select_prefetch const&) noexcept { return false; }
  static void observe(select_state&, float, float) noexcept {}
  static void emit(index_t, float const*, float const*, std::int32_t const*, router_options const&, detail::route_outputs const&, bool) noexcept {}

  // Whether bin_pairs writes the paired layout (see threads.hpp's paired_slot), and the number of
  // leading experts it binned.
  static constexpr bool paired_bins = false;
  static index_t bin_pairs(float const*, float, index_t, float, float, std::int32_t, std::uint16_t*) noexcept { return 0; }
  // One batch of bins stored as uint16 (false: not done here).
  static bool store_bins(xsimd::batch<std::int32_t, Arch> const&, std::uint16_t*) noexcept { return false; }
  // Adds the counts of [x, e) (see merge_counts); returns where it stopped.
  static std::int64_t merge_lines(std::int64_t*, std::uint8_t const* const*, std::int64_t, std::int64_t x, std::int64_t, bool) noexcept {
    return x;
  }
  // Appends the lanes of z >= vg (experts j + lane) to cz / cj at c (false: not done here).
  static bool compress_candidates(xsimd::batch<float, Arch> const&, xsimd::batch<float, Arch> const&, index_t, float*, std::int32_t*,
                                  index_t&) noexcept {
    return false;
  }
};

}  // namespace k3::moe::kernel
