// k3/kda/arch/generic.hpp — where no ISA file of this folder serves Arch, the KDA kernels'
// register-level helpers report that they did nothing and the portable loops run.
#pragma once
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/arch/generic.hpp"
#include "k3/core/config.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3::kda::kernel {

using ::k3::simd::kernel::requires_arch;

// Transposes the whole 16 x 16 blocks of src [rb x cb] into dst; false: not done here.
template <class T>
inline bool transpose_16x16_blocks(T const*, index_t, index_t, index_t, T*, index_t, requires_arch<xsimd::generic>) noexcept {
  return false;
}

}  // namespace k3::kda::kernel
