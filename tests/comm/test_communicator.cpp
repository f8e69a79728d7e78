#include <doctest/doctest.h>

#include <vector>

#include "k3/comm/communicator.hpp"

TEST_CASE("single_process: collectives are identities, peers do not exist") {
  k3::single_process c;
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  std::vector<double> x = {1, 2, 3};
  c.all_reduce_sum(k3::host_view(x.data(), 3));
  CHECK(x == std::vector<double>{1, 2, 3});
  std::vector<float> in = {4, 5}, out(2);
  c.all_gather(k3::tensor_view<float const, 1>(in.data(), {2}), k3::host_view(out.data(), 2));
  CHECK(out == in);
  std::vector<float> small(1);
  CHECK_THROWS_AS(c.all_gather(k3::tensor_view<float const, 1>(in.data(), {2}), k3::host_view(small.data(), 1)), k3::error);
  CHECK_THROWS_AS(c.send(k3::tensor_view<float const, 1>(in.data(), {2}), 1, 0), k3::error);
}
