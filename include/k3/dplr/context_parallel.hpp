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
void cp_local_maps(Par const& par, problem const& p, inputs<T> const& in, head_cfg<R> const& cfg, const_view<T, 4> const* dO,
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

// The communicator every rank passes: present, and the chunked form (the only one split
// across ranks). Run inside the rank's checks, so that every rank learns of a failure.
template <class Comm>
void cp_check_call(char const* what, Comm const* comm, options const& opt) {
  require(comm != nullptr, error_kind::value, std::string(what) + ": argument 'comm': the communicator is missing (null)");
  require(opt.mode == algorithm::chunk, error_kind::unsupported,
          std::string(what) + ": option 'mode': only the chunked form runs across ranks, got recurrent");
  require(!has_varlen(opt), error_kind::unsupported,
          std::string(what) + ": cu_seqlens is not supported with a communicator; split every sequence across ranks instead");
}

// The rank's inputs with h0 left out: its carried state comes from the fold of the other ranks.
template <class T>
inputs<T> without_h0(inputs<T> in) {
  in.h0 = {};
  return in;
}

// The checks of one rank's call, captured so that every rank takes part in cp_agree: the call
// (cp_check_call), the problem of the local inputs into p, h0's shape, then `more` (the
// outputs' or the gradients' checks).
template <class Comm, class T, class More>
std::exception_ptr cp_capture_checks(char const* what, Comm const* comm, options const& opt, inputs<T> const& local_in,
                                     const_view<state_t<T>, 4> h0, problem& p, More&& more) {
  return ::k3::detail::capture_error([&] {
    cp_check_call(what, comm, opt);
    p = make_problem(local_in, opt);
    if (k3::present(h0)) ::k3::detail::check_shape("h0", h0, {p.B, p.H, p.K, p.V});
    more();
  });
}

}  // namespace detail::dplr
}  // namespace k3

namespace k3::dplr {

// forward_args plus the communicator of the ranks that share the sequence (not owned).
template <class T, Communicator C>
struct cp_forward_args {
  C const* comm = nullptr;
  const_view<T, 4> q = {}, k = {}, v = {}, a = {}, b = {}, gk = {};  // this rank's tokens
  const_view<state_t<T>, 4> h0 = {};                                 // global; the same on every rank
  tensor_view<T, 4> o = {};                                          // this rank's tokens
  tensor_view<state_t<T>, 4> ht = {};                                // global; written on every rank
};

// backward_args plus the communicator.
template <class T, Communicator C>
struct cp_backward_args {
  C const* comm = nullptr;
  const_view<T, 4> q = {}, k = {}, v = {}, a = {}, b = {}, gk = {};
  const_view<state_t<T>, 4> h0 = {};
  const_view<T, 4> d_o = {};
  const_view<state_t<T>, 4> dht = {};  // global; the same on every rank
  tensor_view<T, 4> dq = {}, dk = {}, dv = {}, da = {}, db = {}, dgk = {};
  tensor_view<state_t<T>, 4> dh0 = {};  // global; written on every rank
};

// The context-parallel forward: every rank calls it with its own block and the same options;
// the local work runs on `be`. options::mode must be chunk; cu_seqlens is not supported.
template <HostBackend B, class T, Communicator C>
void forward(B const& be, cp_forward_args<T, C> const& x, options const& opt = {}) {
  using R = state_t<T>;
  namespace d = ::k3::detail::dplr;
  forward_args<T> const whole{x.q, x.k, x.v, x.a, x.b, x.gk, x.h0, x.o, x.ht};
  auto const h0 = x.h0;
  d::inputs<T> const in = d::inputs_of(whole);
  d::inputs<T> const local_in = d::without_h0(in);
  d::problem p;
  // With h0, o and ht must not overlap it either.
  std::exception_ptr const failed =
      d::cp_capture_checks("dplr::forward", x.comm, opt, local_in, h0, p, [&] { d::check_outputs(p, in, x.o, x.ht); });
  if (x.comm == nullptr) std::rethrow_exception(failed);  // no collective to take part in
  C const& comm = *x.comm;
  d::cp_agree(comm, "dplr::forward", failed, d::cp_header<T>(p, k3::present(h0), false), d::cp_header_names());
  if (comm.size() == 1) {  // nothing to fold: the ordinary forward
    d::chunked_forward(be, whole, opt);
    return;
  }
  d::head_cfg<R> cfg{R(p.scale), p.chunk, opt.intra, p.K, p.V};
  k3::detail::subnormals_flushed const flush;  // chunk forms: see k3/core/float_env.hpp
  auto par = d::make_par(be);
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
    d::store_state_mat(x.ht, b, h, S);
  }
  forward_args<T> local{x.q, x.k, x.v, x.a, x.b, x.gk, const_view<R, 4>(start.data(), {p.B, p.H, p.K, p.V}), x.o, {}};
  d::chunked_forward(be, local, opt);
}

// The context-parallel backward: every rank calls it with its own block of the forward's
// inputs and of d_o, and the same dht and options.
template <HostBackend B, class T, Communicator C>
void backward(B const& be, cp_backward_args<T, C> const& x, options const& opt = {}) {
  using R = state_t<T>;
  namespace d = ::k3::detail::dplr;
  backward_args<T> const whole{x.q, x.k, x.v, x.a, x.b, x.gk, x.h0, x.d_o, x.dht, x.dq, x.dk, x.dv, x.da, x.db, x.dgk, x.dh0};
  auto const h0 = x.h0;
  d::inputs<T> const local_in = d::without_h0(d::inputs_of(whole));
  d::problem p;
  std::exception_ptr const failed = d::cp_capture_checks("dplr::backward", x.comm, opt, local_in, h0, p, [&] {
    d::check_grads(p, whole);  // h0, dht and dh0 against everything else too
    if (k3::present(x.dht)) k3::detail::check_shape("dht", x.dht, {p.B, p.H, p.K, p.V});
    if (k3::present(x.dh0)) k3::detail::check_shape("dh0", x.dh0, {p.B, p.H, p.K, p.V});
  });
  if (x.comm == nullptr) std::rethrow_exception(failed);  // no collective to take part in
  C const& comm = *x.comm;
  d::cp_agree(comm, "dplr::backward", failed, d::cp_header<T>(p, k3::present(h0), k3::present(x.dht)), d::cp_header_names());
  if (comm.size() == 1) {
    d::chunked_backward(be, whole, opt);
    return;
  }
  d::head_cfg<R> cfg{R(p.scale), p.chunk, opt.intra, p.K, p.V};
  k3::detail::subnormals_flushed const flush;  // chunk forms: see k3/core/float_env.hpp
  auto par = d::make_par(be);
  index_t const W = p.K + 2 * p.V, BH = p.B * p.H, P = comm.size(), me = comm.rank();
  std::vector<R> mine, all(static_cast<std::size_t>(P * BH * p.K * W));
  d::cp_local_maps<T, R>(par, p, local_in, cfg, &x.d_o, mine, W);
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
    d::load_state_mat(x.dht, b, h, p.K, p.V, dS);
    for (index_t r = P - 1; r >= 0; --r) {
      if (r == me) Eigen::Map<d::mat<R>>(dend.data() + task * p.K * p.V, p.K, p.V) = dS;
      d::mat<R> next = blk(r, p.K + p.V, p.V);
      next.noalias() += blk(r, 0, p.K).transpose() * dS;
      dS.swap(next);
    }
    d::store_state_mat(x.dh0, b, h, dS);
  }
  backward_args<T> local{x.q, x.k, x.v, x.a, x.b, x.gk, const_view<R, 4>(start.data(), {p.B, p.H, p.K, p.V}), x.d_o,
                         const_view<R, 4>(dend.data(), {p.B, p.H, p.K, p.V}), x.dq, x.dk, x.dv, x.da, x.db, x.dgk, {}};
  d::chunked_backward(be, local, opt);
}

}  // namespace k3::dplr
