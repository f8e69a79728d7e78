// k3/k3.hpp: everything a CPU user needs, nothing that needs MPI or CUDA.
#include "k3/k3.hpp"
#if defined(MPI_VERSION) || defined(OMPI_MAJOR_VERSION)
#error "k3/k3.hpp must not include <mpi.h>"
#endif
#if defined(__CUDA_RUNTIME_H__) || defined(__CUDACC__)
#error "k3/k3.hpp must not include CUDA headers"
#endif

#include <doctest/doctest.h>

#include <vector>

TEST_CASE("k3.hpp reaches backends, Eigen interop, npy and the communicator") {
  std::vector<float> x = {1, 2, 3, 4, 5, 6};
  auto v = k3::host_view(x.data(), 2, 3);
  k3::cpu::threads<> pool(2);
  pool.for_each(0, 6, [&](std::int64_t i) { x[static_cast<std::size_t>(i)] *= 2; });
  CHECK(k3::as_eigen(v).sum() == 42.f);
  auto bytes = k3::io::format_npy(k3::io::dtype::float32, {2, 3}, x.data());
  auto a = k3::io::parse_npy(bytes);
  CHECK(a.view<float, 2>("x")(1, 2) == 12.f);
  k3::single_process comm;
  comm.all_reduce_sum(v);
  CHECK(x[5] == 12.f);
  static_assert(k3::Communicator<k3::single_process>);
  static_assert(k3::HostBackend<k3::cpu::simd<>>);
  CHECK(k3::simd::isa_name<xsimd::default_arch>() != nullptr);
}
