// The distributed DPLR check shared by the MPI test and the NCCL test: every rank builds the
// same global problem, takes its token block and runs the context-parallel forward/backward
// over the given communicator.
#pragma once
#include <algorithm>
#include <vector>

#include "dplr_test_util.hpp"

namespace dplr_test {

struct cp_errors {
  double o = 0, ht = 0, grads = 0, dh0 = 0, threaded = 0;
  double max() const { return std::max({o, ht, grads, dh0, threaded}); }
};

template <class T>
std::vector<T> block(std::vector<T> const& x, index_t B, index_t T_, index_t H, index_t D, index_t t0, index_t n) {
  std::vector<T> out;
  for (index_t b = 0; b < B; ++b) out.insert(out.end(), x.begin() + (b * T_ + t0) * H * D, x.begin() + (b * T_ + t0 + n) * H * D);
  return out;
}

// Errors of this rank's block of the distributed forward/backward (cuts[r]..cuts[r+1] on rank
// r) against the single-process serial chunked result on the whole problem.
template <class T, class Comm>
cp_errors cp_check(Comm const& comm, int rank, std::uint64_t seed, index_t B, index_t Tn, index_t H, index_t K, index_t V,
              index_t chunk, std::vector<index_t> cuts, bool with_h0) {
  using S = k3::dplr::state_t<T>;
  std::mt19937_64 rng(seed);
  auto p = make<T>(rng, B, Tn, H, K, V, {}, with_h0);
  auto dO = randn<T>(rng, p.nv());
  auto dht = randn<S>(rng, p.ns());
  auto ref = run_fwd(p, chunked_fwd(k3::cpu::serial{}, p.options(chunk)));
  auto gref = run_bwd(p, dO, dht, chunked_bwd(k3::cpu::serial{}, p.options(chunk)));
  index_t t0 = cuts[rank], n = cuts[rank + 1] - cuts[rank];
  problem<T> lp = p;
  lp.T_ = n;
  lp.q = block(p.q, B, Tn, H, K, t0, n), lp.k = block(p.k, B, Tn, H, K, t0, n), lp.a = block(p.a, B, Tn, H, K, t0, n);
  lp.b = block(p.b, B, Tn, H, K, t0, n), lp.gk = block(p.gk, B, Tn, H, K, t0, n), lp.v = block(p.v, B, Tn, H, V, t0, n);
  auto ldO = block(dO, B, Tn, H, V, t0, n);
  auto opt = lp.options(chunk);
  auto got = run_fwd(lp, [&](auto const& a) { k3::dplr::forward(k3::cpu::serial{}, on(comm, a), opt); });
  auto want_o = block(ref.o, B, Tn, H, V, t0, n);
  cp_errors e;
  e.o = rel_err(got.o, want_o), e.ht = rel_err(got.ht, ref.ht);
  auto g = run_bwd(lp, ldO, dht, [&](auto const& a) { k3::dplr::backward(k3::cpu::serial{}, on(comm, a), opt); });
  double& eb = e.grads;
  eb = std::max(eb, rel_err(g.dq, block(gref.dq, B, Tn, H, K, t0, n)));
  eb = std::max(eb, rel_err(g.dk, block(gref.dk, B, Tn, H, K, t0, n)));
  eb = std::max(eb, rel_err(g.da, block(gref.da, B, Tn, H, K, t0, n)));
  eb = std::max(eb, rel_err(g.db, block(gref.db, B, Tn, H, K, t0, n)));
  eb = std::max(eb, rel_err(g.dgk, block(gref.dgk, B, Tn, H, K, t0, n)));
  eb = std::max(eb, rel_err(g.dv, block(gref.dv, B, Tn, H, V, t0, n)));
  e.dh0 = rel_err(g.dh0, gref.dh0);
  // threaded backend inside each rank gives the same
  k3::cpu::threads<> th(2);
  auto got2 = run_fwd(lp, [&](auto const& a) { k3::dplr::forward(th, on(comm, a), opt); });
  e.threaded = std::max(rel_err(got2.o, want_o), rel_err(got2.ht, ref.ht));
  return e;
}

}  // namespace dplr_test
