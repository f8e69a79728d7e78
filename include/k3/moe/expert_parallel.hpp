// k3/moe/expert_parallel.hpp — the Stable LatentMoE layer under MoonEP expert parallelism
// (spec C.5), forward and backward, over a non-blocking communicator (k3::mpi_communicator).
//
// R ranks, each with S tokens and the weights of E/R experts (rank r holds experts
// [r·E/R, (r+1)·E/R)); the router, W↓, the RMSNorm, W↑ and the shared experts are replicated.
// Per step every rank routes its tokens, the routed counts are summed over the job, and every
// rank computes the same MoonEP plan (moonep_rebalance): each rank processes exactly S·K
// (token, expert) pairs, at most E/R of them from experts it does not own. Dispatch sends every
// pair's z to the rank that processes it; the rank that hosts a redundant expert receives that
// expert's weights from its owner (replica weights); combine returns the outputs. The
// backward re-dispatches z with du and p (nothing dispatched is kept between the calls, only
// the processed pairs' pre-activations h_g, h_u), returns dz and dp, and reduces every replica's
// weight gradients to the owner. The non-expert weight gradients are summed over the ranks
// (all-reduce), so every rank's gradients equal those of the single-process layer over all
// R·S tokens.
//
// Every all-to-all and replica buffer has the size the plan guarantees (S·K pair rows, E/R
// replicas) and is allocated once, in moonep_buffers. Storage float or double (the
// communicator sums them); the experts run through the same per-expert code as the
// single-process layer (lm_expert_forward / lm_expert_backward).
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "k3/comm/communicator.hpp"
#include "k3/core/storage.hpp"
#include "k3/moe/latent_moe.hpp"
#include "k3/moe/placement.hpp"

namespace k3::moe {

// The buffers of the expert-parallel layer for one shape, allocated once and reused by every
// step: the dispatch/combine rows, the pre-activations of the processed pairs, the replica
// weights and their gradients, and the plan's index maps.
template <class C>
class moonep_buffers {
 public:
  moonep_buffers(int ranks, index_t tokens_per_rank, index_t k, index_t experts, index_t latent, index_t intermediate)
      : R(ranks), S(tokens_per_rank), K(k), E(experts), l(latent), f(intermediate) {
    ::k3::detail::require(R >= 1 && E >= R && E % R == 0, error_kind::shape, [&] {
      return "moonep_buffers: experts (" + std::to_string(E) + ") must be a positive multiple of ranks (" + std::to_string(R) + ")";
    });
    ::k3::detail::require(S >= 0 && K >= 1 && K <= E && l >= 1 && f >= 1, error_kind::value, "moonep_buffers: expected S >= 0, 1 <= k <= experts, l >= 1, f >= 1");
    std::size_t const pairs = static_cast<std::size_t>(S * K), all = pairs * static_cast<std::size_t>(R);
    index_t const per = E / R;
    send.resize(pairs * static_cast<std::size_t>(2 * l + 1));
    recv.resize(send.size());
    Hg.resize(static_cast<Eigen::Index>(pairs), f);
    Hu.resize(static_cast<Eigen::Index>(pairs), f);
    gidx.resize(all);
    gidx32.resize(all);
    rank_of.resize(all);
    slot_of.resize(all);
    counts.resize(static_cast<std::size_t>(E));
    pos.resize(pairs);
    row_expert.resize(pairs);
    rows.resize(pairs);
    offs.resize(static_cast<std::size_t>(E + 1));
    send_count.resize(static_cast<std::size_t>(R));
    send_off.resize(static_cast<std::size_t>(R));
    recv_count.resize(static_cast<std::size_t>(R));
    recv_off.resize(static_cast<std::size_t>(R));
    replica_w.resize(static_cast<std::size_t>(per) * 3 * static_cast<std::size_t>(f * l));
    replica_g.resize(replica_w.size());
    scratch_g.resize(3 * static_cast<std::size_t>(f * l));
    replica_expert.reserve(static_cast<std::size_t>(per));
  }

  // Bytes held; the dispatch/combine rows are 2·(2l + 1)·S·K values whatever the routing.
  std::size_t bytes() const noexcept {
    auto v = [](auto const& x) { return x.size() * sizeof(typename std::decay_t<decltype(x)>::value_type); };
    return v(send) + v(recv) + static_cast<std::size_t>(Hg.size() + Hu.size()) * sizeof(C) + v(gidx) + v(gidx32) + v(rank_of) + v(slot_of) +
           v(counts) + v(pos) + v(row_expert) + v(rows) + v(offs) + 4 * v(send_count) + v(replica_w) + v(replica_g) + v(scratch_g);
  }
  // The addresses of the buffers, to show that no step reallocates them.
  std::vector<void const*> addresses() const {
    return {send.data(), recv.data(), Hg.data(), Hu.data(), gidx.data(), rank_of.data(), slot_of.data(), replica_w.data(), replica_g.data()};
  }
  // Redundant experts hosted here in the last step, and their ids.
  std::vector<index_t> const& replicas() const noexcept { return replica_expert; }

  // k3's own (read through the members above).
  int R;
  index_t S, K, E, l, f;
  std::vector<C> send, recv;             // [S·K, width] pair rows, width up to 2l + 1
  detail::lm_matrix<C> Hg, Hu;           // [S·K, f] pre-activations of the pairs processed here, grouped by expert
  std::vector<std::int64_t> gidx;        // [R·S·K] every rank's routed experts
  std::vector<std::int32_t> gidx32;
  std::vector<std::int64_t> rank_of, slot_of, counts;
  std::vector<index_t> pos;              // [S·K] row of this rank's pair q in the send/receive layout
  std::vector<index_t> row_expert;       // [S·K] expert of each pair processed here (by slot)
  std::vector<index_t> rows, offs;       // pairs processed here grouped by expert: slots, [E + 1] offsets
  std::vector<index_t> send_count, send_off, recv_count, recv_off;
  std::vector<C> replica_w, replica_g, scratch_g;  // [E/R, 3, f·l] replica weights and gradients; one expert's gradients
  std::vector<index_t> replica_expert;
  moonep_plan plan;
};

template <class T, class Comm>
struct moonep_latent_moe_args {
  Comm const* comm = nullptr;
  moonep_buffers<k3::accumulation_t<T>>* buffers = nullptr;
  // This rank's part of the layer: x [S, d] its tokens, we_gate / we_up / we_down [E/R, ...] its
  // experts, the rest replicated; saved is required by the backward (filled by the forward).
  latent_moe_args<T> layer;
};

// The expert-parallel backward's one aggregate: the forward's args and the gradients.
template <class T, class Comm>
struct moonep_latent_moe_backward_args {
  moonep_latent_moe_args<T, Comm> forward;
  latent_moe_gradients<T> gradients;
};

namespace detail {

inline constexpr int ep_rows_tag = 0x7200, ep_back_tag = 0x7201, ep_weight_tag = 0x7202, ep_grad_tag = 0x7203;

// The rows of every pair between origins and processing ranks: this rank's pair q leaves
// from send row pos[q] (rows grouped by destination, in slot order), the pairs it processes
// arrive at their slots (grouped by origin: slots count up in global token order).
template <class C>
void ep_layout(moonep_buffers<C>& B, int me) {
  index_t const pairs = B.S * B.K;
  std::fill(B.send_count.begin(), B.send_count.end(), 0);
  std::fill(B.recv_count.begin(), B.recv_count.end(), 0);
  for (index_t q = 0; q < pairs; ++q) ++B.send_count[static_cast<std::size_t>(B.rank_of[static_cast<std::size_t>(me * pairs + q)])];
  for (int o = 0; o < B.R; ++o)
    for (index_t q = 0; q < pairs; ++q) {
      std::size_t const g = static_cast<std::size_t>(o * pairs + q);
      if (B.rank_of[g] == me) {
        ::k3::detail::require(B.slot_of[g] >= 0 && B.slot_of[g] < pairs, error_kind::value, "moonep: a slot outside S·K");
        ++B.recv_count[static_cast<std::size_t>(o)];
        B.row_expert[static_cast<std::size_t>(B.slot_of[g])] = B.gidx[g];
      }
    }
  index_t so = 0, ro = 0;
  for (int r = 0; r < B.R; ++r) {
    B.send_off[static_cast<std::size_t>(r)] = so;
    B.recv_off[static_cast<std::size_t>(r)] = ro;
    so += B.send_count[static_cast<std::size_t>(r)];
    ro += B.recv_count[static_cast<std::size_t>(r)];
  }
  // Slots count up in global token order, so each origin's pairs arrive as one block.
  for (int o = 0, seen = 0; o < B.R; ++o, seen = 0)
    for (index_t q = 0; q < pairs; ++q) {
      std::size_t const g = static_cast<std::size_t>(o * pairs + q);
      if (B.rank_of[g] == me)
        ::k3::detail::require(B.slot_of[g] == B.recv_off[static_cast<std::size_t>(o)] + seen++, error_kind::value, "moonep: an origin's slots are not one block");
    }
  ::k3::detail::require(ro == pairs, error_kind::shape, [&] { return "moonep: rank " + std::to_string(me) + " received " + std::to_string(ro) + " pairs, the plan guarantees " + std::to_string(pairs); });
  std::vector<index_t> next(B.send_off);
  for (index_t q = 0; q < pairs; ++q) {
    std::size_t const d = static_cast<std::size_t>(B.rank_of[static_cast<std::size_t>(me * pairs + q)]);
    B.pos[static_cast<std::size_t>(q)] = next[d]++;
  }
  // The pairs processed here grouped by expert, each expert's in slot order.
  std::fill(B.offs.begin(), B.offs.end(), 0);
  for (index_t s = 0; s < pairs; ++s) ++B.offs[static_cast<std::size_t>(B.row_expert[static_cast<std::size_t>(s)] + 1)];
  for (index_t e = 0; e < B.E; ++e) B.offs[static_cast<std::size_t>(e + 1)] += B.offs[static_cast<std::size_t>(e)];
  std::vector<index_t> fill(B.offs.begin(), B.offs.end() - 1);
  for (index_t s = 0; s < pairs; ++s) B.rows[static_cast<std::size_t>(fill[static_cast<std::size_t>(B.row_expert[static_cast<std::size_t>(s)])]++)] = s;
}

// The all-to-all of pair rows of `width` values: from `src` (rows grouped by destination
// with counts sc / offsets so) into `dst` (grouped by origin: rc / ro).
template <class C, class Comm>
void ep_exchange(Comm const& comm, C const* src, std::vector<index_t> const& sc, std::vector<index_t> const& so, C* dst,
                 std::vector<index_t> const& rc, std::vector<index_t> const& ro, index_t width, int tag) {
  int const me = comm.rank(), R = comm.size();
  using request = decltype(comm.isend(tensor_view<C const, 1>{}, 0, 0));
  std::vector<request> pending;
  pending.reserve(static_cast<std::size_t>(2 * R));
  for (int o = 0; o < R; ++o)
    if (o != me && rc[static_cast<std::size_t>(o)] > 0)
      pending.push_back(comm.irecv(tensor_view<C, 1>(dst + ro[static_cast<std::size_t>(o)] * width, {rc[static_cast<std::size_t>(o)] * width}), o, tag));
  for (int d = 0; d < R; ++d)
    if (d != me && sc[static_cast<std::size_t>(d)] > 0)
      pending.push_back(comm.isend(tensor_view<C const, 1>(src + so[static_cast<std::size_t>(d)] * width, {sc[static_cast<std::size_t>(d)] * width}), d, tag));
  std::copy(src + so[static_cast<std::size_t>(me)] * width, src + (so[static_cast<std::size_t>(me)] + sc[static_cast<std::size_t>(me)]) * width,
            dst + ro[static_cast<std::size_t>(me)] * width);
  for (auto& r : pending) comm.wait(r);
}

template <class C>
using ep_wmap = Eigen::Map<lm_matrix<C> const>;

// Expert e's three weight matrices on this rank: its own, or the replica received this step.
template <class C, class T>
void ep_weights(moonep_buffers<C> const& B, latent_moe_args<T> const& a, int me, index_t e, lm_cmap<C>* w, lm_matrix<C>* own) {
  index_t const per = B.E / B.R;
  if (e / per == me) {
    // (a Map is re-seated by placement new: its operator= would copy values)
    new (&w[0]) lm_cmap<C>(lm_map(a.we_gate.slice(0, e - me * per), own[0]));
    new (&w[1]) lm_cmap<C>(lm_map(a.we_up.slice(0, e - me * per), own[1]));
    new (&w[2]) lm_cmap<C>(lm_map(a.we_down.slice(0, e - me * per), own[2]));
    return;
  }
  auto const it = std::find(B.replica_expert.begin(), B.replica_expert.end(), e);
  C const* base = B.replica_w.data() + static_cast<std::size_t>(it - B.replica_expert.begin()) * 3 * static_cast<std::size_t>(B.f * B.l);
  std::size_t const fl = static_cast<std::size_t>(B.f * B.l);
  new (&w[0]) lm_cmap<C>(base, B.f, B.l, Eigen::OuterStride<>(B.l));
  new (&w[1]) lm_cmap<C>(base + fl, B.f, B.l, Eigen::OuterStride<>(B.l));
  new (&w[2]) lm_cmap<C>(base + 2 * fl, B.l, B.f, Eigen::OuterStride<>(B.f));
}

// Routing is global: every rank's experts gathered, the plan, the dispatch maps and this
// rank's layout; the replica weights are posted (owners send, hosts receive).
template <class C, class Comm, class T>
void ep_plan(Comm const& comm, moonep_buffers<C>& B, lm_state<C> const& st, latent_moe_args<T> const& a) {
  int const me = comm.rank();
  index_t const pairs = B.S * B.K, per = B.E / B.R;
  comm.all_gather(tensor_view<std::int64_t const, 1>(st.idx.data(), {pairs}), tensor_view<std::int64_t, 1>(B.gidx.data(), {pairs * B.R}));
  std::fill(B.counts.begin(), B.counts.end(), 0);
  for (std::size_t g = 0; g < B.gidx.size(); ++g) {
    ++B.counts[static_cast<std::size_t>(B.gidx[g])];
    B.gidx32[g] = static_cast<std::int32_t>(B.gidx[g]);
  }
  B.plan = moonep_rebalance(const_view<std::int64_t, 1>(B.counts.data(), {B.E}), B.R);
  moonep_dispatch(const_view<std::int32_t, 2>(B.gidx32.data(), {B.R * B.S, B.K}), B.plan, tensor_view<std::int64_t, 2>(B.rank_of.data(), {B.R * B.S, B.K}),
                  tensor_view<std::int64_t, 2>(B.slot_of.data(), {B.R * B.S, B.K}));
  ep_layout(B, me);
  // Replica weights: every part placed away from its expert's home.
  B.replica_expert.clear();
  using request = decltype(comm.isend(tensor_view<C const, 1>{}, 0, 0));
  std::vector<request> pending;
  std::size_t const fl = static_cast<std::size_t>(B.f * B.l);
  for (auto const& part : B.plan.parts) {
    index_t const home = part.expert / per;
    if (part.rank == home || part.count == 0) continue;
    if (part.rank == me) {
      C* dst = B.replica_w.data() + B.replica_expert.size() * 3 * fl;
      B.replica_expert.push_back(part.expert);
      for (int w = 0; w < 3; ++w)
        pending.push_back(comm.irecv(tensor_view<C, 1>(dst + static_cast<std::size_t>(w) * fl, {static_cast<index_t>(fl)}), static_cast<int>(home), ep_weight_tag + w));
    } else if (home == me) {
      index_t const el = part.expert - me * per;
      pending.push_back(comm.isend(tensor_view<C const, 1>(&a.we_gate(el, 0, 0), {static_cast<index_t>(fl)}), static_cast<int>(part.rank), ep_weight_tag));
      pending.push_back(comm.isend(tensor_view<C const, 1>(&a.we_up(el, 0, 0), {static_cast<index_t>(fl)}), static_cast<int>(part.rank), ep_weight_tag + 1));
      pending.push_back(comm.isend(tensor_view<C const, 1>(&a.we_down(el, 0, 0), {static_cast<index_t>(fl)}), static_cast<int>(part.rank), ep_weight_tag + 2));
    }
  }
  for (auto& r : pending) comm.wait(r);
}

// The experts of the forward: dispatch z, every processed expert on its pairs, combine.
template <class C, HostBackend Bk, class Comm, class T>
void ep_experts_forward(Bk const& b, Comm const& comm, moonep_buffers<C>& B, latent_moe_args<T> const& a, lm_state<C>& st, lm_matrix<C>& O) {
  int const me = comm.rank();
  index_t const pairs = B.S * B.K, l = B.l, K = B.K;
  situ_params<C> const sp{static_cast<C>(st.o.beta_gate), static_cast<C>(st.o.beta_up)};
  ep_plan(comm, B, st, a);
  for (index_t q = 0; q < pairs; ++q)
    std::copy(st.Z.row(q / K).data(), st.Z.row(q / K).data() + l, B.send.data() + B.pos[static_cast<std::size_t>(q)] * l);
  ep_exchange(comm, B.send.data(), B.send_count, B.send_off, B.recv.data(), B.recv_count, B.recv_off, l, ep_rows_tag);
  // The outputs go to the processing side's slots of the send buffer (free after the dispatch).
  b.for_each(0, B.E, [&](std::int64_t e) {
    index_t const r0 = B.offs[static_cast<std::size_t>(e)], ne = B.offs[static_cast<std::size_t>(e + 1)] - r0;
    if (ne == 0) return;
    lm_matrix<C> Ze(ne, l);
    for (index_t i = 0; i < ne; ++i)
      Ze.row(i) = Eigen::Map<lm_matrix<C> const>(B.recv.data() + B.rows[static_cast<std::size_t>(r0 + i)] * l, 1, l);
    lm_matrix<C> own[3];
    lm_cmap<C> w[3] = {lm_cmap<C>(nullptr, 0, 0, Eigen::OuterStride<>(1)), lm_cmap<C>(nullptr, 0, 0, Eigen::OuterStride<>(1)),
                       lm_cmap<C>(nullptr, 0, 0, Eigen::OuterStride<>(1))};
    ep_weights(B, a, me, static_cast<index_t>(e), w, own);
    lm_matrix<C> Oe;
    lm_expert_forward<C>(Ze, w[0], w[1], w[2], sp, B.Hg.middleRows(r0, ne), B.Hu.middleRows(r0, ne), Oe);
    for (index_t i = 0; i < ne; ++i)
      Eigen::Map<lm_matrix<C>>(B.send.data() + B.rows[static_cast<std::size_t>(r0 + i)] * l, 1, l) = Oe.row(i);
  });
  ep_exchange(comm, B.send.data(), B.recv_count, B.recv_off, B.recv.data(), B.send_count, B.send_off, l, ep_rows_tag);
  for (index_t q = 0; q < pairs; ++q) O.row(q) = Eigen::Map<lm_matrix<C> const>(B.recv.data() + B.pos[static_cast<std::size_t>(q)] * l, 1, l);
}

// The experts of the backward: re-dispatch [z | du | p], every processed expert's backward,
// replica gradients to the owners, combine [dz | dp].
template <class C, HostBackend Bk, class Comm, class T>
void ep_experts_backward(Bk const& b, Comm const& comm, moonep_buffers<C>& B, latent_moe_args<T> const& a, latent_moe_gradients<T> const& grad,
                         lm_state<C> const& st, lm_matrix<C> const& DU, lm_matrix<C>& DZslot, std::vector<C>& dp) {
  int const me = comm.rank();
  index_t const pairs = B.S * B.K, l = B.l, K = B.K, W = 2 * l + 1, per = B.E / B.R;
  std::size_t const fl = static_cast<std::size_t>(B.f * B.l);
  situ_params<C> const sp{static_cast<C>(st.o.beta_gate), static_cast<C>(st.o.beta_up)};
  for (index_t q = 0; q < pairs; ++q) {
    C* row = B.send.data() + B.pos[static_cast<std::size_t>(q)] * W;
    std::copy(st.Z.row(q / K).data(), st.Z.row(q / K).data() + l, row);
    std::copy(DU.row(q / K).data(), DU.row(q / K).data() + l, row + l);
    row[2 * l] = st.p[static_cast<std::size_t>(q)];
  }
  ep_exchange(comm, B.send.data(), B.send_count, B.send_off, B.recv.data(), B.recv_count, B.recv_off, W, ep_back_tag);
  bool const want = k3::present(grad.dwe_gate) || k3::present(grad.dwe_up) || k3::present(grad.dwe_down);
  using V2 = decltype(grad.dwe_gate.slice(0, 0));
  b.for_each(0, B.E, [&](std::int64_t e64) {
    index_t const e = static_cast<index_t>(e64);
    index_t const r0 = B.offs[static_cast<std::size_t>(e)], ne = B.offs[static_cast<std::size_t>(e + 1)] - r0;
    bool const mine = e / per == me;
    if (ne == 0 && !mine) return;
    lm_matrix<C> Ze(ne, l), DUe(ne, l);
    std::vector<C> pe(static_cast<std::size_t>(ne)), dpe(static_cast<std::size_t>(ne));
    for (index_t i = 0; i < ne; ++i) {
      C const* row = B.recv.data() + B.rows[static_cast<std::size_t>(r0 + i)] * W;
      Ze.row(i) = Eigen::Map<lm_matrix<C> const>(row, 1, l);
      DUe.row(i) = Eigen::Map<lm_matrix<C> const>(row + l, 1, l);
      pe[static_cast<std::size_t>(i)] = row[2 * l];
    }
    lm_matrix<C> own[3];
    lm_cmap<C> w[3] = {lm_cmap<C>(nullptr, 0, 0, Eigen::OuterStride<>(1)), lm_cmap<C>(nullptr, 0, 0, Eigen::OuterStride<>(1)),
                       lm_cmap<C>(nullptr, 0, 0, Eigen::OuterStride<>(1))};
    if (ne > 0) ep_weights(B, a, me, e, w, own);
    lm_matrix<C> DZe;
    V2 g[3] = {};
    if (want) {
      if (mine) {
        index_t const el = e - me * per;
        if (k3::present(grad.dwe_gate)) g[0] = grad.dwe_gate.slice(0, el);
        if (k3::present(grad.dwe_up)) g[1] = grad.dwe_up.slice(0, el);
        if (k3::present(grad.dwe_down)) g[2] = grad.dwe_down.slice(0, el);
      } else {
        auto const it = std::find(B.replica_expert.begin(), B.replica_expert.end(), e);
        C* base = B.replica_g.data() + static_cast<std::size_t>(it - B.replica_expert.begin()) * 3 * fl;
        g[0] = V2(base, {B.f, B.l});
        g[1] = V2(base + fl, {B.f, B.l});
        g[2] = V2(base + 2 * fl, {B.l, B.f});
      }
    }
    if (ne == 0) {  // an owned expert no pair of this rank reached: its partial gradients are 0
      for (auto const& gv : g)
        if (k3::present(gv))
          for (index_t i = 0; i < gv.extent(0); ++i)
            for (index_t j = 0; j < gv.extent(1); ++j) gv(i, j) = T(0);
      return;
    }
    lm_expert_backward<C>(Ze, DUe, pe.data(), B.Hg.middleRows(r0, ne), B.Hu.middleRows(r0, ne), w[0], w[1], w[2], sp, dpe.data(), DZe, g[0],
                          g[1], g[2]);
    for (index_t i = 0; i < ne; ++i) {
      C* row = B.send.data() + B.rows[static_cast<std::size_t>(r0 + i)] * (l + 1);
      Eigen::Map<lm_matrix<C>>(row, 1, l) = DZe.row(i);
      row[l] = dpe[static_cast<std::size_t>(i)];
    }
  });
  // Replica gradients to the owners, added there in plan order.
  if (want) {
    using request = decltype(comm.isend(tensor_view<C const, 1>{}, 0, 0));
    std::vector<request> pending;
    for (std::size_t i = 0; i < B.replica_expert.size(); ++i)
      pending.push_back(comm.isend(tensor_view<C const, 1>(B.replica_g.data() + i * 3 * fl, {static_cast<index_t>(3 * fl)}),
                                   static_cast<int>(B.replica_expert[i] / per), ep_grad_tag));
    for (auto const& part : B.plan.parts) {
      index_t const home = part.expert / per;
      if (home != me || part.rank == home || part.count == 0) continue;
      // (irecv + wait: a blocking recv expects the header of a blocking send)
      auto r = comm.irecv(tensor_view<C, 1>(B.scratch_g.data(), {static_cast<index_t>(3 * fl)}), static_cast<int>(part.rank), ep_grad_tag);
      comm.wait(r);
      index_t const el = part.expert - me * per;
      V2 const g[3] = {k3::present(grad.dwe_gate) ? grad.dwe_gate.slice(0, el) : V2{}, k3::present(grad.dwe_up) ? grad.dwe_up.slice(0, el) : V2{},
                       k3::present(grad.dwe_down) ? grad.dwe_down.slice(0, el) : V2{}};
      for (int w = 0; w < 3; ++w) {
        if (!k3::present(g[w])) continue;
        C const* src = B.scratch_g.data() + static_cast<std::size_t>(w) * fl;
        for (index_t i = 0; i < g[w].extent(0); ++i)
          for (index_t j = 0; j < g[w].extent(1); ++j) g[w](i, j) = static_cast<T>(g[w](i, j) + src[i * g[w].extent(1) + j]);
      }
    }
    for (auto& r : pending) comm.wait(r);
  }
  ep_exchange(comm, B.send.data(), B.recv_count, B.recv_off, B.recv.data(), B.send_count, B.send_off, l + 1, ep_back_tag);
  for (index_t q = 0; q < pairs; ++q) {
    C const* row = B.recv.data() + B.pos[static_cast<std::size_t>(q)] * (l + 1);
    DZslot.row(q) = Eigen::Map<lm_matrix<C> const>(row, 1, l);
    dp[static_cast<std::size_t>(q)] = row[l];
  }
}

template <class T, class Comm>
lm_dims ep_check(moonep_latent_moe_args<T, Comm> const& a, latent_moe_options const& o, lm_dims const& m) {
  auto const& B = *a.buffers;
  ::k3::detail::require(B.R == a.comm->size(), error_kind::shape, [&] {
    return "argument 'buffers': made for " + std::to_string(B.R) + " ranks, the communicator has " + std::to_string(a.comm->size());
  });
  ::k3::detail::require(B.S == m.T && B.K == o.k && B.E == m.n && B.l == m.l && B.f == m.f, error_kind::value, [&] {
    return "argument 'buffers': made for S = " + std::to_string(B.S) + ", k = " + std::to_string(B.K) + ", experts = " + std::to_string(B.E) +
           ", l = " + std::to_string(B.l) + ", f = " + std::to_string(B.f) + "; the layer has S = " + std::to_string(m.T) + ", k = " +
           std::to_string(o.k) + ", experts = " + std::to_string(m.n) + ", l = " + std::to_string(m.l) + ", f = " + std::to_string(m.f);
  });
  for (auto const* v : {&a.layer.we_gate, &a.layer.we_up, &a.layer.we_down})
    ::k3::detail::require(v->is_contiguous(), error_kind::shape, "arguments 'we_gate', 'we_up', 'we_down': expert-parallel weights must be contiguous (they travel as replicas)");
  return m;
}

// Runs the checks on every rank and throws on all of them if one rank's fail (a rank that
// threw alone would leave the others waiting in the next collective).
template <class Comm, class F>
void ep_agree(Comm const& comm, F&& checks) {
  std::string err;
  try {
    checks();
  } catch (k3::error const& e) {
    err = e.what();
  }
  std::int64_t bad = err.empty() ? 0 : 1;
  comm.all_reduce_sum(tensor_view<std::int64_t, 1>(&bad, {1}));
  if (bad) throw k3::error(error_kind::value, err.empty() ? "moonep_latent_moe: another rank's arguments were rejected" : err);
}

}  // namespace detail

// The forward on this rank's tokens: y, indices, weights of its S tokens (whichever are given),
// and layer.saved filled for the backward. Collective: every rank calls it.
template <HostBackend Bk, class T, NonBlockingCommunicator Comm>
void moonep_latent_moe_forward(Bk const& b, moonep_latent_moe_args<T, Comm> const& a, latent_moe_options const& o = {}) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "moonep_latent_moe: storage must be float or double");
  using C = k3::accumulation_t<T>;
  ::k3::detail::require(a.comm != nullptr && a.buffers != nullptr, error_kind::value, "arguments 'comm', 'buffers': required");
  ::k3::detail::require(a.comm->size() >= 1 && a.layer.w_router.extent(0) % a.comm->size() == 0, error_kind::shape, [&] {
    return "argument 'w_router': experts (" + std::to_string(a.layer.w_router.extent(0)) + ") must be a multiple of ranks (" +
           std::to_string(a.comm->size()) + ")";
  });
  detail::lm_dims m{};
  detail::ep_agree(*a.comm, [&] {
    m = detail::check_latent_moe(b, a.layer, o, a.layer.w_router.extent(0) / a.comm->size());
    detail::ep_check(a, o, m);
  });
  detail::lm_state<C> local;
  detail::lm_state<C>& st = a.layer.saved ? a.layer.saved->state : local;
  detail::lm_forward<C>(b, a.layer, o, m, st, [&](auto& s, auto& O) { detail::ep_experts_forward(b, *a.comm, *a.buffers, a.layer, s, O); });
}

// The backward from the forward's saved state (layer.saved, filled by moonep_latent_moe_forward
// of this step, with the same buffers): dx of this rank's tokens, the gradients of its experts
// (with every replica's reduced in), and the non-expert weight gradients summed over the ranks.
template <HostBackend Bk, class T, NonBlockingCommunicator Comm>
void moonep_latent_moe_backward(Bk const& b, moonep_latent_moe_backward_args<T, Comm> const& args, latent_moe_options const& o = {}) {
  auto const& a = args.forward;
  auto const& g = args.gradients;
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "moonep_latent_moe: storage must be float or double");
  using C = k3::accumulation_t<T>;
  ::k3::detail::require(a.comm != nullptr && a.buffers != nullptr, error_kind::value, "arguments 'comm', 'buffers': required");
  detail::lm_dims m{};
  detail::ep_agree(*a.comm, [&] {
    ::k3::detail::require(a.layer.saved != nullptr && a.layer.saved->filled(), error_kind::value,
                          "argument 'saved': the expert-parallel backward needs the state its forward saved");
    latent_moe_args<T> checked = a.layer;
    checked.y = {};
    checked.indices = {};
    checked.weights = {};
    m = detail::check_latent_moe(b, checked, o, a.layer.w_router.extent(0) / a.comm->size(), false);
    detail::ep_check(a, o, m);
    ::k3::detail::check_view("dy", g.dy);
    ::k3::detail::check_shape("dy", g.dy, {m.T, m.d});
    detail::lm_check_finite(b, "dy", g.dy);
    index_t const held = m.n / a.comm->size();
    detail::lm_check_out("dx", g.dx, {m.T, m.d});
    detail::lm_check_out("dw_router", g.dw_router, {m.n, m.d});
    detail::lm_check_out("dw_down", g.dw_down, {m.l, m.d});
    detail::lm_check_out("dwe_gate", g.dwe_gate, {held, m.f, m.l});
    detail::lm_check_out("dwe_up", g.dwe_up, {held, m.f, m.l});
    detail::lm_check_out("dwe_down", g.dwe_down, {held, m.l, m.f});
    detail::lm_check_out("dnorm_weight", g.dnorm_weight, {m.l});
    detail::lm_check_out("dw_up", g.dw_up, {m.d, m.l});
    detail::lm_check_out("dws_gate", g.dws_gate, {m.s, m.F, m.d});
    detail::lm_check_out("dws_up", g.dws_up, {m.s, m.F, m.d});
    detail::lm_check_out("dws_down", g.dws_down, {m.s, m.d, m.F});
    detail::lm_dims const& sm = a.layer.saved->state.m;
    ::k3::detail::require(sm.T == m.T && sm.d == m.d && sm.n == m.n && sm.l == m.l && sm.f == m.f && sm.s == m.s && sm.F == m.F &&
                              detail::lm_same_options<C>(a.layer.saved->state.o, o), error_kind::shape,
                          "argument 'saved': filled by a forward with other shapes or options");
  });
  detail::lm_state<C> const& st = a.layer.saved->state;
  detail::lm_backward<C>(b, a.layer, g, st, [&](auto const& s, auto const& DU, auto& DZslot, auto& dp) {
    detail::ep_experts_backward(b, *a.comm, *a.buffers, a.layer, g, s, DU, DZslot, dp);
  });
  // The replicated weights' gradients: this rank's tokens' part, summed over the job.
  auto reduce = [&](auto const& v) {
    if (k3::present(v)) a.comm->all_reduce_sum(v);
  };
  reduce(g.dw_router);
  reduce(g.dw_down);
  reduce(g.dnorm_weight);
  reduce(g.dw_up);
  reduce(g.dws_gate);
  reduce(g.dws_up);
  reduce(g.dws_down);
}

}  // namespace k3::moe
