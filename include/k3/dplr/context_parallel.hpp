// k3/dplr/context_parallel.hpp — DPLR forward and backward over a sequence split across the
// ranks of a Communicator (fla's KCP procedure, on any k3 Communicator: MPI, single process).
//
// Layout: rank r holds tokens [t_r, t_{r+1}) of every one of the B sequences, ranks in token
// order (local tensors [B, T_r, H, *]; T_r may differ per rank and may be 0). h0 and dht are
// the global initial state and final-state gradient, given identically on every rank (or
// absent on every rank); ht and dh0 are written on every rank.
//
// Forward: (1) every rank computes its block's affine map (M_r, N_r) from a zero state;
// (2) all-gather; (3) rank r folds the maps of ranks < r into h0 to get its initial state;
// (4) the ordinary chunked forward from that state. Backward mirrors it: each rank also
// computes G_r (the state gradient its own outputs send back), the gradients at each block's
// end come from folding (M^T, G) from the last rank down, then the ordinary chunked backward.
// Communication: B*H*K*(K+V) (forward) or B*H*K*(K+2V) (backward) state-type elements per
// rank, independent of T. A header is exchanged first, so a rank whose B, H, K, V, element
// type, scale or h0/dht presence differs makes every rank throw k3::error naming it; so does
// a rank whose own arguments fail their checks (it throws its own error, the others name it),
// instead of leaving the others waiting in a collective. With one rank both calls are the
// ordinary chunked ones.
#pragma once
#include <bit>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "k3/comm/communicator.hpp"
#include "k3/dplr/maps.hpp"

namespace k3 {
namespace detail::dplr {

// Every rank's local checks ran before this (a rank whose own arguments are wrong must still
// take part, or the others would wait in the collective forever, or pair it with a later
// call's): status and header are exchanged together; any failure makes every rank throw (the
// failing rank its own error, the others an error naming it), then any disagreement does.
template <class C>
void cp_agree(C const& comm, char const* what, std::exception_ptr const& failed, std::vector<std::int64_t> header,
              std::vector<char const*> const& names) {
  index_t const P = comm.size(), n = static_cast<index_t>(names.size()) + 1;
  header.resize(names.size(), 0);
  std::vector<std::int64_t> mine = {failed ? 1 : 0};
  mine.insert(mine.end(), header.begin(), header.end());
  std::vector<std::int64_t> all(static_cast<std::size_t>(P * n));
  comm.all_gather(const_view<std::int64_t, 1>(mine.data(), {n}), tensor_view<std::int64_t, 1>(all.data(), {P * n}));
  if (failed) std::rethrow_exception(failed);
  std::string bad;
  for (index_t r = 0; r < P; ++r)
    if (all[r * n]) bad += (bad.empty() ? "" : ", ") + std::to_string(r);
  if (!bad.empty())
    throw k3::error(error_kind::shape, std::string(what) + ": rank " + bad + " rejected its arguments (see the error there); this is rank " +
                    std::to_string(comm.rank()));
  auto show = [&](index_t i, std::int64_t x) {
    return std::string_view(names[i]) == "scale" ? std::to_string(std::bit_cast<double>(x)) : std::to_string(x);
  };
  for (index_t r = 1; r < P; ++r)
    for (index_t i = 0; i + 1 < n; ++i)
      if (all[r * n + 1 + i] != all[1 + i])
        throw k3::error(error_kind::shape, std::string(what) + ": ranks disagree on " + names[i] + ": rank 0 has " + show(i, all[1 + i]) + ", rank " +
                        std::to_string(r) + " has " + show(i, all[r * n + 1 + i]) + " (this is rank " + std::to_string(comm.rank()) + ")");
}

template <class T>
std::vector<std::int64_t> cp_header(problem const& p, bool has_h0, bool has_dht) {
  return {p.B, p.H, p.K, p.V, std::is_same_v<T, double> ? 2 : 1, has_h0 ? 1 : 0, has_dht ? 1 : 0, std::bit_cast<std::int64_t>(p.scale)};
}
inline std::vector<char const*> cp_header_names() {
  return {"B", "H", "K", "V", "element type (1 float, 2 double)", "h0 given", "dht given", "scale"};
}

// Local (b, h) maps of this rank's block: [M | N | G?] per (b, h), K x W each.
template <class T, class R, class Par>
void cp_local_maps(Par const& par, problem const& p, dplr_inputs<T> const& in, head_cfg<R> const& cfg, const_view<T, 4> const* dO,
                   std::vector<R>& out, index_t W) {
  out.assign(static_cast<std::size_t>(p.B * p.H * p.K * W), R(0));
  for_each_head(par, p.B * p.H, [&](auto const& ex, index_t task) {
    index_t n = task / p.H, h = task % p.H;
    auto hv = head_of(in, p.seqs[n], h);
    mat<R> MN;
    head_map<T, R>(ex, hv, cfg, MN);
    R* dst = out.data() + task * p.K * W;
    for (index_t i = 0; i < p.K; ++i)
      for (index_t j = 0; j < p.K + p.V; ++j) dst[i * W + j] = MN(i, j);
    if (dO) {
      mat<R> Gm = mat<R>::Zero(p.K, p.V);
      auto dOh = head_slice<T>(*dO, p.seqs[n], h);
      auto loadO = [&](index_t t0, index_t c, index_t c0, index_t w, mat<R>& m) { load_cols(dOh, t0, c, c0, w, m); };
      head_dstate<T, R>(ex, hv, cfg, p.V, Gm, loadO);
      for (index_t i = 0; i < p.K; ++i)
        for (index_t j = 0; j < p.V; ++j) dst[i * W + p.K + p.V + j] = Gm(i, j);
    }
  });
}

}  // namespace detail::dplr

template <class T, Communicator C, class Bk = cpu::serial>
void dplr_cp_forward(C const& comm, dplr_inputs<T> const& in, dplr_outputs<T> const& out, dplr_options const& opt = {}, Bk const& bk = {}) {
  using R = dplr_state_t<T>;
  namespace d = detail::dplr;
  auto h0 = in.h0;
  auto local_in = in;
  local_in.h0 = {};
  d::problem p;
  std::exception_ptr const failed = detail::capture_error([&] {
    detail::require(!d::has_varlen(opt), error_kind::unsupported, "dplr_cp_forward: cu_seqlens is not supported; split every sequence across ranks instead");
    p = d::make_problem(local_in, opt);
    if (!d::absent(h0)) detail::check_shape("h0", h0, {p.B, p.H, p.K, p.V});
    d::check_outputs(p, in, out);  // with h0: o and ht must not overlap it either
  });
  d::cp_agree(comm, "dplr_cp_forward", failed, d::cp_header<T>(p, !d::absent(h0), false), d::cp_header_names());
  if (comm.size() == 1) {  // nothing to fold: the ordinary forward
    dplr_chunked_forward(bk, in, out, opt);
    return;
  }
  d::head_cfg<R> cfg{R(p.scale), p.chunk, opt.intra, p.K, p.V};
  k3::detail::subnormals_flushed const flush;  // chunk forms: see k3/core/float_env.hpp
  auto par = d::make_par(bk);
  index_t const W = p.K + p.V, BH = p.B * p.H, P = comm.size(), me = comm.rank();
  std::vector<R> mine, all(static_cast<std::size_t>(P * BH * p.K * W));
  d::cp_local_maps<T, R>(par, p, local_in, cfg, nullptr, mine, W);
  comm.all_gather(const_view<R, 1>(mine.data(), {static_cast<index_t>(mine.size())}), tensor_view<R, 1>(all.data(), {static_cast<index_t>(all.size())}));
  std::vector<R> start(static_cast<std::size_t>(BH * p.K * p.V));
  for (index_t task = 0; task < BH; ++task) {
    index_t b = task / p.H, h = task % p.H;
    d::mat<R> S;
    d::load_state_mat(h0, b, h, p.K, p.V, S);
    for (index_t r = 0; r < P; ++r) {
      if (r == me) Eigen::Map<d::mat<R>>(start.data() + task * p.K * p.V, p.K, p.V) = S;
      R const* base = all.data() + (r * BH + task) * p.K * W;
      Eigen::Map<d::mat<R> const, 0, Eigen::OuterStride<>> M(base, p.K, p.K, Eigen::OuterStride<>(W)), N(base + p.K, p.K, p.V, Eigen::OuterStride<>(W));
      d::mat<R> next = N;
      next.noalias() += M * S;
      S.swap(next);
    }
    d::store_state_mat(out.ht, b, h, S);
  }
  auto lin = local_in;
  lin.h0 = const_view<R, 4>(start.data(), {p.B, p.H, p.K, p.V});
  dplr_chunked_forward(bk, lin, dplr_outputs<T>{out.o, {}}, opt);
}

template <class T, Communicator C, class Bk = cpu::serial>
void dplr_cp_backward(C const& comm, dplr_inputs<T> const& in, dplr_grad_inputs<T> const& gin, dplr_grads<T> const& g,
                      dplr_options const& opt = {}, Bk const& bk = {}) {
  using R = dplr_state_t<T>;
  namespace d = detail::dplr;
  auto h0 = in.h0;
  auto local_in = in;
  local_in.h0 = {};
  auto lgin = gin;
  lgin.dht = {};
  auto lg = g;
  lg.dh0 = {};
  d::problem p;
  std::exception_ptr const failed = detail::capture_error([&] {
    detail::require(!d::has_varlen(opt), error_kind::unsupported, "dplr_cp_backward: cu_seqlens is not supported; split every sequence across ranks instead");
    p = d::make_problem(local_in, opt);
    if (!d::absent(h0)) detail::check_shape("h0", h0, {p.B, p.H, p.K, p.V});
    d::check_grads(p, in, gin, g);  // h0, dht and dh0 against everything else too
    if (!d::absent(gin.dht)) detail::check_shape("dht", gin.dht, {p.B, p.H, p.K, p.V});
    if (!d::absent(g.dh0)) detail::check_shape("dh0", g.dh0, {p.B, p.H, p.K, p.V});
  });
  d::cp_agree(comm, "dplr_cp_backward", failed, d::cp_header<T>(p, !d::absent(h0), !d::absent(gin.dht)), d::cp_header_names());
  if (comm.size() == 1) {
    dplr_chunked_backward(bk, in, gin, g, opt);
    return;
  }
  d::head_cfg<R> cfg{R(p.scale), p.chunk, opt.intra, p.K, p.V};
  k3::detail::subnormals_flushed const flush;  // chunk forms: see k3/core/float_env.hpp
  auto par = d::make_par(bk);
  index_t const W = p.K + 2 * p.V, BH = p.B * p.H, P = comm.size(), me = comm.rank();
  std::vector<R> mine, all(static_cast<std::size_t>(P * BH * p.K * W));
  d::cp_local_maps<T, R>(par, p, local_in, cfg, &lgin.do_, mine, W);
  comm.all_gather(const_view<R, 1>(mine.data(), {static_cast<index_t>(mine.size())}), tensor_view<R, 1>(all.data(), {static_cast<index_t>(all.size())}));
  std::vector<R> start(static_cast<std::size_t>(BH * p.K * p.V)), dend(start.size());
  using cmap = Eigen::Map<d::mat<R> const, 0, Eigen::OuterStride<>>;
  for (index_t task = 0; task < BH; ++task) {
    index_t b = task / p.H, h = task % p.H;
    auto blk = [&](index_t r, index_t col, index_t w) { return cmap(all.data() + (r * BH + task) * p.K * W + col, p.K, w, Eigen::OuterStride<>(W)); };
    d::mat<R> S;
    d::load_state_mat(h0, b, h, p.K, p.V, S);
    for (index_t r = 0; r < me; ++r) {
      d::mat<R> next = blk(r, p.K, p.V);
      next.noalias() += blk(r, 0, p.K) * S;
      S.swap(next);
    }
    Eigen::Map<d::mat<R>>(start.data() + task * p.K * p.V, p.K, p.V) = S;
    d::mat<R> dS;
    d::load_state_mat(gin.dht, b, h, p.K, p.V, dS);
    for (index_t r = P - 1; r >= 0; --r) {
      if (r == me) Eigen::Map<d::mat<R>>(dend.data() + task * p.K * p.V, p.K, p.V) = dS;
      d::mat<R> next = blk(r, p.K + p.V, p.V);
      next.noalias() += blk(r, 0, p.K).transpose() * dS;
      dS.swap(next);
    }
    d::store_state_mat(g.dh0, b, h, dS);
  }
  auto lin = local_in;
  lin.h0 = const_view<R, 4>(start.data(), {p.B, p.H, p.K, p.V});
  lgin.dht = const_view<R, 4>(dend.data(), {p.B, p.H, p.K, p.V});
  dplr_chunked_backward(bk, lin, lgin, lg, opt);
}

}  // namespace k3
