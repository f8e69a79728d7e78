// Runs under mpirun -np 2 and 4. No doctest: every rank must take part in every exchange.
// The expert-parallel Stable LatentMoE layer (k3/moe/expert_parallel.hpp) on R ranks with S
// tokens each must equal the single-process layer over all R·S tokens: y, indices, weights and
// dx of this rank's tokens, the gradients of its experts (replica gradients reduced in) and the
// non-expert gradients, to 1e-12 in double and 1e-5 in float. Routing skewed towards rank 0's
// experts makes MoonEP place pairs away from home (replica weights); every step processes
// exactly S·K pairs per rank, and no step reallocates a buffer.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "k3/backend/cpu/simd.hpp"
#include "k3/comm/mpi.hpp"
#include "k3/moe/expert_parallel.hpp"
#include "support/metrics.hpp"
#include "support/mpi_check.hpp"

namespace moe = k3::moe;
using k3::index_t;

namespace {

struct shape {
  index_t S, d, E, l, f, s, F, k;
};

template <class T>
std::vector<T> gaussian(std::size_t n, unsigned seed, double scale) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> nd(0.0, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(nd(g));
  return v;
}

template <class T>
std::vector<double> widen(T const* p, std::size_t n) {
  return std::vector<double>(p, p + n);
}

template <class T>
struct weights {
  std::vector<T> wr, bias, wd, wg, wu, wdn, nw, wup, wsg, wsu, wsd;
};

template <class T>
weights<T> make_weights(shape const& m, int R, unsigned seed, bool skew) {
  weights<T> w;
  w.wr = gaussian<T>(static_cast<std::size_t>(m.E * m.d), seed + 1, 0.5);
  w.bias = gaussian<T>(static_cast<std::size_t>(m.E), seed + 2, 0.1);
  // Skewed routing: rank 0's experts get a large bias, so other ranks must host them.
  if (skew)
    for (index_t e = 0; e < m.E / R; ++e) w.bias[static_cast<std::size_t>(e)] += T(3);
  w.wd = gaussian<T>(static_cast<std::size_t>(m.l * m.d), seed + 3, 0.4);
  w.wg = gaussian<T>(static_cast<std::size_t>(m.E * m.f * m.l), seed + 4, 0.5);
  w.wu = gaussian<T>(w.wg.size(), seed + 5, 0.5);
  w.wdn = gaussian<T>(w.wg.size(), seed + 6, 0.4);
  w.nw = gaussian<T>(static_cast<std::size_t>(m.l), seed + 7, 0.3);
  for (auto& v : w.nw) v += T(1);
  w.wup = gaussian<T>(static_cast<std::size_t>(m.d * m.l), seed + 8, 0.4);
  w.wsg = gaussian<T>(static_cast<std::size_t>(m.s * m.F * m.d), seed + 9, 0.4);
  w.wsu = gaussian<T>(w.wsg.size(), seed + 10, 0.4);
  w.wsd = gaussian<T>(w.wsg.size(), seed + 11, 0.4);
  return w;
}

// Every output of the layer (forward and backward) on some tokens and experts.
template <class T>
struct outputs {
  std::vector<T> y, p, dx, dwr, dwd, dwg, dwu, dwdn, dnw, dwup, dwsg, dwsu, dwsd;
  std::vector<std::int64_t> idx;
  outputs(shape const& m, index_t T_, index_t experts)
      : y(static_cast<std::size_t>(T_ * m.d)),
        p(static_cast<std::size_t>(T_ * m.k)),
        dx(y.size()),
        dwr(static_cast<std::size_t>(m.E * m.d)),
        dwd(static_cast<std::size_t>(m.l * m.d)),
        dwg(static_cast<std::size_t>(experts * m.f * m.l)),
        dwu(dwg.size()),
        dwdn(dwg.size()),
        dnw(static_cast<std::size_t>(m.l)),
        dwup(static_cast<std::size_t>(m.d * m.l)),
        dwsg(static_cast<std::size_t>(m.s * m.F * m.d)),
        dwsu(dwsg.size()),
        dwsd(dwsg.size()),
        idx(p.size()) {}
};

template <class T>
moe::latent_moe_args<T> layer_args(shape const& m, weights<T> const& w, T const* x, index_t T_, index_t e0, index_t experts, outputs<T>& o) {
  std::size_t const fl = static_cast<std::size_t>(m.f * m.l);
  moe::latent_moe_args<T> a{{x, {T_, m.d}},
                            {w.wr.data(), {m.E, m.d}},
                            {w.bias.data(), {m.E}},
                            {w.wd.data(), {m.l, m.d}},
                            {w.wg.data() + static_cast<std::size_t>(e0) * fl, {experts, m.f, m.l}},
                            {w.wu.data() + static_cast<std::size_t>(e0) * fl, {experts, m.f, m.l}},
                            {w.wdn.data() + static_cast<std::size_t>(e0) * fl, {experts, m.l, m.f}},
                            {w.nw.data(), {m.l}},
                            {w.wup.data(), {m.d, m.l}},
                            {},
                            {},
                            {},
                            {o.y.data(), {T_, m.d}},
                            {o.idx.data(), {T_, m.k}},
                            {o.p.data(), {T_, m.k}}};
  if (m.s > 0) {
    a.ws_gate = {w.wsg.data(), {m.s, m.F, m.d}};
    a.ws_up = {w.wsu.data(), {m.s, m.F, m.d}};
    a.ws_down = {w.wsd.data(), {m.s, m.d, m.F}};
  }
  return a;
}

template <class T>
moe::latent_moe_gradients<T> grad_args(shape const& m, T const* dy, index_t T_, index_t experts, outputs<T>& o) {
  moe::latent_moe_gradients<T> g{{dy, {T_, m.d}},
                                 {o.dx.data(), {T_, m.d}},
                                 {o.dwr.data(), {m.E, m.d}},
                                 {o.dwd.data(), {m.l, m.d}},
                                 {o.dwg.data(), {experts, m.f, m.l}},
                                 {o.dwu.data(), {experts, m.f, m.l}},
                                 {o.dwdn.data(), {experts, m.l, m.f}},
                                 {o.dnw.data(), {m.l}},
                                 {o.dwup.data(), {m.d, m.l}}};
  if (m.s > 0) {
    g.dws_gate = {o.dwsg.data(), {m.s, m.F, m.d}};
    g.dws_up = {o.dwsu.data(), {m.s, m.F, m.d}};
    g.dws_down = {o.dwsd.data(), {m.s, m.d, m.F}};
  }
  return g;
}

template <class T>
void check_layer(k3::mpi_communicator const& comm, shape const& m, unsigned seed, bool skew, double tol, char const* what) {
  int const R = comm.size(), me = comm.rank();
  index_t const per = m.E / R, N = m.S * R;
  moe::latent_moe_options o;
  o.k = m.k;
  o.scale = 1.5;
  k3::cpu::threads<> cpu(2);
  weights<T> const w = make_weights<T>(m, R, seed, skew);
  moe::moonep_buffers<T> buffers(R, m.S, m.k, m.E, m.l, m.f);
  auto const addresses = buffers.addresses();
  moe::latent_moe_saved<T> saved;
  std::int64_t hosted = 0;
  for (int step = 0; step < 2; ++step) {
    // Every rank builds the whole batch (same seed) and the single-process layer on it.
    auto const x = gaussian<T>(static_cast<std::size_t>(N * m.d), seed + 100 + static_cast<unsigned>(step), 1.0);
    auto const dy = gaussian<T>(x.size(), seed + 200 + static_cast<unsigned>(step), 1.0);
    outputs<T> ref(m, N, m.E);
    auto ra = layer_args<T>(m, w, x.data(), N, 0, m.E, ref);
    moe::latent_moe_backward(cpu, moe::latent_moe_backward_args<T>{ra, grad_args<T>(m, dy.data(), N, m.E, ref)}, o);

    outputs<T> got(m, m.S, per);
    std::size_t const mine = static_cast<std::size_t>(me * m.S * m.d);
    auto la = layer_args<T>(m, w, x.data() + mine, m.S, me * per, per, got);
    la.saved = &saved;
    moe::moonep_latent_moe_args<T, k3::mpi_communicator> a{&comm, &buffers, la};
    moe::moonep_latent_moe_forward(cpu, a, o);
    std::fill(got.dx.begin(), got.dx.end(), T(7));
    std::fill(got.dwg.begin(), got.dwg.end(), T(7));
    moe::moonep_latent_moe_backward(cpu, moe::moonep_latent_moe_backward_args<T, k3::mpi_communicator>{a, grad_args<T>(m, dy.data() + mine, m.S, per, got)}, o);
    hosted += static_cast<std::int64_t>(buffers.replicas().size());

    std::size_t const tok = static_cast<std::size_t>(m.S * m.d), tk = static_cast<std::size_t>(m.S * m.k);
    std::size_t const fl = static_cast<std::size_t>(m.f * m.l) * static_cast<std::size_t>(per), e0 = static_cast<std::size_t>(me * per * m.f * m.l);
    EXPECT(std::equal(got.idx.begin(), got.idx.end(), ref.idx.begin() + static_cast<std::ptrdiff_t>(me * tk)), "%s step %d: indices", what, step);
    auto cmp = [&](char const* name, std::vector<T> const& g, std::vector<T> const& r, std::size_t off, std::size_t n) {
      double const e = k3::test::rel_max(widen(g.data(), g.size()), widen(r.data() + off, n));
      EXPECT(g.size() == n && e < tol, "%s step %d: %s rel %.3g (tol %.1g)", what, step, name, e, tol);
    };
    cmp("y", got.y, ref.y, mine, tok);
    cmp("weights", got.p, ref.p, static_cast<std::size_t>(me) * tk, tk);
    cmp("dx", got.dx, ref.dx, mine, tok);
    cmp("dwe_gate", got.dwg, ref.dwg, e0, fl);
    cmp("dwe_up", got.dwu, ref.dwu, e0, fl);
    cmp("dwe_down", got.dwdn, ref.dwdn, e0, fl);
    cmp("dw_router", got.dwr, ref.dwr, 0, ref.dwr.size());
    cmp("dw_down", got.dwd, ref.dwd, 0, ref.dwd.size());
    cmp("dnorm_weight", got.dnw, ref.dnw, 0, ref.dnw.size());
    cmp("dw_up", got.dwup, ref.dwup, 0, ref.dwup.size());
    cmp("dws_gate", got.dwsg, ref.dwsg, 0, ref.dwsg.size());
    cmp("dws_up", got.dwsu, ref.dwsu, 0, ref.dwsu.size());
    cmp("dws_down", got.dwsd, ref.dwsd, 0, ref.dwsd.size());
    // Every rank processed exactly S·K pairs (the receive counts of the plan), and the buffers
    // are the ones allocated at construction.
    index_t processed = 0;
    for (index_t c : buffers.recv_count) processed += c;
    EXPECT(processed == m.S * m.k, "%s step %d: processed %lld pairs, S*K = %lld", what, step, (long long)processed, (long long)(m.S * m.k));
    EXPECT(buffers.addresses() == addresses, "%s step %d: a buffer was reallocated", what, step);
  }
  std::vector<std::int64_t> total = {hosted};
  comm.all_reduce_sum(k3::host_view(total.data(), 1));
  EXPECT(!skew || total[0] > 0, "%s: skewed routing placed no pair away from home", what);
}

}  // namespace

int main(int argc, char** argv) {
  k3::mpi_session session(&argc, &argv);
  k3::mpi_communicator comm;
  int const R = comm.size();
  // E = 8 experts over 2 or 4 ranks; odd widths; k = 3 of 8 and k = 1.
  check_layer<double>(comm, {5, 6, 8, 5, 3, 1, 4, 3}, 11, true, 1e-12, "double, skewed");
  check_layer<double>(comm, {4, 5, 8, 4, 3, 2, 3, 3}, 21, false, 1e-12, "double, shared x2");
  check_layer<double>(comm, {3, 4, 8, 3, 2, 0, 0, 1}, 31, true, 1e-12, "double, k = 1, no shared");
  check_layer<float>(comm, {6, 8, 8, 6, 5, 1, 4, 3}, 41, true, 1e-5, "float, skewed");
  // Bad input is an error on every rank (no hang): buffers made for another k.
  moe::moonep_buffers<double> wrong(R, 5, 2, 8, 5, 3);
  shape const m{5, 6, 8, 5, 3, 1, 4, 3};
  weights<double> const w = make_weights<double>(m, R, 51, false);
  auto const x = gaussian<double>(static_cast<std::size_t>(m.S * m.d), 52, 1.0);
  outputs<double> got(m, m.S, m.E / R);
  moe::latent_moe_options o;
  o.k = m.k;
  auto la = layer_args<double>(m, w, x.data(), m.S, comm.rank() * (m.E / R), m.E / R, got);
  bool threw = false;
  try {
    moe::moonep_latent_moe_forward(k3::cpu::threads<>(1), moe::moonep_latent_moe_args<double, k3::mpi_communicator>{&comm, &wrong, la}, o);
  } catch (k3::error const& e) {
    threw = std::strstr(e.what(), "argument 'buffers'") != nullptr;
  }
  EXPECT(threw, "buffers for another k must be an error naming 'buffers'");
  // NaN in one rank's token: every rank throws (that rank names the token).
  auto xn = x;
  if (comm.rank() == R - 1) xn[7] = NAN;
  la.x = {xn.data(), {m.S, m.d}};
  moe::moonep_buffers<double> right(R, m.S, m.k, m.E, m.l, m.f);
  threw = false;
  std::string msg;
  try {
    moe::moonep_latent_moe_forward(k3::cpu::threads<>(1), moe::moonep_latent_moe_args<double, k3::mpi_communicator>{&comm, &right, la}, o);
  } catch (k3::error const& e) {
    threw = true;
    msg = e.what();
  }
  EXPECT(threw, "NaN on one rank must throw on every rank");
  EXPECT(comm.rank() != R - 1 || msg.find("argument 'x': non-finite value at [1, 1] (token 1)") != std::string::npos, "message: %s", msg.c_str());
  return k3::test::mpi_verdict(comm);
}
