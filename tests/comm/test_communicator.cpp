#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "k3/comm/communicator.hpp"

namespace {
struct no_barrier {
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class V>
  void all_reduce_sum(V) const {}
  template <class A, class B>
  void all_gather(A, B) const {}
  template <class V>
  void send(V, int, int) const {}
  template <class V>
  void recv(V, int, int) const {}
};
struct float_only {  // cannot reduce double or int64 views
  int rank() const { return 0; }
  int size() const { return 1; }
  void all_reduce_sum(k3::tensor_view<float, 1>) const {}
  void all_gather(k3::tensor_view<float const, 1>, k3::tensor_view<float, 1>) const {}
  void send(k3::tensor_view<float const, 1>, int, int) const {}
  void recv(k3::tensor_view<float, 1>, int, int) const {}
  void barrier() const {}
};
}  // namespace

static_assert(k3::Communicator<k3::single_process>);
static_assert(!k3::Communicator<no_barrier>);
static_assert(!k3::Communicator<float_only>);
static_assert(!k3::Communicator<int>);
static_assert(k3::detail::comm_type_code<float>() != k3::detail::comm_type_code<double>());
static_assert(k3::detail::comm_type_code<std::int64_t>() != k3::detail::comm_type_code<std::uint64_t>());

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

TEST_CASE("single_process: rank-2 buffers, non-contiguous views rejected, recv has no peer") {
  k3::single_process c;
  std::vector<std::int64_t> m = {1, 2, 3, 4, 5, 6}, out(6, 0);
  c.all_gather(k3::tensor_view<std::int64_t const, 2>(m.data(), {2, 3}), k3::host_view(out.data(), 6));
  CHECK(out == m);
  auto column = k3::host_view(m.data(), 2, 3).slice(1, 0);  // stride 3
  CHECK_THROWS_WITH_AS(c.all_reduce_sum(column), doctest::Contains("contiguous"), k3::error);
  k3::tensor_view<double, 1> null(nullptr, {4});
  CHECK_THROWS_AS(c.all_reduce_sum(null), k3::error);
  CHECK_THROWS_WITH_AS(c.recv(k3::host_view(out.data(), 6), 0, 0), doctest::Contains("no rank 0"), k3::error);
  CHECK_NOTHROW(c.barrier());
}
