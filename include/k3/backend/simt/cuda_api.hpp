// k3/backend/simt/cuda_api.hpp — the CUDA face of k3's SIMT host runtime: the part of the
// CUDA runtime API, the device built-ins and the qualifiers that k3's kernels use, so that
// the same .cu/.cuh sources compile with g++/clang++ and run on the CPU
// (k3/backend/simt/runtime.hpp executes them).
//
// Reached through k3/backend/cuda/config.cuh when K3_SIMT_RUNTIME is defined (the k3::simt
// CMake target defines it). It replaces the CUDA runtime: a translation unit uses one or the
// other, and a program does not mix them.
//
// Semantics: every call is synchronous (a kernel has finished when its launch returns);
// streams are accepted and order nothing; one device, sm_90's limits; device memory is host
// memory handed out by cudaMalloc, filled with 0xFF bytes (NaN as floats) so that reading it
// before writing shows, and cudaMemcpy/cudaMemset check that their device side lies inside
// such an allocation. Shuffles and votes take the whole warp: the mask is not used.
#pragma once
#if defined(__CUDACC__) || defined(__CUDA_RUNTIME_H__)
#error "k3's SIMT host runtime replaces the CUDA runtime: compile this file with a host compiler and without cuda_runtime.h"
#endif
#include <math.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "k3/backend/simt/runtime.hpp"

// ---- qualifiers ---------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// One block runs at a time, so a kernel's static shared memory is a static local of it.
#define __shared__ static
#define __launch_bounds__(...)

// ---- types --------------------------------------------------------------------------------
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) noexcept : x(vx), y(vy), z(vz) {}
};

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorLaunchFailure = 719,
  cudaErrorNotSupported = 801,
};
typedef cudaError cudaError_t;

struct CUstream_st {
  unsigned flags = 0;
};
typedef CUstream_st* cudaStream_t;
inline constexpr unsigned cudaStreamDefault = 0x0, cudaStreamNonBlocking = 0x1;

// Every stream runs its work to completion when it is issued, so an event is complete once
// recorded; it only has to be a valid handle.
struct CUevent_st {
  bool recorded = false;
};
typedef CUevent_st* cudaEvent_t;
inline constexpr unsigned cudaEventDefault = 0x0, cudaEventDisableTiming = 0x2;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxBlockDimX = 2,
  cudaDevAttrMaxBlockDimY = 3,
  cudaDevAttrMaxBlockDimZ = 4,
  cudaDevAttrMaxGridDimX = 5,
  cudaDevAttrMaxGridDimY = 6,
  cudaDevAttrMaxGridDimZ = 7,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

inline constexpr int warpSize = 32;

namespace k3::simt::cuda_face {

struct device_state {
  std::mutex mutex;
  std::map<std::uintptr_t, std::size_t> allocations;  // base -> bytes
  std::set<CUstream_st*> streams;
  int device = 0;
};
inline device_state& device() {
  static device_state d;
  return d;
}
inline thread_local cudaError_t last_error = cudaSuccess;

inline cudaError_t fail(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

// Does [p, p + bytes) lie inside one live device allocation?
inline bool is_device_range(void const* p, std::size_t bytes) {
  auto& d = device();
  std::lock_guard lock(d.mutex);
  auto const a = reinterpret_cast<std::uintptr_t>(p);
  auto it = d.allocations.upper_bound(a);
  if (it == d.allocations.begin()) return false;
  --it;
  return a >= it->first && a - it->first + bytes <= it->second;
}

inline bool is_stream(cudaStream_t s) {
  if (s == nullptr) return true;
  auto& d = device();
  std::lock_guard lock(d.mutex);
  return d.streams.count(s) != 0;
}

// "include/k3/kda/cuda/decode.cuh:50 decode<float>": the file below include/ or tests/.
inline std::string site_name(char const* file, char const* function, unsigned line) {
  std::string f(file);
  for (char const* root : {"/include/", "/tests/"})
    if (auto at = f.rfind(root); at != std::string::npos) {
      f = f.substr(at + 1);
      break;
    }
  return f + ":" + std::to_string(line) + " " + function;
}

inline simt::extent3 extent(dim3 d) { return {d.x, d.y, d.z}; }

template <class T>
T shuffle(T var, int (*source)(int lane, int arg, int width), int arg, int width) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move trivially copyable values of at most 8 bytes");
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) detail::misuse("a shuffle's width must be a power of two in [1, 32]");
  std::uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = detail::running().exchange(bits, [&](int lane) { return source(lane, arg, width); });
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// Source lanes (-1: the lane keeps its own value), as PTX shfl.sync defines them per segment
// of `width` lanes: indices are compared within the segment, never as absolute lane numbers.
inline int source_idx(int lane, int src, int width) { return (lane & ~(width - 1)) + (src & (width - 1)); }
inline int source_up(int lane, int delta, int width) { return (lane & (width - 1)) >= delta ? lane - delta : -1; }
inline int source_down(int lane, int delta, int width) { return (lane & (width - 1)) + delta < width ? lane + delta : -1; }
inline int source_xor(int lane, int mask, int width) {
  int const src = lane ^ mask;
  return src <= (lane | (width - 1)) ? src : -1;  // a later segment: keep the own value
}

template <class T>
T atomic_add(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_add(v, std::memory_order_relaxed);
}
template <class T, class Better>
T atomic_replace_if(T* p, T v, Better better) {
  std::atomic_ref<T> r(*p);
  T old = r.load(std::memory_order_relaxed);
  while (better(v, old) && !r.compare_exchange_weak(old, v, std::memory_order_relaxed)) {
  }
  return old;
}

}  // namespace k3::simt::cuda_face

// ---- built-in variables ---------------------------------------------------------------------
namespace k3::simt::cuda_face {
inline uint3 thread_idx() {
  auto const t = detail::running().thread_index();
  return {t.x, t.y, t.z};
}
inline uint3 block_idx() {
  auto const b = detail::running().block_index();
  return {b.x, b.y, b.z};
}
inline dim3 block_dim() {
  auto const e = detail::running().block_extent();
  return {e.x, e.y, e.z};
}
inline dim3 grid_dim() {
  auto const e = detail::running().grid_extent();
  return {e.x, e.y, e.z};
}
}  // namespace k3::simt::cuda_face
#define threadIdx (::k3::simt::cuda_face::thread_idx())
#define blockIdx (::k3::simt::cuda_face::block_idx())
#define blockDim (::k3::simt::cuda_face::block_dim())
#define gridDim (::k3::simt::cuda_face::grid_dim())

// Dynamic shared memory: `K3_DYNAMIC_SHARED(float, smem);` declares `float* smem` (16-byte aligned).
#define K3_DYNAMIC_SHARED(T, name) T* const name = reinterpret_cast<T*>(::k3::simt::detail::running().dynamic_shared())

// ---- barriers, shuffles, votes ---------------------------------------------------------------
inline void __syncthreads() { ::k3::simt::detail::running().sync_block(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::k3::simt::detail::running().sync_warp(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <class T>
T __shfl_sync(unsigned, T var, int src, int width = warpSize) {
  return ::k3::simt::cuda_face::shuffle(var, &::k3::simt::cuda_face::source_idx, src, width);
}
template <class T>
T __shfl_up_sync(unsigned, T var, unsigned delta, int width = warpSize) {
  return ::k3::simt::cuda_face::shuffle(var, &::k3::simt::cuda_face::source_up, static_cast<int>(delta), width);
}
template <class T>
T __shfl_down_sync(unsigned, T var, unsigned delta, int width = warpSize) {
  return ::k3::simt::cuda_face::shuffle(var, &::k3::simt::cuda_face::source_down, static_cast<int>(delta), width);
}
template <class T>
T __shfl_xor_sync(unsigned, T var, int lane_mask, int width = warpSize) {
  return ::k3::simt::cuda_face::shuffle(var, &::k3::simt::cuda_face::source_xor, lane_mask, width);
}

inline unsigned __ballot_sync(unsigned, int predicate) {
  auto& s = ::k3::simt::detail::running();
  unsigned const parity = static_cast<unsigned>(s.publish(predicate != 0));
  std::uint32_t const present = s.present_lanes(parity);
  unsigned ballot = 0;
  for (unsigned l = 0; l < 32; ++l)
    if (((present >> l) & 1u) && s.exchanged(parity, l)) ballot |= 1u << l;
  return ballot;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) {
  auto& s = ::k3::simt::detail::running();
  unsigned const parity = static_cast<unsigned>(s.publish(predicate != 0));
  std::uint32_t const present = s.present_lanes(parity);
  for (unsigned l = 0; l < 32; ++l)
    if (((present >> l) & 1u) && !s.exchanged(parity, l)) return 0;
  (void)mask;
  return 1;
}

// ---- atomics (relaxed, as CUDA's) -------------------------------------------------------------
inline int atomicAdd(int* p, int v) { return ::k3::simt::cuda_face::atomic_add(p, v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return ::k3::simt::cuda_face::atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return ::k3::simt::cuda_face::atomic_add(p, v); }
inline float atomicAdd(float* p, float v) { return ::k3::simt::cuda_face::atomic_add(p, v); }
inline double atomicAdd(double* p, double v) { return ::k3::simt::cuda_face::atomic_add(p, v); }
inline int atomicSub(int* p, int v) { return std::atomic_ref<int>(*p).fetch_sub(v, std::memory_order_relaxed); }
inline unsigned atomicSub(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_sub(v, std::memory_order_relaxed); }
template <class T>
  requires(std::is_same_v<T, int> || std::is_same_v<T, unsigned> || std::is_same_v<T, unsigned long long> || std::is_same_v<T, long long>)
T atomicMax(T* p, T v) {
  return ::k3::simt::cuda_face::atomic_replace_if(p, v, [](T a, T b) { return a > b; });
}
template <class T>
  requires(std::is_same_v<T, int> || std::is_same_v<T, unsigned> || std::is_same_v<T, unsigned long long> || std::is_same_v<T, long long>)
T atomicMin(T* p, T v) {
  return ::k3::simt::cuda_face::atomic_replace_if(p, v, [](T a, T b) { return a < b; });
}
template <class T>
  requires(std::is_same_v<T, int> || std::is_same_v<T, unsigned> || std::is_same_v<T, unsigned long long> || std::is_same_v<T, float>)
T atomicExch(T* p, T v) {
  return std::atomic_ref<T>(*p).exchange(v, std::memory_order_relaxed);
}
template <class T>
  requires(std::is_same_v<T, int> || std::is_same_v<T, unsigned> || std::is_same_v<T, unsigned long long>)
T atomicCAS(T* p, T compare, T v) {
  std::atomic_ref<T>(*p).compare_exchange_strong(compare, v, std::memory_order_relaxed);
  return compare;
}

// ---- math and bit intrinsics ------------------------------------------------------------------
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
// The _rn operations are never contracted into an FMA with their neighbours (as in CUDA): a
// call boundary keeps the compiler from fusing them.
[[gnu::noinline]] inline float __fadd_rn(float a, float b) { return a + b; }
[[gnu::noinline]] inline float __fsub_rn(float a, float b) { return a - b; }
[[gnu::noinline]] inline float __fmul_rn(float a, float b) { return a * b; }
[[gnu::noinline]] inline float __fdiv_rn(float a, float b) { return a / b; }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __popc(unsigned x) { return std::popcount(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return x == 0 ? 0 : std::countr_zero(static_cast<unsigned>(x)) + 1; }
template <class T>
T __ldg(T const* p) {
  return *p;
}

// ---- the runtime API ------------------------------------------------------------------------------
inline char const* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
  }
  return "cudaErrorUnknown";
}
inline char const* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorLaunchFailure: return "unspecified launch failure (the SIMT runtime printed why)";
    case cudaErrorNotSupported: return "operation not supported";
  }
  return "unknown error";
}
inline cudaError_t cudaGetLastError() { return std::exchange(::k3::simt::cuda_face::last_error, cudaSuccess); }
inline cudaError_t cudaPeekAtLastError() { return ::k3::simt::cuda_face::last_error; }

inline cudaError_t cudaGetDeviceCount(int* n) {
  if (n == nullptr) return ::k3::simt::cuda_face::fail(cudaErrorInvalidValue);
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  if (d == nullptr) return ::k3::simt::cuda_face::fail(cudaErrorInvalidValue);
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : ::k3::simt::cuda_face::fail(cudaErrorInvalidDevice); }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr) return ::k3::simt::cuda_face::fail(cudaErrorInvalidValue);
  if (device != 0) return ::k3::simt::cuda_face::fail(cudaErrorInvalidDevice);
  namespace s = ::k3::simt;
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = static_cast<int>(s::max_threads_per_block); break;
    case cudaDevAttrMaxBlockDimX: *value = static_cast<int>(s::max_block_extent.x); break;
    case cudaDevAttrMaxBlockDimY: *value = static_cast<int>(s::max_block_extent.y); break;
    case cudaDevAttrMaxBlockDimZ: *value = static_cast<int>(s::max_block_extent.z); break;
    case cudaDevAttrMaxGridDimX: *value = static_cast<int>(s::max_grid_extent.x); break;
    case cudaDevAttrMaxGridDimY: *value = static_cast<int>(s::max_grid_extent.y); break;
    case cudaDevAttrMaxGridDimZ: *value = static_cast<int>(s::max_grid_extent.z); break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = static_cast<int>(s::default_dynamic_shared_bytes); break;
    case cudaDevAttrWarpSize: *value = static_cast<int>(s::warp_size); break;
    case cudaDevAttrMultiProcessorCount: *value = 132; break;  // H100/H200 SXM
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = static_cast<int>(s::max_dynamic_shared_bytes); break;
    default: return ::k3::simt::cuda_face::fail(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

inline cudaError_t cudaFuncSetAttribute(void const* kernel, cudaFuncAttribute attr, int value) {
  if (kernel == nullptr || attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      !::k3::simt::set_dynamic_shared_limit(kernel, static_cast<std::size_t>(value)))
    return ::k3::simt::cuda_face::fail(cudaErrorInvalidValue);
  return cudaSuccess;
}
template <class... P>
cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<void const*>(kernel), attr, value);
}

inline cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  if (p == nullptr) return ::k3::simt::cuda_face::fail(cudaErrorInvalidValue);
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  void* m = ::operator new(bytes, std::align_val_t(256), std::nothrow);
  if (m == nullptr) return ::k3::simt::cuda_face::fail(cudaErrorMemoryAllocation);
  std::memset(m, 0xFF, bytes);  // never-written device memory reads as NaN
  auto& d = ::k3::simt::cuda_face::device();
  std::lock_guard lock(d.mutex);
  d.allocations[reinterpret_cast<std::uintptr_t>(m)] = bytes;
  *p = m;
  return cudaSuccess;
}
template <class T>
cudaError_t cudaMalloc(T** p, std::size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
inline cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  auto& d = ::k3::simt::cuda_face::device();
  {
    std::lock_guard lock(d.mutex);
    auto it = d.allocations.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == d.allocations.end()) return ::k3::simt::cuda_face::fail(cudaErrorInvalidDevicePointer);
    d.allocations.erase(it);
  }
  ::operator delete(p, std::align_val_t(256));
  return cudaSuccess;
}
// Stream-ordered allocation happens at once: the pointer is valid when the call returns.
inline cudaError_t cudaMallocAsync(void** p, std::size_t bytes, cudaStream_t s) {
  if (!::k3::simt::cuda_face::is_stream(s)) return ::k3::simt::cuda_face::fail(cudaErrorInvalidResourceHandle);
  return cudaMalloc(p, bytes);
}
template <class T>
cudaError_t cudaMallocAsync(T** p, std::size_t bytes, cudaStream_t s) {
  return cudaMallocAsync(reinterpret_cast<void**>(p), bytes, s);
}
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  if (!::k3::simt::cuda_face::is_stream(s)) return ::k3::simt::cuda_face::fail(cudaErrorInvalidResourceHandle);
  return cudaFree(p);
}

inline cudaError_t cudaMemcpy(void* dst, void const* src, std::size_t bytes, cudaMemcpyKind kind) {
  using ::k3::simt::cuda_face::is_device_range;
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return ::k3::simt::cuda_face::fail(cudaErrorInvalidValue);
  bool const dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  bool const src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return ::k3::simt::cuda_face::fail(cudaErrorInvalidMemcpyDirection);
  if ((dst_device && !is_device_range(dst, bytes)) || (src_device && !is_device_range(src, bytes)))
    return ::k3::simt::cuda_face::fail(cudaErrorInvalidValue);
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, void const* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t s = nullptr) {
  if (!::k3::simt::cuda_face::is_stream(s)) return ::k3::simt::cuda_face::fail(cudaErrorInvalidResourceHandle);
  return cudaMemcpy(dst, src, bytes, kind);
}
inline cudaError_t cudaMemset(void* p, int value, std::size_t bytes) {
  if (bytes == 0) return cudaSuccess;
  if (!::k3::simt::cuda_face::is_device_range(p, bytes)) return ::k3::simt::cuda_face::fail(cudaErrorInvalidValue);
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t s = nullptr) {
  if (!::k3::simt::cuda_face::is_stream(s)) return ::k3::simt::cuda_face::fail(cudaErrorInvalidResourceHandle);
  return cudaMemset(p, value, bytes);
}

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  if (s == nullptr) return ::k3::simt::cuda_face::fail(cudaErrorInvalidValue);
  *s = new CUstream_st{flags};
  auto& d = ::k3::simt::cuda_face::device();
  std::lock_guard lock(d.mutex);
  d.streams.insert(*s);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  auto& d = ::k3::simt::cuda_face::device();
  {
    std::lock_guard lock(d.mutex);
    if (s == nullptr || d.streams.erase(s) == 0) return ::k3::simt::cuda_face::fail(cudaErrorInvalidResourceHandle);
  }
  delete s;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  return ::k3::simt::cuda_face::is_stream(s) ? cudaSuccess : ::k3::simt::cuda_face::fail(cudaErrorInvalidResourceHandle);
}

// Page-locked host memory is host memory here: copies from and to it are host copies.
inline cudaError_t cudaMallocHost(void** p, std::size_t bytes) {
  if (p == nullptr) return ::k3::simt::cuda_face::fail(cudaErrorInvalidValue);
  *p = bytes ? ::operator new(bytes, std::align_val_t(256), std::nothrow) : nullptr;
  return bytes && *p == nullptr ? ::k3::simt::cuda_face::fail(cudaErrorMemoryAllocation) : cudaSuccess;
}
inline cudaError_t cudaFreeHost(void* p) {
  if (p) ::operator delete(p, std::align_val_t(256));
  return cudaSuccess;
}

inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  if (e == nullptr) return ::k3::simt::cuda_face::fail(cudaErrorInvalidValue);
  *e = new CUevent_st{};
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  if (e == nullptr) return ::k3::simt::cuda_face::fail(cudaErrorInvalidResourceHandle);
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr) {
  if (e == nullptr || !::k3::simt::cuda_face::is_stream(s)) return ::k3::simt::cuda_face::fail(cudaErrorInvalidResourceHandle);
  e->recorded = true;
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  return e == nullptr ? ::k3::simt::cuda_face::fail(cudaErrorInvalidResourceHandle) : cudaSuccess;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned = 0) {
  if (e == nullptr || !::k3::simt::cuda_face::is_stream(s)) return ::k3::simt::cuda_face::fail(cudaErrorInvalidResourceHandle);
  return cudaSuccess;
}

namespace k3::simt {

// kernel<<<grid, block, shared_bytes, stream>>>(args...), run to completion. Each CUDA thread
// gets its own copy of the arguments, converted to the kernel's parameter types once.
template <class... P, class... A>
void launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream, std::string site,
                   A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "launch_kernel: argument count does not match the kernel");
  if (!cuda_face::is_stream(stream)) {
    cuda_face::fail(cudaErrorInvalidResourceHandle);
    return;
  }
  std::tuple<std::decay_t<P>...> params(static_cast<std::decay_t<P>>(std::forward<A>(args))...);
  struct closure {
    void (*kernel)(P...);
    std::tuple<std::decay_t<P>...>* params;
  } c{kernel, &params};
  launch_request r;
  r.kernel = reinterpret_cast<void const*>(kernel);
  r.site = std::move(site);
  r.grid = cuda_face::extent(grid);
  r.block = cuda_face::extent(block);
  r.shared_bytes = shared_bytes;
  r.body = [](void* p) {
    auto& cl = *static_cast<closure*>(p);
    std::apply(cl.kernel, *cl.params);
  };
  r.arg = &c;
  std::string why;
  launch_status const s = launch(r, &why);
  if (s == launch_status::ok) return;
  std::fprintf(stderr, "k3 SIMT runtime: %s: %s\n", r.site.c_str(), why.c_str());
  cuda_face::fail(s == launch_status::bad_configuration        ? cudaErrorInvalidConfiguration
                  : s == launch_status::too_much_shared_memory ? cudaErrorInvalidValue
                                                               : cudaErrorLaunchFailure);
}

}  // namespace k3::simt
