// k3/optim/p2p_muon.hpp — P2P Muon (K3's memory report): NS5 over a ZeRO-sharded parameter
// set without an all-gather.
//
// Every rank holds shard r of every matrix: elements [E·r/N, E·(r+1)/N) of its row-major
// flattening (E elements, N ranks). A plan gives each matrix one owner, balancing NS5 FLOPs
// (largest first, to the least loaded rank; ties to the lower rank). An owner receives the
// other N − 1 shards of each matrix it owns point to point, runs NS5 on the whole matrix and
// sends every rank its shard of the result. A rank so receives about (N − 1)/N of the matrices
// it owns plus 1/N of the others, instead of (N − 1)/N of everything, and holds whole only the
// matrices it owns. The results equal the single-process newton_schulz bit for bit (the same
// code on the same whole matrix; NS5 does not depend on the thread count).
//
// With a communicator that has isend/irecv/wait (k3::mpi_communicator) every receive is posted
// first and every send as soon as its data is ready, so the owner's NS5 of one matrix overlaps
// the transfers of the next; other communicators get a blocking schedule in matrix order.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "k3/comm/communicator.hpp"
#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/optim/newton_schulz.hpp"

namespace k3::optim {

// One matrix of the set: [rows, cols], orthogonalised as `heads` row blocks.
struct matrix_shape {
  index_t rows = 0, cols = 0;
  index_t heads = 1;
  index_t elements() const noexcept { return rows * cols; }
};

// Elements [begin, end) of a flattened matrix that one rank holds.
struct shard_range {
  index_t begin = 0, end = 0;
  index_t size() const noexcept { return end - begin; }
};

inline shard_range shard_of(index_t elements, int rank, int ranks) noexcept {
  auto const e = static_cast<__int128>(elements);
  return {static_cast<index_t>(e * rank / ranks), static_cast<index_t>(e * (rank + 1) / ranks)};
}

struct p2p_plan {
  int ranks = 1;
  std::vector<int> owner;     // per matrix
  std::vector<double> flops;  // per rank: NS5 FLOPs of the matrices it owns
  std::vector<index_t> owned(int rank) const {
    std::vector<index_t> o;
    for (std::size_t j = 0; j < owner.size(); ++j)
      if (owner[j] == rank) o.push_back(static_cast<index_t>(j));
    return o;
  }
};

// Owners for the matrices, balanced by NS5 FLOPs (steps: Newton–Schulz steps).
inline p2p_plan make_p2p_plan(std::span<matrix_shape const> shapes, int ranks, int steps = 5) {
  ::k3::detail::require(ranks >= 1, error_kind::value, [&] { return "argument 'ranks': expected >= 1, got " + std::to_string(ranks); });
  ::k3::detail::require(steps >= 1, error_kind::value, [&] { return "argument 'steps': expected >= 1, got " + std::to_string(steps); });
  p2p_plan plan;
  plan.ranks = ranks;
  plan.owner.assign(shapes.size(), 0);
  plan.flops.assign(static_cast<std::size_t>(ranks), 0.0);
  std::vector<double> cost(shapes.size());
  for (std::size_t j = 0; j < shapes.size(); ++j) {
    matrix_shape const& s = shapes[j];
    ::k3::detail::require(s.rows >= 0 && s.cols >= 0 && s.heads >= 1 && (s.heads == 0 || s.rows % s.heads == 0), error_kind::shape, [&] {
      return "argument 'shapes[" + std::to_string(j) + "]': [" + std::to_string(s.rows) + ", " + std::to_string(s.cols) + "] with " +
             std::to_string(s.heads) + " heads (heads must be >= 1 and divide the rows)";
    });
    cost[j] = static_cast<double>(s.heads) * newton_schulz_flops(s.rows / s.heads, s.cols, steps);
  }
  std::vector<std::size_t> order(shapes.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return cost[x] > cost[y]; });
  for (std::size_t j : order) {
    int best = 0;
    for (int r = 1; r < ranks; ++r)
      if (plan.flops[static_cast<std::size_t>(r)] < plan.flops[static_cast<std::size_t>(best)]) best = r;
    plan.owner[j] = best;
    plan.flops[static_cast<std::size_t>(best)] += cost[j];
  }
  return plan;
}

// Payload bytes each rank receives under the plan (element_bytes per element), and what one
// rank receives in the all-gather P2P Muon replaces ((N − 1)/N of the whole set).
struct p2p_traffic {
  std::vector<std::int64_t> recv_bytes;  // per rank
  std::int64_t all_gather_recv_bytes = 0;
};

inline p2p_traffic p2p_traffic_of(p2p_plan const& plan, std::span<matrix_shape const> shapes, std::int64_t element_bytes) {
  p2p_traffic t;
  t.recv_bytes.assign(static_cast<std::size_t>(plan.ranks), 0);
  for (std::size_t j = 0; j < shapes.size(); ++j) {
    index_t const E = shapes[j].elements();
    for (int r = 0; r < plan.ranks; ++r) {
      index_t const mine = shard_of(E, r, plan.ranks).size();
      t.recv_bytes[static_cast<std::size_t>(r)] += element_bytes * (plan.owner[j] == r ? E - mine : mine);
      t.all_gather_recv_bytes += r == 0 ? element_bytes * (E - mine) : 0;
    }
  }
  return t;
}

// This rank's shards of the inputs and of the results, one per matrix of `shapes`.
template <class Comm, class T>
struct p2p_newton_schulz_args {
  Comm const& comm;
  p2p_plan const& plan;
  std::span<matrix_shape const> shapes;
  std::span<tensor_view<T const, 1> const> g_shards;
  std::span<tensor_view<T, 1> const> o_shards;
};

struct p2p_stats {
  std::int64_t recv_bytes = 0;  // payload bytes received from other ranks
  std::int64_t sent_bytes = 0;
};

namespace detail {

inline constexpr int p2p_shard_tag = 0x7100, p2p_result_tag = 0x7101;

// f(r, shard) for every other rank r whose shard of an E-element matrix is not empty.
template <class F>
void p2p_for_peers(index_t E, int me, int N, F&& f) {
  for (int r = 0; r < N; ++r) {
    shard_range const sh = shard_of(E, r, N);
    if (r != me && sh.size() > 0) f(r, sh);
  }
}

// Every rank must run the same plan on the same shapes: a digest all-reduced twice (the
// second time to tell every rank whether any disagreed) instead of a hang on mismatched sizes.
template <class Comm>
void p2p_agree(Comm const& comm, p2p_plan const& plan, std::span<matrix_shape const> shapes, std::int64_t element_bytes) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  mix(static_cast<std::uint64_t>(plan.ranks));
  mix(static_cast<std::uint64_t>(element_bytes));
  mix(shapes.size());
  for (std::size_t j = 0; j < shapes.size(); ++j) {
    mix(static_cast<std::uint64_t>(shapes[j].rows));
    mix(static_cast<std::uint64_t>(shapes[j].cols));
    mix(static_cast<std::uint64_t>(shapes[j].heads));
    mix(static_cast<std::uint64_t>(plan.owner[j]));
  }
  std::int64_t const mine = static_cast<std::int64_t>(h & ((std::uint64_t{1} << 40) - 1));
  std::int64_t sum[1] = {mine};
  comm.all_reduce_sum(tensor_view<std::int64_t, 1>(sum, {1}));
  std::int64_t bad[1] = {sum[0] != mine * comm.size() ? 1 : 0};
  comm.all_reduce_sum(tensor_view<std::int64_t, 1>(bad, {1}));
  ::k3::detail::require(bad[0] == 0, error_kind::value, [&] {
    return "p2p_newton_schulz: the ranks do not hold the same plan, shapes and element type (" + std::to_string(bad[0]) +
           " of " + std::to_string(comm.size()) + " ranks differ; this is rank " + std::to_string(comm.rank()) + ")";
  });
}

}  // namespace detail

// Every rank's shards of NS5 of every matrix, computed by the matrices' owners.
template <HostBackend Bk, Communicator Comm, class T>
p2p_stats p2p_newton_schulz(Bk const& b, p2p_newton_schulz_args<Comm, T> const& args, newton_schulz_options const& opt = {}) {
  using S = std::remove_const_t<T>;
  static_assert(k3::Storage<S>, "p2p_newton_schulz: storage must be float, double or k3::bfloat16");
  Comm const& comm = args.comm;
  int const me = comm.rank(), N = comm.size();
  std::size_t const n = args.shapes.size();
  ::k3::detail::require(args.plan.ranks == N && args.plan.owner.size() == n, error_kind::shape, [&] {
    return "argument 'plan': made for " + std::to_string(args.plan.ranks) + " ranks and " + std::to_string(args.plan.owner.size()) +
           " matrices, the job has " + std::to_string(N) + " ranks and " + std::to_string(n) + " matrices";
  });
  ::k3::detail::require(args.g_shards.size() == n && args.o_shards.size() == n, error_kind::shape, [&] {
    return "arguments 'g_shards', 'o_shards': expected " + std::to_string(n) + " shards each (one per matrix), got " +
           std::to_string(args.g_shards.size()) + " and " + std::to_string(args.o_shards.size());
  });
  detail::check_newton_schulz_options(opt, 0, "(the shapes' rows)");
  for (std::size_t j = 0; j < n; ++j) {
    matrix_shape const& s = args.shapes[j];
    std::string const at = "[" + std::to_string(j) + "]";
    ::k3::detail::require(s.rows >= 0 && s.cols >= 0 && s.heads >= 1 && s.rows % s.heads == 0, error_kind::shape, [&] {
      return "argument 'shapes" + at + "': [" + std::to_string(s.rows) + ", " + std::to_string(s.cols) + "] with " + std::to_string(s.heads) +
             " heads (heads must be >= 1 and divide the rows)";
    });
    ::k3::detail::require(args.plan.owner[j] >= 0 && args.plan.owner[j] < N, error_kind::value, "argument 'plan': an owner is not a rank of this job");
    index_t const want = shard_of(s.elements(), me, N).size();
    ::k3::detail::check_view("g_shards" + at, args.g_shards[j]);
    ::k3::detail::check_view("o_shards" + at, args.o_shards[j]);
    ::k3::detail::check_shape("g_shards" + at, args.g_shards[j], {want});
    ::k3::detail::check_shape("o_shards" + at, args.o_shards[j], {want});
    ::k3::detail::require(args.g_shards[j].is_contiguous() && args.o_shards[j].is_contiguous(), error_kind::shape,
                          [&] { return "arguments 'g_shards" + at + "', 'o_shards" + at + "': shards must be contiguous"; });
  }
  std::int64_t const word = static_cast<std::int64_t>(sizeof(S));
  if (N > 1) detail::p2p_agree(comm, args.plan, args.shapes, word);

  p2p_stats stats;
  newton_schulz_options ns = opt;
  // The owner's whole matrices: input gathered in place, result written over it.
  std::vector<std::vector<S>> whole(n);
  auto run_owned = [&](std::size_t j) {
    matrix_shape const& s = args.shapes[j];
    ns.heads = s.heads;
    S* p = whole[j].data();
    newton_schulz(b, newton_schulz_args<S, 2>{{p, {s.rows, s.cols}}, {p, {s.rows, s.cols}}}, ns);
    shard_range const mine = shard_of(s.elements(), me, N);
    std::copy(p + mine.begin, p + mine.end, args.o_shards[j].data_handle());
  };
  auto gather_own = [&](std::size_t j) {
    matrix_shape const& s = args.shapes[j];
    whole[j].resize(static_cast<std::size_t>(s.elements()));
    shard_range const mine = shard_of(s.elements(), me, N);
    std::copy(args.g_shards[j].data_handle(), args.g_shards[j].data_handle() + mine.size(), whole[j].data() + mine.begin);
  };

  if constexpr (NonBlockingCommunicator<Comm>) {
    using request = decltype(comm.isend(tensor_view<float const, 1>{}, 0, 0));
    std::vector<std::vector<request>> gathers(n);
    std::vector<request> pending;
    // Receives first: the shards of owned matrices and the results of the others.
    for (std::size_t j = 0; j < n; ++j) {
      index_t const E = args.shapes[j].elements();
      int const owner = args.plan.owner[j];
      if (owner == me) {
        gather_own(j);
        detail::p2p_for_peers(E, me, N, [&](int r, shard_range sh) {
          gathers[j].push_back(comm.irecv(::k3::wire_view(whole[j].data() + sh.begin, sh.size()), r, detail::p2p_shard_tag));
          stats.recv_bytes += word * sh.size();
        });
      } else if (args.o_shards[j].size() > 0) {
        pending.push_back(comm.irecv(::k3::wire_view(args.o_shards[j].data_handle(), args.o_shards[j].size()), owner, detail::p2p_result_tag));
        stats.recv_bytes += word * args.o_shards[j].size();
      }
    }
    for (std::size_t j = 0; j < n; ++j)
      if (args.plan.owner[j] != me && args.g_shards[j].size() > 0) {
        pending.push_back(comm.isend(::k3::wire_view(args.g_shards[j].data_handle(), args.g_shards[j].size()), args.plan.owner[j],
                                     detail::p2p_shard_tag));
        stats.sent_bytes += word * args.g_shards[j].size();
      }
    for (std::size_t j = 0; j < n; ++j) {
      if (args.plan.owner[j] != me) continue;
      for (auto& r : gathers[j]) comm.wait(r);
      run_owned(j);
      index_t const E = args.shapes[j].elements();
      detail::p2p_for_peers(E, me, N, [&](int r, shard_range sh) {
        pending.push_back(comm.isend(::k3::wire_view(static_cast<S const*>(whole[j].data() + sh.begin), sh.size()), r, detail::p2p_result_tag));
        stats.sent_bytes += word * sh.size();
      });
    }
    for (auto& r : pending) comm.wait(r);
  } else {
    // Blocking: matrix by matrix, the owner receives in rank order, computes, sends back.
    for (std::size_t j = 0; j < n; ++j) {
      index_t const E = args.shapes[j].elements();
      int const owner = args.plan.owner[j];
      if (owner == me) {
        gather_own(j);
        detail::p2p_for_peers(E, me, N, [&](int r, shard_range sh) {
          comm.recv(::k3::wire_view(whole[j].data() + sh.begin, sh.size()), r, detail::p2p_shard_tag);
          stats.recv_bytes += word * sh.size();
        });
        run_owned(j);
        detail::p2p_for_peers(E, me, N, [&](int r, shard_range sh) {
          comm.send(::k3::wire_view(static_cast<S const*>(whole[j].data() + sh.begin), sh.size()), r, detail::p2p_result_tag);
          stats.sent_bytes += word * sh.size();
        });
      } else if (args.g_shards[j].size() > 0) {
        comm.send(::k3::wire_view(args.g_shards[j].data_handle(), args.g_shards[j].size()), owner, detail::p2p_shard_tag);
        stats.sent_bytes += word * args.g_shards[j].size();
        comm.recv(::k3::wire_view(args.o_shards[j].data_handle(), args.o_shards[j].size()), owner, detail::p2p_result_tag);
        stats.recv_bytes += word * args.o_shards[j].size();
      }
    }
  }
  return stats;
}

}  // namespace k3::optim
