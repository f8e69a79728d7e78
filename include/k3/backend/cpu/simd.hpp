// k3/backend/cpu/simd.hpp — the xsimd-based CPU backends. Everything touching
// xsimd::batch is a template on Arch: a non-template inline function using default_arch
// would be an ODR hazard (different lanes per TU depending on -march and link order).
//
//   k3::cpu::simd<Arch>     one thread, SIMD kernels
//   k3::cpu::threads<Arch>  SIMD kernels + a thread pool over independent work
//
// Debian 12 ships xsimd 8.1; upstream 9+ renamed hadd -> reduce_add, and 8.1 has no AVX-512
// fma. The shims below are the only place that knows. ISA-specific forms of the primitives live
// in k3/backend/cpu/arch/<isa>.hpp, chosen by the Arch type.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/arch/avx2.hpp"
#include "k3/backend/cpu/arch/avx512.hpp"
#include "k3/backend/cpu/arch/generic.hpp"
#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/thread_pool.hpp"
#include "k3/core/concepts.hpp"
#include "k3/core/host_memory.hpp"

namespace k3::simd {

template <class T, class Arch>
inline T reduce_add(xsimd::batch<T, Arch> const& b) noexcept {
#if XSIMD_VERSION_MAJOR >= 9
  return xsimd::reduce_add(b);
#else
  return xsimd::hadd(b);
#endif
}

// x * y + z and z - x * y with one rounding, whatever the ISA and optimisation level (the vector
// code must agree with scalar std::fma in the same op).
template <class T, class Arch>
inline xsimd::batch<T, Arch> fma(xsimd::batch<T, Arch> const& x, xsimd::batch<T, Arch> const& y,
                                 xsimd::batch<T, Arch> const& z) noexcept {
  return kernel::fma(x, y, z, Arch{});
}
template <class T, class Arch>
inline xsimd::batch<T, Arch> fnma(xsimd::batch<T, Arch> const& x, xsimd::batch<T, Arch> const& y,
                                  xsimd::batch<T, Arch> const& z) noexcept {
  return kernel::fnma(x, y, z, Arch{});
}

// exp(x) for float x <= 0 (NaN passes through; below -104 gives 0), within 2 ulp; the AVX2 and
// AVX-512 forms underflow gradually, xsimd::exp (every other ISA) flushes below the normal range.
template <class Arch>
inline xsimd::batch<float, Arch> exp_nonpositive(xsimd::batch<float, Arch> const& x) noexcept {
  return kernel::exp_nonpositive(x, Arch{});
}

// exp_nonpositive of U vectors in place, each lane rounded exactly as exp_nonpositive rounds it.
template <std::size_t U, class Arch>
inline void exp_nonpositive_n(xsimd::batch<float, Arch> (&x)[U]) noexcept {
  kernel::exp_nonpositive_n(x, Arch{});
}

// A full vector to 64-byte-aligned p without the read for ownership where the ISA has such a
// store (a plain store elsewhere); stream_fence<Arch>() orders the writer's streamed stores
// before whatever it does next.
template <class Arch>
inline void store_stream(float* p, xsimd::batch<float, Arch> const& v) noexcept {
  kernel::store_stream(p, v, Arch{});
}
template <class Arch>
inline void stream_fence() noexcept {
  kernel::stream_fence(Arch{});
}

template <class Arch>
constexpr char const* isa_name() noexcept {
  return Arch::name();
}

}  // namespace k3::simd

namespace k3::cpu {

// One thread; the same memory and loop as cpu::serial, but algorithms pick their
// vectorised kernels for Arch.
template <class Arch = xsimd::default_arch>
struct simd : serial {
  using arch_type = Arch;
  static constexpr char const* name() noexcept { return "cpu::simd"; }
};

template <class Arch = xsimd::default_arch>
class threads : public ::k3::detail::host_memory {
 public:
  using arch_type = Arch;
  static constexpr char const* name() noexcept { return "cpu::threads"; }

  // n <= 0: one thread per hardware thread. Copies share the pool.
  explicit threads(int n = 0) : pool_(std::make_shared<thread_pool>(n)) {}
  explicit threads(std::shared_ptr<thread_pool> pool) : pool_(std::move(pool)) {
    detail::require(pool_ != nullptr, error_kind::value, "cpu::threads: the thread pool must not be null");
  }

  // Splits [begin, end) into one contiguous range per thread.
  template <class F>
  void for_each(std::int64_t begin, std::int64_t end, F&& f) const {
    std::int64_t const n = end - begin;
    if (n <= 0) return;
    std::int64_t const parts = std::min<std::int64_t>(n, pool_->size());
    pool_->run(parts, [&](std::int64_t p) {
      std::int64_t lo = begin + n * p / parts, hi = begin + n * (p + 1) / parts;
      for (std::int64_t i = lo; i < hi; ++i) f(i);
    });
  }
  // Runs task(i) for each i in [0, tasks), dynamically balanced (uneven task sizes).
  template <class F>
  void for_each_task(std::int64_t tasks, F&& f) const {
    pool_->run(tasks, f);
  }
  void fence() const noexcept {}
  int concurrency() const noexcept { return pool_->size(); }
  thread_pool& pool() const noexcept { return *pool_; }

 private:
  std::shared_ptr<thread_pool> pool_;
};

static_assert(HostBackend<simd<>>);
static_assert(HostBackend<threads<>>);

}  // namespace k3::cpu
