// k3/backend/cpu/simd.hpp — the xsimd-based CPU backends. Everything touching
// xsimd::batch is a template on Arch: a non-template inline function using default_arch
// would be an ODR hazard (different lanes per TU depending on -march and link order).
//
//   k3::cpu::simd<Arch>     one thread, SIMD kernels
//   k3::cpu::threads<Arch>  SIMD kernels + a thread pool over independent work
//
// Debian 12 ships xsimd 8.1; upstream 9+ renamed hadd -> reduce_add, and 8.1 has no AVX-512
// fma. The shims below are the only place that knows.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <xsimd/xsimd.hpp>

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

// x * y + z and z - x * y with one rounding. xsimd 8 has no AVX-512 kernel for these and falls
// back to a separate multiply and add, which the compiler fuses at -O2 but not at -O1: results
// would then depend on the optimisation level, and vector code would disagree with scalar
// std::fma in the same op.
template <class T, class Arch>
inline xsimd::batch<T, Arch> fma(xsimd::batch<T, Arch> const& x, xsimd::batch<T, Arch> const& y,
                                 xsimd::batch<T, Arch> const& z) noexcept {
#if defined(__AVX512F__)
  if constexpr (std::is_base_of_v<xsimd::avx512f, Arch> && std::is_same_v<T, float>)
    return _mm512_fmadd_ps(x, y, z);
  else if constexpr (std::is_base_of_v<xsimd::avx512f, Arch> && std::is_same_v<T, double>)
    return _mm512_fmadd_pd(x, y, z);
  else
#endif
    return xsimd::fma(x, y, z);
}
template <class T, class Arch>
inline xsimd::batch<T, Arch> fnma(xsimd::batch<T, Arch> const& x, xsimd::batch<T, Arch> const& y,
                                  xsimd::batch<T, Arch> const& z) noexcept {
#if defined(__AVX512F__)
  if constexpr (std::is_base_of_v<xsimd::avx512f, Arch> && std::is_same_v<T, float>)
    return _mm512_fnmadd_ps(x, y, z);
  else if constexpr (std::is_base_of_v<xsimd::avx512f, Arch> && std::is_same_v<T, double>)
    return _mm512_fnmadd_pd(x, y, z);
  else
#endif
    return xsimd::fnma(x, y, z);
}

// exp(x) for float x <= 0 (NaN passes through; below -104 gives 0), within 2 ulp. On AVX-512
// it is a Cody-Waite reduction, a degree-7 polynomial and one vscalefps (which scales by 2^n
// and underflows gracefully): 13 vector operations against xsimd::exp's 25 with its
// special-case blends, which decides whether a sigmoid keeps up with memory.
template <class Arch>
inline xsimd::batch<float, Arch> exp_nonpositive(xsimd::batch<float, Arch> const& x) noexcept {
#if defined(__AVX512F__)
  if constexpr (std::is_base_of_v<xsimd::avx512f, Arch>) {
    __m512 const v = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);  // NaN: the second operand, x
    __m512 const n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);  // ln 2 = 0.693359375 - 2.12194440e-4
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
  } else
#endif
    return xsimd::exp(x);
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
class threads {
 public:
  using memory_space = host_space;
  using arch_type = Arch;
  static constexpr char const* name() noexcept { return "cpu::threads"; }

  // n <= 0: one thread per hardware thread. Copies share the pool.
  explicit threads(int n = 0) : pool_(std::make_shared<thread_pool>(n)) {}
  explicit threads(std::shared_ptr<thread_pool> pool) : pool_(std::move(pool)) {
    detail::require(pool_ != nullptr, error_kind::value, "cpu::threads: the thread pool must not be null");
  }

  template <class T>
  T* allocate(std::size_t n) const {
    return detail::host_allocate<T>(n);
  }
  template <class T>
  void deallocate(T* p, std::size_t n) const noexcept {
    detail::host_deallocate(p, n);
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
