// k3/attnres/tuning.hpp — memory tuning of the two-phase kernels (never their results), carried
// in two_phase_options, with defaults derived from the host's cache sizes (k3/core/cpu_info.hpp).
#pragma once
#include <cstddef>

#include "k3/core/cpu_info.hpp"

namespace k3::attnres {

// Outputs from stream_threshold_bytes on are written with streaming stores. A cached store to a
// line that is not present first reads it (read for ownership): a read of every line of a
// write-only array, which a streaming store skips, at the price of the cache a next reader might
// have found it in. The default follows the two machines measured (benchmarks/attnres.md): with
// 2 MiB of private L2 (the Xeon VM), 8 L2s (16 MiB): phase 2's h of 58.7 MB (K3, T = 4096) is
// out of cache before its next reader anyway; with a smaller L2 (the Zen 4 VM: 1 MiB, 32 MiB
// L3), twice the L3 (64 MiB when the L3 is not reported), far past the last-level cache.
struct tuning {
  std::size_t stream_threshold_bytes = std::size_t(64) << 20;

  static tuning for_caches(cache_sizes const& c) noexcept {
    if (c.l2 >= (std::size_t(2) << 20)) return {8 * c.l2};
    return {c.l3 > 0 ? 2 * c.l3 : std::size_t(64) << 20};
  }
  static tuning host() noexcept {
    static tuning const t = for_caches(host_cache_sizes());
    return t;
  }
};

}  // namespace k3::attnres
