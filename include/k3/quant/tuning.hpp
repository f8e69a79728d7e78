// k3/quant/tuning.hpp — memory tuning of the vectorised bf16 row quantisers (never the bytes
// they produce): software prefetch of the input and non-temporal stores of the codes, with
// defaults derived from the host's cache sizes (k3/core/cpu_info.hpp).
#pragma once
#include <algorithm>
#include <cstddef>

#include "k3/core/cpu_info.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/prefetch.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3::quant {

// How the row kernels write codes. A code buffer separate from the input costs a read for
// ownership per written cache line (4 bytes of DRAM traffic per bf16 element instead of 3);
// streaming writes every whole cache line of a row with a non-temporal store instead, which also
// takes the codes out of the cache their consumer might have read them from. `automatic` decides
// per call from tuning::stream_min_bytes; the other two force a mode.
enum class store_mode { automatic, cached, streaming };

// The defaults follow the two machines measured (benchmarks/quant.md), told apart by their
// private L2: a core with 2 MiB of L2 (the Xeon VM) keeps too few lines in flight to stream from
// DRAM alone, so the input is prefetched one 16-tile group (2048 bf16, 4 KB) ahead, and codes
// are streamed once they outgrow eight such L2s (16 MiB), where the read for ownership costs
// more than the cache they would have stayed in; with a smaller L2 (1 MiB, the Zen 4 VM, whose
// 32 MiB L3 holds what the L2 drops) both were slower, even far past the caches. Another
// machine may want other values: bench_quant measures them, and options take them.
struct tuning {
  index_t prefetch_distance = 0;                   // bf16 elements ahead; 0: no software prefetch
  std::size_t stream_min_bytes = ~std::size_t{0};  // code bytes from which `automatic` streams

  static tuning for_caches(cache_sizes const& c) noexcept {
    if (c.l2 >= (std::size_t(2) << 20)) return {2048, 8 * c.l2};
    return {};
  }
  static tuning host() noexcept {
    static tuning const t = for_caches(host_cache_sizes());
    return t;
  }
  bool stream(store_mode mode, std::size_t code_bytes) const noexcept {
    return mode == store_mode::streaming || (mode == store_mode::automatic && code_bytes >= stream_min_bytes);
  }
};

namespace simd_impl {

// Prefetch into L2 the lines of n bf16 values `ahead` elements past x(i, j) in row-major order
// (wrapping into row i + 1, not past row i_end - 1), so it works on strided rows too.
K3_INLINE void prefetch_ahead(const_view<bfloat16, 2> x, index_t i, index_t j, index_t n, index_t i_end, index_t ahead) noexcept {
  k3::detail::prefetch_row_ahead(&x(i, 0), i + 1 < i_end ? &x(i + 1, 0) : nullptr, sizeof(bfloat16), x.extent(1), j + ahead, n);
}

// Rows per task: long contiguous ranges (about 16 per worker, for balance; at least `base`):
// fewer partial cache lines at range ends when streaming, longer runs for the prefetchers.
template <class B>
index_t task_rows(B const& b, index_t m, index_t base) {
  index_t workers = 1;
  if constexpr (requires { b.concurrency(); }) workers = std::max<index_t>(1, static_cast<index_t>(b.concurrency()));
  return std::max(base, (m + 16 * workers - 1) / (16 * workers));
}

}  // namespace simd_impl
}  // namespace k3::quant
