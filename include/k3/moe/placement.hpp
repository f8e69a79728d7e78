// k3/moe/placement.hpp — where experts live in expert parallelism.
//
// EPLB (DeepSeek): a periodic, statistics-driven placement with redundant experts. Replicate
// the heaviest expert (by load per replica) until every physical slot is used, then pack the
// replicas onto GPUs with balanced greedy packing; hierarchical when groups divide evenly
// over nodes (groups packed onto nodes first, so group-limited routing stays node-local).
// Tie-breaking is pinned (stable descending sort; first index on max/min) so the published
// example is reproduced exactly.
//
// MoonEP (Kimi K3): an online plan per micro-batch and layer from the router output so that
// every EP rank processes exactly S*K (token, expert) pairs, with at most E/R redundant
// (non-local) experts per rank: an underloaded rank u is filled to exactly S*K from the local
// experts of one overloaded rank, largest remaining expert first, and is then final.
#pragma once
#include <algorithm>
#include <concepts>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"

namespace k3::moe {

// ---------------------------------------------------------------------------------- EPLB

struct eplb_plan {
  index_t layers = 0, experts = 0, physical = 0, max_replicas = 0;
  std::vector<std::int64_t> phy2log;  // [layers][physical]  logical expert held by each slot
  std::vector<std::int64_t> phyrank;  // [layers][physical]  replica number of that expert
  std::vector<std::int64_t> logcnt;   // [layers][experts]   replicas per logical expert
  std::vector<std::int64_t> log2phy;  // [layers][experts][max_replicas], -1 padded
};

namespace detail {

// Each of `packs` packs receives exactly N / packs items; items by weight descending (stable),
// each into the lightest pack that still has room (lowest index on ties).
inline void balanced_packing(std::vector<double> const& w, index_t packs, std::vector<index_t>& pack, std::vector<index_t>& rank) {
  index_t const N = static_cast<index_t>(w.size()), per = N / packs;
  pack.assign(static_cast<std::size_t>(N), 0);
  rank.assign(static_cast<std::size_t>(N), 0);
  if (per == 1) {
    for (index_t i = 0; i < N; ++i) pack[i] = i, rank[i] = 0;
    return;
  }
  std::vector<index_t> order(static_cast<std::size_t>(N));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](index_t a, index_t b) { return w[a] > w[b]; });
  std::vector<double> pw(static_cast<std::size_t>(packs), 0.0);
  std::vector<index_t> items(static_cast<std::size_t>(packs), 0);
  for (index_t i : order) {
    index_t best = -1;
    for (index_t p = 0; p < packs; ++p)
      if (items[p] < per && (best < 0 || pw[p] < pw[best])) best = p;
    pack[i] = best;
    rank[i] = items[best]++;
    pw[best] += w[i];
  }
}

// Replicates E logical experts into P slots: slots [0, E) hold each expert once, then each
// extra slot goes to argmax w / cnt (lowest index on ties).
inline void replicate_experts(std::vector<double> const& w, index_t P, std::vector<index_t>& phy2log, std::vector<index_t>& rank,
                              std::vector<index_t>& cnt) {
  index_t const E = static_cast<index_t>(w.size());
  phy2log.resize(static_cast<std::size_t>(P));
  rank.assign(static_cast<std::size_t>(P), 0);
  cnt.assign(static_cast<std::size_t>(E), 1);
  for (index_t i = 0; i < E; ++i) phy2log[i] = i;
  for (index_t i = E; i < P; ++i) {
    index_t best = 0;
    for (index_t e = 1; e < E; ++e)
      if (w[e] / double(cnt[e]) > w[best] / double(cnt[best])) best = e;
    phy2log[i] = best;
    rank[i] = cnt[best]++;
  }
}

}  // namespace detail

// The statistics EPLB plans from and the plan it writes.
template <class T>
struct eplb_args {
  const_view<T, 2> load;          // [layers, experts], e.g. a moving average of tokens per expert
  eplb_plan* placement = nullptr;  // required; overwritten
};

struct eplb_options {
  index_t physical = 0;  // slots in all, >= experts and a multiple of gpus
  index_t groups = 1, nodes = 1, gpus = 1;
};

// Plans options.physical slots for args.load. Hierarchical if groups % nodes == 0, else global
// (groups = nodes = 1). A reference on every host backend.
template <HostBackend B, class T>
  requires std::same_as<T, double>
void eplb(B const&, eplb_args<T> const& a, eplb_options const& o) {
  ::k3::detail::require(a.placement != nullptr, error_kind::value, "eplb: argument 'placement': missing (null)");
  auto const load = a.load;
  index_t const physical = o.physical, gpus = o.gpus;
  index_t groups = o.groups, nodes = o.nodes;
  using ::k3::detail::require;
  index_t const L = load.extent(0), E = load.extent(1);
  ::k3::detail::check_view("load", load);
  require(L >= 1 && E >= 1, error_kind::shape, [&] { return "argument 'load': expected shape [layers >= 1, experts >= 1], got " + ::k3::detail::shape_of(load); });
  // The packing sorts by load: a NaN breaks the ordering the sort relies on, and a negative
  // or infinite load has no meaning as a token count.
  for (index_t l = 0; l < L; ++l)
    for (index_t e = 0; e < E; ++e)
      require(std::isfinite(load(l, e)) && load(l, e) >= 0, error_kind::value, [&] {
        return "argument 'load': expected finite values >= 0, got " + std::to_string(load(l, e)) + " at layer " + std::to_string(l) +
               ", expert " + std::to_string(e);
      });
  require(groups >= 1 && nodes >= 1 && gpus >= 1, error_kind::value, [&] {
    return "eplb: options 'groups', 'nodes' and 'gpus' must be >= 1, got groups = " + std::to_string(groups) + ", nodes = " +
           std::to_string(nodes) + ", gpus = " + std::to_string(gpus);
  });
  require(physical >= E && physical % gpus == 0, error_kind::shape, [&] {
    return "eplb: option 'physical': need physical >= experts (" + std::to_string(E) + ") and a multiple of gpus (" + std::to_string(gpus) +
           "), got " + std::to_string(physical);
  });
  require(gpus % nodes == 0, error_kind::shape, [&] {
    return "eplb: option 'gpus' (" + std::to_string(gpus) + ") must be a multiple of option 'nodes' (" + std::to_string(nodes) + ")";
  });
  if (groups % nodes != 0) groups = nodes = 1;
  require(E % groups == 0, error_kind::shape, [&] { return "eplb: experts (" + std::to_string(E) + ") must be a multiple of groups (" + std::to_string(groups) + ")"; });
  require(physical % nodes == 0 && physical / nodes >= E / nodes, error_kind::shape, [&] {
    return "eplb: option 'physical' (" + std::to_string(physical) + ") must be a multiple of nodes (" + std::to_string(nodes) +
           ") with at least experts / nodes (" + std::to_string(E / nodes) + ") slots per node";
  });
  index_t const gsize = E / groups, gpn = groups / nodes, epn = E / nodes, ppn = physical / nodes, gpu_per_node = gpus / nodes,
                per_gpu = physical / gpus;
  eplb_plan& plan = *a.placement;
  plan = eplb_plan{};
  plan.layers = L;
  plan.experts = E;
  plan.physical = physical;
  plan.phy2log.resize(static_cast<std::size_t>(L * physical));
  plan.phyrank.resize(static_cast<std::size_t>(L * physical));
  plan.logcnt.resize(static_cast<std::size_t>(L * E));
  for (index_t l = 0; l < L; ++l) {
    // 1. groups onto nodes
    std::vector<double> gw(static_cast<std::size_t>(groups), 0.0);
    for (index_t e = 0; e < E; ++e) gw[e / gsize] += load(l, e);
    std::vector<index_t> gpack, grank;
    detail::balanced_packing(gw, nodes, gpack, grank);
    // node-major ("mlog") numbering of logical experts
    std::vector<index_t> log2mlog(static_cast<std::size_t>(E)), mlog2log(static_cast<std::size_t>(E));
    for (index_t e = 0; e < E; ++e) {
      index_t g = e / gsize;
      log2mlog[e] = (gpack[g] * gpn + grank[g]) * gsize + e % gsize;
    }
    for (index_t e = 0; e < E; ++e) mlog2log[log2mlog[e]] = e;
    for (index_t nd = 0; nd < nodes; ++nd) {
      // 2. replicate inside the node
      std::vector<double> w(static_cast<std::size_t>(epn));
      for (index_t x = 0; x < epn; ++x) w[x] = load(l, mlog2log[nd * epn + x]);
      std::vector<index_t> phy2mlog, phyrank, mcnt;
      detail::replicate_experts(w, ppn, phy2mlog, phyrank, mcnt);
      // 3. pack the node's replicas onto its GPUs
      std::vector<double> pw(static_cast<std::size_t>(ppn));
      for (index_t x = 0; x < ppn; ++x) pw[x] = w[phy2mlog[x]] / double(mcnt[phy2mlog[x]]);
      std::vector<index_t> pack, rank;
      detail::balanced_packing(pw, gpu_per_node, pack, rank);
      for (index_t x = 0; x < ppn; ++x) {
        index_t slot = nd * ppn + pack[x] * per_gpu + rank[x];
        plan.phy2log[l * physical + slot] = mlog2log[nd * epn + phy2mlog[x]];
        plan.phyrank[l * physical + slot] = phyrank[x];
      }
      for (index_t x = 0; x < epn; ++x) plan.logcnt[l * E + mlog2log[nd * epn + x]] = mcnt[x];
    }
  }
  plan.max_replicas = *std::max_element(plan.logcnt.begin(), plan.logcnt.end());
  plan.log2phy.assign(static_cast<std::size_t>(L * E * plan.max_replicas), -1);
  for (index_t l = 0; l < L; ++l)
    for (index_t s = 0; s < physical; ++s)
      plan.log2phy[(l * E + plan.phy2log[l * physical + s]) * plan.max_replicas + plan.phyrank[l * physical + s]] = s;
}

// Structural check of an EPLB plan: every expert placed logcnt times with replica numbers
// 0..logcnt-1, log2phy the inverse of phy2log (and -1 beyond logcnt). Returns an empty string
// when consistent. A malformed plan (sizes that do not match its header, ids out of range) is
// reported, never read out of bounds.
inline std::string check_eplb(eplb_plan const& p) {
  auto const sz = [](auto const& v) { return static_cast<index_t>(v.size()); };
  if (p.layers < 0 || p.experts < 1 || p.physical < p.experts || p.max_replicas < 1)
    return "header: need layers >= 0, experts >= 1, physical >= experts, max_replicas >= 1 (got layers " + std::to_string(p.layers) +
           ", experts " + std::to_string(p.experts) + ", physical " + std::to_string(p.physical) + ", max_replicas " +
           std::to_string(p.max_replicas) + ")";
  if (sz(p.phy2log) != p.layers * p.physical || sz(p.phyrank) != p.layers * p.physical || sz(p.logcnt) != p.layers * p.experts ||
      sz(p.log2phy) != p.layers * p.experts * p.max_replicas)
    return "sizes: expected phy2log and phyrank of " + std::to_string(p.layers * p.physical) + ", logcnt of " +
           std::to_string(p.layers * p.experts) + ", log2phy of " + std::to_string(p.layers * p.experts * p.max_replicas) +
           " entries, got " + std::to_string(p.phy2log.size()) + ", " + std::to_string(p.phyrank.size()) + ", " +
           std::to_string(p.logcnt.size()) + ", " + std::to_string(p.log2phy.size());
  for (index_t l = 0; l < p.layers; ++l) {
    for (index_t e = 0; e < p.experts; ++e) {
      auto c = p.logcnt[l * p.experts + e];
      if (c < 1 || c > p.max_replicas)
        return "layer " + std::to_string(l) + ": expert " + std::to_string(e) + " has logcnt " + std::to_string(c) + ", outside [1, " +
               std::to_string(p.max_replicas) + "]";
    }
    std::vector<index_t> seen(static_cast<std::size_t>(p.experts), 0);
    for (index_t s = 0; s < p.physical; ++s) {
      auto e = p.phy2log[l * p.physical + s];
      if (e < 0 || e >= p.experts) return "layer " + std::to_string(l) + ": slot " + std::to_string(s) + " holds no valid expert";
      auto r = p.phyrank[l * p.physical + s];
      if (r < 0 || r >= p.logcnt[l * p.experts + e])
        return "layer " + std::to_string(l) + ": slot " + std::to_string(s) + " is replica " + std::to_string(r) + " of expert " +
               std::to_string(e) + ", which has " + std::to_string(p.logcnt[l * p.experts + e]) + " replicas";
      ++seen[e];
      if (p.log2phy[(l * p.experts + e) * p.max_replicas + r] != s)
        return "layer " + std::to_string(l) + ": log2phy is not the inverse of phy2log at slot " + std::to_string(s);
    }
    for (index_t e = 0; e < p.experts; ++e) {
      if (seen[e] != p.logcnt[l * p.experts + e])
        return "layer " + std::to_string(l) + ": expert " + std::to_string(e) + " placed " + std::to_string(seen[e]) + " times, logcnt " +
               std::to_string(p.logcnt[l * p.experts + e]);
      for (index_t r = p.logcnt[l * p.experts + e]; r < p.max_replicas; ++r)
        if (p.log2phy[(l * p.experts + e) * p.max_replicas + r] != -1)
          return "layer " + std::to_string(l) + ": log2phy of expert " + std::to_string(e) + " replica " + std::to_string(r) +
                 " (beyond logcnt) is not -1";
    }
  }
  return {};
}

// -------------------------------------------------------------------------------- MoonEP

struct moonep_assignment {
  index_t expert, rank, count;  // `count` pairs of `expert` processed on `rank`
};

struct moonep_plan {
  index_t experts = 0, ranks = 0, pairs_per_rank = 0;  // pairs_per_rank = S*K
  std::vector<moonep_assignment> parts;                 // home parts first (expert order), then fills
  index_t home(index_t e) const noexcept { return e / (experts / ranks); }
};

// `counts` [E]: (token, expert) pairs routed to each expert in this micro-batch (sum = R*S*K).
// Expert e lives on rank e / (E/R).
inline moonep_plan moonep_rebalance(const_view<std::int64_t, 1> counts, index_t ranks) {
  using ::k3::detail::require;
  ::k3::detail::check_view("counts", counts);
  index_t const E = counts.extent(0);
  require(ranks >= 1 && E >= ranks && E % ranks == 0, error_kind::shape, [&] {
    return "argument 'ranks': experts (" + std::to_string(E) + ") must be a positive multiple of ranks (" + std::to_string(ranks) + ")";
  });
  std::int64_t total = 0;
  for (index_t e = 0; e < E; ++e) {
    require(counts(e) >= 0, error_kind::value, [&] { return "argument 'counts': negative count at expert " + std::to_string(e); });
    total += counts(e);
  }
  require(total % ranks == 0, error_kind::shape, [&] {
    return "argument 'counts': total pairs " + std::to_string(total) + " is not a multiple of ranks " + std::to_string(ranks) +
           " (every rank holds S*K)";
  });
  index_t const per = E / ranks, T = total / ranks;
  moonep_plan plan;
  plan.experts = E;
  plan.ranks = ranks;
  plan.pairs_per_rank = T;
  std::vector<std::int64_t> rem(static_cast<std::size_t>(E)), load(static_cast<std::size_t>(ranks), 0);
  for (index_t e = 0; e < E; ++e) {
    rem[e] = counts(e);
    load[e / per] += rem[e];
  }
  std::vector<char> final_(static_cast<std::size_t>(ranks), 0);
  std::vector<moonep_assignment> fills;
  for (;;) {
    index_t u = -1, o = 0;
    for (index_t r = 0; r < ranks; ++r)
      if (!final_[r] && load[r] < T) {
        u = r;
        break;
      }
    if (u < 0) break;
    for (index_t r = 1; r < ranks; ++r)
      if (load[r] > load[o]) o = r;
    std::int64_t d = T - load[u];
    // o is not final (final ranks hold exactly T), so load[o] = sum of rem over its experts > T >= d.
    std::vector<index_t> ex(static_cast<std::size_t>(per));
    std::iota(ex.begin(), ex.end(), o * per);
    std::stable_sort(ex.begin(), ex.end(), [&](index_t a, index_t b) { return rem[a] > rem[b]; });
    for (index_t e : ex) {
      if (d == 0) break;
      std::int64_t t = std::min(rem[e], d);
      if (t == 0) continue;
      rem[e] -= t;
      d -= t;
      fills.push_back({e, u, t});
    }
    load[o] -= T - load[u];
    load[u] = T;
    final_[u] = 1;
  }
  for (index_t e = 0; e < E; ++e)
    if (rem[e] > 0) plan.parts.push_back({e, e / per, rem[e]});
  plan.parts.insert(plan.parts.end(), fills.begin(), fills.end());
  return plan;
}

struct moonep_report {
  bool balanced = false;    // every rank holds exactly pairs_per_rank
  bool conserved = false;   // every expert's pairs are all placed, once
  index_t max_redundant = 0;  // most non-local experts hosted by one rank
  index_t bound = 0;          // E / R
  bool ok() const noexcept { return balanced && conserved && max_redundant <= bound; }
};

inline moonep_report check_moonep(const_view<std::int64_t, 1> counts, moonep_plan const& p) {
  ::k3::detail::check_view("counts", counts);
  moonep_report rep;
  index_t const E = p.experts, R = p.ranks;
  // A plan whose header cannot describe a placement (home() divides by E / R) is not ok.
  if (R < 1 || E < R || E % R != 0) return rep;
  rep.bound = E / R;
  std::vector<std::int64_t> per_rank(static_cast<std::size_t>(R), 0), per_exp(static_cast<std::size_t>(E), 0);
  std::vector<std::vector<char>> hosted(static_cast<std::size_t>(R), std::vector<char>(static_cast<std::size_t>(E), 0));
  bool valid = counts.extent(0) == E;
  for (auto const& a : p.parts) {
    if (a.expert < 0 || a.expert >= E || a.rank < 0 || a.rank >= R || a.count < 0) {
      valid = false;
      continue;
    }
    per_rank[a.rank] += a.count;
    per_exp[a.expert] += a.count;
    if (a.rank != p.home(a.expert) && a.count > 0) hosted[a.rank][a.expert] = 1;
  }
  rep.balanced = valid;
  for (index_t r = 0; r < R; ++r) rep.balanced &= per_rank[r] == p.pairs_per_rank;
  rep.conserved = valid;
  for (index_t e = 0; valid && e < E; ++e) rep.conserved &= per_exp[e] == counts(e);
  for (index_t r = 0; r < R; ++r)
    rep.max_redundant = std::max<index_t>(rep.max_redundant, std::count(hosted[r].begin(), hosted[r].end(), 1));
  return rep;
}

// Dispatch of the routed pairs under a plan: pair (t, r) of `indices` [Tn, K] goes to
// (rank, slot) written into `rank_of` / `slot_of` [Tn, K]. Each expert's pairs are taken in
// token order and handed to its plan parts in order; slots count up per rank, so the map is a
// bijection onto R x pairs_per_rank when the plan is balanced. Slots of index -1 get -1.
inline void moonep_dispatch(const_view<std::int32_t, 2> indices, moonep_plan const& p, tensor_view<std::int64_t, 2> rank_of,
                            tensor_view<std::int64_t, 2> slot_of) {
  index_t const Tn = indices.extent(0), K = indices.extent(1);
  ::k3::detail::check_view("indices", indices);
  ::k3::detail::check_view("rank_of", rank_of);
  ::k3::detail::check_view("slot_of", slot_of);
  ::k3::detail::check_shape("rank_of", rank_of, {Tn, K});
  ::k3::detail::check_shape("slot_of", slot_of, {Tn, K});
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("rank_of", rank_of, "slot_of", slot_of),
                                    ::k3::detail::named_views("indices", indices));
  ::k3::detail::require(p.ranks >= 1 && p.experts >= p.ranks && p.experts % p.ranks == 0, error_kind::shape, [&] {
    return "argument 'plan': experts (" + std::to_string(p.experts) + ") must be a positive multiple of ranks (" +
           std::to_string(p.ranks) + ")";
  });
  std::vector<std::vector<moonep_assignment>> parts(static_cast<std::size_t>(p.experts));
  for (auto const& a : p.parts) {
    ::k3::detail::require(a.expert >= 0 && a.expert < p.experts && a.rank >= 0 && a.rank < p.ranks && a.count >= 0, error_kind::shape, [&] {
      return "argument 'plan': part (expert " + std::to_string(a.expert) + ", rank " + std::to_string(a.rank) + ", count " +
             std::to_string(a.count) + ") outside experts [0, " + std::to_string(p.experts) + "), ranks [0, " + std::to_string(p.ranks) +
             "), count >= 0";
    });
    parts[a.expert].push_back(a);
  }
  std::vector<std::size_t> cur(static_cast<std::size_t>(p.experts), 0);
  std::vector<std::int64_t> used(static_cast<std::size_t>(p.experts), 0), next_slot(static_cast<std::size_t>(p.ranks), 0);
  for (index_t t = 0; t < Tn; ++t)
    for (index_t r = 0; r < K; ++r) {
      index_t e = indices(t, r);
      if (e < 0) {
        rank_of(t, r) = slot_of(t, r) = -1;
        continue;
      }
      ::k3::detail::require(e < p.experts, error_kind::value, [&] {
        return "argument 'indices': expert id " + std::to_string(e) + " at (" + std::to_string(t) + ", " + std::to_string(r) +
               ") outside the plan's experts [0, " + std::to_string(p.experts) + ")";
      });
      auto& ps = parts[e];
      while (cur[e] < ps.size() && used[e] == ps[cur[e]].count) ++cur[e], used[e] = 0;
      ::k3::detail::require(cur[e] < ps.size(), error_kind::value, [&] {
        return "moonep_dispatch: expert " + std::to_string(e) + " has more routed pairs than the plan places";
      });
      ++used[e];
      index_t rk = ps[cur[e]].rank;
      rank_of(t, r) = rk;
      slot_of(t, r) = next_slot[rk]++;
    }
}

}  // namespace k3::moe
