// k3::nccl_communicator: compile-time checks everywhere; on a machine with a GPU, a
// one-rank clique (NCCL refuses two ranks on one device) checks the collectives, the
// host-view staging and the argument checks. Multi-rank runs need one GPU per rank.
#include <k3/comm/nccl.cuh>
// (first: must be self-sufficient)
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include <k3/core/tensor.hpp>

using k3::cuda_device_space;
using k3::index_t;
using k3::tensor_view;

static_assert(k3::Communicator<k3::nccl_communicator>);
static_assert(k3::DeviceCommunicator<k3::nccl_communicator>);
static_assert(!k3::DeviceCommunicator<k3::single_process>);
static_assert(!std::is_copy_constructible_v<k3::nccl_communicator>);
static_assert(k3::detail::nccl_type<k3::bfloat16>() == ncclBfloat16);
static_assert(k3::detail::nccl_type<double>() == ncclFloat64);
static_assert(!k3::detail::nccl_supported_v<std::int16_t>);

TEST_CASE("one-rank NCCL clique: collectives on device and host views") {
  auto comm = k3::nccl_communicator::bootstrap(k3::single_process{});
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  k3::cuda::stream_backend be = comm.backend();

  std::vector<double> h = {1.5, -2, 3.25};
  k3::tensor<double, 1, k3::cuda::stream_backend> d({3}, be);
  be.copy(k3::host_view(h.data(), 3), d.view());
  comm.all_reduce_sum(d.view());
  std::vector<double> back(3);
  be.copy(d.view(), k3::host_view(back.data(), 3));
  CHECK(back == h);

  comm.all_reduce_sum(k3::host_view(h.data(), 3));  // staged through the device
  CHECK(h == std::vector<double>{1.5, -2, 3.25});

  std::vector<float> in = {4, 5, 6}, out(3, 0.f);
  comm.all_gather(tensor_view<float const, 1>(in.data(), {3}), k3::host_view(out.data(), 3));
  CHECK(out == in);
  k3::tensor<float, 1, k3::cuda::stream_backend> din({3}, be), dout({3}, be);
  be.copy(k3::host_view(in.data(), 3), din.view());
  comm.all_gather(tensor_view<float const, 1, cuda_device_space>(din.view()), dout.view());
  std::vector<float> out2(3);
  be.copy(dout.view(), k3::host_view(out2.data(), 3));
  CHECK(out2 == in);
  comm.barrier();

  std::vector<float> small(2);
  CHECK_THROWS_AS(comm.all_gather(tensor_view<float const, 1>(in.data(), {3}), k3::host_view(small.data(), 2)), k3::error);
  CHECK_THROWS_AS(comm.send(tensor_view<float const, 1>(in.data(), {3}), 1, 0), k3::error);
  CHECK_THROWS_AS(comm.recv(k3::host_view(out.data(), 3), 0, 0), k3::error);  // self is not a peer
  tensor_view<float, 1, cuda_device_space> strided(dout.data(), {2}, {2});
  CHECK_THROWS_AS(comm.all_reduce_sum(strided), k3::error);
}
