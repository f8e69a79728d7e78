// Chunked DPLR with NaN and +-Inf inputs: a non-finite value at token t of one (sequence,
// head) must leave every output before t (and every other sequence and head) bit for bit as
// without it, on every backend and long-sequence path, at the first, a middle and the last
// token of a chunk, with T not a multiple of the chunk and in the second of two packed
// sequences. The backward: gradients of other sequences and heads unchanged; with the
// "prefix setup" (zero do at and after t, zero dht for that head) a non-finite k or v at t
// leaves the gradients before t bit for bit unchanged (gradients before t never read later k
// or v; later q, a, b, gk do reach them through the state-gradient chain, as in the
// recurrent reference). Also: finite prefix invariance, bit for bit.
#include <doctest/doctest.h>

#include <cstring>

#include "dplr_test_util.hpp"

using namespace dplr_test;
using k3::index_t;

namespace {

template <class T>
bool same_bits(T x, T y) {
  return std::memcmp(&x, &y, sizeof(T)) == 0;
}

enum class input { q, k, v, a, b, gk };
char const* name(input i) {
  char const* n[] = {"q", "k", "v", "a", "b", "gk"};
  return n[int(i)];
}

template <class T>
std::vector<T>& field(problem<T>& p, input i) {
  switch (i) {
    case input::q: return p.q;
    case input::k: return p.k;
    case input::v: return p.v;
    case input::a: return p.a;
    case input::b: return p.b;
    default: return p.gk;
  }
}

// Element (sequence n, token t of that sequence, head h) of a token-major [B,T,H,D] buffer.
struct layout {
  index_t B, T, H;
  std::vector<std::int64_t> cu;
  index_t row(index_t n, index_t t) const { return cu.empty() ? n * T + t : cu[std::size_t(n)] + t; }  // row in B*T
  std::size_t at(index_t n, index_t t, index_t h, index_t D, index_t d) const { return std::size_t((row(n, t) * H + h) * D + d); }
  index_t len(index_t n) const { return cu.empty() ? T : index_t(cu[std::size_t(n) + 1] - cu[std::size_t(n)]); }
  index_t N() const { return cu.empty() ? B : index_t(cu.size()) - 1; }
};

// Every element of x and y over [B,T,H,D] is bitwise equal, except those of (bn, bh) at
// tokens >= bt. Returns the number of mismatches (reported once).
template <class T>
int diff_outside(layout const& L, std::vector<T> const& x, std::vector<T> const& y, index_t D, index_t bn, index_t bh, index_t bt, char const* what) {
  int bad = 0;
  for (index_t n = 0; n < L.N(); ++n)
    for (index_t t = 0; t < L.len(n); ++t)
      for (index_t h = 0; h < L.H; ++h) {
        if (n == bn && h == bh && t >= bt) continue;
        for (index_t d = 0; d < D; ++d) {
          std::size_t i = L.at(n, t, h, D, d);
          if (!same_bits(x[i], y[i])) {
            if (bad++ == 0) MESSAGE(std::string(what) << ": sequence " << n << " token " << t << " head " << h << " col " << d << ": " << x[i] << " vs " << y[i]);
          }
        }
      }
  return bad;
}

// States [N,H,K,V]: every (sequence, head) other than (bn, bh) bitwise equal.
template <class S>
int diff_states(layout const& L, std::vector<S> const& x, std::vector<S> const& y, index_t KV, index_t bn, index_t bh) {
  int bad = 0;
  for (index_t n = 0; n < L.N(); ++n)
    for (index_t h = 0; h < L.H; ++h) {
      if (n == bn && h == bh) continue;
      for (index_t e = 0; e < KV; ++e)
        bad += !same_bits(x[std::size_t((n * L.H + h) * KV + e)], y[std::size_t((n * L.H + h) * KV + e)]);
    }
  return bad;
}

template <class T>
bool any_nonfinite_at(layout const& L, std::vector<T> const& x, index_t D, index_t n, index_t h, index_t t) {
  for (index_t d = 0; d < D; ++d)
    if (!std::isfinite(double(x[L.at(n, t, h, D, d)]))) return true;
  return false;
}

template <class T>
problem<T> convert(problem<double> const& pd) {
  problem<T> p;
  p.B = pd.B, p.T_ = pd.T_, p.H = pd.H, p.K = pd.K, p.V = pd.V, p.N = pd.N, p.with_h0 = pd.with_h0, p.cu = pd.cu;
  auto cvt = [](auto const& x) { return std::vector<T>(x.begin(), x.end()); };
  p.q = cvt(pd.q), p.k = cvt(pd.k), p.v = cvt(pd.v), p.a = cvt(pd.a), p.b = cvt(pd.b), p.gk = cvt(pd.gk);
  p.h0.assign(pd.h0.begin(), pd.h0.end());
  return p;
}

// The backends and long-sequence paths every check runs on.
template <class F>
void for_each_path(index_t chunk, problem<double> const& shape, F&& f) {
  auto o = shape.options(chunk);
  f("serial", chunked_fwd(k3::cpu::serial{}, o), chunked_bwd(k3::cpu::serial{}, o));
  f("simd", chunked_fwd(k3::cpu::simd<>{}, o), chunked_bwd(k3::cpu::simd<>{}, o));
  // 3 threads: fewer (sequence, head) pairs than threads in the varlen single-head case (the
  // single-sequence pipeline), more in the batched case (one pair per thread).
  k3::cpu::threads<> th(3);
  for (auto mode : {k3::dplr::sequence_split::value_split, k3::dplr::sequence_split::segment_maps}) {
    auto om = o;
    om.long_sequence = mode;
    f(mode == k3::dplr::sequence_split::value_split ? "threads value_split" : "threads segment_maps", chunked_fwd(th, om), chunked_bwd(th, om));
  }
}

struct scenario {
  problem<double> p;
  layout L;
  index_t chunk, bn, bh;
  std::vector<index_t> tokens;  // within sequence bn
};

std::vector<scenario> scenarios() {
  std::mt19937_64 rng(91);
  std::vector<scenario> s;
  // B = 2, H = 2, T = 45 (chunk 16: chunks [0,16) [16,32) [32,45)); the bad value in batch 1,
  // head 1, at the first / a middle / the last token of the full chunk 1, the first token
  // overall, and the last token of the partial last chunk.
  {
    auto p = make<double>(rng, 2, 45, 2, 12, 10);
    s.push_back({p, layout{2, 45, 2, {}}, 16, 1, 1, {0, 16, 23, 31, 32, 44}});
  }
  // varlen, one head: sequences of 37 and 53 tokens; the bad value in the second sequence.
  {
    auto p = make<double>(rng, 1, 90, 1, 12, 10, {0, 37, 90});
    s.push_back({p, layout{1, 90, 1, {0, 37, 90}}, 16, 1, 0, {0, 16, 21, 31, 48, 52}});
  }
  return s;
}

template <class T>
void forward_checks() {
  double const vals[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()};
  for (auto const& sc : scenarios()) {
    auto const clean = convert<T>(sc.p);
    for_each_path(sc.chunk, sc.p, [&](char const* path, auto fwd, auto) {
      auto ref = run_fwd(clean, fwd);
      for (input in : {input::q, input::k, input::v, input::a, input::b, input::gk})
        for (double val : vals)
          for (index_t t : sc.tokens) {
            auto bad = clean;
            index_t D = in == input::v ? clean.V : clean.K;
            field(bad, in)[sc.L.at(sc.bn, t, sc.bh, D, 3)] = static_cast<T>(val);
            auto got = run_fwd(bad, fwd);
            INFO(std::string(path) << ": " << std::string(name(in)) << " = " << val << " at token " << t << " of sequence " << sc.bn << " head " << sc.bh);
            CHECK(diff_outside(sc.L, got.o, ref.o, clean.V, sc.bn, sc.bh, t, "o") == 0);
            CHECK(diff_states(sc.L, got.ht, ref.ht, clean.K * clean.V, sc.bn, sc.bh) == 0);
            // The non-finite value does reach its own token's output (a -inf gate is a hard
            // reset: a legitimate, finite case).
            if (!(in == input::gk && val < 0)) CHECK(any_nonfinite_at(sc.L, got.o, clean.V, sc.bn, sc.bh, t));
          }
    });
  }
}

template <class T>
void backward_checks() {
  double const vals[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()};
  std::mt19937_64 rng(92);
  for (auto const& sc : scenarios()) {
    auto const clean = convert<T>(sc.p);
    auto dO0 = randn<T>(rng, clean.nv());
    auto dht0 = randn<k3::dplr::state_t<T>>(rng, clean.ns());
    for (index_t t : sc.tokens) {
      // prefix setup for (bn, bh): no gradient from its outputs at or after t, none from its final state
      auto dO = dO0;
      auto dht = dht0;
      for (index_t u = t; u < sc.L.len(sc.bn); ++u)
        for (index_t d = 0; d < clean.V; ++d) dO[sc.L.at(sc.bn, u, sc.bh, clean.V, d)] = T(0);
      for (index_t e = 0; e < clean.K * clean.V; ++e) dht[std::size_t((sc.bn * clean.H + sc.bh) * clean.K * clean.V + e)] = 0;
      for_each_path(sc.chunk, sc.p, [&](char const* path, auto, auto bwd) {
        auto ref = run_bwd(clean, dO, dht, bwd);
        for (input in : {input::q, input::k, input::v, input::a, input::b, input::gk})
          for (double val : vals) {
            auto bad = clean;
            index_t D = in == input::v ? clean.V : clean.K;
            field(bad, in)[sc.L.at(sc.bn, t, sc.bh, D, 3)] = static_cast<T>(val);
            auto got = run_bwd(bad, dO, dht, bwd);
            INFO(std::string(path) << ": " << std::string(name(in)) << " = " << val << " at token " << t << " of sequence " << sc.bn << " head " << sc.bh);
            // k and v at t reach no gradient before t; the others do through the state-gradient
            // chain (0 * NaN there, as in the recurrent reference): then only other heads and
            // sequences are checked.
            bool const kv = in == input::k || in == input::v;
            index_t from = kv ? t : 0;
            CHECK(diff_outside(sc.L, got.dq, ref.dq, clean.K, sc.bn, sc.bh, from, "dq") == 0);
            CHECK(diff_outside(sc.L, got.dk, ref.dk, clean.K, sc.bn, sc.bh, from, "dk") == 0);
            CHECK(diff_outside(sc.L, got.dv, ref.dv, clean.V, sc.bn, sc.bh, from, "dv") == 0);
            CHECK(diff_outside(sc.L, got.da, ref.da, clean.K, sc.bn, sc.bh, from, "da") == 0);
            CHECK(diff_outside(sc.L, got.db, ref.db, clean.K, sc.bn, sc.bh, from, "db") == 0);
            CHECK(diff_outside(sc.L, got.dgk, ref.dgk, clean.K, sc.bn, sc.bh, from, "dgk") == 0);
            CHECK(diff_states(sc.L, got.dh0, ref.dh0, clean.K * clean.V, sc.bn, sc.bh) == 0);
            if (kv) {
              // the state-gradient chain never reads k or v: dh0 of the bad head too
              CHECK(diff_states(sc.L, got.dh0, ref.dh0, clean.K * clean.V, -1, -1) == 0);
            }
          }
      });
    }
  }
}

}  // namespace

TEST_CASE("chunked DPLR forward: a NaN or Inf at token t leaves everything before t, and other sequences and heads, bit for bit") {
  SUBCASE("double") { forward_checks<double>(); }
  SUBCASE("float") { forward_checks<float>(); }
}

TEST_CASE("chunked DPLR backward: non-finite inputs stay in their head, k and v at t reach no gradient before t") {
  SUBCASE("double") { backward_checks<double>(); }
  SUBCASE("float") { backward_checks<float>(); }
}

// Changing tokens after `cut` (to other finite values) changes no output before the cut, and,
// with zero do from the cut on and no dht, no gradient before it: bit for bit.
TEST_CASE("chunked DPLR prefix invariance (bitwise, finite inputs)") {
  std::mt19937_64 rng(93);
  for (index_t cut : {3, 16, 21, 40}) {
    auto a = make<double>(rng, 1, 45, 1, 12, 10, {}, true);
    auto r = make<double>(rng, 1, 45, 1, 12, 10, {}, true);
    auto b = a;
    auto tail = [&](std::vector<double>& x, std::vector<double> const& y, index_t D) {
      for (std::size_t i = std::size_t(cut * D); i < x.size(); ++i) x[i] = y[i];
    };
    for (input in : {input::q, input::k, input::v, input::a, input::b, input::gk}) tail(field(b, in), field(r, in), in == input::v ? a.V : a.K);
    auto dO = randn<double>(rng, a.nv());
    for (std::size_t i = std::size_t(cut * a.V); i < dO.size(); ++i) dO[i] = 0;
    layout L{1, 45, 1, {}};
    for_each_path(16, a, [&](char const* path, auto fwd, auto bwd) {
      INFO(std::string(path) << " cut " << cut);
      auto fa = run_fwd(a, fwd), fb = run_fwd(b, fwd);
      CHECK(diff_outside(L, fa.o, fb.o, a.V, 0, 0, cut, "o") == 0);
      std::vector<double> none;
      auto ga = run_bwd(a, dO, none, bwd), gb = run_bwd(b, dO, none, bwd);
      CHECK(diff_outside(L, ga.dq, gb.dq, a.K, 0, 0, cut, "dq") == 0);
      CHECK(diff_outside(L, ga.dk, gb.dk, a.K, 0, 0, cut, "dk") == 0);
      CHECK(diff_outside(L, ga.dv, gb.dv, a.V, 0, 0, cut, "dv") == 0);
      CHECK(diff_outside(L, ga.da, gb.da, a.K, 0, 0, cut, "da") == 0);
      CHECK(diff_outside(L, ga.db, gb.db, a.K, 0, 0, cut, "db") == 0);
      CHECK(diff_outside(L, ga.dgk, gb.dgk, a.K, 0, 0, cut, "dgk") == 0);
    });
  }
}

// The transition part M of a segment map never reads k or v (the values enter only N): a NaN
// or Inf there leaves M finite (from the chunk's twin) and equal to the clean M to rounding.
TEST_CASE("segment maps: a non-finite k or v reaches N but not M") {
  std::mt19937_64 rng(94);
  auto const p = make<double>(rng, 1, 45, 1, 12, 10);
  index_t const K = p.K, V = p.V;
  auto maps = [&](problem<double> const& x, auto const& bk, std::vector<double>& M, std::vector<double>& N) {
    M.assign(std::size_t(K * K), 0);
    N.assign(std::size_t(K * V), 0);
    k3::dplr::segment_maps(bk, maps_of(x.inputs(), k3::host_view(M.data(), 1, 1, K, K), k3::host_view(N.data(), 1, 1, K, V)), x.options(16));
  };
  auto run = [&](auto const& bk, char const* name) {
    std::vector<double> Mc, Nc, Mb, Nb;
    maps(p, bk, Mc, Nc);
    for (input in : {input::k, input::v})
      for (double val : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()})
        for (index_t t : {0, 3, 16, 20, 44}) {
          auto bad = p;
          field(bad, in)[std::size_t(t * (in == input::v ? V : K) + 3)] = val;
          maps(bad, bk, Mb, Nb);
          INFO(std::string(name) << ": " << std::string(::name(in)) << " = " << val << " at token " << t);
          bool m_finite = true;
          for (double e : Mb) m_finite &= std::isfinite(e);
          CHECK(m_finite);
          CHECK(rel_err(Mb, Mc) < 1e-13);
          bool nonfinite = false;
          for (double e : Nb) nonfinite |= !std::isfinite(e);
          CHECK(nonfinite);
        }
  };
  run(k3::cpu::serial{}, "serial");
  run(k3::cpu::threads<>(2), "threads");  // one head: the K + V columns split across threads
}
