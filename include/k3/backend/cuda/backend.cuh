// k3/backend/cuda/backend.cuh — k3::cuda::stream_backend: device memory, a stream, a
// grid-stride for_each and raw kernel launch; plus copies between host and device views.
//
// The backend is a small value type that does not own its stream (copy it freely, as the
// Backend concept asks); k3::cuda::scoped_stream owns one. A device index < 0 means "the
// device current on the calling thread"; otherwise every call switches to that device and
// back.
#pragma once
#include "k3/backend/cuda/config.cuh"
// (config.cuh first: it refuses host compilers with one clear line)
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "k3/backend/cuda/api.hpp"
#include "k3/core/array.hpp"
#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"

namespace k3::cuda {

inline dim3 to_dim3(dim d) noexcept { return dim3(d.x, d.y, d.z); }

// Number of CUDA devices; 0 (not an error) when there is no driver or no device.
inline int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the non-sticky error so later calls are not blamed
    return 0;
  }
  return n;
}

namespace detail {

// Makes `device` current for the guard's lifetime (no-op for device < 0).
class device_guard {
 public:
  explicit device_guard(int device) {
    if (device < 0) return;
    K3_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ == device) {
      prev_ = -1;
      return;
    }
    K3_CUDA_CHECK(cudaSetDevice(device));
  }
  device_guard(device_guard const&) = delete;
  device_guard& operator=(device_guard const&) = delete;
  ~device_guard() {
    if (prev_ >= 0) (void)cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

// Instantiated with functors from anonymous namespaces too, where hidden visibility is
// meaningless (nvcc warns 1407); the kernel stays hidden whenever its functor is external.
#if defined(__CUDACC__)
#pragma nv_diag_push
#pragma nv_diag_suppress 1407
#endif
template <class F>
K3_KERNEL void for_each_kernel(std::int64_t begin, std::int64_t n, F f) {
  std::int64_t const step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) f(begin + i);
}
#if defined(__CUDACC__)
#pragma nv_diag_pop
#endif

// Row-major unravel of a flat index over `ext`.
template <std::size_t Rank>
K3_INLINE array<index_t, Rank> unravel(index_t i, array<index_t, Rank> const& ext) noexcept {
  array<index_t, Rank> idx{};
  for (std::size_t r = Rank; r-- > 0;) {
    idx[r] = ext[r] > 0 ? i % ext[r] : 0;
    i = ext[r] > 0 ? i / ext[r] : 0;
  }
  return idx;
}

// dst[idx] = src[idx] for every index: one thread per element.
template <class T, std::size_t Rank>
struct strided_copy_fn {
  tensor_view<T const, Rank, cuda_device_space> src;
  tensor_view<T, Rank, cuda_device_space> dst;
  K3_HD void operator()(index_t i) const noexcept {
    auto idx = unravel<Rank>(i, dst.extents());
    dst[idx] = src[idx];
  }
};

// Host-side gather (strided -> C order) and scatter (C order -> strided).
template <class T, std::size_t Rank>
void host_gather(tensor_view<T const, Rank, host_space> v, T* out) {
  array<index_t, Rank> idx{};
  for (index_t i = 0, n = v.size(); i < n; ++i) {
    out[i] = v[idx];
    for (std::size_t r = Rank; r-- > 0;) {
      if (++idx[r] < v.extent(r)) break;
      idx[r] = 0;
    }
  }
}
template <class T, std::size_t Rank>
void host_scatter(T const* in, tensor_view<T, Rank, host_space> v) {
  array<index_t, Rank> idx{};
  for (index_t i = 0, n = v.size(); i < n; ++i) {
    v[idx] = in[i];
    for (std::size_t r = Rank; r-- > 0;) {
      if (++idx[r] < v.extent(r)) break;
      idx[r] = 0;
    }
  }
}

template <class S, class D>
void check_copy_args(S const& src, D const& dst) {
  ::k3::detail::check_view("src", src);
  ::k3::detail::check_view("dst", dst);
  ::k3::detail::require(src.extents() == dst.extents(), error_kind::shape, [&] {
    return "cuda::copy: argument 'dst': expected shape " + ::k3::detail::format_shape(src.extents()) +
           " (the shape of 'src'), got " + ::k3::detail::format_shape(dst.extents());
  });
}

// A contiguous device scratch buffer freed on scope exit (cudaFree synchronises the device,
// so the kernels that used it have finished).
template <class T>
class device_scratch {
 public:
  explicit device_scratch(std::size_t n) {
    if (n) K3_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)));
  }
  device_scratch(device_scratch const&) = delete;
  device_scratch& operator=(device_scratch const&) = delete;
  ~device_scratch() {
    if (p_) (void)cudaFree(p_);
  }
  T* get() const noexcept { return p_; }

 private:
  T* p_ = nullptr;
};

}  // namespace detail

class stream_backend {
 public:
  using memory_space = cuda_device_space;
  static constexpr char const* name() noexcept { return "cuda::stream_backend"; }
  static constexpr int block_size = 256;

  // The legacy default stream on the current device.
  stream_backend() noexcept = default;
  explicit stream_backend(cudaStream_t stream, int device = -1) noexcept : stream_(stream), device_(device) {}

  cudaStream_t stream() const noexcept { return stream_; }
  // The device this backend runs on (the current one when constructed without one).
  int device() const {
    if (device_ >= 0) return device_;
    int d = 0;
    K3_CUDA_CHECK(cudaGetDevice(&d));
    return d;
  }

  // The device index as given (-1: whichever device is current at each call).
  int requested_device() const noexcept { return device_; }

  template <class T>
  T* allocate(std::size_t n) const {
    if (n == 0) return nullptr;
    if (n > std::size_t(-1) / sizeof(T)) throw k3::error(error_kind::shape, "cuda::stream_backend::allocate: " + std::to_string(n) + " elements overflow");
    detail::device_guard g(device_);
    void* p = nullptr;
    K3_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    return static_cast<T*>(p);
  }
  template <class T>
  void deallocate(T* p, std::size_t) const noexcept {
    if (p) (void)cudaFree(p);  // errors here can only be reported by a later call
  }
  // Zero bytes in stream order (k3::tensor zero-fills what it allocates).
  template <class T>
  void zero_fill(T* p, std::size_t n) const {
    static_assert(std::is_trivially_copyable_v<T>, "zero_fill needs a trivially copyable type");
    if (n == 0) return;
    detail::device_guard g(device_);
    K3_CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(T), stream_));
  }

  // f(i) for i in [begin, end) on the device, asynchronously in stream order. `f` is copied
  // to the device: it must be a K3_HD/__device__ callable holding device views, not host
  // pointers.
  template <class F>
  void for_each(std::int64_t begin, std::int64_t end, F&& f) const {
    using Fn = std::decay_t<F>;
    if (end <= begin) return;
    std::int64_t const n = end - begin;
    std::int64_t blocks = (n + block_size - 1) / block_size;
    if (blocks > max_blocks) blocks = max_blocks;  // grid-stride loop covers the rest
    detail::device_guard g(device_);
    ::k3::cuda::launch_kernel(detail::for_each_kernel<Fn>, {static_cast<unsigned>(blocks), block_size, 0, stream_}, begin, n, Fn(std::forward<F>(f)));
    K3_CUDA_CHECK(cudaGetLastError());
  }

  // Blocks the host until all work queued on the stream has finished; reports kernel errors.
  void fence() const {
    detail::device_guard g(device_);
    K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  // kernel<<<grid, block, shared_bytes, stream()>>>(args...) (through launch_kernel), with the launch error checked.
  template <class... Params, class... Args>
  void launch(dim3 grid, dim3 block, std::size_t shared_bytes, void (*kernel)(Params...), Args&&... args) const {
    static_assert(sizeof...(Params) == sizeof...(Args), "launch: argument count does not match the kernel");
    k3::detail::require(kernel != nullptr, error_kind::value, "cuda::launch: argument 'kernel' is null");
    k3::detail::require(grid.x && grid.y && grid.z && block.x && block.y && block.z, error_kind::value, [&] {
      return "cuda::launch: arguments 'grid' and 'block' must be non-zero, got grid [" + std::to_string(grid.x) + ", " +
             std::to_string(grid.y) + ", " + std::to_string(grid.z) + "], block [" + std::to_string(block.x) + ", " +
             std::to_string(block.y) + ", " + std::to_string(block.z) + "]";
    });
    detail::device_guard g(device_);
    ::k3::cuda::launch_kernel(kernel, {grid, block, shared_bytes, stream_}, std::forward<Args>(args)...);
    K3_CUDA_CHECK(cudaGetLastError());
  }
  template <class... Params, class... Args>
  void launch(launch_config const& cfg, void (*kernel)(Params...), Args&&... args) const {
    launch(to_dim3(cfg.grid), to_dim3(cfg.block), cfg.shared_bytes, kernel, std::forward<Args>(args)...);
  }

  // Copies between views (see k3::cuda::copy) on this backend's stream.
  template <class Src, class T, std::size_t Rank, class DstSpace>
  void copy(Src const& src, tensor_view<T, Rank, DstSpace> dst) const {
    detail::device_guard g(device_);
    ::k3::cuda::copy<T, Rank>(src, dst, stream_);
  }

 private:
  static constexpr std::int64_t max_blocks = std::int64_t(1) << 20;
  cudaStream_t stream_ = nullptr;
  int device_ = -1;
};

static_assert(CudaBackend<stream_backend>);
static_assert(!HostBackend<stream_backend>);
static_assert(std::is_trivially_copyable_v<stream_backend>);

// Owns a non-blocking stream on one device.
class scoped_stream {
 public:
  explicit scoped_stream(int device = -1) {
    detail::device_guard g(device);
    K3_CUDA_CHECK(cudaGetDevice(&device_));
    K3_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  scoped_stream(scoped_stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)), device_(o.device_) {}
  scoped_stream& operator=(scoped_stream&& o) noexcept {
    if (this != &o) {
      reset();
      stream_ = std::exchange(o.stream_, nullptr);
      device_ = o.device_;
    }
    return *this;
  }
  scoped_stream(scoped_stream const&) = delete;
  scoped_stream& operator=(scoped_stream const&) = delete;
  ~scoped_stream() { reset(); }

  cudaStream_t get() const noexcept { return stream_; }
  int device() const noexcept { return device_; }
  stream_backend backend() const noexcept { return stream_backend(stream_, device_); }

 private:
  void reset() noexcept {
    if (stream_) (void)cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

// ---- copies (declared in api.hpp) -------------------------------------------------------

template <class T, std::size_t Rank>
  requires(!std::is_const_v<T>)
void copy(std::type_identity_t<tensor_view<T const, Rank, host_space>> src, tensor_view<T, Rank, cuda_device_space> dst,
          stream_handle stream) {
  static_assert(std::is_trivially_copyable_v<T>, "cuda::copy needs a trivially copyable element type");
  detail::check_copy_args(src, dst);
  std::size_t const n = static_cast<std::size_t>(src.size());
  if (n == 0) return;
  std::vector<T> staged;
  T const* from = src.data_handle();
  if (!src.is_contiguous()) {
    staged.resize(n);
    detail::host_gather(src, staged.data());
    from = staged.data();
  }
  if (dst.is_contiguous()) {
    K3_CUDA_CHECK(cudaMemcpyAsync(dst.data_handle(), from, n * sizeof(T), cudaMemcpyHostToDevice, stream));
  } else {
    detail::device_scratch<T> tmp(n);
    K3_CUDA_CHECK(cudaMemcpyAsync(tmp.get(), from, n * sizeof(T), cudaMemcpyHostToDevice, stream));
    tensor_view<T const, Rank, cuda_device_space> packed(tmp.get(), dst.extents());
    stream_backend(stream).for_each(0, static_cast<index_t>(n), detail::strided_copy_fn<T, Rank>{packed, dst});
    K3_CUDA_CHECK(cudaStreamSynchronize(stream));  // before `tmp` goes
  }
  K3_CUDA_CHECK(cudaStreamSynchronize(stream));  // `staged` and the caller's buffer may go now
}

template <class T, std::size_t Rank>
  requires(!std::is_const_v<T>)
void copy(std::type_identity_t<tensor_view<T const, Rank, cuda_device_space>> src, tensor_view<T, Rank, host_space> dst,
          stream_handle stream) {
  static_assert(std::is_trivially_copyable_v<T>, "cuda::copy needs a trivially copyable element type");
  detail::check_copy_args(src, dst);
  std::size_t const n = static_cast<std::size_t>(src.size());
  if (n == 0) return;
  detail::device_scratch<T> tmp(src.is_contiguous() ? 0 : n);
  T const* from = src.data_handle();
  if (!src.is_contiguous()) {
    tensor_view<T, Rank, cuda_device_space> packed(tmp.get(), src.extents());
    stream_backend(stream).for_each(0, static_cast<index_t>(n), detail::strided_copy_fn<T, Rank>{src, packed});
    from = tmp.get();
  }
  if (dst.is_contiguous()) {
    K3_CUDA_CHECK(cudaMemcpyAsync(dst.data_handle(), from, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
    K3_CUDA_CHECK(cudaStreamSynchronize(stream));
  } else {
    std::vector<T> staged(n);
    K3_CUDA_CHECK(cudaMemcpyAsync(staged.data(), from, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
    K3_CUDA_CHECK(cudaStreamSynchronize(stream));
    detail::host_scatter(static_cast<T const*>(staged.data()), dst);
  }
}

template <class T, std::size_t Rank>
  requires(!std::is_const_v<T>)
void copy(std::type_identity_t<tensor_view<T const, Rank, cuda_device_space>> src,
          tensor_view<T, Rank, cuda_device_space> dst, stream_handle stream) {
  static_assert(std::is_trivially_copyable_v<T>, "cuda::copy needs a trivially copyable element type");
  detail::check_copy_args(src, dst);
  ::k3::detail::check_no_overlap("dst", dst, "src", src);
  std::size_t const n = static_cast<std::size_t>(src.size());
  if (n == 0) return;
  if (src.is_contiguous() && dst.is_contiguous()) {
    K3_CUDA_CHECK(cudaMemcpyAsync(dst.data_handle(), src.data_handle(), n * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  } else {
    stream_backend(stream).for_each(0, static_cast<index_t>(n), detail::strided_copy_fn<T, Rank>{src, dst});
  }
}

namespace detail {
// n elements of device memory from a backend for the duration of one call (freed at scope
// exit; n = 0 holds nullptr).
template <class T, class B = stream_backend>
class call_buffer {
 public:
  call_buffer(B const& be, std::size_t n) : be_(be), n_(n), p_(be.template allocate<T>(n)) {}
  call_buffer(call_buffer const&) = delete;
  call_buffer& operator=(call_buffer const&) = delete;
  ~call_buffer() { be_.deallocate(p_, n_); }
  T* get() const noexcept { return p_; }

 private:
  B be_;
  std::size_t n_;
  T* p_;
};
}  // namespace detail

}  // namespace k3::cuda

// Instantiates the three copies for one element type and rank, so that .cpp TUs that only
// see api.hpp can call them. Use at namespace scope in exactly one .cu file per program.
#define K3_CUDA_INSTANTIATE_COPY(T, Rank)                                                                      \
  template void ::k3::cuda::copy<T, Rank>(std::type_identity_t<::k3::tensor_view<T const, Rank, ::k3::host_space>>, \
                                          ::k3::tensor_view<T, Rank, ::k3::cuda_device_space>,                 \
                                          ::k3::cuda::stream_handle);                                          \
  template void ::k3::cuda::copy<T, Rank>(                                                                     \
      std::type_identity_t<::k3::tensor_view<T const, Rank, ::k3::cuda_device_space>>,                         \
      ::k3::tensor_view<T, Rank, ::k3::host_space>, ::k3::cuda::stream_handle);                                \
  template void ::k3::cuda::copy<T, Rank>(                                                                     \
      std::type_identity_t<::k3::tensor_view<T const, Rank, ::k3::cuda_device_space>>,                         \
      ::k3::tensor_view<T, Rank, ::k3::cuda_device_space>, ::k3::cuda::stream_handle)
