// k3/moe/arch/sse_avx.hpp — the router's lane masks from SSE and AVX registers (movmskps), for
// xsimd's sse2 and avx families. Each part is empty unless the translation unit is compiled for it.
#pragma once
#include <cstdint>

#include "k3/moe/arch/generic.hpp"

#if defined(__SSE__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace k3::moe::kernel {

#if defined(__SSE2__)
// movmskps of the 4 (SSE) or 8 (AVX) lanes' sign bits.
template <class Arch>
inline std::uint64_t movemask_lanes(xsimd::batch_bool<float, Arch> const& b) noexcept {
  if constexpr (xsimd::batch_bool<float, Arch>::size == 4) return static_cast<unsigned>(_mm_movemask_ps(b));
  else return static_cast<unsigned>(_mm256_movemask_ps(b));
}
template <class Arch>
inline std::uint64_t lane_mask(xsimd::batch_bool<float, Arch> const& b, requires_arch<xsimd::sse2>) noexcept { return movemask_lanes(b); }
#endif
#if defined(__AVX__)
template <class Arch>
inline std::uint64_t lane_mask(xsimd::batch_bool<float, Arch> const& b, requires_arch<xsimd::avx>) noexcept { return movemask_lanes(b); }
#endif

}  // namespace k3::moe::kernel
