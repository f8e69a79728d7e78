// k3/core/interop/eigen.hpp — zero-copy Eigen::Map over rank-2 host views and back.
// Strides are in elements; Eigen's Stride<outer, inner> for a RowMajor matrix is
// (row stride, column stride).
#pragma once
#include <Eigen/Core>

#include "k3/core/tensor_view.hpp"

namespace k3 {

template <class T>
using eigen_row_matrix = Eigen::Matrix<std::remove_const_t<T>, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <class T>
using eigen_map = Eigen::Map<std::conditional_t<std::is_const_v<T>, eigen_row_matrix<T> const, eigen_row_matrix<T>>,
                             Eigen::Unaligned, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>>;

template <class T>
eigen_map<T> as_eigen(tensor_view<T, 2, host_space> v) noexcept {
  return eigen_map<T>(v.data_handle(), v.extent(0), v.extent(1),
                      Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(v.stride(0), v.stride(1)));
}

// A view of any Eigen dense object with direct access (Matrix, Map, Block), keeping its strides.
template <class Derived>
auto as_view(Eigen::DenseBase<Derived>& m) noexcept {
  using S = typename Derived::Scalar;
  auto& d = m.derived();
  index_t const rs = Derived::IsRowMajor ? d.outerStride() : d.innerStride();
  index_t const cs = Derived::IsRowMajor ? d.innerStride() : d.outerStride();
  return tensor_view<S, 2>(d.data(), {static_cast<index_t>(d.rows()), static_cast<index_t>(d.cols())}, {rs, cs});
}
template <class Derived>
auto as_view(Eigen::DenseBase<Derived> const& m) noexcept {
  using S = typename Derived::Scalar;
  auto const& d = m.derived();
  index_t const rs = Derived::IsRowMajor ? d.outerStride() : d.innerStride();
  index_t const cs = Derived::IsRowMajor ? d.innerStride() : d.outerStride();
  return tensor_view<S const, 2>(d.data(), {static_cast<index_t>(d.rows()), static_cast<index_t>(d.cols())}, {rs, cs});
}

}  // namespace k3
