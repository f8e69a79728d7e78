// The Block AttnRes pipeline cache over MPI (mpirun -np 2, 3, 4) with uneven chunks:
// P ranks x V virtual stages (V = 1, 2, 3), explicit cut points (random, a rank whose every
// chunk is empty, cuts inside blocks, everything in the last chunk, one sublayer per chunk),
// float, bfloat16 and double storage, every mode, both decoder-layer-0 rules, against the same
// stack run by one driver in one process. The forward hands every site the same bits (the
// cache moves storage bits and the inverse RMS exactly); the gradients differ only by the
// order in which deposits are summed.
// No doctest: every rank takes part in every check.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/attnres.hpp"
#include "k3/comm/mpi.hpp"
#include "support/mpi_check.hpp"

namespace ar = k3::attnres;
using k3::index_t;

namespace {

struct problem {
  index_t L, S, T, d;
  bool skip;
  std::vector<double> w, g, a, c, emb, dout;  // sublayer l: y = tanh(a_l * x + c_l) per element
  problem(index_t L_, index_t S_, index_t T_, index_t d_, bool skip_, std::uint64_t seed) : L(L_), S(S_), T(T_), d(d_), skip(skip_) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<double> nd(0.0, 1.0);
    auto fill = [&](std::vector<double>& v, index_t n, double sc, double off) {
      v.resize(std::size_t(n));
      for (auto& x : v) x = off + sc * nd(gen);
    };
    fill(w, (L + 1) * d, 1.0, 0.0);
    fill(g, (L + 1) * d, 0.3, 1.0);
    fill(a, L * d, 0.8, 0.0);
    fill(c, L * d, 0.5, 0.0);
    fill(emb, T * d, 1.0, 0.0);
    fill(dout, T * d, 1.0, 0.0);
  }
};

template <class S>
struct result {
  std::vector<std::vector<S>> inputs;  // per site (empty where this rank did not run it)
  std::vector<std::vector<double>> dy;  // gradient of each sublayer output (same)
  std::vector<double> dw, dg, demb;     // [L+1, d] summed over ranks; demb from rank 0
};

template <class S>
ar::block_config make_cfg(problem const& p, ar::mode m) {
  ar::block_config cfg;
  cfg.d = p.d;
  cfg.tokens = p.T;
  cfg.sublayers = p.L;
  cfg.block_sublayers = p.S;
  cfg.skip_first_mix = p.skip;
  cfg.run_mode = m;
  return cfg;
}

bool training(ar::mode m) { return m == ar::mode::train_stored || m == ar::mode::train_recompute; }

// The sublayer in compute precision C from the stored input x, stored as S.
template <class S, class C>
void sublayer(problem const& p, index_t l, std::vector<S> const& x, std::vector<S>& y) {
  y.resize(x.size());
  for (index_t t = 0; t < p.T; ++t)
    for (index_t k = 0; k < p.d; ++k)
      y[std::size_t(t * p.d + k)] = S(C(std::tanh(p.a[std::size_t(l * p.d + k)] * double(C(x[std::size_t(t * p.d + k)])) + p.c[std::size_t(l * p.d + k)])));
}
template <class S, class C, class G>
void sublayer_grad(problem const& p, index_t l, std::vector<S> const& x, G const& gy, std::vector<C>& dx) {
  dx.resize(x.size());
  for (index_t t = 0; t < p.T; ++t)
    for (index_t k = 0; k < p.d; ++k) {
      double const yy = std::tanh(p.a[std::size_t(l * p.d + k)] * double(C(x[std::size_t(t * p.d + k)])) + p.c[std::size_t(l * p.d + k)]);
      dx[std::size_t(t * p.d + k)] = C(double(gy(t, k)) * p.a[std::size_t(l * p.d + k)] * (1 - yy * yy));
    }
}

// Runs the stack: cuts has C + 1 entries; chunk c runs sites [cuts[c], cuts[c+1]) on rank
// c % P (P = 1: one driver, no cache).
template <class S, class Comm>
result<S> run(Comm const& comm, problem const& p, ar::mode m, std::vector<index_t> const& cuts, bool alone) {
  using C = k3::accumulation_t<S>;
  int const P = alone ? 1 : comm.size(), me = alone ? 0 : comm.rank();
  index_t const T = p.T, d = p.d, nc = index_t(cuts.size()) - 1;
  std::vector<C> w(p.w.begin(), p.w.end()), g(p.g.begin(), p.g.end());
  ar::block_attn_res<S> a(make_cfg<S>(p, m), k3::tensor_view<C const, 2>(w.data(), {p.L + 1, d}), k3::tensor_view<C const, 2>(g.data(), {p.L + 1, d}));
  ar::pipeline_cache<Comm> cache(comm);
  result<S> r;
  r.inputs.resize(std::size_t(p.L + 1));
  r.dy.resize(std::size_t(p.L));
  std::vector<S> e(p.emb.size()), x(std::size_t(T * d)), y;
  for (std::size_t i = 0; i < e.size(); ++i) e[i] = S(C(p.emb[i]));
  int const prev = (me + P - 1) % P, next = (me + 1) % P;
  for (index_t c = 0; c < nc; ++c) {
    if (c % P != me) continue;
    if (c == 0) a.begin(k3::host_view(e.data(), T, d));
    else cache.recv_forward(a, prev, int(c));
    for (index_t l = cuts[std::size_t(c)]; l < cuts[std::size_t(c + 1)]; ++l) {
      a.input(k3::host_view(x.data(), T, d));
      r.inputs[std::size_t(l)] = x;
      sublayer<S, C>(p, l, x, y);
      a.add(k3::host_view(y.data(), T, d));
    }
    if (c == nc - 1) {
      a.output(k3::host_view(x.data(), T, d));
      r.inputs[std::size_t(p.L)] = x;
    } else {
      cache.send_forward(a, next, int(c + 1));
    }
  }
  r.dw.assign(std::size_t((p.L + 1) * d), 0.0);
  r.dg = r.dw;
  r.demb.assign(std::size_t(T * d), 0.0);
  if (!training(m)) return r;
  a.backward_prepare();
  std::vector<C> dout(p.dout.begin(), p.dout.end()), dx;
  for (index_t c = nc - 1; c >= 0; --c) {
    if (c % P != me) continue;
    if (c == nc - 1) {
      a.backward_begin();
      a.backward_site(k3::host_view(dout.data(), T, d));
    } else {
      cache.recv_backward(a, next, int(1000 + c));
    }
    for (index_t l = cuts[std::size_t(c + 1)] - 1; l >= cuts[std::size_t(c)]; --l) {
      auto gy = a.grad_sublayer_output();
      r.dy[std::size_t(l)].assign(gy.data_handle(), gy.data_handle() + T * d);
      sublayer_grad<S, C>(p, l, r.inputs[std::size_t(l)], gy, dx);
      a.backward_site(k3::host_view(dx.data(), T, d));
    }
    if (c > 0) cache.send_backward(a, prev, int(1000 + c - 1));
  }
  for (index_t l = 0; l <= p.L; ++l)
    for (index_t k = 0; k < d; ++k) {
      r.dw[std::size_t(l * d + k)] = double(a.grad_w()(l, k));
      r.dg[std::size_t(l * d + k)] = double(a.grad_gain()(l, k));
    }
  if (me == 0)
    for (index_t t = 0; t < T; ++t)
      for (index_t k = 0; k < d; ++k) r.demb[std::size_t(t * d + k)] = double(a.grad_embedding()(t, k));
  if (!alone) {  // each rank's dw/dg rows outside its sites are 0: the sum over ranks is the gradient
    comm.all_reduce_sum(k3::host_view(r.dw.data(), index_t(r.dw.size())));
    comm.all_reduce_sum(k3::host_view(r.dg.data(), index_t(r.dg.size())));
    comm.all_reduce_sum(k3::host_view(r.demb.data(), index_t(r.demb.size())));
  }
  return r;
}

// max |x - y| / max |y|; a NaN or Inf difference is an infinite error (std::max would drop a NaN).
double rel_err(std::vector<double> const& x, std::vector<double> const& y) {
  if (x.size() != y.size()) return INFINITY;
  double m = 0, e = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    m = std::max(m, std::abs(y[i]));
    double const d = std::abs(x[i] - y[i]);
    if (!(d <= e)) e = std::isfinite(d) ? d : INFINITY;
  }
  return e == 0 ? 0 : e / std::max(m, 1e-30);
}

template <class S>
bool same_bits(std::vector<S> const& x, std::vector<S> const& y) {
  return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(S)) == 0);
}

std::vector<index_t> cuts_for(index_t L, index_t S, index_t nc, int P, int pattern, std::mt19937_64& gen) {
  std::vector<index_t> c(std::size_t(nc + 1), 0);
  c[std::size_t(nc)] = L;
  switch (pattern) {
    case 0:  // random, sorted (empty chunks possible)
      for (index_t i = 1; i < nc; ++i) c[std::size_t(i)] = index_t(gen() % std::uint64_t(L + 1));
      std::sort(c.begin(), c.end());
      break;
    case 1: {  // rank 1 runs nothing: its chunks are empty, the others share L unevenly
      index_t at = 0;
      for (index_t i = 1; i < nc; ++i) {
        if ((i - 1) % P != 1) at = std::min(L, at + 1 + index_t(gen() % std::uint64_t(S + 1)));
        c[std::size_t(i)] = at;
      }
      break;
    }
    case 2:  // every cut inside a block (never at a multiple of S where avoidable)
      for (index_t i = 1; i < nc; ++i) {
        index_t x = L * i / nc;
        if (x % S == 0 && x + 1 < L) ++x;
        c[std::size_t(i)] = std::max(c[std::size_t(i - 1)], x);
      }
      break;
    case 3:  // everything in the last chunk
      break;
    case 4:  // one sublayer per chunk, the rest in the last
      for (index_t i = 1; i < nc; ++i) c[std::size_t(i)] = std::min(L, i);
      break;
    default:
      break;
  }
  return c;
}

template <class S>
void check_case(k3::mpi_communicator const& comm, problem const& p, ar::mode m, std::vector<index_t> const& cuts, char const* sname,
                int& failures_before, double gtol) {
  int const me = comm.rank(), P = comm.size();
  index_t const nc = index_t(cuts.size()) - 1;
  auto ref = run<S>(comm, p, m, {0, p.L}, true);
  auto got = run<S>(comm, p, m, cuts, false);
  std::string cs;
  for (auto c : cuts) cs += std::to_string(c) + " ";
  int const before = k3::test::mpi_failures();
  for (index_t c = me; c < nc; c += P)
    for (index_t l = cuts[std::size_t(c)]; l < (c == nc - 1 ? p.L + 1 : cuts[std::size_t(c + 1)]); ++l)
      EXPECT(same_bits(got.inputs[std::size_t(l)], ref.inputs[std::size_t(l)]), "%s mode %d L=%lld S=%lld cuts %s: site %lld input differs",
             sname, int(m), (long long)p.L, (long long)p.S, cs.c_str(), (long long)l);
  if (training(m)) {
    for (index_t c = me; c < nc; c += P)
      for (index_t l = cuts[std::size_t(c)]; l < cuts[std::size_t(c + 1)]; ++l) {
        double const e = rel_err(got.dy[std::size_t(l)], ref.dy[std::size_t(l)]);
        EXPECT(e <= gtol, "%s mode %d L=%lld S=%lld cuts %s: dy at site %lld err %g", sname, int(m), (long long)p.L, (long long)p.S, cs.c_str(),
               (long long)l, e);
      }
    double const ew = rel_err(got.dw, ref.dw), eg = rel_err(got.dg, ref.dg), ee = rel_err(got.demb, ref.demb);
    EXPECT(ew <= gtol && eg <= gtol && ee <= gtol, "%s mode %d L=%lld S=%lld cuts %s: dw %g dg %g demb %g", sname, int(m), (long long)p.L,
           (long long)p.S, cs.c_str(), ew, eg, ee);
  }
  if (k3::test::mpi_failures() != before) ++failures_before;
}

}  // namespace

int main(int argc, char** argv) {
  k3::mpi_session session(&argc, &argv);
  k3::mpi_communicator comm;
  int const P = comm.size();
  std::mt19937_64 gen(77);  // same on every rank: same cuts
  struct layout {
    index_t L, S, T, d;
    bool skip;
  };
  layout const layouts[] = {{11, 3, 3, 5, true}, {8, 1, 2, 4, false}, {13, 4, 1, 7, true}, {6, 8, 2, 3, false}, {9, 2, 0, 3, true}, {0, 2, 2, 3, true}};
  int cases = 0, failed = 0;
  std::uint64_t seed = 300;
  for (auto const& ly : layouts)
    for (index_t V = 1; V <= 3; ++V)
      for (int pattern = 0; pattern < 5; ++pattern) {
        problem p(ly.L, ly.S, ly.T, ly.d, ly.skip, seed++);
        auto cuts = cuts_for(ly.L, ly.S, index_t(P) * V, P, pattern, gen);
        for (ar::mode m : {ar::mode::one_pass, ar::mode::two_phase, ar::mode::train_stored, ar::mode::train_recompute}) {
          check_case<float>(comm, p, m, cuts, "float", failed, 1e-5);
          check_case<k3::bfloat16>(comm, p, m, cuts, "bfloat16", failed, 1e-5);
          check_case<double>(comm, p, m, cuts, "double", failed, 1e-13);
          cases += 3;
        }
      }
  // A receiver whose driver differs from the sender's (fewer tokens: refused from the header;
  // another width d: refused at the running sum) throws, and the payload already on its way
  // is consumed, so the sender does not block in a large send and the next hop on the same
  // pair works.
  {
    int const me = comm.rank();
    index_t const d = 600, T = 64;  // 150 KB of running sum: beyond MPI's eager limit
    std::vector<float> w(std::size_t(3 * (d + 1)), 0.1f), g(w.size(), 1.f), e(std::size_t(T * d), 0.5f), x(std::size_t(T * (d + 1)));
    for (int attempt = 0; attempt < 3; ++attempt) {  // rank 1: 0 too few tokens, 1 width d + 1, 2 the same driver
      ar::block_config cfg;
      cfg.d = (me == 1 && attempt == 1) ? d + 1 : d;
      cfg.sublayers = 2;
      cfg.block_sublayers = 1;
      cfg.run_mode = ar::mode::one_pass;
      cfg.tokens = (me == 1 && attempt == 0) ? T / 2 : T;
      auto wv = k3::tensor_view<float const, 2>(w.data(), {3, cfg.d}), gv = k3::tensor_view<float const, 2>(g.data(), {3, cfg.d});
      ar::block_attn_res<float> a(cfg, wv, gv);
      ar::pipeline_cache<k3::mpi_communicator> cache(comm);
      std::string msg;
      try {
        if (me == 0) {
          a.begin(k3::host_view(e.data(), T, d));
          a.input(k3::host_view(x.data(), T, d));
          a.add(k3::host_view(e.data(), T, d));
          cache.send_forward(a, 1, 77);  // running sum, bank row 0 and its rinv
        } else if (me == 1) {
          cache.recv_forward(a, 0, 77);
          a.input(k3::host_view(x.data(), T, d));
          EXPECT(attempt == 2 && a.site() == 1);
        }
      } catch (k3::error const& err) {
        msg = err.what();
      }
      if (me == 1 && attempt == 0) EXPECT(msg.find("capacity") != std::string::npos, "rank 1: '%s'", msg.c_str());
      else if (me == 1 && attempt == 1) EXPECT(msg.find("peer sent 38400") != std::string::npos, "rank 1: '%s'", msg.c_str());
      else EXPECT(msg.empty(), "rank %d attempt %d: '%s'", me, attempt, msg.c_str());
    }
  }

  if (comm.rank() == 0) std::printf("%d pipeline cases over %d ranks\n", cases, P);
  comm.barrier();
  return k3::test::mpi_verdict(comm);
}
