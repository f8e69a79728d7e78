// k3/backend/cuda/api.hpp is for host compilers: it must parse without any CUDA header and
// declare the copies with the host/device pairing enforced by the types.
#include "k3/backend/cuda/api.hpp"
#if defined(__CUDA_RUNTIME_H__) || defined(__CUDACC__)
#error "api.hpp must not need CUDA headers"
#endif

#include <doctest/doctest.h>

#include <type_traits>
#include <utility>

using k3::cuda_device_space;
using k3::host_space;
using k3::tensor_view;

static_assert(std::is_same_v<k3::cuda::stream_handle, CUstream_st*>);
static_assert(std::is_aggregate_v<k3::cuda::launch_config>);
static_assert(k3::cuda::launch_config{}.grid.x == 1 && k3::cuda::launch_config{}.block.z == 1);
static_assert(k3::cuda::launch_config{}.shared_bytes == 0);

// Which copies exist, checked in unevaluated contexts (nothing is instantiated here).
template <class Src, class Dst>
concept can_copy = requires(Src s, Dst d) { k3::cuda::copy(s, d, k3::cuda::stream_handle{}); };
using hf = tensor_view<float, 2, host_space>;
using hcf = tensor_view<float const, 2, host_space>;
using df = tensor_view<float, 2, cuda_device_space>;
using dcf = tensor_view<float const, 2, cuda_device_space>;
static_assert(can_copy<hf, df> && can_copy<hcf, df>);         // host -> device (T or const T source)
static_assert(can_copy<df, hf> && can_copy<dcf, hf>);         // device -> host
static_assert(can_copy<df, df> && can_copy<dcf, df>);         // device -> device
static_assert(!can_copy<hf, hf>);                             // host -> host is not a CUDA copy
static_assert(!can_copy<hf, dcf> && !can_copy<df, hcf>);      // const destinations
static_assert(!can_copy<hf, tensor_view<double, 2, cuda_device_space>>);  // element types differ
static_assert(!can_copy<hf, tensor_view<float, 3, cuda_device_space>>);   // ranks differ

TEST_CASE("launch_config is a plain value type") {
  k3::cuda::launch_config c{{4, 2, 1}, {128, 1, 1}, 1024};
  CHECK(c.grid.x * c.grid.y * c.grid.z == 8);
  CHECK(c.block.x == 128);
  CHECK(c.shared_bytes == 1024);
}
