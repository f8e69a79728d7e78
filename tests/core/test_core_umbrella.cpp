// k3/core.hpp promises the core vocabulary without Eigen or xsimd (and without CUDA/MPI).
#include "k3/core.hpp"
// (first: nothing else may have brought Eigen or xsimd in)
#if defined(EIGEN_WORLD_VERSION) || defined(XSIMD_VERSION_MAJOR)
#error "k3/core.hpp must not include Eigen or xsimd"
#endif
#if defined(MPI_VERSION) || defined(__CUDA_RUNTIME_H__)
#error "k3/core.hpp must not include MPI or CUDA headers"
#endif

#include <doctest/doctest.h>

TEST_CASE("core.hpp alone is enough for tensors, numerics and validation") {
  k3::tensor<k3::bfloat16, 2> t({2, 3});
  t(1, 2) = k3::store_as<k3::bfloat16>(1.5);
  k3::tensor_view<k3::bfloat16 const, 2> v = t;
  CHECK(k3::load_as<double>(v(1, 2)) == 1.5);
  CHECK_NOTHROW(k3::detail::check_shape("t", v, {2, 3}));
  CHECK(k3::detail::sigmoid(0.0) == 0.5);
  static_assert(k3::Backend<k3::cpu::serial>);
  CHECK(k3::version_major == K3_VERSION_MAJOR);
}
