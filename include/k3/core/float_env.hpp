// k3/core/float_env.hpp — the per-thread floating-point control state that SIMD arithmetic
// follows (x86: MXCSR; AArch64: FPCR), and a scope that flushes subnormals.
//
// Why: the chunked KDA / DPLR forms multiply by decays exp(sum of gates) that pass through the
// subnormal range (below 2^-126 ~ 1.2e-38 in float) for a stretch of every chunk when gates
// sit near K3's lower bound. Intel cores take a microcode assist on each subnormal operand or
// result, which makes the chunked forwards many times slower there, while AMD Zen 4 pays almost
// nothing (benchmarks/kda.md, benchmarks/dplr.md). Flushing changes results by less than 2^-126
// per rounding, far below float's own rounding of the normal values around it.
//
// thread_pool::run hands the caller's state to its workers (as oneTBB does), so a scope opened
// on the calling thread covers every task of the call.
#pragma once
#include <cstdint>

#include "k3/core/arch/target.hpp"

namespace k3::detail {

// The calling thread's control word (rounding mode, flush modes, exception masks; not the
// sticky exception flags, which stay per thread).
struct float_env {
  std::uint64_t bits = 0;

  static float_env current() noexcept { return {target::read_float_control()}; }
  void apply() const noexcept { target::write_float_control(bits); }
  // Subnormal results flushed to zero and subnormal operands read as zero.
  float_env flushing_subnormals() const noexcept { return {bits | target::flush_subnormals_bits}; }
  friend bool operator==(float_env const&, float_env const&) = default;
};

// Whether this target can flush subnormals at all (elsewhere the scope below does nothing).
inline constexpr bool can_flush_subnormals = target::has_float_env;

// Flushes subnormals on this thread while in scope; restores the previous state after.
class subnormals_flushed {
 public:
  subnormals_flushed() noexcept : saved_(float_env::current()) { saved_.flushing_subnormals().apply(); }
  ~subnormals_flushed() { saved_.apply(); }
  subnormals_flushed(subnormals_flushed const&) = delete;
  subnormals_flushed& operator=(subnormals_flushed const&) = delete;

 private:
  float_env saved_;
};

}  // namespace k3::detail
