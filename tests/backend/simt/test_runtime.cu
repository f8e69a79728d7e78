// The SIMT runtime's CUDA semantics, checked by kernels that run the same way on a GPU (nvcc)
// and on k3's host runtime: block barriers (with exited threads), warp shuffles for every
// lane pattern and width against the PTX rules written out here, votes, atomics under
// contention, dynamic shared memory and its limits, launch configuration errors. The last
// cases (deadlock, a throwing kernel, memory checks) exist only on the host runtime.
#include "k3/backend/cuda/config.cuh"
// (config.cuh first: it picks the runtime)
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "support/device_buffer.hpp"

// Kernels have external linkage (nvcc rejects K3_KERNEL's visibility attribute on internal
// functions): a named namespace, not an anonymous one.
namespace simt_test {

template <class T>
using dbuf = k3::test::device_buffer<T>;

// Every thread writes its linear index, waits, reads its neighbour's; threads at or above
// `exit_from` leave before the barrier (exited threads count as arrived).
K3_KERNEL void neighbour_kernel(int* out, unsigned exit_from) {
  __shared__ int slot[1024];
  unsigned const n = blockDim.x * blockDim.y * blockDim.z;
  unsigned const t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  unsigned const b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (t >= exit_from) return;
  slot[t] = static_cast<int>(t + 1000 * b);
  __syncthreads();
  unsigned const live = exit_from < n ? exit_from : n;
  out[b * n + t] = slot[(t + 1) % live];
  __syncthreads();
  slot[t] = -1;  // a second round: nobody may still be reading the first
  __syncthreads();
  out[b * n + t] += slot[(t + 2) % live] == -1 ? 0 : 1000000;
}

enum class shuffle_op { idx, up, down, bfly };

K3_KERNEL void shuffle_kernel(int* out, shuffle_op op, int arg, int width) {
  unsigned const t = threadIdx.x;
  int const v = static_cast<int>(100 + t);
  int r = 0;
  switch (op) {
    case shuffle_op::idx: r = __shfl_sync(0xffffffffu, v, arg + static_cast<int>(t % 32 % 3), width); break;  // lane-dependent source
    case shuffle_op::up: r = __shfl_up_sync(0xffffffffu, v, static_cast<unsigned>(arg), width); break;
    case shuffle_op::down: r = __shfl_down_sync(0xffffffffu, v, static_cast<unsigned>(arg), width); break;
    case shuffle_op::bfly: r = __shfl_xor_sync(0xffffffffu, v, arg, width); break;
  }
  out[t] = r;
}

// PTX shfl.sync, written from the ISA text: within a segment of `width` lanes, idx reads
// lane (src mod width) of the segment; up/down read lane -/+ delta unless that leaves the
// segment; bfly reads lane ^ mask unless that lies in a later segment. Out of range: own value.
int expected_shuffle(shuffle_op op, int lane, int arg, int width) {
  int const seg = lane / width * width, pos = lane % width;
  int src = lane;
  switch (op) {
    case shuffle_op::idx: src = seg + (arg + lane % 3) % width; break;
    case shuffle_op::up: src = pos - arg >= 0 ? lane - arg : lane; break;
    case shuffle_op::down: src = pos + arg < width ? lane + arg : lane; break;
    case shuffle_op::bfly: src = (lane ^ arg) < seg + width ? (lane ^ arg) : lane; break;
  }
  return 100 + src;
}

K3_KERNEL void vote_kernel(unsigned* out, unsigned pattern) {
  unsigned const lane = threadIdx.x % 32;
  int const p = static_cast<int>((pattern >> lane) & 1u);
  unsigned const ballot = __ballot_sync(0xffffffffu, p);
  int const any = __any_sync(0xffffffffu, p), all = __all_sync(0xffffffffu, p);
  out[threadIdx.x] = ballot ^ (static_cast<unsigned>(any) << 31) ^ (static_cast<unsigned>(all) << 30);
}

// A warp reduction with a double (8-byte shuffles), and a value that crosses warps through
// shared memory after __syncwarp.
K3_KERNEL void warp_sum_kernel(double* out) {
  double v = static_cast<double>(threadIdx.x) + 0.25;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  out[threadIdx.x] = v;
}

K3_KERNEL void atomics_kernel(unsigned long long* count, float* fsum, unsigned* vmax, int* isum) {
  unsigned const g = blockIdx.x * blockDim.x + threadIdx.x;
  __shared__ unsigned long long local;
  if (threadIdx.x == 0) local = 0;
  __syncthreads();
  for (int r = 0; r < 4; ++r) {
    atomicAdd(count, 1ull);
    atomicAdd(&local, 1ull);
    atomicAdd(fsum, 1.0f);  // integers below 2^24: exact in any order
    atomicMax(vmax, (g * 2654435761u) >> 8);
    atomicAdd(isum, (g % 2) ? 1 : -1);
  }
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(count + 1, local);
}

K3_KERNEL void dynamic_shared_kernel(unsigned* out, unsigned words) {
  K3_DYNAMIC_SHARED(unsigned, buf);
  for (unsigned i = threadIdx.x; i < words; i += blockDim.x) buf[i] = i * 3u + 1u;
  __syncthreads();
  unsigned bad = 0;
  for (unsigned i = threadIdx.x; i < words; i += blockDim.x) bad += buf[words - 1 - i] != (words - 1 - i) * 3u + 1u;
  if (bad) atomicAdd(out, bad);
}

}  // namespace simt_test

using namespace simt_test;

TEST_CASE("block barriers: every thread sees its neighbour's write, across 1-D and 3-D blocks and grids") {
  struct shape {
    dim3 grid, block;
  };
  for (shape s : {shape{dim3(3), dim3(64)}, shape{dim3(2, 2, 1), dim3(8, 4, 2)}, shape{dim3(1), dim3(1024)}, shape{dim3(2), dim3(33)},
                  shape{dim3(1, 1, 2), dim3(5, 3, 7)}}) {
    unsigned const n = s.block.x * s.block.y * s.block.z, blocks = s.grid.x * s.grid.y * s.grid.z;
    dbuf<int> out(n * blocks, 0xFF);
    k3::cuda::launch_kernel(neighbour_kernel, {s.grid, s.block}, out.p, n);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    auto const h = out.get();
    for (unsigned b = 0; b < blocks; ++b)
      for (unsigned t = 0; t < n; ++t) REQUIRE(h[b * n + t] == static_cast<int>((t + 1) % n + 1000 * b));
  }
}

TEST_CASE("block barriers complete when some threads have exited") {
  for (unsigned exit_from : {1u, 17u, 32u, 100u}) {
    dbuf<int> out(128, 0);
    k3::cuda::launch_kernel(neighbour_kernel, {dim3(1), dim3(128)}, out.p, exit_from);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    auto const h = out.get();
    for (unsigned t = 0; t < exit_from; ++t) REQUIRE(h[t] == static_cast<int>((t + 1) % exit_from));
    for (unsigned t = exit_from; t < 128; ++t) REQUIRE(h[t] == 0);
  }
}

TEST_CASE("shuffles: idx, up, down and xor for every lane pattern and width follow PTX shfl.sync") {
  int cases = 0;
  for (int width : {1, 2, 4, 8, 16, 32})
    for (shuffle_op op : {shuffle_op::idx, shuffle_op::up, shuffle_op::down, shuffle_op::bfly})
      for (int arg = 0; arg < 32; ++arg) {
        dbuf<int> out(64);
        k3::cuda::launch_kernel(shuffle_kernel, {dim3(1), dim3(64)}, out.p, op, arg, width);
        REQUIRE(cudaGetLastError() == cudaSuccess);
        auto const h = out.get();
        for (int t = 0; t < 64; ++t) {
          int const lane = t % 32;
          CAPTURE(width);
          CAPTURE(arg);
          CAPTURE(static_cast<int>(op));
          CAPTURE(t);
          REQUIRE(h[t] == expected_shuffle(op, lane, arg, width) + (t / 32) * 32);
        }
        ++cases;
      }
  CHECK(cases == 6 * 4 * 32);
}

TEST_CASE("votes: ballot, any and all over several patterns") {
  for (unsigned pattern : {0u, 0xffffffffu, 1u, 0x80000000u, 0x5555aaaau, 0x0000ffffu}) {
    dbuf<unsigned> out(64);
    k3::cuda::launch_kernel(vote_kernel, {dim3(1), dim3(64)}, out.p, pattern);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    auto const h = out.get();
    unsigned const want = pattern ^ (unsigned(pattern != 0) << 31) ^ (unsigned(pattern == 0xffffffffu) << 30);
    for (unsigned t = 0; t < 64; ++t) REQUIRE(h[t] == want);
  }
}

TEST_CASE("an 8-byte butterfly reduction gives every lane the warp's sum") {
  dbuf<double> out(96);
  k3::cuda::launch_kernel(warp_sum_kernel, {dim3(1), dim3(96)}, out.p);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  auto const h = out.get();
  for (int t = 0; t < 96; ++t) {
    double want = 0;
    for (int l = 0; l < 32; ++l) want += (t / 32) * 32 + l + 0.25;
    REQUIRE(h[t] == want);
  }
}

TEST_CASE("atomics under contention: add (u64, float, int, shared and global), max") {
  unsigned const blocks = 13, threads = 512;
  dbuf<unsigned long long> count(2);
  dbuf<float> fsum(1);
  dbuf<unsigned> vmax(1);
  dbuf<int> isum(1);
  k3::cuda::launch_kernel(atomics_kernel, {dim3(blocks), dim3(threads)}, count.p, fsum.p, vmax.p, isum.p);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  unsigned long long const n = 4ull * blocks * threads;
  CHECK(count.get()[0] == n);
  CHECK(count.get()[1] == n);
  CHECK(fsum.get()[0] == static_cast<float>(n));
  CHECK(isum.get()[0] == 0);
  unsigned want = 0;
  for (unsigned g = 0; g < blocks * threads; ++g) want = std::max(want, (g * 2654435761u) >> 8);
  CHECK(vmax.get()[0] == want);
}

TEST_CASE("dynamic shared memory: 48 KiB by default, up to 227 KiB after cudaFuncSetAttribute, and no more") {
  dbuf<unsigned> bad(1);
  auto run = [&](std::size_t bytes) {
    k3::cuda::launch_kernel(dynamic_shared_kernel, {dim3(2), dim3(256), bytes}, bad.p, static_cast<unsigned>(bytes / 4));
    return cudaGetLastError();
  };
  CHECK(run(48 * 1024) == cudaSuccess);
  CHECK(run(48 * 1024 + 4) == cudaErrorInvalidValue);
  int optin = 0;
  REQUIRE(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0) == cudaSuccess);
  CHECK(optin >= 227 * 1024);
  REQUIRE(cudaFuncSetAttribute(dynamic_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 156 * 1024) == cudaSuccess);
  CHECK(run(156 * 1024) == cudaSuccess);  // KDA's chunked forward at K = 128
  CHECK(run(156 * 1024 + 4) == cudaErrorInvalidValue);
  REQUIRE(cudaFuncSetAttribute(dynamic_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024) == cudaSuccess);
  CHECK(run(227 * 1024) == cudaSuccess);
  CHECK(cudaFuncSetAttribute(dynamic_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin + 1) == cudaErrorInvalidValue);
  (void)cudaGetLastError();
  CHECK(bad.get()[0] == 0);
}

TEST_CASE("launch configurations outside sm_90's limits are rejected") {
  dbuf<int> out(1);
  for (dim3 block : {dim3(1025), dim3(1, 1, 65), dim3(32, 32, 2), dim3(0)}) {
    k3::cuda::launch_kernel(neighbour_kernel, {dim3(1), block}, out.p, 0u);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  }
  k3::cuda::launch_kernel(neighbour_kernel, {dim3(1, 65536), dim3(1)}, out.p, 0u);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  CHECK(cudaGetLastError() == cudaSuccess);  // the error was cleared
}

#if defined(K3_SIMT_RUNTIME)

namespace simt_test {

// Half of each warp waits at the block barrier, the other half at the warp barrier: neither
// can complete (undefined on a GPU, where it may hang).
K3_KERNEL void divergent_barrier_kernel() {
  if (threadIdx.x % 32 < 16)
    __syncthreads();
  else
    __syncwarp();
}

K3_KERNEL void throwing_kernel(int when) {
  if (static_cast<int>(threadIdx.x) == when) throw std::runtime_error("thrown by a kernel");
  __syncthreads();
}

K3_KERNEL void read_fresh_shared_kernel(float* out) {
  K3_DYNAMIC_SHARED(float, buf);
  out[threadIdx.x] = buf[threadIdx.x];
}

}  // namespace simt_test

// (Not under ThreadSanitizer: the threads of a failed launch never reach the end of the
// kernel, so nothing orders them before the host's next accesses.)
#if !defined(K3_SIMT_TSAN)
TEST_CASE("host runtime: a barrier reached by only some threads is a launch failure, not a hang") {
  k3::cuda::launch_kernel(divergent_barrier_kernel, {dim3(2), dim3(96)});
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  dbuf<int> out(64);
  k3::cuda::launch_kernel(neighbour_kernel, {dim3(1), dim3(64)}, out.p, 64u);  // the runtime recovers
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(out.get()[5] == 6);
}

TEST_CASE("host runtime: an exception in a kernel thread is a launch failure") {
  k3::cuda::launch_kernel(throwing_kernel, {dim3(1), dim3(64)}, 17);
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  k3::cuda::launch_kernel(throwing_kernel, {dim3(1), dim3(64)}, -1);
  CHECK(cudaGetLastError() == cudaSuccess);
}

#endif  // K3_SIMT_TSAN

TEST_CASE("host runtime: fresh device and shared memory read as NaN, copies check their device side") {
  dbuf<float> out(64, 0);
  k3::cuda::launch_kernel(read_fresh_shared_kernel, {dim3(1), dim3(64), 64 * sizeof(float)}, out.p);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  for (float v : out.get()) CHECK(std::isnan(v));
  float* fresh = nullptr;
  REQUIRE(cudaMalloc(&fresh, 16 * sizeof(float)) == cudaSuccess);
  std::vector<float> h(16, 0.f);
  REQUIRE(cudaMemcpy(h.data(), fresh, 16 * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  for (float v : h) CHECK(std::isnan(v));
  std::vector<float> host(16);
  CHECK(cudaMemcpy(host.data(), h.data(), 16 * sizeof(float), cudaMemcpyHostToDevice) == cudaErrorInvalidValue);  // dst is host memory
  CHECK(cudaMemcpy(h.data(), fresh + 8, 16 * sizeof(float), cudaMemcpyDeviceToHost) == cudaErrorInvalidValue);    // past the end
  CHECK(cudaMemset(host.data(), 0, 4) == cudaErrorInvalidValue);
  CHECK(cudaFree(host.data()) == cudaErrorInvalidDevicePointer);
  CHECK(cudaFree(fresh) == cudaSuccess);
  (void)cudaGetLastError();
}

TEST_CASE("host runtime: empty allocations, and a destroyed stream is an error") {
  float* p = nullptr;
  CHECK(cudaMalloc(&p, 0) == cudaSuccess);
  CHECK(p == nullptr);
  CHECK(cudaFree(nullptr) == cudaSuccess);
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s) == cudaErrorInvalidResourceHandle);
  (void)cudaGetLastError();
}

#endif  // K3_SIMT_RUNTIME
