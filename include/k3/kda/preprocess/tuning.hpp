// k3/kda/preprocess/tuning.hpp — memory tuning of the vectorised pre-processing ops (never the
// numbers they produce): how far ahead their input rows are prefetched and from which output
// size their outputs bypass the caches, with defaults from the host's cache sizes.
#pragma once
#include <cstddef>

#include "k3/core/cpu_info.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3::kda {

// The ops walk tiles of 16 rows by 256 channels; the hardware prefetchers, which follow one
// 4 KB page at a time, train on each 1 KB tile row anew and fall behind, so the row that many
// rows ahead is prefetched into L2 meanwhile. An output at least stream_min_bytes large, more than the last
// level cache holds, is written with non-temporal stores: that saves the read for ownership
// of every line, a third of the traffic of an out-of-place op, and the consumer would not
// have found it in the cache anyway.
struct preprocess_tuning {
  index_t prefetch_rows = 16;                      // 0: no software prefetch
  std::size_t stream_min_bytes = ~std::size_t{0};  // output bytes from which stores stream

  static preprocess_tuning for_caches(cache_sizes const& c) noexcept {
    return {16, c.l3 > 0 ? 2 * c.l3 : std::size_t(64) << 20};
  }
  static preprocess_tuning host() noexcept {
    static preprocess_tuning const t = for_caches(host_cache_sizes());
    return t;
  }
  bool stream(std::size_t output_bytes) const noexcept { return output_bytes >= stream_min_bytes; }
};

}  // namespace k3::kda
