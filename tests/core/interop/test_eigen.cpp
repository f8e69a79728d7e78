#include <doctest/doctest.h>

#include <vector>

#include "k3/core/interop/eigen.hpp"

TEST_CASE("as_eigen maps a strided view without copying") {
  std::vector<double> buf(4 * 6);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = double(i);
  k3::tensor_view<double, 2> m(buf.data(), {4, 6});
  auto cols = m.sub(1, 1, 3);  // 4x3, row stride 6
  auto e = k3::as_eigen(cols);
  CHECK(e.rows() == 4);
  CHECK(e.cols() == 3);
  CHECK(e(2, 1) == cols(2, 1));
  e(3, 2) = -1;  // writes through
  CHECK(buf[3 * 6 + 3] == -1);
  CHECK(e.data() == buf.data() + 1);
}

TEST_CASE("as_view of Eigen matrices and blocks keeps strides") {
  Eigen::MatrixXf cm(3, 5);  // column-major
  cm.setRandom();
  auto v = k3::as_view(cm);
  CHECK(v.stride(0) == 1);
  CHECK(v.stride(1) == 3);
  CHECK(v(2, 4) == cm(2, 4));
  k3::eigen_row_matrix<float> rm(4, 4);
  rm.setRandom();
  auto blk = rm.block(1, 1, 2, 3);
  auto bv = k3::as_view(blk);
  CHECK(bv.extent(0) == 2);
  CHECK(bv.extent(1) == 3);
  CHECK(bv(1, 2) == rm(2, 3));
  auto back = k3::as_eigen(bv);
  CHECK(back.isApprox(blk));
}
