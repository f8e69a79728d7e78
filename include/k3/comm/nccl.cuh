// k3/comm/nccl.cuh — k3::nccl_communicator: the Communicator concept over NCCL, for device
// views (the fast path) and host views (staged through device memory, so the type satisfies
// the host-view Communicator concept too). Needs nvcc, <nccl.h> and libnccl: link k3::nccl.
//
// Ordering: operations on device views are enqueued on the communicator's stream and return
// without waiting for the data (later work on that stream sees the result). Operations on
// host views return when the data has arrived, like the MPI communicator. Like the MPI
// communicator, every collective first checks (with a tiny all-reduce) that all ranks pass
// the same element count and type, and send/recv carry a header (count, type, tag, element
// bytes), so mismatches throw k3::error on the affected ranks instead of hanging or reading
// garbage; these checks wait for the stream. NCCL has no tags: messages between two ranks
// are received in the order they were sent, and recv checks the tag it expects.
// As with blocking MPI sends, two ranks that both send to each other first can deadlock.
#pragma once
#include "k3/backend/cuda/config.cuh"
// (config.cuh first: it refuses host compilers with one clear line)
#include <nccl.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "k3/backend/cuda/backend.cuh"
#include "k3/comm/communicator.hpp"
#include "k3/core/error.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3 {

class nccl_error : public k3::error {
 public:
  nccl_error(ncclResult_t r, char const* what)
      : k3::error(error_kind::io, std::string("NCCL error in ") + what + ": " + ncclGetErrorString(r)), code_(r) {}
  ncclResult_t code() const noexcept { return code_; }

 private:
  ncclResult_t code_;
};

namespace detail {

inline void nccl_check(ncclResult_t r, char const* what) {
  if (r != ncclSuccess) throw nccl_error(r, what);
}

template <class T>
constexpr ncclDataType_t nccl_type() noexcept {
  if constexpr (std::is_same_v<T, float>) return ncclFloat32;
  else if constexpr (std::is_same_v<T, double>) return ncclFloat64;
  else if constexpr (std::is_same_v<T, std::int64_t>) return ncclInt64;
  else if constexpr (std::is_same_v<T, std::int32_t>) return ncclInt32;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return ncclUint64;
  else if constexpr (std::is_same_v<T, std::uint32_t>) return ncclUint32;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return ncclUint8;
  else {
    static_assert(std::is_same_v<T, bfloat16>, "k3::nccl_communicator: unsupported element type");
    return ncclBfloat16;  // k3::bfloat16 holds the same 16 bits as __nv_bfloat16
  }
}

template <class T>
inline constexpr bool nccl_supported_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, std::int64_t> ||
    std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::uint64_t> || std::is_same_v<T, std::uint32_t> ||
    std::is_same_v<T, std::uint8_t> || std::is_same_v<T, bfloat16>;

}  // namespace detail

// A communicator that also moves device views: what the later context/pipeline-parallel
// code needs on GPUs. (Communicator itself is stated over host views.)
template <class C>
concept DeviceCommunicator = Communicator<C> && requires(C const& c, tensor_view<float, 1, cuda_device_space> f,
                                                         tensor_view<float const, 1, cuda_device_space> cf, int peer,
                                                         int tag) {
  c.all_reduce_sum(f);
  c.all_gather(cf, f);
  c.send(cf, peer, tag);
  c.recv(f, peer, tag);
};

class nccl_communicator {
 public:
  // Joins the clique `id` as `rank` of `size` on the backend's device and stream. Every rank
  // calls this (collectively) with the same id, obtained by one rank from unique_id().
  nccl_communicator(ncclUniqueId const& id, int rank, int size, cuda::stream_backend backend = {})
      : backend_(backend), owns_(true) {
    detail::require(size >= 1 && rank >= 0 && rank < size, error_kind::value, [&] {
      return "nccl_communicator: rank " + std::to_string(rank) + " is not in a job of size " + std::to_string(size);
    });
    cuda::detail::device_guard g(backend_.requested_device());
    detail::nccl_check(ncclCommInitRank(&comm_, size, id, rank), "ncclCommInitRank");
    try {
      finish_init();
    } catch (...) {
      (void)ncclCommDestroy(comm_);
      throw;
    }
  }

  // Wraps a communicator created elsewhere (not destroyed here).
  nccl_communicator(ncclComm_t comm, cuda::stream_backend backend) : comm_(comm), backend_(backend), owns_(false) {
    detail::require(comm != nullptr, error_kind::value, "nccl_communicator: argument 'comm' is null");
    finish_init();
  }

  // Builds an NCCL communicator over the ranks of a host communicator (MPI, ...): rank 0
  // makes the id, an all-reduce of its bytes hands it to everyone. Collective.
  template <Communicator Host>
  static nccl_communicator bootstrap(Host const& host, cuda::stream_backend backend = {}) {
    static_assert(sizeof(ncclUniqueId) % sizeof(std::int64_t) == 0);
    constexpr std::size_t words = sizeof(ncclUniqueId) / sizeof(std::int64_t);
    std::int64_t buf[words] = {};
    if (host.rank() == 0) {
      ncclUniqueId id = unique_id();
      std::memcpy(buf, &id, sizeof id);
    }
    host.all_reduce_sum(tensor_view<std::int64_t, 1>(buf, {static_cast<index_t>(words)}));
    ncclUniqueId id;
    std::memcpy(&id, buf, sizeof id);
    return nccl_communicator(id, host.rank(), host.size(), backend);
  }

  static ncclUniqueId unique_id() {
    ncclUniqueId id;
    detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    return id;
  }

  nccl_communicator(nccl_communicator&& o) noexcept
      : comm_(std::exchange(o.comm_, nullptr)),
        backend_(o.backend_),
        owns_(o.owns_),
        rank_(o.rank_),
        size_(o.size_),
        scratch_(std::exchange(o.scratch_, nullptr)) {}
  nccl_communicator& operator=(nccl_communicator&&) = delete;
  nccl_communicator(nccl_communicator const&) = delete;
  nccl_communicator& operator=(nccl_communicator const&) = delete;
  ~nccl_communicator() {
    if (scratch_) (void)cudaFree(scratch_);
    if (comm_ && owns_) (void)ncclCommDestroy(comm_);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  ncclComm_t native() const noexcept { return comm_; }
  cuda::stream_backend const& backend() const noexcept { return backend_; }

  // In-place sum over all ranks.
  template <class T, std::size_t R, class Space>
  void all_reduce_sum(tensor_view<T, R, Space> v) const {
    static_assert(!std::is_const_v<T>, "all_reduce_sum writes its buffer");
    static_assert(detail::nccl_supported_v<T>, "all_reduce_sum: unsupported element type");
    check_buffer("all_reduce_sum", v);
    agree("all_reduce_sum", v.size(), detail::nccl_type<T>());
    if (v.size() == 0) return;
    auto const n = static_cast<std::size_t>(v.size());
    cuda::detail::device_guard g(backend_.requested_device());
    staged<T> s(v.data_handle(), n, std::is_same_v<Space, host_space>, true, stream());
    detail::nccl_check(ncclAllReduce(s.ptr, s.ptr, n, detail::nccl_type<T>(), ncclSum, comm_, stream()), "all_reduce_sum");
    s.finish(v.data_handle(), n);
  }

  // out holds size() blocks of in.size() elements, rank r's block at offset r * in.size().
  template <class T, class U, std::size_t R1, std::size_t R2, class Space>
  void all_gather(tensor_view<T, R1, Space> in, tensor_view<U, R2, Space> out) const {
    using E = std::remove_const_t<T>;
    static_assert(std::is_same_v<E, U>, "all_gather: input and output element types differ");
    static_assert(detail::nccl_supported_v<E>, "all_gather: unsupported element type");
    check_buffer("all_gather input", in);
    check_buffer("all_gather output", out);
    agree("all_gather", in.size(), detail::nccl_type<E>());
    detail::require(out.size() == in.size() * size_, error_kind::shape, [&] {
      return "all_gather: argument 'out' must hold " + std::to_string(size_) + " * " + std::to_string(in.size()) +
             " elements, got " + std::to_string(out.size());
    });
    if (in.size() == 0) return;
    constexpr bool host = std::is_same_v<Space, host_space>;
    auto const n = static_cast<std::size_t>(in.size());
    cuda::detail::device_guard g(backend_.requested_device());
    staged<E> sin(const_cast<E*>(in.data_handle()), n, host, true, stream());
    staged<E> sout(out.data_handle(), n * static_cast<std::size_t>(size_), host, false, stream());
    detail::nccl_check(ncclAllGather(sin.ptr, sout.ptr, n, detail::nccl_type<E>(), comm_, stream()), "all_gather");
    sout.finish(out.data_handle(), n * static_cast<std::size_t>(size_));
  }

  // Sends a header (count, type, tag, element bytes) and then the payload.
  template <class T, std::size_t R, class Space>
  void send(tensor_view<T, R, Space> v, int peer, int tag) const {
    using E = std::remove_const_t<T>;
    static_assert(detail::nccl_supported_v<E>, "send: unsupported element type");
    check_buffer("send", v);
    check_peer("send", peer);
    cuda::detail::device_guard g(backend_.requested_device());
    std::int64_t header[4] = {v.size(), detail::nccl_type<E>(), tag, static_cast<std::int64_t>(sizeof(E))};
    K3_CUDA_CHECK(cudaMemcpyAsync(scratch_, header, sizeof header, cudaMemcpyHostToDevice, stream()));
    detail::nccl_check(ncclSend(scratch_, 4, ncclInt64, peer, comm_, stream()), "send header");
    if (v.size() == 0) return;
    auto const n = static_cast<std::size_t>(v.size());
    staged<E> s(const_cast<E*>(v.data_handle()), n, std::is_same_v<Space, host_space>, true, stream());
    detail::nccl_check(ncclSend(s.ptr, n, detail::nccl_type<E>(), peer, comm_, stream()), "send");
    s.finish(nullptr, 0);  // host views: wait before the staging buffer goes
  }

  // Receives into v; throws if the peer sent a different count, type or tag. The payload of
  // a mismatched message is drained so the channel stays usable.
  template <class T, std::size_t R, class Space>
  void recv(tensor_view<T, R, Space> v, int peer, int tag) const {
    static_assert(!std::is_const_v<T>, "recv writes its buffer");
    static_assert(detail::nccl_supported_v<T>, "recv: unsupported element type");
    check_buffer("recv", v);
    check_peer("recv", peer);
    cuda::detail::device_guard g(backend_.requested_device());
    detail::nccl_check(ncclRecv(scratch_ + 4, 4, ncclInt64, peer, comm_, stream()), "recv header");
    std::int64_t header[4] = {};
    K3_CUDA_CHECK(cudaMemcpyAsync(header, scratch_ + 4, sizeof header, cudaMemcpyDeviceToHost, stream()));
    K3_CUDA_CHECK(cudaStreamSynchronize(stream()));
    if (header[0] != v.size() || header[1] != detail::nccl_type<T>() || header[2] != tag) {
      std::int64_t const bytes = header[0] > 0 && header[3] > 0 ? header[0] * header[3] : 0;
      if (bytes > 0) {
        cuda::detail::device_scratch<unsigned char> sink(static_cast<std::size_t>(bytes));
        detail::nccl_check(ncclRecv(sink.get(), static_cast<std::size_t>(bytes), ncclUint8, peer, comm_, stream()), "recv");
        K3_CUDA_CHECK(cudaStreamSynchronize(stream()));
      }
      throw k3::error(error_kind::io, "recv from rank " + std::to_string(peer) + ": expected " + std::to_string(v.size()) +
                      " elements of NCCL type " + std::to_string(detail::nccl_type<T>()) + " with tag " +
                      std::to_string(tag) + ", peer sent " + std::to_string(header[0]) + " of type " +
                      std::to_string(header[1]) + " with tag " + std::to_string(header[2]));
    }
    if (v.size() == 0) return;
    auto const n = static_cast<std::size_t>(v.size());
    staged<T> s(v.data_handle(), n, std::is_same_v<Space, host_space>, false, stream());
    detail::nccl_check(ncclRecv(s.ptr, n, detail::nccl_type<T>(), peer, comm_, stream()), "recv");
    s.finish(v.data_handle(), n);
  }

  // Returns when every rank has reached the barrier and this rank's stream is drained.
  void barrier() const {
    cuda::detail::device_guard g(backend_.requested_device());
    detail::nccl_check(ncclAllReduce(scratch_ + 8, scratch_ + 8, 1, ncclInt64, ncclSum, comm_, stream()), "barrier");
    K3_CUDA_CHECK(cudaStreamSynchronize(stream()));
  }

 private:
  cudaStream_t stream() const noexcept { return backend_.stream(); }

  void finish_init() {
    detail::nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount");
    detail::nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    cuda::detail::device_guard g(backend_.requested_device());
    K3_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scratch_), scratch_words * sizeof(std::int64_t)));
    K3_CUDA_CHECK(cudaMemset(scratch_, 0, scratch_words * sizeof(std::int64_t)));
  }

  // A host view's data goes through a device buffer; a device view is used in place.
  template <class E>
  struct staged {
    E* ptr = nullptr;
    bool host;
    cudaStream_t s;
    cuda::detail::device_scratch<E> buf;
    staged(E* p, std::size_t n, bool is_host, bool upload, cudaStream_t stream)
        : host(is_host), s(stream), buf(is_host ? n : 0) {
      ptr = host ? buf.get() : p;
      if (host && upload) K3_CUDA_CHECK(cudaMemcpyAsync(buf.get(), p, n * sizeof(E), cudaMemcpyHostToDevice, s));
    }
    // For host views: download (if dst) and wait, so the caller's buffer holds the result.
    void finish(E* dst, std::size_t n) {
      if (!host) return;
      if (dst && n) K3_CUDA_CHECK(cudaMemcpyAsync(dst, buf.get(), n * sizeof(E), cudaMemcpyDeviceToHost, s));
      K3_CUDA_CHECK(cudaStreamSynchronize(s));
    }
  };

  template <class V>
  void check_buffer(char const* what, V const& v) const {
    using Space = typename V::memory_space;
    static_assert(std::is_same_v<Space, host_space> || std::is_same_v<Space, cuda_device_space>,
                  "nccl_communicator moves host or CUDA device views");
    detail::require(v.is_contiguous() && (v.size() == 0 || v.data_handle() != nullptr), error_kind::shape, [&] {
      return std::string(what) + ": communicator buffers must be contiguous views with data (shape " +
             detail::format_shape(v.extents()) + ", strides " + detail::format_shape(v.strides()) + ")";
    });
  }
  void check_peer(char const* what, int peer) const {
    detail::require(peer >= 0 && peer < size_ && peer != rank_, error_kind::value, [&] {
      return std::string(what) + ": peer rank " + std::to_string(peer) + " is not another rank of this job (size " +
             std::to_string(size_) + ", this rank " + std::to_string(rank_) + ")";
    });
  }
  // All ranks agree on (count, type) or all throw.
  void agree(char const* what, std::int64_t count, std::int64_t type) const {
    cuda::detail::device_guard g(backend_.requested_device());
    std::int64_t mine[4] = {count, -count, type, -type}, all[4] = {};
    K3_CUDA_CHECK(cudaMemcpyAsync(scratch_, mine, sizeof mine, cudaMemcpyHostToDevice, stream()));
    detail::nccl_check(ncclAllReduce(scratch_, scratch_, 4, ncclInt64, ncclMax, comm_, stream()), what);
    K3_CUDA_CHECK(cudaMemcpyAsync(all, scratch_, sizeof all, cudaMemcpyDeviceToHost, stream()));
    K3_CUDA_CHECK(cudaStreamSynchronize(stream()));
    if (all[0] != -all[1] || all[2] != -all[3])
      throw k3::error(error_kind::shape, std::string(what) + ": ranks passed different element counts or types (this rank " +
                      std::to_string(rank_) + ": " + std::to_string(count) + " elements, NCCL type " + std::to_string(type) +
                      "; counts range " + std::to_string(-all[1]) + ".." + std::to_string(all[0]) + ")");
  }

  static constexpr std::size_t scratch_words = 16;  // [0,4) checks/send header, [4,8) recv header, [8] barrier
  ncclComm_t comm_ = nullptr;
  cuda::stream_backend backend_;
  bool owns_ = false;
  int rank_ = 0, size_ = 1;
  std::int64_t* scratch_ = nullptr;
};

static_assert(Communicator<nccl_communicator>);
static_assert(DeviceCommunicator<nccl_communicator>);
static_assert(!DeviceCommunicator<single_process>);

}  // namespace k3
