// k3/core/tensor_view.hpp — a small, trivially copyable, strided, mdspan-shaped view.
//
// C++20 has no std::mdspan, g++ 12 ships none, and the view's type must be identical in .cpp
// and .cu translation units, so k3 owns one. It keeps mdspan's spelling (extent, stride,
// data_handle, rank) so moving to std::mdspan<T, dextents, layout_stride, accessor> is
// mechanical. Strides are in elements, may be zero (broadcast) but not negative.
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "k3/core/array.hpp"
#include "k3/core/config.hpp"
#include "k3/core/memory_space.hpp"

namespace k3 {

using index_t = std::int64_t;

template <class T, std::size_t Rank, MemorySpace Space = host_space>
class tensor_view {
 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  using index_type = index_t;
  using memory_space = Space;
  using extents_type = array<index_type, Rank>;

  static constexpr std::size_t rank() noexcept { return Rank; }

  K3_INLINE constexpr tensor_view() noexcept : p_(nullptr), ext_{}, str_{} {
    for (std::size_t r = 0; r < Rank; ++r) ext_[r] = str_[r] = 0;
  }

  // Contiguous row-major (C order) view.
  K3_INLINE constexpr tensor_view(T* p, extents_type const& ext) noexcept : p_(p), ext_(ext), str_{} {
    index_type s = 1;
    for (std::size_t r = Rank; r-- > 0;) {
      str_[r] = s;
      s *= ext_[r];
    }
  }

  K3_INLINE constexpr tensor_view(T* p, extents_type const& ext, extents_type const& str) noexcept
      : p_(p), ext_(ext), str_(str) {}

  // T -> const T
  template <class U>
    requires(!std::is_same_v<U, T> && std::is_convertible_v<U (*)[], T (*)[]>)
  K3_INLINE constexpr tensor_view(tensor_view<U, Rank, Space> const& o) noexcept
      : p_(o.data_handle()), ext_(o.extents()), str_(o.strides()) {}

  K3_INLINE constexpr index_type extent(std::size_t r) const noexcept { return ext_[r]; }
  K3_INLINE constexpr index_type stride(std::size_t r) const noexcept { return str_[r]; }
  K3_INLINE constexpr extents_type const& extents() const noexcept { return ext_; }
  K3_INLINE constexpr extents_type const& strides() const noexcept { return str_; }
  K3_INLINE constexpr T* data_handle() const noexcept { return p_; }

  K3_INLINE constexpr index_type size() const noexcept {
    index_type n = 1;
    for (std::size_t r = 0; r < Rank; ++r) n *= ext_[r];
    return n;
  }
  K3_INLINE constexpr bool empty() const noexcept { return size() == 0; }

  // Row-major contiguous (dimensions of extent 1 may carry any stride).
  K3_INLINE constexpr bool is_contiguous() const noexcept {
    index_type s = 1;
    for (std::size_t r = Rank; r-- > 0;) {
      if (ext_[r] != 1 && str_[r] != s) return false;
      s *= ext_[r];
    }
    return true;
  }

  template <class... I>
    requires(sizeof...(I) == Rank && (std::is_integral_v<I> && ...))
  K3_INLINE constexpr T& operator()(I... idx) const noexcept {
    index_type const ii[] = {static_cast<index_type>(idx)...};
    index_type off = 0;
    for (std::size_t r = 0; r < Rank; ++r) off += ii[r] * str_[r];
    return p_[off];
  }

  K3_INLINE constexpr T& operator[](extents_type const& idx) const noexcept {
    index_type off = 0;
    for (std::size_t r = 0; r < Rank; ++r) off += idx[r] * str_[r];
    return p_[off];
  }

  // Fix dimension `dim` at `i`: a view of rank Rank-1 sharing the same memory.
  K3_INLINE constexpr tensor_view<T, (Rank > 0 ? Rank - 1 : 0), Space> slice(std::size_t dim, index_type i) const noexcept
    requires(Rank > 0)
  {
    array<index_type, (Rank > 0 ? Rank - 1 : 0)> e{}, s{};
    std::size_t j = 0;
    for (std::size_t r = 0; r < Rank; ++r) {
      if (r == dim) continue;
      e[j] = ext_[r];
      s[j] = str_[r];
      ++j;
    }
    return {p_ + i * str_[dim], e, s};
  }

  // Restrict dimension `dim` to [begin, begin + count).
  K3_INLINE constexpr tensor_view sub(std::size_t dim, index_type begin, index_type count) const noexcept {
    tensor_view v = *this;
    v.p_ = p_ + begin * str_[dim];
    v.ext_[dim] = count;
    return v;
  }

 private:
  T* p_;
  extents_type ext_;
  extents_type str_;
};

// Deduction from a pointer and a braced list of extents: tensor_view(p, {2, 3}).
template <class T, std::size_t Rank>
tensor_view(T*, array<index_t, Rank> const&) -> tensor_view<T, Rank>;

template <class T, std::size_t Rank, class Space = host_space>
using const_view = tensor_view<T const, Rank, Space>;

namespace detail {
template <class V>
struct is_tensor_view : std::false_type {};
template <class T, std::size_t R, class S>
struct is_tensor_view<tensor_view<T, R, S>> : std::true_type {};
}  // namespace detail

// Optional views: an absent one is a default-constructed view (null data and all extents 0).
// Anything else is present and is checked like a required view (a null pointer with a
// non-empty shape is an error there, never silently ignored).
template <class T, std::size_t Rank, class Space>
K3_HD constexpr bool present(tensor_view<T, Rank, Space> const& v) noexcept {
  if (v.data_handle() != nullptr) return true;
  for (std::size_t r = 0; r < Rank; ++r)
    if (v.extent(r) != 0) return true;
  return false;
}

// Host view over contiguous data with shape given as integers: view_of(p, B, T, H, K).
template <class T, class... I>
  requires(std::is_integral_v<I> && ...)
constexpr tensor_view<T, sizeof...(I)> host_view(T* p, I... ext) noexcept {
  return tensor_view<T, sizeof...(I)>(p, array<index_t, sizeof...(I)>{static_cast<index_t>(ext)...});
}

}  // namespace k3
