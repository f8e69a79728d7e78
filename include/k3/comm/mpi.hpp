// k3/comm/mpi.hpp — k3::mpi_communicator over an MPI communicator (Open MPI from Debian).
// Needs <mpi.h>: link MPI::MPI_CXX. MPI must be initialised by the caller (k3::mpi_session
// does it RAII-style for programs that own main()).
#pragma once
#include <mpi.h>

#include <cstdint>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "k3/comm/communicator.hpp"

namespace k3 {

namespace detail {
template <class T>
MPI_Datatype mpi_type() {
  if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return MPI_UINT64_T;
  else if constexpr (std::is_same_v<T, std::uint16_t>) return MPI_UINT16_T;
  else {
    static_assert(std::is_same_v<T, std::uint8_t>, "k3::mpi_communicator: unsupported element type");
    return MPI_UINT8_T;
  }
}
inline void mpi_check(int rc, char const* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw k3::error(error_kind::io, std::string(what) + ": MPI error: " + std::string(msg, static_cast<std::size_t>(len)));
  }
}
}  // namespace detail

// Initialises MPI for the lifetime of the object (if nobody else did) and finalises it.
class mpi_session {
 public:
  mpi_session(int* argc, char*** argv) {
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
      detail::mpi_check(MPI_Init(argc, argv), "MPI_Init");
      owner_ = true;
    }
  }
  ~mpi_session() {
    if (owner_) MPI_Finalize();
  }
  mpi_session(mpi_session const&) = delete;
  mpi_session& operator=(mpi_session const&) = delete;

 private:
  bool owner_ = false;
};

class mpi_communicator {
 public:
  explicit mpi_communicator(MPI_Comm comm = MPI_COMM_WORLD) : comm_(comm) {
    // Errors come back as return codes, which k3 turns into exceptions.
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  MPI_Comm native() const noexcept { return comm_; }

  // In-place sum. Every rank must pass the same element count and type; a mismatch, or a
  // buffer one rank's own checks reject, throws on every rank (checked with a small
  // collective first, so nobody hangs).
  template <class T, std::size_t R>
  void all_reduce_sum(tensor_view<T, R> v) const {
    static_assert(!std::is_const_v<T>, "all_reduce_sum writes its buffer");
    agree("all_reduce_sum", v.size(), detail::comm_type_code<T>(), local_error([&] { detail::check_comm_view("all_reduce_sum", v); }));
    if (v.size() == 0) return;
    detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, v.data_handle(), static_cast<int>(v.size()), detail::mpi_type<T>(), MPI_SUM, comm_),
                      "all_reduce_sum");
  }

  // out holds size() blocks of in.size() elements, rank r's block at offset r * in.size().
  template <class T, class U, std::size_t R1, std::size_t R2>
  void all_gather(tensor_view<T, R1> in, tensor_view<U, R2> out) const {
    using E = std::remove_const_t<T>;
    static_assert(std::is_same_v<E, U>, "all_gather: input and output element types differ");
    agree("all_gather", in.size(), detail::comm_type_code<E>(), local_error([&] {
            detail::check_comm_view("all_gather input", in);
            detail::check_comm_view("all_gather output", out);
            detail::require(out.size() == in.size() * size_, error_kind::shape, [&] {
              return "all_gather: output must hold " + std::to_string(size_) + " * " + std::to_string(in.size()) + " elements, got " +
                     std::to_string(out.size());
            });
          }));
    if (in.size() == 0) return;
    detail::mpi_check(MPI_Allgather(in.data_handle(), static_cast<int>(in.size()), detail::mpi_type<E>(), out.data_handle(),
                                    static_cast<int>(in.size()), detail::mpi_type<E>(), comm_),
                      "all_gather");
  }

  // Sends a header (element count, type code) and then the payload. A buffer this rank's
  // checks reject still sends a header (count -1), so the receiver throws instead of waiting.
  template <class T, std::size_t R>
  void send(tensor_view<T, R> v, int peer, int tag) const {
    using E = std::remove_const_t<T>;
    check_peer("send", peer);
    if (auto bad = local_error([&] { detail::check_comm_view("send", v); })) {
      std::int64_t header[2] = {-1, detail::comm_type_code<E>()};
      detail::mpi_check(MPI_Send(header, 2, MPI_INT64_T, peer, header_tag(tag), comm_), "send header");
      std::rethrow_exception(bad);
    }
    std::int64_t header[2] = {v.size(), detail::comm_type_code<E>()};
    detail::mpi_check(MPI_Send(header, 2, MPI_INT64_T, peer, header_tag(tag), comm_), "send header");
    if (v.size() > 0)
      detail::mpi_check(MPI_Send(v.data_handle(), static_cast<int>(v.size()), detail::mpi_type<E>(), peer, tag, comm_), "send");
  }

  // Receives into v; throws if the peer sent a different count or type, or if this rank's
  // checks reject v. The payload of a mismatched or rejected message is drained so the
  // channel stays usable.
  template <class T, std::size_t R>
  void recv(tensor_view<T, R> v, int peer, int tag) const {
    static_assert(!std::is_const_v<T>, "recv writes its buffer");
    check_peer("recv", peer);
    auto const bad = local_error([&] { detail::check_comm_view("recv", v); });
    std::int64_t header[2] = {0, 0};
    detail::mpi_check(MPI_Recv(header, 2, MPI_INT64_T, peer, header_tag(tag), comm_, MPI_STATUS_IGNORE), "recv header");
    if (header[0] < 0)
      throw k3::error(error_kind::io, "recv from rank " + std::to_string(peer) + ": the sender rejected its buffer (see the error on rank " +
                      std::to_string(peer) + ")");
    if (bad || header[0] != v.size() || header[1] != detail::comm_type_code<T>()) {
      if (header[0] > 0) {
        MPI_Status st;
        MPI_Probe(peer, tag, comm_, &st);
        int bytes = 0;
        MPI_Get_count(&st, MPI_BYTE, &bytes);
        std::string sink(static_cast<std::size_t>(bytes), '\0');
        MPI_Recv(sink.data(), bytes, MPI_BYTE, peer, tag, comm_, MPI_STATUS_IGNORE);
      }
      if (bad) std::rethrow_exception(bad);
      throw k3::error(error_kind::io, "recv from rank " + std::to_string(peer) + ": expected " + std::to_string(v.size()) +
                      " elements of type code " + std::to_string(detail::comm_type_code<T>()) + ", peer sent " +
                      std::to_string(header[0]) + " of type code " + std::to_string(header[1]));
    }
    if (v.size() > 0)
      detail::mpi_check(MPI_Recv(v.data_handle(), static_cast<int>(v.size()), detail::mpi_type<T>(), peer, tag, comm_, MPI_STATUS_IGNORE),
                        "recv");
  }

  void barrier() const { detail::mpi_check(MPI_Barrier(comm_), "barrier"); }

  // Non-blocking point-to-point, for transfers that overlap compute (P2P Muon): the buffer must
  // stay alive and untouched until wait(request&), which throws if a receive got a different
  // element count than its buffer holds. No header travels: both ends run the same plan.
  struct request {
    MPI_Request handle = MPI_REQUEST_NULL;
    MPI_Datatype type = MPI_DATATYPE_NULL;
    std::int64_t expected = -1;  // receives: the element count the buffer holds
    int peer = -1;
  };
  template <class T, std::size_t R>
  request isend(tensor_view<T, R> v, int peer, int tag) const {
    using E = std::remove_const_t<T>;
    check_peer("isend", peer);
    detail::check_comm_view("isend", v);
    check_count("isend", v.size());
    request r{MPI_REQUEST_NULL, detail::mpi_type<E>(), -1, peer};
    detail::mpi_check(MPI_Isend(v.data_handle(), static_cast<int>(v.size()), r.type, peer, tag, comm_, &r.handle), "isend");
    return r;
  }
  template <class T, std::size_t R>
  request irecv(tensor_view<T, R> v, int peer, int tag) const {
    static_assert(!std::is_const_v<T>, "irecv writes its buffer");
    check_peer("irecv", peer);
    detail::check_comm_view("irecv", v);
    check_count("irecv", v.size());
    request r{MPI_REQUEST_NULL, detail::mpi_type<T>(), v.size(), peer};
    detail::mpi_check(MPI_Irecv(v.data_handle(), static_cast<int>(v.size()), r.type, peer, tag, comm_, &r.handle), "irecv");
    return r;
  }
  void wait(request& r) const {
    MPI_Status st;
    detail::mpi_check(MPI_Wait(&r.handle, &st), "wait");
    if (r.expected >= 0) {
      int got = 0;
      MPI_Get_count(&st, r.type, &got);
      detail::require(got == r.expected, error_kind::io, [&] {
        return "irecv from rank " + std::to_string(r.peer) + ": expected " + std::to_string(r.expected) + " elements, peer sent " +
               std::to_string(got);
      });
    }
  }

 private:
  static int header_tag(int tag) { return tag + (1 << 20); }
  static void check_count(char const* what, std::int64_t n) {
    detail::require(n <= std::numeric_limits<int>::max(), error_kind::shape, [&] {
      return std::string(what) + ": " + std::to_string(n) + " elements is more than one MPI message can carry (at most 2^31 - 1)";
    });
  }
  void check_peer(char const* what, int peer) const {
    detail::require(peer >= 0 && peer < size_ && peer != rank_, error_kind::value, [&] {
      return std::string(what) + ": peer rank " + std::to_string(peer) + " is not another rank of this job (size " +
             std::to_string(size_) + ", this rank " + std::to_string(rank_) + ")";
    });
  }
  // The exception f throws, if any (this rank's own argument checks).
  template <class F>
  static std::exception_ptr local_error(F&& f) {
    return detail::capture_error(std::forward<F>(f));
  }
  // All ranks agree on (count, type) or all throw; a rank whose own checks failed (`bad`)
  // still takes part, then throws its error while the others throw one naming the failure.
  void agree(char const* what, std::int64_t count, std::int64_t type, std::exception_ptr const& bad) const {
    std::int64_t mine[5] = {count, -count, type, -type, bad ? 1 : 0}, all[5];
    detail::mpi_check(MPI_Allreduce(mine, all, 5, MPI_INT64_T, MPI_MAX, comm_), what);
    if (bad) std::rethrow_exception(bad);
    if (all[4])
      throw k3::error(error_kind::shape, std::string(what) + ": another rank's buffer failed its checks (see the error there); this is rank " +
                      std::to_string(rank_));
    if (all[0] != -all[1] || all[2] != -all[3])
      throw k3::error(error_kind::shape, std::string(what) + ": ranks passed different element counts or types (this rank " + std::to_string(rank_) +
                      ": " + std::to_string(count) + " elements, type code " + std::to_string(type) + "; counts range " +
                      std::to_string(-all[1]) + ".." + std::to_string(all[0]) + ")");
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

static_assert(Communicator<mpi_communicator>);

}  // namespace k3
