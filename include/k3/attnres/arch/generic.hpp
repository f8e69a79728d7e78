// k3/attnres/arch/generic.hpp — which ISA kernels two-phase AttnRes has for an architecture:
// none, unless a file of this folder specialises kernel::two_phase_kernels for Arch (then
// two_phase.hpp runs them for bfloat16 storage, and its portable kernels otherwise).
#pragma once

namespace k3::attnres::kernel {

template <class Arch>
struct two_phase_kernels {
  static constexpr bool available = false;
};

}  // namespace k3::attnres::kernel
