// The decode step's API (not reachable from `k3 kda`).
// - every output/input overlap of kda::decode is refused naming both arguments, every backend
//   (the shared check_outputs_apart), and a refused call leaves the pool untouched;
// - slots out of range (negative int32, int64 = P), duplicates: errors naming the slot and index;
// - decoding token by token after a packed chunked prefill (an empty sequence, a length-1 one,
//   one ending on a chunk boundary, slots in a permuted order, odd K, V > 128, HV = 3H) equals
//   one chunked run over the whole sequences; untouched pool slots stay bit for bit.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support/error_of.hpp"
#include "k3/kda.hpp"
#include "k3/kda/preprocess.hpp"
#include "support/metrics.hpp"

using namespace k3;
using namespace k3::test;

namespace {

// One float decode problem whose arrays all live in one buffer, so that any output can be
// pointed at any input.
struct decode_buf {
  static constexpr index_t N = 2, H = 1, HV = 2, K = 4, V = 8, P = 3;
  std::vector<float> mem;
  std::vector<std::int64_t> slots{2, 0};
  index_t q0, k0, v0, g0, b0, o0, p0;
  decode_buf() {
    index_t at = 0;
    auto take = [&](index_t n) { index_t r = at; at += n; return r; };
    q0 = take(N * H * K), k0 = take(N * H * K), v0 = take(N * HV * V), g0 = take(N * HV * K), b0 = take(N * HV);
    o0 = take(N * HV * V), p0 = take(P * HV * K * V);
    mem.assign(std::size_t(at), 0.25f);
    for (index_t i = g0; i < g0 + N * HV * K; ++i) mem[std::size_t(i)] = -0.1f;
  }
  float const* c(index_t off) const { return mem.data() + off; }
  kda::decode_args<float> args() {
    kda::decode_args<float> a;
    a.q = host_view(c(q0), N, H, K);
    a.k = host_view(c(k0), N, H, K);
    a.v = host_view(c(v0), N, HV, V);
    a.g = host_view(c(g0), N, HV, K);
    a.beta = host_view(c(b0), N, HV);
    a.o = host_view(mem.data() + o0, N, HV, V);
    a.state_pool = host_view(mem.data() + p0, P, HV, K, V);
    a.slots64 = host_view(static_cast<std::int64_t const*>(slots.data()), N);
    return a;
  }
};

template <class F>
void every_backend(F&& f) {
  f(cpu::serial{});
  f(cpu::simd<>{});
  f(cpu::threads<>(2));
}

}  // namespace

TEST_CASE("kda decode: an output over any input, or over the other output, names both") {
  struct {
    char const* out;
    char const* in;
  } const cases[] = {{"o", "q"},          {"o", "k"},          {"o", "v"},          {"o", "g"},
                     {"o", "beta"},       {"state_pool", "q"}, {"state_pool", "v"}, {"state_pool", "beta"},
                     {"o", "state_pool"}, {"state_pool", "g"}};
  for (auto const& cs : cases) {
    CAPTURE(cs.out);
    CAPTURE(cs.in);
    every_backend([&](auto const& be) {
      decode_buf d;
      auto a = d.args();
      std::string const in = cs.in;
      index_t const src = in == "q" ? d.q0 : in == "k" ? d.k0 : in == "v" ? d.v0 : in == "g" ? d.g0 : in == "beta" ? d.b0 : d.p0;
      // Move the output onto the input's first element (the shapes stay valid).
      if (std::string(cs.out) == "o") a.o = host_view(d.mem.data() + src, decode_buf::N, decode_buf::HV, decode_buf::V);
      else a.state_pool = host_view(d.mem.data() + src, decode_buf::P, decode_buf::HV, decode_buf::K, decode_buf::V);
      auto const before = d.mem;
      std::string const e = error_of([&] { kda::decode(be, a); });
      CHECK(names_overlap(e, cs.out, cs.in));
      CHECK(d.mem == before);  // refused before anything is written
    });
  }
}

TEST_CASE("kda decode: slots stored inside the pool, and broadcast outputs, are refused") {
  every_backend([&](auto const& be) {
    decode_buf d;
    auto a = d.args();
    // int32 slots kept in the pool's own memory (a server bug: the pool overwrites its index).
    std::int32_t* sl = reinterpret_cast<std::int32_t*>(d.mem.data() + d.p0 + 5);
    sl[0] = 1;
    sl[1] = 2;
    a.slots64 = {};
    a.slots32 = host_view(static_cast<std::int32_t const*>(sl), decode_buf::N);
    CHECK(names_overlap(error_of([&] { kda::decode(be, a); }), "state_pool", "slots"));
    auto b = d.args();
    b.o = tensor_view<float, 3>(d.mem.data() + d.o0, {decode_buf::N, decode_buf::HV, decode_buf::V}, {decode_buf::HV * decode_buf::V, 0, 1});
    std::string e = error_of([&] { kda::decode(be, b); });
    CHECK(e.find("'o'") != std::string::npos);
    CHECK(e.find("stride 0") != std::string::npos);
    auto c = d.args();
    c.state_pool = tensor_view<float, 4>(d.mem.data() + d.p0, {decode_buf::P, decode_buf::HV, decode_buf::K, decode_buf::V},
                                         {0, decode_buf::K * decode_buf::V, decode_buf::V, 1});
    e = error_of([&] { kda::decode(be, c); });
    CHECK(e.find("'state_pool'") != std::string::npos);
    CHECK(e.find("stride 0") != std::string::npos);
  });
}

TEST_CASE("kda decode: slots out of range or repeated name the slot and its index, the pool is untouched") {
  every_backend([&](auto const& be) {
    decode_buf d;
    auto const before = d.mem;
    std::vector<std::int32_t> s32{0, 5};
    auto a = d.args();
    a.slots64 = {};
    a.slots32 = host_view(static_cast<std::int32_t const*>(s32.data()), decode_buf::N);
    std::string e = error_of([&] { kda::decode(be, a); });
    CHECK(e.find("slot 5 at index 1") != std::string::npos);
    d.slots = {3, 0};  // P = 3
    a = d.args();
    e = error_of([&] { kda::decode(be, a); });
    CHECK(e.find("slot 3 at index 0") != std::string::npos);
    d.slots = {1, 1};
    a = d.args();
    e = error_of([&] { kda::decode(be, a); });
    CHECK(e.find("slot 1 appears twice (index 1)") != std::string::npos);
    d.slots = {2, 0};
    a = d.args();
    a.slots32 = host_view(static_cast<std::int32_t const*>(s32.data()), decode_buf::N);  // both given
    CHECK(error_of([&] { kda::decode(be, a); }).find("exactly one of slots32") != std::string::npos);
    CHECK(d.mem == before);
  });
}

TEST_CASE("kda decode after a packed chunked prefill equals one chunked run (empty, length-1, boundary sequences)") {
  index_t const H = 1, HV = 3, K = 5, V = 131, D = 3, P = 6;
  std::vector<index_t> const len{0, 70, 1, 64};
  std::vector<index_t> const slot{4, 0, 5, 2};
  index_t const N = index_t(len.size());
  std::mt19937_64 rng(6);
  std::normal_distribution<double> nd;
  std::uniform_real_distribution<double> ud(0, 1);
  // Full sequences (len + D tokens each), packed.
  std::vector<std::int64_t> cu_full{0}, cu_pre{0};
  for (index_t n = 0; n < N; ++n) {
    cu_full.push_back(cu_full.back() + len[std::size_t(n)] + D);
    cu_pre.push_back(cu_pre.back() + len[std::size_t(n)]);
  }
  index_t const Tf = cu_full.back(), Tp = cu_pre.back();
  auto fill = [&](index_t n, auto gen) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = gen();
    return x;
  };
  auto q = fill(Tf * H * K, [&] { return nd(rng); });
  auto k = fill(Tf * H * K, [&] { return nd(rng) * 0.4; });
  auto v = fill(Tf * HV * V, [&] { return nd(rng); });
  auto g = fill(Tf * HV * K, [&] { return -0.3 * ud(rng); });
  auto beta = fill(Tf * HV, [&] { return ud(rng); });
  auto h0 = fill(N * HV * K * V, [&] { return nd(rng); });
  // Reference: one chunked run over the whole sequences.
  std::vector<double> o_full(std::size_t(Tf * HV * V)), ht_full(h0.size());
  kda::options of;
  of.cu_seqlens = cu_full;
  kda::forward(cpu::threads<>(2), kda::forward_args<double>{host_view(static_cast<double const*>(q.data()), 1, Tf, H, K),
                                                            host_view(static_cast<double const*>(k.data()), 1, Tf, H, K),
                                                            host_view(static_cast<double const*>(v.data()), 1, Tf, HV, V),
                                                            host_view(static_cast<double const*>(g.data()), 1, Tf, HV, K),
                                                            host_view(static_cast<double const*>(beta.data()), 1, Tf, HV),
                                                            host_view(o_full.data(), 1, Tf, HV, V),
                                                            host_view(static_cast<double const*>(h0.data()), N, HV, K, V),
                                                            host_view(ht_full.data(), N, HV, K, V)},
               of);
  // Prefill inputs: the first len[n] tokens of each sequence.
  auto rows = [&](std::vector<double> const& x, index_t width, bool prefill, index_t step) {
    std::vector<double> r;
    for (index_t n = 0; n < N; ++n) {
      index_t const s = cu_full[std::size_t(n)];
      index_t const t0 = prefill ? s : s + len[std::size_t(n)] + step, t1 = prefill ? s + len[std::size_t(n)] : t0 + 1;
      r.insert(r.end(), x.begin() + t0 * width, x.begin() + t1 * width);
    }
    return r;
  };
  auto const qp = rows(q, H * K, true, 0), kp = rows(k, H * K, true, 0), vp = rows(v, HV * V, true, 0), gp = rows(g, HV * K, true, 0),
             bp = rows(beta, HV, true, 0);
  std::vector<double> o_pre(std::size_t(Tp * HV * V)), ht_pre(h0.size());
  kda::options op;
  op.cu_seqlens = cu_pre;
  kda::forward(cpu::threads<>(3), kda::forward_args<double>{host_view(qp.data(), 1, Tp, H, K), host_view(kp.data(), 1, Tp, H, K),
                                                            host_view(vp.data(), 1, Tp, HV, V), host_view(gp.data(), 1, Tp, HV, K),
                                                            host_view(bp.data(), 1, Tp, HV), host_view(o_pre.data(), 1, Tp, HV, V),
                                                            host_view(static_cast<double const*>(h0.data()), N, HV, K, V),
                                                            host_view(ht_pre.data(), N, HV, K, V)},
               op);
  index_t const per = HV * K * V;
  std::vector<std::int32_t> const slots32(slot.begin(), slot.end());
  every_backend([&](auto const& be) {
    std::vector<double> pool(std::size_t(P * per), 7.5);  // slots 1 and 3 are not used: stay 7.5
    for (index_t n = 0; n < N; ++n)
      std::copy(ht_pre.begin() + n * per, ht_pre.begin() + (n + 1) * per, pool.begin() + slot[std::size_t(n)] * per);
    std::vector<double> o_dec, o_ref;
    for (index_t step = 0; step < D; ++step) {
      auto const qd = rows(q, H * K, false, step), kd = rows(k, H * K, false, step), vd = rows(v, HV * V, false, step),
                 gd = rows(g, HV * K, false, step), bd = rows(beta, HV, false, step), oref = rows(o_full, HV * V, false, step);
      std::vector<double> o(std::size_t(N * HV * V));
      kda::decode_args<double> a{host_view(qd.data(), N, H, K), host_view(kd.data(), N, H, K), host_view(vd.data(), N, HV, V),
                                 host_view(gd.data(), N, HV, K), host_view(bd.data(), N, HV),   host_view(o.data(), N, HV, V),
                                 host_view(pool.data(), P, HV, K, V)};
      a.slots32 = host_view(slots32.data(), N);
      kda::decode(be, a);
      o_dec.insert(o_dec.end(), o.begin(), o.end());
      o_ref.insert(o_ref.end(), oref.begin(), oref.end());
    }
    CHECK(rel_rms(o_dec, o_ref) < 1e-12);
    std::vector<double> ht_dec;
    for (index_t n = 0; n < N; ++n)
      ht_dec.insert(ht_dec.end(), pool.begin() + slot[std::size_t(n)] * per, pool.begin() + (slot[std::size_t(n)] + 1) * per);
    CHECK(rel_rms(ht_dec, ht_full) < 1e-12);
    for (index_t s : {1, 3})
      for (index_t i = 0; i < per; ++i) REQUIRE(pool[std::size_t(s * per + i)] == 7.5);
  });
}

// Values just past the gate bound were printed rounded ("%g" / std::to_string): a g one ulp
// below -5 read "value -5 ... is below the gate lower bound = -5", a lower bound of
// -5.0000001 read "got -5.000000". Now the shortest text that reads back.
TEST_CASE("kda: errors about the gate bound print values that read back exactly") {
  std::vector<float> x(2 * 3 * 2 * 4, 0.5f), g(x.size());
  auto xv = host_view(static_cast<float const*>(x.data()), 2, 3, 2, 4);
  auto gv = host_view(g.data(), 2, 3, 2, 4);
  std::string e = error_of([&] { kda::gate_lower_bound(cpu::serial{}, kda::gate_args<float>{.x = xv, .g = gv}, {.lower_bound = -5.0000001}); });
  CHECK(e.find("got -5.0000001") != std::string::npos);
  e = error_of([&] { kda::gate_lower_bound(cpu::serial{}, kda::gate_args<float>{.x = xv, .g = gv}, {.lower_bound = 1e-9}); });
  CHECK(e.find("got 1e-09") != std::string::npos);

  index_t const T = 5, H = 1, K = 3, V = 2;
  for (bool as_float : {true, false}) {
    CAPTURE(as_float);
    std::vector<double> q(std::size_t(T * H * K), 0.1), v(std::size_t(T * V), 1.0), gd(std::size_t(T * K), -5.0), beta(std::size_t(T), 0.5),
        o(std::size_t(T * V));
    std::vector<float> qf(q.begin(), q.end()), vf(v.begin(), v.end()), gf(gd.begin(), gd.end()), bf(beta.begin(), beta.end()), of(o.size());
    gd[7] = std::nextafter(-5.0, -6.0);
    gf[7] = std::nextafter(-5.0f, -6.0f);
    kda::options opt;
    opt.gate_lower_bound = -5;
    std::string const want = as_float ? "value -5.000000476837158 at [0, 2, 0, 1] is below the gate lower bound = -5"
                                      : "value -5.000000000000001 at [0, 2, 0, 1] is below the gate lower bound = -5";
    if (as_float) {
      auto c = [](std::vector<float> const& a, index_t t, index_t h, index_t d) { return host_view(a.data(), 1, t, h, d); };
      e = error_of([&] {
        kda::forward(cpu::serial{}, kda::forward_args<float>{c(qf, T, H, K), c(qf, T, H, K), c(vf, T, 1, V), c(gf, T, 1, K),
                                                             host_view(static_cast<float const*>(bf.data()), 1, T, 1),
                                                             host_view(of.data(), 1, T, 1, V)},
                     opt);
      });
    } else {
      auto c = [](std::vector<double> const& a, index_t t, index_t h, index_t d) { return host_view(a.data(), 1, t, h, d); };
      auto run = [&] {
        kda::forward(cpu::serial{}, kda::forward_args<double>{c(q, T, H, K), c(q, T, H, K), c(v, T, 1, V), c(gd, T, 1, K),
                                                              host_view(static_cast<double const*>(beta.data()), 1, T, 1),
                                                              host_view(o.data(), 1, T, 1, V)},
                     opt);
      };
      e = error_of(run);
      try {
        run();
      } catch (k3::error const& err) {  // the input breaks the option's promise: both named as fields
        CHECK(err.kind() == k3::error_kind::value);
        CHECK(err.argument() == "g");
        CHECK(err.related() == "gate_lower_bound");
      }
      opt.gate_lower_bound = -5.000000001;
      std::string const e2 = error_of(run);
      CHECK_MESSAGE(e2.find("got -5.000000001") != std::string::npos, e2);
    }
    CHECK_MESSAGE(e.find(want) != std::string::npos, e);
  }
}

// cu_seqlens reached only through the API: an int32 view with stride 2 (every other element of
// a buffer) must give what the contiguous int64 list gives, in both modes.
TEST_CASE("kda forward: strided int32 cu_seqlens equal contiguous int64 ones") {
  index_t const T = 40, H = 1, HV = 2, K = 6, V = 5;
  std::vector<std::int64_t> const cu64{0, 0, 9, 9, 40};
  std::vector<std::int32_t> buf;
  for (auto c : cu64) {
    buf.push_back(std::int32_t(c));
    buf.push_back(-77);  // garbage between the offsets
  }
  tensor_view<std::int32_t const, 1> const cu32(buf.data(), {index_t(cu64.size())}, {2});
  std::mt19937_64 rng(61);
  std::normal_distribution<double> nd;
  auto fill = [&](index_t n, double sc, double shift) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = sc * nd(rng) + shift;
    return x;
  };
  auto const q = fill(T * H * K, 1, 0), k = fill(T * H * K, 0.3, 0), v = fill(T * HV * V, 1, 0), g = fill(T * HV * K, 0.05, -0.2),
             beta = fill(T * HV, 0.1, 0.5), h0 = fill(4 * HV * K * V, 1, 0);
  for (auto mode : {kda::algorithm::chunk, kda::algorithm::recurrent}) {
    std::vector<double> o[2], ht[2];
    for (int i = 0; i < 2; ++i) {
      o[i].assign(std::size_t(T * HV * V), 0);
      ht[i].assign(h0.size(), 0);
      kda::options opt;
      opt.mode = mode;
      if (i == 0) opt.cu_seqlens = cu64;
      else opt.cu_seqlens = cu32;
      kda::forward(cpu::threads<>(2),
                   kda::forward_args<double>{host_view(q.data(), 1, T, H, K), host_view(k.data(), 1, T, H, K), host_view(v.data(), 1, T, HV, V),
                                             host_view(g.data(), 1, T, HV, K), host_view(beta.data(), 1, T, HV), host_view(o[i].data(), 1, T, HV, V),
                                             host_view(h0.data(), 4, HV, K, V), host_view(ht[i].data(), 4, HV, K, V)},
                   opt);
    }
    CHECK(o[0] == o[1]);
    CHECK(ht[0] == ht[1]);
  }
}

// kda::decode used to ignore options::gate_lower_bound entirely, so an out-of-range bound that
// forward and backward reject passed silently. g itself is not checked (the step is exact for
// any gate): a g below a valid bound is accepted.
TEST_CASE("kda decode: an out-of-range gate_lower_bound is refused, a valid one accepted") {
  every_backend([&](auto const& be) {
    decode_buf d;
    auto a = d.args();
    kda::options opt;
    for (double lb : {0.0, 0.5, -5.5, std::nan("")}) {
      opt.gate_lower_bound = lb;
      CHECK(error_of([&] { kda::decode(be, a, opt); }).find("option 'gate_lower_bound': expected a value in [-5, 0)") != std::string::npos);
    }
    opt.gate_lower_bound = -0.05;  // every g = -0.1 of decode_buf lies below it: accepted all the same
    CHECK(error_of([&] { kda::decode(be, a, opt); }).empty());
  });
}

// K = 0 or V = 0 (an empty state): o = 0, so every gradient is 0. The kernels formed references
// into empty, null-data rows (UBSan: "reference binding to null pointer" through `k3 kda` with
// K = 0 or V = 0); forward and backward now return zeros before them.
TEST_CASE("kda forward/backward: zero-width heads give o = 0 and zero gradients, every backend and mode") {
  for (auto KV : {std::pair<index_t, index_t>{0, 3}, {3, 0}}) {
    index_t const K = KV.first, V = KV.second;  // not a structured binding: the lambdas below capture them (clang 14)
    index_t const T = 20, H = 1, HV = 2;
    std::vector<double> q(std::size_t(T * H * K), 0.3), v(std::size_t(T * HV * V), 0.7), g(std::size_t(T * HV * K), -0.1),
        beta(std::size_t(T * HV), 0.5), d_o(v.size(), 1.0);
    for (auto mode : {kda::algorithm::chunk, kda::algorithm::recurrent})
      every_backend([&](auto const& be) {
        std::vector<double> dq(q.size(), 7), dk(q.size(), 7), dv(v.size(), 7), dg(g.size(), 7), db(beta.size(), 7);
        kda::backward_args<double> a;
        a.q = host_view(static_cast<double const*>(q.data()), 1, T, H, K);
        a.k = a.q;
        a.v = host_view(static_cast<double const*>(v.data()), 1, T, HV, V);
        a.g = host_view(static_cast<double const*>(g.data()), 1, T, HV, K);
        a.beta = host_view(static_cast<double const*>(beta.data()), 1, T, HV);
        a.d_o = host_view(static_cast<double const*>(d_o.data()), 1, T, HV, V);
        a.dq = host_view(dq.data(), 1, T, H, K);
        a.dk = host_view(dk.data(), 1, T, H, K);
        a.dv = host_view(dv.data(), 1, T, HV, V);
        a.dg = host_view(dg.data(), 1, T, HV, K);
        a.dbeta = host_view(db.data(), 1, T, HV);
        kda::options opt;
        opt.mode = mode;
        kda::backward(be, a, opt);
        for (auto const* x : {&dq, &dk, &dv, &dg, &db})
          for (double e : *x) REQUIRE(e == 0.0);
        std::vector<double> o(v.size(), 7);
        kda::forward(be, kda::forward_args<double>{a.q, a.k, a.v, a.g, a.beta, host_view(o.data(), 1, T, HV, V)}, opt);
        for (double e : o) REQUIRE(e == 0.0);
      });
  }
}
