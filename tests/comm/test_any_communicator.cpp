// k3::any_communicator: the type-erased reference satisfies the Communicator concept, forwards
// every operation and element type to the wrapped communicator, and lets its errors through.
// (Over MPI it is exercised by tests/dplr/test_dplr_mpi.cpp; over NCCL by test_dplr_nccl.)
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "k3/comm/any_communicator.hpp"

namespace {

// Records what reaches it, to check the forwarding (a fake 3-rank job as rank 1).
struct recording_communicator {
  mutable std::vector<std::string> log;
  int rank() const { return 1; }
  int size() const { return 3; }
  template <class T, std::size_t R>
  void all_reduce_sum(k3::tensor_view<T, R> v) const {
    for (k3::index_t i = 0; i < v.size(); ++i) v.data_handle()[i] *= 3;
    log.push_back("all_reduce_sum " + std::to_string(v.size()));
  }
  template <class T, class U, std::size_t R1, std::size_t R2>
  void all_gather(k3::tensor_view<T, R1> in, k3::tensor_view<U, R2> out) const {
    if (out.size() != 3 * in.size()) throw k3::error(k3::error_kind::shape, "all_gather: argument 'out' must hold 3 * " + std::to_string(in.size()));
    for (int r = 0; r < 3; ++r)
      for (k3::index_t i = 0; i < in.size(); ++i) out.data_handle()[r * in.size() + i] = in.data_handle()[i] + U(r);
    log.push_back("all_gather " + std::to_string(in.size()));
  }
  template <class T, std::size_t R>
  void send(k3::tensor_view<T, R> v, int peer, int tag) const {
    log.push_back("send " + std::to_string(v.size()) + " to " + std::to_string(peer) + " tag " + std::to_string(tag));
  }
  template <class T, std::size_t R>
  void recv(k3::tensor_view<T, R> v, int peer, int tag) const {
    for (k3::index_t i = 0; i < v.size(); ++i) v.data_handle()[i] = T(peer + tag);
    log.push_back("recv " + std::to_string(v.size()));
  }
  void barrier() const { log.push_back("barrier"); }
};
static_assert(k3::Communicator<recording_communicator>);

}  // namespace

TEST_CASE("any_communicator forwards every operation and element type") {
  recording_communicator rec;
  k3::any_communicator const c(rec);
  CHECK(c.rank() == 1);
  CHECK(c.size() == 3);

  std::vector<float> f = {1, 2};
  c.all_reduce_sum(k3::host_view(f.data(), 2));
  CHECK(f == std::vector<float>{3, 6});
  std::vector<std::int32_t> i32 = {5};
  c.all_reduce_sum(k3::host_view(i32.data(), 1));
  CHECK(i32[0] == 15);

  std::vector<double> in = {0.5, 1.5}, out(6);
  c.all_gather(k3::const_view<double, 1>(in.data(), {2}), k3::host_view(out.data(), 6));
  CHECK(out == std::vector<double>{0.5, 1.5, 1.5, 2.5, 2.5, 3.5});

  std::vector<std::int64_t> msg = {7, 8, 9};
  c.send(k3::const_view<std::int64_t, 1>(msg.data(), {3}), 2, 11);
  c.recv(k3::host_view(msg.data(), 3), 0, 4);
  CHECK(msg == std::vector<std::int64_t>{4, 4, 4});
  c.barrier();
  CHECK(rec.log == std::vector<std::string>{"all_reduce_sum 2", "all_reduce_sum 1", "all_gather 2", "send 3 to 2 tag 11", "recv 3",
                                            "barrier"});
}

TEST_CASE("any_communicator lets the wrapped communicator's errors through and checks views") {
  k3::single_process const sp;
  k3::any_communicator const c(sp);
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  std::vector<float> x = {1, 2, 3}, y(2);
  CHECK_THROWS_WITH_AS(c.all_gather(k3::const_view<float, 1>(x.data(), {3}), k3::host_view(y.data(), 2)),
                       doctest::Contains("all_gather: output must hold"), k3::error);
  CHECK_THROWS_WITH_AS(c.send(k3::const_view<float, 1>(x.data(), {3}), 1, 0), doctest::Contains("no rank 1"), k3::error);
  // a strided view is rejected before it reaches the wrapped communicator
  k3::tensor_view<float, 1> strided(x.data(), {2}, {2});
  CHECK_THROWS_AS(c.all_reduce_sum(strided), k3::error);
}
