// k3/comm/communicator.hpp — the Communicator concept and the single-process implementation.
//
// A communicator moves host views between the ranks of a job: all-reduce (sum, in place),
// all-gather (each rank contributes the same count), point-to-point send/recv, barrier.
// Every transfer is checked: a peer that sends a different element count or type than the
// receiver expects makes the receiver throw k3::error naming both, instead of hanging or
// reading garbage. Later issues (distributed QB histograms, context and pipeline
// parallelism) are written against this concept only.
#pragma once
#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "k3/core/error.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3 {

template <class C>
concept Communicator = requires(C const& c, tensor_view<float, 1> f, tensor_view<double, 1> d,
                                tensor_view<std::int64_t, 1> i, tensor_view<float const, 1> cf, int peer, int tag) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.all_reduce_sum(f);
  c.all_reduce_sum(d);
  c.all_reduce_sum(i);
  c.all_gather(cf, f);
  c.send(cf, peer, tag);
  c.recv(f, peer, tag);
  c.barrier();
};

namespace detail {
template <class C>
concept posts_nonblocking = requires(C const& c, tensor_view<float, 1> f, tensor_view<float const, 1> cf, int peer, int tag) {
  c.isend(cf, peer, tag);
  c.irecv(f, peer, tag);
};
template <class C>
using comm_request_t = decltype(std::declval<C const&>().isend(std::declval<tensor_view<float const, 1>>(), 0, 0));
}  // namespace detail

// A communicator that also posts non-blocking transfers: isend/irecv return a request that
// wait() completes (k3::mpi_communicator). The request type is named through an alias because
// nvcc 13's front end aborts on a nested requires-expression over decltype of a parameter.
template <class C>
concept NonBlockingCommunicator = Communicator<C> && detail::posts_nonblocking<C> &&
                                  requires(C const& c, detail::comm_request_t<C>& r) { c.wait(r); };

// The words a communicator carries for elements of type T: bfloat16 travels as its 16 bits
// (communicators move float, double, 32/64-bit integers and unsigned words).
template <class T>
using wire_word_t = std::conditional_t<std::is_same_v<std::remove_const_t<T>, bfloat16>, std::uint16_t, std::remove_const_t<T>>;

// The n elements at p as a view of the words a communicator sends or receives for them.
template <class T>
auto wire_view(T* p, index_t n) {
  using W = std::conditional_t<std::is_const_v<T>, wire_word_t<T> const, wire_word_t<T>>;
  return tensor_view<W, 1>(reinterpret_cast<W*>(p), {n});
}

namespace detail {
// Element-type codes carried in message headers so receivers can reject mismatches.
template <class T>
constexpr std::int64_t comm_type_code() noexcept {
  if constexpr (std::is_same_v<T, float>) return 1;
  else if constexpr (std::is_same_v<T, double>) return 2;
  else if constexpr (std::is_same_v<T, std::int64_t>) return 3;
  else if constexpr (std::is_same_v<T, std::int32_t>) return 4;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return 5;
  else if constexpr (std::is_same_v<T, std::uint16_t>) return 6;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return 7;
  else return 0;
}

template <class V>
void check_comm_view(char const* what, V const& v) {
  detail::require(v.is_contiguous() && (v.size() == 0 || v.data_handle() != nullptr), error_kind::shape, [&] {
    return std::string(what) + ": communicator buffers must be contiguous host views (shape " + format_shape(v.extents()) + ")";
  });
}
}  // namespace detail

// One process, one rank: collectives are identities; there is no peer to talk to.
class single_process {
 public:
  int rank() const noexcept { return 0; }
  int size() const noexcept { return 1; }

  template <class T, std::size_t R>
  void all_reduce_sum(tensor_view<T, R> v) const {
    detail::check_comm_view("all_reduce_sum", v);
  }
  template <class T, class U, std::size_t R1, std::size_t R2>
  void all_gather(tensor_view<T, R1> in, tensor_view<U, R2> out) const {
    detail::check_comm_view("all_gather input", in);
    detail::check_comm_view("all_gather output", out);
    detail::require(out.size() == in.size(), error_kind::shape, [&] {
      return "all_gather: output must hold size() * " + std::to_string(in.size()) + " = " + std::to_string(in.size()) +
             " elements, got " + std::to_string(out.size());
    });
    for (index_t i = 0; i < in.size(); ++i) out.data_handle()[i] = in.data_handle()[i];
  }
  template <class T, std::size_t R>
  void send(tensor_view<T, R>, int peer, int) const {
    throw k3::error(error_kind::value, "single_process::send: no rank " + std::to_string(peer) + " in a job of size 1");
  }
  template <class T, std::size_t R>
  void recv(tensor_view<T, R>, int peer, int) const {
    throw k3::error(error_kind::value, "single_process::recv: no rank " + std::to_string(peer) + " in a job of size 1");
  }
  void barrier() const noexcept {}
};

static_assert(Communicator<single_process>);

}  // namespace k3
