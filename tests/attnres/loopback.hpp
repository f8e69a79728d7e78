// Two or more simulated ranks in one process for the pipeline-cache tests: a Communicator
// whose messages are byte copies (with their element type) in a shared mailbox.
#pragma once
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "k3/comm/communicator.hpp"
#include "k3/core/error.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3::test {

struct mailbox {
  std::map<std::tuple<int, int, int>, std::deque<std::pair<std::int64_t, std::vector<unsigned char>>>> q;  // (src, dst, tag)
};

class loopback {
 public:
  loopback(std::shared_ptr<mailbox> m, int rank, int size) : m_(std::move(m)), rank_(rank), size_(size) {}
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  template <class T, std::size_t R>
  void all_reduce_sum(k3::tensor_view<T, R>) const {}
  template <class T, class U, std::size_t R1, std::size_t R2>
  void all_gather(k3::tensor_view<T, R1>, k3::tensor_view<U, R2>) const {}
  template <class T, std::size_t R>
  void send(k3::tensor_view<T, R> v, int peer, int tag) const {
    std::vector<unsigned char> bytes(std::size_t(v.size()) * sizeof(T));
    if (!bytes.empty()) std::memcpy(bytes.data(), v.data_handle(), bytes.size());  // empty messages (T = 0) carry no pointer
    m_->q[{rank_, peer, tag}].push_back({k3::detail::comm_type_code<std::remove_const_t<T>>(), std::move(bytes)});
  }
  template <class T, std::size_t R>
  void recv(k3::tensor_view<T, R> v, int peer, int tag) const {
    auto& d = m_->q[{peer, rank_, tag}];
    k3::detail::require(!d.empty(), k3::error_kind::value, "loopback: nothing to receive");
    auto [code, bytes] = std::move(d.front());
    d.pop_front();
    k3::detail::require(code == k3::detail::comm_type_code<T>() && bytes.size() == std::size_t(v.size()) * sizeof(T), k3::error_kind::value,
                        "loopback: type or count mismatch");
    if (!bytes.empty()) std::memcpy(v.data_handle(), bytes.data(), bytes.size());
  }
  void barrier() const noexcept {}

 private:
  std::shared_ptr<mailbox> m_;
  int rank_, size_;
};
static_assert(k3::Communicator<loopback>);

}  // namespace k3::test
