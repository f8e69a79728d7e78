// DPLR (and KDA-as-DPLR) context parallelism over MPI (mpirun -np 2, 3, 4) against an
// independent single-process float64 token-by-token recurrence written here from the spec
// (S_t = (Diag(e^gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t)) and its
// hand-derived backward. Every rank builds the same global problem and takes its token block:
// uneven blocks, blocks of 0 and 1 tokens, T smaller than the rank count, T = 0, with and
// without h0 / ht / dht / dh0, hard resets and gates at -5 across rank boundaries, float and
// double. Bad input: ranks disagreeing on shapes, options, element type, or one rank's
// arguments failing their own checks, must make every rank throw k3::error, never hang.
// No doctest: every rank takes part in every check.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "k3/comm/any_communicator.hpp"
#include "k3/comm/mpi.hpp"
#include "k3/dplr.hpp"
#include "support/mpi_check.hpp"

using k3::index_t;

namespace {

// ---- the float64 reference -----------------------------------------------------------------
struct global_problem {
  index_t B = 1, T = 1, H = 1, K = 1, V = 1;
  double scale = 1;
  std::vector<double> q, k, v, a, b, gk, h0, dO, dht;  // token-major [B,T,H,*]; states [B,H,K,V]
};

struct ref_result {
  std::vector<double> o, ht, dq, dk, dv, da, db, dgk, dh0;
};

ref_result reference(global_problem const& p, bool use_h0, bool use_dht) {
  index_t const B = p.B, T = p.T, H = p.H, K = p.K, V = p.V;
  ref_result r;
  r.o.assign(std::size_t(B * T * H * V), 0);
  r.ht.assign(std::size_t(B * H * K * V), 0);
  for (auto* x : {&r.dq, &r.dk, &r.da, &r.db, &r.dgk}) x->assign(std::size_t(B * T * H * K), 0);
  r.dv.assign(std::size_t(B * T * H * V), 0);
  r.dh0.assign(std::size_t(B * H * K * V), 0);
  auto at = [&](std::vector<double> const& x, index_t b, index_t t, index_t h, index_t D) { return &x[std::size_t(((b * T + t) * H + h) * D)]; };
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      // states[t] = S after t tokens (states[0] = h0)
      std::vector<std::vector<double>> S(std::size_t(T + 1), std::vector<double>(std::size_t(K * V), 0.0));
      if (use_h0)
        for (index_t i = 0; i < K * V; ++i) S[0][std::size_t(i)] = p.h0[std::size_t((b * H + h) * K * V + i)];
      for (index_t t = 0; t < T; ++t) {
        double const *kt = at(p.k, b, t, h, K), *vt = at(p.v, b, t, h, V), *at_ = at(p.a, b, t, h, K), *bt = at(p.b, b, t, h, K),
                     *gt = at(p.gk, b, t, h, K), *qt = at(p.q, b, t, h, K);
        auto const& Sp = S[std::size_t(t)];
        auto& Sn = S[std::size_t(t + 1)];
        std::vector<double> X(std::size_t(V), 0.0);  // a^T S_{t-1}
        for (index_t i = 0; i < K; ++i)
          for (index_t j = 0; j < V; ++j) X[std::size_t(j)] += at_[i] * Sp[std::size_t(i * V + j)];
        for (index_t i = 0; i < K; ++i)
          for (index_t j = 0; j < V; ++j)
            Sn[std::size_t(i * V + j)] = std::exp(gt[i]) * Sp[std::size_t(i * V + j)] + bt[i] * X[std::size_t(j)] + kt[i] * vt[j];
        double* ot = &r.o[std::size_t(((b * T + t) * H + h) * V)];
        for (index_t j = 0; j < V; ++j) {
          double s = 0;
          for (index_t i = 0; i < K; ++i) s += Sn[std::size_t(i * V + j)] * p.scale * qt[i];
          ot[j] = s;
        }
      }
      for (index_t i = 0; i < K * V; ++i) r.ht[std::size_t((b * H + h) * K * V + i)] = S[std::size_t(T)][std::size_t(i)];
      // backward of L = sum <dO, o> + <dht, S_T>
      std::vector<double> dS(std::size_t(K * V), 0.0);
      if (use_dht)
        for (index_t i = 0; i < K * V; ++i) dS[std::size_t(i)] = p.dht[std::size_t((b * H + h) * K * V + i)];
      for (index_t t = T - 1; t >= 0; --t) {
        double const *kt = at(p.k, b, t, h, K), *vt = at(p.v, b, t, h, V), *at_ = at(p.a, b, t, h, K), *bt = at(p.b, b, t, h, K),
                     *gt = at(p.gk, b, t, h, K), *qt = at(p.q, b, t, h, K), *dot = at(p.dO, b, t, h, V);
        auto const& Sp = S[std::size_t(t)];
        auto const& Sn = S[std::size_t(t + 1)];
        double* dq = &r.dq[std::size_t(((b * T + t) * H + h) * K)];
        double* dk = &r.dk[std::size_t(((b * T + t) * H + h) * K)];
        double* da = &r.da[std::size_t(((b * T + t) * H + h) * K)];
        double* db = &r.db[std::size_t(((b * T + t) * H + h) * K)];
        double* dg = &r.dgk[std::size_t(((b * T + t) * H + h) * K)];
        double* dv = &r.dv[std::size_t(((b * T + t) * H + h) * V)];
        for (index_t i = 0; i < K; ++i) {
          double s = 0;
          for (index_t j = 0; j < V; ++j) s += Sn[std::size_t(i * V + j)] * dot[j];
          dq[i] = p.scale * s;
          for (index_t j = 0; j < V; ++j) dS[std::size_t(i * V + j)] += p.scale * qt[i] * dot[j];
        }
        std::vector<double> X(std::size_t(V), 0.0), dX(std::size_t(V), 0.0);
        for (index_t i = 0; i < K; ++i)
          for (index_t j = 0; j < V; ++j) {
            X[std::size_t(j)] += at_[i] * Sp[std::size_t(i * V + j)];
            dX[std::size_t(j)] += bt[i] * dS[std::size_t(i * V + j)];
          }
        for (index_t i = 0; i < K; ++i) {
          double sk = 0, sb = 0, sa = 0, sg = 0;
          for (index_t j = 0; j < V; ++j) {
            double const d = dS[std::size_t(i * V + j)];
            sk += d * vt[j];
            sb += d * X[std::size_t(j)];
            sa += Sp[std::size_t(i * V + j)] * dX[std::size_t(j)];
            sg += d * Sp[std::size_t(i * V + j)];
          }
          dk[i] = sk, db[i] = sb, da[i] = sa;
          dg[i] = std::exp(gt[i]) * sg;
          if (std::exp(gt[i]) == 0) dg[i] = 0;  // a hard reset: no gradient through e^gk = 0
        }
        for (index_t j = 0; j < V; ++j) {
          double s = 0;
          for (index_t i = 0; i < K; ++i) s += dS[std::size_t(i * V + j)] * kt[i];
          dv[j] = s;
        }
        for (index_t i = 0; i < K; ++i)
          for (index_t j = 0; j < V; ++j)
            dS[std::size_t(i * V + j)] = std::exp(gt[i]) * dS[std::size_t(i * V + j)] + at_[i] * dX[std::size_t(j)];
      }
      for (index_t i = 0; i < K * V; ++i) r.dh0[std::size_t((b * H + h) * K * V + i)] = dS[std::size_t(i)];
    }
  return r;
}

enum class gates { normal, resets, floor5 };

global_problem make_problem(std::uint64_t seed, index_t B, index_t T, index_t H, index_t K, index_t V, gates gm) {
  global_problem p;
  p.B = B, p.T = T, p.H = H, p.K = K, p.V = V;
  p.scale = 1 / std::sqrt(double(K));
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01(0, 1);
  std::uniform_real_distribution<double> u01(0, 1);
  index_t const nk = B * T * H * K, nv = B * T * H * V, ns = B * H * K * V;
  auto fill = [&](std::vector<double>& x, index_t n, double s) {
    x.resize(std::size_t(n));
    for (auto& e : x) e = s * n01(rng);
  };
  fill(p.q, nk, 1);
  fill(p.k, nk, 1 / std::sqrt(double(K)));
  fill(p.v, nv, 1);
  p.a.resize(std::size_t(nk));
  p.b.resize(std::size_t(nk));
  p.gk.resize(std::size_t(nk));
  for (index_t row = 0; row < B * T * H; ++row) {  // a unit, b = -lambda a (stable)
    double nrm = 0;
    for (index_t i = 0; i < K; ++i) nrm += std::pow(p.a[std::size_t(row * K + i)] = n01(rng), 2);
    nrm = std::sqrt(nrm) + 1e-12;
    double const lam = 0.2 + 0.8 * u01(rng);
    for (index_t i = 0; i < K; ++i) {
      double& a = p.a[std::size_t(row * K + i)];
      a /= nrm;
      p.b[std::size_t(row * K + i)] = -lam * a;
      double const ls = -std::log1p(std::exp(-n01(rng))) / 4;
      double g = ls;
      if (gm == gates::resets && u01(rng) < 0.04) g = u01(rng) < 0.5 ? -1000.0 : -std::numeric_limits<double>::infinity();
      if (gm == gates::floor5) g = u01(rng) < 0.3 ? -5.0 : std::max(-5.0, 8 * ls);
      p.gk[std::size_t(row * K + i)] = g;
    }
  }
  fill(p.h0, ns, 0.5);
  fill(p.dO, nv, 1);
  fill(p.dht, ns, 1);
  return p;
}

template <class T>
std::vector<T> block(std::vector<double> const& x, index_t B, index_t Tn, index_t H, index_t D, index_t t0, index_t n) {
  std::vector<T> out;
  for (index_t b = 0; b < B; ++b)
    for (index_t i = (b * Tn + t0) * H * D; i < (b * Tn + t0 + n) * H * D; ++i) out.push_back(static_cast<T>(x[std::size_t(i)]));
  return out;
}
template <class T>
std::vector<T> cast(std::vector<double> const& x) {
  return std::vector<T>(x.begin(), x.end());
}

// max |x - y| over this rank's block y of a reference tensor, relative to the largest
// element of the whole reference tensor `full` (a block can be exactly 0: da, db, dgk of the
// first token without h0; a whole tensor too when T = 1), floored at 1e-3.
template <class A>
double rel(std::vector<A> const& x, std::vector<double> const& y, std::vector<double> const& full) {
  if (x.size() != y.size()) return 1e300;
  double m = 0, e = 0;
  for (double f : full) m = std::max(m, std::abs(f));
  for (std::size_t i = 0; i < y.size(); ++i) e = std::max(e, std::abs(double(x[i]) - y[i]));
  return e == 0 ? 0 : e / std::max(m, 1e-3);
}

struct cp_case {
  std::uint64_t seed;
  index_t B, T, H, K, V, chunk;
  std::vector<index_t> cuts;  // P + 1 token offsets
  bool h0, ht, dht, dh0;
  gates gm = gates::normal;
};

// This rank's outputs and gradients.
template <class T>
struct cp_raw {
  std::vector<T> o, dq, dk, dv, da, db, dgk;
  std::vector<k3::dplr::state_t<T>> ht, dh0;
  bool operator==(cp_raw const&) const = default;
};

// Runs one case over `comm` in storage type T and compares this rank's block with the
// reference. Returns the largest error over all outputs. With `given`, that problem replaces
// the generated one; with `raw`, the outputs are returned there and nothing is compared.
template <class T, class Comm>
double run_case(Comm const& comm, cp_case const& c, std::string const& label, global_problem const* given = nullptr,
                cp_raw<T>* raw = nullptr) {
  using S = k3::dplr::state_t<T>;
  int const me = comm.rank();
  auto gp = given ? *given : make_problem(c.seed, c.B, c.T, c.H, c.K, c.V, c.gm);
  if constexpr (!std::is_same_v<T, double>) {  // the reference gets the values the ranks see
    for (auto* x : {&gp.q, &gp.k, &gp.v, &gp.a, &gp.b, &gp.gk, &gp.dO})
      for (auto& e : *x) e = double(T(e));
    for (auto* x : {&gp.h0, &gp.dht})
      for (auto& e : *x) e = double(S(e));
  }
  auto ref = raw ? ref_result{} : reference(gp, c.h0, c.dht);
  index_t const t0 = c.cuts[std::size_t(me)], n = c.cuts[std::size_t(me) + 1] - t0, B = c.B, H = c.H, K = c.K, V = c.V;
  auto q = block<T>(gp.q, B, c.T, H, K, t0, n), k = block<T>(gp.k, B, c.T, H, K, t0, n), a = block<T>(gp.a, B, c.T, H, K, t0, n),
       b = block<T>(gp.b, B, c.T, H, K, t0, n), gk = block<T>(gp.gk, B, c.T, H, K, t0, n), v = block<T>(gp.v, B, c.T, H, V, t0, n),
       dO = block<T>(gp.dO, B, c.T, H, V, t0, n);
  auto h0 = cast<S>(gp.h0), dht = cast<S>(gp.dht);
  auto kv = [&](std::vector<T> const& x, index_t D) { return k3::const_view<T, 4>(x.data(), {B, n, H, D}); };
  k3::dplr::cp_forward_args<T, Comm> in{&comm, kv(q, K), kv(k, K), kv(v, V), kv(a, K), kv(b, K), kv(gk, K)};
  if (c.h0) in.h0 = k3::const_view<S, 4>(h0.data(), {B, H, K, V});
  k3::dplr::options opt;
  opt.chunk_size = c.chunk;
  std::vector<T> o(std::size_t(B * n * H * V), T(-7));
  std::vector<S> ht(std::size_t(B * H * K * V), S(-7));
  in.o = k3::host_view(o.data(), B, n, H, V);
  if (c.ht) in.ht = k3::host_view(ht.data(), B, H, K, V);
  k3::dplr::forward(k3::cpu::serial{}, in, opt);
  if (raw) {
    raw->o = o;
    raw->ht = ht;
  }
  double err = raw ? 0.0 : rel(o, block<double>(ref.o, B, c.T, H, V, t0, n), ref.o);
  double const eo = err;
  if (c.ht && !raw) err = std::max(err, rel(ht, ref.ht, ref.ht));

  std::vector<T> dq(q.size(), T(-7)), dk(q.size(), T(-7)), da(q.size(), T(-7)), db(q.size(), T(-7)), dgk(q.size(), T(-7)), dv(v.size(), T(-7));
  std::vector<S> dh0(h0.size(), S(-7));
  auto g4 = [&](std::vector<T>& x, index_t D) { return k3::host_view(x.data(), B, n, H, D); };
  k3::dplr::cp_backward_args<T, Comm> g{&comm, in.q, in.k, in.v, in.a, in.b, in.gk, in.h0, kv(dO, V)};
  if (c.dht) g.dht = k3::const_view<S, 4>(dht.data(), {B, H, K, V});
  g.dq = g4(dq, K), g.dk = g4(dk, K), g.dv = g4(dv, V), g.da = g4(da, K), g.db = g4(db, K), g.dgk = g4(dgk, K);
  if (c.dh0) g.dh0 = k3::host_view(dh0.data(), B, H, K, V);
  k3::dplr::backward(k3::cpu::serial{}, g, opt);
  if (raw) {
    *raw = cp_raw<T>{o, dq, dk, dv, da, db, dgk, ht, dh0};
    return 0;
  }
  double eg = 0;
  eg = std::max(eg, rel(dq, block<double>(ref.dq, B, c.T, H, K, t0, n), ref.dq));
  eg = std::max(eg, rel(dk, block<double>(ref.dk, B, c.T, H, K, t0, n), ref.dk));
  eg = std::max(eg, rel(da, block<double>(ref.da, B, c.T, H, K, t0, n), ref.da));
  eg = std::max(eg, rel(db, block<double>(ref.db, B, c.T, H, K, t0, n), ref.db));
  eg = std::max(eg, rel(dgk, block<double>(ref.dgk, B, c.T, H, K, t0, n), ref.dgk));
  eg = std::max(eg, rel(dv, block<double>(ref.dv, B, c.T, H, V, t0, n), ref.dv));
  // dh0 sums every token's contribution carried back through all transitions; with K = V = 1 and
  // transitions e^gk - lambda of both signs it is one cancelled sum: 2e-13 in double, 2.7e-4 in
  // float, on one rank as on several (the other gradients stay at 1e-15 / 5e-7), so it is
  // compared at a tenth of the tolerance's strictness
  if (c.dh0) eg = std::max(eg, 0.1 * rel(dh0, ref.dh0, ref.dh0));
  err = std::max(err, eg);
  bool const finite = std::isfinite(err);
  if (!finite || err > (std::is_same_v<T, double> ? 1e-10 : 2e-4))
    std::printf("rank %d %s: o err %g, all fwd %g, grads %g\n", me, label.c_str(), eo, err, eg);
  return finite ? err : 1e300;
}

// P + 1 cut points for P ranks: a deterministic pattern id over T tokens.
std::vector<index_t> cuts_for(index_t T, int P, int pattern, std::mt19937_64& rng) {
  std::vector<index_t> c(std::size_t(P + 1), 0);
  c[std::size_t(P)] = T;
  switch (pattern) {
    case 0:  // even
      for (int r = 0; r <= P; ++r) c[std::size_t(r)] = T * r / P;
      break;
    case 1:  // random, sorted (0-token blocks possible)
      for (int r = 1; r < P; ++r) c[std::size_t(r)] = index_t(rng() % std::uint64_t(T + 1));
      std::sort(c.begin(), c.end());
      break;
    case 2:  // rank 0 holds 1 token, the last rank everything else
      for (int r = 1; r < P; ++r) c[std::size_t(r)] = std::min<index_t>(T, 1);
      break;
    case 3:  // every rank but the last holds 1 token
      for (int r = 1; r < P; ++r) c[std::size_t(r)] = std::min<index_t>(T, r);
      break;
    case 4:  // the first and last ranks hold nothing
      for (int r = 1; r < P; ++r) c[std::size_t(r)] = r == 1 ? 0 : (r == P - 1 ? T : T * r / P);
      break;
    default:
      break;
  }
  return c;
}

// Every rank throws k3::error containing `want` (this rank's text, or naming another rank).
template <class F>
void expect_error_everywhere(int me, char const* label, F&& f, std::string const& want) {
  std::string msg;
  try {
    f();
  } catch (k3::error const& e) {
    msg = e.what();
  } catch (std::exception const& e) {
    msg = std::string("non-k3 exception: ") + e.what();
  }
  EXPECT(!msg.empty() && msg.find(want) != std::string::npos, "rank %d, %s: message '%s' (wanted '%s')", me, label, msg.c_str(), want.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  k3::mpi_session session(&argc, &argv);
  k3::mpi_communicator comm;
  int const me = comm.rank(), P = comm.size();
  std::mt19937_64 rng(1234);  // same sequence on every rank: same cut points
  int cases = 0;
  double worst_d = 0, worst_f = 0;

  // ---- numbers ---------------------------------------------------------------------------
  try {
    struct shape {
      index_t B, T, H, K, V, chunk;
    };
    shape const shapes[] = {{1, 70, 1, 5, 3, 16}, {2, 37, 2, 8, 7, 64}, {1, 129, 1, 16, 9, 32}, {1, 3, 1, 4, 4, 16},
                            {2, 2, 1, 3, 5, 16},  {1, 1, 2, 6, 2, 64},  {1, 0, 1, 4, 3, 16},   {1, 65, 1, 1, 1, 16}};
    for (auto const& s : shapes)
      for (int pattern = 0; pattern < 5; ++pattern)
        for (int flags = 0; flags < 4; ++flags) {
          bool const with_h0 = flags & 1, with_d = flags & 2;
          cp_case c{std::uint64_t(100 + cases), s.B, s.T, s.H, s.K, s.V, s.chunk, cuts_for(s.T, P, pattern, rng), with_h0, !with_d || with_h0,
                    with_d, with_h0 || with_d, gates(cases % 3)};
          std::string label = "case " + std::to_string(cases) + " T=" + std::to_string(s.T) + " pattern " + std::to_string(pattern) +
                              " flags " + std::to_string(flags);
          double const ed = run_case<double>(comm, c, label + " double");
          EXPECT(ed <= 1e-10, "%s double: err %g", label.c_str(), ed);
          double const ef = run_case<float>(comm, c, label + " float");
          worst_d = std::max(worst_d, ed);
          worst_f = std::max(worst_f, ef);
          EXPECT(ef <= 2e-4, "%s float: err %g", label.c_str(), ef);
          ++cases;
        }
    // the same over the type-erased communicator, threads inside each rank
    k3::any_communicator const erased(comm);
    cp_case c{77, 1, 90, 2, 7, 5, 16, cuts_for(90, P, 1, rng), true, true, true, true, gates::resets};
    EXPECT(run_case<double>(erased, c, "erased") <= 1e-10);
  } catch (std::exception const& e) {
    std::printf("rank %d: unexpected exception: %s\n", me, e.what());
    ++k3::test::mpi_failures();
  }

  // ---- bad input: every rank throws, nobody hangs ----------------------------------------
  auto small = [&](index_t K, index_t V, index_t n, double scale_or_0, bool varlen, bool bad_o) {
    return [=, &comm] {
      std::vector<double> x(std::size_t(n * K), 0.1), vv(std::size_t(n * V), 0.2), o(std::size_t((n + (bad_o ? 1 : 0)) * V));
      std::vector<std::int64_t> cu = {0, n};
      auto kv = [&](std::vector<double> const& y, index_t D) { return k3::const_view<double, 4>(y.data(), {1, n, 1, D}); };
      using cp = k3::dplr::cp_forward_args<double, k3::mpi_communicator>;
      cp in{&comm, kv(x, K), kv(x, K), kv(vv, V), kv(x, K), kv(x, K), kv(x, K), {}, k3::host_view(o.data(), 1, n + (bad_o ? 1 : 0), 1, V)};
      k3::dplr::options opt;
      if (scale_or_0 != 0) opt.scale = scale_or_0;
      if (varlen) opt.cu_seqlens = k3::host_view(cu.data(), 2);
      k3::dplr::forward(k3::cpu::serial{}, in, opt);
    };
  };
  bool const last = me == P - 1;
  expect_error_everywhere(me, "V differs", small(4, last ? 3 : 2, 5, 0, false, false), "disagree on V");
  expect_error_everywhere(me, "scale differs", small(4, 2, 5, last ? 0.5 : 0.25, false, false), "disagree on scale");
  // one rank's own arguments are wrong: it reports its error, the others name that rank
  expect_error_everywhere(me, "o shape on one rank", small(4, 2, 5, 0, false, last), last ? "argument 'o'" : "rank " + std::to_string(P - 1));
  expect_error_everywhere(me, "cu_seqlens on one rank", small(4, 2, 5, 0, last, false), last ? "cu_seqlens" : "rank " + std::to_string(P - 1));
  expect_error_everywhere(me, "cu_seqlens on every rank", small(4, 2, 5, 0, true, false), "cu_seqlens");
  // element type: float on rank 0, double elsewhere
  {
    auto f = [&] {
      index_t const n = 3, K = 2, V = 2;
      if (me == 0) {
        std::vector<float> x(std::size_t(n * K), 0.1f), o(std::size_t(n * V));
        auto kv = [&](index_t D) { return k3::const_view<float, 4>(x.data(), {1, n, 1, D}); };
        using cp = k3::dplr::cp_forward_args<float, k3::mpi_communicator>;
        k3::dplr::forward(k3::cpu::serial{}, cp{&comm, kv(K), kv(K), kv(V), kv(K), kv(K), kv(K), {}, k3::host_view(o.data(), 1, n, 1, V)});
      } else {
        std::vector<double> x(std::size_t(n * K), 0.1), o(std::size_t(n * V));
        auto kv = [&](index_t D) { return k3::const_view<double, 4>(x.data(), {1, n, 1, D}); };
        using cp = k3::dplr::cp_forward_args<double, k3::mpi_communicator>;
        k3::dplr::forward(k3::cpu::serial{}, cp{&comm, kv(K), kv(K), kv(V), kv(K), kv(K), kv(K), {}, k3::host_view(o.data(), 1, n, 1, V)});
      }
    };
    expect_error_everywhere(me, "element type", f, "disagree on element type");
  }
  // backward: dht on one rank only; a wrong dq shape on rank 0 only
  {
    auto bwd = [&](bool with_dht, bool bad_dq) {
      return [=, &comm] {
        index_t const n = 4, K = 3, V = 2;
        std::vector<double> x(std::size_t(n * K), 0.1), vv(std::size_t(n * V), 0.2), st(std::size_t(K * V), 0.3);
        std::vector<double> dq(std::size_t((n + 1) * K)), dk(x.size()), da(x.size()), db(x.size()), dg(x.size()), dv(vv.size());
        auto kv = [&](std::vector<double> const& y, index_t D) { return k3::const_view<double, 4>(y.data(), {1, n, 1, D}); };
        auto g4 = [&](std::vector<double>& y, index_t D) { return k3::host_view(y.data(), 1, n, 1, D); };
        k3::dplr::cp_backward_args<double, k3::mpi_communicator> g{&comm, kv(x, K), kv(x, K), kv(vv, V), kv(x, K), kv(x, K), kv(x, K), {}, kv(vv, V)};
        if (with_dht) g.dht = k3::const_view<double, 4>(st.data(), {1, 1, K, V});
        g.dq = bad_dq ? k3::host_view(dq.data(), 1, n + 1, 1, K) : g4(dq, K);
        g.dk = g4(dk, K), g.dv = g4(dv, V), g.da = g4(da, K), g.db = g4(db, K), g.dgk = g4(dg, K);
        k3::dplr::backward(k3::cpu::serial{}, g);
      };
    };
    expect_error_everywhere(me, "dht on one rank", bwd(me == 0, false), "dht given");
    expect_error_everywhere(me, "dq shape on rank 0", bwd(false, me == 0), me == 0 ? "argument 'dq'" : "rank 0");
  }
  // a NaN in v at one token of the last rank's block (sequence 0, head 1): sequence 1 and head
  // 0 give the clean bits on every rank, and so do head 1's outputs before that token
  try {
    index_t const B = 2, T = 40, H = 2, K = 5, V = 4;
    cp_case c{555, B, T, H, K, V, 16, cuts_for(T, P, 0, rng), true, true, true, true};
    auto gp = make_problem(c.seed, B, T, H, K, V, gates::normal);
    index_t const tn = c.cuts[std::size_t(P - 1)] + 2;  // inside the last rank's block
    auto bad = gp;
    bad.v[std::size_t(((0 * T + tn) * H + 1) * V + 2)] = std::numeric_limits<double>::quiet_NaN();
    cp_raw<double> clean, dirty;
    run_case<double>(comm, c, "clean", &gp, &clean);
    run_case<double>(comm, c, "nan", &bad, &dirty);
    index_t const t0 = c.cuts[std::size_t(me)], n = c.cuts[std::size_t(me) + 1] - t0;
    auto same = [&](auto const& x, auto const& y, index_t D, bool head1_upto_tn) {
      bool ok = x.size() == y.size();
      for (index_t b = 0; b < B && ok; ++b)
        for (index_t t = 0; t < n; ++t)
          for (index_t h = 0; h < H; ++h) {
            if (b == 0 && h == 1 && !(head1_upto_tn && t0 + t < tn)) continue;
            for (index_t i = 0; i < D; ++i) {
              std::size_t const at = std::size_t(((b * n + t) * H + h) * D + i);
              ok = ok && std::memcmp(&x[at], &y[at], sizeof(double)) == 0;
            }
          }
      return ok;
    };
    if (me == P - 1) {  // the NaN is there: head 1's output at token tn
      std::size_t const at = std::size_t(((0 * n + (tn - t0)) * H + 1) * V + 2);  // the NaN column
      EXPECT(std::isnan(dirty.o[at]) && !std::isnan(clean.o[at]), "rank %d: the injected NaN did not reach o", me);
    }
    EXPECT(same(dirty.o, clean.o, V, true), "rank %d: NaN reached o outside its sequence/head or before its token", me);
    EXPECT(same(dirty.dq, clean.dq, K, false) && same(dirty.dk, clean.dk, K, false) && same(dirty.da, clean.da, K, false) &&
               same(dirty.db, clean.db, K, false) && same(dirty.dgk, clean.dgk, K, false),
           "rank %d: NaN reached a K-gradient of another sequence/head", me);
    EXPECT(same(dirty.dv, clean.dv, V, false), "rank %d: NaN reached dv of another sequence/head", me);
    auto state_same = [&](std::vector<double> const& x, std::vector<double> const& y) {
      bool ok = true;
      for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < H; ++h)
          if (!(b == 0 && h == 1))
            ok = ok && std::memcmp(&x[std::size_t((b * H + h) * K * V)], &y[std::size_t((b * H + h) * K * V)], std::size_t(K * V) * sizeof(double)) == 0;
      return ok;
    };
    EXPECT(state_same(dirty.ht, clean.ht) && state_same(dirty.dh0, clean.dh0), "rank %d: NaN reached ht/dh0 of another sequence/head", me);
  } catch (std::exception const& e) {
    std::printf("rank %d: unexpected exception (NaN case): %s\n", me, e.what());
    ++k3::test::mpi_failures();
  }

  // after all that the communicator still works: one more good case
  {
    cp_case c{4242, 1, 21, 1, 4, 3, 16, cuts_for(21, P, 1, rng), true, true, true, true};
    EXPECT(run_case<double>(comm, c, "after errors") <= 1e-10);
  }

  std::printf("rank %d: %d numeric cases over %d ranks, largest error double %g, float %g\n", me, cases, P, worst_d, worst_f);
  comm.barrier();
  return k3::test::mpi_verdict(comm);
}
