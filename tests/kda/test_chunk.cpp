// The chunked WY/UT form against the serial recurrence in double: forward (o, ht) and all
// six gradients to 1e-12 relative RMS, on awkward shapes (T around the chunk size, K and V not
// powers of two, grouped value heads, packed sequences shorter than a sub-chunk and a chunk,
// hard resets g = -1000, the lower-bounded gate at exactly -5); prefix invariance.
#include <doctest/doctest.h>

#include <limits>
#include <random>

#include "kda/kda_fixture.hpp"

using namespace k3;
using namespace k3::test;

namespace {

// Every gradient bit for bit (saved-state and recomputing backwards run the same arithmetic).
void check_same_grads(bwd_result const& x, bwd_result const& y) {
  CHECK(x.dq == y.dq);
  CHECK(x.dk == y.dk);
  CHECK(x.dv == y.dv);
  CHECK(x.dg == y.dg);
  CHECK(x.dbeta == y.dbeta);
  CHECK(x.dh0 == y.dh0);
}

// All six gradients of x within tol (relative RMS) of the reference r.
void check_grads_near(bwd_result const& r, bwd_result const& x, double tol) {
  CHECK(rel_rms(x.dq, r.dq) < tol);
  CHECK(rel_rms(x.dk, r.dk) < tol);
  CHECK(rel_rms(x.dv, r.dv) < tol);
  CHECK(rel_rms(x.dg, r.dg) < tol);
  CHECK(rel_rms(x.dbeta, r.dbeta) < tol);
  CHECK(rel_rms(x.dh0, r.dh0) < tol);
}

void check_chunk_vs_serial(kda_case c, double tol = 1e-12) {
  kda_data64 d = make_data(c);
  typed_data<double> td(d);
  auto rf = run_forward(td, kda::algorithm::recurrent);
  auto cf = run_forward(td, kda::algorithm::chunk);
  INFO("T=" << c.T << " K=" << c.K << " V=" << c.V << " H=" << c.H << " HV=" << c.HV << " varlen=" << c.cu.size()
            << " gate=" << int(c.gate));
  CHECK(rel_rms(cf.o, rf.o) < tol);
  CHECK(rel_rms(cf.ht, rf.ht) < tol);
  auto check_grads = [&](bwd_result const& r, bwd_result const& x) { check_grads_near(r, x, tol); };
  auto rb = run_backward(td, kda::algorithm::recurrent);
  auto cb = run_backward(td, kda::algorithm::chunk);
  check_grads(rb, cb);
  // The simd/threads backends run the register-blocked kernels of chunk_simd.hpp (the serial
  // backend keeps the Eigen formulation): same algebra, different summation order.
  auto tf = run_forward(td, kda::algorithm::chunk, cpu::threads<>(2));
  CHECK(rel_rms(tf.o, rf.o) < tol);
  CHECK(rel_rms(tf.ht, rf.ht) < tol);
  CHECK(rel_rms(tf.o, cf.o) < 1e-13);
  auto tb = run_backward(td, kda::algorithm::chunk, cpu::threads<>(2));
  check_grads(rb, tb);
  // The thread count does not change the per-task code: one thread and two agree exactly.
  auto t1 = run_forward(td, kda::algorithm::chunk, cpu::threads<>(1));
  CHECK(rel_rms(tf.o, t1.o) == 0);
  auto tb1 = run_backward(td, kda::algorithm::chunk, cpu::threads<>(1));
  CHECK(rel_rms(tb.dg, tb1.dg) == 0);
  // Saved states: the forward that fills them gives the same outputs, and the backward that
  // reads them the same gradients, bit for bit, as the backward that recomputes them.
  saved_states<double> ss, st;
  auto cfs = run_forward(td, kda::algorithm::chunk, cpu::serial{}, &ss);
  CHECK(cfs.o == cf.o);
  CHECK(cfs.ht == cf.ht);
  check_same_grads(run_backward(td, kda::algorithm::chunk, cpu::serial{}, &ss), cb);
  auto tfs = run_forward(td, kda::algorithm::chunk, cpu::threads<>(2), &st);
  CHECK(tfs.o == tf.o);
  CHECK(tfs.ht == tf.ht);
  check_same_grads(run_backward(td, kda::algorithm::chunk, cpu::threads<>(2), &st), tb);
  check_same_grads(run_backward(td, kda::algorithm::chunk, cpu::simd<>{}, &st), tb);
  // Records are interchangeable between backends (same algebra, other rounding).
  auto xs = run_backward(td, kda::algorithm::chunk, cpu::serial{}, &st);
  auto xt = run_backward(td, kda::algorithm::chunk, cpu::threads<>(2), &ss);
  for (auto const* x : {&xs, &xt}) {
    CHECK(rel_rms(x->dq, rb.dq) < tol);
    CHECK(rel_rms(x->dk, rb.dk) < tol);
    CHECK(rel_rms(x->dv, rb.dv) < tol);
    CHECK(rel_rms(x->dg, rb.dg) < tol);
    CHECK(rel_rms(x->dbeta, rb.dbeta) < tol);
    CHECK(rel_rms(x->dh0, rb.dh0) < tol);
  }
}

}  // namespace

TEST_CASE("chunked equals serial in double: T around the chunk size") {
  for (index_t T : {1, 15, 63, 64, 65, 200}) check_chunk_vs_serial({.B = 2, .T = T, .H = 1, .HV = 2, .K = 16, .V = 16, .seed = 10 + std::uint64_t(T)});
}

TEST_CASE("chunked equals serial in double: head dims") {
  check_chunk_vs_serial({.B = 1, .T = 65, .H = 1, .HV = 2, .K = 60, .V = 100, .seed = 21});
  check_chunk_vs_serial({.B = 1, .T = 130, .H = 2, .HV = 4, .K = 100, .V = 60, .seed = 22});
  check_chunk_vs_serial({.B = 1, .T = 200, .H = 1, .HV = 2, .K = 128, .V = 128, .seed = 23});
  check_chunk_vs_serial({.B = 1, .T = 63, .H = 1, .HV = 2, .K = 128, .V = 16, .h0 = false, .seed = 24});
}

TEST_CASE("chunked equals serial in double: varlen, resets, lower-bound gate") {
  check_chunk_vs_serial({.B = 1, .T = 200, .H = 1, .HV = 2, .K = 16, .V = 60, .cu = {0, 5, 5, 20, 83, 147, 200}, .seed = 31});
  check_chunk_vs_serial({.B = 1, .T = 150, .H = 2, .HV = 4, .K = 60, .V = 16, .cu = {0, 1, 16, 17, 150}, .dht = false, .seed = 32});
  check_chunk_vs_serial({.B = 2, .T = 200, .H = 1, .HV = 2, .K = 16, .V = 100, .gate = gate_kind::resets, .seed = 33});
  check_chunk_vs_serial({.B = 1, .T = 200, .H = 1, .HV = 2, .K = 60, .V = 16, .cu = {0, 7, 70, 200}, .gate = gate_kind::resets,
                         .seed = 34});
  // Resets far below the underflow of e^g, down to -inf: the chunk-local cumsum clamps them
  // (core/math.hpp full_decay_log), so no -inf - -inf and no rounding that grows with |g|.
  double const inf = std::numeric_limits<double>::infinity();
  for (double reset : {-1e8, -inf}) {
    check_chunk_vs_serial({.B = 2, .T = 200, .H = 1, .HV = 2, .K = 16, .V = 20, .gate = gate_kind::resets, .reset = reset, .seed = 38});
    check_chunk_vs_serial(
        {.B = 1, .T = 200, .H = 1, .HV = 2, .K = 17, .V = 16, .cu = {0, 70, 71, 200}, .gate = gate_kind::resets, .reset = reset, .seed = 39});
  }
  check_chunk_vs_serial({.B = 2, .T = 200, .H = 1, .HV = 2, .K = 100, .V = 16, .gate = gate_kind::lower_bound, .lb = -5, .seed = 35});
  check_chunk_vs_serial(
      {.B = 1, .T = 130, .H = 1, .HV = 2, .K = 16, .V = 60, .cu = {0, 9, 64, 130}, .gate = gate_kind::lower_bound, .lb = -5, .seed = 36});
  check_chunk_vs_serial({.B = 1, .T = 65, .H = 1, .HV = 1, .K = 16, .V = 16, .gate = gate_kind::lower_bound, .lb = -0.5, .seed = 37});
}

// Chunks with a hard reset keep the large log decays in a separate cumsum (chunk.hpp
// split_gate_cumsum); the others keep the single one. Here only chunk 1 of 3 has resets: one
// whole token, one token on half the channels, and one right at the chunk's last row (the
// decay of the whole chunk); chunks 0 and 2 run the plain arithmetic next to it.
TEST_CASE("a chunk with resets between chunks without") {
  double const inf = std::numeric_limits<double>::infinity();
  kda_case c{.B = 1, .T = 180, .H = 1, .HV = 2, .K = 32, .V = 24, .seed = 45};
  kda_data64 base = make_data(c);
  auto with_resets = [&](double reset) {
    kda_data64 d = base;
    for (index_t hv = 0; hv < c.HV; ++hv)
      for (index_t i = 0; i < c.K; ++i) {
        d.g[std::size_t((70 * c.HV + hv) * c.K + i)] = reset;
        if (i % 2 == 0) d.g[std::size_t((100 * c.HV + hv) * c.K + i)] = reset;
        if (hv == 1) d.g[std::size_t((127 * c.HV + hv) * c.K + i)] = reset;
      }
    return d;
  };
  kda_data64 const d = with_resets(-1000);
  typed_data<double> td(d);
  auto rf = run_forward(td, kda::algorithm::recurrent);
  auto rb = run_backward(td, kda::algorithm::recurrent);
  auto check_grads = [&](bwd_result const& x, double tol) { check_grads_near(rb, x, tol); };
  auto each_backend = [&](auto&& f) {
    f(cpu::serial{});
    f(cpu::simd<>{});
    f(cpu::threads<>(2));
  };
  // exact in double on every path
  each_backend([&](auto const& be) {
    auto f = run_forward(td, kda::algorithm::chunk, be);
    CHECK(rel_rms(f.o, rf.o) < 1e-12);
    CHECK(rel_rms(f.ht, rf.ht) < 1e-12);
    check_grads(run_backward(td, kda::algorithm::chunk, be), 1e-12);
  });
  // float against the double reference, and the reset chunk's outputs and the next chunk's
  // depend on a reset through e^g = 0 only: -1000, -1e8 and -inf give the same bits
  typed_data<float> tf(d), tf8(with_resets(-1e8)), tfi(with_resets(-inf));
  each_backend([&](auto const& be) {
    auto f = run_forward(tf, kda::algorithm::chunk, be);
    CHECK(rel_rms(f.o, rf.o) < 1e-6);
    CHECK(rel_rms(f.ht, rf.ht) < 1e-6);
    auto b = run_backward(tf, kda::algorithm::chunk, be);
    check_grads(b, 1e-5);
    for (auto const* t : {&tf8, &tfi}) {
      auto f2 = run_forward(*t, kda::algorithm::chunk, be);
      CHECK(f2.o == f.o);
      CHECK(f2.ht == f.ht);
      auto b2 = run_backward(*t, kda::algorithm::chunk, be);
      CHECK(b2.dq == b.dq);
      CHECK(b2.dk == b.dk);
      CHECK(b2.dv == b.dv);
      CHECK(b2.dbeta == b.dbeta);
      CHECK(b2.dh0 == b.dh0);
    }
  });
  // chunk 0 (no reset) is computed exactly as without the resets of chunk 1
  typed_data<float> t0(base);
  each_backend([&](auto const& be) {
    auto f = run_forward(tf, kda::algorithm::chunk, be), f0 = run_forward(t0, kda::algorithm::chunk, be);
    for (std::size_t i = 0; i < std::size_t(64 * c.HV * c.V); ++i) REQUIRE(f.o[i] == f0.o[i]);
  });
}

TEST_CASE("saved states in float: bitwise equal gradients, grouped heads, varlen, padded V") {
  for (kda_case c : {kda_case{.B = 1, .T = 200, .H = 2, .HV = 4, .K = 60, .V = 40, .cu = {0, 0, 1, 70, 130, 200},
                              .gate = gate_kind::lower_bound, .lb = -5, .seed = 38},
                     kda_case{.B = 3, .T = 129, .H = 1, .HV = 2, .K = 32, .V = 64, .gate = gate_kind::resets, .seed = 39},
                     kda_case{.B = 2, .T = 1, .H = 1, .HV = 1, .K = 16, .V = 16, .seed = 40}}) {
    typed_data<float> td(make_data(c));
    for (int threads : {1, 3}) {
      cpu::threads<> be(threads);
      auto tb = run_backward(td, kda::algorithm::chunk, be);
      saved_states<float> st;
      run_forward(td, kda::algorithm::chunk, be, &st);
      auto sb = run_backward(td, kda::algorithm::chunk, be, &st);
      check_same_grads(sb, tb);
      // ... and the backward really reads them: a changed record changes the gradients.
      if (st.data.empty()) continue;
      for (auto& x : st.data) x *= 1.5f;
      auto xb = run_backward(td, kda::algorithm::chunk, be, &st);
      CHECK(xb.dv != tb.dv);
      CHECK(xb.dh0 != tb.dh0);
    }
  }
}

TEST_CASE("empty sequences pass the initial state through") {
  kda_case c{.B = 1, .T = 20, .H = 1, .HV = 2, .K = 8, .V = 4, .cu = {0, 0, 20, 20}, .seed = 41};
  kda_data64 d = make_data(c);
  typed_data<double> td(d);
  for (auto m : {kda::algorithm::chunk, kda::algorithm::recurrent}) {
    auto f = run_forward(td, m);
    auto b = run_backward(td, m);
    index_t const per = c.HV * c.K * c.V;
    for (index_t n : {0, 2})
      for (index_t i = 0; i < per; ++i) {
        CHECK(f.ht[std::size_t(n * per + i)] == d.h0[std::size_t(n * per + i)]);
        CHECK(b.dh0[std::size_t(n * per + i)] == d.dht[std::size_t(n * per + i)]);
      }
  }
  // With saved states: the empty sequences own no chunk record (3 sequences, 1 chunk).
  saved_states<double> ss;
  run_forward(td, kda::algorithm::chunk, cpu::threads<>(2), &ss);
  CHECK(ss.shape == std::array<index_t, 3>{c.HV, 1, kda::detail::saved_layout{c.K, c.V}.per()});
  auto b = run_backward(td, kda::algorithm::chunk, cpu::threads<>(2), &ss);
  CHECK(b.dh0 == run_backward(td, kda::algorithm::chunk, cpu::threads<>(2)).dh0);
  // B = 0 and T = 0 are no-ops.
  kda_case e{.B = 0, .T = 0, .H = 1, .HV = 1, .K = 4, .V = 4, .seed = 42};
  typed_data<double> te(make_data(e));
  CHECK_NOTHROW(run_forward(te, kda::algorithm::chunk));
  CHECK_NOTHROW(run_backward(te, kda::algorithm::chunk));
  saved_states<double> se;
  CHECK_NOTHROW(run_forward(te, kda::algorithm::chunk, cpu::threads<>(2), &se));
  CHECK(se.data.empty());
  CHECK_NOTHROW(run_backward(te, kda::algorithm::chunk, cpu::threads<>(2), &se));
}

// Changing tokens after t must not change outputs or gradients at or before t (fla #1240):
// compared bit for bit, for both diagonal-tile paths, with the cut inside a sub-chunk.
TEST_CASE("prefix invariance (bitwise)") {
  for (gate_kind gk : {gate_kind::logsigmoid, gate_kind::lower_bound, gate_kind::token_resets}) {
    for (index_t cut : {3, 37, 70}) {
      kda_case c{.B = 1, .T = 75, .H = 1, .HV = 1, .K = 16, .V = 8, .dht = false, .gate = gk, .seed = 50};
      kda_data64 a = make_data(c);
      kda_data64 b = a;
      kda_case c2 = c;
      c2.seed = 51;
      kda_data64 r = make_data(c2);
      // replace everything after `cut`, do included (dht absent, so gradients before the cut
      // depend on later do only through the state: zero later do on both sides)
      auto tail = [&](std::vector<double>& x, std::vector<double> const& y, index_t per) {
        for (std::size_t i = std::size_t(cut * per); i < x.size(); ++i) x[i] = y[i];
      };
      tail(b.q, r.q, c.H * c.K);
      tail(b.k, r.k, c.H * c.K);
      tail(b.v, r.v, c.HV * c.V);
      tail(b.g, r.g, c.HV * c.K);
      tail(b.beta, r.beta, c.HV);
      for (auto* x : {&a.d_o, &b.d_o})
        for (std::size_t i = std::size_t(cut * c.HV * c.V); i < x->size(); ++i) (*x)[i] = 0;
      for (int prec = 0; prec < 2; ++prec) {
        auto chk = [&](auto tag) {
          using T = decltype(tag);
          typed_data<T> ta(a), tb(b);
          auto fa = run_forward(ta, kda::algorithm::chunk), fb = run_forward(tb, kda::algorithm::chunk);
          for (std::size_t i = 0; i < std::size_t(cut * c.HV * c.V); ++i) REQUIRE(fa.o[i] == fb.o[i]);
          // the simd paths too (with resets after the cut a chunk may be split in one run only)
          auto sa = run_forward(ta, kda::algorithm::chunk, cpu::simd<>{}), sb = run_forward(tb, kda::algorithm::chunk, cpu::simd<>{});
          for (std::size_t i = 0; i < std::size_t(cut * c.HV * c.V); ++i) REQUIRE(sa.o[i] == sb.o[i]);
          auto ha = run_backward(ta, kda::algorithm::chunk, cpu::simd<>{}), hb = run_backward(tb, kda::algorithm::chunk, cpu::simd<>{});
          for (std::size_t i = 0; i < std::size_t(cut * c.HV * c.K); ++i) REQUIRE(ha.dg[i] == hb.dg[i]);
          for (std::size_t i = 0; i < std::size_t(cut * c.H * c.K); ++i) REQUIRE(ha.dk[i] == hb.dk[i]);
          auto ga = run_backward(ta, kda::algorithm::chunk), gb = run_backward(tb, kda::algorithm::chunk);
          // Gradients at tokens before the cut see later tokens only through do (zeroed) and
          // the state path, which carries no gradient without dht and later do.
          for (std::size_t i = 0; i < std::size_t(cut * c.HV * c.V); ++i) REQUIRE(ga.dv[i] == gb.dv[i]);
          for (std::size_t i = 0; i < std::size_t(cut * c.HV * c.K); ++i) REQUIRE(ga.dg[i] == gb.dg[i]);
          for (std::size_t i = 0; i < std::size_t(cut * c.H * c.K); ++i) {
            REQUIRE(ga.dq[i] == gb.dq[i]);
            REQUIRE(ga.dk[i] == gb.dk[i]);
          }
        };
        if (prec == 0)
          chk(double{});
        else
          chk(float{});
      }
    }
  }
}

TEST_CASE("a non-finite input at token t leaves the outputs before t untouched (simd and threads backends)") {
  double const nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (gate_kind gk : {gate_kind::logsigmoid, gate_kind::lower_bound})
    for (index_t cut : {5, 10, 63, 64, 70})
      for (int what = 0; what < 4; ++what) {
        kda_case c{.B = 1, .T = 80, .H = 1, .HV = 2, .K = 16, .V = 40, .gate = gk, .seed = 52};
        kda_data64 a = make_data(c);
        kda_data64 b = a;
        // token `cut`, value head 1 (q/k head 0 feeds both value heads)
        if (what == 0) b.v[std::size_t((cut * c.HV + 1) * c.V + 3)] = nan;
        if (what == 1) b.k[std::size_t(cut * c.H * c.K + 2)] = inf;
        if (what == 2) b.g[std::size_t((cut * c.HV + 1) * c.K + 1)] = nan;
        if (what == 3) b.beta[std::size_t(cut * c.HV + 1)] = nan;
        INFO("gate " << int(gk) << " cut " << cut << " input " << what);
        typed_data<double> ta(a), tb(b);
        auto check = [&](auto const& be) {
          auto fa = run_forward(ta, kda::algorithm::chunk, be), fb = run_forward(tb, kda::algorithm::chunk, be);
          for (std::size_t i = 0; i < std::size_t(cut * c.HV * c.V); ++i) REQUIRE(fa.o[i] == fb.o[i]);
        };
        check(cpu::simd<>{});
        check(cpu::threads<>(2));
      }
}

TEST_CASE("the backward's block transpose equals the scalar one") {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  for (index_t rows : {1, 15, 16, 17, 33, 64, 128})
    for (index_t cols : {1, 16, 31, 48, 128}) {
      index_t const lds = cols + 3, ldd = rows + 5;
      std::vector<float> src(std::size_t(rows * lds)), a(std::size_t(cols * ldd), -1.0f), b = a;
      for (auto& x : src) x = nd(rng);
      kda::detail::transpose_into(src.data(), rows, cols, lds, a.data(), ldd);
      kda::detail::transpose_fast<xsimd::default_arch>(src.data(), rows, cols, lds, b.data(), ldd);
      INFO("rows " << rows << " cols " << cols);
      CHECK(a == b);
      for (index_t i = 0; i < rows; ++i)
        for (index_t j = 0; j < cols; ++j) REQUIRE(b[std::size_t(j * ldd + i)] == src[std::size_t(i * lds + j)]);
    }
}
