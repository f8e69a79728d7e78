// k3/attnres/pipeline.hpp — the Block AttnRes cache for pipeline parallelism (spec §5.1,
// paper §4.1 "cross-stage caching"), over any k3::Communicator.
//
// A pipeline cuts the sites 0..L into chunks run by stages (ranks), possibly several chunks
// per rank (virtual stages, wrapping around the ring). Each rank keeps its own bank: every
// block it created or received stays there for the rest of the microbatch. A forward hop
// sends the running sum plus only the bank rows the receiver does not hold yet; which rows
// those are travels with the hops as a small vector (rows held per rank), so no extra
// round trip is needed. Without caching every hop would resend the whole bank.
//
// The backward runs the hops in reverse. A stage sends the gradient of the running sum and
// the gradients of exactly the rows it received on the matching forward hop (then zeroes
// them locally): the gradients of rows it read from its own cache stay deposited in its bank
// gradient until its own earlier chunk's backward (or the sender upstream) uses them. The
// owner of a block therefore sees every reader's contribution before its boundary site
// turns that block's gradient into the gradient of its sublayers.
//
// One pipeline_cache and one block_attn_res per rank and microbatch; call reset() before a
// new microbatch.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "k3/attnres/block.hpp"
#include "k3/comm/communicator.hpp"
#include "k3/core/storage.hpp"

namespace k3::attnres {

template <class Comm>
class pipeline_cache {
 public:
  explicit pipeline_cache(Comm const& comm) : comm_(comm), known_(static_cast<std::size_t>(comm.size()), 0) {}

  void reset() {
    std::fill(known_.begin(), known_.end(), 0);
    sent_.clear();
    received_.clear();
    rows_sent_ = rows_naive_ = 0;
  }

  // Bank rows sent by this rank so far, and what resending the whole bank would have cost.
  std::int64_t rows_sent() const noexcept { return rows_sent_; }
  std::int64_t rows_naive() const noexcept { return rows_naive_; }

  // Forward hop: ar has just finished its chunk (ar.site() is the receiver's first site).
  template <class S, class B>
  void send_forward(block_attn_res<S, B>& ar, int peer, int tag) {
    check_peer(peer);
    using C = k3::accumulation_t<S>;
    std::int64_t const n = ar.bank_count(), k = known_[std::size_t(peer)], T = ar.tokens();
    detail::require(k >= 0 && k <= n, error_kind::shape, [&] { return "pipeline_cache: rank " + std::to_string(peer) + " holds more rows than the sender"; });
    known_[std::size_t(peer)] = n;
    known_[std::size_t(comm_.rank())] = n;
    std::vector<std::int64_t> header = {ar.site(), n, k, T, ar.prefix_empty() ? 1 : 0};
    header.insert(header.end(), known_.begin(), known_.end());
    comm_.send(tensor_view<std::int64_t const, 1>(header.data(), {index_t(header.size())}), peer, tag);
    send_rows(ar.prefix_storage().sub(0, 0, T), peer, tag);
    if (n > k) {
      send_rows(ar.bank_storage().sub(0, k, n - k).sub(1, 0, T), peer, tag);
      auto r = ar.rinv_storage().sub(0, k, n - k).sub(1, 0, T);
      std::vector<C> rv(static_cast<std::size_t>((n - k) * T));
      for (index_t j = 0; j < n - k; ++j)
        for (index_t t = 0; t < T; ++t) rv[std::size_t(j * T + t)] = r(j, t);
      comm_.send(tensor_view<C const, 1>(rv.data(), {index_t(rv.size())}), peer, tag);
    }
    sent_.push_back({k, n, ar.site()});
    rows_sent_ += n - k;
    rows_naive_ += n;
  }

  template <class S, class B>
  void recv_forward(block_attn_res<S, B>& ar, int peer, int tag) {
    check_peer(peer);
    using C = k3::accumulation_t<S>;
    std::vector<std::int64_t> header(5 + known_.size());
    comm_.recv(tensor_view<std::int64_t, 1>(header.data(), {index_t(header.size())}), peer, tag);
    std::int64_t const site = header[0], n = header[1], k = header[2], T = header[3];
    bool const prefix_empty = header[4] != 0;
    std::string why;
    if (k != known_[std::size_t(comm_.rank())])
      why = "pipeline_cache: the sender assumes this rank holds " + std::to_string(k) + " bank rows, it holds " +
            std::to_string(known_[std::size_t(comm_.rank())]);
    else if (n > ar.bank_storage().extent(0))
      why = "pipeline_cache: " + std::to_string(n) + " bank rows exceed the bank (" + std::to_string(ar.bank_storage().extent(0)) + " rows)";
    else if (T > ar.config().tokens)
      why = "pipeline_cache: " + std::to_string(T) + " tokens exceed the driver's capacity " + std::to_string(ar.config().tokens);
    // A header from a mismatched or corrupted send: the row counts index the bank later
    // (send_forward reads rows [known, n)), so each must lie in [k, n] / [0, n].
    else if (!(T >= 0 && n >= k && site >= 0 && site <= ar.config().sublayers))
      why = "pipeline_cache: malformed forward header (site " + std::to_string(site) + ", rows " + std::to_string(k) + ".." + std::to_string(n) +
            ", tokens " + std::to_string(T) + ")";
    for (std::size_t r = 0; r < known_.size() && why.empty(); ++r)
      if (header[5 + r] < 0 || header[5 + r] > n)
        why = "pipeline_cache: malformed forward header (rank " + std::to_string(r) + " said to hold " + std::to_string(header[5 + r]) +
              " of " + std::to_string(n) + " bank rows)";
    if (!why.empty()) {
      // A well-formed header (a sender whose driver differs from this one) announces the
      // payload it has already posted (running sum; bank rows and their rinv when n > k): it
      // is consumed first, or a large send would block the sender and the next hop on this
      // pair would read these messages.
      bool wellformed = T >= 0 && k >= 0 && n >= k;
      for (std::size_t r = 0; r < known_.size(); ++r) wellformed = wellformed && header[5 + r] >= 0 && header[5 + r] <= n;
      if (wellformed) drain(n > k ? 3 : 1, peer, tag);
      throw k3::error(wellformed ? error_kind::value : error_kind::io, why);
    }
    for (std::size_t r = 0; r < known_.size(); ++r) known_[r] = header[5 + r];
    ar.resume_tokens(T);
    int taken = 0;  // messages of this hop received (or refused, which consumes them)
    try {
      ++taken;
      recv_rows(ar.prefix_storage().sub(0, 0, T), peer, tag);
      if (n > k) {
        ++taken;
        recv_rows(ar.bank_storage().sub(0, k, n - k).sub(1, 0, T), peer, tag);
        std::vector<C> rv(static_cast<std::size_t>((n - k) * T));
        ++taken;
        comm_.recv(tensor_view<C, 1>(rv.data(), {index_t(rv.size())}), peer, tag);
        auto r = ar.rinv_storage();
        for (index_t j = 0; j < n - k; ++j)
          for (index_t t = 0; t < T; ++t) r(k + j, t) = rv[std::size_t(j * T + t)];
      }
    } catch (k3::error const&) {  // e.g. the sender's width d differs: the rest of the hop is drained
      drain((n > k ? 3 : 1) - taken, peer, tag);
      throw;
    }
    received_.push_back({k, n, site});
    ar.resume(site, n, T, prefix_empty);
  }

  // Backward hop, the mirror of the latest forward hop this rank received: the gradient of
  // the running sum entering ar's chunk plus the gradients of the rows received then.
  template <class S, class B>
  void send_backward(block_attn_res<S, B>& ar, int peer, int tag) {
    check_peer(peer);
    detail::require(!received_.empty(), error_kind::value, "pipeline_cache::send_backward: no forward hop to mirror");
    auto const [k, n, site_unused] = received_.back();
    static_cast<void>(site_unused);
    received_.pop_back();
    index_t const T = ar.tokens();
    auto g = ar.grad_storage();
    comm_.send(tensor_view<k3::accumulation_t<S> const, 2>(g.data_handle(), {T, ar.config().d}), peer, tag);
    if (n > k) {
      auto db = ar.dbank_storage().sub(0, k, n - k);
      comm_.send(tensor_view<k3::accumulation_t<S> const, 3>(db.data_handle(), {n - k, T, ar.config().d}), peer, tag);
      std::fill(db.data_handle(), db.data_handle() + db.size(), k3::accumulation_t<S>(0));  // routed upstream now
    }
  }

  template <class S, class B>
  void recv_backward(block_attn_res<S, B>& ar, int peer, int tag) {
    check_peer(peer);
    using C = k3::accumulation_t<S>;
    detail::require(!sent_.empty(), error_kind::value, "pipeline_cache::recv_backward: no forward hop to mirror");
    auto [k, n, site] = sent_.back();
    sent_.pop_back();
    index_t const T = ar.tokens(), d = ar.config().d;
    auto g = ar.grad_storage();
    try {
      comm_.recv(tensor_view<C, 2>(g.data_handle(), {T, d}), peer, tag);
    } catch (k3::error const&) {
      drain(n > k ? 1 : 0, peer, tag);
      throw;
    }
    if (n > k) {
      std::vector<C> buf(static_cast<std::size_t>((n - k) * T * d));
      comm_.recv(tensor_view<C, 1>(buf.data(), {index_t(buf.size())}), peer, tag);
      auto db = ar.dbank_storage().sub(0, k, n - k);
      C* p = db.data_handle();
      for (std::size_t i = 0; i < buf.size(); ++i) p[i] += buf[i];
    }
    ar.resume_backward(site - 1);
  }

 private:
  struct hop {
    std::int64_t k, n, site;  // rows [k, n) crossed the hop; site: the receiver's first site
  };

  // Consumes `count` messages from peer on tag, whatever their size: a receive of 0 elements
  // takes each one (a count or type mismatch drains the message, which communicators do).
  void drain(int count, int peer, int tag) const {
    for (int i = 0; i < count; ++i) {
      try {
        comm_.recv(tensor_view<float, 1>(nullptr, {0}), peer, tag);
      } catch (k3::error const&) {
      }
    }
  }

  void check_peer(int peer) const {
    detail::require(peer >= 0 && peer < comm_.size() && peer != comm_.rank(), error_kind::value, [&] {
      return "pipeline_cache: peer " + std::to_string(peer) + " is not another rank of this job of " + std::to_string(comm_.size());
    });
  }

  // Storage rows travel as their bit patterns (bfloat16 as uint16), packed when the view is
  // not contiguous (fewer tokens than the bank's capacity).
  template <class V>
  void send_rows(V v, int peer, int tag) {
    using S = std::remove_const_t<typename V::element_type>;
    std::vector<S> packed;
    S const* p = v.data_handle();
    if (!v.is_contiguous()) {
      packed.resize(static_cast<std::size_t>(v.size()));
      for_rows(v, [&](index_t i, S& x) { packed[std::size_t(i)] = x; });
      p = packed.data();
    }
    if constexpr (std::is_same_v<S, bfloat16>)
      comm_.send(tensor_view<std::uint16_t const, 1>(reinterpret_cast<std::uint16_t const*>(p), {v.size()}), peer, tag);
    else
      comm_.send(tensor_view<S const, 1>(p, {v.size()}), peer, tag);
  }
  template <class V>
  void recv_rows(V v, int peer, int tag) {
    using S = std::remove_const_t<typename V::element_type>;
    std::vector<S> packed;
    S* p = v.data_handle();
    if (!v.is_contiguous()) {
      packed.resize(static_cast<std::size_t>(v.size()));
      p = packed.data();
    }
    if constexpr (std::is_same_v<S, bfloat16>)
      comm_.recv(tensor_view<std::uint16_t, 1>(reinterpret_cast<std::uint16_t*>(p), {v.size()}), peer, tag);
    else
      comm_.recv(tensor_view<S, 1>(p, {v.size()}), peer, tag);
    if (!v.is_contiguous()) for_rows(v, [&](index_t i, S& x) { x = packed[std::size_t(i)]; });
  }
  // f(flat C-order index, element) over a rank-2 or rank-3 view.
  template <class V, class F>
  static void for_rows(V v, F&& f) {
    index_t i = 0;
    if constexpr (V::rank() == 2) {
      for (index_t a = 0; a < v.extent(0); ++a)
        for (index_t b = 0; b < v.extent(1); ++b) f(i++, v(a, b));
    } else {
      for (index_t a = 0; a < v.extent(0); ++a)
        for (index_t b = 0; b < v.extent(1); ++b)
          for (index_t c = 0; c < v.extent(2); ++c) f(i++, v(a, b, c));
    }
  }

  Comm const& comm_;
  std::vector<std::int64_t> known_;  // bank rows each rank holds, as far as the hops tell
  std::vector<hop> sent_, received_;
  std::int64_t rows_sent_ = 0, rows_naive_ = 0;
};

}  // namespace k3::attnres
