// k3/comm/any_communicator.hpp — a type-erased reference to any Communicator.
//
// Why: code compiled by the host compiler (the DPLR/KDA context-parallel drivers, QB histogram
// updates: Eigen and xsimd, never nvcc) must be able to run over NCCL, whose communicator only
// exists in nvcc translation units. Wrap the NCCL communicator once in a .cu file and hand the
// any_communicator to host code:
//
//     // in a .cu file
//     k3::nccl_communicator nccl = k3::nccl_communicator::bootstrap(mpi);
//     k3::any_communicator comm(nccl);   // refers to nccl: keep it alive
//     run_host_side(comm);               // a .cpp function: k3::dplr::forward(cpu, {.comm = &comm, ...})
//
// The operations of the wrapped communicator are instantiated where the any_communicator is
// constructed; a call goes through one function pointer with (pointer, count, element type).
// Host views only (what the Communicator concept moves); element types float, double,
// int64 and int32. Errors of the wrapped communicator (k3::error naming the argument and the
// mismatched counts) pass through unchanged.
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>

#include "k3/comm/communicator.hpp"
#include "k3/core/error.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3 {

class any_communicator {
 public:
  template <Communicator C>
    requires(!std::is_same_v<std::remove_cvref_t<C>, any_communicator>)
  explicit any_communicator(C const& comm) noexcept : comm_(&comm), ops_(&ops_for<C>) {}

  int rank() const { return ops_->rank(comm_); }
  int size() const { return ops_->size(comm_); }
  void barrier() const { ops_->barrier(comm_); }

  template <class T, std::size_t R>
  void all_reduce_sum(tensor_view<T, R> v) const {
    static_assert(!std::is_const_v<T>, "all_reduce_sum writes its buffer");
    detail::check_comm_view("all_reduce_sum", v);
    ops_->all_reduce_sum(comm_, v.data_handle(), v.size(), code<T>());
  }
  template <class T, class U, std::size_t R1, std::size_t R2>
  void all_gather(tensor_view<T, R1> in, tensor_view<U, R2> out) const {
    static_assert(std::is_same_v<std::remove_const_t<T>, U>, "all_gather: input and output element types differ");
    detail::check_comm_view("all_gather input", in);
    detail::check_comm_view("all_gather output", out);
    ops_->all_gather(comm_, in.data_handle(), in.size(), out.data_handle(), out.size(), code<U>());
  }
  template <class T, std::size_t R>
  void send(tensor_view<T, R> v, int peer, int tag) const {
    detail::check_comm_view("send", v);
    ops_->send(comm_, v.data_handle(), v.size(), code<std::remove_const_t<T>>(), peer, tag);
  }
  template <class T, std::size_t R>
  void recv(tensor_view<T, R> v, int peer, int tag) const {
    static_assert(!std::is_const_v<T>, "recv writes its buffer");
    detail::check_comm_view("recv", v);
    ops_->recv(comm_, v.data_handle(), v.size(), code<T>(), peer, tag);
  }

 private:
  enum class elem : int { f32, f64, i64, i32 };

  template <class T>
  static constexpr elem code() {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, std::int64_t> ||
                      std::is_same_v<T, std::int32_t>,
                  "any_communicator moves float, double, int64 and int32 buffers");
    if constexpr (std::is_same_v<T, float>) return elem::f32;
    else if constexpr (std::is_same_v<T, double>) return elem::f64;
    else if constexpr (std::is_same_v<T, std::int64_t>) return elem::i64;
    else return elem::i32;
  }

  // Calls f with a value of the element type named by e (only its type is used).
  template <class F>
  static void dispatch(elem e, F&& f) {
    switch (e) {
      case elem::f32: return f(float{});
      case elem::f64: return f(double{});
      case elem::i64: return f(std::int64_t{});
      case elem::i32: return f(std::int32_t{});
    }
    throw k3::error(error_kind::dtype, "any_communicator: unknown element type code " + std::to_string(static_cast<int>(e)));
  }

  struct ops {
    int (*rank)(void const*);
    int (*size)(void const*);
    void (*barrier)(void const*);
    void (*all_reduce_sum)(void const*, void*, index_t, elem);
    void (*all_gather)(void const*, void const*, index_t, void*, index_t, elem);
    void (*send)(void const*, void const*, index_t, elem, int, int);
    void (*recv)(void const*, void*, index_t, elem, int, int);
  };

  template <class C>
  static C const& self(void const* p) {
    return *static_cast<C const*>(p);
  }

  template <class C>
  static constexpr ops ops_for = {
      [](void const* c) { return static_cast<int>(self<C>(c).rank()); },
      [](void const* c) { return static_cast<int>(self<C>(c).size()); },
      [](void const* c) { self<C>(c).barrier(); },
      [](void const* c, void* p, index_t n, elem e) {
        dispatch(e, [&](auto t) {
          using T = decltype(t);
          self<C>(c).all_reduce_sum(tensor_view<T, 1>(static_cast<T*>(p), {n}));
        });
      },
      [](void const* c, void const* in, index_t n_in, void* out, index_t n_out, elem e) {
        dispatch(e, [&](auto t) {
          using T = decltype(t);
          self<C>(c).all_gather(tensor_view<T const, 1>(static_cast<T const*>(in), {n_in}),
                                tensor_view<T, 1>(static_cast<T*>(out), {n_out}));
        });
      },
      [](void const* c, void const* p, index_t n, elem e, int peer, int tag) {
        dispatch(e, [&](auto t) {
          using T = decltype(t);
          self<C>(c).send(tensor_view<T const, 1>(static_cast<T const*>(p), {n}), peer, tag);
        });
      },
      [](void const* c, void* p, index_t n, elem e, int peer, int tag) {
        dispatch(e, [&](auto t) {
          using T = decltype(t);
          self<C>(c).recv(tensor_view<T, 1>(static_cast<T*>(p), {n}), peer, tag);
        });
      },
  };

  void const* comm_;
  ops const* ops_;
};

static_assert(Communicator<any_communicator>);
static_assert(std::is_trivially_copyable_v<any_communicator>);

}  // namespace k3
