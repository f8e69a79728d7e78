// k3/backend/cpu/arch/generic.hpp — the portable forms of k3's vector primitives (xsimd's own
// kernels), chosen for any Arch that no ISA file of this folder serves better. Dispatch is by
// overload on the architecture tag, as xsimd does it: an Arch{} argument binds to the most
// derived architecture a primitive is written for.
#pragma once
#include <cstddef>

#include <xsimd/xsimd.hpp>

namespace k3::simd::kernel {

// Binds to Arch or any of its bases; the most derived one wins overload resolution.
template <class Arch>
using requires_arch = Arch const&;

template <class T, class Arch>
inline xsimd::batch<T, Arch> fma(xsimd::batch<T, Arch> const& x, xsimd::batch<T, Arch> const& y, xsimd::batch<T, Arch> const& z,
                                 requires_arch<xsimd::generic>) noexcept {
  return xsimd::fma(x, y, z);
}
template <class T, class Arch>
inline xsimd::batch<T, Arch> fnma(xsimd::batch<T, Arch> const& x, xsimd::batch<T, Arch> const& y, xsimd::batch<T, Arch> const& z,
                                  requires_arch<xsimd::generic>) noexcept {
  return xsimd::fnma(x, y, z);
}
template <class Arch>
inline xsimd::batch<float, Arch> exp_nonpositive(xsimd::batch<float, Arch> const& x, requires_arch<xsimd::generic>) noexcept {
  return xsimd::exp(x);
}
template <std::size_t U, class Arch>
inline void exp_nonpositive_n(xsimd::batch<float, Arch> (&x)[U], requires_arch<xsimd::generic>) noexcept {
  for (std::size_t u = 0; u < U; ++u) x[u] = xsimd::exp(x[u]);
}
template <class Arch>
inline void store_stream(float* p, xsimd::batch<float, Arch> const& v, requires_arch<xsimd::generic>) noexcept {
  v.store_aligned(p);
}
inline void stream_fence(requires_arch<xsimd::generic>) noexcept {}

}  // namespace k3::simd::kernel
