// k3/core/tensor.hpp — an owning, contiguous tensor allocated through a backend. Move-only;
// hands out tensor_views of its memory space.
#pragma once
#include <algorithm>
#include <cstddef>
#include <utility>

#include "k3/backend/cpu/serial.hpp"
#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3 {

template <class T, std::size_t Rank, Backend B = cpu::serial>
class tensor {
 public:
  using value_type = T;
  using memory_space = typename B::memory_space;
  using extents_type = array<index_t, Rank>;

  tensor() = default;
  explicit tensor(extents_type const& ext, B backend = B{}) : backend_(std::move(backend)), ext_(ext) {
    index_t n = 1;
    for (std::size_t r = 0; r < Rank; ++r) {
      detail::require(ext[r] >= 0, error_kind::shape, [&] { return "tensor: negative extent in shape " + detail::format_shape(ext); });
      n *= ext[r];
    }
    n_ = static_cast<std::size_t>(n);
    p_ = backend_.template allocate<T>(n_);
    if constexpr (memory_space::host_accessible) std::fill(p_, p_ + n_, T{});
    else if constexpr (requires { backend_.zero_fill(p_, n_); }) {
      // Device memory: the backend zeroes it (in stream order); free it if that fails.
      try {
        backend_.zero_fill(p_, n_);
      } catch (...) {
        release();
        throw;
      }
    }
  }
  tensor(tensor&& o) noexcept : backend_(o.backend_), p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)), ext_(o.ext_) {}
  tensor& operator=(tensor&& o) noexcept {
    if (this != &o) {
      release();
      backend_ = o.backend_;
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
      ext_ = o.ext_;
    }
    return *this;
  }
  tensor(tensor const&) = delete;
  tensor& operator=(tensor const&) = delete;
  ~tensor() { release(); }

  tensor_view<T, Rank, memory_space> view() noexcept { return {p_, ext_}; }
  tensor_view<T const, Rank, memory_space> view() const noexcept { return {p_, ext_}; }
  operator tensor_view<T, Rank, memory_space>() noexcept { return view(); }
  operator tensor_view<T const, Rank, memory_space>() const noexcept { return view(); }

  T* data() noexcept { return p_; }
  T const* data() const noexcept { return p_; }
  index_t extent(std::size_t r) const noexcept { return ext_[r]; }
  extents_type const& extents() const noexcept { return ext_; }
  std::size_t size() const noexcept { return n_; }
  B const& backend() const noexcept { return backend_; }

  template <class... I>
  T& operator()(I... i) noexcept
    requires(memory_space::host_accessible)
  {
    return view()(i...);
  }
  template <class... I>
  T const& operator()(I... i) const noexcept
    requires(memory_space::host_accessible)
  {
    return view()(i...);
  }

 private:
  void release() noexcept {
    if (p_) backend_.deallocate(p_, n_);
    p_ = nullptr;
    n_ = 0;
  }
  B backend_{};
  T* p_ = nullptr;
  std::size_t n_ = 0;
  extents_type ext_{};
};

}  // namespace k3
